//! Downstream connection plumbing shared by the listeners, the TLS layer and
//! the handoff:
//!
//! * [`PrefixedIo`]: a stream with bytes already read (during protocol
//!   detection) put back in front, so protocol handlers see the whole stream.
//! * [`ConnRegistry`]: every live downstream connection with its id, kind and
//!   a control channel. The handoff asks a connection to *park* — stop at a
//!   safe point and hand back its sockets plus any bytes read but not yet
//!   consumed — through [`ConnRegistry::park`].
//!
//! Safe points, per kind (see `docs/performance.md` and the handoff docs):
//! raw TCP parks between two reads/writes (anything read but not written is
//! returned); HTTP/1 parks when no request is in flight (pipelined bytes
//! hyper already read are returned); HTTP/2 cannot park mid-connection and
//! answers by sending GOAWAY and draining.

use std::any::Any;
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, oneshot};

use crate::filters::ConnMeta;

/// Object-safe async stream (TLS streams are passed around boxed).
/// `Any` so a parked `BoxIo` can be downcast to its concrete stream (the
/// handoff extracts TLS secrets from the TLS layer's type).
pub trait DynIo: Any + AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> DynIo for T {}

/// A boxed downstream stream (e.g. a TLS stream produced by the TLS layer).
pub type BoxIo = Box<dyn DynIo>;

/// Streams a parked connection can be handed back as.
pub trait ParkableIo: AsyncRead + AsyncWrite + Send + Unpin + 'static {
    /// The underlying transport (a `TcpStream` for plaintext connections;
    /// whatever the TLS layer boxed otherwise) and any bytes this wrapper had
    /// buffered but not yet returned to a reader.
    fn into_parked(self) -> (Box<dyn Any + Send>, Bytes);
}

impl ParkableIo for TcpStream {
    fn into_parked(self) -> (Box<dyn Any + Send>, Bytes) {
        (Box::new(self), Bytes::new())
    }
}

impl ParkableIo for BoxIo {
    fn into_parked(self) -> (Box<dyn Any + Send>, Bytes) {
        // Upcast, so the receiver downcasts to the concrete stream type.
        let any: Box<dyn Any + Send> = self;
        (any, Bytes::new())
    }
}

impl<T: ParkableIo> ParkableIo for PrefixedIo<T> {
    fn into_parked(self) -> (Box<dyn Any + Send>, Bytes) {
        let (inner_io, inner_bytes) = self.inner.into_parked();
        if inner_bytes.is_empty() {
            return (inner_io, self.prefix);
        }
        let mut all = Vec::with_capacity(self.prefix.len() + inner_bytes.len());
        all.extend_from_slice(&self.prefix);
        all.extend_from_slice(&inner_bytes);
        (inner_io, Bytes::from(all))
    }
}

/// `prefix` is returned by reads before anything from `inner`.
#[derive(Debug)]
pub struct PrefixedIo<T> {
    prefix: Bytes,
    inner: T,
}

impl<T> PrefixedIo<T> {
    pub fn new(prefix: Bytes, inner: T) -> Self {
        Self { prefix, inner }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// Remaining prefix and the inner stream.
    pub fn into_parts(self) -> (Bytes, T) {
        (self.prefix, self.inner)
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for PrefixedIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for PrefixedIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
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
        /// `TcpStream` for plaintext, the TLS layer's stream type otherwise.
        downstream: Box<dyn Any + Send>,
        upstream: TcpStream,
        /// Read from downstream, not yet written upstream.
        to_upstream: Bytes,
        /// Read from upstream, not yet written downstream.
        to_downstream: Bytes,
    },
    /// HTTP/1 between requests: the socket plus pipelined bytes already read.
    Http1 {
        meta: ConnMeta,
        downstream: Box<dyn Any + Send>,
        unread: Bytes,
    },
    /// The connection cannot move (HTTP/2, or mid-upgrade): it was told to
    /// finish (GOAWAY / close after the current exchange) and will end on
    /// its own.
    Draining,
}

/// A request to park, sent to a connection's task.
#[derive(Debug)]
pub struct ParkRequest {
    pub reply: oneshot::Sender<Parked>,
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
    pub fn park(&self, id: u64) -> Option<oneshot::Receiver<Parked>> {
        let entry = self.lock().get(&id).cloned()?;
        let tx = entry
            .park
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        let (reply, rx) = oneshot::channel();
        tx.send(ParkRequest { reply }).ok()?;
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
    use tokio::io::AsyncReadExt;

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
    async fn prefixed_io_returns_the_prefix_before_the_stream() {
        let (mut a, b) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut a, b"world")
            .await
            .unwrap();
        drop(a);
        let mut io = PrefixedIo::new(Bytes::from_static(b"hello "), b);
        let mut s = String::new();
        io.read_to_string(&mut s).await.unwrap();
        assert_eq!(s, "hello world");
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
        let reply = reg.park(1).expect("first park request is delivered");
        assert!(
            reg.park(1).is_none(),
            "a connection is asked to park only once"
        );
        let req = rx1.try_recv().unwrap();
        req.reply.send(Parked::Draining).unwrap();
        assert!(matches!(reply.await.unwrap(), Parked::Draining));
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
