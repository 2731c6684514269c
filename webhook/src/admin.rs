//! The admin port (plain HTTP, no Service points at it): `/live`, `/ready`
//! (serving certificate loaded and caches synced, the two things without
//! which admission answers would be wrong, and not shutting down) and
//! `/metrics`.
//!
//! It listens on every address so the kubelet can probe it from the node
//! and Prometheus can scrape it; every endpoint is read-only (GET/HEAD,
//! anything else 405) and reveals only counters and readiness, never the CA,
//! certificates or cached objects, so any caller may use it. See the ports
//! table in docs/operations.md.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use http::{Method, StatusCode};
use prometheus_client::registry::Registry;

use crate::{
    cache::ClusterState,
    metrics::Metrics,
    server::{SimpleRequest, SimpleResponse, response},
    tls::CertStore,
};

/// Set once SIGTERM arrived: the webhook still serves but reports
/// not-ready, so it leaves the Service's endpoints before it stops
/// accepting connections.
#[derive(Clone, Debug, Default)]
pub struct Draining(Arc<AtomicBool>);

impl Draining {
    pub fn start(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// What the admin endpoints report on.
pub struct Admin {
    pub store: Arc<CertStore>,
    pub state: Arc<dyn ClusterState>,
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    pub draining: Draining,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin").finish_non_exhaustive()
    }
}

impl Admin {
    /// Why the webhook is not ready, or `None` when it is.
    pub fn not_ready_reason(&self) -> Option<&'static str> {
        let cert = self.store.is_loaded();
        let synced = self.state.is_synced();
        self.metrics.cert_loaded.set(i64::from(cert));
        self.metrics.caches_synced.set(i64::from(synced));
        if self.draining.is_draining() {
            return Some("shutting down");
        }
        match (cert, synced) {
            (false, _) => Some("no serving certificate loaded yet"),
            (true, false) => Some("caches not synced yet"),
            (true, true) => None,
        }
    }

    pub async fn handle(&self, req: SimpleRequest) -> SimpleResponse {
        if req.method != Method::GET && req.method != Method::HEAD {
            return response(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "use GET\n");
        }
        match req.path.as_str() {
            "/live" => response(StatusCode::OK, "text/plain", "live\n"),
            "/ready" => match self.not_ready_reason() {
                None => response(StatusCode::OK, "text/plain", "ready\n"),
                Some(why) => response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    format!("{why}\n"),
                ),
            },
            "/metrics" => {
                let _ = self.not_ready_reason();
                let mut text = String::new();
                match prometheus_client::encoding::text::encode(&mut text, &self.registry) {
                    Ok(()) => response(StatusCode::OK, baton_serving::http::OPENMETRICS, text),
                    Err(_) => response(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "text/plain",
                        "encoding failed\n",
                    ),
                }
            }
            _ => response(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
        }
    }
}
