//! The config push end to end in one process, on loopback: the operator's
//! hub and its TLS endpoint (the framed transport and HTTP/2) (served with a certificate from the mesh
//! CA), and the sidecar's real stream client applying into a real
//! `ConfigStore`. The API server's TokenReview and Pod reads are replaced
//! by a [`Cluster`] fake, as in `identity_server.rs`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use baton_config::Snapshot;
use baton_config::framed::{self, Kind};
use baton_config::push::{self, Decoder, Push, Reply, Section};
use baton_operator::identity::authority::{Authority, generate_root};
use baton_operator::identity::cluster::{Cluster, PodState};
use baton_operator::identity::issue::IssuePolicy;
use baton_operator::identity::issue::{Caller, Refusal, ReviewResult};
use baton_operator::identity::metrics::IdentityMetrics;
use baton_operator::identity::rate_limit::RateLimit;
use baton_operator::identity::server::ServingCert;
use baton_operator::identity::service::{IdentityService, ServiceConfig};
use baton_operator::mesh::compile::MeshParams;
use baton_operator::mesh::hub::{Hub, Source};
use baton_operator::mesh::index::{Index, ObjKey};
use baton_operator::mesh::metrics::{PushMetrics, RefusalLabels, ReplyLabels};
use baton_operator::mesh::server::{PushServer, SIGN_PATH, acceptor, serve};
use baton_sidecar::config::store::ConfigStore;
use baton_sidecar::control::{self, ControlConfig};
use baton_sidecar::metrics::Metrics;
use baton_sidecar::operator_link::OperatorLink;
use baton_sidecar::tls::identity_client::{IdentityClient, IdentityClientError};
use baton_sidecar::tls::settings::KeyType;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::json;
use time::OffsetDateTime;
use tokio::sync::watch;

const AUDIENCE: &str = "identity.baton.dev";
const SERVER_NAME: &str = "baton-operator.baton-system.svc";

struct FakeCluster {
    tokens: HashMap<String, ReviewResult>,
    /// When set, every review waits for the gate to open.
    gate: Option<Arc<Gate>>,
}

/// Holds TokenReviews back and counts those waiting.
struct Gate {
    waiting: std::sync::atomic::AtomicUsize,
    open: watch::Sender<bool>,
}

impl Cluster for FakeCluster {
    async fn review(&self, token: &str, audience: &str) -> Result<ReviewResult, Refusal> {
        assert_eq!(audience, AUDIENCE);
        if let Some(gate) = &self.gate {
            use std::sync::atomic::Ordering::SeqCst;
            gate.waiting.fetch_add(1, SeqCst);
            let _ = gate.open.subscribe().wait_for(|open| *open).await;
            gate.waiting.fetch_sub(1, SeqCst);
        }
        Ok(self.tokens.get(token).cloned().unwrap_or(ReviewResult {
            error: Some("invalid bearer token".into()),
            ..ReviewResult::default()
        }))
    }

    async fn pod(&self, _: &str, name: &str, _: Option<&str>) -> Result<PodState, Refusal> {
        Ok(if name.starts_with("client") {
            PodState::Meshed
        } else {
            PodState::NotMeshed
        })
    }

    async fn refusal_event(&self, _: &Caller, _: &'static str, _: String) {}
}

fn bound(pod: &str) -> ReviewResult {
    ReviewResult {
        authenticated: true,
        audiences: vec![AUDIENCE.into()],
        username: "system:serviceaccount:shop:client".into(),
        pod_name: Some(pod.into()),
        pod_uid: None,
        error: None,
    }
}

fn from<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).unwrap()
}

fn shop(ix: &mut Index) {
    for name in ["client-1", "client-2"] {
        let pod: Pod = from(json!({
            "metadata": {"name": name, "namespace": "shop",
                         "labels": {"app": "client", "baton.dev/injected": "true"}},
            "spec": {"serviceAccountName": "client", "containers": [{"name": "app"}]},
            "status": {"podIP": "10.1.0.1"}
        }));
        ix.apply_pod(&pod);
    }
    for (name, ip, ep) in [
        ("server", "10.96.0.10", "10.1.1.1"),
        ("server-v2", "10.96.0.11", "10.1.1.2"),
    ] {
        let svc: Service = from(json!({
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80}]}
        }));
        ix.apply_service(&svc);
        let slice: EndpointSlice = from(json!({
            "metadata": {"name": format!("{name}-1"), "namespace": "shop",
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ep], "conditions": {"ready": true}}],
            "ports": [{"name": "http", "port": 8080}]
        }));
        ix.apply_endpoint_slice(&slice);
    }
}

/// A running operator endpoint; its tasks are aborted on drop.
struct Operator {
    hub: Arc<Hub>,
    addr: std::net::SocketAddr,
    dir: tempfile::TempDir,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.tasks.iter().for_each(|t| t.abort());
    }
}

async fn start_operator() -> Operator {
    start_operator_gated(None).await
}

async fn start_operator_gated(gate: Option<Arc<Gate>>) -> Operator {
    let now = OffsetDateTime::now_utc();
    let ca = generate_root("cluster.local", now, Duration::from_secs(3600)).unwrap();
    let authority = Authority::from_pem(&ca, now).unwrap();
    let (chain, key) = authority
        .serving_certificate(&[SERVER_NAME.into()], &[], now, Duration::from_secs(3600))
        .unwrap();
    let serving = Arc::new(ServingCert::default());
    serving.store_pem(&chain, &key).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ca.pem"), &ca.bundle).unwrap();

    let hub = Arc::new(Hub::new(
        MeshParams {
            trust_domain: "cluster.local".into(),
            cluster_domain: "cluster.local".into(),
            identity: None,
            default_authorization: Default::default(),
        },
        PushMetrics::default(),
    ));
    hub.update(shop);
    hub.mark_synced();
    let tokens = HashMap::from([
        ("token-1".to_owned(), bound("client-1")),
        ("token-2".to_owned(), bound("client-2")),
    ]);
    // The identity service answers certificate requests on the config
    // stream's connections, as the operator binary composes it.
    let identity = Arc::new(IdentityService::new(
        FakeCluster {
            tokens: tokens.clone(),
            gate: None,
        },
        ServiceConfig {
            trust_domain: "cluster.local".into(),
            audience: AUDIENCE.into(),
            policy: IssuePolicy::default(),
            rate_limit: RateLimit::default(),
        },
        Arc::new(ArcSwap::from_pointee(authority)),
        IdentityMetrics::default(),
    ));
    let server = Arc::new(PushServer {
        hub: hub.clone(),
        cluster: FakeCluster { tokens, gate },
        audience: AUDIENCE.into(),
        trust_domain: "cluster.local".into(),
        authenticating: baton_operator::mesh::server::authenticating(),
        ping_interval: Duration::from_millis(300),
        sign: Some(Arc::new(move |req| {
            let identity = identity.clone();
            Box::pin(async move { baton_operator::identity::server::sign(&identity, &req).await })
        })),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let tasks = vec![
        tokio::spawn(hub.clone().run()),
        tokio::spawn(async move {
            let _ = serve(listener, acceptor(serving), server).await;
        }),
    ];
    Operator {
        hub,
        addr,
        dir,
        tasks,
    }
}

/// A sidecar's store and stream client; the client stops on drop.
struct Sidecar {
    store: Arc<ConfigStore>,
    metrics: Arc<Metrics>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        self.stop.send_replace(true);
        self.task.abort();
    }
}

fn start_sidecar(op: &Operator, pod: &str, token: &str) -> Sidecar {
    start_sidecar_serving(op, pod, token, &baton_config::pod_default())
}

/// A sidecar already serving `snapshot` (what a handoff hands over).
fn start_sidecar_serving(op: &Operator, pod: &str, token: &str, snapshot: &Snapshot) -> Sidecar {
    start_sidecar_linked(op, pod, token, snapshot, OperatorLink::default())
}

/// [`start_sidecar_serving`], publishing its operator connection on `link`.
fn start_sidecar_linked(
    op: &Operator,
    pod: &str,
    token: &str,
    snapshot: &Snapshot,
    link: OperatorLink,
) -> Sidecar {
    let metrics = Arc::new(Metrics::new());
    let store = Arc::new(ConfigStore::new(snapshot, metrics.clone()).unwrap());
    let token_path = op.dir.path().join(format!("{pod}-{token}"));
    std::fs::write(&token_path, token).unwrap();
    let cfg = ControlConfig {
        address: op.addr.to_string(),
        server_name: SERVER_NAME.into(),
        ca_bundle: op.dir.path().join("ca.pem"),
        trust_state: None,
        token_path,
        pod: format!("shop/{pod}"),
        min_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(400),
    };
    let (stop, rx) = watch::channel(false);
    let task = tokio::spawn(control::run_reporting(
        cfg,
        store.clone(),
        metrics.clone(),
        rx,
        None,
        link,
    ));
    Sidecar {
        store,
        metrics,
        stop,
        task,
    }
}

/// Polls `f` every 10 ms for up to 10 s; whether it came true.
/// Polls `f` until it holds, for up to 30 s of wall time. A deadline, not a
/// count of polls: under a loaded machine (CI builds beside the tests) 1,000
/// polls of 10 ms once ran out before a TLS stream's first exchange.
async fn wait_for(mut f: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if f() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn eventually(what: &str, f: impl FnMut() -> bool) {
    assert!(wait_for(f).await, "timed out waiting for {what}");
}

fn has_route(store: &ConfigStore, name: &str) -> bool {
    has_route_in(&store.snapshot(), name)
}

fn has_route_in(snapshot: &Snapshot, name: &str) -> bool {
    snapshot.routes.iter().any(|r| r.name == name)
}

fn split_route() -> baton_crds::Route {
    from(json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "Route",
        "metadata": {"name": "split", "namespace": "shop",
                     "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"parentRef": {"name": "server", "port": 80},
                 "rules": [{"backendRefs": [{"name": "server", "port": 80, "weight": 9},
                                             {"name": "server-v2", "port": 80, "weight": 1}]}]}
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_requests_ride_on_the_config_streams_connection_while_it_is_open() {
    let op = start_operator().await;
    let link = OperatorLink::default();
    let sc = start_sidecar_linked(
        &op,
        "client-1",
        "token-1",
        &baton_config::pod_default(),
        link.clone(),
    );
    eventually("the config stream publishes its connection", || {
        link.held().is_some()
    })
    .await;
    // The identity endpoint the client is configured with: a port nothing
    // listens on, so only the held connection can answer.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let token_path = op.dir.path().join("sign-token");
    std::fs::write(&token_path, "token-1").unwrap();
    let client = IdentityClient::new(
        &format!("https://{closed}{SIGN_PATH}"),
        Some(&op.dir.path().join("ca.pem")),
        Some(token_path),
        "spiffe://cluster.local/ns/shop/sa/client".parse().unwrap(),
        KeyType::EcdsaP256,
    )
    .unwrap()
    .with_link(link.clone());
    let material = client
        .issue()
        .await
        .expect("issued over the config stream's connection");
    assert_eq!(
        material.identity().map(|i| i.to_string()).as_deref(),
        Some("spiffe://cluster.local/ns/shop/sa/client")
    );
    assert_eq!(op.hub.metrics().sign_requests.get(), 1);
    // Still one stream, one connection: the request did not disturb it.
    assert_eq!(sc.metrics.control_connected.get(), 1);

    // The stream gone, the slot is empty and the client falls back to its
    // own connection (here: refused).
    drop(sc);
    eventually("the connection is withdrawn", || link.held().is_none()).await;
    match client.issue().await {
        Err(IdentityClientError::Connect(_)) => {}
        other => panic!("want a connect error from the fallback, got {other:?}"),
    }
    assert_eq!(op.hub.metrics().sign_requests.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_gets_its_snapshot_then_every_change_and_acks_each() {
    let op = start_operator().await;
    let sc = start_sidecar(&op, "client-1", "token-1");
    // `/ready` on the in-pod default says what it waits for.
    let ready = control::readiness(sc.store.clone());
    if sc.store.version() == 0 {
        assert_eq!(
            ready(),
            Err("waiting for the first config from the operator".into())
        );
    }
    eventually("the first snapshot", || {
        has_route(&sc.store, "service:shop/server:80")
    })
    .await;
    assert_eq!(sc.store.version(), 1);
    assert_eq!(ready(), Ok(()));
    eventually("the first ACK", || {
        op.hub.sidecars().iter().any(|s| s.acked == Some(1))
    })
    .await;
    assert_eq!(sc.metrics.control_connected.get(), 1);

    // A Route applied: the sidecar gets version 2 with it, and ACKs.
    op.hub.update(|ix| ix.apply_route(&split_route()));
    eventually("the route", || has_route(&sc.store, "route:shop/split/0")).await;
    assert_eq!(sc.store.version(), 2);
    assert!(!has_route(&sc.store, "service:shop/server:80"));
    eventually("the second ACK", || {
        op.hub.sidecars().iter().any(|s| s.acked == Some(2))
    })
    .await;
    // Status counts the sidecar as serving the Route's generation.
    let split = Source::Route(ObjKey::new("shop", "split"), 0);
    let programmed = op.hub.programmed(&split);
    assert_eq!((programmed.acked, programmed.total), (1, 1));
    assert_eq!(programmed.nack, None);

    // A change that does not alter this sidecar's snapshot pushes nothing.
    let pushes = op.hub.metrics().pushes.get();
    op.hub
        .update(|ix| ix.delete_pod(&ObjKey::new("shop", "client-2")));
    tokio::time::sleep(Hub::DEBOUNCE * 3).await;
    assert_eq!(op.hub.metrics().pushes.get(), pushes);
    assert_eq!(sc.store.version(), 2);
    let acks = op
        .hub
        .metrics()
        .replies
        .get_or_create(&ReplyLabels { kind: "ack" })
        .get();
    assert_eq!(acks, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_snapshot_is_nacked_and_the_last_good_one_keeps_serving() {
    let op = start_operator().await;
    let sc = start_sidecar(&op, "client-1", "token-1");
    eventually("the first snapshot", || sc.store.version() == 1).await;
    // The sidecar's TLS layer refuses every change from now on.
    sc.store
        .set_tls_hook(Arc::new(|_| Err("no certificates here".into())));
    op.hub.update(|ix| ix.apply_route(&split_route()));
    eventually("the NACK", || {
        op.hub.sidecars().iter().any(|s| {
            s.nack
                .as_deref()
                .is_some_and(|e| e.contains("no certificates here"))
        })
    })
    .await;
    assert_eq!(sc.store.version(), 1, "the refused version never serves");
    // Status sees the refusal of the Route's generation.
    let programmed = op
        .hub
        .programmed(&Source::Route(ObjKey::new("shop", "split"), 0));
    assert_eq!((programmed.acked, programmed.total), (0, 1));
    assert!(programmed.nack.unwrap().contains("no certificates here"));
    assert!(has_route(&sc.store, "service:shop/server:80"));
    assert_eq!(
        op.hub.sidecars()[0].acked,
        Some(1),
        "the ACKed version stays the last good one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_of_connecting_sidecars_is_authenticated_a_bounded_number_at_a_time() {
    use baton_operator::mesh::server::AUTHENTICATING_AT_ONCE;
    use std::sync::atomic::Ordering::SeqCst;
    let gate = Arc::new(Gate {
        waiting: Default::default(),
        open: watch::channel(false).0,
    });
    let op = Arc::new(start_operator_gated(Some(gate.clone())).await);
    // Twice as many streams as may be authenticated at once, all opened
    // together (an operator restart: every sidecar reconnects).
    let crowd: Vec<_> = (0..2 * AUTHENTICATING_AT_ONCE)
        .map(|_| {
            let op = op.clone();
            tokio::spawn(async move {
                let body = StreamBody::new(futures::stream::pending::<
                    Result<Frame<bytes::Bytes>, std::convert::Infallible>,
                >())
                .boxed();
                open_stream(&op, "token-1", "shop/client-1", &[], body)
                    .await
                    .status()
            })
        })
        .collect();
    assert!(
        wait_for(|| gate.waiting.load(SeqCst) == AUTHENTICATING_AT_ONCE).await,
        "{} reviews waiting",
        gate.waiting.load(SeqCst)
    );
    // The rest stay queued behind the bound, however long the API is slow.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(gate.waiting.load(SeqCst), AUTHENTICATING_AT_ONCE);
    gate.open.send_replace(true);
    for stream in crowd {
        assert_eq!(stream.await.unwrap(), 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_for_another_pod_or_without_a_valid_token_are_refused_and_counted() {
    let op = start_operator().await;
    // client-2's token, claiming client-1.
    let thief = start_sidecar(&op, "client-1", "token-2");
    let forged = start_sidecar(&op, "client-1", "forged");
    let refusals = |reason: &'static str| {
        op.hub
            .metrics()
            .refusals
            .get_or_create(&RefusalLabels { reason })
            .get()
    };
    let refused = wait_for(|| {
        refusals("pod_mismatch") >= 1
            && refusals("token_rejected") >= 1
            && thief.metrics.control_reconnects.get() >= 1
    })
    .await;
    assert!(
        refused,
        "pod_mismatch {} token_rejected {} reconnects {} {}",
        refusals("pod_mismatch"),
        refusals("token_rejected"),
        thief.metrics.control_reconnects.get(),
        forged.metrics.control_reconnects.get()
    );
    assert_eq!(thief.store.version(), 0);
    assert_eq!(forged.store.version(), 0);
    assert!(op.hub.sidecars().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_keeps_its_config_without_the_operator_and_resumes_at_its_version() {
    let op = start_operator().await;
    let sc = start_sidecar(&op, "client-1", "token-1");
    op.hub.update(|ix| ix.apply_route(&split_route()));
    eventually("the route", || has_route(&sc.store, "route:shop/split/0")).await;
    let served = sc.store.snapshot();
    drop(op);
    // The operator is gone: the data plane keeps the last good config.
    eventually("the stream to drop", || {
        sc.metrics.control_connected.get() == 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sc.store.snapshot(), served);

    // A new sidecar process that inherited the snapshot (a handoff) connects
    // to a new operator: it reports the inherited version, and the operator
    // continues from there.
    let op2 = start_operator().await;
    op2.hub.update(|ix| ix.apply_route(&split_route()));
    let next = start_sidecar_serving(&op2, "client-1", "token-1", &served);
    let inherited = served.version;
    eventually("the resumed stream's ACK", || {
        op2.hub
            .sidecars()
            .iter()
            .any(|s| s.acked.is_some_and(|a| a > inherited))
    })
    .await;
    assert!(next.store.version() > inherited);
    assert!(has_route(&next.store, "route:shop/split/0"));

    // A process that inherited a pushed snapshot is Ready before its own
    // stream connects (the operator may be down during an upgrade);
    // refused streams never make a fresh one Ready.
    let orphan = start_sidecar_serving(&op2, "client-1", "wrong-token", &served);
    assert_eq!(control::readiness(orphan.store.clone())(), Ok(()));
    let fresh = start_sidecar(&op2, "client-1", "wrong-token");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(control::readiness(fresh.store.clone())().is_err());
}

/// An authenticated stream whose request body is `garbage`, over a raw
/// HTTP/2 client (the sidecar's client never sends a bad frame).
type ReplyBody = http_body_util::combinators::BoxBody<bytes::Bytes, std::convert::Infallible>;

/// A hand-driven stream: TLS and HTTP/2 to the operator as `pod` with
/// `token`, `headers` added to the request, `replies` as its body.
async fn open_stream(
    op: &Operator,
    token: &str,
    pod: &str,
    headers: &[(&str, &str)],
    replies: ReplyBody,
) -> http::Response<hyper::body::Incoming> {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, ServerName};

    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&std::fs::read(op.dir.path().join("ca.pem")).unwrap()) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(op.addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from(SERVER_NAME).unwrap(), tcp)
        .await
        .unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::post(format!("https://{SERVER_NAME}{}", push::WATCH_PATH))
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .header(push::POD_HEADER, pod);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req.body(replies).unwrap();
    sender.send_request(req).await.unwrap()
}

/// A stream that sends `garbage` as its replies. The response is returned
/// to be held: dropping it resets the stream, and a reset that reaches the
/// operator before it has read the garbage ends the stream for that reason
/// instead (one CI run under load waited 30 s for a bad frame never read).
async fn raw_stream(
    op: &Operator,
    token: &str,
    pod: &str,
    garbage: &'static [u8],
) -> http::Response<hyper::body::Incoming> {
    let body = Full::new(bytes::Bytes::from_static(garbage)).boxed();
    open_stream(op, token, pod, &[], body).await
}

/// The pushes of a hand-driven stream, decoded.
struct Pushes {
    body: hyper::body::Incoming,
    decoder: Decoder,
}

impl Pushes {
    async fn next(&mut self) -> Push {
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Some(p) = self.decoder.next_message::<Push>().unwrap() {
                    return p;
                }
                let frame = self.body.frame().await.unwrap().unwrap();
                if let Some(data) = frame.data_ref() {
                    self.decoder.extend(data);
                }
            }
        })
        .await
        .expect("a push within 10 s")
    }
}

/// A hand-driven stream for client-1 with `headers`: its pushes, and where
/// its replies go.
async fn driven_stream(
    op: &Operator,
    headers: &[(&str, &str)],
) -> (Pushes, tokio::sync::mpsc::Sender<bytes::Bytes>) {
    let (replies, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(4);
    let body = StreamBody::new(futures::stream::unfold(rx, |mut rx| async move {
        let b = rx.recv().await?;
        Some((Ok(Frame::data(b)), rx))
    }))
    .boxed();
    let resp = open_stream(op, "token-1", "shop/client-1", headers, body).await;
    assert_eq!(resp.status(), 200);
    let pushes = Pushes {
        body: resp.into_body(),
        decoder: Decoder::default(),
    };
    (pushes, replies)
}

const WITH_DELTAS: (&str, &str) = (push::CAPABILITIES_HEADER, "delta");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_after_an_ack_are_deltas_and_a_nacked_delta_is_followed_by_the_full_snapshot() {
    let op = start_operator().await;
    let (mut pushes, replies) = driven_stream(&op, &[WITH_DELTAS]).await;
    let reply = async |r: Reply| replies.send(push::encode(&r).into()).await.unwrap();
    // A sidecar from before the framed transport, still served.
    let labels = baton_operator::mesh::metrics::TransportLabels { transport: "h2" };
    assert_eq!(op.hub.metrics().opened.get_or_create(&labels).get(), 1);

    // The first push of a stream is the whole snapshot.
    let first = pushes.next().await;
    assert_eq!(
        (first.version, first.base, first.delta.is_some()),
        (1, None, false)
    );
    let serving = first.clone().resolve(&Snapshot::default()).unwrap();
    reply(Reply::Ack {
        nonce: first.nonce,
        version: 1,
    })
    .await;
    eventually("the ACK", || {
        op.hub.sidecars().iter().any(|s| s.acked == Some(1))
    })
    .await;

    // A change onto an ACKed version: only what changed, onto version 1.
    op.hub.update(|ix| ix.apply_route(&split_route()));
    let delta = pushes.next().await;
    assert_eq!((delta.version, delta.base), (2, Some(1)));
    assert!(delta.snapshot.is_none());
    let sections = &delta.delta.as_ref().unwrap().sections;
    assert!(
        sections
            .iter()
            .all(|s| matches!(s, Section::Routes(_) | Section::Clusters(_))),
        "a Route change touches routes (and clusters), nothing else: {sections:?}"
    );
    let wanted = delta.clone().resolve(&serving).unwrap();
    assert!(wanted.routes.iter().any(|r| r.name == "route:shop/split/0"));

    // Refused: the full snapshot follows, with the same config.
    reply(Reply::Nack {
        nonce: delta.nonce,
        error: "base mismatch".into(),
    })
    .await;
    let full = pushes.next().await;
    assert_eq!(
        (full.version, full.base, full.delta.is_some()),
        (3, None, false)
    );
    let mut got = full.snapshot.clone().unwrap();
    got.version = wanted.version;
    assert_eq!(got, wanted);
    reply(Reply::Ack {
        nonce: full.nonce,
        version: 3,
    })
    .await;
    eventually("the ACK of the full snapshot", || {
        op.hub
            .sidecars()
            .iter()
            .any(|s| s.acked == Some(3) && s.nack.is_none())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_declares_no_delta_capability_gets_only_full_snapshots() {
    let op = start_operator().await;
    // A sidecar from before deltas sends no capabilities header; one from
    // the future may name capabilities this operator does not know.
    for headers in [
        &[][..],
        &[(push::CAPABILITIES_HEADER, "gzip, teleport")][..],
    ] {
        let (mut pushes, replies) = driven_stream(&op, headers).await;
        let mut serving = Snapshot::default();
        for weight in 1..=3 {
            let p = pushes.next().await;
            assert_eq!((p.base, p.delta.is_some()), (None, false), "{headers:?}");
            serving = p.clone().resolve(&serving).unwrap();
            replies
                .send(
                    push::encode(&Reply::Ack {
                        nonce: p.nonce,
                        version: p.version,
                    })
                    .into(),
                )
                .await
                .unwrap();
            eventually("the ACK", || {
                op.hub.sidecars().iter().any(|s| s.acked == Some(p.version))
            })
            .await;
            let mut route = split_route();
            route.spec.rules[0].backend_refs[0].weight = weight;
            op.hub.update(|ix| ix.apply_route(&route));
        }
        assert!(has_route_in(&serving, "route:shop/split/0"));
        drop(replies);
        drop(pushes);
        eventually("the stream to close", || op.hub.sidecars().is_empty()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_stream_gets_the_full_snapshot_past_its_version_then_deltas() {
    let op = start_operator().await;
    // What a handoff's new process reports: the inherited version.
    let (mut pushes, replies) =
        driven_stream(&op, &[WITH_DELTAS, (push::VERSION_HEADER, "41")]).await;
    let first = pushes.next().await;
    assert_eq!(
        (first.version, first.base, first.snapshot.is_some()),
        (42, None, true)
    );
    let serving = first.clone().resolve(&Snapshot::default()).unwrap();
    let ack = |p: &Push| {
        push::encode(&Reply::Ack {
            nonce: p.nonce.clone(),
            version: p.version,
        })
    };
    replies.send(ack(&first).into()).await.unwrap();
    eventually("the ACK", || {
        op.hub.sidecars().iter().any(|s| s.acked == Some(42))
    })
    .await;
    op.hub.update(|ix| ix.apply_route(&split_route()));
    let delta = pushes.next().await;
    assert_eq!((delta.version, delta.base), (43, Some(42)));
    let applied = delta.resolve(&serving).unwrap();
    assert!(has_route_in(&applied, "route:shop/split/0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_reply_closes_only_that_stream() {
    let op = start_operator().await;
    let good = start_sidecar(&op, "client-1", "token-1");
    eventually("the first snapshot", || good.store.version() == 1).await;
    // client-2 authenticates, then sends a frame that is not JSON.
    let bad = raw_stream(&op, "token-2", "shop/client-2", b"\0\0\0\x03{x}").await;
    assert_eq!(bad.status(), 200, "the stream opened before the bad frame");
    eventually("the bad frame to close that stream", || {
        op.hub.metrics().bad_frames.get() == 1 && op.hub.sidecars().len() == 1
    })
    .await;
    drop(bad);
    // The well-behaved sidecar keeps getting its config.
    op.hub.update(|ix| ix.apply_route(&split_route()));
    eventually("the route", || has_route(&good.store, "route:shop/split/0")).await;
}

/// A hand-driven stream in the framed transport (what the sidecar's client
/// speaks to this operator), for what the real client never sends.
struct Framed {
    tls: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    decoder: framed::FrameDecoder,
}

impl Framed {
    async fn connect(op: &Operator) -> Framed {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, ServerName};

        let mut roots = rustls::RootCertStore::empty();
        for c in
            CertificateDer::pem_slice_iter(&std::fs::read(op.dir.path().join("ca.pem")).unwrap())
        {
            roots.add(c.unwrap()).unwrap();
        }
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        // HTTP/2 first: the operator's order decides.
        config.alpn_protocols = vec![b"h2".to_vec(), framed::ALPN.to_vec()];
        let tcp = tokio::net::TcpStream::connect(op.addr).await.unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from(SERVER_NAME).unwrap(), tcp)
            .await
            .unwrap();
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(framed::ALPN));
        Framed {
            tls,
            decoder: framed::FrameDecoder::new(push::MAX_FRAME),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.try_send(bytes).await.unwrap();
    }

    /// For bytes the operator may stop reading before their end.
    async fn try_send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        use tokio::io::AsyncWriteExt;
        self.tls.write_all(bytes).await?;
        self.tls.flush().await
    }

    async fn hello(&mut self, token: &str, pod: &str) {
        let hello = framed::Hello {
            token: token.into(),
            pod: pod.into(),
            version: 0,
            capabilities: push::Capabilities::ALL.header_value(),
        };
        self.send(&framed::encode_json(Kind::Hello, &hello)).await;
    }

    /// The next frame, `None` once the operator closed the connection.
    async fn next(&mut self) -> Option<(Kind, bytes::Bytes)> {
        use tokio::io::AsyncReadExt;
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match self.decoder.next_frame().unwrap() {
                    Some(framed::Frame::Known(kind, payload)) => return Some((kind, payload)),
                    Some(framed::Frame::Unknown(k)) => panic!("unknown kind {k}"),
                    None => {}
                }
                let mut buf = [0u8; 4096];
                match self.tls.read(&mut buf).await {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => self.decoder.extend(&buf[..n]),
                }
            }
        })
        .await
        .expect("a frame or the end within 10 s")
    }

    /// The next frame but PINGs, which are answered.
    async fn next_answering_pings(&mut self) -> Option<(Kind, bytes::Bytes)> {
        loop {
            match self.next().await {
                Some((Kind::Ping, _)) => self.send(&framed::encode(Kind::Pong, &[])).await,
                other => return other,
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_framed_stream_opens_gets_pushes_acks_them_and_signs_on_the_same_connection() {
    let op = start_operator().await;
    let mut stream = Framed::connect(&op).await;
    stream.hello("token-1", "shop/client-1").await;
    assert_eq!(stream.next().await.map(|f| f.0), Some(Kind::Open));
    let (kind, payload) = stream.next_answering_pings().await.unwrap();
    assert_eq!(kind, Kind::Push);
    let first: Push = framed::json("PUSH", &payload).unwrap();
    assert_eq!((first.version, first.snapshot.is_some()), (1, true));
    let ack = Reply::Ack {
        nonce: first.nonce,
        version: first.version,
    };
    stream.send(&framed::encode_json(Kind::Reply, &ack)).await;
    eventually("the ACK to be counted", || {
        op.hub.sidecars().iter().any(|s| s.acked == Some(1))
    })
    .await;

    // A change: a delta onto the ACKed version (the stream declared it).
    op.hub.update(|ix| ix.apply_route(&split_route()));
    let (kind, payload) = stream.next_answering_pings().await.unwrap();
    assert_eq!(kind, Kind::Push);
    let change: Push = framed::json("PUSH", &payload).unwrap();
    assert_eq!((change.version, change.base), (2, Some(1)));

    // A certificate request on the same connection reaches the identity
    // service, which refuses this body: its answer comes back by id.
    let sign = framed::Sign {
        id: 41,
        token: "token-1".into(),
        request: bytes::Bytes::from_static(b"{\"csr\":\"not a csr\"}"),
    };
    stream.send(&sign.encode()).await;
    let (kind, payload) = stream.next_answering_pings().await.unwrap();
    assert_eq!(kind, Kind::Signed);
    let signed = framed::Signed::decode(payload).unwrap();
    assert_eq!((signed.id, signed.status), (41, 400), "{signed:?}");
    assert_eq!(op.hub.metrics().sign_requests.get(), 1);
    let opened = |transport| {
        let labels = baton_operator::mesh::metrics::TransportLabels { transport };
        op.hub.metrics().opened.get_or_create(&labels).get()
    };
    assert_eq!((opened("framed"), opened("h2")), (1, 0));
    // The stream lives on through pings it answers (300 ms apart here).
    let answering = tokio::time::timeout(Duration::from_millis(1000), async {
        stream.next_answering_pings().await
    });
    assert!(answering.await.is_err(), "nothing but pings was sent");
    assert_eq!(op.hub.sidecars().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_framed_stream_is_refused_with_a_reason_for_a_bad_token_or_a_bad_hello() {
    let op = start_operator().await;
    let refusals = |reason: &'static str| {
        op.hub
            .metrics()
            .refusals
            .get_or_create(&RefusalLabels { reason })
            .get()
    };
    let refused = async |stream: &mut Framed| {
        let (kind, payload) = stream.next().await.expect("a REFUSED frame");
        assert_eq!(kind, Kind::Refused);
        let refused: framed::Refused = framed::json("REFUSED", &payload).unwrap();
        assert_eq!(stream.next().await, None, "closed after the refusal");
        refused
    };

    let mut forged = Framed::connect(&op).await;
    forged.hello("forged", "shop/client-1").await;
    let r = refused(&mut forged).await;
    assert_eq!(
        (r.status, r.reason.as_str()),
        (401, "token_rejected"),
        "{r:?}"
    );

    let mut thief = Framed::connect(&op).await;
    thief.hello("token-2", "shop/client-1").await;
    let r = refused(&mut thief).await;
    assert_eq!(
        (r.status, r.reason.as_str()),
        (403, "pod_mismatch"),
        "{r:?}"
    );

    // Anything but a HELLO first, or a HELLO larger than a HELLO can be.
    let mut rude = Framed::connect(&op).await;
    rude.send(&framed::encode(Kind::Pong, &[])).await;
    assert_eq!(refused(&mut rude).await.reason, "bad_hello");
    let mut huge = Framed::connect(&op).await;
    // Refused from its length alone: the rest may meet a closed connection.
    let _ = huge
        .try_send(&framed::encode(Kind::Hello, &vec![b' '; framed::MAX_HELLO]))
        .await;
    assert_eq!(refused(&mut huge).await.reason, "bad_hello");

    assert_eq!(refusals("token_rejected"), 1);
    assert_eq!(refusals("pod_mismatch"), 1);
    assert_eq!(refusals("bad_hello"), 2);
    assert!(op.hub.sidecars().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_framed_stream_ends_on_a_malformed_reply_or_when_it_stops_answering_pings() {
    let op = start_operator().await;
    let good = start_sidecar(&op, "client-1", "token-1");
    eventually("the first snapshot", || good.store.version() == 1).await;

    let mut bad = Framed::connect(&op).await;
    bad.hello("token-2", "shop/client-2").await;
    assert_eq!(bad.next().await.map(|f| f.0), Some(Kind::Open));
    bad.send(&framed::encode(Kind::Reply, b"{x}")).await;
    eventually("the bad frame to close that stream", || {
        op.hub.metrics().bad_frames.get() == 1 && op.hub.sidecars().len() == 1
    })
    .await;

    // A sidecar that reads but never answers: gone after one ping interval
    // of silence (300 ms here).
    let mut mute = Framed::connect(&op).await;
    mute.hello("token-2", "shop/client-2").await;
    assert_eq!(mute.next().await.map(|f| f.0), Some(Kind::Open));
    eventually("the mute stream to open", || op.hub.sidecars().len() == 2).await;
    let mut pings = 0;
    while let Some((kind, _)) = mute.next().await {
        pings += usize::from(kind == Kind::Ping);
    }
    assert!(pings >= 1, "pinged before being dropped");
    eventually("the mute stream to be dropped", || {
        op.hub.sidecars().len() == 1
    })
    .await;

    // The real sidecar answers its pings and keeps getting its config.
    op.hub.update(|ix| ix.apply_route(&split_route()));
    eventually("the route", || has_route(&good.store, "route:shop/split/0")).await;
    assert_eq!(good.metrics.control_reconnects.get(), 0);
}
