//! The config watch endpoint: one long-lived stream per sidecar over TLS,
//! in one of two transports chosen by ALPN: the framed transport
//! ([`baton_config::framed`], what current sidecars offer first) or HTTP/2
//! (wire format in [`baton_config::push`], what sidecars from before it
//! speak). Both open the same hub stream after the same authentication.
//!
//! A stream opens only for a caller whose projected ServiceAccount token the
//! API server accepts for the mesh audience (TokenReview, the audience
//! checked), bound to a meshed Pod, and that Pod must be the one the
//! sidecar claims in `x-baton-pod`: a sidecar can never read another Pod's
//! config. Authentication reuses the identity service's TokenReview path
//! ([`crate::identity::cluster::Cluster`], [`caller_from_review`]). A
//! refused stream gets a status and a JSON reason, and is counted; a
//! malformed reply frame closes that stream only.
//!
//! Memory per stream is what bounds a replica (decision 0066): an idle
//! framed stream holds rustls' record buffer, a read buffer released while
//! empty, and its task; an HTTP/2 one ~28 KiB more of `h2`'s fixed buffers.

use std::convert::Infallible;
use std::sync::Arc;

use baton_config::framed::{self, FrameDecoder, Hello, Kind};
use baton_config::push::{self, Capabilities, Decoder, Reply};
use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use super::hub::{Hub, StreamId};
use super::index::ObjKey;
use crate::identity::cluster::{Cluster, PodState};
use crate::identity::issue::{Refusal, caller_from_review};
use crate::identity::server::{MAX_SIGN_BODY, ServingCert, SignRequest};

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
    #[error("the stream's first frame must be a HELLO: {0}")]
    BadHello(String),
}

impl StreamRefusal {
    pub fn metric_label(&self) -> &'static str {
        match self {
            StreamRefusal::Auth(r) => r.metric_label(),
            StreamRefusal::MissingPod => "missing_pod",
            StreamRefusal::PodMismatch { .. } => "pod_mismatch",
            StreamRefusal::NotFound => "not_found",
            StreamRefusal::BadHello(_) => "bad_hello",
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
            StreamRefusal::BadHello(_) => StatusCode::BAD_REQUEST,
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
    /// How often a framed stream is pinged ([`framed::PING_INTERVAL`]; tests
    /// shorten it); a stream silent for a whole interval after a ping ends.
    pub ping_interval: std::time::Duration,
}

/// TLS handshakes in progress at once on the config push endpoint: when
/// every sidecar reconnects together, the rest wait accepted, holding a
/// socket each instead of a rustls connection mid-handshake (decision 0066).
pub const HANDSHAKING_AT_ONCE: usize = 64;

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

/// The identity service's answer to one certificate request, whichever
/// transport carried it.
pub type Signer = Arc<
    dyn Fn(SignRequest) -> futures::future::BoxFuture<'static, Response<Full<Bytes>>> + Send + Sync,
>;

/// The path of certificate requests, as on the identity endpoint.
pub const SIGN_PATH: &str = baton_crds::contract::identity::SIGN_PATH;

pub type Body = BoxBody<Bytes, Infallible>;

impl<C: Cluster> PushServer<C> {
    /// Who may open an HTTP/2 stream for which Pod.
    async fn authenticate(&self, req: &Request<Incoming>) -> Result<ObjKey, StreamRefusal> {
        if req.uri().path() != push::WATCH_PATH || req.method() != http::Method::POST {
            return Err(StreamRefusal::NotFound);
        }
        let token = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let claimed = req
            .headers()
            .get(push::POD_HEADER)
            .and_then(|v| v.to_str().ok());
        self.authorize(token, claimed).await
    }

    /// Who may open a stream for which Pod, from the caller's token and the
    /// `namespace/name` it claims (one bounded turn of the API reads).
    async fn authorize(
        &self,
        token: Option<&str>,
        claimed: Option<&str>,
    ) -> Result<ObjKey, StreamRefusal> {
        // Never closed, so acquiring only waits.
        let _turn = self.authenticating.acquire().await;
        let token = token
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(Refusal::MissingToken)?;
        let claimed = claimed
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

    /// Counts and logs a refused stream; the answer's status and body.
    fn refused(&self, refusal: &StreamRefusal) -> framed::Refused {
        self.hub
            .metrics()
            .refusals
            .get_or_create(&super::metrics::RefusalLabels {
                reason: refusal.metric_label(),
            })
            .inc();
        tracing::info!(reason = refusal.metric_label(), error = %refusal, "config stream refused");
        framed::Refused {
            status: refusal.status().as_u16(),
            reason: refusal.metric_label().to_owned(),
            message: refusal.to_string(),
        }
    }

    /// Opens the hub stream of an authenticated sidecar: the pushes it is
    /// sent, and the guard that ends it in the hub when dropped.
    fn open(
        &self,
        pod: ObjKey,
        version: u64,
        caps: Capabilities,
        transport: &'static str,
    ) -> (
        Arc<Disconnect>,
        watch::Receiver<Option<Arc<push::SharedPush>>>,
    ) {
        tracing::info!(%pod, version, delta = caps.delta, transport, "config stream opened");
        self.hub
            .metrics()
            .opened
            .get_or_create(&super::metrics::TransportLabels { transport })
            .inc();
        let (id, pushes) = self.hub.connect(pod, version, caps);
        let guard = Arc::new(Disconnect {
            hub: self.hub.clone(),
            id,
        });
        (guard, pushes)
    }

    /// Answers one HTTP/2 request: a certificate request (to the identity
    /// service), a refusal, or the stream of pushes.
    pub async fn respond(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        if req.uri().path() == SIGN_PATH
            && let Some(sign) = &self.sign
        {
            self.hub.metrics().sign_requests.inc();
            let answer = match crate::identity::server::read_request(SIGN_PATH, req).await {
                Ok(req) => sign(req).await,
                Err(refused) => refused,
            };
            return answer.map(BodyExt::boxed);
        }
        let pod = match self.authenticate(&req).await {
            Ok(pod) => pod,
            Err(refusal) => {
                let refused = self.refused(&refusal);
                let body = serde_json::json!({
                    "reason": refused.reason,
                    "message": refused.message,
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
        let (guard, pushes) = self.open(pod, version, caps, "h2");
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

impl Disconnect {
    /// A malformed frame from the sidecar: counted, and its stream ends.
    fn bad_frame(&self, error: &dyn std::fmt::Display) {
        self.hub.metrics().bad_frames.inc();
        tracing::warn!(%error, "malformed reply frame; closing that stream");
        self.hub.disconnect(self.id);
    }
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
                    stream.bad_frame(&error);
                    return;
                }
            }
        }
    }
    // The sidecar closed its half: the stream is over.
    stream.hub.disconnect(stream.id);
}

/// A TLS acceptor for this endpoint: `cert` (the identity endpoint's), the
/// framed transport preferred over HTTP/2 whatever order the client
/// offers them in.
pub fn acceptor(cert: Arc<ServingCert>) -> TlsAcceptor {
    let acceptor = crate::identity::server::acceptor(cert);
    let mut config = (*acceptor.config().clone()).clone();
    config.alpn_protocols = vec![framed::ALPN.to_vec(), b"h2".to_vec()];
    TlsAcceptor::from(Arc::new(config))
}

/// Accepts TLS connections and serves each in the transport its ALPN chose
/// (the accept loop every endpoint shares, [`baton_serving::accept`]). The
/// connections are owned by this future: dropping it (aborting its task)
/// closes every stream, as a process exit would.
pub async fn serve<C: Cluster>(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    server: Arc<PushServer<C>>,
) -> std::io::Result<()> {
    let never = tokio_util::sync::CancellationToken::new();
    let owned = baton_serving::accept::Connections::Owned;
    baton_serving::accept::serve_tls_bounded(
        listener,
        acceptor,
        "config push",
        never,
        owned,
        HANDSHAKING_AT_ONCE,
        move |tls, peer| -> futures::future::BoxFuture<'static, ()> {
            let server = server.clone();
            // Each transport's future boxed on its own: a connection's task
            // is sized for the largest state of what it runs, and HTTP/2's
            // (or a second copy of the TLS connection, held by an async
            // block that dispatched) would otherwise be paid by every framed
            // stream for its whole life (decision 0066).
            if tls.get_ref().1.alpn_protocol() == Some(framed::ALPN) {
                return Box::pin(serve_framed(server, tls));
            }
            Box::pin(async move {
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
            })
        },
    )
    .await;
    Ok(())
}

/// How long a connection may take to send its HELLO.
const HELLO_TIMEOUT: std::time::Duration = baton_serving::accept::HANDSHAKE_TIMEOUT;

/// Largest frame of an authenticated framed stream: a reply, or a
/// certificate request with its token.
const MAX_STREAM_FRAME: usize = MAX_SIGN_BODY + (16 << 10);

/// Bytes read from TLS at a time: replies are tens of bytes, and this
/// buffer lives in every stream's task.
const READ_CHUNK: usize = 512;

/// Serves one framed-transport connection ([`baton_config::framed`]): the
/// HELLO is authenticated as an HTTP/2 request's headers would be, then
/// pushes go out as the hub sends them, replies and certificate requests
/// come in, and a sidecar silent for a whole [`framed::PING_INTERVAL`]
/// after a PING is dropped. Returns when the stream is over.
///
/// One task reads and writes the connection, without splitting it (a split
/// is one more allocation a stream): `select!` drops every branch's future
/// before its handler runs, so a handler may write, and each branch's
/// future is cancel-safe.
async fn serve_framed<C: Cluster>(server: Arc<PushServer<C>>, mut tls: TlsStream<TcpStream>) {
    let mut decoder = FrameDecoder::new(framed::MAX_HELLO);
    let mut buf = [0u8; READ_CHUNK];
    let hello =
        match tokio::time::timeout(HELLO_TIMEOUT, read_hello(&mut tls, &mut decoder, &mut buf))
            .await
        {
            Ok(Ok(Some(hello))) => Ok(hello),
            // Closed before a HELLO: nothing to answer.
            Ok(Ok(None)) => return,
            Ok(Err(why)) => Err(StreamRefusal::BadHello(why)),
            Err(_) => Err(StreamRefusal::BadHello(format!(
                "none within {HELLO_TIMEOUT:?}"
            ))),
        };
    let authorized = match hello {
        // Boxed: the API reads' state is needed once, not for the stream's
        // life in its task.
        Ok(hello) => Box::pin(server.authorize(Some(&hello.token), Some(&hello.pod)))
            .await
            .map(|pod| (pod, hello)),
        Err(refusal) => Err(refusal),
    };
    let (pod, hello) = match authorized {
        Ok(ok) => ok,
        Err(refusal) => {
            let refused = server.refused(&refusal);
            let _ = tls
                .write_all(&framed::encode_json(Kind::Refused, &refused))
                .await;
            let _ = tls.shutdown().await;
            return;
        }
    };
    if write_flushed(&mut tls, &framed::encode(Kind::Open, &[]))
        .await
        .is_err()
    {
        return;
    }
    let (stream, mut pushes) = server.open(pod, hello.version, hello.capabilities(), "framed");
    drop(hello);
    decoder.set_limit(MAX_STREAM_FRAME);
    // Answers to certificate requests, written by this task; the channel is
    // made at the first request (a sidecar asks every few hours, and an
    // idle channel is ~2 KiB a stream).
    let mut signing: Option<(mpsc::Sender<framed::Signed>, mpsc::Receiver<framed::Signed>)> = None;
    let every = server.ping_interval;
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    let mut heard = true;
    loop {
        let wrote = tokio::select! {
            read = tls.read(&mut buf) => {
                let n = match read {
                    // The sidecar closed its side (or the connection broke).
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                heard = true;
                decoder.extend(&buf[..n]);
                if !server.on_frames(&stream, &mut decoder, &mut signing) {
                    return;
                }
                Ok(())
            }
            changed = pushes.changed() => {
                // The sender lives in the hub until disconnect.
                if changed.is_err() {
                    break;
                }
                let push = pushes.borrow_and_update().clone();
                match push {
                    Some(push) => write_push(&mut tls, &push).await,
                    None => Ok(()),
                }
            }
            Some(answer) = async {
                match signing.as_mut() {
                    Some((_, answers)) => answers.recv().await,
                    None => std::future::pending().await,
                }
            } => write_flushed(&mut tls, &answer.encode()).await,
            _ = ping.tick() => {
                if !heard {
                    tracing::info!("config stream silent since the last ping; closing it");
                    break;
                }
                heard = false;
                write_flushed(&mut tls, &framed::encode(Kind::Ping, &[])).await
            }
        };
        if wrote.is_err() {
            break;
        }
    }
    stream.hub.disconnect(stream.id);
}

impl<C: Cluster> PushServer<C> {
    /// Handles every complete frame `decoder` holds; `false` when the
    /// stream must end (a malformed frame, counted).
    fn on_frames(
        &self,
        stream: &Disconnect,
        decoder: &mut FrameDecoder,
        signing: &mut Option<(mpsc::Sender<framed::Signed>, mpsc::Receiver<framed::Signed>)>,
    ) -> bool {
        loop {
            let frame = match decoder.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => return true,
                Err(error) => {
                    stream.bad_frame(&error);
                    return false;
                }
            };
            let outcome = match frame {
                framed::Frame::Known(Kind::Reply, payload) => {
                    framed::json::<Reply>("REPLY", &payload).map(|r| stream.hub.reply(stream.id, r))
                }
                framed::Frame::Known(Kind::Sign, payload) => {
                    framed::Sign::decode(payload).map(|req| {
                        let (answers, _) = signing.get_or_insert_with(|| mpsc::channel(4));
                        self.sign_framed(req, answers.clone());
                    })
                }
                framed::Frame::Known(Kind::Pong, _) => Ok(()),
                framed::Frame::Known(kind, _) => Err(framed::FramedError::Malformed {
                    what: "stream",
                    why: format!("a sidecar does not send {kind:?}"),
                }),
                // A newer sidecar's frame this build does not know.
                framed::Frame::Unknown(_) => Ok(()),
            };
            if let Err(error) = outcome {
                stream.bad_frame(&error);
                return false;
            }
        }
    }

    /// Answers a certificate request from the stream's connection in a
    /// task of its own: the stream keeps pushing meanwhile.
    fn sign_framed(&self, req: framed::Sign, answers: mpsc::Sender<framed::Signed>) {
        self.hub.metrics().sign_requests.inc();
        let Some(sign) = self.sign.clone() else {
            let body = serde_json::json!({
                "reason": "not_found",
                "message": "this endpoint signs no certificates",
            });
            let answer = framed::Signed {
                id: req.id,
                status: StatusCode::NOT_FOUND.as_u16(),
                body: Bytes::from(body.to_string()),
            };
            let _ = answers.try_send(answer);
            return;
        };
        tokio::spawn(async move {
            let answer = sign(SignRequest {
                authorization: Some(format!("Bearer {}", req.token)),
                body: req.request,
            })
            .await;
            let status = answer.status().as_u16();
            let body = match answer.into_body().collect().await {
                Ok(body) => body.to_bytes(),
                Err(never) => match never {},
            };
            // The stream may have ended meanwhile: then nobody waits.
            let _ = answers
                .send(framed::Signed {
                    id: req.id,
                    status,
                    body,
                })
                .await;
        });
    }
}

/// Reads until a HELLO; `Ok(None)` if the connection closed first.
async fn read_hello<R: tokio::io::AsyncRead + Unpin>(
    rd: &mut R,
    decoder: &mut FrameDecoder,
    buf: &mut [u8],
) -> Result<Option<Hello>, String> {
    loop {
        match decoder.next_frame().map_err(|e| e.to_string())? {
            Some(framed::Frame::Known(Kind::Hello, payload)) => {
                return framed::json::<Hello>("HELLO", &payload)
                    .map(Some)
                    .map_err(|e| e.to_string());
            }
            Some(other) => return Err(format!("got {other:?}")),
            None => {}
        }
        match rd.read(buf).await {
            Ok(0) | Err(_) => return Ok(None),
            Ok(n) => decoder.extend(&buf[..n]),
        }
    }
}

async fn write_flushed<W: tokio::io::AsyncWrite + Unpin>(
    wr: &mut W,
    bytes: &[u8],
) -> std::io::Result<()> {
    wr.write_all(bytes).await?;
    wr.flush().await
}

/// Writes a push's frame: the config's bytes are shared by every stream of
/// its group, written from the shared buffer.
async fn write_push<W: tokio::io::AsyncWrite + Unpin>(
    wr: &mut W,
    push: &push::SharedPush,
) -> std::io::Result<()> {
    for part in framed::push_parts(push) {
        wr.write_all(&part).await?;
    }
    wr.flush().await
}
