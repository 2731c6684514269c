//! Precompiled route tables and the pure function that matches a request
//! against them.
//!
//! Why separate from the proxy: matching is the part of the hot path with the
//! most cases (host wildcards, three path kinds, headers, query, methods), so
//! it is a pure function over borrowed request parts with no I/O, tested
//! exhaustively below. Everything that can be done once per snapshot (regex
//! compilation, header-name parsing, lower-casing, weight prefix sums) is
//! done by [`crate::config::compile`], never per request.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use baton_config::{FaultConfig, RetryConfig};
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use regex::Regex;

/// How a route matches the host.
#[derive(Debug, Clone)]
pub enum HostMatch {
    /// Lower-cased exact host (no port).
    Exact(String),
    /// `*.example.com` stored as `.example.com`: any non-empty subdomain.
    Suffix(String),
}

impl HostMatch {
    fn matches(&self, host: &str) -> bool {
        match self {
            HostMatch::Exact(h) => host.eq_ignore_ascii_case(h),
            HostMatch::Suffix(s) => {
                host.len() > s.len() && {
                    let tail = &host[host.len() - s.len()..];
                    tail.eq_ignore_ascii_case(s)
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
pub enum PathMatcher {
    Exact(String),
    /// Prefix without a trailing slash (except the root `/`).
    Prefix(String),
    Regex(Regex),
}

impl PathMatcher {
    fn matches(&self, path: &str) -> bool {
        match self {
            PathMatcher::Exact(p) => path == p,
            PathMatcher::Prefix(p) => {
                if p == "/" {
                    return true;
                }
                // Segment-aware: `/api` matches `/api`, `/api/`, `/api/x`, not `/apix`.
                path.starts_with(p.as_str())
                    && matches!(path.as_bytes().get(p.len()), None | Some(b'/'))
            }
            PathMatcher::Regex(r) => r.is_match(path),
        }
    }
}

#[derive(Debug, Clone)]
pub enum ValueMatcher {
    Present,
    Exact(String),
    Regex(Regex),
}

impl ValueMatcher {
    fn matches(&self, value: &str) -> bool {
        match self {
            ValueMatcher::Present => true,
            ValueMatcher::Exact(e) => value == e,
            ValueMatcher::Regex(r) => r.is_match(value),
        }
    }
}

#[derive(Debug, Clone)]
pub struct HeaderCondition {
    pub name: HeaderName,
    pub matcher: ValueMatcher,
    pub invert: bool,
}

#[derive(Debug, Clone)]
pub struct QueryCondition {
    pub name: String,
    pub matcher: ValueMatcher,
    pub invert: bool,
}

/// Compiled header rewrite: applied in the order remove, set, add.
#[derive(Debug, Clone, Default)]
pub struct HeaderRewriter {
    pub remove: Vec<HeaderName>,
    pub set: Vec<(HeaderName, HeaderValue)>,
    pub add: Vec<(HeaderName, HeaderValue)>,
}

impl HeaderRewriter {
    pub fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.set.is_empty() && self.add.is_empty()
    }

    pub fn apply(&self, headers: &mut HeaderMap) {
        for name in &self.remove {
            headers.remove(name);
        }
        for (name, value) in &self.set {
            headers.insert(name.clone(), value.clone());
        }
        for (name, value) in &self.add {
            headers.append(name.clone(), value.clone());
        }
    }
}

/// Token-bucket retry budget: every request deposits `ratio` of a retry,
/// every retry withdraws one; `min_per_sec` tokens are granted per second so
/// quiet routes can still retry. Lock-free (fixed point, 1 retry = 1000).
#[derive(Debug)]
pub struct RetryBudget {
    tokens: AtomicU64,
    last_refill_ms: AtomicU64,
    deposit: u64,
    min_per_sec: u64,
    cap: u64,
    epoch: Instant,
}

const TOKEN: u64 = 1000;

impl RetryBudget {
    pub fn new(ratio: f64, min_per_sec: u32) -> Self {
        let min_per_sec = u64::from(min_per_sec) * TOKEN;
        Self {
            tokens: AtomicU64::new(min_per_sec),
            last_refill_ms: AtomicU64::new(0),
            deposit: (ratio * TOKEN as f64) as u64,
            min_per_sec,
            cap: min_per_sec.max(TOKEN) * 10,
            epoch: Instant::now(),
        }
    }

    /// Called once per original request.
    pub fn deposit(&self) {
        self.add(self.deposit);
        let now = self.epoch.elapsed().as_millis() as u64;
        let last = self.last_refill_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 1000
            && self
                .last_refill_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.add(self.min_per_sec);
        }
    }

    fn add(&self, n: u64) {
        let _ = self
            .tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                Some((t + n).min(self.cap))
            });
    }

    /// Take one retry's worth of budget; false = budget exhausted.
    pub fn try_withdraw(&self) -> bool {
        self.tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                t.checked_sub(TOKEN)
            })
            .is_ok()
    }
}

/// Retry settings compiled for one route.
#[derive(Debug)]
pub struct RetryPolicy {
    pub attempts: u32,
    pub on_connect_failure: bool,
    pub on_reset: bool,
    pub on_statuses: Vec<u16>,
    pub per_try_timeout: Option<Duration>,
    pub budget: RetryBudget,
}

impl RetryPolicy {
    pub fn new(c: &RetryConfig) -> Self {
        Self {
            attempts: c.attempts,
            on_connect_failure: c.on_connect_failure,
            on_reset: c.on_reset,
            on_statuses: c.on_statuses.clone(),
            per_try_timeout: c.per_try_timeout_ms.map(Duration::from_millis),
            budget: RetryBudget::new(c.budget_ratio, c.budget_min_per_sec),
        }
    }
}

/// A route ready to serve: conditions plus what to do on match.
#[derive(Debug)]
pub struct CompiledRoute {
    pub name: Arc<str>,
    pub hosts: Vec<HostMatch>,
    /// Destination ports (any of); empty = any.
    pub ports: Vec<u16>,
    pub path: Option<PathMatcher>,
    pub methods: Vec<Method>,
    pub headers: Vec<HeaderCondition>,
    pub query: Vec<QueryCondition>,
    /// (cluster index, cumulative weight) — binary/linear search on a draw.
    pub backends: Vec<(usize, u32)>,
    pub total_weight: u32,
    pub timeout: Option<Duration>,
    pub retry: Option<RetryPolicy>,
    pub fault: Option<FaultConfig>,
    /// (cluster index, percent)
    pub mirror: Option<(usize, f64)>,
    pub request_headers: HeaderRewriter,
    pub response_headers: HeaderRewriter,
    /// Metric handles, resolved on first use.
    pub metrics: std::sync::OnceLock<crate::metrics::RouteMetrics>,
    /// Why this route's requests need the general (hyper) path; `None`
    /// when the HTTP/1.1 fast path may serve them. Set once at compile
    /// time from [`CompiledRoute::needs_general_path`].
    pub general_path: Option<GeneralPath>,
}

/// Why requests take the general HTTP path instead of the HTTP/1.1 fast
/// path. Decided once per route and per listener when a snapshot compiles
/// (never per request), by functions that name every field of what they
/// classify: a filter added to a route or a listener does not compile
/// until it says whether the fast path may skip it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GeneralPath {
    Retry,
    Fault,
    Mirror,
    HeaderRewrite,
    /// A route on the listener matches on request headers, which the fast
    /// path does not collect.
    HeaderMatch,
}

/// The parts of a request routing looks at, borrowed (no copies).
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// Host without port.
    pub host: &'a str,
    /// Destination port: the Host header's port, else the connection's
    /// (original) destination port.
    pub port: u16,
    pub path: &'a str,
    pub query: Option<&'a str>,
    pub method: &'a Method,
    pub headers: &'a HeaderMap,
}

impl CompiledRoute {
    /// What of this route needs the general path, if anything. Every field
    /// is named: a new one must be classified here.
    pub fn needs_general_path(&self) -> Option<GeneralPath> {
        let CompiledRoute {
            // Matching the fast path does itself (with an empty header map).
            name: _,
            hosts: _,
            ports: _,
            path: _,
            methods: _,
            query: _,
            // Classified per listener (`GeneralPath::HeaderMatch`): a header
            // condition on any route changes which route a request matches.
            headers: _,
            // Backend choice, timeout and metrics: the fast path does these.
            backends: _,
            total_weight: _,
            timeout: _,
            metrics: _,
            general_path: _,
            retry,
            fault,
            mirror,
            request_headers,
            response_headers,
        } = self;
        if retry.is_some() {
            Some(GeneralPath::Retry)
        } else if fault.is_some() {
            Some(GeneralPath::Fault)
        } else if mirror.is_some() {
            Some(GeneralPath::Mirror)
        } else if !request_headers.is_empty() || !response_headers.is_empty() {
            Some(GeneralPath::HeaderRewrite)
        } else {
            None
        }
    }

    /// True when every condition of the route holds for `req`.
    pub fn matches(&self, req: &RequestView<'_>) -> bool {
        (self.hosts.is_empty() || self.hosts.iter().any(|h| h.matches(req.host)))
            && (self.ports.is_empty() || self.ports.contains(&req.port))
            && self.path.as_ref().is_none_or(|p| p.matches(req.path))
            && (self.methods.is_empty() || self.methods.iter().any(|m| m == req.method))
            && self
                .headers
                .iter()
                .all(|c| header_condition(c, req.headers))
            && self.query.iter().all(|c| query_condition(c, req.query))
    }

    /// True when the route applies to a whole TCP connection to `ip`
    /// (textual) and `port`: its hosts name the destination IP (a Service's
    /// ClusterIP), its ports include the destination port, and it has no
    /// per-request condition.
    pub fn matches_connection(&self, ip: &str, port: u16) -> bool {
        self.hosts.iter().any(|h| h.matches(ip))
            && (self.ports.is_empty() || self.ports.contains(&port))
            && self.path.is_none()
            && self.methods.is_empty()
            && self.headers.is_empty()
            && self.query.is_empty()
    }

    /// Pick a backend cluster index for a uniformly random `draw`.
    pub fn pick_backend(&self, draw: u32) -> usize {
        pick_weighted(&self.backends, self.total_weight, draw)
    }
}

/// The backend of `backends` ((cluster index, cumulative weight), non-empty)
/// that a uniformly random `draw` lands on. A zero-weight backend repeats the
/// previous cumulative weight, so no draw lands on it.
fn pick_weighted(backends: &[(usize, u32)], total_weight: u32, draw: u32) -> usize {
    if backends.len() == 1 {
        return backends[0].0;
    }
    let point = draw % total_weight.max(1);
    backends
        .iter()
        .find(|(_, cumulative)| point < *cumulative)
        .map_or(backends[0].0, |(c, _)| *c)
}

/// A tcp route ready to serve: the weighted backends one connection to its
/// destinations picks from, once, when it arrives.
#[derive(Debug)]
pub struct CompiledTcpRoute {
    pub name: Arc<str>,
    /// (cluster index, cumulative weight), as [`CompiledRoute::backends`].
    pub backends: Vec<(usize, u32)>,
    pub total_weight: u32,
    /// Overrides the chosen cluster's connect timeout.
    pub connect_timeout: Option<Duration>,
}

impl CompiledTcpRoute {
    /// Pick a backend cluster index for a uniformly random `draw`.
    pub fn pick_backend(&self, draw: u32) -> usize {
        pick_weighted(&self.backends, self.total_weight, draw)
    }
}

fn header_condition(c: &HeaderCondition, headers: &HeaderMap) -> bool {
    let found = headers
        .get_all(&c.name)
        .iter()
        .any(|v| v.to_str().is_ok_and(|v| c.matcher.matches(v)));
    found != c.invert
}

fn query_condition(c: &QueryCondition, query: Option<&str>) -> bool {
    let found = query.is_some_and(|q| {
        q.split('&').any(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            k == c.name && c.matcher.matches(v)
        })
    });
    found != c.invert
}

/// First route (in configuration order) whose conditions all hold.
pub fn match_route<'t>(
    routes: &'t [Arc<CompiledRoute>],
    req: &RequestView<'_>,
) -> Option<&'t Arc<CompiledRoute>> {
    routes.iter().find(|r| r.matches(req))
}

/// The cluster a raw TCP connection to `dst` goes to: the backend of the
/// first route that applies to the whole connection
/// ([`CompiledRoute::matches_connection`]).
pub fn connection_cluster(
    routes: &[Arc<CompiledRoute>],
    dst: std::net::SocketAddr,
    draw: u32,
) -> Option<usize> {
    // Formatted once per connection, not once per route.
    let ip = dst.ip().to_string();
    routes
        .iter()
        .find(|r| r.matches_connection(&ip, dst.port()))
        .map(|r| r.pick_backend(draw))
}

/// Split an authority into host and optional port (`[v6]:port` aware).
pub fn split_host_port(authority: &str) -> (&str, Option<u16>) {
    if let Some(rest) = authority.strip_prefix('[') {
        if let Some((host, tail)) = rest.split_once(']') {
            let port = tail.strip_prefix(':').and_then(|p| p.parse().ok());
            return (host, port);
        }
        return (authority, None);
    }
    match authority.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => match p.parse() {
            Ok(port) => (h, Some(port)),
            Err(_) => (authority, None),
        },
        _ => (authority, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{self, Snapshot};

    fn table(yaml: &str) -> Vec<Arc<CompiledRoute>> {
        let snap: Snapshot = config::yaml::parse(yaml).unwrap();
        let compiled = config::compile(&snap).unwrap();
        compiled.listeners[0].routes.clone()
    }

    const BASE: &str = "
listeners: [{name: l, address: '127.0.0.1:0'}]
clusters: [{name: a, endpoints: ['127.0.0.1:1']}, {name: b, endpoints: ['127.0.0.1:2']}]
";

    fn req<'a>(
        host: &'a str,
        path: &'a str,
        method: &'a Method,
        headers: &'a HeaderMap,
    ) -> RequestView<'a> {
        let (path, query) = match path.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (path, None),
        };
        RequestView {
            host,
            port: 80,
            path,
            query,
            method,
            headers,
        }
    }

    fn route_name(routes: &[Arc<CompiledRoute>], view: RequestView<'_>) -> Option<String> {
        match_route(routes, &view).map(|r| r.name.to_string())
    }

    #[test]
    fn a_tcp_connection_takes_the_cluster_of_the_route_naming_its_destination() {
        let t = table(&format!(
            "{BASE}routes: [
              {{name: canary, match: {{hosts: ['10.96.0.9'], ports: [80], headers: [{{name: x, exact: '1'}}]}}, backends: [{{cluster: b}}]}},
              {{name: svc, match: {{hosts: ['svc', '10.96.0.9'], ports: [80]}}, backends: [{{cluster: a}}]}},
              {{name: other, match: {{hosts: ['10.96.0.8']}}, backends: [{{cluster: b}}]}}]"
        ));
        let dst = |s: &str| s.parse::<std::net::SocketAddr>().unwrap();
        // The header rule needs a request; the plain Service route applies.
        assert_eq!(connection_cluster(&t, dst("10.96.0.9:80"), 0), Some(0));
        assert_eq!(connection_cluster(&t, dst("10.96.0.9:81"), 0), None);
        assert_eq!(connection_cluster(&t, dst("10.96.0.8:5432"), 0), Some(1));
        assert_eq!(connection_cluster(&t, dst("10.1.0.1:80"), 0), None);
    }

    #[test]
    fn empty_match_matches_every_request() {
        let t = table(&format!(
            "{BASE}routes: [{{name: all, backends: [{{cluster: a}}]}}]"
        ));
        let h = HeaderMap::new();
        for (host, path, m) in [
            ("x", "/", Method::GET),
            ("", "/a/b?c=d", Method::POST),
            ("Y.Z", "/", Method::DELETE),
        ] {
            assert_eq!(
                route_name(&t, req(host, path, &m, &h)).as_deref(),
                Some("all")
            );
        }
    }

    #[test]
    fn host_matching_is_case_insensitive_and_wildcards_need_a_subdomain() {
        let t = table(&format!(
            "{BASE}routes:
- {{name: exact, match: {{hosts: [API.example.com]}}, backends: [{{cluster: a}}]}}
- {{name: wild, match: {{hosts: ['*.example.com']}}, backends: [{{cluster: a}}]}}"
        ));
        let h = HeaderMap::new();
        let m = Method::GET;
        let cases = [
            ("api.example.com", Some("exact")),
            ("API.EXAMPLE.COM", Some("exact")),
            ("www.example.com", Some("wild")),
            ("a.b.example.com", Some("wild")),
            ("example.com", None),
            (".example.com", None),
            ("example.org", None),
            ("notexample.com", None),
        ];
        for (host, want) in cases {
            assert_eq!(
                route_name(&t, req(host, "/", &m, &h)).as_deref(),
                want,
                "host {host}"
            );
        }
    }

    #[test]
    fn destination_ports_separate_routes_with_the_same_host() {
        let t = table(&format!(
            "{BASE}routes:
- {{name: web, match: {{hosts: [svc], ports: [80]}}, backends: [{{cluster: a}}]}}
- {{name: admin, match: {{hosts: [svc], ports: [8080, 8081]}}, backends: [{{cluster: a}}]}}"
        ));
        let h = HeaderMap::new();
        let m = Method::GET;
        for (port, want) in [
            (80, Some("web")),
            (8080, Some("admin")),
            (8081, Some("admin")),
            (9000, None),
        ] {
            let view = RequestView {
                port,
                ..req("svc", "/", &m, &h)
            };
            assert_eq!(route_name(&t, view).as_deref(), want, "port {port}");
        }
    }

    #[test]
    fn path_exact_prefix_and_regex_behave_as_documented() {
        let t = table(&format!(
            "{BASE}routes:
- {{name: exact, match: {{path: {{exact: /health}}}}, backends: [{{cluster: a}}]}}
- {{name: prefix, match: {{path: {{prefix: /api/}}}}, backends: [{{cluster: a}}]}}
- {{name: regex, match: {{path: {{regex: '/users/[0-9]+'}}}}, backends: [{{cluster: a}}]}}
- {{name: root, match: {{path: {{prefix: /}}}}, backends: [{{cluster: a}}]}}"
        ));
        let h = HeaderMap::new();
        let m = Method::GET;
        let cases = [
            ("/health", "exact"),
            ("/health/", "root"),
            ("/healthz", "root"),
            ("/api", "prefix"),
            ("/api/", "prefix"),
            ("/api/v1/x", "prefix"),
            ("/apix", "root"),
            ("/users/42", "regex"),
            ("/users/42/x", "root"),
            ("/x/users/42", "root"),
            ("/users/abc", "root"),
            ("/health?x=1", "exact"),
        ];
        for (path, want) in cases {
            assert_eq!(
                route_name(&t, req("h", path, &m, &h)).as_deref(),
                Some(want),
                "path {path}"
            );
        }
    }

    #[test]
    fn methods_headers_and_query_conditions_all_must_hold() {
        let t = table(&format!(
            "{BASE}routes:
- name: strict
  match:
    methods: [GET, HEAD]
    headers: [{{name: x-canary, exact: 'yes'}}, {{name: x-user, regex: 'u[0-9]+'}}, {{name: x-debug, invert: true}}]
    query: [{{name: v, exact: '2'}}, {{name: flag}}]
  backends: [{{cluster: a}}]"
        ));
        let m = Method::GET;
        let mut ok = HeaderMap::new();
        ok.insert("x-canary", "yes".parse().unwrap());
        ok.insert("x-user", "u17".parse().unwrap());
        assert!(route_name(&t, req("h", "/?v=2&flag", &m, &ok)).is_some());
        assert!(route_name(&t, req("h", "/?flag=&v=2", &Method::HEAD, &ok)).is_some());
        assert!(
            route_name(&t, req("h", "/?v=2&flag", &Method::POST, &ok)).is_none(),
            "method"
        );
        assert!(
            route_name(&t, req("h", "/?v=3&flag", &m, &ok)).is_none(),
            "query value"
        );
        assert!(
            route_name(&t, req("h", "/?v=2", &m, &ok)).is_none(),
            "query presence"
        );
        assert!(route_name(&t, req("h", "/", &m, &ok)).is_none(), "no query");
        let mut bad_user = ok.clone();
        bad_user.insert("x-user", "admin".parse().unwrap());
        assert!(
            route_name(&t, req("h", "/?v=2&flag", &m, &bad_user)).is_none(),
            "regex is anchored"
        );
        let mut partial = ok.clone();
        partial.insert("x-user", "u1x".parse().unwrap());
        assert!(
            route_name(&t, req("h", "/?v=2&flag", &m, &partial)).is_none(),
            "regex is anchored at the end"
        );
        let mut debug = ok.clone();
        debug.insert("x-debug", "1".parse().unwrap());
        assert!(
            route_name(&t, req("h", "/?v=2&flag", &m, &debug)).is_none(),
            "inverted presence"
        );
        let mut no_canary = ok.clone();
        no_canary.remove("x-canary");
        assert!(
            route_name(&t, req("h", "/?v=2&flag", &m, &no_canary)).is_none(),
            "missing header"
        );
    }

    #[test]
    fn first_matching_route_in_configuration_order_wins() {
        let t = table(&format!(
            "{BASE}routes:
- {{name: first, match: {{path: {{prefix: /}}}}, backends: [{{cluster: a}}]}}
- {{name: second, match: {{path: {{exact: /x}}}}, backends: [{{cluster: b}}]}}"
        ));
        let h = HeaderMap::new();
        assert_eq!(
            route_name(&t, req("h", "/x", &Method::GET, &h)).as_deref(),
            Some("first")
        );
    }

    #[test]
    fn weighted_backends_split_draws_in_proportion() {
        let t = table(&format!(
            "{BASE}routes: [{{name: w, backends: [{{cluster: a, weight: 3}}, {{cluster: b, weight: 1}}]}}]"
        ));
        let r = &t[0];
        let picks: Vec<usize> = (0..8).map(|d| r.pick_backend(d)).collect();
        assert_eq!(picks, vec![0, 0, 0, 1, 0, 0, 0, 1]);
    }

    #[test]
    fn zero_weight_backends_are_never_picked() {
        let t = table(&format!(
            "{BASE}routes: [{{name: w, backends: [{{cluster: a, weight: 0}}, {{cluster: b, weight: 5}}]}}]"
        ));
        assert!((0..100).all(|d| t[0].pick_backend(d) == 1));
    }

    #[test]
    fn host_port_splitting_handles_ipv6_and_missing_ports() {
        assert_eq!(split_host_port("a.b:8080"), ("a.b", Some(8080)));
        assert_eq!(split_host_port("a.b"), ("a.b", None));
        assert_eq!(split_host_port("[::1]:80"), ("::1", Some(80)));
        assert_eq!(split_host_port("[::1]"), ("::1", None));
        assert_eq!(split_host_port("::1"), ("::1", None));
        assert_eq!(split_host_port("a:notaport"), ("a:notaport", None));
    }

    #[test]
    fn retry_budget_allows_ratio_of_requests_plus_minimum() {
        let b = RetryBudget::new(0.5, 0);
        assert!(!b.try_withdraw());
        b.deposit();
        assert!(!b.try_withdraw());
        b.deposit();
        assert!(b.try_withdraw());
        assert!(!b.try_withdraw());
        let m = RetryBudget::new(0.0, 2);
        assert!(m.try_withdraw() && m.try_withdraw() && !m.try_withdraw());
    }
}
