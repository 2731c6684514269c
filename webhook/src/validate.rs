//! `/validate`: admission of Baton's own objects.
//!
//! One [`Validate`] implementation per kind lives next to the type in
//! `baton-crds` (the per-object rules, the same ones the CRD schema encodes
//! as CEL for newer clusters); this module dispatches on the review's kind,
//! turns field errors into one denial message, and adds the rules that span
//! objects, which neither the schema nor CEL can express:
//!
//! * two TlsPolicies of a namespace that select a common pod must agree on
//!   mTLS mode, minimum version and offload mode (otherwise which one wins
//!   would be an accident of naming);
//! * one Route per Service port (`parentRef`) per namespace;
//! * an AuthorizationPolicy's port names must be declared by at least one
//!   of the Pods it selects, when it selects any yet.
//!
//! Pure: the view of existing objects comes from the caches.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use baton_crds::{
    AcceleratorPool, AuthorizationPolicy, Route, SidecarRelease, TlsPolicy,
    contract::GROUP,
    selector,
    validation::{Validate, summarize},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde::de::DeserializeOwned;

/// Existing objects the cross-object rules compare against.
#[derive(Clone, Copy, Debug, Default)]
pub struct ValidationView<'a> {
    pub tls_policies: &'a [Arc<TlsPolicy>],
    pub routes: &'a [Arc<Route>],
    /// The mesh's trust domain; empty: identities are not checked against
    /// one.
    pub trust_domain: &'a str,
    /// The Pods of the object's namespace (filled for AuthorizationPolicy
    /// reviews only: port names are checked against them).
    pub pods: &'a [PodPorts],
}

/// A Pod as port-name admission sees it: its name, labels and the names of
/// its application containers' ports (not the sidecar slots').
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodPorts {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub port_names: BTreeSet<String>,
}

impl PodPorts {
    pub fn of(pod: &k8s_openapi::api::core::v1::Pod) -> Self {
        use baton_crds::contract::containers::{SLOT_A, SLOT_B};
        Self {
            name: pod.metadata.name.clone().unwrap_or_default(),
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            port_names: pod
                .spec
                .iter()
                .flat_map(|s| s.containers.iter())
                .filter(|c| c.name != SLOT_A && c.name != SLOT_B)
                .flat_map(|c| c.ports.iter().flatten())
                .filter_map(|p| p.name.clone())
                .collect(),
        }
    }
}

/// The verdict on one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Allowed, with warnings shown by kubectl (possibly none).
    Allowed(Vec<String>),
    Denied(String),
}

/// Validates `object` (the review's object as JSON) of `group`/`kind`.
pub fn validate(
    group: &str,
    kind: &str,
    object: &serde_json::Value,
    view: &ValidationView<'_>,
) -> Verdict {
    if group != GROUP {
        return Verdict::Denied(format!(
            "the Baton validator only handles group {GROUP}, got {kind}.{group}: \
             check the ValidatingWebhookConfiguration rules"
        ));
    }
    match kind {
        "SidecarRelease" => per_object::<SidecarRelease>(kind, object)
            .map_or_else(Verdict::Denied, |_| Verdict::Allowed(vec![])),
        "AcceleratorPool" => per_object::<AcceleratorPool>(kind, object)
            .map_or_else(Verdict::Denied, |_| Verdict::Allowed(vec![])),
        "TlsPolicy" => match per_object::<TlsPolicy>(kind, object) {
            Ok(p) => tls_policy_conflicts(&p, view.tls_policies),
            Err(m) => Verdict::Denied(m),
        },
        "Route" => match per_object::<Route>(kind, object) {
            Ok(r) => route_conflicts(&r, view.routes),
            Err(m) => Verdict::Denied(m),
        },
        "AuthorizationPolicy" => match per_object::<AuthorizationPolicy>(kind, object) {
            Ok(p) => match foreign_identities(&p, view.trust_domain) {
                Verdict::Allowed(_) => port_names(&p, view.pods),
                denied => denied,
            },
            Err(m) => Verdict::Denied(m),
        },
        other => Verdict::Denied(format!(
            "the Baton validator does not know kind {other:?}: expected SidecarRelease, Route, TlsPolicy, AcceleratorPool or AuthorizationPolicy"
        )),
    }
}

/// An AuthorizationPolicy naming an identity of another trust domain
/// would never match a peer of this mesh: refused, with the domain to use.
fn foreign_identities(policy: &AuthorizationPolicy, trust_domain: &str) -> Verdict {
    if trust_domain.is_empty() {
        return Verdict::Allowed(vec![]);
    }
    match policy.foreign_identities(trust_domain).as_slice() {
        [] => Verdict::Allowed(vec![]),
        errors => Verdict::Denied(format!(
            "AuthorizationPolicy {} is invalid: {}",
            display_name(&policy.metadata),
            summarize(errors)
        )),
    }
}

/// Pods named in a warning before "and N more".
const SHOWN_PODS: usize = 3;

/// An AuthorizationPolicy's port names against the Pods it selects now. A
/// name none of them declares is refused, with the names they do declare
/// (a typo, or a port the workload does not have). A name only some
/// declare, or any name while no Pod matches yet, is allowed with a
/// warning: Pods come and go, and the operator reports a name a selected
/// Pod lacks on the policy's ResolvedRefs condition (UnknownPort).
fn port_names(policy: &AuthorizationPolicy, pods: &[PodPorts]) -> Verdict {
    let named: Vec<(usize, &str)> = policy
        .spec
        .ports
        .iter()
        .enumerate()
        .filter_map(|(i, p)| match p {
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(n) => {
                Some((i, n.as_str()))
            }
            _ => None,
        })
        .collect();
    if named.is_empty() {
        return Verdict::Allowed(vec![]);
    }
    let selected: Vec<&PodPorts> = pods
        .iter()
        .filter(|p| selector::matches(&policy.spec.pod_selector, &p.labels))
        .collect();
    let names = || {
        named
            .iter()
            .map(|(_, n)| format!("{n:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if selected.is_empty() {
        return Verdict::Allowed(vec![format!(
            "no Pod matches the podSelector yet, so port names {} are not checked now: each is resolved on the Pods that match, and the policy's ResolvedRefs condition reports a name a Pod does not declare (UnknownPort)",
            names()
        )]);
    }
    let declared: BTreeSet<&str> = selected
        .iter()
        .flat_map(|p| p.port_names.iter().map(String::as_str))
        .collect();
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    for (i, name) in &named {
        let lacking: Vec<&str> = selected
            .iter()
            .filter(|p| !p.port_names.contains(*name))
            .map(|p| p.name.as_str())
            .collect();
        if lacking.len() == selected.len() {
            errors.push(baton_crds::validation::FieldError::new(
                format!("spec.ports[{i}]"),
                format!(
                    "no Pod the policy selects ({} of them) declares a container port named {name:?}; they declare {}: name one of those or give the port's number",
                    selected.len(),
                    if declared.is_empty() {
                        "no named ports".to_owned()
                    } else {
                        declared.iter().copied().collect::<Vec<_>>().join(", ")
                    }
                ),
            ));
        } else if !lacking.is_empty() {
            let more = lacking.len().saturating_sub(SHOWN_PODS);
            warnings.push(format!(
                "Pods {}{} declare no container port named {name:?}: the policy does not apply to that port on them (ResolvedRefs: UnknownPort)",
                lacking[..lacking.len().min(SHOWN_PODS)].join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            ));
        }
    }
    if errors.is_empty() {
        Verdict::Allowed(warnings)
    } else {
        Verdict::Denied(format!(
            "AuthorizationPolicy {} is invalid: {}",
            display_name(&policy.metadata),
            summarize(&errors)
        ))
    }
}

fn display_name(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    let name = meta.name.as_deref().unwrap_or("<unnamed>");
    match &meta.namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_owned(),
    }
}

fn per_object<K>(kind: &str, object: &serde_json::Value) -> Result<K, String>
where
    K: DeserializeOwned + Validate + kube::Resource,
{
    let typed: K = serde_json::from_value(object.clone())
        .map_err(|e| format!("{kind} does not match its schema: {e}"))?;
    typed.validate().map_err(|errors| {
        format!(
            "{kind} {} is invalid: {}",
            display_name(typed.meta()),
            summarize(&errors)
        )
    })?;
    Ok(typed)
}

/// A label set that satisfies both selectors, if one is easy to build:
/// the union of their `matchLabels` plus, for each `In`/`Exists`
/// requirement, a value that satisfies it. Finding one proves the selectors
/// overlap; not finding one does not prove they are disjoint (complex
/// expressions), so this can miss conflicts but never invents one.
pub fn common_pod(a: &LabelSelector, b: &LabelSelector) -> Option<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    for sel in [a, b] {
        for (k, v) in sel.match_labels.iter().flatten() {
            match labels.get(k) {
                Some(existing) if existing != v => return None,
                _ => {
                    labels.insert(k.clone(), v.clone());
                }
            }
        }
    }
    for sel in [a, b] {
        for r in sel.match_expressions.iter().flatten() {
            if labels.contains_key(&r.key) {
                continue;
            }
            match r.operator.as_str() {
                "In" => {
                    if let Some(v) = r.values.iter().flatten().next() {
                        labels.insert(r.key.clone(), v.clone());
                    }
                }
                "Exists" => {
                    labels.insert(r.key.clone(), String::new());
                }
                _ => {}
            }
        }
    }
    (selector::matches(a, &labels) && selector::matches(b, &labels)).then_some(labels)
}

fn tls_policy_conflicts(new: &TlsPolicy, existing: &[Arc<TlsPolicy>]) -> Verdict {
    let ns = new.metadata.namespace.as_deref();
    let name = new.metadata.name.as_deref();
    let mut sorted: Vec<&TlsPolicy> = existing
        .iter()
        .map(AsRef::as_ref)
        .filter(|p| p.metadata.namespace.as_deref() == ns && p.metadata.name.as_deref() != name)
        .collect();
    sorted.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    for other in sorted {
        let Some(witness) = common_pod(&new.spec.pod_selector, &other.spec.pod_selector) else {
            continue;
        };
        let (a, b) = (&new.spec, &other.spec);
        let mut diffs = Vec::new();
        if a.mtls.mode != b.mtls.mode {
            diffs.push(format!("mtls.mode {:?} vs {:?}", a.mtls.mode, b.mtls.mode));
        }
        if a.min_version != b.min_version {
            diffs.push(format!(
                "minVersion {:?} vs {:?}",
                a.min_version, b.min_version
            ));
        }
        if a.private_key_offload.mode != b.private_key_offload.mode {
            diffs.push(format!(
                "privateKeyOffload.mode {} vs {}",
                a.private_key_offload.mode.as_str(),
                b.private_key_offload.mode.as_str()
            ));
        }
        if diffs.is_empty() {
            continue;
        }
        let example = if witness.is_empty() {
            "every pod".to_owned()
        } else {
            format!(
                "e.g. a pod labelled {}",
                witness
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            )
        };
        return Verdict::Denied(format!(
            "TlsPolicy {} selects the same pods as TlsPolicy {} ({example}) but conflicts with it: {}; \
             make the podSelectors disjoint or align the settings",
            display_name(&new.metadata),
            display_name(&other.metadata),
            diffs.join(", ")
        ));
    }
    Verdict::Allowed(vec![])
}

fn route_conflicts(new: &Route, existing: &[Arc<Route>]) -> Verdict {
    let ns = new.metadata.namespace.as_deref();
    let name = new.metadata.name.as_deref();
    let parent = &new.spec.parent_ref;
    let clash = existing
        .iter()
        .map(AsRef::as_ref)
        .filter(|r| r.metadata.namespace.as_deref() == ns && r.metadata.name.as_deref() != name)
        .filter(|r| r.spec.parent_ref.name == parent.name && r.spec.parent_ref.port == parent.port)
        .min_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    match clash {
        Some(other) => Verdict::Denied(format!(
            "Route {} targets Service port {}:{}, which Route {} already routes: \
             put the rules into that Route (one Route per Service port)",
            display_name(&new.metadata),
            parent.name,
            parent.port,
            display_name(&other.metadata)
        )),
        None => Verdict::Allowed(vec![]),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn tls(name: &str, selector: serde_json::Value, mtls: &str) -> serde_json::Value {
        json!({"apiVersion": "baton.dev/v1alpha1", "kind": "TlsPolicy",
               "metadata": {"name": name, "namespace": "apps"},
               "spec": {"podSelector": selector, "mtls": {"mode": mtls}}})
    }

    fn route(name: &str, service: &str, port: i32, weights: &[i32]) -> serde_json::Value {
        let backends: Vec<_> = weights
            .iter()
            .map(|w| json!({"name": "web-v1", "port": 80, "weight": w}))
            .collect();
        json!({"apiVersion": "baton.dev/v1alpha1", "kind": "Route",
               "metadata": {"name": name, "namespace": "apps"},
               "spec": {"parentRef": {"name": service, "port": port}, "rules": [{"backendRefs": backends}]}})
    }

    fn arc<K: DeserializeOwned>(v: serde_json::Value) -> Arc<K> {
        Arc::new(serde_json::from_value(v).unwrap())
    }

    #[test]
    fn an_authorization_policy_naming_another_trust_domain_is_refused_with_the_mesh_s() {
        let policy = |id: &str| {
            json!({"apiVersion": "baton.dev/v1alpha1", "kind": "AuthorizationPolicy",
                   "metadata": {"name": "p", "namespace": "apps"},
                   "spec": {"rules": [{"from": {"identities": [id]}}]}})
        };
        let view = ValidationView {
            trust_domain: "mesh.example",
            ..ValidationView::default()
        };
        let m = denied(validate(
            GROUP,
            "AuthorizationPolicy",
            &policy("spiffe://cluster.local/ns/apps/sa/web"),
            &view,
        ));
        assert!(
            m.starts_with(
                "AuthorizationPolicy apps/p is invalid: spec.rules[0].from.identities[0]"
            ),
            "{m}"
        );
        assert!(m.contains("not this mesh's \"mesh.example\""), "{m}");
        assert_eq!(
            validate(
                GROUP,
                "AuthorizationPolicy",
                &policy("spiffe://mesh.example/ns/apps/sa/web"),
                &view
            ),
            Verdict::Allowed(vec![])
        );
        // A malformed identity is refused whatever the trust domain.
        let m = denied(validate(
            GROUP,
            "AuthorizationPolicy",
            &policy("apps/web"),
            &view,
        ));
        assert!(m.contains("is not a SPIFFE ID"), "{m}");
    }

    fn pod(name: &str, app: &str, ports: &[&str]) -> PodPorts {
        PodPorts {
            name: name.into(),
            labels: [("app".to_owned(), app.to_owned())].into(),
            port_names: ports.iter().map(|p| (*p).to_owned()).collect(),
        }
    }

    fn named(ports: serde_json::Value) -> serde_json::Value {
        json!({"apiVersion": "baton.dev/v1alpha1", "kind": "AuthorizationPolicy",
               "metadata": {"name": "p", "namespace": "apps"},
               "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "ports": ports}})
    }

    #[test]
    fn a_port_name_no_selected_pod_declares_is_refused_listing_the_names_they_do() {
        let pods = [
            pod("web-1", "web", &["http", "metrics"]),
            pod("web-2", "web", &["http"]),
            pod("db-1", "db", &["grpc"]),
        ];
        let view = ValidationView {
            pods: &pods,
            ..ValidationView::default()
        };
        let m = denied(validate(
            GROUP,
            "AuthorizationPolicy",
            &named(json!([8080, "grpc", "htp"])),
            &view,
        ));
        assert_eq!(
            m,
            "AuthorizationPolicy apps/p is invalid: \
             spec.ports[1]: no Pod the policy selects (2 of them) declares a container port named \"grpc\"; they declare http, metrics: name one of those or give the port's number; \
             spec.ports[2]: no Pod the policy selects (2 of them) declares a container port named \"htp\"; they declare http, metrics: name one of those or give the port's number"
        );
        assert_eq!(
            validate(
                GROUP,
                "AuthorizationPolicy",
                &named(json!(["http", 9090])),
                &view
            ),
            Verdict::Allowed(vec![])
        );
    }

    #[test]
    fn a_port_name_only_some_selected_pods_declare_is_allowed_with_a_warning_naming_the_rest() {
        let pods = [
            pod("web-1", "web", &["http", "metrics"]),
            pod("web-2", "web", &["http"]),
        ];
        let view = ValidationView {
            pods: &pods,
            ..ValidationView::default()
        };
        match validate(
            GROUP,
            "AuthorizationPolicy",
            &named(json!(["metrics"])),
            &view,
        ) {
            Verdict::Allowed(w) => {
                assert_eq!(w.len(), 1, "{w:?}");
                assert!(
                    w[0].starts_with("Pods web-2 declare no container port named \"metrics\""),
                    "{w:?}"
                );
                assert!(w[0].contains("UnknownPort"), "{w:?}");
            }
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn port_names_are_allowed_with_a_warning_while_no_pod_matches_yet() {
        let pods = [pod("db-1", "db", &["grpc"])];
        let view = ValidationView {
            pods: &pods,
            ..ValidationView::default()
        };
        match validate(GROUP, "AuthorizationPolicy", &named(json!(["http"])), &view) {
            Verdict::Allowed(w) => {
                assert_eq!(w.len(), 1, "{w:?}");
                assert!(w[0].starts_with("no Pod matches the podSelector yet, so port names \"http\" are not checked now"), "{w:?}");
            }
            v => panic!("{v:?}"),
        }
        // Numbers only: nothing to resolve, no warning.
        assert_eq!(
            validate(GROUP, "AuthorizationPolicy", &named(json!([80])), &view),
            Verdict::Allowed(vec![])
        );
    }

    #[test]
    fn a_malformed_port_name_is_refused_with_what_a_name_is_whatever_the_pods() {
        let m = denied(validate(
            GROUP,
            "AuthorizationPolicy",
            &named(json!(["HTTP", 0])),
            &ValidationView::default(),
        ));
        assert!(
            m.starts_with("AuthorizationPolicy apps/p is invalid: spec.ports[0]: \"HTTP\" is not a port name: a name (IANA_SVC_NAME) is 1 to 15 lowercase letters"),
            "{m}"
        );
        assert!(m.contains("spec.ports[1]: port 0 is out of range"), "{m}");
    }

    fn denied(v: Verdict) -> String {
        match v {
            Verdict::Denied(m) => m,
            Verdict::Allowed(_) => panic!("expected a denial"),
        }
    }

    #[test]
    fn a_valid_route_is_allowed() {
        let v = validate(
            GROUP,
            "Route",
            &route("r", "web", 80, &[1, 3]),
            &ValidationView::default(),
        );
        assert_eq!(v, Verdict::Allowed(vec![]));
    }

    #[test]
    fn a_route_whose_weights_are_all_zero_is_refused_with_the_field() {
        let m = denied(validate(
            GROUP,
            "Route",
            &route("r", "web", 80, &[0, 0]),
            &ValidationView::default(),
        ));
        assert!(
            m.starts_with("Route apps/r is invalid: spec.rules[0]"),
            "{m}"
        );
    }

    #[test]
    fn a_second_route_for_the_same_service_port_is_refused() {
        let routes = vec![arc::<Route>(route("first", "web", 80, &[1]))];
        let view = ValidationView {
            routes: &routes,
            ..ValidationView::default()
        };
        let m = denied(validate(
            GROUP,
            "Route",
            &route("second", "web", 80, &[1]),
            &view,
        ));
        assert!(m.contains("which Route apps/first already routes"), "{m}");
        // Another port, or an update of the same Route, is fine.
        assert!(matches!(
            validate(GROUP, "Route", &route("second", "web", 81, &[1]), &view),
            Verdict::Allowed(_)
        ));
        assert!(matches!(
            validate(GROUP, "Route", &route("first", "web", 80, &[2]), &view),
            Verdict::Allowed(_)
        ));
    }

    #[test]
    fn an_object_that_does_not_match_the_schema_is_refused_with_the_parse_error() {
        let mut r = route("r", "web", 80, &[1]);
        r["spec"]["protocol"] = json!("smtp");
        let m = denied(validate(GROUP, "Route", &r, &ValidationView::default()));
        assert!(
            m.contains("Route does not match its schema") && m.contains("smtp"),
            "{m}"
        );
    }

    #[test]
    fn an_invalid_tls_policy_is_refused_with_every_problem() {
        let mut p = tls("p", json!({}), "Strict");
        p["spec"]["cipherSuites"] = json!(["TLS_FAKE"]);
        p["spec"]["certificate"] = json!({"source": "Secret"});
        let m = denied(validate(GROUP, "TlsPolicy", &p, &ValidationView::default()));
        assert!(
            m.contains("spec.cipherSuites[0]") && m.contains("spec.certificate.secretRef"),
            "{m}"
        );
    }

    #[test]
    fn overlapping_tls_policies_with_conflicting_modes_are_refused() {
        let existing = vec![arc::<TlsPolicy>(tls(
            "strict",
            json!({"matchLabels": {"app": "web"}}),
            "Strict",
        ))];
        let view = ValidationView {
            tls_policies: &existing,
            ..ValidationView::default()
        };
        let m = denied(validate(
            GROUP,
            "TlsPolicy",
            &tls("loose", json!({}), "Permissive"),
            &view,
        ));
        assert!(
            m.contains("TlsPolicy apps/strict") && m.contains("app=web") && m.contains("mtls.mode"),
            "{m}"
        );
        // Disjoint selectors, identical settings, or updating itself: allowed.
        for (name, sel, mode) in [
            ("other", json!({"matchLabels": {"app": "db"}}), "Permissive"),
            ("same", json!({}), "Strict"),
            (
                "strict",
                json!({"matchLabels": {"app": "web"}}),
                "Permissive",
            ),
        ] {
            assert!(
                matches!(
                    validate(GROUP, "TlsPolicy", &tls(name, sel, mode), &view),
                    Verdict::Allowed(_)
                ),
                "{name}"
            );
        }
    }

    #[test]
    fn policies_in_other_namespaces_never_conflict() {
        let mut other = tls("strict", json!({}), "Strict");
        other["metadata"]["namespace"] = json!("elsewhere");
        let existing = vec![arc::<TlsPolicy>(other)];
        let view = ValidationView {
            tls_policies: &existing,
            ..ValidationView::default()
        };
        assert!(matches!(
            validate(GROUP, "TlsPolicy", &tls("p", json!({}), "Disabled"), &view),
            Verdict::Allowed(_)
        ));
    }

    #[test]
    fn the_overlap_witness_uses_in_and_exists_requirements() {
        let a: LabelSelector = serde_json::from_value(json!({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["fe", "be"]}]})).unwrap();
        let b: LabelSelector = serde_json::from_value(json!({"matchLabels": {"app": "web"}, "matchExpressions": [{"key": "canary", "operator": "Exists"}]})).unwrap();
        let w = common_pod(&a, &b).unwrap();
        assert_eq!(w.get("tier").map(String::as_str), Some("fe"));
        assert!(w.contains_key("canary"));
        let c: LabelSelector =
            serde_json::from_value(json!({"matchLabels": {"app": "db"}})).unwrap();
        assert!(common_pod(&b, &c).is_none());
        let d: LabelSelector = serde_json::from_value(
            json!({"matchExpressions": [{"key": "canary", "operator": "DoesNotExist"}]}),
        )
        .unwrap();
        assert!(common_pod(&b, &d).is_none());
    }

    #[test]
    fn an_invalid_sidecar_release_is_refused() {
        let r = json!({"apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease", "metadata": {"name": "r"},
                       "spec": {"version": "-bad", "image": "i", "upgrade": {"strategy": "HotUpgrade"}}});
        let m = denied(validate(
            GROUP,
            "SidecarRelease",
            &r,
            &ValidationView::default(),
        ));
        assert!(
            m.contains("spec.version") && m.contains("spec.emptyImage"),
            "{m}"
        );
    }

    #[test]
    fn an_invalid_accelerator_pool_is_refused() {
        let p = json!({"apiVersion": "baton.dev/v1alpha1", "kind": "AcceleratorPool", "metadata": {"name": "p"},
                       "spec": {"resourceName": "qat", "devicesPerSidecar": 1}});
        let m = denied(validate(
            GROUP,
            "AcceleratorPool",
            &p,
            &ValidationView::default(),
        ));
        assert!(m.contains("spec.resourceName"), "{m}");
    }

    #[test]
    fn unknown_kinds_and_groups_are_refused_with_a_hint() {
        let m = denied(validate(
            GROUP,
            "Gateway",
            &json!({}),
            &ValidationView::default(),
        ));
        assert!(m.contains("does not know kind \"Gateway\""), "{m}");
        let m = denied(validate(
            "apps",
            "Deployment",
            &json!({}),
            &ValidationView::default(),
        ));
        assert!(
            m.contains("check the ValidatingWebhookConfiguration"),
            "{m}"
        );
    }
}
