//! Verdicts on the cluster and the control plane (pure): `kubernetes-api`,
//! `crds`, `control-plane` and `pre-install`.

use baton_crds::contract::{SYSTEM_NAMESPACE, webhook};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::version::Info;
use serde_json::Value;

use super::Check;
use super::fetch::{ControlPlane, Got, PreObserved};

/// The operator's Deployment and leader Lease (operator/src/leader.rs).
pub const OPERATOR: &str = "baton-operator";
/// Oldest supported minor of Kubernetes 1 (docs/operations.md).
pub const MIN_MINOR: u32 = 20;
/// Newest minor that needs the `k8s-1.20` kustomize component (policy/v1beta1
/// PodDisruptionBudgets, no CEL rules).
const LAST_MINOR_WITH_COMPONENT: u32 = 24;
/// Slack for clock skew between this machine and the API server when judging
/// a Lease.
pub const LEASE_GRACE_SECONDS: i64 = 5;
/// What installs Baton (hint of every "not installed" failure).
pub const INSTALL: &str = "kubectl apply -k manifests/";

/// A hint for an object the caller may not read.
pub fn can_i(verb: &str, resource: &str, namespace: Option<&str>) -> String {
    match namespace {
        Some(ns) => format!("check your RBAC: kubectl auth can-i {verb} {resource} -n {ns}"),
        None => format!("check your RBAC: kubectl auth can-i {verb} {resource}"),
    }
}

/// `(major, minor)` of a `/version` answer; cloud providers append `+` to
/// the minor (`"27+"`).
pub fn parse_version(info: &Info) -> Option<(u32, u32)> {
    let digits = |s: &str| {
        s.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .ok()
    };
    Some((digits(&info.major)?, digits(&info.minor)?))
}

/// `server version`: Baton supports 1.20 and newer.
pub fn version_check(version: &Got<Info>) -> Check {
    const NAME: &str = "server version";
    let info = match version {
        Got::Found(info) => info,
        Got::Missing => {
            return Check::warning(NAME, "GET /version answered 404", "kubectl version");
        }
        Got::Unreadable(why) => {
            return Check::warning(
                NAME,
                format!("cannot read /version: {why}"),
                "kubectl version",
            );
        }
    };
    match parse_version(info) {
        None => Check::warning(
            NAME,
            format!(
                "cannot parse version {:?}.{:?} ({})",
                info.major, info.minor, info.git_version
            ),
            "Baton supports Kubernetes 1.20 and newer (docs/operations.md); check kubectl version",
        ),
        Some((major, minor)) if major < 1 || (major == 1 && minor < MIN_MINOR) => Check::failure(
            NAME,
            format!("{major}.{minor} is not supported (Baton supports 1.{MIN_MINOR}+)"),
            format!("upgrade the cluster to Kubernetes 1.{MIN_MINOR} or newer"),
        ),
        Some((1, minor)) if minor <= LAST_MINOR_WITH_COMPONENT => Check::ok(
            NAME,
            format!(
                "1.{minor} is supported (install with the manifests/components/k8s-1.20 component)"
            ),
        ),
        Some((major, minor)) => Check::ok(NAME, format!("{major}.{minor} is supported")),
    }
}

/// `kubernetes-api`: the server answered (it did, or the command would
/// have stopped with the connection error), and its version is supported.
pub fn kubernetes_api(version: &Got<Info>) -> Vec<Check> {
    vec![
        Check::ok("can reach the API server", ""),
        version_check(version),
    ]
}

/// `crds`: every CRD this CLI knows is installed, with the same schema.
pub fn crds(
    installed: &[(String, Got<CustomResourceDefinition>)],
    expected: &[CustomResourceDefinition],
) -> Vec<Check> {
    expected
        .iter()
        .map(|want| {
            let name = want.metadata.name.clone().unwrap_or_default();
            let label = format!("CRD {name}");
            match installed.iter().find(|(n, _)| *n == name).map(|(_, g)| g) {
                None | Some(Got::Missing) => Check::failure(label, "not installed", INSTALL),
                Some(Got::Unreadable(why)) => Check::failure(
                    label,
                    format!("cannot read: {why}"),
                    can_i("get", "customresourcedefinitions", None),
                ),
                Some(Got::Found(have)) => match schema_difference(have, want) {
                    None => Check::ok(label, "installed; schema matches this kubectl-baton"),
                    Some(diff) => Check::warning(
                        label,
                        format!("installed schema differs from this kubectl-baton's: {diff}"),
                        format!(
                            "{INSTALL} from the Baton version of this kubectl-baton ({}), or use the kubectl-baton of the installed version",
                            env!("CARGO_PKG_VERSION")
                        ),
                    ),
                },
            }
        })
        .collect()
}

/// Where an installed CRD's schema differs from the expected one, if it
/// does: the version names, then each version's `openAPIV3Schema` as JSON.
///
/// Comparing the typed objects' JSON ignores what the API server adds
/// around the schema (status, managedFields, `conversion`, defaults of
/// other spec fields). Inside the schema, `x-kubernetes-validations` (CEL
/// rules) is ignored: a 1.20–1.24 server drops it and the k8s-1.20 install
/// component removes it, while the webhook enforces the same rules there,
/// so its absence is not drift.
pub fn schema_difference(
    installed: &CustomResourceDefinition,
    expected: &CustomResourceDefinition,
) -> Option<String> {
    let names = |crd: &CustomResourceDefinition| {
        let mut v: Vec<String> = crd.spec.versions.iter().map(|v| v.name.clone()).collect();
        v.sort();
        v
    };
    let (have, want) = (names(installed), names(expected));
    if have != want {
        return Some(format!(
            "versions [{}] installed, [{}] expected",
            have.join(", "),
            want.join(", ")
        ));
    }
    for version in &expected.spec.versions {
        let other = installed
            .spec
            .versions
            .iter()
            .find(|v| v.name == version.name)?;
        let schema = |v: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinitionVersion| {
            let mut value = v
                .schema
                .as_ref()
                .and_then(|s| serde_json::to_value(&s.open_api_v3_schema).ok())
                .unwrap_or(Value::Null);
            strip_key(&mut value, "x-kubernetes-validations");
            value
        };
        if let Some(path) = first_difference(&schema(other), &schema(version), "") {
            return Some(format!("{} at openAPIV3Schema{path}", version.name));
        }
    }
    None
}

fn strip_key(value: &mut Value, key: &str) {
    match value {
        Value::Object(map) => {
            map.remove(key);
            map.values_mut().for_each(|v| strip_key(v, key));
        }
        Value::Array(items) => items.iter_mut().for_each(|v| strip_key(v, key)),
        _ => {}
    }
}

/// The JSON path of the first place `a` and `b` differ (`.properties.spec`).
pub fn first_difference(a: &Value, b: &Value, path: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter().find_map(|k| {
                let here = format!("{path}.{k}");
                match (x.get(k), y.get(k)) {
                    (Some(p), Some(q)) => first_difference(p, q, &here),
                    _ => Some(here),
                }
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (p, q))| first_difference(p, q, &format!("{path}[{i}]"))),
        _ if a == b => None,
        _ => Some(if path.is_empty() {
            " (root)".to_owned()
        } else {
            path.to_owned()
        }),
    }
}

/// `control-plane`: both Deployments ready, the leader Lease fresh.
pub fn control_plane(cp: &ControlPlane, now: i64) -> Vec<Check> {
    vec![
        deployment(OPERATOR, &cp.operator),
        deployment(webhook::SERVICE, &cp.webhook),
        lease(&cp.lease, now),
    ]
}

/// One Deployment: every desired replica ready. Scaled to 0 is a failure of
/// its own, with the command that undoes it (both run 2 replicas).
pub fn deployment(name: &str, got: &Got<Deployment>) -> Check {
    let label = format!("{name} Deployment");
    let d = match got {
        Got::Found(d) => d,
        Got::Missing => return Check::failure(label, "not found", INSTALL),
        Got::Unreadable(why) => {
            return Check::failure(
                label,
                format!("cannot read: {why}"),
                can_i("get", "deployments", Some(SYSTEM_NAMESPACE)),
            );
        }
    };
    let desired = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let ready = d
        .status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0);
    let detail = format!("{ready}/{desired} replicas ready");
    if desired == 0 {
        Check::failure(
            label,
            format!("{detail} (scaled to 0)"),
            format!("kubectl -n {SYSTEM_NAMESPACE} scale deployment {name} --replicas=2"),
        )
    } else if ready < desired {
        Check::failure(
            label,
            detail,
            format!("kubectl -n {SYSTEM_NAMESPACE} describe deployment {name}"),
        )
    } else {
        Check::ok(label, detail)
    }
}

/// The leader Lease: held, and renewed within its duration (plus
/// [`LEASE_GRACE_SECONDS`]). A stale Lease means no operator replica is
/// writing status or rolling sidecars out.
pub fn lease(got: &Got<Lease>, now: i64) -> Check {
    let label = format!("leader Lease {OPERATOR}");
    let logs = format!("kubectl -n {SYSTEM_NAMESPACE} logs deployment/{OPERATOR}");
    let l = match got {
        Got::Found(l) => l,
        Got::Missing => {
            return Check::failure(
                label,
                "not found: no operator replica has started leading",
                format!("{logs} (the leader creates the Lease)"),
            );
        }
        Got::Unreadable(why) => {
            return Check::failure(
                label,
                format!("cannot read: {why}"),
                can_i("get", "leases.coordination.k8s.io", Some(SYSTEM_NAMESPACE)),
            );
        }
    };
    let spec = l.spec.clone().unwrap_or_default();
    let Some(holder) = spec.holder_identity.filter(|h| !h.is_empty()) else {
        return Check::failure(label, "no holder: no operator replica leads", logs);
    };
    let duration = i64::from(spec.lease_duration_seconds.unwrap_or(15));
    let Some(renewed) = spec
        .renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .map(|t| t.0.as_second())
    else {
        return Check::failure(label, format!("held by {holder}, never renewed"), logs);
    };
    let ago = crate::output::age(now - renewed);
    if renewed + duration + LEASE_GRACE_SECONDS >= now {
        Check::ok(label, format!("held by {holder}, renewed {ago} ago"))
    } else {
        Check::failure(
            label,
            format!("held by {holder}, not renewed for {ago} (lease {duration}s)"),
            format!("{logs}; is the leader {holder} stuck?"),
        )
    }
}

/// One thing `kubectl apply -k manifests/` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permission {
    pub verb: &'static str,
    pub group: &'static str,
    pub resource: &'static str,
    pub namespace: Option<&'static str>,
}

impl std::fmt::Display for Permission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.verb, self.resource)?;
        if !self.group.is_empty() {
            write!(f, ".{}", self.group)?;
        }
        if let Some(ns) = self.namespace {
            write!(f, " in {ns}")?;
        }
        Ok(())
    }
}

const fn create(
    group: &'static str,
    resource: &'static str,
    namespace: Option<&'static str>,
) -> Permission {
    Permission {
        verb: "create",
        group,
        resource,
        namespace,
    }
}

/// What installing needs: every kind manifests/ holds (kustomization.yaml).
pub const INSTALL_PERMISSIONS: &[Permission] = &[
    create("apiextensions.k8s.io", "customresourcedefinitions", None),
    create("", "namespaces", None),
    create("rbac.authorization.k8s.io", "clusterroles", None),
    create("rbac.authorization.k8s.io", "clusterrolebindings", None),
    create(
        "admissionregistration.k8s.io",
        "mutatingwebhookconfigurations",
        None,
    ),
    create(
        "admissionregistration.k8s.io",
        "validatingwebhookconfigurations",
        None,
    ),
    create("apps", "deployments", Some(SYSTEM_NAMESPACE)),
    create("", "services", Some(SYSTEM_NAMESPACE)),
    create("", "serviceaccounts", Some(SYSTEM_NAMESPACE)),
    create("rbac.authorization.k8s.io", "roles", Some(SYSTEM_NAMESPACE)),
    create(
        "rbac.authorization.k8s.io",
        "rolebindings",
        Some(SYSTEM_NAMESPACE),
    ),
    create("policy", "poddisruptionbudgets", Some(SYSTEM_NAMESPACE)),
];

/// Name fragments of other meshes' sidecar injectors.
pub const OTHER_INJECTORS: &[&str] = &[
    "istio-sidecar-injector",
    "linkerd-proxy-injector",
    "sidecar-injector",
    "proxy-injector",
];

/// `pre-install`: the version, the caller's permissions, and webhook
/// configurations that would fight Baton's.
pub fn pre_install(pre: &PreObserved) -> Vec<Check> {
    let mut out = vec![version_check(&pre.version), permissions(&pre.permissions)];
    out.extend(conflicting_injectors(&pre.mutating));
    out
}

/// One check for every permission install needs, naming the missing ones.
pub fn permissions(reviews: &[(Permission, Got<bool>)]) -> Check {
    const NAME: &str = "permissions to install";
    let denied: Vec<String> = reviews
        .iter()
        .filter(|(_, g)| *g == Got::Found(false))
        .map(|(p, _)| p.to_string())
        .collect();
    let unknown: Vec<String> = reviews
        .iter()
        .filter_map(|(p, g)| match g {
            Got::Found(_) => None,
            Got::Missing => Some(format!("{p} (404)")),
            Got::Unreadable(why) => Some(format!("{p} ({why})")),
        })
        .collect();
    if !denied.is_empty() {
        Check::failure(
            NAME,
            format!("missing: {}", denied.join(", ")),
            "install as a cluster admin, or have one grant these (kubectl auth can-i --list)",
        )
    } else if !unknown.is_empty() {
        Check::warning(
            NAME,
            format!("could not ask the API server: {}", unknown.join(", ")),
            "kubectl auth can-i --list",
        )
    } else {
        Check::ok(
            NAME,
            format!("may do all {} things {INSTALL} does", reviews.len()),
        )
    }
}

/// A leftover Baton injector (already installed) and other meshes'
/// injectors (Pods both select would get two sidecars) are warnings.
pub fn conflicting_injectors(mutating: &Got<Vec<String>>) -> Vec<Check> {
    const NAME: &str = "mutating webhook configurations";
    let names = match mutating {
        Got::Found(names) => names,
        Got::Missing => return vec![Check::ok(NAME, "none installed")],
        Got::Unreadable(why) => {
            return vec![Check::warning(
                NAME,
                format!("cannot list: {why}"),
                can_i("list", "mutatingwebhookconfigurations", None),
            )];
        }
    };
    let mut out = Vec::new();
    for name in names {
        if name == webhook::MUTATING_CONFIGURATION {
            out.push(Check::warning(
                format!("MutatingWebhookConfiguration {name}"),
                "Baton is already installed",
                "check it with kubectl baton check, or remove the leftover first: kubectl delete mutatingwebhookconfiguration baton-sidecar-injector",
            ));
        } else if OTHER_INJECTORS.iter().any(|f| name.contains(f)) {
            out.push(Check::warning(
                format!("MutatingWebhookConfiguration {name}"),
                "another sidecar injector: Pods both select would get two proxies",
                format!(
                    "keep Baton's namespaces out of its selector, or remove it: kubectl delete mutatingwebhookconfiguration {name}"
                ),
            ));
        }
    }
    if out.is_empty() {
        out.push(Check::ok(NAME, "no other sidecar injector"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::Status;
    use serde_json::json;

    fn info(major: &str, minor: &str) -> Got<Info> {
        Got::Found(Info {
            major: major.into(),
            minor: minor.into(),
            git_version: format!("v{major}.{minor}.0"),
            ..Info::default()
        })
    }

    #[test]
    fn versions_from_1_20_are_supported_and_older_ones_fail() {
        let c = version_check(&info("1", "20"));
        assert_eq!(c.status, Status::Ok);
        assert!(c.detail.unwrap().contains("k8s-1.20 component"));
        let c = version_check(&info("1", "33+"));
        assert_eq!(c.status, Status::Ok);
        assert_eq!(c.detail.as_deref(), Some("1.33 is supported"));
        let c = version_check(&info("1", "19"));
        assert_eq!(c.status, Status::Failure);
        assert!(c.hint.unwrap().contains("1.20 or newer"));
        assert_eq!(version_check(&info("one", "x")).status, Status::Warning);
        let c = version_check(&Got::Unreadable("403 Forbidden: no".into()));
        assert_eq!(c.status, Status::Warning);
        assert_eq!(c.hint.as_deref(), Some("kubectl version"));
    }

    #[test]
    fn the_api_category_reports_reachability_and_version() {
        let checks = kubernetes_api(&info("1", "20"));
        assert_eq!(checks.len(), 2);
        assert!(checks.iter().all(|c| c.status == Status::Ok));
        assert_eq!(checks[0].name, "can reach the API server");
    }

    fn expected() -> Vec<CustomResourceDefinition> {
        baton_crds::schema::crds()
    }

    fn installed_as(
        crds: &[CustomResourceDefinition],
    ) -> Vec<(String, Got<CustomResourceDefinition>)> {
        crds.iter()
            .map(|c| (c.metadata.name.clone().unwrap(), Got::Found(c.clone())))
            .collect()
    }

    #[test]
    fn crds_as_this_cli_renders_them_match_even_with_server_fields_and_without_cel() {
        let mut installed = expected();
        for crd in &mut installed {
            // What the API server adds, and what 1.20 / the component drop.
            crd.metadata.resource_version = Some("42".into());
            crd.metadata.uid = Some("u".into());
            crd.status = Some(Default::default());
            let mut v = serde_json::to_value(&*crd).unwrap();
            strip_key(&mut v, "x-kubernetes-validations");
            *crd = serde_json::from_value(v).unwrap();
        }
        let checks = crds(&installed_as(&installed), &expected());
        assert_eq!(checks.len(), 5);
        for c in &checks {
            assert_eq!(c.status, Status::Ok, "{c:?}");
        }
        assert_eq!(checks[0].name, "CRD sidecarreleases.baton.dev");
    }

    #[test]
    fn a_changed_schema_warns_with_where_it_differs() {
        let mut installed = expected();
        let mut v = serde_json::to_value(&installed[0]).unwrap();
        v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            ["version"]["type"] = json!("integer");
        installed[0] = serde_json::from_value(v).unwrap();
        let checks = crds(&installed_as(&installed), &expected());
        assert_eq!(checks[0].status, Status::Warning);
        let detail = checks[0].detail.clone().unwrap();
        assert!(
            detail.contains("v1alpha1 at openAPIV3Schema.properties.spec.properties.version.type"),
            "{detail}"
        );
        assert!(checks[0].hint.clone().unwrap().starts_with(INSTALL));
        assert_eq!(checks[1].status, Status::Ok);
    }

    #[test]
    fn other_version_names_warn() {
        let mut installed = expected();
        installed[1].spec.versions[0].name = "v1beta1".into();
        let checks = crds(&installed_as(&installed), &expected());
        assert_eq!(checks[1].status, Status::Warning);
        assert!(
            checks[1]
                .detail
                .clone()
                .unwrap()
                .contains("versions [v1beta1] installed, [v1alpha1] expected")
        );
    }

    #[test]
    fn a_missing_or_unreadable_crd_fails() {
        let mut installed = installed_as(&expected());
        installed[0].1 = Got::Missing;
        installed[2].1 = Got::Unreadable("403 Forbidden: no".into());
        installed.remove(3);
        let checks = crds(&installed, &expected());
        assert_eq!(checks[0].status, Status::Failure);
        assert_eq!(checks[0].detail.as_deref(), Some("not installed"));
        assert_eq!(checks[0].hint.as_deref(), Some(INSTALL));
        assert_eq!(checks[2].status, Status::Failure);
        assert!(
            checks[2]
                .hint
                .clone()
                .unwrap()
                .contains("kubectl auth can-i get customresourcedefinitions")
        );
        assert_eq!(checks[3].status, Status::Failure, "absent from the answer");
    }

    pub(crate) fn deployment_with(replicas: i32, ready: Option<i32>) -> Got<Deployment> {
        Got::Found(
            serde_json::from_value(json!({
                "metadata": {"name": "baton-webhook", "namespace": "baton-system"},
                "spec": {"replicas": replicas, "selector": {}, "template": {}},
                "status": {"readyReplicas": ready},
            }))
            .unwrap(),
        )
    }

    #[test]
    fn a_deployment_with_every_replica_ready_is_ok() {
        let c = deployment("baton-webhook", &deployment_with(2, Some(2)));
        assert_eq!(c.status, Status::Ok);
        assert_eq!(c.name, "baton-webhook Deployment");
        assert_eq!(c.detail.as_deref(), Some("2/2 replicas ready"));
    }

    #[test]
    fn a_deployment_short_of_ready_replicas_fails_with_describe() {
        let c = deployment("baton-webhook", &deployment_with(2, None));
        assert_eq!(c.status, Status::Failure);
        assert_eq!(c.detail.as_deref(), Some("0/2 replicas ready"));
        assert_eq!(
            c.hint.as_deref(),
            Some("kubectl -n baton-system describe deployment baton-webhook")
        );
    }

    #[test]
    fn a_deployment_scaled_to_zero_fails_with_the_scale_command() {
        // Even while the old Pods are still counted ready.
        let c = deployment("baton-webhook", &deployment_with(0, Some(2)));
        assert_eq!(c.status, Status::Failure);
        assert_eq!(
            c.detail.as_deref(),
            Some("2/0 replicas ready (scaled to 0)")
        );
        assert_eq!(
            c.hint.as_deref(),
            Some("kubectl -n baton-system scale deployment baton-webhook --replicas=2")
        );
        let c = deployment("baton-webhook", &deployment_with(0, None));
        assert_eq!(
            c.detail.as_deref(),
            Some("0/0 replicas ready (scaled to 0)")
        );
    }

    #[test]
    fn a_missing_or_forbidden_deployment_fails() {
        let c = deployment(OPERATOR, &Got::Missing);
        assert_eq!(c.status, Status::Failure);
        assert_eq!(c.hint.as_deref(), Some(INSTALL));
        let c = deployment(OPERATOR, &Got::Unreadable("403 Forbidden: x".into()));
        assert_eq!(c.status, Status::Failure);
        assert_eq!(
            c.hint.as_deref(),
            Some("check your RBAC: kubectl auth can-i get deployments -n baton-system")
        );
    }

    pub(crate) fn lease_with(holder: Option<&str>, renewed: Option<&str>) -> Got<Lease> {
        Got::Found(
            serde_json::from_value(json!({
                "metadata": {"name": "baton-operator"},
                "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                         "renewTime": renewed},
            }))
            .unwrap(),
        )
    }

    /// 2024-01-01T00:00:00Z.
    const NOW: i64 = 1_704_067_200;

    #[test]
    fn a_freshly_renewed_lease_names_its_holder() {
        let c = lease(
            &lease_with(Some("op-1"), Some("2023-12-31T23:59:50.000000Z")),
            NOW,
        );
        assert_eq!(c.status, Status::Ok, "{c:?}");
        assert_eq!(c.detail.as_deref(), Some("held by op-1, renewed 10s ago"));
        // Within duration + grace.
        let c = lease(
            &lease_with(Some("op-1"), Some("2023-12-31T23:59:41.000000Z")),
            NOW,
        );
        assert_eq!(c.status, Status::Ok);
    }

    #[test]
    fn a_stale_lease_fails_naming_the_holder() {
        let c = lease(
            &lease_with(Some("op-1"), Some("2023-12-31T23:58:00.000000Z")),
            NOW,
        );
        assert_eq!(c.status, Status::Failure);
        assert_eq!(
            c.detail.as_deref(),
            Some("held by op-1, not renewed for 2m0s (lease 15s)")
        );
        assert!(c.hint.unwrap().contains("logs deployment/baton-operator"));
    }

    #[test]
    fn a_lease_without_holder_or_renewal_or_at_all_fails() {
        assert_eq!(lease(&lease_with(None, None), NOW).status, Status::Failure);
        assert_eq!(
            lease(&lease_with(Some(""), None), NOW).status,
            Status::Failure
        );
        let c = lease(&lease_with(Some("op-1"), None), NOW);
        assert_eq!(c.detail.as_deref(), Some("held by op-1, never renewed"));
        let c = lease(&Got::Missing, NOW);
        assert_eq!(c.status, Status::Failure);
        assert!(c.hint.unwrap().contains("the leader creates the Lease"));
        let c = lease(&Got::Unreadable("403".into()), NOW);
        assert!(
            c.hint
                .unwrap()
                .contains("can-i get leases.coordination.k8s.io")
        );
    }

    #[test]
    fn the_control_plane_category_has_both_deployments_and_the_lease() {
        let cp = ControlPlane {
            operator: deployment_with(2, Some(2)),
            webhook: deployment_with(0, None),
            lease: lease_with(Some("op-1"), Some("2023-12-31T23:59:59.000000Z")),
        };
        let checks = control_plane(&cp, NOW);
        let statuses: Vec<Status> = checks.iter().map(|c| c.status).collect();
        assert_eq!(statuses, [Status::Ok, Status::Failure, Status::Ok]);
        assert_eq!(checks[1].name, "baton-webhook Deployment");
    }

    fn reviews(denied: &[&str]) -> Vec<(Permission, Got<bool>)> {
        INSTALL_PERMISSIONS
            .iter()
            .map(|p| (*p, Got::Found(!denied.contains(&p.resource))))
            .collect()
    }

    #[test]
    fn install_permissions_pass_when_all_are_allowed() {
        let c = permissions(&reviews(&[]));
        assert_eq!(c.status, Status::Ok);
        assert_eq!(
            c.detail.as_deref(),
            Some("may do all 12 things kubectl apply -k manifests/ does")
        );
    }

    #[test]
    fn missing_permissions_fail_naming_each_one() {
        let c = permissions(&reviews(&["customresourcedefinitions", "deployments"]));
        assert_eq!(c.status, Status::Failure);
        assert_eq!(
            c.detail.as_deref(),
            Some(
                "missing: create customresourcedefinitions.apiextensions.k8s.io, create deployments.apps in baton-system"
            )
        );
        assert!(c.hint.unwrap().contains("cluster admin"));
    }

    #[test]
    fn unanswered_access_reviews_warn() {
        let mut r = reviews(&[]);
        r[1].1 = Got::Unreadable("403 Forbidden: no".into());
        let c = permissions(&r);
        assert_eq!(c.status, Status::Warning);
        assert!(
            c.detail
                .unwrap()
                .contains("create namespaces (403 Forbidden: no)")
        );
    }

    #[test]
    fn other_injectors_and_a_leftover_baton_injector_warn() {
        let names = Got::Found(vec![
            "istio-sidecar-injector".to_owned(),
            "cert-manager-webhook".to_owned(),
            "linkerd-proxy-injector-webhook-config".to_owned(),
            "baton-sidecar-injector".to_owned(),
        ]);
        let checks = conflicting_injectors(&names);
        assert_eq!(checks.len(), 3);
        assert!(checks.iter().all(|c| c.status == Status::Warning));
        assert_eq!(
            checks[0].name,
            "MutatingWebhookConfiguration istio-sidecar-injector"
        );
        assert!(
            checks[0]
                .hint
                .clone()
                .unwrap()
                .contains("kubectl delete mutatingwebhookconfiguration istio-sidecar-injector")
        );
        assert_eq!(
            checks[2].detail.as_deref(),
            Some("Baton is already installed")
        );
    }

    #[test]
    fn no_injector_is_ok_and_an_unlistable_one_warns() {
        let checks = conflicting_injectors(&Got::Found(vec!["cert-manager-webhook".into()]));
        assert_eq!(checks.len(), 1);
        assert_eq!(checks[0].status, Status::Ok);
        let checks = conflicting_injectors(&Got::Unreadable("403".into()));
        assert_eq!(checks[0].status, Status::Warning);
    }

    #[test]
    fn pre_install_combines_version_permissions_and_injectors() {
        let pre = PreObserved {
            version: info("1", "20"),
            permissions: reviews(&[]),
            mutating: Got::Found(vec![]),
        };
        let checks = pre_install(&pre);
        assert_eq!(checks.len(), 3);
        assert!(checks.iter().all(|c| c.status == Status::Ok));
    }
}
