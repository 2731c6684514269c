//! `TlsContext`: compiled policy + certificate store + offload engine, and
//! the two things the data plane plugs into its listeners:
//!
//! - [`Acceptor`] (inbound): per mode, either terminates mTLS and reports the
//!   verified peer identity, or passes plaintext and the application's own
//!   TLS through (Permissive, decided from the ClientHello; Disabled), or
//!   refuses both (Strict: counted and logged).
//! - [`Connector`] (outbound): originates mTLS to a peer sidecar, marked as
//!   mesh TLS by the SNI [`MESH_SERVER_NAME`], and refuses it unless the peer
//!   proves the SPIFFE identity expected for the destination.
//!
//! Rotation: [`TlsContext::update_material`] swaps the certificate in the
//! store (resolvers read it per handshake) and rebuilds the server config and
//! the per-identity client configs (the trust bundle may have changed). Both
//! are arc-swapped: handshakes in progress finish with the config they began
//! with, established connections are never touched.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::client::Resumption;
use rustls::server::{
    NoServerSessionStorage, ServerSessionMemoryCache, StoresServerSessions, WebPkiClientVerifier,
};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, ClientConnection, ServerConfig, ServerConnection};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::TlsError;
use super::material::{CertStore, FileWatcher, Material, MaterialError, StoreResolver};
use super::metrics::TlsMetrics;
use super::offload::Offload;
use super::settings::{CertSource, CompiledPolicy, TlsMode, TlsSettings, compile};
use super::spiffe::{SpiffeId, spiffe_ids};
use super::stream::{TlsStream, handshake};
use super::verify::{MeshClientVerifier, SpiffeServerVerifier};
use crate::client_hello::{Hello, MESH_SERVER_NAME, peek_client_hello};

/// Server-side established stream.
pub type ServerTlsStream<IO> = TlsStream<IO, ServerConnection>;
/// Client-side established stream.
pub type ClientTlsStream<IO> = TlsStream<IO, ClientConnection>;

/// What the handshake established about the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// Verified SPIFFE identity (None only for certificate-less clients on a
    /// listener with `requireClientCert: false`).
    pub identity: Option<SpiffeId>,
    pub alpn: Option<Vec<u8>>,
    pub version: Option<rustls::ProtocolVersion>,
    pub suite: Option<rustls::CipherSuite>,
}

impl PeerInfo {
    fn of<S>(conn: &rustls::ConnectionCommon<S>, trust_domain: &str) -> Self {
        let identity = conn
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|c| spiffe_ids(c).ok())
            .and_then(|ids| {
                ids.into_iter()
                    .find(|id| trust_domain.is_empty() || id.trust_domain == trust_domain)
            });
        PeerInfo {
            identity,
            alpn: conn.alpn_protocol().map(<[u8]>::to_vec),
            version: conn.protocol_version(),
            suite: conn.negotiated_cipher_suite().map(|s| s.suite()),
        }
    }
}

#[derive(Debug, Default)]
struct ClientCache {
    generation: u64,
    configs: HashMap<SpiffeId, Arc<ClientConfig>>,
}

/// Everything a sidecar needs to speak mesh TLS.
#[derive(Debug)]
pub struct TlsContext {
    policy: CompiledPolicy,
    settings: TlsSettings,
    offload: Arc<Offload>,
    store: Arc<CertStore>,
    /// The material `store` was built from, for the handoff to carry.
    material: ArcSwap<Material>,
    server: ArcSwap<ServerConfig>,
    server_generation: std::sync::atomic::AtomicU64,
    clients: Mutex<ClientCache>,
    sessions: Arc<dyn StoresServerSessions>,
    /// Key log for the handoff's `SecretCapture` (TLS 1.3 KeyUpdate after a
    /// connection moved needs the application traffic secrets).
    key_log: Mutex<Option<Arc<dyn rustls::KeyLog>>>,
    metrics: TlsMetrics,
}

/// Turns material into a certified key signed through the offload engine,
/// refusing a key that does not belong to the leaf certificate.
fn certify(material: &Material, offload: &Offload) -> Result<Arc<CertifiedKey>, TlsError> {
    use x509_parser::prelude::*;
    let software = rustls::crypto::ring::sign::any_supported_type(&material.key)?;
    let (_, leaf) = X509Certificate::from_der(material.cert_chain[0].as_ref())
        .map_err(|e| MaterialError::Certificate(e.to_string()))?;
    match software.public_key() {
        Some(spki) if spki.as_ref() == leaf.public_key().raw => {}
        _ => return Err(MaterialError::KeyMismatch.into()),
    }
    let key = offload.signing_key(&material.key)?;
    Ok(Arc::new(CertifiedKey::new(
        material.cert_chain.clone(),
        key,
    )))
}

impl TlsContext {
    /// Builds a context from settings and initial material.
    pub fn new(
        settings: &TlsSettings,
        material: Material,
        offload: Arc<Offload>,
        metrics: TlsMetrics,
    ) -> Result<Arc<Self>, TlsError> {
        let policy = compile(settings)?;
        let certified = certify(&material, &offload)?;
        let roots = Arc::new(material.root_store()?);
        let store = Arc::new(CertStore::new(certified, roots, material.identity()));
        let sessions: Arc<dyn StoresServerSessions> = if policy.session_resumption {
            ServerSessionMemoryCache::new(4096)
        } else {
            Arc::new(NoServerSessionStorage {})
        };
        let server = build_server_config(&policy, &store, &sessions, None)?;
        if let Ok((_, not_after)) = material.validity() {
            metrics.cert_expiry_seconds.set(unix(not_after));
        }
        metrics.material_generation.set(1);
        Ok(Arc::new(TlsContext {
            policy,
            settings: settings.clone(),
            offload,
            store,
            material: ArcSwap::from_pointee(material),
            server: ArcSwap::from_pointee(server),
            server_generation: 1.into(),
            clients: Mutex::new(ClientCache::default()),
            sessions,
            key_log: Mutex::new(None),
            metrics,
        }))
    }

    /// Standalone start: selects the offload engine from settings and the
    /// process environment and loads the `files` source.
    pub fn from_files(settings: &TlsSettings, metrics: TlsMetrics) -> Result<Arc<Self>, TlsError> {
        let Some(CertSource::Files {
            cert_chain,
            key,
            trust_bundle,
            ..
        }) = &settings.source
        else {
            return Err(TlsError::NoSource(settings.mode));
        };
        let material = Material::from_files(cert_chain, key, trust_bundle)?;
        check_identity(settings, &material)?;
        TlsContext::with_selected_offload(settings, material, metrics)
    }

    /// [`TlsContext::new`] with the offload engine selected from the settings
    /// and the process environment (the webhook's `BATON_OFFLOAD_*`).
    pub fn with_selected_offload(
        settings: &TlsSettings,
        material: Material,
        metrics: TlsMetrics,
    ) -> Result<Arc<Self>, TlsError> {
        let offload = Arc::new(Offload::select(
            &settings.offload,
            &|k| std::env::var(k).ok(),
            metrics.clone(),
        ));
        TlsContext::new(settings, material, offload, metrics)
    }

    /// For a `files` source: polls the files and applies rotations.
    pub fn watch_files(self: &Arc<Self>) -> Option<FileWatcher> {
        let Some(CertSource::Files {
            cert_chain,
            key,
            trust_bundle,
            poll_interval_ms,
        }) = &self.settings.source
        else {
            return None;
        };
        let ctx = Arc::downgrade(self);
        Some(FileWatcher::spawn(
            cert_chain.clone(),
            key.clone(),
            trust_bundle.clone(),
            Duration::from_millis(*poll_interval_ms),
            move |m| match ctx.upgrade() {
                Some(ctx) => ctx.update_material(m).map(|_| ()),
                None => Ok(()),
            },
        ))
    }

    /// Rotation: new certificate/key/bundle for new handshakes. Returns the
    /// new generation. Invalid material is refused and the old stays.
    pub fn update_material(&self, material: Material) -> Result<u64, TlsError> {
        check_identity(&self.settings, &material)?;
        let certified = certify(&material, &self.offload)?;
        let roots = Arc::new(material.root_store()?);
        let generation = self.store.swap(certified, roots, material.identity());
        let key_log = self
            .key_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let server = build_server_config(&self.policy, &self.store, &self.sessions, key_log)?;
        self.server.store(Arc::new(server));
        self.server_generation
            .store(generation, std::sync::atomic::Ordering::Release);
        if let Ok((_, not_after)) = material.validity() {
            self.metrics.cert_expiry_seconds.set(unix(not_after));
        }
        self.metrics.material_generation.set(generation as i64);
        self.material.store(Arc::new(material));
        Ok(generation)
    }

    /// Installs a key log on the server and client configs (the handoff's
    /// `SecretCapture`); applies to handshakes from now on.
    pub fn set_key_log(&self, key_log: Arc<dyn rustls::KeyLog>) -> Result<(), TlsError> {
        *self.key_log.lock().unwrap_or_else(|p| p.into_inner()) = Some(key_log.clone());
        let server = build_server_config(&self.policy, &self.store, &self.sessions, Some(key_log))?;
        self.server.store(Arc::new(server));
        // Client configs are built on demand with the current key log.
        self.clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .configs
            .clear();
        Ok(())
    }

    /// The certificate, key and trust bundle new handshakes use.
    pub fn material(&self) -> Arc<Material> {
        self.material.load_full()
    }

    pub fn settings(&self) -> &TlsSettings {
        &self.settings
    }

    pub fn mode(&self) -> TlsMode {
        self.policy.mode
    }

    pub fn offload(&self) -> &Arc<Offload> {
        &self.offload
    }

    /// `(notBefore, notAfter)` of the leaf certificate in use.
    pub fn current_validity(&self) -> Option<(std::time::SystemTime, std::time::SystemTime)> {
        let loaded = self.store.load();
        super::material::validity(loaded.certified.cert.first()?).ok()
    }

    /// Our own identity (from the leaf certificate in use).
    pub fn local_identity(&self) -> Option<SpiffeId> {
        self.store.load().identity.clone()
    }

    /// `Err(reason)` while the sidecar must not be ready (offload Required
    /// without a working engine).
    pub fn readiness(&self) -> Result<(), String> {
        self.offload.readiness()
    }

    /// Current server config (what the next inbound handshake uses).
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.server.load_full()
    }

    /// Client config that accepts only `expected` (cached per identity and
    /// material generation).
    pub fn client_config(&self, expected: &SpiffeId) -> Result<Arc<ClientConfig>, TlsError> {
        let loaded = self.store.load();
        let mut cache = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if cache.generation != loaded.generation {
            cache.configs.clear();
            cache.generation = loaded.generation;
        }
        if let Some(c) = cache.configs.get(expected) {
            return Ok(c.clone());
        }
        let p = &self.policy;
        let verifier = Arc::new(SpiffeServerVerifier::new(
            loaded.roots.clone(),
            expected.clone(),
            p.provider.signature_verification_algorithms,
        ));
        let mut cfg = ClientConfig::builder_with_provider(p.provider.clone())
            .with_protocol_versions(&p.versions)?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_cert_resolver(Arc::new(StoreResolver(self.store.clone())));
        cfg.alpn_protocols = p.alpn.clone();
        // SNI stays on: the fixed MESH_SERVER_NAME is how the peer tells
        // mesh TLS from the application's own TLS (decision 0026). It names
        // no workload; peers are verified by identity, not name.
        cfg.enable_sni = true;
        // The handoff moves raw TCP connections with their originated TLS
        // session (ClientConnection::dangerous_extract_secrets), and the key
        // log lets the next process follow a TLS 1.3 KeyUpdate.
        cfg.enable_secret_extraction = true;
        if let Some(k) = self
            .key_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            cfg.key_log = k;
        }
        if !p.session_resumption {
            cfg.resumption = Resumption::disabled();
        }
        let cfg = Arc::new(cfg);
        // Bounded: one entry per destination identity of this snapshot.
        if cache.configs.len() >= 4096 {
            cache.configs.clear();
        }
        cache.configs.insert(expected.clone(), cfg.clone());
        Ok(cfg)
    }

    pub fn acceptor(self: &Arc<Self>) -> Acceptor {
        Acceptor { ctx: self.clone() }
    }

    pub fn connector(self: &Arc<Self>) -> Connector {
        Connector { ctx: self.clone() }
    }

    pub fn metrics(&self) -> &TlsMetrics {
        &self.metrics
    }
}

fn unix(t: std::time::SystemTime) -> i64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn build_server_config(
    p: &CompiledPolicy,
    store: &Arc<CertStore>,
    sessions: &Arc<dyn StoresServerSessions>,
    key_log: Option<Arc<dyn rustls::KeyLog>>,
) -> Result<ServerConfig, TlsError> {
    let roots = store.load().roots.clone();
    let builder = WebPkiClientVerifier::builder_with_provider(roots, p.provider.clone());
    let builder = if p.require_client_cert {
        builder
    } else {
        builder.allow_unauthenticated()
    };
    let verifier = Arc::new(MeshClientVerifier::new(
        builder.build()?,
        p.trust_domain.clone(),
    ));
    let mut cfg = ServerConfig::builder_with_provider(p.provider.clone())
        .with_protocol_versions(&p.versions)?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(Arc::new(StoreResolver(store.clone())));
    cfg.alpn_protocols = p.alpn.clone();
    // The policy's suite order wins over the client's (testssl flags a server
    // that follows the client's preference).
    cfg.ignore_client_order = true;
    // The handoff moves established connections to the next process with
    // their record-layer secrets (ServerConnection::dangerous_extract_secrets).
    cfg.enable_secret_extraction = true;
    if let Some(k) = key_log {
        cfg.key_log = k;
    }
    cfg.session_storage = sessions.clone();
    if !p.session_resumption {
        cfg.send_tls13_tickets = 0;
    }
    Ok(cfg)
}

/// Result of accepting one inbound connection.
#[derive(Debug)]
pub enum Accepted<IO> {
    /// mTLS terminated; plaintext flows through the stream.
    Tls(Box<ServerTlsStream<IO>>, PeerInfo),
    /// Plaintext (Permissive or Disabled); nothing was consumed.
    Plaintext(IO),
    /// TLS without the mesh marker, the application's own (Permissive):
    /// to be passed through as opaque bytes; nothing was consumed.
    AppTls(IO),
}

/// Inbound side; cheap to clone, one per listener.
#[derive(Debug, Clone)]
pub struct Acceptor {
    ctx: Arc<TlsContext>,
}

impl Acceptor {
    pub fn context(&self) -> &Arc<TlsContext> {
        &self.ctx
    }

    /// Accepts a TCP connection according to the mode. Peeks (never
    /// consumes) at the whole ClientHello to tell mesh TLS (terminated) from
    /// the application's own TLS (passed through in Permissive, refused in
    /// Strict) and from plaintext (see [`crate::client_hello`]).
    pub async fn accept(&self, tcp: TcpStream) -> Result<Accepted<TcpStream>, TlsError> {
        let mode = self.ctx.policy.mode;
        if mode == TlsMode::Disabled {
            return Ok(Accepted::Plaintext(tcp));
        }
        let hello = peek_client_hello(&tcp, self.ctx.policy.detect_timeout).await?;
        let metrics = &self.ctx.metrics;
        match (mode, hello) {
            (_, Some(Hello::Mesh)) => self
                .accept_tls(tcp)
                .await
                .map(|(s, p)| Accepted::Tls(Box::new(s), p)),
            (TlsMode::Permissive, Some(Hello::App(_))) => {
                metrics.app_tls_passthrough.inc();
                Ok(Accepted::AppTls(tcp))
            }
            (_, Some(Hello::App(why))) => {
                metrics.app_tls_refused.inc();
                tracing::warn!(peer = ?tcp.peer_addr().ok(), reason = why.as_str(), "TLS without the mesh marker refused: Strict mTLS");
                Err(TlsError::AppTlsRefused(why.as_str()))
            }
            // Plaintext, or nothing decidable before the detection timeout
            // (a server-speaks-first protocol).
            (TlsMode::Permissive, _) => {
                metrics.plaintext_accepted.inc();
                Ok(Accepted::Plaintext(tcp))
            }
            _ => {
                metrics.plaintext_refused.inc();
                tracing::warn!(peer = ?tcp.peer_addr().ok(), "plaintext connection refused: Strict mTLS");
                Err(TlsError::PlaintextRefused)
            }
        }
    }

    /// Terminates TLS on any stream (no detection).
    pub async fn accept_tls<IO>(&self, io: IO) -> Result<(ServerTlsStream<IO>, PeerInfo), TlsError>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let r = self.accept_tls_inner(io).await;
        let label = match &r {
            Ok(_) => "ok",
            Err(e) => e.metric_label(),
        };
        self.ctx.metrics.handshake("server", label);
        r
    }

    async fn accept_tls_inner<IO>(
        &self,
        io: IO,
    ) -> Result<(ServerTlsStream<IO>, PeerInfo), TlsError>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        if let Err(reason) = self.ctx.readiness() {
            return Err(super::offload::OffloadError::Unavailable {
                engine: self.ctx.offload.status().requested.as_str(),
                reason,
            }
            .into());
        }
        let conn = ServerConnection::new(self.ctx.server_config())?;
        let stream = tokio::time::timeout(
            self.ctx.policy.handshake_timeout,
            handshake(io, conn, self.ctx.offload.pool()),
        )
        .await
        .map_err(|_| TlsError::HandshakeTimeout)?
        .map_err(TlsError::Handshake)?;
        let peer = PeerInfo::of(stream.get_ref().1, &self.ctx.policy.trust_domain);
        Ok((stream, peer))
    }
}

/// Outbound side; cheap to clone.
#[derive(Debug, Clone)]
pub struct Connector {
    ctx: Arc<TlsContext>,
}

impl Connector {
    pub fn context(&self) -> &Arc<TlsContext> {
        &self.ctx
    }

    /// Originates mTLS over `io` to a peer that must prove `expected`.
    /// `alpn` overrides the policy's list for this connection (e.g. only
    /// `h2` when the app spoke HTTP/2).
    pub async fn connect<IO>(
        &self,
        io: IO,
        expected: &SpiffeId,
        alpn: Option<Vec<Vec<u8>>>,
    ) -> Result<(ClientTlsStream<IO>, PeerInfo), TlsError>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let r = self.connect_inner(io, expected, alpn).await;
        let label = match &r {
            Ok(_) => "ok",
            Err(e) => e.metric_label(),
        };
        self.ctx.metrics.handshake("client", label);
        r
    }

    async fn connect_inner<IO>(
        &self,
        io: IO,
        expected: &SpiffeId,
        alpn: Option<Vec<Vec<u8>>>,
    ) -> Result<(ClientTlsStream<IO>, PeerInfo), TlsError>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        if self.ctx.policy.mode == TlsMode::Disabled {
            return Err(TlsError::Disabled);
        }
        let config = self.ctx.client_config(expected)?;
        // Sent as SNI, the mesh marker the terminating side looks for; never
        // checked against the certificate (the SPIFFE identity is).
        let name = ServerName::try_from(MESH_SERVER_NAME).expect("static name is valid");
        let conn = match alpn {
            Some(a) => ClientConnection::new_with_alpn(config, name, a)?,
            None => ClientConnection::new(config, name)?,
        };
        let stream = tokio::time::timeout(
            self.ctx.policy.handshake_timeout,
            handshake(io, conn, self.ctx.offload.pool()),
        )
        .await
        .map_err(|_| TlsError::HandshakeTimeout)?
        .map_err(TlsError::Handshake)?;
        let peer = PeerInfo::of(stream.get_ref().1, &self.ctx.policy.trust_domain);
        Ok((stream, peer))
    }
}

/// When the settings name this workload's identity, the certificate must
/// carry it: a Secret's certificate issued for another name would be
/// refused by every peer that expects this workload, so it is refused here,
/// with the reason, and the last good certificate stays.
fn check_identity(settings: &TlsSettings, material: &Material) -> Result<(), TlsError> {
    let Some(expected) = &settings.identity.local else {
        return Ok(());
    };
    let found = material.identity().map(|id| id.to_string());
    if found.as_deref() == Some(expected.as_str()) {
        return Ok(());
    }
    Err(TlsError::IdentityMismatch {
        expected: expected.clone(),
        found: found.unwrap_or_else(|| "no SPIFFE ID".into()),
    })
}
