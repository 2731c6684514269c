//! The `tls` section of a snapshot: mesh TLS settings of one sidecar
//! (compiled by the operator from a TlsPolicy, or written by hand in
//! standalone YAML), and their validation.
//!
//! Why here and typed: the operator writes this section and the sidecar reads
//! it, so both must agree on every field, default and refusal. The types
//! carry the shape (unknown fields are refused, as everywhere in the
//! snapshot); [`TlsSettings::validate`] carries every rule that needs no TLS
//! library — names of versions, suites, groups and ALPN protocols from the
//! lists below, the version range, SPIFFE syntax and trust domain, what a
//! mode or a certificate source needs. The sidecar's TLS layer turns valid
//! settings into rustls objects; that part depends on the crypto provider
//! and stays there.
//!
//! The JSON form is the wire form (config push, handoff, `/config`) that
//! sidecars of earlier versions parse too, so field names and aliases never
//! change. Serialization writes what a TlsPolicy decides (`mode`,
//! `min_version`, `cipher_suites`, `offload.mode`) always and every other
//! field only when it differs from its default: the section reads like what
//! its author wrote, and the operator's output is the JSON it sent when it
//! built the section by hand (decision 0033).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::spiffe::{SpiffeError, SpiffeId, valid_trust_domain};

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
    /// Every version, oldest first.
    pub const ALL: [TlsVersion; 2] = [TlsVersion::Tls12, TlsVersion::Tls13];
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
    #[serde(skip_serializing_if = "is_default")]
    pub engine: EngineKind,
    /// Crypto worker threads of the engine's pool.
    #[serde(skip_serializing_if = "is_default_workers")]
    pub workers: usize,
    /// Handshake steps that may wait for a worker; beyond that, handshake
    /// tasks wait (asynchronously) for a slot.
    #[serde(skip_serializing_if = "is_default_queue")]
    pub queue: usize,
    /// OpenSSL provider to load explicitly (e.g. `qatprovider`); `None`
    /// relies on `OPENSSL_CONF`/the default provider.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub openssl_provider: Option<String>,
}

const DEFAULT_WORKERS: usize = 1;
const DEFAULT_QUEUE: usize = 256;

impl Default for OffloadSettings {
    fn default() -> Self {
        OffloadSettings {
            mode: OffloadMode::Preferred,
            engine: EngineKind::Software,
            workers: DEFAULT_WORKERS,
            queue: DEFAULT_QUEUE,
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
        /// Path of the private key (the key itself is never in the section).
        key: PathBuf,
        trust_bundle: PathBuf,
        /// How often the files are checked for changes.
        #[serde(
            default = "default_poll_ms",
            skip_serializing_if = "is_default_poll_ms"
        )]
        poll_interval_ms: u64,
    },
    /// The operator's identity service: CSR + projected SA token.
    IdentityService {
        /// `http(s)://host:port/path` of the signing endpoint.
        url: String,
        /// CA bundle that authenticates the identity service (https only).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ca_bundle: Option<PathBuf>,
        /// Projected token; defaults to the contract's mount path.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token_path: Option<PathBuf>,
        #[serde(default, skip_serializing_if = "is_default")]
        key_type: KeyType,
    },
}

/// How often a `files` source is checked for changes by default.
pub const DEFAULT_POLL_MS: u64 = 1000;

fn default_poll_ms() -> u64 {
    DEFAULT_POLL_MS
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
    #[serde(skip_serializing_if = "String::is_empty")]
    pub trust_domain: String,
    /// Our own identity (`spiffe://…`); required for the identity service.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local: Option<String>,
    /// Destination (cluster name) → the SPIFFE identity its sidecars must
    /// present.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub expected_peers: BTreeMap<String, String>,
}

/// TLS settings of one sidecar: the snapshot's `tls` section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsSettings {
    pub mode: TlsMode,
    pub min_version: TlsVersion,
    /// Highest version offered/accepted; `None` = the newest supported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_version: Option<TlsVersion>,
    /// Allowed cipher suites by IANA, OpenSSL or rustls name
    /// ([`CIPHER_SUITES`]); empty = all safe defaults of the provider.
    pub cipher_suites: Vec<String>,
    /// Key-exchange groups ([`KX_GROUPS`]); empty = defaults.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
    /// ALPN protocols in preference order ([`ALPN_PROTOCOLS`]).
    #[serde(skip_serializing_if = "is_default_alpn")]
    pub alpn: Vec<String>,
    /// TLS session resumption (tickets / session cache).
    #[serde(skip_serializing_if = "is_true")]
    pub session_resumption: bool,
    /// Inbound TLS must present a client certificate (mesh mTLS). Off only
    /// for edge-style listeners and benchmarks with certificate-less clients.
    #[serde(skip_serializing_if = "is_true")]
    pub require_client_cert: bool,
    #[serde(skip_serializing_if = "is_default")]
    pub identity: IdentitySettings,
    /// A map with one key naming the variant (`files: {…}`), in YAML too
    /// (where serde's default for an enum is a `!files` tag).
    #[serde(
        skip_serializing_if = "Option::is_none",
        with = "serde_yaml_ng::with::singleton_map"
    )]
    pub source: Option<CertSource>,
    pub offload: OffloadSettings,
    /// Bound on a full handshake.
    #[serde(skip_serializing_if = "is_default_handshake_timeout")]
    pub handshake_timeout_ms: u64,
    /// Permissive mode: how long to wait for a first byte before treating a
    /// silent client (server-speaks-first protocol) as plaintext.
    #[serde(skip_serializing_if = "is_default_detect_timeout")]
    pub detect_timeout_ms: u64,
    /// The operator's re-issue trigger (identity-service source only): the
    /// trust generation certificates are issued under now, and the window
    /// over which this sidecar spreads its request for one. Sent only to a
    /// sidecar whose config stream declared the `reissue` capability
    /// ([`crate::push::Capabilities`]); a change of this field alone never
    /// rebuilds the TLS context, it only wakes the certificate client.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reissue: Option<Reissue>,
}

/// When a sidecar must ask for a new certificate before its renewal time:
/// as soon as the trust generation it holds (the one its certificate came
/// with) differs from `generation`, after a delay drawn uniformly from
/// `[0, spread_ms)` ([`Reissue::delay`]) so a fleet does not ask at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reissue {
    /// Opaque name of the issuing CA and trust bundle certificates are
    /// issued under now (the operator's digest of both).
    pub generation: String,
    /// Width of the window the requests are spread over, in milliseconds
    /// (the operator scales it to the sidecars it serves).
    pub spread_ms: u64,
}

impl Reissue {
    /// Whether a sidecar holding a certificate of trust generation `held`
    /// must ask for a new one. A sidecar that holds none yet is already
    /// asking (its bootstrap), and one that holds the current generation
    /// has nothing to do. Pure.
    pub fn wanted(&self, held: Option<&str>) -> bool {
        held.is_some_and(|h| h != self.generation)
    }

    /// The delay before this sidecar's request: `jitter01 ∈ [0, 1)` scaled
    /// to the spread (uniform over the window for a uniform `jitter01`).
    /// Pure.
    pub fn delay(&self, jitter01: f64) -> std::time::Duration {
        std::time::Duration::from_millis(self.spread_ms).mul_f64(jitter01.clamp(0.0, 1.0))
    }
}

const DEFAULT_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
const DEFAULT_DETECT_TIMEOUT_MS: u64 = 1_000;

fn default_alpn() -> Vec<String> {
    ALPN_PROTOCOLS.iter().map(|p| p.to_string()).collect()
}

impl Default for TlsSettings {
    fn default() -> Self {
        TlsSettings {
            mode: TlsMode::Strict,
            min_version: TlsVersion::Tls12,
            max_version: None,
            cipher_suites: Vec::new(),
            groups: Vec::new(),
            alpn: default_alpn(),
            session_resumption: true,
            require_client_cert: true,
            identity: IdentitySettings::default(),
            source: None,
            offload: OffloadSettings::default(),
            handshake_timeout_ms: DEFAULT_HANDSHAKE_TIMEOUT_MS,
            detect_timeout_ms: DEFAULT_DETECT_TIMEOUT_MS,
            reissue: None,
        }
    }
}

// `skip_serializing_if` predicates: a field equal to its default is left
// out, so an earlier sidecar fills in the same value.
fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}
fn is_true(v: &bool) -> bool {
    *v
}
fn is_default_alpn(v: &[String]) -> bool {
    v.iter().map(String::as_str).eq(ALPN_PROTOCOLS)
}
fn is_default_handshake_timeout(v: &u64) -> bool {
    *v == DEFAULT_HANDSHAKE_TIMEOUT_MS
}
fn is_default_detect_timeout(v: &u64) -> bool {
    *v == DEFAULT_DETECT_TIMEOUT_MS
}
fn is_default_workers(v: &usize) -> bool {
    *v == DEFAULT_WORKERS
}
fn is_default_queue(v: &usize) -> bool {
    *v == DEFAULT_QUEUE
}
fn is_default_poll_ms(v: &u64) -> bool {
    *v == DEFAULT_POLL_MS
}

/// A cipher suite the sidecar implements, by every name policy may use.
/// Only AEAD suites with forward secrecy are listed, so every entry is
/// acceptable for the mesh; the sidecar checks that its crypto provider
/// implements exactly these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CipherSuiteName {
    /// The IANA name (the canonical one).
    pub iana: &'static str,
    /// OpenSSL's spelling.
    pub openssl: &'static str,
    /// rustls's `CipherSuite` name (`TLS13_…` for TLS 1.3), which the
    /// TlsPolicy CRD uses.
    pub rustls: &'static str,
    /// The protocol version the suite belongs to.
    pub version: TlsVersion,
}

const fn suite(
    iana: &'static str,
    openssl: &'static str,
    rustls: &'static str,
    version: TlsVersion,
) -> CipherSuiteName {
    CipherSuiteName {
        iana,
        openssl,
        rustls,
        version,
    }
}

/// Every cipher suite policy may name.
pub const CIPHER_SUITES: [CipherSuiteName; 9] = {
    use TlsVersion::{Tls12, Tls13};
    [
        suite(
            "TLS_AES_128_GCM_SHA256",
            "TLS_AES_128_GCM_SHA256",
            "TLS13_AES_128_GCM_SHA256",
            Tls13,
        ),
        suite(
            "TLS_AES_256_GCM_SHA384",
            "TLS_AES_256_GCM_SHA384",
            "TLS13_AES_256_GCM_SHA384",
            Tls13,
        ),
        suite(
            "TLS_CHACHA20_POLY1305_SHA256",
            "TLS_CHACHA20_POLY1305_SHA256",
            "TLS13_CHACHA20_POLY1305_SHA256",
            Tls13,
        ),
        suite(
            "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
            "ECDHE-ECDSA-AES128-GCM-SHA256",
            "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
            Tls12,
        ),
        suite(
            "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
            "ECDHE-ECDSA-AES256-GCM-SHA384",
            "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
            Tls12,
        ),
        suite(
            "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
            "ECDHE-ECDSA-CHACHA20-POLY1305",
            "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
            Tls12,
        ),
        suite(
            "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
            "ECDHE-RSA-AES128-GCM-SHA256",
            "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
            Tls12,
        ),
        suite(
            "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
            "ECDHE-RSA-AES256-GCM-SHA384",
            "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
            Tls12,
        ),
        suite(
            "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
            "ECDHE-RSA-CHACHA20-POLY1305",
            "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
            Tls12,
        ),
    ]
};

/// The suite a policy name (IANA, OpenSSL or rustls spelling,
/// case-insensitive) stands for.
pub fn cipher_suite(name: &str) -> Option<&'static CipherSuiteName> {
    CIPHER_SUITES.iter().find(|s| {
        [s.iana, s.openssl, s.rustls]
            .iter()
            .any(|n| n.eq_ignore_ascii_case(name))
    })
}

/// Every cipher-suite name policy may use, for error messages (IANA names
/// first, then the OpenSSL spellings that differ).
pub fn valid_cipher_suite_names() -> Vec<&'static str> {
    let mut names: Vec<&str> = CIPHER_SUITES.iter().map(|s| s.iana).collect();
    names.extend(
        CIPHER_SUITES
            .iter()
            .filter(|s| s.iana != s.openssl)
            .map(|s| s.openssl),
    );
    names
}

/// Key-exchange groups by their names: the canonical name first, then the
/// aliases policy may use (compared case-insensitively).
pub const KX_GROUPS: [&[&str]; 3] = [
    &["X25519", "x25519"],
    &["P-256", "secp256r1", "prime256v1"],
    &["P-384", "secp384r1"],
];

/// The canonical name of a key-exchange group named in policy.
pub fn kx_group(name: &str) -> Option<&'static str> {
    KX_GROUPS
        .iter()
        .find(|names| names.iter().any(|n| n.eq_ignore_ascii_case(name)))
        .map(|names| names[0])
}

/// ALPN protocols the sidecar serves, in its default preference order.
pub const ALPN_PROTOCOLS: [&str; 2] = ["h2", "http/1.1"];

/// What is wrong with one field of the `tls` section. Messages name the
/// valid values so a TlsPolicy can be fixed from the error alone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsProblem {
    #[error("unknown cipher suite {name:?}; valid names: {valid}")]
    UnknownCipherSuite { name: String, valid: String },
    #[error("unknown key-exchange group {name:?}; valid names: {valid}")]
    UnknownGroup { name: String, valid: String },
    #[error("unknown ALPN protocol {0:?}; valid: h2, http/1.1")]
    UnknownAlpn(String),
    #[error("max_version {max} is below min_version {min}")]
    VersionRange { min: TlsVersion, max: TlsVersion },
    #[error("no allowed cipher suite ({suites}) works with TLS {versions}")]
    NoSuiteForVersions { versions: String, suites: String },
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
    #[error("must be greater than zero")]
    Zero,
}

/// One refused field: its path from the snapshot's root (`tls.alpn[1]`,
/// `tls.identity.expected_peers.reviews`) and the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct TlsFieldError {
    pub field: String,
    pub problem: TlsProblem,
}

/// Every refused field of a `tls` section (never empty).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct InvalidTlsSection(pub Vec<TlsFieldError>);

impl TlsSettings {
    /// Checks every rule that needs no TLS library and reports every
    /// refused field. Pure; the sidecar validates the whole snapshot with
    /// it, and its TLS layer builds rustls objects only from settings that
    /// pass.
    pub fn validate(&self) -> Result<(), InvalidTlsSection> {
        let mut errors = Vec::new();
        let mut refuse = |field: String, problem| errors.push(TlsFieldError { field, problem });

        let max = self.max_version.unwrap_or(TlsVersion::Tls13);
        if max < self.min_version {
            refuse(
                "tls.max_version".into(),
                TlsProblem::VersionRange {
                    min: self.min_version,
                    max,
                },
            );
        }
        let mut suites = Vec::with_capacity(self.cipher_suites.len());
        for (i, name) in self.cipher_suites.iter().enumerate() {
            match cipher_suite(name) {
                Some(s) => suites.push(s),
                None => refuse(
                    format!("tls.cipher_suites[{i}]"),
                    TlsProblem::UnknownCipherSuite {
                        name: name.clone(),
                        valid: valid_cipher_suite_names().join(", "),
                    },
                ),
            }
        }
        // A version stays enabled only if some allowed suite serves it (an
        // empty list allows every suite); with none left, no handshake can
        // succeed.
        let wanted: Vec<TlsVersion> = TlsVersion::ALL
            .into_iter()
            .filter(|v| *v >= self.min_version && *v <= max)
            .collect();
        if !wanted.is_empty()
            && suites.len() == self.cipher_suites.len()
            && !suites.is_empty()
            && !wanted
                .iter()
                .any(|v| suites.iter().any(|s| s.version == *v))
        {
            refuse(
                "tls.cipher_suites".into(),
                TlsProblem::NoSuiteForVersions {
                    versions: wanted
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join("/"),
                    suites: self.cipher_suites.join(", "),
                },
            );
        }
        for (i, name) in self.groups.iter().enumerate() {
            if kx_group(name).is_none() {
                refuse(
                    format!("tls.groups[{i}]"),
                    TlsProblem::UnknownGroup {
                        name: name.clone(),
                        valid: KX_GROUPS.concat().join(", "),
                    },
                );
            }
        }
        for (i, p) in self.alpn.iter().enumerate() {
            if !ALPN_PROTOCOLS.contains(&p.as_str()) {
                refuse(format!("tls.alpn[{i}]"), TlsProblem::UnknownAlpn(p.clone()));
            }
        }

        let td = &self.identity.trust_domain;
        if !td.is_empty() && !valid_trust_domain(td) {
            refuse(
                "tls.identity.trust_domain".into(),
                TlsProblem::TrustDomain(td.clone()),
            );
        }
        let check_id = |id: &str| -> Result<(), TlsProblem> {
            let parsed: SpiffeId = id
                .parse()
                .map_err(|e| TlsProblem::Identity(id.to_string(), e))?;
            if !td.is_empty() && parsed.trust_domain != *td {
                return Err(TlsProblem::ForeignIdentity {
                    id: id.to_string(),
                    trust_domain: td.clone(),
                });
            }
            Ok(())
        };
        if let Some(Err(problem)) = self.identity.local.as_deref().map(check_id) {
            refuse("tls.identity.local".into(), problem);
        }
        for (peer, id) in &self.identity.expected_peers {
            if let Err(problem) = check_id(id) {
                refuse(format!("tls.identity.expected_peers.{peer}"), problem);
            }
        }
        match &self.source {
            None if self.mode != TlsMode::Disabled => {
                refuse("tls.source".into(), TlsProblem::MissingSource(self.mode));
            }
            Some(CertSource::IdentityService { .. }) if self.identity.local.is_none() => {
                refuse(
                    "tls.identity.local".into(),
                    TlsProblem::MissingLocalIdentity,
                );
            }
            _ => {}
        }

        for (field, zero) in [
            ("tls.offload.workers", self.offload.workers == 0),
            ("tls.offload.queue", self.offload.queue == 0),
            ("tls.handshake_timeout_ms", self.handshake_timeout_ms == 0),
        ] {
            if zero {
                refuse(field.into(), TlsProblem::Zero);
            }
        }

        if errors.is_empty() {
            Ok(())
        } else {
            Err(InvalidTlsSection(errors))
        }
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

    /// The refused fields and the problems, in order.
    fn refusals(s: &TlsSettings) -> Vec<(String, TlsProblem)> {
        match s.validate() {
            Ok(()) => Vec::new(),
            Err(InvalidTlsSection(errors)) => {
                errors.into_iter().map(|e| (e.field, e.problem)).collect()
            }
        }
    }

    fn only_refusal(s: &TlsSettings) -> (String, TlsProblem) {
        let mut r = refusals(s);
        assert_eq!(r.len(), 1, "{r:?}");
        r.remove(0)
    }

    #[test]
    fn every_name_of_a_suite_finds_it_in_any_case() {
        for s in &CIPHER_SUITES {
            for name in [s.iana, s.openssl, s.rustls] {
                assert_eq!(cipher_suite(name), Some(s));
                assert_eq!(cipher_suite(&name.to_lowercase()), Some(s));
            }
        }
        assert_eq!(cipher_suite("TLS_RSA_WITH_RC4_128_SHA"), None);
        assert_eq!(kx_group("PRIME256V1"), Some("P-256"));
        assert_eq!(kx_group("ffdhe2048"), None);
    }

    #[test]
    fn a_full_section_parses_and_validates() {
        let json = r#"{
            "mode": "Permissive",
            "min_version": "1.3",
            "max_version": "1.3",
            "cipher_suites": ["TLS13_AES_256_GCM_SHA384", "ECDHE-RSA-AES128-GCM-SHA256"],
            "groups": ["x25519", "secp384r1"],
            "alpn": ["h2"],
            "session_resumption": false,
            "require_client_cert": false,
            "identity": {"trust_domain": "cluster.local",
                         "local": "spiffe://cluster.local/ns/shop/sa/cart",
                         "expected_peers": {"reviews": "spiffe://cluster.local/ns/default/sa/reviews"}},
            "source": {"identity_service": {"url": "https://id:8443/v1/sign", "ca_bundle": "/ca.pem",
                                            "token_path": "/token", "key_type": "RSA-3072"}},
            "offload": {"mode": "Required", "engine": "openssl", "workers": 2, "queue": 8,
                        "openssl_provider": "qatprovider"},
            "handshake_timeout_ms": 500,
            "detect_timeout_ms": 20
        }"#;
        let s: TlsSettings = serde_json::from_str(json).unwrap();
        assert_eq!(s.mode, TlsMode::Permissive);
        assert_eq!(s.min_version, TlsVersion::Tls13);
        assert_eq!(s.offload.engine, EngineKind::Openssl);
        assert_eq!(
            s.source,
            Some(CertSource::IdentityService {
                url: "https://id:8443/v1/sign".into(),
                ca_bundle: Some("/ca.pem".into()),
                token_path: Some("/token".into()),
                key_type: KeyType::Rsa3072,
            })
        );
        assert_eq!(
            s.expected_identity("reviews"),
            Some("spiffe://cluster.local/ns/default/sa/reviews")
        );
        s.validate().unwrap();
        // Every field differs from its default, so every one is written.
        let back = serde_json::to_value(&s).unwrap();
        assert_eq!(
            back,
            serde_json::from_str::<serde_json::Value>(json).unwrap()
        );
        assert_eq!(serde_json::from_value::<TlsSettings>(back).unwrap(), s);
    }

    #[test]
    fn an_empty_section_takes_every_default_and_writes_only_the_policy_fields() {
        let s: TlsSettings = serde_yaml_ng::from_str("{}").unwrap();
        assert_eq!(s, TlsSettings::default());
        assert_eq!(s.alpn, ["h2", "http/1.1"]);
        assert_eq!(s.offload.queue, 256);
        assert_eq!(
            serde_json::to_value(&s).unwrap(),
            serde_json::json!({"mode": "Strict", "min_version": "1.2", "cipher_suites": [],
                               "offload": {"mode": "Preferred"}})
        );
    }

    #[test]
    fn lowercase_modes_and_tls_prefixed_versions_are_accepted() {
        let s: TlsSettings = serde_yaml_ng::from_str(
            "{mode: permissive, min_version: TLSv1.2, max_version: TLSv1.3, offload: {mode: disabled}}",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.mode, TlsMode::Permissive);
        assert_eq!(s.max_version, Some(TlsVersion::Tls13));
        assert_eq!(s.offload.mode, OffloadMode::Disabled);
        // `qat` is accepted by the environment override only.
        assert!(
            serde_yaml_ng::from_str::<TlsSettings>("{offload: {engine: qat}}").is_err(),
            "qat is no serde name"
        );
        assert_eq!("qat".parse::<EngineKind>(), Ok(EngineKind::Openssl));
    }

    /// The reference example of docs/tls.md, as a standalone file has it.
    const DOC_EXAMPLE: &str = r#"
mode: Strict
min_version: "1.2"
max_version: "1.3"
cipher_suites: []
groups: []
alpn: [h2, http/1.1]
session_resumption: true
require_client_cert: true
identity:
  trust_domain: cluster.local
  local: spiffe://cluster.local/ns/shop/sa/cart
  expected_peers:
    reviews: spiffe://cluster.local/ns/shop/sa/reviews
source:
  files: {cert_chain: /etc/baton/tls/cert.pem, key: /etc/baton/tls/key.pem,
          trust_bundle: /etc/baton/tls/ca.pem, poll_interval_ms: 1000}
offload:
  mode: Preferred
  engine: software
  workers: 1
  queue: 256
  openssl_provider: null
handshake_timeout_ms: 10000
detect_timeout_ms: 1000
"#;

    #[test]
    fn yaml_sections_parse_with_their_source_as_a_one_key_map() {
        let s: TlsSettings = serde_yaml_ng::from_str(DOC_EXAMPLE).unwrap();
        assert_eq!(s.max_version, Some(TlsVersion::Tls13));
        assert_eq!(
            s.source,
            Some(CertSource::Files {
                cert_chain: "/etc/baton/tls/cert.pem".into(),
                key: "/etc/baton/tls/key.pem".into(),
                trust_bundle: "/etc/baton/tls/ca.pem".into(),
                poll_interval_ms: 1000,
            })
        );
        s.validate().unwrap();
        let yaml = serde_yaml_ng::to_string(&s).unwrap();
        assert!(yaml.contains("files:") && !yaml.contains('!'), "{yaml}");
        assert_eq!(serde_yaml_ng::from_str::<TlsSettings>(&yaml).unwrap(), s);
        let id: TlsSettings = serde_yaml_ng::from_str(
            "source: {identity_service: {url: 'https://id:8443/v1/sign', key_type: ECDSA-P384}}",
        )
        .unwrap();
        assert!(matches!(
            id.source,
            Some(CertSource::IdentityService {
                key_type: KeyType::EcdsaP384,
                ..
            })
        ));
        for bad in [
            "source: {}",
            "source: {files: {cert_chain: c, key: k, trust_bundle: b}, identity_service: {url: u}}",
            "source: {vault: {path: x}}",
            "source: !files {cert_chain: c, key: k, trust_bundle: b, extra: 1}",
        ] {
            assert!(
                serde_yaml_ng::from_str::<TlsSettings>(bad).is_err(),
                "{bad} accepted"
            );
        }
    }

    #[test]
    fn unknown_fields_are_refused_at_every_level() {
        for bad in [
            r#"{"mdoe": "Strict"}"#,
            r#"{"identity": {"trust_domian": "x"}}"#,
            r#"{"offload": {"worker": 2}}"#,
            r#"{"source": {"files": {"cert_chain": "c", "key": "k", "trust_bundle": "b", "poll": 1}}}"#,
            r#"{"source": {"identity_service": {"url": "u", "token": "t"}}}"#,
            r#"{"source": {"vault": {}}}"#,
            r#"{"mode": "Lenient"}"#,
            r#"{"min_version": "1.1"}"#,
        ] {
            assert!(
                serde_json::from_str::<TlsSettings>(bad).is_err(),
                "{bad} accepted"
            );
        }
    }

    #[test]
    fn two_certificate_sources_at_once_are_refused() {
        let both = r#"{"source": {"files": {"cert_chain": "c", "key": "k", "trust_bundle": "b"},
                                  "identity_service": {"url": "u"}}}"#;
        assert!(serde_json::from_str::<TlsSettings>(both).is_err());
    }

    #[test]
    fn the_base_section_is_valid_and_disabled_needs_no_source() {
        assert_eq!(refusals(&base()), []);
        let s = TlsSettings {
            source: None,
            mode: TlsMode::Disabled,
            ..base()
        };
        assert_eq!(refusals(&s), []);
    }

    #[test]
    fn unknown_cipher_suite_is_refused_at_its_index_with_the_valid_names() {
        let s = TlsSettings {
            cipher_suites: vec![
                "TLS13_AES_128_GCM_SHA256".into(),
                "TLS_RSA_WITH_RC4_128_SHA".into(),
            ],
            ..base()
        };
        let err = s.validate().unwrap_err();
        assert_eq!(err.0.len(), 1, "{err}");
        assert_eq!(err.0[0].field, "tls.cipher_suites[1]");
        let msg = err.to_string();
        assert!(msg.starts_with("tls.cipher_suites[1]: "), "{msg}");
        assert!(msg.contains("TLS_RSA_WITH_RC4_128_SHA"), "{msg}");
        assert!(msg.contains("TLS_AES_128_GCM_SHA256"), "{msg}");
        assert!(msg.contains("ECDHE-RSA-AES128-GCM-SHA256"), "{msg}");
    }

    #[test]
    fn unknown_group_and_alpn_are_refused_at_their_index() {
        let s = TlsSettings {
            groups: vec!["X25519".into(), "ffdhe2048".into()],
            alpn: vec!["spdy/3".into()],
            ..base()
        };
        let r = refusals(&s);
        assert_eq!(r.len(), 2, "{r:?}");
        assert_eq!(r[0].0, "tls.groups[1]");
        assert!(matches!(r[0].1, TlsProblem::UnknownGroup { .. }));
        assert!(r[0].1.to_string().contains("secp384r1"), "{}", r[0].1);
        assert_eq!(
            r[1],
            (
                "tls.alpn[0]".into(),
                TlsProblem::UnknownAlpn("spdy/3".into())
            )
        );
    }

    #[test]
    fn max_below_min_is_refused_at_max_version() {
        let s = TlsSettings {
            min_version: TlsVersion::Tls13,
            max_version: Some(TlsVersion::Tls12),
            ..base()
        };
        assert_eq!(
            only_refusal(&s),
            (
                "tls.max_version".into(),
                TlsProblem::VersionRange {
                    min: TlsVersion::Tls13,
                    max: TlsVersion::Tls12
                }
            )
        );
    }

    #[test]
    fn tls12_only_suites_with_min_13_are_refused() {
        let s = TlsSettings {
            min_version: TlsVersion::Tls13,
            cipher_suites: vec!["ECDHE-RSA-AES128-GCM-SHA256".into()],
            ..base()
        };
        let (field, problem) = only_refusal(&s);
        assert_eq!(field, "tls.cipher_suites");
        assert_eq!(
            problem.to_string(),
            "no allowed cipher suite (ECDHE-RSA-AES128-GCM-SHA256) works with TLS 1.3"
        );
        // TLS 1.2 suites alone are fine while 1.2 is allowed (1.3 is then off).
        let s = TlsSettings {
            cipher_suites: vec!["ECDHE-RSA-AES128-GCM-SHA256".into()],
            ..base()
        };
        assert_eq!(refusals(&s), []);
    }

    #[test]
    fn bad_identities_are_refused_at_their_field() {
        let mut s = base();
        s.identity.local = Some("spiffe://cluster.local/ns/a".into());
        s.identity
            .expected_peers
            .insert("reviews".into(), "spiffe://other.org/ns/a/sa/b".into());
        let r = refusals(&s);
        assert_eq!(
            r,
            [
                (
                    "tls.identity.local".into(),
                    TlsProblem::Identity("spiffe://cluster.local/ns/a".into(), SpiffeError::Path)
                ),
                (
                    "tls.identity.expected_peers.reviews".into(),
                    TlsProblem::ForeignIdentity {
                        id: "spiffe://other.org/ns/a/sa/b".into(),
                        trust_domain: "cluster.local".into()
                    }
                ),
            ]
        );
        let mut s = base();
        s.identity.trust_domain = "Cluster.Local".into();
        assert_eq!(
            only_refusal(&s),
            (
                "tls.identity.trust_domain".into(),
                TlsProblem::TrustDomain("Cluster.Local".into())
            )
        );
    }

    #[test]
    fn a_missing_source_or_local_identity_is_refused() {
        let s = TlsSettings {
            source: None,
            ..base()
        };
        assert_eq!(
            only_refusal(&s),
            (
                "tls.source".into(),
                TlsProblem::MissingSource(TlsMode::Strict)
            )
        );
        let s = TlsSettings {
            source: Some(CertSource::IdentityService {
                url: "https://id/v1/sign".into(),
                ca_bundle: None,
                token_path: None,
                key_type: KeyType::default(),
            }),
            ..base()
        };
        assert_eq!(
            only_refusal(&s),
            (
                "tls.identity.local".into(),
                TlsProblem::MissingLocalIdentity
            )
        );
    }

    #[test]
    fn zero_workers_queue_and_handshake_timeout_are_refused() {
        let mut s = base();
        s.offload.workers = 0;
        s.offload.queue = 0;
        s.handshake_timeout_ms = 0;
        let fields: Vec<String> = refusals(&s).into_iter().map(|(f, _)| f).collect();
        assert_eq!(
            fields,
            [
                "tls.offload.workers",
                "tls.offload.queue",
                "tls.handshake_timeout_ms"
            ]
        );
        assert_eq!(
            s.validate().unwrap_err().to_string(),
            "tls.offload.workers: must be greater than zero; tls.offload.queue: must be \
             greater than zero; tls.handshake_timeout_ms: must be greater than zero"
        );
    }

    #[test]
    fn a_sidecar_asks_again_only_when_it_holds_another_generation() {
        let r = Reissue {
            generation: "g2".into(),
            spread_ms: 10_000,
        };
        assert!(r.wanted(Some("g1")), "a certificate of the old generation");
        assert!(!r.wanted(Some("g2")), "already re-issued");
        assert!(
            !r.wanted(None),
            "no certificate yet: the bootstrap is already asking"
        );
    }

    #[test]
    fn the_reissue_delay_spans_the_spread_uniformly() {
        let r = Reissue {
            generation: "g".into(),
            spread_ms: 20_000,
        };
        assert_eq!(r.delay(0.0), std::time::Duration::ZERO);
        assert_eq!(r.delay(0.5), std::time::Duration::from_secs(10));
        assert_eq!(r.delay(0.25), std::time::Duration::from_secs(5));
        // Out-of-range jitter stays inside the window.
        assert_eq!(r.delay(7.0), std::time::Duration::from_secs(20));
        assert_eq!(r.delay(-1.0), std::time::Duration::ZERO);
    }

    #[test]
    fn the_reissue_trigger_is_left_out_when_absent_and_reads_back_when_present() {
        let mut s = TlsSettings::default();
        let json = serde_json::to_value(&s).unwrap();
        assert!(json.get("reissue").is_none(), "{json}");
        s.reissue = Some(Reissue {
            generation: "ab12".into(),
            spread_ms: 2_000,
        });
        let json = serde_json::to_string(&s).unwrap();
        assert!(
            json.contains(r#""reissue":{"generation":"ab12","spread_ms":2000}"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<TlsSettings>(&json).unwrap(), s);
    }
}
