//! Certificate verifiers for mesh mTLS.
//!
//! - [`MeshClientVerifier`] (server side): the standard WebPKI client
//!   verifier against the trust bundle, plus "the certificate carries a SPIFFE
//!   identity in our trust domain" — done inside the handshake so a foreign
//!   peer gets an alert instead of a connection that is closed later.
//! - [`SpiffeServerVerifier`] (client side): chain against the trust bundle,
//!   then the URI SAN must equal the identity expected for the destination.
//!   DNS names are deliberately not consulted: a mesh peer is addressed by
//!   identity, not by hostname.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature};
use rustls::server::ParsedCertificate;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, Error, OtherError, RootCertStore,
    SignatureScheme,
};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

use super::spiffe::{SpiffeId, spiffe_ids};

/// Why a peer's identity was refused (wrapped in `CertificateError::Other`).
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("peer certificate has no SPIFFE identity ({0})")]
    Missing(String),
    #[error("peer identity {found} is not the expected {expected}")]
    Mismatch { expected: SpiffeId, found: String },
    #[error("peer identity {found} is outside trust domain {trust_domain}")]
    ForeignTrustDomain { trust_domain: String, found: String },
}

fn identity_error(e: IdentityError) -> Error {
    Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(e))))
}

fn describe(ids: &[SpiffeId]) -> String {
    ids.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Server-side verifier: WebPKI chain + SPIFFE identity in our trust domain.
#[derive(Debug)]
pub struct MeshClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    trust_domain: String,
}

impl MeshClientVerifier {
    /// `inner` is a `WebPkiClientVerifier` built from the trust bundle; an
    /// empty `trust_domain` accepts any SPIFFE identity the bundle signed.
    pub fn new(inner: Arc<dyn ClientCertVerifier>, trust_domain: String) -> Self {
        MeshClientVerifier {
            inner,
            trust_domain,
        }
    }
}

impl ClientCertVerifier for MeshClientVerifier {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        let ids = spiffe_ids(end_entity).map_err(|e| identity_error(IdentityError::Missing(e)))?;
        if ids.is_empty() {
            return Err(identity_error(IdentityError::Missing(
                "no spiffe:// URI SAN".into(),
            )));
        }
        if !self.trust_domain.is_empty()
            && !ids.iter().any(|id| id.trust_domain == self.trust_domain)
        {
            return Err(identity_error(IdentityError::ForeignTrustDomain {
                trust_domain: self.trust_domain.clone(),
                found: describe(&ids),
            }));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Client-side verifier: the server must chain to the bundle and present
/// exactly the expected SPIFFE identity.
#[derive(Debug)]
pub struct SpiffeServerVerifier {
    roots: Arc<RootCertStore>,
    expected: SpiffeId,
    algs: WebPkiSupportedAlgorithms,
}

impl SpiffeServerVerifier {
    pub fn new(
        roots: Arc<RootCertStore>,
        expected: SpiffeId,
        algs: WebPkiSupportedAlgorithms,
    ) -> Self {
        SpiffeServerVerifier {
            roots,
            expected,
            algs,
        }
    }
}

impl ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.algs.all,
        )?;
        let ids = spiffe_ids(end_entity).map_err(|e| identity_error(IdentityError::Missing(e)))?;
        if ids.contains(&self.expected) {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(identity_error(IdentityError::Mismatch {
                expected: self.expected.clone(),
                found: describe(&ids),
            }))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}
