//! Reading a sidecar's admin port from the Pod IP: the documents the
//! sidecar answers anyone (`/handoff` for the rollout controller,
//! `/offload` for the AcceleratorPool books). One GET over a fresh
//! HTTP/1.1 connection, bounded in time; any failure is "no answer" and the
//! caller decides what that means.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;

/// The body of a 2xx answer to `GET path` on `addr`, within `timeout`.
pub async fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Option<Bytes> {
    tokio::time::timeout(timeout, get_unbounded(addr, path))
        .await
        .ok()
        .flatten()
}

async fn get_unbounded(addr: SocketAddr, path: &str) -> Option<Bytes> {
    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .ok()?;
    let conn = tokio::spawn(conn);
    let request = http::Request::get(path)
        .header(http::header::HOST, addr.to_string())
        .body(Empty::<Bytes>::new())
        .ok()?;
    let response = sender.send_request(request).await.ok()?;
    let ok = response.status().is_success();
    let body = response.into_body().collect().await.ok()?.to_bytes();
    conn.abort();
    ok.then_some(body)
}
