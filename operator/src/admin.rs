//! Admin HTTP listener: `/live`, `/ready`, `/metrics`, `/sidecars`. Plain
//! HTTP/1.1 on its own port so probes and scrapes never compete with the API
//! traffic.
//!
//! Every endpoint is read-only and reveals nothing beyond counters, the
//! leader flag and, on `/sidecars`, which Pods hold a config stream with
//! their config generations and certificate expiries (what `kubectl baton
//! status` shows; no config, key or token), so the port answers any caller
//! (the kubelet probes it from the node, Prometheus scrapes it, the CLI comes
//! through the API server's Pod proxy); any method other than GET or HEAD is
//! refused (405), so nothing here can ever change state. See the ports table
//! in docs/operations.md.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use baton_serving::accept::Connections;
use http::{Method, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Bytes;
use tokio::net::TcpListener;
use tokio::sync::watch;

use baton_crds::sidecars::{self, Report};

use crate::identity::ledger::Ledger;
use crate::mesh::hub::Hub;
use crate::metrics::Metrics;

/// What `/sidecars` reads: the config push hub and the certificate ledger,
/// each set once this replica has started it (the port is up before).
#[derive(Debug, Default)]
pub struct SidecarsView {
    pub hub: OnceLock<Arc<Hub>>,
    pub ledger: OnceLock<Arc<Ledger>>,
}

impl SidecarsView {
    /// This replica's report at `now` (unix seconds).
    pub fn report(&self, now: i64) -> Report {
        let mut sidecars: Vec<sidecars::Sidecar> = self
            .hub
            .get()
            .map(|hub| {
                hub.sidecars()
                    .into_iter()
                    .map(|s| sidecars::Sidecar {
                        pod: s.pod.to_string(),
                        sent: s.version,
                        acked: s.acked,
                        nack: s.nack,
                    })
                    .collect()
            })
            .unwrap_or_default();
        sidecars.sort_by(|a, b| a.pod.cmp(&b.pod));
        Report {
            config_push: self.hub.get().is_some(),
            sidecars,
            certificates: self
                .ledger
                .get()
                .map(|l| l.snapshot(now))
                .unwrap_or_default(),
        }
    }
}

/// Routes one admin request. Pure apart from reading the metrics and the
/// view.
pub fn respond(
    path: &str,
    metrics: &Metrics,
    ready: bool,
    view: &SidecarsView,
) -> Response<Full<Bytes>> {
    let (status, body) = match path {
        "/live" => (StatusCode::OK, "live\n".to_owned()),
        "/ready" if ready => (StatusCode::OK, "ready\n".to_owned()),
        "/ready" => (StatusCode::SERVICE_UNAVAILABLE, "not ready\n".to_owned()),
        "/metrics" => (StatusCode::OK, metrics.encode()),
        sidecars::PATH => {
            let now = time::OffsetDateTime::now_utc().unix_timestamp();
            match serde_json::to_string(&view.report(now)) {
                Ok(json) => (StatusCode::OK, json),
                Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
            }
        }
        _ => (
            StatusCode::NOT_FOUND,
            "not found: try /live, /ready, /metrics, /sidecars\n".to_owned(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}

/// [`respond`] for GET and HEAD; 405 for any other method.
pub fn respond_to(
    method: &Method,
    path: &str,
    metrics: &Metrics,
    ready: bool,
    view: &SidecarsView,
) -> Response<Full<Bytes>> {
    if method != Method::GET && method != Method::HEAD {
        let mut r = Response::new(Full::new(Bytes::from_static(
            b"method not allowed: the admin port is read-only (GET, HEAD)\n",
        )));
        *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        return r;
    }
    respond(path, metrics, ready, view)
}

/// Serves until the task is dropped (the accept loop and connection
/// handling are [`baton_serving::admin`]'s, shared by every Baton process).
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    ready: watch::Receiver<bool>,
    view: Arc<SidecarsView>,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "admin listening");
    let never = tokio_util::sync::CancellationToken::new();
    baton_serving::admin::serve(listener, never, Connections::Owned, move |req, _peer| {
        let response = respond_to(
            req.method(),
            req.uri().path(),
            &metrics,
            *ready.borrow(),
            &view,
        );
        std::future::ready(response)
    })
    .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_follows_the_flag_and_unknown_paths_are_404() {
        let m = Metrics::default();
        let v = SidecarsView::default();
        let respond = |path: &str, m: &Metrics, ready: bool| respond(path, m, ready, &v);
        assert_eq!(
            respond("/ready", &m, false).status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(respond("/ready", &m, true).status(), StatusCode::OK);
        assert_eq!(respond("/live", &m, false).status(), StatusCode::OK);
        assert_eq!(respond("/metrics", &m, false).status(), StatusCode::OK);
        assert_eq!(respond("/nope", &m, true).status(), StatusCode::NOT_FOUND);
    }

    #[test]
    fn only_get_and_head_are_answered_so_no_caller_can_change_anything() {
        let m = Metrics::default();
        let v = SidecarsView::default();
        let respond_to = |method: &Method, path: &str, m: &Metrics, ready: bool| {
            respond_to(method, path, m, ready, &v)
        };
        for path in ["/live", "/ready", "/metrics", "/sidecars"] {
            for method in [Method::GET, Method::HEAD] {
                assert_eq!(respond_to(&method, path, &m, true).status(), StatusCode::OK);
            }
            for method in [Method::POST, Method::PUT, Method::DELETE, Method::PATCH] {
                assert_eq!(
                    respond_to(&method, path, &m, true).status(),
                    StatusCode::METHOD_NOT_ALLOWED,
                    "{method} {path}"
                );
            }
        }
    }

    #[test]
    fn sidecars_reports_the_ledger_and_says_when_config_push_is_off() {
        let m = Metrics::default();
        let v = SidecarsView::default();
        let ledger = Arc::new(Ledger::default());
        let far = time::OffsetDateTime::now_utc().unix_timestamp() + 3_600;
        ledger.record("shop/web-1".into(), far, 0);
        v.ledger.set(ledger).unwrap();
        let r = respond("/sidecars", &m, true, &v);
        assert_eq!(r.status(), StatusCode::OK);
        let body = futures::executor::block_on(http_body_util::BodyExt::collect(r.into_body()))
            .unwrap()
            .to_bytes();
        let report: Report = serde_json::from_slice(&body).unwrap();
        assert!(!report.config_push, "no hub: config push is off");
        assert!(report.sidecars.is_empty());
        assert_eq!(report.certificates.len(), 1);
        assert_eq!(report.certificates[0].pod, "shop/web-1");
        assert_eq!(report.certificates[0].not_after, far);
    }
}
