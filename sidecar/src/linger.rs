//! Lingering close: a connection the sidecar ends while its peer may still
//! be sending is half-closed and read until the peer closes (bounded), never
//! closed with unread bytes.
//!
//! Why: closing a TCP socket whose receive queue holds unread bytes makes
//! the kernel send RST instead of FIN, and a peer that gets the RST discards
//! what it had not read yet. An HTTP/2 connection drained for a handoff ends
//! exactly like that: the server sends GOAWAY naming the last stream it
//! processed, finishes those streams and closes — while the client, which
//! has not seen the GOAWAY yet, keeps sending new streams. With a plain
//! close the client gets a reset, loses the GOAWAY, and cannot tell that
//! its newest streams were never processed (RFC 9113 §6.8 lets it retry
//! them only if it sees the GOAWAY), so it reports them failed. nginx's
//! `lingering_close` exists for the same race in HTTP/1.1.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

/// How long a closed connection is read for the peer's close.
pub const LINGER_TIMEOUT: Duration = Duration::from_secs(2);
/// How many bytes a lingering close reads (and drops) at most.
pub const LINGER_MAX_BYTES: usize = 1 << 20;

/// An I/O object that, when dropped, hands its connection to a task that
/// half-closes it (flushing, and for TLS sending close_notify) and reads
/// until the peer closes, [`LINGER_TIMEOUT`] or [`LINGER_MAX_BYTES`].
/// Outside a Tokio runtime it closes at once.
#[derive(Debug)]
pub struct Lingering<I: AsyncRead + AsyncWrite + Unpin + Send + 'static> {
    io: Option<I>,
}

impl<I: AsyncRead + AsyncWrite + Unpin + Send + 'static> Lingering<I> {
    pub fn new(io: I) -> Self {
        Self { io: Some(io) }
    }

    fn io(&mut self) -> &mut I {
        self.io.as_mut().expect("present until dropped")
    }

    /// The connection, to continue elsewhere (an HTTP/2 connection moving
    /// at a handoff): no lingering close.
    pub fn into_inner(mut self) -> I {
        self.io.take().expect("present until dropped")
    }
}

impl<I: AsyncRead + AsyncWrite + Unpin + Send + 'static> Drop for Lingering<I> {
    fn drop(&mut self) {
        if let (Some(io), Ok(runtime)) = (self.io.take(), tokio::runtime::Handle::try_current()) {
            // Counted before the connection leaves the registry (its guard
            // is dropped after this), so a drain never sees a gap.
            let lingering = InFlight::new();
            runtime.spawn(async move {
                linger(io).await;
                drop(lingering);
            });
        }
    }
}

/// Lingering closes still running in this process. A process that exits
/// (its drain done) while one runs closes that socket with the peer's
/// bytes unread: the reset the lingering close exists to avoid, which also
/// cuts a response the kernel has not sent yet. Seen as a TLS streaming
/// call's body cut when an old sidecar stopped after a handoff.
static IN_FLIGHT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static SETTLED: tokio::sync::Notify = tokio::sync::Notify::const_new();

struct InFlight;

impl InFlight {
    fn new() -> Self {
        IN_FLIGHT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if IN_FLIGHT.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            SETTLED.notify_waiters();
        }
    }
}

/// Resolves once no lingering close runs in this process (each is bounded
/// by [`LINGER_TIMEOUT`]); the drain waits for it before stopping.
pub async fn settled() {
    loop {
        let notified = SETTLED.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if IN_FLIGHT.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            return;
        }
        notified.await;
    }
}

/// Half-closes `io` and reads until the peer closes (bounded).
pub async fn linger<I: AsyncRead + AsyncWrite + Unpin>(mut io: I) {
    let _ = tokio::time::timeout(LINGER_TIMEOUT, async {
        if io.shutdown().await.is_err() {
            return;
        }
        let mut buf = [0u8; 4096];
        let mut read = 0;
        while read < LINGER_MAX_BYTES {
            match io.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => read += n,
            }
        }
    })
    .await;
}

impl<I: AsyncRead + AsyncWrite + Unpin + Send + 'static> AsyncRead for Lingering<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(self.io()).poll_read(cx, buf)
    }
}

impl<I: AsyncRead + AsyncWrite + Unpin + Send + 'static> AsyncWrite for Lingering<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(self.io()).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(self.io()).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.as_ref().is_some_and(|io| io.is_write_vectored())
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.io()).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.io()).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::{TcpListener, TcpStream};

    /// A drain waits for the lingering closes it started: `settled` does
    /// not resolve while the peer keeps the connection open, and does once
    /// it closes.
    #[tokio::test]
    async fn settled_waits_for_a_running_lingering_close() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        drop(Lingering::new(server));
        // The peer has not closed: the lingering close is still reading.
        let waited = tokio::time::timeout(Duration::from_millis(300), settled()).await;
        assert!(waited.is_err(), "settled while a lingering close ran");
        drop(client);
        // Other tests' lingering closes may run too: each ends within
        // LINGER_TIMEOUT.
        tokio::time::timeout(LINGER_TIMEOUT * 5, settled())
            .await
            .expect("settled once the peer closed");
    }

    /// The peer sent bytes the server never read, then the server writes
    /// its last words and drops the connection: the peer must read every
    /// byte and a clean end of stream, not a reset.
    #[tokio::test]
    async fn a_dropped_connection_with_unread_bytes_ends_with_fin_and_delivers_the_last_words() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        // Unread by the server: the client's next streams.
        client.write_all(&[7u8; 32 * 1024]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut server = Lingering::new(server);
        server.write_all(b"GOAWAY last-stream-id=3").await.unwrap();
        drop(server);
        let mut received = Vec::new();
        let outcome = tokio::time::timeout(Duration::from_secs(5), async {
            let mut buf = [0u8; 1024];
            loop {
                match client.read(&mut buf).await {
                    Ok(0) => return Ok(()),
                    Ok(n) => received.extend_from_slice(&buf[..n]),
                    Err(e) => return Err(e),
                }
            }
        })
        .await
        .expect("the server closes its side");
        assert_eq!(received, b"GOAWAY last-stream-id=3");
        assert!(outcome.is_ok(), "a reset instead of FIN: {outcome:?}");
    }

    /// A peer that never closes does not keep the task: it ends after the
    /// linger timeout.
    #[tokio::test]
    async fn lingering_is_bounded_in_time() {
        let (a, _b) = tokio::io::duplex(64);
        let started = tokio::time::Instant::now();
        tokio::time::timeout(LINGER_TIMEOUT * 5, linger(a))
            .await
            .expect("lingering ends by itself");
        assert!(started.elapsed() >= LINGER_TIMEOUT);
    }
}
