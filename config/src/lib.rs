//! `baton-config`: the sidecar's configuration model — one versioned
//! [`Snapshot`] type that carries everything the data plane needs
//! (listeners, routes, clusters with their endpoints, TLS, policies).
//!
//! Why a crate of its own: two programs build on it. The sidecar parses,
//! validates and serves snapshots; the operator compiles Route, TlsPolicy and
//! Service objects into them and pushes them to sidecars. Both must agree on
//! every field and default, so the type lives once, below both, and stays
//! kube-free (the sidecar never links kube; it depends only on the
//! `baton_contract` names).
//!
//! Why one type: a snapshot is the unit of change. It is parsed (from YAML in
//! standalone mode, from the operator's push stream), validated and compiled
//! as a whole (the sidecar's `config::compile`), then swapped in atomically;
//! the handoff sends it verbatim to the next process. Everything here is
//! plain serde data, serializable both ways; the one set of rules it carries
//! is the `tls` section's ([`tls::TlsSettings::validate`]), which needs no
//! TLS library and which the sidecar runs with the rest of its validation,
//! so operator and sidecar refuse the same sections.

pub mod framed;
pub mod push;
pub mod report;
pub mod spiffe;
pub mod tls;
pub mod yaml;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use baton_contract::ports;
use serde::{Deserialize, Serialize};

pub use tls::TlsSettings;

/// One complete, versioned configuration of the sidecar.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// Monotonic version set by the producer (operator or file author);
    /// exported as `baton_sidecar_config_version`.
    #[serde(default)]
    pub version: u64,
    #[serde(default)]
    pub admin: AdminConfig,
    #[serde(default)]
    pub runtime: RuntimeConfig,
    #[serde(default)]
    pub listeners: Vec<ListenerConfig>,
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// Per-connection routes for opaque TCP, by destination. Left out of
    /// the JSON when empty, so a snapshot without one is byte for byte what
    /// a sidecar from before tcp routes parses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tcp_routes: Vec<TcpRouteConfig>,
    #[serde(default)]
    pub clusters: Vec<ClusterConfig>,
    /// Mesh TLS settings ([`tls`]): validated with the rest of the
    /// snapshot, turned into rustls objects by the sidecar's TLS layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSettings>,
    #[serde(default)]
    pub policies: Policies,
}

/// The in-pod default: transparent outbound and inbound listeners on the
/// contract's ports forwarding to the original destination, the admin port
/// open to the kubelet's probes. A sidecar serves it until a config arrives;
/// the operator compiles every workload's snapshot on top of it, so the
/// listeners a Pod's iptables rules redirect to are the same in both.
pub fn pod_default() -> Snapshot {
    let listener = |name: &str, port: u16, direction| ListenerConfig {
        name: name.into(),
        address: SocketAddr::from(([0, 0, 0, 0], port)),
        direction,
        capture: Capture::Transparent,
        protocol: ListenerProtocol::Auto,
        opaque_ports: vec![],
        detect_timeout_ms: default_detect_timeout_ms(),
        tcp_cluster: None,
        port_map: BTreeMap::new(),
        passthrough: true,
        max_connections: None,
        rbac: None,
        access_log: false,
        terminate_tls: TlsTermination::Mesh,
    };
    Snapshot {
        listeners: vec![
            listener(OUTBOUND_LISTENER, ports::OUTBOUND, Direction::Outbound),
            listener(INBOUND_LISTENER, ports::INBOUND, Direction::Inbound),
        ],
        admin: AdminConfig {
            address: SocketAddr::from(([0, 0, 0, 0], ports::ADMIN)),
        },
        ..Default::default()
    }
}

/// Name of [`pod_default`]'s outbound listener (app → mesh).
pub const OUTBOUND_LISTENER: &str = "outbound";
/// Name of [`pod_default`]'s inbound listener (mesh → app).
pub const INBOUND_LISTENER: &str = "inbound";

/// Admin listener (`/metrics`, `/ready`, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    #[serde(default = "default_admin_address")]
    pub address: SocketAddr,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            address: default_admin_address(),
        }
    }
}

fn default_admin_address() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], ports::ADMIN))
}

/// Process-level knobs. `worker_threads` only takes effect at start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Tokio worker threads; a sidecar shares the pod's CPU, so small.
    #[serde(default = "one")]
    pub worker_threads: usize,
    /// Largest request head (request line + headers) accepted; larger → 431.
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: usize,
    /// Most header lines accepted in a request head; more → 431.
    #[serde(default = "default_max_headers")]
    pub max_headers: usize,
    /// Time a client has to send a complete request head.
    #[serde(default = "default_header_read_timeout_ms")]
    pub header_read_timeout_ms: u64,
    /// Request bodies up to this size (with a known length) are buffered so
    /// they can be retried and mirrored; larger ones stream and are neither.
    #[serde(default = "default_max_buffered_body")]
    pub max_buffered_body: usize,
    /// Grace period for in-flight requests when draining.
    #[serde(default = "default_drain_timeout_ms")]
    pub drain_timeout_ms: u64,
    /// HTTP/2 concurrent streams per downstream connection.
    #[serde(default = "default_h2_streams")]
    pub h2_max_concurrent_streams: u32,
    /// Mirrored requests in flight at once (excess copies are dropped).
    #[serde(default = "default_mirror_inflight")]
    pub max_mirror_inflight: usize,
    /// Scheduler ticks (task polls) between two polls of the I/O driver
    /// (tokio's `event_interval`; default 61). Lower: socket events are
    /// seen sooner while many tasks are runnable, at more `epoll_wait`s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_interval: Option<u32>,
    /// Scheduler ticks between two looks at wake-ups from other threads —
    /// offloaded signatures, the lag probe (tokio's `global_queue_interval`;
    /// default 31 with one worker, self-tuning with more). Lower: those
    /// tasks wait less behind a busy local queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_queue_interval: Option<u32>,
    /// Serve plain HTTP/1.1 exchanges without hyper (see `h1fast`): less
    /// than half the user CPU per request; anything else on the connection
    /// goes to hyper. `false`: every HTTP/1 connection goes to hyper.
    #[serde(default = "yes")]
    pub h1_fast_path: bool,
    /// Access-log lines written per second at most, over all listeners
    /// with `access_log: true` (a token bucket with one second of burst);
    /// lines beyond it are dropped and counted. Unset: 1000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_log_lines_per_second: Option<u32>,
    /// W3C Trace Context on HTTP requests (propagate `traceparent`, start
    /// a trace when a request has none; the sidecar is a span). Unset: on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_context: Option<bool>,
    /// Share (0–100) of the traces the sidecar starts that are marked
    /// sampled. Unset: 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_sample_percent: Option<f64>,
    /// Most (route, peer identity) pairs with series of their own in the
    /// per-peer route metrics; observations beyond go to the pair
    /// (`overflow`, `overflow`). Unset: 300.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route_metrics_max_series: Option<usize>,
}

impl RuntimeConfig {
    pub fn access_log_lines_per_second(&self) -> u32 {
        self.access_log_lines_per_second.unwrap_or(1000)
    }
    pub fn trace_context(&self) -> bool {
        self.trace_context.unwrap_or(true)
    }
    pub fn trace_sample_percent(&self) -> f64 {
        self.trace_sample_percent.unwrap_or(100.0)
    }
    pub fn route_metrics_max_series(&self) -> usize {
        self.route_metrics_max_series.unwrap_or(300)
    }
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            worker_threads: 1,
            max_header_bytes: default_max_header_bytes(),
            max_headers: default_max_headers(),
            header_read_timeout_ms: default_header_read_timeout_ms(),
            max_buffered_body: default_max_buffered_body(),
            drain_timeout_ms: default_drain_timeout_ms(),
            h2_max_concurrent_streams: default_h2_streams(),
            max_mirror_inflight: default_mirror_inflight(),
            event_interval: None,
            h1_fast_path: true,
            global_queue_interval: None,
            access_log_lines_per_second: None,
            trace_context: None,
            trace_sample_percent: None,
            route_metrics_max_series: None,
        }
    }
}

fn one() -> usize {
    1
}
fn default_max_header_bytes() -> usize {
    16 * 1024
}
fn default_max_headers() -> usize {
    100
}
fn default_header_read_timeout_ms() -> u64 {
    10_000
}
fn default_max_buffered_body() -> usize {
    64 * 1024
}
fn default_drain_timeout_ms() -> u64 {
    10_000
}
fn default_h2_streams() -> u32 {
    256
}
fn default_mirror_inflight() -> usize {
    64
}

/// Which side of the pod a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// app → mesh
    #[default]
    Outbound,
    /// mesh → app
    Inbound,
}

/// How traffic reaches a listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Capture {
    /// The app connects to the listener on purpose; the target comes from the
    /// Host header, the listener's port map or its default TCP cluster.
    #[default]
    Explicit,
    /// iptables REDIRECTs connections here; the original destination is read
    /// with `SO_ORIGINAL_DST` and used for port maps and passthrough.
    Transparent,
}

/// What a listener expects on its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ListenerProtocol {
    /// Detect per connection: HTTP/1.1, HTTP/2 prior knowledge, TLS (handed
    /// to the TLS layer when configured), else raw TCP.
    #[default]
    Auto,
    Http1,
    Http2,
    /// Opaque: never look at the bytes.
    Tcp,
}

/// A listening socket and how its connections are handled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    pub name: String,
    pub address: SocketAddr,
    #[serde(default)]
    pub direction: Direction,
    #[serde(default)]
    pub capture: Capture,
    #[serde(default)]
    pub protocol: ListenerProtocol,
    /// Destination ports (original destination in transparent mode, the
    /// listener's own port in explicit mode) that skip detection: raw TCP.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub opaque_ports: Vec<u16>,
    /// How long to wait for the client's first bytes before deciding the
    /// protocol is server-speaks-first and proxying raw TCP.
    #[serde(default = "default_detect_timeout_ms")]
    pub detect_timeout_ms: u64,
    /// Cluster for raw TCP connections when no port map entry applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_cluster: Option<String>,
    /// Destination port → cluster, for TCP and for HTTP requests no route
    /// matched (explicit mode: the port in the Host header).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub port_map: BTreeMap<u16, String>,
    /// Forward to the original destination when nothing else matches
    /// (transparent mode only).
    #[serde(default)]
    pub passthrough: bool,
    /// Connection limit (network filter); excess connections are closed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
    /// Name of an RBAC policy in `policies.rbac` enforced on this listener.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rbac: Option<String>,
    /// Emit one `access` log line per request.
    #[serde(default)]
    pub access_log: bool,
    /// Which TLS an inbound listener terminates while the `tls` section's
    /// mode is Strict or Permissive.
    #[serde(default, skip_serializing_if = "is_mesh_only")]
    pub terminate_tls: TlsTermination,
}

/// Which ClientHellos an inbound listener terminates under mesh TLS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsTermination {
    /// Only mesh TLS (the marker SNI a sidecar sends): the application's
    /// own TLS passes through (Permissive) or is refused (Strict).
    #[default]
    Mesh,
    /// Every TLS client: the listener is the TLS edge for clients outside
    /// the mesh (with `require_client_cert: false`), as the TLS benchmark
    /// runs it against nginx. The application's own TLS cannot reach it.
    All,
}

fn is_mesh_only(t: &TlsTermination) -> bool {
    *t == TlsTermination::Mesh
}

fn default_detect_timeout_ms() -> u64 {
    500
}

/// An HTTP route: a match, backends and per-route behaviour.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub name: String,
    /// Listener names this route applies to; empty = every listener.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub listeners: Vec<String>,
    #[serde(rename = "match", default)]
    pub matches: MatchConfig,
    pub backends: Vec<WeightedBackend>,
    /// Deadline for the response head, across retries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<FaultConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<MirrorConfig>,
    #[serde(default, skip_serializing_if = "HeaderRewrite::is_empty")]
    pub request_headers: HeaderRewrite,
    #[serde(default, skip_serializing_if = "HeaderRewrite::is_empty")]
    pub response_headers: HeaderRewrite,
}

/// A TCP route: every new connection to one of `destinations` picks one
/// backend cluster by weight, and its bytes are proxied opaquely (a
/// connection to a destination a tcp route claims is never parsed as HTTP).
/// The choice is made once per connection: a config change steers new
/// connections only; open ones keep their backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TcpRouteConfig {
    pub name: String,
    /// Listener names this route applies to; empty = every listener.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub listeners: Vec<String>,
    /// Destinations (IP and port) whose connections this route takes: the
    /// original destination under transparent capture (a Service's
    /// ClusterIP and port), the address the client dialled (the listener's
    /// own) under explicit capture. One destination belongs to at most one
    /// tcp route per listener.
    pub destinations: Vec<SocketAddr>,
    pub backends: Vec<WeightedBackend>,
    /// Connect timeout to the chosen backend's endpoint; absent: the
    /// cluster's `connect_timeout_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_timeout_ms: Option<u64>,
}

/// All conditions must hold (AND); an empty match matches everything.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct MatchConfig {
    /// Host names (port ignored, case-insensitive); `*.example.com` matches
    /// any subdomain. Empty = any host.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    /// Destination ports (any of): the port in the Host header, else the
    /// connection's original destination port (transparent) or the
    /// listener's own port. Empty = any port. The operator sets it so two
    /// ports of one Service (same host names) route apart.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathMatch>,
    /// Methods (any of); empty = any method.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<ValueMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub query: Vec<ValueMatch>,
}

/// Exactly one of `exact`, `prefix` (segment-aware: `/api` matches `/api`
/// and `/api/x`, not `/apix`) or `regex` (anchored over the whole path).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct PathMatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
}

/// Header or query-parameter condition: `exact` or `regex` (anchored), or
/// neither for "present"; `invert` negates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ValueMatch {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub invert: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightedBackend {
    pub cluster: String,
    #[serde(default = "one_u32")]
    pub weight: u32,
}

fn one_u32() -> u32 {
    1
}

/// Retries happen only where they are safe: connect failures (the request
/// never left, any method), and — for idempotent methods only — a reset
/// before the response head or one of the listed statuses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// Extra attempts after the first.
    pub attempts: u32,
    #[serde(default = "yes")]
    pub on_connect_failure: bool,
    #[serde(default = "yes")]
    pub on_reset: bool,
    /// 5xx statuses that are retried (idempotent methods only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on_statuses: Vec<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_try_timeout_ms: Option<u64>,
    /// Retries may add at most this fraction of the route's request rate ...
    #[serde(default = "default_budget_ratio")]
    pub budget_ratio: f64,
    /// ... plus this many retries per second (so low-rate routes can retry).
    #[serde(default = "default_budget_min")]
    pub budget_min_per_sec: u32,
}

impl RetryConfig {
    /// `attempts` retries with every other field at its default (the same
    /// defaults a YAML file that leaves them out gets).
    pub fn new(attempts: u32) -> Self {
        Self {
            attempts,
            on_connect_failure: true,
            on_reset: true,
            on_statuses: Vec::new(),
            per_try_timeout_ms: None,
            budget_ratio: default_budget_ratio(),
            budget_min_per_sec: default_budget_min(),
        }
    }
}

fn yes() -> bool {
    true
}
fn default_budget_ratio() -> f64 {
    0.2
}
fn default_budget_min() -> u32 {
    10
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FaultConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay: Option<FaultDelay>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort: Option<FaultAbort>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultDelay {
    pub percent: f64,
    pub ms: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultAbort {
    pub percent: f64,
    pub status: u16,
}

/// Fire-and-forget copy of matching requests to a shadow cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MirrorConfig {
    pub cluster: String,
    #[serde(default = "hundred")]
    pub percent: f64,
}

fn hundred() -> f64 {
    100.0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct HeaderRewrite {
    /// Replace (or add) these headers.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub set: BTreeMap<String, String>,
    /// Append these values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub add: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove: Vec<String>,
}

impl HeaderRewrite {
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.add.is_empty() && self.remove.is_empty()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LbPolicy {
    #[default]
    RoundRobin,
    /// Power of two choices on in-flight requests.
    LeastRequest,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamProtocol {
    #[default]
    Http1,
    /// HTTP/2 prior knowledge, one multiplexed connection per endpoint.
    Http2,
}

/// A set of endpoints traffic can be sent to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    pub name: String,
    pub endpoints: Vec<SocketAddr>,
    #[serde(default)]
    pub lb: LbPolicy,
    #[serde(default)]
    pub protocol: UpstreamProtocol,
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    #[serde(default = "default_pool_idle_ms")]
    pub pool_idle_timeout_ms: u64,
    #[serde(default = "default_pool_max_idle")]
    pub pool_max_idle_per_endpoint: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outlier: Option<OutlierConfig>,
    /// Originate mesh mTLS to the endpoints (peer sidecars' inbound ports)
    /// with this sidecar's identity; needs the snapshot's `tls` section.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtls: Option<ClusterMtls>,
}

impl ClusterConfig {
    /// A cluster of `endpoints` with every other field at its default.
    pub fn new(name: impl Into<String>, endpoints: Vec<SocketAddr>) -> Self {
        Self {
            name: name.into(),
            endpoints,
            lb: LbPolicy::default(),
            protocol: UpstreamProtocol::default(),
            connect_timeout_ms: default_connect_timeout_ms(),
            pool_idle_timeout_ms: default_pool_idle_ms(),
            pool_max_idle_per_endpoint: default_pool_max_idle(),
            outlier: None,
            mtls: None,
        }
    }
}

/// Outbound mesh mTLS for a cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ClusterMtls {
    /// SPIFFE ID every endpoint must present. Default: the cluster's entry
    /// in `tls.identity.expected_peers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
}

fn default_connect_timeout_ms() -> u64 {
    1_000
}
fn default_pool_idle_ms() -> u64 {
    60_000
}
fn default_pool_max_idle() -> usize {
    64
}

/// Eject an endpoint after consecutive failures; each further ejection
/// doubles the time out (capped).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutlierConfig {
    #[serde(default = "default_consecutive")]
    pub consecutive_failures: u32,
    #[serde(default = "default_base_ejection_ms")]
    pub base_ejection_ms: u64,
    #[serde(default = "default_max_ejection_ms")]
    pub max_ejection_ms: u64,
    /// Never eject more than this share of a cluster's endpoints.
    #[serde(default = "default_max_ejected_percent")]
    pub max_ejected_percent: u32,
}

fn default_consecutive() -> u32 {
    5
}
fn default_base_ejection_ms() -> u64 {
    1_000
}
fn default_max_ejection_ms() -> u64 {
    30_000
}
fn default_max_ejected_percent() -> u32 {
    50
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Policies {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rbac: Vec<RbacPolicy>,
}

/// An authorization policy as the sidecar enforces it: ordered rules.
///
/// Evaluation (the sidecar's `filters::Rbac`): rules are tried in order;
/// an `audit` rule that matches is recorded (counted, logged) and does not
/// decide; the first `allow` or `deny` rule that matches decides; when none
/// does, `default_action` decides (`audit` there means: let it through and
/// record it as a request the policy would have denied). The operator
/// compiles AuthorizationPolicies into this order — deny rules, then audit
/// rules, then allow rules, then each port's implicit deny — so the
/// precedence users read in docs/crds.md is plain first-match here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RbacPolicy {
    pub name: String,
    pub rules: Vec<RbacRule>,
    #[serde(default = "deny")]
    pub default_action: RbacAction,
}

fn deny() -> RbacAction {
    RbacAction::Deny
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RbacAction {
    #[default]
    Allow,
    Deny,
    /// As a rule: record a match, keep evaluating. As the default: let the
    /// request or connection through, recorded as one the policy would deny.
    Audit,
}

/// Every non-empty list must match (AND); within a list, any entry (OR).
/// A rule with `methods`, `paths`, `path_prefixes` or `headers` needs a
/// request: on a connection whose bytes are not HTTP (TCP, opaque ports)
/// it never matches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RbacRule {
    /// Label of the rule in counters and logs (the operator writes
    /// `<namespace>/<policy>/rules[i]`); empty → `rules[<index>]`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(default)]
    pub action: RbacAction,
    /// Peer identities (SPIFFE URIs) from mTLS: an exact URI, `*` (any
    /// authenticated peer), or a prefix ending in `*`
    /// (`spiffe://cluster.local/ns/shop/*`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub identities: Vec<String>,
    /// `true`: only peers with a mesh identity; `false`: only peers without
    /// one (plaintext, or TLS without a mesh client certificate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authenticated: Option<bool>,
    /// Source CIDRs, e.g. `10.0.0.0/8`, `::1/128`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cidrs: Vec<String>,
    /// Destination ports (the original destination on a transparent
    /// listener, the listener's own port otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    /// Exact request paths (without the query).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub path_prefixes: Vec<String>,
    /// Request headers; every entry must match (AND).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<RbacHeader>,
}

/// One header condition: `exact` or `prefix` on the value (names are
/// case-insensitive), or neither: the header is present.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RbacHeader {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}
