//! Config propagation (`harness = false`): a Route change → every connected
//! sidecar stream has the new snapshot, p50/p99/max.
//!
//! ```sh
//! cargo bench -p baton-operator --bench config_push              # 100 and 1,000 streams
//! BATON_BENCH_STREAMS=100,1000,5000 cargo bench -p baton-operator --bench config_push
//! ```
//!
//! The operator's real hub and HTTP/2 + TLS endpoint run in this process on
//! a one-thread runtime (one core); each simulated sidecar is its own TLS
//! connection and HTTP/2 stream from a load generator on another runtime,
//! decoding every push and answering ACK. The index holds 1,000 Pods, 100
//! Services (each with 10 endpoints) and one Route per round; TokenReview
//! and the Pod read are answered in memory (no API server), so this is the
//! operator's own cost. Propagation of one stream = time from the index
//! update (the watcher event) to that stream's client decoding the push,
//! so it includes the 100 ms debounce. Also printed: the process's RSS
//! (load generator included) after the streams are connected.
//!
//! Bounded: at most 10,000 streams, 5 rounds, 127.0.0.1 only, 120 s per size.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_config::push::{self, Decoder, Push, Reply};
use baton_operator::identity::authority::{Authority, generate_root};
use baton_operator::identity::cluster::{Cluster, PodState};
use baton_operator::identity::issue::{Caller, Refusal, ReviewResult};
use baton_operator::identity::server::{ServingCert, acceptor};
use baton_operator::mesh::compile::MeshParams;
use baton_operator::mesh::hub::Hub;
use baton_operator::mesh::index::Index;
use baton_operator::mesh::metrics::PushMetrics;
use baton_operator::mesh::server::{PushServer, serve};
use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::json;
use time::OffsetDateTime;
use tokio::sync::mpsc;

const AUDIENCE: &str = "identity.baton.dev";
const SERVER_NAME: &str = "baton-identity.baton-system.svc";
const ROUNDS: usize = 5;

/// Every `pod-<n>` token is bound to Pod `bench/pod-<n>`.
struct InMemory;

impl Cluster for InMemory {
    async fn review(&self, token: &str, _: &str) -> Result<ReviewResult, Refusal> {
        Ok(ReviewResult {
            authenticated: true,
            audiences: vec![AUDIENCE.into()],
            username: "system:serviceaccount:bench:app".into(),
            pod_name: Some(token.to_owned()),
            pod_uid: None,
            error: None,
        })
    }
    async fn pod(&self, _: &str, _: &str, _: Option<&str>) -> Result<PodState, Refusal> {
        Ok(PodState::Meshed)
    }
    async fn refusal_event(&self, _: &Caller, _: &'static str, _: String) {}
}

fn from<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).unwrap()
}

/// 1,000 Pods (at least one per stream), 100 Services with 10 endpoints.
fn cluster(index: &mut Index, pods: usize) {
    for p in 0..pods.max(1000) {
        index.apply_pod(&from(json!({
            "metadata": {"name": format!("pod-{p}"), "namespace": "bench",
                         "labels": {"app": format!("app-{}", p % 100), "baton.dev/injected": "true"}},
            "spec": {"serviceAccountName": "app", "containers": [{"name": "app"}]},
            "status": {"podIP": format!("10.1.{}.{}", p / 250, p % 250 + 1)}
        })));
    }
    for s in 0..100 {
        index.apply_service(&from(json!({
            "metadata": {"name": format!("svc-{s}"), "namespace": "bench"},
            "spec": {"clusterIP": format!("10.96.0.{}", s + 1), "ports": [{"name": "http", "port": 80}]}
        })));
        let endpoints: Vec<_> = (0..10)
            .map(|e| json!({"addresses": [format!("10.2.{s}.{}", e + 1)], "conditions": {"ready": true}}))
            .collect();
        index.apply_endpoint_slice(&from(json!({
            "metadata": {"name": format!("svc-{s}-1"), "namespace": "bench",
                         "labels": {"kubernetes.io/service-name": format!("svc-{s}")}},
            "addressType": "IPv4", "endpoints": endpoints,
            "ports": [{"name": "http", "port": 8080}]
        })));
    }
}

fn route(round: usize) -> baton_crds::Route {
    from(json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "Route",
        "metadata": {"name": "split", "namespace": "bench", "generation": round,
                     "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"parentRef": {"name": "svc-0", "port": 80},
                 "rules": [{"backendRefs": [{"name": "svc-1", "port": 80, "weight": 100 - round},
                                             {"name": "svc-2", "port": 80, "weight": round}]}]}
    }))
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// One simulated sidecar: opens its stream, ACKs every push, reports
/// (stream, version, when decoded).
async fn sidecar(
    n: usize,
    addr: SocketAddr,
    tls: tokio_rustls::TlsConnector,
    seen: mpsc::UnboundedSender<(usize, u64, Instant)>,
) -> Result<(), String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let tls = tls
        .connect(ServerName::try_from(SERVER_NAME).unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let (replies, rx) = mpsc::channel::<Bytes>(4);
    let body = StreamBody::new(Box::pin(futures::stream::unfold(rx, |mut rx| async move {
        let b = rx.recv().await?;
        Some((Ok::<_, std::convert::Infallible>(Frame::data(b)), rx))
    })));
    let req = http::Request::post(format!("https://{SERVER_NAME}{}", push::WATCH_PATH))
        .header(http::header::AUTHORIZATION, format!("Bearer pod-{n}"))
        .header(push::POD_HEADER, format!("bench/pod-{n}"))
        .body(body)
        .unwrap();
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let mut body = resp.into_body();
    let mut decoder = Decoder::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| e.to_string())?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        decoder.extend(data);
        while let Some(p) = decoder.next_message::<Push>().map_err(|e| e.to_string())? {
            let _ = seen.send((n, p.version, Instant::now()));
            let ack = Reply::Ack {
                nonce: p.nonce,
                version: p.version,
            };
            if replies.send(Bytes::from(push::encode(&ack))).await.is_err() {
                return Ok(());
            }
        }
    }
    Ok(())
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

fn run_size(streams: usize) {
    // The operator: one core.
    let op_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // The load generator: its own thread(s).
    let load_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let now = OffsetDateTime::now_utc();
    let ca = generate_root("cluster.local", now, Duration::from_secs(3600)).unwrap();
    let authority = Authority::from_pem(&ca, now).unwrap();
    let (chain, key) = authority
        .serving_certificate(&[SERVER_NAME.into()], &[], now, Duration::from_secs(3600))
        .unwrap();
    let serving = Arc::new(ServingCert::default());
    serving.store_pem(&chain, &key).unwrap();

    let hub = Arc::new(Hub::new(
        MeshParams {
            trust_domain: "cluster.local".into(),
            cluster_domain: "cluster.local".into(),
            identity: None,
        },
        PushMetrics::default(),
    ));
    hub.update(|ix| cluster(ix, streams));
    hub.mark_synced();
    let listener = op_rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let server = Arc::new(PushServer {
        hub: hub.clone(),
        cluster: InMemory,
        audience: AUDIENCE.into(),
        trust_domain: "cluster.local".into(),
    });
    let op_thread = {
        let hub = hub.clone();
        std::thread::spawn(move || {
            op_rt.block_on(async move {
                tokio::spawn(hub.run());
                let _ = tokio::time::timeout(
                    Duration::from_secs(120),
                    serve(listener, acceptor(serving), server),
                )
                .await;
            })
        })
    };

    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca.bundle.as_bytes()) {
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
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config));

    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let started = Instant::now();
    load_rt.block_on(async {
        // Connect in waves so the one-core server is not handed 5,000
        // handshakes at once.
        for n in 0..streams {
            tokio::spawn(sidecar(n, addr, tls.clone(), seen_tx.clone()));
            if n % 200 == 199 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // Everyone has version 1 (the initial snapshot).
        let mut versions: HashMap<usize, u64> = HashMap::new();
        let deadline = Instant::now() + Duration::from_secs(120);
        while versions.len() < streams && Instant::now() < deadline {
            if let Ok(Some((n, v, _))) =
                tokio::time::timeout(Duration::from_secs(5), seen.recv()).await
            {
                versions.insert(n, v);
            }
        }
        assert_eq!(
            versions.len(),
            streams,
            "every stream got its first snapshot"
        );
        let connect = started.elapsed();
        let rss = rss_kib();
        let mut samples = Vec::with_capacity(streams * ROUNDS);
        for round in 1..=ROUNDS {
            let t0 = Instant::now();
            hub.update(|ix| ix.apply_route(&route(round)));
            let mut got = 0;
            while got < streams && t0.elapsed() < Duration::from_secs(60) {
                if let Ok(Some((_, v, at))) =
                    tokio::time::timeout(Duration::from_secs(5), seen.recv()).await
                    && v as usize == round + 1
                {
                    samples.push(at - t0);
                    got += 1;
                }
            }
            assert_eq!(got, streams, "round {round}: every stream got the change");
        }
        samples.sort();
        println!(
            "streams {streams:>5}: propagation p50 {:>7.1} ms  p99 {:>7.1} ms  max {:>7.1} ms  \
             ({} pushes; connect+first snapshot {:.1} s; RSS {} MiB)",
            percentile(&samples, 0.50).as_secs_f64() * 1e3,
            percentile(&samples, 0.99).as_secs_f64() * 1e3,
            samples.last().unwrap().as_secs_f64() * 1e3,
            samples.len(),
            connect.as_secs_f64(),
            rss / 1024,
        );
    });
    drop(load_rt);
    // The server's 120 s timeout ends its thread; do not wait for it.
    drop(op_thread);
}

fn main() {
    let sizes: Vec<usize> = std::env::var("BATON_BENCH_STREAMS")
        .unwrap_or_else(|_| "100,1000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .map(|n: usize| n.clamp(1, 10_000))
        .collect();
    println!("config push propagation: operator on one core, {ROUNDS} Route changes per size");
    for n in sizes {
        run_size(n);
    }
}
