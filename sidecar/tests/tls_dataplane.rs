//! The TLS layer plugged into the real data plane: the sidecar terminates
//! mesh mTLS on its inbound listener (HTTP/1.1 and HTTP/2 by ALPN) and
//! forwards plaintext to a local app, refuses plaintext in Strict mode,
//! exports the TLS metrics and gates /ready on the offload engine.

mod tls_support;

use std::net::SocketAddr;
use std::time::Duration;

use baton_sidecar::config::yaml;
use baton_sidecar::server::{Running, StartOptions, start};
use baton_sidecar::tls::{MeshTls, TlsMetrics};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tls_support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

async fn app() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(Bytes::from(
                        "hello from app",
                    ))))
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (addr, task)
}

fn pem(der: &[u8], label: &str) -> String {
    let b64 = openssl::base64::encode_block(der);
    let lines: Vec<&str> = b64
        .as_bytes()
        .chunks(64)
        .map(|c| std::str::from_utf8(c).unwrap())
        .collect();
    format!(
        "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
        lines.join("\n")
    )
}

struct Sidecar {
    running: Running,
    _dir: tempfile::TempDir,
    _app: tokio::task::JoinHandle<()>,
}

async fn sidecar(pki: &Pki, extra_tls: &str) -> Sidecar {
    let dir = tempfile::tempdir().unwrap();
    let m = pki.leaf("backend", Key::P256);
    let (c, k, b) = (
        dir.path().join("c.pem"),
        dir.path().join("k.pem"),
        dir.path().join("b.pem"),
    );
    std::fs::write(&c, pem(&m.cert_chain[0], "CERTIFICATE")).unwrap();
    std::fs::write(&k, pem(m.key.secret_der(), "PRIVATE KEY")).unwrap();
    std::fs::write(&b, pem(&m.trust_bundle[0], "CERTIFICATE")).unwrap();
    let (app_addr, app_task) = app().await;
    let text = format!(
        "listeners: [{{name: inbound, address: '127.0.0.1:0'}}]
clusters: [{{name: app, endpoints: ['{app_addr}']}}]
routes: [{{name: default, backends: [{{cluster: app}}]}}]
tls:
  mode: Strict
  identity: {{trust_domain: {TD}}}
  source: {{files: {{cert_chain: '{}', key: '{}', trust_bundle: '{}'}}}}
{extra_tls}",
        c.display(),
        k.display(),
        b.display()
    );
    let mut snap = yaml::parse(&text).unwrap();
    snap.admin.address = "127.0.0.1:0".parse().unwrap();
    let tls = MeshTls::new(TlsMetrics::default());
    tls.apply(snap.tls.as_ref()).unwrap();
    let running = start(
        snap,
        StartOptions {
            tls: Some(tls.clone()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    tls.attach(&running);
    Sidecar {
        running,
        _dir: dir,
        _app: app_task,
    }
}

async fn admin_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let resp = send
        .send_request(
            hyper::Request::get(path)
                .header("host", "admin")
                .body(Empty::<Bytes>::new())
                .unwrap(),
        )
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_terminates_mesh_mtls_for_http1_and_http2_and_refuses_plaintext() {
    let pki = Pki::new("mesh-ca");
    let sc = sidecar(&pki, "").await;
    let inbound = sc.running.addr("inbound").unwrap();
    let client = context(
        &settings(baton_sidecar::tls::TlsMode::Strict),
        pki.leaf("frontend", Key::P256),
    );

    // HTTP/1.1 over mTLS (ALPN http/1.1).
    let tcp = TcpStream::connect(inbound).await.unwrap();
    let (tls, peer) = client
        .connector()
        .connect(tcp, &id("backend"), Some(vec![b"http/1.1".to_vec()]))
        .await
        .unwrap();
    assert_eq!(peer.alpn.as_deref(), Some(&b"http/1.1"[..]));
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    for _ in 0..3 {
        // Keep-alive: the same TLS connection carries every request.
        send.ready().await.unwrap();
        let resp = tokio::time::timeout(
            Duration::from_secs(10),
            send.send_request(
                hyper::Request::get("/")
                    .header("host", "backend")
                    .body(Empty::<Bytes>::new())
                    .unwrap(),
            ),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"hello from app");
    }

    // HTTP/2 over mTLS (ALPN h2).
    let tcp = TcpStream::connect(inbound).await.unwrap();
    let (tls, peer) = client
        .connector()
        .connect(tcp, &id("backend"), Some(vec![b"h2".to_vec()]))
        .await
        .unwrap();
    assert_eq!(peer.alpn.as_deref(), Some(&b"h2"[..]));
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(conn);
    send.ready().await.unwrap();
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        send.send_request(
            hyper::Request::get("https://backend/")
                .body(Empty::<Bytes>::new())
                .unwrap(),
        ),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2);

    // Plaintext to the Strict inbound listener: closed without a response.
    let mut tcp = TcpStream::connect(inbound).await.unwrap();
    tcp.write_all(b"GET / HTTP/1.1\r\nhost: backend\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut out)).await;
    assert!(
        out.is_empty(),
        "plaintext got an answer: {}",
        String::from_utf8_lossy(&out)
    );

    let (status, _) = admin_get(sc.running.admin_addr, "/ready").await;
    assert_eq!(status, 200);
    let (_, metrics) = admin_get(sc.running.admin_addr, "/metrics").await;
    assert!(
        metrics.contains("baton_sidecar_tls_plaintext_refused_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("baton_sidecar_tls_handshakes_total{side=\"server\",result=\"ok\"} 2"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offload_required_without_a_working_engine_keeps_the_sidecar_not_ready() {
    let pki = Pki::new("mesh-ca");
    let sc = sidecar(
        &pki,
        "  offload: {mode: Required, engine: openssl, openssl_provider: baton-no-such-provider}\n",
    )
    .await;
    let (status, body) = admin_get(sc.running.admin_addr, "/ready").await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("Required") && body.contains("baton-no-such-provider"),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_tls_section_is_refused_and_the_serving_config_stays() {
    let pki = Pki::new("mesh-ca");
    let sc = sidecar(&pki, "").await;
    let mut snap = (*sc.running.shared.store.snapshot()).clone();
    snap.version += 1;
    let mut tls = snap.tls.clone().unwrap();
    tls["cipher_suites"] = serde_json::json!(["TLS_RSA_WITH_RC4_128_SHA"]);
    snap.tls = Some(tls);
    let err = sc.running.shared.store.apply(&snap).unwrap_err();
    assert!(err.to_string().contains("TLS_AES_128_GCM_SHA256"), "{err}");
    // Still serving mTLS.
    let client = context(
        &settings(baton_sidecar::tls::TlsMode::Strict),
        pki.leaf("frontend", Key::P256),
    );
    let tcp = TcpStream::connect(sc.running.addr("inbound").unwrap())
        .await
        .unwrap();
    client
        .connector()
        .connect(tcp, &id("backend"), None)
        .await
        .unwrap();
}
