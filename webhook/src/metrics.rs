//! The webhook's Prometheus metrics (one registry, prefix `baton_webhook`).

use std::time::Duration;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabels {
    /// `mutate-pods`, `validate` or `other`.
    pub endpoint: &'static str,
    /// `allowed`, `patched`, `denied`, `invalid` (undecodable body) or `not_found`.
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    pub endpoint: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// See [`crate::inject::Decision::metric_label`].
    pub decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub error: &'static str,
}

/// Every metric the process exports.
#[derive(Debug)]
pub struct Metrics {
    pub admissions: Family<AdmissionLabels, Counter>,
    pub latency: Family<EndpointLabels, Histogram>,
    pub injection_decisions: Family<DecisionLabels, Counter>,
    pub cert_reloads: Counter,
    pub errors: Family<ErrorLabels, Counter>,
    pub cert_loaded: Gauge,
    pub caches_synced: Gauge,
}

fn latency_histogram() -> Histogram {
    // 50 µs .. ~1.6 s: mutate is expected in the tens of microseconds.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            admissions: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            injection_decisions: Family::default(),
            cert_reloads: Counter::default(),
            errors: Family::default(),
            cert_loaded: Gauge::default(),
            caches_synced: Gauge::default(),
        };
        registry.register(
            "admissions",
            "Admission reviews answered, by endpoint and result",
            m.admissions.clone(),
        );
        registry.register(
            "admission_duration_seconds",
            "Time to answer an admission review",
            m.latency.clone(),
        );
        registry.register(
            "injection_decisions",
            "Injection decisions, by decision",
            m.injection_decisions.clone(),
        );
        registry.register(
            "certificate_reloads",
            "Serving certificate loads and reloads",
            m.cert_reloads.clone(),
        );
        registry.register("errors", "Background errors, by kind", m.errors.clone());
        registry.register(
            "certificate_loaded",
            "1 when a serving certificate is loaded",
            m.cert_loaded.clone(),
        );
        registry.register(
            "caches_synced",
            "1 when every watch cache has synced",
            m.caches_synced.clone(),
        );
        m
    }

    /// A standalone instance (tests, benchmarks).
    pub fn unregistered() -> Self {
        Self::register(&mut Registry::default())
    }

    pub fn observe(&self, endpoint: &'static str, result: &'static str, elapsed: Duration) {
        self.admissions
            .get_or_create(&AdmissionLabels { endpoint, result })
            .inc();
        self.latency
            .get_or_create(&EndpointLabels { endpoint })
            .observe(elapsed.as_secs_f64());
    }
}

/// A registry with the `baton_webhook` prefix.
pub fn registry() -> Registry {
    Registry::with_prefix("baton_webhook")
}
