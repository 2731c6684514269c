//! The rustls side of serving: the crypto provider (explicit, so a process
//! never depends on a global default being installed), a serving
//! certificate that can be swapped while serving, and the server
//! configuration built on them.
//!
//! [`CertStore`] is a rustls [`ResolvesServerCert`] backed by an
//! [`ArcSwapOption`]: a renewal or rotation stores a new [`CertifiedKey`]
//! and the very next handshake uses it, while connections already
//! established keep theirs. No restart, no lock on the handshake path.

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Why a certificate and key were not loaded. Never contains key material.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("PEM: {0}")]
    Pem(String),
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
}

impl CertError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            CertError::Pem(_) => "pem",
            CertError::Tls(_) => "tls",
        }
    }
}

/// The ring provider, in its own order.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The ring provider with the SHA-256 suites first: the handshake's
/// transcript and key schedule hash with the suite's hash, and SHA-256 runs
/// on the CPU's SHA extensions where SHA-384 cannot (decision 0019: SHA-384
/// was a fifth of the identity endpoint's handshake CPU).
pub fn provider_sha256_first() -> Arc<CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    use rustls::CipherSuite as S;
    // Stable sort: the provider's order otherwise.
    provider.cipher_suites.sort_by_key(|s| {
        matches!(
            s.suite(),
            S::TLS13_AES_256_GCM_SHA384
                | S::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
                | S::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384
        )
    });
    Arc::new(provider)
}

/// Builds a [`CertifiedKey`] from PEM text (chain, then key), checking
/// that the key belongs to the leaf.
pub fn certified_key(
    cert_pem: impl AsRef<[u8]>,
    key_pem: impl AsRef<[u8]>,
) -> Result<CertifiedKey, CertError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_ref())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertError::Pem(format!("certificate chain: {e}")))?;
    if chain.is_empty() {
        return Err(CertError::Pem("no CERTIFICATE block found".into()));
    }
    // The parser's error would be fine, but say only which part failed:
    // nothing from a key file belongs in a log.
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_ref())
        .map_err(|_| CertError::Pem("private key does not parse".into()))?;
    Ok(CertifiedKey::from_der(chain, key, &provider())?)
}

/// The current serving certificate; empty until the first load.
#[derive(Debug, Default)]
pub struct CertStore {
    current: ArcSwapOption<CertifiedKey>,
}

impl CertStore {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// True once a certificate has been loaded (feeds readiness).
    pub fn is_loaded(&self) -> bool {
        self.current.load().is_some()
    }

    /// Parses a PEM chain and key ([`certified_key`]) and serves them from
    /// the next handshake on; on error the current certificate stays.
    pub fn store_pem(
        &self,
        cert_pem: impl AsRef<[u8]>,
        key_pem: impl AsRef<[u8]>,
    ) -> Result<(), CertError> {
        let key = certified_key(cert_pem, key_pem)?;
        self.current.store(Some(Arc::new(key)));
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

/// A server configuration on `provider` resolving through `store`,
/// offering h2 and http/1.1 by ALPN, no client authentication.
pub fn server_config(
    store: Arc<CertStore>,
    provider: Arc<CryptoProvider>,
) -> Result<ServerConfig, CertError> {
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(store);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

#[cfg(test)]
mod tests {
    //! A real handshake over loopback through [`crate::accept::serve_tls`]:
    //! what the webhook and the operator serve with.

    use std::net::SocketAddr;
    use std::time::Duration;

    use http::StatusCode;
    use rustls_pki_types::ServerName;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio_rustls::{TlsAcceptor, TlsConnector};
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::accept::{Connections, serve_tls};

    fn self_signed(name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn client(cert_pem: &str) -> TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(cert_pem.as_bytes()).unwrap())
            .unwrap();
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        TlsConnector::from(Arc::new(config))
    }

    async fn server(store: Arc<CertStore>) -> (SocketAddr, CancellationToken) {
        server_bounded(store, None).await
    }

    /// With `Some(n)`: [`crate::accept::serve_tls_bounded`], `n` handshakes
    /// at once.
    async fn server_bounded(
        store: Arc<CertStore>,
        at_once: Option<usize>,
    ) -> (SocketAddr, CancellationToken) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = TlsAcceptor::from(Arc::new(
            server_config(store, provider_sha256_first()).unwrap(),
        ));
        let stop = CancellationToken::new();
        let conn_stop = stop.clone();
        let serve = move |tls, peer| {
            crate::http::serve_connection(
                tls,
                |_req| async { crate::http::response(StatusCode::OK, "text/plain", "tls\n") },
                conn_stop.clone(),
                "test",
                peer,
            )
        };
        match at_once {
            None => tokio::spawn(serve_tls(
                listener,
                acceptor,
                "test",
                stop.clone(),
                Connections::Owned,
                serve,
            )),
            Some(n) => tokio::spawn(crate::accept::serve_tls_bounded(
                listener,
                acceptor,
                "test",
                stop.clone(),
                Connections::Owned,
                n,
                serve,
            )),
        };
        (addr, stop)
    }

    #[tokio::test]
    async fn a_bounded_endpoint_handshakes_the_next_client_only_when_a_turn_is_free() {
        let store = CertStore::new();
        let (cert, key) = self_signed("one.test");
        store.store_pem(&cert, &key).unwrap();
        let (addr, stop) = server_bounded(store, Some(1)).await;
        // A client that connects and never says hello holds the only turn.
        let stalled = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let connector = client(&cert);
        let waiting = tokio::spawn(async move { fetch(addr, &connector, "one.test").await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "handshaken while the turn was held");
        // It gives up: its handshake fails, and the turn goes to the next.
        drop(stalled);
        let answer = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("served once the turn was free")
            .unwrap()
            .unwrap();
        assert!(answer.ends_with("tls\n"), "{answer}");
        stop.cancel();
    }

    async fn fetch(
        addr: SocketAddr,
        connector: &TlsConnector,
        name: &str,
    ) -> std::io::Result<String> {
        let tcp = TcpStream::connect(addr).await?;
        let name = ServerName::try_from(name.to_owned()).unwrap();
        let mut tls = connector.connect(name, tcp).await?;
        tls.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await?;
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(10), tls.read_to_string(&mut out))
            .await
            .expect("an answer")?;
        Ok(out)
    }

    #[tokio::test]
    async fn a_swapped_certificate_serves_from_the_next_handshake() {
        let store = CertStore::new();
        let (first_cert, first_key) = self_signed("one.test");
        store.store_pem(&first_cert, &first_key).unwrap();
        let (addr, stop) = server(store.clone()).await;
        let answer = fetch(addr, &client(&first_cert), "one.test").await.unwrap();
        assert!(answer.ends_with("tls\n"), "{answer}");
        // A garbage handshake costs only its own connection.
        let mut junk = TcpStream::connect(addr).await.unwrap();
        junk.write_all(b"not a ClientHello\r\n\r\n").await.unwrap();
        let mut sink = Vec::new();
        let _ = junk.read_to_end(&mut sink).await;
        let (second_cert, second_key) = self_signed("two.test");
        store.store_pem(&second_cert, &second_key).unwrap();
        assert!(fetch(addr, &client(&first_cert), "one.test").await.is_err());
        let answer = fetch(addr, &client(&second_cert), "two.test")
            .await
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        stop.cancel();
    }

    #[test]
    fn a_key_of_another_certificate_or_garbage_is_refused_and_the_current_one_stays() {
        let store = CertStore::new();
        assert!(!store.is_loaded());
        let (cert, key) = self_signed("a.test");
        let (_, other_key) = self_signed("b.test");
        store.store_pem(&cert, &key).unwrap();
        let leaf = store.leaf_der().unwrap();
        let err = store.store_pem(&cert, &other_key).unwrap_err();
        assert_eq!(err.metric_label(), "tls", "{err}");
        let err = store.store_pem("garbage", &key).unwrap_err();
        assert_eq!(err.to_string(), "PEM: no CERTIFICATE block found");
        let err = store
            .store_pem(&cert, "-----BEGIN PRIVATE KEY-----\nAAAA\n")
            .unwrap_err();
        assert_eq!(err.metric_label(), "pem");
        assert!(!err.to_string().contains("AAAA"));
        assert_eq!(store.leaf_der(), Some(leaf));
    }

    #[test]
    fn the_sha256_first_provider_keeps_every_suite_and_moves_sha384_last() {
        let plain = provider();
        let reordered = provider_sha256_first();
        assert_eq!(plain.cipher_suites.len(), reordered.cipher_suites.len());
        let last = reordered.cipher_suites.last().unwrap().suite();
        assert!(format!("{last:?}").ends_with("SHA384"), "{last:?}");
        let first = reordered.cipher_suites.first().unwrap().suite();
        assert!(format!("{first:?}").ends_with("SHA256"), "{first:?}");
    }
}
