//! The identity endpoint in-process on loopback, driven by the sidecar's
//! real identity client (`baton_sidecar::tls::identity_client`) and, for
//! what that client cannot send (a tampered CSR, no token), by a raw
//! HTTPS request. The API server is replaced by a [`Cluster`] fake that
//! answers TokenReviews and Pod reads from a table.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use baton_operator::identity::authority::{Authority, CaPem, generate_intermediate, generate_root};
use baton_operator::identity::cluster::{Cluster, PodState};
use baton_operator::identity::issue::{Caller, IssuePolicy, Refusal, ReviewResult};
use baton_operator::identity::metrics::IdentityMetrics;
use baton_operator::identity::rate_limit::RateLimit;
use baton_operator::identity::server::{ServingCert, acceptor, serve};
use baton_operator::identity::service::{IdentityService, ServiceConfig};
use baton_sidecar::tls::identity_client::{
    IdentityClient, IdentityClientError, RetryPolicy, bootstrap, bootstrap_with,
};
use baton_sidecar::tls::settings::KeyType;
use baton_sidecar::tls::{Accepted, CertSource, SpiffeId, TlsContext, TlsMetrics, TlsSettings};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};
use time::OffsetDateTime;

const AUDIENCE: &str = "identity.baton.dev";
const PATH: &str = "/v1/sign";

type Events = Arc<Mutex<Vec<(String, &'static str, String)>>>;

/// TokenReview and Pod answers from tables; Events recorded.
struct FakeCluster {
    tokens: HashMap<String, ReviewResult>,
    pods: HashMap<String, PodState>,
    events: Events,
}

impl Cluster for FakeCluster {
    async fn review(&self, token: &str, audience: &str) -> Result<ReviewResult, Refusal> {
        assert_eq!(
            audience, AUDIENCE,
            "the service must ask for the mesh audience"
        );
        Ok(self.tokens.get(token).cloned().unwrap_or(ReviewResult {
            error: Some("invalid bearer token".into()),
            ..ReviewResult::default()
        }))
    }

    async fn pod(
        &self,
        namespace: &str,
        name: &str,
        _uid: Option<&str>,
    ) -> Result<PodState, Refusal> {
        Ok(*self
            .pods
            .get(&format!("{namespace}/{name}"))
            .unwrap_or(&PodState::Gone))
    }

    async fn refusal_event(&self, caller: &Caller, reason: &'static str, note: String) {
        self.events
            .lock()
            .unwrap()
            .push((caller.pod_name.clone(), reason, note));
    }
}

fn bound(ns: &str, sa: &str, pod: &str, audience: &str) -> ReviewResult {
    ReviewResult {
        authenticated: true,
        audiences: vec![audience.into()],
        username: format!("system:serviceaccount:{ns}:{sa}"),
        pod_name: Some(pod.into()),
        pod_uid: Some(format!("uid-{pod}")),
        error: None,
    }
}

fn fake() -> FakeCluster {
    let tokens = HashMap::from([
        ("cart-token".to_owned(), bound("shop", "cart", "cart-1", AUDIENCE)),
        // The API server refuses a token of another audience when asked for ours.
        (
            "api-audience-token".to_owned(),
            ReviewResult {
                error: Some("token audiences [\"https://kubernetes.default.svc\"] is invalid for the target audiences [\"identity.baton.dev\"]".into()),
                ..ReviewResult::default()
            },
        ),
        ("plain-token".to_owned(), bound("legacy", "web", "web-1", AUDIENCE)),
        ("front-token".to_owned(), bound("shop", "frontend", "frontend-1", AUDIENCE)),
        ("back-token".to_owned(), bound("shop", "backend", "backend-1", AUDIENCE)),
    ]);
    let pods = HashMap::from([
        ("shop/cart-1".to_owned(), PodState::Meshed),
        ("shop/frontend-1".to_owned(), PodState::Meshed),
        ("shop/backend-1".to_owned(), PodState::Meshed),
        ("legacy/web-1".to_owned(), PodState::NotMeshed),
    ]);
    FakeCluster {
        tokens,
        pods,
        events: Events::default(),
    }
}

/// A running endpoint; aborted on drop, even when a test fails.
struct Endpoint {
    addr: SocketAddr,
    dir: tempfile::TempDir,
    service: Arc<IdentityService<FakeCluster>>,
    authority: Arc<ArcSwap<Authority>>,
    serving: Arc<ServingCert>,
    events: Events,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Endpoint {
    fn url(&self) -> String {
        format!("https://127.0.0.1:{}{PATH}", self.addr.port())
    }

    fn bundle_path(&self) -> std::path::PathBuf {
        self.dir.path().join("identity-ca.pem")
    }

    /// The sidecar's client, presenting `token` and claiming `identity`.
    fn client(&self, token: &str, identity: &str, key_type: KeyType) -> IdentityClient {
        let token_path = self.dir.path().join(format!("token-{token}"));
        std::fs::write(&token_path, format!("{token}\n")).unwrap();
        IdentityClient::new(
            &self.url(),
            Some(&self.bundle_path()),
            Some(token_path),
            identity.parse().unwrap(),
            key_type,
        )
        .unwrap()
        .with_timeout(Duration::from_secs(20))
    }

    /// What the operator does when it reads an edited CA Secret: the
    /// endpoint's own certificate from the new material, then issuance.
    fn install_ca(&self, ca: &CaPem) {
        let authority = Authority::from_pem(ca, OffsetDateTime::now_utc()).unwrap();
        store_serving(&authority, &self.serving);
        self.authority.store(Arc::new(authority));
    }

    fn metrics_text(&self) -> String {
        let mut registry =
            prometheus_client::registry::Registry::with_prefix("baton_operator_identity");
        self.service.metrics().register(&mut registry);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        out
    }
}

/// The endpoint's serving certificate, issued by `authority`.
fn store_serving(authority: &Authority, serving: &ServingCert) {
    let (chain, key) = authority
        .serving_certificate(
            &["baton-identity.baton-system.svc".into()],
            &["127.0.0.1".parse().unwrap()],
            OffsetDateTime::now_utc(),
            Duration::from_secs(3600),
        )
        .unwrap();
    serving.store_pem(&chain, &key).unwrap();
}

async fn start(ca: &CaPem, policy: IssuePolicy, rate_limit: RateLimit) -> Endpoint {
    let authority = Authority::from_pem(ca, OffsetDateTime::now_utc()).unwrap();
    let serving = Arc::new(ServingCert::default());
    store_serving(&authority, &serving);
    let authority = Arc::new(ArcSwap::from_pointee(authority));
    let dir = tempfile::tempdir().unwrap();
    // What the sidecar is given as the endpoint's CA: the mesh trust bundle.
    std::fs::write(dir.path().join("identity-ca.pem"), &ca.bundle).unwrap();
    let cluster = fake();
    let events = cluster.events.clone();
    let service = Arc::new(IdentityService::new(
        cluster,
        ServiceConfig {
            trust_domain: "cluster.local".into(),
            audience: AUDIENCE.into(),
            policy,
            rate_limit,
        },
        authority.clone(),
        IdentityMetrics::default(),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(serve(
        listener,
        acceptor(serving.clone()),
        service.clone(),
        PATH,
    ));
    Endpoint {
        addr,
        dir,
        service,
        authority,
        serving,
        events,
        task,
    }
}

fn root() -> CaPem {
    generate_root(
        "cluster.local",
        OffsetDateTime::now_utc(),
        Duration::from_secs(365 * 86_400),
    )
    .unwrap()
}

fn verifies_against(chain: &str, bundle: &str) -> bool {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::new(rustls::crypto::ring::default_provider()),
    )
    .build()
    .unwrap();
    let chain: Vec<_> = CertificateDer::pem_slice_iter(chain.as_bytes())
        .map(Result::unwrap)
        .collect();
    verifier
        .verify_client_cert(&chain[0], &chain[1..], UnixTime::now())
        .is_ok()
}

fn status_of(err: IdentityClientError) -> (u16, String) {
    match err {
        IdentityClientError::Status { status, body } => (status, body),
        other => panic!("expected a refusal, got {other}"),
    }
}

/// A raw HTTPS POST (for requests the sidecar's client never sends).
async fn raw_post(
    ep: &Endpoint,
    token: Option<&str>,
    body: &str,
) -> (u16, http::HeaderMap, String) {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&std::fs::read(ep.bundle_path()).unwrap()) {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(ep.addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::post(PATH).header(http::header::HOST, "127.0.0.1");
    if let Some(t) = token {
        req = req.header(http::header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let resp = sender
        .send_request(req.body(Full::new(Bytes::from(body.to_owned()))).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

const CART: &str = "spiffe://cluster.local/ns/shop/sa/cart";

#[tokio::test]
async fn the_sidecars_client_obtains_a_certificate_for_its_service_account_that_verifies_against_the_root()
 {
    let ca = root();
    let ep = start(&ca, IssuePolicy::default(), RateLimit::default()).await;
    let material = ep
        .client("cart-token", CART, KeyType::EcdsaP256)
        .issue()
        .await
        .unwrap();
    assert_eq!(material.identity().unwrap().to_string(), CART);
    let (chain, _key, bundle) = material.to_pem();
    assert_eq!(bundle, ca.bundle);
    assert!(verifies_against(&chain, &ca.bundle));
    let metrics = ep.metrics_text();
    assert!(
        metrics.contains("baton_operator_identity_certificates_issued_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("baton_operator_identity_issuance_seconds_count 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_plug_in_intermediate_issues_chains_the_sidecar_accepts() {
    let root = root();
    let inter = generate_intermediate(
        &root,
        "baton-issuer",
        OffsetDateTime::now_utc(),
        Duration::from_secs(30 * 86_400),
    )
    .unwrap();
    let ep = start(&inter, IssuePolicy::default(), RateLimit::default()).await;
    let material = ep
        .client("cart-token", CART, KeyType::EcdsaP256)
        .issue()
        .await
        .unwrap();
    assert_eq!(material.cert_chain.len(), 2, "leaf + intermediate");
    let (chain, _, bundle) = material.to_pem();
    assert_eq!(bundle, root.bundle);
    assert!(verifies_against(&chain, &root.bundle));
}

#[tokio::test]
async fn rsa_2048_is_issued_where_allowed() {
    let ep = start(
        &root(),
        IssuePolicy {
            allow_rsa: true,
            ..IssuePolicy::default()
        },
        RateLimit::default(),
    )
    .await;
    let material = ep
        .client("cart-token", CART, KeyType::Rsa2048)
        .issue()
        .await
        .unwrap();
    assert_eq!(material.identity().unwrap().to_string(), CART);
}

#[tokio::test]
async fn a_token_for_another_audience_is_refused_with_401() {
    let ep = start(&root(), IssuePolicy::default(), RateLimit::default()).await;
    let err = ep
        .client("api-audience-token", CART, KeyType::EcdsaP256)
        .issue()
        .await
        .unwrap_err();
    let (status, body) = status_of(err);
    assert_eq!(status, 401);
    assert!(body.contains("wrong_audience"), "{body}");
    assert!(
        ep.metrics_text()
            .contains("baton_operator_identity_refusals_total{reason=\"wrong_audience\"} 1")
    );
}

#[tokio::test]
async fn a_csr_claiming_another_service_account_is_refused_and_the_pod_gets_an_event() {
    let ep = start(&root(), IssuePolicy::default(), RateLimit::default()).await;
    let err = ep
        .client(
            "cart-token",
            "spiffe://cluster.local/ns/shop/sa/payments",
            KeyType::EcdsaP256,
        )
        .issue()
        .await
        .unwrap_err();
    let (status, body) = status_of(err);
    assert_eq!(status, 403);
    assert!(body.contains("identity_mismatch"), "{body}");
    assert!(
        body.contains("sa/payments") && body.contains("sa/cart"),
        "{body}"
    );
    // The Event is published off the request path: wait for it, bounded.
    let mut events = Vec::new();
    for _ in 0..100 {
        events = ep.events.lock().unwrap().clone();
        if !events.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].0, "cart-1");
    assert_eq!(events[0].1, "IdentityMismatch");
    assert!(
        ep.metrics_text()
            .contains("baton_operator_identity_refusals_total{reason=\"identity_mismatch\"} 1")
    );
}

#[tokio::test]
async fn an_unsupported_key_type_is_refused_with_the_allowed_types() {
    let ep = start(&root(), IssuePolicy::default(), RateLimit::default()).await;
    for key_type in [KeyType::EcdsaP384, KeyType::Rsa2048] {
        let err = ep
            .client("cart-token", CART, key_type)
            .issue()
            .await
            .unwrap_err();
        let (status, body) = status_of(err);
        assert_eq!(status, 400, "{key_type:?}");
        assert!(body.contains("unsupported_key_type"), "{body}");
        assert!(body.contains("allowed: ECDSA-P256"), "{body}");
    }
}

#[tokio::test]
async fn a_csr_with_a_bad_signature_is_refused() {
    let ep = start(&root(), IssuePolicy::default(), RateLimit::default()).await;
    let client = ep.client("cart-token", CART, KeyType::EcdsaP256);
    let (_key, csr) = client.make_csr().unwrap();
    let mut der = pem::parse(&csr).unwrap().into_contents();
    let n = der.len();
    der[n - 2] ^= 0x55;
    let tampered = pem::encode(&pem::Pem::new("CERTIFICATE REQUEST", der));
    let body = serde_json::json!({ "csr": tampered }).to_string();
    let (status, _, text) = raw_post(&ep, Some("cart-token"), &body).await;
    assert_eq!(status, 400, "{text}");
    let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(parsed["reason"], "bad_signature");
}

#[tokio::test]
async fn requests_without_a_token_or_with_a_bad_body_are_refused_with_the_reason() {
    let ep = start(&root(), IssuePolicy::default(), RateLimit::default()).await;
    let (status, _, text) = raw_post(&ep, None, "{}").await;
    assert_eq!(status, 401, "{text}");
    assert!(text.contains("missing_token"), "{text}");
    let (status, _, text) = raw_post(&ep, Some("cart-token"), "not json").await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("bad_request"), "{text}");
    let (status, _, text) = raw_post(&ep, Some("forged"), "{\"csr\":\"x\"}").await;
    assert_eq!(status, 401, "{text}");
    assert!(text.contains("token_rejected"), "{text}");
}

#[tokio::test]
async fn a_pod_outside_the_mesh_is_refused() {
    let ep = start(&root(), IssuePolicy::default(), RateLimit::default()).await;
    let err = ep
        .client(
            "plain-token",
            "spiffe://cluster.local/ns/legacy/sa/web",
            KeyType::EcdsaP256,
        )
        .issue()
        .await
        .unwrap_err();
    let (status, body) = status_of(err);
    assert_eq!(status, 403);
    assert!(body.contains("pod_not_meshed"), "{body}");
}

#[tokio::test]
async fn a_looping_pod_is_throttled_with_retry_after() {
    let ep = start(
        &root(),
        IssuePolicy::default(),
        RateLimit {
            burst: 2,
            refill: Duration::from_secs(3600),
        },
    )
    .await;
    let client = ep.client("cart-token", CART, KeyType::EcdsaP256);
    client.issue().await.unwrap();
    client.issue().await.unwrap();
    let (status, body) = status_of(client.issue().await.unwrap_err());
    assert_eq!(status, 429);
    assert!(body.contains("rate_limited"), "{body}");
    let (_, csr) = client.make_csr().unwrap();
    let (status, headers, _) = raw_post(
        &ep,
        Some("cart-token"),
        &serde_json::json!({ "csr": csr }).to_string(),
    )
    .await;
    assert_eq!(status, 429);
    let retry: u64 = headers[http::header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((3000..=3600).contains(&retry), "{retry}");
    // Two throttled requests, one Event: a loop must not become API writes.
    let throttled = || {
        ep.events
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.1 == "CertificateRequestsThrottled")
            .count()
    };
    for _ in 0..100 {
        if throttled() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(throttled(), 1);
    assert!(
        ep.metrics_text()
            .contains("baton_operator_identity_refusals_total{reason=\"rate_limited\"} 2")
    );
}

/// The sidecar's TLS settings with the identity service as the source.
fn sidecar_settings(ep: &Endpoint, token: &str, sa: &str) -> TlsSettings {
    let token_path = ep.dir.path().join(format!("token-{token}"));
    std::fs::write(&token_path, format!("{token}\n")).unwrap();
    let mut s = TlsSettings::default();
    s.identity.trust_domain = "cluster.local".into();
    s.identity.local = Some(format!("spiffe://cluster.local/ns/shop/sa/{sa}"));
    s.source = Some(CertSource::IdentityService {
        url: ep.url(),
        ca_bundle: Some(ep.bundle_path()),
        token_path: Some(token_path),
        key_type: KeyType::EcdsaP256,
    });
    s
}

/// A mesh server on the sidecar's acceptor: a banner naming the client's
/// identity, then every line echoed. Aborted on drop.
struct MeshEcho {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for MeshEcho {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl MeshEcho {
    async fn start(ctx: Arc<TlsContext>) -> MeshEcho {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = ctx.acceptor();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(Accepted::Tls(s, peer)) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut s = tokio::io::BufReader::new(s);
                    let who = peer.identity.map(|i| i.to_string()).unwrap_or_default();
                    if s.get_mut()
                        .write_all(format!("{who}\n").as_bytes())
                        .await
                        .is_err()
                    {
                        return;
                    }
                    let mut line = String::new();
                    while matches!(s.read_line(&mut line).await, Ok(n) if n > 0) {
                        if s.get_mut().write_all(line.as_bytes()).await.is_err() {
                            return;
                        }
                        line.clear();
                    }
                });
            }
        });
        MeshEcho { addr, task }
    }
}

/// One mTLS connection from `client` to `server_addr`, expecting `expected`;
/// `rounds` echoes on it, `pause` apart. Returns the banner.
async fn mesh_exchange(
    client: &Arc<TlsContext>,
    server_addr: SocketAddr,
    expected: &SpiffeId,
    rounds: usize,
    pause: Duration,
) -> Result<String, String> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let work = async {
        let tcp = tokio::net::TcpStream::connect(server_addr)
            .await
            .map_err(|e| e.to_string())?;
        let (s, _) = client
            .connector()
            .connect(tcp, expected, None)
            .await
            .map_err(|e| format!("handshake: {e}: {:?}", std::error::Error::source(&e)))?;
        let mut s = tokio::io::BufReader::new(s);
        let mut banner = String::new();
        s.read_line(&mut banner).await.map_err(|e| e.to_string())?;
        for i in 0..rounds {
            let msg = format!("ping {i}\n");
            s.get_mut()
                .write_all(msg.as_bytes())
                .await
                .map_err(|e| e.to_string())?;
            let mut back = String::new();
            s.read_line(&mut back).await.map_err(|e| e.to_string())?;
            if back != msg {
                return Err(format!("echo {back:?} for {msg:?}"));
            }
            tokio::time::sleep(pause).await;
        }
        Ok(banner.trim().to_owned())
    };
    let limit = Duration::from_secs(10) + pause * u32::try_from(rounds).unwrap_or(u32::MAX);
    tokio::time::timeout(limit, work)
        .await
        .map_err(|_| "exchange timed out".to_owned())?
}

fn held(ctx: &TlsContext) -> (String, String) {
    let (chain, _key, bundle) = ctx.material().to_pem();
    (chain, bundle)
}

/// Polls `done` every 50 ms for at most `limit`.
async fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_rotation_under_continuous_mtls_traffic_fails_no_request_and_restarts_nothing() {
    // Two sidecars renew every ~2 s (3 s certificates, no backdating) from the
    // real endpoint while the frontend talks to the backend over Strict mTLS:
    // new handshakes back to back, and one connection held open throughout.
    // The CA Secret goes through the runbook's edits (docs/tls.md): trust
    // both roots, issue from the new one, drop the old one. Nothing is
    // restarted; the `ca_bundle` file the sidecars started with names only
    // the old root.
    // The sidecar's renewal errors, shown when the test fails.
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("baton_sidecar::tls::identity_client=warn")
        .try_init();
    let old = root();
    let new = root();
    let policy = IssuePolicy {
        lifetime: Duration::from_secs(3),
        backdate: Duration::ZERO,
        ..IssuePolicy::default()
    };
    let rate = RateLimit {
        burst: 100,
        refill: Duration::from_millis(100),
    };
    let ep = start(&old, policy, rate).await;
    let retry = RetryPolicy {
        attempts: 5,
        base: Duration::from_millis(50),
        max: Duration::from_millis(400),
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let front = bootstrap(
        &sidecar_settings(&ep, "front-token", "frontend"),
        TlsMetrics::default(),
        stop_rx.clone(),
        retry,
    )
    .await
    .unwrap();
    let back = bootstrap(
        &sidecar_settings(&ep, "back-token", "backend"),
        TlsMetrics::default(),
        stop_rx,
        retry,
    )
    .await
    .unwrap();
    let server = MeshEcho::start(back.clone()).await;
    let backend: SpiffeId = "spiffe://cluster.local/ns/shop/sa/backend".parse().unwrap();

    // Traffic, bounded in count and time, until `running` drops to false.
    let running = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let server_addr = server.addr;
    let short = {
        let (front, backend, running) = (front.clone(), backend.clone(), running.clone());
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0u32, Vec::new());
            for _ in 0..20_000 {
                if !running.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                match mesh_exchange(&front, server_addr, &backend, 1, Duration::ZERO).await {
                    Ok(banner) if banner == "spiffe://cluster.local/ns/shop/sa/frontend" => ok += 1,
                    Ok(banner) => failed.push(format!("server saw {banner:?}")),
                    Err(e) => failed.push(e),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (ok, failed)
        })
    };
    let long = {
        let (front, backend) = (front.clone(), backend.clone());
        // ≥ 15 s of echoes on one connection opened before the rotation.
        tokio::spawn(async move {
            mesh_exchange(
                &front,
                server_addr,
                &backend,
                300,
                Duration::from_millis(50),
            )
            .await
        })
    };

    let roots = |pem: &str| CertificateDer::pem_slice_iter(pem.as_bytes()).count();
    let both = CaPem {
        bundle: format!("{}{}", old.bundle, new.bundle),
        ..old.clone()
    };
    // 1. Trust both roots; still issue from the old one.
    ep.install_ca(&both);
    wait_for(
        "both sidecars to hold the two-root bundle",
        Duration::from_secs(15),
        || [&front, &back].iter().all(|c| roots(&held(c).1) == 2),
    )
    .await;
    // 2. Issue from the new root (the endpoint's certificate too).
    ep.install_ca(&CaPem {
        cert: new.cert.clone(),
        key: new.key.clone(),
        bundle: both.bundle.clone(),
    });
    wait_for(
        "both sidecars to hold leaves of the new root",
        Duration::from_secs(15),
        || {
            [&front, &back]
                .iter()
                .all(|c| verifies_against(&held(c).0, &new.bundle))
        },
    )
    .await;
    // 3. Drop the old root.
    ep.install_ca(&new);
    wait_for(
        "both sidecars to trust the new root only",
        Duration::from_secs(15),
        || [&front, &back].iter().all(|c| held(c).1 == new.bundle),
    )
    .await;
    // A few more renewals under the final CA.
    tokio::time::sleep(Duration::from_secs(3)).await;
    running.store(false, std::sync::atomic::Ordering::SeqCst);

    let (ok, failed) = short.await.unwrap();
    assert!(
        failed.is_empty(),
        "{} of {} exchanges failed, first: {}",
        failed.len(),
        ok as usize + failed.len(),
        failed[0]
    );
    assert!(
        ok >= 100,
        "too little traffic to prove anything: {ok} exchanges"
    );
    long.await
        .unwrap()
        .expect("the connection opened before the rotation kept working");
    // Every certificate now chains to the new root only, and nothing
    // verifies against the old one.
    for c in [&front, &back] {
        let (chain, bundle) = held(c);
        assert!(verifies_against(&chain, &new.bundle));
        assert!(!verifies_against(&chain, &old.bundle));
        assert_eq!(bundle, new.bundle);
    }
    let _ = stop_tx.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushed_trust_generation_re_issues_before_renewal_time_through_every_rotation_step() {
    // Hour-long certificates: no renewal happens in this test, so every
    // certificate after the first is the re-issue trigger's doing.
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("baton_sidecar::tls::identity_client=info")
        .try_init();
    let old = root();
    let new = root();
    let policy = IssuePolicy {
        lifetime: Duration::from_secs(3600),
        ..IssuePolicy::default()
    };
    let rate = RateLimit {
        burst: 100,
        refill: Duration::from_millis(100),
    };
    let ep = start(&old, policy, rate).await;
    let generation = |ca: &CaPem| {
        Authority::from_pem(ca, OffsetDateTime::now_utc())
            .unwrap()
            .trust_state()
            .generation
            .clone()
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (trigger, trigger_rx) = tokio::sync::watch::channel(None);
    let mut sidecars = Vec::new();
    for (token, sa) in [("front-token", "frontend"), ("back-token", "backend")] {
        let held = Arc::new(tokio::sync::watch::channel(None).0);
        let ctx = bootstrap_with(
            &sidecar_settings(&ep, token, sa),
            TlsMetrics::default(),
            stop_rx.clone(),
            RetryPolicy::default(),
            trigger_rx.clone(),
            held.clone(),
            baton_sidecar::operator_link::OperatorLink::default(),
        )
        .await
        .unwrap();
        assert_eq!(held.borrow().clone(), Some(generation(&old)), "{sa}");
        sidecars.push((ctx, held));
    }
    let roots = |pem: &str| CertificateDer::pem_slice_iter(pem.as_bytes()).count();
    let both = CaPem {
        bundle: format!("{}{}", old.bundle, new.bundle),
        ..old.clone()
    };
    let issuing_new = CaPem {
        cert: new.cert.clone(),
        key: new.key.clone(),
        bundle: both.bundle.clone(),
    };
    for (step, ca) in [
        ("1. trust both roots", &both),
        ("3. issue from the new root", &issuing_new),
        ("5. drop the old root", &new),
    ] {
        ep.install_ca(ca);
        let want = generation(ca);
        trigger.send_replace(Some(baton_config::tls::Reissue {
            generation: want.clone(),
            spread_ms: 300,
        }));
        wait_for(step, Duration::from_secs(30), || {
            sidecars
                .iter()
                .all(|(_, held)| held.borrow().as_deref() == Some(want.as_str()))
        })
        .await;
        for (ctx, _) in &sidecars {
            let (chain, bundle) = held(ctx);
            match step.as_bytes()[0] {
                b'1' => {
                    assert_eq!(roots(&bundle), 2, "{step}");
                    assert!(verifies_against(&chain, &old.bundle), "{step}");
                }
                b'3' => assert!(verifies_against(&chain, &new.bundle), "{step}"),
                _ => assert_eq!(bundle, new.bundle, "{step}"),
            }
        }
    }
    // Two first certificates, then one per sidecar per step: the trigger
    // asks once for each new generation, not in a loop.
    let metrics = ep.metrics_text();
    assert!(
        metrics.contains("baton_operator_identity_certificates_issued_total 8"),
        "{metrics}"
    );
    stop_tx.send(true).unwrap();
}
