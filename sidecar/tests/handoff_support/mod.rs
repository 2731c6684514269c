//! Harness for the multi-process handoff tests: real `baton-sidecar`
//! processes on loopback, a local upstream (HTTP/1.1 + HTTP/2 and a TCP echo
//! server), and a load client that checks every response and every byte.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub const BIN: &str = env!("CARGO_BIN_EXE_baton-sidecar");

/// A `baton-sidecar` child process, SIGKILLed (by its own PID) on drop.
pub struct Sidecar {
    pub child: Child,
    pub log: PathBuf,
}

/// A forked launcher waiting to exec `baton-sidecar` (see [`World::prepare`]).
pub struct Prepared {
    sidecar: Sidecar,
    go: std::process::ChildStdin,
}

impl Prepared {
    /// Execs the sidecar now; the process keeps the launcher's PID.
    pub fn start(self) -> Sidecar {
        use std::io::Write;
        let mut go = self.go;
        go.write_all(b"go\n").expect("start the prepared sidecar");
        self.sidecar
    }
}

impl Sidecar {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig);
    }

    /// Waits (bounded) for the process to exit; its status if it did.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The whole log (an error message may sit above a long backtrace when
    /// RUST_BACKTRACE is set).
    pub fn log_all(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One test's world: a temp dir with the config, socket and status file;
/// the ports; the upstreams.
pub struct World {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub socket: PathBuf,
    pub status: PathBuf,
    pub admin: SocketAddr,
    pub http: SocketAddr,
    pub tcp: SocketAddr,
    /// Mesh-TLS listener (auto-detect; TLS is terminated, the decrypted
    /// stream goes to the echo server), when the world has TLS.
    pub tls: Option<(SocketAddr, rustls_pki_types::CertificateDer<'static>)>,
    /// Raw TCP listener whose cluster originates mesh mTLS to the sidecar's
    /// own mesh-TLS listener (then to the echo server), when the world has
    /// TLS: such a connection has TLS on its upstream side, and a second one
    /// (the inbound leg) on its downstream side, in the same process.
    pub mtls_out: Option<SocketAddr>,
    pub upstream: Upstream,
    generation: AtomicU64,
    /// Every process started in this world and its log (pid, path).
    started: Mutex<Vec<(u32, PathBuf)>>,
}

/// The identity in the world's certificate.
pub const SIDECAR_ID: &str = "spiffe://cluster.local/ns/test/sa/sidecar";

/// A CA and a server certificate (DNS `localhost` and the mesh marker name
/// + a SPIFFE URI) as PEM files in `dir`; returns the CA certificate.
fn write_pki(dir: &Path) -> rustls_pki_types::CertificateDer<'static> {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, SanType};
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let mut leaf = CertificateParams::new(vec![
        "localhost".to_string(),
        baton_sidecar::client_hello::MESH_SERVER_NAME.to_string(),
    ])
    .unwrap();
    leaf.subject_alt_names
        .push(SanType::URI(SIDECAR_ID.try_into().unwrap()));
    let key = KeyPair::generate().unwrap();
    let cert = leaf.signed_by(&key, &ca).unwrap();
    std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    ca.der().clone()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl World {
    pub async fn new() -> Self {
        Self::build(false).await
    }

    /// With a mesh-TLS listener (Permissive, server-authenticated).
    pub async fn new_with_tls() -> Self {
        Self::build(true).await
    }

    async fn build(with_tls: bool) -> Self {
        let upstream = Upstream::start().await;
        let dir = tempfile::tempdir().unwrap();
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let tcp: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let config = dir.path().join("sidecar.yaml");
        let (tls, mtls_out, tls_listener, tls_section) = if with_tls {
            let ca = write_pki(dir.path());
            let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let out: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let d = dir.path().display();
            let listener = format!(
                "  - name: tls\n    address: {addr}\n    direction: inbound\n    tcp_cluster: echo\n  \
                 - name: mtls-out\n    address: {out}\n    protocol: tcp\n    tcp_cluster: echo-mtls\n"
            );
            let section = format!(
                "tls:
  mode: Permissive
  require_client_cert: false
  identity: {{ trust_domain: cluster.local }}
  source: {{ files: {{ cert_chain: '{d}/cert.pem', key: '{d}/key.pem', trust_bundle: '{d}/ca.pem' }} }}
"
            );
            // The sidecar dials itself, so the identity is its own.
            let cluster = format!(
                "  - {{ name: echo-mtls, endpoints: [{addr}], mtls: {{ identity: '{SIDECAR_ID}' }} }}\n"
            );
            (Some((addr, ca)), Some(out), listener, cluster + &section)
        } else {
            (None, None, String::new(), String::new())
        };
        let (up_http, up_echo) = (upstream.http, upstream.echo);
        // Extra keys for benchmarks: of the upstream cluster (e.g.
        // `pool_max_idle_per_endpoint: 2`) and of `runtime` (e.g.
        // `event_interval: 8`).
        let up_extra = std::env::var("BATON_BENCH_UP_EXTRA")
            .map(|v| format!(", {v}"))
            .unwrap_or_default();
        let runtime_extra = std::env::var("BATON_BENCH_RUNTIME")
            .map(|v| format!(", {v}"))
            .unwrap_or_default();
        std::fs::write(
            &config,
            format!(
                "version: 1
admin: {{ address: {admin} }}
runtime: {{ worker_threads: 1, drain_timeout_ms: 5000, header_read_timeout_ms: 300000{runtime_extra} }}
listeners:
  - name: http
    address: {http}
    capture: explicit
  - name: tcp
    address: {tcp}
    protocol: tcp
    tcp_cluster: echo
{tls_listener}routes:
  - name: all
    match: {{ path: {{ prefix: / }} }}
    backends: [{{ cluster: up }}]
clusters:
  - {{ name: up, endpoints: [{up_http}]{up_extra} }}
  - {{ name: echo, endpoints: [{up_echo}] }}
{tls_section}"
            ),
        )
        .unwrap();
        let socket = dir.path().join("handoff.sock");
        let status = dir.path().join("handoff-status.json");
        Self {
            dir,
            config,
            socket,
            status,
            admin,
            http,
            tcp,
            tls,
            mtls_out,
            upstream,
            generation: AtomicU64::new(0),
            started: Mutex::default(),
        }
    }

    /// Starts a sidecar process; `env` adds or overrides variables.
    pub fn spawn(&self, env: &[(&str, &str)]) -> Sidecar {
        self.spawn_with_config(&self.config, env)
    }

    /// [`World::spawn`] with another config file: a Pod's sidecar, say,
    /// which starts with no policy of its own and serves what it inherits.
    pub fn spawn_with_config(&self, config: &Path, env: &[(&str, &str)]) -> Sidecar {
        let (mut cmd, log) = self.command(Command::new(BIN), config, env);
        let child = cmd.spawn().expect("spawn baton-sidecar");
        self.started.lock().unwrap().push((child.id(), log.clone()));
        Sidecar { child, log }
    }

    /// A sidecar forked now, as a shell waiting on its stdin, and exec'd by
    /// [`Prepared::start`]. Benchmarks prepare the next process before they
    /// open thousands of connections: a process forked from the load
    /// generator later would inherit its large descriptor table (and the
    /// exec would close thousands of descriptors), which a sidecar a
    /// container runtime starts does not have.
    pub fn prepare(&self, env: &[(&str, &str)]) -> Prepared {
        let mut sh = Command::new("/bin/sh");
        sh.args(["-c", "read go && exec \"$0\" \"$@\"", BIN]);
        let (mut cmd, log) = self.command(sh, &self.config, env);
        let mut child = cmd
            .stdin(Stdio::piped())
            .spawn()
            .expect("fork the launcher");
        let go = child.stdin.take().expect("the launcher's stdin");
        self.started.lock().unwrap().push((child.id(), log.clone()));
        Prepared {
            sidecar: Sidecar { child, log },
            go,
        }
    }

    /// `baton-sidecar run` with this world's config, socket, status file and
    /// log, run through `cmd` (the binary itself, or a launcher that execs it).
    fn command(&self, mut cmd: Command, config: &Path, env: &[(&str, &str)]) -> (Command, PathBuf) {
        let g = self.generation.fetch_add(1, Ordering::Relaxed);
        let log = self.dir.path().join(format!("sidecar-{g}.log"));
        let file = std::fs::File::create(&log).unwrap();
        cmd.args(["run", "--config"])
            .arg(config)
            .env("BATON_HANDOFF_SOCKET", &self.socket)
            .env("BATON_HANDOFF_STATUS_FILE", &self.status)
            .env("BATON_LOG", "info")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        for (k, v) in env {
            cmd.env(k, v);
        }
        (cmd, log)
    }

    /// Waits until `/ready` answers 200.
    pub async fn wait_ready(&self, within: Duration) {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok((200, _)) = admin_get(self.admin, "/ready").await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("sidecar not ready within {within:?}");
    }

    /// The last lines of every sidecar log of this world (for failures).
    pub fn logs(&self) -> String {
        let mut out = String::new();
        let mut entries: Vec<_> = std::fs::read_dir(self.dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .collect();
        entries.sort();
        for p in entries
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "log"))
        {
            let s = std::fs::read_to_string(p).unwrap_or_default();
            let lines: Vec<&str> = s.lines().collect();
            out.push_str(&format!(
                "== {}\n{}\n",
                p.display(),
                lines[lines.len().saturating_sub(25)..].join("\n")
            ));
        }
        out
    }

    /// The last 40 lines of the logs of the processes `pids` (those this
    /// world started; others are named as unknown), for failure messages.
    pub fn log_tails_of(&self, pids: &[u32]) -> String {
        let started = self.started.lock().unwrap();
        let mut out = String::new();
        let mut seen = Vec::new();
        for pid in pids {
            if seen.contains(pid) {
                continue;
            }
            seen.push(*pid);
            match started.iter().find(|(p, _)| p == pid) {
                Some((_, log)) => {
                    let s = std::fs::read_to_string(log).unwrap_or_default();
                    let lines: Vec<&str> = s.lines().collect();
                    out.push_str(&format!(
                        "== pid {pid}: {}\n{}\n",
                        log.display(),
                        lines[lines.len().saturating_sub(40)..].join("\n")
                    ));
                }
                None => out.push_str(&format!("== pid {pid}: not a sidecar of this test\n")),
            }
        }
        out
    }

    /// The status file, if it exists and parses.
    pub fn status(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&std::fs::read(&self.status).ok()?).ok()
    }

    /// Waits until process `pid` reports a completed handoff.
    pub async fn wait_complete(&self, pid: u32, within: Duration) -> serde_json::Value {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(s) = self.status()
                && s["pid"] == pid
                && s["result"] == "complete"
            {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "no completed handoff by pid {pid} within {within:?}; status: {:?}\n{}",
            self.status(),
            self.logs()
        );
    }
}

/// Minimal HTTP/1.0 GET against the admin port: (status, body).
pub async fn admin_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await??;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await??;
    let text = String::from_utf8_lossy(&out).to_string();
    let code = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

/// Sum of a metric's samples whose series starts with `prefix` (name plus
/// optional label filter, e.g. `baton_sidecar_requests_total{`).
pub fn metric_sum(text: &str, prefix: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .map(|v| v as u64)
        .sum()
}

/// Requests whose path starts with this are answered with their whole
/// request body (read to its end first); every other with its path.
pub const ECHO_BODY_PREFIX: &str = "/echo-body/";

/// The local upstream: HTTP (1.1 and 2) answering with its path (or, under
/// [`ECHO_BODY_PREFIX`], the request body), recording how often each request
/// path was served (counted when its head arrives); and a TCP echo server.
pub struct Upstream {
    pub http: SocketAddr,
    pub echo: SocketAddr,
    /// request path → times served (a duplicate shows up as 2).
    pub served: Arc<Mutex<HashMap<String, u32>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Upstream {
    async fn start() -> Self {
        // A backlog like a production server's (somaxconn), not tokio's
        // 128: the benchmark opens its idle connections 200 at a time, and
        // the sidecar opens upstream connections as fast as they arrive; a
        // full accept queue drops SYNs, retried only after 1 s, past the
        // cluster's connect timeout.
        let hl = {
            let s =
                socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
            s.set_reuse_address(true).unwrap();
            s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
                .unwrap();
            s.listen(4096).unwrap();
            s.set_nonblocking(true).unwrap();
            TcpListener::from_std(s.into()).unwrap()
        };
        let el = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (http, echo) = (hl.local_addr().unwrap(), el.local_addr().unwrap());
        let served: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
        let s = served.clone();
        let http_task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = hl.accept().await else {
                    return;
                };
                let s = s.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let s = s.clone();
                        async move {
                            let path = req.uri().path().to_string();
                            *s.lock().unwrap().entry(path.clone()).or_default() += 1;
                            // Every request body is read to its end before
                            // the answer, as a gRPC server does: hyper closes
                            // a connection whose request body was left unread
                            // (it cannot tell where the next request starts),
                            // and a proxy's next request on it would race that
                            // close. A streaming call gets its whole body back
                            // (every byte checked by the client).
                            let received = match req.into_body().collect().await {
                                Ok(b) => b.to_bytes(),
                                Err(_) => Bytes::from_static(b"body read error"),
                            };
                            let body = if path.starts_with(ECHO_BODY_PREFIX) {
                                received
                            } else {
                                Bytes::from(path)
                            };
                            Ok::<_, std::convert::Infallible>(Response::new(Full::new(body)))
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        let echo_task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = el.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let (mut r, mut w) = stream.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        });
        Self {
            http,
            echo,
            served,
            tasks: vec![http_task, echo_task],
        }
    }

    /// Paths served more than once (a duplicated request).
    pub fn duplicates(&self) -> Vec<String> {
        self.served
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(p, _)| p.clone())
            .collect()
    }
}

/// Shared results of the load client.
#[derive(Default)]
pub struct Stats {
    pub ok: AtomicU64,
    pub failures: Mutex<Vec<String>>,
    /// Where the test's handoff sequence is ("handoff #3: pid 10 → pid 11",
    /// set by the test): a stalled exchange names the handoff it began in.
    phase: Mutex<String>,
    /// Processes that held a stalled connection (their logs go into the
    /// failure message).
    pub stalled_pids: Mutex<Vec<u32>>,
    pub echo_bytes: AtomicU64,
    /// HTTP/2 requests retried after a GOAWAY said they were not processed.
    pub h2_retries: AtomicU64,
    pub tls_bytes: AtomicU64,
    pub https_ok: AtomicU64,
}

impl Stats {
    pub fn fail(&self, what: String) {
        let mut f = self.failures.lock().unwrap();
        if f.len() < 50 {
            f.push(what);
        }
    }
    pub fn failure_count(&self) -> usize {
        self.failures.lock().unwrap().len()
    }

    /// Records where the handoff sequence is, for stall messages.
    pub fn set_phase(&self, phase: impl Into<String>) {
        *self.phase.lock().unwrap() = phase.into();
    }

    fn phase(&self) -> String {
        let p = self.phase.lock().unwrap();
        if p.is_empty() {
            "before any handoff".to_string()
        } else {
            p.clone()
        }
    }

    /// Runs one exchange of `who` with its own time limit. A stall becomes
    /// an error naming the exchange, the connection, the handoff phase when
    /// it began and when it was given up, and the process(es) holding the
    /// connection's far end at that moment (from /proc).
    pub async fn exchange<T>(
        &self,
        who: &Who,
        what: &str,
        fut: impl std::future::Future<Output = Result<T, String>>,
    ) -> Result<T, String> {
        let began = self.phase();
        match tokio::time::timeout(EXCHANGE_TIMEOUT, fut).await {
            Ok(r) => r.map_err(|e| format!("{who}: {what}: {e} (began {began})")),
            Err(_) => {
                let holders = who.holders();
                self.stalled_pids
                    .lock()
                    .unwrap()
                    .extend(holders.iter().map(|(pid, _)| *pid));
                let held = if holders.is_empty() {
                    "no process holds its far end".to_string()
                } else {
                    holders
                        .iter()
                        .map(|(pid, comm)| format!("pid {pid} ({comm})"))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                Err(format!(
                    "STALL {who}: {what}: nothing within {EXCHANGE_TIMEOUT:?}; began {began}, \
                     given up {}; far end held by {held}",
                    self.phase()
                ))
            }
        }
    }
}

/// Each exchange of a load client (a request and its response, an echoed
/// chunk, a connect, a handshake, the close) gets this long. Far above what
/// one takes even on a saturated machine (milliseconds; a handoff pauses a
/// connection for well under a second), so hitting it means a stall.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);

/// One load client's connection, for failure messages: its kind and index,
/// the sidecar address it talks to and its own local port (once connected).
pub struct Who {
    pub kind: &'static str,
    pub index: u64,
    pub target: SocketAddr,
    pub local_port: std::sync::atomic::AtomicU16,
}

impl Who {
    pub fn new(kind: &'static str, index: u64, target: SocketAddr) -> Self {
        Self {
            kind,
            index,
            target,
            local_port: std::sync::atomic::AtomicU16::new(0),
        }
    }

    pub fn connected(&self, s: &TcpStream) {
        if let Ok(a) = s.local_addr() {
            self.local_port.store(a.port(), Ordering::Relaxed);
        }
    }

    /// The processes that hold the sidecar's end of this connection now.
    pub fn holders(&self) -> Vec<(u32, String)> {
        match self.local_port.load(Ordering::Relaxed) {
            0 => Vec::new(),
            port => socket_holders(self.target, port),
        }
    }
}

impl std::fmt::Display for Who {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.local_port.load(Ordering::Relaxed) {
            0 => write!(
                f,
                "{} client #{} (not connected) -> {}",
                self.kind, self.index, self.target
            ),
            p => write!(
                f,
                "{} client #{} (local port {p}) -> {}",
                self.kind, self.index, self.target
            ),
        }
    }
}

/// The processes (pid, name) that hold the socket whose local address is
/// `server` and whose peer is 127.0.0.1:`client_port`: the TCP table gives
/// the socket's inode, the processes' fd tables its holders. Read-only.
pub fn socket_holders(server: SocketAddr, client_port: u16) -> Vec<(u32, String)> {
    let port_of = |field: &str| {
        field
            .rsplit_once(':')
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
    };
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9
                && port_of(f[1]) == Some(server.port())
                && port_of(f[2]) == Some(client_port)
                && f[9] != "0"
            {
                inodes.push(format!("socket:[{}]", f[9]));
            }
        }
    }
    let mut out = Vec::new();
    if inodes.is_empty() {
        return out;
    }
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|l| inodes.iter().any(|i| l.as_os_str() == i.as_str()))
        });
        if holds {
            let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
            out.push((pid, comm.trim().to_string()));
        }
    }
    out
}

/// Deterministic byte stream for echo checks (xorshift64*).
pub struct Pattern(u64);

impl Pattern {
    pub fn new(seed: u64) -> Self {
        Self(seed | 1)
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            *b = (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8;
        }
    }
}

/// What kinds of traffic to run.
#[derive(Clone, Copy)]
pub struct LoadShape {
    pub keepalive: usize,
    pub new_conns: usize,
    pub h2: usize,
    pub echo: usize,
    /// TLS echo streams through the mesh-TLS listener, per version (the
    /// TLS 1.3 ones also send KeyUpdates).
    pub tls12: usize,
    pub tls13: usize,
    /// HTTP/1.1 keep-alive over TLS 1.3 (ALPN http/1.1) through the TLS listener.
    pub https: usize,
    /// Echo streams through the `mtls-out` listener (plaintext in, mesh
    /// mTLS originated to the upstream).
    pub mtls_echo: usize,
    /// Pause between operations of one client (bounds the load).
    pub pace: Duration,
}

impl Default for LoadShape {
    /// No clients; a 4 ms pace.
    fn default() -> Self {
        Self {
            keepalive: 0,
            new_conns: 0,
            h2: 0,
            echo: 0,
            tls12: 0,
            tls13: 0,
            https: 0,
            mtls_echo: 0,
            pace: Duration::from_millis(4),
        }
    }
}

/// A running load client; [`Load::finish`] stops it and checks the tails.
pub struct Load {
    pub stats: Arc<Stats>,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The clients in `tasks` order, by kind, for a failure message.
    order: String,
}

impl Load {
    pub async fn start(world: &World, shape: LoadShape) -> Self {
        let stats = Arc::new(Stats::default());
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        for c in 0..shape.keepalive {
            tasks.push(tokio::spawn(keepalive_client(
                world.http,
                c,
                shape.pace,
                stats.clone(),
                stop_rx.clone(),
            )));
        }
        for c in 0..shape.new_conns {
            tasks.push(tokio::spawn(new_conn_client(
                world.http,
                c,
                shape.pace,
                stats.clone(),
                stop_rx.clone(),
            )));
        }
        for c in 0..shape.h2 {
            tasks.push(tokio::spawn(h2_client(
                world.http,
                c,
                shape.pace,
                stats.clone(),
                stop_rx.clone(),
            )));
        }
        for c in 0..shape.echo {
            tasks.push(tokio::spawn(echo_client(
                world.tcp,
                c as u64,
                shape.pace,
                stats.clone(),
                stop_rx.clone(),
            )));
        }
        if let Some(out) = world.mtls_out {
            for c in 0..shape.mtls_echo {
                tasks.push(tokio::spawn(echo_client(
                    out,
                    200 + c as u64,
                    shape.pace,
                    stats.clone(),
                    stop_rx.clone(),
                )));
            }
        }
        if let Some((addr, ca)) = &world.tls {
            for c in 0..shape.https {
                tasks.push(tokio::spawn(https_client(
                    *addr,
                    ca.clone(),
                    c,
                    shape.pace,
                    stats.clone(),
                    stop_rx.clone(),
                )));
            }
            for (c, v) in (0..shape.tls12)
                .map(|c| (c, &rustls::version::TLS12))
                .chain((0..shape.tls13).map(|c| (100 + c, &rustls::version::TLS13)))
            {
                tasks.push(tokio::spawn(tls_echo_client(
                    *addr,
                    ca.clone(),
                    v,
                    c as u64,
                    shape.pace,
                    stats.clone(),
                    stop_rx.clone(),
                )));
            }
        }
        let order = format!(
            "keepalive {}, new_conns {}, h2 {}, echo {}, mtls_echo {}, https {}, tls12 {}, tls13 {}",
            shape.keepalive,
            shape.new_conns,
            shape.h2,
            shape.echo,
            if world.mtls_out.is_some() {
                shape.mtls_echo
            } else {
                0
            },
            if world.tls.is_some() { shape.https } else { 0 },
            if world.tls.is_some() { shape.tls12 } else { 0 },
            if world.tls.is_some() { shape.tls13 } else { 0 },
        );
        Self {
            stats,
            stop,
            tasks,
            order,
        }
    }

    /// Stops every client (each finishes its current exchange and, for echo
    /// streams, half-closes and checks the complete tail).
    pub async fn finish(self) -> Arc<Stats> {
        let _ = self.stop.send(true);
        let n = self.tasks.len();
        // Every exchange has its own limit (a stall is reported by the
        // client itself, naming the exchange); this only catches a client
        // that went on making progress too slowly to finish.
        let limit = EXCHANGE_TIMEOUT * 3;
        for (i, mut t) in self.tasks.into_iter().enumerate() {
            if tokio::time::timeout(limit, &mut t).await.is_err() {
                t.abort();
                // Clients are numbered in this order.
                self.stats.fail(format!(
                    "load client #{i} of {n} did not finish within {limit:?} (order: {})",
                    self.order
                ));
            }
        }
        self.stats
    }
}

async fn keepalive_client(
    addr: SocketAddr,
    c: usize,
    pace: Duration,
    stats: Arc<Stats>,
    stop: watch::Receiver<bool>,
) {
    let who = Who::new("keepalive", c as u64, addr);
    let r = async {
        let stream = stats
            .exchange(&who, "connect", async {
                TcpStream::connect(addr).await.map_err(|e| e.to_string())
            })
            .await?;
        who.connected(&stream);
        let (mut sender, conn) = stats
            .exchange(&who, "handshake", async {
                hyper::client::conn::http1::handshake(TokioIo::new(stream))
                    .await
                    .map_err(|e| e.to_string())
            })
            .await?;
        tokio::spawn(conn);
        let mut seq = 0u64;
        while !*stop.borrow() {
            seq += 1;
            let path = format!("/ka/{c}/{seq}");
            let (s, body) = stats
                .exchange(
                    &who,
                    &format!("GET {path}"),
                    keepalive_get(&mut sender, &path),
                )
                .await?;
            if s != 200 || body != path.as_bytes() {
                return Err(format!(
                    "{who}: GET {path}: {s} {:?}",
                    String::from_utf8_lossy(&body)
                ));
            }
            stats.ok.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(pace).await;
        }
        Ok::<(), String>(())
    }
    .await;
    if let Err(e) = r {
        stats.fail(e);
    }
}

async fn new_conn_client(
    addr: SocketAddr,
    c: usize,
    pace: Duration,
    stats: Arc<Stats>,
    stop: watch::Receiver<bool>,
) {
    let mut seq = 0u64;
    while !*stop.borrow() {
        seq += 1;
        let path = format!("/nc/{c}/{seq}");
        // A new connection each time: its own local port in the messages.
        let who = Who::new("new-conn", c as u64, addr);
        let r = stats
            .exchange(&who, &format!("connect + GET {path}"), async {
                let stream = TcpStream::connect(addr)
                    .await
                    .map_err(|e| format!("connect: {e}"))?;
                who.connected(&stream);
                let (mut sender, conn) =
                    hyper::client::conn::http1::handshake(TokioIo::new(stream))
                        .await
                        .map_err(|e| e.to_string())?;
                tokio::spawn(conn);
                let req = Request::get(&path)
                    .header("host", "upstream")
                    .header("connection", "close")
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
                let status = resp.status();
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?
                    .to_bytes();
                Ok((status, body))
            })
            .await;
        match r {
            Ok((s, body)) if s == 200 && body == path.as_bytes() => {
                stats.ok.fetch_add(1, Ordering::Relaxed);
            }
            Ok((s, body)) => stats.fail(format!(
                "{who}: GET {path}: {s} {:?}",
                String::from_utf8_lossy(&body)
            )),
            Err(e) => stats.fail(e),
        }
        tokio::time::sleep(pace).await;
    }
}

async fn h2_client(
    addr: SocketAddr,
    c: usize,
    pace: Duration,
    stats: Arc<Stats>,
    stop: watch::Receiver<bool>,
) {
    // A pooling client: after GOAWAY it opens a new connection (to whichever
    // process accepts it), as compliant HTTP/2 clients do. Its connections'
    // local ports come from the responses (the last one is the one in use).
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let who = Who::new("h2", c as u64, addr);
    let mut seq = 0u64;
    while !*stop.borrow() {
        seq += 1;
        let path = format!("/h2/{c}/{seq}");
        let uri: http::Uri = format!("http://{addr}{path}").parse().unwrap();
        let mut attempts = 0;
        let r = loop {
            attempts += 1;
            let r = stats
                .exchange(&who, &format!("GET {path} (attempt {attempts})"), async {
                    let req = Request::get(uri.clone())
                        .body(Full::new(Bytes::new()))
                        .unwrap();
                    let resp = client.request(req).await.map_err(|e| format!("{e:?}"))?;
                    if let Some(info) = resp
                        .extensions()
                        .get::<hyper_util::client::legacy::connect::HttpInfo>()
                    {
                        who.local_port
                            .store(info.local_addr().port(), Ordering::Relaxed);
                    }
                    let status = resp.status();
                    let body = resp
                        .into_body()
                        .collect()
                        .await
                        .map_err(|e| e.to_string())?
                        .to_bytes();
                    Ok((status, body))
                })
                .await;
            // RFC 9113 §6.8: a stream above the GOAWAY's last-stream-id was
            // not processed, so a client retries it on a new connection
            // (the upstream's duplicate check proves it was not processed).
            match &r {
                Err(e)
                    if attempts < 3 && (e.contains("GoAway(") || e.contains("REFUSED_STREAM")) =>
                {
                    stats.h2_retries.fetch_add(1, Ordering::Relaxed);
                }
                _ => break r,
            }
        };
        match r {
            Ok((s, body)) if s == 200 && body == path.as_bytes() => {
                stats.ok.fetch_add(1, Ordering::Relaxed);
            }
            Ok((s, body)) => stats.fail(format!(
                "{who}: GET {path}: {s} {:?}",
                String::from_utf8_lossy(&body)
            )),
            Err(e) => stats.fail(e),
        }
        tokio::time::sleep(pace).await;
    }
}

/// One long-lived TCP stream through the sidecar to the echo server: writes
/// a deterministic stream in random-sized chunks while reading the echo back
/// and comparing every byte; at the end half-closes and expects exactly the
/// bytes sent, then EOF.
async fn echo_client(
    addr: SocketAddr,
    c: u64,
    pace: Duration,
    stats: Arc<Stats>,
    stop: watch::Receiver<bool>,
) {
    let kind = if c >= 200 { "mtls-echo" } else { "echo" };
    let who = Who::new(kind, c, addr);
    let r = async {
        let stream = stats
            .exchange(&who, "connect", async {
                TcpStream::connect(addr).await.map_err(|e| e.to_string())
            })
            .await?;
        who.connected(&stream);
        echo_session(stream, &who, c, pace, &stats, stop).await
    }
    .await;
    match r {
        Ok(n) => {
            stats.echo_bytes.fetch_add(n, Ordering::Relaxed);
        }
        Err(e) => stats.fail(e),
    }
}

/// The echo stream of [`echo_client`]. Every write and every read has its
/// own time limit: the writer sends a chunk every `pace`, so a read that
/// waits [`EXCHANGE_TIMEOUT`] for bytes (or, after the half-close, for the
/// EOF) is a stall, and so is a write that long (the flow stopped and the
/// buffers filled).
pub async fn echo_session(
    stream: TcpStream,
    who: &Who,
    seed: u64,
    pace: Duration,
    stats: &Stats,
    mut stop: watch::Receiver<bool>,
) -> Result<u64, String> {
    let (mut r, mut w) = stream.into_split();
    let sent_so_far = AtomicU64::new(0);
    let writer = async {
        let mut p = Pattern::new(seed);
        let mut sent = 0u64;
        let mut round = 0u64;
        loop {
            if *stop.borrow() {
                break;
            }
            round += 1;
            let len = 1 + ((round * 7919 + seed * 104_729) % 8192) as usize;
            let mut buf = vec![0u8; len];
            p.fill(&mut buf);
            stats
                .exchange(who, &format!("write {len} B after {sent} B"), async {
                    w.write_all(&buf).await.map_err(|e| e.to_string())
                })
                .await?;
            sent += len as u64;
            sent_so_far.store(sent, Ordering::Relaxed);
            tokio::select! {
                _ = tokio::time::sleep(pace) => {}
                _ = stop.changed() => {}
            }
        }
        stats
            .exchange(who, &format!("half-close after {sent} B"), async {
                w.shutdown().await.map_err(|e| e.to_string())
            })
            .await?;
        Ok::<u64, String>(sent)
    };
    let reader = async {
        let mut p = Pattern::new(seed);
        let mut got = 0u64;
        let mut buf = vec![0u8; 16 * 1024];
        let mut want = vec![0u8; 16 * 1024];
        loop {
            let what = format!(
                "read echo after {got} of {} B sent",
                sent_so_far.load(Ordering::Relaxed)
            );
            let n = stats
                .exchange(who, &what, async {
                    r.read(&mut buf).await.map_err(|e| e.to_string())
                })
                .await?;
            if n == 0 {
                return Ok::<u64, String>(got);
            }
            p.fill(&mut want[..n]);
            if buf[..n] != want[..n] {
                return Err(format!("{who}: byte mismatch at offset {got}"));
            }
            got += n as u64;
        }
    };
    let (sent, got) = tokio::join!(writer, reader);
    let (sent, got) = (sent?, got?);
    if sent != got {
        return Err(format!("{who}: sent {sent} bytes, echoed {got}"));
    }
    Ok(sent)
}

pub fn path_exists(p: &Path) -> bool {
    p.exists()
}

/// A TLS stream through the sidecar's mesh-TLS listener to the echo server,
/// lockstep (write a chunk, read it back, compare); TLS 1.3 clients also
/// refresh their traffic keys now and then (a KeyUpdate the sidecar must
/// follow, before or after a move). Ends with close_notify both ways.
async fn tls_echo_client(
    addr: SocketAddr,
    ca: rustls_pki_types::CertificateDer<'static>,
    version: &'static rustls::SupportedProtocolVersion,
    c: u64,
    pace: Duration,
    stats: Arc<Stats>,
    stop: watch::Receiver<bool>,
) {
    let kind = if version.version == rustls::ProtocolVersion::TLSv1_3 {
        "tls13-echo"
    } else {
        "tls12-echo"
    };
    let who = Who::new(kind, c, addr);
    let r = async {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca).map_err(|e| e.to_string())?;
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[version])
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = stats
            .exchange(&who, "connect", async {
                TcpStream::connect(addr).await.map_err(|e| e.to_string())
            })
            .await?;
        who.connected(&tcp);
        // The mesh marker (SNI): these clients stand in for a peer sidecar;
        // a ClientHello without it is the application's own TLS.
        let name =
            rustls_pki_types::ServerName::try_from(baton_sidecar::client_hello::MESH_SERVER_NAME)
                .unwrap();
        let mut s = stats
            .exchange(&who, "TLS handshake", async {
                tokio_rustls::TlsConnector::from(Arc::new(cfg))
                    .connect(name, tcp)
                    .await
                    .map_err(|e| e.to_string())
            })
            .await?;
        let tls13 = s.get_ref().1.protocol_version() == Some(rustls::ProtocolVersion::TLSv1_3);
        let (mut tx, mut rx) = (Pattern::new(c + 7), Pattern::new(c + 7));
        let mut total = 0u64;
        let mut round = 0u64;
        while !*stop.borrow() {
            round += 1;
            if tls13 && round.is_multiple_of(25) && round >= 50 {
                s.get_mut()
                    .1
                    .refresh_traffic_keys()
                    .map_err(|e| e.to_string())?;
            }
            let len = 1 + ((round * 6007 + c * 31) % 4096) as usize;
            let mut out = vec![0u8; len];
            tx.fill(&mut out);
            let mut back = vec![0u8; len];
            stats
                .exchange(&who, &format!("echo {len} B after {total} B"), async {
                    s.write_all(&out).await.map_err(|e| format!("write: {e}"))?;
                    s.flush().await.map_err(|e| format!("flush: {e}"))?;
                    s.read_exact(&mut back)
                        .await
                        .map_err(|e| format!("read: {e}"))?;
                    Ok(())
                })
                .await?;
            let mut want = vec![0u8; len];
            rx.fill(&mut want);
            if back != want {
                return Err(format!("{who}: byte mismatch after {total} B"));
            }
            total += len as u64;
            tokio::time::sleep(pace).await;
        }
        let rest = stats
            .exchange(
                &who,
                &format!("close_notify both ways after {total} B"),
                async {
                    s.shutdown()
                        .await
                        .map_err(|e| format!("close_notify: {e}"))?;
                    let mut rest = Vec::new();
                    s.read_to_end(&mut rest)
                        .await
                        .map_err(|e| format!("close: {e}"))?;
                    Ok(rest)
                },
            )
            .await?;
        if !rest.is_empty() {
            return Err(format!("{who}: {} unexpected bytes at close", rest.len()));
        }
        Ok::<u64, String>(total)
    }
    .await;
    match r {
        Ok(n) => {
            stats.echo_bytes.fetch_add(n, Ordering::Relaxed);
            stats.tls_bytes.fetch_add(n, Ordering::Relaxed);
        }
        Err(e) => stats.fail(e),
    }
}

/// HTTP/1.1 keep-alive over TLS (ALPN `http/1.1`): one TLS connection, every
/// response checked; the connection moves as TLS + HTTP/1.1 between requests.
async fn https_client(
    addr: SocketAddr,
    ca: rustls_pki_types::CertificateDer<'static>,
    c: usize,
    pace: Duration,
    stats: Arc<Stats>,
    stop: watch::Receiver<bool>,
) {
    let who = Who::new("https", c as u64, addr);
    let r = async {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca).map_err(|e| e.to_string())?;
        let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tcp = stats
            .exchange(&who, "connect", async {
                TcpStream::connect(addr).await.map_err(|e| e.to_string())
            })
            .await?;
        who.connected(&tcp);
        // The mesh marker (SNI): these clients stand in for a peer sidecar;
        // a ClientHello without it is the application's own TLS.
        let name =
            rustls_pki_types::ServerName::try_from(baton_sidecar::client_hello::MESH_SERVER_NAME)
                .unwrap();
        let (mut sender, conn) = stats
            .exchange(&who, "TLS + HTTP/1.1 handshake", async {
                let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
                    .connect(name, tcp)
                    .await
                    .map_err(|e| format!("TLS: {e}"))?;
                hyper::client::conn::http1::handshake(TokioIo::new(tls))
                    .await
                    .map_err(|e| e.to_string())
            })
            .await?;
        tokio::spawn(conn);
        let mut seq = 0u64;
        while !*stop.borrow() {
            seq += 1;
            let path = format!("/tls/{c}/{seq}");
            let (status, body) = stats
                .exchange(
                    &who,
                    &format!("GET {path}"),
                    keepalive_get(&mut sender, &path),
                )
                .await?;
            if status != 200 || body != path.as_bytes() {
                return Err(format!(
                    "{who}: GET {path}: {status} {:?}",
                    String::from_utf8_lossy(&body)
                ));
            }
            stats.ok.fetch_add(1, Ordering::Relaxed);
            stats.https_ok.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(pace).await;
        }
        Ok::<(), String>(())
    }
    .await;
    if let Err(e) = r {
        stats.fail(e);
    }
}

/// An HTTP/1.1 keep-alive client connection.
pub type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// A keep-alive HTTP/1.1 connection to `addr`.
pub async fn connect(addr: std::net::SocketAddr) -> Sender {
    let s = TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

/// One GET on `sender`; whether it returned 200 with a whole body.
pub async fn get(sender: &mut Sender, path: &str) -> bool {
    if sender.ready().await.is_err() {
        return false;
    }
    let req = Request::get(path)
        .header("host", "x")
        .body(Full::new(Bytes::new()))
        .unwrap();
    match sender.send_request(req).await {
        Ok(r) => r.status() == 200 && r.into_body().collect().await.is_ok(),
        Err(_) => false,
    }
}

/// One `GET path` on a keep-alive HTTP/1.1 connection: status and body.
async fn keepalive_get(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    path: &str,
) -> Result<(hyper::StatusCode, Bytes), String> {
    sender.ready().await.map_err(|e| e.to_string())?;
    let req = Request::get(path)
        .header("host", "upstream")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, body))
}

/// A test knob from the environment (longer soak runs), else `default`.
pub fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Waits up to `within` for the sidecar process to exit.
pub async fn wait_exit(s: &mut Sidecar, within: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok(Some(st)) = s.child.try_wait() {
            return Some(st);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// The world's `/metrics` text, retried briefly while a handoff swaps the
/// admin socket's owner.
pub async fn metrics(world: &World) -> String {
    for _ in 0..50 {
        if let Ok((200, body)) = admin_get(world.admin, "/metrics").await {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no /metrics answer");
}
