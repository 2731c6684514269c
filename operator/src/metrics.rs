//! The operator's Prometheus metrics (prefix `baton_operator_`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReconcileLabels {
    pub kind: &'static str,
    /// `ok`, or the error's `metric_label()`.
    pub result: &'static str,
}

/// One registry per process; handles are cheap clones into it.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: Family<ReconcileLabels, Counter>,
    leader: Gauge,
    /// The identity service's metrics (`baton_operator_identity_*`).
    pub identity: crate::identity::metrics::IdentityMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("baton_operator");
        let reconciles = Family::<ReconcileLabels, Counter>::default();
        registry.register(
            "reconciles",
            "Reconciliations by kind and result",
            reconciles.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease",
            leader.clone(),
        );
        let identity = crate::identity::metrics::IdentityMetrics::default();
        identity.register(registry.sub_registry_with_prefix("identity"));
        Self {
            registry,
            reconciles,
            leader,
            identity,
        }
    }
}

impl Metrics {
    pub fn reconciled(&self, kind: &'static str, result: &'static str) {
        self.reconciles
            .get_or_create(&ReconcileLabels { kind, result })
            .inc();
    }

    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// Renders the registry in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconcile_results_and_leadership_are_exported() {
        let m = Metrics::default();
        m.reconciled("SidecarRelease", "ok");
        m.reconciled("SidecarRelease", "ok");
        m.set_leader(true);
        let text = m.encode();
        assert!(
            text.contains(
                "baton_operator_reconciles_total{kind=\"SidecarRelease\",result=\"ok\"} 2"
            ),
            "{text}"
        );
        assert!(text.contains("baton_operator_leader 1"), "{text}");
    }
}
