//! The pure heart of the identity service: who the caller is (from a
//! TokenReview result), whether its CSR may be signed, and the certificate
//! that answers it.
//!
//! Nothing here does I/O. The identity a certificate carries comes only from
//! the TokenReview result ([`caller_from_review`]); the CSR contributes its
//! public key and nothing else — its SAN is checked to equal that identity
//! (so a sidecar configured with the wrong `identity.local` learns why), but
//! its subject, extensions and requested validity are never copied.

use std::fmt;
use std::time::Duration;

use rcgen::{
    CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyUsagePurpose, SanType, SerialNumber,
};
use time::OffsetDateTime;
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::oid_registry::{OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY, OID_PKCS1_RSAENCRYPTION};
use x509_parser::prelude::FromDer;

use super::authority::Authority;

/// Largest CSR accepted (PEM text). A P-256 CSR is ~500 bytes, RSA-2048 ~1 KiB.
pub const MAX_CSR_BYTES: usize = 16 * 1024;

/// Why a request got no certificate. Every variant is a clear answer to the
/// caller (HTTP status + message) and a metric label.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("no bearer token (Authorization: Bearer <projected ServiceAccount token>)")]
    MissingToken,
    #[error("token rejected by the API server: {0}")]
    TokenRejected(String),
    #[error("token audience is not {expected} (project the token with that audience)")]
    WrongAudience { expected: String },
    #[error("token does not belong to a ServiceAccount (user {0:?})")]
    NotServiceAccount(String),
    #[error("token is not bound to a Pod (use a projected ServiceAccount token)")]
    NotBoundToPod,
    #[error("pod {namespace}/{pod} no longer exists (or was replaced)")]
    PodNotFound { namespace: String, pod: String },
    #[error("pod {namespace}/{pod} is not meshed (no Baton sidecar was injected)")]
    PodNotMeshed { namespace: String, pod: String },
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("CSR does not parse: {0}")]
    CsrMalformed(String),
    #[error("CSR signature does not verify with its own public key")]
    BadSignature,
    #[error("unsupported key type {found} (allowed: {allowed})")]
    UnsupportedKeyType { found: String, allowed: String },
    #[error("CSR asks for {requested}; this token may only obtain {allowed}")]
    IdentityMismatch { requested: String, allowed: String },
    #[error("too many certificate requests from pod {pod}; retry in {retry_after_secs} s")]
    RateLimited { pod: String, retry_after_secs: u64 },
    /// The CA-wide re-issue bucket is empty: a trust change made the fleet
    /// ask faster than `--identity-reissue-rate`. The sidecar keeps its
    /// (still valid) certificate and asks again later; no Event (nothing
    /// for the Pod's owner to fix).
    #[error("re-issue requests exceed the CA's re-issue rate; retry in {retry_after_secs} s")]
    ReissueDeferred { retry_after_secs: u64 },
    #[error("the TokenReview API is unavailable: {0}")]
    ReviewUnavailable(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl Refusal {
    /// Stable label for `baton_operator_identity_refusals_total{reason}`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Refusal::MissingToken => "missing_token",
            Refusal::TokenRejected(_) => "token_rejected",
            Refusal::WrongAudience { .. } => "wrong_audience",
            Refusal::NotServiceAccount(_) => "not_service_account",
            Refusal::NotBoundToPod => "not_bound_to_pod",
            Refusal::PodNotFound { .. } => "pod_not_found",
            Refusal::PodNotMeshed { .. } => "pod_not_meshed",
            Refusal::BadRequest(_) => "bad_request",
            Refusal::CsrMalformed(_) => "csr_malformed",
            Refusal::BadSignature => "bad_signature",
            Refusal::UnsupportedKeyType { .. } => "unsupported_key_type",
            Refusal::IdentityMismatch { .. } => "identity_mismatch",
            Refusal::RateLimited { .. } => "rate_limited",
            Refusal::ReissueDeferred { .. } => "reissue_deferred",
            Refusal::ReviewUnavailable(_) => "review_unavailable",
            Refusal::Internal(_) => "internal",
        }
    }

    /// HTTP status of the answer: 4xx for what the caller must change, 429
    /// for "slow down", 5xx for what is our fault (the client retries).
    pub fn http_status(&self) -> u16 {
        match self {
            Refusal::MissingToken | Refusal::TokenRejected(_) | Refusal::WrongAudience { .. } => {
                401
            }
            Refusal::NotServiceAccount(_)
            | Refusal::NotBoundToPod
            | Refusal::PodNotFound { .. }
            | Refusal::PodNotMeshed { .. }
            | Refusal::IdentityMismatch { .. } => 403,
            Refusal::BadRequest(_)
            | Refusal::CsrMalformed(_)
            | Refusal::BadSignature
            | Refusal::UnsupportedKeyType { .. } => 400,
            Refusal::RateLimited { .. } | Refusal::ReissueDeferred { .. } => 429,
            Refusal::ReviewUnavailable(_) => 503,
            Refusal::Internal(_) => 500,
        }
    }

    /// Event reason on the caller's Pod, for refusals its owner can fix
    /// (wrong sidecar settings, a Pod outside the mesh, a looping client).
    /// `None` for refusals without a known Pod or that are our own fault.
    pub fn event_reason(&self) -> Option<&'static str> {
        match self {
            Refusal::IdentityMismatch { .. } => Some("IdentityMismatch"),
            Refusal::UnsupportedKeyType { .. } => Some("UnsupportedKeyType"),
            Refusal::PodNotMeshed { .. } => Some("PodNotMeshed"),
            Refusal::RateLimited { .. } => Some("CertificateRequestsThrottled"),
            Refusal::BadSignature | Refusal::CsrMalformed(_) => Some("InvalidCertificateRequest"),
            _ => None,
        }
    }
}

/// A workload identity: `spiffe://<trust domain>/ns/<namespace>/sa/<sa>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    pub trust_domain: String,
    pub namespace: String,
    pub service_account: String,
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

/// True for a trust domain the sidecar's SPIFFE parser accepts (the config
/// model's rule, shared by both).
pub use baton_config::spiffe::valid_trust_domain;

/// The outcome of a TokenReview, as the identity service needs it (the
/// kube-free projection of `TokenReviewStatus`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReviewResult {
    pub authenticated: bool,
    /// Audiences the API server says the token is valid for.
    pub audiences: Vec<String>,
    pub username: String,
    /// `authentication.kubernetes.io/pod-name` / `pod-uid` of a bound token.
    pub pod_name: Option<String>,
    pub pod_uid: Option<String>,
    pub error: Option<String>,
}

/// Who is asking: a ServiceAccount in a namespace, through one Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub identity: Identity,
    pub pod_name: String,
    pub pod_uid: Option<String>,
}

impl Caller {
    /// Key of the rate limiter: the Pod (its UID when the token carries one,
    /// so a recreated Pod of the same name starts with a full bucket).
    pub fn pod_key(&self) -> String {
        match &self.pod_uid {
            Some(uid) => uid.clone(),
            None => format!("{}/{}", self.identity.namespace, self.pod_name),
        }
    }
}

const SA_PREFIX: &str = "system:serviceaccount:";

/// Turns a TokenReview result into the caller's identity, or a refusal.
/// The API server was asked for `audience`; its answer must say so too
/// (the TokenReview API contract: check `status.audiences`).
pub fn caller_from_review(
    review: &ReviewResult,
    audience: &str,
    trust_domain: &str,
) -> Result<Caller, Refusal> {
    if !review.authenticated {
        let error = review.error.clone().unwrap_or_default();
        // The API server reports a wrong audience only in its error text
        // ("token audiences [...] is invalid for the target audiences").
        if error.contains("audience") {
            return Err(Refusal::WrongAudience {
                expected: audience.to_owned(),
            });
        }
        return Err(Refusal::TokenRejected(if error.is_empty() {
            "not authenticated".to_owned()
        } else {
            error
        }));
    }
    if !review.audiences.iter().any(|a| a == audience) {
        return Err(Refusal::WrongAudience {
            expected: audience.to_owned(),
        });
    }
    let rest = review
        .username
        .strip_prefix(SA_PREFIX)
        .ok_or_else(|| Refusal::NotServiceAccount(review.username.clone()))?;
    let (namespace, service_account) = rest
        .split_once(':')
        .filter(|(ns, sa)| !ns.is_empty() && !sa.is_empty() && !sa.contains(':'))
        .ok_or_else(|| Refusal::NotServiceAccount(review.username.clone()))?;
    let pod_name = review
        .pod_name
        .clone()
        .filter(|p| !p.is_empty())
        .ok_or(Refusal::NotBoundToPod)?;
    Ok(Caller {
        identity: Identity {
            trust_domain: trust_domain.to_owned(),
            namespace: namespace.to_owned(),
            service_account: service_account.to_owned(),
        },
        pod_name,
        pod_uid: review.pod_uid.clone().filter(|u| !u.is_empty()),
    })
}

/// Key types a CSR may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    EcdsaP256,
    Rsa2048,
}

impl KeyKind {
    pub fn name(self) -> &'static str {
        match self {
            KeyKind::EcdsaP256 => "ECDSA-P256",
            KeyKind::Rsa2048 => "RSA-2048",
        }
    }
}

/// What the issuer accepts and how long certificates live.
#[derive(Debug, Clone)]
pub struct IssuePolicy {
    /// RSA-2048 is accepted only when allowed (a TlsPolicy that wants RSA);
    /// ECDSA P-256 always.
    pub allow_rsa: bool,
    pub lifetime: Duration,
    /// How far `notBefore` is backdated: peers' clocks may lag ours.
    pub backdate: Duration,
}

impl Default for IssuePolicy {
    fn default() -> Self {
        IssuePolicy {
            allow_rsa: false,
            lifetime: Duration::from_secs(24 * 3600),
            backdate: Duration::from_secs(60),
        }
    }
}

impl IssuePolicy {
    fn allowed_names(&self) -> String {
        if self.allow_rsa {
            "ECDSA-P256, RSA-2048".to_owned()
        } else {
            "ECDSA-P256".to_owned()
        }
    }
}

/// A CSR that passed every check: its public key (SubjectPublicKeyInfo DER)
/// and the key type.
#[derive(Debug, Clone)]
pub struct CheckedCsr {
    pub key_kind: KeyKind,
    spki_der: Vec<u8>,
}

/// Parses and checks a PEM CSR: one `CERTIFICATE REQUEST` block, a key of an
/// allowed type, a signature that verifies with that key, and exactly one
/// SAN, the URI `expected`.
pub fn check_csr(
    pem: &str,
    expected: &Identity,
    policy: &IssuePolicy,
) -> Result<CheckedCsr, Refusal> {
    use rustls_pki_types::CertificateSigningRequestDer;
    use rustls_pki_types::pem::PemObject;
    if pem.len() > MAX_CSR_BYTES {
        return Err(Refusal::CsrMalformed(format!(
            "larger than {MAX_CSR_BYTES} bytes"
        )));
    }
    let der = CertificateSigningRequestDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| Refusal::CsrMalformed(format!("no CERTIFICATE REQUEST PEM block: {e}")))?;
    let (rest, csr) = X509CertificationRequest::from_der(der.as_ref())
        .map_err(|e| Refusal::CsrMalformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(Refusal::CsrMalformed("trailing bytes after the CSR".into()));
    }
    let spki = &csr.certification_request_info.subject_pki;
    let key_kind = key_kind(spki, policy)?;
    csr.verify_signature().map_err(|_| Refusal::BadSignature)?;

    let requested = requested_sans(&csr)?;
    let want = expected.to_string();
    if requested.len() != 1 || requested[0] != want {
        return Err(Refusal::IdentityMismatch {
            requested: if requested.is_empty() {
                "no SAN".to_owned()
            } else {
                requested.join(", ")
            },
            allowed: want,
        });
    }
    Ok(CheckedCsr {
        key_kind,
        spki_der: spki.raw.to_vec(),
    })
}

fn key_kind(
    spki: &x509_parser::x509::SubjectPublicKeyInfo<'_>,
    policy: &IssuePolicy,
) -> Result<KeyKind, Refusal> {
    let alg = &spki.algorithm.algorithm;
    let unsupported = |found: String| Refusal::UnsupportedKeyType {
        found,
        allowed: policy.allowed_names(),
    };
    if *alg == OID_KEY_TYPE_EC_PUBLIC_KEY {
        let curve = spki
            .algorithm
            .parameters
            .as_ref()
            .and_then(|p| p.as_oid().ok());
        return match curve {
            Some(c) if c == OID_EC_P256 => Ok(KeyKind::EcdsaP256),
            Some(c) => Err(unsupported(format!("ECDSA curve {}", curve_name(&c)))),
            None => Err(unsupported("ECDSA without a named curve".into())),
        };
    }
    if *alg == OID_PKCS1_RSAENCRYPTION {
        let bits = match spki.parsed() {
            Ok(x509_parser::public_key::PublicKey::RSA(rsa)) => rsa.key_size(),
            _ => {
                return Err(Refusal::CsrMalformed(
                    "RSA public key does not parse".into(),
                ));
            }
        };
        return match (bits, policy.allow_rsa) {
            (2048, true) => Ok(KeyKind::Rsa2048),
            _ => Err(unsupported(format!("RSA-{bits}"))),
        };
    }
    Err(unsupported(format!("algorithm {alg}")))
}

fn curve_name(oid: &x509_parser::der_parser::oid::Oid<'_>) -> String {
    match oid.to_id_string().as_str() {
        "1.3.132.0.34" => "P-384".to_owned(),
        "1.3.132.0.35" => "P-521".to_owned(),
        other => other.to_owned(),
    }
}

/// Every SAN the CSR asks for, rendered (`URI`s verbatim, others tagged).
fn requested_sans(csr: &X509CertificationRequest<'_>) -> Result<Vec<String>, Refusal> {
    let mut out = Vec::new();
    for ext in csr.requested_extensions().into_iter().flatten() {
        if let ParsedExtension::SubjectAlternativeName(san) = ext {
            for name in &san.general_names {
                out.push(match name {
                    GeneralName::URI(u) => (*u).to_owned(),
                    GeneralName::DNSName(d) => format!("DNS:{d}"),
                    GeneralName::IPAddress(ip) => format!("IP:{ip:?}"),
                    GeneralName::RFC822Name(m) => format!("email:{m}"),
                    other => format!("{other:?}"),
                });
            }
        } else if let ParsedExtension::ParseError { error } = ext {
            return Err(Refusal::CsrMalformed(format!("extension: {error}")));
        }
    }
    Ok(out)
}

/// A signed certificate, as the wire response wants it.
#[derive(Debug, Clone)]
pub struct Issued {
    /// Leaf first, then the intermediates up to (not including) the root.
    pub certificate_chain_pem: String,
    /// Every trusted root.
    pub trust_bundle_pem: String,
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
    /// The trust generation it was issued under (the sidecar compares it
    /// with the one its config names, [`super::rotation`]).
    pub trust_generation: String,
}

/// Builds and signs the workload certificate for `identity` over the CSR's
/// key. `serial` is 16 random bytes from the caller (keeps this pure).
/// The lifetime never outlasts the issuer: a leaf valid after its issuer
/// expires would fail verification anyway, and an honest `notAfter` lets the
/// sidecar renew in time.
pub fn build_certificate(
    csr: &CheckedCsr,
    identity: &Identity,
    authority: &Authority,
    policy: &IssuePolicy,
    now: OffsetDateTime,
    serial: [u8; 16],
) -> Result<Issued, Refusal> {
    let internal = |e: rcgen::Error| Refusal::Internal(e.to_string());
    let public_key = rcgen::SubjectPublicKeyInfo::from_der(&csr.spki_der).map_err(internal)?;
    let mut params = CertificateParams::default();
    // Empty subject: the identity is the URI SAN alone (rcgen then marks
    // the SAN critical, as RFC 5280 requires).
    params.distinguished_name = rcgen::DistinguishedName::new();
    let uri = identity.to_string().try_into().map_err(internal)?;
    params.subject_alt_names = vec![SanType::URI(uri)];
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = match csr.key_kind {
        KeyKind::EcdsaP256 => vec![KeyUsagePurpose::DigitalSignature],
        // TLS 1.2 RSA key exchange suites are not offered, but some peers
        // still check for keyEncipherment on RSA leaves.
        KeyKind::Rsa2048 => vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ],
    };
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    let mut serial = serial;
    serial[0] &= 0x7f; // positive INTEGER
    params.serial_number = Some(SerialNumber::from_slice(&serial));
    let not_before = now - policy.backdate;
    let not_after = (now + policy.lifetime).min(authority.issuer_not_after());
    if not_after <= now {
        return Err(Refusal::Internal("the issuing CA has expired".into()));
    }
    params.not_before = not_before;
    params.not_after = not_after;
    let leaf = authority.sign(&params, &public_key).map_err(internal)?;
    let mut chain = leaf;
    chain.push_str(authority.chain_pem());
    Ok(Issued {
        certificate_chain_pem: chain,
        trust_bundle_pem: authority.trust_bundle_pem().to_owned(),
        not_before,
        not_after,
        trust_generation: authority.trust_state().generation.clone(),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::identity::authority::{CaPem, generate_intermediate, generate_root};
    use rcgen::PublicKeyData;
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, UnixTime};
    use std::sync::Arc;

    pub(crate) fn id(ns: &str, sa: &str) -> Identity {
        Identity {
            trust_domain: "cluster.local".into(),
            namespace: ns.into(),
            service_account: sa.into(),
        }
    }

    pub(crate) fn csr_with(kp: &rcgen::KeyPair, sans: Vec<SanType>) -> String {
        let mut params = CertificateParams::default();
        params.subject_alt_names = sans;
        params.serialize_request(kp).unwrap().pem().unwrap()
    }

    pub(crate) fn csr_for(kp: &rcgen::KeyPair, identity: &Identity) -> String {
        csr_with(
            kp,
            vec![SanType::URI(identity.to_string().try_into().unwrap())],
        )
    }

    fn rsa_key(bits: u32) -> rcgen::KeyPair {
        let pem = openssl::rsa::Rsa::generate(bits)
            .and_then(openssl::pkey::PKey::from_rsa)
            .and_then(|k| k.private_key_to_pem_pkcs8())
            .unwrap();
        rcgen::KeyPair::from_pem(&String::from_utf8(pem).unwrap()).unwrap()
    }

    fn now() -> OffsetDateTime {
        OffsetDateTime::now_utc()
    }

    fn root() -> CaPem {
        generate_root("cluster.local", now(), Duration::from_secs(365 * 86_400)).unwrap()
    }

    fn certs(pem: &str) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<_, _>>()
            .unwrap()
    }

    /// Verifies `chain` (leaf first) against `bundle` as a TLS peer would
    /// (webpki, the verifier rustls uses for client certificates).
    pub(crate) fn verifies(chain_pem: &str, bundle_pem: &str) -> bool {
        let mut roots = rustls::RootCertStore::empty();
        for c in certs(bundle_pem) {
            roots.add(c).unwrap();
        }
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        let chain = certs(chain_pem);
        verifier
            .verify_client_cert(&chain[0], &chain[1..], UnixTime::now())
            .is_ok()
    }

    fn uri_sans(pem: &str) -> Vec<String> {
        let der = certs(pem).remove(0);
        let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
        cert.subject_alternative_name()
            .unwrap()
            .map(|s| {
                s.value
                    .general_names
                    .iter()
                    .map(|n| format!("{n}"))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn issue(
        csr: &str,
        identity: &Identity,
        authority: &Authority,
        policy: &IssuePolicy,
    ) -> Result<Issued, Refusal> {
        let checked = check_csr(csr, identity, policy)?;
        build_certificate(&checked, identity, authority, policy, now(), rand::random())
    }

    #[test]
    fn a_p256_csr_for_the_reviewed_identity_gets_a_24h_leaf_that_verifies_against_the_root() {
        let ca = root();
        let authority = Authority::from_pem(&ca, now()).unwrap();
        let me = id("shop", "cart");
        let kp = rcgen::KeyPair::generate().unwrap();
        let issued = issue(&csr_for(&kp, &me), &me, &authority, &IssuePolicy::default()).unwrap();
        assert!(verifies(
            &issued.certificate_chain_pem,
            &issued.trust_bundle_pem
        ));
        assert_eq!(
            certs(&issued.certificate_chain_pem).len(),
            1,
            "a root issuer adds no intermediates"
        );
        assert_eq!(
            uri_sans(&issued.certificate_chain_pem),
            vec!["URI(spiffe://cluster.local/ns/shop/sa/cart)".to_owned()]
        );
        let lifetime = issued.not_after - issued.not_before;
        assert_eq!(
            lifetime,
            time::Duration::hours(24) + time::Duration::minutes(1)
        );
        let der = certs(&issued.certificate_chain_pem).remove(0);
        let (_, leaf) = x509_parser::parse_x509_certificate(&der).unwrap();
        assert!(!leaf.is_ca());
        // Empty subject: the SAN must be critical (RFC 5280 4.2.1.6).
        assert!(leaf.subject().as_raw().len() <= 2, "{}", leaf.subject());
        assert!(leaf.subject_alternative_name().unwrap().unwrap().critical);
        let eku = leaf.extended_key_usage().unwrap().unwrap().value;
        assert!(eku.server_auth && eku.client_auth);
        // The certificate carries the CSR's key, not one of ours.
        assert_eq!(
            leaf.public_key().subject_public_key.data.as_ref(),
            kp.public_key_raw()
        );
    }

    #[test]
    fn the_lifetime_is_configurable_and_never_outlasts_the_issuer() {
        let ca = generate_root("cluster.local", now(), Duration::from_secs(3600)).unwrap();
        let authority = Authority::from_pem(&ca, now()).unwrap();
        let me = id("a", "b");
        let kp = rcgen::KeyPair::generate().unwrap();
        let short = IssuePolicy {
            lifetime: Duration::from_secs(600),
            ..IssuePolicy::default()
        };
        let issued = issue(&csr_for(&kp, &me), &me, &authority, &short).unwrap();
        assert_eq!(
            issued.not_after - issued.not_before,
            time::Duration::seconds(660)
        );
        // 24 h asked, the root lives one hour: the leaf ends with the root.
        let issued = issue(&csr_for(&kp, &me), &me, &authority, &IssuePolicy::default()).unwrap();
        assert_eq!(issued.not_after, authority.issuer_not_after());
    }

    #[test]
    fn leaves_from_a_plug_in_intermediate_carry_it_in_the_chain_and_verify_against_the_root() {
        let root = root();
        let intermediate =
            generate_intermediate(&root, "issuer", now(), Duration::from_secs(86_400 * 30))
                .unwrap();
        let authority = Authority::from_pem(&intermediate, now()).unwrap();
        let me = id("shop", "cart");
        let kp = rcgen::KeyPair::generate().unwrap();
        let issued = issue(&csr_for(&kp, &me), &me, &authority, &IssuePolicy::default()).unwrap();
        let chain = certs(&issued.certificate_chain_pem);
        assert_eq!(chain.len(), 2);
        assert_eq!(chain[1], certs(&intermediate.cert)[0]);
        assert_eq!(issued.trust_bundle_pem, root.bundle);
        assert!(verifies(&issued.certificate_chain_pem, &root.bundle));
        // Without the intermediate the leaf does not verify: the chain is needed.
        let leaf_only = pem::encode(&pem::Pem::new("CERTIFICATE", chain[0].to_vec()));
        assert!(!verifies(&leaf_only, &root.bundle));
    }

    #[test]
    fn serial_numbers_are_random_and_positive() {
        let authority = Authority::from_pem(&root(), now()).unwrap();
        let me = id("a", "b");
        let kp = rcgen::KeyPair::generate().unwrap();
        let csr = check_csr(&csr_for(&kp, &me), &me, &IssuePolicy::default()).unwrap();
        let p = IssuePolicy::default();
        let serial = |s: [u8; 16]| {
            let issued = build_certificate(&csr, &me, &authority, &p, now(), s).unwrap();
            let der = certs(&issued.certificate_chain_pem).remove(0);
            let (_, c) = x509_parser::parse_x509_certificate(&der).unwrap();
            c.raw_serial().to_vec()
        };
        let a = serial([0xff; 16]);
        assert_eq!(a[0] & 0x80, 0, "{a:?}");
        assert_ne!(serial([1; 16]), serial([2; 16]));
    }

    #[test]
    fn a_csr_claiming_another_service_account_is_refused() {
        let policy = IssuePolicy::default();
        let kp = rcgen::KeyPair::generate().unwrap();
        let csr = csr_for(&kp, &id("shop", "admin"));
        let err = check_csr(&csr, &id("shop", "cart"), &policy).unwrap_err();
        assert_eq!(
            err,
            Refusal::IdentityMismatch {
                requested: "spiffe://cluster.local/ns/shop/sa/admin".into(),
                allowed: "spiffe://cluster.local/ns/shop/sa/cart".into(),
            }
        );
        // Another namespace, or another trust domain, is no better.
        let other_ns = csr_for(&kp, &id("bank", "cart"));
        assert!(matches!(
            check_csr(&other_ns, &id("shop", "cart"), &policy),
            Err(Refusal::IdentityMismatch { .. })
        ));
        let mut foreign = id("shop", "cart");
        foreign.trust_domain = "evil.example".into();
        assert!(matches!(
            check_csr(&csr_for(&kp, &foreign), &id("shop", "cart"), &policy),
            Err(Refusal::IdentityMismatch { .. })
        ));
    }

    #[test]
    fn a_csr_with_extra_or_missing_sans_is_refused() {
        let me = id("shop", "cart");
        let policy = IssuePolicy::default();
        let kp = rcgen::KeyPair::generate().unwrap();
        let extra = csr_with(
            &kp,
            vec![
                SanType::URI(me.to_string().try_into().unwrap()),
                SanType::DnsName("kubernetes.default.svc".try_into().unwrap()),
            ],
        );
        let err = check_csr(&extra, &me, &policy).unwrap_err();
        assert_eq!(err.metric_label(), "identity_mismatch");
        assert!(
            err.to_string().contains("DNS:kubernetes.default.svc"),
            "{err}"
        );
        let none = csr_with(&kp, vec![]);
        assert!(
            check_csr(&none, &me, &policy)
                .unwrap_err()
                .to_string()
                .contains("no SAN")
        );
    }

    #[test]
    fn a_csr_whose_signature_does_not_verify_is_refused() {
        let me = id("shop", "cart");
        let kp = rcgen::KeyPair::generate().unwrap();
        let pem_text = csr_for(&kp, &me);
        let mut der = pem::parse(&pem_text).unwrap().into_contents();
        // The signature is the last bytes of the DER: flip one.
        let last = der.len() - 2;
        der[last] ^= 0x01;
        let tampered = pem::encode(&pem::Pem::new("CERTIFICATE REQUEST", der));
        assert_eq!(
            check_csr(&tampered, &me, &IssuePolicy::default()).unwrap_err(),
            Refusal::BadSignature
        );
    }

    #[test]
    fn a_csr_signed_by_another_key_than_it_carries_is_refused() {
        // Splice key A's SubjectPublicKeyInfo into a CSR signed by key B.
        let me = id("shop", "cart");
        let a = rcgen::KeyPair::generate().unwrap();
        let b = rcgen::KeyPair::generate().unwrap();
        let mut der = pem::parse(csr_for(&b, &me)).unwrap().into_contents();
        let spki_b = b.subject_public_key_info();
        let spki_a = a.subject_public_key_info();
        let at = der
            .windows(spki_b.len())
            .position(|w| w == spki_b.as_slice())
            .unwrap();
        der[at..at + spki_a.len()].copy_from_slice(&spki_a);
        let spliced = pem::encode(&pem::Pem::new("CERTIFICATE REQUEST", der));
        assert_eq!(
            check_csr(&spliced, &me, &IssuePolicy::default()).unwrap_err(),
            Refusal::BadSignature
        );
    }

    #[test]
    fn p384_and_ed25519_keys_are_unsupported() {
        let me = id("shop", "cart");
        for alg in [&rcgen::PKCS_ECDSA_P384_SHA384, &rcgen::PKCS_ED25519] {
            let kp = rcgen::KeyPair::generate_for(alg).unwrap();
            let err = check_csr(&csr_for(&kp, &me), &me, &IssuePolicy::default()).unwrap_err();
            assert_eq!(err.metric_label(), "unsupported_key_type", "{err}");
            assert!(err.to_string().contains("allowed: ECDSA-P256"), "{err}");
        }
        let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
        let err = check_csr(&csr_for(&kp, &me), &me, &IssuePolicy::default()).unwrap_err();
        assert!(err.to_string().contains("P-384"), "{err}");
    }

    #[test]
    fn rsa_2048_is_accepted_only_where_allowed_and_other_sizes_never() {
        let me = id("shop", "cart");
        let authority = Authority::from_pem(&root(), now()).unwrap();
        let kp = rsa_key(2048);
        let csr = csr_for(&kp, &me);
        let denied = check_csr(&csr, &me, &IssuePolicy::default()).unwrap_err();
        assert_eq!(
            denied,
            Refusal::UnsupportedKeyType {
                found: "RSA-2048".into(),
                allowed: "ECDSA-P256".into()
            }
        );
        let rsa = IssuePolicy {
            allow_rsa: true,
            ..IssuePolicy::default()
        };
        let issued = issue(&csr, &me, &authority, &rsa).unwrap();
        assert!(verifies(
            &issued.certificate_chain_pem,
            &issued.trust_bundle_pem
        ));
        let big = csr_for(&rsa_key(3072), &me);
        assert_eq!(
            check_csr(&big, &me, &rsa).unwrap_err().to_string(),
            "unsupported key type RSA-3072 (allowed: ECDSA-P256, RSA-2048)"
        );
    }

    #[test]
    fn garbage_truncated_and_oversized_csrs_are_malformed() {
        let me = id("a", "b");
        let p = IssuePolicy::default();
        for bad in [
            "",
            "hello",
            "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
        ] {
            assert_eq!(
                check_csr(bad, &me, &p).unwrap_err().metric_label(),
                "csr_malformed",
                "{bad:?}"
            );
        }
        let kp = rcgen::KeyPair::generate().unwrap();
        let mut der = pem::parse(csr_for(&kp, &me)).unwrap().into_contents();
        der.truncate(der.len() - 10);
        let truncated = pem::encode(&pem::Pem::new("CERTIFICATE REQUEST", der));
        assert_eq!(
            check_csr(&truncated, &me, &p).unwrap_err().metric_label(),
            "csr_malformed"
        );
        let huge = "A".repeat(MAX_CSR_BYTES + 1);
        assert!(
            check_csr(&huge, &me, &p)
                .unwrap_err()
                .to_string()
                .contains("larger than")
        );
        // A certificate is not a CSR.
        let cert = root().cert;
        assert_eq!(
            check_csr(&cert, &me, &p).unwrap_err().metric_label(),
            "csr_malformed"
        );
    }

    fn review(user: &str, pod: Option<&str>) -> ReviewResult {
        ReviewResult {
            authenticated: true,
            audiences: vec!["identity.baton.dev".into()],
            username: user.into(),
            pod_name: pod.map(str::to_owned),
            pod_uid: pod.map(|p| format!("uid-{p}")),
            error: None,
        }
    }

    const AUD: &str = "identity.baton.dev";

    #[test]
    fn a_pod_bound_service_account_token_names_the_caller() {
        let caller = caller_from_review(
            &review("system:serviceaccount:shop:cart", Some("cart-1")),
            AUD,
            "td",
        )
        .unwrap();
        assert_eq!(caller.identity.to_string(), "spiffe://td/ns/shop/sa/cart");
        assert_eq!(caller.pod_name, "cart-1");
        assert_eq!(caller.pod_key(), "uid-cart-1");
        let no_uid = Caller {
            pod_uid: None,
            ..caller
        };
        assert_eq!(no_uid.pod_key(), "shop/cart-1");
    }

    #[test]
    fn tokens_for_another_audience_are_refused_whichever_way_the_api_server_says_it() {
        let mut r = review("system:serviceaccount:shop:cart", Some("p"));
        r.audiences = vec!["https://kubernetes.default.svc".into()];
        let wrong = Refusal::WrongAudience {
            expected: AUD.into(),
        };
        assert_eq!(caller_from_review(&r, AUD, "td").unwrap_err(), wrong);
        let unauth = ReviewResult {
            error: Some("[invalid bearer token, token audiences [\"api\"] is invalid for the target audiences [\"identity.baton.dev\"]]".into()),
            ..ReviewResult::default()
        };
        assert_eq!(caller_from_review(&unauth, AUD, "td").unwrap_err(), wrong);
    }

    #[test]
    fn unauthenticated_user_and_unbound_tokens_are_refused_with_their_reason() {
        let expired = ReviewResult {
            error: Some("token has expired".into()),
            ..ReviewResult::default()
        };
        assert_eq!(
            caller_from_review(&expired, AUD, "td").unwrap_err(),
            Refusal::TokenRejected("token has expired".into())
        );
        assert_eq!(
            caller_from_review(&ReviewResult::default(), AUD, "td")
                .unwrap_err()
                .metric_label(),
            "token_rejected"
        );
        for user in [
            "alice",
            "system:serviceaccount:",
            "system:serviceaccount:ns",
            "system:serviceaccount::sa",
            "system:serviceaccount:ns:a:b",
        ] {
            assert_eq!(
                caller_from_review(&review(user, Some("p")), AUD, "td").unwrap_err(),
                Refusal::NotServiceAccount(user.into())
            );
        }
        assert_eq!(
            caller_from_review(&review("system:serviceaccount:a:b", None), AUD, "td").unwrap_err(),
            Refusal::NotBoundToPod
        );
    }

    #[test]
    fn every_refusal_has_its_own_label_and_an_error_status() {
        let all = [
            Refusal::MissingToken,
            Refusal::TokenRejected(String::new()),
            Refusal::WrongAudience {
                expected: String::new(),
            },
            Refusal::NotServiceAccount(String::new()),
            Refusal::NotBoundToPod,
            Refusal::PodNotFound {
                namespace: String::new(),
                pod: String::new(),
            },
            Refusal::PodNotMeshed {
                namespace: String::new(),
                pod: String::new(),
            },
            Refusal::BadRequest(String::new()),
            Refusal::CsrMalformed(String::new()),
            Refusal::BadSignature,
            Refusal::UnsupportedKeyType {
                found: String::new(),
                allowed: String::new(),
            },
            Refusal::IdentityMismatch {
                requested: String::new(),
                allowed: String::new(),
            },
            Refusal::RateLimited {
                pod: String::new(),
                retry_after_secs: 1,
            },
            Refusal::ReissueDeferred {
                retry_after_secs: 1,
            },
            Refusal::ReviewUnavailable(String::new()),
            Refusal::Internal(String::new()),
        ];
        let labels: std::collections::HashSet<_> = all.iter().map(Refusal::metric_label).collect();
        assert_eq!(labels.len(), all.len());
        for r in &all {
            assert!((400..600).contains(&r.http_status()), "{r:?}");
        }
        assert_eq!(
            Refusal::RateLimited {
                pod: String::new(),
                retry_after_secs: 1
            }
            .http_status(),
            429
        );
        assert_eq!(Refusal::ReviewUnavailable(String::new()).http_status(), 503);
    }

    #[test]
    fn trust_domains_follow_the_sidecars_rules() {
        assert!(valid_trust_domain("cluster.local"));
        assert!(valid_trust_domain("prod_eu-1.example"));
        for bad in ["", "Cluster.local", "a/b", "a b", &"x".repeat(256)] {
            assert!(!valid_trust_domain(bad), "{bad:?}");
        }
    }
}
