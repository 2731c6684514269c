//! Raw TCP proxying with a park point.
//!
//! A hand-written bidirectional copy instead of `copy_bidirectional`: each
//! direction keeps its own buffer and cursor, and every step is a single
//! cancel-safe read or write, so the loop can stop between any two steps and
//! hand back both sockets plus exactly the bytes read but not yet written
//! (the handoff moves them to the next process without loss or duplication).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
#[cfg(test)]
use tokio::io::{AsyncReadExt, AsyncWriteExt};
#[cfg(test)]
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use crate::conn::{ParkRequest, ParkableIo, Parked};
use crate::filters::ConnMeta;
use crate::upstream::TcpUpstream;

const BUF: usize = 16 * 1024;

/// One direction's state: `buf[pos..len]` is read but not yet written.
struct Pipe {
    buf: Box<[u8]>,
    pos: usize,
    len: usize,
    eof: bool,
    shut: bool,
}

impl Pipe {
    fn new(initial: &[u8]) -> Self {
        let mut buf = vec![0u8; BUF.max(initial.len())].into_boxed_slice();
        buf[..initial.len()].copy_from_slice(initial);
        Self {
            buf,
            pos: 0,
            len: initial.len(),
            eof: false,
            shut: false,
        }
    }

    fn pending(&self) -> Bytes {
        Bytes::copy_from_slice(&self.buf[self.pos..self.len])
    }

    /// Move bytes from `r` to `w` until blocked or finished. State lives in
    /// `self`, so stopping between two polls loses nothing. `moved` counts
    /// bytes written.
    fn poll_pipe<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        mut r: Pin<&mut R>,
        mut w: Pin<&mut W>,
        moved: &mut u64,
    ) -> Poll<std::io::Result<()>>
    where
        R: AsyncRead + ?Sized,
        W: AsyncWrite + ?Sized,
    {
        loop {
            if self.shut {
                return Poll::Ready(Ok(()));
            }
            if self.pos < self.len {
                let n = ready!(w.as_mut().poll_write(cx, &self.buf[self.pos..self.len]))?;
                if n == 0 {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
                }
                self.pos += n;
                *moved += n as u64;
                continue;
            }
            if self.eof {
                ready!(w.as_mut().poll_shutdown(cx))?;
                self.shut = true;
                return Poll::Ready(Ok(()));
            }
            // Flush before blocking on a read, so nothing sits in a writer's buffer.
            if let Poll::Ready(Err(e)) = w.as_mut().poll_flush(cx) {
                return Poll::Ready(Err(e));
            }
            let mut rb = ReadBuf::new(&mut self.buf);
            ready!(r.as_mut().poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            self.pos = 0;
            self.len = n;
            if n == 0 {
                self.eof = true;
            }
        }
    }
}

/// How a proxied TCP connection ended.
#[derive(Debug)]
pub enum TcpEnd {
    Closed,
    Error(std::io::Error),
    /// Parked for the handoff; the [`Parked`] value was sent to the asker.
    Parked,
}

enum Stop {
    Park(ParkRequest),
    Err(std::io::Error),
}

/// Bytes one proxied connection moved (for its access-log line).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Moved {
    /// Client → upstream.
    pub up: u64,
    /// Upstream → client.
    pub down: u64,
}

/// Proxy `down` ⇄ `up` until both directions close, an error occurs, or a
/// park request arrives. `to_upstream` holds bytes already read from `down`
/// (during detection) that must reach `up` first.
pub async fn proxy<D: ParkableIo>(
    down: D,
    up: TcpUpstream,
    to_upstream: &[u8],
    meta: &ConnMeta,
    park: oneshot::Receiver<ParkRequest>,
    rx: &Counter,
    tx: &Counter,
) -> (TcpEnd, Moved) {
    let mut moved = Moved::default();
    let end = proxy_counted(down, up, to_upstream, &[], meta, park, rx, tx, &mut moved).await;
    (end, moved)
}

/// [`proxy`] for a connection adopted from another process (the handoff):
/// `to_downstream` holds bytes the previous owner read from `up` and had not
/// yet written to `down`; they reach `down` before anything newer.
#[allow(clippy::too_many_arguments)]
pub async fn proxy_resumed<D: ParkableIo>(
    down: D,
    up: TcpUpstream,
    to_upstream: &[u8],
    to_downstream: &[u8],
    meta: &ConnMeta,
    park: oneshot::Receiver<ParkRequest>,
    rx: &Counter,
    tx: &Counter,
) -> TcpEnd {
    let mut moved = Moved::default();
    proxy_counted(
        down,
        up,
        to_upstream,
        to_downstream,
        meta,
        park,
        rx,
        tx,
        &mut moved,
    )
    .await
}

#[allow(clippy::too_many_arguments)]
async fn proxy_counted<D: ParkableIo>(
    mut down: D,
    mut up: TcpUpstream,
    to_upstream: &[u8],
    to_downstream: &[u8],
    meta: &ConnMeta,
    mut park: oneshot::Receiver<ParkRequest>,
    rx: &Counter,
    tx: &Counter,
    moved: &mut Moved,
) -> TcpEnd {
    let mut c2s = Pipe::new(to_upstream);
    let mut s2c = Pipe::new(to_downstream);
    let mut park_open = true;
    let result = std::future::poll_fn(|cx| {
        if park_open {
            match Pin::new(&mut park).poll(cx) {
                Poll::Ready(Ok(req)) => {
                    if req.upstream_tls || !up.is_tls() {
                        return Poll::Ready(Err(Stop::Park(req)));
                    }
                    // The receiver cannot continue an originated TLS session
                    // (protocol 1): finish here, and tell the handoff so.
                    req.answer(Parked::Draining);
                    park_open = false;
                }
                Poll::Ready(Err(_)) => park_open = false,
                Poll::Pending => {}
            }
        }
        let (mut up_n, mut down_n) = (0, 0);
        let a = c2s.poll_pipe(cx, Pin::new(&mut down), Pin::new(&mut up), &mut up_n);
        let b = s2c.poll_pipe(cx, Pin::new(&mut up), Pin::new(&mut down), &mut down_n);
        rx.inc_by(up_n);
        tx.inc_by(down_n);
        moved.up += up_n;
        moved.down += down_n;
        match (a, b) {
            (Poll::Ready(Err(e)), _) | (_, Poll::Ready(Err(e))) => Poll::Ready(Err(Stop::Err(e))),
            (Poll::Ready(Ok(())), Poll::Ready(Ok(()))) => Poll::Ready(Ok(())),
            _ => Poll::Pending,
        }
    })
    .await;
    match result {
        Ok(()) => TcpEnd::Closed,
        Err(Stop::Err(e)) => TcpEnd::Error(e),
        Err(Stop::Park(req)) => {
            let (upstream, _) = up.into_parked();
            let (downstream, extra) = down.into_parked();
            let mut to_up = extra.to_vec();
            to_up.extend_from_slice(&c2s.pending());
            req.answer(Parked::Tcp {
                meta: meta.clone(),
                downstream,
                upstream,
                to_upstream: Bytes::from(to_up),
                to_downstream: s2c.pending(),
            });
            TcpEnd::Parked
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::ParkedIo;
    use std::sync::Arc;
    use tokio::net::TcpListener;

    fn meta() -> ConnMeta {
        ConnMeta {
            id: 1,
            listener: Arc::from("t"),
            peer: "127.0.0.1:1".parse().unwrap(),
            local: "127.0.0.1:2".parse().unwrap(),
            original_dst: None,
            peer_identity: None,
            alpn: None,
            tls: false,
        }
    }

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (b, _) = l.accept().await.unwrap();
        (a, b)
    }

    #[tokio::test]
    async fn proxies_both_ways_and_parks_with_sockets_and_pending_bytes() {
        let (mut client, proxy_down) = pair().await;
        let (proxy_up, mut server) = pair().await;
        let (park_tx, park_rx) = oneshot::channel();
        let (rx, tx) = (Counter::default(), Counter::default());
        let task = tokio::spawn(async move {
            proxy(
                proxy_down,
                TcpUpstream::Plain(proxy_up),
                b"pre-",
                &meta(),
                park_rx,
                &rx,
                &tx,
            )
            .await
        });
        client.write_all(b"hello").await.unwrap();
        let mut got = [0u8; 9];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pre-hello");
        server.write_all(b"back").await.unwrap();
        let mut back = [0u8; 4];
        client.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"back");

        let (req, reply_rx) = ParkRequest::new(true);
        park_tx.send(req).unwrap();
        let parked = reply_rx.await.unwrap().parked;
        assert!(matches!(task.await.unwrap().0, TcpEnd::Parked));
        let Parked::Tcp {
            downstream,
            upstream,
            to_upstream,
            to_downstream,
            ..
        } = parked
        else {
            panic!("tcp")
        };
        assert!(to_upstream.is_empty() && to_downstream.is_empty());
        // The sockets still work after the park: the new owner continues.
        let (ParkedIo::Tcp(mut downstream), ParkedIo::Tcp(mut upstream)) = (downstream, upstream)
        else {
            panic!("plain tcp ends")
        };
        client.write_all(b"after").await.unwrap();
        let mut after = [0u8; 5];
        downstream.read_exact(&mut after).await.unwrap();
        assert_eq!(&after, b"after");
        upstream.write_all(b"up").await.unwrap();
        let mut up = [0u8; 2];
        server.read_exact(&mut up).await.unwrap();
        assert_eq!(&up, b"up");
    }

    #[tokio::test]
    async fn half_close_is_propagated_and_the_proxy_ends_when_both_sides_close() {
        let (mut client, proxy_down) = pair().await;
        let (proxy_up, mut server) = pair().await;
        let (_park_tx, park_rx) = oneshot::channel();
        let task = tokio::spawn(async move {
            proxy(
                proxy_down,
                TcpUpstream::Plain(proxy_up),
                b"",
                &meta(),
                park_rx,
                &Counter::default(),
                &Counter::default(),
            )
            .await
        });
        client.write_all(b"req").await.unwrap();
        client.shutdown().await.unwrap();
        let mut buf = Vec::new();
        server.read_to_end(&mut buf).await.unwrap();
        assert_eq!(buf, b"req");
        server.write_all(b"resp").await.unwrap();
        server.shutdown().await.unwrap();
        let mut resp = Vec::new();
        client.read_to_end(&mut resp).await.unwrap();
        assert_eq!(resp, b"resp");
        let (end, moved) = task.await.unwrap();
        assert!(matches!(end, TcpEnd::Closed));
        assert_eq!(moved, Moved { up: 3, down: 4 });
    }
}
