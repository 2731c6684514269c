//! `AuthorizationPolicy` (namespaced): who may call the selected Pods, on
//! which ports, with which methods, paths and headers — Allow, Deny or
//! Audit. The operator compiles every policy selecting a Pod (with the
//! namespace's or cluster's default, see [`DefaultAuthorization`]) into the
//! RBAC policy of that Pod's inbound listener; docs/crds.md states the
//! precedence.

use std::net::IpAddr;
use std::str::FromStr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::HEADER_NAME_PATTERN;
use crate::selector;
use crate::tls_policy::client_identity;
use crate::validation::{Errors, FieldError, Validate};

/// Who may call the selected Pods, and what they may ask.
// Each printcolumn(...) repeats `type_ = ...`; clippy reads that as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "baton.dev",
    doc = "AuthorizationPolicy: Allow, Deny or Audit requests and connections to the selected pods by peer identity, source address, port, method, path and headers.",
    version = "v1alpha1",
    kind = "AuthorizationPolicy",
    namespaced,
    status = "AuthorizationPolicyStatus",
    shortname = "authz",
    category = "baton",
    derive = "PartialEq",
    printcolumn(
        name = "Action",
        type_ = "string",
        json_path = ".spec.action",
        description = "Allow, Deny or Audit"
    ),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status",
        description = "Policy is valid"
    ),
    printcolumn(
        name = "Programmed",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Programmed\")].message",
        description = "How many sidecars ACKed it"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("self.action == 'Allow' || (has(self.rules) && size(self.rules) > 0)").message("a Deny or Audit policy without rules matches nothing: add a rule (an empty rule `{}` matches every request)"))]
#[serde(rename_all = "camelCase")]
pub struct AuthorizationPolicySpec {
    /// Pods (in this namespace) the policy applies to. Empty: every Pod in
    /// the namespace.
    #[serde(default)]
    pub pod_selector: LabelSelector,

    /// Pod ports the policy applies to: container port numbers (`8080`) or
    /// names of the selected Pods' container ports (`http`, an
    /// IANA_SVC_NAME), each name resolved per Pod. Empty: every port.
    // Entries are checked by `Validate` (the webhook, and the operator's
    // Accepted condition), not by CEL: the API server's cost estimate
    // takes an int-or-string item to be as long as a whole request, so a
    // name regex per item would exceed the rule budget and a newer API
    // server would refuse the CRD; the one cheap check, `type(p) == int`
    // for the number range, cannot be evaluated by kube-cel, which the
    // tests hold every rule to (docs/decisions/0054).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub ports: Vec<IntOrString>,

    /// Allow: requests a rule matches are let through; on the policy's
    /// ports, a request no Allow policy matches is denied. Deny: requests a
    /// rule matches are refused (before any Allow is considered). Audit:
    /// requests a rule matches are recorded (sidecar counter, access log)
    /// and nothing is decided.
    #[serde(default)]
    pub action: AuthorizationAction,

    /// Write an access log line for every request to the selected Pods.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub access_log: bool,

    /// A request matches the policy when ANY rule matches (OR); a rule
    /// matches when ALL its non-empty fields do (AND). Empty: matches
    /// nothing (an Allow policy without rules allows nothing on its ports).
    /// An empty rule `{}` matches every request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub rules: Vec<AuthorizationRule>,
}

/// What a policy does with the requests its rules match.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum AuthorizationAction {
    /// Let matching requests through; deny the rest on the policy's ports.
    #[default]
    Allow,
    /// Refuse matching requests (HTTP 403, or the connection closed).
    Deny,
    /// Record matching requests; decide nothing.
    Audit,
}

impl AuthorizationAction {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Allow => "Allow",
            Self::Deny => "Deny",
            Self::Audit => "Audit",
        }
    }
}

/// One rule: where a request comes from and what it asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AuthorizationRule {
    /// The peer. Empty: any peer.
    #[serde(default, skip_serializing_if = "RuleFrom::is_empty")]
    pub from: RuleFrom,
    /// The request. Empty: any request or connection. A rule with methods,
    /// paths or headers matches HTTP requests only, never a raw TCP
    /// connection.
    #[serde(default, skip_serializing_if = "RuleTo::is_empty")]
    pub to: RuleTo,
}

/// Conditions on the peer; every non-empty field must hold (AND), any
/// entry of a field may (OR).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[x_kube(validation = Rule::new("!has(self.authenticated) || self.authenticated || ((!has(self.identities) || size(self.identities) == 0) && (!has(self.serviceAccounts) || size(self.serviceAccounts) == 0) && (!has(self.namespaces) || size(self.namespaces) == 0))").message("authenticated: false matches peers without a mesh identity, so identities, serviceAccounts and namespaces would never match: remove one or the other"))]
#[serde(rename_all = "camelCase")]
pub struct RuleFrom {
    /// Mesh identities, as SPIFFE IDs
    /// `spiffe://<trust domain>/ns/<namespace>/sa/<serviceaccount>` in this
    /// mesh's trust domain.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 64),
        inner(length(min = 9, max = 512), regex(pattern = r"^spiffe://"))
    )]
    pub identities: Vec<String>,
    /// ServiceAccounts, as `namespace/name`, or `name` for one in the
    /// policy's namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 317)))]
    pub service_accounts: Vec<String>,
    /// Namespaces whose workloads (any ServiceAccount) match.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 63)))]
    pub namespaces: Vec<String>,
    /// true: peers with a mesh identity (mTLS); false: peers without one
    /// (plaintext). Absent: either.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authenticated: Option<bool>,
    /// Source addresses, as CIDRs (`10.0.0.0/8`, `fd00::/8`) or single
    /// addresses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 2, max = 43)))]
    pub ip_blocks: Vec<String>,
}

impl RuleFrom {
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }
}

/// Conditions on the request; every non-empty field must hold (AND), any
/// entry of `methods` or `paths` may (OR), every header must (AND).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuleTo {
    /// HTTP methods, upper case (`GET`, `POST`, …).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 16),
        inner(length(min = 1, max = 16), regex(pattern = "^[A-Z]+$"))
    )]
    pub methods: Vec<String>,
    /// Request paths (without the query string).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub paths: Vec<PathRule>,
    /// Request headers; all must hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub headers: Vec<HeaderRule>,
}

impl RuleTo {
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }
}

/// One path condition: exactly one of `exact` or `prefix`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[x_kube(validation = Rule::new("has(self.exact) != has(self.prefix)").message("a path names exactly one of exact or prefix"))]
#[serde(rename_all = "camelCase")]
pub struct PathRule {
    /// The whole path equals this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024), regex(pattern = "^/"))]
    pub exact: Option<String>,
    /// The path starts with this string (a plain string prefix: `/api`
    /// also matches `/apix`; end it with `/` to mean a directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024), regex(pattern = "^/"))]
    pub prefix: Option<String>,
}

/// One header condition: the header is present and, with `exact` or
/// `prefix`, its value matches.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[x_kube(validation = Rule::new("!(has(self.exact) && has(self.prefix))").message("a header names at most one of exact or prefix"))]
#[serde(rename_all = "camelCase")]
pub struct HeaderRule {
    /// Header name (case-insensitive).
    #[schemars(length(min = 1, max = 256), regex(pattern = HEADER_NAME_PATTERN))]
    pub name: String,
    /// The value equals this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub exact: Option<String>,
    /// The value starts with this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub prefix: Option<String>,
}

/// Observed state of an AuthorizationPolicy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AuthorizationPolicyStatus {
    /// `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Accepted, Programmed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// HTTP methods a rule may name (RFC 9110 and PATCH).
pub const METHODS: &[&str] = &[
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
];

/// What a Pod's inbound side does with requests no AuthorizationPolicy
/// decides: the namespace's `baton.dev/default-authorization` annotation,
/// else the operator's `--default-authorization` flag.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DefaultAuthorization {
    /// Everyone, with or without a mesh identity (Baton without policies).
    #[default]
    AllUnauthenticated,
    /// Peers with a mesh identity of any trust domain the sidecar trusts.
    AllAuthenticated,
    /// Peers with a mesh identity in this mesh's trust domain.
    ClusterAuthenticated,
    /// No one.
    Deny,
    /// Everyone, and each request recorded as one `deny` would refuse.
    Audit,
}

impl DefaultAuthorization {
    /// Every value, in the order docs list them.
    pub const ALL: [Self; 5] = [
        Self::AllUnauthenticated,
        Self::AllAuthenticated,
        Self::ClusterAuthenticated,
        Self::Deny,
        Self::Audit,
    ];

    /// The spelling of the annotation and flag.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AllUnauthenticated => "all-unauthenticated",
            Self::AllAuthenticated => "all-authenticated",
            Self::ClusterAuthenticated => "cluster-authenticated",
            Self::Deny => "deny",
            Self::Audit => "audit",
        }
    }
}

impl std::fmt::Display for DefaultAuthorization {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DefaultAuthorization {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "{s:?} is not a default authorization: use one of {}",
                    Self::ALL.map(Self::as_str).join(", ")
                )
            })
    }
}

/// The SPIFFE ID a `from.serviceAccounts` entry names: `ns/sa`, or `sa` in
/// `namespace`.
pub fn service_account_identity(
    entry: &str,
    namespace: &str,
    trust_domain: &str,
) -> Result<String, String> {
    let qualified = if entry.contains('/') {
        entry.to_owned()
    } else {
        format!("{namespace}/{entry}")
    };
    client_identity(&qualified, trust_domain)
}

/// The trust domain of a SPIFFE ID (`spiffe://<td>/…`), if it is one.
pub fn trust_domain_of(id: &str) -> Option<&str> {
    id.strip_prefix("spiffe://")?.split('/').next()
}

/// Parses a CIDR or a single address; the prefix length must fit the family.
pub fn parse_cidr(s: &str) -> Result<(IpAddr, u8), String> {
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s, None),
    };
    let ip: IpAddr = addr.parse().map_err(|_| {
        format!(
            "{s:?} is not a CIDR: use an address and prefix length, e.g. 10.0.0.0/8 or fd00::/8"
        )
    })?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    let len = match len {
        None => max,
        Some(l) => l
            .parse::<u8>()
            .ok()
            .filter(|l| *l <= max)
            .ok_or_else(|| format!("{s:?}: prefix length must be 0 to {max}"))?,
    };
    Ok((ip, len))
}

impl AuthorizationPolicy {
    /// Problems only the trust domain reveals: `from.identities` entries
    /// of another trust domain (no peer of this mesh can ever present
    /// them). Kept out of [`Validate`], which sees no cluster settings; the
    /// webhook and the operator both call it with theirs.
    pub fn foreign_identities(&self, trust_domain: &str) -> Vec<FieldError> {
        let mut out = Vec::new();
        for (i, r) in self.spec.rules.iter().enumerate() {
            for (j, id) in r.from.identities.iter().enumerate() {
                if let Some(td) = trust_domain_of(id)
                    && td != trust_domain
                {
                    out.push(FieldError::new(
                        format!("spec.rules[{i}].from.identities[{j}]"),
                        format!(
                            "{id:?} is in trust domain {td:?}, not this mesh's {trust_domain:?}: no peer can present it; use spiffe://{trust_domain}/ns/<namespace>/sa/<serviceaccount>"
                        ),
                    ));
                }
            }
        }
        out
    }
}

impl Validate for AuthorizationPolicy {
    fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut e = Errors::default();
        let s = &self.spec;
        let namespace = self.metadata.namespace.as_deref().unwrap_or("default");
        selector::check(&mut e, "spec.podSelector", &s.pod_selector);
        for (i, p) in s.ports.iter().enumerate() {
            match p {
                IntOrString::Int(n) if !(1..=65535).contains(n) => e.push(
                    format!("spec.ports[{i}]"),
                    format!("port {n} is out of range: use 1 to 65535"),
                ),
                IntOrString::String(name) => {
                    if let Err(why) = check_port_name(name) {
                        e.push(format!("spec.ports[{i}]"), why);
                    }
                }
                IntOrString::Int(_) => {}
            }
            if s.ports[..i].contains(p) {
                let shown = match p {
                    IntOrString::Int(n) => n.to_string(),
                    IntOrString::String(name) => format!("{name:?}"),
                };
                e.push(
                    format!("spec.ports[{i}]"),
                    format!("port {shown} is listed twice: remove the duplicate"),
                );
            }
        }
        if s.action != AuthorizationAction::Allow && s.rules.is_empty() {
            e.push(
                "spec.rules",
                "a Deny or Audit policy without rules matches nothing: add a rule (an empty rule `{}` matches every request)",
            );
        }
        for (i, r) in s.rules.iter().enumerate() {
            let p = format!("spec.rules[{i}]");
            let f = &r.from;
            for (j, id) in f.identities.iter().enumerate() {
                let fp = format!("{p}.from.identities[{j}]");
                if !id.starts_with("spiffe://") {
                    e.push(fp, format!("{id:?} is not a SPIFFE ID: use spiffe://<trust domain>/ns/<namespace>/sa/<serviceaccount> (or list it under serviceAccounts as namespace/name)"));
                } else if let Err(why) = client_identity(id, "check") {
                    e.push(fp, why);
                }
            }
            for (j, sa) in f.service_accounts.iter().enumerate() {
                if let Err(why) = service_account_identity(sa, namespace, "check") {
                    e.push(format!("{p}.from.serviceAccounts[{j}]"), why);
                }
            }
            for (j, ns) in f.namespaces.iter().enumerate() {
                if !is_dns_label(ns) {
                    e.push(
                        format!("{p}.from.namespaces[{j}]"),
                        format!("{ns:?} is not a valid namespace name"),
                    );
                }
            }
            let names_peers = !f.identities.is_empty()
                || !f.service_accounts.is_empty()
                || !f.namespaces.is_empty();
            if f.authenticated == Some(false) && names_peers {
                e.push(
                    format!("{p}.from.authenticated"),
                    "authenticated: false matches peers without a mesh identity, so identities, serviceAccounts and namespaces would never match: remove one or the other",
                );
            }
            for (j, c) in f.ip_blocks.iter().enumerate() {
                if let Err(why) = parse_cidr(c) {
                    e.push(format!("{p}.from.ipBlocks[{j}]"), why);
                }
            }
            let t = &r.to;
            for (j, m) in t.methods.iter().enumerate() {
                if !METHODS.contains(&m.as_str()) {
                    e.push(
                        format!("{p}.to.methods[{j}]"),
                        format!(
                            "{m:?} is not an HTTP method: use one of {}",
                            METHODS.join(", ")
                        ),
                    );
                }
            }
            for (j, path) in t.paths.iter().enumerate() {
                let pp = format!("{p}.to.paths[{j}]");
                match (&path.exact, &path.prefix) {
                    (Some(v), None) | (None, Some(v)) => {
                        if !v.starts_with('/') {
                            e.push(pp, format!("{v:?} must start with /"));
                        } else if v.contains(['?', '#']) {
                            e.push(pp, format!("{v:?}: paths are matched without the query string; remove ? and #"));
                        }
                    }
                    _ => e.push(pp, "a path names exactly one of exact or prefix"),
                }
            }
            for (j, h) in t.headers.iter().enumerate() {
                let hp = format!("{p}.to.headers[{j}]");
                if h.name.is_empty()
                    || !h
                        .name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
                {
                    e.push(
                        format!("{hp}.name"),
                        format!("{:?} is not an HTTP header name", h.name),
                    );
                }
                if h.exact.is_some() && h.prefix.is_some() {
                    e.push(hp, "a header names at most one of exact or prefix");
                }
            }
        }
        e.into_result()
    }
}

/// Whether `name` is a valid container port name (Kubernetes'
/// IANA_SVC_NAME): 1 to 15 characters, lowercase letters, digits and `-`,
/// at least one letter, no `-` at either end and no `--`. The message says
/// how to fix it.
pub fn check_port_name(name: &str) -> Result<(), String> {
    let valid = (1..=15).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && name.bytes().any(|b| b.is_ascii_lowercase())
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.contains("--");
    if valid {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a port name: a name (IANA_SVC_NAME) is 1 to 15 lowercase letters, digits and '-', with at least one letter, no '-' at either end and no \"--\", e.g. http or grpc-web; or give the port's number"
        ))
    }
}

impl AuthorizationPolicySpec {
    /// The port names `ports` lists (not the numbers), in order.
    pub fn port_names(&self) -> impl Iterator<Item = &str> {
        self.ports.iter().filter_map(|p| match p {
            IntOrString::String(name) => Some(name.as_str()),
            IntOrString::Int(_) => None,
        })
    }
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(spec: serde_json::Value) -> AuthorizationPolicy {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "AuthorizationPolicy",
            "metadata": {"name": "p", "namespace": "shop"},
            "spec": spec,
        }))
        .unwrap()
    }

    fn errors(spec: serde_json::Value) -> Vec<String> {
        match policy(spec).validate() {
            Ok(()) => vec![],
            Err(e) => e.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn a_full_policy_is_valid() {
        let e = errors(serde_json::json!({
            "podSelector": {"matchLabels": {"app": "server"}},
            "ports": [8080, 9000],
            "action": "Allow",
            "accessLog": true,
            "rules": [{
                "from": {"identities": ["spiffe://cluster.local/ns/shop/sa/web"],
                         "serviceAccounts": ["client", "other/client"],
                         "namespaces": ["shop"], "authenticated": true,
                         "ipBlocks": ["10.88.0.0/16", "fd00::/8", "10.0.0.1"]},
                "to": {"methods": ["GET", "HEAD"],
                       "paths": [{"exact": "/public"}, {"prefix": "/static/"}],
                       "headers": [{"name": "x-tenant", "exact": "a"}, {"name": "x-trace"}]}
            }, {}]
        }));
        assert!(e.is_empty(), "{e:?}");
    }

    #[test]
    fn rejects_bad_cidr_method_port_path_header_and_identity_with_a_message_each() {
        let e = errors(serde_json::json!({
            "ports": [0, 70000, 80, 80],
            "rules": [{
                "from": {"identities": ["shop/web", "spiffe://cluster.local/web"],
                         "serviceAccounts": ["Bad_Name"],
                         "namespaces": ["-x"],
                         "ipBlocks": ["10.0.0.0/33", "banana"]},
                "to": {"methods": ["get", "FETCH"],
                       "paths": [{"exact": "nope"}, {}, {"exact": "/a", "prefix": "/b"}],
                       "headers": [{"name": "bad name"}, {"name": "x", "exact": "a", "prefix": "b"}]}
            }]
        }));
        let expect = [
            "spec.ports[0]: port 0 is out of range",
            "spec.ports[1]: port 70000 is out of range",
            "spec.ports[3]: port 80 is listed twice",
            "spec.rules[0].from.identities[0]: \"shop/web\" is not a SPIFFE ID",
            "spec.rules[0].from.identities[1]: \"spiffe://cluster.local/web\" is not a workload SPIFFE ID",
            "spec.rules[0].from.serviceAccounts[0]:",
            "spec.rules[0].from.namespaces[0]: \"-x\" is not a valid namespace name",
            "spec.rules[0].from.ipBlocks[0]: \"10.0.0.0/33\": prefix length must be 0 to 32",
            "spec.rules[0].from.ipBlocks[1]: \"banana\" is not a CIDR",
            "spec.rules[0].to.methods[0]: \"get\" is not an HTTP method",
            "spec.rules[0].to.methods[1]: \"FETCH\" is not an HTTP method",
            "spec.rules[0].to.paths[0]: \"nope\" must start with /",
            "spec.rules[0].to.paths[1]: a path names exactly one of exact or prefix",
            "spec.rules[0].to.paths[2]: a path names exactly one of exact or prefix",
            "spec.rules[0].to.headers[0].name: \"bad name\" is not an HTTP header name",
            "spec.rules[0].to.headers[1]: a header names at most one of exact or prefix",
        ];
        for x in expect {
            assert!(
                e.iter().any(|m| m.starts_with(x)),
                "missing {x:?} in {e:#?}"
            );
        }
        assert_eq!(e.len(), expect.len(), "{e:#?}");
    }

    #[test]
    fn ports_are_numbers_or_iana_service_names_and_a_bad_name_says_what_a_name_is() {
        let e = errors(serde_json::json!({
            "ports": [8080, "http", "grpc-web", "h2c", "http", "HTTP", "8080",
                      "-http", "http-", "a--b", "a-very-long-port", "", "web_ui"]
        }));
        let expect = [
            "spec.ports[4]: port \"http\" is listed twice",
            "spec.ports[5]: \"HTTP\" is not a port name",
            "spec.ports[6]: \"8080\" is not a port name",
            "spec.ports[7]: \"-http\" is not a port name",
            "spec.ports[8]: \"http-\" is not a port name",
            "spec.ports[9]: \"a--b\" is not a port name",
            "spec.ports[10]: \"a-very-long-port\" is not a port name",
            "spec.ports[11]: \"\" is not a port name",
            "spec.ports[12]: \"web_ui\" is not a port name",
        ];
        for x in expect {
            assert!(
                e.iter().any(|m| m.starts_with(x)),
                "missing {x:?} in {e:#?}"
            );
        }
        assert_eq!(e.len(), expect.len(), "{e:#?}");
        assert!(e[1].contains("IANA_SVC_NAME"), "{}", e[1]);
        assert!(e[1].contains("or give the port's number"), "{}", e[1]);
        assert!(check_port_name("a-very-long-po").is_ok());
        assert!(check_port_name("8080-http").is_ok());
        let p = policy(serde_json::json!({"ports": [80, "http", "admin"]}));
        assert_eq!(p.spec.port_names().collect::<Vec<_>>(), ["http", "admin"]);
    }

    #[test]
    fn malformed_identities_are_refused_with_the_form_to_use() {
        let e = errors(serde_json::json!({"rules": [{"from": {
            "identities": ["web", "spiffe://", "spiffe://cluster.local/ns/shop/sa/"],
            "serviceAccounts": ["shop/web/extra", "/web"]
        }}]}));
        assert_eq!(e.len(), 5, "{e:#?}");
        assert!(
            e[0].contains(
                "is not a SPIFFE ID: use spiffe://<trust domain>/ns/<namespace>/sa/<serviceaccount>"
            ),
            "{}",
            e[0]
        );
        for m in &e {
            assert!(m.starts_with("spec.rules[0].from."), "{m}");
            assert!(m.len() > 40, "a message that says what is wrong: {m}");
        }
    }

    #[test]
    fn a_deny_or_audit_policy_needs_a_rule_and_an_allow_policy_does_not() {
        assert!(errors(serde_json::json!({"action": "Allow"})).is_empty());
        for action in ["Deny", "Audit"] {
            let e = errors(serde_json::json!({"action": action}));
            assert_eq!(e.len(), 1, "{e:?}");
            assert!(
                e[0].starts_with(
                    "spec.rules: a Deny or Audit policy without rules matches nothing"
                )
            );
        }
        assert!(errors(serde_json::json!({"action": "Deny", "rules": [{}]})).is_empty());
    }

    #[test]
    fn unauthenticated_peers_cannot_also_be_named_by_identity() {
        let e = errors(serde_json::json!({
            "rules": [{"from": {"authenticated": false, "namespaces": ["shop"]}}]
        }));
        assert_eq!(e.len(), 1);
        assert!(
            e[0].starts_with("spec.rules[0].from.authenticated:"),
            "{e:?}"
        );
        assert!(
            errors(serde_json::json!({"rules": [{"from": {"authenticated": false}}]})).is_empty()
        );
    }

    #[test]
    fn an_identity_outside_the_trust_domain_is_named_with_the_mesh_s_domain() {
        let p = policy(serde_json::json!({"rules": [{"from": {"identities": [
            "spiffe://cluster.local/ns/shop/sa/web",
            "spiffe://other.example/ns/shop/sa/web"
        ]}}]}));
        assert_eq!(p.validate(), Ok(()));
        let e = p.foreign_identities("cluster.local");
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].path, "spec.rules[0].from.identities[1]");
        assert!(
            e[0].message.contains("not this mesh's \"cluster.local\""),
            "{}",
            e[0]
        );
    }

    #[test]
    fn service_accounts_default_to_the_policy_s_namespace() {
        assert_eq!(
            service_account_identity("web", "shop", "td").unwrap(),
            "spiffe://td/ns/shop/sa/web"
        );
        assert_eq!(
            service_account_identity("infra/probe", "shop", "td").unwrap(),
            "spiffe://td/ns/infra/sa/probe"
        );
    }

    #[test]
    fn default_authorization_parses_every_documented_value_and_refuses_others() {
        for d in DefaultAuthorization::ALL {
            assert_eq!(d.as_str().parse::<DefaultAuthorization>(), Ok(d));
        }
        let e = "allow".parse::<DefaultAuthorization>().unwrap_err();
        assert!(
            e.contains(
                "all-unauthenticated, all-authenticated, cluster-authenticated, deny, audit"
            ),
            "{e}"
        );
    }

    #[test]
    fn an_unknown_action_does_not_parse() {
        let r: Result<AuthorizationPolicy, _> = serde_json::from_value(serde_json::json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "AuthorizationPolicy",
            "metadata": {"name": "p", "namespace": "shop"},
            "spec": {"action": "Permit"},
        }));
        assert!(r.unwrap_err().to_string().contains("Allow"));
    }
}
