//! Asynchronous private-key offload.
//!
//! rustls signs synchronously (`Signer::sign` inside `process_new_packets`),
//! so "asynchronous" is achieved one level up: the handshake driver in
//! [`super::stream`] submits each handshake step (`process_new_packets` while
//! handshaking) to the engine's [`CryptoPool`] and awaits the result. The
//! tokio worker that owns the connection keeps serving other connections
//! while the signature (and the key exchange and certificate verification in
//! the same step) runs on a crypto thread. The signature itself is produced
//! by the engine's key ([`EngineKey`]):
//!
//! - `software`: CPU signing on the crypto pool: ring for ECDSA (the code
//!   rustls would run inline), and for RSA libcrypto's built-in software
//!   implementation, which signs RSA-2048 about 1.7× faster than ring on
//!   x86-64 (`bench/sign-speed.sh`); ring when libcrypto cannot load the key
//!   or fails its check signature;
//! - `openssl`: OpenSSL 3 `EVP_PKEY` signing through whatever provider is
//!   loaded (`OPENSSL_CONF`, or `offload.opensslProvider` — Intel's
//!   `qatprovider` on a QAT node; OpenSSL's default provider here).
//!
//! Selection ([`Offload::select`]): mode and engine come from the settings,
//! overridden by `BATON_OFFLOAD_MODE` / `BATON_OFFLOAD_ENGINE` which the
//! webhook sets from the device the operator allocated. An engine must pass a
//! sign-and-verify self test to be used. `Required` without a working engine
//! leaves the sidecar not ready with the reason; `Preferred` falls back to
//! the software pool, counts it and reports it; a signature that fails at
//! run time under `Preferred` is redone in software (counted too), and
//! under `Required` fails its handshake and turns the sidecar not ready
//! with the reason until a self-test passes again ([`RECHECK`]).

use std::fmt;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rustls::sign::{Signer, SigningKey};
use rustls::{SignatureAlgorithm, SignatureScheme};
use rustls_pki_types::PrivateKeyDer;

use super::metrics::{EngineMetrics, TlsMetrics};
pub use super::settings::{EngineKind, OffloadMode, OffloadSettings};

#[derive(Debug, Clone, thiserror::Error)]
pub enum OffloadError {
    #[error("engine {engine} unavailable: {reason}")]
    Unavailable {
        engine: &'static str,
        reason: String,
    },
    #[error("engine {engine} cannot use this key: {reason}")]
    Key {
        engine: &'static str,
        reason: String,
    },
    #[error("engine {engine} failed to sign: {reason}")]
    Sign {
        engine: &'static str,
        reason: String,
    },
    #[error("engine {engine} self-test failed: {reason}")]
    SelfTest {
        engine: &'static str,
        reason: String,
    },
    #[error("crypto worker pool is shut down")]
    PoolClosed,
    #[error("crypto worker lost the job (panicked)")]
    WorkerLost,
}

/// An offload engine: turns a private key into something that signs.
pub trait Engine: Send + Sync + fmt::Debug {
    fn kind(&self) -> EngineKind;
    /// Short name for metrics and logs (`software`, `openssl`, …).
    fn name(&self) -> &'static str {
        self.kind().as_str()
    }
    fn load_key(&self, key: &PrivateKeyDer<'_>) -> Result<Arc<dyn EngineKey>, OffloadError>;
}

/// A private key held by an engine.
pub trait EngineKey: Send + Sync + fmt::Debug {
    fn algorithm(&self) -> SignatureAlgorithm;
    /// Schemes this key can produce, in preference order.
    fn schemes(&self) -> &[SignatureScheme];
    /// Signs `message` (unhashed) with `scheme`; output in TLS wire format.
    fn sign(&self, scheme: SignatureScheme, message: &[u8]) -> Result<Vec<u8>, OffloadError>;
}

/// Every scheme a key may offer, in preference order: these, then RSA's.
const NON_RSA_SCHEMES: &[SignatureScheme] = &[
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ED25519,
];

const RSA_SCHEMES: &[SignatureScheme] = &[
    SignatureScheme::RSA_PSS_SHA512,
    SignatureScheme::RSA_PSS_SHA384,
    SignatureScheme::RSA_PSS_SHA256,
    SignatureScheme::RSA_PKCS1_SHA512,
    SignatureScheme::RSA_PKCS1_SHA384,
    SignatureScheme::RSA_PKCS1_SHA256,
];

// ---------------------------------------------------------------- software

/// CPU signing: ring, except RSA through libcrypto where it works (see the
/// module docs).
#[derive(Debug, Default)]
pub struct SoftwareEngine;

/// Which library signs for a [`SoftwareEngine`] key.
enum SoftwareSigner {
    Ring,
    /// libcrypto, with ring behind it if a signature fails at run time.
    Libcrypto(OpensslKey),
}

struct SoftwareKey {
    signer: SoftwareSigner,
    ring: Arc<dyn SigningKey>,
    schemes: Vec<SignatureScheme>,
}

impl fmt::Debug for SoftwareKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let library = match self.signer {
            SoftwareSigner::Ring => "ring",
            SoftwareSigner::Libcrypto(_) => "libcrypto",
        };
        f.debug_struct("SoftwareKey")
            .field("algorithm", &self.ring.algorithm())
            .field("library", &library)
            .finish()
    }
}

impl Engine for SoftwareEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Software
    }

    fn load_key(&self, key: &PrivateKeyDer<'_>) -> Result<Arc<dyn EngineKey>, OffloadError> {
        let ring_key =
            rustls::crypto::ring::sign::any_supported_type(key).map_err(|e| OffloadError::Key {
                engine: "software",
                reason: e.to_string(),
            })?;
        let schemes: Vec<SignatureScheme> = NON_RSA_SCHEMES
            .iter()
            .chain(RSA_SCHEMES)
            .copied()
            .filter(|s| ring_key.choose_scheme(&[*s]).is_some())
            .collect();
        let signer = if ring_key.algorithm() == SignatureAlgorithm::RSA {
            match libcrypto_rsa(key, &schemes) {
                Ok(k) => SoftwareSigner::Libcrypto(k),
                Err(e) => {
                    tracing::info!(error = %e, "software engine: RSA signs with ring");
                    SoftwareSigner::Ring
                }
            }
        } else {
            SoftwareSigner::Ring
        };
        Ok(Arc::new(SoftwareKey {
            signer,
            ring: ring_key,
            schemes,
        }))
    }
}

/// The RSA key in libcrypto, used only after a PSS and a PKCS#1 signature it
/// made verified with ring (a broken `OPENSSL_CONF` or provider must not
/// break handshakes that ring can sign).
fn libcrypto_rsa(
    key: &PrivateKeyDer<'_>,
    schemes: &[SignatureScheme],
) -> Result<OpensslKey, OffloadError> {
    openssl::init();
    let k = openssl_key("software", key)?;
    let check = |reason: String| OffloadError::SelfTest {
        engine: "software",
        reason,
    };
    let public = k
        .pkey
        .rsa()
        .and_then(|r| r.public_key_to_der_pkcs1())
        .map_err(|e| check(e.to_string()))?;
    let msg = b"baton software engine: libcrypto RSA check";
    // One per padding: the digests are table entries of the same code.
    let checked = [
        SignatureScheme::RSA_PSS_SHA256,
        SignatureScheme::RSA_PKCS1_SHA256,
    ];
    for &scheme in checked.iter().filter(|s| schemes.contains(s)) {
        let alg: &dyn ring::signature::VerificationAlgorithm = match scheme {
            SignatureScheme::RSA_PSS_SHA256 => &ring::signature::RSA_PSS_2048_8192_SHA256,
            _ => &ring::signature::RSA_PKCS1_2048_8192_SHA256,
        };
        let sig = k.sign(scheme, msg)?;
        ring::signature::UnparsedPublicKey::new(alg, &public)
            .verify(msg, &sig)
            .map_err(|_| check(format!("{scheme:?} signature rejected by ring")))?;
    }
    Ok(k)
}

impl EngineKey for SoftwareKey {
    fn algorithm(&self) -> SignatureAlgorithm {
        self.ring.algorithm()
    }

    fn schemes(&self) -> &[SignatureScheme] {
        &self.schemes
    }

    fn sign(&self, scheme: SignatureScheme, message: &[u8]) -> Result<Vec<u8>, OffloadError> {
        let err = |reason: String| OffloadError::Sign {
            engine: "software",
            reason,
        };
        if let SoftwareSigner::Libcrypto(k) = &self.signer {
            match k.sign(scheme, message) {
                Ok(sig) => return Ok(sig),
                Err(e) => {
                    tracing::warn!(error = %e, "software engine: libcrypto failed to sign; signing with ring")
                }
            }
        }
        self.ring
            .choose_scheme(&[scheme])
            .ok_or_else(|| err(format!("scheme {scheme:?} not supported by key")))?
            .sign(message)
            .map_err(|e| err(e.to_string()))
    }
}

// ----------------------------------------------------------------- openssl

/// OpenSSL 3 EVP signing. Holding the provider keeps it loaded.
pub struct OpensslEngine {
    provider: Option<openssl::provider::Provider>,
    provider_name: Option<String>,
}

impl fmt::Debug for OpensslEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpensslEngine")
            .field("provider", &self.provider_name)
            .field("loaded", &self.provider.is_some())
            .finish()
    }
}

impl OpensslEngine {
    /// Initialises OpenSSL and, if `provider` is given, loads it (keeping the
    /// default provider as a fallback for algorithms it does not cover).
    pub fn new(provider: Option<&str>) -> Result<Self, OffloadError> {
        openssl::init();
        let loaded = match provider {
            Some(name) => Some(
                openssl::provider::Provider::try_load(None, name, true).map_err(|e| {
                    OffloadError::Unavailable {
                        engine: "openssl",
                        reason: format!("load provider {name:?}: {e}"),
                    }
                })?,
            ),
            None => None,
        };
        Ok(OpensslEngine {
            provider: loaded,
            provider_name: provider.map(str::to_string),
        })
    }
}

struct OpensslKey {
    /// The engine it belongs to, for errors and metrics.
    engine: &'static str,
    pkey: openssl::pkey::PKey<openssl::pkey::Private>,
    algorithm: SignatureAlgorithm,
    schemes: Vec<SignatureScheme>,
}

impl fmt::Debug for OpensslKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpensslKey")
            .field("algorithm", &self.algorithm)
            .field("bits", &self.pkey.bits())
            .finish()
    }
}

impl Engine for OpensslEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Openssl
    }

    fn load_key(&self, key: &PrivateKeyDer<'_>) -> Result<Arc<dyn EngineKey>, OffloadError> {
        Ok(Arc::new(openssl_key("openssl", key)?))
    }
}

/// `key` as an OpenSSL `EVP_PKEY`, with the schemes it can sign.
fn openssl_key(engine: &'static str, key: &PrivateKeyDer<'_>) -> Result<OpensslKey, OffloadError> {
    use openssl::pkey::{Id, PKey};
    let err = |reason: String| OffloadError::Key { engine, reason };
    let pkey = match key {
        PrivateKeyDer::Pkcs8(k) => PKey::private_key_from_pkcs8(k.secret_pkcs8_der()),
        PrivateKeyDer::Pkcs1(k) => {
            openssl::rsa::Rsa::private_key_from_der(k.secret_pkcs1_der()).and_then(PKey::from_rsa)
        }
        PrivateKeyDer::Sec1(k) => openssl::ec::EcKey::private_key_from_der(k.secret_sec1_der())
            .and_then(PKey::from_ec_key),
        _ => return Err(err("unsupported private key encoding".into())),
    }
    .map_err(|e| err(e.to_string()))?;
    let (algorithm, schemes) = match pkey.id() {
        Id::RSA => (SignatureAlgorithm::RSA, RSA_SCHEMES.to_vec()),
        Id::EC => {
            let ec = pkey.ec_key().map_err(|e| err(e.to_string()))?;
            match ec.group().curve_name() {
                Some(openssl::nid::Nid::X9_62_PRIME256V1) => (
                    SignatureAlgorithm::ECDSA,
                    vec![SignatureScheme::ECDSA_NISTP256_SHA256],
                ),
                Some(openssl::nid::Nid::SECP384R1) => (
                    SignatureAlgorithm::ECDSA,
                    vec![SignatureScheme::ECDSA_NISTP384_SHA384],
                ),
                other => return Err(err(format!("unsupported curve {other:?}"))),
            }
        }
        other => return Err(err(format!("unsupported key type {other:?}"))),
    };
    Ok(OpensslKey {
        engine,
        pkey,
        algorithm,
        schemes,
    })
}

impl EngineKey for OpensslKey {
    fn algorithm(&self) -> SignatureAlgorithm {
        self.algorithm
    }

    fn schemes(&self) -> &[SignatureScheme] {
        &self.schemes
    }

    fn sign(&self, scheme: SignatureScheme, message: &[u8]) -> Result<Vec<u8>, OffloadError> {
        use openssl::hash::MessageDigest;
        use openssl::rsa::Padding;
        use openssl::sign::RsaPssSaltlen;
        let err = |reason: String| OffloadError::Sign {
            engine: self.engine,
            reason,
        };
        if !self.schemes.contains(&scheme) {
            return Err(err(format!("scheme {scheme:?} not supported by key")));
        }
        let (md, pss) = match scheme {
            SignatureScheme::RSA_PSS_SHA256 => (MessageDigest::sha256(), true),
            SignatureScheme::RSA_PSS_SHA384 => (MessageDigest::sha384(), true),
            SignatureScheme::RSA_PSS_SHA512 => (MessageDigest::sha512(), true),
            SignatureScheme::RSA_PKCS1_SHA256 | SignatureScheme::ECDSA_NISTP256_SHA256 => {
                (MessageDigest::sha256(), false)
            }
            SignatureScheme::RSA_PKCS1_SHA384 | SignatureScheme::ECDSA_NISTP384_SHA384 => {
                (MessageDigest::sha384(), false)
            }
            SignatureScheme::RSA_PKCS1_SHA512 => (MessageDigest::sha512(), false),
            other => return Err(err(format!("scheme {other:?} not supported"))),
        };
        let sign = || -> Result<Vec<u8>, openssl::error::ErrorStack> {
            let mut signer = openssl::sign::Signer::new(md, &self.pkey)?;
            if self.algorithm == SignatureAlgorithm::RSA {
                if pss {
                    signer.set_rsa_padding(Padding::PKCS1_PSS)?;
                    signer.set_rsa_pss_saltlen(RsaPssSaltlen::DIGEST_LENGTH)?;
                    signer.set_rsa_mgf1_md(md)?;
                } else {
                    signer.set_rsa_padding(Padding::PKCS1)?;
                }
            }
            // ECDSA signatures come out DER-encoded, which is the TLS format.
            signer.sign_oneshot_to_vec(message)
        };
        sign().map_err(|e| err(e.to_string()))
    }
}

// --------------------------------------------------------- self test

/// Signs with a throwaway P-256 key through `engine` and verifies the result
/// with ring: an engine is only used after it produced one valid signature.
pub fn self_test(engine: &dyn Engine) -> Result<(), OffloadError> {
    let fail = |reason: String| OffloadError::SelfTest {
        engine: engine.name(),
        reason,
    };
    let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
        .map_err(|e| fail(e.to_string()))?;
    let der = PrivateKeyDer::Pkcs8(kp.serialize_der().into());
    let key = engine.load_key(&der)?;
    let msg = b"baton offload self-test";
    let sig = key.sign(SignatureScheme::ECDSA_NISTP256_SHA256, msg)?;
    ring::signature::UnparsedPublicKey::new(
        &ring::signature::ECDSA_P256_SHA256_ASN1,
        kp.public_key_raw(),
    )
    .verify(msg, &sig)
    .map_err(|_| fail("signature did not verify".into()))
}

// ------------------------------------------------------------- the pool

type Job = Box<dyn FnOnce() + Send>;

/// Nice value of crypto threads relative to the event loop (0).
const CRYPTO_NICE: i32 = 10;

/// A dedicated, bounded pool of crypto threads. At most `workers + queue`
/// steps are admitted; further submitters wait asynchronously for a slot, so
/// a handshake burst becomes back-pressure on accept, never an unbounded
/// queue or a blocked event loop.
pub struct CryptoPool {
    tx: mpsc::SyncSender<Job>,
    slots: Arc<tokio::sync::Semaphore>,
    metrics: EngineMetrics,
    name: &'static str,
}

impl fmt::Debug for CryptoPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CryptoPool")
            .field("engine", &self.name)
            .field("free_slots", &self.slots.available_permits())
            .finish()
    }
}

impl CryptoPool {
    pub fn new(
        name: &'static str,
        workers: usize,
        queue: usize,
        metrics: EngineMetrics,
    ) -> std::io::Result<Self> {
        let capacity = workers + queue;
        let (tx, rx) = mpsc::sync_channel::<Job>(capacity);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..workers {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("baton-crypto-{name}-{i}"))
                .spawn(move || {
                    // Let the event loop preempt signatures (see crate::sched).
                    if let Err(e) = crate::sched::set_current_thread_nice(CRYPTO_NICE) {
                        tracing::debug!(error = %e, "cannot lower crypto thread priority");
                    }
                    loop {
                        // Hold the lock only to receive, not to run.
                        let job = match rx.lock() {
                            Ok(guard) => guard.recv(),
                            Err(_) => return,
                        };
                        match job {
                            Ok(job) => {
                                // A panicking step drops its result sender,
                                // which the submitter sees as WorkerLost.
                                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                            }
                            // Every sender dropped: the pool is gone.
                            Err(_) => return,
                        }
                    }
                })?;
        }
        Ok(CryptoPool {
            tx,
            slots: Arc::new(tokio::sync::Semaphore::new(capacity)),
            metrics,
            name,
        })
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Runs `f` on a crypto thread and awaits its result without blocking
    /// the calling task's thread.
    pub async fn run<R, F>(&self, f: F) -> Result<R, OffloadError>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| OffloadError::PoolClosed)?;
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let m = self.metrics.clone();
        m.queue_depth.inc();
        let submitted = Instant::now();
        let job: Job = Box::new(move || {
            m.queue_depth.dec();
            m.in_flight.inc();
            let r = f();
            m.in_flight.dec();
            m.wait_seconds.observe(submitted.elapsed().as_secs_f64());
            m.jobs.inc();
            let _ = done_tx.send(r);
            drop(permit);
        });
        if self.tx.try_send(job).is_err() {
            // Unreachable while slots == channel capacity; be safe anyway.
            self.metrics.queue_depth.dec();
            return Err(OffloadError::PoolClosed);
        }
        done_rx.await.map_err(|_| OffloadError::WorkerLost)
    }
}

// ------------------------------------------------- rustls-facing key

/// What rustls sees: a `SigningKey` whose signatures go to the engine key,
/// with latency/error metrics and (under `Preferred`) a software fallback.
#[derive(Debug)]
pub struct OffloadSigningKey {
    inner: Arc<KeyPair>,
}

#[derive(Debug)]
struct KeyPair {
    primary: Arc<dyn EngineKey>,
    primary_name: &'static str,
    primary_metrics: EngineMetrics,
    fallback: Option<(Arc<dyn EngineKey>, EngineMetrics)>,
    metrics: TlsMetrics,
    health: Arc<RuntimeHealth>,
}

/// How long a sidecar that lost its Required engine at run time waits
/// between two self-tests (each `/ready` probe may trigger at most one).
pub const RECHECK: std::time::Duration = std::time::Duration::from_secs(5);

/// A Required engine's health after start-up: a failed signature marks it
/// failed (the sidecar goes not ready with the reason); a self-test that
/// passes again, run from the readiness check at most every [`RECHECK`],
/// clears it.
#[derive(Debug, Default)]
struct RuntimeHealth {
    /// The failure and when the engine was last tested.
    failed: Mutex<Option<(String, Instant)>>,
    /// `Preferred`: the last signature the engine failed (software redid
    /// it), for `/offload`.
    last_sign_error: Mutex<Option<String>>,
}

impl RuntimeHealth {
    fn fail(&self, reason: String, now: Instant) {
        let mut f = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if f.is_none() {
            tracing::error!(%reason, "offload Required and the engine failed at run time: not ready");
            *f = Some((reason, now));
        }
    }
}

#[derive(Debug)]
struct OffloadSigner {
    key: Arc<KeyPair>,
    scheme: SignatureScheme,
}

impl SigningKey for OffloadSigningKey {
    fn choose_scheme(&self, offered: &[SignatureScheme]) -> Option<Box<dyn Signer>> {
        self.inner
            .primary
            .schemes()
            .iter()
            .find(|s| offered.contains(s))
            .map(|&scheme| {
                Box::new(OffloadSigner {
                    key: self.inner.clone(),
                    scheme,
                }) as Box<dyn Signer>
            })
    }

    fn algorithm(&self) -> SignatureAlgorithm {
        self.inner.primary.algorithm()
    }
}

impl Signer for OffloadSigner {
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, rustls::Error> {
        let k = &self.key;
        let start = Instant::now();
        match k.primary.sign(self.scheme, message) {
            Ok(sig) => {
                k.primary_metrics
                    .sign_seconds
                    .observe(start.elapsed().as_secs_f64());
                k.primary_metrics.signatures.inc();
                Ok(sig)
            }
            Err(e) => {
                k.primary_metrics.errors.inc();
                let Some((fallback, fm)) = &k.fallback else {
                    tracing::warn!(engine = k.primary_name, error = %e, "private-key operation failed");
                    if k.primary_name != "software" {
                        k.health.fail(e.to_string(), Instant::now());
                        k.metrics.offload_ready.set(0);
                    }
                    return Err(rustls::Error::General(e.to_string()));
                };
                tracing::warn!(engine = k.primary_name, error = %e, "private-key operation failed; signing in software");
                k.metrics.fallback("sign_error");
                *k.health
                    .last_sign_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                let start = Instant::now();
                let sig = fallback.sign(self.scheme, message).map_err(|e| {
                    fm.errors.inc();
                    rustls::Error::General(e.to_string())
                })?;
                fm.sign_seconds.observe(start.elapsed().as_secs_f64());
                fm.signatures.inc();
                Ok(sig)
            }
        }
    }

    fn scheme(&self) -> SignatureScheme {
        self.scheme
    }
}

// ------------------------------------------------------------ selection

/// What selection decided, for /ready, logs and the pod annotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadStatus {
    pub mode: OffloadMode,
    pub requested: EngineKind,
    /// Engine that signs (software after a fallback).
    pub active: EngineKind,
    /// `Some(reason)` when the requested engine is not in use.
    pub fallback_reason: Option<String>,
    /// `Err(reason)` when `Required` could not be satisfied.
    pub ready: Result<(), String>,
}

/// The selected engine, its pool (none when offload is Disabled: signing is
/// inline) and the software fallback.
#[derive(Debug)]
pub struct Offload {
    engine: Arc<dyn Engine>,
    fallback: Option<Arc<dyn Engine>>,
    pool: Option<CryptoPool>,
    status: OffloadStatus,
    metrics: TlsMetrics,
    health: Arc<RuntimeHealth>,
}

impl Offload {
    /// Selects from settings and the environment (`BATON_OFFLOAD_MODE`,
    /// `BATON_OFFLOAD_ENGINE` override the settings).
    pub fn select(
        settings: &OffloadSettings,
        env: &dyn Fn(&str) -> Option<String>,
        metrics: TlsMetrics,
    ) -> Self {
        use baton_contract::env as cenv;
        let mut s = settings.clone();
        let mut notes = Vec::new();
        if let Some(v) = env(cenv::OFFLOAD_MODE) {
            match v.parse() {
                Ok(m) => s.mode = m,
                Err(e) => notes.push(format!("{}: {e}", cenv::OFFLOAD_MODE)),
            }
        }
        if let Some(v) = env(cenv::OFFLOAD_ENGINE) {
            match v.parse() {
                Ok(k) => s.engine = k,
                Err(e) => notes.push(format!("{}: {e}", cenv::OFFLOAD_ENGINE)),
            }
        }
        let candidate: Result<Arc<dyn Engine>, OffloadError> = if !notes.is_empty() {
            Err(OffloadError::Unavailable {
                engine: s.engine.as_str(),
                reason: notes.join("; "),
            })
        } else {
            match s.engine {
                _ if s.mode == OffloadMode::Disabled => Ok(Arc::new(SoftwareEngine)),
                EngineKind::Software => Ok(Arc::new(SoftwareEngine)),
                EngineKind::Openssl => OpensslEngine::new(s.openssl_provider.as_deref())
                    .map(|e| Arc::new(e) as Arc<dyn Engine>),
            }
        };
        Offload::with_candidate(&s, candidate, metrics)
    }

    /// Selection given an already constructed (or failed) engine; tests use
    /// it with engines that fail on purpose.
    pub fn with_candidate(
        s: &OffloadSettings,
        candidate: Result<Arc<dyn Engine>, OffloadError>,
        metrics: TlsMetrics,
    ) -> Self {
        let software: Arc<dyn Engine> = Arc::new(SoftwareEngine);
        if s.mode == OffloadMode::Disabled {
            // No pool: the engine signs inline on the connection's task.
            // `select` passes the software engine here.
            metrics.offload_ready.set(1);
            let engine = candidate.unwrap_or_else(|_| software.clone());
            return Offload {
                engine,
                fallback: None,
                pool: None,
                status: OffloadStatus {
                    mode: s.mode,
                    requested: s.engine,
                    active: EngineKind::Software,
                    fallback_reason: None,
                    ready: Ok(()),
                },
                metrics,
                health: Arc::default(),
            };
        }
        let tested = candidate.and_then(|e| self_test(e.as_ref()).map(|()| e));
        let (engine, fallback_reason, ready) = match tested {
            Ok(e) => (e, None, Ok(())),
            Err(err) => {
                let reason = err.to_string();
                metrics.engine(s.engine.as_str()).errors.inc();
                if s.mode == OffloadMode::Required {
                    tracing::error!(%reason, "offload Required but no working engine: not ready");
                    (
                        software.clone(),
                        Some(reason.clone()),
                        Err(format!("offload Required: {reason}")),
                    )
                } else {
                    tracing::warn!(%reason, "offload engine unavailable; falling back to software");
                    metrics.fallback("engine_unavailable");
                    (software.clone(), Some(reason), Ok(()))
                }
            }
        };
        metrics.offload_ready.set(if ready.is_ok() { 1 } else { 0 });
        let active = engine.kind();
        let pool = CryptoPool::new(
            engine.name(),
            s.workers,
            s.queue,
            metrics.engine(engine.name()),
        )
        .map_err(|e| tracing::error!(error = %e, "cannot start crypto threads; signing inline"))
        .ok();
        Offload {
            fallback: (s.mode == OffloadMode::Preferred && active != EngineKind::Software)
                .then_some(software),
            engine,
            pool,
            status: OffloadStatus {
                mode: s.mode,
                requested: s.engine,
                active,
                fallback_reason,
                ready,
            },
            metrics,
            health: Arc::default(),
        }
    }

    pub fn status(&self) -> &OffloadStatus {
        &self.status
    }

    /// `Err(reason)` while `Required` is not satisfied: no working engine
    /// at start-up, or the engine failed a signature since (then a
    /// self-test runs at most every [`RECHECK`] and readiness returns when
    /// one passes).
    pub fn readiness(&self) -> Result<(), String> {
        self.readiness_at(Instant::now())
    }

    /// [`Offload::readiness`] as of `now` (tests move the clock).
    pub fn readiness_at(&self, now: Instant) -> Result<(), String> {
        self.status.ready.clone()?;
        let mut failed = self.health.failed.lock().unwrap_or_else(|p| p.into_inner());
        let Some((reason, tested)) = failed.as_mut() else {
            return Ok(());
        };
        if now.saturating_duration_since(*tested) >= RECHECK {
            *tested = now;
            match self_test(self.engine.as_ref()) {
                Ok(()) => {
                    tracing::info!(
                        engine = self.engine.name(),
                        "offload engine works again: ready"
                    );
                    *failed = None;
                    self.metrics.offload_ready.set(1);
                    return Ok(());
                }
                Err(e) => *reason = e.to_string(),
            }
        }
        Err(format!(
            "offload Required: engine {} failed at run time: {reason}",
            self.engine.name()
        ))
    }

    /// What `GET /offload` reports: the selection, readiness, and the
    /// signatures software redid since the process started.
    pub fn report(&self) -> baton_config::report::OffloadReport {
        let ready = self.readiness();
        baton_config::report::OffloadReport {
            configured: true,
            mode: format!("{:?}", self.status.mode),
            requested: self.status.requested.as_str().to_owned(),
            active: self.status.active.as_str().to_owned(),
            fallback_reason: self.status.fallback_reason.clone(),
            ready: ready.is_ok(),
            not_ready_reason: ready.err(),
            sign_errors_redone_in_software: self.metrics.fallbacks("sign_error"),
            last_sign_error: self
                .health
                .last_sign_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        }
    }

    /// The pool handshake steps run on; `None` = sign inline.
    pub fn pool(&self) -> Option<&CryptoPool> {
        self.pool.as_ref()
    }

    /// Loads `key` into the active engine (and the fallback) as a rustls
    /// signing key.
    pub fn signing_key(
        &self,
        key: &PrivateKeyDer<'_>,
    ) -> Result<Arc<dyn SigningKey>, OffloadError> {
        let primary = self.engine.load_key(key)?;
        let fallback = match &self.fallback {
            Some(f) => Some((f.load_key(key)?, self.metrics.engine(f.name()))),
            None => None,
        };
        Ok(Arc::new(OffloadSigningKey {
            inner: Arc::new(KeyPair {
                primary,
                primary_name: self.engine.name(),
                primary_metrics: self.metrics.engine(self.engine.name()),
                fallback,
                metrics: self.metrics.clone(),
                health: self.health.clone(),
            }),
        }))
    }
}
