//! The config stream client: one stream over TLS to the operator, applying
//! each pushed snapshot (or delta, applied onto the serving snapshot)
//! through the [`ConfigStore`] and answering ACK or NACK.
//!
//! The stream is carried on the framed transport
//! ([`baton_config::framed`]) when the operator selects it by ALPN, else
//! as one HTTP/2 stream ([`baton_config::push`]) for an operator from
//! before it; the messages and their meaning are the same on both. The
//! connection is published on the [`OperatorLink`] while the stream is
//! open, for certificate requests.
//!
//! Failure behaviour, by design:
//! * a snapshot the store refuses is NACKed with the error and never
//!   replaces the serving one (the store validates before it swaps);
//! * losing the operator changes nothing in the data plane: the last good
//!   config keeps serving while the client reconnects with jittered,
//!   doubling back-off (so a restarted operator is not stampeded);
//! * a process that took over through a handoff starts with the inherited
//!   snapshot already serving and reports its version on connect, so there
//!   is no window of default config.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use baton_config::framed::{self, Frame as FramedFrame, FrameDecoder, Kind};
use baton_config::push::{self, Decoder, Push, Reply};
use baton_contract as contract;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, watch};

use crate::config::store::ConfigStore;
use crate::metrics::Metrics;
use crate::operator_link::{self, OperatorLink, SignJob};

/// Where and how to reach the operator.
#[derive(Debug, Clone)]
pub struct ControlConfig {
    /// `host:port` of the operator's config endpoint.
    pub address: String,
    /// Name the operator's certificate must carry (the Service's DNS name).
    pub server_name: String,
    /// PEM bundle of the CA that signs the operator's serving certificate
    /// (on injected Pods: the mesh trust bundle as of admission).
    pub ca_bundle: PathBuf,
    /// The newest mesh trust bundle the Pod's sidecars learned, trusted
    /// together with `ca_bundle` and re-read on every connect
    /// ([`crate::tls::trust_state`]).
    pub trust_state: Option<PathBuf>,
    /// Projected ServiceAccount token, re-read on every connect (kubelet
    /// rotates it).
    pub token_path: PathBuf,
    /// `namespace/name` of this Pod.
    pub pod: String,
    /// First back-off; doubles per failure up to `max_backoff`.
    pub min_backoff: Duration,
    pub max_backoff: Duration,
}

/// Why one stream ended.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("trust bundle: {0}")]
    Trust(#[from] crate::tls::trust_state::TrustError),
    #[error("invalid server name {0:?}")]
    ServerName(String),
    #[error("tls: {0}")]
    Tls(String),
    #[error("connect to {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("http/2: {0}")]
    Http(#[from] hyper::Error),
    #[error("operator refused the stream ({status}): {body}")]
    Refused { status: u16, body: String },
    #[error("malformed push frame: {0}")]
    Frame(#[from] push::FrameError),
    #[error("framed stream: {0}")]
    Framed(#[from] framed::FramedError),
    #[error("framed stream: operator sent {0}")]
    Protocol(String),
    #[error("framed stream: {0}")]
    Io(#[source] std::io::Error),
    #[error("nothing heard from the operator for {0:?}")]
    Silent(Duration),
    #[error("the operator read nothing for {0:?}")]
    Stalled(Duration),
    #[error("operator closed the stream")]
    Closed,
}

/// Runs the client until `stop` turns true. Never returns an error: every
/// failure is logged, counted, and followed by a reconnect.
pub async fn run(
    cfg: ControlConfig,
    store: Arc<ConfigStore>,
    metrics: Arc<Metrics>,
    stop: watch::Receiver<bool>,
) {
    run_reporting(cfg, store, metrics, stop, None, OperatorLink::default()).await
}

/// [`run`], reporting to the operator the trust generation of the
/// certificate the sidecar holds (`certificate`, from the TLS layer) on
/// every stream whose config carries a re-issue trigger, and publishing
/// the stream's connection on `link` while it is open (the certificate
/// client sends its requests on it: [`crate::operator_link`]).
pub async fn run_reporting(
    cfg: ControlConfig,
    store: Arc<ConfigStore>,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
    certificate: Option<watch::Receiver<Option<String>>>,
    link: OperatorLink,
) {
    let mut backoff = cfg.min_backoff;
    loop {
        let mut applied_any = false;
        let result = tokio::select! {
            r = stream_once(&cfg, &store, &metrics, &mut applied_any, certificate.clone(), &link, framed::SILENCE_LIMIT) => r,
            _ = stop.wait_for(|s| *s) => return,
        };
        metrics.control_connected.set(0);
        metrics.control_reconnects.inc();
        if applied_any {
            backoff = cfg.min_backoff;
        }
        let wait = jittered(backoff);
        match result {
            Err(StreamError::Closed) | Ok(()) => {
                tracing::info!(retry_in = ?wait, "config stream closed by the operator; keeping the serving config")
            }
            Err(error) => {
                tracing::warn!(%error, retry_in = ?wait, "config stream failed; keeping the serving config")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        backoff = (backoff * 2).min(cfg.max_backoff);
    }
}

/// `/ready` while the config stream is on: 503 until the sidecar serves a
/// config the operator pushed (version > 0; a handoff hands its
/// predecessor's over). A Pod that turned Ready on the in-pod default
/// would take traffic its peers already send as mesh mTLS (their configs
/// say it is meshed) before it knows it must terminate it: Istio's sidecar
/// waits for its first xDS config in the same way.
pub fn readiness(store: Arc<ConfigStore>) -> crate::admin::ReadinessHook {
    Arc::new(move || {
        if store.version() > 0 {
            Ok(())
        } else {
            Err("waiting for the first config from the operator".into())
        }
    })
}

/// Uniform in [d/2, d]: spreads the reconnects of many sidecars.
fn jittered(d: Duration) -> Duration {
    d.mul_f64(0.5 + rand::random::<f64>() * 0.5)
}

fn tls_connector(cfg: &ControlConfig) -> Result<tokio_rustls::TlsConnector, StreamError> {
    // Both files are re-read on every connect: the kept one changes when
    // the identity service sends a new bundle (a root rotation).
    let mut roots = rustls::RootCertStore::empty();
    for cert in crate::tls::trust_state::roots(&cfg.ca_bundle, cfg.trust_state.as_deref())? {
        roots
            .add(cert)
            .map_err(|e| StreamError::Tls(e.to_string()))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| StreamError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    // The framed transport first: an operator that knows it selects it, an
    // older one selects `h2` (decision 0066).
    config.alpn_protocols = vec![framed::ALPN.to_vec(), b"h2".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// One connection: open the stream, apply pushes until it ends. The
/// operator picks the transport by ALPN: the framed one
/// ([`baton_config::framed`]) when it knows it, HTTP/2 otherwise (an
/// operator from before it). A framed stream ends when nothing arrives
/// for `silence_limit` ([`framed::SILENCE_LIMIT`]; shorter in tests).
async fn stream_once(
    cfg: &ControlConfig,
    store: &ConfigStore,
    metrics: &Metrics,
    applied_any: &mut bool,
    certificate: Option<watch::Receiver<Option<String>>>,
    link: &OperatorLink,
    silence_limit: Duration,
) -> Result<(), StreamError> {
    let token = std::fs::read_to_string(&cfg.token_path).map_err(|source| StreamError::Read {
        path: cfg.token_path.clone(),
        source,
    })?;
    let connector = tls_connector(cfg)?;
    let name = ServerName::try_from(cfg.server_name.clone())
        .map_err(|_| StreamError::ServerName(cfg.server_name.clone()))?;
    let tcp = tokio::net::TcpStream::connect(&cfg.address)
        .await
        .map_err(|source| StreamError::Connect {
            addr: cfg.address.clone(),
            source,
        })?;
    let tls = connector
        .connect(name, tcp)
        .await
        .map_err(|e| StreamError::Tls(e.to_string()))?;
    let stream = Stream {
        cfg,
        store,
        metrics,
        link,
        token: token.trim(),
    };
    if tls.get_ref().1.alpn_protocol() == Some(framed::ALPN) {
        stream
            .framed(tls, applied_any, certificate, silence_limit)
            .await
    } else {
        stream.http2(tls, applied_any, certificate).await
    }
}

/// What both transports of one stream work with.
struct Stream<'a> {
    cfg: &'a ControlConfig,
    store: &'a ConfigStore,
    metrics: &'a Metrics,
    link: &'a OperatorLink,
    /// The ServiceAccount token, trimmed.
    token: &'a str,
}

type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

impl Stream<'_> {
    /// The stream is open: counted, and said.
    fn opened(&self) {
        self.metrics.control_connected.set(1);
        tracing::info!(operator = %self.cfg.address, version = self.store.version(), "config stream open");
    }

    /// The answer to one push, noting in `applied_any` that one applied.
    fn answer(&self, push: Push, applied_any: &mut bool) -> Reply {
        let reply = apply(self.store, push);
        if matches!(reply, Reply::Ack { .. }) {
            *applied_any = true;
        }
        reply
    }

    /// The stream as an HTTP/2 `POST` ([`push`]'s protocol).
    async fn http2(
        &self,
        tls: Tls,
        applied_any: &mut bool,
        mut certificate: Option<watch::Receiver<Option<String>>>,
    ) -> Result<(), StreamError> {
        let (cfg, store) = (self.cfg, self.store);
        let (mut sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .keep_alive_interval(Some(Duration::from_secs(30)))
            .keep_alive_timeout(Duration::from_secs(20))
            .timer(hyper_util::rt::TokioTimer::new())
            .handshake(TokioIo::new(tls))
            .await?;
        let conn = tokio::spawn(conn);
        let _abort = AbortOnDrop(conn);

        let (replies, rx) = mpsc::channel::<Bytes>(16);
        let body: operator_link::Body = ReplyBody(rx).boxed_unsync();
        let req = http::Request::post(push::WATCH_PATH)
            .uri(format!("https://{}{}", cfg.server_name, push::WATCH_PATH))
            .header(
                http::header::AUTHORIZATION,
                format!("Bearer {}", self.token),
            )
            .header(push::POD_HEADER, &cfg.pod)
            .header(push::VERSION_HEADER, store.version().to_string())
            .header(
                push::CAPABILITIES_HEADER,
                push::Capabilities::ALL.header_value(),
            )
            .body(body)
            .expect("request parts are valid");
        let resp = sender.send_request(req).await?;
        if resp.status() != http::StatusCode::OK {
            let status = resp.status().as_u16();
            let body = resp
                .into_body()
                .collect()
                .await
                .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                .unwrap_or_default();
            return Err(StreamError::Refused { status, body });
        }
        // Withdrawn when this function returns (the stream is over).
        let _published = self.link.publish(sender.clone(), &cfg.server_name);
        self.opened();
        let mut body = resp.into_body();
        let mut decoder = Decoder::default();
        let mut reports = CertificateReports::default();
        loop {
            tokio::select! {
                frame = body.frame() => {
                    let Some(frame) = frame else { break };
                    let frame = frame?;
                    let Some(data) = frame.data_ref() else {
                        continue;
                    };
                    decoder.extend(data);
                    while let Some(push) = decoder.next_message::<Push>()? {
                        let reply = self.answer(push, applied_any);
                        if replies
                            .send(Bytes::from(push::encode(&reply)))
                            .await
                            .is_err()
                        {
                            return Err(StreamError::Closed);
                        }
                    }
                }
                () = certificate_changed(&mut certificate) => {}
            }
            if let Some(report) = reports.due(store, certificate.as_ref())
                && replies
                    .send(Bytes::from(push::encode(&report)))
                    .await
                    .is_err()
            {
                return Err(StreamError::Closed);
            }
        }
        Err(StreamError::Closed)
    }

    /// The stream on the framed transport ([`framed`]'s protocol), which
    /// ends when nothing arrives for `silence_limit`.
    ///
    /// One task reads, writes and carries certificate requests: everything
    /// it writes is small (replies, PONGs, SIGNs), and every future it
    /// waits on is cancel-safe, so a frame is never half read or lost.
    async fn framed(
        &self,
        mut tls: Tls,
        applied_any: &mut bool,
        mut certificate: Option<watch::Receiver<Option<String>>>,
        silence_limit: Duration,
    ) -> Result<(), StreamError> {
        let hello = framed::Hello {
            token: self.token.to_owned(),
            pod: self.cfg.pod.clone(),
            version: self.store.version(),
            capabilities: push::Capabilities::ALL.header_value(),
        };
        write_frame(
            &mut tls,
            &framed::encode_json(Kind::Hello, &hello),
            silence_limit,
        )
        .await?;

        let mut decoder = FrameDecoder::new(push::MAX_FRAME);
        let mut buf = [0u8; 8 << 10];
        let silence = tokio::time::sleep(silence_limit);
        tokio::pin!(silence);
        // Until OPEN: no certificate requests, no reports.
        let mut open: Option<(mpsc::Receiver<SignJob>, operator_link::Published)> = None;
        let mut signs = PendingSigns::default();
        let mut reports = CertificateReports::default();
        loop {
            while let Some(frame) = decoder.next_frame()? {
                let (kind, payload) = match frame {
                    FramedFrame::Known(kind, payload) => (kind, payload),
                    // A newer operator may send more; before OPEN, nothing
                    // but OPEN or REFUSED is acceptable.
                    FramedFrame::Unknown(kind) if open.is_some() => {
                        tracing::debug!(kind, "skipping a config stream frame of an unknown kind");
                        continue;
                    }
                    FramedFrame::Unknown(kind) => {
                        return Err(StreamError::Protocol(format!(
                            "a frame of unknown kind {kind} before OPEN"
                        )));
                    }
                };
                match (kind, open.is_some()) {
                    (Kind::Refused, _) => {
                        let refused: framed::Refused = framed::json("REFUSED", &payload)?;
                        return Err(StreamError::Refused {
                            status: refused.status,
                            body: String::from_utf8_lossy(&payload).into_owned(),
                        });
                    }
                    (Kind::Open, false) => {
                        let (jobs, rx) = mpsc::channel(SIGN_QUEUE);
                        // Withdrawn when this function returns.
                        open = Some((rx, self.link.publish_framed(jobs)));
                        self.opened();
                    }
                    (Kind::Push, true) => {
                        let push: Push = framed::json("PUSH", &payload)?;
                        let reply = self.answer(push, applied_any);
                        let frame = framed::encode_json(Kind::Reply, &reply);
                        write_frame(&mut tls, &frame, silence_limit).await?;
                    }
                    (Kind::Ping, true) => {
                        let pong = framed::encode(Kind::Pong, &[]);
                        write_frame(&mut tls, &pong, silence_limit).await?;
                    }
                    (Kind::Signed, true) => signs.answer(framed::Signed::decode(payload)?),
                    (kind, _) => {
                        let when = if open.is_some() { "" } else { " before OPEN" };
                        return Err(StreamError::Protocol(format!("a {kind:?} frame{when}")));
                    }
                }
            }
            // After what just arrived (a push with a trigger) or changed
            // (the certificate).
            if open.is_some()
                && let Some(report) = reports.due(self.store, certificate.as_ref())
            {
                let frame = framed::encode_json(Kind::Reply, &report);
                write_frame(&mut tls, &frame, silence_limit).await?;
            }
            tokio::select! {
                read = tls.read(&mut buf) => {
                    let n = read.map_err(StreamError::Io)?;
                    if n == 0 {
                        return Err(StreamError::Closed);
                    }
                    decoder.extend(&buf[..n]);
                    // Anything heard counts: a large push may take a while.
                    silence.as_mut().reset(tokio::time::Instant::now() + silence_limit);
                }
                Some(job) = async {
                    match open.as_mut() {
                        Some((jobs, _)) => jobs.recv().await,
                        None => std::future::pending().await,
                    }
                } => {
                    if let Some(frame) = signs.send(job) {
                        write_frame(&mut tls, &frame, silence_limit).await?;
                    }
                }
                () = certificate_changed(&mut certificate), if open.is_some() => {}
                () = &mut silence => return Err(StreamError::Silent(silence_limit)),
            }
        }
    }
}

/// Certificate requests queued for a framed stream's task at most: the
/// certificate client sends one at a time.
const SIGN_QUEUE: usize = 4;

/// Writes one frame, giving up after `limit` (an operator that reads
/// nothing is as gone as one that sends nothing).
async fn write_frame(tls: &mut Tls, frame: &[u8], limit: Duration) -> Result<(), StreamError> {
    let write = async {
        tls.write_all(frame).await?;
        tls.flush().await
    };
    match tokio::time::timeout(limit, write).await {
        Ok(written) => written.map_err(StreamError::Io),
        Err(_) => Err(StreamError::Stalled(limit)),
    }
}

/// The certificate requests a framed stream sent and awaits SIGNED for.
#[derive(Default)]
struct PendingSigns {
    next_id: u32,
    waiting: HashMap<u32, oneshot::Sender<operator_link::SignAnswer>>,
}

impl PendingSigns {
    /// The SIGN frame for `job`, remembering whom to answer; `None` (and
    /// the job answered with the reason) when it cannot be sent.
    fn send(&mut self, job: SignJob) -> Option<Vec<u8>> {
        if job.token.len() > usize::from(u16::MAX) {
            // The frame's token length is 16 bits; a cut token would only
            // be refused by the operator.
            let _ = job
                .answer
                .send(Err("token too long for a SIGN frame".into()));
            return None;
        }
        // A requester that timed out stopped waiting.
        self.waiting.retain(|_, answer| !answer.is_closed());
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        self.waiting.insert(id, job.answer);
        Some(
            framed::Sign {
                id,
                token: job.token,
                request: job.request,
            }
            .encode(),
        )
    }

    fn answer(&mut self, signed: framed::Signed) {
        match self.waiting.remove(&signed.id) {
            Some(answer) => {
                let _ = answer.send(Ok((signed.status, signed.body)));
            }
            None => tracing::debug!(id = signed.id, "SIGNED for no pending request"),
        }
    }
}

/// Waits until the held certificate changes; forever without one (or once
/// its sender is gone, when it is dropped). Cancel-safe.
async fn certificate_changed(certificate: &mut Option<watch::Receiver<Option<String>>>) {
    match certificate.as_mut() {
        Some(c) => {
            if c.changed().await.is_err() {
                *certificate = None;
            }
        }
        None => std::future::pending().await,
    }
}

/// What one stream told the operator of the certificate held (a new
/// stream, perhaps to another replica, is told again).
#[derive(Default)]
struct CertificateReports {
    reported: Option<String>,
}

impl CertificateReports {
    /// The report due now ([`certificate_report`]), taken as sent.
    fn due(
        &mut self,
        store: &ConfigStore,
        certificate: Option<&watch::Receiver<Option<String>>>,
    ) -> Option<Reply> {
        let triggered = store
            .snapshot()
            .tls
            .as_ref()
            .is_some_and(|t| t.reissue.is_some());
        let held = certificate.and_then(|c| c.borrow().clone());
        let generation = certificate_report(triggered, held.as_deref(), self.reported.as_deref())?;
        self.reported = Some(generation.clone());
        Some(Reply::Certificate { generation })
    }
}

/// The certificate report to send, if any: only on a stream whose config
/// carries a re-issue trigger (`triggered`: the operator understands the
/// report), only for a certificate that names its generation, and only when
/// it differs from the last one reported on this stream. Pure.
pub fn certificate_report(
    triggered: bool,
    held: Option<&str>,
    reported: Option<&str>,
) -> Option<String> {
    match held {
        Some(h) if triggered && Some(h) != reported => Some(h.to_owned()),
        _ => None,
    }
}

/// Apply one push: a delta is applied onto the serving snapshot first; the
/// store validates and swaps, or refuses and keeps the serving snapshot.
fn apply(store: &ConfigStore, push: Push) -> Reply {
    let (nonce, version) = (push.nonce.clone(), push.version);
    let applied = push
        .resolve(&store.snapshot())
        .map_err(|e| e.to_string())
        .and_then(|snapshot| {
            refused_by_test_knob(&snapshot)?;
            store.apply(&snapshot).map_err(|e| e.to_string())
        });
    match applied {
        Ok(()) => Reply::Ack { nonce, version },
        Err(error) => Reply::Nack { nonce, error },
    }
}

/// Testing knob ([`contract::env::TEST_REFUSE_ROUTE`]): refuses, as an
/// invalid config would be, any snapshot with a route whose name contains
/// the variable's value, so end-to-end tests can show a sidecar that NACKed
/// its newest config (STALE in `kubectl baton status`) while it keeps
/// serving the last good one. Unset in every Pod Baton injects.
fn refused_by_test_knob(snapshot: &baton_config::Snapshot) -> Result<(), String> {
    static KNOB: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let knob = KNOB.get_or_init(|| {
        std::env::var(contract::env::TEST_REFUSE_ROUTE)
            .ok()
            .filter(|v| !v.is_empty())
    });
    match knob {
        Some(needle) => match snapshot
            .routes
            .iter()
            .find(|r| r.name.contains(needle.as_str()))
        {
            Some(r) => Err(format!(
                "route {:?} refused by the testing knob {}",
                r.name,
                contract::env::TEST_REFUSE_ROUTE
            )),
            None => Ok(()),
        },
        None => Ok(()),
    }
}

/// The request body: reply frames as they are queued; ends when the
/// sender is dropped.
struct ReplyBody(mpsc::Receiver<Bytes>);

impl http_body::Body for ReplyBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<Result<(), hyper::Error>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::certificate_report;

    #[test]
    fn the_held_generation_is_reported_once_per_stream_and_again_when_it_changes() {
        assert_eq!(
            certificate_report(true, Some("g1"), None).as_deref(),
            Some("g1")
        );
        assert_eq!(certificate_report(true, Some("g1"), Some("g1")), None);
        assert_eq!(
            certificate_report(true, Some("g2"), Some("g1")).as_deref(),
            Some("g2")
        );
    }

    #[test]
    fn nothing_is_reported_to_an_operator_that_sent_no_trigger_or_without_a_generation() {
        // No trigger: an operator from before reports may not decode one.
        assert_eq!(certificate_report(false, Some("g1"), None), None);
        // No certificate yet, or one from an operator naming no generation.
        assert_eq!(certificate_report(true, None, None), None);
    }

    /// The framed client against a scripted operator: a real TLS server on
    /// loopback, speaking frame by frame what the test says.
    mod framed_client {
        use std::sync::Arc;
        use std::time::Duration;

        use baton_config::framed::{self, Frame, FrameDecoder, Kind};
        use baton_config::push::{self, ConfigKind, Reply, SharedPush};
        use bytes::Bytes;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use tokio::net::{TcpListener, TcpStream};
        use tokio::sync::{oneshot, watch};

        use crate::config::store::ConfigStore;
        use crate::control::{ControlConfig, StreamError, stream_once};
        use crate::metrics::Metrics;
        use crate::operator_link::{Held, OperatorLink, SignJob};

        const SERVER_NAME: &str = "baton-operator.baton-system.svc";
        const CONFIG: &str = "version: 1\nclusters: [{name: a, endpoints: ['127.0.0.1:1']}]\nroutes: [{name: r, backends: [{cluster: a}]}]\n";
        /// Bounds every wait of a test: loopback answers in milliseconds.
        const PATIENCE: Duration = Duration::from_secs(10);

        /// A TLS operator on 127.0.0.1:0 selecting from `alpn`, and the
        /// client's configuration for it (files in the returned directory).
        struct Operator {
            listener: TcpListener,
            tls: Arc<rustls::ServerConfig>,
            cfg: ControlConfig,
            _dir: tempfile::TempDir,
        }

        impl Operator {
            async fn start(alpn: &[&[u8]]) -> Operator {
                let ca_key = rcgen::KeyPair::generate().unwrap();
                let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
                ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
                let ca = rcgen::CertifiedIssuer::self_signed(ca, ca_key).unwrap();
                let key = rcgen::KeyPair::generate().unwrap();
                let leaf = rcgen::CertificateParams::new(vec![SERVER_NAME.into()])
                    .unwrap()
                    .signed_by(&key, &ca)
                    .unwrap();
                let mut tls = rustls::ServerConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(
                    vec![leaf.der().clone()],
                    rustls_pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
                )
                .unwrap();
                tls.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();

                let dir = tempfile::tempdir().unwrap();
                std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
                // The client trims what kubelet writes.
                std::fs::write(dir.path().join("token"), "t0k\n").unwrap();
                let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
                let cfg = ControlConfig {
                    address: listener.local_addr().unwrap().to_string(),
                    server_name: SERVER_NAME.into(),
                    ca_bundle: dir.path().join("ca.pem"),
                    trust_state: None,
                    token_path: dir.path().join("token"),
                    pod: "ns/web-0".into(),
                    min_backoff: Duration::from_millis(10),
                    max_backoff: Duration::from_millis(10),
                };
                Operator {
                    listener,
                    tls: Arc::new(tls),
                    cfg,
                    _dir: dir,
                }
            }

            /// Accepts one connection; also returns the ALPN protocols the
            /// client offered, in its order.
            async fn accept(&self) -> (tokio_rustls::server::TlsStream<TcpStream>, Vec<Vec<u8>>) {
                let (tcp, _) = self.listener.accept().await.unwrap();
                let start =
                    tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), tcp)
                        .await
                        .unwrap();
                let offered = start
                    .client_hello()
                    .alpn()
                    .map(|a| a.map(<[u8]>::to_vec).collect())
                    .unwrap_or_default();
                let tls = start.into_stream(self.tls.clone()).await.unwrap();
                (tls, offered)
            }
        }

        /// The operator's end of a framed stream.
        struct Peer {
            tls: tokio_rustls::server::TlsStream<TcpStream>,
            decoder: FrameDecoder,
        }

        impl Peer {
            async fn accept(operator: &Operator) -> Peer {
                let (tls, offered) = operator.accept().await;
                assert_eq!(offered, [framed::ALPN.to_vec(), b"h2".to_vec()]);
                assert_eq!(tls.get_ref().1.alpn_protocol(), Some(framed::ALPN));
                Peer {
                    tls,
                    decoder: FrameDecoder::new(push::MAX_FRAME),
                }
            }

            async fn send(&mut self, frame: &[u8]) {
                self.tls.write_all(frame).await.unwrap();
                self.tls.flush().await.unwrap();
            }

            async fn frame(&mut self) -> (Kind, Bytes) {
                let mut buf = [0u8; 4096];
                loop {
                    match self.decoder.next_frame().unwrap() {
                        Some(Frame::Known(kind, payload)) => return (kind, payload),
                        Some(Frame::Unknown(kind)) => panic!("the sidecar sent kind {kind}"),
                        None => {}
                    }
                    let n = tokio::time::timeout(PATIENCE, self.tls.read(&mut buf))
                        .await
                        .expect("the sidecar sends in time")
                        .unwrap();
                    assert!(n > 0, "the sidecar closed the stream");
                    self.decoder.extend(&buf[..n]);
                }
            }

            async fn expect(&mut self, want: Kind) -> Bytes {
                let (kind, payload) = self.frame().await;
                assert_eq!(kind, want, "{}", String::from_utf8_lossy(&payload));
                payload
            }

            /// Reads HELLO and checks it against the client's settings.
            async fn hello(&mut self, version: u64) {
                let hello: framed::Hello =
                    framed::json("HELLO", &self.expect(Kind::Hello).await).unwrap();
                assert_eq!(
                    hello,
                    framed::Hello {
                        token: "t0k".into(),
                        pod: "ns/web-0".into(),
                        version,
                        capabilities: push::Capabilities::ALL.header_value(),
                    }
                );
            }

            /// Pushes `yaml` as version `version` and returns the reply.
            async fn push(&mut self, yaml: &str, version: u64, nonce: &str) -> Reply {
                let snapshot = baton_config::yaml::parse(yaml).unwrap();
                let parts = framed::push_parts(&SharedPush {
                    version,
                    nonce: nonce.into(),
                    kind: ConfigKind::Snapshot,
                    json: SharedPush::snapshot_json(&snapshot),
                });
                self.send(&parts.concat()).await;
                framed::json("REPLY", &self.expect(Kind::Reply).await).unwrap()
            }
        }

        fn store() -> (Arc<ConfigStore>, Arc<Metrics>) {
            let metrics = Arc::new(Metrics::new());
            let snapshot = baton_config::yaml::parse(CONFIG).unwrap();
            let store = Arc::new(ConfigStore::new(&snapshot, metrics.clone()).unwrap());
            (store, metrics)
        }

        /// The sidecar's side of one test: a fresh store, metrics and link.
        struct Client {
            store: Arc<ConfigStore>,
            metrics: Arc<Metrics>,
            link: OperatorLink,
            applied_any: bool,
        }

        impl Client {
            fn new() -> Client {
                let (store, metrics) = store();
                Client {
                    store,
                    metrics,
                    link: OperatorLink::default(),
                    applied_any: false,
                }
            }

            /// One `stream_once` against `operator` while `script` plays
            /// the operator's side; both bounded by [`PATIENCE`].
            async fn run<T>(
                &mut self,
                operator: &Operator,
                certificate: Option<watch::Receiver<Option<String>>>,
                silence: Duration,
                script: impl std::future::Future<Output = T>,
            ) -> (Result<(), StreamError>, T) {
                let client = stream_once(
                    &operator.cfg,
                    &self.store,
                    &self.metrics,
                    &mut self.applied_any,
                    certificate,
                    &self.link,
                    silence,
                );
                tokio::time::timeout(PATIENCE, async { tokio::join!(client, script) })
                    .await
                    .expect("the scripted stream ends in time")
            }
        }

        /// Waits until the link holds a framed stream's handle.
        async fn framed_handle(link: &OperatorLink) -> tokio::sync::mpsc::Sender<SignJob> {
            loop {
                if let Some(Held::Framed(jobs)) = link.held() {
                    return jobs;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }

        #[tokio::test]
        async fn the_framed_stream_says_hello_applies_pushes_answers_pings_and_carries_certificate_requests()
         {
            let operator = Operator::start(&[framed::ALPN, b"h2"]).await;
            let mut client = Client::new();
            let (link, metrics) = (client.link.clone(), client.metrics.clone());
            let (sign_now, signing) = oneshot::channel::<()>();

            let script = async {
                let mut peer = Peer::accept(&operator).await;
                peer.hello(1).await;
                peer.send(&framed::encode(Kind::Open, &[])).await;
                let reply = peer
                    .push(&CONFIG.replace("version: 1", "version: 2"), 2, "n2")
                    .await;
                assert_eq!(
                    reply,
                    Reply::Ack {
                        nonce: "n2".into(),
                        version: 2
                    }
                );
                // A kind this build does not know is skipped after OPEN.
                peer.send(&[0, 0, 0, 2, 99, 0]).await;
                peer.send(&framed::encode(Kind::Ping, &[])).await;
                assert!(peer.expect(Kind::Pong).await.is_empty());

                sign_now.send(()).unwrap();
                let sign = framed::Sign::decode(peer.expect(Kind::Sign).await).unwrap();
                assert_eq!(sign.token, "fresh-token");
                assert_eq!(&sign.request[..], b"{\"csr\":\"pem\"}");
                let signed = framed::Signed {
                    id: sign.id,
                    status: 200,
                    body: Bytes::from_static(b"{\"certificateChain\":\"...\"}"),
                };
                peer.send(&signed.encode()).await;
                // A refused push is NACKed and keeps the serving config.
                let reply = peer
                    .push(
                        "version: 3\nroutes: [{name: r, backends: [{cluster: missing}]}]\n",
                        3,
                        "n3",
                    )
                    .await;
                assert!(
                    matches!(&reply, Reply::Nack { nonce, .. } if nonce == "n3"),
                    "{reply:?}"
                );
                // Closing ends the stream as the HTTP/2 one ends.
                peer.tls.shutdown().await.unwrap();
            };
            let signer = async {
                signing.await.unwrap();
                let jobs = framed_handle(&link).await;
                assert_eq!(metrics.control_connected.get(), 1);
                let (job, answer) =
                    SignJob::new("fresh-token", Bytes::from_static(b"{\"csr\":\"pem\"}"));
                jobs.send(job).await.unwrap();
                answer.await.unwrap().unwrap()
            };
            let (result, ((), signed)) = client
                .run(&operator, None, framed::SILENCE_LIMIT, async {
                    tokio::join!(script, signer)
                })
                .await;

            assert!(matches!(result, Err(StreamError::Closed)), "{result:?}");
            assert!(client.applied_any);
            assert_eq!(
                client.store.version(),
                2,
                "the NACKed version 3 did not replace 2"
            );
            assert_eq!(
                signed,
                (200, Bytes::from_static(b"{\"certificateChain\":\"...\"}"))
            );
            assert!(link.held().is_none(), "withdrawn when the stream ended");
        }

        #[tokio::test]
        async fn a_refusal_on_the_framed_stream_is_the_refused_error_with_its_status() {
            let operator = Operator::start(&[framed::ALPN]).await;
            let mut client = Client::new();
            let script = async {
                let mut peer = Peer::accept(&operator).await;
                peer.hello(1).await;
                let refused = framed::Refused {
                    status: 403,
                    reason: "Forbidden".into(),
                    message: "the token is not bound to ns/web-0".into(),
                };
                peer.send(&framed::encode_json(Kind::Refused, &refused))
                    .await;
                peer
            };
            let (result, _peer) = client
                .run(&operator, None, framed::SILENCE_LIMIT, script)
                .await;
            match result {
                Err(StreamError::Refused { status, body }) => {
                    assert_eq!(status, 403);
                    assert!(body.contains("not bound to ns/web-0"), "{body}");
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(client.metrics.control_connected.get(), 0);
            assert!(client.link.held().is_none());
        }

        #[tokio::test]
        async fn a_silent_operator_ends_the_framed_stream() {
            let operator = Operator::start(&[framed::ALPN]).await;
            let mut client = Client::new();
            let script = async {
                let mut peer = Peer::accept(&operator).await;
                peer.hello(1).await;
                peer.send(&framed::encode(Kind::Open, &[])).await;
                // Held open, and silent, until the client gives up.
                peer
            };
            let silence = Duration::from_millis(300);
            let (result, _peer) = client.run(&operator, None, silence, script).await;
            assert!(
                matches!(result, Err(StreamError::Silent(d)) if d == silence),
                "{result:?}"
            );
        }

        #[tokio::test]
        async fn frames_meant_for_the_operator_and_unknown_kinds_before_open_end_the_stream() {
            for (before_open, frame) in [
                (false, framed::encode(Kind::Pong, &[])),
                (false, framed::encode(Kind::Hello, b"{}")),
                (true, framed::encode(Kind::Push, b"{}")),
                (true, vec![0, 0, 0, 1, 99]),
            ] {
                let operator = Operator::start(&[framed::ALPN]).await;
                let script = async {
                    let mut peer = Peer::accept(&operator).await;
                    peer.hello(1).await;
                    if !before_open {
                        peer.send(&framed::encode(Kind::Open, &[])).await;
                    }
                    peer.send(&frame).await;
                    peer
                };
                let (result, _peer) = Client::new()
                    .run(&operator, None, framed::SILENCE_LIMIT, script)
                    .await;
                assert!(
                    matches!(result, Err(StreamError::Protocol(_))),
                    "{frame:?}: {result:?}"
                );
            }
        }

        #[tokio::test]
        async fn the_framed_stream_reports_the_held_certificate_once_a_trigger_arrives() {
            let operator = Operator::start(&[framed::ALPN]).await;
            let mut client = Client::new();
            let (held, certificate) = watch::channel(Some("g1".to_string()));
            let script = async {
                let mut peer = Peer::accept(&operator).await;
                peer.hello(1).await;
                peer.send(&framed::encode(Kind::Open, &[])).await;
                let triggered = format!(
                    "{}tls: {{mode: Disabled, reissue: {{generation: g2, spread_ms: 0}}}}\n",
                    CONFIG.replace("version: 1", "version: 2")
                );
                let reply = peer.push(&triggered, 2, "n2").await;
                assert!(matches!(reply, Reply::Ack { version: 2, .. }), "{reply:?}");
                let report: Reply = framed::json("REPLY", &peer.expect(Kind::Reply).await).unwrap();
                assert_eq!(
                    report,
                    Reply::Certificate {
                        generation: "g1".into()
                    }
                );
                held.send_replace(Some("g2".into()));
                let report: Reply = framed::json("REPLY", &peer.expect(Kind::Reply).await).unwrap();
                assert_eq!(
                    report,
                    Reply::Certificate {
                        generation: "g2".into()
                    }
                );
                peer.tls.shutdown().await.unwrap();
            };
            let (result, ()) = client
                .run(&operator, Some(certificate), framed::SILENCE_LIMIT, script)
                .await;
            assert!(matches!(result, Err(StreamError::Closed)), "{result:?}");
        }

        #[tokio::test]
        async fn an_operator_that_selects_h2_gets_the_http2_stream() {
            use http_body_util::BodyExt;
            use hyper_util::rt::{TokioExecutor, TokioIo};

            let operator = Operator::start(&[b"h2"]).await;
            let mut client = Client::new();
            let server = async {
                let (tls, offered) = operator.accept().await;
                // Offered both, in preference order; h2 was selected.
                assert_eq!(offered, [framed::ALPN.to_vec(), b"h2".to_vec()]);
                assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
                let service = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        assert_eq!(req.uri().path(), push::WATCH_PATH);
                        let header = |name: &str| req.headers()[name].to_str().unwrap().to_owned();
                        assert_eq!(header("authorization"), "Bearer t0k");
                        assert_eq!(header(push::POD_HEADER), "ns/web-0");
                        assert_eq!(header(push::VERSION_HEADER), "1");
                        let body = http_body_util::Full::new(Bytes::from_static(
                            b"{\"reason\":\"Forbidden\"}",
                        ));
                        Ok::<_, std::convert::Infallible>(
                            http::Response::builder()
                                .status(403)
                                .body(body.map_err(|e| match e {}).boxed())
                                .unwrap(),
                        )
                    },
                );
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            };
            let stream = stream_once(
                &operator.cfg,
                &client.store,
                &client.metrics,
                &mut client.applied_any,
                None,
                &client.link,
                framed::SILENCE_LIMIT,
            );
            // The server task ends only when the client drops the
            // connection: race them, the client's answer decides.
            let result = tokio::time::timeout(PATIENCE, async {
                tokio::select! {
                    r = stream => r,
                    () = server => panic!("the server ended first"),
                }
            })
            .await
            .unwrap();
            match result {
                Err(StreamError::Refused { status, body }) => {
                    assert_eq!(status, 403);
                    assert_eq!(body, "{\"reason\":\"Forbidden\"}");
                }
                other => panic!("{other:?}"),
            }
        }
    }
}
