//! The config stream client: one HTTP/2 stream over TLS to the operator
//! (wire format in [`baton_config::push`]), applying each pushed snapshot
//! (or delta, applied onto the serving snapshot) through the [`ConfigStore`]
//! and answering ACK or NACK.
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

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use baton_config::push::{self, Decoder, Push, Reply};
use baton_contract as contract;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls_pki_types::ServerName;
use tokio::sync::{mpsc, watch};

use crate::config::store::ConfigStore;
use crate::metrics::Metrics;
use crate::operator_link::{self, OperatorLink};

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
            r = stream_once(&cfg, &store, &metrics, &mut applied_any, certificate.clone(), &link) => r,
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
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// One connection: open the stream, apply pushes until it ends.
async fn stream_once(
    cfg: &ControlConfig,
    store: &ConfigStore,
    metrics: &Metrics,
    applied_any: &mut bool,
    mut certificate: Option<watch::Receiver<Option<String>>>,
    link: &OperatorLink,
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
            format!("Bearer {}", token.trim()),
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
    metrics.control_connected.set(1);
    // Withdrawn when this function returns (the stream is over).
    let _published = link.publish(sender.clone(), &cfg.server_name);
    tracing::info!(operator = %cfg.address, version = store.version(), "config stream open");
    let mut body = resp.into_body();
    let mut decoder = Decoder::default();
    // What this stream was told of the certificate held (a new stream,
    // perhaps to another replica, is told again).
    let mut reported: Option<String> = None;
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
                    let reply = apply(store, push);
                    if matches!(reply, Reply::Ack { .. }) {
                        *applied_any = true;
                    }
                    if replies
                        .send(Bytes::from(push::encode(&reply)))
                        .await
                        .is_err()
                    {
                        return Err(StreamError::Closed);
                    }
                }
            }
            changed = async {
                match certificate.as_mut() {
                    Some(c) => c.changed().await,
                    None => std::future::pending().await,
                }
            } => {
                if changed.is_err() {
                    certificate = None;
                }
            }
        }
        let triggered = store
            .snapshot()
            .tls
            .as_ref()
            .is_some_and(|t| t.reissue.is_some());
        let held = certificate.as_ref().and_then(|c| c.borrow().clone());
        if let Some(generation) =
            certificate_report(triggered, held.as_deref(), reported.as_deref())
        {
            let report = Reply::Certificate {
                generation: generation.clone(),
            };
            if replies
                .send(Bytes::from(push::encode(&report)))
                .await
                .is_err()
            {
                return Err(StreamError::Closed);
            }
            reported = Some(generation);
        }
    }
    Err(StreamError::Closed)
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
}
