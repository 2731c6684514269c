//! The HTTP/1.1 fast path: plain request/response exchanges proxied by
//! rewriting the heads and copying the bodies, without hyper.
//!
//! Why: with TLS terminated by rustls and the bytes copied as raw TCP, the
//! sidecar spends ~2.5 µs of user CPU per keep-alive request; through hyper
//! (server connection, client pool, `http` types) it spends ~10 µs, twice
//! nginx's HTTP layer (docs/performance.md, "HTTP/1.1 fast path"). Most mesh
//! traffic is the simple case: a request without a body or with a small one,
//! a route without retries, mirrors, faults or header rewrites, one
//! upstream endpoint answering with a `Content-Length` or chunked body.
//!
//! How: the request head is parsed with `httparse` (what hyper uses), checked
//! for eligibility, and written to an upstream connection taken from the
//! cluster's idle list (newest first, a lock without contention on a
//! current-thread runtime; no task hand-over). The response head is parsed,
//! its hop-by-hop headers are dropped, and the body is copied by its framing
//! (length, chunked, or until close).
//!
//! Every head is first checked by [`crate::h1valid::validate`] (the same
//! check the hyper path runs on the raw bytes) and refused there if invalid.
//! Anything else — a `Transfer-Encoding` request body, `Expect`, an
//! upgrade, HTTP/1.0, an absolute-form target, a body larger than [`MAX_BODY`], a route or
//! listener whose filters need the general path (decided once when the
//! snapshot compiles: [`crate::routing::GeneralPath`]), a malformed head — is handed,
//! with every byte read so far, to the hyper path for the rest of the
//! connection, which applies all of its checks (including the smuggling
//! guard). A handoff parks the connection between two requests, like the
//! hyper path; upstream connections are not moved.
//!
//! A listener's authorization policy and access log do not send requests
//! away: once the fast path knows it keeps a request (every reason to fall
//! back is found first, so nothing is decided or logged twice), it asks
//! the policy ([`crate::filters::Rbac::authorize`], with the head's raw
//! header lines) and starts the line ([`crate::access_log::start_http`]),
//! the functions the general path calls; a denial or a path that cannot be
//! normalized is answered here as the general path answers it
//! (docs/decisions/0053).
//!
//! On by default; `runtime.h1_fast_path: false` sends every HTTP/1
//! connection to the hyper path. Every test suite runs with it on (the
//! handoff, TLS and end-to-end suites included).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::{Method, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;

use crate::config::UpstreamProtocol;
use crate::conn::{ChunkedEnd, ParkRequest, ParkableIo, Parked, PrefixedIo};
use crate::filters::ConnMeta;
use crate::h1valid::parse_length;
use crate::http_proxy::{Shared, idempotent, record_request};
use crate::routing::{CompiledRoute, RequestView, match_route, split_host_port};
use crate::upstream::{Cluster, Outcome, TcpUpstream};

/// Largest request body the fast path carries (it must be read whole before
/// the request is sent); larger bodies go through hyper, which streams.
pub const MAX_BODY: usize = 64 * 1024;
/// Header lines parsed on the fast path; more go to hyper (which applies
/// `runtime.max_headers`).
const MAX_HEADERS: usize = 64;
/// Room for each read of a response body after its first part.
const BODY_READ: usize = 64 * 1024;
/// Header lines accepted in a response head (hyper's client takes 100).
const MAX_RESPONSE_HEADERS: usize = 128;

/// Why the fast path let hyper take over (for tests and debug logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    Head,
    Framing,
    Route,
    Upstream,
}

impl Fallback {
    pub fn label(self) -> &'static str {
        match self {
            Fallback::Head => "head",
            Fallback::Framing => "framing",
            Fallback::Route => "route",
            Fallback::Upstream => "upstream",
        }
    }
}

/// Serve an HTTP/1 connection on the fast path, handing it to hyper at the
/// first request it does not take.
pub async fn serve<I: ParkableIo>(
    io: PrefixedIo<I>,
    meta: ConnMeta,
    shared: Arc<Shared>,
    mut park: oneshot::Receiver<ParkRequest>,
) {
    let (prefix, mut down) = io.into_parts();
    let mut buf = BytesMut::with_capacity(8 * 1024);
    buf.extend_from_slice(&prefix);
    let mut rbuf = BytesMut::with_capacity(8 * 1024);
    let mut drain = shared.lifecycle.drain_signal();
    let snapshot = shared.store.snapshot();
    let rt = &snapshot.runtime;
    let head_timeout = Duration::from_millis(rt.header_read_timeout_ms);
    let max_pairs = rt.route_metrics_max_series();
    let mut peers = crate::route_metrics::ConnCache::default();
    // False once the registry dropped its side (the process is going away):
    // keep serving, never park.
    let mut parkable = true;
    loop {
        // Between requests: the safe point for a handoff. The client has
        // `header_read_timeout_ms` for the whole head, idle time included
        // (as with hyper).
        let deadline = tokio::time::Instant::now() + head_timeout;
        let head_len = loop {
            if !buf.is_empty() {
                match head_length(&buf, rt.max_header_bytes) {
                    Ok(Some(n)) => break n,
                    Ok(None) => {}
                    Err(()) => {
                        return fall_back(down, buf, meta, shared, park, Fallback::Head).await;
                    }
                }
            }
            if *drain.borrow() && buf.is_empty() {
                return;
            }
            tokio::select! {
                biased;
                req = &mut park, if parkable => {
                    if let Ok(req) = req {
                        let (downstream, pre) = down.into_parked();
                        let mut unread = pre.to_vec();
                        unread.extend_from_slice(&buf);
                        req.answer(Parked::Http1 { meta, downstream, unread: Bytes::from(unread) });
                        return;
                    }
                    parkable = false;
                }
                _ = crate::lifecycle::wait_until(&mut drain, |d| *d), if buf.is_empty() => {}
                r = tokio::time::timeout_at(deadline, read_more(&mut down, &mut buf)) => match r {
                    Ok(Ok(n)) if n > 0 => {}
                    _ => return,
                },
            }
        };
        let started = Instant::now();
        // Every head is validated before anything else reads it (the check
        // the general path runs too), so no eligibility rule can skip it.
        if let Err(why) = crate::h1valid::validate(&buf[..head_len]) {
            return refuse(down, &buf[..head_len], &meta, &shared, why).await;
        }
        let planned = match plan(&buf[..head_len], &meta, &shared, started) {
            Ok(p) => p,
            Err(why) => return fall_back(down, buf, meta, shared, park, why).await,
        };
        // Counted when taken, before anything is answered: a client that
        // has its response finds the request counted.
        shared.metrics.h1_fast_path_requests.inc();
        // The whole body, before anything is sent (or answered: a request
        // the sidecar answers itself is read to its end, so the next one
        // starts where the client put it).
        let body_len = match &planned {
            Planned::Forward(p) => p.body_len,
            Planned::Answer(a) => a.body_len,
        };
        let deadline = tokio::time::Instant::now() + head_timeout;
        while buf.len() < head_len + body_len {
            match tokio::time::timeout_at(deadline, read_more(&mut down, &mut buf)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => return,
            }
        }
        let mut plan = match planned {
            Planned::Forward(p) => p,
            Planned::Answer(a) => {
                buf.advance(head_len + body_len);
                let close = a.close || *drain.borrow();
                let pair = a.route_name.as_ref().map(|r| {
                    peers.get(
                        &shared.peer_routes,
                        r,
                        meta.peer_identity.as_deref(),
                        max_pairs,
                    )
                });
                let sent = a.answer(&shared, pair, &mut down, close).await;
                if sent.is_err() || close {
                    let _ = down.shutdown().await;
                    return;
                }
                continue;
            }
        };
        let mut request = std::mem::take(&mut plan.upstream_head);
        request.extend_from_slice(&buf[head_len..head_len + plan.body_len]);
        buf.advance(head_len + plan.body_len);
        let close = plan.close || *drain.borrow();
        let ex = Exchange {
            plan: &plan,
            shared: &shared,
            started,
            close,
            pair: peers.get(
                &shared.peer_routes,
                &plan.route_name,
                meta.peer_identity.as_deref(),
                max_pairs,
            ),
        };
        match ex.run(&request, &mut rbuf, &mut down).await {
            Ok(keep) => {
                if !keep || close {
                    let _ = down.shutdown().await;
                    return;
                }
            }
            Err(()) => return,
        }
    }
}

/// Read more into `buf`, with room for a whole typical head.
async fn read_more<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut BytesMut,
) -> std::io::Result<usize> {
    if buf.capacity() - buf.len() < 2048 {
        buf.reserve(8 * 1024);
    }
    r.read_buf(buf).await
}

/// Answer a head that failed validation and close: nothing was sent
/// upstream, and nothing after it on this connection is read.
async fn refuse<I: ParkableIo>(
    mut down: I,
    head: &[u8],
    meta: &ConnMeta,
    shared: &Shared,
    why: crate::h1valid::Refusal,
) {
    crate::http_proxy::count_refusal(&shared.metrics, meta, why);
    shared.metrics.local_response(why.reason());
    let head_request = head.trim_ascii_start().starts_with(b"HEAD ");
    let _ = down.write_all(&why.response(head_request)).await;
    let _ = down.shutdown().await;
}

/// Give the connection to the hyper path, with everything read so far.
async fn fall_back<I: ParkableIo>(
    down: I,
    buf: BytesMut,
    meta: ConnMeta,
    shared: Arc<Shared>,
    park: oneshot::Receiver<ParkRequest>,
    why: Fallback,
) {
    tracing::trace!(conn = meta.id, ?why, "h1 fast path: hyper takes over");
    shared.metrics.h1_fast_path_fallback(why.label());
    let io = PrefixedIo::new(buf.freeze(), down);
    Box::pin(crate::http_conn::serve_http1(io, meta, shared, park)).await
}

/// Length of the request head in `buf`, `None` while incomplete, `Err` for
/// a head the fast path does not parse (hyper answers it).
fn head_length(buf: &[u8], max: usize) -> Result<Option<usize>, ()> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) if n <= max => Ok(Some(n)),
        Ok(httparse::Status::Partial) if buf.len() < max => Ok(None),
        _ => Err(()),
    }
}

/// What the fast path does with a request it takes.
enum Planned {
    /// Send it upstream.
    Forward(Plan),
    /// Answer it here: denied by the listener's policy, or a path that
    /// cannot be normalized.
    Answer(Answer),
}

/// A request the sidecar answers itself, as the general path would.
struct Answer {
    status: StatusCode,
    reason: &'static str,
    body: std::borrow::Cow<'static, str>,
    /// The request body's length (read and dropped).
    body_len: usize,
    close: bool,
    /// A `HEAD` request: the answer has no body.
    head_request: bool,
    route: Option<Arc<CompiledRoute>>,
    /// Known for a denial (routing came first), not for a refused path.
    route_name: Option<Arc<str>>,
    log: Option<Arc<crate::access_log::Pending>>,
    started: Instant,
}

impl Answer {
    /// Count it (a local response; per route when routed, as the general
    /// path's `record_status`), log it and write it.
    async fn answer<D: ParkableIo>(
        self,
        shared: &Shared,
        pair: Option<&crate::route_metrics::PairMetrics>,
        down: &mut D,
        close: bool,
    ) -> Result<(), ()> {
        shared.metrics.local_response(self.reason);
        if let Some(name) = &self.route_name {
            record_request(
                &shared.metrics,
                self.route.as_deref(),
                name,
                self.status,
                self.started,
            );
        }
        if let Some(pair) = pair {
            pair.record(self.status.as_u16(), self.started.elapsed().as_secs_f64());
        }
        if let Some(log) = &self.log {
            log.answered(self.status.as_u16(), Some(self.reason));
            if !self.head_request {
                log.add_out(self.body.len() as u64);
            }
        }
        let out = local_response(
            self.status,
            self.reason,
            &self.body,
            close,
            self.head_request,
        );
        down.write_all(&out).await.map_err(|_| ())
    }
}

/// A local answer's bytes: the general path's `local` (same status, headers
/// and body), `connection: close` when it is the connection's last. To a
/// `HEAD` request, the head alone (its `content-length` the body's, as
/// hyper answers): a body there would be read as the next response.
fn local_response(
    status: StatusCode,
    reason: &str,
    body: &str,
    close: bool,
    head_request: bool,
) -> Vec<u8> {
    let head = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: text/plain; charset=utf-8\r\nx-baton-local-reason: {reason}\r\ncontent-length: {}\r\n{}\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len(),
        if close { "connection: close\r\n" } else { "" },
    );
    let mut out = head.into_bytes();
    if !head_request {
        out.extend_from_slice(body.as_bytes());
    }
    out
}

/// What to do with one request.
struct Plan {
    /// The head for the upstream (the body is appended once read).
    upstream_head: Vec<u8>,
    method: Method,
    body_len: usize,
    /// The client asked to close after this exchange.
    close: bool,
    route: Option<Arc<CompiledRoute>>,
    route_name: Arc<str>,
    cluster: Arc<Cluster>,
    endpoint: crate::upstream::ActiveGuard,
    timeout: Option<Duration>,
    /// The request's access-log line, when the listener has one.
    log: Option<Arc<crate::access_log::Pending>>,
}

/// Whether the fast path takes this request, and what it does with it.
/// Every reason to fall back is found before the policy is asked or the
/// access-log line started: a request hyper takes over is decided, counted
/// and logged once, there.
fn plan(
    head: &[u8],
    meta: &ConnMeta,
    shared: &Shared,
    started: Instant,
) -> Result<Planned, Fallback> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    if !matches!(req.parse(head), Ok(httparse::Status::Complete(_))) || req.version != Some(1) {
        return Err(Fallback::Head);
    }
    let method =
        Method::from_bytes(req.method.unwrap_or("").as_bytes()).map_err(|_| Fallback::Head)?;
    if method == Method::CONNECT {
        return Err(Fallback::Head);
    }
    let path_and_query = req.path.unwrap_or("");
    if !path_and_query.starts_with('/') {
        return Err(Fallback::Head);
    }
    let mut host = None;
    let mut length: Option<usize> = None;
    let mut close = false;
    // `traceparent` values (more than one makes the context invalid).
    let mut traceparents = [None, None];
    for h in req.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("host") {
            if host.is_some() {
                return Err(Fallback::Head);
            }
            host = Some(std::str::from_utf8(h.value).map_err(|_| Fallback::Head)?);
        } else if name.eq_ignore_ascii_case("content-length") {
            // A repeated one (even with the same value) is left to hyper.
            if length.is_some() {
                return Err(Fallback::Framing);
            }
            let n = parse_length(h.value)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or(Fallback::Framing)?;
            length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            || name.eq_ignore_ascii_case("expect")
            || name.eq_ignore_ascii_case("upgrade")
        {
            return Err(Fallback::Framing);
        } else if name.eq_ignore_ascii_case("connection") {
            close |= has_token(h.value, "close");
        } else if name.eq_ignore_ascii_case(crate::trace::TRACEPARENT) {
            let slot = usize::from(traceparents[0].is_some());
            traceparents[slot] = Some(h.value);
        }
    }
    let body_len = length.unwrap_or(0);
    if body_len > MAX_BODY {
        return Err(Fallback::Framing);
    }
    let host = host.ok_or(Fallback::Head)?;

    let active = shared.store.load();
    let listener = active
        .config
        .listener(&meta.listener)
        .ok_or(Fallback::Route)?;
    // Decided when the snapshot compiled (`GeneralPath`), never here: one
    // list of what the fast path may skip, next to the types it classifies.
    if listener.general_path.is_some() {
        return Err(Fallback::Route);
    }
    let (raw_path, query) = match path_and_query.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (path_and_query, None),
    };
    let rt = &active.config.snapshot.runtime;
    // What the general path does first, in its order: the span, the
    // access-log line (started below, once nothing can fall back), the
    // path the policy matches.
    let span = rt.trace_context().then(|| {
        crate::trace::Span::for_request(
            traceparents.into_iter().flatten(),
            rt.trace_sample_percent(),
        )
    });
    let start_log = || {
        listener.config.access_log.then(|| {
            let line = crate::access_log::RequestLine {
                protocol: "http/1.1",
                method: method.as_str(),
                authority: (!host.is_empty()).then_some(host),
                path: raw_path,
            };
            crate::access_log::start_http(
                &shared.access_log,
                rt.access_log_lines_per_second(),
                started,
                meta,
                line,
                span.as_ref(),
            )
        })?
    };
    let rbac = listener.rbac.as_ref();
    let path = match rbac.filter(|r| r.matches_paths()) {
        None => std::borrow::Cow::Borrowed(raw_path),
        Some(_) => match crate::path_norm::normalize(raw_path) {
            Ok(p) => p,
            Err(why) => {
                return Ok(Planned::Answer(Answer {
                    status: StatusCode::BAD_REQUEST,
                    reason: why.reason(),
                    body: why.body().into(),
                    body_len,
                    close,
                    head_request: method == Method::HEAD,
                    route: None,
                    route_name: None,
                    log: start_log(),
                    started,
                }));
            }
        },
    };

    let (hostname, host_port) = split_host_port(host);
    let view = RequestView {
        host: hostname,
        port: host_port.unwrap_or(meta.dst_port()),
        path: &path,
        query,
        method: &method,
        headers: empty_headers(),
    };
    let (route, cluster) = match match_route(&listener.routes, &view) {
        Some(r) => {
            if r.general_path.is_some() {
                return Err(Fallback::Route);
            }
            (Some(r.clone()), r.pick_backend(crate::filters::fast_rand()))
        }
        None => {
            let port = host_port.unwrap_or(meta.dst_port());
            (None, *listener.port_map.get(&port).ok_or(Fallback::Route)?)
        }
    };
    let cluster = active.upstreams.clusters[cluster].clone();
    if cluster.config.protocol != UpstreamProtocol::Http1 {
        return Err(Fallback::Route);
    }
    let endpoint = cluster.pick().ok_or(Fallback::Upstream)?;
    let route_name = match &route {
        Some(r) => r.name.clone(),
        None => cluster.name.clone(),
    };

    // The fast path keeps this request: its line, then the policy (the
    // one function the general path calls too).
    let log = start_log();
    if let Some(l) = &log {
        l.update(|r| r.route = Some(route_name.to_string()));
    }
    if let Some(rbac) = rbac {
        let facts = crate::filters::RequestFacts {
            method: &method,
            path: &path,
            headers: crate::filters::Headers::Raw(req.headers),
        };
        let verdict = rbac.authorize(&shared.metrics, meta, Some(&facts));
        if let Some(l) = &log {
            l.authorized(&verdict);
        }
        if verdict.denied() {
            return Ok(Planned::Answer(Answer {
                status: StatusCode::FORBIDDEN,
                reason: crate::filters::DENIED_REASON,
                body: crate::filters::DENIED_BODY.into(),
                body_len,
                close,
                head_request: method == Method::HEAD,
                route,
                route_name: Some(route_name),
                log,
                started,
            }));
        }
    }
    if let Some(l) = &log {
        l.add_in(body_len as u64);
    }
    // The upstream gets the path the policy matched (docs/decisions/0053).
    let target = match &path {
        std::borrow::Cow::Owned(p) => Some((p.as_str(), query)),
        std::borrow::Cow::Borrowed(_) => None,
    };
    Ok(Planned::Forward(Plan {
        upstream_head: rewrite_request(&req, body_len, span.as_ref(), target),
        method,
        body_len,
        close,
        timeout: route.as_ref().and_then(|r| r.timeout),
        route,
        route_name,
        cluster,
        endpoint,
        log,
    }))
}

fn empty_headers() -> &'static http::HeaderMap {
    static EMPTY: std::sync::OnceLock<http::HeaderMap> = std::sync::OnceLock::new();
    EMPTY.get_or_init(http::HeaderMap::new)
}

/// Whether a comma-separated header value lists `token`.
fn has_token(v: &[u8], token: &str) -> bool {
    v.split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// The upstream connection an exchange uses, taken from the cluster's idle
/// list or new. Dropped after a clean exchange, it goes back to the list
/// (`pool_max_idle_per_endpoint`), so idle client connections hold no
/// upstream connection and clients that open a connection per request do
/// not cost one each.
struct Lease {
    cluster: std::sync::Weak<Cluster>,
    endpoint: usize,
    io: Option<TcpUpstream>,
    /// The exchange ended cleanly: back to the idle list when dropped
    /// (otherwise closed).
    idle: bool,
}

impl Lease {
    fn io(&mut self) -> &mut TcpUpstream {
        self.io.as_mut().expect("present until dropped")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.idle
            && let (Some(c), Some(io)) = (self.cluster.upgrade(), self.io.take())
        {
            c.put_idle(self.endpoint, io);
        }
    }
}

/// One request/response exchange.
struct Exchange<'a> {
    plan: &'a Plan,
    shared: &'a Shared,
    started: Instant,
    /// This is the connection's last exchange.
    close: bool,
    /// The (route, peer) series of this request.
    pair: &'a crate::route_metrics::PairMetrics,
}

impl Exchange<'_> {
    /// Send the request and copy its response: `Ok(keep)`, whether the
    /// connection can carry another exchange; `Err` when it must close without
    /// another response.
    async fn run<D: ParkableIo>(
        &self,
        out: &[u8],
        rbuf: &mut BytesMut,
        down: &mut D,
    ) -> Result<bool, ()> {
        let (plan, shared, close) = (self.plan, self.shared, self.close);
        let idx = plan.endpoint.index();
        let addr = plan.endpoint.endpoint().addr;
        let idempotent = idempotent(&plan.method);
        if let Some(log) = &plan.log {
            log.update(|r| r.upstream = Some(addr.to_string()));
        }
        let mut attempt = 0;
        // The lease goes back to the cluster's idle list when this returns
        // (newest first: the connection's next request most likely takes it
        // again), so an idle client connection holds no upstream connection,
        // and before the client sees the end, so its next connection finds
        // it.
        let (mut lease, head) = loop {
            attempt += 1;
            let fresh = match plan.cluster.take_idle(idx) {
                Some(io) => Ok((io, true)),
                None => plan
                    .cluster
                    .connect_upstream(addr, b"http/1.1")
                    .await
                    .map(|io| (io, false)),
            };
            let (io, reused) = match fresh {
                Ok(x) => x,
                Err(e) => {
                    plan.endpoint.report(Outcome::Failure);
                    let text = format!(
                        "upstream unavailable: route {}: {} {addr}: client error (Connect): {e}\n",
                        plan.route_name, plan.cluster.name
                    );
                    shared.metrics.upstream_error("connect");
                    return self
                        .local(
                            down,
                            StatusCode::SERVICE_UNAVAILABLE,
                            "upstream_unavailable",
                            &text,
                        )
                        .await;
                }
            };
            let mut lease = Lease {
                cluster: Arc::downgrade(&plan.cluster),
                endpoint: idx,
                io: Some(io),
                idle: false,
            };
            let io = lease.io();
            rbuf.clear();
            let sent = io.write_all(out).await;
            let got = match sent {
                Ok(()) => {
                    read_response_head(io, rbuf, plan.timeout, plan.method == Method::HEAD).await
                }
                Err(e) => Err(HeadError::Io(e)),
            };
            match got {
                Ok(h) => break (lease, h),
                // A kept-alive connection the upstream closed while idle: one
                // more try on a fresh one, where that is safe.
                Err(HeadError::Io(_))
                    if reused && rbuf.is_empty() && idempotent && attempt == 1 =>
                {
                    continue;
                }
                Err(e) => {
                    plan.endpoint.report(Outcome::Failure);
                    let (status, reason, label, what) = match e {
                        HeadError::Timeout => (
                            StatusCode::GATEWAY_TIMEOUT,
                            "upstream_timeout",
                            "timeout",
                            "upstream request timeout",
                        ),
                        _ => (
                            StatusCode::BAD_GATEWAY,
                            "upstream_reset",
                            "reset",
                            "upstream reset before response",
                        ),
                    };
                    shared.metrics.upstream_error(label);
                    let text = format!(
                        "{what}: route {}: {} {addr}: {e}\n",
                        plan.route_name, plan.cluster.name
                    );
                    return self.local(down, status, reason, &text).await;
                }
            }
        };
        plan.endpoint.report(if head.status.as_u16() >= 500 {
            Outcome::Failure
        } else {
            Outcome::Success
        });
        self.record(head.status);
        if let Some(log) = &plan.log {
            log.answered(head.status.as_u16(), None);
        }
        let framing = head.framing;
        let close_down = close || matches!(framing, Framing::Close);
        let mut out = rewrite_response(&rbuf[..head.len], close_down);
        rbuf.advance(head.len);
        let copied = copy_body(framing, lease.io(), rbuf, down, &mut out).await;
        lease.idle = copied.is_ok() && head.upstream_keep && rbuf.is_empty();
        // What the client got of the body (the data, not chunk framing: the
        // general path counts the same).
        let sent = match copied {
            Ok(n) | Err(n) => n,
        };
        if let Some(log) = &plan.log {
            log.add_out(sent);
        }
        copied.map(|_| !close_down).map_err(|_| ())
    }

    /// Count the request and its time to response head, as the hyper path does.
    fn record(&self, status: StatusCode) {
        let p = self.plan;
        record_request(
            &self.shared.metrics,
            p.route.as_deref(),
            &p.route_name,
            status,
            self.started,
        );
        // A second clock read rather than a changed `record_request`
        // (shared with the general path): ~20 ns, measured in 0048.
        self.pair
            .record(status.as_u16(), self.started.elapsed().as_secs_f64());
    }

    /// A local answer (the hyper path's `local`), same headers and body.
    async fn local<D: ParkableIo>(
        &self,
        down: &mut D,
        status: StatusCode,
        reason: &'static str,
        body: &str,
    ) -> Result<bool, ()> {
        self.shared.metrics.local_response(reason);
        self.record(status);
        let head_request = self.plan.method == Method::HEAD;
        if let Some(log) = &self.plan.log {
            log.answered(status.as_u16(), Some(reason));
            if !head_request {
                log.add_out(body.len() as u64);
            }
        }
        let out = local_response(status, reason, body, self.close, head_request);
        down.write_all(&out).await.map_err(|_| ())?;
        Ok(true)
    }
}

/// The request head for the upstream, without hop-by-hop headers; `room`:
/// bytes to reserve for the body that follows. With a `span`, the
/// `traceparent` is the span's (and `tracestate` is dropped when the trace
/// restarted: [`crate::trace`]). With a `target` (a normalized path and
/// the query), that is the request target instead of the received one.
fn rewrite_request(
    req: &httparse::Request<'_, '_>,
    room: usize,
    span: Option<&crate::trace::Span>,
    target: Option<(&str, Option<&str>)>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(512 + room);
    out.extend_from_slice(req.method.unwrap_or("GET").as_bytes());
    out.push(b' ');
    match target {
        Some((path, query)) => {
            out.extend_from_slice(path.as_bytes());
            if let Some(q) = query {
                out.push(b'?');
                out.extend_from_slice(q.as_bytes());
            }
        }
        None => out.extend_from_slice(req.path.unwrap_or("/").as_bytes()),
    }
    out.extend_from_slice(b" HTTP/1.1\r\n");
    write_headers(&mut out, req.headers, span.map(|s| s.restarted()));
    if let Some(s) = span {
        out.extend_from_slice(b"traceparent: ");
        out.extend_from_slice(&s.traceparent());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// Headers except hop-by-hop ones and the ones `Connection` names; with
/// `trace` = `Some(restarted)` also `traceparent` (the caller writes its
/// own) and, when the trace restarted, `tracestate`.
fn write_headers(out: &mut Vec<u8>, headers: &[httparse::Header<'_>], trace: Option<bool>) {
    // The `Connection` values, found once (not once per header).
    let connection: Vec<&[u8]> = headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("connection"))
        .map(|h| h.value)
        .collect();
    let named = |n: &str| connection.iter().any(|v| has_token(v, n));
    for h in headers {
        if crate::h1valid::HOP_BY_HOP
            .iter()
            .any(|n| h.name.eq_ignore_ascii_case(n))
            || named(h.name)
            || trace.is_some_and(|restarted| {
                h.name.eq_ignore_ascii_case(crate::trace::TRACEPARENT)
                    || (restarted && h.name.eq_ignore_ascii_case(crate::trace::TRACESTATE))
            })
        {
            continue;
        }
        out.extend_from_slice(h.name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
}

/// The response head for the client: hop-by-hop headers dropped
/// (`transfer-encoding` kept: a chunked body is copied as it is), and
/// `connection: close` when this is the connection's last response.
fn rewrite_response(head: &[u8], close: bool) -> Vec<u8> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let _ = resp.parse(head);
    let mut out = Vec::with_capacity(head.len() + 1024);
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(resp.code.unwrap_or(502).to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(resp.reason.unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    write_headers(&mut out, resp.headers, None);
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(u64),
    Chunked,
    /// Until the upstream closes (then the client's connection closes too).
    Close,
}

struct Head {
    len: usize,
    status: StatusCode,
    framing: Framing,
    /// The upstream keeps the connection open after this response.
    upstream_keep: bool,
}

#[derive(Debug, thiserror::Error)]
enum HeadError {
    #[error("{0}")]
    Io(std::io::Error),
    #[error("no response head within the route timeout")]
    Timeout,
    #[error("invalid response head: {0}")]
    Invalid(&'static str),
}

/// Read the response head (skipping `1xx` interim responses, which the
/// fast path does not solicit) into `rbuf`.
async fn read_response_head(
    io: &mut TcpUpstream,
    rbuf: &mut BytesMut,
    timeout: Option<Duration>,
    head_request: bool,
) -> Result<Head, HeadError> {
    let read = async {
        loop {
            if !rbuf.is_empty() {
                let mut headers = [httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS];
                let mut resp = httparse::Response::new(&mut headers);
                match resp.parse(rbuf) {
                    Ok(httparse::Status::Complete(n)) => {
                        let code = resp.code.unwrap_or(0);
                        if (100..200).contains(&code) {
                            if code == 101 {
                                return Err(HeadError::Invalid("101 without an upgrade"));
                            }
                            rbuf.advance(n);
                            continue;
                        }
                        let status =
                            StatusCode::from_u16(code).map_err(|_| HeadError::Invalid("status"))?;
                        let bodiless = head_request
                            || status == StatusCode::NO_CONTENT
                            || status == StatusCode::NOT_MODIFIED;
                        return response_head(n, status, resp.version, resp.headers, bodiless);
                    }
                    Ok(httparse::Status::Partial) if rbuf.len() < 64 * 1024 => {}
                    _ => return Err(HeadError::Invalid("unparseable")),
                }
            }
            match read_more(io, rbuf).await {
                Ok(0) => {
                    return Err(HeadError::Io(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "connection closed before message completed",
                    )));
                }
                Ok(_) => {}
                Err(e) => return Err(HeadError::Io(e)),
            }
        }
    };
    match timeout {
        Some(t) => tokio::time::timeout(t, read)
            .await
            .unwrap_or(Err(HeadError::Timeout)),
        None => read.await,
    }
}

fn response_head(
    len: usize,
    status: StatusCode,
    version: Option<u8>,
    headers: &[httparse::Header<'_>],
    bodiless: bool,
) -> Result<Head, HeadError> {
    let mut length = None;
    let mut chunked = None;
    let mut keep = version == Some(1);
    for h in headers {
        if h.name.eq_ignore_ascii_case("content-length") {
            let n = parse_length(h.value).ok_or(HeadError::Invalid("content-length"))?;
            if length.is_some_and(|l| l != n) {
                return Err(HeadError::Invalid("content-length"));
            }
            length = Some(n);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            // The last coding decides (RFC 9112 §6.3); chunked is copied,
            // anything else is read until close.
            let last = h
                .value
                .rsplit(|&b| b == b',')
                .next()
                .unwrap_or(b"")
                .trim_ascii();
            chunked = Some(last.eq_ignore_ascii_case(b"chunked"));
        } else if h.name.eq_ignore_ascii_case("connection") {
            if has_token(h.value, "close") {
                keep = false;
            } else if has_token(h.value, "keep-alive") {
                keep = true;
            }
        }
    }
    let framing = match (chunked, length) {
        // A response to HEAD, a 204 or a 304 ends after its head, whatever
        // its headers say (RFC 9112 §6.3).
        _ if bodiless => Framing::Length(0),
        (Some(true), None) => Framing::Chunked,
        // Both: a smuggling shape; the response is not trusted to end.
        (Some(_), Some(_)) => {
            return Err(HeadError::Invalid(
                "both content-length and transfer-encoding",
            ));
        }
        (Some(false), None) => Framing::Close,
        (None, Some(n)) => Framing::Length(n),
        (None, None) => Framing::Close,
    };
    Ok(Head {
        len,
        status,
        framing,
        upstream_keep: keep && framing != Framing::Close,
    })
}

/// Copy the response body after `out` (the rewritten head), starting with
/// what `rbuf` already holds; leaves in `rbuf` anything after the body.
/// Either way, the body's data bytes written to the client (a chunked
/// body's without its framing).
async fn copy_body<D: ParkableIo>(
    framing: Framing,
    io: &mut TcpUpstream,
    rbuf: &mut BytesMut,
    down: &mut D,
    out: &mut Vec<u8>,
) -> Result<u64, u64> {
    let mut sent = 0u64;
    let mut scan = ChunkedEnd::default();
    let mut left = match framing {
        Framing::Length(n) => n,
        _ => u64::MAX,
    };
    loop {
        // The part of `rbuf` that belongs to this body.
        let take = match framing {
            Framing::Length(_) => (rbuf.len() as u64).min(left) as usize,
            Framing::Chunked => match scan.feed(rbuf).map_err(|_| sent)? {
                Some(end) => {
                    left = 0;
                    end
                }
                None => rbuf.len(),
            },
            Framing::Close => rbuf.len(),
        };
        // The head goes out with the first part of the body (one write for
        // a small response); later parts go straight from `rbuf`.
        let written = if out.is_empty() {
            down.write_all(&rbuf[..take]).await
        } else {
            out.extend_from_slice(&rbuf[..take]);
            let w = down.write_all(out).await;
            out.clear();
            w
        };
        written.map_err(|_| sent)?;
        sent = match framing {
            Framing::Chunked => scan.data_bytes(),
            _ => sent + take as u64,
        };
        rbuf.advance(take);
        if let Framing::Length(_) = framing {
            left -= take as u64;
        }
        if left == 0 {
            return Ok(sent);
        }
        // Large bodies move in large reads.
        if rbuf.capacity() - rbuf.len() < BODY_READ / 4 {
            rbuf.reserve(BODY_READ);
        }
        match read_more(io, rbuf).await {
            Ok(0) if framing == Framing::Close => return Ok(sent),
            Ok(0) | Err(_) => return Err(sent),
            Ok(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_end_is_found_across_any_split() {
        let body = b"4\r\nWiki\r\n5;ext=1\r\npedia\r\n0\r\nx-trailer: 1\r\n\r\nNEXT";
        let end = body.len() - 4;
        for split in 0..body.len() {
            let mut s = ChunkedEnd::default();
            let got = match s.feed(&body[..split]).unwrap() {
                Some(n) => Some(n),
                None => s.feed(&body[split..]).unwrap().map(|n| n + split),
            };
            assert_eq!(got, Some(end), "split at {split}");
            assert_eq!(s.data_bytes(), 9, "chunk data counted, not framing");
        }
    }

    #[test]
    fn chunked_end_refuses_malformed_bodies() {
        for bad in [
            &b"zz\r\n"[..],
            b"4\r\nWikiXX",
            b"4\nWiki",
            b"ffffffffffffffffff\r\n",
        ] {
            assert!(ChunkedEnd::default().feed(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn request_rewrite_drops_hop_by_hop_and_connection_named_headers() {
        let head = b"GET /a?b=1 HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, x-hop\r\nX-Hop: 1\r\nKeep-Alive: 5\r\nTE: trailers\r\nX-End: 2\r\n\r\n";
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut headers);
        req.parse(head).unwrap();
        let out = String::from_utf8(rewrite_request(&req, 0, None, None)).unwrap();
        assert_eq!(out, "GET /a?b=1 HTTP/1.1\r\nHost: x\r\nX-End: 2\r\n\r\n");
    }

    #[test]
    fn request_rewrite_sends_a_normalized_path_with_the_query() {
        let head = b"GET //a/../b?c=%2F HTTP/1.1\r\nHost: x\r\n\r\n";
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut headers);
        req.parse(head).unwrap();
        let out = rewrite_request(&req, 0, None, Some(("/b", Some("c=%2F"))));
        assert_eq!(out, b"GET /b?c=%2F HTTP/1.1\r\nHost: x\r\n\r\n");
        let out = rewrite_request(&req, 0, None, Some(("/b", None)));
        assert!(out.starts_with(b"GET /b HTTP/1.1\r\n"));
    }

    #[test]
    fn a_local_answer_has_the_general_paths_headers_and_body() {
        let out = local_response(
            StatusCode::FORBIDDEN,
            "rbac_denied",
            "denied by rbac policy\n",
            false,
            false,
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 403 Forbidden\r\ncontent-type: text/plain; charset=utf-8\r\nx-baton-local-reason: rbac_denied\r\ncontent-length: 22\r\n\r\ndenied by rbac policy\n"
        );
        let last = local_response(StatusCode::BAD_REQUEST, "path_bad_escape", "x", true, false);
        assert!(
            String::from_utf8(last)
                .unwrap()
                .contains("\r\nconnection: close\r\n\r\nx")
        );
        let head = local_response(
            StatusCode::FORBIDDEN,
            "rbac_denied",
            "denied\n",
            false,
            true,
        );
        assert!(
            String::from_utf8(head)
                .unwrap()
                .ends_with("content-length: 7\r\n\r\n"),
            "no body after the head of an answer to HEAD"
        );
    }

    /// What trace context and the per-peer metrics add to each fast-path
    /// request, in ns (printed, not checked: timings are not a test).
    #[test]
    #[ignore = "a measurement: cargo test --release -p baton-sidecar --lib -- --ignored --nocapture fast_path_cost"]
    fn fast_path_cost_of_trace_context_and_peer_metrics() {
        use std::hint::black_box;
        const N: u32 = 300_000;
        fn ns(mut f: impl FnMut()) -> f64 {
            let t = Instant::now();
            for _ in 0..N {
                f();
            }
            t.elapsed().as_nanos() as f64 / f64::from(N)
        }
        let head = b"GET /api/items?id=1 HTTP/1.1\r\nHost: reviews:9080\r\nUser-Agent: wrk\r\nAccept: */*\r\n\r\n";
        let traced = b"GET /api/items?id=1 HTTP/1.1\r\nHost: reviews:9080\r\nUser-Agent: wrk\r\nAccept: */*\r\ntraceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\n\r\n";
        let mut h1 = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut plain_req = httparse::Request::new(&mut h1);
        plain_req.parse(head).unwrap();
        let mut h2 = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut traced_req = httparse::Request::new(&mut h2);
        traced_req.parse(traced).unwrap();
        let tp: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        for round in 0..3 {
            let off = ns(|| {
                black_box(rewrite_request(black_box(&plain_req), 0, None, None));
            });
            let new_trace = ns(|| {
                let s = crate::trace::Span::for_request(std::iter::empty(), 100.0);
                black_box(rewrite_request(black_box(&plain_req), 0, Some(&s), None));
            });
            let continued = ns(|| {
                let s = crate::trace::Span::for_request([tp].into_iter(), 100.0);
                black_box(rewrite_request(black_box(&traced_req), 0, Some(&s), None));
            });
            let m = crate::metrics::Metrics::new();
            let route: Arc<str> = Arc::from("r");
            let per_route = crate::metrics::RouteMetrics::resolve(&m, &route);
            let table = crate::route_metrics::PeerRouteMetrics::new(&m);
            let mut cache = crate::route_metrics::ConnCache::default();
            let started = Instant::now();
            let route_only = ns(|| {
                per_route.record(200, started.elapsed().as_secs_f64());
            });
            let with_peer = ns(|| {
                per_route.record(200, started.elapsed().as_secs_f64());
                cache
                    .get(&table, &route, Some("spiffe://td/ns/a/sa/b"), 300)
                    .record(200, started.elapsed().as_secs_f64());
            });
            println!(
                "round {round}: head rewrite {off:.0} ns; + new trace {:.0} ns; + continued trace {:.0} ns; per-route metrics {route_only:.0} ns; + per-peer {:.0} ns",
                new_trace - off,
                continued - off,
                with_peer - route_only
            );
        }
    }

    #[test]
    fn response_rewrite_keeps_chunking_and_adds_close_when_last() {
        let head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive\r\nX-A: 1\r\n\r\n";
        let out = String::from_utf8(rewrite_response(head, true)).unwrap();
        assert_eq!(
            out,
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\nconnection: close\r\n\r\n"
        );
    }

    #[test]
    fn response_framing_follows_rfc_9112() {
        let h = |raw: &[u8]| {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut r = httparse::Response::new(&mut headers);
            let n = match r.parse(raw).unwrap() {
                httparse::Status::Complete(n) => n,
                _ => panic!("partial"),
            };
            response_head(n, StatusCode::OK, r.version, r.headers, false)
        };
        let f = |raw: &[u8]| h(raw).map(|x| (x.framing, x.upstream_keep)).ok();
        assert_eq!(
            f(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\n"),
            Some((Framing::Length(3), true))
        );
        assert_eq!(
            f(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n"),
            Some((Framing::Chunked, true))
        );
        assert_eq!(
            f(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n"),
            Some((Framing::Close, false))
        );
        assert_eq!(f(b"HTTP/1.1 200 OK\r\n\r\n"), Some((Framing::Close, false)));
        assert_eq!(
            f(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\n"),
            Some((Framing::Length(3), false))
        );
        assert_eq!(
            f(b"HTTP/1.0 200 OK\r\ncontent-length: 3\r\n\r\n"),
            Some((Framing::Length(3), false))
        );
        assert_eq!(
            f(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n"),
            None
        );
        assert_eq!(
            f(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n"),
            None
        );
        assert_eq!(f(b"HTTP/1.1 200 OK\r\ncontent-length: +3\r\n\r\n"), None);
    }
}
