//! The mesh certificate authority, as loaded material: the issuing
//! certificate and key, the chain from it up to a root, and the trust bundle
//! (every root sidecars trust). Pure: parsing, checking, generating a root,
//! signing.
//!
//! One layout serves every source — the cert-manager `kubernetes.io/tls` CA
//! layout:
//!
//! | key | self-managed root | plug-in CA / cert-manager |
//! |---|---|---|
//! | `tls.crt` | the root | the intermediate (then any further intermediates) |
//! | `tls.key` | the root's key | the intermediate's key |
//! | `ca.crt`  | the root(s) | the root(s) |
//!
//! `ca.crt` may hold several roots: that is how a root rotation is staged
//! (new root trusted everywhere before anything it signs is served).
//! The private key is held in an `rcgen::KeyPair` whose `Debug` never
//! prints it, and [`Authority`]'s own `Debug` prints only public facts.

use std::fmt;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData, SanType,
};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use time::OffsetDateTime;
use x509_parser::certificate::X509Certificate;
use x509_parser::prelude::FromDer;

/// Keys of the CA Secret (cert-manager's layout).
pub const CERT_KEY: &str = "tls.crt";
pub const KEY_KEY: &str = "tls.key";
pub const BUNDLE_KEY: &str = "ca.crt";

/// Why CA material cannot be used. Messages name the Secret key at fault
/// and never contain key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaError {
    #[error("{key}: {detail}")]
    Pem { key: &'static str, detail: String },
    #[error(
        "tls.key: not a usable private key ({0}); PKCS#8, SEC1 (EC) and PKCS#1 (RSA) PEM are accepted"
    )]
    Key(String),
    #[error("tls.key does not belong to the first certificate of tls.crt")]
    KeyMismatch,
    #[error("{0} is not a CA certificate (basicConstraints CA:TRUE is required)")]
    NotCa(String),
    #[error("tls.crt does not chain to any root in ca.crt ({0})")]
    Untrusted(String),
    #[error("the issuing certificate {subject} expired at {not_after}")]
    Expired { subject: String, not_after: String },
    #[error("generate: {0}")]
    Generate(String),
}

impl CaError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            CaError::Pem { .. } => "pem",
            CaError::Key(_) => "key",
            CaError::KeyMismatch => "key_mismatch",
            CaError::NotCa(_) => "not_ca",
            CaError::Untrusted(_) => "untrusted",
            CaError::Expired { .. } => "expired",
            CaError::Generate(_) => "generate",
        }
    }
}

/// The PEM texts of a CA (the Secret's three keys). `Debug` redacts the key.
pub use baton_controlplane::ca_secret::CaPem;

/// Loaded, checked CA material, ready to sign.
pub struct Authority {
    issuer: Issuer<'static, KeyPair>,
    issuer_subject: String,
    /// PEM of the intermediates (tls.crt minus self-signed certificates):
    /// what follows the leaf in an issued chain. Empty for a root issuer.
    chain_pem: String,
    trust_bundle_pem: String,
    issuer_not_after: OffsetDateTime,
    /// notAfter of the root the issuer chains to.
    root_not_after: OffsetDateTime,
    /// Earliest notAfter among the bundle's roots.
    bundle_min_not_after: OffsetDateTime,
    bundle_len: usize,
    /// What certificates issued from this material are issued under
    /// (rotation tracking, [`super::rotation`]).
    trust: super::rotation::TrustState,
}

impl fmt::Debug for Authority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Authority")
            .field("issuer", &self.issuer_subject)
            .field("issuer_not_after", &self.issuer_not_after)
            .field("root_not_after", &self.root_not_after)
            .field("bundle_roots", &self.bundle_len)
            .field("trust_generation", &self.trust.generation)
            .finish_non_exhaustive()
    }
}

fn certs(key: &'static str, pem: &str) -> Result<Vec<CertificateDer<'static>>, CaError> {
    let v = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CaError::Pem {
            key,
            detail: e.to_string(),
        })?;
    if v.is_empty() {
        return Err(CaError::Pem {
            key,
            detail: "no CERTIFICATE block".into(),
        });
    }
    Ok(v)
}

fn parse<'a>(key: &'static str, der: &'a [u8]) -> Result<X509Certificate<'a>, CaError> {
    X509Certificate::from_der(der)
        .map(|(_, c)| c)
        .map_err(|e| CaError::Pem {
            key,
            detail: format!("certificate does not parse: {e}"),
        })
}

fn is_ca(cert: &X509Certificate<'_>) -> bool {
    matches!(cert.basic_constraints(), Ok(Some(bc)) if bc.value.ca)
}

fn self_signed(cert: &X509Certificate<'_>) -> bool {
    cert.subject() == cert.issuer() && cert.verify_signature(None).is_ok()
}

fn signed_by(child: &X509Certificate<'_>, parent: &X509Certificate<'_>) -> bool {
    child.issuer() == parent.subject() && child.verify_signature(Some(parent.public_key())).is_ok()
}

fn pem_encode(der: &[u8]) -> String {
    pem::encode_config(
        &pem::Pem::new("CERTIFICATE", der),
        pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF),
    )
}

/// Reads a private key in PKCS#8, or converts SEC1 / PKCS#1 (cert-manager's
/// default encodings) to PKCS#8: ring, under rcgen, signs only from PKCS#8.
fn key_pair(pem: &str) -> Result<KeyPair, CaError> {
    if let Ok(k) = KeyPair::from_pem(pem) {
        return Ok(k);
    }
    // Never echo the library's error text verbatim into messages: keep it
    // to the error kind, which cannot contain key bytes.
    let pkey = openssl::pkey::PKey::private_key_from_pem(pem.as_bytes())
        .map_err(|_| CaError::Key("unreadable PEM".into()))?;
    let pkcs8 = pkey
        .private_key_to_pem_pkcs8()
        .map_err(|_| CaError::Key("cannot convert to PKCS#8".into()))?;
    KeyPair::from_pem(&String::from_utf8_lossy(&pkcs8))
        .map_err(|_| CaError::Key("unsupported key algorithm".into()))
}

impl Authority {
    /// Checks and loads CA material: the key matches the issuer, the issuer
    /// is a CA and unexpired, and tls.crt chains to a root of ca.crt.
    pub fn from_pem(ca: &CaPem, now: OffsetDateTime) -> Result<Authority, CaError> {
        let chain = certs(CERT_KEY, &ca.cert)?;
        let roots = certs(BUNDLE_KEY, &ca.bundle)?;
        let key = key_pair(&ca.key)?;
        let chain_parsed = chain
            .iter()
            .map(|c| parse(CERT_KEY, c))
            .collect::<Result<Vec<_>, _>>()?;
        let roots_parsed = roots
            .iter()
            .map(|c| parse(BUNDLE_KEY, c))
            .collect::<Result<Vec<_>, _>>()?;
        let issuer = &chain_parsed[0];
        if issuer.public_key().subject_public_key.data.as_ref() != key.der_bytes() {
            return Err(CaError::KeyMismatch);
        }
        if !is_ca(issuer) {
            return Err(CaError::NotCa(format!("tls.crt ({})", issuer.subject())));
        }
        for root in &roots_parsed {
            if !is_ca(root) {
                return Err(CaError::NotCa(format!("ca.crt ({})", root.subject())));
            }
        }
        let issuer_not_after = issuer.validity().not_after.to_datetime();
        if issuer_not_after <= now {
            return Err(CaError::Expired {
                subject: issuer.subject().to_string(),
                not_after: issuer_not_after.to_string(),
            });
        }
        // Walk tls.crt upwards until a certificate is, or is signed by, a
        // root of the bundle.
        let mut anchor = None;
        for (i, cert) in chain_parsed.iter().enumerate() {
            if i > 0 && !signed_by(&chain_parsed[i - 1], cert) {
                return Err(CaError::Untrusted(format!(
                    "certificate {} of tls.crt did not sign the one before it",
                    i + 1
                )));
            }
            if let Some(r) = roots_parsed
                .iter()
                .find(|r| r.as_ref() == cert.as_ref() || signed_by(cert, r))
            {
                anchor = Some(r);
                break;
            }
        }
        let anchor =
            anchor.ok_or_else(|| CaError::Untrusted(format!("issuer {}", issuer.subject())))?;
        let chain_pem = chain
            .iter()
            .zip(&chain_parsed)
            .filter(|(_, p)| !self_signed(p))
            .map(|(der, _)| pem_encode(der))
            .collect::<String>();
        let trust_bundle_pem = roots.iter().map(|d| pem_encode(d)).collect::<String>();
        let root_not_after = anchor.validity().not_after.to_datetime();
        let bundle_min_not_after = roots_parsed
            .iter()
            .map(|r| r.validity().not_after.to_datetime())
            .min()
            .expect("bundle is not empty");
        let issuer_subject = issuer.subject().to_string();
        // The digest of everything a sidecar's certificate depends on: the
        // issuing chain and the roots. Every replica computes the same name
        // from the same Secret, with no coordination.
        let generation = {
            let mut h = openssl::sha::Sha256::new();
            for der in &chain {
                h.update(&(der.len() as u64).to_be_bytes());
                h.update(der);
            }
            h.update(b"|");
            for der in &roots {
                h.update(&(der.len() as u64).to_be_bytes());
                h.update(der);
            }
            h.finish()[..8]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        };
        let newest_root_not_before = roots_parsed
            .iter()
            .map(|r| r.validity().not_before.to_datetime())
            .max()
            .expect("bundle is not empty");
        let trust = super::rotation::TrustState {
            generation,
            roots: roots.len(),
            issuer_root: anchor.subject().to_string(),
            issuer_root_is_newest: roots.len() > 1
                && anchor.validity().not_before.to_datetime() == newest_root_not_before,
        };
        let issuer_rc = Issuer::from_ca_cert_der(&chain[0], key).map_err(|e| CaError::Pem {
            key: CERT_KEY,
            detail: e.to_string(),
        })?;
        Ok(Authority {
            issuer: issuer_rc,
            issuer_subject,
            chain_pem,
            trust_bundle_pem,
            issuer_not_after,
            root_not_after,
            bundle_min_not_after,
            bundle_len: roots.len(),
            trust,
        })
    }

    /// The trust generation and the roots' shape ([`super::rotation`]).
    pub fn trust_state(&self) -> &super::rotation::TrustState {
        &self.trust
    }

    pub fn issuer_subject(&self) -> &str {
        &self.issuer_subject
    }
    pub fn issuer_not_after(&self) -> OffsetDateTime {
        self.issuer_not_after
    }
    pub fn root_not_after(&self) -> OffsetDateTime {
        self.root_not_after
    }
    pub fn bundle_min_not_after(&self) -> OffsetDateTime {
        self.bundle_min_not_after
    }
    pub fn bundle_len(&self) -> usize {
        self.bundle_len
    }
    /// Intermediates to append after an issued leaf.
    pub fn chain_pem(&self) -> &str {
        &self.chain_pem
    }
    /// Every root sidecars should trust.
    pub fn trust_bundle_pem(&self) -> &str {
        &self.trust_bundle_pem
    }

    /// Signs `params` over `public_key`; returns the leaf's PEM.
    pub fn sign(
        &self,
        params: &CertificateParams,
        public_key: &impl PublicKeyData,
    ) -> Result<String, rcgen::Error> {
        Ok(params.signed_by(public_key, &self.issuer)?.pem())
    }

    /// A serving certificate for the identity endpoint itself (fresh P-256
    /// key), so sidecars verify the endpoint with the mesh trust bundle.
    /// Returns (chain PEM, key PEM).
    pub fn serving_certificate(
        &self,
        dns_names: &[String],
        ips: &[std::net::IpAddr],
        now: OffsetDateTime,
        lifetime: Duration,
    ) -> Result<(String, String), CaError> {
        let gen_err = |e: rcgen::Error| CaError::Generate(e.to_string());
        let key = KeyPair::generate().map_err(gen_err)?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(
            DnType::CommonName,
            dns_names.first().map_or("baton-identity", String::as_str),
        );
        params.distinguished_name = dn;
        params.subject_alt_names = dns_names
            .iter()
            .map(|n| n.clone().try_into().map(SanType::DnsName))
            .chain(ips.iter().map(|ip| Ok(SanType::IpAddress(*ip))))
            .collect::<Result<_, _>>()
            .map_err(gen_err)?;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = now - time::Duration::minutes(1);
        params.not_after = (now + lifetime).min(self.issuer_not_after);
        let leaf = self.sign(&params, &key).map_err(gen_err)?;
        Ok((leaf + &self.chain_pem, key.serialize_pem()))
    }
}

/// Generates a self-signed ECDSA P-256 root for `trust_domain`: the
/// material of a self-managed CA's Secret (the root issues directly, as
/// Istio's self-signed CA does).
pub fn generate_root(
    trust_domain: &str,
    now: OffsetDateTime,
    validity: Duration,
) -> Result<CaPem, CaError> {
    let gen_err = |e: rcgen::Error| CaError::Generate(e.to_string());
    let key = KeyPair::generate().map_err(gen_err)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "baton-identity-root");
    dn.push(DnType::OrganizationName, trust_domain);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + validity;
    let cert = params.self_signed(&key).map_err(gen_err)?.pem();
    Ok(CaPem {
        bundle: cert.clone(),
        cert,
        key: key.serialize_pem(),
    })
}

/// Issues an intermediate CA under `root` (tests, and the plug-in CA
/// example in the docs' runbook are shaped like this).
pub fn generate_intermediate(
    root: &CaPem,
    name: &str,
    now: OffsetDateTime,
    validity: Duration,
) -> Result<CaPem, CaError> {
    let gen_err = |e: rcgen::Error| CaError::Generate(e.to_string());
    let root_key = key_pair(&root.key)?;
    let issuer = Issuer::from_ca_cert_pem(&root.cert, root_key).map_err(gen_err)?;
    let key = KeyPair::generate().map_err(gen_err)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.use_authority_key_identifier_extension = true;
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + validity;
    let cert = params.signed_by(&key, &issuer).map_err(gen_err)?.pem();
    Ok(CaPem {
        cert,
        key: key.serialize_pem(),
        bundle: root.bundle.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> OffsetDateTime {
        OffsetDateTime::now_utc()
    }

    fn year() -> Duration {
        Duration::from_secs(365 * 86_400)
    }

    #[test]
    fn a_generated_root_loads_as_its_own_anchor_and_debug_never_shows_the_key() {
        let ca = generate_root("cluster.local", now(), year()).unwrap();
        let a = Authority::from_pem(&ca, now()).unwrap();
        assert_eq!(a.chain_pem(), "", "a root issuer adds no intermediate");
        assert_eq!(a.bundle_len(), 1);
        assert_eq!(a.root_not_after(), a.issuer_not_after());
        assert!(a.issuer_subject().contains("baton-identity-root"));
        let secret_body: String = ca.key.lines().filter(|l| !l.starts_with("-----")).collect();
        for debug in [format!("{a:?}"), format!("{ca:?}")] {
            assert!(!debug.contains(&secret_body[..40]), "{debug}");
            assert!(!debug.contains("PRIVATE KEY"), "{debug}");
        }
        assert!(format!("{ca:?}").contains("<redacted>"));
    }

    #[test]
    fn a_plug_in_intermediate_is_used_with_its_root_as_anchor() {
        let root = generate_root("cluster.local", now(), year()).unwrap();
        let inter =
            generate_intermediate(&root, "issuer", now(), Duration::from_secs(86_400)).unwrap();
        let a = Authority::from_pem(&inter, now()).unwrap();
        assert_eq!(a.chain_pem(), inter.cert);
        assert!(a.issuer_not_after() < a.root_not_after());
        // cert-manager may append the root to tls.crt: it is not repeated in chains.
        let with_root = CaPem {
            cert: format!("{}{}", inter.cert, root.cert),
            ..inter.clone()
        };
        assert_eq!(
            Authority::from_pem(&with_root, now()).unwrap().chain_pem(),
            inter.cert
        );
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let a = generate_root("td", now(), year()).unwrap();
        let b = generate_root("td", now(), year()).unwrap();
        let mixed = CaPem { key: b.key, ..a };
        assert_eq!(
            Authority::from_pem(&mixed, now()).unwrap_err(),
            CaError::KeyMismatch
        );
    }

    #[test]
    fn an_intermediate_whose_root_is_not_in_the_bundle_is_refused() {
        let root = generate_root("td", now(), year()).unwrap();
        let other = generate_root("td", now(), year()).unwrap();
        let inter = generate_intermediate(&root, "issuer", now(), year()).unwrap();
        let wrong_bundle = CaPem {
            bundle: other.cert,
            ..inter
        };
        let err = Authority::from_pem(&wrong_bundle, now()).unwrap_err();
        assert_eq!(err.metric_label(), "untrusted", "{err}");
    }

    #[test]
    fn a_leaf_certificate_cannot_be_the_issuer() {
        let root = generate_root("td", now(), year()).unwrap();
        let authority = Authority::from_pem(&root, now()).unwrap();
        let (leaf, key) = authority
            .serving_certificate(&["x.example".into()], &[], now(), Duration::from_secs(3600))
            .unwrap();
        let err = Authority::from_pem(
            &CaPem {
                cert: leaf,
                key,
                bundle: root.bundle,
            },
            now(),
        )
        .unwrap_err();
        assert_eq!(err.metric_label(), "not_ca", "{err}");
    }

    #[test]
    fn an_expired_issuer_is_refused() {
        let old = now() - time::Duration::days(10);
        let root = generate_root("td", old, Duration::from_secs(86_400)).unwrap();
        let err = Authority::from_pem(&root, now()).unwrap_err();
        assert_eq!(err.metric_label(), "expired", "{err}");
    }

    #[test]
    fn a_bundle_with_two_roots_is_handed_out_whole_and_the_earliest_expiry_is_reported() {
        let old = generate_root("td", now(), Duration::from_secs(86_400 * 30)).unwrap();
        let new = generate_root("td", now(), year()).unwrap();
        // Rotation step 1: trust both, still issue from the old root.
        let staged = CaPem {
            bundle: format!("{}{}", old.cert, new.cert),
            ..old.clone()
        };
        let a = Authority::from_pem(&staged, now()).unwrap();
        assert_eq!(a.bundle_len(), 2);
        assert_eq!(a.trust_bundle_pem(), staged.bundle);
        assert!(a.bundle_min_not_after() < now() + time::Duration::days(31));
        // Step 2: issue from the new root, old still trusted.
        let switched = CaPem {
            bundle: staged.bundle.clone(),
            ..new
        };
        let b = Authority::from_pem(&switched, now()).unwrap();
        assert!(b.root_not_after() > now() + time::Duration::days(300));
        assert_eq!(b.bundle_len(), 2);
    }

    #[test]
    fn sec1_and_pkcs1_keys_as_cert_manager_writes_them_are_accepted() {
        let root = generate_root("td", now(), year()).unwrap();
        let pkey = openssl::pkey::PKey::private_key_from_pem(root.key.as_bytes()).unwrap();
        let sec1 = String::from_utf8(pkey.ec_key().unwrap().private_key_to_pem().unwrap()).unwrap();
        assert!(sec1.contains("BEGIN EC PRIVATE KEY"));
        let a = Authority::from_pem(&CaPem { key: sec1, ..root }, now());
        assert!(a.is_ok(), "{a:?}");

        // An RSA CA (PKCS#1), e.g. a corporate root.
        let rsa = openssl::rsa::Rsa::generate(2048).unwrap();
        let pkcs1 = String::from_utf8(rsa.private_key_to_pem().unwrap()).unwrap();
        let pkcs8 = String::from_utf8(
            openssl::pkey::PKey::from_rsa(rsa)
                .unwrap()
                .private_key_to_pem_pkcs8()
                .unwrap(),
        )
        .unwrap();
        let kp = KeyPair::from_pem(&pkcs8).unwrap();
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "rsa root");
        let cert = params.self_signed(&kp).unwrap().pem();
        let a = Authority::from_pem(
            &CaPem {
                bundle: cert.clone(),
                cert,
                key: pkcs1,
            },
            now(),
        );
        assert!(a.is_ok(), "{a:?}");
    }

    #[test]
    fn an_unreadable_key_is_refused_without_echoing_it() {
        let root = generate_root("td", now(), year()).unwrap();
        let garbled = root.key.replace('A', "*");
        let err = Authority::from_pem(
            &CaPem {
                key: garbled.clone(),
                ..root
            },
            now(),
        )
        .unwrap_err();
        assert_eq!(err.metric_label(), "key");
        let body: String = garbled
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .collect();
        assert!(!err.to_string().contains(&body[..20]), "{err}");
    }

    #[test]
    fn missing_or_garbage_pem_names_the_secret_key_at_fault() {
        let root = generate_root("td", now(), year()).unwrap();
        let err = Authority::from_pem(
            &CaPem {
                cert: "nope".into(),
                ..root.clone()
            },
            now(),
        )
        .unwrap_err();
        assert!(err.to_string().starts_with("tls.crt:"), "{err}");
        let err = Authority::from_pem(
            &CaPem {
                bundle: String::new(),
                ..root
            },
            now(),
        )
        .unwrap_err();
        assert!(err.to_string().starts_with("ca.crt:"), "{err}");
    }
}
