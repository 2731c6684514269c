//! The two sides of a handoff, wired to the data plane.
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

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_crds::contract;
use bytes::Bytes;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};

use baton_handoff::conn::{
    BoxIo, ConnKind, ConnMeta, ConnRegistry, Detached, Parked, ParkedAt, ParkedIo, SessionDetach,
};
use baton_handoff::plane::{CarriedCounters, DataPlane, Inherited, Phase, Resumed, Serving};
pub use baton_handoff::plane::{IdentityCarrier, IdentityPem};
use baton_handoff::protocol::{
    Batch, Channel, ConnKind as WireKind, ConnectionHeader, Frame, ListenerInfo, Message,
    ProtocolError, Receiver, Sender, StateSnapshot, UPSTREAM_TLS_SINCE, VersionRange, negotiate,
};
use baton_handoff::sched::{on_own_thread, yield_cpu};
use baton_tls_record::{AeadKind, TLS12, TLS13, TlsRecordStream, TlsWireState};

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

/// Where and how this process hands off.
#[derive(Clone)]
pub struct HandoffConfig {
    pub socket: PathBuf,
    pub status_file: PathBuf,
    /// Longest wait for the peer's next step before the handoff fails.
    pub step_timeout: Duration,
    /// Longest wait for in-flight requests to reach a safe point.
    pub park_timeout: Duration,
    pub versions: VersionRange,
    pub sidecar_version: String,
    /// Testing knob (0 in production): pause before each adoption step.
    pub test_step_delay: Duration,
    /// Carries the certificate and key across (the TLS layer).
    pub identity: Option<Arc<dyn IdentityCarrier>>,
    /// Takes parked TLS sessions apart so they can move (the TLS layer);
    /// without it a boxed (TLS) connection finishes in this process.
    pub sessions: Option<Arc<dyn SessionDetach>>,
    /// UIDs besides this process's effective UID that may take over on the
    /// handoff socket (see [`peer_allowed`]); empty in the injected Pod.
    pub peer_uids: Vec<u32>,
    /// Why this process must not take over from a live sidecar (offload
    /// Required but no working engine in this slot, e.g. the device is
    /// held by the other slot's container): it then leaves the serving
    /// sidecar untouched and [`run`] fails with the reason.
    pub adopt_refusal: Option<String>,
}

impl std::fmt::Debug for HandoffConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandoffConfig")
            .field("socket", &self.socket)
            .field("status_file", &self.status_file)
            .field("step_timeout", &self.step_timeout)
            .field("park_timeout", &self.park_timeout)
            .field("versions", &self.versions)
            .field("identity", &self.identity.is_some())
            .field("peer_uids", &self.peer_uids)
            .field("adopt_refusal", &self.adopt_refusal)
            .finish_non_exhaustive()
    }
}

impl HandoffConfig {
    /// Paths and timeouts from the environment (see `contract::env`),
    /// defaulting to the shared volume's paths; `sidecar_version` is the
    /// release this process runs (what the peer logs and the status shows).
    pub fn from_env(sidecar_version: &str) -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let ms = |k: &str, d: u64| {
            Duration::from_millis(var(k).and_then(|v| v.parse().ok()).unwrap_or(d))
        };
        let versions = var(contract::env::HANDOFF_PROTOCOL_RANGE)
            .and_then(|v| {
                let (a, b) = v.split_once('-')?;
                Some(VersionRange {
                    min: a.trim().parse().ok()?,
                    max: b.trim().parse().ok()?,
                })
            })
            .unwrap_or_else(VersionRange::this_build);
        Self {
            socket: var(contract::env::HANDOFF_SOCKET)
                .unwrap_or_else(|| contract::volumes::HANDOFF_SOCKET.into())
                .into(),
            status_file: var(contract::env::HANDOFF_STATUS_FILE)
                .unwrap_or_else(|| contract::volumes::HANDOFF_STATUS_FILE.into())
                .into(),
            step_timeout: ms(contract::env::HANDOFF_TIMEOUT_MS, 10_000),
            park_timeout: ms(contract::env::HANDOFF_PARK_TIMEOUT_MS, 30_000),
            versions,
            sidecar_version: sidecar_version.to_string(),
            test_step_delay: ms(contract::env::HANDOFF_TEST_STEP_DELAY_MS, 0),
            identity: None,
            sessions: None,
            peer_uids: var(contract::env::HANDOFF_PEER_UIDS)
                .map(|v| parse_uids(&v))
                .unwrap_or_default(),
            adopt_refusal: None,
        }
    }

    pub fn with_identity(mut self, identity: Arc<dyn IdentityCarrier>) -> Self {
        self.identity = Some(identity);
        self
    }

    pub fn with_sessions(mut self, sessions: Arc<dyn SessionDetach>) -> Self {
        self.sessions = Some(sessions);
        self
    }

    /// See [`HandoffConfig::adopt_refusal`].
    pub fn with_adopt_refusal(mut self, reason: Option<String>) -> Self {
        self.adopt_refusal = reason;
        self
    }
}

/// Pure: the UIDs of `BATON_HANDOFF_PEER_UIDS`. An entry that is not a
/// number is logged and ignored (it can only narrow who may take over).
fn parse_uids(v: &str) -> Vec<u32> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .filter_map(|s| match s.parse() {
            Ok(uid) => Some(uid),
            Err(_) => {
                tracing::warn!(
                    entry = s,
                    "{}: not a UID; ignored",
                    contract::env::HANDOFF_PEER_UIDS
                );
                None
            }
        })
        .collect()
}

/// Pure: whether a process with `peer_uid` may take over from a sidecar
/// running as `own_uid`. Whoever completes a handoff receives every live
/// connection, the TLS session keys and the mesh private key, so only the
/// sidecar's own UID (and UIDs listed explicitly) may; an application
/// container that mounts the shared volume runs under another UID.
pub fn peer_allowed(peer_uid: u32, own_uid: u32, extra: &[u32]) -> bool {
    peer_uid == own_uid || extra.contains(&peer_uid)
}

type StaticLabels = Vec<(&'static str, &'static str)>;

/// The handoff's metric families (same registry, `baton_sidecar_` prefix).
#[derive(Debug, Clone)]
pub struct HandoffMetrics {
    /// 1 once this process completed adopting from a previous one.
    pub complete: Gauge,
    /// `role` = old/new, `result` = complete/refused/refused_peer/failed
    /// (`refused_peer`: the connecting process runs under another UID).
    pub handoffs: Family<StaticLabels, Counter>,
    /// `outcome` = moved (acknowledged by the new process), kept (resumed
    /// here: not movable or the handoff failed), drained (HTTP/2: GOAWAY).
    pub connections: Family<StaticLabels, Counter>,
    pub last_duration_ms: Gauge,
    /// New process: how long each adopted connection went unread, from the
    /// moment the old process's task stopped reading it to the moment this
    /// process's event loop took it over. A request that arrived meanwhile
    /// waited that long.
    pub pause: Histogram,
}

/// Pause buckets, seconds: 1-2-5 steps from 100 µs to 10 s (the default step
/// timeout), so even a stalled handoff's connections land in a bucket.
const PAUSE_BUCKETS: [f64; 16] = [
    0.000_1, 0.000_2, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
    10.0,
];

/// Where [`HandoffMetrics::register`] adds its families: the process
/// registry (the data plane's may note counter families on the way, as the
/// sidecar's does for carried counters).
pub trait MetricRegistry {
    fn register(&mut self, name: &str, help: &str, metric: impl Metric);
}

impl MetricRegistry for Registry {
    fn register(&mut self, name: &str, help: &str, metric: impl Metric) {
        Registry::register(self, name, help, metric);
    }
}

impl Default for HandoffMetrics {
    fn default() -> Self {
        Self {
            complete: Gauge::default(),
            handoffs: Family::default(),
            connections: Family::default(),
            last_duration_ms: Gauge::default(),
            pause: Histogram::new(PAUSE_BUCKETS),
        }
    }
}

impl HandoffMetrics {
    /// Adds the families to `r` (unprefixed names; the registry's prefix
    /// applies).
    pub fn register(&self, r: &mut impl MetricRegistry) {
        r.register(
            "handoff_complete",
            "1 once this process completed a handoff as the new process",
            self.complete.clone(),
        );
        r.register(
            "handoffs",
            "Handoffs by role and result",
            self.handoffs.clone(),
        );
        r.register(
            "handoff_connections",
            "Connections at a handoff, by outcome",
            self.connections.clone(),
        );
        r.register(
            "handoff_last_duration_milliseconds",
            "Duration of the last handoff this process took part in",
            self.last_duration_ms.clone(),
        );
        r.register(
            "handoff_connection_pause_seconds",
            "Adopted connections: time unread between the old process's safe point and this process's event loop",
            self.pause.clone(),
        );
    }

    fn handoff(&self, role: &'static str, result: &'static str) {
        self.handoffs
            .get_or_create(&vec![("role", role), ("result", result)])
            .inc();
    }

    fn conn(&self, outcome: &'static str) {
        self.connections
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }
}

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

/// Serializable [`ConnMeta`] (ids are per process and not carried).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct MetaWire {
    listener: String,
    peer: SocketAddr,
    local: SocketAddr,
    #[serde(default)]
    original_dst: Option<SocketAddr>,
    #[serde(default)]
    peer_identity: Option<String>,
    #[serde(default)]
    alpn: Option<Vec<u8>>,
    #[serde(default)]
    tls: bool,
}

impl MetaWire {
    fn from_meta(m: &ConnMeta) -> Self {
        Self {
            listener: m.listener.to_string(),
            peer: m.peer,
            local: m.local,
            original_dst: m.original_dst,
            peer_identity: m.peer_identity.clone(),
            alpn: m.alpn.clone(),
            tls: m.tls,
        }
    }

    fn into_meta(self, id: u64) -> ConnMeta {
        ConnMeta {
            id,
            listener: Arc::from(self.listener),
            peer: self.peer,
            local: self.local,
            original_dst: self.original_dst,
            peer_identity: self.peer_identity,
            alpn: self.alpn,
            tls: self.tls,
        }
    }
}

/// One end (downstream or upstream) of a connection being resumed.
enum End {
    /// A socket; with the record-layer state (and the ciphertext received
    /// but not yet decrypted) when a TLS session continues on it.
    Raw(TcpStream, Option<Box<(TlsWireState, Vec<u8>)>>),
    /// A session another layer boxed (TLS), taken apart only through
    /// [`SessionDetach`].
    Boxed(BoxIo),
}

impl End {
    fn from_parked(io: ParkedIo) -> Self {
        match io {
            ParkedIo::Tcp(t) => End::Raw(t, None),
            ParkedIo::Boxed(b) => End::Boxed(b),
        }
    }

    /// Stops a TLS session at a record boundary and turns it into a socket
    /// plus record state; also returns the plaintext decrypted but not yet
    /// read. `Err` gives the end back when it cannot move (not at a record
    /// boundary, or no layer to take it apart); `Ok(None)` means the session
    /// turned out to be broken.
    async fn extract(
        self,
        conn: u64,
        sessions: Option<&dyn SessionDetach>,
    ) -> Result<Option<(Self, Vec<u8>)>, Self> {
        let b = match self {
            End::Raw(..) => return Ok(Some((self, Vec::new()))),
            End::Boxed(b) => b,
        };
        let Some(sessions) = sessions else {
            return Err(End::Boxed(b));
        };
        match sessions.detach(b, conn).await {
            Detached::Moved {
                tcp,
                state,
                ciphertext,
                plaintext,
            } => Ok(Some((
                End::Raw(tcp, Some(Box::new((*state, ciphertext)))),
                plaintext,
            ))),
            Detached::Stays(b) => Err(End::Boxed(b)),
            Detached::Broken => Ok(None),
        }
    }

    /// The stream to serve this end with in this process: a socket with TLS
    /// state continues on our record layer.
    fn into_io(self, conn: u64) -> Option<ParkedIo> {
        Some(match self {
            End::Raw(tcp, None) => ParkedIo::Tcp(tcp),
            End::Raw(tcp, Some(sealed)) => {
                let (state, ciphertext) = *sealed;
                match TlsRecordStream::new(tcp, &state, ciphertext, Vec::new()) {
                    Ok(s) => ParkedIo::Boxed(Box::new(s)),
                    Err(e) => {
                        tracing::error!(conn, error = %e, "cannot resume the TLS record layer; connection closed");
                        return None;
                    }
                }
            }
            End::Boxed(b) => ParkedIo::Boxed(b),
        })
    }
}

/// A connection stopped at a safe point, ready to be resumed (here or, once
/// both ends are raw sockets, in the next process).
struct Resumable {
    meta: ConnMeta,
    kind: WireKind,
    down: End,
    up: Option<End>,
    /// Plaintext read from downstream, not yet consumed (for HTTP/1: the
    /// pipelined bytes hyper read ahead).
    to_upstream: Bytes,
    to_downstream: Bytes,
    /// When its task stopped reading it (on the old process); `None` from a
    /// peer that does not say.
    paused_since: Option<Instant>,
}

impl Resumable {
    fn from_parked(p: ParkedAt) -> Option<Self> {
        let paused_since = Some(p.at);
        match p.parked {
            Parked::Tcp {
                meta,
                downstream,
                upstream,
                to_upstream,
                to_downstream,
            } => Some(Self {
                meta,
                kind: WireKind::Tcp,
                down: End::from_parked(downstream),
                up: Some(End::from_parked(upstream)),
                to_upstream,
                to_downstream,
                paused_since,
            }),
            Parked::Http1 {
                meta,
                downstream,
                unread,
            } => Some(Self {
                meta,
                kind: WireKind::Http1,
                down: End::from_parked(downstream),
                up: None,
                to_upstream: unread,
                to_downstream: Bytes::new(),
                paused_since,
            }),
            Parked::Draining => None,
        }
    }

    /// Turns both ends into raw sockets plus record state, so the
    /// connection can be sent. `Err` gives the connection back when an end
    /// is not at a record boundary (it then finishes in this process; an
    /// end already extracted continues on our record layer); `Ok(None)`
    /// means the connection turned out to be broken.
    async fn extract_tls(
        mut self,
        sessions: Option<&dyn SessionDetach>,
    ) -> Result<Option<Self>, Self> {
        let id = self.meta.id;
        let down = match self.down.extract(id, sessions).await {
            Ok(Some((end, plain))) => {
                // rustls decrypted these after everything the data plane holds.
                append(&mut self.to_upstream, &plain);
                end
            }
            Ok(None) => return Ok(None),
            Err(end) => {
                self.down = end;
                return Err(self);
            }
        };
        self.down = down;
        if let Some(up) = self.up.take() {
            match up.extract(id, sessions).await {
                Ok(Some((end, plain))) => {
                    append(&mut self.to_downstream, &plain);
                    self.up = Some(end);
                }
                Ok(None) => return Ok(None),
                Err(end) => {
                    self.up = Some(end);
                    return Err(self);
                }
            }
        }
        Ok(Some(self))
    }

    /// Builds a connection received from the previous process.
    fn from_frame(
        h: &ConnectionHeader,
        blob: Vec<u8>,
        fds: Vec<OwnedFd>,
        id: u64,
    ) -> Result<Self, String> {
        let want = match h.kind {
            WireKind::Tcp => 2,
            WireKind::Http1 => 1,
        };
        if fds.len() != want {
            return Err(format!(
                "{:?} connection needs {want} descriptors, got {}",
                h.kind,
                fds.len()
            ));
        }
        for t in h.tls.iter().chain(h.up_tls.as_deref()) {
            // Check the state now so a bad one is declined, not adopted.
            AeadKind::from_name(&t.aead).map_err(|e| e.to_string())?;
            if t.version != TLS12 && t.version != TLS13 {
                return Err(format!("unsupported TLS version 0x{:04x}", t.version));
            }
        }
        if h.up_tls.is_some() && h.kind != WireKind::Tcp {
            return Err("upstream TLS state on a connection without an upstream".into());
        }
        let lens = [
            h.to_upstream_len,
            h.to_downstream_len,
            h.tls_ciphertext_len,
            h.up_tls_ciphertext_len,
        ];
        if lens.iter().map(|&l| l as usize).sum::<usize>() != blob.len() {
            return Err(format!(
                "blob of {} bytes does not match its parts {lens:?}",
                blob.len()
            ));
        }
        let meta: MetaWire =
            serde_json::from_value(h.meta.clone()).map_err(|e| format!("bad meta: {e}"))?;
        let mut fds = fds.into_iter();
        let tcp = |fd: OwnedFd| -> Result<TcpStream, String> {
            let s = std::net::TcpStream::from(fd);
            s.set_nonblocking(true).map_err(|e| e.to_string())?;
            TcpStream::from_std(s).map_err(|e| e.to_string())
        };
        let down = tcp(fds.next().expect("counted"))?;
        let up = match fds.next() {
            Some(fd) => Some(tcp(fd)?),
            None => None,
        };
        let mut blob = Bytes::from(blob);
        let mut take = |n: u32| blob.split_to(n as usize);
        let to_upstream = take(h.to_upstream_len);
        let to_downstream = take(h.to_downstream_len);
        let down_ct = take(h.tls_ciphertext_len);
        let up_ct = take(h.up_tls_ciphertext_len);
        Ok(Self {
            meta: meta.into_meta(id),
            kind: h.kind,
            down: End::Raw(down, h.tls.clone().map(|t| Box::new((t, down_ct.to_vec())))),
            up: up.map(|u| End::Raw(u, h.up_tls.clone().map(|t| Box::new((*t, up_ct.to_vec()))))),
            to_upstream,
            to_downstream,
            paused_since: monotonic::to_instant(h.parked_at_ns),
        })
    }
}

/// `CLOCK_MONOTONIC`, which both processes of a pod read alike (one kernel,
/// no time namespace), as nanoseconds on the wire: `Instant` is that clock
/// but does not expose it.
mod monotonic {
    use std::time::{Duration, Instant};

    fn now_ns() -> Option<u64> {
        let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).ok()?;
        Some(t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
    }

    /// `t` on the wire; 0 if the clock cannot be read.
    pub(super) fn to_ns(t: Instant) -> u64 {
        now_ns().map_or(0, |now| now.saturating_sub(t.elapsed().as_nanos() as u64))
    }

    /// Back from the wire: `None` for 0 (a peer that did not send it) and for
    /// anything in the future or over a minute old (not the same clock).
    pub(super) fn to_instant(ns: u64) -> Option<Instant> {
        let now = now_ns()?;
        if ns == 0 || ns > now || now - ns > 60_000_000_000 {
            return None;
        }
        Instant::now().checked_sub(Duration::from_nanos(now - ns))
    }
}

fn append(to: &mut Bytes, more: &[u8]) {
    if !more.is_empty() {
        let mut all = to.to_vec();
        all.extend_from_slice(more);
        *to = Bytes::from(all);
    }
}

/// Serve a resumed connection in this process (the data plane registers
/// and counts it). A TLS session whose secrets were extracted continues on
/// our record layer.
fn spawn_resumed(serving: &Arc<dyn Serving>, r: Resumable) {
    // Called on the handoff's thread: the connection belongs to the runtime
    // that serves (its sockets register there, its task runs there).
    let _rt = serving.runtime().enter();
    let Some(down) = r.down.into_io(r.meta.id) else {
        return;
    };
    let up = match r.up.map(|u| u.into_io(r.meta.id)) {
        None => None,
        Some(None) => return,
        Some(Some(io)) => Some(io),
    };
    serving.clone().resume(Resumed {
        kind: r.kind,
        meta: r.meta,
        down,
        up,
        to_upstream: r.to_upstream,
        to_downstream: r.to_downstream,
    });
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
    // The old process's certificate, for new handshakes until our own
    // arrives (a failure leaves us on our own source, as on a fresh start).
    if let (Some(carrier), Some(cert_chain), Some(key), Some(trust_bundle)) = (
        &cfg.identity,
        state.cert_chain_pem,
        state.private_key_pem,
        state.trust_bundle_pem,
    ) {
        // Whatever the TLS layer sets up belongs to the serving runtime.
        let _rt = serving.enter();
        match carrier.import(&IdentityPem {
            cert_chain,
            key,
            trust_bundle,
        }) {
            Ok(true) => tracing::info!("handoff: serving with the carried mesh certificate"),
            Ok(false) => tracing::debug!("handoff: carried mesh certificate not needed"),
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
                if let Some(rx) = shared.registry().park(id, upstream_tls) {
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

/// Appends connection `id`'s frame to `batch`; its sockets stay open (in
/// `pending`) until the batch is sent and acknowledged.
fn push_connection(batch: &mut Batch, id: u64, r: &Resumable) -> Result<(), ProtocolError> {
    let raw = |e: &End| -> (RawFd, Option<TlsWireState>, Vec<u8>) {
        let End::Raw(tcp, tls) = e else {
            unreachable!("only raw sockets are sent (extract_tls ran)")
        };
        match tls.as_deref() {
            Some((state, ct)) => (tcp.as_raw_fd(), Some(state.clone()), ct.clone()),
            None => (tcp.as_raw_fd(), None, Vec::new()),
        }
    };
    let (down_fd, tls, down_ct) = raw(&r.down);
    let mut fds = vec![down_fd];
    let (up_tls, up_ct) = match r.up.as_ref().map(raw) {
        Some((fd, state, ct)) => {
            fds.push(fd);
            (state, ct)
        }
        None => (None, Vec::new()),
    };
    let parts: [&[u8]; 4] = [&r.to_upstream, &r.to_downstream, &down_ct, &up_ct];
    let mut blob = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
    for p in parts {
        blob.extend_from_slice(p);
    }
    let header = ConnectionHeader {
        id,
        kind: r.kind,
        to_upstream_len: r.to_upstream.len() as u32,
        to_downstream_len: r.to_downstream.len() as u32,
        tls_ciphertext_len: down_ct.len() as u32,
        tls,
        up_tls_ciphertext_len: up_ct.len() as u32,
        up_tls: up_tls.map(Box::new),
        meta: serde_json::to_value(MetaWire::from_meta(&r.meta)).unwrap_or_default(),
        parked_at_ns: r.paused_since.map_or(0, monotonic::to_ns),
    };
    batch.push(&Message::Connection(header), &blob, &fds)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: WireKind, tls: Option<TlsWireState>) -> ConnectionHeader {
        ConnectionHeader {
            id: 1,
            kind,
            to_upstream_len: 2,
            to_downstream_len: 1,
            tls_ciphertext_len: 0,
            up_tls: None,
            up_tls_ciphertext_len: 0,
            tls,
            meta: serde_json::to_value(MetaWire {
                listener: "outbound".into(),
                peer: "127.0.0.1:1".parse().unwrap(),
                local: "127.0.0.1:2".parse().unwrap(),
                original_dst: None,
                peer_identity: Some("spiffe://td/ns/a/sa/b".into()),
                alpn: None,
                tls: false,
            })
            .unwrap(),
            parked_at_ns: 0,
        }
    }

    #[test]
    fn only_the_sidecars_own_uid_and_listed_uids_may_take_over() {
        assert!(peer_allowed(1337, 1337, &[]));
        assert!(!peer_allowed(1000, 1337, &[]));
        // Root is no exception: an application container running as root
        // is exactly who must not pull the keys out.
        assert!(!peer_allowed(0, 1337, &[]));
        assert!(peer_allowed(1338, 1337, &[1338]));
        assert!(!peer_allowed(1000, 1337, &[1338]));
        assert_eq!(parse_uids(" 1338, x,,0 "), vec![1338, 0]);
    }

    #[tokio::test]
    async fn a_socket_from_this_process_carries_its_own_uid_so_a_successor_passes() {
        // Our own UID passes the check; the refusal path is covered with a
        // real process under another UID in tests/admin_access.rs.
        let (a, _b) = UnixStream::pair().unwrap();
        let c = a.peer_cred().unwrap();
        assert!(peer_allowed(c.uid(), nix::unistd::geteuid().as_raw(), &[]));
    }

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

    #[test]
    fn a_pause_start_survives_the_wire_and_nonsense_is_ignored() {
        let t = Instant::now() - Duration::from_millis(3);
        let back = monotonic::to_instant(monotonic::to_ns(t)).expect("a recent instant");
        // Same clock, read twice: off by the time between two reads, not by
        // a unit or an epoch (the bound is loose so a preempted read passes).
        let off = if back > t { back - t } else { t - back };
        assert!(off < Duration::from_millis(100), "{off:?}");
        assert!(monotonic::to_instant(0).is_none(), "not sent");
        let now = monotonic::to_ns(Instant::now());
        assert!(
            monotonic::to_instant(now + 60_000_000_000).is_none(),
            "future"
        );
        if now > 120_000_000_000 {
            assert!(
                monotonic::to_instant(now - 120_000_000_000).is_none(),
                "stale"
            );
        }
    }

    fn fds(n: usize) -> Vec<OwnedFd> {
        (0..n)
            .map(|_| OwnedFd::from(std::net::TcpListener::bind("127.0.0.1:0").unwrap()))
            .collect()
    }

    #[tokio::test]
    async fn a_connection_with_the_wrong_number_of_descriptors_is_declined() {
        let err = Resumable::from_frame(&header(WireKind::Tcp, None), b"abc".to_vec(), fds(1), 7)
            .err()
            .unwrap();
        assert!(err.contains("needs 2 descriptors"), "{err}");
    }

    #[tokio::test]
    async fn a_tls_connection_with_an_unknown_cipher_or_version_is_declined() {
        let d = baton_tls_record::DirectionSecrets {
            seq: 0,
            key: vec![0; 16],
            iv: vec![0; 12],
            traffic_secret: None,
        };
        let mut t = TlsWireState {
            version: TLS13,
            aead: "rc4".into(),
            tx: d.clone(),
            rx: d,
            server: true,
        };
        let err = Resumable::from_frame(
            &header(WireKind::Http1, Some(t.clone())),
            b"abc".to_vec(),
            fds(1),
            7,
        )
        .err()
        .unwrap();
        assert!(err.contains("rc4"), "{err}");
        t.aead = "aes_128_gcm".into();
        t.version = 0x0301;
        assert!(
            Resumable::from_frame(
                &header(WireKind::Http1, Some(t)),
                b"abc".to_vec(),
                fds(1),
                7
            )
            .is_err()
        );
    }

    #[tokio::test]
    async fn a_received_connection_keeps_its_metadata_and_splits_its_bytes() {
        let r = Resumable::from_frame(&header(WireKind::Tcp, None), b"upd".to_vec(), fds(2), 9)
            .ok()
            .unwrap();
        assert_eq!((r.meta.id, &*r.meta.listener), (9, "outbound"));
        assert_eq!(
            r.meta.peer_identity.as_deref(),
            Some("spiffe://td/ns/a/sa/b")
        );
        assert_eq!(
            (&r.to_upstream[..], &r.to_downstream[..]),
            (&b"up"[..], &b"d"[..])
        );
        assert!(matches!(r.down, End::Raw(_, None)));
        assert!(matches!(r.up, Some(End::Raw(_, None))));
    }

    fn secrets() -> TlsWireState {
        let d = baton_tls_record::DirectionSecrets {
            seq: 3,
            key: vec![1; 16],
            iv: vec![2; 12],
            traffic_secret: None,
        };
        TlsWireState {
            version: TLS13,
            aead: "aes_128_gcm".into(),
            tx: d.clone(),
            rx: d,
            server: false,
        }
    }

    #[tokio::test]
    async fn an_upstream_tls_session_gets_its_state_and_the_last_part_of_the_blob() {
        let mut h = header(
            WireKind::Tcp,
            Some(TlsWireState {
                server: true,
                ..secrets()
            }),
        );
        h.tls_ciphertext_len = 2;
        h.up_tls = Some(Box::new(secrets()));
        h.up_tls_ciphertext_len = 3;
        let r = Resumable::from_frame(&h, b"updDDuuu".to_vec(), fds(2), 9)
            .ok()
            .unwrap();
        assert_eq!(
            (&r.to_upstream[..], &r.to_downstream[..]),
            (&b"up"[..], &b"d"[..])
        );
        let End::Raw(_, Some(sealed)) = &r.down else {
            panic!("downstream TLS state")
        };
        let (down, down_ct) = &**sealed;
        assert!(down.server && down_ct == b"DD");
        let Some(End::Raw(_, Some(sealed))) = &r.up else {
            panic!("upstream TLS state")
        };
        let (up, up_ct) = &**sealed;
        assert!(!up.server && up_ct == b"uuu");
    }

    #[tokio::test]
    async fn inconsistent_upstream_tls_frames_are_declined() {
        // Upstream state on an HTTP/1 connection (it has no upstream socket).
        let mut h = header(WireKind::Http1, None);
        h.up_tls = Some(Box::new(secrets()));
        let err = Resumable::from_frame(&h, b"upd".to_vec(), fds(1), 1)
            .err()
            .unwrap();
        assert!(err.contains("without an upstream"), "{err}");
        // A blob that does not match the lengths its header announces.
        let mut h = header(WireKind::Tcp, None);
        h.up_tls = Some(Box::new(secrets()));
        h.up_tls_ciphertext_len = 10;
        let err = Resumable::from_frame(&h, b"upd".to_vec(), fds(2), 1)
            .err()
            .unwrap();
        assert!(err.contains("does not match"), "{err}");
    }

    #[test]
    fn the_test_knobs_default_to_off_and_the_contract_paths() {
        let c = HandoffConfig::from_env("test");
        if std::env::var(contract::env::HANDOFF_SOCKET).is_err() {
            assert_eq!(c.socket, PathBuf::from(contract::volumes::HANDOFF_SOCKET));
        }
        if std::env::var(contract::env::HANDOFF_PROTOCOL_RANGE).is_err() {
            assert_eq!(c.versions, VersionRange::this_build());
        }
    }
}
