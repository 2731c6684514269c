//! Identity-service metrics, registered in the operator's registry under
//! `baton_operator_identity_*`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// A `Refusal::metric_label()`.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CaLabels {
    /// `issuer` (signs leaves), `root` (the issuer's trust anchor),
    /// `bundle_earliest` (the root of the bundle that expires first).
    pub ca: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// A [`super::rotation::Phase::reason`].
    pub phase: &'static str,
}

#[derive(Clone, Debug)]
pub struct IdentityMetrics {
    rotation_phase: Family<PhaseLabels, Gauge>,
    reissue_pending: Gauge,
    reissue_throttled: Counter,
    issued: Counter,
    refusals: Family<ReasonLabels, Counter>,
    latency: Histogram,
    ca_expiry: Family<CaLabels, Gauge<f64, AtomicU64>>,
    bundle_roots: Gauge,
}

impl Default for IdentityMetrics {
    fn default() -> Self {
        IdentityMetrics {
            rotation_phase: Family::default(),
            reissue_pending: Gauge::default(),
            reissue_throttled: Counter::default(),
            issued: Counter::default(),
            refusals: Family::default(),
            // 0.25 ms .. ~4 s
            latency: Histogram::new(exponential_buckets(0.00025, 2.0, 15)),
            ca_expiry: Family::default(),
            bundle_roots: Gauge::default(),
        }
    }
}

impl IdentityMetrics {
    /// Registers every metric under `registry` (the caller picks the
    /// sub-registry prefix, `identity`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "certificates_issued",
            "Workload certificates issued",
            self.issued.clone(),
        );
        registry.register(
            "refusals",
            "Certificate requests refused, by reason",
            self.refusals.clone(),
        );
        registry.register(
            "issuance_seconds",
            "Time from request received to certificate answered (TokenReview included)",
            self.latency.clone(),
        );
        registry.register(
            "ca_expiry_seconds",
            "Seconds until the CA certificate expires (refreshed on every CA reload)",
            self.ca_expiry.clone(),
        );
        registry.register(
            "rotation_phase",
            "1 for the root rotation phase the leader observes, 0 for the others (leader only)",
            self.rotation_phase.clone(),
        );
        registry.register(
            "reissue_pending",
            "Sidecars that still hold a certificate of an earlier trust generation, all replicas (leader only)",
            self.reissue_pending.clone(),
        );
        registry.register(
            "reissue_throttled",
            "Re-issue requests answered 429 by the CA-wide re-issue bucket",
            self.reissue_throttled.clone(),
        );
        registry.register(
            "trust_bundle_roots",
            "Roots in the trust bundle handed to sidecars",
            self.bundle_roots.clone(),
        );
    }

    pub fn issued(&self, seconds: f64) {
        self.issued.inc();
        self.latency.observe(seconds);
    }

    pub fn refused(&self, reason: &'static str, seconds: f64) {
        self.refusals.get_or_create(&ReasonLabels { reason }).inc();
        self.latency.observe(seconds);
    }

    pub fn set_ca(&self, issuer: f64, root: f64, bundle_earliest: f64, roots: usize) {
        for (ca, v) in [
            ("issuer", issuer),
            ("root", root),
            ("bundle_earliest", bundle_earliest),
        ] {
            self.ca_expiry.get_or_create(&CaLabels { ca }).set(v);
        }
        self.bundle_roots
            .set(i64::try_from(roots).unwrap_or(i64::MAX));
    }

    /// The observed rotation phase and the sidecars still to re-issue.
    pub fn set_rotation(&self, phase: super::rotation::Phase, pending: usize) {
        for p in super::rotation::Phase::ALL {
            self.rotation_phase
                .get_or_create(&PhaseLabels { phase: p.reason() })
                .set(i64::from(p == phase));
        }
        self.reissue_pending
            .set(i64::try_from(pending).unwrap_or(i64::MAX));
    }

    pub fn reissue_throttled(&self) {
        self.reissue_throttled.inc();
    }
}
