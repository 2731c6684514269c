//! The two sides of a handoff and their flow control, driving a data plane
//! through the traits of [`crate::plane`]: [`adopt`] in the new process,
//! [`hand_off`] in the old one.
//!
//! ```text
//!  new (adopting)                          old (serving → handing off)
//!  ── Hello{versions} ───────────────────▶  negotiate (Refuse → keep serving)
//!  ◀─────────────────── Welcome{version} ──  phase HandingOff
//!  ◀──────── Listeners (+ fds, incl. admin)
//!  ◀───── State{config, counters} ─────────
//!  start accept loops on the same sockets
//!  ── Accepting ─────────────────────────▶  pause own accept loops
//!  ◀── Connection{id, kind, bytes} (+fds) ─  park each connection at a safe
//!  ── Ack{id} ───────────────────────────▶  point; release it on Ack only
//!  ...                                      (concurrently, many in flight)
//!  ◀──────────────────── Done{n} ──────────
//!  ── Complete ──────────────────────────▶  phase Draining (HTTP/2 GOAWAY
//!  phase Serving, status file, metric       streams finish), then exit
//! ```
//!
//! Failure: if the new process dies or makes no progress for
//! `step_timeout`, the old shuts the socket down (from then on the new cannot
//! acknowledge anything), reads the acknowledgements that did arrive, resumes
//! every other parked connection itself, and accepts again. The new process
//! acknowledges a connection before it touches it, so each connection is
//! served by exactly one process.
//!
//! Threads: each side runs the protocol on a thread of its own at nice 10
//! ([`on_own_thread`]), so the event loop, still serving the
//! connections not moved yet (old) or already adopted (new), preempts it.
//! Connections always live on the event loop's runtime
//! ([`Serving::runtime`]); the handoff thread only moves them.
//!
//! Flow control (old side): at most [`PARK_WINDOW`] connections are asked
//! to park at once, and no more while [`IN_FLIGHT`] are parked or sent and
//! unacknowledged; the registry is walked in slices of [`LIST_SLICE`]. The
//! new side acknowledges in batches of at most [`ACK_BATCH`]. What happens to
//! one connection on the way is [`crate::transit`]'s.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};

use crate::config::{HandoffConfig, peer_allowed};
use crate::conn::{ConnKind, ConnRegistry, ParkedAt};
use crate::metrics::HandoffMetrics;
use crate::plane::{
    CarriedCounters, DataPlane, IdentityImportError, IdentityPem, Inherited, Phase, Serving,
};
use crate::protocol::{
    Batch, Channel, Frame, HTTP2_SINCE, ListenerInfo, Message, ProtocolError, Receiver, Sender,
    StateSnapshot, UPSTREAM_TLS_SINCE, negotiate,
};
use crate::sched::{on_own_thread, yield_cpu};
use crate::transit::{Resumable, push_connection, spawn_resumed};

/// Connections parked at once by the old process (see `hand_off_inner`).
/// A parked connection is frozen until the new process adopts it, so the
/// window bounds each connection's pause; the work is CPU-bound, so a small
/// window costs no throughput (measured: 8 beat 128 on both counts).
const PARK_WINDOW: usize = 8;

/// Connections parked or sent and not yet acknowledged, at most. The old
/// process parks more only as acknowledgements come back: without this it
/// parks and sends as fast as it can, and whenever the new process reads
/// more slowly (it does more per connection, and at nice 10 it yields to
/// any serving thread) the frames queue in the socket's buffer, each
/// connection frozen while it waits there (10,000 connections: mean pause
/// 2.3 ms, longest 5–10 ms). Sixteen keep the mean at 0.2 ms and the longest
/// at 1–2 ms, and 10,000 connections still move in a quarter of a second.
pub const IN_FLIGHT: usize = 2 * PARK_WINDOW;

/// Connections listed per slice when the old process walks its registry
/// (see `list_unasked`).
const LIST_SLICE: usize = 1024;

/// Connections the new process acknowledges in one write at most (fewer
/// when fewer frames arrived together): bounds how long the first of them
/// waits before it is served, and keeps a batch of acknowledgements (~1 KiB)
/// one kernel buffer, so the old process receives all of it or none of it
/// and a failed write never leaves it believing in an ack we gave up on.
const ACK_BATCH: usize = 32;

/// Listener name under which the admin socket travels (not a valid config
/// listener name, so it never collides).
pub const ADMIN_LISTENER: &str = "@admin";

/// The thread each side of a handoff runs on ([`on_own_thread`]).
const HANDOFF_THREAD: &str = "baton-handoff";

/// Its nice value: the event loop (nice 0, or what the sidecar was started
/// with) preempts it whenever a request arrives, as it does crypto threads.
const HANDOFF_NICE: i32 = 10;

#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The data plane did not start on the inherited sockets.
    #[error("{0}")]
    Start(Box<dyn std::error::Error + Send + Sync>),
    #[error("handoff I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl HandoffError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            HandoffError::Protocol(p) => p.metric_label(),
            HandoffError::Start(_) => "start",
            HandoffError::Io(_) => "io",
        }
    }
}

/// What the new process writes to the status file when it completes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HandoffStatus {
    /// `complete`.
    pub result: String,
    pub protocol_version: u32,
    pub from_version: String,
    pub to_version: String,
    pub listeners: usize,
    pub connections: u64,
    pub duration_ms: u64,
    /// Seconds since the Unix epoch.
    pub completed_at: u64,
    pub pid: u32,
}

fn write_status(path: &Path, status: &HandoffStatus) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec_pretty(status).map_err(std::io::Error::other)?,
    )?;
    std::fs::rename(&tmp, path)
}

async fn step_delay(cfg: &HandoffConfig) {
    if !cfg.test_step_delay.is_zero() {
        tokio::time::sleep(cfg.test_step_delay).await;
    }
}

async fn recv_within(rx: &mut Receiver, t: Duration) -> Result<Frame, ProtocolError> {
    tokio::time::timeout(t, rx.recv())
        .await
        .map_err(|_| ProtocolError::Timeout)?
}

fn unexpected(m: &Message) -> ProtocolError {
    ProtocolError::Unexpected(format!("{m:?}").chars().take(120).collect())
}

/// Connect to a live sidecar's handoff socket, if there is one.
pub async fn connect(path: &Path) -> Option<UnixStream> {
    match UnixStream::connect(path).await {
        Ok(s) => Some(s),
        Err(e) => {
            if e.kind() != std::io::ErrorKind::NotFound
                && e.kind() != std::io::ErrorKind::ConnectionRefused
            {
                tracing::warn!(path = %path.display(), error = %e, "handoff socket unusable; starting fresh");
            }
            None
        }
    }
}

/// Bind the handoff socket (replacing a stale one). `None` when its
/// directory does not exist (no shared volume: handoff disabled).
pub fn bind(path: &Path) -> Option<UnixListener> {
    if path
        .parent()
        .is_some_and(|d| !d.as_os_str().is_empty() && !d.is_dir())
    {
        tracing::info!(path = %path.display(), "no handoff directory; handoff disabled");
        return None;
    }
    let _ = std::fs::remove_file(path);
    match UnixListener::bind(path) {
        Ok(l) => Some(l),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot bind the handoff socket; handoff disabled");
            None
        }
    }
}

/// [`bind`], then make the socket connectable by its owner only (unless
/// other UIDs are allowed): processes of other users in the Pod cannot even
/// connect. Root bypasses file modes, hence the SO_PEERCRED check on every
/// connection as well (see `hand_off_here`).
pub fn bind_restricted(path: &Path, peer_uids: &[u32]) -> Option<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let l = bind(path)?;
    let mode = if peer_uids.is_empty() { 0o600 } else { 0o666 };
    if let Err(e) = std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)) {
        tracing::warn!(path = %path.display(), error = %e, "cannot restrict the handoff socket's mode");
    }
    Some(l)
}

/// New process: take over from the sidecar at the other end of `stream`.
/// `start` starts the data plane on what the old process hands over (its
/// sockets and config); returns that data plane (phase `Serving`) once the
/// old process has handed over everything.
///
/// The protocol runs on a thread of its own ([`HANDOFF_NICE`]); the data
/// plane it starts, and every connection it adopts, run on the caller's
/// runtime.
pub async fn adopt<P, F, Fut, E>(
    stream: UnixStream,
    start: F,
    cfg: &HandoffConfig,
    hm: &HandoffMetrics,
    counters: Arc<dyn CarriedCounters>,
) -> Result<P, HandoffError>
where
    P: DataPlane,
    F: FnOnce(Inherited) -> Fut + Send + 'static,
    Fut: Future<Output = Result<P, E>> + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    let serving = tokio::runtime::Handle::current();
    let stream = stream.into_std()?;
    let (cfg, hm) = (cfg.clone(), hm.clone());
    let start: StartFn<P> = Box::new(move |inherited| {
        Box::pin(async move {
            start(inherited)
                .await
                .map_err(|e| HandoffError::Start(e.into()))
        })
    });
    on_own_thread(HANDOFF_THREAD, HANDOFF_NICE, async move {
        // Registered with this thread's runtime: its reads wake this thread.
        let stream = UnixStream::from_std(stream)?;
        adopt_here(stream, start, &cfg, &hm, &*counters, serving).await
    })
    .await?
}

/// [`adopt`]'s `start`, boxed (run once, on the serving runtime).
type StartFn<P> = Box<
    dyn FnOnce(Inherited) -> std::pin::Pin<Box<dyn Future<Output = Result<P, HandoffError>> + Send>>
        + Send,
>;

async fn adopt_here<P: DataPlane>(
    stream: UnixStream,
    start: StartFn<P>,
    cfg: &HandoffConfig,
    hm: &HandoffMetrics,
    counters: &dyn CarriedCounters,
    serving: tokio::runtime::Handle,
) -> Result<P, HandoffError> {
    let started = Instant::now();
    // The other way round too: whoever can replace the socket file on the
    // shared volume must not be able to feed us listeners and config.
    let own = nix::unistd::geteuid().as_raw();
    let server = stream.peer_cred()?;
    if !peer_allowed(server.uid(), own, &cfg.peer_uids) {
        hm.handoff("new", "refused_peer");
        return Err(ProtocolError::Refused(format!(
            "the handoff socket is served by uid {}, not by a sidecar (uid {own}); not adopting",
            server.uid()
        ))
        .into());
    }
    let (tx, mut rx) = Channel::new(stream).split();
    tx.send(
        &Message::Hello {
            versions: cfg.versions,
            sidecar_version: cfg.sidecar_version.clone(),
        },
        b"",
        &[],
    )
    .await?;
    let (protocol_version, from_version) = match recv_within(&mut rx, cfg.step_timeout).await?.msg {
        Message::Welcome {
            protocol_version,
            sidecar_version,
        } => (protocol_version, sidecar_version),
        Message::Refuse { reason } => {
            hm.handoff("new", "refused");
            return Err(ProtocolError::Refused(reason).into());
        }
        m => return Err(unexpected(&m).into()),
    };
    tracing::info!(protocol_version, from = %from_version, "handoff: adopting");

    let f = recv_within(&mut rx, cfg.step_timeout).await?;
    let Message::Listeners { listeners } = &f.msg else {
        return Err(unexpected(&f.msg).into());
    };
    if listeners.len() != f.fds.len() {
        return Err(ProtocolError::MissingFds {
            expected: listeners.len(),
            got: f.fds.len(),
        }
        .into());
    }
    let n_listeners = listeners.len();
    let mut inherited = Inherited::default();
    for (info, fd) in listeners.iter().zip(f.fds) {
        let l = std::net::TcpListener::from(fd);
        l.set_nonblocking(true)?;
        if info.name == ADMIN_LISTENER {
            inherited.admin = Some(l);
        } else {
            inherited.listeners.insert(info.name.clone(), l);
        }
    }

    let f = recv_within(&mut rx, cfg.step_timeout).await?;
    let Message::State(state) = f.msg else {
        return Err(unexpected(&f.msg).into());
    };
    // The data plane serves exactly that until the next config push.
    inherited.config = state.config;
    // The old process's TLS policy, then its certificate for new
    // handshakes until our own arrives (a failure to read the certificate
    // leaves us on our own source, as on a fresh start). Both are in place
    // before the data plane starts: its first connection is served under
    // the policy and with the identity the old process served it with.
    if let Some(carrier) = &cfg.identity {
        let pem = match (
            state.cert_chain_pem,
            state.private_key_pem,
            state.trust_bundle_pem,
        ) {
            (Some(cert_chain), Some(key), Some(trust_bundle)) => Some(IdentityPem {
                cert_chain,
                key,
                trust_bundle,
            }),
            _ => None,
        };
        // Whatever the TLS layer sets up belongs to the serving runtime.
        let _rt = serving.enter();
        match carrier.import(&inherited.config, pem.as_ref()) {
            Ok(true) => tracing::info!("handoff: serving with the carried mesh certificate"),
            Ok(false) => tracing::debug!("handoff: carried mesh certificate not needed"),
            Err(e @ IdentityImportError::Policy(_)) => {
                hm.handoff("new", "refused_policy");
                return Err(ProtocolError::Refused(e.to_string()).into());
            }
            Err(e) => tracing::warn!(error = %e, "handoff: carried mesh certificate refused"),
        }
    }
    // Carried by series name: families registered later (the TLS layer's,
    // once attached) continue too.
    counters.import(&state.counters);

    step_delay(cfg).await;
    let running = serving
        .spawn(start(inherited))
        .await
        .map_err(|e| std::io::Error::other(format!("starting the data plane: {e}")))??;
    let shared = running.serving();
    let mut moved = 0u64;
    // From here on we serve: a failure leaves us with what we acknowledged
    // (the old process keeps the rest), never exits.
    let rest = async {
        // Accept loops run on the shared sockets now: the old may stop accepting.
        tx.send(&Message::Accepting, b"", &[]).await?;

        let mut next = 0u64;
        // Connections taken from frames already read, acknowledged together
        // (one write; the old process reads them in one go too).
        let mut acks = Batch::default();
        let mut adopted = Vec::new();
        loop {
            let f = match rx.try_recv()? {
                Some(f) => f,
                None => {
                    moved += acknowledge(&tx, &mut acks, &mut adopted, &shared, hm).await?;
                    recv_within(&mut rx, cfg.step_timeout).await?
                }
            };
            if acks.len() >= ACK_BATCH || !matches!(f.msg, Message::Connection(_)) {
                moved += acknowledge(&tx, &mut acks, &mut adopted, &shared, hm).await?;
            }
            match f.msg {
                Message::Connection(h) => {
                    next += 1;
                    // Its sockets register with the serving runtime.
                    let resumable = {
                        let _rt = shared.runtime().enter();
                        Resumable::from_frame(&h, f.blob, f.fds, next)
                    };
                    match resumable {
                        Ok(r) => {
                            step_delay(cfg).await;
                            acks.push(&Message::Ack { id: h.id }, b"", &[])?;
                            adopted.push(r);
                        }
                        Err(reason) => {
                            tracing::warn!(id = h.id, %reason, "handoff: connection refused; the old process keeps it");
                            acks.push(&Message::Nack { id: h.id, reason }, b"", &[])?;
                        }
                    }
                }
                Message::Done {
                    connections,
                    counters: delta,
                } => {
                    // Every connection before `Done` is acknowledged above.
                    counters.import(&delta);
                    tracing::info!(
                        offered = connections,
                        moved,
                        "handoff: all connections received"
                    );
                    break;
                }
                m => return Err(unexpected(&m)),
            }
        }
        tx.send(&Message::Complete, b"", &[]).await?;
        Ok::<(), ProtocolError>(())
    }
    .await;
    if let Err(e) = rest {
        tracing::error!(error = %e, moved, "handoff: old process stopped mid-handoff; serving what we adopted");
        hm.handoff("new", "failed");
        running.set_phase(Phase::Serving);
        return Ok(running);
    }
    let elapsed = started.elapsed();
    running.set_phase(Phase::Serving);
    hm.complete.set(1);
    hm.handoff("new", "complete");
    hm.last_duration_ms.set(elapsed.as_millis() as i64);
    let status = HandoffStatus {
        result: "complete".into(),
        protocol_version,
        from_version,
        to_version: cfg.sidecar_version.clone(),
        listeners: n_listeners,
        connections: moved,
        duration_ms: elapsed.as_millis() as u64,
        completed_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        pid: std::process::id(),
    };
    if let Ok(v) = serde_json::to_value(&status) {
        running.record_status(v);
    }
    if let Err(e) = write_status(&cfg.status_file, &status) {
        tracing::warn!(path = %cfg.status_file.display(), error = %e, "cannot write the handoff status file");
    }
    tracing::info!(
        connections = moved,
        ms = elapsed.as_millis() as u64,
        "handoff complete"
    );
    Ok(running)
}

/// New process: acknowledges what `acks` holds, then serves the connections
/// adopted with it; returns how many. Acknowledging before touching the
/// sockets is what makes a connection belong to exactly one process: once
/// the acks are written the old process has let go.
async fn acknowledge(
    tx: &Sender,
    acks: &mut Batch,
    adopted: &mut Vec<Resumable>,
    shared: &Arc<dyn Serving>,
    hm: &HandoffMetrics,
) -> Result<u64, ProtocolError> {
    if acks.is_empty() {
        return Ok(0);
    }
    tx.send_batch(&std::mem::take(acks)).await?;
    let n = adopted.len() as u64;
    // The batch goes to the serving runtime as one task, which spawns each
    // connection's there: one cross-thread wake-up per batch, not one per
    // connection (10,000 connections: a fifth less CPU in this process).
    let batch = std::mem::take(adopted);
    let serving = shared.clone();
    let pause = hm.pause.clone();
    shared.runtime().spawn(async move {
        for r in batch {
            // The event loop has it now: its pause ends here.
            if let Some(t) = r.paused_since {
                pause.observe(t.elapsed().as_secs_f64());
            }
            spawn_resumed(&serving, r);
        }
    });
    // Frames usually arrive faster than one socket op yields: let the
    // connections already adopted (and the request that just moved) run
    // between batches instead of after the whole handoff.
    yield_cpu();
    tokio::task::yield_now().await;
    Ok(n)
}

/// Old process: serve one handoff request. `Ok(true)`: everything was handed
/// over and this process should drain and exit; `Ok(false)`: refused, keep
/// serving; `Err`: failed, and this process already resumed serving.
///
/// The protocol runs on a thread of its own ([`HANDOFF_NICE`]), so the
/// connections not moved yet are served first; what it resumes here runs on
/// the caller's runtime.
pub async fn hand_off(
    stream: UnixStream,
    running: &Arc<dyn DataPlane>,
    cfg: &HandoffConfig,
    hm: &HandoffMetrics,
) -> Result<bool, HandoffError> {
    let stream = stream.into_std()?;
    let (running, cfg, hm) = (running.clone(), cfg.clone(), hm.clone());
    let out = on_own_thread(HANDOFF_THREAD, HANDOFF_NICE, {
        let running = running.clone();
        async move {
            let stream = UnixStream::from_std(stream)?;
            hand_off_here(stream, &*running, &cfg, &hm).await
        }
    })
    .await;
    match out {
        Ok(r) => r,
        Err(e) => {
            // The thread did not start, or panicked: serve again with what
            // this process still holds.
            tracing::error!(error = %e, "handoff thread failed; resuming service");
            resume_serving(&*running);
            Err(e.into())
        }
    }
}

/// Old process, after a failed handoff: accept again and say so. The
/// connections not handed over never stopped being served.
fn resume_serving(running: &dyn DataPlane) {
    if let Err(e) = running.resume_accepting() {
        tracing::error!(error = %e, "cannot restart accept loops");
    }
    running.set_phase(Phase::Serving);
}

async fn hand_off_here(
    stream: UnixStream,
    running: &dyn DataPlane,
    cfg: &HandoffConfig,
    hm: &HandoffMetrics,
) -> Result<bool, HandoffError> {
    let started = Instant::now();
    // Before reading a byte: only the sidecar's own UID may take over.
    let own = nix::unistd::geteuid().as_raw();
    let refusal = match stream.peer_cred() {
        Ok(c) if peer_allowed(c.uid(), own, &cfg.peer_uids) => None,
        Ok(c) => Some(format!(
            "peer uid {} (pid {}) is not the sidecar's uid {own}",
            c.uid(),
            c.pid().map_or_else(|| "?".to_string(), |p| p.to_string())
        )),
        Err(e) => Some(format!("peer credentials unavailable: {e}")),
    };
    let (tx, mut rx) = Channel::new(stream).split();
    if let Some(reason) = refusal {
        tracing::warn!(%reason, "handoff refused: the peer is not a sidecar of this Pod; still serving");
        let _ = tx.send(&Message::Refuse { reason }, b"", &[]).await;
        hm.handoff("old", "refused_peer");
        // Let the peer finish writing its Hello before we close (a close
        // under its write would turn our answer into EPIPE on its side);
        // bounded, and whatever it sent is dropped unread.
        let _ = tokio::time::timeout(Duration::from_secs(1), rx.recv()).await;
        return Ok(false);
    }
    let hello = recv_within(&mut rx, cfg.step_timeout).await?;
    let Message::Hello {
        versions,
        sidecar_version,
    } = hello.msg
    else {
        return Err(unexpected(&hello.msg).into());
    };
    let version = match negotiate(cfg.versions, versions) {
        Ok(v) => v,
        Err(reason) => {
            tracing::warn!(peer = %sidecar_version, %reason, "handoff refused; still serving");
            let _ = tx.send(&Message::Refuse { reason }, b"", &[]).await;
            hm.handoff("old", "refused");
            return Ok(false);
        }
    };
    tx.send(
        &Message::Welcome {
            protocol_version: version,
            sidecar_version: cfg.sidecar_version.clone(),
        },
        b"",
        &[],
    )
    .await?;
    running.set_phase(Phase::HandingOff);
    tracing::info!(peer = %sidecar_version, protocol_version = version, "handing off");

    match hand_off_inner(tx, rx, running, cfg, hm, version).await {
        Ok(()) => {
            hm.handoff("old", "complete");
            hm.last_duration_ms
                .set(started.elapsed().as_millis() as i64);
            Ok(true)
        }
        Err(e) => {
            tracing::error!(error = %e, "handoff failed; resuming service");
            hm.handoff("old", "failed");
            resume_serving(running);
            Err(e)
        }
    }
}

/// A connection sent to the new process and not yet acknowledged.
struct InFlight {
    resumable: Resumable,
}

async fn hand_off_inner(
    tx: Sender,
    rx: Receiver,
    running: &dyn DataPlane,
    cfg: &HandoffConfig,
    hm: &HandoffMetrics,
    version: u32,
) -> Result<(), HandoffError> {
    let shared = running.serving();
    // A version-1 peer cannot continue an originated TLS session: such
    // connections answer "draining" and finish here.
    let upstream_tls = version >= UPSTREAM_TLS_SINCE;
    // A version-2 peer cannot take an HTTP/2 connection: they drain here.
    // Otherwise one waits for its safe point until a little before the park
    // deadline, so its fallback (GOAWAY, counted) happens inside the
    // handoff and its counters travel with `Done`.
    let http2_until = (version >= HTTP2_SINCE).then(|| {
        let margin = (cfg.park_timeout / 10).min(Duration::from_secs(1));
        std::time::Instant::now() + cfg.park_timeout.saturating_sub(margin)
    });

    // Frames from the new process are read by their own task, so sending
    // (which may block on a full socket) never stops us reading acks.
    let (ev_tx, events) = mpsc::unbounded_channel();
    let mut events = Events(events);
    let reader = tokio::spawn(read_frames(rx, ev_tx));

    // Whatever happens next, this guard resumes what was not handed over.
    let mut pending: HashMap<u64, InFlight> = HashMap::new();
    // Outside the block: whatever is still parking when it ends (a long
    // request, or an error) must be resumed, never dropped.
    let mut parks = Parks::default();
    let result = async {
        // 1. Listeners, the admin socket last.
        let socks = running.listening_sockets()?;
        let admin = running.admin_socket()?;
        let mut infos = Vec::new();
        let mut fds = Vec::new();
        for (name, l) in &socks {
            infos.push(ListenerInfo { name: name.clone(), addr: l.local_addr()?.to_string() });
            fds.push(l.as_raw_fd());
        }
        infos.push(ListenerInfo { name: ADMIN_LISTENER.into(), addr: admin.local_addr()?.to_string() });
        fds.push(admin.as_raw_fd());
        tx.send(&Message::Listeners { listeners: infos }, b"", &fds).await?;
        drop(socks);
        drop(admin);

        // 2. State: the new process starts serving from it.
        let identity = cfg.identity.as_ref().and_then(|i| i.export());
        let state = StateSnapshot {
            config: shared.config(),
            cert_chain_pem: identity.as_ref().map(|i| i.cert_chain.clone()),
            private_key_pem: identity.as_ref().map(|i| i.key.clone()),
            trust_bundle_pem: identity.map(|i| i.trust_bundle),
            counters: shared.counters().export(),
        };
        let exported = state.counters.clone();
        tx.send(&Message::State(state), b"", &[]).await?;

        // 3. Stop accepting only once the new process accepts.
        match next_event(&mut events, cfg.step_timeout).await?.msg {
            Message::Accepting => {}
            m => return Err(unexpected(&m).into()),
        }
        running.pause_accepting();

        // 4. Connections: park up to PARK_WINDOW at a time, and no more
        // while IN_FLIGHT are parked or unacknowledged (a parked connection
        // is frozen until the new process adopts it, so both bounds keep
        // each one's pause short); send each as it reaches its safe point;
        // release it when acknowledged.
        let mut asked = std::collections::HashSet::new();
        let mut queue = std::collections::VecDeque::new();
        let mut draining = std::collections::HashSet::new();
        let ask_all = |parks: &mut Parks,
                       queue: &mut std::collections::VecDeque<u64>,
                       sent_unacked: usize| {
            while parks.len() < PARK_WINDOW && parks.len() + sent_unacked < IN_FLIGHT {
                let Some(id) = queue.pop_front() else { break };
                if let Some(rx) = shared.registry().park_with(id, upstream_tls, http2_until) {
                    parks.push(id, rx);
                }
            }
        };
        // The registry is listed (O(n)) only here and when everything asked
        // so far is done, never per connection.
        list_unasked(shared.registry(), &mut asked, &mut queue).await;
        ask_all(&mut parks, &mut queue, pending.len());
        let park_deadline = tokio::time::Instant::now() + cfg.park_timeout;
        // One buffer for every batch (see below).
        let mut batch = Batch::default();
        let mut sent = 0u64;
        let mut progress = tokio::time::Instant::now();
        let mut completed = false;
        loop {
            // Parks empty with a queue left: IN_FLIGHT are unacknowledged,
            // and the next ack asks more.
            if parks.is_empty() && queue.is_empty() {
                // Connections accepted just before the pause register a
                // moment later: look once more before declaring done.
                tokio::task::yield_now().await;
                list_unasked(shared.registry(), &mut asked, &mut queue).await;
                ask_all(&mut parks, &mut queue, pending.len());
                if parks.is_empty() && queue.is_empty() {
                    break;
                }
            }
            tokio::select! {
                joined = parks.next(), if !parks.is_empty() => {
                    let Some(joined) = joined else { continue };
                    progress = tokio::time::Instant::now();
                    // Every connection parked by now goes in one write.
                    // (Taken one at a time, not collected: in this process's
                    // heap, fragmented by the connections already let go,
                    // any allocation above the small cached sizes is slow.)
                    batch.clear();
                    let mut next = Some(joined);
                    while let Some(joined) = next.take().or_else(|| parks.try_next()) {
                        let (id, Some(parked)) = joined else { continue }; // ended on its own
                        match Resumable::from_parked(parked) {
                            None => {
                                hm.conn("drained");
                                draining.insert(id);
                            }
                            Some(r) => match r.extract_tls(cfg.sessions.as_deref()).await {
                                Ok(Some(r)) => {
                                    sent += 1;
                                    // Pending before sending: if the send fails,
                                    // the failure path below resumes it here.
                                    pending.insert(sent, InFlight { resumable: r });
                                    push_connection(&mut batch, sent, &pending[&sent].resumable)?;
                                }
                                Ok(None) => hm.conn("lost"),
                                Err(r) => {
                                    // Not at a record boundary: it finishes here.
                                    hm.conn("kept");
                                    spawn_resumed(&shared, r);
                                }
                            },
                        }
                    }
                    ask_all(&mut parks, &mut queue, pending.len());
                    tx.send_batch(&batch).await?;
                    // Serve the connections not yet moved between sends
                    // (see the adopting side).
                    yield_cpu();
                    tokio::task::yield_now().await;
                }
                ev = events.recv() => {
                    progress = tokio::time::Instant::now();
                    handle_ack(ev, &mut pending, &shared, hm, &mut completed)?;
                    ask_all(&mut parks, &mut queue, pending.len());
                }
                _ = tokio::time::sleep_until(park_deadline) => {
                    tracing::warn!(waiting = parks.len(), "handoff: requests still in flight at the park deadline; they finish here");
                    break;
                }
                _ = tokio::time::sleep_until(progress + cfg.step_timeout) => {
                    return Err(ProtocolError::Timeout.into());
                }
            }
        }
        // HTTP/2 connections got GOAWAY and finish their streams here; wait
        // (bounded) so what they count is in the final counters. Bounded
        // well inside the new process's step timeout (it waits for `Done`),
        // and not for raw TCP that stays here: it ends when its peers close.
        let drain_deadline =
            tokio::time::Instant::now() + cfg.park_timeout.min(cfg.step_timeout / 2);
        while tokio::time::Instant::now() < drain_deadline
            && shared
                .registry()
                .list()
                .iter()
                .any(|c| draining.contains(&c.id) && c.kind != ConnKind::Tcp)
        {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                ev = events.recv() => handle_ack(ev, &mut pending, &shared, hm, &mut completed)?,
            }
        }
        let now = shared.counters().export();
        let delta = now
            .into_iter()
            .filter_map(|(k, v)| {
                let d = v.saturating_sub(exported.get(&k).copied().unwrap_or(0));
                (d > 0).then_some((k, d))
            })
            .collect();
        tx.send(&Message::Done { connections: sent, counters: delta }, b"", &[]).await?;
        while !(completed && pending.is_empty()) {
            let ev = tokio::time::timeout(cfg.step_timeout, events.recv()).await.map_err(|_| ProtocolError::Timeout)?;
            handle_ack(ev, &mut pending, &shared, hm, &mut completed)?;
        }
        Ok::<(), HandoffError>(())
    }
    .await;

    // Late parks (long requests, or the handoff failed) resume here.
    if !parks.is_empty() {
        let shared = shared.clone();
        let hm = hm.clone();
        // Outlives this thread's runtime.
        shared.clone().runtime().spawn(async move {
            while let Some(j) = parks.next().await {
                if let (_, Some(p)) = j
                    && let Some(r) = Resumable::from_parked(p)
                {
                    hm.conn("kept");
                    spawn_resumed(&shared, r);
                }
            }
        });
    }
    if result.is_err() {
        // From here on the new process cannot acknowledge anything; what it
        // acknowledged before is still queued and is honoured.
        tx.shutdown();
        while let Some(ev) = events.recv().await {
            if let Ok(Frame {
                msg: Message::Ack { id },
                ..
            }) = ev
                && pending.remove(&id).is_some()
            {
                hm.conn("moved");
            }
        }
        for (_, f) in pending.drain() {
            hm.conn("kept");
            spawn_resumed(&shared, f.resumable);
        }
    }
    reader.abort();
    result
}

/// Frames from the new process, as the reader task received them.
///
/// Boxed on the channel: it stores items in blocks of 32, and a block of
/// unboxed frames is an allocation of several KiB, which the heap of an old
/// process that has just let go of thousands of connections serves slowly
/// (a tenth of its CPU at 10,000 connections); a box is a cached small size.
struct Events(mpsc::UnboundedReceiver<Box<Result<Frame, ProtocolError>>>);

impl Events {
    async fn recv(&mut self) -> Option<Result<Frame, ProtocolError>> {
        self.0.recv().await.map(|b| *b)
    }
}

/// The connections asked to park and not parked yet: at most
/// [`PARK_WINDOW`], so polling them all at each wake-up is cheap.
///
/// Plain futures, not tasks: a task per connection, spawned from the
/// handoff's thread on the serving runtime (where it must live should the
/// handoff end first), cost a cross-thread wake-up each. Futures are moved
/// there only in that case.
#[derive(Default)]
struct Parks(Vec<(u64, oneshot::Receiver<ParkedAt>)>);

impl Parks {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn push(&mut self, id: u64, rx: oneshot::Receiver<ParkedAt>) {
        self.0.push((id, rx));
    }

    /// The next connection to reach its safe point, with what its task
    /// handed over (`None`: it ended on its own); `None` when none is asked.
    /// Cancel-safe: a connection leaves the set only when returned.
    async fn next(&mut self) -> Option<(u64, Option<ParkedAt>)> {
        if self.0.is_empty() {
            return None;
        }
        std::future::poll_fn(|cx| {
            for i in 0..self.0.len() {
                if let std::task::Poll::Ready(r) = std::pin::Pin::new(&mut self.0[i].1).poll(cx) {
                    let (id, _) = self.0.swap_remove(i);
                    return std::task::Poll::Ready(Some((id, r.ok())));
                }
            }
            std::task::Poll::Pending
        })
        .await
    }

    /// Like [`Self::next`], without waiting.
    fn try_next(&mut self) -> Option<(u64, Option<ParkedAt>)> {
        for i in 0..self.0.len() {
            let parked = match self.0[i].1.try_recv() {
                Ok(p) => Some(p),
                Err(oneshot::error::TryRecvError::Closed) => None,
                Err(oneshot::error::TryRecvError::Empty) => continue,
            };
            let (id, _) = self.0.swap_remove(i);
            return Some((id, parked));
        }
        None
    }
}

/// Queues every registered connection not asked to park yet. The first
/// listing is the whole registry (10,000 connections: a few ms of hashing),
/// so it goes in slices, letting the connections it lists run in between.
async fn list_unasked(
    registry: &ConnRegistry,
    asked: &mut std::collections::HashSet<u64>,
    queue: &mut std::collections::VecDeque<u64>,
) {
    for ids in registry.ids().chunks(LIST_SLICE) {
        for &id in ids {
            if asked.insert(id) {
                queue.push_back(id);
            }
        }
        yield_cpu();
        tokio::task::yield_now().await;
    }
}

async fn read_frames(
    mut rx: Receiver,
    out: mpsc::UnboundedSender<Box<Result<Frame, ProtocolError>>>,
) {
    loop {
        let r = rx.recv().await;
        let end = r.is_err();
        if out.send(Box::new(r)).is_err() || end {
            return;
        }
    }
}

async fn next_event(events: &mut Events, t: Duration) -> Result<Frame, HandoffError> {
    match tokio::time::timeout(t, events.recv()).await {
        Err(_) => Err(ProtocolError::Timeout.into()),
        Ok(None) => Err(ProtocolError::Closed.into()),
        Ok(Some(r)) => Ok(r?),
    }
}

fn handle_ack(
    ev: Option<Result<Frame, ProtocolError>>,
    pending: &mut HashMap<u64, InFlight>,
    shared: &Arc<dyn Serving>,
    hm: &HandoffMetrics,
    completed: &mut bool,
) -> Result<(), HandoffError> {
    let frame = ev.ok_or(ProtocolError::Closed)??;
    match frame.msg {
        Message::Ack { id } => {
            // Dropping our copies of the sockets: the new process owns them.
            if pending.remove(&id).is_none() {
                return Err(
                    ProtocolError::Unexpected(format!("ack for unknown connection {id}")).into(),
                );
            }
            hm.conn("moved");
        }
        Message::Nack { id, reason } => {
            tracing::warn!(id, %reason, "new process declined a connection; serving it here");
            if let Some(f) = pending.remove(&id) {
                hm.conn("kept");
                spawn_resumed(shared, f.resumable);
            }
        }
        Message::Complete => *completed = true,
        m => return Err(unexpected(&m).into()),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::Parked;

    #[tokio::test]
    async fn parks_return_each_connection_once_and_a_cancelled_wait_loses_none() {
        let mut parks = Parks::default();
        assert!(parks.next().await.is_none(), "nothing asked");
        let (tx1, rx1) = oneshot::channel();
        let (tx2, rx2) = oneshot::channel();
        let (tx3, rx3) = oneshot::channel();
        parks.push(1, rx1);
        parks.push(2, rx2);
        parks.push(3, rx3);
        assert!(parks.try_next().is_none());
        // A wait cancelled before anything parked (a select! branch losing).
        assert!(
            tokio::time::timeout(Duration::from_millis(10), parks.next())
                .await
                .is_err()
        );
        assert_eq!(parks.len(), 3);
        let draining = || ParkedAt {
            parked: Parked::Draining,
            at: Instant::now(),
        };
        assert!(tx2.send(draining()).is_ok());
        let (id, parked) = parks.next().await.unwrap();
        assert_eq!(id, 2);
        assert!(matches!(
            parked,
            Some(ParkedAt {
                parked: Parked::Draining,
                ..
            })
        ));
        // A connection that ended on its own.
        drop(tx3);
        let (id, parked) = parks.try_next().unwrap();
        assert_eq!(id, 3);
        assert!(parked.is_none());
        // Parking from another task wakes the waiter.
        tokio::spawn(async move {
            tokio::task::yield_now().await;
            let _ = tx1.send(draining());
        });
        let (id, parked) = parks.next().await.unwrap();
        assert_eq!(id, 1);
        assert!(parked.is_some());
        assert!(parks.is_empty());
    }
}
