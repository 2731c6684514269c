//! The HTTP request path: route → stream filters → upstream (with retries,
//! timeouts, mirroring and header rewrites) → response.
//!
//! One [`HttpService`] per downstream connection; it loads the serving
//! config once per request and keeps that `Arc` until the request is done
//! (reloads never change a request midway).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::Semaphore;

use crate::body::{EndHook, InFlight, ProxyBody};
use crate::config::UpstreamProtocol;
use crate::config::store::{Active, ConfigStore};
use crate::conn::{ConnRegistry, H1Refusal};
use crate::filters::{
    ConnMeta, DENIED_BODY, DENIED_REASON, FilterAction, Headers, RequestFacts, StreamFilter,
    Verdict, fast_rand,
};
use crate::h1valid::Refusal;
use crate::lifecycle::Lifecycle;
use crate::metrics::{Metrics, RequestLabels, RouteLabels, RouteMetrics, StatusClass};
use crate::routing::{CompiledRoute, RequestView, match_route, split_host_port};
use crate::upstream::{Cluster, Outcome, SendError};

/// Process-wide state every connection handler shares.
#[derive(Debug)]
pub struct Shared {
    pub store: Arc<ConfigStore>,
    pub metrics: Arc<Metrics>,
    pub registry: Arc<ConnRegistry>,
    pub lifecycle: Lifecycle,
    /// Bounded fire-and-forget mirrors.
    pub mirror_slots: Arc<Semaphore>,
    /// Client for transparent passthrough (original destination).
    pub passthrough: Client<HttpConnector, ProxyBody>,
    /// Live connections per listener name (connection-limit filter).
    pub conn_counts: std::sync::Mutex<std::collections::HashMap<String, Arc<AtomicU32>>>,
    pub bytes_rx: prometheus_client::metrics::counter::Counter,
    pub bytes_tx: prometheus_client::metrics::counter::Counter,
    /// Access-log lines of listeners with `access_log: true`.
    pub access_log: Arc<crate::access_log::AccessLog>,
    /// Requests by route and peer identity (bounded).
    pub peer_routes: crate::route_metrics::PeerRouteMetrics,
    /// The runtime that serves traffic. A handoff runs on a thread of its
    /// own (`baton_handoff::sched::on_own_thread`) and registers the connections it adopts
    /// or gives back with this one, so they outlive the handoff.
    pub runtime: tokio::runtime::Handle,
}

impl Shared {
    /// Must be called inside the runtime that will serve traffic.
    /// `access_out`: where access-log lines go (stdout when `None`).
    pub fn new(
        store: Arc<ConfigStore>,
        metrics: Arc<Metrics>,
        lifecycle: Lifecycle,
        access_out: Option<Box<dyn std::io::Write + Send>>,
    ) -> Arc<Self> {
        let rt = store.snapshot().runtime.clone();
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(1)));
        connector.set_nodelay(true);
        let passthrough = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        let bytes_rx = metrics
            .bytes
            .get_or_create(&vec![("direction", "downstream_rx")])
            .clone();
        let bytes_tx = metrics
            .bytes
            .get_or_create(&vec![("direction", "downstream_tx")])
            .clone();
        Arc::new(Self {
            store,
            registry: ConnRegistry::new(),
            lifecycle,
            mirror_slots: Arc::new(Semaphore::new(rt.max_mirror_inflight)),
            passthrough,
            conn_counts: Default::default(),
            bytes_rx,
            bytes_tx,
            access_log: crate::access_log::AccessLog::start(&metrics, access_out),
            peer_routes: crate::route_metrics::PeerRouteMetrics::new(&metrics),
            metrics,
            runtime: tokio::runtime::Handle::current(),
        })
    }

    pub fn conn_count(&self, listener: &str) -> Arc<AtomicU32> {
        self.conn_counts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(listener.to_owned())
            .or_default()
            .clone()
    }
}

/// hyper service for one downstream connection.
#[derive(Debug, Clone)]
pub struct HttpService {
    pub shared: Arc<Shared>,
    pub conn: Arc<ConnMeta>,
    pub inflight: Arc<InFlight>,
    /// HTTP/1 only: marks the request the framing guard refused.
    pub h1_refusal: Option<Arc<H1Refusal>>,
    /// This connection's last (route, peer) metric handles: its peer never
    /// changes, so the shared table (a lock and two hashes) is asked only
    /// when the route changes. Uncontended: an HTTP/2 connection's streams
    /// run on its one event loop.
    pub peers: Arc<std::sync::Mutex<crate::route_metrics::ConnCache>>,
}

impl hyper::service::Service<Request<Incoming>> for HttpService {
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ProxyBody>, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        if let Some(why) = self.h1_refusal.as_ref().and_then(|r| r.next_is_refused()) {
            let resp = refuse(why, &self.shared.metrics, &self.conn);
            return Box::pin(std::future::ready(Ok(resp)));
        }
        let svc = self.clone();
        Box::pin(async move { Ok(svc.handle(req).await) })
    }
}

/// Count a finished request and its time to response head.
pub(crate) fn record_request(
    m: &Metrics,
    compiled: Option<&CompiledRoute>,
    route: &Arc<str>,
    status: StatusCode,
    started: Instant,
) {
    let elapsed = started.elapsed().as_secs_f64();
    match compiled {
        Some(r) => r
            .metrics
            .get_or_init(|| RouteMetrics::resolve(m, route))
            .record(status.as_u16(), elapsed),
        None => {
            m.requests
                .get_or_create(&RequestLabels {
                    route: route.clone(),
                    status_class: StatusClass::of(status.as_u16()),
                })
                .inc();
            m.request_duration
                .get_or_create(&RouteLabels {
                    route: route.clone(),
                })
                .observe(elapsed);
        }
    }
}

/// Why the sidecar answered itself (also the metric label).
fn local(
    status: StatusCode,
    reason: &'static str,
    body: impl Into<Bytes>,
    metrics: &Metrics,
) -> Response<ProxyBody> {
    metrics.local_response(reason);
    let mut resp = Response::new(ProxyBody::full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp.headers_mut().insert(
        HeaderName::from_static("x-baton-local-reason"),
        HeaderValue::from_static(reason),
    );
    resp
}

/// The answer to a request head [`crate::h1valid::validate`] refused (the
/// framing shadow saw it; hyper only parsed a stand-in). `Connection: close`:
/// after a malformed head nothing on the connection can be trusted to be
/// where a parser would look for the next request.
fn refuse(why: Refusal, metrics: &Metrics, conn: &ConnMeta) -> Response<ProxyBody> {
    count_refusal(metrics, conn, why);
    let mut resp = local(why.status(), why.reason(), format!("{why}\n"), metrics);
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// Count a refused HTTP/1 request head and write its one access-log line
/// (both paths; the caller sends the answer and counts it as a local
/// response).
pub(crate) fn count_refusal(metrics: &Metrics, conn: &ConnMeta, why: Refusal) {
    metrics.request_refusal(why.reason());
    tracing::info!(target: "access", conn = conn.id, peer = %conn.peer, listener = %conn.listener, status = why.status().as_u16(), reason = why.reason(), "request refused: {why}");
}

/// Where a request goes.
enum Target {
    Route(Arc<CompiledRoute>),
    Cluster(usize),
    Passthrough(SocketAddr),
}

/// Hop-by-hop headers never forwarded (RFC 9110 §7.6.1), plus the ones
/// named in `Connection`.
fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .filter(|n| !(keep_upgrade && n == header::UPGRADE))
        .collect();
    for n in named {
        headers.remove(n);
    }
    // The fast path's list (`connection` and `upgrade` are decided below),
    // and `transfer-encoding`: hyper frames each message itself.
    for n in crate::h1valid::HOP_BY_HOP
        .into_iter()
        .filter(|n| !matches!(*n, "connection" | "upgrade"))
        .chain(["transfer-encoding"])
    {
        headers.remove(n);
    }
    if keep_upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    } else {
        headers.remove(header::CONNECTION);
        headers.remove(header::UPGRADE);
    }
}

/// An upgrade to relay: HTTP/1.1, the `upgrade` connection option and
/// `Upgrade: websocket`. The head validation already refused every other
/// protocol except `h2c`, which is ignored: the request is served as
/// HTTP/1.1 and the offer is not passed on (RFC 9110 §7.8).
fn wants_upgrade(req: &Request<Incoming>) -> bool {
    req.version() == Version::HTTP_11
        && req.headers().get(header::UPGRADE).is_some_and(|v| {
            v.as_bytes()
                .split(|b| *b == b'/')
                .next()
                .is_some_and(|p| p.trim_ascii().eq_ignore_ascii_case(b"websocket"))
        })
        && req.headers().get_all(header::CONNECTION).iter().any(|v| {
            v.to_str().is_ok_and(|s| {
                s.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
        })
}

/// Idempotent per RFC 9110 §9.2.2: safe to send twice.
pub(crate) fn idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// How one attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    Connect,
    Reset,
    Timeout,
}

impl Failure {
    fn label(self) -> &'static str {
        match self {
            Failure::Connect => "connect",
            Failure::Reset => "reset",
            Failure::Timeout => "timeout",
        }
    }
}

fn upstream_uri(authority: &http::uri::Authority, original: &Uri) -> Uri {
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(http::uri::Scheme::HTTP);
    parts.authority = Some(authority.clone());
    parts.path_and_query = Some(
        original
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
    );
    Uri::from_parts(parts).unwrap_or_else(|_| original.clone())
}

/// The origin form of `uri` (its path and query; `/` when it has none):
/// what an HTTP/1.1 request line to an origin server carries.
fn origin_form(uri: &Uri) -> Uri {
    uri.path_and_query()
        .map_or_else(|| Uri::from_static("/"), |pq| Uri::from(pq.clone()))
}

/// `uri` with its path replaced (the query kept): the normalized path
/// forwarded upstream. Left as it was if the result would not parse (it
/// always does: normalizing only removes characters and decodes
/// unreserved ones).
fn with_path(uri: &mut Uri, path: &str) {
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_owned(),
    };
    let mut parts = uri.clone().into_parts();
    if let Ok(pq) = http::uri::PathAndQuery::try_from(pq) {
        parts.path_and_query = Some(pq);
        if let Ok(u) = Uri::from_parts(parts) {
            *uri = u;
        }
    }
}

fn clone_parts(p: &http::request::Parts) -> http::request::Parts {
    let mut req = Request::new(());
    *req.method_mut() = p.method.clone();
    *req.uri_mut() = p.uri.clone();
    *req.version_mut() = p.version;
    *req.headers_mut() = p.headers.clone();
    req.into_parts().0
}

impl HttpService {
    /// One request; its access-log line (when the listener has one) gets
    /// the answer's status and counts the response body as it passes.
    async fn handle(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        let mut pending = None;
        let head_request = req.method() == Method::HEAD;
        let resp = self.handle_request(req, &mut pending).await;
        match pending {
            Some(p) => finish_http(resp, p, head_request),
            None => resp,
        }
    }

    async fn handle_request(
        &self,
        mut req: Request<Incoming>,
        pending: &mut Option<Arc<crate::access_log::Pending>>,
    ) -> Response<ProxyBody> {
        let started = Instant::now();
        let guard = self.inflight.enter();
        let active = self.shared.store.load();
        let metrics = &self.shared.metrics;
        let Some(listener) = active.config.listener(&self.conn.listener) else {
            return local(
                StatusCode::SERVICE_UNAVAILABLE,
                "listener_removed",
                "listener is no longer configured\n",
                metrics,
            );
        };
        // The authority the request is routed by, found once: routing and
        // the access-log line read the same one.
        let authority = req
            .uri()
            .authority()
            .map(|a| a.as_str())
            .or_else(|| {
                req.headers()
                    .get(header::HOST)
                    .and_then(|h| h.to_str().ok())
            })
            .unwrap_or("");
        // The sidecar's span and the request's access-log line, before
        // anything can answer it.
        let rt = &active.config.snapshot.runtime;
        let span = rt
            .trace_context()
            .then(|| crate::trace::Span::from_headers(req.headers(), rt.trace_sample_percent()));
        if listener.config.access_log {
            let line = crate::access_log::RequestLine {
                protocol: match req.version() {
                    Version::HTTP_2 => "h2",
                    Version::HTTP_10 => "http/1.0",
                    _ => "http/1.1",
                },
                method: req.method().as_str(),
                authority: (!authority.is_empty()).then_some(authority),
                path: req.uri().path(),
            };
            *pending = crate::access_log::start_http(
                &self.shared.access_log,
                rt.access_log_lines_per_second(),
                started,
                &self.conn,
                line,
                span.as_ref(),
            );
        }
        // A policy with a path condition matches the normalized path, and
        // the request goes on (routed, forwarded) with it; a path that
        // cannot be normalized safely is refused (docs/decisions/0053).
        let normalized: Option<String> = match listener.rbac.as_ref() {
            Some(r) if r.matches_paths() => match crate::path_norm::normalize(req.uri().path()) {
                Ok(std::borrow::Cow::Owned(n)) => Some(n),
                Ok(std::borrow::Cow::Borrowed(_)) => None,
                Err(why) => {
                    return local(StatusCode::BAD_REQUEST, why.reason(), why.body(), metrics);
                }
            },
            _ => None,
        };
        let path = normalized.as_deref().unwrap_or(req.uri().path());

        // Route.
        let (host, host_port) = split_host_port(authority);
        let view = RequestView {
            host,
            port: host_port.unwrap_or(self.conn.dst_port()),
            path,
            query: req.uri().query(),
            method: req.method(),
            headers: req.headers(),
        };
        let target = match match_route(&listener.routes, &view) {
            Some(r) => Some(Target::Route(r.clone())),
            None => {
                let port = host_port.unwrap_or(self.conn.dst_port());
                match (listener.port_map.get(&port), self.conn.original_dst) {
                    (Some(c), _) => Some(Target::Cluster(*c)),
                    (None, Some(dst)) if listener.config.passthrough => {
                        Some(Target::Passthrough(dst))
                    }
                    _ => None,
                }
            }
        };
        let route_name: Option<Arc<str>> = target.as_ref().map(|t| match t {
            Target::Route(r) => r.name.clone(),
            Target::Cluster(c) => active.upstreams.clusters[*c].name.clone(),
            Target::Passthrough(_) => Arc::from("passthrough"),
        });
        // The line names the route before anything can answer: a denied
        // request's line says which route it asked for.
        if let (Some(p), Some(name)) = (pending.as_ref(), &route_name) {
            p.update(|r| r.route = Some(name.to_string()));
        }

        // Authorization, under the config this request arrived under (one
        // `load` per request: a keep-alive connection opened before a
        // policy change is governed by the new policy from its next
        // request on), before anything is answered: a denied client gets
        // 403 whether or not a route exists.
        let authz: Option<Verdict> = listener.rbac.as_ref().map(|rbac| {
            let facts = RequestFacts {
                method: req.method(),
                path,
                headers: Headers::Map(req.headers()),
            };
            rbac.authorize(metrics, &self.conn, Some(&facts))
        });
        if let (Some(v), Some(p)) = (&authz, pending.as_ref()) {
            p.authorized(v);
        }
        // The request's verdict stays here for what reads it later (the
        // access log); a denied request ends now.
        if authz.as_ref().is_some_and(Verdict::denied) {
            let resp = local(StatusCode::FORBIDDEN, DENIED_REASON, DENIED_BODY, metrics);
            if let Some(route_name) = &route_name {
                let compiled = match &target {
                    Some(Target::Route(r)) => Some(&**r),
                    _ => None,
                };
                self.record_status(
                    compiled,
                    route_name,
                    resp.status(),
                    started,
                    listener.config.access_log,
                );
            }
            return resp;
        }
        let (Some(target), Some(route_name)) = (target, route_name) else {
            let body = format!("no route for host {host:?} path {path:?}\n");
            return local(StatusCode::NOT_FOUND, "no_route", body, metrics);
        };

        // Stream filters, in chain order: fault injection.
        let draw = fast_rand() % 10_000;
        let fault = match &target {
            Target::Route(r) => r.fault.clone().map(StreamFilter::Fault),
            _ => None,
        };
        for filter in fault.iter() {
            match filter.on_request(draw) {
                FilterAction::Continue => {}
                FilterAction::Delay(d) => tokio::time::sleep(d).await,
                FilterAction::Respond(status, body) => {
                    let resp = local(status, "fault_abort", body, metrics);
                    let compiled = match &target {
                        Target::Route(r) => Some(&**r),
                        _ => None,
                    };
                    self.record_status(
                        compiled,
                        &route_name,
                        resp.status(),
                        started,
                        listener.config.access_log,
                    );
                    return resp;
                }
            }
        }

        let upgrade = wants_upgrade(&req);
        let downstream_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        if let Some(n) = normalized {
            with_path(&mut parts.uri, &n);
        }
        strip_hop_by_hop(&mut parts.headers, upgrade);
        if let Some(s) = &span {
            s.apply(&mut parts.headers);
        }
        // The authority the request was routed by is the one the upstream
        // gets: an absolute-form target's wins over `Host` (RFC 9112 §3.2.2:
        // a proxy generates `Host` from it), as does HTTP/2's `:authority`.
        if let Some(a) = parts.uri.authority()
            && let Ok(v) = HeaderValue::from_str(a.as_str())
        {
            parts.headers.insert(header::HOST, v);
        }
        let route = match &target {
            Target::Route(r) => Some(r.clone()),
            _ => None,
        };
        if let Some(r) = &route {
            r.request_headers.apply(&mut parts.headers);
        }

        // Buffer small bodies when they may be replayed (retry, mirror).
        let replay_wanted = route.as_ref().is_some_and(|r| {
            r.retry.as_ref().is_some_and(|x| x.attempts > 0) || r.mirror.is_some()
        });
        let max_buf = active.config.snapshot.runtime.max_buffered_body as u64;
        let mut buffered: Option<Bytes> = None;
        let mut streamed: Option<Incoming> = None;
        if replay_wanted
            && !upgrade
            && http_body::Body::size_hint(&body)
                .upper()
                .is_some_and(|n| n <= max_buf)
        {
            match body.collect().await {
                Ok(c) => {
                    let b = c.to_bytes();
                    if let Some(p) = pending.as_ref() {
                        p.add_in(b.len() as u64);
                    }
                    buffered = Some(b);
                }
                Err(_) => {
                    return local(
                        StatusCode::BAD_REQUEST,
                        "body_read_error",
                        "error reading request body\n",
                        metrics,
                    );
                }
            }
        } else {
            streamed = Some(body);
        }

        // Mirror (fire-and-forget, only with a buffered body).
        if let (Some(r), Some(b)) = (&route, &buffered)
            && let Some((cluster, percent)) = r.mirror
            && f64::from(draw) < percent * 100.0
        {
            self.mirror(&active, cluster, clone_parts(&parts), b.clone(), r.timeout);
        }

        let result = match target {
            Target::Passthrough(dst) => {
                let authority = http::uri::Authority::try_from(dst.to_string().as_str()).ok();
                match authority {
                    Some(a) => {
                        parts.uri = upstream_uri(&a, &parts.uri);
                        parts.version = Version::HTTP_11;
                        if let Some(p) = pending.as_ref() {
                            p.update(|r| r.upstream = Some(dst.to_string()));
                        }
                        let tap = pending.clone().map(crate::body::Tap::In);
                        let body = buffered
                            .map(ProxyBody::full)
                            .or(streamed.map(|s| ProxyBody::streamed(s).with_tap(tap)))
                            .unwrap_or_default();
                        self.shared
                            .passthrough
                            .request(Request::from_parts(parts, body))
                            .await
                            .map(|r| (r, None))
                            .map_err(|e| {
                                if e.is_connect() {
                                    (Failure::Connect, e.to_string())
                                } else {
                                    (Failure::Reset, e.to_string())
                                }
                            })
                    }
                    None => Err((Failure::Connect, "bad original destination".into())),
                }
            }
            Target::Cluster(c) => {
                self.send_with_retries(
                    cluster_picker(&active, Some(c)),
                    None,
                    parts,
                    buffered,
                    streamed,
                    &route_name,
                    pending.as_ref(),
                )
                .await
            }
            Target::Route(ref r) => {
                let picker = cluster_picker(&active, None);
                let fut = self.send_with_retries(
                    picker,
                    Some(r.clone()),
                    parts,
                    buffered,
                    streamed,
                    &route_name,
                    pending.as_ref(),
                );
                match r.timeout {
                    Some(t) => tokio::time::timeout(t, fut).await.unwrap_or_else(|_| {
                        Err((
                            Failure::Timeout,
                            format!("no response within {} ms", t.as_millis()),
                        ))
                    }),
                    None => fut.await,
                }
            }
        };

        let resp = match result {
            Ok((mut resp, end_hook)) => {
                let switching = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
                if switching && let Some(down) = downstream_upgrade {
                    // Both sides switch protocols: splice the raw streams.
                    let up = hyper::upgrade::on(&mut resp);
                    tokio::spawn(splice_upgrades(down, up));
                }
                let (mut rparts, rbody) = resp.into_parts();
                strip_hop_by_hop(&mut rparts.headers, switching && upgrade);
                if upgrade && !switching {
                    // The upstream declined the upgrade. The framing shadow
                    // stopped following at the upgrade head; end the
                    // connection rather than read unvalidated heads after it.
                    rparts
                        .headers
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                if let Some(r) = &route {
                    r.response_headers.apply(&mut rparts.headers);
                }
                if switching {
                    Response::from_parts(rparts, ProxyBody::streamed(rbody))
                } else {
                    Response::from_parts(
                        rparts,
                        ProxyBody::streamed(rbody)
                            .with_done(Some(guard))
                            .with_end_hook(end_hook),
                    )
                }
            }
            Err((failure, detail)) => {
                metrics.upstream_error(failure.label());
                let (status, reason, text) = match failure {
                    Failure::Connect => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "upstream_unavailable",
                        "upstream unavailable",
                    ),
                    Failure::Reset => (
                        StatusCode::BAD_GATEWAY,
                        "upstream_reset",
                        "upstream reset before response",
                    ),
                    Failure::Timeout => (
                        StatusCode::GATEWAY_TIMEOUT,
                        "upstream_timeout",
                        "upstream request timeout",
                    ),
                };
                local(
                    status,
                    reason,
                    format!("{text}: route {route_name}: {detail}\n"),
                    metrics,
                )
            }
        };
        self.record_status(
            route.as_deref(),
            &route_name,
            resp.status(),
            started,
            listener.config.access_log,
        );
        resp
    }

    fn record_status(
        &self,
        compiled: Option<&CompiledRoute>,
        route: &Arc<str>,
        status: StatusCode,
        started: Instant,
        access_log: bool,
    ) {
        record_request(&self.shared.metrics, compiled, route, status, started);
        let max = self
            .shared
            .store
            .snapshot()
            .runtime
            .route_metrics_max_series();
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(
                &self.shared.peer_routes,
                route,
                self.conn.peer_identity.as_deref(),
                max,
            )
            .record(status.as_u16(), started.elapsed().as_secs_f64());
        if access_log {
            tracing::debug!(target: "access", conn = self.conn.id, peer = %self.conn.peer, route = %route, status = status.as_u16(), micros = started.elapsed().as_micros() as u64, "request");
        }
    }

    /// Send to the route's (or a fixed) cluster, retrying where safe.
    // `log`: the request's access-log line, told each attempt's endpoint.
    #[allow(clippy::too_many_arguments)]
    async fn send_with_retries(
        &self,
        picker: ClusterPicker,
        route: Option<Arc<CompiledRoute>>,
        parts: http::request::Parts,
        buffered: Option<Bytes>,
        mut streamed: Option<Incoming>,
        route_name: &Arc<str>,
        log: Option<&Arc<crate::access_log::Pending>>,
    ) -> Result<(Response<Incoming>, Option<EndHook>), (Failure, String)> {
        let retry = route.as_ref().and_then(|r| r.retry.as_ref());
        if let Some(r) = retry {
            r.budget.deposit();
        }
        let replayable = buffered.is_some();
        let method_idempotent = idempotent(&parts.method);
        let mut parts = Some(parts);
        let mut attempt: u32 = 0;
        loop {
            let cluster = picker.pick(route.as_deref());
            let Some(ep) = cluster.pick() else {
                self.shared.metrics.upstream_error("no_endpoints");
                return Err((
                    Failure::Connect,
                    format!("cluster {} has no endpoints", cluster.name),
                ));
            };
            if let Some(p) = log {
                p.update(|r| r.upstream = Some(ep.endpoint().addr.to_string()));
            }
            let more_attempts = retry.is_some_and(|r| attempt < r.attempts) && replayable;
            let mut p = if more_attempts {
                clone_parts(parts.as_ref().expect("parts kept while retries remain"))
            } else {
                parts.take().expect("parts available for the last attempt")
            };
            p.version = match cluster.config.protocol {
                UpstreamProtocol::Http1 => Version::HTTP_11,
                UpstreamProtocol::Http2 => Version::HTTP_2,
            };
            let body = match (&buffered, streamed.take()) {
                (Some(b), _) => ProxyBody::full(b.clone()),
                (None, Some(s)) => {
                    ProxyBody::streamed(s).with_tap(log.cloned().map(crate::body::Tap::In))
                }
                (None, None) => ProxyBody::Empty,
            };
            // HTTP/1.1 upstreams take the cluster's own connection list;
            // HTTP/2 upstreams and protocol upgrades (the connection is
            // spliced, never reused) take hyper-util's client.
            let own_pool = cluster.config.protocol == UpstreamProtocol::Http1
                && !p.headers.contains_key(header::UPGRADE);
            let fut = async {
                if own_pool {
                    p.uri = origin_form(&p.uri);
                    if !p.headers.contains_key(header::HOST)
                        && let Ok(v) = HeaderValue::from_str(ep.endpoint().authority.as_str())
                    {
                        p.headers.insert(header::HOST, v);
                    }
                    match cluster
                        .send_http1(ep.index(), Request::from_parts(p, body))
                        .await
                    {
                        Ok((resp, checkin)) => Ok((resp, Some(EndHook::new(|| checkin.done())))),
                        Err(SendError::Connect(e)) => {
                            Err((Failure::Connect, format!("client error (Connect): {e}")))
                        }
                        Err(e) => Err((Failure::Reset, e.to_string())),
                    }
                } else {
                    p.uri = upstream_uri(&ep.endpoint().authority, &p.uri);
                    match cluster.client.request(Request::from_parts(p, body)).await {
                        Ok(resp) => Ok((resp, None)),
                        Err(e) => {
                            let kind = if e.is_connect() {
                                Failure::Connect
                            } else {
                                Failure::Reset
                            };
                            let detail = match std::error::Error::source(&e) {
                                Some(s) => format!("{e}: {s}"),
                                None => e.to_string(),
                            };
                            Err((kind, detail))
                        }
                    }
                }
            };
            let res = match retry.and_then(|r| r.per_try_timeout) {
                Some(t) => tokio::time::timeout(t, fut).await.map_err(|_| ()),
                None => Ok(fut.await),
            };
            let failure = match res {
                Ok(Ok((resp, hook))) => {
                    let status = resp.status().as_u16();
                    let retry_status =
                        retry.is_some_and(|r| r.on_statuses.contains(&status)) && method_idempotent;
                    ep.report(if status >= 500 {
                        Outcome::Failure
                    } else {
                        Outcome::Success
                    });
                    if !(retry_status && more_attempts) {
                        return Ok((resp, hook));
                    }
                    if !retry.is_some_and(|r| r.budget.try_withdraw()) {
                        self.retry_metric("budget_exhausted");
                        return Ok((resp, hook));
                    }
                    self.retry_metric("sent");
                    attempt += 1;
                    tracing::debug!(route = %route_name, status, attempt, "retrying on status");
                    continue;
                }
                Ok(Err((kind, detail))) => {
                    ep.report(Outcome::Failure);
                    (
                        kind,
                        format!("{} {}: {detail}", cluster.name, ep.endpoint().addr),
                    )
                }
                Err(()) => {
                    ep.report(Outcome::Failure);
                    (
                        Failure::Timeout,
                        format!("{} {}: per-try timeout", cluster.name, ep.endpoint().addr),
                    )
                }
            };
            self.shared.metrics.upstream_error(failure.0.label());
            let safe = match failure.0 {
                // The request never left: safe for every method.
                Failure::Connect => retry.is_some_and(|r| r.on_connect_failure),
                Failure::Reset => retry.is_some_and(|r| r.on_reset) && method_idempotent,
                Failure::Timeout => method_idempotent,
            };
            if !(safe && more_attempts) {
                return Err(failure);
            }
            if !retry.is_some_and(|r| r.budget.try_withdraw()) {
                self.retry_metric("budget_exhausted");
                return Err(failure);
            }
            self.retry_metric("sent");
            attempt += 1;
        }
    }

    fn retry_metric(&self, outcome: &'static str) {
        self.shared
            .metrics
            .retries
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    fn mirror(
        &self,
        active: &Arc<Active>,
        cluster: usize,
        mut parts: http::request::Parts,
        body: Bytes,
        timeout: Option<Duration>,
    ) {
        let metrics = self.shared.metrics.clone();
        let Ok(permit) = self.shared.mirror_slots.clone().try_acquire_owned() else {
            metrics
                .mirror
                .get_or_create(&vec![("outcome", "dropped")])
                .inc();
            return;
        };
        let cluster = active.upstreams.clusters[cluster].clone();
        metrics
            .mirror
            .get_or_create(&vec![("outcome", "sent")])
            .inc();
        tokio::spawn(async move {
            let _permit = permit;
            let Some(ep) = cluster.pick() else { return };
            parts.uri = upstream_uri(&ep.endpoint().authority, &parts.uri);
            parts.version = match cluster.config.protocol {
                UpstreamProtocol::Http1 => Version::HTTP_11,
                UpstreamProtocol::Http2 => Version::HTTP_2,
            };
            let fut = async {
                if let Ok(resp) = cluster
                    .client
                    .request(Request::from_parts(parts, ProxyBody::full(body)))
                    .await
                {
                    let _ = resp.into_body().collect().await;
                }
            };
            let _ = tokio::time::timeout(timeout.unwrap_or(Duration::from_secs(5)), fut).await;
        });
    }
}

/// Chooses the cluster for each attempt (a new weighted draw per retry, so
/// retries can land on another backend).
struct ClusterPicker {
    active: Arc<Active>,
    fixed: Option<usize>,
}

fn cluster_picker(active: &Arc<Active>, fixed: Option<usize>) -> ClusterPicker {
    ClusterPicker {
        active: active.clone(),
        fixed,
    }
}

impl ClusterPicker {
    fn pick(&self, route: Option<&CompiledRoute>) -> Arc<Cluster> {
        let idx = match (self.fixed, route) {
            (Some(c), _) => c,
            (None, Some(r)) => r.pick_backend(fast_rand()),
            (None, None) => 0,
        };
        self.active.upstreams.clusters[idx].clone()
    }
}

/// Join two upgraded connections (WebSocket etc.) and copy until either ends.
pub(crate) async fn splice_upgrades(
    down: hyper::upgrade::OnUpgrade,
    up: hyper::upgrade::OnUpgrade,
) {
    let (Ok(down), Ok(up)) = (down.await, up.await) else {
        return;
    };
    let mut down = TokioIo::new(down);
    let mut up = TokioIo::new(up);
    let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
}

/// Give the line the answer's status (and, for an answer the sidecar made
/// itself, its reason and the authorization verdict it implies) and count
/// the response body into it.
// Here, not in `access_log`: the body module taps bodies into a line, so
// the line cannot know the body type without a module cycle.
fn finish_http(
    resp: http::Response<ProxyBody>,
    p: Arc<crate::access_log::Pending>,
    head_request: bool,
) -> http::Response<ProxyBody> {
    // Only the sidecar's own answers (buffered bodies) are asked for a
    // reason: an upstream's response could carry any header.
    let reason = match resp.body() {
        ProxyBody::Streamed { .. } => None,
        _ => resp
            .headers()
            .get(LOCAL_REASON)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
    };
    p.answered(resp.status().as_u16(), reason.as_deref());
    // hyper polls a local answer's body to a HEAD request but sends none
    // of it: the client got no body bytes, so none are counted.
    if head_request {
        return resp;
    }
    resp.map(|b| b.with_tap(Some(crate::body::Tap::Out(p))))
}

const LOCAL_REASON: &str = "x-baton-local-reason";
