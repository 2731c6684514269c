//! The install set in `manifests/` and the samples in `manifests/examples/`,
//! checked against the code: names and ports from `contract`, webhook
//! selectors evaluated with the same matcher the webhook uses, RBAC scoped
//! to the objects the code touches, hardened pods, and examples that both
//! enforcers accept.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use baton_crds::contract::{self, labels, webhook as names};
use baton_crds::selector;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::rbac::v1::{ClusterRole, PolicyRule, Role};
use serde_json::Value;
use support::{cel_errors, rust_errors};

fn manifests() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests")
}

fn read_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    baton_crds::yaml::documents(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every document of the install set, in kustomization order.
fn install_set() -> Vec<Value> {
    let k = &read_docs(&manifests().join("kustomization.yaml"))[0];
    k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| read_docs(&manifests().join(r.as_str().unwrap())))
        .collect()
}

fn find<T: serde::de::DeserializeOwned>(kind: &str, name: &str) -> T {
    let doc = install_set()
        .into_iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("install set has no {kind} {name}"));
    serde_json::from_value(doc).unwrap()
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml") {
            out.push(p);
        }
    }
}

#[test]
fn every_example_is_accepted_by_the_webhook_rules_and_the_cel_rules() {
    let mut files = vec![];
    yaml_files(&manifests().join("examples"), &mut files);
    let mut kinds_seen = std::collections::BTreeSet::new();
    for f in files {
        for doc in read_docs(&f) {
            let kind = doc["kind"].as_str().unwrap().to_owned();
            assert_eq!(doc["apiVersion"], "baton.dev/v1alpha1", "{}", f.display());
            assert_eq!(
                rust_errors(&kind, &doc),
                Vec::<String>::new(),
                "{}",
                f.display()
            );
            assert_eq!(
                cel_errors(&kind, &doc),
                Vec::<String>::new(),
                "{}",
                f.display()
            );
            kinds_seen.insert(kind);
        }
    }
    let all: std::collections::BTreeSet<String> = baton_crds::objects::KINDS
        .iter()
        .map(|k| k.to_string())
        .collect();
    assert_eq!(kinds_seen, all, "every kind needs an example");
}

#[test]
fn kustomization_lists_every_manifest_and_only_existing_ones() {
    let k = &read_docs(&manifests().join("kustomization.yaml"))[0];
    let listed: Vec<PathBuf> = k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| manifests().join(r.as_str().unwrap()))
        .collect();
    for p in &listed {
        assert!(p.is_file(), "{} is listed but missing", p.display());
    }
    let mut files = vec![];
    yaml_files(&manifests(), &mut files);
    for f in files {
        let rel = f.strip_prefix(manifests()).unwrap();
        let skip = rel.starts_with("examples")
            || rel.starts_with("components")
            || rel == Path::new("kustomization.yaml");
        if !skip {
            assert!(
                listed.contains(&f),
                "{} is not in kustomization.yaml",
                rel.display()
            );
        }
    }
}

#[test]
fn every_namespaced_object_lives_in_baton_system() {
    for d in install_set() {
        let kind = d["kind"].as_str().unwrap();
        let cluster_scoped = matches!(
            kind,
            "Namespace"
                | "CustomResourceDefinition"
                | "ClusterRole"
                | "ClusterRoleBinding"
                | "MutatingWebhookConfiguration"
                | "ValidatingWebhookConfiguration"
        );
        if !cluster_scoped {
            assert_eq!(
                d["metadata"]["namespace"],
                contract::SYSTEM_NAMESPACE,
                "{kind} {}",
                d["metadata"]["name"]
            );
        }
    }
}

fn mutating() -> MutatingWebhookConfiguration {
    find(
        "MutatingWebhookConfiguration",
        names::MUTATING_CONFIGURATION,
    )
}

#[test]
fn injector_entries_call_the_webhook_service_as_the_contract_says() {
    let cfg = mutating();
    let hooks = cfg.webhooks.unwrap();
    let got: Vec<&str> = hooks.iter().map(|h| h.name.as_str()).collect();
    assert_eq!(
        got,
        [names::MUTATING_WEBHOOK, names::MUTATING_WEBHOOK_POD_OPT_IN]
    );
    for h in &hooks {
        let svc = h.client_config.service.as_ref().unwrap();
        assert_eq!(svc.name, names::SERVICE);
        assert_eq!(svc.namespace, contract::SYSTEM_NAMESPACE);
        assert_eq!(svc.path.as_deref(), Some(names::MUTATE_PODS_PATH));
        assert_eq!(svc.port, Some(i32::from(names::PORT)));
        assert_eq!(h.side_effects, "None");
        assert!(
            h.timeout_seconds.is_some_and(|t| t <= 5),
            "{}: timeout",
            h.name
        );
        assert_eq!(h.failure_policy.as_deref(), Some("Fail"));
        assert_eq!(h.reinvocation_policy.as_deref(), Some("IfNeeded"));
        assert_eq!(h.admission_review_versions, ["v1"]);
        let rules = h.rules.as_ref().unwrap();
        assert_eq!(rules.len(), 1);
        assert_eq!(
            rules[0].resources.as_deref(),
            Some(&["pods".to_string()][..])
        );
        assert_eq!(
            rules[0].operations.as_deref(),
            Some(&["CREATE".to_string()][..])
        );
    }
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Which injector entries the API server would call for a pod.
fn entries_called(ns: &str, ns_inject: Option<&str>, pod_inject: Option<&str>) -> Vec<String> {
    let mut ns_labels = map(&[("kubernetes.io/metadata.name", ns)]);
    if let Some(v) = ns_inject {
        ns_labels.insert(labels::INJECT.into(), v.into());
    }
    let mut pod_labels = map(&[("app", "x")]);
    if let Some(v) = pod_inject {
        pod_labels.insert(labels::INJECT.into(), v.into());
    }
    mutating()
        .webhooks
        .unwrap()
        .into_iter()
        .filter(|h| {
            selector::matches_opt(h.namespace_selector.as_ref(), &ns_labels)
                && selector::matches_opt(h.object_selector.as_ref(), &pod_labels)
        })
        .map(|h| h.name)
        .collect()
}

#[test]
fn opted_in_namespaces_inject_every_pod_except_opted_out_ones() {
    assert_eq!(
        entries_called("shop", Some("enabled"), None),
        [names::MUTATING_WEBHOOK]
    );
    assert_eq!(
        entries_called("shop", Some("enabled"), Some("enabled")),
        [names::MUTATING_WEBHOOK]
    );
    assert!(entries_called("shop", Some("enabled"), Some("disabled")).is_empty());
}

#[test]
fn pods_opt_in_by_label_in_namespaces_that_did_not_opt_in() {
    assert_eq!(
        entries_called("shop", None, Some("enabled")),
        [names::MUTATING_WEBHOOK_POD_OPT_IN]
    );
    assert!(entries_called("shop", None, None).is_empty());
    assert!(entries_called("shop", None, Some("disabled")).is_empty());
}

#[test]
fn namespaces_that_opted_out_are_never_injected() {
    for pod in [None, Some("enabled"), Some("disabled")] {
        assert!(
            entries_called("shop", Some("disabled"), pod).is_empty(),
            "pod label {pod:?}"
        );
    }
}

#[test]
fn system_namespaces_are_never_injected_whatever_their_labels() {
    for ns in contract::NEVER_INJECT_NAMESPACES {
        for ns_inject in [None, Some("enabled")] {
            for pod in [None, Some("enabled")] {
                assert!(
                    entries_called(ns, ns_inject, pod).is_empty(),
                    "{ns} {ns_inject:?} {pod:?}"
                );
            }
        }
    }
}

#[test]
fn no_pod_is_sent_to_both_injector_entries() {
    for ns_inject in [None, Some("enabled"), Some("disabled"), Some("other")] {
        for pod in [None, Some("enabled"), Some("disabled"), Some("other")] {
            assert!(
                entries_called("shop", ns_inject, pod).len() <= 1,
                "{ns_inject:?} {pod:?}"
            );
        }
    }
}

#[test]
fn the_validator_covers_every_baton_kind_but_not_status() {
    let cfg: ValidatingWebhookConfiguration = find(
        "ValidatingWebhookConfiguration",
        names::VALIDATING_CONFIGURATION,
    );
    let hooks = cfg.webhooks.unwrap();
    assert_eq!(hooks.len(), 1);
    let h = &hooks[0];
    assert_eq!(h.name, names::VALIDATING_WEBHOOK);
    let svc = h.client_config.service.as_ref().unwrap();
    assert_eq!(
        (svc.name.as_str(), svc.path.as_deref(), svc.port),
        (
            names::SERVICE,
            Some(names::VALIDATE_PATH),
            Some(i32::from(names::PORT))
        )
    );
    assert_eq!(h.side_effects, "None");
    assert_eq!(h.failure_policy.as_deref(), Some("Fail"));
    let rule = &h.rules.as_ref().unwrap()[0];
    assert_eq!(
        rule.api_groups.as_deref(),
        Some(&[contract::GROUP.to_string()][..])
    );
    let mut got = rule.resources.clone().unwrap();
    got.sort();
    let mut want: Vec<String> = baton_crds::schema::crds()
        .into_iter()
        .map(|c| c.spec.names.plural)
        .collect();
    want.sort();
    assert_eq!(got, want);
}

fn rules_of(kind: &str, name: &str) -> Vec<PolicyRule> {
    match kind {
        "ClusterRole" => find::<ClusterRole>(kind, name).rules.unwrap(),
        _ => find::<Role>(kind, name).rules.unwrap(),
    }
}

fn grants(
    rules: &[PolicyRule],
    group: &str,
    resource: &str,
    verb: &str,
) -> Vec<Option<Vec<String>>> {
    rules
        .iter()
        .filter(|r| {
            r.api_groups
                .as_ref()
                .is_some_and(|g| g.iter().any(|g| g == group))
                && r.resources
                    .as_ref()
                    .is_some_and(|rs| rs.iter().any(|x| x == resource))
                && r.verbs.iter().any(|v| v == verb)
        })
        .map(|r| r.resource_names.clone())
        .collect()
}

#[test]
fn no_role_uses_wildcards_or_reads_secrets_cluster_wide() {
    for (kind, name) in [
        ("ClusterRole", "baton-operator"),
        ("ClusterRole", "baton-webhook"),
        ("Role", "baton-operator-leader-election"),
        ("Role", "baton-webhook-ca"),
        ("Role", "baton-operator-identity-ca"),
        ("Role", "baton-operator-configmaps"),
        ("Role", "baton-webhook-trust-bundle"),
    ] {
        for r in rules_of(kind, name) {
            let all = r
                .verbs
                .iter()
                .chain(r.resources.iter().flatten())
                .chain(r.api_groups.iter().flatten());
            for s in all {
                assert_ne!(s, "*", "{kind} {name} uses a wildcard");
            }
            if kind == "ClusterRole" {
                assert!(
                    !r.resources.iter().flatten().any(|x| x == "secrets"),
                    "{name} reaches secrets cluster-wide"
                );
            }
        }
    }
}

#[test]
fn the_webhook_may_touch_only_its_own_configurations_and_ca_secret() {
    let cr = rules_of("ClusterRole", "baton-webhook");
    let own = |n: &str| vec![Some(vec![n.to_string()])];
    let admission = "admissionregistration.k8s.io";
    assert_eq!(
        grants(&cr, admission, "mutatingwebhookconfigurations", "update"),
        own(names::MUTATING_CONFIGURATION)
    );
    assert_eq!(
        grants(&cr, admission, "validatingwebhookconfigurations", "update"),
        own(names::VALIDATING_CONFIGURATION)
    );
    assert_eq!(
        grants(&cr, admission, "mutatingwebhookconfigurations", "get"),
        own(names::MUTATING_CONFIGURATION)
    );
    let role = rules_of("Role", "baton-webhook-ca");
    assert_eq!(grants(&role, "", "secrets", "get"), own(names::CA_SECRET));
    assert_eq!(
        grants(&role, "", "secrets", "update"),
        own(names::CA_SECRET)
    );
    assert_eq!(grants(&role, "", "secrets", "create").len(), 1);
    for r in [
        "sidecarreleases",
        "tlspolicies",
        "acceleratorpools",
        "routes",
    ] {
        assert_eq!(grants(&cr, contract::GROUP, r, "watch").len(), 1, "{r}");
        assert!(grants(&cr, contract::GROUP, r, "update").is_empty(), "{r}");
    }
    for r in ["namespaces", "nodes", "pods"] {
        assert_eq!(grants(&cr, "", r, "list").len(), 1, "{r}");
    }
    // Reads Pods (port names); never changes one.
    for verb in ["create", "update", "patch", "delete"] {
        assert!(grants(&cr, "", "pods", verb).is_empty(), "{verb}");
    }
}

#[test]
fn the_operator_writes_status_and_pods_but_never_specs_of_baton_objects() {
    let cr = rules_of("ClusterRole", "baton-operator");
    for r in [
        "sidecarreleases",
        "routes",
        "tlspolicies",
        "acceleratorpools",
        "authorizationpolicies",
    ] {
        assert_eq!(grants(&cr, contract::GROUP, r, "watch").len(), 1, "{r}");
        assert!(
            grants(&cr, contract::GROUP, r, "patch").is_empty(),
            "{r} spec is the user's"
        );
        assert_eq!(
            grants(&cr, contract::GROUP, &format!("{r}/status"), "patch").len(),
            1,
            "{r}/status"
        );
    }
    assert_eq!(grants(&cr, "", "pods", "patch").len(), 1);
    assert_eq!(grants(&cr, "", "events", "create").len(), 1);
    // The rollout evicts pods it cannot upgrade in place (the Eviction API
    // honours PodDisruptionBudgets; a plain delete would not) and reads a
    // node's kubelet version (native sidecars); the AcceleratorPool books
    // watch every Node (labels, allocatable): no more than that.
    assert_eq!(grants(&cr, "", "pods/eviction", "create").len(), 1);
    assert_eq!(grants(&cr, "", "pods", "delete").len(), 0);
    for verb in ["get", "list", "watch"] {
        assert_eq!(grants(&cr, "", "nodes", verb).len(), 1, "nodes {verb}");
    }
    for verb in ["patch", "update"] {
        assert!(grants(&cr, "", "nodes", verb).is_empty(), "nodes {verb}");
    }
    for (group, r) in [("", "secrets"), ("apps", "deployments")] {
        assert!(
            grants(&cr, group, r, "get").is_empty() && grants(&cr, group, r, "create").is_empty(),
            "{r}"
        );
    }
    let lease = rules_of("Role", "baton-operator-leader-election");
    assert_eq!(
        grants(&lease, "coordination.k8s.io", "leases", "update"),
        vec![Some(vec!["baton-operator".to_string()])]
    );
}

#[test]
fn the_operator_reviews_tokens_and_reads_only_its_own_identity_ca_secret() {
    let cr = rules_of("ClusterRole", "baton-operator");
    assert_eq!(
        grants(&cr, "authentication.k8s.io", "tokenreviews", "create"),
        vec![None]
    );
    let role = rules_of("Role", "baton-operator-identity-ca");
    assert_eq!(
        grants(&role, "", "secrets", "get"),
        vec![Some(vec![contract::identity::CA_SECRET.to_string()])]
    );
    assert_eq!(grants(&role, "", "secrets", "create").len(), 1);
    for verb in ["update", "patch", "list", "watch", "delete"] {
        assert!(grants(&role, "", "secrets", verb).is_empty(), "{verb}");
    }
}

const CONFIGMAP_VERBS: [&str; 8] = [
    "get",
    "list",
    "watch",
    "create",
    "patch",
    "update",
    "delete",
    "deletecollection",
];

/// Decision 0058: the trust bundle is copied into each Pod by the webhook,
/// so no account needs ConfigMaps outside baton-system.
#[test]
fn no_cluster_role_grants_any_configmap_verb() {
    let cluster_roles: Vec<ClusterRole> = install_set()
        .into_iter()
        .filter(|d| d["kind"] == "ClusterRole")
        .map(|d| serde_json::from_value(d).unwrap())
        .collect();
    assert!(cluster_roles.len() >= 2, "the operator's and the webhook's");
    for cr in &cluster_roles {
        let rules = cr.rules.clone().unwrap_or_default();
        for verb in CONFIGMAP_VERBS {
            assert!(
                grants(&rules, "", "configmaps", verb).is_empty(),
                "ClusterRole {:?} grants {verb} on configmaps",
                cr.metadata.name
            );
        }
    }
}

#[test]
fn the_webhook_reads_the_trust_bundle_configmap_by_name_only() {
    let role = rules_of("Role", "baton-webhook-trust-bundle");
    let by_name = vec![Some(vec![contract::identity::TRUST_CONFIG_MAP.to_string()])];
    for verb in ["get", "list", "watch"] {
        assert_eq!(grants(&role, "", "configmaps", verb), by_name, "{verb}");
    }
    for verb in ["create", "patch", "update", "delete"] {
        assert!(grants(&role, "", "configmaps", verb).is_empty(), "{verb}");
    }
}

#[test]
fn the_leader_lists_push_tallies_in_its_own_namespace_only() {
    let role = rules_of("Role", "baton-operator-configmaps");
    assert_eq!(grants(&role, "", "configmaps", "list"), vec![None]);
    // Push tallies and the trust bundle, by server-side apply.
    for verb in ["create", "patch"] {
        assert_eq!(grants(&role, "", "configmaps", verb), vec![None], "{verb}");
    }
    for verb in ["get", "watch", "delete", "update"] {
        assert!(grants(&role, "", "configmaps", verb).is_empty(), "{verb}");
    }
    let env: Vec<String> = deployment("baton-operator")
        .spec
        .unwrap()
        .template
        .spec
        .unwrap()
        .containers[0]
        .env
        .iter()
        .flatten()
        .map(|e| e.name.clone())
        .collect();
    assert!(env.iter().any(|e| e == "BATON_POD_UID"), "{env:?}");
}

fn deployment(name: &str) -> Deployment {
    find("Deployment", name)
}

#[test]
fn both_deployments_run_two_hardened_replicas_with_probes_and_limits() {
    for (name, image) in [
        ("baton-operator", "docker.io/baton/operator:0.1.0"),
        ("baton-webhook", "docker.io/baton/webhook:0.1.0"),
    ] {
        let d = deployment(name);
        let spec = d.spec.unwrap();
        assert_eq!(spec.replicas, Some(2), "{name}");
        let pod = spec.template.spec.unwrap();
        assert_eq!(pod.service_account_name.as_deref(), Some(name));
        let psc = pod.security_context.unwrap();
        assert_eq!(psc.run_as_non_root, Some(true), "{name}");
        assert!(psc.run_as_user.is_some_and(|u| u != 0), "{name}");
        for c in pod.containers {
            assert_eq!(c.image.as_deref(), Some(image));
            assert_eq!(c.image_pull_policy.as_deref(), Some("IfNotPresent"));
            let sc = c.security_context.unwrap();
            assert_eq!(sc.read_only_root_filesystem, Some(true), "{name}");
            assert_eq!(sc.allow_privilege_escalation, Some(false), "{name}");
            assert_eq!(
                sc.capabilities.unwrap().drop,
                Some(vec!["ALL".to_string()]),
                "{name}"
            );
            let res = c.resources.unwrap();
            assert!(
                res.requests
                    .is_some_and(|r| r.contains_key("cpu") && r.contains_key("memory")),
                "{name}"
            );
            assert!(
                res.limits.is_some_and(|l| l.contains_key("memory")),
                "{name}"
            );
            let ready = c.readiness_probe.unwrap().http_get.unwrap();
            let live = c.liveness_probe.unwrap().http_get.unwrap();
            assert_eq!(ready.path.as_deref(), Some(contract::commands::READY_PATH));
            assert_eq!(live.path.as_deref(), Some(contract::commands::LIVE_PATH));
        }
    }
}

#[test]
fn webhook_ports_and_service_match_the_contract() {
    let pod = deployment("baton-webhook")
        .spec
        .unwrap()
        .template
        .spec
        .unwrap();
    let ports: BTreeMap<String, i32> = pod.containers[0]
        .ports
        .iter()
        .flatten()
        .map(|p| (p.name.clone().unwrap(), p.container_port))
        .collect();
    assert_eq!(ports["https"], i32::from(names::PORT));
    assert_eq!(ports["admin"], i32::from(names::ADMIN_PORT));
    let svc: Service = find("Service", names::SERVICE);
    let https = svc
        .spec
        .unwrap()
        .ports
        .unwrap()
        .into_iter()
        .find(|p| p.name.as_deref() == Some("https"))
        .unwrap();
    assert_eq!(https.port, i32::from(names::PORT));
}

#[test]
fn services_and_the_pdb_select_their_deployments_pods() {
    for name in ["baton-operator", "baton-webhook"] {
        let tpl_labels = deployment(name)
            .spec
            .unwrap()
            .template
            .metadata
            .unwrap()
            .labels
            .unwrap();
        let svc: Service = find("Service", name);
        let sel = svc.spec.unwrap().selector.unwrap();
        assert!(
            sel.iter().all(|(k, v)| tpl_labels.get(k) == Some(v)),
            "{name} Service"
        );
    }
    // Each Deployment has a PodDisruptionBudget that keeps one replica.
    for name in ["baton-operator", "baton-webhook"] {
        let pdb = install_set()
            .into_iter()
            .find(|d| d["kind"] == "PodDisruptionBudget" && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{name} PodDisruptionBudget"));
        assert_eq!(pdb["spec"]["minAvailable"], 1);
        let sel: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector =
            serde_json::from_value(pdb["spec"]["selector"].clone()).unwrap();
        let tpl_labels = deployment(name)
            .spec
            .unwrap()
            .template
            .metadata
            .unwrap()
            .labels
            .unwrap();
        assert!(selector::matches(&sel, &tpl_labels), "{name}");
    }
}

#[test]
fn both_deployments_spread_over_nodes_and_keep_a_replica_through_rollouts() {
    for name in ["baton-operator", "baton-webhook"] {
        let spec = deployment(name).spec.unwrap();
        let rolling = spec.strategy.unwrap().rolling_update.unwrap();
        assert_eq!(
            rolling.max_unavailable,
            Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(0)),
            "{name}"
        );
        let pod = spec.template.spec.unwrap();
        let keys: Vec<String> = pod
            .topology_spread_constraints
            .unwrap_or_default()
            .into_iter()
            .map(|c| c.topology_key)
            .collect();
        assert!(
            keys.contains(&"kubernetes.io/hostname".to_owned()),
            "{name}: {keys:?}"
        );
        let psc = pod.security_context.unwrap();
        assert_eq!(
            psc.seccomp_profile.map(|p| p.type_).as_deref(),
            Some("RuntimeDefault"),
            "{name}"
        );
        assert!(
            pod.termination_grace_period_seconds
                .is_some_and(|s| s >= 30),
            "{name}"
        );
    }
}

#[test]
fn the_system_namespace_is_labelled_so_the_injector_skips_it() {
    let ns = install_set()
        .into_iter()
        .find(|d| d["kind"] == "Namespace")
        .unwrap();
    assert_eq!(ns["metadata"]["name"], contract::SYSTEM_NAMESPACE);
    assert_eq!(
        ns["metadata"]["labels"][labels::INJECT],
        labels::INJECT_DISABLED
    );
    assert_eq!(
        ns["metadata"]["labels"]["kubernetes.io/metadata.name"],
        contract::SYSTEM_NAMESPACE
    );
}

/// JSON pointers of every `x-kubernetes-validations` in `v`.
fn cel_pointers(v: &Value, path: &str, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, c) in m {
                let p = format!("{path}/{}", k.replace('~', "~0").replace('/', "~1"));
                if k == "x-kubernetes-validations" {
                    out.push(p);
                } else {
                    cel_pointers(c, &p, out);
                }
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate() {
                cel_pointers(c, &format!("{path}/{i}"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn the_k8s_1_20_component_removes_exactly_the_cel_rules_crdgen_emits() {
    let comp = &read_docs(&manifests().join("components/k8s-1.20/kustomization.yaml"))[0];
    let mut removed: Vec<String> = vec![];
    for p in comp["patches"].as_array().unwrap() {
        if p["target"]["kind"] != "CustomResourceDefinition" {
            continue;
        }
        let name = p["target"]["name"].as_str().unwrap();
        let ops = baton_crds::yaml::documents(p["patch"].as_str().unwrap()).unwrap();
        for op in ops[0].as_array().unwrap() {
            assert_eq!(op["op"], "remove");
            removed.push(format!("{name}{}", op["path"].as_str().unwrap()));
        }
    }
    let mut want = vec![];
    for crd in baton_crds::schema::crds() {
        let name = crd.metadata.name.clone().unwrap();
        let mut ptrs = vec![];
        cel_pointers(&serde_json::to_value(&crd).unwrap(), "", &mut ptrs);
        want.extend(ptrs.into_iter().map(|p| format!("{name}{p}")));
    }
    removed.sort();
    want.sort();
    assert_eq!(
        removed, want,
        "update manifests/components/k8s-1.20/kustomization.yaml to remove exactly the CEL rules"
    );
}

#[test]
fn the_k8s_1_20_component_replaces_the_pdbs_with_policy_v1beta1() {
    let docs = read_docs(&manifests().join("components/k8s-1.20/pdb-v1beta1.yaml"));
    let bases: Vec<Value> = install_set()
        .into_iter()
        .filter(|d| d["kind"] == "PodDisruptionBudget")
        .collect();
    assert_eq!(docs.len(), bases.len());
    for base in bases {
        assert_eq!(base["apiVersion"], "policy/v1");
        let old = docs
            .iter()
            .find(|d| d["metadata"]["name"] == base["metadata"]["name"])
            .unwrap_or_else(|| panic!("no v1beta1 copy of {}", base["metadata"]["name"]));
        assert_eq!(old["apiVersion"], "policy/v1beta1");
        assert_eq!(old["spec"], base["spec"]);
        assert_eq!(old["metadata"], base["metadata"]);
    }
}

/// docs/operations.md's "Ports and who may call them" table as (component,
/// port, the "bound" cell) rows; a row with an empty component cell belongs
/// to the one above it.
fn documented_ports() -> Vec<(String, u16, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let section = text
        .split("\n## Ports and who may call them\n")
        .nth(1)
        .expect("docs/operations.md has a section 'Ports and who may call them'");
    let mut rows = vec![];
    let mut component = String::new();
    // The first table of the section; its first two lines are the header.
    for line in section
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
    {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if !cells[1].is_empty() {
            component = cells[1].trim_matches('`').to_owned();
        }
        // Ports are the numbers in backticks of the socket cell.
        for quoted in cells[2].split('`').skip(1).step_by(2) {
            if let Ok(port) = quoted.parse::<u16>() {
                rows.push((component.clone(), port, cells[3].to_owned()));
            }
        }
    }
    assert!(!rows.is_empty(), "no port rows found in docs/operations.md");
    rows
}

/// Firewall and NetworkPolicy authors read that table: every port Baton
/// opens must be in it, under the component that opens it, and a port a
/// Service exposes must say so.
#[test]
fn every_port_the_manifests_and_the_sidecar_open_is_in_the_operations_port_table() {
    let table = documented_ports();
    let row = |component: &str, port: u16| {
        table
            .iter()
            .find(|(c, p, _)| c == component && *p == port)
            .map(|(_, _, bound)| bound.as_str())
    };
    let mut missing = vec![];
    for doc in install_set() {
        let name = doc["metadata"]["name"].as_str().unwrap_or_default();
        match doc["kind"].as_str() {
            Some("Deployment") => {
                let containers = doc["spec"]["template"]["spec"]["containers"]
                    .as_array()
                    .unwrap();
                for port in containers
                    .iter()
                    .flat_map(|c| c["ports"].as_array().cloned().unwrap_or_default())
                {
                    let number = u16::try_from(port["containerPort"].as_u64().unwrap()).unwrap();
                    if row(name, number).is_none() {
                        missing.push(format!("{name}: containerPort {number}"));
                    }
                }
            }
            Some("Service") => {
                let component = doc["spec"]["selector"]["app.kubernetes.io/name"]
                    .as_str()
                    .unwrap_or_else(|| panic!("Service {name} selects no component"));
                for port in doc["spec"]["ports"].as_array().unwrap() {
                    let number = u16::try_from(port["port"].as_u64().unwrap()).unwrap();
                    match row(component, number) {
                        None => missing.push(format!("Service {name}: port {number}")),
                        Some(bound) if !bound.contains(&format!("`{name}`")) => missing.push(
                            format!("Service {name}: port {number} is listed without the Service"),
                        ),
                        Some(_) => {}
                    }
                }
            }
            _ => {}
        }
    }
    // The sidecar's listeners: injected by the webhook, in no manifest.
    for port in [
        contract::ports::OUTBOUND,
        contract::ports::INBOUND,
        contract::ports::ADMIN,
    ] {
        if row("baton-sidecar", port).is_none() {
            missing.push(format!("baton-sidecar: {port}"));
        }
    }
    assert!(
        missing.is_empty(),
        "docs/operations.md's port table misses: {missing:#?}"
    );
}
