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
//! * one Route per Service port (`parentRef`) per namespace.
//!
//! Pure: the view of existing objects comes from the caches.

use std::{collections::BTreeMap, sync::Arc};

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
            Ok(p) => foreign_identities(&p, view.trust_domain),
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
