//! Certificate issuance throughput and latency (`harness = false`):
//!
//! ```sh
//! cargo bench -p baton-operator --bench identity
//! BATON_BENCH_CSRS=2000 cargo bench -p baton-operator --bench identity
//! ```
//!
//! Three figures, measured in the same run so they read as ratios on any
//! machine:
//! 1. **peer**: raw ECDSA P-256 signatures per second on one thread (ring,
//!    through rcgen's `SigningKey`, the same code that signs certificates);
//! 2. **pure issuance** on one thread: CSR parse + key check + signature
//!    verification + SAN check + certificate build and signature, for a
//!    burst of pre-generated CSRs; reported as certificates/s and as a
//!    ratio to (1);
//! 3. **server burst**: the HTTPS endpoint on a one-thread runtime (one
//!    core), every CSR of the burst sent at once, each on its own TLS
//!    connection from a load generator on another thread: wall time,
//!    certificates/s, client-observed latency p50/p99/max (TLS handshake
//!    included), and the process's RSS before and at peak (load generator
//!    included). TokenReview and the Pod read are answered in memory (no
//!    API server), so this is the operator's own cost.
//!
//! Bounded: at most `BATON_BENCH_CSRS` (default 1,000, capped at 10,000)
//! requests, on 127.0.0.1 only, 120 s timeout.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use baton_operator::identity::authority::{Authority, generate_root};
use baton_operator::identity::cluster::{Cluster, PodState};
use baton_operator::identity::issue::{
    Caller, Identity, IssuePolicy, Refusal, ReviewResult, build_certificate, check_csr,
};
use baton_operator::identity::metrics::IdentityMetrics;
use baton_operator::identity::rate_limit::RateLimit;
use baton_operator::identity::server::{ServingCert, acceptor, serve};
use baton_operator::identity::service::{IdentityService, ServiceConfig};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rcgen::SigningKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use time::OffsetDateTime;

const AUDIENCE: &str = "identity.baton.dev";

/// Every token `t<i>` is bound to Pod `p<i>` of ServiceAccount bench/load.
struct InMemory;

impl Cluster for InMemory {
    async fn review(&self, token: &str, _audience: &str) -> Result<ReviewResult, Refusal> {
        Ok(ReviewResult {
            authenticated: true,
            audiences: vec![AUDIENCE.into()],
            username: "system:serviceaccount:bench:load".into(),
            pod_name: Some(token.replacen('t', "p", 1)),
            pod_uid: Some(token.to_owned()),
            error: None,
        })
    }
    async fn pod(&self, _: &str, _: &str, _: Option<&str>) -> Result<PodState, Refusal> {
        Ok(PodState::Meshed)
    }
    async fn refusal_event(&self, _: &Caller, _: &'static str, _: String) {}
}

fn identity() -> Identity {
    Identity {
        trust_domain: "cluster.local".into(),
        namespace: "bench".into(),
        service_account: "load".into(),
    }
}

fn csrs(n: usize) -> Vec<String> {
    let uri = identity().to_string();
    (0..n)
        .map(|_| {
            let kp = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::default();
            params.subject_alt_names = vec![rcgen::SanType::URI(uri.clone().try_into().unwrap())];
            params.serialize_request(&kp).unwrap().pem().unwrap()
        })
        .collect()
}

fn proc_status(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    text.lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn post(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    token: String,
    body: Bytes,
) -> Result<Duration, String> {
    let start = Instant::now();
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = http::Request::post("/v1/sign")
        .header(http::header::HOST, "127.0.0.1")
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Full::new(body))
        .unwrap();
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    if status != 200 {
        return Err(format!("{status}: {}", String::from_utf8_lossy(&body)));
    }
    Ok(start.elapsed())
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let n: usize = std::env::var("BATON_BENCH_CSRS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
        .clamp(1, 10_000);
    let now = OffsetDateTime::now_utc();
    let ca = generate_root("cluster.local", now, Duration::from_secs(86_400 * 365)).unwrap();
    let authority = Authority::from_pem(&ca, now).unwrap();
    let policy = IssuePolicy::default();
    let me = identity();
    println!("identity issuance benchmark: {n} CSRs (ECDSA P-256), one core per phase");

    // 1. Peer: raw P-256 signatures on this thread, over a message of a
    //    leaf certificate's TBS size.
    let key = rcgen::KeyPair::generate().unwrap();
    let msg = vec![0x5a_u8; 400];
    let signs = (n * 4).max(2000);
    let t = Instant::now();
    for _ in 0..signs {
        std::hint::black_box(key.sign(&msg).unwrap());
    }
    let sign_rate = signs as f64 / t.elapsed().as_secs_f64();
    println!("peer   raw ECDSA P-256 sign:      {sign_rate:>9.0} signatures/s");

    // 2. Pure issuance on one thread.
    let pems = csrs(n);
    let t = Instant::now();
    for pem in &pems {
        let checked = check_csr(pem, &me, &policy).unwrap();
        std::hint::black_box(
            build_certificate(&checked, &me, &authority, &policy, now, rand::random()).unwrap(),
        );
    }
    let pure_rate = n as f64 / t.elapsed().as_secs_f64();
    println!(
        "pure   check + build + sign:      {pure_rate:>9.0} certificates/s  ({:.2} x the raw signing rate)",
        pure_rate / sign_rate
    );

    // 3. The HTTPS server on a one-thread runtime, the burst from another.
    let serving = Arc::new(ServingCert::default());
    let (chain, skey) = authority
        .serving_certificate(
            &[],
            &["127.0.0.1".parse().unwrap()],
            now,
            Duration::from_secs(3600),
        )
        .unwrap();
    serving.store_pem(&chain, &skey).unwrap();
    let service = Arc::new(IdentityService::new(
        InMemory,
        ServiceConfig {
            trust_domain: "cluster.local".into(),
            audience: AUDIENCE.into(),
            policy: policy.clone(),
            rate_limit: RateLimit::default(),
        },
        Arc::new(ArcSwap::from_pointee(authority)),
        IdentityMetrics::default(),
    ));
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    std_listener.set_nonblocking(true).unwrap();
    let addr = std_listener.local_addr().unwrap();
    let server_service = service.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(std_listener).unwrap();
            tokio::select! {
                r = serve(listener, acceptor(serving), server_service, "/v1/sign") => { r.unwrap(); }
                _ = stop_rx => {}
            }
        });
    });

    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca.bundle.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let client_config = Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth(),
    );
    let bodies: Vec<Bytes> = pems
        .iter()
        .map(|csr| Bytes::from(serde_json::json!({ "csr": csr }).to_string()))
        .collect();
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let rss_before = proc_status("VmRSS:").unwrap_or(0);
    // Reset the peak-RSS mark so VmHWM reports the burst's peak.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let t = Instant::now();
    let results = client_rt.block_on(async {
        let tasks: Vec<_> = bodies
            .into_iter()
            .enumerate()
            .map(|(i, body)| tokio::spawn(post(addr, client_config.clone(), format!("t{i}"), body)))
            .collect();
        let mut out = Vec::with_capacity(tasks.len());
        let deadline = Instant::now() + Duration::from_secs(120);
        for task in tasks {
            let left = deadline.saturating_duration_since(Instant::now());
            out.push(match tokio::time::timeout(left, task).await {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("timed out".into()),
            });
        }
        out
    });
    let wall = t.elapsed();
    let rss_peak = proc_status("VmHWM:").unwrap_or(0);
    let _ = stop_tx.send(());
    server.join().unwrap();

    let mut latencies: Vec<Duration> = results
        .iter()
        .filter_map(|r| r.as_ref().ok().copied())
        .collect();
    let failures: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    latencies.sort();
    if let Some(f) = failures.first() {
        println!(
            "server FAILED {} of {n} requests; first: {f}",
            failures.len()
        );
    }
    if latencies.is_empty() {
        std::process::exit(1);
    }
    let served = latencies.len() as f64 / wall.as_secs_f64();
    println!(
        "server burst of {n} concurrent CSRs: {:>6.0} certificates/s ({:.2} x raw signing), wall {:.0} ms",
        served,
        served / sign_rate,
        wall.as_secs_f64() * 1000.0
    );
    println!(
        "server latency (connect + TLS + issue): p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms",
        percentile(&latencies, 0.50).as_secs_f64() * 1000.0,
        percentile(&latencies, 0.99).as_secs_f64() * 1000.0,
        latencies.last().unwrap().as_secs_f64() * 1000.0
    );
    println!(
        "process RSS: {:.1} MiB before the burst, {:.1} MiB peak during it (server + load generator)",
        rss_before as f64 / 1024.0,
        rss_peak as f64 / 1024.0
    );
    let text = {
        let mut registry = prometheus_client::registry::Registry::default();
        service.metrics().register(&mut registry);
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &registry).unwrap();
        s
    };
    let issued = text
        .lines()
        .find(|l| l.starts_with("certificates_issued_total"))
        .unwrap_or("certificates_issued_total ?");
    println!("server metrics: {issued}");
    if !failures.is_empty() {
        std::process::exit(1);
    }
}
