//! A bounded traffic driver: byte-checked TCP streams, HTTP/1.1 requests and
//! HTTP/2 streams, each optionally over TLS ([`Load::tls`], e.g. mTLS with a
//! client certificate), against one address (a pod IP on the bridge, or loopback),
//! with a [`Report`] that says exactly which exchange failed, at which stage
//! and, for corrupted data, at which byte offset.
//!
//! Payloads are deterministic per (seed, exchange index) so a byte that comes
//! back from the wrong stream is detected, not just a short read. Every run is
//! bounded in count ([`Load::exchanges`]) and time ([`Load::timeout`] per
//! exchange, [`Load::deadline`] overall).

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::stream::{self, StreamExt};
use http::{Method, Request, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// Protocol of a traffic run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Raw TCP: write the payload, half-close, read the echo back.
    Tcp,
    /// One HTTP/1.1 connection per exchange, `POST` echoing the payload.
    Http1,
    /// A shared HTTP/2 (h2c, prior knowledge) connection; one stream per
    /// exchange. Like every real HTTP/2 client, it opens a new connection
    /// when the server drains the old one with GOAWAY, and re-sends only
    /// requests the server provably did not process (RFC 9113 §8.7): never
    /// sent, or refused above GOAWAY's last-stream-id / with REFUSED_STREAM.
    /// Those re-sends are counted in [`Report::retried_unprocessed`].
    Http2,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "tcp",
            Protocol::Http1 => "http/1.1",
            Protocol::Http2 => "http/2",
        })
    }
}

impl std::str::FromStr for Protocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tcp" => Ok(Protocol::Tcp),
            "http1" | "http/1.1" => Ok(Protocol::Http1),
            "http2" | "h2" | "http/2" => Ok(Protocol::Http2),
            other => Err(format!("unknown protocol {other:?} (tcp, http1, http2)")),
        }
    }
}

/// TLS for a run: the client configuration (trust roots, client certificate
/// for mTLS, ALPN: set `h2` for HTTP/2) and the name the server must prove.
#[derive(Clone)]
pub struct Tls {
    pub config: Arc<rustls::ClientConfig>,
    pub server_name: ServerName<'static>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("server_name", &self.server_name)
            .field("alpn", &self.config.alpn_protocols)
            .finish_non_exhaustive()
    }
}

/// How much traffic to send. All fields are bounds.
#[derive(Debug, Clone)]
pub struct Load {
    pub protocol: Protocol,
    /// Number of exchanges (streams / requests).
    pub exchanges: usize,
    /// Exchanges in flight at once.
    pub concurrency: usize,
    /// Payload bytes per exchange.
    pub payload_bytes: usize,
    /// Time limit of one exchange.
    pub timeout: Duration,
    /// Time limit of the whole run; exchanges not started by then are
    /// reported as [`Stage::NotStarted`].
    pub deadline: Duration,
    /// Seed of the payload generator.
    pub seed: u64,
    /// Speak TLS over each connection.
    pub tls: Option<Tls>,
}

impl Load {
    /// A small default run: 20 exchanges of 4 KiB, 4 at a time.
    pub fn new(protocol: Protocol) -> Self {
        Self {
            protocol,
            exchanges: 20,
            concurrency: 4,
            payload_bytes: 4096,
            timeout: Duration::from_secs(5),
            deadline: Duration::from_secs(60),
            seed: 0xba70,
            tls: None,
        }
    }
    pub fn exchanges(mut self, n: usize) -> Self {
        self.exchanges = n;
        self
    }
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }
    pub fn payload_bytes(mut self, n: usize) -> Self {
        self.payload_bytes = n;
        self
    }
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }
    pub fn deadline(mut self, t: Duration) -> Self {
        self.deadline = t;
        self
    }
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }
}

/// Where an exchange failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stage {
    Connect,
    /// The TLS handshake failed (untrusted certificate, wrong name, ...).
    Tls,
    Handshake,
    Write,
    Read,
    /// The HTTP status was not 200.
    Status(u16),
    /// The server spoke another HTTP version than asked for.
    Version(String),
    /// Fewer or more bytes came back than were sent.
    Length {
        sent: usize,
        received: usize,
    },
    /// The first differing byte.
    Mismatch {
        offset: usize,
        expected: u8,
        received: u8,
    },
    Timeout,
    /// The run's deadline passed before the exchange began.
    NotStarted,
}

/// One failed exchange.
#[derive(Debug, Clone)]
pub struct Failure {
    pub index: usize,
    pub stage: Stage,
    pub detail: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "exchange #{} failed at {:?}", self.index, self.stage)?;
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        Ok(())
    }
}

/// Outcome of a run.
#[derive(Debug, Clone)]
pub struct Report {
    pub target: SocketAddr,
    pub protocol: Protocol,
    pub attempted: usize,
    pub succeeded: usize,
    pub bytes_echoed: u64,
    pub failures: Vec<Failure>,
    pub elapsed: Duration,
    /// Response headers of the first successful HTTP exchange (empty for TCP).
    pub first_headers: Vec<(String, String)>,
    /// HTTP/2 requests re-sent on a new connection because the server had
    /// provably not processed them (a drained connection); not failures.
    pub retried_unprocessed: usize,
    /// HTTP/2 connections opened after the first one (GOAWAY drains).
    pub reconnects: usize,
    /// HTTP/2 connections opened in all (the first plus the reconnects);
    /// those minus the reconnects were kept open by the server through the
    /// run (moved at a handoff, or no handoff while they were open).
    pub h2_connections: usize,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.failures.is_empty() && self.succeeded == self.attempted
    }

    /// Value of a response header of the first successful HTTP exchange.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.first_headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Panics with every failure listed when any exchange failed.
    #[track_caller]
    pub fn assert_all_ok(&self) {
        assert!(self.ok(), "{self}");
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} to {}: {}/{} exchanges ok, {} bytes echoed in {:?}",
            self.protocol,
            self.target,
            self.succeeded,
            self.attempted,
            self.bytes_echoed,
            self.elapsed
        )?;
        if self.reconnects > 0 || self.retried_unprocessed > 0 {
            write!(
                f,
                " ({} reconnects, {} unprocessed requests re-sent)",
                self.reconnects, self.retried_unprocessed
            )?;
        }
        for failure in self.failures.iter().take(20) {
            write!(f, "\n  {failure}")?;
        }
        if self.failures.len() > 20 {
            write!(f, "\n  ... and {} more failures", self.failures.len() - 20)?;
        }
        Ok(())
    }
}

/// The payload of exchange `index`: deterministic, distinct per index.
pub fn payload(seed: u64, index: usize, len: usize) -> Vec<u8> {
    // xorshift64*: cheap, and a byte from another exchange never matches.
    let mut state = seed ^ ((index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
    (0..len)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
        })
        .collect()
}

/// Compares an echo with what was sent.
pub fn check_echo(sent: &[u8], received: &[u8]) -> Result<(), Stage> {
    if let Some(offset) = sent.iter().zip(received).position(|(a, b)| a != b) {
        return Err(Stage::Mismatch {
            offset,
            expected: sent[offset],
            received: received[offset],
        });
    }
    if sent.len() != received.len() {
        return Err(Stage::Length {
            sent: sent.len(),
            received: received.len(),
        });
    }
    Ok(())
}

type Headers = Vec<(String, String)>;
/// Outcome of one exchange: bytes echoed and response headers, or why not.
type Outcome = Result<(usize, Headers), Failure>;

fn fail(index: usize, stage: Stage, detail: impl fmt::Display) -> Failure {
    Failure {
        index,
        stage,
        detail: detail.to_string(),
    }
}

/// Runs `load` against `target` and reports every exchange's outcome.
pub async fn run(target: SocketAddr, load: &Load) -> Report {
    let started = Instant::now();
    let deadline = started + load.deadline;
    let h2 = if load.protocol == Protocol::Http2 {
        match H2Pool::connect(target, load.tls.clone(), load.timeout).await {
            Ok(pool) => Some(Arc::new(pool)),
            Err(failure) => {
                let mut failures = vec![failure];
                failures.extend(
                    (1..load.exchanges).map(|i| fail(i, Stage::NotStarted, "no HTTP/2 connection")),
                );
                return Report {
                    target,
                    protocol: load.protocol,
                    attempted: load.exchanges,
                    succeeded: 0,
                    bytes_echoed: 0,
                    failures,
                    elapsed: started.elapsed(),
                    first_headers: Vec::new(),
                    retried_unprocessed: 0,
                    reconnects: 0,
                    h2_connections: 0,
                };
            }
        }
    } else {
        None
    };

    let results: Vec<(usize, Outcome)> = stream::iter(0..load.exchanges)
        .map(|index| {
            let h2 = h2.clone();
            async move {
                if Instant::now() >= deadline {
                    return (
                        index,
                        Err(fail(index, Stage::NotStarted, "run deadline passed")),
                    );
                }
                let body = payload(load.seed, index, load.payload_bytes);
                let exchange = async {
                    match load.protocol {
                        Protocol::Tcp => {
                            tcp_exchange(target, load.tls.as_ref(), index, &body).await
                        }
                        Protocol::Http1 => {
                            http1_exchange(target, load.tls.as_ref(), index, body.clone()).await
                        }
                        Protocol::Http2 => {
                            let pool = h2.expect("an HTTP/2 run has a connection");
                            pool.exchange(index, body.clone()).await
                        }
                    }
                };
                let result = match tokio::time::timeout(load.timeout, exchange).await {
                    Ok(result) => result,
                    Err(_) => Err(fail(
                        index,
                        Stage::Timeout,
                        format!("no complete echo within {:?}", load.timeout),
                    )),
                };
                (index, result.map(|headers| (body.len(), headers)))
            }
        })
        .buffer_unordered(load.concurrency.max(1))
        .collect()
        .await;

    let mut report = Report {
        target,
        protocol: load.protocol,
        attempted: load.exchanges,
        succeeded: 0,
        bytes_echoed: 0,
        failures: Vec::new(),
        elapsed: started.elapsed(),
        first_headers: Vec::new(),
        retried_unprocessed: h2.as_ref().map_or(0, |p| p.retried.load(Ordering::Relaxed)),
        reconnects: h2
            .as_ref()
            .map_or(0, |p| p.reconnects.load(Ordering::Relaxed)),
        h2_connections: h2
            .as_ref()
            .map_or(0, |p| 1 + p.reconnects.load(Ordering::Relaxed)),
    };
    let mut results = results;
    results.sort_by_key(|(index, _)| *index);
    for (_, result) in results {
        match result {
            Ok((bytes, headers)) => {
                report.succeeded += 1;
                report.bytes_echoed += bytes as u64;
                if report.first_headers.is_empty() {
                    report.first_headers = headers;
                }
            }
            Err(failure) => report.failures.push(failure),
        }
    }
    report
}

async fn tcp_exchange(
    target: SocketAddr,
    tls: Option<&Tls>,
    index: usize,
    body: &[u8],
) -> Result<Headers, Failure> {
    let stream = connect(target, tls, index).await?;
    let (mut reader, mut writer) = tokio::io::split(stream);
    // Write and read concurrently: a large payload would otherwise deadlock
    // against the echo filling its send buffer.
    let write = async {
        writer.write_all(body).await?;
        writer.shutdown().await
    };
    let read = async {
        let mut received = Vec::with_capacity(body.len());
        reader.read_to_end(&mut received).await.map(|_| received)
    };
    let (written, received) = tokio::join!(write, read);
    written.map_err(|e| fail(index, Stage::Write, e))?;
    let received = received.map_err(|e| fail(index, Stage::Read, e))?;
    check_echo(body, &received).map_err(|stage| fail(index, stage, ""))?;
    Ok(Vec::new())
}

/// A connected stream, plain or TLS.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

async fn connect(
    target: SocketAddr,
    tls: Option<&Tls>,
    index: usize,
) -> Result<Box<dyn Io>, Failure> {
    let tcp = TcpStream::connect(target)
        .await
        .map_err(|e| fail(index, Stage::Connect, e))?;
    let _ = tcp.set_nodelay(true);
    match tls {
        None => Ok(Box::new(tcp)),
        Some(tls) => {
            let stream = TlsConnector::from(tls.config.clone())
                .connect(tls.server_name.clone(), tcp)
                .await
                .map_err(|e| fail(index, Stage::Tls, e))?;
            Ok(Box::new(stream))
        }
    }
}

fn echo_request(
    target: SocketAddr,
    tls: bool,
    body: Vec<u8>,
    version: Version,
) -> Request<Full<Bytes>> {
    let builder = Request::builder().method(Method::POST).version(version);
    let builder = if version == Version::HTTP_2 {
        let scheme = if tls { "https" } else { "http" };
        builder.uri(format!("{scheme}://{target}/echo"))
    } else {
        builder
            .uri("/echo")
            .header(http::header::HOST, target.to_string())
    };
    builder
        .body(Full::new(Bytes::from(body)))
        .expect("static request parts are valid")
}

async fn check_response(
    index: usize,
    response: http::Response<hyper::body::Incoming>,
    expected_version: Version,
    sent: &[u8],
) -> Result<Headers, Failure> {
    if response.status() != StatusCode::OK {
        return Err(fail(index, Stage::Status(response.status().as_u16()), ""));
    }
    if response.version() != expected_version {
        return Err(fail(
            index,
            Stage::Version(format!("{:?}", response.version())),
            "",
        ));
    }
    let headers: Headers = response
        .headers()
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or("<binary>").to_owned()))
        .collect();
    let received = response
        .into_body()
        .collect()
        .await
        .map_err(|e| fail(index, Stage::Read, e))?
        .to_bytes();
    check_echo(sent, &received).map_err(|stage| fail(index, stage, ""))?;
    Ok(headers)
}

async fn http1_exchange(
    target: SocketAddr,
    tls: Option<&Tls>,
    index: usize,
    body: Vec<u8>,
) -> Result<Headers, Failure> {
    let stream = connect(target, tls, index).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| fail(index, Stage::Handshake, e))?;
    let conn = tokio::spawn(conn);
    let sent = body.clone();
    let response = sender
        .send_request(echo_request(target, tls.is_some(), body, Version::HTTP_11))
        .await
        .map_err(|e| fail(index, Stage::Write, e))?;
    let result = check_response(index, response, Version::HTTP_11, &sent).await;
    conn.abort();
    result
}

type H2Sender = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

/// The HTTP/2 connection of a run, replaced when the server drains it.
struct H2Pool {
    target: SocketAddr,
    tls: Option<Tls>,
    timeout: Duration,
    current: tokio::sync::Mutex<H2Sender>,
    retried: AtomicUsize,
    reconnects: AtomicUsize,
}

/// Attempts per exchange: a drain can hit a request at most once per
/// connection, so three connections in a row draining under one request
/// means something other than a drain is wrong.
const H2_ATTEMPTS: usize = 3;

impl H2Pool {
    async fn connect(
        target: SocketAddr,
        tls: Option<Tls>,
        timeout: Duration,
    ) -> Result<Self, Failure> {
        let sender = connect_h2(target, tls.as_ref(), timeout).await?;
        Ok(Self {
            target,
            tls,
            timeout,
            current: tokio::sync::Mutex::new(sender),
            retried: AtomicUsize::new(0),
            reconnects: AtomicUsize::new(0),
        })
    }

    /// A sender on a live connection: the current one, or a new one when
    /// the current one is closed (or going away).
    async fn sender(&self) -> Result<H2Sender, Failure> {
        let mut current = self.current.lock().await;
        if current.is_closed() {
            *current = connect_h2(self.target, self.tls.as_ref(), self.timeout).await?;
            self.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        Ok(current.clone())
    }

    async fn exchange(&self, index: usize, body: Vec<u8>) -> Result<Headers, Failure> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut sender = self.sender().await.map_err(|f| Failure { index, ..f })?;
            let request = echo_request(
                self.target,
                self.tls.is_some(),
                body.clone(),
                Version::HTTP_2,
            );
            let sent = match sender.ready().await {
                // Nothing was sent: the connection closed under us.
                Err(e) => Err((e, true)),
                Ok(()) => match sender.send_request(request).await {
                    Ok(response) => Ok(response),
                    Err(e) => {
                        let unprocessed = h2_unprocessed(&e);
                        Err((e, unprocessed))
                    }
                },
            };
            match sent {
                Ok(response) => {
                    return check_response(index, response, Version::HTTP_2, &body).await;
                }
                Err((_, true)) if attempt < H2_ATTEMPTS => {
                    self.retried.fetch_add(1, Ordering::Relaxed);
                }
                Err((e, true)) => return Err(fail(index, Stage::Handshake, e)),
                Err((e, false)) => return Err(fail(index, Stage::Write, e)),
            }
        }
    }
}

/// Whether a failed HTTP/2 request provably never reached the application
/// (RFC 9113 §8.7): the stream was refused (REFUSED_STREAM), or it was above
/// the last-stream-id of a graceful GOAWAY (NO_ERROR), or hyper never
/// handed it to the connection.
pub(crate) fn h2_unprocessed(error: &hyper::Error) -> bool {
    if error.is_canceled() {
        return true;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return h2.reason() == Some(h2::Reason::REFUSED_STREAM)
                || (h2.is_go_away()
                    && h2.is_remote()
                    && h2.reason() == Some(h2::Reason::NO_ERROR));
        }
        source = e.source();
    }
    false
}

async fn connect_h2(
    target: SocketAddr,
    tls: Option<&Tls>,
    timeout: Duration,
) -> Result<H2Sender, Failure> {
    let connect = async {
        let stream = connect(target, tls, 0).await?;
        let (sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .map_err(|e| fail(0, Stage::Handshake, e))?;
        tokio::spawn(async move {
            if let Err(error) = conn.await {
                tracing::debug!(%error, "http/2 client connection ended");
            }
        });
        Ok(sender)
    };
    tokio::time::timeout(timeout, connect)
        .await
        .unwrap_or_else(|_| Err(fail(0, Stage::Timeout, "HTTP/2 connection not established")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An h2c echo server that drains every connection gracefully (GOAWAY,
    /// as a sidecar handing off does) once `per_conn` streams arrived on
    /// it; with `abort` it drops the connection instead, without answering
    /// the streams it took.
    async fn draining_h2_server(per_conn: usize, abort: bool) -> SocketAddr {
        use hyper::service::service_fn;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let seen = Arc::new(AtomicUsize::new(0));
                    let full = Arc::new(tokio::sync::Notify::new());
                    let (seen2, full2) = (seen.clone(), full.clone());
                    let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                        let (seen, full) = (seen2.clone(), full2.clone());
                        async move {
                            if seen.fetch_add(1, Ordering::SeqCst) + 1 == per_conn {
                                full.notify_one();
                            }
                            if abort {
                                // Hold the stream until the connection is dropped.
                                std::future::pending::<()>().await;
                            }
                            let body = req.into_body().collect().await?.to_bytes();
                            Ok::<_, hyper::Error>(http::Response::new(Full::new(body)))
                        }
                    });
                    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service);
                    tokio::pin!(conn);
                    tokio::select! {
                        _ = conn.as_mut() => return,
                        () = full.notified() => {}
                    }
                    if abort {
                        return; // dropped: a reset, not a drain
                    }
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn http2_drained_by_goaway_reconnects_and_loses_no_exchange() {
        let addr = draining_h2_server(4, false).await;
        let report = run(
            addr,
            &Load::new(Protocol::Http2).exchanges(60).concurrency(8),
        )
        .await;
        report.assert_all_ok();
        assert!(report.reconnects >= 5, "{report}");
        // Every connection the server drained was replaced: none kept.
        assert_eq!(report.h2_connections, report.reconnects + 1, "{report}");
        assert_eq!(report.bytes_echoed, 60 * 4096);
    }

    #[tokio::test]
    async fn http2_streams_the_server_took_and_dropped_are_failures_not_retries() {
        let addr = draining_h2_server(3, true).await;
        let report = run(
            addr,
            &Load::new(Protocol::Http2)
                .exchanges(3)
                .concurrency(3)
                .timeout(Duration::from_secs(3)),
        )
        .await;
        assert_eq!(report.succeeded, 0, "{report}");
        assert_eq!(report.failures.len(), 3, "{report}");
        assert_eq!(report.retried_unprocessed, 0, "{report}");
    }

    #[test]
    fn payloads_differ_between_exchanges_and_repeat_for_the_same_one() {
        assert_eq!(payload(1, 3, 64), payload(1, 3, 64));
        assert_ne!(payload(1, 3, 64), payload(1, 4, 64));
        assert_ne!(payload(1, 3, 64), payload(2, 3, 64));
    }

    #[test]
    fn check_echo_reports_the_first_differing_offset() {
        let sent = payload(7, 0, 100);
        let mut received = sent.clone();
        received[42] ^= 0xff;
        assert_eq!(
            check_echo(&sent, &received),
            Err(Stage::Mismatch {
                offset: 42,
                expected: sent[42],
                received: sent[42] ^ 0xff
            })
        );
    }

    #[test]
    fn check_echo_reports_a_short_echo_as_a_length_failure() {
        let sent = payload(7, 0, 100);
        assert_eq!(
            check_echo(&sent, &sent[..60]),
            Err(Stage::Length {
                sent: 100,
                received: 60
            })
        );
        assert_eq!(check_echo(&sent, &sent), Ok(()));
    }

    #[test]
    fn protocols_parse_from_their_cli_names() {
        assert_eq!("tcp".parse::<Protocol>(), Ok(Protocol::Tcp));
        assert_eq!("http1".parse::<Protocol>(), Ok(Protocol::Http1));
        assert_eq!("h2".parse::<Protocol>(), Ok(Protocol::Http2));
        assert!("udp".parse::<Protocol>().is_err());
    }
}
