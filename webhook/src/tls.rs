//! The serving certificate, swappable at runtime: a rotation (self-managed
//! CA) or a changed file (cert-manager) is stored in the [`CertStore`] and
//! the very next handshake uses it, while connections already established
//! keep theirs. The store, the provider and the configuration are
//! [`baton_serving::tls`]'s (the operator serves with the same); what is
//! the webhook's own is watching certificate files ([`CertFiles`]).

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use rustls::ServerConfig;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};

pub use baton_serving::tls::{CertStore, certified_key, provider};

/// A rustls server configuration resolving through `store`, offering h2
/// and http/1.1 (the API server uses either).
pub fn server_config(store: Arc<CertStore>) -> Result<ServerConfig> {
    Ok(baton_serving::tls::server_config(store, provider())?)
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
        Ok(store.store_pem(&cert, &key)?)
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
