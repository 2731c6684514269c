//! The TLS layer plugged into the real data plane: the sidecar terminates
//! mesh mTLS on its inbound listener (HTTP/1.1 and HTTP/2 by ALPN) and
//! forwards plaintext to a local app, refuses plaintext in Strict mode,
//! exports the TLS metrics and gates /ready on the offload engine.

use crate::tls_support;

use std::net::SocketAddr;
use std::time::Duration;

use baton_sidecar::config::yaml;
use baton_sidecar::conn::IdentityImportError;
use baton_sidecar::server::{Running, StartOptions, start};
use baton_sidecar::tls::{CertSource, MeshTls, TlsMetrics, TlsSettings};
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

struct Sidecar {
    running: Running,
    tls: std::sync::Arc<MeshTls>,
    _dir: tempfile::TempDir,
    _app: tokio::task::JoinHandle<()>,
}

/// A sidecar for the mesh workload `backend`: a Strict mTLS inbound
/// listener in front of a local HTTP app.
async fn sidecar(pki: &Pki, extra_tls: &str) -> Sidecar {
    sidecar_as(
        pki,
        "backend",
        "listeners: [{name: inbound, address: '127.0.0.1:0', direction: inbound}]
clusters: [{name: app, endpoints: ['{app}']}]
routes: [{name: default, backends: [{cluster: app}]}]",
        extra_tls,
    )
    .await
}

/// A sidecar with service account `sa`'s mesh certificate serving
/// `data_plane` (`{app}` is replaced by a local HTTP app's address).
async fn sidecar_as(pki: &Pki, sa: &str, data_plane: &str, extra_tls: &str) -> Sidecar {
    let dir = tempfile::tempdir().unwrap();
    let m = pki.leaf(sa, Key::P256);
    let (c, k, b) = (
        dir.path().join("c.pem"),
        dir.path().join("k.pem"),
        dir.path().join("b.pem"),
    );
    std::fs::write(&c, pem(&m.cert_chain[0], "CERTIFICATE")).unwrap();
    std::fs::write(&k, pem(m.key.secret_der(), "PRIVATE KEY")).unwrap();
    std::fs::write(&b, pem(&m.trust_bundle[0], "CERTIFICATE")).unwrap();
    let (app_addr, app_task) = app().await;
    let data_plane = data_plane.replace("{app}", &app_addr.to_string());
    let text = format!(
        "{data_plane}
tls:
  mode: Strict
  identity: {{trust_domain: {TD}, expected_peers: {{backend: '{}'}}}}
  source: {{files: {{cert_chain: '{}', key: '{}', trust_bundle: '{}'}}}}
{extra_tls}",
        id("backend"),
        c.display(),
        k.display(),
        b.display()
    );
    let mut snap = yaml::parse(&text).unwrap();
    snap.admin.address = "127.0.0.1:0".parse().unwrap();
    let tls = MeshTls::new(TlsMetrics::default());
    tls.apply(snap.tls.as_ref()).unwrap();
    let running = start(snap, {
        let mut opts = StartOptions::default();
        tls.plug(&mut opts);
        opts
    })
    .await
    .unwrap();
    tls.attach(&running);
    Sidecar {
        running,
        tls,
        _dir: dir,
        _app: app_task,
    }
}

async fn admin_get(addr: SocketAddr, path: &str) -> (u16, String) {
    get_with_host(addr, path, "admin").await
}

/// One HTTP/1.1 request on a fresh plaintext connection to `addr`.
async fn get_with_host(addr: SocketAddr, path: &str, host: &str) -> (u16, String) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        send.send_request(
            hyper::Request::get(path)
                .header("host", host)
                .body(Empty::<Bytes>::new())
                .unwrap(),
        ),
    )
    .await
    .unwrap()
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
    tls.cipher_suites = vec!["TLS_RSA_WITH_RC4_128_SHA".into()];
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

async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    get_with_host(addr, path, "backend").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbound_clusters_originate_mesh_mtls_to_the_peer_sidecar_for_http1_http2_and_tcp() {
    let pki = Pki::new("mesh-ca");
    let backend = sidecar(&pki, "").await;
    let peer = backend.running.addr("inbound").unwrap();
    // The frontend's app talks plaintext to its sidecar; every cluster
    // below points at the backend sidecar's Strict inbound port.
    let frontend = sidecar_as(
        &pki,
        "frontend",
        &format!(
            "listeners:
- {{name: outbound, address: '127.0.0.1:0'}}
- {{name: tcp-out, address: '127.0.0.1:0', protocol: tcp, tcp_cluster: backend-tcp}}
clusters:
- {{name: backend, endpoints: ['{peer}'], mtls: {{}}}}
- {{name: backend-h2, endpoints: ['{peer}'], protocol: http2, mtls: {{identity: '{}'}}}}
- {{name: backend-tcp, endpoints: ['{peer}'], mtls: {{identity: '{}'}}}}
- {{name: impostor, endpoints: ['{peer}'], mtls: {{identity: '{}'}}}}
- {{name: plain, endpoints: ['{peer}']}}
routes:
- {{name: h2, match: {{path: {{prefix: /h2}}}}, backends: [{{cluster: backend-h2}}]}}
- {{name: impostor, match: {{path: {{prefix: /impostor}}}}, backends: [{{cluster: impostor}}]}}
- {{name: plain, match: {{path: {{prefix: /plain}}}}, backends: [{{cluster: plain}}]}}
- {{name: default, backends: [{{cluster: backend}}]}}",
            id("backend"),
            id("backend"),
            id("someone-else"),
        ),
        // `backend` names no identity: it comes from expected_peers.
        "",
    )
    .await;
    let out = frontend.running.addr("outbound").unwrap();

    // HTTP/1.1 over originated mTLS, several requests on pooled connections.
    for _ in 0..5 {
        assert_eq!(get(out, "/").await, (200, "hello from app".into()));
    }
    // HTTP/2 (ALPN h2) over originated mTLS.
    for _ in 0..3 {
        assert_eq!(get(out, "/h2").await, (200, "hello from app".into()));
    }
    // The peer presents `backend`, not the identity this cluster expects:
    // refused by the frontend, answered 503 with the reason.
    let (status, body) = get(out, "/impostor").await;
    assert_eq!(status, 503, "{body}");
    // Plaintext to a Strict inbound is refused by the backend.
    let (status, body) = get(out, "/plain").await;
    assert!(status == 502 || status == 503, "{status} {body}");

    // Raw TCP over originated mTLS: the bytes reach the backend's inbound,
    // which detects HTTP inside the tunnel and answers.
    let mut tcp = TcpStream::connect(frontend.running.addr("tcp-out").unwrap())
        .await
        .unwrap();
    tcp.write_all(b"GET / HTTP/1.1\r\nhost: backend\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut reply = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut reply))
        .await
        .unwrap()
        .unwrap();
    let reply = String::from_utf8_lossy(&reply);
    assert!(
        reply.starts_with("HTTP/1.1 200") && reply.ends_with("hello from app"),
        "{reply}"
    );

    // Both sides counted what happened: 3 good client handshakes at least
    // (HTTP/1 pool, HTTP/2, TCP) and the impostor refused.
    let (_, m) = admin_get(frontend.running.admin_addr, "/metrics").await;
    let client_ok = metric(
        &m,
        "baton_sidecar_tls_handshakes_total{side=\"client\",result=\"ok\"}",
    );
    assert!(client_ok >= 3.0, "{m}");
    let refused: f64 = m
        .lines()
        .filter(|l| {
            l.starts_with("baton_sidecar_tls_handshakes_total{side=\"client\"")
                && !l.contains("result=\"ok\"")
        })
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert!(refused >= 1.0, "{m}");
    let (_, m) = admin_get(backend.running.admin_addr, "/metrics").await;
    assert!(
        metric(
            &m,
            "baton_sidecar_tls_handshakes_total{side=\"server\",result=\"ok\"}"
        ) >= 3.0,
        "{m}"
    );
    assert!(
        metric(&m, "baton_sidecar_tls_plaintext_refused_total") >= 1.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_asking_for_mtls_without_a_tls_section_is_refused_with_a_clear_error() {
    let text = "listeners: [{name: outbound, address: '127.0.0.1:0'}]
clusters: [{name: backend, endpoints: ['127.0.0.1:9'], mtls: {identity: 'not-a-spiffe-id'}}]
routes: [{name: default, backends: [{cluster: backend}]}]";
    let err = baton_sidecar::config::compile(&yaml::parse(text).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("clusters[0] (backend).mtls"), "{err}");
    assert!(err.contains("tls section"), "{err}");
    assert!(err.contains("mtls.identity"), "{err}");
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_carried_by_the_handoff_serves_while_the_identity_service_is_unreachable() {
    use baton_sidecar::handoff::IdentityCarrier;
    let pki = Pki::new("mesh-ca");
    let old = sidecar(&pki, "").await;
    let carried = old.tls.export().expect("the old process has a certificate");
    assert!(carried.key.contains("PRIVATE KEY"));
    assert!(
        format!("{carried:?}").find("PRIVATE").is_none(),
        "Debug redacts"
    );

    // The new process starts as in a Pod, with no policy of its own; the
    // snapshot the old process served (which the new one serves until the
    // next push) gets its identity from an identity service that does not
    // answer (nothing listens on port 9 of loopback).
    let new = MeshTls::new(TlsMetrics::default());
    assert_eq!(new.mode(), None);
    let served = served_config(unreachable_identity_service());

    // Import: the old process's policy is in force and the node is ready at
    // once, new handshakes presenting the carried identity.
    assert_eq!(new.import(&served, Some(&carried)), Ok(true));
    assert_eq!(new.mode(), Some(baton_sidecar::tls::TlsMode::Strict));
    new.readiness().unwrap();
    let ctx = new.context().unwrap();
    assert_eq!(ctx.local_identity(), Some(id("backend")));
    let srv = EchoServer::start(ctx).await;
    let client = context(
        &settings(baton_sidecar::tls::TlsMode::Strict),
        pki.leaf("frontend", Key::P256),
    );
    mtls_round_trip(&client, srv.addr, &id("backend"))
        .await
        .unwrap();
    // The failing bootstrap keeps retrying but does not make it unready.
    tokio::time::sleep(Duration::from_millis(300)).await;
    new.readiness().unwrap();

    // A process with its own (files) certificate keeps it.
    let own = served_config(old.tls.context().unwrap().settings().clone());
    assert_eq!(old.tls.import(&own, Some(&carried)), Ok(false));
    // Garbage is refused with a reason; the policy is in force, waiting for
    // the process's own certificate.
    let mut bad = carried.clone();
    bad.key = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n".into();
    let fresh = MeshTls::new(TlsMetrics::default());
    let err = fresh.import(&served, Some(&bad)).unwrap_err();
    assert!(
        matches!(
            err,
            IdentityImportError::Unreadable(_) | IdentityImportError::Unusable(_)
        ),
        "{err}"
    );
    let reason = fresh.readiness().unwrap_err();
    assert!(reason.contains("identity service"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_taking_over_puts_the_served_policy_in_force_before_it_serves() {
    use baton_sidecar::handoff::IdentityCarrier;
    let pki = Pki::new("mesh-ca");
    let old = sidecar(&pki, "").await;
    let settings = old.tls.context().unwrap().settings().clone();

    // No certificate carried: the policy alone (a files source) is in force,
    // with the process's own certificate.
    let new = MeshTls::new(TlsMetrics::default());
    assert_eq!(
        new.import(&served_config(settings.clone()), None),
        Ok(false)
    );
    assert_eq!(new.mode(), Some(baton_sidecar::tls::TlsMode::Strict));
    new.readiness().unwrap();
    assert_eq!(new.context().unwrap().local_identity(), Some(id("backend")));

    // A served snapshot without a `tls` section: no policy, as the old one.
    let plain = served_config_without_tls();
    assert_eq!(new.import(&plain, None), Ok(false));
    assert_eq!(new.mode(), None);

    // A policy this build cannot put in force refuses the handoff (the old
    // process keeps serving) instead of serving without it.
    let mut broken = settings;
    broken.source = None;
    let err = new.import(&served_config(broken), None).unwrap_err();
    assert!(matches!(err, IdentityImportError::Policy(_)), "{err}");
    assert!(err.to_string().contains("certificate source"), "{err}");
}

/// The serialized snapshot an old process hands over, with `tls`.
fn served_config(tls: TlsSettings) -> serde_json::Value {
    serde_json::to_value(baton_sidecar::config::Snapshot {
        tls: Some(tls),
        ..baton_sidecar::config::pod_default()
    })
    .unwrap()
}

fn served_config_without_tls() -> serde_json::Value {
    serde_json::to_value(baton_sidecar::config::pod_default()).unwrap()
}

/// Strict settings whose identity service never answers (nothing listens on
/// port 9 of loopback).
fn unreachable_identity_service() -> TlsSettings {
    let mut s = TlsSettings::default();
    s.identity.trust_domain = TD.into();
    s.identity.local = Some(id("backend").to_string());
    s.source = Some(CertSource::IdentityService {
        url: "http://127.0.0.1:9/sign".into(),
        ca_bundle: None,
        token_path: Some("/nonexistent/token".into()),
        key_type: Default::default(),
    });
    s
}
