//! Prometheus metrics of the TLS layer.
//!
//! One [`TlsMetrics`] per process (the [`TlsMetrics::global`] instance, which
//! [`register`] adds to the admin registry); tests build their own so their
//! counts do not interfere. Handles for a given engine are resolved once
//! ([`EngineMetrics`]) so the handshake path never allocates label sets.

use std::sync::LazyLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use crate::metrics::Registrar;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineLabel {
    pub engine: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandshakeLabels {
    /// `server` (inbound) or `client` (outbound).
    pub side: String,
    /// `ok` or a `TlsError::metric_label`.
    pub result: String,
}

fn latency_histogram() -> Histogram {
    // 10 µs .. ~330 ms: a P-256 sign is ~30 µs, RSA-3072 a few ms, and
    // a saturated queue shows up in the upper buckets.
    Histogram::new(exponential_buckets(1e-5, 2.0, 16))
}

/// All TLS metric families. Cloning shares the underlying values.
#[derive(Clone, Debug)]
pub struct TlsMetrics {
    pub offload_queue_depth: Family<EngineLabel, Gauge>,
    pub offload_in_flight: Family<EngineLabel, Gauge>,
    pub offload_sign_seconds: Family<EngineLabel, Histogram, fn() -> Histogram>,
    pub offload_wait_seconds: Family<EngineLabel, Histogram, fn() -> Histogram>,
    pub offload_errors: Family<EngineLabel, Counter>,
    pub offload_signatures: Family<EngineLabel, Counter>,
    pub offload_jobs: Family<EngineLabel, Counter>,
    pub offload_fallbacks: Family<ReasonLabel, Counter>,
    pub offload_ready: Gauge,
    pub handshakes: Family<HandshakeLabels, Counter>,
    pub plaintext_refused: Counter,
    pub plaintext_accepted: Counter,
    /// TLS without the mesh marker passed through as opaque bytes (Permissive).
    pub app_tls_passthrough: Counter,
    /// TLS without the mesh marker refused (Strict).
    pub app_tls_refused: Counter,
    pub material_generation: Gauge,
    pub cert_expiry_seconds: Gauge,
}

impl Default for TlsMetrics {
    fn default() -> Self {
        TlsMetrics {
            offload_queue_depth: Family::default(),
            offload_in_flight: Family::default(),
            offload_sign_seconds: Family::new_with_constructor(latency_histogram),
            offload_wait_seconds: Family::new_with_constructor(latency_histogram),
            offload_errors: Family::default(),
            offload_signatures: Family::default(),
            offload_jobs: Family::default(),
            offload_fallbacks: Family::default(),
            offload_ready: Gauge::default(),
            handshakes: Family::default(),
            plaintext_refused: Counter::default(),
            plaintext_accepted: Counter::default(),
            app_tls_passthrough: Counter::default(),
            app_tls_refused: Counter::default(),
            material_generation: Gauge::default(),
            cert_expiry_seconds: Gauge::default(),
        }
    }
}

static GLOBAL: LazyLock<TlsMetrics> = LazyLock::new(TlsMetrics::default);

/// Per-engine handles, resolved once.
#[derive(Clone, Debug)]
pub struct EngineMetrics {
    pub queue_depth: Gauge,
    pub in_flight: Gauge,
    pub sign_seconds: Histogram,
    pub wait_seconds: Histogram,
    pub errors: Counter,
    pub signatures: Counter,
    pub jobs: Counter,
}

impl TlsMetrics {
    /// The process-wide instance the sidecar uses.
    pub fn global() -> TlsMetrics {
        GLOBAL.clone()
    }

    pub fn engine(&self, engine: &str) -> EngineMetrics {
        let l = EngineLabel {
            engine: engine.to_string(),
        };
        EngineMetrics {
            queue_depth: self.offload_queue_depth.get_or_create(&l).clone(),
            in_flight: self.offload_in_flight.get_or_create(&l).clone(),
            sign_seconds: self.offload_sign_seconds.get_or_create(&l).clone(),
            wait_seconds: self.offload_wait_seconds.get_or_create(&l).clone(),
            errors: self.offload_errors.get_or_create(&l).clone(),
            signatures: self.offload_signatures.get_or_create(&l).clone(),
            jobs: self.offload_jobs.get_or_create(&l).clone(),
        }
    }

    pub fn fallback(&self, reason: &str) {
        self.offload_fallbacks
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
    }

    pub fn fallbacks(&self, reason: &str) -> u64 {
        self.offload_fallbacks
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .get()
    }

    pub fn handshake(&self, side: &str, result: &str) {
        self.handshakes
            .get_or_create(&HandshakeLabels {
                side: side.to_string(),
                result: result.to_string(),
            })
            .inc();
    }

    /// Adds every family to `registry` (names are prefixed `tls_`; the
    /// caller's sub-registry adds the component prefix).
    pub fn register_into(&self, registry: &mut Registrar<'_>) {
        let mut r = registry.sub_registry_with_prefix("tls");
        r.register(
            "offload_queue_depth",
            "Handshake steps waiting for a crypto worker",
            self.offload_queue_depth.clone(),
        );
        r.register(
            "offload_in_flight",
            "Handshake steps running on a crypto worker",
            self.offload_in_flight.clone(),
        );
        r.register(
            "offload_sign_seconds",
            "Private-key operation latency by engine",
            self.offload_sign_seconds.clone(),
        );
        r.register(
            "offload_wait_seconds",
            "Time from submitting a handshake step to its completion (queue + run)",
            self.offload_wait_seconds.clone(),
        );
        r.register(
            "offload_errors",
            "Failed private-key operations by engine",
            self.offload_errors.clone(),
        );
        r.register(
            "offload_signatures",
            "Private-key operations completed by engine",
            self.offload_signatures.clone(),
        );
        r.register(
            "offload_jobs",
            "Handshake steps completed on the crypto pool by engine",
            self.offload_jobs.clone(),
        );
        r.register(
            "offload_fallbacks",
            "Times the software engine stood in for the configured one",
            self.offload_fallbacks.clone(),
        );
        r.register(
            "offload_ready",
            "1 when the offload mode is satisfied, 0 when Required and no engine works",
            self.offload_ready.clone(),
        );
        r.register(
            "handshakes",
            "TLS handshakes by side and result",
            self.handshakes.clone(),
        );
        r.register(
            "plaintext_refused",
            "Plaintext connections refused by Strict mTLS",
            self.plaintext_refused.clone(),
        );
        r.register(
            "plaintext_accepted",
            "Plaintext connections accepted by Permissive mode",
            self.plaintext_accepted.clone(),
        );
        r.register(
            "app_tls_passthrough",
            "TLS connections without the mesh marker (the application's own TLS) passed through by Permissive mode",
            self.app_tls_passthrough.clone(),
        );
        r.register(
            "app_tls_refused",
            "TLS connections without the mesh marker (the application's own TLS) refused by Strict mTLS",
            self.app_tls_refused.clone(),
        );
        r.register(
            "material_generation",
            "Generation of the certificate material in use (bumps on rotation)",
            self.material_generation.clone(),
        );
        r.register(
            "cert_expiry_timestamp_seconds",
            "notAfter of the certificate in use, Unix seconds",
            self.cert_expiry_seconds.clone(),
        );
    }
}

/// Registers the process-wide TLS metrics; the admin `/metrics` registry
/// calls this once at startup.
pub fn register(registry: &mut Registrar<'_>) {
    TlsMetrics::global().register_into(registry);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_metrics_appear_in_the_text_exposition() {
        let m = TlsMetrics::default();
        let reg = crate::metrics::Metrics::new();
        reg.register(|r| m.register_into(r));
        m.engine("software").sign_seconds.observe(0.0001);
        m.fallback("engine_unavailable");
        m.plaintext_refused.inc();
        m.app_tls_passthrough.inc();
        let out = reg.encode();
        assert!(
            out.contains("baton_sidecar_tls_offload_sign_seconds_count{engine=\"software\"} 1"),
            "{out}"
        );
        assert!(
            out.contains(
                "baton_sidecar_tls_offload_fallbacks_total{reason=\"engine_unavailable\"} 1"
            ),
            "{out}"
        );
        assert!(
            out.contains("baton_sidecar_tls_plaintext_refused_total 1"),
            "{out}"
        );
        assert!(
            out.contains("baton_sidecar_tls_app_tls_passthrough_total 1"),
            "{out}"
        );
    }
}
