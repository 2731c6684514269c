//! Config propagation (`harness = false`): a Route change → every connected
//! sidecar stream has the new config, p50/p99/max.
//!
//! ```sh
//! cargo bench -p baton-operator --bench config_push              # 100 and 1,000 streams
//! BATON_BENCH_STREAMS=100,1000,5000 cargo bench -p baton-operator --bench config_push
//! BATON_BENCH_DELTAS=0 cargo bench -p baton-operator --bench config_push   # full snapshots only
//! BATON_BENCH_TRANSPORTS=h2 cargo bench -p baton-operator --bench config_push # one transport
//! BATON_BENCH_OPERATOR_WRAP="heaptrack -o /tmp/op" cargo bench ...          # the operator profiled
//! ```
//!
//! Each size runs in both transports of the endpoint (decision 0066): the
//! framed one current sidecars speak, and HTTP/2, which sidecars from
//! before it speak; the operator's memory per stream is printed for each,
//! measured in the same run.
//!
//! The simulated sidecars declare the `delta` capability, as the real client
//! does; with `BATON_BENCH_DELTAS=0` they declare none (a sidecar from before
//! deltas), so every push is the whole snapshot: the same harness measures
//! what the deltas save.
//!
//! Two processes. The **operator** (this binary re-executed with
//! `BATON_BENCH_OPERATOR` set) runs the real hub and HTTP/2 + TLS endpoint
//! on the operator binary's runtime (multi-thread, two workers); its index
//! holds 1,000 Pods, 100 Services (two ports, 10 endpoints each) and 200
//! Routes, one of which changes per round by a line on its stdin (the
//! watcher event). TokenReview
//! and the Pod read are answered in memory (no API server), so this is the
//! operator's own cost, and its CPU seconds and RSS are read from its own
//! `/proc/<pid>`. The **load generator** (this process) opens one TLS
//! connection and HTTP/2 stream per simulated sidecar, reads every push's
//! version and nonce and answers ACK. It does not build the snapshot: a
//! real sidecar decodes and validates on its own CPU, not on the operator's
//! two cores, so that cost is measured once on a captured push and printed
//! beside the figures (`apply`), not paid 1,000 times here.
//!
//! Propagation of one stream = time from the index update (the stdin line)
//! to that stream's client having read the push, so it includes the 100 ms
//! debounce.
//!
//! Bounded: at most 10,000 streams, 5 rounds, 127.0.0.1 only, 120 s per size;
//! the operator process exits when its stdin closes.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_config::framed::{self, Kind};
use baton_config::push::{self, Decoder, Push, Reply};
use baton_operator::identity::authority::{Authority, generate_root};
use baton_operator::identity::cluster::{Cluster, PodState};
use baton_operator::identity::issue::{Caller, Refusal, ReviewResult};
use baton_operator::identity::server::ServingCert;
use baton_operator::mesh::compile::MeshParams;
use baton_operator::mesh::hub::Hub;
use baton_operator::mesh::index::Index;
use baton_operator::mesh::metrics::PushMetrics;
use baton_operator::mesh::server::{PushServer, acceptor, serve};
use baton_sidecar::config::store::ConfigStore;
use baton_sidecar::metrics::Metrics;
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

/// 1,000 Pods (at least one per stream), 100 Services with two ports and
/// 10 endpoints, 199 Routes (one per Service port, but svc-0:80, which the
/// bench's own Route takes): with it, the issue's 1,000 Pods / 100
/// Services / 200 Routes.
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
            "spec": {"clusterIP": format!("10.96.0.{}", s + 1),
                     "ports": [{"name": "http", "port": 80}, {"name": "alt", "port": 81}]}
        })));
        let endpoints: Vec<_> = (0..10)
            .map(|e| json!({"addresses": [format!("10.2.{s}.{}", e + 1)], "conditions": {"ready": true}}))
            .collect();
        index.apply_endpoint_slice(&from(json!({
            "metadata": {"name": format!("svc-{s}-1"), "namespace": "bench",
                         "labels": {"kubernetes.io/service-name": format!("svc-{s}")}},
            "addressType": "IPv4", "endpoints": endpoints,
            "ports": [{"name": "http", "port": 8080}, {"name": "alt", "port": 8081}]
        })));
        for port in [80, 81] {
            if (s, port) == (0, 80) {
                continue;
            }
            index.apply_route(&from(json!({
                "apiVersion": "baton.dev/v1alpha1", "kind": "Route",
                "metadata": {"name": format!("svc-{s}-{port}"), "namespace": "bench",
                             "generation": 1, "creationTimestamp": "2026-01-01T00:00:00Z"},
                "spec": {"parentRef": {"name": format!("svc-{s}"), "port": port},
                         "rules": [{"backendRefs": [{"name": format!("svc-{}", (s + 1) % 100), "port": port}]}]}
            })));
        }
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

/// What the load generator reads of a push: its version and nonce; the
/// config itself is skipped (see the module docs).
#[derive(serde::Deserialize)]
struct PushHead {
    version: u64,
    nonce: String,
}

/// The endpoint's transports (decision 0066).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Framed,
    H2,
}

impl Transport {
    fn alpn(self) -> &'static [u8] {
        match self {
            Transport::Framed => framed::ALPN,
            Transport::H2 => b"h2",
        }
    }
}

/// Where a simulated sidecar reports each push it read: (stream, version,
/// when read).
type Seen = mpsc::UnboundedSender<(usize, u64, Instant)>;

/// What the load generator reads of a push, and the ACK it answers with.
/// Stream 0 decodes its pushes whole and keeps them for the `apply`
/// measurement.
fn read_push(
    n: usize,
    payload: &[u8],
    sample: &Mutex<Vec<Push>>,
    seen: &Seen,
) -> Result<Reply, String> {
    let head = if n == 0 {
        let p: Push = serde_json::from_slice(payload).map_err(|e| e.to_string())?;
        let head = PushHead {
            version: p.version,
            nonce: p.nonce.clone(),
        };
        sample.lock().unwrap().push(p);
        head
    } else {
        serde_json::from_slice::<PushHead>(payload).map_err(|e| e.to_string())?
    };
    let _ = seen.send((n, head.version, Instant::now()));
    Ok(Reply::Ack {
        nonce: head.nonce,
        version: head.version,
    })
}

/// One simulated sidecar: opens its stream in `transport`, ACKs every push.
async fn sidecar(
    n: usize,
    addr: SocketAddr,
    tls: tokio_rustls::TlsConnector,
    seen: Seen,
    sample: Arc<Mutex<Vec<Push>>>,
    caps: push::Capabilities,
    transport: Transport,
) -> Result<(), String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let mut tls = tls
        .connect(ServerName::try_from(SERVER_NAME).unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    if transport == Transport::Framed {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let hello = framed::Hello {
            token: format!("pod-{n}"),
            pod: format!("bench/pod-{n}"),
            version: 0,
            capabilities: caps.header_value(),
        };
        let io = |e: std::io::Error| e.to_string();
        tls.write_all(&framed::encode_json(Kind::Hello, &hello))
            .await
            .map_err(io)?;
        tls.flush().await.map_err(io)?;
        let mut decoder = framed::FrameDecoder::new(push::MAX_FRAME);
        let mut buf = vec![0u8; 16 << 10];
        loop {
            let read = tls.read(&mut buf).await.map_err(io)?;
            if read == 0 {
                return Ok(());
            }
            decoder.extend(&buf[..read]);
            while let Some(frame) = decoder.next_frame().map_err(|e| e.to_string())? {
                let answer = match frame {
                    framed::Frame::Known(Kind::Push, payload) => {
                        let ack = read_push(n, &payload, &sample, &seen)?;
                        framed::encode_json(Kind::Reply, &ack)
                    }
                    framed::Frame::Known(Kind::Ping, _) => framed::encode(Kind::Pong, &[]),
                    framed::Frame::Known(Kind::Open, _) => continue,
                    other => return Err(format!("unexpected {other:?}")),
                };
                tls.write_all(&answer).await.map_err(io)?;
                tls.flush().await.map_err(io)?;
            }
        }
    }
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
        .header(push::CAPABILITIES_HEADER, caps.header_value())
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
        while let Some(frame) = decoder.next_frame().map_err(|e| e.to_string())? {
            let ack = read_push(n, &frame, &sample, &seen)?;
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

/// The operator process: hub + endpoint; prints its address and CA, then
/// applies `route <round>` lines from stdin until stdin closes.
fn operator(streams: usize) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
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
            default_authorization: Default::default(),
        },
        PushMetrics::default(),
    ));
    hub.update(|ix| cluster(ix, streams));
    hub.mark_synced();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let server = Arc::new(PushServer {
        hub: hub.clone(),
        cluster: InMemory,
        audience: AUDIENCE.into(),
        trust_domain: "cluster.local".into(),
        authenticating: baton_operator::mesh::server::authenticating(),
        ping_interval: baton_config::framed::PING_INTERVAL,
        sign: None,
    });
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", listener.local_addr().unwrap()).unwrap();
        write!(out, "{}", ca.bundle).unwrap();
        writeln!(out, "END").unwrap();
        out.flush().unwrap();
    }
    rt.spawn(hub.clone().run());
    rt.spawn(async move {
        let _ = tokio::time::timeout(
            Duration::from_secs(120),
            serve(listener, acceptor(serving), server),
        )
        .await;
    });
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        if let Some(round) = line.strip_prefix("route ").and_then(|r| r.parse().ok()) {
            hub.update(|ix| ix.apply_route(&route(round)));
        }
    }
    // stdin closed: the harness is done with this size.
    std::process::exit(0);
}

/// CPU seconds (user + system) and RSS / peak RSS (KiB) of a process.
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    cpu: f64,
    rss_kib: u64,
    hwm_kib: u64,
}

fn usage(pid: &str) -> Usage {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces): utime and
    // stime are the 12th and 13th, in clock ticks (USER_HZ, 100 on Linux).
    let ticks: f64 = stat
        .rsplit_once(')')
        .map(|(_, rest)| {
            let f: Vec<&str> = rest.split_whitespace().collect();
            f.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
                + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
        })
        .unwrap_or(0.0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0)
    };
    Usage {
        cpu: ticks / 100.0,
        rss_kib: field("VmRSS:"),
        hwm_kib: field("VmHWM:"),
    }
}

/// What one real sidecar spends on a push: decode it, resolve a delta onto
/// the serving snapshot, validate and swap it in through its config store.
/// Stream 0's pushes are replayed in order (so every delta meets its base;
/// a failure here fails the bench): the first (full snapshot) and the
/// median of the rest, each with its frame size.
fn apply_cost(pushes: &[Push]) -> [(usize, Duration); 2] {
    let store = ConfigStore::new(&baton_config::pod_default(), Arc::new(Metrics::new())).unwrap();
    let mut costs: Vec<(usize, Duration)> = pushes
        .iter()
        .map(|p| {
            let frame = push::encode(p);
            let t = Instant::now();
            let mut d = Decoder::default();
            d.extend(&frame);
            let p: Push = d.next_message().unwrap().unwrap();
            let snapshot = p.resolve(&store.snapshot()).unwrap();
            store.apply(&snapshot).unwrap();
            (frame.len(), t.elapsed())
        })
        .collect();
    let first = costs.remove(0);
    costs.sort_by_key(|c| c.1);
    [
        first,
        costs.get(costs.len() / 2).copied().unwrap_or_default(),
    ]
}

fn run_size(streams: usize, caps: push::Capabilities, transport: Transport) {
    // A profiler to run the operator under, e.g. `heaptrack -o /tmp/op`
    // (its RSS figures are then the wrapper's).
    let mut command = match std::env::var("BATON_BENCH_OPERATOR_WRAP") {
        Ok(wrap) if !wrap.trim().is_empty() => {
            let mut words = wrap.split_whitespace();
            let mut c = Command::new(words.next().expect("not empty"));
            c.args(words).arg(std::env::current_exe().unwrap());
            c
        }
        _ => Command::new(std::env::current_exe().unwrap()),
    };
    let mut child = command
        .env("BATON_BENCH_OPERATOR", streams.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    // The first line that is an address (a wrapper may print before it).
    let addr: SocketAddr = loop {
        line.clear();
        assert!(
            stdout.read_line(&mut line).unwrap() > 0,
            "the operator exited"
        );
        if let Ok(addr) = line.trim().parse() {
            break addr;
        }
    };
    let mut bundle = String::new();
    loop {
        line.clear();
        if stdout.read_line(&mut line).unwrap() == 0 || line.trim() == "END" {
            break;
        }
        bundle.push_str(&line);
    }
    let op_start = usage(&pid);

    // The load generator: one thread.
    let load_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![transport.alpn().to_vec()];
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config));

    let sample = Arc::new(Mutex::new(Vec::new()));
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let started = Instant::now();
    let me = usage("self");
    load_rt.block_on(async {
        // Connect in waves so the server is not handed 5,000 handshakes at
        // once.
        for n in 0..streams {
            tokio::spawn(sidecar(
                n,
                addr,
                tls.clone(),
                seen_tx.clone(),
                sample.clone(),
                caps,
                transport,
            ));
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
        // Idle: connected, nothing changing.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let op_idle = usage(&pid);
        let mut samples = Vec::with_capacity(streams * ROUNDS);
        for round in 1..=ROUNDS {
            let t0 = Instant::now();
            writeln!(stdin, "route {round}").unwrap();
            stdin.flush().unwrap();
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
        let op_end = usage(&pid);
        let me_end = usage("self");
        samples.sort();
        let [(full_bytes, full_apply), (change_bytes, change_apply)] =
            apply_cost(&sample.lock().unwrap());
        println!(
            "{transport:?} streams {streams:>5}: propagation p50 {:>7.1} ms  p99 {:>7.1} ms  max {:>7.1} ms  \
             ({} pushes; connect+first snapshot {:.1} s)",
            percentile(&samples, 0.50).as_secs_f64() * 1e3,
            percentile(&samples, 0.99).as_secs_f64() * 1e3,
            samples.last().unwrap().as_secs_f64() * 1e3,
            samples.len(),
            connect.as_secs_f64(),
        );
        println!(
            "               operator: RSS idle {:.1} MiB ({:.1} KiB per stream over its RSS \
             before they connected), peak {:.1} MiB; CPU {:.2} s connecting, \
             {:.2} s for {ROUNDS} rounds; load generator CPU {:.2} s",
            op_idle.rss_kib as f64 / 1024.0,
            (op_idle.rss_kib as f64 - op_start.rss_kib as f64) / streams as f64,
            op_end.hwm_kib as f64 / 1024.0,
            op_idle.cpu - op_start.cpu,
            op_end.cpu - op_idle.cpu,
            me_end.cpu - me.cpu,
        );
        println!(
            "               one sidecar (own CPU, not included above): first snapshot \
             {:.1} KiB applied in {:.2} ms, a change {:.1} KiB in {:.2} ms",
            full_bytes as f64 / 1024.0,
            full_apply.as_secs_f64() * 1e3,
            change_bytes as f64 / 1024.0,
            change_apply.as_secs_f64() * 1e3,
        );
    });
    drop(load_rt);
    drop(stdin);
    let _ = child.wait();
}

fn main() {
    if let Some(streams) = std::env::var("BATON_BENCH_OPERATOR")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return operator(streams);
    }
    let sizes: Vec<usize> = std::env::var("BATON_BENCH_STREAMS")
        .unwrap_or_else(|_| "100,1000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .map(|n: usize| n.clamp(1, 10_000))
        .collect();
    let transports: Vec<Transport> = std::env::var("BATON_BENCH_TRANSPORTS")
        .unwrap_or_else(|_| "framed,h2".into())
        .split(',')
        .map(|t| match t.trim() {
            "framed" => Transport::Framed,
            "h2" => Transport::H2,
            other => panic!("BATON_BENCH_TRANSPORTS: {other:?} is neither framed nor h2"),
        })
        .collect();
    let caps = match std::env::var("BATON_BENCH_DELTAS").as_deref() {
        Ok("0") => push::Capabilities::default(),
        _ => push::Capabilities::ALL,
    };
    println!(
        "config push propagation: operator in its own process (2 runtime workers), \
         {ROUNDS} Route changes per size, {}",
        if caps.delta {
            "deltas after the first ACK"
        } else {
            "full snapshots only (BATON_BENCH_DELTAS=0)"
        }
    );
    for n in sizes {
        for &transport in &transports {
            run_size(n, caps, transport);
        }
    }
}
