//! The handoff's metric families, registered in the data plane's registry
//! through [`MetricRegistry`].

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry};

type StaticLabels = Vec<(&'static str, &'static str)>;

/// The handoff's metric families, in the data plane's registry (the
/// sidecar's: `baton_sidecar_` prefix).
#[derive(Debug, Clone)]
pub struct HandoffMetrics {
    /// 1 once this process completed adopting from a previous one.
    pub complete: Gauge,
    /// `role` = old/new, `result` = complete/refused/refused_peer/failed
    /// (`refused_peer`: the connecting process runs under another UID).
    pub handoffs: Family<StaticLabels, Counter>,
    /// `outcome` = moved (acknowledged by the new process), kept (resumed
    /// here: not movable or the handoff failed), drained (HTTP/2: GOAWAY).
    pub connections: Family<StaticLabels, Counter>,
    pub last_duration_ms: Gauge,
    /// New process: how long each adopted connection went unread, from the
    /// moment the old process's task stopped reading it to the moment this
    /// process's event loop took it over. A request that arrived meanwhile
    /// waited that long.
    pub pause: Histogram,
}

/// Pause buckets, seconds: 1-2-5 steps from 100 µs to 10 s (the default step
/// timeout), so even a stalled handoff's connections land in a bucket.
const PAUSE_BUCKETS: [f64; 16] = [
    0.000_1, 0.000_2, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
    10.0,
];

/// Where [`HandoffMetrics::register`] adds its families: the process
/// registry (the data plane's may note counter families on the way, as the
/// sidecar's does for carried counters).
pub trait MetricRegistry {
    fn register(&mut self, name: &str, help: &str, metric: impl Metric);
}

impl MetricRegistry for Registry {
    fn register(&mut self, name: &str, help: &str, metric: impl Metric) {
        Registry::register(self, name, help, metric);
    }
}

impl Default for HandoffMetrics {
    fn default() -> Self {
        Self {
            complete: Gauge::default(),
            handoffs: Family::default(),
            connections: Family::default(),
            last_duration_ms: Gauge::default(),
            pause: Histogram::new(PAUSE_BUCKETS),
        }
    }
}

impl HandoffMetrics {
    /// Adds the families to `r` (unprefixed names; the registry's prefix
    /// applies).
    pub fn register(&self, r: &mut impl MetricRegistry) {
        r.register(
            "handoff_complete",
            "1 once this process completed a handoff as the new process",
            self.complete.clone(),
        );
        r.register(
            "handoffs",
            "Handoffs by role and result",
            self.handoffs.clone(),
        );
        r.register(
            "handoff_connections",
            "Connections at a handoff, by outcome",
            self.connections.clone(),
        );
        r.register(
            "handoff_last_duration_milliseconds",
            "Duration of the last handoff this process took part in",
            self.last_duration_ms.clone(),
        );
        r.register(
            "handoff_connection_pause_seconds",
            "Adopted connections: time unread between the old process's safe point and this process's event loop",
            self.pause.clone(),
        );
    }

    pub(crate) fn handoff(&self, role: &'static str, result: &'static str) {
        self.handoffs
            .get_or_create(&vec![("role", role), ("result", result)])
            .inc();
    }

    pub(crate) fn conn(&self, outcome: &'static str) {
        self.connections
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_families_register_in_a_plain_registry_under_its_prefix() {
        let mut r = Registry::with_prefix("x");
        let m = HandoffMetrics::default();
        m.register(&mut r);
        m.handoff("old", "complete");
        m.conn("moved");
        m.pause.observe(0.000_3);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        for want in [
            r#"x_handoffs_total{role="old",result="complete"} 1"#,
            r#"x_handoff_connections_total{outcome="moved"} 1"#,
            r#"x_handoff_connection_pause_seconds_bucket{le="0.0005"} 1"#,
            "x_handoff_complete 0",
        ] {
            assert!(out.contains(want), "{want} in {out}");
        }
    }
}
