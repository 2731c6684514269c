//! Certificate issuance throughput and latency (`harness = false`):
//!
//! ```sh
//! cargo bench -p baton-operator --bench identity
//! BATON_BENCH_CSRS=2000 cargo bench -p baton-operator --bench identity
//! ```
//!
//! Figures measured in the same run so they read as ratios on any machine:
//! 1. **peers**: raw ECDSA P-256 signatures per second on one thread (ring,
//!    through rcgen's `SigningKey`, the same code that signs certificates),
//!    and the CSR check alone (parse + signature verification + SAN check);
//! 2. **pure issuance** on one thread: CSR check + certificate build and
//!    signature, for a burst of pre-generated CSRs; certificates/s and the
//!    ratio to (1);
//! 3. **served**, the HTTPS endpoint on a one-thread runtime (one core), the
//!    load generator on another thread, four bursts of `BATON_BENCH_CSRS`
//!    requests all sent at once:
//!    - *handshakes, stock rustls* (the peer for the endpoint's TLS
//!      settings): each on a new TLS connection, a request that issues
//!      nothing (404), served with rustls's default server settings;
//!    - *handshakes only*: the same with the endpoint's own acceptor — its
//!      TLS cost alone;
//!    - *new connection per CSR* (what a fleet of sidecars does: each
//!      renews once per ~16 h, so nothing is reused);
//!    - *one HTTP/2 connection* carrying every CSR — issuance through the
//!      server without any handshake;
//!    - *held connections* (decision 0056): one HTTP/2 connection per
//!      simulated sidecar, opened before the measurement (as a sidecar holds
//!      its config stream's connection), then one CSR on each, all at once
//!      and then paced at `BATON_BENCH_RATE` per second (default 3,000):
//!      the server's CPU counted from the moment every connection is open,
//!      so the handshakes are not in it, and the CSR latency measured by
//!      the client under that load;
//!    - *held framed streams* (decision 0066): the same on the config push
//!      endpoint's framed transport, what current sidecars hold: each
//!      stream authenticated (HELLO, OPEN) before the measurement, then one
//!      SIGN frame per stream, answered by SIGNED.
//!
//!    For each: wall time and certificates/s as the client sees them,
//!    client latency p50/p99/max, and the **server thread's own CPU time**
//!    (`/proc/thread-self/schedstat`) → requests per CPU-second, i.e. per
//!    core, which does not depend on how much CPU the load generator (or
//!    anyone else on the machine) takes. Process RSS before and at peak
//!    (load generator included).
//!
//! TokenReview and the Pod read are answered in memory (no API server), so
//! this is the operator's own cost. Bounded: at most `BATON_BENCH_CSRS`
//! (default 1,000, capped at 10,000) requests per burst, on 127.0.0.1 only,
//! 120 s timeout per burst.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use baton_config::framed::{self, FrameDecoder, Kind};
use baton_operator::identity::authority::{Authority, generate_root};
use baton_operator::identity::cluster::{Cluster, PodState};
use baton_operator::identity::issue::{
    Caller, Identity, IssuePolicy, Refusal, ReviewResult, build_certificate, check_csr,
};
use baton_operator::identity::metrics::IdentityMetrics;
use baton_operator::identity::rate_limit::RateLimit;
use baton_operator::identity::server::{ServingCert, acceptor, serve};
use baton_operator::identity::service::{IdentityService, ServiceConfig};
use baton_operator::mesh::compile::MeshParams;
use baton_operator::mesh::hub::Hub;
use baton_operator::mesh::metrics::PushMetrics;
use baton_operator::mesh::server::{PushServer, acceptor as push_acceptor, serve as push_serve};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::SigningKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// Nanoseconds this thread has spent on a CPU (Linux schedstat).
fn thread_cpu_ns() -> u64 {
    cpu_ns_of(std::path::Path::new("/proc/thread-self"))
}

/// Nanoseconds the thread whose `/proc/<pid>/task/<tid>` is `task` has
/// spent on a CPU, read from any thread.
fn cpu_ns_of(task: &std::path::Path) -> u64 {
    std::fs::read_to_string(task.join("schedstat"))
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn request(path: &str, token: &str, body: Bytes) -> http::Request<Full<Bytes>> {
    http::Request::post(path)
        .header(http::header::HOST, "127.0.0.1")
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Full::new(body))
        .unwrap()
}

async fn tls_connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    tokio_rustls::TlsConnector::from(config)
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())
}

async fn read_answer(
    resp: http::Response<hyper::body::Incoming>,
    want: http::StatusCode,
) -> Result<(), String> {
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    if status != want {
        return Err(format!("{status}: {}", String::from_utf8_lossy(&body)));
    }
    Ok(())
}

/// One request on its own new TLS connection (HTTP/1.1).
async fn post_new_connection(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    req: http::Request<Full<Bytes>>,
    want: http::StatusCode,
) -> Result<Duration, String> {
    let start = Instant::now();
    let tls = tls_connect(addr, config).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    read_answer(resp, want).await?;
    Ok(start.elapsed())
}

/// How a burst reaches the server.
#[derive(Clone, Copy, PartialEq)]
enum Burst {
    /// New connection each, a path that issues nothing.
    HandshakeOnly,
    /// New connection per CSR.
    NewConnections,
    /// Every CSR as a stream of one HTTP/2 connection.
    OneH2Connection,
    /// One HTTP/2 connection per CSR, all opened before the server's CPU
    /// is counted; the CSRs sent at once (`None`) or one every `Some(gap)`.
    Held(Option<Duration>),
    /// [`Burst::Held`] on the config push endpoint's framed transport: one
    /// authenticated config stream per CSR, each CSR a SIGN frame.
    HeldFramed(Option<Duration>),
}

struct Measured {
    latencies: Vec<Duration>,
    failures: Vec<String>,
    wall: Duration,
    server_cpu: Duration,
    rss_peak_kib: u64,
}

/// Runs the endpoint on a fresh one-thread runtime and sends one burst.
fn served_burst(
    service: &Arc<IdentityService<InMemory>>,
    acceptor: &tokio_rustls::TlsAcceptor,
    client_config: &Arc<rustls::ClientConfig>,
    bodies: &[Bytes],
    burst: Burst,
) -> Measured {
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    std_listener.set_nonblocking(true).unwrap();
    let addr = std_listener.local_addr().unwrap();
    let (server_service, acceptor) = (service.clone(), acceptor.clone());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<(u64, std::path::PathBuf)>();
    // Named, so a profiler can tell the server's samples from the client's.
    let server = std::thread::Builder::new()
        .name("identity-server".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let cpu_start = thread_cpu_ns();
            // Where the client reads this thread's CPU time mid-burst.
            let task = std::fs::read_link("/proc/thread-self").unwrap();
            let task = std::path::Path::new("/proc").join(task);
            ready_tx.send((cpu_start, task)).unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(std_listener).unwrap();
                if let Burst::HeldFramed(_) = burst {
                    // The config push endpoint as the operator composes it:
                    // its certificate requests answered by the same service.
                    let server = Arc::new(PushServer {
                        hub: Arc::new(Hub::new(
                            MeshParams {
                                trust_domain: "cluster.local".into(),
                                cluster_domain: "cluster.local".into(),
                                identity: None,
                                default_authorization: Default::default(),
                            },
                            PushMetrics::default(),
                        )),
                        cluster: InMemory,
                        audience: AUDIENCE.into(),
                        trust_domain: "cluster.local".into(),
                        authenticating: baton_operator::mesh::server::authenticating(),
                        ping_interval: baton_config::framed::PING_INTERVAL,
                        sign: Some(Arc::new(move |req| {
                            let service = server_service.clone();
                            Box::pin(async move {
                                baton_operator::identity::server::sign(&service, &req).await
                            })
                        })),
                    });
                    tokio::select! {
                        r = push_serve(listener, acceptor, server) => { r.unwrap(); }
                        _ = stop_rx => {}
                    }
                    return;
                }
                tokio::select! {
                    r = serve(listener, acceptor, server_service, "/v1/sign") => { r.unwrap(); }
                    _ = stop_rx => {}
                }
            });
            thread_cpu_ns().saturating_sub(cpu_start)
        })
        .unwrap();
    let (_, server_task) = ready_rx.recv().unwrap();
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // Reset the peak-RSS mark so VmHWM reports this burst's peak.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let t = Instant::now();
    // Held connections: the server's CPU time and the wall time of the
    // CSRs alone.
    let mut held_phase: Option<(u64, Duration)> = None;
    let results: Vec<Result<Duration, String>> = client_rt.block_on(async {
        if let Burst::Held(gap) = burst {
            let (results, csr_cpu, csr_wall) =
                held_burst(addr, client_config, bodies, gap, &server_task).await;
            held_phase = Some((csr_cpu, csr_wall));
            return results;
        }
        if let Burst::HeldFramed(gap) = burst {
            let (results, csr_cpu, csr_wall) =
                held_framed_burst(addr, client_config, bodies, gap, &server_task).await;
            held_phase = Some((csr_cpu, csr_wall));
            return results;
        }
        let h2 = if burst == Burst::OneH2Connection {
            let tls = tls_connect(addr, client_config.clone()).await.unwrap();
            let (sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                    .await
                    .unwrap();
            tokio::spawn(conn);
            Some(sender)
        } else {
            None
        };
        let tasks: Vec<_> = bodies
            .iter()
            .enumerate()
            .map(|(i, body)| {
                let token = format!("t{i}");
                let (config, body, h2) = (client_config.clone(), body.clone(), h2.clone());
                tokio::spawn(async move {
                    match (burst, h2) {
                        (Burst::HandshakeOnly, _) => {
                            post_new_connection(
                                addr,
                                config,
                                request("/nothing", &token, Bytes::new()),
                                http::StatusCode::NOT_FOUND,
                            )
                            .await
                        }
                        (Burst::Held(_) | Burst::HeldFramed(_), _) => {
                            unreachable!("served by held_burst and held_framed_burst")
                        }
                        (_, None) => {
                            post_new_connection(
                                addr,
                                config,
                                request("/v1/sign", &token, body),
                                http::StatusCode::OK,
                            )
                            .await
                        }
                        (_, Some(mut sender)) => {
                            let start = Instant::now();
                            sender.ready().await.map_err(|e| e.to_string())?;
                            let resp = sender
                                .send_request(request("https://127.0.0.1/v1/sign", &token, body))
                                .await
                                .map_err(|e| e.to_string())?;
                            read_answer(resp, http::StatusCode::OK).await?;
                            Ok(start.elapsed())
                        }
                    }
                })
            })
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
    let wall = held_phase.map_or_else(|| t.elapsed(), |(_, w)| w);
    let rss_peak_kib = proc_status("VmHWM:").unwrap_or(0);
    let _ = stop_tx.send(());
    let total = server.join().unwrap();
    // Held connections: only what the server spent on the CSRs.
    let server_cpu = Duration::from_nanos(held_phase.map_or(total, |(csr_cpu, _)| csr_cpu));
    let mut latencies: Vec<Duration> = results
        .iter()
        .filter_map(|r| r.as_ref().ok().copied())
        .collect();
    latencies.sort();
    let failures = results.into_iter().filter_map(Result::err).collect();
    Measured {
        latencies,
        failures,
        wall,
        server_cpu,
        rss_peak_kib,
    }
}

/// The server's thread idle: its CPU time stops moving (at most 1 s).
async fn settle(server_task: &std::path::Path) {
    let mut last = cpu_ns_of(server_task);
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = cpu_ns_of(server_task);
        if now == last {
            break;
        }
        last = now;
    }
}

/// Each held request's latency (120 s for them all), and the connections
/// they came back with, kept open until the caller has read the CPU.
async fn collect_held<T>(
    tasks: Vec<tokio::task::JoinHandle<Result<(Duration, T), String>>>,
) -> (Vec<Result<Duration, String>>, Vec<T>) {
    let mut out = Vec::with_capacity(tasks.len());
    let mut open = Vec::with_capacity(tasks.len());
    let deadline = Instant::now() + Duration::from_secs(120);
    for task in tasks {
        let left = deadline.saturating_duration_since(Instant::now());
        out.push(match tokio::time::timeout(left, task).await {
            Ok(Ok(Ok((latency, conn)))) => {
                open.push(conn);
                Ok(latency)
            }
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("timed out".into()),
        });
    }
    (out, open)
}

/// The held-connections burst: opens one HTTP/2 connection per body (at
/// most 64 handshakes in flight), waits for the server to go idle, reads its
/// CPU time, then sends one CSR per connection — all at once, or one every
/// `gap` — and keeps every connection open until all answers are in.
/// Returns each CSR's latency (from its send), the server's CPU time from
/// the first CSR to the last answer (connections still open), and that
/// span's wall time.
async fn held_burst(
    addr: SocketAddr,
    config: &Arc<rustls::ClientConfig>,
    bodies: &[Bytes],
    gap: Option<Duration>,
    server_task: &std::path::Path,
) -> (Vec<Result<Duration, String>>, u64, Duration) {
    let open = Arc::new(tokio::sync::Semaphore::new(64));
    let connecting: Vec<_> = bodies
        .iter()
        .map(|_| {
            let (config, open) = (config.clone(), open.clone());
            tokio::spawn(async move {
                let _permit = open.acquire_owned().await.map_err(|e| e.to_string())?;
                let tls = tls_connect(addr, config).await?;
                let (mut sender, conn) =
                    hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                        .await
                        .map_err(|e| e.to_string())?;
                tokio::spawn(conn);
                sender.ready().await.map_err(|e| e.to_string())?;
                Ok::<_, String>(sender)
            })
        })
        .collect();
    let mut senders = Vec::with_capacity(bodies.len());
    for c in connecting {
        senders.push(c.await.map_err(|e| e.to_string()).and_then(|r| r));
    }
    // Let the server finish the connections' SETTINGS exchange.
    settle(server_task).await;
    let cpu_at_open = cpu_ns_of(server_task);
    let start = tokio::time::Instant::now();
    let tasks: Vec<_> = senders
        .into_iter()
        .zip(bodies)
        .enumerate()
        .map(|(i, (sender, body))| {
            let body = body.clone();
            let at = start + gap.map_or(Duration::ZERO, |g| g * i as u32);
            tokio::spawn(async move {
                let mut sender = sender?;
                tokio::time::sleep_until(at).await;
                let sent = Instant::now();
                let resp = sender
                    .send_request(request("https://127.0.0.1/v1/sign", &format!("t{i}"), body))
                    .await
                    .map_err(|e| e.to_string())?;
                read_answer(resp, http::StatusCode::OK).await?;
                // The sender goes back with the latency: the connection
                // stays open (as a sidecar's does) until the CPU is read.
                Ok((sent.elapsed(), sender))
            })
        })
        .collect();
    let (out, open) = collect_held(tasks).await;
    let wall = start.elapsed();
    let used = cpu_ns_of(server_task).saturating_sub(cpu_at_open);
    drop(open);
    (out, used, wall)
}

/// One framed config stream, authenticated: HELLO sent, OPEN read.
async fn open_framed(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    i: usize,
) -> Result<(FramedTls, FrameDecoder), String> {
    let mut tls = tls_connect(addr, config).await?;
    let hello = framed::Hello {
        token: format!("t{i}"),
        pod: format!("bench/p{i}"),
        version: 0,
        capabilities: String::new(),
    };
    let io = |e: std::io::Error| e.to_string();
    tls.write_all(&framed::encode_json(Kind::Hello, &hello))
        .await
        .map_err(io)?;
    tls.flush().await.map_err(io)?;
    let mut decoder = FrameDecoder::new(baton_config::push::MAX_FRAME);
    match next_frame(&mut tls, &mut decoder).await? {
        (Kind::Open, _) => Ok((tls, decoder)),
        (kind, payload) => Err(format!(
            "{kind:?} instead of OPEN: {}",
            String::from_utf8_lossy(&payload)
        )),
    }
}

type FramedTls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

async fn next_frame(
    tls: &mut FramedTls,
    decoder: &mut FrameDecoder,
) -> Result<(Kind, Bytes), String> {
    let mut buf = [0u8; 4096];
    loop {
        match decoder.next_frame().map_err(|e| e.to_string())? {
            Some(framed::Frame::Known(kind, payload)) => return Ok((kind, payload)),
            Some(framed::Frame::Unknown(k)) => return Err(format!("unknown kind {k}")),
            None => {}
        }
        let n = tls.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("the operator closed the stream".into());
        }
        decoder.extend(&buf[..n]);
    }
}

/// [`held_burst`] on framed config streams: every stream opened and
/// authenticated first, then one SIGN per stream, at once or one every
/// `gap`; the streams stay open until every answer is in.
async fn held_framed_burst(
    addr: SocketAddr,
    config: &Arc<rustls::ClientConfig>,
    bodies: &[Bytes],
    gap: Option<Duration>,
    server_task: &std::path::Path,
) -> (Vec<Result<Duration, String>>, u64, Duration) {
    let open = Arc::new(tokio::sync::Semaphore::new(64));
    let opening: Vec<_> = (0..bodies.len())
        .map(|i| {
            let (config, open) = (config.clone(), open.clone());
            tokio::spawn(async move {
                let _permit = open.acquire_owned().await.map_err(|e| e.to_string())?;
                open_framed(addr, config, i).await
            })
        })
        .collect();
    let mut streams = Vec::with_capacity(bodies.len());
    for o in opening {
        streams.push(o.await.map_err(|e| e.to_string()).and_then(|r| r));
    }
    // Let the server finish the authentications.
    settle(server_task).await;
    let cpu_at_open = cpu_ns_of(server_task);
    let start = tokio::time::Instant::now();
    let tasks: Vec<_> = streams
        .into_iter()
        .zip(bodies)
        .enumerate()
        .map(|(i, (stream, body))| {
            let body = body.clone();
            let at = start + gap.map_or(Duration::ZERO, |g| g * i as u32);
            tokio::spawn(async move {
                let (mut tls, mut decoder) = stream?;
                tokio::time::sleep_until(at).await;
                let sent = Instant::now();
                let sign = framed::Sign {
                    id: 1,
                    token: format!("t{i}"),
                    request: body,
                };
                tls.write_all(&sign.encode())
                    .await
                    .map_err(|e| e.to_string())?;
                tls.flush().await.map_err(|e| e.to_string())?;
                loop {
                    let (kind, payload) = next_frame(&mut tls, &mut decoder).await?;
                    if kind != Kind::Signed {
                        continue;
                    }
                    let signed = framed::Signed::decode(payload).map_err(|e| e.to_string())?;
                    if signed.status != 200 {
                        return Err(format!(
                            "{}: {}",
                            signed.status,
                            String::from_utf8_lossy(&signed.body)
                        ));
                    }
                    // The stream goes back with the latency: open until the
                    // CPU is read, as a sidecar's stays.
                    return Ok((sent.elapsed(), tls));
                }
            })
        })
        .collect();
    let (out, open) = collect_held(tasks).await;
    let wall = start.elapsed();
    let used = cpu_ns_of(server_task).saturating_sub(cpu_at_open);
    drop(open);
    (out, used, wall)
}

fn report(label: &str, n: usize, m: &Measured, sign_rate: f64) -> Option<f64> {
    if let Some(f) = m.failures.first() {
        println!("{label}: FAILED {} of {n}; first: {f}", m.failures.len());
    }
    if m.latencies.is_empty() {
        return None;
    }
    let ok = m.latencies.len() as f64;
    let per_core = ok / m.server_cpu.as_secs_f64();
    println!(
        "{label}: {:>6.0} req/s seen by the client (wall {:.0} ms); server CPU {:.0} ms = {:>6.0} req per CPU-second ({:.3} x raw signing)",
        ok / m.wall.as_secs_f64(),
        m.wall.as_secs_f64() * 1000.0,
        m.server_cpu.as_secs_f64() * 1000.0,
        per_core,
        per_core / sign_rate,
    );
    println!(
        "{:>w$}  latency p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms;  RSS peak {:.1} MiB",
        "",
        percentile(&m.latencies, 0.50).as_secs_f64() * 1000.0,
        percentile(&m.latencies, 0.99).as_secs_f64() * 1000.0,
        m.latencies.last().unwrap().as_secs_f64() * 1000.0,
        m.rss_peak_kib as f64 / 1024.0,
        w = label.len(),
    );
    Some(per_core)
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

    // 2. The CSR check alone, then pure issuance, on one thread.
    let pems = csrs(n);
    let t = Instant::now();
    for pem in &pems {
        std::hint::black_box(check_csr(pem, &me, &policy).unwrap());
    }
    let check_rate = n as f64 / t.elapsed().as_secs_f64();
    println!("peer   CSR check alone:           {check_rate:>9.0} CSRs/s  (parse + verify + SAN)");
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

    // 3. The HTTPS endpoint on a one-thread runtime, bursts from another.
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
            // Every request of the bench comes from its own Pod; the
            // bucket is exercised, never empty.
            rate_limit: RateLimit::default(),
        },
        Arc::new(ArcSwap::from_pointee(authority)),
        IdentityMetrics::default(),
    ));
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca.bundle.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut client_config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    // A fleet's sidecars hold no session to resume: every connection of a
    // burst is a full handshake, as in production.
    client_config.resumption = rustls::client::Resumption::disabled();
    let h1 = Arc::new(client_config.clone());
    client_config.alpn_protocols = vec![b"h2".to_vec()];
    let h2 = Arc::new(client_config);
    let bodies: Vec<Bytes> = pems
        .iter()
        .map(|csr| Bytes::from(serde_json::json!({ "csr": csr }).to_string()))
        .collect();
    let rss_before = proc_status("VmRSS:").unwrap_or(0);
    println!(
        "served bursts of {n} concurrent requests, server on one thread; process RSS before {:.1} MiB",
        rss_before as f64 / 1024.0
    );
    // Peer for the endpoint's TLS settings: rustls's defaults (the
    // client's suite order, two session tickets per handshake).
    let stock = {
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_cert_resolver(serving.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    };
    let ours = acceptor(serving.clone());
    let stock_hs = served_burst(&service, &stock, &h1, &bodies, Burst::HandshakeOnly);
    let stock_rate = report("  handshakes, stock rustls  ", n, &stock_hs, sign_rate);
    let handshake = served_burst(&service, &ours, &h1, &bodies, Burst::HandshakeOnly);
    let hs_rate = report("  handshakes only (404)     ", n, &handshake, sign_rate);
    let fresh = served_burst(&service, &ours, &h1, &bodies, Burst::NewConnections);
    let fresh_rate = report("  new connection per CSR    ", n, &fresh, sign_rate);
    let reused = served_burst(&service, &ours, &h2, &bodies, Burst::OneH2Connection);
    let reused_rate = report("  one HTTP/2 connection     ", n, &reused, sign_rate);
    // Decision 0056: each CSR on a connection the sidecar already holds.
    let held = served_burst(&service, &ours, &h2, &bodies, Burst::Held(None));
    report("  held connections, at once ", n, &held, sign_rate);
    let rate: u32 = std::env::var("BATON_BENCH_RATE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000)
        .clamp(1, 100_000);
    let paced = served_burst(
        &service,
        &ours,
        &h2,
        &bodies,
        Burst::Held(Some(Duration::from_secs(1) / rate)),
    );
    report(
        &format!("  held connections, {rate}/s "),
        n,
        &paced,
        sign_rate,
    );
    if let (Some(stock), Some(hs)) = (stock_rate, hs_rate) {
        println!(
            "  the endpoint's TLS settings: {:.2} x the handshakes per CPU-second of stock rustls",
            hs / stock
        );
    }
    if let (Some(hs), Some(fresh), Some(reused)) = (hs_rate, fresh_rate, reused_rate) {
        // Per-request CPU adds up: handshake + issuance ≈ new-connection cost.
        println!(
            "  per request: handshake {:.0} us + served issuance {:.0} us = {:.0} us; measured new-connection {:.0} us",
            1e6 / hs,
            1e6 / reused,
            1e6 / hs + 1e6 / reused,
            1e6 / fresh
        );
    }
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
    // Decision 0066: the same on framed config streams, what current
    // sidecars hold.
    let mut framed_config = (*h2).clone();
    framed_config.alpn_protocols = vec![framed::ALPN.to_vec()];
    let framed_config = Arc::new(framed_config);
    let push_acceptor = push_acceptor(serving.clone());
    let held_framed = served_burst(
        &service,
        &push_acceptor,
        &framed_config,
        &bodies,
        Burst::HeldFramed(None),
    );
    report("  held framed, at once      ", n, &held_framed, sign_rate);
    let paced_framed = served_burst(
        &service,
        &push_acceptor,
        &framed_config,
        &bodies,
        Burst::HeldFramed(Some(Duration::from_secs(1) / rate)),
    );
    report(
        &format!("  held framed, {rate}/s      "),
        n,
        &paced_framed,
        sign_rate,
    );
    if [
        &stock_hs,
        &handshake,
        &fresh,
        &reused,
        &held,
        &paced,
        &held_framed,
        &paced_framed,
    ]
    .iter()
    .any(|m| !m.failures.is_empty())
    {
        std::process::exit(1);
    }
}
