//! Client of the operator's identity service: the sidecar's certificate
//! comes from a CSR authenticated with the pod's projected ServiceAccount
//! token.
//!
//! Wire protocol (the server side belongs to the operator; see docs/tls.md):
//!
//! ```text
//! POST <url>
//! Authorization: Bearer <projected token, audience identity.baton.dev>
//! Content-Type: application/json
//! {"csr": "<PEM CERTIFICATE REQUEST with the SPIFFE URI SAN>"}
//!
//! 200 {"certificateChain": "<PEM leaf + intermediates>", "trustBundle": "<PEM roots>"}
//! ```
//!
//! The private key never leaves the process. Renewal happens at 2/3 of the
//! certificate's lifetime, jittered by ±5 % of the lifetime so a fleet that
//! started together does not renew together; failed requests are retried
//! with capped, jittered exponential back-off. The token is re-read on every
//! request because the kubelet rotates it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;

use super::TlsError;
use super::context::TlsContext;
use super::material::{Material, pem_encode};
use super::metrics::TlsMetrics;
use super::settings::{CertSource, KeyType, TlsSettings};
use super::spiffe::SpiffeId;
use crate::operator_link::{Held, OperatorLink, SignJob};

#[derive(Debug, thiserror::Error)]
pub enum IdentityClientError {
    #[error("invalid identity service URL {0:?} (want http(s)://host[:port]/path)")]
    Url(String),
    #[error("read token {path}: {source}")]
    Token {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("CA bundle: {0}")]
    CaBundle(String),
    #[error("key generation / CSR: {0}")]
    Csr(String),
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("http: {0}")]
    Http(String),
    #[error("identity service answered {status}: {body}")]
    Status { status: u16, body: String },
    #[error("invalid response: {0}")]
    Response(String),
    #[error("request timed out")]
    Timeout,
    #[error("the issued certificate does not carry identity {0}")]
    WrongIdentity(SpiffeId),
    #[error("settings: {0}")]
    Settings(String),
}

#[derive(Debug, Serialize, Deserialize)]
pub struct SignRequest {
    pub csr: String,
    /// The trust generation a re-issue trigger named, when that is why this
    /// request is made (the CA's re-issue bucket applies to it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reissue: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SignResponse {
    pub certificate_chain: String,
    pub trust_bundle: String,
    /// The trust generation the certificate was issued under (absent from
    /// an operator before re-issue triggers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trust_generation: Option<String>,
}

/// A certificate from the identity service and the trust generation it was
/// issued under.
#[derive(Debug)]
pub struct Issued {
    pub material: Material,
    pub generation: Option<String>,
}

/// Re-issue attempts for one trust generation before the client falls back
/// to its renewal schedule (a replica that has not re-read the CA yet
/// answers with the previous generation; these cover its reload interval).
pub const REISSUE_ATTEMPTS: u32 = 6;
/// Back-off between re-issue attempts of one generation.
pub const REISSUE_BACKOFF: (Duration, Duration) = (Duration::from_secs(2), Duration::from_secs(30));

/// The next certificate request: how long to wait and whether it is a
/// re-issue (else the renewal). `renewal` is the wait until renewal time;
/// `trigger` the pushed re-issue trigger, `held` the generation of the
/// certificate held, `attempts` the re-issue attempts already made for the
/// trigger's generation, `jitter01 ∈ [0, 1)`. The first attempt waits a
/// uniform share of the trigger's spread, later ones back off. Pure.
pub fn next_request(
    renewal: Duration,
    trigger: Option<&baton_config::tls::Reissue>,
    held: Option<&str>,
    attempts: u32,
    jitter01: f64,
) -> (Duration, bool) {
    match trigger {
        Some(t) if t.wanted(held) && attempts < REISSUE_ATTEMPTS => {
            let wait = if attempts == 0 {
                t.delay(jitter01)
            } else {
                backoff(attempts - 1, REISSUE_BACKOFF.0, REISSUE_BACKOFF.1, jitter01)
            };
            if wait < renewal {
                (wait, true)
            } else {
                (renewal, false)
            }
        }
        _ => (renewal, false),
    }
}

/// Bounded retry schedule for one issuance round.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub attempts: u32,
    pub base: Duration,
    pub max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 8,
            base: Duration::from_millis(200),
            max: Duration::from_secs(30),
        }
    }
}

/// Delay before retry `attempt` (0-based): `base·2^attempt` capped at `max`,
/// scaled by `jitter01 ∈ [0,1)` into [50 %, 100 %] ("equal jitter"). Pure.
pub fn backoff(attempt: u32, base: Duration, max: Duration, jitter01: f64) -> Duration {
    let exp = base.saturating_mul(1u32 << attempt.min(20)).min(max);
    exp.mul_f64(0.5 + 0.5 * jitter01.clamp(0.0, 1.0))
}

/// Time to wait before renewing a certificate valid in
/// `[not_before, not_after]`: at 2/3 of its lifetime, shifted by
/// `jitter ∈ [-1,1]` × 5 % of the lifetime; never negative. Pure.
pub fn renewal_delay(
    not_before: SystemTime,
    not_after: SystemTime,
    now: SystemTime,
    jitter: f64,
) -> Duration {
    let lifetime = not_after
        .duration_since(not_before)
        .unwrap_or(Duration::ZERO);
    let base = lifetime.mul_f64(2.0 / 3.0);
    let shift = lifetime.mul_f64(0.05 * jitter.abs().min(1.0));
    let offset = if jitter >= 0.0 {
        base + shift
    } else {
        base.saturating_sub(shift)
    };
    let at = not_before + offset;
    at.duration_since(now).unwrap_or(Duration::ZERO)
}

/// Talks to the identity service.
#[derive(Debug, Clone)]
pub struct IdentityClient {
    uri: http::Uri,
    https: Option<Arc<rustls::ClientConfig>>,
    /// The roots of `ca_bundle`, kept so [`IdentityClient::trust_also`] can
    /// rebuild `https` with the mesh bundle the sidecar holds added.
    configured_roots: Vec<CertificateDer<'static>>,
    /// Where the newest bundle the service sent is kept for the Pod's
    /// other and later sidecar processes ([`super::trust_state`]).
    trust_state: Option<PathBuf>,
    token_path: PathBuf,
    identity: SpiffeId,
    key_type: KeyType,
    timeout: Duration,
    /// The config stream's connection to the operator, tried first
    /// ([`crate::operator_link`], decision 0056).
    link: Option<OperatorLink>,
}

impl IdentityClient {
    pub fn new(
        url: &str,
        ca_bundle: Option<&Path>,
        token_path: Option<PathBuf>,
        identity: SpiffeId,
        key_type: KeyType,
    ) -> Result<Self, IdentityClientError> {
        let uri: http::Uri = url
            .parse()
            .map_err(|_| IdentityClientError::Url(url.to_string()))?;
        if uri.host().is_none() {
            return Err(IdentityClientError::Url(url.to_string()));
        }
        let (https, configured_roots) = match uri.scheme_str() {
            Some("http") => (None, Vec::new()),
            Some("https") => {
                let path = ca_bundle
                    .ok_or_else(|| IdentityClientError::CaBundle("https needs ca_bundle".into()))?;
                let pem = std::fs::read(path).map_err(|e| {
                    IdentityClientError::CaBundle(format!("{}: {e}", path.display()))
                })?;
                use rustls_pki_types::pem::PemObject;
                let roots = CertificateDer::pem_slice_iter(&pem)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| IdentityClientError::CaBundle(e.to_string()))?;
                (Some(https_config(&roots, &[])?), roots)
            }
            _ => return Err(IdentityClientError::Url(url.to_string())),
        };
        Ok(IdentityClient {
            uri,
            https,
            configured_roots,
            trust_state: None,
            token_path: token_path.unwrap_or_else(|| {
                Path::new(baton_contract::volumes::TOKEN_MOUNT_PATH)
                    .join(baton_contract::volumes::TOKEN_FILE)
            }),
            identity,
            key_type,
            timeout: Duration::from_secs(10),
            link: None,
        })
    }

    /// Also trusts the bundle kept at `path` (missing: nothing kept yet) for
    /// the identity endpoint, and keeps there the bundle of every
    /// certificate issued from now on ([`super::trust_state`]).
    pub fn with_trust_state(mut self, path: Option<PathBuf>) -> Result<Self, IdentityClientError> {
        if let (Some(path), Some(_)) = (&path, &self.https) {
            self.configured_roots = super::trust_state::union(
                std::mem::take(&mut self.configured_roots),
                super::trust_state::kept(path),
            );
            self.https = Some(https_config(&self.configured_roots, &[])?);
        }
        self.trust_state = path;
        Ok(self)
    }

    /// From the `identity_service` source of the settings, keeping the
    /// trust bundle where `BATON_TRUST_STATE` says (injected slots).
    pub fn from_settings(settings: &TlsSettings) -> Result<Self, IdentityClientError> {
        let Some(CertSource::IdentityService {
            url,
            ca_bundle,
            token_path,
            key_type,
        }) = &settings.source
        else {
            return Err(IdentityClientError::Settings(
                "source is not identity_service".into(),
            ));
        };
        let local =
            settings.identity.local.as_deref().ok_or_else(|| {
                IdentityClientError::Settings("identity.local is required".into())
            })?;
        let identity = local
            .parse()
            .map_err(|e| IdentityClientError::Settings(format!("identity.local: {e}")))?;
        IdentityClient::new(
            url,
            ca_bundle.as_deref(),
            token_path.clone(),
            identity,
            *key_type,
        )?
        .with_trust_state(super::trust_state::path_from_env())
    }

    /// Also trusts `bundle` — the mesh roots this sidecar holds now, which
    /// came with its last certificate — for the identity endpoint.
    ///
    /// The endpoint's serving certificate is issued by the mesh CA, so after
    /// a root rotation's "issue from the new root" step it chains to a root
    /// that the `ca_bundle` file mounted at start may not contain; the
    /// bundle received with the previous certificate does (rotation step 1
    /// put both roots in it). Without this a rotated mesh could not renew.
    pub fn trust_also(
        &mut self,
        bundle: &[CertificateDer<'static>],
    ) -> Result<(), IdentityClientError> {
        if self.https.is_some() {
            self.https = Some(https_config(&self.configured_roots, bundle)?);
        }
        Ok(())
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sends requests on the config stream's connection while it is open
    /// (decision 0056), else on a connection of its own.
    pub fn with_link(mut self, link: OperatorLink) -> Self {
        self.link = Some(link);
        self
    }

    pub fn identity(&self) -> &SpiffeId {
        &self.identity
    }

    /// Generates a fresh key and CSR (PEM). Pure apart from randomness.
    pub fn make_csr(&self) -> Result<(PrivateKeyDer<'static>, String), IdentityClientError> {
        let csr_err = |e: String| IdentityClientError::Csr(e);
        let kp = match self.key_type {
            KeyType::EcdsaP256 => rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256),
            KeyType::EcdsaP384 => rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384),
            KeyType::Rsa2048 | KeyType::Rsa3072 => {
                // ring cannot generate RSA keys; OpenSSL can.
                let bits = if self.key_type == KeyType::Rsa2048 {
                    2048
                } else {
                    3072
                };
                let pem = openssl::rsa::Rsa::generate(bits)
                    .and_then(openssl::pkey::PKey::from_rsa)
                    .and_then(|k| k.private_key_to_pem_pkcs8())
                    .map_err(|e| csr_err(e.to_string()))?;
                rcgen::KeyPair::from_pem(&String::from_utf8_lossy(&pem))
            }
        }
        .map_err(|e| csr_err(e.to_string()))?;
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name.push(
            rcgen::DnType::CommonName,
            self.identity.service_account.clone(),
        );
        params.subject_alt_names = vec![rcgen::SanType::URI(
            self.identity
                .to_string()
                .try_into()
                .map_err(|e: rcgen::Error| csr_err(e.to_string()))?,
        )];
        let csr = params
            .serialize_request(&kp)
            .and_then(|c| c.pem())
            .map_err(|e| csr_err(e.to_string()))?;
        Ok((PrivateKeyDer::Pkcs8(kp.serialize_der().into()), csr))
    }

    /// One issuance attempt: key, CSR, POST, validate.
    pub async fn issue(&self) -> Result<Material, IdentityClientError> {
        self.issue_tagged(None).await.map(|i| i.material)
    }

    /// [`IdentityClient::issue`], with the trust generation the answer
    /// names; `reissue`: the generation a re-issue trigger named, when that
    /// is why this request is made.
    pub async fn issue_tagged(&self, reissue: Option<&str>) -> Result<Issued, IdentityClientError> {
        let token = std::fs::read_to_string(&self.token_path).map_err(|source| {
            IdentityClientError::Token {
                path: self.token_path.clone(),
                source,
            }
        })?;
        let (key, csr) = self.make_csr()?;
        let body = serde_json::to_vec(&SignRequest {
            csr,
            reissue: reissue.map(str::to_owned),
        })
        .expect("serializable");
        let (status, resp) = tokio::time::timeout(self.timeout, self.post(body, token.trim()))
            .await
            .map_err(|_| IdentityClientError::Timeout)??;
        if status != 200 {
            return Err(IdentityClientError::Status {
                status,
                body: String::from_utf8_lossy(&resp[..resp.len().min(512)]).into_owned(),
            });
        }
        let r: SignResponse = serde_json::from_slice(&resp)
            .map_err(|e| IdentityClientError::Response(e.to_string()))?;
        let key_pem = {
            // Material::from_pem wants PEM for all three parts.
            let PrivateKeyDer::Pkcs8(k) = &key else {
                unreachable!("make_csr returns PKCS#8")
            };
            pem_encode("PRIVATE KEY", k.secret_pkcs8_der())
        };
        let material = Material::from_pem(
            r.certificate_chain.as_bytes(),
            key_pem.as_bytes(),
            r.trust_bundle.as_bytes(),
        )
        .map_err(|e| IdentityClientError::Response(e.to_string()))?;
        if material.identity().as_ref() != Some(&self.identity) {
            return Err(IdentityClientError::WrongIdentity(self.identity.clone()));
        }
        if let Some(path) = &self.trust_state
            && let Err(error) = super::trust_state::keep(path, &r.trust_bundle)
        {
            // The certificate is good; only a later process loses the
            // newest roots (it still has the injected ones).
            tracing::warn!(%error, path = %path.display(), "trust bundle not kept for the next sidecar process");
        }
        Ok(Issued {
            material,
            generation: r.trust_generation,
        })
    }

    /// Up to `policy.attempts` attempts with jittered back-off.
    pub async fn issue_with_retries(
        &self,
        policy: RetryPolicy,
    ) -> Result<Material, IdentityClientError> {
        self.issue_tagged_with_retries(policy)
            .await
            .map(|i| i.material)
    }

    /// [`IdentityClient::issue_with_retries`] with the trust generation.
    pub async fn issue_tagged_with_retries(
        &self,
        policy: RetryPolicy,
    ) -> Result<Issued, IdentityClientError> {
        let mut attempt = 0;
        loop {
            match self.issue_tagged(None).await {
                Ok(m) => return Ok(m),
                Err(e) if attempt + 1 >= policy.attempts => return Err(e),
                Err(e) => {
                    let delay = backoff(attempt, policy.base, policy.max, rand::random::<f64>());
                    tracing::warn!(error = %e, attempt, ?delay, "certificate request failed; retrying");
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
            }
        }
    }

    /// Renews for as long as `ctx` lives and `stop` stays false, and asks
    /// early when `trigger` names a trust generation other than the one the
    /// held certificate came with (published on `held`). Each round trusts
    /// the endpoint with the bundle the context holds then.
    pub async fn run(
        mut self,
        ctx: std::sync::Weak<TlsContext>,
        mut stop: tokio::sync::watch::Receiver<bool>,
        policy: RetryPolicy,
        mut trigger: tokio::sync::watch::Receiver<Option<baton_config::tls::Reissue>>,
        held: Arc<tokio::sync::watch::Sender<Option<String>>>,
    ) {
        let mut failures = 0u32;
        // Re-issue attempts made for the generation named here.
        let mut attempts = (None::<String>, 0u32);
        let mut trigger_open = true;
        loop {
            let Some(current) = ctx.upgrade() else { return };
            let validity = current.current_validity();
            drop(current);
            let renewal = match validity {
                Some((nb, na)) if failures == 0 => {
                    renewal_delay(nb, na, SystemTime::now(), rand::random::<f64>() * 2.0 - 1.0)
                }
                _ => backoff(failures, policy.base, policy.max, rand::random::<f64>()),
            };
            let pushed = trigger.borrow_and_update().clone();
            let generation = pushed.as_ref().map(|t| t.generation.clone());
            if attempts.0 != generation {
                attempts = (generation, 0);
            }
            let held_now = held.borrow().clone();
            let (delay, reissue) = next_request(
                renewal,
                pushed.as_ref(),
                held_now.as_deref(),
                attempts.1,
                rand::random::<f64>(),
            );
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                r = stop.wait_for(|s| *s) => { let _ = r; return; }
                r = trigger.changed(), if trigger_open => {
                    // A closed channel (no config stream, plain `bootstrap`)
                    // leaves renewal alone; a new trigger: wait again, from
                    // its spread.
                    trigger_open = r.is_ok();
                    continue;
                }
            }
            if let Some(current) = ctx.upgrade()
                && let Err(e) = self.trust_also(&current.material().trust_bundle)
            {
                tracing::warn!(error = %e, "held trust bundle not usable for the identity endpoint");
            }
            let result = if reissue {
                attempts.1 += 1;
                let asked = attempts.0.clone();
                let r = self.issue_tagged(asked.as_deref()).await;
                if let Err(e) = &r {
                    tracing::warn!(error = %e, attempt = attempts.1, "certificate re-issue failed; keeping the current certificate");
                }
                match r {
                    Ok(i) => Ok(i),
                    // The renewal schedule is unaffected by a failed
                    // re-issue: the held certificate is still valid.
                    Err(_) => continue,
                }
            } else {
                self.issue_tagged_with_retries(policy).await
            };
            match result {
                Ok(issued) => {
                    let Some(ctx) = ctx.upgrade() else { return };
                    match ctx.update_material(issued.material) {
                        Ok(material_generation) => {
                            failures = 0;
                            tracing::info!(
                                generation = material_generation,
                                trust_generation = issued.generation.as_deref().unwrap_or("-"),
                                reissue,
                                identity = %self.identity,
                                "certificate renewed"
                            );
                            held.send_replace(issued.generation);
                        }
                        Err(e) => {
                            failures += 1;
                            tracing::error!(error = %e, "renewed certificate refused");
                        }
                    }
                }
                Err(e) => {
                    failures += 1;
                    tracing::error!(error = %e, "certificate renewal failed; keeping the current certificate");
                }
            }
        }
    }

    /// POSTs a request: on the config stream's connection when one is
    /// open (an HTTP/2 stream, or a SIGN frame on the framed transport),
    /// else (or when that fails, or the operator there does not answer
    /// this path: one from before decision 0056 says 404) on a new
    /// connection.
    async fn post(&self, body: Vec<u8>, token: &str) -> Result<(u16, Bytes), IdentityClientError> {
        if let Some(held) = self.link.as_ref().and_then(OperatorLink::held) {
            let path = self.uri.path_and_query().map_or("/", |p| p.as_str());
            // Half the budget: the rest is for the new connection.
            let held = tokio::time::timeout(self.timeout / 2, async {
                match held {
                    Held::Http2 { sender, origin } => {
                        post_held(sender, &origin, path, body.clone(), token).await
                    }
                    Held::Framed(jobs) => sign_framed(&jobs, body.clone(), token).await,
                }
            })
            .await;
            match held {
                Ok(Ok((404, _))) => {
                    tracing::debug!(
                        "the operator's config endpoint does not sign; using the identity endpoint"
                    )
                }
                Ok(Ok(answer)) => return Ok(answer),
                Ok(Err(error)) => {
                    tracing::debug!(%error, "certificate request on the config stream's connection failed; using a new connection")
                }
                Err(_) => {
                    tracing::debug!(
                        "certificate request on the config stream's connection timed out; using a new connection"
                    )
                }
            }
        }
        self.post_new(body, token).await
    }

    /// POSTs on a connection of its own (HTTP/1.1, TLS when `https`).
    async fn post_new(
        &self,
        body: Vec<u8>,
        token: &str,
    ) -> Result<(u16, Bytes), IdentityClientError> {
        let host = self
            .uri
            .host()
            .unwrap_or_default()
            .trim_matches(|c| c == '[' || c == ']');
        let port = self
            .uri
            .port_u16()
            .unwrap_or(if self.https.is_some() { 443 } else { 80 });
        let tcp = TcpStream::connect((host, port))
            .await
            .map_err(IdentityClientError::Connect)?;
        let authority = self
            .uri
            .authority()
            .map(|a| a.as_str().to_string())
            .unwrap_or_default();
        let req = http::Request::post(self.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/"))
            .header(http::header::HOST, authority)
            .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| IdentityClientError::Http(e.to_string()))?;
        match &self.https {
            None => send(TokioIo::new(tcp), req).await,
            Some(cfg) => {
                let name = ServerName::try_from(host.to_string())
                    .map_err(|e| IdentityClientError::Url(e.to_string()))?;
                let tls = tokio_rustls::TlsConnector::from(cfg.clone())
                    .connect(name, tcp)
                    .await
                    .map_err(IdentityClientError::Connect)?;
                send(TokioIo::new(tls), req).await
            }
        }
    }
}

/// Client TLS for the identity endpoint: server authentication against
/// `configured` ∪ `held` (duplicates are harmless), no client certificate.
fn https_config(
    configured: &[CertificateDer<'static>],
    held: &[CertificateDer<'static>],
) -> Result<Arc<rustls::ClientConfig>, IdentityClientError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in configured.iter().chain(held) {
        roots
            .add(c.clone())
            .map_err(|e| IdentityClientError::CaBundle(e.to_string()))?;
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| IdentityClientError::CaBundle(e.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(cfg))
}

async fn send<IO>(
    io: IO,
    req: http::Request<Full<Bytes>>,
) -> Result<(u16, Bytes), IdentityClientError>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let http = |e: hyper::Error| IdentityClientError::Http(e.to_string());
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(http)?;
    // The connection task ends when `sender` is dropped.
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let resp = sender.send_request(req).await.map_err(http)?;
    read_answer(resp).await
}

/// One request as a new HTTP/2 stream on the operator connection the
/// config stream holds: no TCP or TLS handshake.
async fn post_held(
    mut sender: hyper::client::conn::http2::SendRequest<crate::operator_link::Body>,
    origin: &str,
    path: &str,
    body: Vec<u8>,
    token: &str,
) -> Result<(u16, Bytes), IdentityClientError> {
    let http = |e: hyper::Error| IdentityClientError::Http(e.to_string());
    let req = http::Request::post(format!("{origin}{path}"))
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)).boxed_unsync())
        .map_err(|e| IdentityClientError::Http(e.to_string()))?;
    sender.ready().await.map_err(http)?;
    let resp = sender.send_request(req).await.map_err(http)?;
    read_answer(resp).await
}

/// One request as a SIGN frame on the framed config stream the sidecar
/// holds, answered by the stream's task when SIGNED arrives. A stream that
/// ends first drops the job: an error, and the caller falls back.
async fn sign_framed(
    jobs: &tokio::sync::mpsc::Sender<SignJob>,
    body: Vec<u8>,
    token: &str,
) -> Result<(u16, Bytes), IdentityClientError> {
    let ended = || IdentityClientError::Http("the config stream ended".into());
    let (job, answer) = SignJob::new(token, Bytes::from(body));
    jobs.send(job).await.map_err(|_| ended())?;
    answer
        .await
        .map_err(|_| ended())?
        .map_err(IdentityClientError::Http)
}

/// The status and body (at most 1 MiB: answers are a few KiB).
async fn read_answer(
    resp: http::Response<hyper::body::Incoming>,
) -> Result<(u16, Bytes), IdentityClientError> {
    let status = resp.status().as_u16();
    let body = http_body_util::Limited::new(resp.into_body(), 1 << 20)
        .collect()
        .await
        .map_err(|e| IdentityClientError::Http(e.to_string()))?
        .to_bytes();
    Ok((status, body))
}

/// Identity-service start: select the offload engine, obtain the first
/// certificate (with retries), build the context, and spawn the renewal
/// task (stopped by `stop` or when the context is dropped).
pub async fn bootstrap(
    settings: &TlsSettings,
    metrics: TlsMetrics,
    stop: tokio::sync::watch::Receiver<bool>,
    policy: RetryPolicy,
) -> Result<Arc<TlsContext>, TlsError> {
    let (_trigger, trigger) = tokio::sync::watch::channel(None);
    let held = Arc::new(tokio::sync::watch::channel(None).0);
    bootstrap_with(
        settings,
        metrics,
        stop,
        policy,
        trigger,
        held,
        OperatorLink::default(),
    )
    .await
}

/// [`bootstrap`], following `trigger` (the pushed re-issue trigger),
/// publishing the held certificate's trust generation on `held`, and
/// sending requests on the config stream's connection while `link` holds
/// one.
pub async fn bootstrap_with(
    settings: &TlsSettings,
    metrics: TlsMetrics,
    stop: tokio::sync::watch::Receiver<bool>,
    policy: RetryPolicy,
    trigger: tokio::sync::watch::Receiver<Option<baton_config::tls::Reissue>>,
    held: Arc<tokio::sync::watch::Sender<Option<String>>>,
    link: OperatorLink,
) -> Result<Arc<TlsContext>, TlsError> {
    let client = IdentityClient::from_settings(settings)
        .map_err(|e| TlsError::Io(std::io::Error::other(e)))?
        .with_link(link);
    let issued = client
        .issue_tagged_with_retries(policy)
        .await
        .map_err(|e| TlsError::Io(std::io::Error::other(e)))?;
    let ctx = TlsContext::with_selected_offload(settings, issued.material, metrics)?;
    held.send_replace(issued.generation);
    tokio::spawn(client.run(Arc::downgrade(&ctx), stop, policy, trigger, held));
    Ok(ctx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_is_at_two_thirds_of_the_lifetime_without_jitter() {
        let nb = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let na = nb + Duration::from_secs(300);
        assert_eq!(renewal_delay(nb, na, nb, 0.0), Duration::from_secs(200));
        assert_eq!(
            renewal_delay(nb, na, nb + Duration::from_secs(50), 0.0),
            Duration::from_secs(150)
        );
    }

    #[test]
    fn renewal_jitter_stays_within_five_percent_of_the_lifetime() {
        let nb = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let na = nb + Duration::from_secs(1000);
        let lo = renewal_delay(nb, na, nb, -1.0).as_secs_f64();
        let hi = renewal_delay(nb, na, nb, 1.0).as_secs_f64();
        assert!((lo - (666.666 - 50.0)).abs() < 0.01, "{lo}");
        assert!((hi - (666.666 + 50.0)).abs() < 0.01, "{hi}");
    }

    #[test]
    fn an_overdue_certificate_renews_immediately() {
        let nb = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let na = nb + Duration::from_secs(30);
        assert_eq!(
            renewal_delay(nb, na, na + Duration::from_secs(5), 0.3),
            Duration::ZERO
        );
    }

    fn trigger(generation: &str, spread_secs: u64) -> baton_config::tls::Reissue {
        baton_config::tls::Reissue {
            generation: generation.into(),
            spread_ms: spread_secs * 1000,
        }
    }

    #[test]
    fn a_new_trust_generation_asks_within_its_spread_before_renewal_time() {
        let renewal = Duration::from_secs(3600);
        let t = trigger("g2", 20);
        assert_eq!(
            next_request(renewal, Some(&t), Some("g1"), 0, 0.5),
            (Duration::from_secs(10), true)
        );
        assert_eq!(
            next_request(renewal, Some(&t), Some("g1"), 0, 0.0),
            (Duration::ZERO, true)
        );
    }

    #[test]
    fn the_current_generation_or_no_trigger_leaves_the_renewal_schedule_alone() {
        let renewal = Duration::from_secs(3600);
        let t = trigger("g2", 20);
        for (trigger, held) in [
            (Some(&t), Some("g2")),
            (None, Some("g1")),
            // An operator from before trust generations names none.
            (Some(&t), None),
        ] {
            assert_eq!(
                next_request(renewal, trigger, held, 0, 0.5),
                (renewal, false),
                "{trigger:?} {held:?}"
            );
        }
    }

    #[test]
    fn re_issue_attempts_back_off_and_stop_at_the_limit() {
        let renewal = Duration::from_secs(3600);
        let t = trigger("g2", 20);
        // A replica still on g1 answered: the next attempt backs off.
        assert_eq!(
            next_request(renewal, Some(&t), Some("g1"), 1, 1.0),
            (REISSUE_BACKOFF.0, true)
        );
        assert_eq!(
            next_request(renewal, Some(&t), Some("g1"), 3, 1.0),
            (REISSUE_BACKOFF.0 * 4, true)
        );
        assert_eq!(
            next_request(renewal, Some(&t), Some("g1"), REISSUE_ATTEMPTS, 1.0),
            (renewal, false),
            "past the limit only renewal time asks"
        );
    }

    #[test]
    fn renewal_due_sooner_than_the_re_issue_is_a_renewal() {
        let t = trigger("g2", 60);
        assert_eq!(
            next_request(Duration::from_secs(5), Some(&t), Some("g1"), 0, 0.5),
            (Duration::from_secs(5), false)
        );
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let b = Duration::from_millis(100);
        let m = Duration::from_secs(2);
        assert_eq!(backoff(0, b, m, 1.0), Duration::from_millis(100));
        assert_eq!(backoff(3, b, m, 1.0), Duration::from_millis(800));
        assert_eq!(backoff(10, b, m, 1.0), m);
        assert_eq!(backoff(30, b, m, 0.0), m / 2);
    }

    #[test]
    fn the_csr_carries_the_spiffe_identity_for_every_key_type() {
        for kt in [KeyType::EcdsaP256, KeyType::EcdsaP384, KeyType::Rsa2048] {
            let c = IdentityClient::new(
                "http://127.0.0.1:1/sign",
                None,
                Some("/nonexistent".into()),
                "spiffe://td/ns/n/sa/s".parse().unwrap(),
                kt,
            )
            .unwrap();
            let (_key, pem) = c.make_csr().unwrap();
            let parsed = rcgen::CertificateSigningRequestParams::from_pem(&pem).unwrap();
            assert!(
                parsed.params.subject_alt_names.iter().any(|s| matches!(
                    s, rcgen::SanType::URI(u) if u.as_str() == "spiffe://td/ns/n/sa/s"
                )),
                "{kt:?}"
            );
        }
    }

    #[test]
    fn pem_encoding_round_trips_through_the_pem_parser() {
        use rustls_pki_types::pem::PemObject;
        let kp = rcgen::KeyPair::generate().unwrap();
        let der = kp.serialize_der();
        let pem = pem_encode("PRIVATE KEY", &der);
        let back = PrivateKeyDer::from_pem_slice(pem.as_bytes()).unwrap();
        assert_eq!(back.secret_der(), der.as_slice());
    }

    #[test]
    fn non_http_urls_are_refused() {
        let id: SpiffeId = "spiffe://td/ns/n/sa/s".parse().unwrap();
        assert!(
            IdentityClient::new("ftp://x/y", None, None, id.clone(), KeyType::EcdsaP256).is_err()
        );
        assert!(IdentityClient::new("https://x/y", None, None, id, KeyType::EcdsaP256).is_err());
    }

    /// A client whose link holds a framed stream's queue (`rx`), published
    /// while the returned guard lives.
    fn client_with_framed_link() -> (
        IdentityClient,
        tokio::sync::mpsc::Receiver<SignJob>,
        crate::operator_link::Published,
    ) {
        let link = OperatorLink::default();
        let (jobs, rx) = tokio::sync::mpsc::channel(1);
        let published = link.publish_framed(jobs);
        // Nothing listens on port 1: a fallback fails to connect.
        let client = IdentityClient::new(
            "http://127.0.0.1:1/sign",
            None,
            Some("/nonexistent".into()),
            "spiffe://td/ns/n/sa/s".parse().unwrap(),
            KeyType::EcdsaP256,
        )
        .unwrap()
        .with_timeout(Duration::from_secs(2))
        .with_link(link);
        (client, rx, published)
    }

    #[tokio::test]
    async fn a_request_goes_as_a_sign_job_on_a_framed_stream_and_returns_its_answer() {
        let (client, mut jobs, _published) = client_with_framed_link();
        let stream = async {
            let job = jobs.recv().await.unwrap();
            assert_eq!(job.token, "tok");
            assert_eq!(&job.request[..], b"{\"csr\":\"x\"}");
            job.answer
                .send(Ok((200, Bytes::from_static(b"signed"))))
                .unwrap();
        };
        let (answer, ()) = tokio::join!(client.post(b"{\"csr\":\"x\"}".to_vec(), "tok"), stream);
        assert_eq!(answer.unwrap(), (200, Bytes::from_static(b"signed")));
    }

    #[tokio::test]
    async fn a_framed_stream_that_ends_before_answering_falls_back_to_a_new_connection() {
        let (client, mut jobs, _published) = client_with_framed_link();
        let stream = async {
            // The stream ended: its pending requests are dropped.
            drop(jobs.recv().await.unwrap());
        };
        let (answer, ()) = tokio::time::timeout(Duration::from_secs(5), async {
            tokio::join!(client.post(b"{}".to_vec(), "tok"), stream)
        })
        .await
        .unwrap();
        assert!(
            matches!(answer, Err(IdentityClientError::Connect(_))),
            "{answer:?}"
        );
    }

    #[tokio::test]
    async fn a_framed_stream_that_does_not_answer_in_half_the_timeout_is_given_up() {
        let (client, mut jobs, _published) = client_with_framed_link();
        let started = tokio::time::Instant::now();
        let stream = async {
            let job = jobs.recv().await.unwrap();
            // Held, unanswered, until the client has fallen back.
            tokio::time::sleep(Duration::from_secs(3)).await;
            drop(job);
        };
        let answer = tokio::select! {
            a = client.post(b"{}".to_vec(), "tok") => a,
            () = stream => panic!("the client waited for the stream"),
        };
        assert!(
            matches!(answer, Err(IdentityClientError::Connect(_))),
            "{answer:?}"
        );
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(900) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
    }
}
