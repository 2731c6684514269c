//! The mTLS matrix, over real loopback sockets with the real `Acceptor` and
//! `Connector`: right identity, wrong identity, expired, not yet valid,
//! wrong CA, foreign trust domain, no client certificate, plaintext to
//! Strict, plaintext and TLS to Permissive, version and cipher outside
//! policy, and every supported key type on TLS 1.2 and 1.3.

use crate::tls_support;

use std::sync::Arc;
use std::time::Duration;

use baton_sidecar::tls::settings::{TlsMode, TlsVersion};
use baton_sidecar::tls::verify::SpiffeServerVerifier;
use baton_sidecar::tls::{TlsContext, TlsError};
use tls_support::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn handshakes(ctx: &Arc<TlsContext>, side: &str, result: &str) -> u64 {
    ctx.metrics()
        .handshakes
        .get_or_create(&baton_sidecar::tls::metrics::HandshakeLabels {
            side: side.into(),
            result: result.into(),
        })
        .get()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_with_the_expected_identity_works_for_every_key_type_and_version() {
    let pki = Pki::new("mesh-ca");
    for key in [Key::P256, Key::P384, Key::Rsa2048, Key::Rsa3072] {
        for version in [TlsVersion::Tls12, TlsVersion::Tls13] {
            let mut s = settings(TlsMode::Strict);
            s.min_version = version;
            s.max_version = Some(version);
            let server = context(&s, pki.leaf("backend", key));
            let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", key));
            let srv = EchoServer::start(server.clone()).await;

            let tcp = TcpStream::connect(srv.addr).await.unwrap();
            let (mut stream, peer) = client
                .connector()
                .connect(tcp, &id("backend"), None)
                .await
                .unwrap_or_else(|e| panic!("{key:?} {version}: {e}"));
            assert_eq!(peer.identity, Some(id("backend")));
            let expected_version = match version {
                TlsVersion::Tls12 => rustls::ProtocolVersion::TLSv1_2,
                TlsVersion::Tls13 => rustls::ProtocolVersion::TLSv1_3,
            };
            assert_eq!(peer.version, Some(expected_version), "{key:?}");
            // ALPN from the default policy: h2 preferred.
            assert_eq!(peer.alpn.as_deref(), Some(&b"h2"[..]));
            let (banner, back) = exchange(&mut stream, "ping").await.unwrap();
            assert_eq!(
                banner,
                format!("tls {}", id("frontend")),
                "{key:?} {version}"
            );
            assert_eq!(back, "ping");
            assert_eq!(handshakes(&server, "server", "ok"), 1);
            assert_eq!(handshakes(&client, "client", "ok"), 1);
        }
    }
}

#[tokio::test]
async fn a_server_presenting_another_identity_is_refused_by_the_client() {
    let pki = Pki::new("mesh-ca");
    let server = context(&settings(TlsMode::Strict), pki.leaf("impostor", Key::P256));
    let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server).await;
    let err = mtls_round_trip(&client, srv.addr, &id("backend"))
        .await
        .unwrap_err();
    assert!(err.contains("Mismatch"), "{err}");
    assert!(err.contains("impostor"), "{err}");
}

#[tokio::test]
async fn an_expired_server_certificate_is_refused() {
    let pki = Pki::new("mesh-ca");
    let expired = pki.leaf_with(
        &id("backend").to_string(),
        Key::P256,
        now_plus(-7200),
        now_plus(-3600),
    );
    let server = context(&settings(TlsMode::Strict), expired);
    let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server).await;
    let err = mtls_round_trip(&client, srv.addr, &id("backend"))
        .await
        .unwrap_err();
    assert!(err.to_lowercase().contains("expired"), "{err}");
}

#[tokio::test]
async fn a_not_yet_valid_server_certificate_is_refused() {
    let pki = Pki::new("mesh-ca");
    let future = pki.leaf_with(
        &id("backend").to_string(),
        Key::P256,
        now_plus(3600),
        now_plus(7200),
    );
    let server = context(&settings(TlsMode::Strict), future);
    let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server).await;
    let err = mtls_round_trip(&client, srv.addr, &id("backend"))
        .await
        .unwrap_err();
    assert!(
        err.to_lowercase().contains("not valid yet") || err.contains("NotValidYet"),
        "{err}"
    );
}

/// A refused client certificate is detected by the server after the client
/// finished its side of a TLS 1.3 handshake, so the client sees the alert on
/// its first read: either way no data flows and the server counts a failure.
async fn assert_client_refused(server: Arc<TlsContext>, client: Arc<TlsContext>) {
    let srv = EchoServer::start(server.clone()).await;
    let r = mtls_round_trip(&client, srv.addr, &id("backend")).await;
    assert!(r.is_err(), "client was accepted: {r:?}");
    // The server's handshake task records the failure; wait for it (bounded).
    for _ in 0..100 {
        if handshakes(&server, "server", "handshake") == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(handshakes(&server, "server", "handshake"), 1);
    assert_eq!(handshakes(&server, "server", "ok"), 0);
}

#[tokio::test]
async fn an_expired_client_certificate_is_refused_by_the_server() {
    let pki = Pki::new("mesh-ca");
    let server = context(&settings(TlsMode::Strict), pki.leaf("backend", Key::P256));
    let expired = pki.leaf_with(
        &id("frontend").to_string(),
        Key::P256,
        now_plus(-7200),
        now_plus(-3600),
    );
    assert_client_refused(server, context(&settings(TlsMode::Strict), expired)).await;
}

#[tokio::test]
async fn a_not_yet_valid_client_certificate_is_refused_by_the_server() {
    let pki = Pki::new("mesh-ca");
    let server = context(&settings(TlsMode::Strict), pki.leaf("backend", Key::P256));
    let future = pki.leaf_with(
        &id("frontend").to_string(),
        Key::P256,
        now_plus(3600),
        now_plus(7200),
    );
    assert_client_refused(server, context(&settings(TlsMode::Strict), future)).await;
}

#[tokio::test]
async fn a_client_certificate_from_another_ca_is_refused_by_the_server() {
    let pki = Pki::new("mesh-ca");
    let rogue = Pki::new("rogue-ca");
    let server = context(&settings(TlsMode::Strict), pki.leaf("backend", Key::P256));
    // The client trusts the real CA but its own certificate is the rogue's.
    let mut m = rogue.leaf("frontend", Key::P256);
    m.trust_bundle = vec![pki.ca_der()];
    assert_client_refused(server, context(&settings(TlsMode::Strict), m)).await;
}

#[tokio::test]
async fn a_server_certificate_from_another_ca_is_refused_by_the_client() {
    let pki = Pki::new("mesh-ca");
    let rogue = Pki::new("rogue-ca");
    let mut m = rogue.leaf("backend", Key::P256);
    m.trust_bundle = vec![pki.ca_der()];
    let server = context(&settings(TlsMode::Strict), m);
    let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server).await;
    let err = mtls_round_trip(&client, srv.addr, &id("backend"))
        .await
        .unwrap_err();
    assert!(
        err.contains("UnknownIssuer") || err.to_lowercase().contains("unknown issuer"),
        "{err}"
    );
}

#[tokio::test]
async fn a_client_from_a_foreign_trust_domain_is_refused_even_with_a_valid_chain() {
    let pki = Pki::new("mesh-ca");
    let server = context(&settings(TlsMode::Strict), pki.leaf("backend", Key::P256));
    let foreign = pki.leaf_with(
        "spiffe://evil.example/ns/default/sa/frontend",
        Key::P256,
        now_plus(-60),
        now_plus(3600),
    );
    let mut cs = settings(TlsMode::Strict);
    cs.identity.trust_domain = String::new();
    let client = TlsContext::new(
        &cs,
        foreign,
        software_offload(&Default::default()),
        Default::default(),
    )
    .unwrap();
    assert_client_refused(server, client).await;
}

#[tokio::test]
async fn a_client_without_a_certificate_is_refused_by_a_strict_listener() {
    let pki = Pki::new("mesh-ca");
    let server = context(&settings(TlsMode::Strict), pki.leaf("backend", Key::P256));
    let srv = EchoServer::start(server.clone()).await;
    // An independent client implementation (tokio-rustls) with no certificate.
    let mut roots = rustls::RootCertStore::empty();
    roots.add(pki.ca_der()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(SpiffeServerVerifier::new(
            Arc::new(roots),
            id("backend"),
            provider.signature_verification_algorithms,
        )))
        .with_no_client_auth();
    let tcp = TcpStream::connect(srv.addr).await.unwrap();
    let r = async {
        let mut s = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect("mesh.baton.invalid".try_into().unwrap(), tcp)
            .await?;
        exchange(&mut s, "ping").await
    }
    .await;
    assert!(r.is_err(), "certificate-less client was served: {r:?}");
}

#[tokio::test]
async fn plaintext_to_a_strict_listener_is_refused_and_counted() {
    let pki = Pki::new("mesh-ca");
    let server = context(&settings(TlsMode::Strict), pki.leaf("backend", Key::P256));
    let srv = EchoServer::start(server.clone()).await;
    let mut tcp = TcpStream::connect(srv.addr).await.unwrap();
    tcp.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(closed_without_data(&mut tcp).await);
    for _ in 0..100 {
        if server.metrics().plaintext_refused.get() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(server.metrics().plaintext_refused.get(), 1);
}

#[tokio::test]
async fn a_permissive_listener_serves_plaintext_and_tls_on_the_same_port() {
    let pki = Pki::new("mesh-ca");
    let server = context(
        &settings(TlsMode::Permissive),
        pki.leaf("backend", Key::P256),
    );
    let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server.clone()).await;

    let mut plain = TcpStream::connect(srv.addr).await.unwrap();
    plain.write_all(b"hello\n").await.unwrap();
    let (banner, back) = {
        use tokio::io::{AsyncBufReadExt, BufReader};
        let mut r = BufReader::new(&mut plain);
        let mut b = String::new();
        r.read_line(&mut b).await.unwrap();
        let mut e = String::new();
        r.read_line(&mut e).await.unwrap();
        (b, e)
    };
    assert_eq!(banner.trim(), "plain");
    assert_eq!(back.trim(), "hello");

    let (banner, back) = mtls_round_trip(&client, srv.addr, &id("backend"))
        .await
        .unwrap();
    assert_eq!(banner, format!("tls {}", id("frontend")));
    assert_eq!(back, "ping");
    assert_eq!(server.metrics().plaintext_accepted.get(), 1);
}

#[tokio::test]
async fn a_silent_client_on_a_permissive_listener_is_plaintext_after_the_detect_timeout() {
    let pki = Pki::new("mesh-ca");
    let server = context(
        &settings(TlsMode::Permissive),
        pki.leaf("backend", Key::P256),
    );
    let srv = EchoServer::start(server).await;
    // Server-speaks-first protocols: the client waits for the banner.
    let tcp = TcpStream::connect(srv.addr).await.unwrap();
    let mut r = tokio::io::BufReader::new(tcp);
    let mut banner = String::new();
    tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::AsyncBufReadExt::read_line(&mut r, &mut banner),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(banner.trim(), "plain");
}

#[tokio::test]
async fn a_disabled_policy_accepts_plaintext_and_refuses_to_originate_tls() {
    let pki = Pki::new("mesh-ca");
    let s = settings(TlsMode::Disabled);
    let server = context(&s, pki.leaf("backend", Key::P256));
    let srv = EchoServer::start(server.clone()).await;
    let mut tcp = TcpStream::connect(srv.addr).await.unwrap();
    let (banner, back) = exchange(&mut tcp, "x").await.unwrap();
    assert_eq!((banner.as_str(), back.as_str()), ("plain", "x"));
    let tcp = TcpStream::connect(srv.addr).await.unwrap();
    let r = server.connector().connect(tcp, &id("backend"), None).await;
    assert!(matches!(r, Err(TlsError::Disabled)));
}

#[tokio::test]
async fn a_client_limited_to_tls12_cannot_reach_a_listener_requiring_tls13() {
    let pki = Pki::new("mesh-ca");
    let mut ss = settings(TlsMode::Strict);
    ss.min_version = TlsVersion::Tls13;
    let server = context(&ss, pki.leaf("backend", Key::P256));
    let mut cs = settings(TlsMode::Strict);
    cs.max_version = Some(TlsVersion::Tls12);
    let client = context(&cs, pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server.clone()).await;
    let err = mtls_round_trip(&client, srv.addr, &id("backend"))
        .await
        .unwrap_err();
    assert!(
        err.contains("ProtocolVersion") || err.to_lowercase().contains("version"),
        "{err}"
    );
}

#[tokio::test]
async fn a_client_offering_only_suites_outside_policy_is_refused() {
    let pki = Pki::new("mesh-ca");
    let mut ss = settings(TlsMode::Strict);
    ss.cipher_suites = vec!["TLS_AES_256_GCM_SHA384".into()];
    let server = context(&ss, pki.leaf("backend", Key::P256));
    let mut cs = settings(TlsMode::Strict);
    cs.cipher_suites = vec![
        "TLS_CHACHA20_POLY1305_SHA256".into(),
        "ECDHE-ECDSA-AES128-GCM-SHA256".into(),
    ];
    let client = context(&cs, pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server.clone()).await;
    let err = mtls_round_trip(&client, srv.addr, &id("backend"))
        .await
        .unwrap_err();
    assert!(err.to_lowercase().contains("handshake"), "{err}");

    // The same client with an allowed suite gets through, and the suite is the policy's.
    let mut cs = settings(TlsMode::Strict);
    cs.cipher_suites = vec![
        "TLS_AES_256_GCM_SHA384".into(),
        "TLS_AES_128_GCM_SHA256".into(),
    ];
    let client = context(&cs, pki.leaf("frontend", Key::P256));
    let tcp = TcpStream::connect(srv.addr).await.unwrap();
    let (_s, peer) = client
        .connector()
        .connect(tcp, &id("backend"), None)
        .await
        .unwrap();
    assert_eq!(
        peer.suite,
        Some(rustls::CipherSuite::TLS13_AES_256_GCM_SHA384)
    );
}

#[tokio::test]
async fn the_connector_can_narrow_alpn_per_connection() {
    let pki = Pki::new("mesh-ca");
    let server = context(&settings(TlsMode::Strict), pki.leaf("backend", Key::P256));
    let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server).await;
    let tcp = TcpStream::connect(srv.addr).await.unwrap();
    let (_s, peer) = client
        .connector()
        .connect(tcp, &id("backend"), Some(vec![b"http/1.1".to_vec()]))
        .await
        .unwrap();
    assert_eq!(peer.alpn.as_deref(), Some(&b"http/1.1"[..]));
}

#[tokio::test]
async fn the_server_config_allows_secret_extraction_for_the_handoff() {
    let pki = Pki::new("mesh-ca");
    let server = context(&settings(TlsMode::Strict), pki.leaf("backend", Key::P256));
    assert!(server.server_config().enable_secret_extraction);
    // And an established server connection really yields its secrets.
    let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let acceptor = server.acceptor();
    let srv = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        let (s, _) = acceptor.accept_tls(tcp).await.unwrap();
        let (_io, conn) = s.into_parts();
        conn.dangerous_extract_secrets().map(|_| ())
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (_c, _) = client
        .connector()
        .connect(tcp, &id("backend"), None)
        .await
        .unwrap();
    srv.await.unwrap().unwrap();
}

#[tokio::test]
async fn the_handoff_key_log_captures_tls13_traffic_secrets() {
    let pki = Pki::new("mesh-ca");
    let server = context(&settings(TlsMode::Strict), pki.leaf("backend", Key::P256));
    let capture = Arc::new(baton_sidecar::tls_record::SecretCapture::new(64));
    server.set_key_log(capture.clone()).unwrap();
    let client = context(&settings(TlsMode::Strict), pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server).await;
    mtls_round_trip(&client, srv.addr, &id("backend"))
        .await
        .unwrap();
    // One client and one server application traffic secret.
    assert_eq!(capture.len(), 2);
}

#[tokio::test]
async fn the_policy_suite_order_wins_over_the_client_preference() {
    let pki = Pki::new("mesh-ca");
    let mut ss = settings(TlsMode::Strict);
    ss.cipher_suites = vec![
        "TLS_AES_256_GCM_SHA384".into(),
        "TLS_AES_128_GCM_SHA256".into(),
    ];
    let server = context(&ss, pki.leaf("backend", Key::P256));
    let mut cs = settings(TlsMode::Strict);
    cs.cipher_suites = vec![
        "TLS_AES_128_GCM_SHA256".into(),
        "TLS_AES_256_GCM_SHA384".into(),
    ];
    let client = context(&cs, pki.leaf("frontend", Key::P256));
    let srv = EchoServer::start(server).await;
    let tcp = TcpStream::connect(srv.addr).await.unwrap();
    let (_s, peer) = client
        .connector()
        .connect(tcp, &id("backend"), None)
        .await
        .unwrap();
    assert_eq!(
        peer.suite,
        Some(rustls::CipherSuite::TLS13_AES_256_GCM_SHA384)
    );
}
