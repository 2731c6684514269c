//! The config watch endpoint: HTTP/2 over TLS, one long-lived stream per
//! sidecar (wire format in [`baton_config::push`]).
//!
//! A stream opens only for a caller whose projected ServiceAccount token the
//! API server accepts for the mesh audience (TokenReview, the audience
//! checked), bound to a meshed Pod, and that Pod must be the one the
//! sidecar claims in `x-baton-pod`: a sidecar can never read another Pod's
//! config. Authentication reuses the identity service's TokenReview path
//! ([`crate::identity::cluster::Cluster`], [`caller_from_review`]). A
//! refused stream gets a status and a JSON reason, and is counted; a
//! malformed reply frame closes that stream only.

use std::convert::Infallible;
use std::sync::Arc;

use baton_config::push::{self, Capabilities, Decoder, Reply};
use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::hub::{Hub, StreamId};
use super::index::ObjKey;
use crate::identity::cluster::{Cluster, PodState};
use crate::identity::issue::{Refusal, caller_from_review};

/// Why a stream was not opened.
#[derive(Debug, thiserror::Error)]
pub enum StreamRefusal {
    #[error(transparent)]
    Auth(#[from] Refusal),
    #[error(
        "header {} must name the sidecar's Pod as namespace/name",
        push::POD_HEADER
    )]
    MissingPod,
    #[error("the token is bound to pod {bound}, not {claimed}")]
    PodMismatch { claimed: String, bound: String },
    #[error("use POST {}", push::WATCH_PATH)]
    NotFound,
}

impl StreamRefusal {
    pub fn metric_label(&self) -> &'static str {
        match self {
            StreamRefusal::Auth(r) => r.metric_label(),
            StreamRefusal::MissingPod => "missing_pod",
            StreamRefusal::PodMismatch { .. } => "pod_mismatch",
            StreamRefusal::NotFound => "not_found",
        }
    }

    fn status(&self) -> StatusCode {
        match self {
            StreamRefusal::Auth(r) => {
                StatusCode::from_u16(r.http_status()).unwrap_or(StatusCode::FORBIDDEN)
            }
            StreamRefusal::MissingPod => StatusCode::BAD_REQUEST,
            StreamRefusal::PodMismatch { .. } => StatusCode::FORBIDDEN,
            StreamRefusal::NotFound => StatusCode::NOT_FOUND,
        }
    }
}

/// The endpoint's state: the hub and how callers are authenticated.
pub struct PushServer<C> {
    pub hub: Arc<Hub>,
    pub cluster: C,
    /// Audience the sidecar's token must carry.
    pub audience: String,
    pub trust_domain: String,
    /// Answers certificate requests (`POST` [`SIGN_PATH`]) that sidecars
    /// send on the connection their config stream holds, which costs the
    /// CA no handshake (decision 0056). Composed by the caller (the
    /// identity service), so this module never reaches into it; `None`:
    /// such requests get 404 and the sidecar uses the identity endpoint.
    pub sign: Option<Signer>,
    /// Bounds the streams being authenticated at once (a TokenReview and a
    /// Pod read each): when thousands of sidecars reconnect together (an
    /// operator restart, a failover), the rest wait their turn instead of
    /// holding as many API requests and their buffers at the same moment.
    /// [`authenticating`] makes one of the usual size.
    pub authenticating: tokio::sync::Semaphore,
}

/// Streams authenticated at once ([`PushServer::authenticating`]).
pub const AUTHENTICATING_AT_ONCE: usize = 32;

/// The bound on concurrent authentications, at its usual size.
pub fn authenticating() -> tokio::sync::Semaphore {
    tokio::sync::Semaphore::new(AUTHENTICATING_AT_ONCE)
}

impl<C: std::fmt::Debug> std::fmt::Debug for PushServer<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushServer")
            .field("cluster", &self.cluster)
            .field("audience", &self.audience)
            .field("trust_domain", &self.trust_domain)
            .field("sign", &self.sign.is_some())
            .finish_non_exhaustive()
    }
}

/// The identity service's answer to one certificate request.
pub type Signer = Arc<
    dyn Fn(Request<Incoming>) -> futures::future::BoxFuture<'static, Response<Body>> + Send + Sync,
>;

/// The path of certificate requests, as on the identity endpoint.
pub const SIGN_PATH: &str = baton_crds::contract::identity::SIGN_PATH;

pub type Body = BoxBody<Bytes, Infallible>;

impl<C: Cluster> PushServer<C> {
    /// Who may open a stream for which Pod.
    async fn authenticate(&self, req: &Request<Incoming>) -> Result<ObjKey, StreamRefusal> {
        if req.uri().path() != push::WATCH_PATH || req.method() != http::Method::POST {
            return Err(StreamRefusal::NotFound);
        }
        let token = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(Refusal::MissingToken)?;
        let claimed = req
            .headers()
            .get(push::POD_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once('/'))
            .map(|(ns, name)| ObjKey::new(ns, name))
            .ok_or(StreamRefusal::MissingPod)?;
        let review = self.cluster.review(token, &self.audience).await?;
        let caller = caller_from_review(&review, &self.audience, &self.trust_domain)?;
        let bound = ObjKey::new(&caller.identity.namespace, &caller.pod_name);
        if bound != claimed {
            return Err(StreamRefusal::PodMismatch {
                claimed: claimed.to_string(),
                bound: bound.to_string(),
            });
        }
        match self
            .cluster
            .pod(&bound.namespace, &bound.name, caller.pod_uid.as_deref())
            .await?
        {
            PodState::Meshed => Ok(bound),
            PodState::NotMeshed => Err(Refusal::PodNotMeshed {
                namespace: bound.namespace,
                pod: bound.name,
            }
            .into()),
            PodState::Gone => Err(Refusal::PodNotFound {
                namespace: bound.namespace,
                pod: bound.name,
            }
            .into()),
        }
    }

    /// Answers one request: a certificate request (to the identity
    /// service), a refusal, or the stream of pushes.
    pub async fn respond(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        if req.uri().path() == SIGN_PATH
            && let Some(sign) = &self.sign
        {
            self.hub.metrics().sign_requests.inc();
            return sign(req).await;
        }
        let authenticated = {
            // Never closed, so acquiring only waits.
            let _turn = self.authenticating.acquire().await;
            self.authenticate(&req).await
        };
        let pod = match authenticated {
            Ok(pod) => pod,
            Err(refusal) => {
                self.hub
                    .metrics()
                    .refusals
                    .get_or_create(&super::metrics::RefusalLabels {
                        reason: refusal.metric_label(),
                    })
                    .inc();
                tracing::info!(reason = refusal.metric_label(), error = %refusal, "config stream refused");
                let body = serde_json::json!({
                    "reason": refusal.metric_label(),
                    "message": refusal.to_string(),
                });
                return Response::builder()
                    .status(refusal.status())
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(body.to_string())).boxed())
                    .expect("static response parts");
            }
        };
        let version = req
            .headers()
            .get(push::VERSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        // Absent (a sidecar from before deltas): full snapshots only.
        let caps = req
            .headers()
            .get(push::CAPABILITIES_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(Capabilities::parse)
            .unwrap_or_default();
        tracing::info!(%pod, version, delta = caps.delta, "config stream opened");
        let (id, pushes) = self.hub.connect(pod, version, caps);
        let guard = Arc::new(Disconnect {
            hub: self.hub.clone(),
            id,
        });
        tokio::spawn(read_replies(req.into_body(), guard.clone()));
        let frames = futures::stream::unfold((pushes, guard), |(mut rx, guard)| async move {
            loop {
                // The sender lives in the hub until disconnect.
                rx.changed().await.ok()?;
                let push = rx.borrow_and_update().clone();
                if let Some(push) = push {
                    // The config's bytes are shared by every stream of its
                    // group: sent by reference, not copied per stream.
                    let parts = push
                        .frame_parts()
                        .map(|b| Ok::<_, Infallible>(Frame::data(b)));
                    return Some((futures::stream::iter(parts), (rx, guard)));
                }
            }
        })
        .flatten();
        Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/x-baton-push")
            .body(BodyExt::boxed(StreamBody::new(frames)))
            .expect("static response parts")
    }
}

/// Removes a stream from the hub when both halves are gone.
#[derive(Debug)]
struct Disconnect {
    hub: Arc<Hub>,
    id: StreamId,
}

impl Drop for Disconnect {
    fn drop(&mut self) {
        self.hub.disconnect(self.id);
    }
}

/// Reads the sidecar's replies until it closes its side or sends garbage.
async fn read_replies(mut body: Incoming, stream: Arc<Disconnect>) {
    let mut decoder = Decoder::default();
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { break };
        let Some(data) = frame.data_ref() else {
            continue;
        };
        decoder.extend(data);
        loop {
            match decoder.next_message::<Reply>() {
                Ok(Some(reply)) => stream.hub.reply(stream.id, reply),
                Ok(None) => break,
                Err(error) => {
                    stream.hub.metrics().bad_frames.inc();
                    tracing::warn!(%error, "malformed reply frame; closing that stream");
                    stream.hub.disconnect(stream.id);
                    return;
                }
            }
        }
    }
    // The sidecar closed its half: the stream is over.
    stream.hub.disconnect(stream.id);
}

/// Accepts TLS connections and serves HTTP/2 on each (the accept loop every
/// endpoint shares, [`baton_serving::accept`]). The connections are owned
/// by this future: dropping it (aborting its task) closes every stream, as
/// a process exit would.
pub async fn serve<C: Cluster>(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    server: Arc<PushServer<C>>,
) -> std::io::Result<()> {
    let never = tokio_util::sync::CancellationToken::new();
    let owned = baton_serving::accept::Connections::Owned;
    baton_serving::accept::serve_tls(
        listener,
        acceptor,
        "config push",
        never,
        owned,
        move |tls, peer| {
            let server = server.clone();
            async move {
                let service = hyper::service::service_fn(move |req| {
                    let server = server.clone();
                    async move { Ok::<_, Infallible>(server.respond(req).await) }
                });
                let mut h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                // Idle sidecars must not look dead to middleboxes, and dead
                // sidecars must not hold a stream forever.
                h2.keep_alive_interval(Some(std::time::Duration::from_secs(30)))
                    .keep_alive_timeout(std::time::Duration::from_secs(20))
                    .timer(hyper_util::rt::TokioTimer::new());
                if let Err(error) = h2.serve_connection(TokioIo::new(tls), service).await {
                    tracing::debug!(%peer, %error, "config push connection ended");
                }
            }
        },
    )
    .await;
    Ok(())
}
