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
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

/// Response header: port of the listener that accepted the connection.
pub const HEADER_SERVER_PORT: &str = "x-echo-server-port";
/// Response header: `HTTP/1.1` or `HTTP/2.0`, as the server saw the request.
pub const HEADER_PROTOCOL: &str = "x-echo-protocol";
/// Response header: the pre-NAT destination (`ip:port`) when the connection
/// was redirected by iptables; absent otherwise.
pub const HEADER_ORIGINAL_DST: &str = "x-echo-original-dst";
/// Response header: name of the server (the pod's hostname).
pub const HEADER_SERVER_NAME: &str = "x-echo-server-name";

/// Path on which the HTTP echo server fails every tenth request (per
/// process) with 503: a flaky backend that a retry policy hides (within
/// the default 20 % retry budget).
pub const FLAKY_PATH: &str = "/flaky";

/// Requests seen on [`FLAKY_PATH`] by this process.
static FLAKY_SEEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

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
    serve_http_echo_tls(listener, server_name, None).await
}

/// [`serve_http_echo`], over TLS when `tls` is given (ALPN `h2` and
/// `http/1.1` as configured in the acceptor; the protocol is detected from
/// the first bytes either way).
pub async fn serve_http_echo_tls(
    listener: TcpListener,
    server_name: String,
    tls: Option<TlsAcceptor>,
) -> std::io::Result<()> {
    loop {
        let (stream, _peer) = listener.accept().await?;
        let info = ConnInfo {
            local_port: stream.local_addr()?.port(),
            original_dst: original_dst(&stream),
            server_name: server_name.clone(),
        };
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                None => serve_http_conn(stream, info).await,
                Some(acceptor) => match acceptor.accept(stream).await {
                    Ok(stream) => serve_http_conn(stream, info).await,
                    Err(error) => tracing::debug!(%error, "TLS handshake failed"),
                },
            }
        });
    }
}

async fn serve_http_conn<S>(stream: S, info: ConnInfo)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |req| echo(req, info.clone()));
    let builder = auto::Builder::new(TokioExecutor::new());
    if let Err(error) = builder
        .serve_connection(TokioIo::new(stream), service)
        .await
    {
        tracing::debug!(%error, "http echo connection ended with an error");
    }
}

async fn echo(req: Request<Incoming>, info: ConnInfo) -> Result<Response<Full<Bytes>>, Infallible> {
    let protocol = format!("{:?}", req.version());
    let is_post = req.method() == http::Method::POST;
    // The first, eleventh, twenty-first ... request on the flaky path fails.
    let fail = req.uri().path() == FLAKY_PATH
        && FLAKY_SEEN
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .is_multiple_of(10);
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
    let status = if fail {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    let mut builder = Response::builder()
        .status(status)
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
    serve_tcp_echo_tls(listener, None).await
}

/// [`serve_tcp_echo`], over TLS when `tls` is given.
pub async fn serve_tcp_echo_tls(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
) -> std::io::Result<()> {
    loop {
        let (stream, _peer) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                None => echo_bytes(stream).await,
                Some(acceptor) => match acceptor.accept(stream).await {
                    Ok(stream) => echo_bytes(stream).await,
                    Err(error) => tracing::debug!(%error, "TLS handshake failed"),
                },
            }
        });
    }
}

async fn echo_bytes<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S) {
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
}

/// A TLS acceptor from PEM files (certificate chain, private key), offering
/// ALPN `h2` and `http/1.1`; the demo servers' `--tls-cert/--tls-key`.
pub fn tls_acceptor_from_pem(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<TlsAcceptor, TlsSetupError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert)
        .map_err(|e| TlsSetupError::Pem(cert.display().to_string(), e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsSetupError::Pem(cert.display().to_string(), e))?;
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| TlsSetupError::Pem(key.display().to_string(), e))?;
    tls_acceptor(certs, key)
}

/// A TLS acceptor (ring provider, TLS 1.2 and 1.3, ALPN `h2` + `http/1.1`).
pub fn tls_acceptor(
    certs: Vec<rustls_pki_types::CertificateDer<'static>>,
    key: rustls_pki_types::PrivateKeyDer<'static>,
) -> Result<TlsAcceptor, TlsSetupError> {
    let mut config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(TlsSetupError::Rustls)?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(TlsSetupError::Rustls)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(std::sync::Arc::new(config)))
}

/// Why a demo server's TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("reading PEM {0}: {1}")]
    Pem(String, rustls_pki_types::pem::Error),
    #[error("TLS configuration: {0}")]
    Rustls(rustls::Error),
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

    fn tls_pair(name: &str) -> (TlsAcceptor, rustls::ClientConfig) {
        let issued =
            rcgen::generate_simple_self_signed(vec![name.to_owned()]).expect("self-signed cert");
        let cert = issued.cert.der().clone();
        let key = rustls_pki_types::PrivateKeyDer::try_from(issued.signing_key.serialize_der())
            .expect("key der");
        let acceptor = tls_acceptor(vec![cert.clone()], key).expect("acceptor");
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert).expect("root");
        let mut client = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
        client.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        (acceptor, client)
    }

    fn tls(client: rustls::ClientConfig, name: &str) -> traffic::Tls {
        traffic::Tls {
            config: std::sync::Arc::new(client),
            server_name: rustls_pki_types::ServerName::try_from(name.to_owned())
                .expect("server name"),
        }
    }

    #[tokio::test]
    async fn tcp_http1_and_http2_are_echoed_over_tls() {
        let (acceptor, client) = tls_pair("echo.test");
        let (tcp_addr, tcp) = spawn({
            let acceptor = acceptor.clone();
            move |l| serve_tcp_echo_tls(l, Some(acceptor))
        })
        .await;
        let (http_addr, http) =
            spawn(move |l| serve_http_echo_tls(l, "tls".to_owned(), Some(acceptor))).await;
        let tls = tls(client, "echo.test");
        traffic::run(
            tcp_addr,
            &Load::new(Protocol::Tcp)
                .exchanges(8)
                .payload_bytes(100_000)
                .tls(tls.clone()),
        )
        .await
        .assert_all_ok();
        let mut h1 = tls.clone();
        let mut h1_config = (*h1.config).clone();
        h1_config.alpn_protocols = vec![b"http/1.1".to_vec()];
        h1.config = std::sync::Arc::new(h1_config);
        let report =
            traffic::run(http_addr, &Load::new(Protocol::Http1).exchanges(8).tls(h1)).await;
        report.assert_all_ok();
        assert_eq!(report.header(HEADER_PROTOCOL), Some("HTTP/1.1"));
        let report =
            traffic::run(http_addr, &Load::new(Protocol::Http2).exchanges(8).tls(tls)).await;
        report.assert_all_ok();
        assert_eq!(report.header(HEADER_PROTOCOL), Some("HTTP/2.0"));
        tcp.abort();
        http.abort();
    }

    #[tokio::test]
    async fn a_certificate_for_another_name_fails_every_exchange_at_the_tls_stage() {
        let (acceptor, client) = tls_pair("echo.test");
        let (addr, server) = spawn(move |l| serve_tcp_echo_tls(l, Some(acceptor))).await;
        let report = traffic::run(
            addr,
            &Load::new(Protocol::Tcp)
                .exchanges(3)
                .tls(tls(client, "other.test")),
        )
        .await;
        assert_eq!(report.failures.len(), 3, "{report}");
        assert!(
            report.failures.iter().all(|f| f.stage == Stage::Tls),
            "{report}"
        );
        assert!(
            report.failures[0].detail.contains("not valid for name"),
            "{report}"
        );
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
