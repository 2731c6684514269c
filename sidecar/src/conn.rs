//! Downstream connection plumbing shared by the listeners, the protocol
//! handlers and the TLS layer:
//!
//! * [`PrefixedIo`]: a stream with bytes already read (during protocol
//!   detection) put back in front, so protocol handlers see the whole stream.
//! * [`FramingGuard`], [`H1Refusal`]: the general HTTP/1.1 path's
//!   read-side shadow, which withholds each request head until it is
//!   complete and valid (see `docs/architecture.md`); the pure framing it
//!   runs, [`H1Framing`], is `baton_wire::h1framing`, re-exported here.
//! * The connection registry and the parked-connection types
//!   ([`ConnRegistry`], [`Parked`], [`ParkedIo`], [`ParkableIo`],
//!   [`SessionDetach`], …) are the handoff mechanism's and live in
//!   `baton_handoff::conn`; they are re-exported here under the names the
//!   data plane has always used, as are the identity types the handoff
//!   carries ([`IdentityPem`], [`IdentityCarrier`]).
//!
//! Safe points, per kind (the data plane answers a park request at them):
//! raw TCP parks between two reads/writes (anything read but not written is
//! returned); HTTP/1 parks when no request is in flight (pipelined bytes
//! hyper already read are returned); HTTP/2 parks when no stream is open
//! and the client has emptied its HPACK table (`h2_shim`), or,
//! when it cannot, answers by sending GOAWAY and draining.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub use baton_handoff::conn::{
    BoxIo, ConnEntry, ConnGuard, ConnKind, ConnRegistry, ConnSummary, Detached, DynIo, ParkRequest,
    ParkableIo, Parked, ParkedAt, ParkedIo, SessionDetach,
};
pub use baton_handoff::plane::{IdentityCarrier, IdentityImportError, IdentityPem};

pub use baton_wire::h1framing::{ChunkedEnd, FramingVerdict, H1Framing};

use crate::h1valid::Refusal;

impl<T: ParkableIo> ParkableIo for PrefixedIo<T> {
    fn into_parked(self) -> (ParkedIo, Bytes) {
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

/// `AsyncWrite` for a wrapper that only changes the read side: every write
/// goes straight to its `inner` stream.
macro_rules! write_through_to_inner {
    ($wrapper:ident) => {
        impl<T: AsyncWrite + Unpin> AsyncWrite for $wrapper<T> {
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
            fn poll_shutdown(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<io::Result<()>> {
                Pin::new(&mut self.inner).poll_shutdown(cx)
            }
        }
    };
}

write_through_to_inner!(PrefixedIo);

/// Shared by a [`FramingGuard`] (the read side) and its connection's HTTP
/// service: which request, if any, the service must refuse, and why. hyper
/// serves HTTP/1 requests one at a time, in order, so the service finds the
/// refused one by counting.
#[derive(Debug)]
pub struct H1Refusal {
    /// Index of the refused request on this connection; `u64::MAX` while none.
    at: AtomicU64,
    /// The [`Refusal`] code (set before `at`).
    reason: AtomicU8,
    /// Requests the service has been called for.
    served: AtomicU64,
}

impl H1Refusal {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            at: AtomicU64::new(u64::MAX),
            reason: AtomicU8::new(0),
            served: AtomicU64::new(0),
        })
    }

    fn mark(&self, index: u64, why: Refusal) {
        self.reason.store(why.code(), Ordering::Relaxed);
        self.at.store(index, Ordering::Release);
    }

    /// Called by the service once per request, in order: why this one is
    /// refused, if it is. The guard marks it before hyper can see even its
    /// stand-in head, so the mark is always there in time.
    pub fn next_is_refused(&self) -> Option<Refusal> {
        let n = self.served.fetch_add(1, Ordering::Relaxed);
        if n == self.at.load(Ordering::Acquire) {
            Refusal::from_code(self.reason.load(Ordering::Relaxed))
        } else {
            None
        }
    }
}

/// The HTTP/1 downstream stream as hyper reads it, with the [`H1Framing`]
/// shadow on the read path. A head reaches hyper only once it is complete
/// and valid (the bytes of a partial head are withheld, so hyper cannot
/// answer a malformed one by itself, with no reason). A refused head never
/// reaches hyper: it gets a stand-in head in its place, which the service
/// answers with the refusal ([`H1Refusal`]), then only end-of-stream; the
/// refused head's body and anything pipelined after it are read and dropped.
#[derive(Debug)]
pub struct FramingGuard<T> {
    inner: T,
    framing: H1Framing,
    refusal: Arc<H1Refusal>,
    refused: bool,
    /// Read and fed to the shadow, not yet released (a partial head).
    held: bytes::BytesMut,
    /// Released, not yet handed to the reader (it asked for fewer bytes).
    ready: bytes::BytesMut,
}

/// What hyper parses in place of a refused head: a request it accepts, that
/// asks to close. The service never forwards it (it answers the refusal).
const STAND_IN: &[u8] = b"GET / HTTP/1.1\r\nhost: refused.invalid\r\nconnection: close\r\n\r\n";
/// The same for a refused `HEAD` request (so the answer has no body).
const STAND_IN_HEAD: &[u8] =
    b"HEAD / HTTP/1.1\r\nhost: refused.invalid\r\nconnection: close\r\n\r\n";

impl<T> FramingGuard<T> {
    pub fn new(inner: T, framing: H1Framing, refusal: Arc<H1Refusal>) -> Self {
        Self {
            inner,
            framing,
            refusal,
            refused: false,
            held: bytes::BytesMut::new(),
            ready: bytes::BytesMut::new(),
        }
    }
}

impl<T: ParkableIo> ParkableIo for FramingGuard<T> {
    fn into_parked(self) -> (ParkedIo, Bytes) {
        // What this layer read and did not hand to hyper comes first (the
        // receiver starts a fresh shadow at the same request boundary hyper
        // parked at, and validates those bytes again).
        let (io, inner) = self.inner.into_parked();
        if self.ready.is_empty() && self.held.is_empty() {
            return (io, inner);
        }
        let mut all = self.ready;
        all.extend_from_slice(&self.held);
        all.extend_from_slice(&inner);
        (io, all.freeze())
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for FramingGuard<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if !this.ready.is_empty() {
                let n = this.ready.len().min(buf.remaining());
                buf.put_slice(&this.ready.split_to(n));
                return Poll::Ready(Ok(()));
            }
            let before = buf.filled().len();
            if this.refused {
                // Drain and drop until the client closes (or hyper does,
                // after the answer).
                loop {
                    std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
                    if buf.filled().len() == before {
                        return Poll::Ready(Ok(()));
                    }
                    buf.set_filled(before);
                }
            }
            std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
            let read = buf.filled().len() - before;
            if read == 0 || (!this.framing.following() && this.held.is_empty()) {
                // End of stream (a withheld partial head is dropped: hyper
                // sees a close between requests), or no longer following.
                return Poll::Ready(Ok(()));
            }
            match this.framing.feed(&buf.filled()[before..]) {
                FramingVerdict::Pass => {
                    let keep = this.framing.withheld();
                    if this.held.is_empty() && keep == 0 {
                        // The common case: everything read goes to hyper.
                        return Poll::Ready(Ok(()));
                    }
                    this.held.extend_from_slice(&buf.filled()[before..]);
                    buf.set_filled(before);
                    let release = this.held.len() - keep;
                    this.ready = this.held.split_to(release);
                }
                FramingVerdict::Refuse {
                    index,
                    why,
                    end,
                    head_len,
                } => {
                    this.held
                        .extend_from_slice(&buf.filled()[before..before + end]);
                    buf.set_filled(before);
                    let start = this.held.len() - head_len;
                    let head_request = this.held[start..].starts_with(b"HEAD ");
                    this.held.truncate(start);
                    this.ready = std::mem::take(&mut this.held);
                    this.ready.extend_from_slice(if head_request {
                        STAND_IN_HEAD
                    } else {
                        STAND_IN
                    });
                    this.refusal.mark(index, why);
                    this.refused = true;
                }
            }
        }
    }
}

write_through_to_inner!(FramingGuard);

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn framing_guard_hands_the_parser_only_the_refused_head() {
        let (mut client, server) = tokio::io::duplex(1024);
        let refusal = H1Refusal::new();
        let mut guard = FramingGuard::new(server, H1Framing::new(8192), refusal.clone());
        let first = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        let head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n";
        let mut all = first.to_vec();
        all.extend_from_slice(head);
        all.extend_from_slice(b"0\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n");
        // In small pieces: partial heads are withheld, then released whole.
        let writer = tokio::spawn(async move {
            for piece in all.chunks(7) {
                tokio::io::AsyncWriteExt::write_all(&mut client, piece)
                    .await
                    .unwrap();
                tokio::task::yield_now().await;
            }
        });
        let mut seen = Vec::new();
        guard.read_to_end(&mut seen).await.unwrap();
        writer.await.unwrap();
        let mut expected = first.to_vec();
        expected.extend_from_slice(STAND_IN);
        assert_eq!(
            seen, expected,
            "the refused head is replaced, nothing after it passes"
        );
        assert_eq!(refusal.next_is_refused(), None, "request 0 passes");
        assert_eq!(
            refusal.next_is_refused(),
            Some(Refusal::Smuggling),
            "request 1 is refused"
        );
        assert_eq!(refusal.next_is_refused(), None);
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
}
