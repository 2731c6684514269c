//! Certificate material and its rotation.
//!
//! [`CertStore`] holds the current certified key and trust bundle behind an
//! `ArcSwap`. The rustls resolvers read it on every handshake, so a rotation
//! is one pointer swap: new handshakes use the new certificate, established
//! connections keep the keys they negotiated and are never touched. The trust
//! bundle lives here too; `TlsContext` rebuilds its verifiers when the
//! bundle's generation changes.
//!
//! [`FileWatcher`] polls the three PEM files (standalone mode) and applies a
//! change only when all of them parse and the key matches the certificate, so
//! a half-written rotation is retried on the next tick instead of served.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::RootCertStore;
use rustls::client::ResolvesClientCert;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::spiffe::{SpiffeId, spiffe_ids};

#[derive(Debug, thiserror::Error)]
pub enum MaterialError {
    #[error("read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: invalid PEM: {detail}")]
    Pem { what: &'static str, detail: String },
    #[error("{0} contains no certificate")]
    Empty(&'static str),
    #[error("trust bundle: {0}")]
    Bundle(rustls::Error),
    #[error("the private key does not match the certificate")]
    KeyMismatch,
    #[error("certificate: {0}")]
    Certificate(String),
}

/// A certificate chain, its private key and the trust bundle, as PEM-decoded
/// DER. This is also what the handoff carries to the next process.
#[derive(Debug)]
pub struct Material {
    pub cert_chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    pub trust_bundle: Vec<CertificateDer<'static>>,
}

impl Clone for Material {
    fn clone(&self) -> Self {
        Material {
            cert_chain: self.cert_chain.clone(),
            key: self.key.clone_key(),
            trust_bundle: self.trust_bundle.clone(),
        }
    }
}

impl Material {
    /// Decodes PEM text (chain, key, bundle).
    pub fn from_pem(chain: &[u8], key: &[u8], bundle: &[u8]) -> Result<Self, MaterialError> {
        let certs = |what: &'static str,
                     pem: &[u8]|
         -> Result<Vec<CertificateDer<'static>>, MaterialError> {
            let v = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| MaterialError::Pem {
                    what,
                    detail: e.to_string(),
                })?;
            if v.is_empty() {
                return Err(MaterialError::Empty(what));
            }
            Ok(v)
        };
        Ok(Material {
            cert_chain: certs("certificate chain", chain)?,
            key: PrivateKeyDer::from_pem_slice(key).map_err(|e| MaterialError::Pem {
                what: "private key",
                detail: e.to_string(),
            })?,
            trust_bundle: certs("trust bundle", bundle)?,
        })
    }

    /// PEM text of (chain, key, bundle): what the handoff carries.
    pub fn to_pem(&self) -> (String, String, String) {
        let all = |certs: &[CertificateDer<'_>]| {
            certs
                .iter()
                .map(|c| pem_encode("CERTIFICATE", c.as_ref()))
                .collect::<String>()
        };
        (
            all(&self.cert_chain),
            pem_encode("PRIVATE KEY", self.key.secret_der()),
            all(&self.trust_bundle),
        )
    }

    /// Reads and decodes the three PEM files.
    pub fn from_files(chain: &Path, key: &Path, bundle: &Path) -> Result<Self, MaterialError> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| MaterialError::Read {
                path: p.to_path_buf(),
                source,
            })
        };
        Material::from_pem(&read(chain)?, &read(key)?, &read(bundle)?)
    }

    /// The trust bundle as a rustls root store.
    pub fn root_store(&self) -> Result<RootCertStore, MaterialError> {
        let mut roots = RootCertStore::empty();
        for c in &self.trust_bundle {
            roots.add(c.clone()).map_err(MaterialError::Bundle)?;
        }
        Ok(roots)
    }

    /// The SPIFFE identity of the leaf certificate, if any.
    pub fn identity(&self) -> Option<SpiffeId> {
        spiffe_ids(&self.cert_chain[0]).ok()?.into_iter().next()
    }

    /// Validity period of the leaf certificate.
    pub fn validity(&self) -> Result<(SystemTime, SystemTime), MaterialError> {
        validity(&self.cert_chain[0])
    }
}

/// `(notBefore, notAfter)` of a certificate.
pub fn validity(cert: &CertificateDer<'_>) -> Result<(SystemTime, SystemTime), MaterialError> {
    use x509_parser::prelude::*;
    let (_, parsed) = X509Certificate::from_der(cert.as_ref())
        .map_err(|e| MaterialError::Certificate(e.to_string()))?;
    let to_system = |t: ASN1Time| {
        let secs = t.timestamp();
        if secs >= 0 {
            SystemTime::UNIX_EPOCH + Duration::from_secs(secs as u64)
        } else {
            SystemTime::UNIX_EPOCH
        }
    };
    Ok((
        to_system(parsed.validity().not_before),
        to_system(parsed.validity().not_after),
    ))
}

/// What handshakes currently use.
#[derive(Debug)]
pub struct Loaded {
    pub certified: Arc<CertifiedKey>,
    pub roots: Arc<RootCertStore>,
    /// Bumped on every swap; verifiers are rebuilt when it changes.
    pub generation: u64,
    pub identity: Option<SpiffeId>,
}

/// Current certificate + trust bundle, swapped atomically on rotation.
#[derive(Debug)]
pub struct CertStore {
    current: ArcSwap<Loaded>,
    generation: AtomicU64,
}

impl CertStore {
    pub fn new(
        certified: Arc<CertifiedKey>,
        roots: Arc<RootCertStore>,
        identity: Option<SpiffeId>,
    ) -> Self {
        CertStore {
            current: ArcSwap::from_pointee(Loaded {
                certified,
                roots,
                generation: 1,
                identity,
            }),
            generation: AtomicU64::new(1),
        }
    }

    pub fn load(&self) -> Arc<Loaded> {
        self.current.load_full()
    }

    /// Swaps in new material; returns the new generation.
    pub fn swap(
        &self,
        certified: Arc<CertifiedKey>,
        roots: Arc<RootCertStore>,
        identity: Option<SpiffeId>,
    ) -> u64 {
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        self.current.store(Arc::new(Loaded {
            certified,
            roots,
            generation,
            identity,
        }));
        generation
    }
}

/// Resolves our certificate for both handshake sides from the store.
#[derive(Debug, Clone)]
pub struct StoreResolver(pub Arc<CertStore>);

impl ResolvesServerCert for StoreResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current.load().certified.clone())
    }
}

impl ResolvesClientCert for StoreResolver {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current.load().certified.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Polls PEM files and calls `apply` with new material when they change.
/// Dropping the watcher stops it.
#[derive(Debug)]
pub struct FileWatcher {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FileWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Stamp = Vec<Option<(SystemTime, u64)>>;

fn stamp(paths: &[PathBuf]) -> Stamp {
    paths
        .iter()
        .map(|p| {
            std::fs::metadata(p)
                .ok()
                .map(|m| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len()))
        })
        .collect()
}

impl FileWatcher {
    /// Starts polling every `interval`. `apply` returns an error when the
    /// material is refused (kept for the next change). Must be called inside
    /// a tokio runtime.
    pub fn spawn<F>(
        chain: PathBuf,
        key: PathBuf,
        bundle: PathBuf,
        interval: Duration,
        apply: F,
    ) -> Self
    where
        F: Fn(Material) -> Result<(), super::TlsError> + Send + Sync + 'static,
    {
        let paths = vec![chain, key, bundle];
        let task = tokio::spawn(async move {
            let mut last = stamp(&paths);
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let now = stamp(&paths);
                if now == last {
                    continue;
                }
                match Material::from_files(&paths[0], &paths[1], &paths[2]) {
                    Ok(m) => match apply(m) {
                        Ok(()) => {
                            tracing::info!(chain = %paths[0].display(), "TLS material reloaded");
                            last = now;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "TLS material refused; keeping the current one")
                        }
                    },
                    // Usually a rotation caught half-way: retry next tick.
                    Err(e) => tracing::debug!(error = %e, "TLS material not loadable yet"),
                }
            }
        });
        FileWatcher { task }
    }
}

/// PEM armour for one DER object (64-column base64).
pub(crate) fn pem_encode(label: &str, der: &[u8]) -> String {
    use std::fmt::Write;
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::with_capacity(der.len() * 4 / 3 + 4);
    for chunk in der.chunks(3) {
        let n = chunk.len();
        let v = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= n {
                b64.push(T[((v >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        let _ = writeln!(out, "{}", std::str::from_utf8(line).unwrap_or_default());
    }
    let _ = writeln!(out, "-----END {label}-----");
    out
}

// The identity as the handoff carries it, and the trait the TLS layer
// implements to carry it, live beside the other cross-layer traits.
pub use crate::conn::{IdentityCarrier, IdentityImportError, IdentityPem};
