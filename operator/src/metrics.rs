//! The operator's Prometheus metrics (prefix `baton_operator_`).

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReconcileLabels {
    pub kind: &'static str,
    /// `ok`, or the error's `metric_label()`.
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RolloutLabels {
    /// `start`, `finish`, `fail`, `evict`.
    pub action: &'static str,
    /// `ok` or `error` (not taken: conflict, PDB, API error).
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    pub pool: String,
    /// `capacity`, `allocated`, `free`, `pending`.
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolNameLabels {
    pub pool: String,
}

/// One registry per process; handles are cheap clones into it.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: Family<ReconcileLabels, Counter>,
    leader: Gauge,
    rollout_actions: Family<RolloutLabels, Counter>,
    handoff_duration: Histogram,
    pool_devices: Family<PoolLabels, Gauge>,
    pool_fallbacks: Family<PoolNameLabels, Gauge>,
    /// The identity service's metrics (`baton_operator_identity_*`).
    pub identity: crate::identity::metrics::IdentityMetrics,
    /// The config push's metrics (`baton_operator_push_*`).
    pub push: crate::mesh::metrics::PushMetrics,
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
        let rollout_actions = Family::<RolloutLabels, Counter>::default();
        registry.register(
            "rollout_actions",
            "Rollout steps by action and result",
            rollout_actions.clone(),
        );
        // 1 ms .. ~16 s: a handoff of a few connections takes milliseconds,
        // 10,000 take a quarter of a second.
        let handoff_duration = Histogram::new(
            prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 15),
        );
        registry.register(
            "handoff_duration_seconds",
            "Per-pod handoff duration of completed in-place upgrades, as the new sidecar measured it",
            handoff_duration.clone(),
        );
        let pool_devices = Family::<PoolLabels, Gauge>::default();
        registry.register(
            "accelerator_devices",
            "AcceleratorPool devices by state, as the pool's status reports them",
            pool_devices.clone(),
        );
        let pool_fallbacks = Family::<PoolNameLabels, Gauge>::default();
        registry.register(
            "accelerator_fallbacks",
            "Running sidecars that asked for a pool's devices and run in software",
            pool_fallbacks.clone(),
        );
        let identity = crate::identity::metrics::IdentityMetrics::default();
        identity.register(registry.sub_registry_with_prefix("identity"));
        let push = crate::mesh::metrics::PushMetrics::default();
        push.register(registry.sub_registry_with_prefix("push"));
        Self {
            registry,
            reconciles,
            leader,
            rollout_actions,
            handoff_duration,
            pool_devices,
            pool_fallbacks,
            identity,
            push,
        }
    }
}

impl Metrics {
    pub fn reconciled(&self, kind: &'static str, result: &'static str) {
        self.reconciles
            .get_or_create(&ReconcileLabels { kind, result })
            .inc();
    }

    pub fn rollout_action(&self, action: &'static str, result: &'static str) {
        self.rollout_actions
            .get_or_create(&RolloutLabels { action, result })
            .inc();
    }

    pub fn handoff_completed(&self, duration_ms: u64) {
        self.handoff_duration
            .observe(Duration::from_millis(duration_ms).as_secs_f64());
    }

    /// Mirrors one AcceleratorPool's status totals.
    pub fn pool_observed(&self, pool: &str, status: &baton_crds::AcceleratorPoolStatus) {
        for (state, value) in [
            ("capacity", status.capacity),
            ("allocated", status.allocated),
            ("free", status.free),
            ("pending", status.pending),
        ] {
            self.pool_devices
                .get_or_create(&PoolLabels {
                    pool: pool.to_owned(),
                    state,
                })
                .set(value);
        }
        self.pool_fallbacks
            .get_or_create(&PoolNameLabels {
                pool: pool.to_owned(),
            })
            .set(status.fallbacks);
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
        m.rollout_action("finish", "ok");
        m.handoff_completed(12);
        m.pool_observed(
            "qat",
            &baton_crds::AcceleratorPoolStatus {
                capacity: 4,
                allocated: 3,
                fallbacks: 2,
                ..Default::default()
            },
        );
        let text = m.encode();
        assert!(
            text.contains("baton_operator_accelerator_devices{pool=\"qat\",state=\"allocated\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("baton_operator_accelerator_fallbacks{pool=\"qat\"} 2"),
            "{text}"
        );
        assert!(
            text.contains(
                "baton_operator_rollout_actions_total{action=\"finish\",result=\"ok\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("baton_operator_handoff_duration_seconds_count 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "baton_operator_reconciles_total{kind=\"SidecarRelease\",result=\"ok\"} 2"
            ),
            "{text}"
        );
        assert!(text.contains("baton_operator_leader 1"), "{text}");
    }
}
