//! One Prometheus registry per process (prefix `baton_sidecar`), with the
//! data plane's metric families as typed fields so the hot path updates them
//! without name lookups. Other layers (TLS, handoff) register their own
//! families through [`Metrics::register`].
//!
//! Counters carried over by a handoff live in a store of their own
//! ([`Metrics::carry`]) and are added to the exposition by series name, so a
//! family continues whichever module registers it and whenever (the TLS
//! layer registers its families only once it is attached, after the import).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};

pub mod carried;

/// HTTP status class label (`2xx` ...), so cardinality stays bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatusClass {
    C1xx,
    C2xx,
    C3xx,
    C4xx,
    C5xx,
}

impl EncodeLabelValue for StatusClass {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        let s = match self {
            StatusClass::C1xx => "1xx",
            StatusClass::C2xx => "2xx",
            StatusClass::C3xx => "3xx",
            StatusClass::C4xx => "4xx",
            StatusClass::C5xx => "5xx",
        };
        EncodeLabelValue::encode(&s, encoder)
    }
}

impl StatusClass {
    pub fn of(status: u16) -> Self {
        match status {
            100..=199 => StatusClass::C1xx,
            200..=299 => StatusClass::C2xx,
            300..=399 => StatusClass::C3xx,
            400..=499 => StatusClass::C4xx,
            _ => StatusClass::C5xx,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RequestLabels {
    pub route: Arc<str>,
    pub status_class: StatusClass,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: Arc<str>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ConnLabels {
    pub listener: Arc<str>,
    pub protocol: &'static str,
}

/// `baton_sidecar_authz_total`: what authorization policies decided. The
/// values of `policy` and `rule` come only from the config (policy names,
/// rule names or `rules[i]`, and `default`), `verdict` is one of `allow`,
/// `deny`, `audit`: the series are bounded by the config's rules, never by
/// the traffic (no peer, path or identity is a label).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct AuthzLabels {
    pub policy: Arc<str>,
    pub rule: Arc<str>,
    pub verdict: &'static str,
}

type Labels = Vec<(&'static str, &'static str)>;

/// Per-route metric handles, resolved once per compiled route so the hot
/// path does no label hashing or lock (counters are shared with the family,
/// so values continue across reloads).
#[derive(Debug, Clone)]
pub struct RouteMetrics {
    by_class: [Counter; 5],
    duration: Histogram,
}

impl RouteMetrics {
    pub fn resolve(m: &Metrics, route: &Arc<str>) -> Self {
        let class = |c| {
            m.requests
                .get_or_create(&RequestLabels {
                    route: route.clone(),
                    status_class: c,
                })
                .clone()
        };
        Self {
            by_class: [
                class(StatusClass::C1xx),
                class(StatusClass::C2xx),
                class(StatusClass::C3xx),
                class(StatusClass::C4xx),
                class(StatusClass::C5xx),
            ],
            duration: m
                .request_duration
                .get_or_create(&RouteLabels {
                    route: route.clone(),
                })
                .clone(),
        }
    }

    pub fn record(&self, status: u16, seconds: f64) {
        self.by_class[StatusClass::of(status) as usize].inc();
        self.duration.observe(seconds);
    }
}

fn latency_histogram() -> Histogram {
    // 100 µs .. ~13 s
    Histogram::new(exponential_buckets(0.0001, 2.0, 18))
}

/// What [`Metrics::register`] hands a layer: the process registry, plus a
/// note of every counter family's full name and help. The exposition omits a
/// family with no series yet; the note lets a series carried over by a
/// handoff show under its family from the moment the family is registered,
/// whoever registers it and whenever.
#[derive(Debug)]
pub struct Registrar<'a> {
    registry: &'a mut Registry,
    prefix: String,
    counters: &'a mut BTreeMap<String, String>,
}

impl Registrar<'_> {
    /// [`Registry::register`], remembering counter families.
    pub fn register(&mut self, name: &str, help: &str, metric: impl Metric) {
        if metric.metric_type() == MetricType::Counter {
            self.counters
                .insert(format!("{}_{name}", self.prefix), help.to_string());
        }
        self.registry.register(name, help, metric);
    }

    /// [`Registry::sub_registry_with_prefix`]: names get `<prefix>_`.
    pub fn sub_registry_with_prefix(&mut self, prefix: &str) -> Registrar<'_> {
        Registrar {
            registry: self.registry.sub_registry_with_prefix(prefix),
            prefix: format!("{}_{prefix}", self.prefix),
            counters: self.counters,
        }
    }
}

/// The handoff's families register like any layer's.
impl baton_handoff::metrics::MetricRegistry for Registrar<'_> {
    fn register(&mut self, name: &str, help: &str, metric: impl Metric) {
        Registrar::register(self, name, help, metric);
    }
}

/// The data plane's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Mutex<Registry>,
    /// Counter series carried over from the previous process (see
    /// [`Metrics::carry`]): added to this process's values at exposition.
    carried: Mutex<BTreeMap<String, u64>>,
    /// Every registered counter family: full name → help.
    counter_families: Mutex<BTreeMap<String, String>>,
    pub requests: Family<RequestLabels, Counter>,
    pub request_duration: Family<RouteLabels, Histogram, fn() -> Histogram>,
    pub connections_active: Family<ConnLabels, Gauge>,
    pub connections: Family<ConnLabels, Counter>,
    /// `direction` = `downstream_rx` / `downstream_tx` (bytes from / to clients).
    pub bytes: Family<Labels, Counter>,
    /// `class` = connect / timeout / reset / no_endpoints / protocol.
    pub upstream_errors: Family<Labels, Counter>,
    pub retries: Family<Labels, Counter>,
    pub outlier_ejections: Counter,
    pub mirror: Family<Labels, Counter>,
    pub config_version: Gauge,
    pub config_applies: Counter,
    pub config_apply_errors: Family<Labels, Counter>,
    /// 1 while the config stream to the operator is open.
    pub control_connected: Gauge,
    /// Config stream (re)connection attempts that failed or ended.
    pub control_reconnects: Counter,
    pub phase: Family<Labels, Gauge>,
    pub local_responses: Family<Labels, Counter>,
    /// HTTP/1 request heads refused by `h1valid::validate`, by reason.
    pub request_refusals: Family<Labels, Counter>,
    /// Requests served on the HTTP/1 fast path.
    pub h1_fast_path_requests: Counter,
    /// HTTP/1 connections the fast path handed to hyper, by reason.
    pub h1_fast_path_fallbacks: Family<Labels, Counter>,
    /// Fed by [`crate::loop_lag`].
    pub event_loop_lag: Histogram,
    /// Admin requests refused because the caller is not on the Pod's
    /// loopback, by endpoint (see [`crate::admin`]).
    pub admin_refused: Family<Labels, Counter>,
    /// Authorization verdicts by policy, rule and verdict (see
    /// [`AuthzLabels`]; handles resolved per compiled policy:
    /// `crate::filters::Verdict::count`).
    pub authz: Family<AuthzLabels, Counter>,
    /// HTTP/2 connections asked to park at a handoff, by outcome: `moved`
    /// (no GOAWAY) or `drained` (GOAWAY; decision 0062 says when), counted
    /// by the old process; and, by the new one, `failed_after_move`: a
    /// moved connection whose client's HPACK encoder had ignored the table
    /// reset, refused at its next request (GOAWAY, request unprocessed).
    pub h2_handoff: Family<Labels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("baton_sidecar");
        let mut counters = BTreeMap::new();
        let mut r = Registrar {
            registry: &mut registry,
            prefix: "baton_sidecar".to_string(),
            counters: &mut counters,
        };
        let m = Self {
            registry: Mutex::new(Registry::default()),
            carried: Mutex::new(BTreeMap::new()),
            counter_families: Mutex::new(BTreeMap::new()),
            requests: Family::default(),
            request_duration: Family::new_with_constructor(latency_histogram),
            connections_active: Family::default(),
            connections: Family::default(),
            bytes: Family::default(),
            upstream_errors: Family::default(),
            retries: Family::default(),
            outlier_ejections: Counter::default(),
            mirror: Family::default(),
            config_version: Gauge::default(),
            config_applies: Counter::default(),
            control_connected: Gauge::default(),
            control_reconnects: Counter::default(),
            config_apply_errors: Family::default(),
            phase: Family::default(),
            local_responses: Family::default(),
            request_refusals: Family::default(),
            h1_fast_path_requests: Counter::default(),
            h1_fast_path_fallbacks: Family::default(),
            event_loop_lag: crate::loop_lag::histogram(),
            admin_refused: Family::default(),
            authz: Family::default(),
            h2_handoff: Family::default(),
        };
        r.register(
            "requests",
            "HTTP requests by route and status class",
            m.requests.clone(),
        );
        r.register(
            "request_duration_seconds",
            "Time to response head by route",
            m.request_duration.clone(),
        );
        r.register(
            "connections_active",
            "Open downstream connections",
            m.connections_active.clone(),
        );
        r.register(
            "connections",
            "Accepted downstream connections",
            m.connections.clone(),
        );
        r.register("bytes", "Bytes proxied, by direction", m.bytes.clone());
        r.register(
            "upstream_errors",
            "Upstream failures by class",
            m.upstream_errors.clone(),
        );
        r.register(
            "retries",
            "Retries by outcome (sent, budget_exhausted)",
            m.retries.clone(),
        );
        r.register(
            "outlier_ejections",
            "Endpoints ejected after consecutive failures",
            m.outlier_ejections.clone(),
        );
        r.register(
            "mirror_requests",
            "Mirrored requests by outcome (sent, dropped)",
            m.mirror.clone(),
        );
        r.register(
            "config_version",
            "Version of the serving config snapshot",
            m.config_version.clone(),
        );
        r.register(
            "config_applies",
            "Config snapshots applied",
            m.config_applies.clone(),
        );
        r.register(
            "control_stream_connected",
            "1 while the config stream to the operator is open",
            m.control_connected.clone(),
        );
        r.register(
            "control_stream_reconnects",
            "Config stream connections to the operator that failed or ended",
            m.control_reconnects.clone(),
        );
        r.register(
            "config_apply_errors",
            "Config snapshots refused, by reason",
            m.config_apply_errors.clone(),
        );
        r.register(
            "lifecycle_phase",
            "1 for the current lifecycle phase",
            m.phase.clone(),
        );
        r.register(
            "handoff_h2_connections",
            "HTTP/2 connections asked to park at a handoff, by outcome: moved (kept open, no GOAWAY) or drained (GOAWAY); failed_after_move: moved, then refused at its next request because the client's HPACK encoder ignored the table reset",
            m.h2_handoff.clone(),
        );
        r.register(
            "local_responses",
            "Responses generated by the sidecar, by reason",
            m.local_responses.clone(),
        );
        r.register(
            "http1_request_refusals",
            "HTTP/1 requests refused by the request-head validation (400/501/505, connection closed, nothing forwarded), by reason",
            m.request_refusals.clone(),
        );
        r.register(
            "h1_fast_path_requests",
            "HTTP/1 requests served on the fast path (without hyper)",
            m.h1_fast_path_requests.clone(),
        );
        r.register(
            "h1_fast_path_fallbacks",
            "HTTP/1 connections the fast path handed to the general (hyper) path, by the reason of the first request it did not take",
            m.h1_fast_path_fallbacks.clone(),
        );
        r.register(
            "event_loop_lag_seconds",
            "Time a task woken from outside the data-plane runtime waits until the runtime polls it (sampled every ~10 ms)",
            m.event_loop_lag.clone(),
        );
        r.register(
            "admin_refused",
            "Admin requests refused because the caller is not on the Pod's loopback, by endpoint",
            m.admin_refused.clone(),
        );
        r.register(
            "authz",
            "Authorization verdicts by policy, rule (or default) and verdict (allow, deny, audit: let through by an audit rule or default)",
            m.authz.clone(),
        );
        *m.registry.lock().unwrap_or_else(|e| e.into_inner()) = registry;
        *m.counter_families.lock().unwrap_or_else(|e| e.into_inner()) = counters;
        m
    }

    /// Let another layer add its families to the same registry (same prefix).
    pub fn register(&self, f: impl FnOnce(&mut Registrar<'_>)) {
        let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        let mut counters = self
            .counter_families
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        f(&mut Registrar {
            registry: &mut registry,
            prefix: "baton_sidecar".to_string(),
            counters: &mut counters,
        });
    }

    /// Text exposition for `/metrics`, with the carried-over counters
    /// added to their series.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(8192);
        {
            let reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
            let _ = prometheus_client::encoding::text::encode(&mut out, &reg);
        }
        let carried = self.carried.lock().unwrap_or_else(|e| e.into_inner());
        if carried.is_empty() {
            out
        } else {
            let families = self
                .counter_families
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            carried::add_carried(&out, &carried, &families)
        }
    }

    /// Adds counter series (`name_total{labels}` → value) carried over from
    /// the previous process. They are added to this process's own values
    /// whenever the exposition is made, so a family registered after the
    /// import (or never touched here yet) continues where the old process
    /// left off. A series whose family is never registered is not shown.
    pub fn carry(&self, counters: &BTreeMap<String, u64>) {
        let mut carried = self.carried.lock().unwrap_or_else(|e| e.into_inner());
        // A zero adds nothing (and would only make the series look placed).
        for (series, v) in counters.iter().filter(|(_, v)| **v > 0) {
            *carried.entry(series.clone()).or_default() += v;
        }
    }

    /// Carried series whose family this process has not registered (yet).
    pub fn carried_unplaced(&self) -> Vec<String> {
        let carried = self.carried.lock().unwrap_or_else(|e| e.into_inner());
        let families = self
            .counter_families
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        carried::unplaced(&carried, &families)
    }

    pub fn admin_refused(&self, endpoint: &'static str) {
        self.admin_refused
            .get_or_create(&vec![("endpoint", endpoint)])
            .inc();
    }

    pub fn upstream_error(&self, class: &'static str) {
        self.upstream_errors
            .get_or_create(&vec![("class", class)])
            .inc();
    }

    /// `reason` is the fast path's `Fallback::label` (a label value, so
    /// the metrics do not depend on the fast path's types).
    pub fn h1_fast_path_fallback(&self, reason: &'static str) {
        self.h1_fast_path_fallbacks
            .get_or_create(&vec![("reason", reason)])
            .inc();
    }

    pub fn request_refusal(&self, reason: &'static str) {
        self.request_refusals
            .get_or_create(&vec![("reason", reason)])
            .inc();
    }

    pub fn h2_handoff(&self, outcome: &'static str) {
        self.h2_handoff
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    pub fn local_response(&self, reason: &'static str) {
        self.local_responses
            .get_or_create(&vec![("reason", reason)])
            .inc();
    }
}
