//! The identity-service client against an in-process identity service
//! (HTTP and HTTPS): CSR with the projected token, retries, renewal at 2/3 of
//! the lifetime, and a refused token.

use crate::tls_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use baton_sidecar::tls::TlsMetrics;
use baton_sidecar::tls::identity_client::{RetryPolicy, SignRequest, SignResponse, bootstrap};
use baton_sidecar::tls::settings::{CertSource, KeyType, TlsMode};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tls_support::*;

/// Minimal identity service: checks the bearer token, fails the first
/// `fail_first` requests with 503, signs the CSR for `lifetime`.
struct IdentityService {
    addr: SocketAddr,
    requests: Arc<AtomicU64>,
    pki: Arc<Pki>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for IdentityService {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn respond(status: u16, body: impl Into<Bytes>) -> hyper::Response<Full<Bytes>> {
    hyper::Response::builder()
        .status(status)
        .body(Full::new(body.into()))
        .unwrap()
}

impl IdentityService {
    async fn start(
        token: &str,
        fail_first: u64,
        lifetime: Duration,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> Self {
        let pki = Arc::new(Pki::new("identity-ca"));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let requests = Arc::new(AtomicU64::new(0));
        let (p, r, token) = (pki.clone(), requests.clone(), format!("Bearer {token}"));
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = l.accept().await else {
                    return;
                };
                let (pki, requests, token, tls) =
                    (p.clone(), r.clone(), token.clone(), tls.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        let (pki, requests, token) = (pki.clone(), requests.clone(), token.clone());
                        async move {
                            let n = requests.fetch_add(1, Ordering::SeqCst);
                            let auth = req
                                .headers()
                                .get("authorization")
                                .and_then(|v| v.to_str().ok());
                            if auth != Some(token.as_str()) {
                                return Ok::<_, hyper::Error>(respond(401, "bad token"));
                            }
                            if n < fail_first {
                                return Ok(respond(503, "warming up"));
                            }
                            let body = req.into_body().collect().await?.to_bytes();
                            let Ok(sign) = serde_json::from_slice::<SignRequest>(&body) else {
                                return Ok(respond(400, "bad json"));
                            };
                            let Ok(mut csr) =
                                rcgen::CertificateSigningRequestParams::from_pem(&sign.csr)
                            else {
                                return Ok(respond(400, "bad csr"));
                            };
                            csr.params.not_before = now_plus(-1).into();
                            csr.params.not_after = (std::time::SystemTime::now() + lifetime).into();
                            csr.params.extended_key_usages = vec![
                                rcgen::ExtendedKeyUsagePurpose::ServerAuth,
                                rcgen::ExtendedKeyUsagePurpose::ClientAuth,
                            ];
                            let cert = csr.signed_by(&pki.ca).unwrap();
                            let resp = SignResponse {
                                certificate_chain: cert.pem(),
                                trust_bundle: pki.ca.pem(),
                                trust_generation: None,
                            };
                            Ok(respond(200, serde_json::to_vec(&resp).unwrap()))
                        }
                    });
                    let http = hyper::server::conn::http1::Builder::new();
                    match tls {
                        None => {
                            let _ = http.serve_connection(TokioIo::new(tcp), svc).await;
                        }
                        Some(cfg) => {
                            if let Ok(s) = tokio_rustls::TlsAcceptor::from(cfg).accept(tcp).await {
                                let _ = http.serve_connection(TokioIo::new(s), svc).await;
                            }
                        }
                    }
                });
            }
        });
        IdentityService {
            addr,
            requests,
            pki,
            task,
        }
    }
}

fn client_settings(
    url: String,
    token_path: std::path::PathBuf,
    ca_bundle: Option<std::path::PathBuf>,
) -> baton_sidecar::tls::TlsSettings {
    let mut s = settings(TlsMode::Strict);
    s.identity.local = Some(id("frontend").to_string());
    s.source = Some(CertSource::IdentityService {
        url,
        ca_bundle,
        token_path: Some(token_path),
        key_type: KeyType::EcdsaP256,
    });
    s
}

const FAST: RetryPolicy = RetryPolicy {
    attempts: 5,
    base: Duration::from_millis(20),
    max: Duration::from_millis(100),
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_survives_transient_failures_and_renews_at_two_thirds_of_the_lifetime() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "projected-sa-token\n").unwrap();
    let svc = IdentityService::start("projected-sa-token", 2, Duration::from_secs(3), None).await;
    let s = client_settings(format!("http://{}/v1/sign", svc.addr), token, None);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let metrics = TlsMetrics::default();
    let ctx = bootstrap(&s, metrics.clone(), stop_rx, FAST).await.unwrap();
    assert_eq!(
        svc.requests.load(Ordering::SeqCst),
        3,
        "two 503s, then success"
    );
    assert_eq!(ctx.local_identity(), Some(id("frontend")));

    // The issued certificate really works for mTLS against a mesh peer.
    let server = context(
        &settings(TlsMode::Strict),
        svc.pki.leaf("backend", Key::P256),
    );
    let srv = EchoServer::start(server).await;
    let (banner, _) = mtls_round_trip(&ctx, srv.addr, &id("backend"))
        .await
        .unwrap();
    assert_eq!(banner, format!("tls {}", id("frontend")));

    // Renewal at 2 s (± 0.15 s jitter) of a 3 s certificate; bounded wait.
    let (nb, na) = ctx.current_validity().unwrap();
    for _ in 0..100 {
        if metrics.material_generation.get() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(metrics.material_generation.get() >= 2, "no renewal");
    let (nb2, na2) = ctx.current_validity().unwrap();
    assert!(nb2 >= nb && na2 > na, "renewed certificate is not newer");
    let renewed_at = svc.requests.load(Ordering::SeqCst);
    assert!(renewed_at >= 4);
    stop_tx.send(true).unwrap();
    // Still serving with the renewed certificate.
    mtls_round_trip(&ctx, srv.addr, &id("backend"))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_refused_token_fails_bootstrap_after_bounded_retries() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "stolen-token").unwrap();
    let svc = IdentityService::start("projected-sa-token", 0, Duration::from_secs(60), None).await;
    let s = client_settings(format!("http://{}/v1/sign", svc.addr), token, None);
    let (_stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let err = bootstrap(&s, TlsMetrics::default(), stop_rx, FAST)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("401"), "{err}");
    assert_eq!(
        svc.requests.load(Ordering::SeqCst),
        u64::from(FAST.attempts)
    );
}

#[tokio::test]
async fn the_identity_service_can_be_reached_over_https_with_a_ca_bundle() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "t0k3n").unwrap();
    // The identity service's own serving certificate, for 127.0.0.1.
    let serving_ca = Pki::new("serving-ca");
    let kp = key_pair(Key::P256);
    let mut p = rcgen::CertificateParams::default();
    p.subject_alt_names = vec![rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap())];
    let cert = p.signed_by(&kp, &serving_ca.ca).unwrap();
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        rustls_pki_types::PrivateKeyDer::Pkcs8(kp.serialize_der().into()),
    )
    .unwrap();
    let svc =
        IdentityService::start("t0k3n", 0, Duration::from_secs(60), Some(Arc::new(cfg))).await;
    let ca_file = dir.path().join("serving-ca.pem");
    std::fs::write(&ca_file, serving_ca.ca.pem()).unwrap();
    let s = client_settings(
        format!("https://127.0.0.1:{}/v1/sign", svc.addr.port()),
        token,
        Some(ca_file),
    );
    let (_stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let ctx = bootstrap(&s, TlsMetrics::default(), stop_rx, FAST)
        .await
        .unwrap();
    assert_eq!(ctx.local_identity(), Some(id("frontend")));
    assert_eq!(svc.requests.load(Ordering::SeqCst), 1);
}

/// A config can require mTLS toward a peer before the sidecar's first
/// certificate arrived (the e2e outage test caught a client's first requests
/// failing with 503 in that window): an outbound mTLS connection waits for
/// the bootstrap instead of failing, and fails with the bootstrap's reason
/// only when no certificate comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbound_mtls_waits_for_the_first_certificate_instead_of_failing() {
    use baton_sidecar::tls::{MeshTls, TlsError};
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "projected-sa-token\n").unwrap();
    // Three 503s first: the bootstrap's back-off keeps the certificate
    // away for a while after the settings are applied.
    let svc = IdentityService::start("projected-sa-token", 3, Duration::from_secs(60), None).await;
    let s = client_settings(format!("http://{}/v1/sign", svc.addr), token.clone(), None);
    let server = context(
        &settings(TlsMode::Strict),
        svc.pki.leaf("backend", Key::P256),
    );
    let srv = EchoServer::start(server).await;

    let tls = MeshTls::new(TlsMetrics::default());
    tls.apply(Some(&s)).unwrap();
    assert!(tls.context().is_none(), "no certificate yet");
    // What a cluster does before its TCP connect.
    tls.wait_for_certificate()
        .await
        .expect("the connection waits for the certificate");
    let tcp = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    let backend = id("backend").to_string();
    let (_io, peer) = tls
        .connect_to(tcp, "backend", Some(&backend), None)
        .await
        .expect("mTLS with the certificate");
    assert_eq!(peer.identity, Some(id("backend")));
    assert!(
        svc.requests.load(Ordering::SeqCst) >= 4,
        "issued after three 503s"
    );

    // A bootstrap that cannot succeed: the wait is bounded and the error
    // names the bootstrap's state.
    std::fs::write(&token, "stolen-token").unwrap();
    let mut refused = s.clone();
    refused.identity.local = Some(id("other").to_string());
    let tls = MeshTls::new(TlsMetrics::default());
    tls.apply(Some(&refused)).unwrap();
    let started = std::time::Instant::now();
    match tls.wait_for_certificate().await {
        Err(TlsError::NoCertificate(reason)) => assert!(!reason.is_empty()),
        Err(e) => panic!("expected NoCertificate, got {e}"),
        Ok(_) => panic!("connected without a certificate"),
    }
    assert!(started.elapsed() < baton_sidecar::tls::glue::FIRST_CERTIFICATE_WAIT * 2);
}

/// The server side of the same race (the e2e identity test caught a
/// client's first mTLS requests answered 503 "handshake" right after a
/// Strict policy reached both Pods): an inbound mesh TLS handshake that
/// arrives before this sidecar's first certificate waits for the bootstrap
/// instead of being refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbound_mtls_handshake_waits_for_the_first_certificate_instead_of_being_refused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "projected-sa-token\n").unwrap();
    let svc = IdentityService::start("projected-sa-token", 3, Duration::from_secs(60), None).await;
    // The application: a TCP echo.
    let app = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_addr = app.local_addr().unwrap();
    let app_task = tokio::spawn(async move {
        while let Ok((mut s, _)) = app.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    let text = format!(
        "listeners: [{{name: in, address: '127.0.0.1:0', direction: inbound, protocol: tcp, tcp_cluster: app}}]
clusters: [{{name: app, endpoints: ['{app_addr}']}}]
tls:
  mode: Strict
  identity: {{trust_domain: {TD}, local: '{local}'}}
  source: {{identity_service: {{url: 'http://{svc}/v1/sign', token_path: '{token}'}}}}
",
        local = id("backend"),
        svc = svc.addr,
        token = token.display(),
    );
    let (running, tls) = start_with_mesh_tls(&text).await;
    assert!(tls.context().is_none(), "no certificate yet");

    let tcp = tokio::net::TcpStream::connect(running.addr("in").unwrap())
        .await
        .unwrap();
    let client = context(
        &settings(TlsMode::Strict),
        svc.pki.leaf("frontend", Key::P256),
    );
    let (mut s, peer) = client
        .connector()
        .connect(tcp, &id("backend"), None)
        .await
        .expect("the handshake waits for the server's first certificate");
    assert_eq!(peer.identity, Some(id("backend")));
    assert!(
        svc.requests.load(Ordering::SeqCst) >= 4,
        "issued after three 503s"
    );
    s.write_all(b"ping").await.unwrap();
    let mut back = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back))
        .await
        .expect("echo in time")
        .unwrap();
    assert_eq!(&back, b"ping");
    app_task.abort();
}

/// Decision 0058: every bundle the identity service sends is kept on the
/// Pod's shared volume, and a process started later (a restarted slot, the
/// next process of a hot upgrade) trusts it together with the bundle
/// injected at admission — which, after a root rotation, no longer names
/// the root the endpoint's certificate chains to.
#[tokio::test]
async fn the_kept_bundle_lets_a_new_process_reach_an_endpoint_its_injected_bundle_does_not_verify()
{
    use baton_sidecar::tls::identity_client::IdentityClient;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "t0k3n").unwrap();
    let kept = dir.path().join("trust-bundle.pem");

    // 1. A process holding no certificate asks over plain HTTP and keeps
    //    the bundle that came with its certificate.
    let svc = IdentityService::start("t0k3n", 0, Duration::from_secs(60), None).await;
    let client = IdentityClient::new(
        &format!("http://{}/v1/sign", svc.addr),
        None,
        Some(token.clone()),
        id("frontend"),
        KeyType::EcdsaP256,
    )
    .unwrap()
    .with_trust_state(Some(kept.clone()))
    .unwrap();
    client.issue().await.unwrap();
    assert_eq!(std::fs::read_to_string(&kept).unwrap(), svc.pki.ca.pem());

    // 2. The endpoint now serves a certificate of that root (issuance moved
    //    to the new root); the injected bundle names only an older root.
    let kp = key_pair(Key::P256);
    let mut p = rcgen::CertificateParams::default();
    p.subject_alt_names = vec![rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap())];
    let serving = p.signed_by(&kp, &svc.pki.ca).unwrap();
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![serving.der().clone()],
        rustls_pki_types::PrivateKeyDer::Pkcs8(kp.serialize_der().into()),
    )
    .unwrap();
    let https =
        IdentityService::start("t0k3n", 0, Duration::from_secs(60), Some(Arc::new(cfg))).await;
    let injected = dir.path().join("ca.crt");
    std::fs::write(&injected, Pki::new("old-root").ca.pem()).unwrap();
    let url = format!("https://127.0.0.1:{}/v1/sign", https.addr.port());
    let fresh = |kept: Option<std::path::PathBuf>| {
        IdentityClient::new(
            &url,
            Some(&injected),
            Some(token.clone()),
            id("frontend"),
            KeyType::EcdsaP256,
        )
        .unwrap()
        .with_trust_state(kept)
        .unwrap()
    };
    let err = fresh(None).issue().await.unwrap_err();
    assert!(
        err.to_string().contains("UnknownIssuer")
            || err.to_string().contains("invalid peer certificate"),
        "{err}"
    );
    assert_eq!(https.requests.load(Ordering::SeqCst), 0);
    fresh(Some(kept.clone())).issue().await.unwrap();
    assert_eq!(https.requests.load(Ordering::SeqCst), 1);
}
