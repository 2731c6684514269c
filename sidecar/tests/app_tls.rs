//! The application's own TLS under a mesh TLS policy (decision 0026): a
//! sidecar terminates only TLS whose ClientHello carries the mesh marker
//! (SNI `mesh.baton.invalid`, which its connector sends). Under Permissive,
//! a client outside the mesh doing TLS to the application itself completes
//! its handshake with the application's certificate, end to end through the
//! sidecar; under Strict it is refused (counted, logged). Mesh clients are
//! terminated and their identity is seen on both.

use crate::tls_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use baton_sidecar::server::Running;
use baton_sidecar::tls::{Accepted, MeshTls, TlsContext, TlsError, TlsMode};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tls_support::*;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The application: a TLS echo server with its own self-signed certificate
/// (DNS `app.test`, IP 127.0.0.1), nothing to do with the mesh PKI.
struct App {
    addr: SocketAddr,
    cert: CertificateDer<'static>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for App {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn tls_app() -> App {
    let issued =
        rcgen::generate_simple_self_signed(vec!["app.test".to_owned(), "127.0.0.1".to_owned()])
            .unwrap();
    let cert = issued.cert.der().clone();
    let key = PrivateKeyDer::try_from(issued.signing_key.serialize_der()).unwrap();
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![cert.clone()], key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(s) = acceptor.accept(tcp).await else {
                    return;
                };
                let (mut r, mut w) = tokio::io::split(s);
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    App { addr, cert, task }
}

/// A plain HTTP/1.1 server answering every request `200 ok` and closing.
async fn web() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut head: Vec<u8> = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend(&buf[..n]),
                    }
                }
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                    )
                    .await;
            });
        }
    });
    (addr, task)
}

struct Sidecar {
    running: Running,
    _tls: Arc<MeshTls>,
    _dir: tempfile::TempDir,
    _web: tokio::task::JoinHandle<()>,
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        self._web.abort();
    }
}

/// A sidecar under `mode` whose inbound listener detects protocols: HTTP
/// goes to `web` behind an RBAC policy that admits only the `frontend`
/// identity (so a 200 proves the mesh client's identity was seen), raw TCP
/// (and TLS passed through) to the TLS application.
async fn sidecar(pki: &Pki, mode: &str, app: SocketAddr) -> Sidecar {
    sidecar_with(pki, mode, app, true).await
}

/// [`sidecar`], with or without the identity allow-list (`rbac`), which
/// applies to every connection, TLS passed through included.
async fn sidecar_with(pki: &Pki, mode: &str, app: SocketAddr, rbac: bool) -> Sidecar {
    let rbac = if rbac { " rbac: frontend-only," } else { "" };
    let dir = tempfile::tempdir().unwrap();
    let source = write_backend_pki(pki, dir.path());
    let (web, web_task) = web().await;
    let text = format!(
        "listeners: [{{name: in, address: '127.0.0.1:0', direction: inbound, tcp_cluster: app,{rbac} detect_timeout_ms: 300}}]
clusters: [{{name: app, endpoints: ['{app}']}}, {{name: web, endpoints: ['{web}']}}]
routes: [{{name: r, backends: [{{cluster: web}}]}}]
policies:
  rbac:
  - name: frontend-only
    rules:
    - {{action: allow, identities: ['{frontend}']}}
    default_action: deny
tls:
  mode: {mode}
  identity: {{trust_domain: {TD}}}
  source: {source}
",
        frontend = id("frontend"),
    );
    let (running, tls) = start_with_mesh_tls(&text).await;
    Sidecar {
        running,
        _tls: tls,
        _dir: dir,
        _web: web_task,
    }
}

/// A rustls client outside the mesh that trusts only the application's
/// certificate.
fn app_client(app: &App) -> tokio_rustls::TlsConnector {
    client_trusting(app.cert.clone())
}

/// A rustls client outside the mesh (no client certificate) that trusts
/// only `root`.
fn client_trusting(root: CertificateDer<'static>) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root).unwrap();
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
}

fn frontend(pki: &Pki) -> Arc<TlsContext> {
    context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256))
}

/// `GET /` over `s`; returns the response (the server closes after it).
async fn get<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> String {
    s.write_all(b"GET / HTTP/1.1\r\nhost: app\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("response timed out")
        .expect("response");
    String::from_utf8_lossy(&out).into_owned()
}

/// A mesh client (the sidecar's own connector, identity `frontend`) through
/// the sidecar at `addr`: mTLS is terminated and RBAC admits the identity.
async fn assert_mesh_client_served(pki: &Pki, addr: SocketAddr) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut s, peer) = frontend(pki)
        .connector()
        .connect(tcp, &id("backend"), Some(vec![b"http/1.1".to_vec()]))
        .await
        .expect("mesh mTLS");
    assert_eq!(peer.identity, Some(id("backend")));
    assert_eq!(peer.alpn.as_deref(), Some(&b"http/1.1"[..]));
    let resp = get(&mut s).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permissive_terminates_mesh_tls_and_passes_the_applications_own_tls_through_end_to_end() {
    let pki = Pki::new("mesh-ca");
    let app = tls_app().await;
    let sc = sidecar(&pki, "Permissive", app.addr).await;
    let addr = sc.running.addr("in").unwrap();

    assert_mesh_client_served(&pki, addr).await;
    // Plaintext is accepted, but carries no identity: RBAC denies it (the
    // 200 above came from the mesh client's verified identity).
    let mut plain = TcpStream::connect(addr).await.unwrap();
    let resp = get(&mut plain).await;
    assert!(resp.starts_with("HTTP/1.1 403"), "{resp}");

    // The allow-list admits only `frontend`, whatever the connection
    // carries: the application's own TLS (no mesh identity) is closed too.
    let tcp = TcpStream::connect(addr).await.unwrap();
    let refused = app_client(&app)
        .connect(ServerName::try_from("app.test").unwrap(), tcp)
        .await;
    assert!(
        refused.is_err(),
        "the allow-list let unidentified TLS through"
    );
    drop(sc);

    // Without an allow-list, a client outside the mesh speaks TLS to the
    // application itself, with SNI and without (an IP address: rustls sends
    // none).
    let sc = sidecar_with(&pki, "Permissive", app.addr, false).await;
    let addr = sc.running.addr("in").unwrap();
    assert_mesh_client_served(&pki, addr).await;
    for name in ["app.test", "127.0.0.1"] {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let mut s = app_client(&app)
            .connect(ServerName::try_from(name).unwrap(), tcp)
            .await
            .unwrap_or_else(|e| panic!("{name}: the application's handshake failed: {e}"));
        let seen = s.get_ref().1.peer_certificates().unwrap()[0].clone();
        assert_eq!(seen, app.cert, "{name}: not the application's certificate");
        s.write_all(b"hello app\n").await.unwrap();
        let mut back = [0u8; 10];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back))
            .await
            .expect("echo timed out")
            .unwrap();
        assert_eq!(&back, b"hello app\n", "{name}");
    }

    assert_exposes(
        &sc,
        &[
            "baton_sidecar_tls_app_tls_passthrough_total 2",
            r#"baton_sidecar_tls_handshakes_total{side="server",result="ok"} 1"#,
            r#"baton_sidecar_connections_total{listener="in",protocol="tcp"} 2"#,
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_refuses_the_applications_own_tls_and_still_terminates_mesh_tls() {
    let pki = Pki::new("mesh-ca");
    let app = tls_app().await;
    let sc = sidecar(&pki, "Strict", app.addr).await;
    let addr = sc.running.addr("in").unwrap();

    let tcp = TcpStream::connect(addr).await.unwrap();
    let r = app_client(&app)
        .connect(ServerName::try_from("app.test").unwrap(), tcp)
        .await;
    assert!(r.is_err(), "Strict let the application's own TLS through");
    // Nor is it answered with the mesh certificate: the connection closes
    // without a byte.
    let mut raw = TcpStream::connect(addr).await.unwrap();
    raw.write_all(&client_hello_bytes("app.test"))
        .await
        .unwrap();
    assert!(closed_without_data(&mut raw).await);

    assert_mesh_client_served(&pki, addr).await;
    assert_exposes(
        &sc,
        &[
            "baton_sidecar_tls_app_tls_refused_total 2",
            r#"baton_sidecar_local_responses_total{reason="app_tls_refused"} 2"#,
        ],
    );
}

/// The sidecar's `/metrics` text has each of `series` (name, labels, value).
fn assert_exposes(sc: &Sidecar, series: &[&str]) {
    let m = sc.running.shared.metrics.encode();
    for s in series {
        assert!(m.contains(s), "no `{s}` in:\n{m}");
    }
}

/// The ClientHello a rustls client for `name` sends first.
fn client_hello_bytes(name: &str) -> Vec<u8> {
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_no_client_auth();
    let name = ServerName::try_from(name.to_owned()).unwrap();
    let mut conn = rustls::ClientConnection::new(Arc::new(cfg), name).unwrap();
    let mut out = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut out).unwrap();
    }
    out
}

/// The `Acceptor` on its own: mesh TLS is terminated with the client's
/// identity; the application's TLS is handed back untouched (Permissive,
/// every byte still to be read) or refused (Strict).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_acceptor_tells_mesh_tls_from_the_applications_tls_without_consuming_it() {
    let pki = Pki::new("mesh-ca");
    let accept_one = |mode: TlsMode| {
        let server = context(&settings(mode), pki.leaf("backend", Key::P256));
        async move {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let task = tokio::spawn(async move {
                let (tcp, _) = l.accept().await.unwrap();
                server.acceptor().accept(tcp).await
            });
            (addr, task)
        }
    };

    // Mesh TLS: terminated, the client's identity seen.
    let (addr, task) = accept_one(TlsMode::Permissive).await;
    let client = frontend(&pki);
    let connect = tokio::spawn(async move {
        let tcp = TcpStream::connect(addr).await.unwrap();
        client.connector().connect(tcp, &id("backend"), None).await
    });
    match task.await.unwrap() {
        Ok(Accepted::Tls(_, peer)) => assert_eq!(peer.identity, Some(id("frontend"))),
        other => panic!("mesh TLS not terminated: {other:?}"),
    }
    connect.await.unwrap().expect("mesh handshake");

    // The application's TLS under Permissive: not consumed.
    let hello = client_hello_bytes("app.test");
    let (addr, task) = accept_one(TlsMode::Permissive).await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(&hello).await.unwrap();
    let mut passed = match task.await.unwrap() {
        Ok(Accepted::AppTls(s)) => s,
        other => panic!("not handed back as the application's TLS: {other:?}"),
    };
    let mut got = vec![0u8; hello.len()];
    passed.read_exact(&mut got).await.unwrap();
    assert_eq!(got, hello);

    // And refused under Strict.
    let (addr, task) = accept_one(TlsMode::Strict).await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(&hello).await.unwrap();
    match task.await.unwrap() {
        Err(TlsError::AppTlsRefused(reason)) => assert_eq!(reason, "no_mesh_marker"),
        other => panic!("Strict did not refuse: {other:?}"),
    }
    assert!(closed_without_data(&mut tcp).await);
}

/// An inbound listener with `terminate_tls: all` is a TLS edge: under
/// Strict without client certificates it terminates a client outside the
/// mesh (its SNI is a host name, not the marker) and serves it HTTP, as
/// the TLS benchmark runs it against nginx. On an outbound listener the
/// setting is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_edge_listener_terminates_clients_outside_the_mesh() {
    let pki = Pki::new("mesh-ca");
    let dir = tempfile::tempdir().unwrap();
    // A serving certificate for the host name `edge.test`, from the mesh CA.
    let kp = key_pair(Key::P256);
    let mut p = rcgen::CertificateParams::default();
    p.subject_alt_names = vec![rcgen::SanType::DnsName("edge.test".try_into().unwrap())];
    let cert = p.signed_by(&kp, &pki.ca).unwrap();
    let (c, k, b) = (
        dir.path().join("c.pem"),
        dir.path().join("k.pem"),
        dir.path().join("b.pem"),
    );
    std::fs::write(&c, pem(cert.der(), "CERTIFICATE")).unwrap();
    std::fs::write(&k, pem(&kp.serialize_der(), "PRIVATE KEY")).unwrap();
    std::fs::write(&b, pem(&pki.ca_der(), "CERTIFICATE")).unwrap();
    let (web, web_task) = web().await;
    let text = format!(
        "listeners: [{{name: in, address: '127.0.0.1:0', direction: inbound, terminate_tls: all}}]
clusters: [{{name: web, endpoints: ['{web}']}}]
routes: [{{name: r, backends: [{{cluster: web}}]}}]
tls:
  mode: Strict
  require_client_cert: false
  identity: {{trust_domain: {TD}}}
  source: {{files: {{cert_chain: '{c}', key: '{k}', trust_bundle: '{b}'}}}}
",
        c = c.display(),
        k = k.display(),
        b = b.display(),
    );
    let (running, _tls) = start_with_mesh_tls(&text).await;
    let addr = running.addr("in").unwrap();

    let tcp = TcpStream::connect(addr).await.unwrap();
    let mut s = client_trusting(pki.ca_der())
        .connect(ServerName::try_from("edge.test").unwrap(), tcp)
        .await
        .expect("the edge terminates a client outside the mesh");
    let resp = get(&mut s).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let m = running.shared.metrics.encode();
    assert!(
        m.contains(r#"baton_sidecar_tls_handshakes_total{side="server",result="ok"} 1"#),
        "{m}"
    );
    assert!(
        !m.contains("baton_sidecar_tls_app_tls_refused_total 1"),
        "{m}"
    );
    web_task.abort();

    let outbound = text.replace("direction: inbound", "direction: outbound");
    let err =
        baton_sidecar::config::compile(&baton_sidecar::config::yaml::parse(&outbound).unwrap())
            .unwrap_err()
            .to_string();
    assert!(
        err.contains("listeners[0] (in).terminate_tls") && err.contains("only an inbound listener"),
        "{err}"
    );
}
