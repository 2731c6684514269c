//! `TlsSettings`: the TLS part of the sidecar's config snapshot (compiled by
//! the operator from a TlsPolicy, or written by hand in standalone YAML), and
//! its compilation into the rustls objects a handshake needs.
//!
//! Everything here is pure: `TlsSettings::compile` validates names and
//! combinations and returns a [`CompiledPolicy`]; nothing touches the disk or
//! the network, so the data plane can validate a snapshot before swapping it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use rustls::crypto::{CryptoProvider, SupportedKxGroup, ring};
use rustls::{SupportedCipherSuite, SupportedProtocolVersion};
use serde::{Deserialize, Serialize};

use super::spiffe::{SpiffeError, SpiffeId};

/// How a listener treats plaintext (the TlsPolicy `mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum TlsMode {
    /// mTLS only; a plaintext connection is refused, counted and logged.
    #[default]
    #[serde(alias = "strict")]
    Strict,
    /// TLS and plaintext on the same port, told apart by the first bytes.
    #[serde(alias = "permissive")]
    Permissive,
    /// No TLS at all: inbound is plaintext, outbound originates plaintext.
    #[serde(alias = "disabled")]
    Disabled,
}

/// A TLS protocol version as written in policy (`"1.2"`, `"1.3"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum TlsVersion {
    #[serde(rename = "1.2", alias = "TLSv1.2")]
    Tls12,
    #[serde(rename = "1.3", alias = "TLSv1.3")]
    Tls13,
}

impl TlsVersion {
    fn rustls(self) -> &'static SupportedProtocolVersion {
        match self {
            TlsVersion::Tls12 => &rustls::version::TLS12,
            TlsVersion::Tls13 => &rustls::version::TLS13,
        }
    }
}

impl std::fmt::Display for TlsVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TlsVersion::Tls12 => "1.2",
            TlsVersion::Tls13 => "1.3",
        })
    }
}

/// Private-key offload mode (the TlsPolicy `offload.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum OffloadMode {
    /// Sign inline on the connection's task (the benchmark baseline).
    #[serde(alias = "disabled")]
    Disabled,
    /// Use the configured engine; if it does not work, fall back to the
    /// software pool, count it and report it.
    #[default]
    #[serde(alias = "preferred")]
    Preferred,
    /// Use the configured engine or stay not-ready with the reason.
    #[serde(alias = "required")]
    Required,
}

impl std::str::FromStr for OffloadMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "Disabled" | "disabled" => Ok(OffloadMode::Disabled),
            "Preferred" | "preferred" => Ok(OffloadMode::Preferred),
            "Required" | "required" => Ok(OffloadMode::Required),
            other => Err(format!(
                "unknown offload mode {other:?} (valid: Disabled, Preferred, Required)"
            )),
        }
    }
}

/// Which engine signs handshakes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// ring on a dedicated bounded worker pool.
    #[default]
    Software,
    /// OpenSSL 3 EVP with whatever provider `OPENSSL_CONF` (or `provider`)
    /// loads: Intel's QAT provider on a QAT node, the default provider here.
    Openssl,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Software => "software",
            EngineKind::Openssl => "openssl",
        }
    }
}

impl std::str::FromStr for EngineKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "software" => Ok(EngineKind::Software),
            "openssl" | "qat" => Ok(EngineKind::Openssl),
            other => Err(format!(
                "unknown offload engine {other:?} (valid: software, openssl)"
            )),
        }
    }
}

/// Offload configuration; `BATON_OFFLOAD_MODE` / `BATON_OFFLOAD_ENGINE`
/// (set by the webhook from the device the operator allocated) override it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OffloadSettings {
    pub mode: OffloadMode,
    pub engine: EngineKind,
    /// Crypto worker threads of the engine's pool.
    pub workers: usize,
    /// Handshake steps that may wait for a worker; beyond that, handshake
    /// tasks wait (asynchronously) for a slot.
    pub queue: usize,
    /// OpenSSL provider to load explicitly (e.g. `qatprovider`); `None`
    /// relies on `OPENSSL_CONF`/the default provider.
    pub openssl_provider: Option<String>,
}

impl Default for OffloadSettings {
    fn default() -> Self {
        OffloadSettings {
            mode: OffloadMode::Preferred,
            engine: EngineKind::Software,
            workers: 1,
            queue: 256,
            openssl_provider: None,
        }
    }
}

/// Where certificates come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum CertSource {
    /// PEM files (standalone mode, tests), polled for rotation.
    Files {
        cert_chain: PathBuf,
        key: PathBuf,
        trust_bundle: PathBuf,
        /// How often the files are checked for changes.
        #[serde(default = "default_poll_ms")]
        poll_interval_ms: u64,
    },
    /// The operator's identity service: CSR + projected SA token.
    IdentityService {
        /// `http(s)://host:port/path` of the signing endpoint.
        url: String,
        /// CA bundle that authenticates the identity service (https only).
        #[serde(default)]
        ca_bundle: Option<PathBuf>,
        /// Projected token; defaults to the contract's mount path.
        #[serde(default)]
        token_path: Option<PathBuf>,
        #[serde(default)]
        key_type: KeyType,
    },
}

fn default_poll_ms() -> u64 {
    1000
}

/// Key types the mesh issues and accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum KeyType {
    #[default]
    #[serde(rename = "ECDSA-P256")]
    EcdsaP256,
    #[serde(rename = "ECDSA-P384")]
    EcdsaP384,
    #[serde(rename = "RSA-2048")]
    Rsa2048,
    #[serde(rename = "RSA-3072")]
    Rsa3072,
}

/// Who we are and who we expect on the other side.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IdentitySettings {
    /// Trust domain of the mesh; peers from another domain are refused.
    pub trust_domain: String,
    /// Our own identity (`spiffe://…`); required for the identity service.
    pub local: Option<String>,
    /// Destination (cluster name) → the SPIFFE identity its sidecars must
    /// present.
    pub expected_peers: BTreeMap<String, String>,
}

/// TLS settings of one sidecar (part of the config snapshot).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsSettings {
    pub mode: TlsMode,
    pub min_version: TlsVersion,
    /// Highest version offered/accepted; `None` = the newest supported.
    pub max_version: Option<TlsVersion>,
    /// Allowed cipher suites by IANA or OpenSSL name; empty = all safe
    /// defaults of the provider.
    pub cipher_suites: Vec<String>,
    /// Key-exchange groups (`X25519`, `P-256`, `P-384`); empty = defaults.
    pub groups: Vec<String>,
    /// ALPN protocols in preference order.
    pub alpn: Vec<String>,
    /// TLS session resumption (tickets / session cache).
    pub session_resumption: bool,
    /// Inbound TLS must present a client certificate (mesh mTLS). Off only
    /// for edge-style listeners and benchmarks with certificate-less clients.
    pub require_client_cert: bool,
    pub identity: IdentitySettings,
    pub source: Option<CertSource>,
    pub offload: OffloadSettings,
    /// Bound on a full handshake.
    pub handshake_timeout_ms: u64,
    /// Permissive mode: how long to wait for a first byte before treating a
    /// silent client (server-speaks-first protocol) as plaintext.
    pub detect_timeout_ms: u64,
}

impl Default for TlsSettings {
    fn default() -> Self {
        TlsSettings {
            mode: TlsMode::Strict,
            min_version: TlsVersion::Tls12,
            max_version: None,
            cipher_suites: Vec::new(),
            groups: Vec::new(),
            alpn: vec!["h2".into(), "http/1.1".into()],
            session_resumption: true,
            require_client_cert: true,
            identity: IdentitySettings::default(),
            source: None,
            offload: OffloadSettings::default(),
            handshake_timeout_ms: 10_000,
            detect_timeout_ms: 1_000,
        }
    }
}

/// Why settings were refused. Messages name the valid values so an operator
/// can fix a TlsPolicy from the error alone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    #[error("unknown cipher suite {name:?}; valid names: {valid}")]
    UnknownCipherSuite { name: String, valid: String },
    #[error("unknown key-exchange group {name:?}; valid names: {valid}")]
    UnknownGroup { name: String, valid: String },
    #[error("unknown ALPN protocol {0:?}; valid: h2, http/1.1")]
    UnknownAlpn(String),
    #[error("max_version {max} is below min_version {min}")]
    VersionRange { min: TlsVersion, max: TlsVersion },
    #[error("no allowed cipher suite works with TLS {0} (allowed versions {1})")]
    NoSuiteForVersions(String, String),
    #[error("trust domain {0:?} is invalid: lowercase letters, digits, '.', '-', '_' only")]
    TrustDomain(String),
    #[error("identity {0:?}: {1}")]
    Identity(String, SpiffeError),
    #[error("identity {id} is not in trust domain {trust_domain}")]
    ForeignIdentity { id: String, trust_domain: String },
    #[error("the identity_service source needs identity.local")]
    MissingLocalIdentity,
    #[error("mode {0:?} needs a certificate source")]
    MissingSource(TlsMode),
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
}

/// (IANA name, OpenSSL name, suite). Only AEAD suites with forward secrecy
/// exist in rustls, so every entry is acceptable for the mesh.
fn suite_table() -> [(&'static str, &'static str, SupportedCipherSuite); 9] {
    use ring::cipher_suite as cs;
    [
        (
            "TLS_AES_128_GCM_SHA256",
            "TLS_AES_128_GCM_SHA256",
            cs::TLS13_AES_128_GCM_SHA256,
        ),
        (
            "TLS_AES_256_GCM_SHA384",
            "TLS_AES_256_GCM_SHA384",
            cs::TLS13_AES_256_GCM_SHA384,
        ),
        (
            "TLS_CHACHA20_POLY1305_SHA256",
            "TLS_CHACHA20_POLY1305_SHA256",
            cs::TLS13_CHACHA20_POLY1305_SHA256,
        ),
        (
            "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
            "ECDHE-ECDSA-AES128-GCM-SHA256",
            cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        ),
        (
            "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
            "ECDHE-ECDSA-AES256-GCM-SHA384",
            cs::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
        ),
        (
            "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
            "ECDHE-ECDSA-CHACHA20-POLY1305",
            cs::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
        ),
        (
            "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
            "ECDHE-RSA-AES128-GCM-SHA256",
            cs::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
        ),
        (
            "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
            "ECDHE-RSA-AES256-GCM-SHA384",
            cs::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
        ),
        (
            "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
            "ECDHE-RSA-CHACHA20-POLY1305",
            cs::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
        ),
    ]
}

/// Every cipher-suite name policy may use (IANA names first).
pub fn valid_cipher_suite_names() -> Vec<&'static str> {
    let table = suite_table();
    let mut names: Vec<&str> = table.iter().map(|(iana, _, _)| *iana).collect();
    names.extend(
        table
            .iter()
            .filter(|(iana, ossl, _)| iana != ossl)
            .map(|(_, ossl, _)| *ossl),
    );
    names
}

/// Maps one policy name (IANA or OpenSSL spelling, case-insensitive) to the
/// rustls suite.
pub fn cipher_suite_by_name(name: &str) -> Result<SupportedCipherSuite, SettingsError> {
    suite_table()
        .into_iter()
        .find(|(iana, ossl, suite)| {
            iana.eq_ignore_ascii_case(name)
                || ossl.eq_ignore_ascii_case(name)
                // rustls's own spelling (TLS13_AES_128_GCM_SHA256), which the
                // TlsPolicy CRD uses.
                || suite.suite().as_str().is_some_and(|r| r.eq_ignore_ascii_case(name))
        })
        .map(|(_, _, suite)| suite)
        .ok_or_else(|| SettingsError::UnknownCipherSuite {
            name: name.to_string(),
            valid: valid_cipher_suite_names().join(", "),
        })
}

fn group_table() -> [(&'static [&'static str], &'static dyn SupportedKxGroup); 3] {
    use ring::kx_group;
    [
        (&["X25519", "x25519"], kx_group::X25519),
        (&["P-256", "secp256r1", "prime256v1"], kx_group::SECP256R1),
        (&["P-384", "secp384r1"], kx_group::SECP384R1),
    ]
}

/// Maps a key-exchange group name to the rustls group.
pub fn group_by_name(name: &str) -> Result<&'static dyn SupportedKxGroup, SettingsError> {
    group_table()
        .into_iter()
        .find(|(names, _)| names.iter().any(|n| n.eq_ignore_ascii_case(name)))
        .map(|(_, g)| g)
        .ok_or_else(|| SettingsError::UnknownGroup {
            name: name.to_string(),
            valid: group_table()
                .iter()
                .flat_map(|(n, _)| n.iter().copied())
                .collect::<Vec<_>>()
                .join(", "),
        })
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

impl TlsSettings {
    /// Validates and compiles the settings. Pure.
    pub fn compile(&self) -> Result<CompiledPolicy, SettingsError> {
        let max = self.max_version.unwrap_or(TlsVersion::Tls13);
        if max < self.min_version {
            return Err(SettingsError::VersionRange {
                min: self.min_version,
                max,
            });
        }
        let suites: Vec<SupportedCipherSuite> = if self.cipher_suites.is_empty() {
            ring::DEFAULT_CIPHER_SUITES.to_vec()
        } else {
            self.cipher_suites
                .iter()
                .map(|n| cipher_suite_by_name(n))
                .collect::<Result<_, _>>()?
        };
        let wanted: Vec<TlsVersion> = [TlsVersion::Tls12, TlsVersion::Tls13]
            .into_iter()
            .filter(|v| *v >= self.min_version && *v <= max)
            .collect();
        // A version only stays enabled if some allowed suite serves it.
        let versions: Vec<&'static SupportedProtocolVersion> = wanted
            .iter()
            .map(|v| v.rustls())
            .filter(|v| suites.iter().any(|s| s.version() == *v))
            .collect();
        if versions.is_empty() {
            return Err(SettingsError::NoSuiteForVersions(
                wanted
                    .iter()
                    .map(|v| v.to_string())
                    .collect::<Vec<_>>()
                    .join("/"),
                self.cipher_suites.join(", "),
            ));
        }
        let suites: Vec<SupportedCipherSuite> = suites
            .into_iter()
            .filter(|s| versions.contains(&s.version()))
            .collect();
        let kx_groups = if self.groups.is_empty() {
            ring::DEFAULT_KX_GROUPS.to_vec()
        } else {
            self.groups
                .iter()
                .map(|n| group_by_name(n))
                .collect::<Result<_, _>>()?
        };
        let alpn = self
            .alpn
            .iter()
            .map(|p| match p.as_str() {
                "h2" | "http/1.1" => Ok(p.as_bytes().to_vec()),
                other => Err(SettingsError::UnknownAlpn(other.to_string())),
            })
            .collect::<Result<_, _>>()?;
        if !self.identity.trust_domain.is_empty()
            && !super::spiffe::valid_trust_domain(&self.identity.trust_domain)
        {
            return Err(SettingsError::TrustDomain(
                self.identity.trust_domain.clone(),
            ));
        }
        let check_id = |id: &str| -> Result<(), SettingsError> {
            let parsed: SpiffeId = id
                .parse()
                .map_err(|e| SettingsError::Identity(id.to_string(), e))?;
            if !self.identity.trust_domain.is_empty()
                && parsed.trust_domain != self.identity.trust_domain
            {
                return Err(SettingsError::ForeignIdentity {
                    id: id.to_string(),
                    trust_domain: self.identity.trust_domain.clone(),
                });
            }
            Ok(())
        };
        if let Some(local) = &self.identity.local {
            check_id(local)?;
        }
        for id in self.identity.expected_peers.values() {
            check_id(id)?;
        }
        match &self.source {
            None if self.mode != TlsMode::Disabled => {
                return Err(SettingsError::MissingSource(self.mode));
            }
            Some(CertSource::IdentityService { .. }) if self.identity.local.is_none() => {
                return Err(SettingsError::MissingLocalIdentity);
            }
            _ => {}
        }
        if self.offload.workers == 0 {
            return Err(SettingsError::Zero("offload.workers"));
        }
        if self.offload.queue == 0 {
            return Err(SettingsError::Zero("offload.queue"));
        }
        if self.handshake_timeout_ms == 0 {
            return Err(SettingsError::Zero("handshake_timeout_ms"));
        }
        let provider = CryptoProvider {
            cipher_suites: suites,
            kx_groups,
            ..ring::default_provider()
        };
        Ok(CompiledPolicy {
            mode: self.mode,
            provider: Arc::new(provider),
            versions,
            alpn,
            session_resumption: self.session_resumption,
            require_client_cert: self.require_client_cert,
            trust_domain: self.identity.trust_domain.clone(),
            handshake_timeout: std::time::Duration::from_millis(self.handshake_timeout_ms),
            detect_timeout: std::time::Duration::from_millis(self.detect_timeout_ms),
        })
    }

    /// The SPIFFE identity a destination's sidecars must present.
    pub fn expected_identity(&self, destination: &str) -> Option<&str> {
        self.identity
            .expected_peers
            .get(destination)
            .map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files() -> Option<CertSource> {
        Some(CertSource::Files {
            cert_chain: "c.pem".into(),
            key: "k.pem".into(),
            trust_bundle: "b.pem".into(),
            poll_interval_ms: 1000,
        })
    }

    fn base() -> TlsSettings {
        TlsSettings {
            source: files(),
            identity: IdentitySettings {
                trust_domain: "cluster.local".into(),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn iana_and_openssl_names_map_to_the_same_suite() {
        for (iana, ossl, suite) in suite_table() {
            assert_eq!(cipher_suite_by_name(iana).unwrap().suite(), suite.suite());
            assert_eq!(cipher_suite_by_name(ossl).unwrap().suite(), suite.suite());
            assert_eq!(
                cipher_suite_by_name(&iana.to_lowercase()).unwrap().suite(),
                suite.suite()
            );
        }
    }

    #[test]
    fn every_provider_suite_has_a_policy_name() {
        for s in ring::ALL_CIPHER_SUITES {
            assert!(
                suite_table().iter().any(|(_, _, t)| t.suite() == s.suite()),
                "{:?} has no policy name",
                s.suite()
            );
        }
    }

    #[test]
    fn unknown_cipher_suite_is_refused_with_the_valid_names() {
        let s = TlsSettings {
            cipher_suites: vec!["TLS_RSA_WITH_RC4_128_SHA".into()],
            ..base()
        };
        let err = s.compile().unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("TLS_RSA_WITH_RC4_128_SHA"), "{msg}");
        assert!(msg.contains("TLS_AES_128_GCM_SHA256"), "{msg}");
        assert!(msg.contains("ECDHE-RSA-AES128-GCM-SHA256"), "{msg}");
    }

    #[test]
    fn unknown_group_and_alpn_are_refused() {
        let s = TlsSettings {
            groups: vec!["ffdhe2048".into()],
            ..base()
        };
        assert!(matches!(
            s.compile(),
            Err(SettingsError::UnknownGroup { .. })
        ));
        let s = TlsSettings {
            alpn: vec!["spdy/3".into()],
            ..base()
        };
        assert_eq!(
            s.compile().unwrap_err(),
            SettingsError::UnknownAlpn("spdy/3".into())
        );
    }

    #[test]
    fn min_version_13_enables_only_tls13_and_its_suites() {
        let p = TlsSettings {
            min_version: TlsVersion::Tls13,
            ..base()
        }
        .compile()
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
    fn tls12_only_suites_with_min_13_are_refused() {
        let s = TlsSettings {
            min_version: TlsVersion::Tls13,
            cipher_suites: vec!["ECDHE-RSA-AES128-GCM-SHA256".into()],
            ..base()
        };
        assert!(matches!(
            s.compile(),
            Err(SettingsError::NoSuiteForVersions(..))
        ));
    }

    #[test]
    fn tls12_suites_only_disable_tls13() {
        let p = TlsSettings {
            cipher_suites: vec!["TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256".into()],
            ..base()
        }
        .compile()
        .unwrap();
        assert_eq!(p.versions, vec![&rustls::version::TLS12]);
        assert_eq!(p.provider.cipher_suites.len(), 1);
    }

    #[test]
    fn max_below_min_is_refused() {
        let s = TlsSettings {
            min_version: TlsVersion::Tls13,
            max_version: Some(TlsVersion::Tls12),
            ..base()
        };
        assert!(matches!(
            s.compile(),
            Err(SettingsError::VersionRange { .. })
        ));
    }

    #[test]
    fn peers_outside_the_trust_domain_are_refused() {
        let mut s = base();
        s.identity
            .expected_peers
            .insert("reviews".into(), "spiffe://other.org/ns/a/sa/b".into());
        assert!(matches!(
            s.compile(),
            Err(SettingsError::ForeignIdentity { .. })
        ));
    }

    #[test]
    fn strict_without_a_source_is_refused_but_disabled_is_fine() {
        let s = TlsSettings {
            source: None,
            ..base()
        };
        assert_eq!(
            s.compile().unwrap_err(),
            SettingsError::MissingSource(TlsMode::Strict)
        );
        let s = TlsSettings {
            source: None,
            mode: TlsMode::Disabled,
            ..base()
        };
        assert!(s.compile().is_ok());
    }

    #[test]
    fn settings_round_trip_through_yaml_shaped_json() {
        let json = r#"{
            "mode": "Permissive",
            "min_version": "TLSv1.3",
            "cipher_suites": ["TLS13_AES_256_GCM_SHA384"],
            "alpn": ["h2"],
            "session_resumption": false,
            "identity": {"trust_domain": "cluster.local",
                         "expected_peers": {"reviews": "spiffe://cluster.local/ns/default/sa/reviews"}},
            "source": {"files": {"cert_chain": "/c", "key": "/k", "trust_bundle": "/b"}},
            "offload": {"mode": "Required", "engine": "openssl", "workers": 2}
        }"#;
        let s: TlsSettings = serde_json::from_str(json).unwrap();
        assert_eq!(s.mode, TlsMode::Permissive);
        assert_eq!(s.min_version, TlsVersion::Tls13);
        assert_eq!(s.offload.engine, EngineKind::Openssl);
        assert_eq!(
            s.expected_identity("reviews"),
            Some("spiffe://cluster.local/ns/default/sa/reviews")
        );
        let p = s.compile().unwrap();
        assert_eq!(p.alpn, vec![b"h2".to_vec()]);
        let back: TlsSettings = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn unknown_fields_are_refused() {
        let r: Result<TlsSettings, _> = serde_json::from_str(r#"{"mdoe": "Strict"}"#);
        assert!(r.is_err());
    }
}
