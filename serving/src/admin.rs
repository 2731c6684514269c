//! A plain-HTTP admin port: [`crate::accept`] and [`crate::http`] put
//! together, with a handler that sees the request and the caller's address
//! (the sidecar decides some endpoints by it). What each process answers
//! (its routes, who may call them) stays in that process.

use std::future::Future;
use std::net::SocketAddr;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::accept::{self, Connections};

/// Serves `handler` on `listener` until `stop` (see [`Connections`] for
/// what happens to the connections then).
pub async fn serve<H, Fut>(
    listener: TcpListener,
    stop: CancellationToken,
    connections: Connections,
    handler: H,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let conn_stop = stop.clone();
    accept::serve_plain(listener, "admin", stop, connections, move |tcp, peer| {
        let handler = handler.clone();
        let stop = conn_stop.clone();
        crate::http::serve_connection(tcp, move |req| handler(req, peer), stop, "admin", peer)
    })
    .await;
}

#[cfg(test)]
mod tests {
    //! Real sockets on port 0, HTTP/1.1 written by hand so the test sees
    //! exactly what a kubelet probe or a scrape sends.

    use std::time::Duration;

    use http::StatusCode;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;
    use crate::http::response;

    async fn listener() -> (TcpListener, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        (l, addr)
    }

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
            .await
            .expect("the admin port answers")
            .unwrap();
        out
    }

    fn echo_peer()
    -> impl Fn(Request<Incoming>, SocketAddr) -> std::future::Ready<Response<Full<Bytes>>>
    + Clone
    + Send
    + Sync
    + 'static {
        |req, peer| {
            std::future::ready(response(
                StatusCode::OK,
                "text/plain",
                format!("{} from {}\n", req.uri().path(), peer.ip()),
            ))
        }
    }

    #[tokio::test]
    async fn the_handler_answers_with_the_callers_address() {
        let (l, addr) = listener().await;
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve(l, stop.clone(), Connections::Owned, echo_peer()));
        let answer = get(addr, "/live").await;
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        assert!(answer.ends_with("/live from 127.0.0.1\n"), "{answer}");
        stop.cancel();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_drained_port_stops_accepting_and_returns_once_its_connections_closed() {
        let (l, addr) = listener().await;
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve(l, stop.clone(), Connections::Drained, echo_peer()));
        // An idle keep-alive connection, as a scraper leaves one.
        let mut idle = TcpStream::connect(addr).await.unwrap();
        idle.write_all(b"GET /metrics HTTP/1.1\r\nHost: admin\r\n\r\n")
            .await
            .unwrap();
        let mut first = [0u8; 15];
        idle.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"HTTP/1.1 200 OK");
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the idle connection is shut down, not waited for forever")
            .unwrap();
        let mut rest = Vec::new();
        idle.read_to_end(&mut rest).await.unwrap();
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "the listening socket is closed"
        );
    }
}
