//! Opaque TCP inbound listeners (`protocol: tcp`) under a mesh TLS policy:
//! the sidecar terminates mesh TLS (1.2 and 1.3) and passes the inner bytes
//! on untouched (no detection of the inner protocol, even when the bytes
//! look like HTTP); Strict refuses plaintext, Permissive passes it on; such
//! connections move to a new process with every byte, and the TLS counters
//! continue across the handoff.

use crate::handoff_support;
use crate::tls_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use baton_sidecar::server::Running;
use baton_sidecar::tls::{MeshTls, TlsContext, TlsMode, TlsVersion};
use handoff_support::{Pattern, World, admin_get, metric_sum};
use tls_support::*;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A raw TCP echo server (the application behind the opaque port).
async fn echo_app() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    (addr, task)
}

struct Sidecar {
    running: Running,
    _tls: Arc<MeshTls>,
    _dir: tempfile::TempDir,
    _app: tokio::task::JoinHandle<()>,
}

/// An in-process sidecar whose only listener is an opaque inbound one in
/// front of a TCP echo app, under mesh TLS `mode`.
async fn opaque_sidecar(pki: &Pki, mode: &str) -> Sidecar {
    let dir = tempfile::tempdir().unwrap();
    let source = write_backend_pki(pki, dir.path());
    let (app, task) = echo_app().await;
    let text = format!(
        "listeners: [{{name: in, address: '127.0.0.1:0', direction: inbound, protocol: tcp, tcp_cluster: app, detect_timeout_ms: 300}}]
clusters: [{{name: app, endpoints: ['{app}']}}]
tls:
  mode: {mode}
  identity: {{trust_domain: {TD}}}
  source: {source}
"
    );
    let (running, tls) = start_with_mesh_tls(&text).await;
    Sidecar {
        running,
        _tls: tls,
        _dir: dir,
        _app: task,
    }
}

/// A mesh client (workload `frontend`) speaking only TLS `version`.
fn client(pki: &Pki, version: TlsVersion) -> Arc<TlsContext> {
    let mut s = settings(TlsMode::Strict);
    s.min_version = version;
    s.max_version = Some(version);
    context(&s, pki.leaf("frontend", Key::P256))
}

/// Writes `msg` and reads back exactly as many bytes (bounded in time).
async fn echo<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, msg: &[u8]) -> Vec<u8> {
    s.write_all(msg).await.unwrap();
    s.flush().await.unwrap();
    let mut back = vec![0u8; msg.len()];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back))
        .await
        .expect("echo timed out")
        .expect("echo read");
    back
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_opaque_inbound_listener_under_strict_terminates_mesh_tls_1_2_and_1_3_and_passes_the_inner_bytes_untouched()
 {
    let pki = Pki::new("mesh-ca");
    let sc = opaque_sidecar(&pki, "Strict").await;
    let addr = sc.running.addr("in").unwrap();
    for version in [TlsVersion::Tls12, TlsVersion::Tls13] {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (mut s, peer) = client(&pki, version)
            .connector()
            .connect(tcp, &id("backend"), None)
            .await
            .unwrap_or_else(|e| panic!("{version:?}: mesh TLS refused: {e}"));
        let wire = match version {
            TlsVersion::Tls12 => rustls::ProtocolVersion::TLSv1_2,
            TlsVersion::Tls13 => rustls::ProtocolVersion::TLSv1_3,
        };
        assert_eq!(peer.version, Some(wire), "{version:?}");
        // Bytes that an HTTP/1 or HTTP/2 server would answer (or refuse)
        // come back verbatim: nothing looks inside the mesh TLS.
        for msg in [
            &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            b"\x16\x03\x01 not a second handshake",
        ] {
            assert_eq!(echo(&mut s, msg).await, msg, "{version:?}");
        }
        // 256 KiB in 16 KiB steps (each echoed before the next is sent).
        let mut big = vec![0u8; 256 * 1024];
        Pattern::new(7).fill(&mut big);
        for chunk in big.chunks(16 * 1024) {
            assert!(
                echo(&mut s, chunk).await == chunk,
                "{version:?}: echo differs"
            );
        }
    }
    let m = sc.running.shared.metrics.encode();
    assert!(
        m.contains(r#"baton_sidecar_tls_handshakes_total{side="server",result="ok"} 2"#),
        "{m}"
    );
    assert!(
        m.contains(r#"baton_sidecar_connections_total{listener="in",protocol="tcp"} 2"#),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_opaque_inbound_listener_refuses_plaintext_under_strict_and_passes_it_on_under_permissive()
 {
    let pki = Pki::new("mesh-ca");
    let strict = opaque_sidecar(&pki, "Strict").await;
    let mut tcp = TcpStream::connect(strict.running.addr("in").unwrap())
        .await
        .unwrap();
    tcp.write_all(b"hello in plaintext\n").await.unwrap();
    assert!(
        closed_without_data(&mut tcp).await,
        "Strict must close a plaintext connection unanswered"
    );
    let m = strict.running.shared.metrics.encode();
    assert!(
        m.contains("baton_sidecar_local_responses_total{reason=\"plaintext_refused\"} 1"),
        "{m}"
    );

    let permissive = opaque_sidecar(&pki, "Permissive").await;
    let addr = permissive.running.addr("in").unwrap();
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    assert_eq!(
        echo(&mut tcp, b"hello in plaintext\n").await,
        b"hello in plaintext\n"
    );
    // A silent client (server-speaks-first protocol) is plaintext after the
    // listener's detect timeout: its first bytes still arrive intact.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(echo(&mut silent, b"late").await, b"late");
    // And mesh TLS is still terminated on the same listener.
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut s, _) = client(&pki, TlsVersion::Tls13)
        .connector()
        .connect(tcp, &id("backend"), None)
        .await
        .unwrap();
    assert_eq!(echo(&mut s, b"inside").await, b"inside");
}

/// `baton-sidecar validate` refuses a listener that can never serve.
#[test]
fn validate_refuses_a_forced_http_inbound_listener_whose_alpn_the_tls_policy_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "listeners: [{name: in, address: '127.0.0.1:15006', direction: inbound, protocol: http2}]
tls: {mode: Strict, alpn: ['http/1.1'], source: {files: {cert_chain: c, key: k, trust_bundle: b}}}
",
    )
    .unwrap();
    let out = std::process::Command::new(handoff_support::BIN)
        .args(["validate", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "accepted: {err}");
    assert!(err.contains("does not list"), "{err}");

    // The TLS section itself is validated too.
    std::fs::write(
        &bad,
        "tls: {mode: Strict, cipher_suites: [NOPE], source: {files: {cert_chain: c, key: k, trust_bundle: b}}}\n",
    )
    .unwrap();
    let out = std::process::Command::new(handoff_support::BIN)
        .args(["validate", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "accepted: {err}");
    assert!(err.contains("unknown cipher suite"), "{err}");
}

/// Real processes: long-lived mesh TLS 1.2 and 1.3 connections on an opaque
/// Strict listener move to a new process mid-stream without losing or
/// reordering a byte, and `baton_sidecar_tls_handshakes_total` continues
/// (20 handshakes before, one after: 23 with the two long-lived ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opaque_mesh_tls_connections_and_the_tls_counters_survive_a_handoff() {
    let world = World::new().await;
    let pki = Pki::new("mesh-ca");
    let source = write_backend_pki(&pki, world.dir.path());
    let inbound: SocketAddr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    std::fs::write(
        &world.config,
        format!(
            "version: 1
admin: {{ address: {admin} }}
runtime: {{ worker_threads: 1, drain_timeout_ms: 5000 }}
listeners:
  - {{ name: in, address: {inbound}, direction: inbound, protocol: tcp, tcp_cluster: echo }}
clusters:
  - {{ name: echo, endpoints: [{echo}] }}
tls:
  mode: Strict
  identity: {{ trust_domain: {TD} }}
  source: {source}
",
            admin = world.admin,
            echo = world.upstream.echo,
        ),
    )
    .unwrap();
    let mut old = world.spawn(&[]);
    world.wait_ready(Duration::from_secs(20)).await;

    let connect = |version| {
        let c = client(&pki, version);
        async move {
            let tcp = TcpStream::connect(inbound).await.unwrap();
            c.connector()
                .connect(tcp, &id("backend"), None)
                .await
                .unwrap_or_else(|e| panic!("{version:?}: {e}"))
        }
    };
    for i in 0..20 {
        let v = if i % 2 == 0 {
            TlsVersion::Tls12
        } else {
            TlsVersion::Tls13
        };
        let (mut s, _) = connect(v).await;
        assert_eq!(echo(&mut s, b"short").await, b"short");
    }
    let (mut s12, p12) = connect(TlsVersion::Tls12).await;
    let (mut s13, p13) = connect(TlsVersion::Tls13).await;
    assert_eq!(p12.version, Some(rustls::ProtocolVersion::TLSv1_2));
    assert_eq!(p13.version, Some(rustls::ProtocolVersion::TLSv1_3));
    let (mut pat12, mut pat13) = (Pattern::new(12), Pattern::new(13));
    // The next 8000 bytes of each connection's own pattern.
    let mut round = || {
        let mut a = vec![0u8; 8000];
        let mut b = vec![0u8; 8000];
        pat12.fill(&mut a);
        pat13.fill(&mut b);
        (a, b)
    };
    let (a, b) = round();
    assert!(echo(&mut s12, &a).await == a, "TLS 1.2 before the handoff");
    assert!(echo(&mut s13, &b).await == b, "TLS 1.3 before the handoff");
    let before = admin_get(world.admin, "/metrics").await.unwrap().1;
    assert_eq!(
        metric_sum(
            &before,
            r#"baton_sidecar_tls_handshakes_total{side="server",result="ok"}"#
        ),
        22,
        "{before}"
    );

    let new = world.spawn(&[]);
    world
        .wait_complete(new.pid(), Duration::from_secs(30))
        .await;
    assert!(
        old.wait_exit(Duration::from_secs(20)).is_some(),
        "the old process did not exit"
    );
    // The same sessions, now served by the new process.
    for _ in 0..3 {
        let (a, b) = round();
        assert!(echo(&mut s12, &a).await == a, "TLS 1.2 after the handoff");
        assert!(echo(&mut s13, &b).await == b, "TLS 1.3 after the handoff");
    }
    let (mut s, _) = connect(TlsVersion::Tls13).await;
    assert_eq!(echo(&mut s, b"after").await, b"after");
    let after = admin_get(world.admin, "/metrics").await.unwrap().1;
    assert_eq!(
        metric_sum(
            &after,
            r#"baton_sidecar_tls_handshakes_total{side="server",result="ok"}"#
        ),
        23,
        "the TLS counter did not continue:\n{after}\n{}",
        world.logs()
    );
    let log = world.logs();
    assert!(
        !log.contains("does not export") && !log.contains("not carried over"),
        "{log}"
    );
    drop(new);
}

/// An inbound listener that detects protocols, with the mesh TLS layer
/// attached but no policy applied (an injected sidecar before any TlsPolicy
/// selects it): a ClientHello is the application's own TLS and reaches the
/// application byte for byte instead of being refused by a TLS layer that
/// has no certificate to answer with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbound_listener_without_a_tls_policy_passes_the_applications_own_tls_through() {
    let (app, _task) = echo_app().await;
    let text = format!(
        "listeners: [{{name: in, address: '127.0.0.1:0', direction: inbound, tcp_cluster: app, detect_timeout_ms: 300}}]
clusters: [{{name: app, endpoints: ['{app}']}}]
"
    );
    let (running, _tls) = start_with_mesh_tls(&text).await;
    let mut tcp = TcpStream::connect(running.addr("in").unwrap())
        .await
        .unwrap();
    // A TLS handshake record header (content type 22, version 3.1) and
    // whatever follows: the echo must return it verbatim.
    let hello = b"\x16\x03\x01\x00\x08client-hello-bytes";
    assert_eq!(echo(&mut tcp, hello).await, hello);
}
