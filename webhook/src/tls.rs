//! The serving certificate, swappable at runtime.
//!
//! [`CertStore`] is a rustls [`ResolvesServerCert`] backed by an
//! [`ArcSwap`]: a rotation (self-managed CA) or a changed file (cert-manager)
//! stores a new [`CertifiedKey`] and the very next handshake uses it, while
//! connections already established keep theirs. No restart, no lock on the
//! handshake path.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use arc_swap::ArcSwapOption;
use rustls::{
    ServerConfig,
    crypto::CryptoProvider,
    server::{ClientHello, ResolvesServerCert},
    sign::CertifiedKey,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};

/// The crypto provider used for serving (explicit, so the process never
/// depends on a global default being installed).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Holds the current serving certificate; empty until the first load.
#[derive(Debug, Default)]
pub struct CertStore {
    current: ArcSwapOption<CertifiedKey>,
}

impl CertStore {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// True once a certificate has been loaded (feeds `/ready`).
    pub fn is_loaded(&self) -> bool {
        self.current.load().is_some()
    }

    /// Parses a PEM chain + PEM key and makes it the serving certificate.
    pub fn store_pem(&self, cert_pem: &[u8], key_pem: &[u8]) -> Result<()> {
        self.current
            .store(Some(Arc::new(certified_key(cert_pem, key_pem)?)));
        Ok(())
    }

    /// The DER of the leaf currently served (tests and logging).
    pub fn leaf_der(&self) -> Option<CertificateDer<'static>> {
        self.current
            .load()
            .as_ref()
            .and_then(|k| k.cert.first().cloned())
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.load_full()
    }
}

/// Builds a [`CertifiedKey`] from PEM text, checking key and leaf match.
pub fn certified_key(cert_pem: &[u8], key_pem: &[u8]) -> Result<CertifiedKey> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Pem(format!("certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err(Error::Pem("no CERTIFICATE block found".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| Error::Pem(format!("private key: {e}")))?;
    Ok(CertifiedKey::from_der(chain, key, &provider())?)
}

/// A rustls server configuration resolving through `store`, offering h2
/// and http/1.1 (the API server uses either).
pub fn server_config(store: Arc<CertStore>) -> Result<ServerConfig> {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(store);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// Certificate and key files provided from outside (cert-manager mounts a
/// Secret; kubelet updates the files in place via a symlink swap).
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl CertFiles {
    fn read(&self) -> Result<(Vec<u8>, Vec<u8>)> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| Error::File {
                path: p.to_owned(),
                source,
            })
        };
        Ok((read(&self.cert)?, read(&self.key)?))
    }

    /// Loads both files into `store`.
    pub fn load_into(&self, store: &CertStore) -> Result<()> {
        let (cert, key) = self.read()?;
        store.store_pem(&cert, &key)
    }

    /// Polls the files every `interval` and reloads when their content
    /// changes. Polling (not inotify) because kubelet replaces Secret volumes
    /// by swapping a `..data` symlink, which inotify watches on the file miss.
    /// A half-written pair (key and cert from different rotations) fails the
    /// key-match check and is retried on the next tick, keeping the old cert.
    pub async fn watch(self, store: Arc<CertStore>, interval: Duration, stop: CancellationToken) {
        let mut last = self.read().ok();
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
            let Ok(now) = self.read() else { continue };
            if last.as_ref() == Some(&now) {
                continue;
            }
            match store.store_pem(&now.0, &now.1) {
                Ok(()) => {
                    tracing::info!(cert = %self.cert.display(), "serving certificate reloaded from files");
                    last = Some(now);
                }
                Err(error) => {
                    tracing::warn!(%error, "certificate files changed but do not load; keeping the current certificate")
                }
            }
        }
    }
}
