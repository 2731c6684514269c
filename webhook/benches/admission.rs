//! Admission latency at a fixed rate against the real HTTPS server on
//! loopback (`harness = false`; run through `bench/webhook-bench.sh`).
//!
//! Open loop: requests are sent on a fixed schedule (default 200 req/s for
//! 10 s, bounded in count and time) over keep-alive connections, the way the
//! API server calls webhooks, each from its own task, so a slow answer
//! never delays the next send (no coordinated omission). The server runs on
//! its own multi-threaded runtime, the load generator on another thread. Reported next to two peers measured in the same
//! run: the same server answering 404 (the transport + TLS floor) and the
//! pure `mutate` call (the logic alone), so the numbers are read as ratios
//! on whatever machine runs them.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use baton_crds::contract::{labels, webhook as names};
use baton_webhook::{
    admin::Admin,
    ca,
    cache::{ClusterState, Snapshot, StaticState},
    handler::Admission,
    inject::{self, InjectConfig, Outcome, ServerVersion},
    metrics::{self, Metrics},
    spawn_servers,
    tls::CertStore,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::core::v1::Pod;
use rustls_pki_types::{CertificateDer, ServerName, pem::PemObject};
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn snapshot() -> Snapshot {
    let release = serde_json::from_value(json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease",
        "metadata": {"name": "default"},
        "spec": {"version": "1.0.0", "image": "baton/sidecar:1.0.0", "emptyImage": "baton/empty:1",
                 "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}},
    }))
    .unwrap();
    Snapshot {
        namespace_labels: [(labels::INJECT.to_owned(), labels::INJECT_ENABLED.to_owned())].into(),
        releases: vec![Arc::new(release)],
        server_version: Some(ServerVersion::new(1, 20)),
        // One root, the size of a real mesh bundle (copied into every Pod).
        trust_bundle: Some(
            baton_webhook::ca::generate_ca(
                time::OffsetDateTime::now_utc(),
                std::time::Duration::from_secs(86_400),
            )
            .unwrap()
            .cert
            .into(),
        ),
        ..Snapshot::default()
    }
}

/// A realistic pod from a Deployment: two containers, env, probes, volumes.
fn pod() -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Pod",
    "metadata": {"generateName": "web-6d4b75cb6d-", "namespace": "apps",
                 "labels": {"app": "web", "pod-template-hash": "6d4b75cb6d"},
                 "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-11-30T10:00:00Z"},
                 "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-6d4b75cb6d",
                                      "uid": "3d0c5b8e-2b1a-4d8e-9c67-0f9b8e3c2a11", "controller": true}]},
    "spec": {
        "containers": [
            {"name": "app", "image": "registry.local/web:1.4.2", "ports": [{"containerPort": 8080, "name": "http"}],
             "env": [{"name": "LOG_LEVEL", "value": "info"}, {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
             "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}},
             "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}},
             "volumeMounts": [{"name": "config", "mountPath": "/etc/web"}]},
            {"name": "log-shipper", "image": "registry.local/shipper:2", "args": ["--from", "/var/log/web"]},
        ],
        "volumes": [{"name": "config", "configMap": {"name": "web-config"}}],
        "serviceAccountName": "web",
    }})
}

fn review(i: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": format!("00000000-0000-0000-0000-{i:012}"),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "apps", "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod(),
        }
    }))
    .unwrap()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

struct Stats {
    p50: Duration,
    p99: Duration,
    max: Duration,
    n: usize,
}

fn stats(mut v: Vec<Duration>) -> Stats {
    v.sort();
    Stats {
        p50: percentile(&v, 0.50),
        p99: percentile(&v, 0.99),
        max: *v.last().unwrap(),
        n: v.len(),
    }
}

type Sender = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

async fn connect(addr: std::net::SocketAddr, ca_pem: &str) -> Sender {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(baton_webhook::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(
            ServerName::try_from("baton-webhook.baton-system.svc").unwrap(),
            tcp,
        )
        .await
        .unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    send
}

/// Sends `count` requests to `path` at `rate` per second over `conns`
/// connections; returns each request's latency.
async fn open_loop(
    senders: &[Sender],
    path: &'static str,
    rate: f64,
    count: u64,
    expect: u16,
) -> Vec<Duration> {
    let start = Instant::now() + Duration::from_millis(20);
    let interval = Duration::from_secs_f64(1.0 / rate);
    let mut tasks = Vec::with_capacity(count as usize);
    for i in 0..count {
        let scheduled = start + interval * u32::try_from(i).unwrap();
        tokio::time::sleep_until(scheduled.into()).await;
        let mut send = senders[i as usize % senders.len()].clone();
        let body = Bytes::from(review(i));
        tasks.push(tokio::spawn(async move {
            // Latency from the actual send: the pacer's own timer lateness
            // (tokio's 1 ms wheel) is not the server's. The client never
            // waits for the server before sending (one task per request), so
            // this does not hide server stalls.
            let sent = Instant::now();
            let req = http::Request::builder()
                .method("POST")
                .uri(format!(
                    "https://baton-webhook.baton-system.svc{path}?timeout=5s"
                ))
                .header("content-type", "application/json")
                .body(Full::new(body))
                .unwrap();
            let resp = tokio::time::timeout(Duration::from_secs(5), send.send_request(req))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(resp.status().as_u16(), expect);
            let _ = resp.into_body().collect().await.unwrap();
            sent.elapsed()
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn main() {
    // `cargo bench` passes `--bench`; this harness takes its knobs from env.
    let rate: f64 = env_or("BATON_BENCH_RATE", 200.0);
    let seconds: u64 = env_or("BATON_BENCH_SECONDS", 10).min(60);
    let conns: usize = env_or("BATON_BENCH_CONNECTIONS", 2).clamp(1, 16);
    let count = ((rate * seconds as f64) as u64).clamp(1, 20_000);
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ca = ca::generate_ca(time::OffsetDateTime::now_utc(), Duration::from_secs(3600)).unwrap();
    let stop = CancellationToken::new();
    let servers = server_rt.block_on(async {
        let cert = ca::issue_serving(
            &ca,
            &ca::service_dns_names("baton-webhook", "baton-system"),
            &[],
            time::OffsetDateTime::now_utc(),
            Duration::from_secs(3600),
        )
        .unwrap();
        let store = CertStore::new();
        store
            .store_pem(cert.cert_pem.as_bytes(), cert.key_pem.as_bytes())
            .unwrap();
        let mut registry = metrics::registry();
        let m = Arc::new(Metrics::register(&mut registry));
        let state: Arc<dyn ClusterState> = Arc::new(StaticState(snapshot()));
        let admission = Arc::new(Admission::new(
            state.clone(),
            InjectConfig::default(),
            m.clone(),
            None,
        ));
        let admin = Arc::new(Admin {
            store: store.clone(),
            state,
            registry: Arc::new(registry),
            metrics: m,
            draining: Default::default(),
        });
        spawn_servers(
            TcpListener::bind("127.0.0.1:0").await.unwrap(),
            TcpListener::bind("127.0.0.1:0").await.unwrap(),
            admission,
            admin,
            store,
            stop.clone(),
        )
        .unwrap()
    });
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    client_rt.block_on(async move {
        let mut senders = Vec::new();
        for _ in 0..conns {
            senders.push(connect(servers.addr, &ca.bundle).await);
        }
        // Warm-up (connections, allocator, caches), not measured.
        open_loop(&senders, names::MUTATE_PODS_PATH, rate, (rate as u64).min(200), 200).await;

        let mutate = stats(open_loop(&senders, names::MUTATE_PODS_PATH, rate, count, 200).await);
        let floor = stats(open_loop(&senders, "/not-found", rate, count, 404).await);

        // The pure function alone, same pod.
        let pod: Pod = serde_json::from_value(pod()).unwrap();
        let snap = snapshot();
        let mut pure = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let t = Instant::now();
            let out = inject::mutate(&pod, &snap.cluster_view(), &InjectConfig::default()).unwrap();
            assert!(matches!(out, Outcome::Injected(_)));
            pure.push(t.elapsed());
        }
        let pure = stats(pure);

        println!("baton-webhook admission latency, open loop {rate} req/s x {seconds} s over {conns} HTTP/2+TLS connections on loopback");
        println!("{:<34} {:>6} {:>10} {:>10} {:>10}", "", "n", "p50 µs", "p99 µs", "max µs");
        for (name, s) in [("POST /mutate-pods (inject)", &mutate), ("POST /not-found (404, floor)", &floor), ("mutate() alone", &pure)] {
            println!("{name:<34} {:>6} {:>10.0} {:>10.0} {:>10.0}", s.n, us(s.p50), us(s.p99), us(s.max));
        }
        println!(
            "ratio mutate/floor: p50 {:.2}x p99 {:.2}x; target p99 < 2000 µs: {}",
            us(mutate.p50) / us(floor.p50),
            us(mutate.p99) / us(floor.p99),
            if mutate.p99 < Duration::from_millis(2) { "met" } else { "NOT met" }
        );
    });
    stop.cancel();
    drop(servers);
    server_rt.shutdown_timeout(Duration::from_secs(2));
}
