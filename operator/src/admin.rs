//! Admin HTTP listener: `/live`, `/ready`, `/metrics`. Plain HTTP/1.1 on its
//! own port so probes and scrapes never compete with the API traffic.
//!
//! Every endpoint is read-only and reveals nothing beyond counters and the
//! leader flag, so the port answers any caller (the kubelet probes it from
//! the node, Prometheus scrapes it); any method other than GET or HEAD is
//! refused (405), so nothing here can ever change state. See the ports
//! table in docs/operations.md.

use std::net::SocketAddr;
use std::sync::Arc;

use baton_serving::accept::Connections;
use http::{Method, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Bytes;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::metrics::Metrics;

/// Routes one admin request. Pure apart from reading the metrics.
pub fn respond(path: &str, metrics: &Metrics, ready: bool) -> Response<Full<Bytes>> {
    let (status, body) = match path {
        "/live" => (StatusCode::OK, "live\n".to_owned()),
        "/ready" if ready => (StatusCode::OK, "ready\n".to_owned()),
        "/ready" => (StatusCode::SERVICE_UNAVAILABLE, "not ready\n".to_owned()),
        "/metrics" => (StatusCode::OK, metrics.encode()),
        _ => (
            StatusCode::NOT_FOUND,
            "not found: try /live, /ready, /metrics\n".to_owned(),
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
) -> Response<Full<Bytes>> {
    if method != Method::GET && method != Method::HEAD {
        let mut r = Response::new(Full::new(Bytes::from_static(
            b"method not allowed: the admin port is read-only (GET, HEAD)\n",
        )));
        *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        return r;
    }
    respond(path, metrics, ready)
}

/// Serves until the task is dropped (the accept loop and connection
/// handling are [`baton_serving::admin`]'s, shared by every Baton process).
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    ready: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "admin listening");
    let never = tokio_util::sync::CancellationToken::new();
    baton_serving::admin::serve(listener, never, Connections::Owned, move |req, _peer| {
        let response = respond_to(req.method(), req.uri().path(), &metrics, *ready.borrow());
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
        for path in ["/live", "/ready", "/metrics"] {
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
}
