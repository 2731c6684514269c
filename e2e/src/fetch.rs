//! A request driver that runs *inside* a meshed Pod: the e2e test asks it
//! (`POST /fetch`, JSON [`FetchSpec`]) to send a bounded number of HTTP/1.1
//! or HTTP/2 (h2c, prior knowledge) requests, or TCP echo exchanges, to a
//! target — a Service's ClusterIP:port, so the Pod's own
//! sidecar captures them and applies the Routes compiled for it — and gets
//! back what happened ([`FetchReport`]): status codes and which server
//! (the echo's `x-echo-server-name`) answered, counted.
//!
//! The test process on the host cannot be the client: traffic it sends
//! never passes through a client-side sidecar. A shell loop of `wget`s in
//! the Pod could, but tells nothing about statuses or servers per request.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};

use crate::demo::HEADER_SERVER_NAME;

/// Port the driver listens on in its Pod.
pub const PORT: u16 = 9000;
/// Most requests one `/fetch` may send.
pub const MAX_COUNT: usize = 100_000;
/// Longest one `/fetch` may run.
pub const MAX_RUN: Duration = Duration::from_secs(120);

/// What to send.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FetchSpec {
    /// `ip:port` to connect to.
    pub target: SocketAddr,
    #[serde(default = "root")]
    pub path: String,
    pub count: usize,
    #[serde(default = "one")]
    pub concurrency: usize,
    /// Extra request headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub protocol: FetchProtocol,
}

/// What one worker speaks on its connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FetchProtocol {
    #[default]
    Http1,
    /// h2c with prior knowledge: one connection per worker, one stream per
    /// request.
    Http2,
    /// Raw TCP to an echo server: each exchange writes [`TCP_MESSAGE`]
    /// bytes and reads them back ([`FetchReport::echoed`]).
    Tcp,
}

/// Bytes of one TCP exchange. The first is a control byte, so a sidecar's
/// protocol detection decides "raw TCP" at once (no text protocol starts
/// with one).
pub const TCP_MESSAGE: usize = 64;

fn root() -> String {
    "/".to_owned()
}

fn one() -> usize {
    1
}

/// What came back, counted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchReport {
    /// Responses by status code.
    pub statuses: BTreeMap<u16, usize>,
    /// Responses by the server that answered (`-` when the response had no
    /// `x-echo-server-name`: the sidecar answered itself).
    pub servers: BTreeMap<String, usize>,
    /// TCP exchanges whose bytes came back unchanged.
    #[serde(default)]
    pub echoed: usize,
    /// Requests sent again on a new connection because the first attempt
    /// provably was not processed (RFC 9113 §8.7: hyper never sent it, the
    /// stream was refused, or a graceful GOAWAY's last-stream-id excluded
    /// it), as compliant clients do; counted, and only once per request.
    #[serde(default)]
    pub retried: usize,
    /// Requests that got no response (connect, I/O, timeout), or TCP
    /// exchanges that did not echo.
    pub errors: usize,
    /// The first few errors, for the failure message.
    pub error_samples: Vec<String>,
    /// The first few 5xx responses a sidecar answered itself (no
    /// `x-echo-server-name`): when (Unix ms), status and the start of the
    /// body, which names the sidecar's reason — what a failure message
    /// needs to place the failure in time.
    #[serde(default)]
    pub local_samples: Vec<String>,
}

impl FetchReport {
    pub fn responses(&self) -> usize {
        self.statuses.values().sum()
    }

    pub fn status(&self, code: u16) -> usize {
        self.statuses.get(&code).copied().unwrap_or(0)
    }

    /// Responses from servers whose name starts with `prefix` (a
    /// Deployment's Pods).
    pub fn from_servers(&self, prefix: &str) -> usize {
        self.servers
            .iter()
            .filter(|(name, _)| name.starts_with(prefix))
            .map(|(_, n)| n)
            .sum()
    }

    /// Adds `other`'s counts to these.
    pub fn merge(&mut self, other: FetchReport) {
        for (k, v) in other.statuses {
            *self.statuses.entry(k).or_default() += v;
        }
        for (k, v) in other.servers {
            *self.servers.entry(k).or_default() += v;
        }
        self.echoed += other.echoed;
        self.retried += other.retried;
        self.errors += other.errors;
        for e in other.error_samples {
            if self.error_samples.len() < 5 {
                self.error_samples.push(e);
            }
        }
        for e in other.local_samples {
            if self.local_samples.len() < 5 {
                self.local_samples.push(e);
            }
        }
    }
}

/// Sends the requests: `concurrency` workers, each on one keep-alive
/// connection (reopened after an error), until `count` are done or
/// [`MAX_RUN`] passes.
pub async fn run(spec: FetchSpec) -> Result<FetchReport, String> {
    if spec.count == 0 || spec.count > MAX_COUNT {
        return Err(format!("count must be 1..={MAX_COUNT}"));
    }
    // A path or header that cannot form a request is refused here, once.
    let mut check = Request::get(&spec.path);
    for (k, v) in &spec.headers {
        check = check.header(k.as_str(), v.as_str());
    }
    check.body(()).map_err(|e| format!("request: {e}"))?;
    let concurrency = spec.concurrency.clamp(1, 64);
    let deadline = Instant::now() + MAX_RUN;
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (spec, next) = (spec.clone(), next.clone());
        workers.spawn(async move {
            let mut report = FetchReport::default();
            let mut conn: Option<Conn> = None;
            let mut seq = 0u64;
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < spec.count
                && Instant::now() < deadline
            {
                seq += 1;
                match tokio::time::timeout(
                    Duration::from_secs(5),
                    once(&spec, &mut conn, seq, &mut report.retried),
                )
                .await
                {
                    Ok(Ok(None)) => report.echoed += 1,
                    Ok(Ok(Some((resp, body)))) => {
                        let server = resp
                            .headers()
                            .get(HEADER_SERVER_NAME)
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("-")
                            .to_owned();
                        if server == "-"
                            && resp.status().is_server_error()
                            && report.local_samples.len() < 5
                        {
                            report
                                .local_samples
                                .push(local_sample(resp.status(), &body));
                        }
                        *report.statuses.entry(resp.status().as_u16()).or_default() += 1;
                        *report.servers.entry(server).or_default() += 1;
                    }
                    Ok(Err(e)) => {
                        conn = None;
                        report.errors += 1;
                        if report.error_samples.len() < 5 {
                            report.error_samples.push(e);
                        }
                    }
                    Err(_) => {
                        conn = None;
                        report.errors += 1;
                        if report.error_samples.len() < 5 {
                            report.error_samples.push("timed out after 5 s".into());
                        }
                    }
                }
            }
            report
        });
    }
    let mut total = FetchReport::default();
    while let Some(r) = workers.join_next().await {
        total.merge(r.map_err(|e| format!("worker: {e}"))?);
    }
    Ok(total)
}

/// "<unix ms> <status> <body start>" of a response the sidecar answered.
fn local_sample(status: StatusCode, body: &[u8]) -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let text = String::from_utf8_lossy(&body[..body.len().min(800)]);
    format!("{ms} {} {}", status.as_u16(), text.trim_end())
}

/// A worker's open connection.
enum Conn {
    Http1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    Http2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
    Tcp(TcpStream),
}

impl Conn {
    fn is_closed(&self) -> bool {
        match self {
            Conn::Http1(s) => s.is_closed(),
            Conn::Http2(s) => s.is_closed(),
            Conn::Tcp(_) => false,
        }
    }

    async fn open(spec: &FetchSpec) -> Result<Conn, String> {
        let tcp = TcpStream::connect(spec.target)
            .await
            .map_err(|e| format!("connect {}: {e}", spec.target))?;
        let _ = tcp.set_nodelay(true);
        Ok(match spec.protocol {
            FetchProtocol::Tcp => Conn::Tcp(tcp),
            FetchProtocol::Http1 => {
                let (send, driver) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                    .await
                    .map_err(|e| format!("handshake: {e}"))?;
                tokio::spawn(driver);
                Conn::Http1(send)
            }
            FetchProtocol::Http2 => {
                let (send, driver) = hyper::client::conn::http2::handshake(
                    hyper_util::rt::TokioExecutor::new(),
                    TokioIo::new(tcp),
                )
                .await
                .map_err(|e| format!("h2 handshake: {e}"))?;
                tokio::spawn(driver);
                Conn::Http2(send)
            }
        })
    }
}

/// One request (or TCP exchange, `None`) on the worker's connection
/// (opened if needed); the body is read to the end so the connection can
/// be reused, and returned.
async fn once(
    spec: &FetchSpec,
    conn: &mut Option<Conn>,
    seq: u64,
    retried: &mut usize,
) -> Result<Option<(Response<()>, Bytes)>, String> {
    if conn.as_ref().is_none_or(Conn::is_closed) {
        *conn = Some(Conn::open(spec).await?);
    }
    if let Some(Conn::Tcp(tcp)) = conn.as_mut() {
        return echo_exchange(tcp, seq).await.map(|()| None);
    }
    let resp = match send(spec, conn.as_mut().expect("opened above")).await {
        // Not processed (RFC 9113 §8.7): once more on a new connection.
        Err(e) if crate::traffic::h2_unprocessed(&e) => {
            *retried += 1;
            *conn = Some(Conn::open(spec).await?);
            send(spec, conn.as_mut().expect("opened above")).await
        }
        r => r,
    }
    .map_err(|e| format!("request: {}", error_chain(&e)))?;
    let (parts, body) = resp.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| format!("response body: {}", error_chain(&e)))?
        .to_bytes();
    Ok(Some((Response::from_parts(parts, ()), body)))
}

/// An error with its sources (hyper's own text is one word: "http2 error").
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        out.push_str(": ");
        out.push_str(&e.to_string());
        source = e.source();
    }
    out
}

/// Sends the spec's request on an HTTP connection.
async fn send(spec: &FetchSpec, conn: &mut Conn) -> Result<Response<Incoming>, hyper::Error> {
    let mut req = match spec.protocol {
        // h2 needs the scheme and authority in the URI (:scheme, :authority).
        FetchProtocol::Http2 => Request::get(format!("http://{}{}", spec.target, spec.path)),
        _ => Request::get(&spec.path).header(http::header::HOST, spec.target.to_string()),
    };
    for (k, v) in &spec.headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let req = req
        .body(Full::new(Bytes::new()))
        .expect("run() refused specs whose path or headers form no request");
    match conn {
        Conn::Http1(send) => {
            send.ready().await?;
            send.send_request(req).await
        }
        Conn::Http2(send) => {
            send.ready().await?;
            send.send_request(req).await
        }
        Conn::Tcp(_) => unreachable!("TCP exchanges are not requests"),
    }
}

/// Writes one numbered message and reads it back byte for byte.
async fn echo_exchange(tcp: &mut TcpStream, seq: u64) -> Result<(), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut msg = format!("\x01baton-fetch {seq} ").into_bytes();
    msg.resize(TCP_MESSAGE, b'.');
    tcp.write_all(&msg)
        .await
        .map_err(|e| format!("tcp write: {e}"))?;
    let mut back = vec![0u8; TCP_MESSAGE];
    tcp.read_exact(&mut back)
        .await
        .map_err(|e| format!("tcp read: {e}"))?;
    if back != msg {
        return Err(format!(
            "tcp echo differs: sent {:?}, got {:?}",
            String::from_utf8_lossy(&msg),
            String::from_utf8_lossy(&back)
        ));
    }
    Ok(())
}

/// Serves `POST /fetch` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener) -> std::io::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(async move {
            let service = service_fn(handle);
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn handle(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let reply = |status: StatusCode, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r
    };
    if req.method() != http::Method::POST || req.uri().path() != "/fetch" {
        return Ok(reply(StatusCode::NOT_FOUND, "POST /fetch only\n".into()));
    }
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return Ok(reply(StatusCode::BAD_REQUEST, format!("body: {e}\n"))),
    };
    let spec: FetchSpec = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return Ok(reply(StatusCode::BAD_REQUEST, format!("spec: {e}\n"))),
    };
    Ok(match run(spec).await {
        Ok(report) => reply(
            StatusCode::OK,
            serde_json::to_string(&report).expect("reports serialize"),
        ),
        Err(e) => reply(StatusCode::BAD_REQUEST, format!("{e}\n")),
    })
}

/// Asks the driver at `driver` to run `spec` (from the test process).
pub async fn fetch_via(driver: SocketAddr, spec: &FetchSpec) -> Result<FetchReport, String> {
    let tcp = TcpStream::connect(driver)
        .await
        .map_err(|e| format!("connect to the driver {driver}: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| format!("driver handshake: {e}"))?;
    tokio::spawn(conn);
    let req = Request::post("/fetch")
        .header(http::header::HOST, driver.to_string())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(
            serde_json::to_vec(spec).expect("specs serialize"),
        )))
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(MAX_RUN + Duration::from_secs(10), send.send_request(req))
        .await
        .map_err(|_| "the driver did not answer".to_owned())?
        .map_err(|e| format!("driver request: {e}"))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("driver body: {e}"))?
        .to_bytes();
    if status != StatusCode::OK {
        return Err(format!(
            "driver answered {status}: {}",
            String::from_utf8_lossy(&body)
        ));
    }
    serde_json::from_slice(&body).map_err(|e| format!("driver report: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(crate::demo::serve_http_echo(l, "echo-1".into()));
        addr
    }

    async fn driver() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve(l));
        addr
    }

    #[tokio::test]
    async fn the_driver_counts_statuses_and_servers() {
        let (target, driver) = (echo().await, driver().await);
        let spec = FetchSpec {
            target,
            path: "/".into(),
            count: 50,
            concurrency: 4,
            headers: BTreeMap::from([("x-canary".into(), "1".into())]),
            protocol: FetchProtocol::Http1,
        };
        let r = fetch_via(driver, &spec).await.unwrap();
        assert_eq!(r.status(200), 50);
        assert_eq!(r.from_servers("echo-"), 50);
        assert_eq!(r.errors, 0);
    }

    #[tokio::test]
    async fn the_flaky_path_fails_every_tenth_request_of_a_process() {
        let target = echo().await;
        let spec = FetchSpec {
            target,
            path: crate::demo::FLAKY_PATH.into(),
            count: 20,
            concurrency: 1,
            headers: BTreeMap::new(),
            protocol: FetchProtocol::Http1,
        };
        let r = run(spec).await.unwrap();
        // Only this test uses the path: requests 0 and 10 fail.
        assert_eq!(r.responses(), 20);
        assert_eq!((r.status(503), r.status(200)), (2, 18), "{r:?}");
    }

    #[tokio::test]
    async fn unreachable_targets_are_errors_not_hangs() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = l.local_addr().unwrap();
        drop(l);
        let r = run(FetchSpec {
            target,
            path: "/".into(),
            count: 3,
            concurrency: 1,
            headers: BTreeMap::new(),
            protocol: FetchProtocol::Http1,
        })
        .await
        .unwrap();
        assert_eq!(r.errors, 3);
        assert_eq!(r.responses(), 0);
        assert!(r.error_samples[0].contains("connect"), "{r:?}");
    }

    #[tokio::test]
    async fn the_driver_speaks_http2_and_byte_checked_tcp() {
        let (target, driver) = (echo().await, driver().await);
        let mut spec = FetchSpec {
            target,
            path: "/".into(),
            count: 30,
            concurrency: 3,
            headers: BTreeMap::new(),
            protocol: FetchProtocol::Http2,
        };
        let r = fetch_via(driver, &spec).await.unwrap();
        assert_eq!((r.status(200), r.errors), (30, 0), "{r:?}");

        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        spec.target = l.local_addr().unwrap();
        tokio::spawn(crate::demo::serve_tcp_echo(l));
        spec.protocol = FetchProtocol::Tcp;
        let r = fetch_via(driver, &spec).await.unwrap();
        assert_eq!((r.echoed, r.errors, r.responses()), (30, 0, 0), "{r:?}");
    }

    #[tokio::test]
    async fn counts_are_bounded() {
        let spec = FetchSpec {
            target: "127.0.0.1:1".parse().unwrap(),
            path: "/".into(),
            count: MAX_COUNT + 1,
            concurrency: 1,
            headers: BTreeMap::new(),
            protocol: FetchProtocol::Http1,
        };
        assert!(run(spec).await.is_err());
    }
}
