//! The filter chains, in the MOSN/Envoy sense.
//!
//! * Network filters run once per accepted connection, in order, before any
//!   protocol handling: [`NetworkFilter::ConnectionLimit`], then the terminal
//!   protocol handler (TCP proxy or HTTP server).
//! * Authorization ([`Rbac`], issue #36) runs once per HTTP request, before
//!   anything of the request is answered or forwarded (a denied client gets
//!   403 whether or not a route exists), and once per connection whose
//!   bytes are not HTTP, before the upstream connect (docs/decisions/0047).
//! * Stream filters run once per HTTP request, in order, after routing:
//!   access log (observes), fault (may delay / abort), mirror (copies),
//!   then the router (terminal).
//!
//! The chains are enums rather than trait objects: the set is closed and
//! known at compile time, dispatch is a jump table, and adding a filter is
//! one variant plus one match arm in [`StreamFilter::on_request`] — the core
//! proxy loop never changes. Its configuration lands on a route or a
//! listener, whose classification for the HTTP/1.1 fast path
//! ([`crate::routing::GeneralPath`]) names every field: the crate does not
//! compile until the new filter says whether the fast path may skip it.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

// The config model's types, from the crate that holds them (not through
// `crate::config`, which compiles snapshots into these filters).
use baton_config::{FaultConfig, RbacAction, RbacPolicy};
use http::{HeaderMap, HeaderName, Method, StatusCode};
use prometheus_client::metrics::counter::Counter;

use crate::metrics::{AuthzLabels, Metrics};

/// Per-connection facts every filter may look at (the handoff carries them
/// with a moved connection, hence their home in `baton_handoff`).
pub use baton_handoff::conn::ConnMeta;

/// Network filters, run per connection before protocol handling.
#[derive(Debug)]
pub enum NetworkFilter {
    /// Refuse (close) connections beyond `max` live ones on a listener.
    ConnectionLimit { max: u32, live: Arc<AtomicU32> },
}

/// Held while a connection counts against a limit.
#[derive(Debug)]
pub struct ConnPermit(Option<Arc<AtomicU32>>);

impl Drop for ConnPermit {
    fn drop(&mut self) {
        if let Some(c) = &self.0 {
            c.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl NetworkFilter {
    /// `None` = close the connection now.
    pub fn on_accept(&self) -> Option<ConnPermit> {
        match self {
            NetworkFilter::ConnectionLimit { max, live } => {
                let prev = live.fetch_add(1, Ordering::Relaxed);
                if prev >= *max {
                    live.fetch_sub(1, Ordering::Relaxed);
                    None
                } else {
                    Some(ConnPermit(Some(live.clone())))
                }
            }
        }
    }
}

/// An IPv4/IPv6 network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (a, p) = s.split_once('/').unwrap_or((s, ""));
        let addr: IpAddr = a
            .parse()
            .map_err(|_| format!("invalid CIDR {s:?}: bad address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = if p.is_empty() {
            max
        } else {
            p.parse()
                .map_err(|_| format!("invalid CIDR {s:?}: bad prefix"))?
        };
        if prefix > max {
            return Err(format!("invalid CIDR {s:?}: prefix > {max}"));
        }
        Ok(Cidr { addr, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) if self.addr.is_ipv4() => match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => return false,
            },
            other => other,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = if self.prefix == 0 {
                    0
                } else {
                    u32::MAX << (32 - self.prefix)
                };
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = if self.prefix == 0 {
                    0
                } else {
                    u128::MAX << (128 - self.prefix)
                };
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// One identity pattern of a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
enum IdPattern {
    /// `*`: any authenticated peer.
    Any,
    Exact(String),
    /// `spiffe://td/ns/shop/*`: the part before the `*`.
    Prefix(String),
}

impl IdPattern {
    fn parse(s: &str) -> Result<IdPattern, String> {
        match s {
            "" => Err("empty identity pattern (use \"*\" for any authenticated peer)".into()),
            "*" => Ok(IdPattern::Any),
            _ => match s.strip_suffix('*') {
                Some(p) if !p.contains('*') => Ok(IdPattern::Prefix(p.to_string())),
                None if !s.contains('*') => Ok(IdPattern::Exact(s.to_string())),
                _ => Err(format!(
                    "identity pattern {s:?}: '*' only as the whole pattern or at its end"
                )),
            },
        }
    }

    fn matches(&self, id: &str) -> bool {
        match self {
            IdPattern::Any => true,
            IdPattern::Exact(e) => e == id,
            IdPattern::Prefix(p) => id.starts_with(p.as_str()),
        }
    }
}

/// What a header condition wants of the header's value.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HeaderValueMatch {
    Present,
    Exact(Vec<u8>),
    Prefix(Vec<u8>),
}

#[derive(Debug, Clone)]
struct HeaderCond {
    /// Lower case (header maps are keyed so: names match whatever their case).
    name: HeaderName,
    value: HeaderValueMatch,
}

impl HeaderCond {
    /// Any field line of the header satisfies the condition (a repeated
    /// header is not joined): a deny rule on a value cannot be evaded by
    /// sending the header twice.
    fn matches(&self, headers: Headers<'_>) -> bool {
        match headers {
            Headers::Map(map) => {
                self.matches_values(map.get_all(&self.name).iter().map(|v| v.as_bytes()))
            }
            Headers::Raw(raw) => self.matches_values(
                raw.iter()
                    .filter(|h| h.name.eq_ignore_ascii_case(self.name.as_str()))
                    .map(|h| h.value),
            ),
        }
    }

    fn matches_values<'v>(&self, mut values: impl Iterator<Item = &'v [u8]>) -> bool {
        match &self.value {
            HeaderValueMatch::Present => values.next().is_some(),
            HeaderValueMatch::Exact(v) => values.any(|h| h == v.as_slice()),
            HeaderValueMatch::Prefix(p) => values.any(|h| h.starts_with(p)),
        }
    }
}

/// A request's header lines as either HTTP/1 path holds them: the general
/// path's parsed map, or the fast path's `httparse` lines (no map is built
/// for a policy). Both hold each field line separately, values without
/// surrounding whitespace; names are matched in any case.
#[derive(Debug, Clone, Copy)]
pub enum Headers<'a> {
    Map(&'a HeaderMap),
    Raw(&'a [httparse::Header<'a>]),
}

#[derive(Debug)]
struct RbacRuleC {
    /// For counters and logs: the rule's name, else `rules[<index>]`.
    label: Arc<str>,
    action: RbacAction,
    identities: Vec<IdPattern>,
    authenticated: Option<bool>,
    cidrs: Vec<Cidr>,
    ports: Vec<u16>,
    methods: Vec<Method>,
    paths: Vec<String>,
    path_prefixes: Vec<String>,
    headers: Vec<HeaderCond>,
}

impl RbacRuleC {
    /// The rule looks at the request (method, path, headers), so it never
    /// matches a connection whose bytes are not HTTP.
    fn needs_request(&self) -> bool {
        !self.methods.is_empty()
            || !self.paths.is_empty()
            || !self.path_prefixes.is_empty()
            || !self.headers.is_empty()
    }

    /// Every non-empty condition holds (AND); within one, any entry (OR).
    /// Cheapest conditions first.
    fn matches(&self, conn: &ConnMeta, req: Option<&RequestFacts<'_>>) -> bool {
        let identity = conn.peer_identity.as_deref();
        if let Some(want) = self.authenticated
            && want != identity.is_some()
        {
            return false;
        }
        if !self.ports.is_empty() && !self.ports.contains(&conn.dst_port()) {
            return false;
        }
        if !self.identities.is_empty()
            && !identity.is_some_and(|id| self.identities.iter().any(|p| p.matches(id)))
        {
            return false;
        }
        if !self.cidrs.is_empty() {
            let ip = conn.peer.ip();
            if !self.cidrs.iter().any(|c| c.contains(ip)) {
                return false;
            }
        }
        if !self.needs_request() {
            return true;
        }
        let Some(req) = req else {
            return false;
        };
        (self.methods.is_empty() || self.methods.iter().any(|m| m == req.method))
            && (self.paths.is_empty() || self.paths.iter().any(|p| p == req.path))
            && (self.path_prefixes.is_empty()
                || self
                    .path_prefixes
                    .iter()
                    .any(|p| req.path.starts_with(p.as_str())))
            && self.headers.iter().all(|h| h.matches(req.headers))
    }
}

/// The request-scoped facts a policy looks at.
#[derive(Debug, Clone, Copy)]
pub struct RequestFacts<'a> {
    pub method: &'a Method,
    /// The path without the query: normalized ([`crate::path_norm`]) when
    /// the policy has a path condition ([`Rbac::matches_paths`]).
    pub path: &'a str,
    pub headers: Headers<'a>,
}

/// The reason (metric label, `x-baton-local-reason`) and the static body of
/// the answer to a denied request, the same on every path: a denied
/// client learns neither routes nor policy names.
pub const DENIED_REASON: &str = "rbac_denied";
pub const DENIED_BODY: &str = "denied by rbac policy\n";

/// Allowed through or refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Allow,
    Deny,
}

/// Which part of a policy decided (or audited).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    /// The rule at this index.
    Rule(usize),
    /// No allow or deny rule matched: the policy's `default_action`.
    Default,
}

/// What a policy decided for one request or connection, and why: what
/// logs and counters name (and what the access log reads). Holds the
/// policy, so it outlives the config snapshot it was decided under.
#[derive(Debug, Clone)]
pub struct Verdict {
    rbac: Arc<Rbac>,
    pub decision: Decision,
    pub by: By,
    /// The audit rule that matched, if one did.
    pub audit: Option<usize>,
}

impl Verdict {
    pub fn denied(&self) -> bool {
        self.decision == Decision::Deny
    }

    /// Let through by an `audit` default: the policy would deny it.
    pub fn would_deny(&self) -> bool {
        self.by == By::Default && self.rbac.default_action == RbacAction::Audit
    }

    pub fn policy(&self) -> &str {
        &self.rbac.name
    }

    /// The deciding rule's label, or `default`.
    pub fn rule(&self) -> &str {
        self.rbac.label(self.by)
    }

    /// The audit rule's label if one matched, else `default` when an audit
    /// default let it through.
    pub fn audit_rule(&self) -> Option<&str> {
        match self.audit {
            Some(i) => Some(self.rbac.label(By::Rule(i))),
            None if self.would_deny() => Some(DEFAULT_LABEL),
            None => None,
        }
    }

    /// `allow`, `deny` or `audit` (an audit default that let it through).
    pub fn verdict_label(&self) -> &'static str {
        match (self.decision, self.would_deny()) {
            (Decision::Deny, _) => "deny",
            (Decision::Allow, true) => "audit",
            (Decision::Allow, false) => "allow",
        }
    }

    /// Counts the verdict in `baton_sidecar_authz_total`: once for what
    /// decided (`allow`/`deny`, or `audit` for an audit default), once more
    /// for an audit rule that matched.
    pub fn count(&self, metrics: &Metrics) {
        let counters = self.rbac.counters(metrics);
        counters[self.rbac.slot(self.by)].inc();
        if let Some(i) = self.audit {
            counters[self.rbac.slot(By::Rule(i))].inc();
        }
    }

    /// Counts it and logs what is worth a line (denied, audited), at info on
    /// target `authz`: peer, identity, tls, listener, the request's method
    /// and path (`-` for a connection, `req` = `None`), policy and rule.
    pub fn record(&self, metrics: &Metrics, conn: &ConnMeta, req: Option<&RequestFacts<'_>>) {
        self.count(metrics);
        if self.decision == Decision::Allow && self.audit_rule().is_none() {
            return;
        }
        let (method, path) = match req {
            Some(r) => (r.method.as_str(), r.path),
            None => ("-", "-"),
        };
        let what = if req.is_some() {
            "request"
        } else {
            "connection"
        };
        let identity = conn.peer_identity.as_deref().unwrap_or("-");
        let audit = self.audit_rule().unwrap_or("-");
        if self.denied() {
            tracing::info!(target: "authz", conn = conn.id, listener = %conn.listener,
                peer = %conn.peer, identity, tls = conn.tls, method, path,
                policy = self.policy(), rule = self.rule(), audit,
                "{what} denied by authorization policy");
        } else if self.would_deny() {
            tracing::info!(target: "authz", conn = conn.id, listener = %conn.listener,
                peer = %conn.peer, identity, tls = conn.tls, method, path,
                policy = self.policy(), rule = self.rule(), audit,
                "{what} would be denied by authorization policy (audit): let through");
        } else {
            tracing::info!(target: "authz", conn = conn.id, listener = %conn.listener,
                peer = %conn.peer, identity, tls = conn.tls, method, path,
                policy = self.policy(), rule = self.rule(), audit,
                "{what} matched an audit rule of authorization policy");
        }
    }
}

/// A compiled authorization policy (the config model's [`RbacPolicy`]):
/// ordered rules; an audit rule that matches is recorded and evaluation
/// goes on; the first allow or deny rule that matches decides; none does →
/// the default action (`audit` there: let through, recorded as would deny).
#[derive(Debug)]
pub struct Rbac {
    pub name: Arc<str>,
    rules: Vec<RbacRuleC>,
    default_action: RbacAction,
    /// Some rule has `paths` or `path_prefixes` ([`Rbac::matches_paths`]).
    matches_paths: bool,
    /// One counter per rule, then the default's, resolved on first use
    /// (the hot path then does no label hashing).
    counters: OnceLock<Vec<Counter>>,
}

/// Why a policy was refused: the rule (its index) and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbacError {
    pub rule: usize,
    pub reason: String,
}

impl std::fmt::Display for RbacError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rules[{}]: {}", self.rule, self.reason)
    }
}

/// The label of the default action in counters and logs.
const DEFAULT_LABEL: &str = "default";

fn verdict_of(action: RbacAction) -> &'static str {
    match action {
        RbacAction::Allow => "allow",
        RbacAction::Deny => "deny",
        RbacAction::Audit => "audit",
    }
}

impl Rbac {
    /// Compiles and validates `p`; an error names the rule (the caller
    /// puts it under `policies.rbac[i]`).
    pub fn compile(p: &RbacPolicy) -> Result<Rbac, RbacError> {
        let mut rules = Vec::with_capacity(p.rules.len());
        for (i, r) in p.rules.iter().enumerate() {
            let at = |reason: String| RbacError { rule: i, reason };
            let label: Arc<str> = if r.name.is_empty() {
                Arc::from(format!("rules[{i}]"))
            } else {
                Arc::from(r.name.as_str())
            };
            // Two rules may share a name (one policy rule the operator
            // expanded, say): they share its counter series.
            if &*label == DEFAULT_LABEL {
                return Err(at(format!(
                    "rule name {label:?} is reserved (counters and logs name the default action so)"
                )));
            }
            let identities = r
                .identities
                .iter()
                .map(|s| IdPattern::parse(s))
                .collect::<Result<Vec<_>, _>>()
                .map_err(at)?;
            let cidrs = r
                .cidrs
                .iter()
                .map(|c| Cidr::parse(c))
                .collect::<Result<Vec<_>, _>>()
                .map_err(at)?;
            if r.ports.contains(&0) {
                return Err(at("port 0 never matches (ports are 1..=65535)".into()));
            }
            let methods = r
                .methods
                .iter()
                .map(|m| {
                    // Methods are case-sensitive (RFC 9110 §9.1): "get"
                    // would never match a GET, and a deny rule would fail open.
                    if m.is_empty() || m.bytes().any(|b| b.is_ascii_lowercase()) {
                        return Err(format!(
                            "invalid method {m:?} (methods are case-sensitive: write \"GET\")"
                        ));
                    }
                    Method::from_bytes(m.as_bytes()).map_err(|_| format!("invalid method {m:?}"))
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(at)?;
            for p in r.paths.iter().chain(&r.path_prefixes) {
                if !p.starts_with('/') {
                    return Err(at(format!("path {p:?} must start with '/'")));
                }
            }
            let headers = r
                .headers
                .iter()
                .map(|h| {
                    let name = HeaderName::from_bytes(h.name.as_bytes())
                        .map_err(|_| format!("invalid header name {:?}", h.name))?;
                    let value = match (&h.exact, &h.prefix) {
                        (None, None) => HeaderValueMatch::Present,
                        (Some(v), None) => HeaderValueMatch::Exact(v.as_bytes().to_vec()),
                        (None, Some(v)) => HeaderValueMatch::Prefix(v.as_bytes().to_vec()),
                        (Some(_), Some(_)) => {
                            return Err(format!(
                                "header {:?}: set exact or prefix, not both",
                                h.name
                            ));
                        }
                    };
                    Ok(HeaderCond { name, value })
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(at)?;
            rules.push(RbacRuleC {
                label,
                action: r.action,
                identities,
                authenticated: r.authenticated,
                cidrs,
                ports: r.ports.clone(),
                methods,
                paths: r.paths.clone(),
                path_prefixes: r.path_prefixes.clone(),
                headers,
            });
        }
        Ok(Rbac {
            name: Arc::from(p.name.as_str()),
            matches_paths: rules
                .iter()
                .any(|r| !r.paths.is_empty() || !r.path_prefixes.is_empty()),
            rules,
            default_action: p.default_action,
            counters: OnceLock::new(),
        })
    }

    /// The pure decision: `req` is `None` for a connection whose bytes are
    /// not HTTP (rules that need a request never match it).
    pub fn decide(
        &self,
        conn: &ConnMeta,
        req: Option<&RequestFacts<'_>>,
    ) -> (Decision, By, Option<usize>) {
        let mut audit = None;
        for (i, r) in self.rules.iter().enumerate() {
            // An audit rule already recorded cannot change the outcome.
            if r.action == RbacAction::Audit && audit.is_some() {
                continue;
            }
            if !r.matches(conn, req) {
                continue;
            }
            match r.action {
                RbacAction::Allow => return (Decision::Allow, By::Rule(i), audit),
                RbacAction::Deny => return (Decision::Deny, By::Rule(i), audit),
                RbacAction::Audit => audit = Some(i),
            }
        }
        match self.default_action {
            RbacAction::Allow => (Decision::Allow, By::Default, audit),
            RbacAction::Deny => (Decision::Deny, By::Default, audit),
            RbacAction::Audit => (Decision::Allow, By::Default, audit),
        }
    }

    /// Whether any rule has a path condition: then requests are matched
    /// (and forwarded) with their path normalized ([`crate::path_norm`]).
    pub fn matches_paths(&self) -> bool {
        self.matches_paths
    }

    /// Decide a request (or connection, `req` = `None`), count and log the
    /// verdict: what every HTTP path calls per request, so the fast path
    /// and the general path cannot disagree.
    pub fn authorize(
        self: &Arc<Self>,
        metrics: &Metrics,
        conn: &ConnMeta,
        req: Option<&RequestFacts<'_>>,
    ) -> Verdict {
        let v = self.check(conn, req);
        v.record(metrics, conn, req);
        v
    }

    /// [`Rbac::decide`] as a [`Verdict`] (not counted or logged yet:
    /// [`Verdict::record`]).
    pub fn check(self: &Arc<Self>, conn: &ConnMeta, req: Option<&RequestFacts<'_>>) -> Verdict {
        let (decision, by, audit) = self.decide(conn, req);
        Verdict {
            rbac: self.clone(),
            decision,
            by,
            audit,
        }
    }

    fn label(&self, by: By) -> &str {
        match by {
            By::Rule(i) => &self.rules[i].label,
            By::Default => DEFAULT_LABEL,
        }
    }

    fn slot(&self, by: By) -> usize {
        match by {
            By::Rule(i) => i,
            By::Default => self.rules.len(),
        }
    }

    /// Each rule's counter (its verdict is its action), then the default's.
    /// The label values come only from the config (policy and rule names),
    /// so the series are bounded by the config's rules (plus one default
    /// per policy), never by traffic.
    fn counters(&self, metrics: &Metrics) -> &[Counter] {
        self.counters.get_or_init(|| {
            let one = |rule: &Arc<str>, action| {
                metrics
                    .authz
                    .get_or_create(&AuthzLabels {
                        policy: self.name.clone(),
                        rule: rule.clone(),
                        verdict: verdict_of(action),
                    })
                    .clone()
            };
            let default: Arc<str> = Arc::from(DEFAULT_LABEL);
            self.rules
                .iter()
                .map(|r| one(&r.label, r.action))
                .chain(std::iter::once(one(&default, self.default_action)))
                .collect()
        })
    }
}

/// What a stream filter wants done with a request.
#[derive(Debug, PartialEq, Eq)]
pub enum FilterAction {
    Continue,
    /// Answer locally with this status and a short reason body.
    Respond(StatusCode, &'static str),
    /// Sleep, then continue.
    Delay(Duration),
}

/// Stream filters (per request), run in chain order after routing and
/// authorization ([`Rbac`], evaluated by the request path itself: its
/// outcome is a [`Verdict`] the access log reads, not only an action).
#[derive(Debug)]
pub enum StreamFilter {
    Fault(FaultConfig),
}

impl StreamFilter {
    /// `draw` is a uniform random number in `0..10_000` (basis points), so
    /// percentages are decided without a lock or allocation.
    pub fn on_request(&self, draw: u32) -> FilterAction {
        match self {
            StreamFilter::Fault(f) => fault_decision(f, draw),
        }
    }
}

/// Pure fault decision: abort wins over delay when both fire.
pub fn fault_decision(f: &FaultConfig, draw: u32) -> FilterAction {
    let hit = |percent: f64| f64::from(draw % 10_000) < percent * 100.0;
    if let Some(a) = &f.abort
        && hit(a.percent)
    {
        let status = StatusCode::from_u16(a.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        return FilterAction::Respond(status, "fault injected\n");
    }
    if let Some(d) = &f.delay
        && hit(d.percent)
    {
        return FilterAction::Delay(Duration::from_millis(d.ms));
    }
    FilterAction::Continue
}

/// Cheap thread-local xorshift PRNG for load-balancing and percentage
/// decisions (not for anything security-relevant).
pub fn fast_rand() -> u32 {
    use std::cell::Cell;
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
            let addr = &t as *const u64 as u64;
            (t ^ addr.rotate_left(32)) | 1
        });
    }
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32
    })
}

/// Pure: whether a caller at `peer` is inside the Pod: on its loopback
/// (127.0.0.0/8, ::1, or 127.x mapped into IPv6 by a dual-stack socket).
/// Containers of a Pod share its network namespace, so its loopback is
/// reachable only from them (and through `kubectl port-forward`, which the
/// API server authorizes per Pod); the kubelet and other Pods arrive from
/// the Pod's or the node's addresses.
pub fn from_pod(peer: IpAddr) -> bool {
    match peer {
        IpAddr::V4(a) => a.is_loopback(),
        IpAddr::V6(a) => a.is_loopback() || a.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{FaultAbort, FaultDelay, RbacHeader, RbacRule};

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn cidrs_contain_what_they_should() {
        let c = Cidr::parse("10.1.0.0/16").unwrap();
        assert!(c.contains(ip("10.1.255.3")));
        assert!(!c.contains(ip("10.2.0.1")));
        assert!(
            c.contains(ip("::ffff:10.1.0.9")),
            "v4-mapped v6 peers match v4 networks"
        );
        assert!(Cidr::parse("0.0.0.0/0").unwrap().contains(ip("8.8.8.8")));
        assert!(Cidr::parse("::1/128").unwrap().contains(ip("::1")));
        assert!(!Cidr::parse("::1/128").unwrap().contains(ip("127.0.0.1")));
        assert_eq!(Cidr::parse("1.2.3.4").unwrap().prefix, 32);
        assert!(Cidr::parse("1.2.3.4/33").is_err());
        assert!(Cidr::parse("nope/3").is_err());
    }

    fn rule(action: RbacAction) -> RbacRule {
        RbacRule {
            action,
            ..RbacRule::default()
        }
    }

    fn policy(rules: Vec<RbacRule>, default_action: RbacAction) -> Arc<Rbac> {
        Arc::new(
            Rbac::compile(&RbacPolicy {
                name: "p".into(),
                rules,
                default_action,
            })
            .unwrap(),
        )
    }

    /// A connection from `peer` (ip) to port `port`, with `identity`.
    fn conn(identity: Option<&str>, peer: &str, port: u16) -> ConnMeta {
        ConnMeta {
            id: 1,
            listener: Arc::from("l"),
            peer: std::net::SocketAddr::new(ip(peer), 40000),
            local: std::net::SocketAddr::new(ip("10.9.9.9"), port),
            original_dst: None,
            peer_identity: identity.map(str::to_string),
            alpn: None,
            tls: identity.is_some(),
        }
    }

    fn headers(list: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in list {
            h.append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    /// The decision for a request (`Some`) or a connection (`None`) as
    /// (allowed, deciding rule label, audit label).
    fn decide(
        r: &Arc<Rbac>,
        c: &ConnMeta,
        req: Option<(&Method, &str, &HeaderMap)>,
    ) -> (bool, String, Option<String>) {
        let facts = req.map(|(method, path, headers)| RequestFacts {
            method,
            path,
            headers: Headers::Map(headers),
        });
        let v = r.check(c, facts.as_ref());
        (
            !v.denied(),
            v.rule().to_string(),
            v.audit_rule().map(str::to_string),
        )
    }

    fn allowed(r: &Arc<Rbac>, c: &ConnMeta, method: &Method, path: &str) -> bool {
        decide(r, c, Some((method, path, &HeaderMap::new()))).0
    }

    const WEB: &str = "spiffe://td/ns/a/sa/web";

    #[test]
    fn rbac_first_matching_rule_decides_and_default_applies_otherwise() {
        let r = policy(
            vec![
                RbacRule {
                    path_prefixes: vec!["/admin".into()],
                    ..rule(RbacAction::Deny)
                },
                RbacRule {
                    identities: vec![WEB.into()],
                    ..rule(RbacAction::Allow)
                },
                RbacRule {
                    name: "loopback-get".into(),
                    cidrs: vec!["127.0.0.0/8".into()],
                    methods: vec!["GET".into()],
                    ..rule(RbacAction::Allow)
                },
            ],
            RbacAction::Deny,
        );
        let web = conn(Some(WEB), "10.0.0.1", 80);
        let none = HeaderMap::new();
        assert_eq!(
            decide(&r, &web, Some((&Method::POST, "/x", &none))),
            (true, "rules[1]".into(), None)
        );
        assert_eq!(
            decide(&r, &web, Some((&Method::GET, "/admin/x", &none))),
            (false, "rules[0]".into(), None)
        );
        let local = conn(None, "127.0.0.1", 80);
        assert_eq!(
            decide(&r, &local, Some((&Method::GET, "/x", &none))),
            (true, "loopback-get".into(), None),
            "a named rule is labelled by its name"
        );
        assert_eq!(
            decide(&r, &local, Some((&Method::POST, "/x", &none))),
            (false, "default".into(), None)
        );
        let other = conn(Some("spiffe://td/ns/b/sa/x"), "10.0.0.1", 80);
        assert!(!allowed(&r, &other, &Method::GET, "/x"));
    }

    #[test]
    fn rbac_identity_patterns_exact_any_and_prefix() {
        let r = policy(
            vec![RbacRule {
                identities: vec!["spiffe://td/ns/shop/*".into(), WEB.into()],
                ..rule(RbacAction::Allow)
            }],
            RbacAction::Deny,
        );
        let get = |id: Option<&str>| allowed(&r, &conn(id, "10.0.0.1", 80), &Method::GET, "/");
        assert!(get(Some("spiffe://td/ns/shop/sa/cart")));
        assert!(get(Some(WEB)));
        assert!(!get(Some("spiffe://td/ns/a/sa/web2")), "exact is exact");
        assert!(
            !get(Some("spiffe://td/ns/shopping/sa/x")),
            "the prefix ends at its '/'"
        );
        assert!(!get(Some("spiffe://other/ns/shop/sa/cart")));
        assert!(!get(None), "a pattern needs an identity");

        let any = policy(
            vec![RbacRule {
                identities: vec!["*".into()],
                ..rule(RbacAction::Allow)
            }],
            RbacAction::Deny,
        );
        assert!(allowed(
            &any,
            &conn(Some("spiffe://x"), "1.1.1.1", 80),
            &Method::GET,
            "/"
        ));
        assert!(!allowed(
            &any,
            &conn(None, "1.1.1.1", 80),
            &Method::GET,
            "/"
        ));
    }

    #[test]
    fn rbac_authenticated_true_and_false() {
        let only_mesh = policy(
            vec![RbacRule {
                authenticated: Some(true),
                ..rule(RbacAction::Allow)
            }],
            RbacAction::Deny,
        );
        let only_plain = policy(
            vec![RbacRule {
                authenticated: Some(false),
                ..rule(RbacAction::Allow)
            }],
            RbacAction::Deny,
        );
        let mesh = conn(Some(WEB), "10.0.0.1", 80);
        let plain = conn(None, "10.0.0.1", 80);
        assert!(allowed(&only_mesh, &mesh, &Method::GET, "/"));
        assert!(!allowed(&only_mesh, &plain, &Method::GET, "/"));
        assert!(!allowed(&only_plain, &mesh, &Method::GET, "/"));
        assert!(allowed(&only_plain, &plain, &Method::GET, "/"));
        // TLS without a mesh client certificate is unauthenticated.
        let tls_no_id = ConnMeta {
            tls: true,
            ..plain.clone()
        };
        assert!(allowed(&only_plain, &tls_no_id, &Method::GET, "/"));
        // Connection-level rule: it decides connections too.
        assert_eq!(only_mesh.check(&mesh, None).decision, Decision::Allow);
        assert_eq!(only_mesh.check(&plain, None).decision, Decision::Deny);
    }

    #[test]
    fn rbac_ports_are_the_destination_port() {
        let r = policy(
            vec![RbacRule {
                ports: vec![8080, 9090],
                ..rule(RbacAction::Deny)
            }],
            RbacAction::Allow,
        );
        assert!(!allowed(
            &r,
            &conn(None, "10.0.0.1", 8080),
            &Method::GET,
            "/"
        ));
        assert!(allowed(&r, &conn(None, "10.0.0.1", 80), &Method::GET, "/"));
        // Under transparent capture the original destination's port counts.
        let captured = ConnMeta {
            original_dst: Some("10.1.1.1:9090".parse().unwrap()),
            ..conn(None, "10.0.0.1", 15006)
        };
        assert!(!allowed(&r, &captured, &Method::GET, "/"));
        assert_eq!(r.check(&captured, None).decision, Decision::Deny);
    }

    #[test]
    fn rbac_exact_paths_and_prefixes() {
        let r = policy(
            vec![
                RbacRule {
                    paths: vec!["/healthz".into()],
                    ..rule(RbacAction::Allow)
                },
                RbacRule {
                    path_prefixes: vec!["/api/".into()],
                    methods: vec!["GET".into()],
                    ..rule(RbacAction::Allow)
                },
            ],
            RbacAction::Deny,
        );
        let c = conn(None, "10.0.0.1", 80);
        assert!(allowed(&r, &c, &Method::GET, "/healthz"));
        assert!(allowed(&r, &c, &Method::POST, "/healthz"));
        assert!(
            !allowed(&r, &c, &Method::GET, "/healthz/x"),
            "exact is exact"
        );
        assert!(!allowed(&r, &c, &Method::GET, "/healthzz"));
        assert!(allowed(&r, &c, &Method::GET, "/api/v1"));
        assert!(
            !allowed(&r, &c, &Method::DELETE, "/api/v1"),
            "methods AND paths"
        );
        assert!(!allowed(&r, &c, &Method::GET, "/api"));
    }

    #[test]
    fn rbac_headers_exact_prefix_and_presence_with_names_in_any_case() {
        let r = policy(
            vec![
                RbacRule {
                    name: "team-a".into(),
                    headers: vec![
                        RbacHeader {
                            name: "X-Team".into(),
                            exact: Some("a".into()),
                            prefix: None,
                        },
                        RbacHeader {
                            name: "x-canary".into(),
                            exact: None,
                            prefix: None,
                        },
                    ],
                    ..rule(RbacAction::Allow)
                },
                RbacRule {
                    name: "bearer".into(),
                    headers: vec![RbacHeader {
                        name: "authorization".into(),
                        exact: None,
                        prefix: Some("Bearer ".into()),
                    }],
                    ..rule(RbacAction::Allow)
                },
            ],
            RbacAction::Deny,
        );
        let c = conn(None, "10.0.0.1", 80);
        let ok = |list: &[(&str, &str)]| decide(&r, &c, Some((&Method::GET, "/", &headers(list))));
        assert_eq!(
            ok(&[("x-team", "a"), ("X-CANARY", "")]),
            (true, "team-a".into(), None),
            "names match in any case; presence matches an empty value"
        );
        assert!(
            !ok(&[("x-team", "a")]).0,
            "every header condition must hold"
        );
        assert!(
            !ok(&[("x-team", "A"), ("x-canary", "1")]).0,
            "values are exact"
        );
        assert!(
            ok(&[("x-team", "b"), ("x-team", "a"), ("x-canary", "1")]).0,
            "any line of a repeated header"
        );
        assert_eq!(ok(&[("authorization", "Bearer abc")]).1, "bearer");
        assert!(!ok(&[("authorization", "Basic abc")]).0);
        assert!(!ok(&[]).0);
    }

    #[test]
    fn rbac_headers_decide_the_same_from_a_header_map_and_from_raw_lines() {
        let r = policy(
            vec![
                RbacRule {
                    headers: vec![RbacHeader {
                        name: "X-Team".into(),
                        exact: Some("a".into()),
                        prefix: None,
                    }],
                    ..rule(RbacAction::Deny)
                },
                RbacRule {
                    headers: vec![RbacHeader {
                        name: "authorization".into(),
                        exact: None,
                        prefix: Some("Bearer ".into()),
                    }],
                    ..rule(RbacAction::Allow)
                },
            ],
            RbacAction::Deny,
        );
        let c = conn(None, "10.0.0.1", 80);
        for head in [
            &b"GET / HTTP/1.1\r\nX-TEAM: a\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nx-team: b\r\nx-team:   a  \r\n\r\n",
            b"GET / HTTP/1.1\r\nAuthorization: Bearer x\r\n\r\n",
            b"GET / HTTP/1.1\r\nauthorization: Basic x\r\n\r\n",
            b"GET / HTTP/1.1\r\nx-team: ab\r\nauthorization: Bearer x\r\n\r\n",
            b"GET / HTTP/1.1\r\n\r\n",
        ] {
            let mut lines = [httparse::EMPTY_HEADER; 8];
            let mut req = httparse::Request::new(&mut lines);
            req.parse(head).unwrap();
            // The map as hyper builds it: one entry per line, the value
            // bytes httparse found.
            let mut map = HeaderMap::new();
            for h in req.headers.iter() {
                map.append(
                    HeaderName::from_bytes(h.name.as_bytes()).unwrap(),
                    http::HeaderValue::from_bytes(h.value).unwrap(),
                );
            }
            let ask = |headers| {
                let facts = RequestFacts {
                    method: &Method::GET,
                    path: "/",
                    headers,
                };
                let v = r.check(&c, Some(&facts));
                (v.decision, v.rule().to_string())
            };
            assert_eq!(
                ask(Headers::Raw(req.headers)),
                ask(Headers::Map(&map)),
                "{}",
                String::from_utf8_lossy(head)
            );
        }
    }

    #[test]
    fn rbac_an_audit_rule_is_recorded_and_does_not_decide() {
        let r = policy(
            vec![
                RbacRule {
                    name: "watch-admin".into(),
                    path_prefixes: vec!["/admin".into()],
                    ..rule(RbacAction::Audit)
                },
                RbacRule {
                    name: "second-audit".into(),
                    ..rule(RbacAction::Audit)
                },
                RbacRule {
                    identities: vec![WEB.into()],
                    ..rule(RbacAction::Allow)
                },
            ],
            RbacAction::Deny,
        );
        let none = HeaderMap::new();
        let web = conn(Some(WEB), "10.0.0.1", 80);
        assert_eq!(
            decide(&r, &web, Some((&Method::GET, "/admin/x", &none))),
            (true, "rules[2]".into(), Some("watch-admin".into())),
            "the first audit rule that matches is recorded; the allow rule decides"
        );
        assert_eq!(
            decide(&r, &web, Some((&Method::GET, "/x", &none))),
            (true, "rules[2]".into(), Some("second-audit".into()))
        );
        let other = conn(None, "10.0.0.1", 80);
        let v = r.check(&other, None);
        assert!(
            v.denied(),
            "an audit rule never lets through what the rest denies"
        );
        assert_eq!(v.audit_rule(), Some("second-audit"));
        assert!(!v.would_deny());
        assert_eq!(v.verdict_label(), "deny");
    }

    #[test]
    fn rbac_an_audit_default_lets_through_recorded_as_would_deny() {
        let r = policy(
            vec![RbacRule {
                identities: vec![WEB.into()],
                ..rule(RbacAction::Allow)
            }],
            RbacAction::Audit,
        );
        let v = r.check(&conn(None, "10.0.0.1", 80), None);
        assert_eq!(v.decision, Decision::Allow);
        assert!(v.would_deny());
        assert_eq!((v.rule(), v.audit_rule()), ("default", Some("default")));
        assert_eq!(v.verdict_label(), "audit");
        let v = r.check(&conn(Some(WEB), "10.0.0.1", 80), None);
        assert!(!v.would_deny() && v.audit_rule().is_none());
        assert_eq!(v.verdict_label(), "allow");

        // Counted: one series per rule and verdict, the default's as audit.
        let m = Metrics::new();
        r.check(&conn(None, "10.0.0.1", 80), None).count(&m);
        r.check(&conn(None, "10.0.0.2", 80), None).count(&m);
        r.check(&conn(Some(WEB), "10.0.0.1", 80), None).count(&m);
        let text = m.encode();
        assert!(
            text.contains(
                r#"baton_sidecar_authz_total{policy="p",rule="default",verdict="audit"} 2"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"baton_sidecar_authz_total{policy="p",rule="rules[0]",verdict="allow"} 1"#
            ),
            "{text}"
        );
    }

    #[test]
    fn rbac_for_a_whole_connection_skips_rules_that_need_a_request() {
        let r = policy(
            vec![
                RbacRule {
                    methods: vec!["GET".into()],
                    ..rule(RbacAction::Allow)
                },
                RbacRule {
                    paths: vec!["/x".into()],
                    ..rule(RbacAction::Allow)
                },
                RbacRule {
                    headers: vec![RbacHeader {
                        name: "x".into(),
                        exact: None,
                        prefix: None,
                    }],
                    ..rule(RbacAction::Allow)
                },
                RbacRule {
                    path_prefixes: vec!["/".into()],
                    ..rule(RbacAction::Deny)
                },
                RbacRule {
                    identities: vec![WEB.into()],
                    ..rule(RbacAction::Allow)
                },
            ],
            RbacAction::Deny,
        );
        let web = r.check(&conn(Some(WEB), "10.0.0.1", 80), None);
        assert_eq!(
            (web.decision, web.rule()),
            (Decision::Allow, "rules[4]"),
            "the deny-by-path rule does not match a connection either"
        );
        let other = r.check(&conn(Some("spiffe://td/ns/b/sa/x"), "10.0.0.1", 80), None);
        assert_eq!(
            (other.decision, other.rule()),
            (Decision::Deny, "default"),
            "the GET rule matches every request of any peer, but no connection"
        );
        assert!(r.check(&conn(None, "10.0.0.1", 80), None).denied());
    }

    #[test]
    fn rbac_knows_whether_it_matches_paths() {
        let by_path = policy(
            vec![RbacRule {
                path_prefixes: vec!["/admin".into()],
                ..rule(RbacAction::Deny)
            }],
            RbacAction::Allow,
        );
        let by_peer = policy(
            vec![RbacRule {
                cidrs: vec!["10.0.0.0/8".into()],
                methods: vec!["GET".into()],
                ..rule(RbacAction::Allow)
            }],
            RbacAction::Deny,
        );
        assert!(by_path.matches_paths());
        assert!(!by_peer.matches_paths());
    }

    #[test]
    fn fault_fires_by_percentage_and_abort_wins_over_delay() {
        let f = FaultConfig {
            delay: Some(FaultDelay {
                percent: 50.0,
                ms: 7,
            }),
            abort: Some(FaultAbort {
                percent: 10.0,
                status: 503,
            }),
        };
        assert_eq!(
            fault_decision(&f, 0),
            FilterAction::Respond(StatusCode::SERVICE_UNAVAILABLE, "fault injected\n")
        );
        assert_eq!(
            fault_decision(&f, 999),
            FilterAction::Respond(StatusCode::SERVICE_UNAVAILABLE, "fault injected\n")
        );
        assert_eq!(
            fault_decision(&f, 1000),
            FilterAction::Delay(Duration::from_millis(7))
        );
        assert_eq!(
            fault_decision(&f, 4999),
            FilterAction::Delay(Duration::from_millis(7))
        );
        assert_eq!(fault_decision(&f, 5000), FilterAction::Continue);
        let never = FaultConfig {
            delay: None,
            abort: Some(FaultAbort {
                percent: 0.0,
                status: 500,
            }),
        };
        assert!((0..10_000).all(|d| fault_decision(&never, d) == FilterAction::Continue));
    }

    #[test]
    fn connection_limit_refuses_beyond_max_and_frees_on_drop() {
        let f = NetworkFilter::ConnectionLimit {
            max: 2,
            live: Arc::new(AtomicU32::new(0)),
        };
        let a = f.on_accept().unwrap();
        let _b = f.on_accept().unwrap();
        assert!(f.on_accept().is_none());
        drop(a);
        assert!(f.on_accept().is_some());
    }
}
