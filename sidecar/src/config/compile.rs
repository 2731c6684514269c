//! Validation and compilation of a [`Snapshot`] into the structures the data
//! plane serves from. Pure: no I/O, no runtime state — the same snapshot
//! always compiles to the same result, and every problem is reported at once
//! with the path of the offending field.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Method};
use regex::Regex;

use super::{
    Capture, Direction, ListenerConfig, ListenerProtocol, PathMatch, Snapshot, TlsTermination,
    ValueMatch,
};
use crate::filters::{Cidr, Rbac};
use crate::routing::{
    CompiledRoute, CompiledTcpRoute, GeneralPath, HeaderCondition, HeaderRewriter, HostMatch,
    PathMatcher, QueryCondition, RetryPolicy, ValueMatcher,
};

/// The TLS layer's reason for refusing a `tls` section.
pub type TlsRefusal = Box<dyn std::error::Error + Send + Sync>;

/// Why a snapshot was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Parse(#[from] super::yaml::ParseError),
    /// Every problem found, each prefixed with the field path.
    #[error("invalid config: {}", .0.join("; "))]
    Invalid(Vec<String>),
    /// The TLS layer refused the `tls` section. Boxed because that error
    /// type belongs to the TLS layer, above this module (`crate::tls::TlsError`
    /// in the binary; callers may downcast).
    #[error("invalid tls section: {0}")]
    Tls(#[source] TlsRefusal),
    #[error("cannot read config file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

impl ConfigError {
    /// Short label for the `apply errors` metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ConfigError::Parse(_) => "parse",
            ConfigError::Invalid(_) => "invalid",
            ConfigError::Tls(_) => "tls",
            ConfigError::Io { .. } => "io",
        }
    }
}

/// One listener's compiled view: its routes (in order) and resolved names.
#[derive(Debug)]
pub struct CompiledListener {
    pub config: ListenerConfig,
    pub routes: Vec<Arc<CompiledRoute>>,
    pub rbac: Option<Arc<Rbac>>,
    /// Destination port → cluster index.
    pub port_map: HashMap<u16, usize>,
    pub tcp_cluster: Option<usize>,
    /// Destination → the tcp route that takes connections to it.
    pub tcp_routes: HashMap<SocketAddr, Arc<CompiledTcpRoute>>,
    /// Why every HTTP request on this listener takes the general path;
    /// `None` when the fast path may serve them (each route then decides
    /// for its own requests: [`CompiledRoute::general_path`]).
    pub general_path: Option<GeneralPath>,
}

impl CompiledListener {
    /// What of the listener needs the general path for every request.
    /// Every field of the listener's config is named: a new one must be
    /// classified here.
    fn needs_general_path(
        config: &ListenerConfig,
        routes: &[Arc<CompiledRoute>],
    ) -> Option<GeneralPath> {
        let ListenerConfig {
            // Connection-level: decided before any HTTP handling.
            name: _,
            address: _,
            direction: _,
            capture: _,
            protocol: _,
            opaque_ports: _,
            detect_timeout_ms: _,
            tcp_cluster: _,
            port_map: _,
            passthrough: _,
            max_connections: _,
            // Both HTTP/1 paths evaluate the policy and write the
            // access-log line per request, with the same functions
            // (`filters::Rbac::authorize`, `access_log::start_http`;
            // docs/decisions/0053).
            rbac: _,
            access_log: _,
            terminate_tls: _,
        } = config;
        if routes.iter().any(|r| !r.headers.is_empty()) {
            Some(GeneralPath::HeaderMatch)
        } else {
            None
        }
    }

    /// Whether connections to `dst` (the original destination, else the
    /// listener's own address) must skip protocol detection: the listener
    /// or the port is opaque, or a tcp route owns the destination (its
    /// bytes are never HTTP to the mesh, whatever they look like).
    pub fn is_opaque(&self, dst: SocketAddr) -> bool {
        self.config.protocol == ListenerProtocol::Tcp
            || self.config.opaque_ports.contains(&dst.port())
            || self.tcp_routes.contains_key(&dst)
    }

    /// The tcp route that takes connections to `dst`, if one does.
    pub fn tcp_route(&self, dst: SocketAddr) -> Option<&Arc<CompiledTcpRoute>> {
        if self.tcp_routes.is_empty() {
            return None;
        }
        self.tcp_routes.get(&dst)
    }
}

/// A validated snapshot, ready to serve. Cluster indices refer to
/// `snapshot.clusters` order.
#[derive(Debug)]
pub struct CompiledConfig {
    pub snapshot: Arc<Snapshot>,
    pub listeners: Vec<CompiledListener>,
    pub cluster_index: HashMap<String, usize>,
}

impl CompiledConfig {
    pub fn listener(&self, name: &str) -> Option<&CompiledListener> {
        self.listeners.iter().find(|l| l.config.name == name)
    }
}

struct Problems(Vec<String>);

impl Problems {
    fn push(&mut self, path: impl std::fmt::Display, reason: impl std::fmt::Display) {
        self.0.push(format!("{path}: {reason}"));
    }
}

/// Validate `snapshot` and compile it. All problems are collected.
pub fn compile(snapshot: &Snapshot) -> Result<CompiledConfig, ConfigError> {
    let mut p = Problems(Vec::new());
    let rt = &snapshot.runtime;
    if !(1..=64).contains(&rt.worker_threads) {
        p.push("runtime.worker_threads", "must be 1..=64");
    }
    if !(1024..=1 << 20).contains(&rt.max_header_bytes) {
        p.push("runtime.max_header_bytes", "must be 1024..=1048576");
    }
    for (name, v) in [
        ("runtime.event_interval", rt.event_interval),
        ("runtime.global_queue_interval", rt.global_queue_interval),
    ] {
        if v.is_some_and(|v| !(1..=1024).contains(&v)) {
            p.push(name, "must be 1..=1024");
        }
    }
    if rt.max_headers == 0 || rt.max_headers > 1000 {
        p.push("runtime.max_headers", "must be 1..=1000");
    }
    if rt.h2_max_concurrent_streams == 0 {
        p.push("runtime.h2_max_concurrent_streams", "must be > 0");
    }
    if rt
        .trace_sample_percent
        .is_some_and(|v| !(0.0..=100.0).contains(&v))
    {
        p.push("runtime.trace_sample_percent", "must be 0..=100");
    }
    if rt.route_metrics_max_series.is_some_and(|v| v > 100_000) {
        p.push("runtime.route_metrics_max_series", "must be 0..=100000");
    }

    // Clusters.
    let mut cluster_index = HashMap::new();
    for (i, c) in snapshot.clusters.iter().enumerate() {
        let at = format!("clusters[{i}] ({})", c.name);
        if c.name.is_empty() {
            p.push(&at, "name must not be empty");
        }
        if cluster_index.insert(c.name.clone(), i).is_some() {
            p.push(&at, "duplicate cluster name");
        }
        if c.connect_timeout_ms == 0 {
            p.push(format!("{at}.connect_timeout_ms"), "must be > 0");
        }
        if let Some(m) = &c.mtls {
            if snapshot.tls.is_none() {
                p.push(
                    format!("{at}.mtls"),
                    "originating mesh mTLS needs the snapshot's tls section (identity and trust)",
                );
            }
            if let Some(id) = &m.identity
                && let Err(e) = id.parse::<baton_config::spiffe::SpiffeId>()
            {
                p.push(format!("{at}.mtls.identity"), e.to_string());
            }
        }
        let mut seen = HashSet::new();
        let admin_port = snapshot.admin.address.port();
        for e in &c.endpoints {
            if !seen.insert(e) {
                p.push(format!("{at}.endpoints"), format!("duplicate endpoint {e}"));
            }
            // The admin service trusts callers on the Pod's loopback; a
            // cluster there would relay anyone the routes admit to it.
            if admin_port != 0 && e.port() == admin_port && crate::filters::from_pod(e.ip()) {
                p.push(
                    format!("{at}.endpoints"),
                    format!(
                        "{e} is the sidecar's own admin port on loopback: proxied callers would \
                         reach its Pod-only endpoints (/shutdown, /config, ...)"
                    ),
                );
            }
        }
        if let Some(o) = &c.outlier {
            if o.consecutive_failures == 0 {
                p.push(format!("{at}.outlier.consecutive_failures"), "must be > 0");
            }
            if o.base_ejection_ms == 0 || o.base_ejection_ms > o.max_ejection_ms {
                p.push(
                    format!("{at}.outlier"),
                    "need 0 < base_ejection_ms <= max_ejection_ms",
                );
            }
            if o.max_ejected_percent > 100 {
                p.push(
                    format!("{at}.outlier.max_ejected_percent"),
                    "must be 0..=100",
                );
            }
        }
    }
    let cluster = |p: &mut Problems, at: &str, name: &str| -> Option<usize> {
        let idx = cluster_index.get(name).copied();
        if idx.is_none() {
            p.push(at, format!("unknown cluster {name:?}"));
        }
        idx
    };

    // RBAC policies.
    let mut rbac = HashMap::new();
    for (i, policy) in snapshot.policies.rbac.iter().enumerate() {
        let at = format!("policies.rbac[{i}] ({})", policy.name);
        match Rbac::compile(policy) {
            Ok(r) => {
                if rbac.insert(policy.name.clone(), Arc::new(r)).is_some() {
                    p.push(&at, "duplicate policy name");
                }
            }
            Err(e) => p.push(
                format!("policies.rbac[{i}].rules[{}] ({})", e.rule, policy.name),
                e.reason,
            ),
        }
    }

    // Routes (compiled once, shared by every listener they apply to).
    let listener_names: HashSet<&str> =
        snapshot.listeners.iter().map(|l| l.name.as_str()).collect();
    let mut route_names = HashSet::new();
    let mut routes = Vec::with_capacity(snapshot.routes.len());
    for (i, r) in snapshot.routes.iter().enumerate() {
        let at = format!("routes[{i}] ({})", r.name);
        if !route_names.insert(r.name.as_str()) {
            p.push(&at, "duplicate route name");
        }
        for l in &r.listeners {
            if !listener_names.contains(l.as_str()) {
                p.push(format!("{at}.listeners"), format!("unknown listener {l:?}"));
            }
        }
        let m = &r.matches;
        let hosts = m
            .hosts
            .iter()
            .map(|h| match h.strip_prefix("*.") {
                Some(rest) => HostMatch::Suffix(format!(".{}", rest.to_ascii_lowercase())),
                None => HostMatch::Exact(h.to_ascii_lowercase()),
            })
            .collect();
        let path = match &m.path {
            None => None,
            Some(PathMatch {
                exact: Some(s),
                prefix: None,
                regex: None,
            })
            | Some(PathMatch {
                exact: None,
                prefix: Some(s),
                regex: None,
            }) if !s.starts_with('/') => {
                p.push(format!("{at}.match.path"), "must start with '/'");
                None
            }
            Some(PathMatch {
                exact: Some(s),
                prefix: None,
                regex: None,
            }) => Some(PathMatcher::Exact(s.clone())),
            Some(PathMatch {
                exact: None,
                prefix: Some(s),
                regex: None,
            }) => {
                let trimmed = if s.len() > 1 {
                    s.trim_end_matches('/')
                } else {
                    s.as_str()
                };
                Some(PathMatcher::Prefix(if trimmed.is_empty() {
                    "/".into()
                } else {
                    trimmed.into()
                }))
            }
            Some(PathMatch {
                exact: None,
                prefix: None,
                regex: Some(s),
            }) => anchored(s)
                .map_err(|e| p.push(format!("{at}.match.path.regex"), e))
                .ok()
                .map(PathMatcher::Regex),
            Some(_) => {
                p.push(
                    format!("{at}.match.path"),
                    "set exactly one of exact, prefix, regex",
                );
                None
            }
        };
        let methods = m
            .methods
            .iter()
            .filter_map(|s| {
                parse_method(s)
                    .map_err(|e| p.push(format!("{at}.match.methods"), e))
                    .ok()
            })
            .collect();
        let headers = m
            .headers
            .iter()
            .filter_map(|h| {
                let name = HeaderName::from_bytes(h.name.as_bytes())
                    .map_err(|_| {
                        p.push(
                            format!("{at}.match.headers"),
                            format!("invalid header name {:?}", h.name),
                        )
                    })
                    .ok()?;
                let matcher = value_matcher(h)
                    .map_err(|e| p.push(format!("{at}.match.headers"), e))
                    .ok()?;
                Some(HeaderCondition {
                    name,
                    matcher,
                    invert: h.invert,
                })
            })
            .collect();
        let query = m
            .query
            .iter()
            .filter_map(|q| {
                let matcher = value_matcher(q)
                    .map_err(|e| p.push(format!("{at}.match.query"), e))
                    .ok()?;
                Some(QueryCondition {
                    name: q.name.clone(),
                    matcher,
                    invert: q.invert,
                })
            })
            .collect();

        let (backends, total) = weighted(&mut p, &at, &r.backends, &cluster);
        if r.timeout_ms == Some(0) {
            p.push(format!("{at}.timeout_ms"), "must be > 0");
        }
        if let Some(retry) = &r.retry {
            if retry.attempts > 10 {
                p.push(format!("{at}.retry.attempts"), "must be <= 10");
            }
            for s in &retry.on_statuses {
                if !(500..=599).contains(s) {
                    p.push(
                        format!("{at}.retry.on_statuses"),
                        format!("{s} is not a 5xx status"),
                    );
                }
            }
            if !(0.0..=10.0).contains(&retry.budget_ratio) {
                p.push(format!("{at}.retry.budget_ratio"), "must be 0..=10");
            }
            if retry.per_try_timeout_ms == Some(0) {
                p.push(format!("{at}.retry.per_try_timeout_ms"), "must be > 0");
            }
        }
        if let Some(f) = &r.fault {
            if let Some(d) = &f.delay
                && !(0.0..=100.0).contains(&d.percent)
            {
                p.push(format!("{at}.fault.delay.percent"), "must be 0..=100");
            }
            if let Some(a) = &f.abort {
                if !(0.0..=100.0).contains(&a.percent) {
                    p.push(format!("{at}.fault.abort.percent"), "must be 0..=100");
                }
                if !(200..=599).contains(&a.status) {
                    p.push(format!("{at}.fault.abort.status"), "must be 200..=599");
                }
            }
        }
        let mirror = r.mirror.as_ref().and_then(|m| {
            if !(0.0..=100.0).contains(&m.percent) {
                p.push(format!("{at}.mirror.percent"), "must be 0..=100");
            }
            cluster(&mut p, &format!("{at}.mirror"), &m.cluster).map(|c| (c, m.percent))
        });
        let request_headers =
            rewriter(&mut p, &format!("{at}.request_headers"), &r.request_headers);
        let response_headers = rewriter(
            &mut p,
            &format!("{at}.response_headers"),
            &r.response_headers,
        );

        let mut route = CompiledRoute {
            name: Arc::from(r.name.as_str()),
            hosts,
            ports: m.ports.clone(),
            path,
            methods,
            headers,
            query,
            backends,
            total_weight: total,
            timeout: r.timeout_ms.map(Duration::from_millis),
            retry: r.retry.as_ref().map(RetryPolicy::new),
            fault: r.fault.clone(),
            mirror,
            request_headers,
            response_headers,
            metrics: Default::default(),
            general_path: None,
        };
        route.general_path = route.needs_general_path();
        routes.push((r.listeners.clone(), Arc::new(route)));
    }

    // TCP routes (compiled once, shared like HTTP routes).
    let mut tcp_route_names = HashSet::new();
    let mut tcp_routes = Vec::with_capacity(snapshot.tcp_routes.len());
    for (i, r) in snapshot.tcp_routes.iter().enumerate() {
        let at = format!("tcp_routes[{i}] ({})", r.name);
        if r.name.is_empty() {
            p.push(&at, "name must not be empty");
        }
        if !tcp_route_names.insert(r.name.as_str()) {
            p.push(&at, "duplicate tcp route name");
        }
        for l in &r.listeners {
            if !listener_names.contains(l.as_str()) {
                p.push(format!("{at}.listeners"), format!("unknown listener {l:?}"));
            }
        }
        if r.destinations.is_empty() {
            p.push(
                format!("{at}.destinations"),
                "at least one destination is required",
            );
        }
        let mut seen = HashSet::new();
        for d in &r.destinations {
            if d.port() == 0 {
                p.push(format!("{at}.destinations"), format!("{d} has port 0"));
            }
            if !seen.insert(d) {
                p.push(
                    format!("{at}.destinations"),
                    format!("duplicate destination {d}"),
                );
            }
        }
        let (backends, total) = weighted(&mut p, &at, &r.backends, &cluster);
        if r.connect_timeout_ms == Some(0) {
            p.push(format!("{at}.connect_timeout_ms"), "must be > 0");
        }
        let route = CompiledTcpRoute {
            name: Arc::from(r.name.as_str()),
            backends,
            total_weight: total,
            connect_timeout: r.connect_timeout_ms.map(Duration::from_millis),
        };
        tcp_routes.push((r, Arc::new(route)));
    }

    // The TLS section: every rule that needs no crypto provider (the TLS
    // layer's hook builds the rustls objects on apply), and the mode
    // listeners depend on.
    if let Some(Err(invalid)) = snapshot.tls.as_ref().map(|t| t.validate()) {
        for e in invalid.0 {
            p.push(e.field, e.problem);
        }
    }
    let mesh_tls = snapshot
        .tls
        .as_ref()
        .filter(|t| t.mode != baton_config::tls::TlsMode::Disabled);

    // Listeners.
    let mut names = HashSet::new();
    let mut addrs = HashSet::new();
    let mut listeners = Vec::with_capacity(snapshot.listeners.len());
    for (i, l) in snapshot.listeners.iter().enumerate() {
        let at = format!("listeners[{i}] ({})", l.name);
        if l.name.is_empty() {
            p.push(&at, "name must not be empty");
        }
        if !names.insert(l.name.as_str()) {
            p.push(&at, "duplicate listener name");
        }
        if l.address.port() != 0 && !addrs.insert(l.address) {
            p.push(&at, format!("address {} used twice", l.address));
        }
        if l.address == snapshot.admin.address && l.address.port() != 0 {
            p.push(&at, "address collides with the admin listener");
        }
        if !(1..=60_000).contains(&l.detect_timeout_ms) {
            p.push(format!("{at}.detect_timeout_ms"), "must be 1..=60000");
        }
        if l.passthrough && l.capture != Capture::Transparent {
            p.push(
                format!("{at}.passthrough"),
                "only valid with capture: transparent",
            );
        }
        if l.max_connections == Some(0) {
            p.push(format!("{at}.max_connections"), "must be > 0");
        }
        let tcp_cluster = l
            .tcp_cluster
            .as_ref()
            .and_then(|c| cluster(&mut p, &format!("{at}.tcp_cluster"), c));
        let port_map = l
            .port_map
            .iter()
            .filter_map(|(port, c)| {
                cluster(&mut p, &format!("{at}.port_map[{port}]"), c).map(|i| (*port, i))
            })
            .collect::<HashMap<_, _>>();
        if l.protocol == ListenerProtocol::Tcp
            && l.tcp_cluster.is_none()
            && l.port_map.is_empty()
            && !l.passthrough
        {
            p.push(
                &at,
                "a tcp listener needs tcp_cluster, port_map or passthrough",
            );
        }
        if l.terminate_tls == TlsTermination::All && l.direction != Direction::Inbound {
            p.push(
                format!("{at}.terminate_tls"),
                "only an inbound listener terminates TLS (use direction: inbound, or \
                 terminate_tls: mesh)",
            );
        }
        if let (Some(tls), Direction::Inbound) = (&mesh_tls, l.direction) {
            let needed = match l.protocol {
                ListenerProtocol::Http1 => Some("http/1.1"),
                ListenerProtocol::Http2 => Some("h2"),
                ListenerProtocol::Auto | ListenerProtocol::Tcp => None,
            };
            if let Some(proto) = needed
                && !tls.alpn.is_empty()
                && !tls.alpn.iter().any(|a| a == proto)
            {
                p.push(
                    format!("{at}.protocol"),
                    format!(
                        "mesh clients reach this listener through mesh TLS offering ALPN {proto:?}, \
                         which tls.alpn {:?} does not list: every handshake would fail \
                         (add {proto:?} to tls.alpn)",
                        tls.alpn
                    ),
                );
            }
        }
        let rbac = l.rbac.as_ref().and_then(|name| {
            let r = rbac.get(name).cloned();
            if r.is_none() {
                p.push(
                    format!("{at}.rbac"),
                    format!("unknown rbac policy {name:?}"),
                );
            }
            r
        });
        let routes: Vec<Arc<CompiledRoute>> = routes
            .iter()
            .filter(|(only, _)| only.is_empty() || only.iter().any(|n| n == &l.name))
            .map(|(_, r)| r.clone())
            .collect();
        let mut by_destination: HashMap<SocketAddr, Arc<CompiledTcpRoute>> = HashMap::new();
        for (r, compiled) in tcp_routes
            .iter()
            .filter(|(r, _)| r.listeners.is_empty() || r.listeners.iter().any(|n| n == &l.name))
        {
            for d in &r.destinations {
                if let Some(other) = by_destination.insert(*d, compiled.clone())
                    && !Arc::ptr_eq(&other, compiled)
                {
                    // Two routes for one destination: which one a
                    // connection follows would depend on list order.
                    p.push(
                        &at,
                        format!(
                            "destination {d} is claimed by tcp routes {:?} and {:?}",
                            other.name, compiled.name
                        ),
                    );
                }
            }
        }
        let general_path = CompiledListener::needs_general_path(l, &routes);
        listeners.push(CompiledListener {
            config: l.clone(),
            routes,
            rbac,
            port_map,
            tcp_cluster,
            tcp_routes: by_destination,
            general_path,
        });
    }

    if p.0.is_empty() {
        Ok(CompiledConfig {
            snapshot: Arc::new(snapshot.clone()),
            listeners,
            cluster_index,
        })
    } else {
        Err(ConfigError::Invalid(p.0))
    }
}

/// Backends as (cluster index, cumulative weight) and their total weight,
/// for a route's weighted draw; problems (none, unknown clusters, a zero or
/// overflowing total) are reported at `at.backends`.
fn weighted(
    p: &mut Problems,
    at: &str,
    list: &[super::WeightedBackend],
    cluster: &dyn Fn(&mut Problems, &str, &str) -> Option<usize>,
) -> (Vec<(usize, u32)>, u32) {
    let at = format!("{at}.backends");
    if list.is_empty() {
        p.push(&at, "at least one backend is required");
    }
    let mut total: u64 = 0;
    let mut backends = Vec::with_capacity(list.len());
    for b in list {
        total += u64::from(b.weight);
        if let Some(idx) = cluster(p, &at, &b.cluster) {
            backends.push((idx, total.min(u64::from(u32::MAX)) as u32));
        }
    }
    if !list.is_empty() && total == 0 {
        p.push(&at, "total weight must be > 0");
    }
    if total > u64::from(u32::MAX) {
        p.push(&at, "total weight overflows u32");
    }
    (backends, total.min(u64::from(u32::MAX)) as u32)
}

fn anchored(pattern: &str) -> Result<Regex, String> {
    Regex::new(&format!("^(?:{pattern})$")).map_err(|e| format!("invalid regex {pattern:?}: {e}"))
}

fn parse_method(s: &str) -> Result<Method, String> {
    Method::from_bytes(s.as_bytes()).map_err(|_| format!("invalid method {s:?}"))
}

fn value_matcher(v: &ValueMatch) -> Result<ValueMatcher, String> {
    match (&v.exact, &v.regex) {
        (Some(_), Some(_)) => Err(format!("{}: set exact or regex, not both", v.name)),
        (Some(e), None) => Ok(ValueMatcher::Exact(e.clone())),
        (None, Some(r)) => anchored(r).map(ValueMatcher::Regex),
        (None, None) => Ok(ValueMatcher::Present),
    }
}

fn rewriter(p: &mut Problems, at: &str, r: &super::HeaderRewrite) -> HeaderRewriter {
    let name = |p: &mut Problems, n: &str| {
        HeaderName::from_bytes(n.as_bytes())
            .map_err(|_| p.push(at, format!("invalid header name {n:?}")))
            .ok()
    };
    let pair = |p: &mut Problems, n: &str, v: &str| {
        let n = name(p, n)?;
        let v = HeaderValue::from_str(v)
            .map_err(|_| p.push(at, format!("invalid header value {v:?}")))
            .ok()?;
        Some((n, v))
    };
    HeaderRewriter {
        remove: r.remove.iter().filter_map(|n| name(p, n)).collect(),
        set: r.set.iter().filter_map(|(n, v)| pair(p, n, v)).collect(),
        add: r.add.iter().filter_map(|(n, v)| pair(p, n, v)).collect(),
    }
}

/// Parse a CIDR list for callers outside the snapshot (the `init` step).
pub fn parse_cidrs(list: &[String]) -> Result<Vec<Cidr>, String> {
    list.iter().map(|s| Cidr::parse(s)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::yaml::parse;

    fn problems(yaml: &str) -> Vec<String> {
        match compile(&parse(yaml).unwrap()) {
            Ok(_) => Vec::new(),
            Err(ConfigError::Invalid(p)) => p,
            Err(e) => panic!("unexpected error {e}"),
        }
    }

    fn assert_refused(yaml: &str, needle: &str) {
        let p = problems(yaml);
        assert!(
            p.iter().any(|s| s.contains(needle)),
            "expected a problem containing {needle:?}, got {p:?}"
        );
    }

    const C: &str = "clusters: [{name: a, endpoints: ['127.0.0.1:1']}]\n";

    #[test]
    fn the_example_config_is_valid() {
        let snap = parse(include_str!("../../../examples/standalone.yaml")).unwrap();
        compile(&snap).unwrap();
    }

    #[test]
    fn the_general_path_is_decided_once_per_route_and_listener() {
        let yaml = "clusters: [{name: a, endpoints: ['127.0.0.1:1']}, {name: b, endpoints: ['127.0.0.1:2']}]
listeners:
- {name: plain, address: '127.0.0.1:0'}
- {name: logged, address: '127.0.0.1:0', access_log: true}
- {name: guarded, address: '127.0.0.1:0', rbac: nobody}
- {name: by-header, address: '127.0.0.1:0'}
routes:
- {name: simple, listeners: [plain, logged, guarded], match: {path: {prefix: /s}, methods: [GET]}, backends: [{cluster: a, weight: 9}, {cluster: b, weight: 1}], timeout_ms: 50}
- {name: retried, listeners: [plain], backends: [{cluster: a}], retry: {attempts: 2}}
- {name: faulty, listeners: [plain], backends: [{cluster: a}], fault: {abort: {percent: 1, status: 503}}}
- {name: mirrored, listeners: [plain], backends: [{cluster: a}], mirror: {cluster: b}}
- {name: rewritten, listeners: [plain], backends: [{cluster: a}], response_headers: {remove: [server]}}
- {name: canary, listeners: [by-header], match: {headers: [{name: x-canary, exact: 'yes'}]}, backends: [{cluster: b}]}
policies:
  rbac:
  - {name: nobody, rules: [], default_action: deny}
";
        let c = compile(&parse(yaml).unwrap()).unwrap();
        let route = |l: &str, r: &str| {
            c.listener(l)
                .unwrap()
                .routes
                .iter()
                .find(|x| &*x.name == r)
                .unwrap()
                .general_path
        };
        assert_eq!(route("plain", "simple"), None);
        assert_eq!(route("plain", "retried"), Some(GeneralPath::Retry));
        assert_eq!(route("plain", "faulty"), Some(GeneralPath::Fault));
        assert_eq!(route("plain", "mirrored"), Some(GeneralPath::Mirror));
        assert_eq!(
            route("plain", "rewritten"),
            Some(GeneralPath::HeaderRewrite)
        );
        let listener = |l: &str| c.listener(l).unwrap().general_path;
        assert_eq!(listener("plain"), None);
        // The fast path evaluates policies and writes access-log lines
        // itself (docs/decisions/0053).
        assert_eq!(listener("logged"), None);
        assert_eq!(listener("guarded"), None);
        // A header condition decides between routes, so the whole listener
        // goes to the general path (the route itself needs nothing).
        assert_eq!(listener("by-header"), Some(GeneralPath::HeaderMatch));
        assert_eq!(route("by-header", "canary"), None);
    }

    #[test]
    fn empty_snapshot_is_valid() {
        assert!(problems("{}").is_empty());
    }

    #[test]
    fn rejects_route_with_unknown_cluster() {
        assert_refused(
            &format!("{C}routes: [{{name: r, backends: [{{cluster: nope}}]}}]"),
            "unknown cluster \"nope\"",
        );
    }

    #[test]
    fn rejects_route_with_zero_total_weight() {
        assert_refused(
            &format!("{C}routes: [{{name: r, backends: [{{cluster: a, weight: 0}}]}}]"),
            "total weight must be > 0",
        );
    }

    #[test]
    fn rejects_route_without_backends() {
        assert_refused(
            &format!("{C}routes: [{{name: r, backends: []}}]"),
            "at least one backend",
        );
    }

    #[test]
    fn rejects_invalid_regex_naming_the_field() {
        assert_refused(
            &format!(
                "{C}routes: [{{name: r, match: {{path: {{regex: '(('}}}}, backends: [{{cluster: a}}]}}]"
            ),
            "routes[0] (r).match.path.regex",
        );
    }

    #[test]
    fn rejects_relative_paths_and_bad_methods_and_headers() {
        assert_refused(
            &format!(
                "{C}routes: [{{name: r, match: {{path: {{prefix: api}}}}, backends: [{{cluster: a}}]}}]"
            ),
            "must start with '/'",
        );
        assert_refused(
            &format!(
                "{C}routes: [{{name: r, match: {{methods: ['G T']}}, backends: [{{cluster: a}}]}}]"
            ),
            "invalid method",
        );
        assert_refused(
            &format!(
                "{C}routes: [{{name: r, match: {{headers: [{{name: 'a b'}}]}}, backends: [{{cluster: a}}]}}]"
            ),
            "invalid header name",
        );
        assert_refused(
            &format!(
                "{C}routes: [{{name: r, match: {{headers: [{{name: a, exact: x, regex: y}}]}}, backends: [{{cluster: a}}]}}]"
            ),
            "not both",
        );
        assert_refused(
            &format!(
                "{C}routes: [{{name: r, backends: [{{cluster: a}}], request_headers: {{set: {{x: \"a\\nb\"}}}}}}]"
            ),
            "invalid header value",
        );
    }

    #[test]
    fn rejects_retry_on_non_5xx_and_too_many_attempts() {
        assert_refused(
            &format!(
                "{C}routes: [{{name: r, backends: [{{cluster: a}}], retry: {{attempts: 2, on_statuses: [404]}}}}]"
            ),
            "404 is not a 5xx",
        );
        assert_refused(
            &format!(
                "{C}routes: [{{name: r, backends: [{{cluster: a}}], retry: {{attempts: 11}}}}]"
            ),
            "must be <= 10",
        );
    }

    #[test]
    fn rejects_fault_percent_out_of_range_and_bad_abort_status() {
        assert_refused(
            &format!(
                "{C}routes: [{{name: r, backends: [{{cluster: a}}], fault: {{delay: {{percent: 101, ms: 1}}}}}}]"
            ),
            "fault.delay.percent",
        );
        assert_refused(
            &format!(
                "{C}routes: [{{name: r, backends: [{{cluster: a}}], fault: {{abort: {{percent: 1, status: 99}}}}}}]"
            ),
            "fault.abort.status",
        );
    }

    #[test]
    fn rejects_path_match_with_zero_or_two_kinds() {
        assert_refused(
            &format!("{C}routes: [{{name: r, match: {{path: {{}}}}, backends: [{{cluster: a}}]}}]"),
            "exactly one of",
        );
        assert_refused(
            &format!(
                "{C}routes: [{{name: r, match: {{path: {{exact: /a, prefix: /b}}}}, backends: [{{cluster: a}}]}}]"
            ),
            "exactly one of",
        );
    }

    #[test]
    fn rejects_duplicate_names_and_addresses() {
        assert_refused(
            "clusters: [{name: a, endpoints: []}, {name: a, endpoints: []}]",
            "duplicate cluster name",
        );
        assert_refused(
            "listeners: [{name: l, address: '127.0.0.1:9'}, {name: l, address: '127.0.0.1:9'}]",
            "duplicate listener name",
        );
        assert_refused(
            "listeners: [{name: l, address: '127.0.0.1:9'}, {name: m, address: '127.0.0.1:9'}]",
            "used twice",
        );
        assert_refused(
            &format!(
                "{C}routes: [{{name: r, backends: [{{cluster: a}}]}}, {{name: r, backends: [{{cluster: a}}]}}]"
            ),
            "duplicate route name",
        );
    }

    #[test]
    fn accepts_rbac_on_listeners_whose_connections_skip_http() {
        // Connections that are not HTTP are checked per connection
        // (`listener::serve_tcp`), so a policy on a tcp listener or one
        // with opaque ports governs them too.
        let rbac =
            "policies: {rbac: [{name: p, rules: [{action: allow, cidrs: ['10.0.0.0/8']}]}]}\n";
        for l in [
            "{name: l, address: '127.0.0.1:0', protocol: tcp, tcp_cluster: a, rbac: p}",
            "{name: l, address: '127.0.0.1:0', opaque_ports: [5432], tcp_cluster: a, rbac: p}",
            "{name: l, address: '127.0.0.1:0', rbac: p}",
        ] {
            let p = problems(&format!("{C}{rbac}listeners: [{l}]"));
            assert!(p.is_empty(), "{l}: {p:?}");
        }
    }

    #[test]
    fn refuses_policies_it_cannot_evaluate_naming_the_rule() {
        for (rule, needle) in [
            ("{action: allow, cidrs: ['10.0.0.0/33']}", "10.0.0.0/33"),
            ("{action: allow, methods: ['G T']}", "invalid method"),
            ("{action: deny, methods: ['get']}", "case-sensitive"),
            (
                "{action: allow, identities: ['']}",
                "empty identity pattern",
            ),
            (
                "{action: allow, identities: ['spiffe://*/ns/a']}",
                "'*' only as the whole pattern or at its end",
            ),
            (
                "{action: allow, headers: [{name: 'bad header'}]}",
                "invalid header name",
            ),
            (
                "{action: allow, headers: [{name: x, exact: a, prefix: b}]}",
                "not both",
            ),
            ("{action: allow, paths: [admin]}", "must start with '/'"),
            ("{action: allow, ports: [0]}", "port 0"),
            ("{name: default, action: allow}", "reserved"),
        ] {
            let yaml =
                format!("policies: {{rbac: [{{name: p, rules: [{{action: allow}}, {rule}]}}]}}");
            let p = problems(&yaml);
            assert!(
                p.iter()
                    .any(|s| s.starts_with("policies.rbac[0].rules[1] (p): ") && s.contains(needle)),
                "{rule}: expected policies.rbac[0].rules[1] and {needle:?}, got {p:?}"
            );
        }
        // Everything the model has compiles.
        assert!(
            problems(
                "policies: {rbac: [{name: p, default_action: audit, rules: [
                  {name: 'ns/p/rules[0]', action: audit, identities: ['spiffe://td/ns/a/*', '*'], authenticated: true,
                   cidrs: ['10.0.0.0/8', '::1'], ports: [80, 8080], methods: [GET, PURGE], paths: [/x],
                   path_prefixes: [/y/], headers: [{name: X-Team, exact: a}, {name: x-b, prefix: c}, {name: x-c}]}]}]}"
            )
            .is_empty()
        );
    }

    #[test]
    fn rejects_a_forced_http_inbound_listener_whose_alpn_the_tls_policy_does_not_offer() {
        let tls = "tls: {mode: Strict, alpn: ['http/1.1'], source: {files: {cert_chain: c, key: k, trust_bundle: b}}}\n";
        assert_refused(
            &format!(
                "{C}{tls}listeners: [{{name: in, address: '127.0.0.1:0', direction: inbound, protocol: http2}}]"
            ),
            "ALPN \"h2\", which tls.alpn [\"http/1.1\"] does not list",
        );
        // An opaque listener needs no ALPN; an outbound one no mesh TLS.
        for ok in [
            "{name: in, address: '127.0.0.1:0', direction: inbound, protocol: tcp, tcp_cluster: a}",
            "{name: in, address: '127.0.0.1:0', direction: inbound, protocol: http1}",
            "{name: out, address: '127.0.0.1:0', protocol: http2}",
        ] {
            let p = problems(&format!("{C}{tls}listeners: [{ok}]"));
            assert!(p.is_empty(), "{ok}: {p:?}");
        }
    }

    #[test]
    fn an_invalid_tls_section_is_refused_with_the_rest_of_the_snapshot_by_field_path() {
        let p = problems(
            "clusters: [{name: a, endpoints: ['127.0.0.1:1'], connect_timeout_ms: 0}]
tls: {min_version: '1.3', cipher_suites: [TLS13_AES_128_GCM_SHA256, NOPE],
      identity: {trust_domain: td, expected_peers: {a: 'spiffe://other/ns/x/sa/y'}}}
",
        );
        let at = |prefix: &str| p.iter().any(|m| m.starts_with(prefix));
        assert!(at("clusters[0] (a).connect_timeout_ms: "), "{p:?}");
        assert!(
            at("tls.cipher_suites[1]: unknown cipher suite \"NOPE\""),
            "{p:?}"
        );
        assert!(at("tls.identity.expected_peers.a: identity "), "{p:?}");
        assert!(
            at("tls.source: mode Strict needs a certificate source"),
            "{p:?}"
        );
        assert_eq!(p.len(), 4, "{p:?}");
    }

    #[test]
    fn rejects_a_cluster_endpoint_on_the_admin_port_of_loopback() {
        assert_refused(
            "admin: {address: '0.0.0.0:15020'}\nclusters: [{name: a, endpoints: ['127.0.0.1:15020']}]",
            "the sidecar's own admin port on loopback",
        );
        assert!(
            problems("admin: {address: '0.0.0.0:15020'}\nclusters: [{name: a, endpoints: ['10.0.0.1:15020', '127.0.0.1:8080']}]")
                .is_empty()
        );
    }

    #[test]
    fn rejects_listener_references_that_do_not_resolve() {
        assert_refused(
            &format!("{C}listeners: [{{name: l, address: '127.0.0.1:0', tcp_cluster: zz}}]"),
            "unknown cluster \"zz\"",
        );
        assert_refused(
            &format!("{C}listeners: [{{name: l, address: '127.0.0.1:0', rbac: p}}]"),
            "unknown rbac policy",
        );
        assert_refused(
            &format!("{C}routes: [{{name: r, listeners: [x], backends: [{{cluster: a}}]}}]"),
            "unknown listener \"x\"",
        );
        assert_refused(
            "listeners: [{name: l, address: '127.0.0.1:0', protocol: tcp}]",
            "needs tcp_cluster",
        );
        assert_refused(
            "listeners: [{name: l, address: '127.0.0.1:0', passthrough: true}]",
            "only valid with capture: transparent",
        );
    }

    #[test]
    fn rejects_bad_outlier_and_runtime_settings() {
        assert_refused(
            "clusters: [{name: a, endpoints: [], outlier: {consecutive_failures: 0}}]",
            "consecutive_failures",
        );
        assert_refused(
            "clusters: [{name: a, endpoints: [], outlier: {base_ejection_ms: 10, max_ejection_ms: 5}}]",
            "base_ejection_ms",
        );
        assert_refused("runtime: {worker_threads: 0}", "worker_threads");
        assert_refused("runtime: {event_interval: 0}", "runtime.event_interval");
        assert_refused(
            "runtime: {global_queue_interval: 5000}",
            "runtime.global_queue_interval",
        );
        assert_refused(
            "clusters: [{name: a, endpoints: ['127.0.0.1:1', '127.0.0.1:1']}]",
            "duplicate endpoint",
        );
    }

    #[test]
    fn reports_every_problem_at_once() {
        let p = problems(
            "clusters: [{name: a, endpoints: [], connect_timeout_ms: 0}]\nroutes: [{name: r, backends: [{cluster: b}]}]",
        );
        assert_eq!(p.len(), 2, "{p:?}");
    }

    const AB: &str = "clusters: [{name: a, endpoints: ['127.0.0.1:1']}, {name: b, endpoints: ['127.0.0.1:2']}]
listeners: [{name: out, address: '127.0.0.1:0', capture: transparent, passthrough: true}, {name: other, address: '127.0.0.1:0'}]
";

    #[test]
    fn a_tcp_route_makes_its_destinations_opaque_and_draws_backends_by_weight() {
        let c = compile(
            &parse(&format!(
                "{AB}tcp_routes: [{{name: t, listeners: [out], destinations: ['10.96.0.7:5432', '[fd00::7]:5432'], backends: [{{cluster: a, weight: 3}}, {{cluster: b, weight: 1}}], connect_timeout_ms: 250}}]"
            ))
            .unwrap(),
        )
        .unwrap();
        let out = c.listener("out").unwrap();
        let dst: SocketAddr = "10.96.0.7:5432".parse().unwrap();
        assert!(out.is_opaque(dst));
        assert!(out.is_opaque("[fd00::7]:5432".parse().unwrap()));
        // Another IP on the same port, or the same IP on another port, is not.
        assert!(!out.is_opaque("10.96.0.8:5432".parse().unwrap()));
        assert!(!out.is_opaque("10.96.0.7:80".parse().unwrap()));
        let r = out.tcp_route(dst).unwrap();
        assert_eq!(r.connect_timeout, Some(Duration::from_millis(250)));
        let picks: Vec<usize> = (0..4).map(|d| r.pick_backend(d)).collect();
        assert_eq!(picks, vec![0, 0, 0, 1], "3:1 over a, b");
        // A route names its listeners; the other one does not have it.
        assert!(c.listener("other").unwrap().tcp_route(dst).is_none());
    }

    #[test]
    fn a_zero_weight_tcp_backend_is_never_drawn() {
        let c = compile(
            &parse(&format!(
                "{AB}tcp_routes: [{{name: t, destinations: ['10.96.0.7:5432'], backends: [{{cluster: a, weight: 0}}, {{cluster: b, weight: 2}}]}}]"
            ))
            .unwrap(),
        )
        .unwrap();
        let r = c
            .listener("out")
            .unwrap()
            .tcp_route("10.96.0.7:5432".parse().unwrap())
            .unwrap()
            .clone();
        assert!((0..100).all(|d| r.pick_backend(d) == 1));
        assert_eq!(r.connect_timeout, None);
    }

    #[test]
    fn rejects_tcp_routes_with_zero_total_weight_unknown_clusters_or_no_destination() {
        let t = |body: &str| format!("{AB}tcp_routes: [{{name: t, {body}}}]");
        assert_refused(
            &t("destinations: ['10.0.0.1:1'], backends: [{cluster: a, weight: 0}]"),
            "tcp_routes[0] (t).backends: total weight must be > 0",
        );
        assert_refused(
            &t("destinations: ['10.0.0.1:1'], backends: []"),
            "at least one backend is required",
        );
        assert_refused(
            &t("destinations: ['10.0.0.1:1'], backends: [{cluster: nope}]"),
            "tcp_routes[0] (t).backends: unknown cluster \"nope\"",
        );
        assert_refused(
            &t("destinations: [], backends: [{cluster: a}]"),
            "at least one destination is required",
        );
        assert_refused(
            &t("destinations: ['10.0.0.1:0'], backends: [{cluster: a}]"),
            "has port 0",
        );
        assert_refused(
            &t("destinations: ['10.0.0.1:1'], backends: [{cluster: a}], connect_timeout_ms: 0"),
            "connect_timeout_ms: must be > 0",
        );
        assert_refused(
            &t("listeners: [nope], destinations: ['10.0.0.1:1'], backends: [{cluster: a}]"),
            "unknown listener \"nope\"",
        );
    }

    #[test]
    fn rejects_two_tcp_routes_claiming_one_destination_on_one_listener() {
        assert_refused(
            &format!(
                "{AB}tcp_routes:
- {{name: t1, destinations: ['10.0.0.1:1'], backends: [{{cluster: a}}]}}
- {{name: t2, destinations: ['10.0.0.1:1'], backends: [{{cluster: b}}]}}"
            ),
            "destination 10.0.0.1:1 is claimed by tcp routes \"t1\" and \"t2\"",
        );
        assert_refused(
            &format!(
                "{AB}tcp_routes:
- {{name: t, destinations: ['10.0.0.1:1'], backends: [{{cluster: a}}]}}
- {{name: t, destinations: ['10.0.0.2:1'], backends: [{{cluster: b}}]}}"
            ),
            "duplicate tcp route name",
        );
        // On different listeners, one destination may go two ways.
        assert!(
            problems(&format!(
                "{AB}tcp_routes:
- {{name: t1, listeners: [out], destinations: ['10.0.0.1:1'], backends: [{{cluster: a}}]}}
- {{name: t2, listeners: [other], destinations: ['10.0.0.1:1'], backends: [{{cluster: b}}]}}"
            ))
            .is_empty()
        );
    }

    #[test]
    fn routes_apply_only_to_their_listeners() {
        let snap = parse(&format!(
            "{C}listeners: [{{name: l1, address: '127.0.0.1:0'}}, {{name: l2, address: '127.0.0.1:0'}}]
routes: [{{name: only1, listeners: [l1], backends: [{{cluster: a}}]}}, {{name: all, backends: [{{cluster: a}}]}}]"
        ))
        .unwrap();
        let c = compile(&snap).unwrap();
        let names = |l: &str| {
            c.listener(l)
                .unwrap()
                .routes
                .iter()
                .map(|r| r.name.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(names("l1"), vec!["only1", "all"]);
        assert_eq!(names("l2"), vec!["all"]);
    }
}
