//! The connections a handoff moves: every live downstream connection in a
//! registry, how one is asked to stop at a safe point, and what it hands
//! back.
//!
//! * [`ConnMeta`]: the facts about a connection that travel with it
//!   (listener, addresses, TLS peer identity, ALPN).
//! * [`ConnRegistry`]: every live downstream connection with its id, kind
//!   and a control channel. The old side of a handoff asks a connection to
//!   *park* — stop at a safe point and hand back its sockets plus any bytes
//!   read but not yet consumed — through [`ConnRegistry::park`]; the data
//!   plane registers each connection it serves and answers the request at
//!   its own safe points ([`ParkRequest::answer`]).
//! * [`ParkedIo`], [`ParkableIo`], [`SessionDetach`]: what a parked end is,
//!   and how the layer that boxed a stream (TLS) takes its session apart
//!   for a move, so the handoff never needs that layer's concrete types.
//!
//! Safe points, per kind (the data plane's; see `docs/upgrade.md`): raw TCP
//! parks between two reads/writes (anything read but not written is
//! returned); HTTP/1 parks when no request is in flight (pipelined bytes
//! already read are returned); HTTP/2 parks when no stream is open and the
//! client has emptied its HPACK table (docs/decisions/0060, 0062: the
//! carried state is [`Parked::Http2`]), and otherwise — a stream outliving
//! [`ParkRequest::http2_until`], or a peer that cannot take HTTP/2 — sends
//! GOAWAY and drains ([`Parked::Draining`]).

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{Notify, oneshot};

use baton_tls_record::TlsWireState;

/// Per-connection facts: what the data plane's filters look at, and what
/// travels with a connection to the next process (all but `id`, which is
/// per process). The TLS layer fills `peer_identity` (verified SPIFFE URI
/// of the client certificate) and `alpn`; plaintext connections leave them
/// `None`.
#[derive(Debug, Clone)]
pub struct ConnMeta {
    pub id: u64,
    pub listener: Arc<str>,
    pub peer: SocketAddr,
    pub local: SocketAddr,
    /// Original destination (`SO_ORIGINAL_DST`) in transparent mode.
    pub original_dst: Option<SocketAddr>,
    pub peer_identity: Option<String>,
    pub alpn: Option<Vec<u8>>,
    pub tls: bool,
}

impl ConnMeta {
    /// Port the client meant to reach: original destination, else ours.
    pub fn dst_port(&self) -> u16 {
        self.original_dst.unwrap_or(self.local).port()
    }
}

/// Object-safe async stream (TLS streams are passed around boxed).
/// `Any` so the layer that boxed a stream can recognize it again (the TLS
/// layer, when it takes a parked session apart: [`SessionDetach`]).
pub trait DynIo: Any + AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> DynIo for T {}

/// A boxed downstream stream (e.g. a TLS stream produced by the TLS layer).
pub type BoxIo = Box<dyn DynIo>;

/// The transport of a parked connection end.
pub enum ParkedIo {
    /// A plain socket.
    Tcp(TcpStream),
    /// A stream another layer boxed (a TLS session); only that layer can
    /// take it apart ([`SessionDetach`]).
    Boxed(BoxIo),
}

impl std::fmt::Debug for ParkedIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParkedIo::Tcp(t) => f.debug_tuple("Tcp").field(t).finish(),
            ParkedIo::Boxed(_) => f.write_str("Boxed(..)"),
        }
    }
}

/// A boxed parked end taken apart by [`SessionDetach::detach`].
pub enum Detached {
    /// Stopped at a TLS record boundary: the socket, the record-layer state,
    /// the ciphertext read from the socket but not decrypted, and the
    /// plaintext decrypted but not read yet. Another process can continue
    /// the session from these (`baton_tls_record`).
    Moved {
        tcp: TcpStream,
        state: Box<TlsWireState>,
        ciphertext: Vec<u8>,
        plaintext: Vec<u8>,
    },
    /// Not at a record boundary, or not a session this layer can take apart:
    /// the stream, unchanged, to finish in this process.
    Stays(BoxIo),
    /// The session turned out to be broken; it is closed.
    Broken,
}

/// Takes apart the boxed sessions of parked connections for a handoff. The
/// layer that boxed them (TLS) implements it; the handoff calls it, so it
/// depends on this trait, not on the TLS layer's stream types.
pub trait SessionDetach: Send + Sync {
    /// Stops `io` at a record boundary (flushing what it still has to send)
    /// and takes it apart; `conn` is for the logs.
    fn detach(&self, io: BoxIo, conn: u64) -> Pin<Box<dyn Future<Output = Detached> + Send>>;
}

/// Streams a parked connection can be handed back as.
pub trait ParkableIo: AsyncRead + AsyncWrite + Send + Unpin + 'static {
    /// The underlying transport (a `TcpStream` for plaintext connections;
    /// whatever the TLS layer boxed otherwise) and any bytes this wrapper had
    /// buffered but not yet returned to a reader.
    fn into_parked(self) -> (ParkedIo, Bytes);
}

impl ParkableIo for TcpStream {
    fn into_parked(self) -> (ParkedIo, Bytes) {
        (ParkedIo::Tcp(self), Bytes::new())
    }
}

impl ParkableIo for BoxIo {
    fn into_parked(self) -> (ParkedIo, Bytes) {
        (ParkedIo::Boxed(self), Bytes::new())
    }
}

/// What a connection currently is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ConnKind {
    Detecting = 0,
    Tcp = 1,
    Http1 = 2,
    Http2 = 3,
    /// TLS handshake in progress (after it, the kind becomes the inner
    /// protocol and [`ConnEntry::tls`] stays true).
    Tls = 4,
}

impl ConnKind {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => ConnKind::Tcp,
            2 => ConnKind::Http1,
            3 => ConnKind::Http2,
            4 => ConnKind::Tls,
            _ => ConnKind::Detecting,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ConnKind::Detecting => "detecting",
            ConnKind::Tcp => "tcp",
            ConnKind::Http1 => "http1",
            ConnKind::Http2 => "http2",
            ConnKind::Tls => "tls",
        }
    }
}

/// A connection handed back by [`ConnRegistry::park`]. The connection's task
/// has stopped touching the sockets; the receiver owns them.
#[derive(Debug)]
pub enum Parked {
    /// Raw TCP proxy: both sockets plus bytes read from one side and not yet
    /// written to the other.
    Tcp {
        meta: ConnMeta,
        /// A socket for plaintext, the TLS layer's boxed stream otherwise.
        downstream: ParkedIo,
        /// A socket for a plain upstream, the TLS layer's boxed client
        /// stream for an originated mesh-mTLS one.
        upstream: ParkedIo,
        /// Read from downstream, not yet written upstream.
        to_upstream: Bytes,
        /// Read from upstream, not yet written downstream.
        to_downstream: Bytes,
    },
    /// HTTP/1 between requests: the socket plus pipelined bytes already read.
    Http1 {
        meta: ConnMeta,
        downstream: ParkedIo,
        unread: Bytes,
    },
    /// HTTP/2 with no stream open and both directions at a frame boundary:
    /// the socket, the client bytes read but not given to `h2` yet, and the
    /// connection's state outside `h2` (the data plane's encoding; the
    /// handoff carries it opaquely).
    Http2 {
        meta: ConnMeta,
        downstream: ParkedIo,
        unread: Bytes,
        state: Bytes,
    },
    /// The connection cannot move (HTTP/2 past its deadline or to a peer
    /// that cannot take it, or mid-upgrade): it was told to
    /// finish (GOAWAY / close after the current exchange) and will end on
    /// its own.
    Draining,
}

/// A parked connection and the moment its task stopped: from then on
/// nothing reads it until a process resumes it (the pause the handoff
/// metrics measure).
#[derive(Debug)]
pub struct ParkedAt {
    pub parked: Parked,
    pub at: std::time::Instant,
}

/// A request to park, sent to a connection's task.
#[derive(Debug)]
pub struct ParkRequest {
    reply: oneshot::Sender<ParkedAt>,
    /// Whether the receiving process can continue an originated TLS session
    /// to the upstream (handoff protocol 2). When it cannot, a raw TCP
    /// connection with such an upstream answers [`Parked::Draining`].
    pub upstream_tls: bool,
    /// Whether the receiving process can take an HTTP/2 connection
    /// (protocol 3), and until when an HTTP/2 connection may wait for its
    /// safe point before it falls back to GOAWAY and drains. `None`: answer
    /// [`Parked::Draining`] at once.
    pub http2_until: Option<std::time::Instant>,
}

impl ParkRequest {
    /// A request, and where its answer arrives.
    pub fn new(upstream_tls: bool) -> (Self, oneshot::Receiver<ParkedAt>) {
        Self::with_http2(upstream_tls, None)
    }

    /// A request that lets HTTP/2 connections move until `http2_until`.
    pub fn with_http2(
        upstream_tls: bool,
        http2_until: Option<std::time::Instant>,
    ) -> (Self, oneshot::Receiver<ParkedAt>) {
        let (reply, rx) = oneshot::channel();
        (
            Self {
                reply,
                upstream_tls,
                http2_until,
            },
            rx,
        )
    }

    /// The connection's task hands itself over (stamped now).
    pub fn answer(self, parked: Parked) {
        let _ = self.reply.send(ParkedAt {
            parked,
            at: std::time::Instant::now(),
        });
    }
}

/// Registry entry for one live connection.
#[derive(Debug)]
pub struct ConnEntry {
    pub meta: ConnMeta,
    kind: AtomicU8,
    tls: std::sync::atomic::AtomicBool,
    park: Mutex<Option<oneshot::Sender<ParkRequest>>>,
}

impl ConnEntry {
    pub fn kind(&self) -> ConnKind {
        ConnKind::from_u8(self.kind.load(Ordering::Relaxed))
    }
    pub fn tls(&self) -> bool {
        self.tls.load(Ordering::Relaxed)
    }
}

/// Snapshot of one registry entry (for listing).
#[derive(Debug, Clone)]
pub struct ConnSummary {
    pub id: u64,
    pub kind: ConnKind,
    pub tls: bool,
    pub listener: Arc<str>,
    pub peer: SocketAddr,
}

/// Every live downstream connection of the process.
#[derive(Debug, Default)]
pub struct ConnRegistry {
    next_id: AtomicU64,
    conns: Mutex<HashMap<u64, Arc<ConnEntry>>>,
    emptied: Notify,
}

impl ConnRegistry {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            next_id: AtomicU64::new(1),
            ..Default::default()
        })
    }

    /// Fresh connection id (also used in logs).
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Add a connection; it stays registered while the guard lives. The
    /// receiver yields at most one park request.
    pub fn register(
        self: &Arc<Self>,
        meta: ConnMeta,
    ) -> (ConnGuard, oneshot::Receiver<ParkRequest>) {
        let (tx, rx) = oneshot::channel();
        let id = meta.id;
        let entry = Arc::new(ConnEntry {
            meta,
            kind: AtomicU8::new(ConnKind::Detecting as u8),
            tls: Default::default(),
            park: Mutex::new(Some(tx)),
        });
        self.lock().insert(id, entry.clone());
        (
            ConnGuard {
                registry: self.clone(),
                entry,
            },
            rx,
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<ConnEntry>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ids of every registered connection: what the handoff walks. Only
    /// ids, so the lock is held for one small copy, not one allocation per
    /// connection.
    pub fn ids(&self) -> Vec<u64> {
        self.lock().keys().copied().collect()
    }

    pub fn list(&self) -> Vec<ConnSummary> {
        self.lock()
            .values()
            .map(|e| ConnSummary {
                id: e.meta.id,
                kind: e.kind(),
                tls: e.tls(),
                listener: e.meta.listener.clone(),
                peer: e.meta.peer,
            })
            .collect()
    }

    /// Ask connection `id` to park. `None` if it is gone or was already
    /// asked; otherwise the receiver resolves with the parked connection (or
    /// is dropped if the connection ended first).
    pub fn park(&self, id: u64, upstream_tls: bool) -> Option<oneshot::Receiver<ParkedAt>> {
        self.park_with(id, upstream_tls, None)
    }

    /// [`Self::park`], letting an HTTP/2 connection move if it reaches its
    /// safe point before `http2_until` ([`ParkRequest::http2_until`]).
    pub fn park_with(
        &self,
        id: u64,
        upstream_tls: bool,
        http2_until: Option<std::time::Instant>,
    ) -> Option<oneshot::Receiver<ParkedAt>> {
        let entry = self.lock().get(&id).cloned()?;
        let tx = entry
            .park
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        let (req, rx) = ParkRequest::with_http2(upstream_tls, http2_until);
        tx.send(req).ok()?;
        Some(rx)
    }

    /// Resolves when no connection is registered.
    pub async fn wait_empty(&self) {
        loop {
            let notified = self.emptied.notified();
            if self.is_empty() {
                return;
            }
            notified.await;
        }
    }
}

/// Keeps a connection registered; updates its kind.
#[derive(Debug)]
pub struct ConnGuard {
    registry: Arc<ConnRegistry>,
    entry: Arc<ConnEntry>,
}

impl ConnGuard {
    pub fn set_kind(&self, kind: ConnKind) {
        self.entry.kind.store(kind as u8, Ordering::Relaxed);
    }
    pub fn set_tls(&self) {
        self.entry.tls.store(true, Ordering::Relaxed);
    }
    pub fn id(&self) -> u64 {
        self.entry.meta.id
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        let mut conns = self.registry.lock();
        conns.remove(&self.entry.meta.id);
        if conns.is_empty() {
            self.registry.emptied.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(id: u64) -> ConnMeta {
        ConnMeta {
            id,
            listener: Arc::from("l"),
            peer: "127.0.0.1:1".parse().unwrap(),
            local: "127.0.0.1:2".parse().unwrap(),
            original_dst: None,
            peer_identity: None,
            alpn: None,
            tls: false,
        }
    }

    #[tokio::test]
    async fn registry_tracks_parks_once_and_empties_on_drop() {
        let reg = ConnRegistry::new();
        let (g1, mut rx1) = reg.register(meta(1));
        let (g2, _rx2) = reg.register(meta(2));
        g1.set_kind(ConnKind::Http1);
        assert_eq!(reg.len(), 2);
        let kinds: Vec<_> = reg.list().into_iter().map(|s| (s.id, s.kind)).collect();
        assert!(kinds.contains(&(1, ConnKind::Http1)));
        let mut ids = reg.ids();
        ids.sort_unstable();
        assert_eq!(ids, [1, 2], "ids lists what list does");
        let reply = reg.park(1, true).expect("first park request is delivered");
        assert!(
            reg.park(1, true).is_none(),
            "a connection is asked to park only once"
        );
        let req = rx1.try_recv().unwrap();
        req.answer(Parked::Draining);
        assert!(matches!(reply.await.unwrap().parked, Parked::Draining));
        let waiter = tokio::spawn({
            let reg = reg.clone();
            async move { reg.wait_empty().await }
        });
        drop(g1);
        drop(g2);
        waiter.await.unwrap();
        assert!(reg.is_empty());
    }
}
