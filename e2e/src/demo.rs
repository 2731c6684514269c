//! The demo applications that run in e2e pods (and in-process in unit tests):
//! an HTTP/1.1 + HTTP/2 (cleartext, prior knowledge or upgrade-free
//! detection) echo server and a TCP echo server.
//!
//! Both report what a test needs to tell *where* a byte went: the HTTP server
//! answers with the port its listener is bound to, the protocol it spoke and,
//! when iptables redirected the connection, the original destination
//! (`SO_ORIGINAL_DST`). That is how the iptables e2e test proves a REDIRECT
//! took effect rather than merely that something answered.

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Response header: port of the listener that accepted the connection.
pub const HEADER_SERVER_PORT: &str = "x-echo-server-port";
/// Response header: `HTTP/1.1` or `HTTP/2.0`, as the server saw the request.
pub const HEADER_PROTOCOL: &str = "x-echo-protocol";
/// Response header: the pre-NAT destination (`ip:port`) when the connection
/// was redirected by iptables; absent otherwise.
pub const HEADER_ORIGINAL_DST: &str = "x-echo-original-dst";
/// Response header: name of the server (the pod's hostname).
pub const HEADER_SERVER_NAME: &str = "x-echo-server-name";

/// What the HTTP echo server learned about one connection.
#[derive(Debug, Clone)]
struct ConnInfo {
    local_port: u16,
    original_dst: Option<SocketAddrV4>,
    server_name: String,
}

/// The pre-NAT destination of a redirected IPv4 connection, if any.
/// For a connection that was not redirected the kernel returns the local
/// address itself; that case is reported as `None`.
pub fn original_dst(stream: &TcpStream) -> Option<SocketAddrV4> {
    let raw = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::OriginalDst).ok()?;
    let dst = SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(raw.sin_addr.s_addr)),
        u16::from_be(raw.sin_port),
    );
    match stream.local_addr() {
        Ok(SocketAddr::V4(local)) if local == dst => None,
        _ => Some(dst),
    }
}

/// Serves HTTP/1.1 and HTTP/2 (h2c) on `listener` until the task is dropped.
///
/// `POST` (any path) echoes the request body verbatim; any other method
/// answers a short text line. Every response carries the `x-echo-*` headers.
pub async fn serve_http_echo(listener: TcpListener, server_name: String) -> std::io::Result<()> {
    loop {
        let (stream, _peer) = listener.accept().await?;
        let info = ConnInfo {
            local_port: stream.local_addr()?.port(),
            original_dst: original_dst(&stream),
            server_name: server_name.clone(),
        };
        tokio::spawn(async move {
            let service = service_fn(move |req| echo(req, info.clone()));
            let builder = auto::Builder::new(TokioExecutor::new());
            if let Err(error) = builder
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%error, "http echo connection ended with an error");
            }
        });
    }
}

async fn echo(req: Request<Incoming>, info: ConnInfo) -> Result<Response<Full<Bytes>>, Infallible> {
    let protocol = format!("{:?}", req.version());
    let is_post = req.method() == http::Method::POST;
    let body = match req.into_body().collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            let mut response =
                Response::new(Full::new(Bytes::from(format!("body error: {error}\n"))));
            *response.status_mut() = StatusCode::BAD_REQUEST;
            return Ok(response);
        }
    };
    let body = if is_post {
        body
    } else {
        Bytes::from(format!(
            "baton demo-http-echo {} {}\n",
            info.server_name, protocol
        ))
    };
    let mut builder = Response::builder()
        .status(StatusCode::OK)
        .header(HEADER_SERVER_PORT, info.local_port.to_string())
        .header(HEADER_PROTOCOL, protocol)
        .header(HEADER_SERVER_NAME, info.server_name.as_str());
    if let Some(dst) = info.original_dst {
        builder = builder.header(HEADER_ORIGINAL_DST, dst.to_string());
    }
    Ok(builder
        .body(Full::new(body))
        .expect("static response parts are valid"))
}

/// Echoes every byte of every connection back to its sender until the task
/// is dropped. A connection ends when the client shuts down its write side.
pub async fn serve_tcp_echo(listener: TcpListener) -> std::io::Result<()> {
    loop {
        let (mut stream, _peer) = listener.accept().await?;
        tokio::spawn(async move {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => {
                        if stream.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
            let _ = stream.shutdown().await;
        });
    }
}

/// The host name reported by the echo server (the pod name inside a pod).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".to_owned())
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::traffic::{self, Load, Protocol, Stage};

    async fn spawn<F, Fut>(serve: F) -> (SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)
    where
        F: FnOnce(TcpListener) -> Fut,
        Fut: std::future::Future<Output = std::io::Result<()>> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        (addr, tokio::spawn(serve(listener)))
    }

    #[tokio::test]
    async fn tcp_streams_are_echoed_byte_for_byte() {
        let (addr, server) = spawn(serve_tcp_echo).await;
        let report = traffic::run(
            addr,
            &Load::new(Protocol::Tcp)
                .exchanges(16)
                .payload_bytes(256 * 1024),
        )
        .await;
        report.assert_all_ok();
        assert_eq!(report.bytes_echoed, 16 * 256 * 1024);
        server.abort();
    }

    #[tokio::test]
    async fn http1_requests_are_echoed_and_name_the_listener_port() {
        let (addr, server) = spawn(|l| serve_http_echo(l, "test".to_owned())).await;
        let report = traffic::run(addr, &Load::new(Protocol::Http1).exchanges(10)).await;
        report.assert_all_ok();
        assert_eq!(report.header(HEADER_PROTOCOL), Some("HTTP/1.1"));
        assert_eq!(
            report.header(HEADER_SERVER_PORT),
            Some(addr.port().to_string().as_str())
        );
        assert_eq!(
            report.header(HEADER_ORIGINAL_DST),
            None,
            "no redirect on loopback"
        );
        server.abort();
    }

    #[tokio::test]
    async fn http2_streams_share_one_connection_and_are_echoed() {
        let (addr, server) = spawn(|l| serve_http_echo(l, "test".to_owned())).await;
        let report = traffic::run(
            addr,
            &Load::new(Protocol::Http2).exchanges(50).concurrency(16),
        )
        .await;
        report.assert_all_ok();
        assert_eq!(report.header(HEADER_PROTOCOL), Some("HTTP/2.0"));
        server.abort();
    }

    #[tokio::test]
    async fn a_closed_port_is_reported_as_a_connect_failure_for_every_exchange() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        let report = traffic::run(addr, &Load::new(Protocol::Tcp).exchanges(3)).await;
        assert!(!report.ok());
        assert_eq!(report.failures.len(), 3);
        assert!(
            report.failures.iter().all(|f| f.stage == Stage::Connect),
            "{report}"
        );
    }

    #[tokio::test]
    async fn a_server_that_corrupts_bytes_is_caught_at_the_exact_offset() {
        // A "TCP echo" that flips byte 100 of each stream.
        let (addr, server) = spawn(|listener: TcpListener| async move {
            loop {
                let (mut stream, _) = listener.accept().await?;
                tokio::spawn(async move {
                    let mut data = Vec::new();
                    let _ = stream.read_to_end(&mut data).await;
                    if data.len() > 100 {
                        data[100] ^= 0x01;
                    }
                    let _ = stream.write_all(&data).await;
                    let _ = stream.shutdown().await;
                });
            }
        })
        .await;
        let report = traffic::run(
            addr,
            &Load::new(Protocol::Tcp).exchanges(2).payload_bytes(1000),
        )
        .await;
        assert_eq!(report.succeeded, 0);
        for failure in &report.failures {
            assert!(
                matches!(failure.stage, Stage::Mismatch { offset: 100, .. }),
                "{report}"
            );
        }
        server.abort();
    }

    #[tokio::test]
    async fn a_server_that_never_answers_is_reported_as_a_timeout() {
        let (addr, server) = spawn(|listener: TcpListener| async move {
            let mut held = Vec::new();
            loop {
                let (stream, _) = listener.accept().await?;
                held.push(stream);
            }
        })
        .await;
        let load = Load::new(Protocol::Http1)
            .exchanges(2)
            .timeout(std::time::Duration::from_millis(300));
        let report = traffic::run(addr, &load).await;
        assert!(
            report.failures.iter().all(|f| f.stage == Stage::Timeout),
            "{report}"
        );
        assert_eq!(report.failures.len(), 2);
        server.abort();
    }
}
