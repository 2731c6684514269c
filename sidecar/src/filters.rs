//! The filter chains, in the MOSN/Envoy sense.
//!
//! * Network filters run once per accepted connection, in order, before any
//!   protocol handling: [`NetworkFilter::ConnectionLimit`], then the terminal
//!   protocol handler (TCP proxy or HTTP server).
//! * Stream filters run once per HTTP request, in order, after routing:
//!   access log (observes), RBAC (may deny), fault (may delay / abort),
//!   mirror (copies), then the router (terminal).
//!
//! The chains are enums rather than trait objects: the set is closed and
//! known at compile time, dispatch is a jump table, and adding a filter is
//! one variant plus one match arm in [`StreamFilter::on_request`] — the core
//! proxy loop never changes. Its configuration lands on a route or a
//! listener, whose classification for the HTTP/1.1 fast path
//! ([`crate::routing::GeneralPath`]) names every field: the crate does not
//! compile until the new filter says whether the fast path may skip it.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

// The config model's types, from the crate that holds them (not through
// `crate::config`, which compiles snapshots into these filters).
use baton_config::{FaultConfig, RbacAction, RbacPolicy};
use http::{Method, StatusCode};

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

#[derive(Debug)]
struct RbacRuleC {
    action: RbacAction,
    identities: Vec<String>,
    cidrs: Vec<Cidr>,
    methods: Vec<Method>,
    path_prefixes: Vec<String>,
}

/// A compiled RBAC policy: ordered rules, first match decides.
#[derive(Debug)]
pub struct Rbac {
    pub name: String,
    rules: Vec<RbacRuleC>,
    default_action: RbacAction,
}

impl Rbac {
    pub fn compile(p: &RbacPolicy) -> Result<Rbac, String> {
        let mut rules = Vec::with_capacity(p.rules.len());
        for (i, r) in p.rules.iter().enumerate() {
            // Never fail open on a condition this build cannot evaluate.
            if r.authenticated.is_some()
                || !r.ports.is_empty()
                || !r.paths.is_empty()
                || !r.headers.is_empty()
                || r.action == RbacAction::Audit
            {
                return Err(format!(
                    "rules[{i}]: authenticated, ports, paths, headers and audit are not supported"
                ));
            }
            let cidrs = r
                .cidrs
                .iter()
                .map(|c| Cidr::parse(c))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("rules[{i}]: {e}"))?;
            let methods = r
                .methods
                .iter()
                .map(|m| {
                    Method::from_bytes(m.as_bytes())
                        .map_err(|_| format!("rules[{i}]: invalid method {m:?}"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            rules.push(RbacRuleC {
                action: r.action,
                identities: r.identities.clone(),
                cidrs,
                methods,
                path_prefixes: r.path_prefixes.clone(),
            });
        }
        Ok(Rbac {
            name: p.name.clone(),
            rules,
            default_action: p.default_action,
        })
    }

    /// Pure decision for a whole connection whose bytes are not HTTP (TCP
    /// inside mesh TLS): rules with methods or path prefixes cannot be
    /// decided without a request and never match; the rest as
    /// [`Rbac::evaluate`].
    pub fn evaluate_connection(&self, identity: Option<&str>, ip: IpAddr) -> RbacAction {
        for r in &self.rules {
            if !r.methods.is_empty() || !r.path_prefixes.is_empty() {
                continue;
            }
            let id_ok = r.identities.is_empty()
                || identity
                    .is_some_and(|id| r.identities.iter().any(|want| want == "*" || want == id));
            let ip_ok = r.cidrs.is_empty() || r.cidrs.iter().any(|c| c.contains(ip));
            if id_ok && ip_ok {
                return r.action;
            }
        }
        self.default_action
    }

    /// Pure decision for one request.
    pub fn evaluate(
        &self,
        identity: Option<&str>,
        ip: IpAddr,
        method: &Method,
        path: &str,
    ) -> RbacAction {
        for r in &self.rules {
            let id_ok = r.identities.is_empty()
                || identity
                    .is_some_and(|id| r.identities.iter().any(|want| want == "*" || want == id));
            let ip_ok = r.cidrs.is_empty() || r.cidrs.iter().any(|c| c.contains(ip));
            let m_ok = r.methods.is_empty() || r.methods.iter().any(|m| m == method);
            let p_ok = r.path_prefixes.is_empty()
                || r.path_prefixes.iter().any(|p| path.starts_with(p.as_str()));
            if id_ok && ip_ok && m_ok && p_ok {
                return r.action;
            }
        }
        self.default_action
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

/// The request-scoped inputs stream filters read.
#[derive(Debug)]
pub struct RequestInfo<'a> {
    pub conn: &'a ConnMeta,
    pub method: &'a Method,
    pub path: &'a str,
}

/// Stream filters (per request), run in chain order.
#[derive(Debug)]
pub enum StreamFilter {
    Rbac(Arc<Rbac>),
    Fault(FaultConfig),
}

impl StreamFilter {
    /// `draw` is a uniform random number in `0..10_000` (basis points), so
    /// percentages are decided without a lock or allocation.
    pub fn on_request(&self, req: &RequestInfo<'_>, draw: u32) -> FilterAction {
        match self {
            StreamFilter::Rbac(rbac) => {
                match rbac.evaluate(
                    req.conn.peer_identity.as_deref(),
                    req.conn.peer.ip(),
                    req.method,
                    req.path,
                ) {
                    // Audit semantics land with the authorization filter
                    // (issue #36); until then an audit default lets through.
                    RbacAction::Allow | RbacAction::Audit => FilterAction::Continue,
                    RbacAction::Deny => {
                        FilterAction::Respond(StatusCode::FORBIDDEN, "denied by rbac policy\n")
                    }
                }
            }
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
    use crate::config::{FaultAbort, FaultDelay, RbacRule};

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

    #[test]
    fn rbac_first_matching_rule_decides_and_default_applies_otherwise() {
        let p = RbacPolicy {
            name: "p".into(),
            rules: vec![
                RbacRule {
                    path_prefixes: vec!["/admin".into()],
                    ..rule(RbacAction::Deny)
                },
                RbacRule {
                    identities: vec!["spiffe://td/ns/a/sa/web".into()],
                    ..rule(RbacAction::Allow)
                },
                RbacRule {
                    cidrs: vec!["127.0.0.0/8".into()],
                    methods: vec!["GET".into()],
                    ..rule(RbacAction::Allow)
                },
            ],
            default_action: RbacAction::Deny,
        };
        let r = Rbac::compile(&p).unwrap();
        let web = Some("spiffe://td/ns/a/sa/web");
        assert_eq!(
            r.evaluate(web, ip("10.0.0.1"), &Method::POST, "/x"),
            RbacAction::Allow
        );
        assert_eq!(
            r.evaluate(web, ip("10.0.0.1"), &Method::GET, "/admin/x"),
            RbacAction::Deny
        );
        assert_eq!(
            r.evaluate(None, ip("127.0.0.1"), &Method::GET, "/x"),
            RbacAction::Allow
        );
        assert_eq!(
            r.evaluate(None, ip("127.0.0.1"), &Method::POST, "/x"),
            RbacAction::Deny
        );
        assert_eq!(
            r.evaluate(
                Some("spiffe://td/ns/b/sa/x"),
                ip("10.0.0.1"),
                &Method::GET,
                "/x"
            ),
            RbacAction::Deny
        );
    }

    #[test]
    fn rbac_for_a_whole_connection_skips_rules_that_need_a_request() {
        let p = RbacPolicy {
            name: "p".into(),
            rules: vec![
                RbacRule {
                    methods: vec!["GET".into()],
                    ..rule(RbacAction::Allow)
                },
                RbacRule {
                    identities: vec!["spiffe://td/ns/a/sa/web".into()],
                    ..rule(RbacAction::Allow)
                },
            ],
            default_action: RbacAction::Deny,
        };
        let r = Rbac::compile(&p).unwrap();
        assert_eq!(
            r.evaluate_connection(Some("spiffe://td/ns/a/sa/web"), ip("10.0.0.1")),
            RbacAction::Allow
        );
        assert_eq!(
            r.evaluate_connection(Some("spiffe://td/ns/b/sa/x"), ip("10.0.0.1")),
            RbacAction::Deny,
            "the GET rule matches every request of any peer, but no connection"
        );
        assert_eq!(
            r.evaluate_connection(None, ip("10.0.0.1")),
            RbacAction::Deny
        );
    }

    #[test]
    fn rbac_wildcard_identity_requires_an_authenticated_peer() {
        let p = RbacPolicy {
            name: "p".into(),
            rules: vec![RbacRule {
                identities: vec!["*".into()],
                ..rule(RbacAction::Allow)
            }],
            default_action: RbacAction::Deny,
        };
        let r = Rbac::compile(&p).unwrap();
        assert_eq!(
            r.evaluate(Some("spiffe://x"), ip("1.1.1.1"), &Method::GET, "/"),
            RbacAction::Allow
        );
        assert_eq!(
            r.evaluate(None, ip("1.1.1.1"), &Method::GET, "/"),
            RbacAction::Deny
        );
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
