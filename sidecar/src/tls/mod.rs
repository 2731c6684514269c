//! Mesh TLS for the sidecar: mutual TLS between sidecars with SPIFFE
//! identities, TlsPolicy enforcement, certificate rotation, and asynchronous
//! private-key offload.
//!
//! Layout (pure logic first, I/O last):
//!
//! - [`settings`]: the snapshot's typed `tls` section (`baton-config`'s
//!   `TlsSettings`, validated with the snapshot) compiled into rustls objects
//!   (version, suite, group and ALPN policy). Pure and exhaustively tested.
//! - [`spiffe`]: SPIFFE identities (`spiffe://<td>/ns/<ns>/sa/<sa>`, parsed by
//!   `baton-config`) and their extraction from a certificate's URI SAN.
//!
//!   Both live in [`crate::tls_settings`], below the config compiler, and
//!   are re-exported here.
//! - [`verify`]: the client-certificate verifier (WebPKI chain + trust-domain
//!   check) and the server verifier that checks the peer's SPIFFE identity
//!   instead of a DNS name.
//! - [`material`]: certificate material (chain, key, trust bundle), the
//!   arc-swap backed store the rustls resolvers read, PEM loading and the file
//!   watcher.
//! - [`offload`]: private-key offload engines (`software`, `openssl`), the
//!   bounded crypto worker pool and engine selection.
//! - [`stream`]: a rustls stream whose handshake steps run on the offload pool
//!   so the event loop never signs; afterwards it is a plain AsyncRead/Write.
//! - [`context`]: `TlsContext` ties the above together and hands out the
//!   [`Acceptor`] (inbound: TLS or plaintext per mode, verified peer identity)
//!   and the [`Connector`] (outbound mTLS to a peer with an expected identity).
//! - [`identity_client`]: the CSR client for the operator's identity service
//!   (projected ServiceAccount token, renewal at 2/3 lifetime with jitter).
//! - [`trust_state`]: the trust bundle a Pod's sidecars learned, kept on
//!   the shared volume and trusted with the injected one (decision 0058).
//! - [`metrics`]: Prometheus metrics; the admin registry calls [`register`].
//! - [`glue`]: [`MeshTls`], the data plane's view: the listener's
//!   `TlsTerminator`, outbound connect by destination, the config hook,
//!   readiness.
//! - [`detach`]: [`MeshTls`] as the handoff's `SessionDetach` and (in
//!   [`material`]) its `IdentityCarrier`: sessions and the identity leave
//!   through traits the lower `conn` and `material` modules define, so this
//!   layer never imports the handoff.
//!
//! See docs/tls.md for the design, in particular why offload is done per
//! handshake step rather than inside `Signer::sign`.

pub mod context;
pub mod detach;
pub mod glue;
pub mod identity_client;
pub mod material;
pub mod metrics;
pub mod offload;
pub mod stream;
pub mod trust_state;
pub mod verify;

pub use crate::tls_settings::{settings, spiffe};

pub use context::{Accepted, Acceptor, Connector, PeerInfo, TlsContext};
pub use glue::MeshTls;
pub use material::{CertStore, Material};
pub use metrics::{TlsMetrics, register};
pub use offload::{EngineKind, Offload, OffloadMode, OffloadSettings};
pub use settings::{CertSource, TlsMode, TlsSettings, TlsVersion};
pub use spiffe::SpiffeId;
pub use stream::TlsStream;

/// Every failure the TLS layer reports. Leaf errors keep their source so the
/// data plane can log the chain; `metric_label` gives a bounded label.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("invalid TLS settings: {0}")]
    Settings(#[from] settings::SettingsError),
    #[error("the identity_service source needs a running tokio runtime")]
    NoRuntime,
    #[error("mode {0:?} needs a certificate source")]
    NoSource(settings::TlsMode),
    #[error("certificate material: {0}")]
    Material(#[from] material::MaterialError),
    /// A certificate from files (a TlsPolicy's Secret) that names another
    /// workload: mesh peers would refuse it, so it is never served.
    #[error(
        "the certificate names {found}, not this workload's identity {expected}: \
         issue it for {expected} (a URI SAN) from a root in the mesh trust bundle"
    )]
    IdentityMismatch { expected: String, found: String },
    #[error("private-key offload: {0}")]
    Offload(#[from] offload::OffloadError),
    #[error("rustls: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("plaintext connection refused by Strict mTLS")]
    PlaintextRefused,
    #[error("TLS without the mesh marker ({0}) refused by Strict mTLS")]
    AppTlsRefused(&'static str),
    #[error("TLS is disabled by policy")]
    Disabled,
    /// Outbound mTLS before the first certificate arrived (after waiting
    /// [`glue::FIRST_CERTIFICATE_WAIT`]); the reason is the bootstrap's.
    #[error("no mesh certificate yet: {0}")]
    NoCertificate(String),
    #[error("handshake timed out")]
    HandshakeTimeout,
    #[error("handshake: {0}")]
    Handshake(#[source] std::io::Error),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

impl TlsError {
    /// Bounded label for metrics (`error` label values).
    pub fn metric_label(&self) -> &'static str {
        match self {
            TlsError::Settings(_) | TlsError::NoSource(_) => "settings",
            TlsError::NoRuntime => "runtime",
            TlsError::Material(_) | TlsError::IdentityMismatch { .. } => "material",
            TlsError::Offload(_) => "offload",
            TlsError::Rustls(_) => "rustls",
            TlsError::Verifier(_) => "verifier",
            TlsError::PlaintextRefused => "plaintext_refused",
            TlsError::AppTlsRefused(_) => "app_tls_refused",
            TlsError::Disabled => "disabled",
            TlsError::NoCertificate(_) => "no_certificate",
            TlsError::HandshakeTimeout => "handshake_timeout",
            TlsError::Handshake(_) => "handshake",
            TlsError::Io(_) => "io",
        }
    }
}
