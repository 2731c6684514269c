//! Inbound authorization: every AuthorizationPolicy selecting a Pod, the
//! `mtls.allowedClients` of its TlsPolicy, its httpGet probes and the
//! default (namespace annotation, else the operator's flag) compiled into
//! the one [`RbacPolicy`] its inbound listener enforces.
//!
//! The sidecar evaluates rules in order, audit rules record and go on, and
//! the first allow or deny rule that matches decides. So the precedence
//! docs/crds.md states is an order here:
//!
//! ```text
//!   deny rules        Deny policies: refused before anything else is asked
//!   audit rules       Audit policies: recorded, nothing decided
//!   allow rules       Allow policies, allowedClients (all ports), probes
//!   implicit deny     the ports some Allow policy selects (or all ports)
//!   default rule      all-authenticated / cluster-authenticated only
//!   default_action    allow / deny / audit, from the default
//! ```
//!
//! Pure, like the rest of the compiler: same inputs, same policy.

use std::collections::BTreeSet;

use baton_config::{RbacAction, RbacHeader, RbacPolicy, RbacRule};
use baton_crds::authorization_policy::{
    AuthorizationAction, AuthorizationRule, DefaultAuthorization, parse_cidr,
    service_account_identity,
};
use baton_crds::tls_policy::client_identity;
use baton_crds::{AuthorizationPolicy, TlsPolicy, Validate};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::compile::Refusal;
use super::index::{Index, ObjKey, PodInfo};

/// Name of the compiled policy in the snapshot's `policies.rbac`.
pub const POLICY_NAME: &str = "inbound-authorization";
/// Label of the rule that denies what no Allow policy allowed.
pub const IMPLICIT_DENY: &str = "implicit-deny";

/// Why an AuthorizationPolicy is not used, if it is not: invalid, or it
/// names identities of another trust domain.
pub fn refusal(policy: &AuthorizationPolicy, trust_domain: &str) -> Option<Refusal> {
    let mut errors = policy.validate().err().unwrap_or_default();
    errors.extend(policy.foreign_identities(trust_domain));
    (!errors.is_empty()).then(|| Refusal {
        reason: "Invalid",
        message: baton_crds::validation::summarize(&errors),
    })
}

/// The accepted AuthorizationPolicies selecting `pod`, by key.
pub fn select<'i>(
    index: &'i Index,
    trust_domain: &str,
    pod: &ObjKey,
) -> Vec<(&'i ObjKey, &'i AuthorizationPolicy)> {
    let Some(info) = index.pods.get(pod) else {
        return Vec::new();
    };
    index
        .authorization_policies
        .range(ObjKey::new(&pod.namespace, "")..)
        .take_while(|(k, _)| k.namespace == pod.namespace)
        .filter(|(_, p)| {
            baton_crds::selector::matches(&p.spec.pod_selector, &info.labels)
                && refusal(p, trust_domain).is_none()
        })
        .map(|(k, p)| (k, p.as_ref()))
        .collect()
}

/// The default for Pods of `namespace`: its annotation when it holds a
/// valid value, else the operator's. (An invalid annotation falls back
/// rather than failing open or closed by accident; docs say so.)
pub fn default_for(
    index: &Index,
    namespace: &str,
    flag: DefaultAuthorization,
) -> DefaultAuthorization {
    index
        .namespace_defaults
        .get(namespace)
        .and_then(|v| v.parse().ok())
        .unwrap_or(flag)
}

/// What the inbound side of one Pod enforces.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Inbound {
    /// `None`: nothing to enforce (no policy, allowedClients or default
    /// other than all-unauthenticated): the listener stays as before.
    pub rbac: Option<RbacPolicy>,
    /// A selecting policy's `accessLog`, or the Pod's annotation.
    pub access_log: bool,
}

/// Compiles the inbound authorization of one Pod. `tls` is its TlsPolicy
/// (for `allowedClients`), `policies` the accepted AuthorizationPolicies
/// selecting it ([`select`]).
pub fn compile(
    trust_domain: &str,
    default: DefaultAuthorization,
    info: &PodInfo,
    tls: Option<(&ObjKey, &TlsPolicy)>,
    policies: &[(&ObjKey, &AuthorizationPolicy)],
) -> Inbound {
    let access_log = info.access_log || policies.iter().any(|(_, p)| p.spec.access_log);
    let allowed_clients = tls
        .map(|(k, p)| (k, &p.spec.mtls.allowed_clients))
        .filter(|(_, a)| !a.is_empty());
    if policies.is_empty()
        && allowed_clients.is_none()
        && default == DefaultAuthorization::AllUnauthenticated
    {
        return Inbound {
            rbac: None,
            access_log,
        };
    }

    let of = |action| {
        policies
            .iter()
            .filter(move |(_, p)| p.spec.action == action)
    };
    let mut rules = Vec::new();
    for action in [
        AuthorizationAction::Deny,
        AuthorizationAction::Audit,
        AuthorizationAction::Allow,
    ] {
        for (key, p) in of(action) {
            let Some(ports) = ports(p, info) else {
                // Names only, none declared by this Pod: the policy
                // applies to no port here (status says UnknownPort).
                continue;
            };
            for (i, r) in p.spec.rules.iter().enumerate() {
                let name = format!("{key}/rules[{i}]");
                rules.extend(rule(
                    r,
                    &name,
                    rbac_action(action),
                    &ports,
                    &key.namespace,
                    trust_domain,
                ));
            }
        }
    }
    // allowedClients: an Allow policy on every port (the shorthand).
    if let Some((key, allowed)) = allowed_clients {
        rules.push(RbacRule {
            name: format!("tlspolicy:{key}/mtls.allowedClients"),
            action: RbacAction::Allow,
            identities: allowed
                .iter()
                // Entries were validated before the policy was selected.
                .filter_map(|e| client_identity(e, trust_domain).ok())
                .collect(),
            ..RbacRule::default()
        });
    }

    // Ports some Allow policy selects: None = every port.
    let mut allow_ports: Option<BTreeSet<u16>> = Some(BTreeSet::new());
    let mut any_allow = allowed_clients.is_some();
    if allowed_clients.is_some() {
        allow_ports = None;
    }
    for (_, p) in of(AuthorizationAction::Allow) {
        let Some(ports) = ports(p, info) else {
            continue;
        };
        any_allow = true;
        match (&mut allow_ports, ports.is_empty()) {
            (Some(_), true) => allow_ports = None,
            (Some(set), false) => set.extend(ports),
            (None, _) => {}
        }
    }

    // Probes, where something below would refuse them: the kubelet keeps
    // working under deny, all-authenticated and Allow policies alike.
    // (Under audit too: audit reports what deny would refuse, and deny
    // admits probes.)
    let default_allows = default == DefaultAuthorization::AllUnauthenticated;
    for (port, path) in &info.probes {
        let implicitly_denied =
            any_allow && allow_ports.as_ref().is_none_or(|set| set.contains(port));
        if implicitly_denied || !default_allows {
            rules.push(RbacRule {
                name: format!("probe:{port}{path}"),
                action: RbacAction::Allow,
                ports: vec![*port],
                methods: vec!["GET".into()],
                paths: vec![path.clone()],
                ..RbacRule::default()
            });
        }
    }

    if any_allow {
        rules.push(RbacRule {
            name: IMPLICIT_DENY.into(),
            action: RbacAction::Deny,
            ports: allow_ports
                .map(|s| s.into_iter().collect())
                .unwrap_or_default(),
            ..RbacRule::default()
        });
    }

    let default_action = match default {
        DefaultAuthorization::AllUnauthenticated => RbacAction::Allow,
        DefaultAuthorization::Audit => RbacAction::Audit,
        DefaultAuthorization::Deny => RbacAction::Deny,
        DefaultAuthorization::AllAuthenticated => {
            rules.push(RbacRule {
                name: "default:all-authenticated".into(),
                action: RbacAction::Allow,
                authenticated: Some(true),
                ..RbacRule::default()
            });
            RbacAction::Deny
        }
        DefaultAuthorization::ClusterAuthenticated => {
            rules.push(RbacRule {
                name: "default:cluster-authenticated".into(),
                action: RbacAction::Allow,
                identities: vec![format!("spiffe://{trust_domain}/*")],
                ..RbacRule::default()
            });
            RbacAction::Deny
        }
    };
    Inbound {
        rbac: Some(RbacPolicy {
            name: POLICY_NAME.into(),
            rules,
            default_action,
        }),
        access_log,
    }
}

fn rbac_action(a: AuthorizationAction) -> RbacAction {
    match a {
        AuthorizationAction::Allow => RbacAction::Allow,
        AuthorizationAction::Deny => RbacAction::Deny,
        AuthorizationAction::Audit => RbacAction::Audit,
    }
}

/// The policy's ports on one Pod: numbers as they are, names resolved
/// against the Pod's container ports. Empty: every port. `None`: the
/// policy lists ports but none exists on this Pod (every entry a name the
/// Pod does not declare), so it applies to no port here — never "every
/// port", which is what an empty list would say.
fn ports(p: &AuthorizationPolicy, info: &PodInfo) -> Option<Vec<u16>> {
    let mut v: Vec<u16> = p
        .spec
        .ports
        .iter()
        .filter_map(|p| match p {
            IntOrString::Int(n) => u16::try_from(*n).ok(),
            IntOrString::String(name) => info.port_names.get(name).copied(),
        })
        .collect();
    if v.is_empty() && !p.spec.ports.is_empty() {
        return None;
    }
    v.sort_unstable();
    v.dedup();
    Some(v)
}

/// How the port names the `policies` list resolve on a Pod (`None`: not
/// declared): what the compile reads of the Pod's ports, for
/// [`super::compile::CompileKey`].
pub fn resolved_names(
    info: &PodInfo,
    policies: &[(&ObjKey, &AuthorizationPolicy)],
) -> Vec<(String, Option<u16>)> {
    let names: BTreeSet<&str> = policies
        .iter()
        .flat_map(|(_, p)| p.spec.port_names())
        .collect();
    names
        .into_iter()
        .map(|n| (n.to_owned(), info.port_names.get(n).copied()))
        .collect()
}

/// Pods shown by name in an UnknownPort message before "and N more".
const SHOWN_PODS: usize = 3;

/// The port names of `policy` that Pods it selects do not declare, as one
/// message for its status (`None`: every name resolves on every selected
/// Pod, or it names none). A Pod without the name gets no rule from the
/// policy on that port; the message says which Pods and what they declare.
pub fn unknown_ports(index: &Index, key: &ObjKey, policy: &AuthorizationPolicy) -> Option<String> {
    let names: Vec<&str> = policy.spec.port_names().collect();
    if names.is_empty() {
        return None;
    }
    let mut missing: Vec<String> = Vec::new();
    let mut total = 0;
    for (pod, info) in index
        .pods
        .range(ObjKey::new(&key.namespace, "")..)
        .take_while(|(k, _)| k.namespace == key.namespace)
        .filter(|(_, i)| baton_crds::selector::matches(&policy.spec.pod_selector, &i.labels))
    {
        let absent: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| !info.port_names.contains_key(*n))
            .collect();
        if absent.is_empty() {
            continue;
        }
        total += 1;
        if missing.len() < SHOWN_PODS {
            let declared: Vec<&str> = info.port_names.keys().map(String::as_str).collect();
            missing.push(format!(
                "Pod {} declares no container port named {} (it declares {})",
                pod.name,
                absent
                    .iter()
                    .map(|n| format!("{n:?}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                if declared.is_empty() {
                    "no named port".to_owned()
                } else {
                    declared.join(", ")
                }
            ));
        }
    }
    if total == 0 {
        return None;
    }
    let more = total - missing.len();
    let mut message = missing.join("; ");
    if more > 0 {
        message.push_str(&format!("; and {more} more Pods"));
    }
    message.push_str(": the policy does not apply to those ports of those Pods; name a port they declare or use its number");
    Some(message)
}

/// A peer pattern: one identity, or every identity of a namespace.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Peer {
    Exact(String),
    Namespace(String),
}

/// The peers matching every non-empty one of `identities`,
/// `serviceAccounts` and `namespaces` (they AND like any two fields; the
/// sidecar has one identity list, so the intersection is computed here).
/// `None`: no peer condition. `Some(empty)`: no peer can match.
fn peers(r: &AuthorizationRule, namespace: &str, trust_domain: &str) -> Option<Vec<Peer>> {
    let f = &r.from;
    let mut sets: Vec<Vec<Peer>> = Vec::new();
    if !f.identities.is_empty() {
        sets.push(f.identities.iter().cloned().map(Peer::Exact).collect());
    }
    if !f.service_accounts.is_empty() {
        sets.push(
            f.service_accounts
                .iter()
                .filter_map(|sa| service_account_identity(sa, namespace, trust_domain).ok())
                .map(Peer::Exact)
                .collect(),
        );
    }
    if !f.namespaces.is_empty() {
        sets.push(f.namespaces.iter().cloned().map(Peer::Namespace).collect());
    }
    let ns_prefix = |ns: &str| format!("spiffe://{trust_domain}/ns/{ns}/");
    let mut sets = sets.into_iter();
    let first = sets.next()?;
    Some(sets.fold(first, |acc, set| {
        let mut out = BTreeSet::new();
        for a in &acc {
            for b in &set {
                match (a, b) {
                    (Peer::Exact(x), Peer::Exact(y)) if x == y => {
                        out.insert(a.clone());
                    }
                    (Peer::Exact(x), Peer::Namespace(n)) | (Peer::Namespace(n), Peer::Exact(x))
                        if x.starts_with(&ns_prefix(n)) =>
                    {
                        out.insert(Peer::Exact(x.clone()));
                    }
                    (Peer::Namespace(x), Peer::Namespace(y)) if x == y => {
                        out.insert(a.clone());
                    }
                    _ => {}
                }
            }
        }
        out.into_iter().collect()
    }))
}

/// One policy rule as sidecar rules: none when it can match no peer, two
/// when it lists both exact and prefix paths (the sidecar ANDs its path
/// lists; the CRD ORs a rule's paths).
fn rule(
    r: &AuthorizationRule,
    name: &str,
    action: RbacAction,
    ports: &[u16],
    namespace: &str,
    trust_domain: &str,
) -> Vec<RbacRule> {
    let identities = match peers(r, namespace, trust_domain) {
        None => Vec::new(),
        Some(p) if p.is_empty() => return Vec::new(),
        Some(p) => p
            .into_iter()
            .map(|p| match p {
                Peer::Exact(id) => id,
                Peer::Namespace(ns) => format!("spiffe://{trust_domain}/ns/{ns}/*"),
            })
            .collect(),
    };
    let base = RbacRule {
        name: name.to_owned(),
        action,
        identities,
        authenticated: r.from.authenticated,
        cidrs: r
            .from
            .ip_blocks
            .iter()
            .filter_map(|c| parse_cidr(c).ok())
            .map(|(ip, len)| format!("{ip}/{len}"))
            .collect(),
        ports: ports.to_vec(),
        methods: r.to.methods.clone(),
        headers: r
            .to
            .headers
            .iter()
            .map(|h| RbacHeader {
                name: h.name.to_ascii_lowercase(),
                exact: h.exact.clone(),
                prefix: h.prefix.clone(),
            })
            .collect(),
        ..RbacRule::default()
    };
    let exact: Vec<String> = r.to.paths.iter().filter_map(|p| p.exact.clone()).collect();
    let prefixes: Vec<String> = r.to.paths.iter().filter_map(|p| p.prefix.clone()).collect();
    match (exact.is_empty(), prefixes.is_empty()) {
        (true, true) => vec![base],
        (false, true) => vec![RbacRule {
            paths: exact,
            ..base
        }],
        (true, false) => vec![RbacRule {
            path_prefixes: prefixes,
            ..base
        }],
        (false, false) => vec![
            RbacRule {
                paths: exact,
                ..base.clone()
            },
            RbacRule {
                path_prefixes: prefixes,
                ..base
            },
        ],
    }
}
