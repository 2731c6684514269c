//! The admin listener: `/metrics`, `/ready`, `/live`, `/config` (secrets
//! redacted), `/log-level`, `/connections`, `/handoff`, `/offload` and
//! `/shutdown`.
//!
//! Kept deliberately separate from the data-plane listeners: it never goes
//! through routing or filters, and it keeps answering while draining (so
//! probes and scrapes see the drain happen).
//!
//! **Who may call what.** In a Pod the port is reachable from anywhere that
//! reaches the Pod's IP (the kubelet probes it from the node, Prometheus
//! scrapes it), so the service decides by caller ([`access`]): `/live`,
//! `/ready`, `/metrics`, `/handoff` (read-only upgrade status) and
//! `/offload` (which engine signs: what the operator's AcceleratorPool books
//! read) answer
//! anyone; `/config`, `/connections`, `/log-level` and `/shutdown`, which
//! change state or reveal configuration, connections and identities, answer
//! only callers on the Pod's loopback ([`from_pod`]) and refuse anyone else
//! with 403 (counted in `baton_sidecar_admin_refused_total{endpoint}`). The
//! decision uses the socket's peer address only, never a header, and lives in
//! the handler, so it holds on an admin socket the handoff passed in from the
//! previous process as much as on one bound here.
use std::net::SocketAddr;
use std::sync::Arc;

use baton_serving::accept::Connections;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::yaml::redacted_json;
// Also used by the config compiler (an endpoint on the admin port), so it
// lives below both.
pub use crate::filters::from_pod;
use crate::http_proxy::Shared;
use crate::lifecycle::Phase;

/// Changes the log filter at runtime (an `EnvFilter` directive string).
pub type LogLevelHook = Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// Extra readiness condition (the TLS layer: "offload Required but no
/// engine"): `Err(reason)` keeps `/ready` at 503 with that reason.
pub type ReadinessHook = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;
/// The private-key offload engine's state as JSON (the TLS layer installs
/// it with its first context), for `GET /offload`.
pub type OffloadHook = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;

#[derive(Clone)]
pub struct Admin {
    pub shared: Arc<Shared>,
    pub log_level: Option<LogLevelHook>,
    pub readiness: Arc<std::sync::Mutex<Vec<ReadinessHook>>>,
    /// The handoff that made this process the serving one (the status-file
    /// document), for `GET /handoff`; `None` after a fresh start.
    pub handoff: Arc<std::sync::Mutex<Option<serde_json::Value>>>,
    /// `None` until TLS is attached: `/offload` then says `configured: false`.
    pub offload: Arc<std::sync::Mutex<Option<OffloadHook>>>,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Admin")
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        "text/plain; charset=utf-8".parse().expect("static"),
    );
    r
}

fn json(value: &serde_json::Value) -> Response<Full<Bytes>> {
    let mut r = text(
        StatusCode::OK,
        serde_json::to_vec_pretty(value).unwrap_or_default(),
    );
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        "application/json".parse().expect("static"),
    );
    r
}

/// Who may call an admin endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Probes, scrapes and the rollout controller's status read: answers
    /// any caller that reaches the port.
    Anyone,
    /// Changes state or reveals configuration, connections or identities:
    /// only a process in the Pod (its loopback).
    PodOnly,
}

/// Pure: the access rule and metric label of `path`; `None` for a path the
/// admin service does not serve (404 for everyone).
pub fn access(path: &str) -> Option<(Access, &'static str)> {
    Some(match path {
        "/live" => (Access::Anyone, "/live"),
        "/ready" => (Access::Anyone, "/ready"),
        "/metrics" => (Access::Anyone, "/metrics"),
        // Phase and last handoff (versions, counts, durations): what the
        // operator's rollout controller reads from the Pod IP, no addresses,
        // identities or configuration.
        "/handoff" => (Access::Anyone, "/handoff"),
        // Mode, requested and active engine, fallback counts: no keys,
        // identities or configuration.
        "/offload" => (Access::Anyone, "/offload"),
        "/config" => (Access::PodOnly, "/config"),
        "/connections" => (Access::PodOnly, "/connections"),
        "/log-level" => (Access::PodOnly, "/log-level"),
        "/shutdown" => (Access::PodOnly, "/shutdown"),
        _ => return None,
    })
}

impl Admin {
    /// Serves until the lifecycle reaches `Stopped` (the mechanics are
    /// [`baton_serving::admin`]'s, shared by every Baton process).
    /// Connections are detached: after a handoff the accept loop is aborted
    /// (the successor answers on the shared socket) while requests already
    /// accepted here finish.
    pub async fn serve(self, listener: TcpListener) {
        let stop = CancellationToken::new();
        let mut phase = self.shared.lifecycle.subscribe();
        let stopped = {
            let stop = stop.clone();
            async move {
                crate::lifecycle::wait_until(&mut phase, |p| *p == Phase::Stopped).await;
                stop.cancel();
            }
        };
        let serve =
            baton_serving::admin::serve(listener, stop, Connections::Detached, move |req, peer| {
                let admin = self.clone();
                async move { admin.handle(req, peer).await }
            });
        tokio::join!(stopped, serve);
    }

    /// Answers one admin request from `peer` (the connection's remote
    /// address).
    pub async fn handle<B>(&self, req: Request<B>, peer: SocketAddr) -> Response<Full<Bytes>>
    where
        B: http_body::Body,
        B::Error: std::fmt::Display,
    {
        if let Some((Access::PodOnly, endpoint)) = access(req.uri().path())
            && !from_pod(peer.ip())
        {
            self.shared.metrics.admin_refused(endpoint);
            tracing::debug!(%peer, endpoint, "admin request refused: caller not on the Pod's loopback");
            let mut r = text(
                StatusCode::FORBIDDEN,
                format!(
                    "forbidden: {endpoint} answers only callers inside the Pod (127.0.0.1 or ::1), \
                     not {}\n",
                    peer.ip()
                ),
            );
            r.headers_mut().insert(
                "x-baton-local-reason",
                "admin_not_loopback".parse().expect("static"),
            );
            return r;
        }
        let phase = self.shared.lifecycle.current();
        match (req.method(), req.uri().path()) {
            (&Method::GET, "/metrics") => {
                let mut r = text(StatusCode::OK, self.shared.metrics.encode());
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    baton_serving::http::OPENMETRICS.parse().expect("static"),
                );
                r
            }
            (&Method::GET, "/live") => {
                if phase == Phase::Stopped {
                    text(StatusCode::SERVICE_UNAVAILABLE, "stopped\n")
                } else {
                    text(StatusCode::OK, format!("{}\n", phase.as_str()))
                }
            }
            (&Method::GET, "/ready") => {
                if !phase.serves() {
                    return text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("not ready: {}\n", phase.as_str()),
                    );
                }
                let hooks = self
                    .readiness
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                for h in hooks {
                    if let Err(reason) = h() {
                        return text(
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("not ready: {reason}\n"),
                        );
                    }
                }
                text(StatusCode::OK, "ready\n")
            }
            (&Method::GET, "/config") => json(&redacted_json(&self.shared.store.snapshot())),
            (&Method::GET, "/handoff") => {
                // Phase first: during a handoff the old process says
                // `handing-off`/`draining`, the new one `adopting`.
                let last = self
                    .handoff
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                // `slot` and `retired` tell the operator which slot serves
                // and whether the one it left idles (its image can be
                // swapped back without cutting anything).
                let retirement = crate::lifecycle::Retirement::from_env();
                json(&serde_json::json!({
                    "phase": phase.as_str(),
                    "complete": last.is_some(),
                    "lastHandoff": last,
                    "slot": retirement.slot(),
                    "version": env!("CARGO_PKG_VERSION"),
                    "pid": std::process::id(),
                    "retired": retirement.retired_slots(),
                }))
            }
            (&Method::GET, "/offload") => {
                let hook = self
                    .offload
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                json(&hook.map_or_else(|| serde_json::json!({ "configured": false }), |h| h()))
            }
            (&Method::GET, "/connections") => {
                let mut out = String::new();
                for c in self.shared.registry.list() {
                    out.push_str(&format!(
                        "{} {} {} tls={} {}\n",
                        c.id,
                        c.listener,
                        c.kind.as_str(),
                        c.tls,
                        c.peer
                    ));
                }
                text(StatusCode::OK, out)
            }
            (&Method::POST, "/log-level") | (&Method::PUT, "/log-level") => {
                let query_level = req
                    .uri()
                    .query()
                    .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("level=")))
                    .map(str::to_owned);
                let level = match query_level {
                    Some(l) => l,
                    None => match req.into_body().collect().await {
                        Ok(b) => String::from_utf8_lossy(&b.to_bytes()).trim().to_owned(),
                        Err(_) => return text(StatusCode::BAD_REQUEST, "cannot read body\n"),
                    },
                };
                match &self.log_level {
                    None => text(
                        StatusCode::NOT_IMPLEMENTED,
                        "log level is not reloadable in this process\n",
                    ),
                    Some(hook) => match hook(&level) {
                        Ok(()) => text(StatusCode::OK, format!("log level set to {level}\n")),
                        Err(e) => text(
                            StatusCode::BAD_REQUEST,
                            format!("invalid log level {level:?}: {e}\n"),
                        ),
                    },
                }
            }
            (&Method::POST, "/shutdown") => {
                tracing::info!("shutdown requested through the admin endpoint");
                if phase < Phase::Draining {
                    self.shared.lifecycle.set(Phase::Draining);
                }
                text(StatusCode::OK, "draining\n")
            }
            (
                _,
                "/metrics" | "/live" | "/ready" | "/config" | "/connections" | "/log-level"
                | "/handoff" | "/offload" | "/shutdown",
            ) => text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n"),
            _ => text(StatusCode::NOT_FOUND, "not found\n"),
        }
    }
}
