//! The `tls` section of the config snapshot ([`TlsSettings`], typed and
//! validated in `baton-config`, re-exported here) compiled into the rustls
//! objects a handshake needs: the crypto provider with the allowed suites
//! and groups, the protocol versions, the ALPN list.
//!
//! This is the provider-dependent half of the section: names come from the
//! shared lists of `baton_config::tls` and are looked up in ring's provider
//! here (a test keeps the two in step). Everything is pure: [`compile`]
//! validates and returns a [`CompiledPolicy`]; nothing touches the disk or
//! the network, so the data plane can check a snapshot before swapping it.

use std::sync::Arc;

use rustls::crypto::{CryptoProvider, SupportedKxGroup, ring};
use rustls::{SupportedCipherSuite, SupportedProtocolVersion};

pub use baton_config::tls::{
    CertSource, EngineKind, IdentitySettings, InvalidTlsSection, KeyType, OffloadMode,
    OffloadSettings, TlsFieldError, TlsMode, TlsProblem, TlsSettings, TlsVersion,
};

/// Why settings cannot be compiled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    /// The section breaks a rule of `baton-config` (the snapshot's
    /// validation refuses it too; this is the TLS layer's own check).
    #[error(transparent)]
    Invalid(#[from] InvalidTlsSection),
    /// A name on the shared list that ring's provider does not implement.
    /// Cannot happen while `every_listed_name_is_in_the_provider` passes.
    #[error("{0} is not implemented by the crypto provider")]
    NotInProvider(&'static str),
}

fn rustls_version(v: TlsVersion) -> &'static SupportedProtocolVersion {
    match v {
        TlsVersion::Tls12 => &rustls::version::TLS12,
        TlsVersion::Tls13 => &rustls::version::TLS13,
    }
}

/// The provider's suite for a name `baton_config` accepts.
fn provider_suite(name: &str) -> Result<SupportedCipherSuite, SettingsError> {
    let listed = baton_config::tls::cipher_suite(name)
        .ok_or(SettingsError::NotInProvider("an unlisted cipher suite"))?;
    ring::ALL_CIPHER_SUITES
        .iter()
        .find(|s| s.suite().as_str() == Some(listed.rustls))
        .copied()
        .ok_or(SettingsError::NotInProvider(listed.iana))
}

/// The provider's key-exchange group for a name `baton_config` accepts.
fn provider_group(name: &str) -> Result<&'static dyn SupportedKxGroup, SettingsError> {
    let canonical = baton_config::tls::kx_group(name).ok_or(SettingsError::NotInProvider(
        "an unlisted key-exchange group",
    ))?;
    match canonical {
        "X25519" => Ok(ring::kx_group::X25519),
        "P-256" => Ok(ring::kx_group::SECP256R1),
        "P-384" => Ok(ring::kx_group::SECP384R1),
        other => Err(SettingsError::NotInProvider(other)),
    }
}

/// Settings compiled into what rustls needs; built once per snapshot.
#[derive(Debug, Clone)]
pub struct CompiledPolicy {
    pub mode: TlsMode,
    pub provider: Arc<CryptoProvider>,
    pub versions: Vec<&'static SupportedProtocolVersion>,
    pub alpn: Vec<Vec<u8>>,
    pub session_resumption: bool,
    pub require_client_cert: bool,
    pub trust_domain: String,
    pub handshake_timeout: std::time::Duration,
    pub detect_timeout: std::time::Duration,
}

/// Validates `settings` and compiles them into what rustls needs. Pure.
pub fn compile(settings: &TlsSettings) -> Result<CompiledPolicy, SettingsError> {
    settings.validate()?;
    let max = settings.max_version.unwrap_or(TlsVersion::Tls13);
    let suites: Vec<SupportedCipherSuite> = if settings.cipher_suites.is_empty() {
        ring::DEFAULT_CIPHER_SUITES.to_vec()
    } else {
        settings
            .cipher_suites
            .iter()
            .map(|n| provider_suite(n))
            .collect::<Result<_, _>>()?
    };
    // A version only stays enabled if some allowed suite serves it
    // (validation made sure one does).
    let versions: Vec<&'static SupportedProtocolVersion> = TlsVersion::ALL
        .into_iter()
        .filter(|v| *v >= settings.min_version && *v <= max)
        .map(rustls_version)
        .filter(|v| suites.iter().any(|s| s.version() == *v))
        .collect();
    let suites: Vec<SupportedCipherSuite> = suites
        .into_iter()
        .filter(|s| versions.contains(&s.version()))
        .collect();
    let kx_groups = if settings.groups.is_empty() {
        ring::DEFAULT_KX_GROUPS.to_vec()
    } else {
        settings
            .groups
            .iter()
            .map(|n| provider_group(n))
            .collect::<Result<_, _>>()?
    };
    let alpn = settings
        .alpn
        .iter()
        .map(|p| p.as_bytes().to_vec())
        .collect();
    let provider = CryptoProvider {
        cipher_suites: suites,
        kx_groups,
        ..ring::default_provider()
    };
    Ok(CompiledPolicy {
        mode: settings.mode,
        provider: Arc::new(provider),
        versions,
        alpn,
        session_resumption: settings.session_resumption,
        require_client_cert: settings.require_client_cert,
        trust_domain: settings.identity.trust_domain.clone(),
        handshake_timeout: std::time::Duration::from_millis(settings.handshake_timeout_ms),
        detect_timeout: std::time::Duration::from_millis(settings.detect_timeout_ms),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_config::tls::{CIPHER_SUITES, KX_GROUPS};

    fn base() -> TlsSettings {
        TlsSettings {
            source: Some(CertSource::Files {
                cert_chain: "c.pem".into(),
                key: "k.pem".into(),
                trust_bundle: "b.pem".into(),
                poll_interval_ms: 1000,
            }),
            identity: IdentitySettings {
                trust_domain: "cluster.local".into(),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn every_listed_name_is_in_the_provider_and_every_provider_suite_is_listed() {
        for s in &CIPHER_SUITES {
            for name in [s.iana, s.openssl, s.rustls] {
                let suite = provider_suite(name).unwrap();
                assert_eq!(suite.version(), rustls_version(s.version), "{name}");
            }
        }
        for s in ring::ALL_CIPHER_SUITES {
            assert!(
                CIPHER_SUITES
                    .iter()
                    .any(|l| s.suite().as_str() == Some(l.rustls)),
                "{:?} has no policy name",
                s.suite()
            );
        }
        for names in KX_GROUPS {
            for name in names {
                provider_group(name).unwrap();
            }
        }
    }

    #[test]
    fn invalid_settings_are_refused_with_the_field() {
        let s = TlsSettings {
            alpn: vec!["spdy/3".into()],
            ..base()
        };
        let err = compile(&s).unwrap_err();
        assert_eq!(
            err.to_string(),
            "tls.alpn[0]: unknown ALPN protocol \"spdy/3\"; valid: h2, http/1.1"
        );
    }

    #[test]
    fn min_version_13_enables_only_tls13_and_its_suites() {
        let p = compile(&TlsSettings {
            min_version: TlsVersion::Tls13,
            ..base()
        })
        .unwrap();
        assert_eq!(p.versions, vec![&rustls::version::TLS13]);
        assert!(
            p.provider
                .cipher_suites
                .iter()
                .all(|s| s.version() == &rustls::version::TLS13)
        );
    }

    #[test]
    fn tls12_suites_only_disable_tls13() {
        let p = compile(&TlsSettings {
            cipher_suites: vec!["TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256".into()],
            ..base()
        })
        .unwrap();
        assert_eq!(p.versions, vec![&rustls::version::TLS12]);
        assert_eq!(p.provider.cipher_suites.len(), 1);
    }

    #[test]
    fn named_groups_and_alpn_are_what_the_provider_gets() {
        let p = compile(&TlsSettings {
            groups: vec!["secp384r1".into()],
            alpn: vec!["h2".into()],
            ..base()
        })
        .unwrap();
        assert_eq!(p.provider.kx_groups.len(), 1);
        assert_eq!(
            p.provider.kx_groups[0].name(),
            ring::kx_group::SECP384R1.name()
        );
        assert_eq!(p.alpn, vec![b"h2".to_vec()]);
        let p = compile(&base()).unwrap();
        assert_eq!(p.alpn, vec![b"h2".to_vec(), b"http/1.1".to_vec()]);
        assert_eq!(p.versions.len(), 2);
    }
}
