//! A rustls stream for tokio whose handshake can run on the offload pool.
//!
//! tokio-rustls drives `process_new_packets` inside `poll`, i.e. on the event
//! loop, and offers no way to construct its stream from a connection we
//! handshook ourselves. So this module owns both halves:
//!
//! - [`handshake`]: an async loop that does socket I/O on the calling task
//!   and, while handshaking, moves the connection to a crypto thread for each
//!   `process_new_packets` call (that is where rustls signs, runs the key
//!   exchange and verifies the peer's chain). Without a pool it processes
//!   inline — the "offload disabled" baseline.
//! - [`TlsStream`]: the established connection as `AsyncRead + AsyncWrite`.
//!   Record protection is cheap AEAD work and stays on the event loop.
//!   [`TlsStream::into_parts`] gives the socket and the rustls connection
//!   back, which is what the handoff needs for `dangerous_extract_secrets`.

use std::io::{self, Read, Write};
use std::ops::DerefMut;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use rustls::{ConnectionCommon, SideData};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::offload::CryptoPool;

/// An established TLS connection over `IO`.
#[derive(Debug)]
pub struct TlsStream<IO, C> {
    io: IO,
    conn: C,
    close_sent: bool,
}

struct SyncReader<'a, 'b, IO> {
    io: &'a mut IO,
    cx: &'a mut Context<'b>,
}

impl<IO: AsyncRead + Unpin> Read for SyncReader<'_, '_, IO> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut rb = ReadBuf::new(buf);
        match Pin::new(&mut *self.io).poll_read(self.cx, &mut rb) {
            Poll::Ready(Ok(())) => Ok(rb.filled().len()),
            Poll::Ready(Err(e)) => Err(e),
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

struct SyncWriter<'a, 'b, IO> {
    io: &'a mut IO,
    cx: &'a mut Context<'b>,
}

impl<IO: AsyncWrite + Unpin> Write for SyncWriter<'_, '_, IO> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match Pin::new(&mut *self.io).poll_write(self.cx, buf) {
            Poll::Ready(r) => r,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match Pin::new(&mut *self.io).poll_write_vectored(self.cx, bufs) {
            Poll::Ready(r) => r,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match Pin::new(&mut *self.io).poll_flush(self.cx) {
            Poll::Ready(r) => r,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

fn poll_read_tls<IO, S>(
    io: &mut IO,
    conn: &mut ConnectionCommon<S>,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>>
where
    IO: AsyncRead + Unpin,
{
    let mut r = SyncReader { io, cx };
    match conn.read_tls(&mut r) {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Poll::Pending,
        res => Poll::Ready(res),
    }
}

fn poll_write_tls<IO, S>(
    io: &mut IO,
    conn: &mut ConnectionCommon<S>,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>>
where
    IO: AsyncWrite + Unpin,
{
    let mut w = SyncWriter { io, cx };
    match conn.write_tls(&mut w) {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Poll::Pending,
        Ok(0) => Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
        res => Poll::Ready(res),
    }
}

async fn flush_all<IO, S>(io: &mut IO, conn: &mut ConnectionCommon<S>) -> io::Result<()>
where
    IO: AsyncWrite + Unpin,
{
    while conn.wants_write() {
        std::future::poll_fn(|cx| poll_write_tls(io, conn, cx)).await?;
    }
    std::future::poll_fn(|cx| Pin::new(&mut *io).poll_flush(cx)).await
}

/// Completes the handshake of `conn` over `io`. With a `pool`, every
/// handshake step that may do public-key crypto runs on a crypto thread and
/// this task only awaits it.
pub async fn handshake<IO, C, S>(
    mut io: IO,
    mut conn: C,
    pool: Option<&CryptoPool>,
) -> io::Result<TlsStream<IO, C>>
where
    IO: AsyncRead + AsyncWrite + Unpin,
    C: DerefMut<Target = ConnectionCommon<S>> + Send + 'static,
    S: SideData,
{
    loop {
        flush_all(&mut io, &mut conn).await?;
        if !conn.is_handshaking() {
            break;
        }
        let n = std::future::poll_fn(|cx| poll_read_tls(&mut io, &mut conn, cx)).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the connection during the TLS handshake",
            ));
        }
        let result = match pool {
            Some(pool) => {
                let (back, r) = pool
                    .run(move || {
                        let r = conn.process_new_packets().map(|_| ());
                        (conn, r)
                    })
                    .await
                    .map_err(io::Error::other)?;
                conn = back;
                r
            }
            None => conn.process_new_packets().map(|_| ()),
        };
        if let Err(e) = result {
            // Tell the peer why (the alert rustls queued), best effort.
            let _ = flush_all(&mut io, &mut conn).await;
            return Err(io::Error::new(io::ErrorKind::InvalidData, e));
        }
    }
    Ok(TlsStream {
        io,
        conn,
        close_sent: false,
    })
}

impl<IO, C> TlsStream<IO, C> {
    pub fn get_ref(&self) -> (&IO, &C) {
        (&self.io, &self.conn)
    }

    pub fn get_mut(&mut self) -> (&mut IO, &mut C) {
        (&mut self.io, &mut self.conn)
    }

    /// The socket and the rustls connection (for secret extraction by the
    /// handoff). Bytes rustls already decrypted but nobody read are still in
    /// the connection's reader.
    pub fn into_parts(self) -> (IO, C) {
        (self.io, self.conn)
    }
}

impl<IO, C, S> AsyncRead for TlsStream<IO, C>
where
    IO: AsyncRead + AsyncWrite + Unpin,
    C: DerefMut<Target = ConnectionCommon<S>> + Unpin,
    S: SideData,
{
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let this = &mut *self;
        loop {
            match this.conn.reader().read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
            // Alerts or KeyUpdate responses rustls queued go out first.
            while this.conn.wants_write() {
                match poll_write_tls(&mut this.io, &mut this.conn, cx) {
                    Poll::Ready(Ok(_)) => {}
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => break,
                }
            }
            match poll_read_tls(&mut this.io, &mut this.conn, cx) {
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
            if let Err(e) = this.conn.process_new_packets() {
                while this.conn.wants_write() {
                    if !matches!(
                        poll_write_tls(&mut this.io, &mut this.conn, cx),
                        Poll::Ready(Ok(_))
                    ) {
                        break;
                    }
                }
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, e)));
            }
        }
    }
}

impl<IO, C, S> AsyncWrite for TlsStream<IO, C>
where
    IO: AsyncRead + AsyncWrite + Unpin,
    C: DerefMut<Target = ConnectionCommon<S>> + Unpin,
    S: SideData,
{
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        loop {
            let n = this.conn.writer().write(buf)?;
            while this.conn.wants_write() {
                match poll_write_tls(&mut this.io, &mut this.conn, cx) {
                    Poll::Ready(Ok(_)) => {}
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    // The bytes are buffered in rustls; report them written.
                    Poll::Pending if n > 0 || buf.is_empty() => return Poll::Ready(Ok(n)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            if n > 0 || buf.is_empty() {
                return Poll::Ready(Ok(n));
            }
            // rustls's send buffer was full and is now drained: retry.
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.conn.writer().flush()?;
        while this.conn.wants_write() {
            ready!(poll_write_tls(&mut this.io, &mut this.conn, cx))?;
        }
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.close_sent {
            self.conn.send_close_notify();
            self.close_sent = true;
        }
        ready!(self.as_mut().poll_flush(cx))?;
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
