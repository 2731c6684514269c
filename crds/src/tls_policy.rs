//! `TlsPolicy` (namespaced): how the sidecars of the selected pods speak TLS:
//! mTLS mode (Istio `PeerAuthentication` modes), minimum version and cipher
//! suites (rustls names), where the certificate comes from, and whether the
//! private-key operations are offloaded to an Intel QAT device.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::contract::DEFAULT_QAT_RESOURCE;
use crate::selector;
use crate::validation::{Errors, FieldError, Validate};

/// TLS settings for the sidecars of the selected pods.
// Each printcolumn(...) repeats `type_ = ...`; clippy reads that as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "baton.dev",
    doc = "TlsPolicy: mTLS mode, TLS version and cipher suites, certificate source and private-key offload for the sidecars of the selected pods.",
    version = "v1alpha1",
    kind = "TlsPolicy",
    namespaced,
    status = "TlsPolicyStatus",
    shortname = "tlsp",
    category = "baton",
    derive = "PartialEq",
    printcolumn(
        name = "mTLS",
        type_ = "string",
        json_path = ".spec.mtls.mode",
        description = "Strict, Permissive or Disabled"
    ),
    printcolumn(
        name = "Min-Version",
        type_ = "string",
        json_path = ".spec.minVersion",
        description = "Lowest TLS version accepted"
    ),
    printcolumn(
        name = "Offload",
        type_ = "string",
        json_path = ".spec.privateKeyOffload.mode",
        description = "Private-key offload mode"
    ),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status",
        priority = 1,
        description = "Policy is valid"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("!has(self.cipherSuites) || self.minVersion != 'TLSv1.3' || self.cipherSuites.all(c, c.startsWith('TLS13_'))").message("minVersion TLSv1.3 never negotiates TLS 1.2 suites: remove the TLS_ECDHE_* entries from cipherSuites or lower minVersion"))]
#[x_kube(validation = Rule::new("!has(self.cipherSuites) || size(self.cipherSuites) == 0 || self.cipherSuites.exists(c, c.startsWith('TLS13_'))").message("cipherSuites must include at least one TLS 1.3 suite (TLS13_*): TLS 1.3 is always enabled"))]
#[x_kube(validation = Rule::new("self.mtls.mode != 'Disabled' || self.privateKeyOffload.mode == 'Disabled'").message("privateKeyOffload needs TLS: with mtls.mode Disabled set privateKeyOffload.mode to Disabled"))]
#[x_kube(validation = Rule::new("self.mtls.mode != 'Disabled' || !has(self.mtls.allowedClients) || size(self.mtls.allowedClients) == 0").message("mtls.allowedClients needs client identities from mTLS: with mtls.mode Disabled remove allowedClients"))]
#[serde(rename_all = "camelCase")]
pub struct TlsPolicySpec {
    /// Pods (in this namespace) whose sidecars follow this policy. An empty
    /// selector selects every pod in the namespace. Policies selecting a
    /// common pod must agree on mtls.mode, minVersion and
    /// privateKeyOffload.mode (the validating webhook refuses conflicting
    /// ones); among agreeing policies the alphabetically first applies.
    pub pod_selector: LabelSelector,

    /// Mutual TLS between sidecars.
    #[serde(default)]
    pub mtls: MtlsSettings,

    /// Lowest TLS version the sidecar accepts or offers.
    #[serde(default)]
    pub min_version: TlsVersion,

    /// Allowed cipher suites, by their rustls / IANA names. Empty: rustls'
    /// safe defaults (all listed suites). TLS 1.3 is always enabled, so at
    /// least one TLS13_* suite is required.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "cipher_suites_schema")]
    pub cipher_suites: Vec<String>,

    /// Where the sidecar's certificate and key come from.
    #[serde(default)]
    pub certificate: CertificateSource,

    /// Offload of private-key operations (handshake signatures) to an Intel
    /// QAT device.
    #[serde(default)]
    pub private_key_offload: PrivateKeyOffload,
}

/// Mutual TLS settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MtlsSettings {
    /// Strict: inbound connections must be mesh mTLS. Permissive: mTLS and
    /// plaintext both accepted (for migrating). Disabled: plaintext only.
    #[serde(default)]
    pub mode: MtlsMode,
    /// Clients allowed to reach the selected pods, by their mesh identity:
    /// `namespace/serviceaccount`, or a SPIFFE ID
    /// `spiffe://<trust domain>/ns/<namespace>/sa/<serviceaccount>`.
    /// Empty: every client the mode accepts. Non-empty: an HTTP request
    /// from any other client (another identity, or plaintext under
    /// Permissive) is answered 403; any other TCP connection is closed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 3, max = 512)))]
    pub allowed_clients: Vec<String>,
}

/// The SPIFFE ID an `allowedClients` entry names in `trust_domain`, or why
/// the entry is not one.
pub fn client_identity(entry: &str, trust_domain: &str) -> Result<String, String> {
    let (namespace, account, id) = match entry.strip_prefix("spiffe://") {
        Some(rest) => {
            let mut parts = rest.split('/');
            match (
                parts.next(),
                parts.next(),
                parts.next(),
                parts.next(),
                parts.next(),
                parts.next(),
            ) {
                (Some(td), Some("ns"), Some(ns), Some("sa"), Some(sa), None) if !td.is_empty() => {
                    (ns, sa, entry.to_owned())
                }
                _ => {
                    return Err(format!(
                        "{entry:?} is not a workload SPIFFE ID: use spiffe://<trust domain>/ns/<namespace>/sa/<serviceaccount>"
                    ));
                }
            }
        }
        None => match entry.split_once('/') {
            Some((ns, sa)) => (ns, sa, format!("spiffe://{trust_domain}/ns/{ns}/sa/{sa}")),
            None => {
                return Err(format!(
                    "{entry:?} names no ServiceAccount: use namespace/serviceaccount or a SPIFFE ID"
                ));
            }
        },
    };
    if !is_dns_label(namespace) {
        return Err(format!(
            "{entry:?}: namespace {namespace:?} is not a valid namespace name"
        ));
    }
    if !is_dns_subdomain(account) {
        return Err(format!(
            "{entry:?}: {account:?} is not a valid ServiceAccount name"
        ));
    }
    Ok(id)
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// mTLS mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum MtlsMode {
    /// Only mesh mTLS accepted.
    #[default]
    Strict,
    /// mTLS and plaintext accepted.
    Permissive,
    /// Plaintext only.
    Disabled,
}

/// TLS protocol version.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum TlsVersion {
    /// TLS 1.2 and 1.3.
    #[default]
    #[serde(rename = "TLSv1.2")]
    Tls12,
    /// TLS 1.3 only.
    #[serde(rename = "TLSv1.3")]
    Tls13,
}

/// Cipher suites Baton's sidecar (rustls, ring provider) implements, with the
/// TLS version each belongs to. Names are rustls' `CipherSuite` names.
pub const CIPHER_SUITES: &[(&str, TlsVersion)] = &[
    ("TLS13_AES_256_GCM_SHA384", TlsVersion::Tls13),
    ("TLS13_AES_128_GCM_SHA256", TlsVersion::Tls13),
    ("TLS13_CHACHA20_POLY1305_SHA256", TlsVersion::Tls13),
    ("TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384", TlsVersion::Tls12),
    ("TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256", TlsVersion::Tls12),
    (
        "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
        TlsVersion::Tls12,
    ),
    ("TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384", TlsVersion::Tls12),
    ("TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256", TlsVersion::Tls12),
    (
        "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
        TlsVersion::Tls12,
    ),
];

/// The TLS version a cipher suite name belongs to; `None` if unknown.
pub fn cipher_suite_version(name: &str) -> Option<TlsVersion> {
    CIPHER_SUITES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| *v)
}

fn cipher_suites_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let names: Vec<&str> = CIPHER_SUITES.iter().map(|(n, _)| *n).collect();
    schemars::json_schema!({
        "type": "array",
        "maxItems": CIPHER_SUITES.len(),
        "items": { "type": "string", "enum": names },
    })
}

/// Certificate source.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[x_kube(validation = Rule::new("self.source == 'Secret' ? has(self.secretRef) : !has(self.secretRef)").message("secretRef is required with source Secret and not allowed with source Mesh"))]
#[serde(rename_all = "camelCase")]
pub struct CertificateSource {
    /// Mesh: a workload certificate the operator issues for the pod's
    /// ServiceAccount identity, rotated automatically. Secret: a
    /// `kubernetes.io/tls` Secret you manage (`secretRef`).
    #[serde(default)]
    pub source: CertificateSourceKind,
    /// The `kubernetes.io/tls` Secret (same namespace) with `tls.crt` and
    /// `tls.key`. Only with source Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretRef>,
}

impl CertificateSource {
    /// The Secret the sidecars' certificate comes from, with source Secret.
    pub fn secret_name(&self) -> Option<&str> {
        match (self.source, &self.secret_ref) {
            (CertificateSourceKind::Secret, Some(r)) if !r.name.is_empty() => Some(&r.name),
            _ => None,
        }
    }
}

/// Where a certificate comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum CertificateSourceKind {
    /// Issued by the mesh for the pod's ServiceAccount.
    #[default]
    Mesh,
    /// Read from a Secret.
    Secret,
}

/// Reference to a Secret in the same namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretRef {
    /// Secret name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// Private-key offload to an Intel QAT device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PrivateKeyOffload {
    /// Disabled: keys are used in software. Preferred: use a device when the
    /// pool has one free, otherwise fall back to software (recorded on the
    /// pod and in the pool status). Required: the pod gets a device or is
    /// refused at admission.
    #[serde(default)]
    pub mode: OffloadMode,
    /// Extended resource name of the devices, as the device plugin
    /// advertises it.
    #[serde(default = "default_qat_resource")]
    #[schemars(length(min = 1, max = 253))]
    pub resource: String,
    /// AcceleratorPool to take devices from. Absent: the pool whose
    /// `resourceName` equals `resource` (alphabetically first if several).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub pool: Option<String>,
}

impl Default for PrivateKeyOffload {
    fn default() -> Self {
        Self {
            mode: OffloadMode::Disabled,
            resource: default_qat_resource(),
            pool: None,
        }
    }
}

fn default_qat_resource() -> String {
    DEFAULT_QAT_RESOURCE.to_owned()
}

/// Offload mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum OffloadMode {
    /// Software only.
    #[default]
    Disabled,
    /// Device if available, else software.
    Preferred,
    /// Device or no pod.
    Required,
}

impl OffloadMode {
    /// The spelling used in the schema and in `BATON_OFFLOAD_MODE`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disabled => "Disabled",
            Self::Preferred => "Preferred",
            Self::Required => "Required",
        }
    }
}

/// Observed state of a TlsPolicy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TlsPolicyStatus {
    /// `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Accepted, Programmed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Whether `name` is a valid extended resource name (`domain/name`).
pub fn is_extended_resource_name(name: &str) -> bool {
    let Some((domain, res)) = name.split_once('/') else {
        return false;
    };
    let domain_ok = domain.len() <= 253
        && domain.contains('.')
        && domain.split('.').all(is_dns_label)
        && !domain.ends_with("kubernetes.io");
    let res_ok = !res.is_empty()
        && res.len() <= 63
        && res
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && res.starts_with(|c: char| c.is_ascii_alphanumeric())
        && res.ends_with(|c: char| c.is_ascii_alphanumeric());
    domain_ok && res_ok
}

impl Validate for TlsPolicy {
    fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut e = Errors::default();
        let s = &self.spec;
        selector::check(&mut e, "spec.podSelector", &s.pod_selector);

        let valid_names = || {
            CIPHER_SUITES
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut any13 = false;
        for (i, c) in s.cipher_suites.iter().enumerate() {
            let p = format!("spec.cipherSuites[{i}]");
            match cipher_suite_version(c) {
                None => e.push(
                    p,
                    format!("unknown cipher suite {c:?}: use one of {}", valid_names()),
                ),
                Some(TlsVersion::Tls12) if s.min_version == TlsVersion::Tls13 => e.push(
                    p,
                    format!(
                        "{c} is a TLS 1.2 suite and minVersion is TLSv1.3, so it is never negotiated: remove it or set minVersion TLSv1.2"
                    ),
                ),
                Some(TlsVersion::Tls13) => any13 = true,
                Some(TlsVersion::Tls12) => {}
            }
            if s.cipher_suites[..i].contains(c) {
                e.push(
                    format!("spec.cipherSuites[{i}]"),
                    format!("{c} is listed twice: remove the duplicate"),
                );
            }
        }
        if !s.cipher_suites.is_empty() && !any13 {
            e.push(
                "spec.cipherSuites",
                "must include at least one TLS 1.3 suite (TLS13_AES_256_GCM_SHA384, TLS13_AES_128_GCM_SHA256 or TLS13_CHACHA20_POLY1305_SHA256): TLS 1.3 is always enabled",
            );
        }

        let allowed = &s.mtls.allowed_clients;
        for (i, entry) in allowed.iter().enumerate() {
            let p = format!("spec.mtls.allowedClients[{i}]");
            // The trust domain does not change the verdict, only the ID.
            if let Err(why) = client_identity(entry, "check") {
                e.push(&p, why);
            }
            if allowed[..i].contains(entry) {
                e.push(p, format!("{entry} is listed twice: remove the duplicate"));
            }
        }
        if s.mtls.mode == MtlsMode::Disabled && !allowed.is_empty() {
            e.push(
                "spec.mtls.allowedClients",
                "needs client identities from mTLS: with mtls.mode Disabled remove allowedClients",
            );
        }

        let c = &s.certificate;
        match (c.source, &c.secret_ref) {
            (CertificateSourceKind::Secret, None) => e.push(
                "spec.certificate.secretRef",
                "is required with source Secret: name a kubernetes.io/tls Secret in this namespace",
            ),
            (CertificateSourceKind::Secret, Some(r)) if r.name.is_empty() => {
                e.push("spec.certificate.secretRef.name", "must not be empty")
            }
            (CertificateSourceKind::Mesh, Some(_)) => e.push(
                "spec.certificate.secretRef",
                "is only allowed with source Secret: remove it or set source Secret",
            ),
            _ => {}
        }

        let o = &s.private_key_offload;
        if !is_extended_resource_name(&o.resource) {
            e.push(
                "spec.privateKeyOffload.resource",
                format!(
                    "{:?} is not an extended resource name: use <domain>/<name>, e.g. {DEFAULT_QAT_RESOURCE}",
                    o.resource
                ),
            );
        }
        if o.pool.as_deref().is_some_and(str::is_empty) {
            e.push(
                "spec.privateKeyOffload.pool",
                "must name an AcceleratorPool or be omitted",
            );
        }
        if s.mtls.mode == MtlsMode::Disabled && o.mode != OffloadMode::Disabled {
            e.push(
                "spec.privateKeyOffload.mode",
                "privateKeyOffload needs TLS: with mtls.mode Disabled set privateKeyOffload.mode to Disabled",
            );
        }
        e.into_result()
    }
}
