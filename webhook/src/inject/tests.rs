//! Exhaustive tests of `mutate`: every test applies the patch to the pod's
//! JSON with a real RFC 6902 implementation and inspects the result, so a
//! patch that would not apply (or would apply wrongly) fails here.

use std::{collections::BTreeMap, sync::Arc};

use baton_crds::{
    AcceleratorPool, SidecarRelease, TlsPolicy,
    contract::{SIDECAR_UID, annotations, containers, env, labels, ports, volumes},
};
use json_patch::Patch;
use k8s_openapi::api::core::v1::{Container, Node, Pod};
use serde_json::{Value, json};

use super::*;

fn release(name: &str, extra: Value) -> Arc<SidecarRelease> {
    let mut spec = json!({
        "version": "1.2.0",
        "image": "baton/sidecar:1.2.0",
        "emptyImage": "baton/empty:1",
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
    });
    json_patch::merge(&mut spec, &extra);
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease",
            "metadata": {"name": name}, "spec": spec,
        }))
        .unwrap(),
    )
}

fn policy(ns: &str, name: &str, selector: Value, offload: Value) -> Arc<TlsPolicy> {
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "TlsPolicy",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"podSelector": selector, "privateKeyOffload": offload},
        }))
        .unwrap(),
    )
}

fn pool(name: &str, status: Value) -> Arc<AcceleratorPool> {
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "AcceleratorPool",
            "metadata": {"name": name},
            "spec": {"resourceName": "qat.intel.com/cy", "devicesPerSidecar": 1,
                     "nodeSelector": {"matchLabels": {"qat": "yes"}}},
            "status": status,
        }))
        .unwrap(),
    )
}

fn node(name: &str, qat: Option<&str>) -> Arc<Node> {
    let mut n = json!({"metadata": {"name": name, "labels": {"qat": "yes"}}, "status": {"allocatable": {"cpu": "4"}}});
    if let Some(q) = qat {
        n["status"]["allocatable"]["qat.intel.com/cy"] = json!(q);
    }
    Arc::new(serde_json::from_value(n).unwrap())
}

fn pod(v: Value) -> Pod {
    serde_json::from_value(v).unwrap()
}

fn app_pod() -> Pod {
    pod(json!({
        "metadata": {"name": "web-1", "labels": {"app": "web"}, "annotations": {"team": "a"}},
        "spec": {"containers": [{"name": "app", "image": "app:1", "ports": [{"containerPort": 8080}]}]},
    }))
}

struct Fixture {
    ns_labels: BTreeMap<String, String>,
    releases: Vec<Arc<SidecarRelease>>,
    policies: Vec<Arc<TlsPolicy>>,
    pools: Vec<Arc<AcceleratorPool>>,
    nodes: Vec<Arc<Node>>,
    recent_grants: Vec<RecentGrant>,
    version: ServerVersion,
    config: InjectConfig,
    trust_bundle: Option<String>,
}

/// What ConfigMap baton-system/baton-mesh-trust holds in the fixtures.
const BUNDLE: &str = "-----BEGIN CERTIFICATE-----\nMIIBroot\n-----END CERTIFICATE-----\n";

impl Fixture {
    fn new() -> Self {
        Self {
            ns_labels: BTreeMap::from([(
                labels::INJECT.to_owned(),
                labels::INJECT_ENABLED.to_owned(),
            )]),
            releases: vec![release("default", json!({}))],
            policies: vec![],
            pools: vec![],
            nodes: vec![],
            recent_grants: Vec::new(),
            version: ServerVersion::new(1, 20),
            config: InjectConfig::default(),
            trust_bundle: Some(BUNDLE.to_owned()),
        }
    }

    fn old(mut self) -> Self {
        self.version = ServerVersion::new(1, 20);
        self
    }

    fn native(mut self) -> Self {
        self.version = ServerVersion::new(1, 32);
        self
    }

    fn view(&self, ns: &'static str) -> ClusterView<'_> {
        ClusterView {
            namespace: ns,
            namespace_labels: &self.ns_labels,
            releases: &self.releases,
            tls_policies: &self.policies,
            pools: &self.pools,
            nodes: &self.nodes,
            recent_grants: &self.recent_grants,
            grant_id: "req-this",
            server_version: self.version,
            trust_bundle: self.trust_bundle.as_deref(),
        }
    }

    fn run(&self, pod: &Pod) -> Result<Outcome, Denial> {
        mutate(pod, &self.view("apps"), &self.config)
    }

    fn inject(&self, pod: &Pod) -> (Injection, Pod) {
        match self.run(pod) {
            Ok(Outcome::Injected(inj)) => {
                let patched = apply(pod, &inj.patch);
                (*inj, patched)
            }
            other => panic!("expected an injection, got {other:?}"),
        }
    }

    fn skip(&self, pod: &Pod) -> Skip {
        match self.run(pod) {
            Ok(Outcome::Skipped(s)) => s,
            other => panic!("expected a skip, got {other:?}"),
        }
    }

    fn deny(&self, pod: &Pod) -> Denial {
        match self.run(pod) {
            Err(d) => d,
            other => panic!("expected a denial, got {other:?}"),
        }
    }
}

fn apply(pod: &Pod, patch: &Patch) -> Pod {
    let mut doc = serde_json::to_value(pod).unwrap();
    json_patch::patch(&mut doc, patch)
        .unwrap_or_else(|e| panic!("patch does not apply: {e}\n{patch:#?}"));
    serde_json::from_value(doc).unwrap()
}

fn names(cs: &[Container]) -> Vec<&str> {
    cs.iter().map(|c| c.name.as_str()).collect()
}

fn container<'a>(p: &'a Pod, name: &str) -> &'a Container {
    let s = p.spec.as_ref().unwrap();
    s.containers
        .iter()
        .chain(s.init_containers.iter().flatten())
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn annotation<'a>(p: &'a Pod, key: &str) -> Option<&'a str> {
    p.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

fn env_of<'a>(c: &'a Container, name: &str) -> Option<&'a str> {
    c.env
        .as_ref()?
        .iter()
        .find(|e| e.name == name)?
        .value
        .as_deref()
}

fn caps(c: &Container) -> (Vec<String>, Vec<String>) {
    let caps = c
        .security_context
        .as_ref()
        .unwrap()
        .capabilities
        .clone()
        .unwrap();
    (caps.add.unwrap_or_default(), caps.drop.unwrap_or_default())
}

// ---- the opt-in decision --------------------------------------------------

#[test]
fn a_pod_in_an_opted_in_namespace_is_injected() {
    let (inj, p) = Fixture::new().inject(&app_pod());
    assert_eq!(inj.release, "default");
    assert_eq!(annotation(&p, annotations::STATUS), Some("injected"));
}

#[test]
fn a_pod_label_opts_in_inside_a_namespace_that_did_not() {
    let mut f = Fixture::new();
    f.ns_labels.clear();
    assert_eq!(f.skip(&app_pod()), Skip::NotOptedIn);
    let mut p = app_pod();
    p.metadata
        .labels
        .as_mut()
        .unwrap()
        .insert(labels::INJECT.into(), labels::INJECT_ENABLED.into());
    f.inject(&p);
}

#[test]
fn a_pod_label_disabled_opts_out_of_an_opted_in_namespace() {
    let mut p = app_pod();
    p.metadata
        .labels
        .as_mut()
        .unwrap()
        .insert(labels::INJECT.into(), labels::INJECT_DISABLED.into());
    assert_eq!(Fixture::new().skip(&p), Skip::OptedOut);
}

#[test]
fn host_network_pods_are_never_injected() {
    let mut p = app_pod();
    p.spec.as_mut().unwrap().host_network = Some(true);
    assert_eq!(Fixture::new().skip(&p), Skip::HostNetwork);
}

#[test]
fn system_namespaces_are_never_injected_even_when_labelled() {
    let f = Fixture::new();
    for ns in ["kube-system", "baton-system", "kube-public"] {
        let out = mutate(&app_pod(), &f.view(ns), &f.config).unwrap();
        assert!(
            matches!(out, Outcome::Skipped(Skip::SystemNamespace)),
            "{ns}"
        );
    }
}

#[test]
fn other_label_values_do_not_opt_in() {
    let mut f = Fixture::new();
    f.ns_labels.insert(labels::INJECT.into(), "yes".into());
    assert_eq!(f.skip(&app_pod()), Skip::NotOptedIn);
}

// ---- idempotence -------------------------------------------------------------

#[test]
fn an_injected_pod_gets_an_empty_patch_when_submitted_again() {
    for f in [Fixture::new().old(), Fixture::new().native()] {
        let (_, injected) = f.inject(&app_pod());
        assert_eq!(f.skip(&injected), Skip::AlreadyInjected);
    }
}

#[test]
fn reinvocation_after_another_webhook_changed_the_pod_changes_nothing() {
    let f = Fixture::new();
    let (_, mut injected) = f.inject(&app_pod());
    // Another mutating webhook adds a container after us.
    injected.spec.as_mut().unwrap().containers.push(Container {
        name: "other-sidecar".into(),
        ..Container::default()
    });
    assert_eq!(f.skip(&injected), Skip::AlreadyInjected);
}

#[test]
fn the_patch_is_deterministic() {
    let f = Fixture::new();
    let (a, _) = f.inject(&app_pod());
    let (b, _) = f.inject(&app_pod());
    assert_eq!(a.patch, b.patch);
    assert_eq!(a.config_hash, b.config_hash);
}

// ---- release selection -------------------------------------------------------

#[test]
fn no_release_selecting_the_pod_is_a_clear_denial() {
    let mut f = Fixture::new();
    f.releases = vec![release(
        "only-db",
        json!({"podSelector": {"matchLabels": {"app": "db"}}}),
    )];
    let d = f.deny(&app_pod());
    assert_eq!(d.reason, DenialReason::NoRelease);
    assert!(
        d.message.contains("no SidecarRelease selects it"),
        "{}",
        d.message
    );
    assert!(d.message.contains("apps/web-1"), "{}", d.message);
    assert!(d.reason.wants_event());
}

#[test]
fn the_highest_priority_release_wins_and_is_recorded() {
    let mut f = Fixture::new();
    f.releases = vec![
        release("base", json!({})),
        release(
            "canary",
            json!({"priority": 10, "version": "1.3.0-rc1", "image": "baton/sidecar:1.3.0-rc1",
                                 "podSelector": {"matchLabels": {"app": "web"}}}),
        ),
    ];
    let (inj, p) = f.inject(&app_pod());
    assert_eq!(inj.release, "canary");
    assert_eq!(annotation(&p, annotations::RELEASE), Some("canary"));
    assert_eq!(annotation(&p, annotations::VERSION), Some("1.3.0-rc1"));
    assert_eq!(
        container(&p, containers::SLOT_A).image.as_deref(),
        Some("baton/sidecar:1.3.0-rc1")
    );
    assert_eq!(
        p.metadata.labels.as_ref().unwrap()[labels::RELEASE],
        "canary"
    );
}

#[test]
fn a_release_namespace_selector_is_honoured() {
    let mut f = Fixture::new();
    f.releases = vec![release(
        "prod-only",
        json!({"namespaceSelector": {"matchLabels": {"env": "prod"}}}),
    )];
    assert_eq!(f.deny(&app_pod()).reason, DenialReason::NoRelease);
    f.ns_labels.insert("env".into(), "prod".into());
    f.inject(&app_pod());
}

// ---- what is added: slots, ordering, native vs ordinary ---------------------

#[test]
fn old_servers_get_ordinary_containers_placed_first_with_a_wait_hook() {
    let (inj, p) = Fixture::new().old().inject(&app_pod());
    assert!(!inj.native_sidecars);
    let s = p.spec.as_ref().unwrap();
    assert_eq!(
        names(&s.containers),
        [containers::SLOT_A, containers::SLOT_B, "app"]
    );
    let a = container(&p, containers::SLOT_A);
    assert!(a.restart_policy.is_none());
    let hook = a.lifecycle.as_ref().unwrap().post_start.as_ref().unwrap();
    let cmd = hook.exec.as_ref().unwrap().command.as_ref().unwrap();
    assert_eq!(
        cmd[1..],
        ["wait-ready".to_owned(), "--timeout-secs=60".to_owned()]
    );
    assert_eq!(a.args.as_deref(), Some(&["run".to_owned()][..]));
    assert_eq!(
        annotation(&p, "kubectl.kubernetes.io/default-container"),
        Some("app")
    );
    // baton-init is the only init container.
    assert_eq!(
        names(s.init_containers.as_ref().unwrap()),
        [containers::INIT]
    );
}

#[test]
fn servers_1_29_to_1_31_get_ordinary_containers_so_an_upgrade_stays_in_place() {
    // Native sidecars exist there, but their kubelets ignore an image
    // update of one: a hot upgrade would have to evict the Pod.
    for minor in [29, 30, 31] {
        let mut f = Fixture::new();
        f.version = ServerVersion::new(1, minor);
        let (inj, p) = f.inject(&app_pod());
        assert!(!inj.native_sidecars, "1.{minor}");
        let s = p.spec.as_ref().unwrap();
        assert_eq!(
            names(&s.containers),
            [containers::SLOT_A, containers::SLOT_B, "app"],
            "1.{minor}"
        );
        assert_eq!(
            names(s.init_containers.as_ref().unwrap()),
            [containers::INIT],
            "1.{minor}"
        );
    }
}

#[test]
fn servers_from_1_32_get_native_sidecars_before_user_init_containers() {
    let mut p = app_pod();
    p.spec.as_mut().unwrap().init_containers = Some(vec![Container {
        name: "migrate".into(),
        ..Container::default()
    }]);
    let (inj, p) = Fixture::new().native().inject(&p);
    assert!(inj.native_sidecars);
    let s = p.spec.as_ref().unwrap();
    assert_eq!(
        names(s.init_containers.as_ref().unwrap()),
        [
            containers::INIT,
            containers::SLOT_A,
            containers::SLOT_B,
            "migrate"
        ]
    );
    assert_eq!(names(&s.containers), ["app"]);
    for slot in [containers::SLOT_A, containers::SLOT_B] {
        assert_eq!(
            container(&p, slot).restart_policy.as_deref(),
            Some("Always")
        );
    }
    let a = container(&p, containers::SLOT_A);
    assert!(a.startup_probe.is_some());
    assert!(a.lifecycle.is_none());
    assert!(container(&p, containers::INIT).restart_policy.is_none());
    assert_eq!(
        annotation(&p, "kubectl.kubernetes.io/default-container"),
        None
    );
}

#[test]
fn old_servers_run_user_init_containers_before_capture_starts() {
    let mut p = app_pod();
    p.spec.as_mut().unwrap().init_containers = Some(vec![Container {
        name: "fetch".into(),
        ..Container::default()
    }]);
    let (_, p) = Fixture::new().old().inject(&p);
    assert_eq!(
        names(p.spec.as_ref().unwrap().init_containers.as_ref().unwrap()),
        ["fetch", containers::INIT]
    );
}

#[test]
fn the_native_choice_can_be_forced_by_configuration() {
    let mut f = Fixture::new().old();
    f.config.native_sidecars = NativeSidecars::Always;
    assert!(f.inject(&app_pod()).0.native_sidecars);
    let mut f = Fixture::new().native();
    f.config.native_sidecars = NativeSidecars::Never;
    assert!(!f.inject(&app_pod()).0.native_sidecars);
}

#[test]
fn a_release_without_empty_image_gets_only_the_active_slot() {
    let mut f = Fixture::new();
    let mut r = (*release("recreate", json!({}))).clone();
    r.spec.empty_image = None;
    f.releases = vec![Arc::new(r)];
    let (_, p) = f.inject(&app_pod());
    assert_eq!(
        names(&p.spec.as_ref().unwrap().containers),
        [containers::SLOT_A, "app"]
    );
}

#[test]
fn the_slots_share_the_handoff_volume_and_the_identity_token() {
    let (_, p) = Fixture::new().inject(&app_pod());
    let vols = p.spec.as_ref().unwrap().volumes.as_ref().unwrap();
    let shared = vols.iter().find(|v| v.name == volumes::SHARED).unwrap();
    assert!(shared.empty_dir.is_some());
    let token = vols.iter().find(|v| v.name == volumes::TOKEN).unwrap();
    let proj = &token.projected.as_ref().unwrap().sources.as_ref().unwrap()[0];
    let sat = proj.service_account_token.as_ref().unwrap();
    assert_eq!(sat.audience.as_deref(), Some(volumes::TOKEN_AUDIENCE));
    assert_eq!(sat.path, volumes::TOKEN_FILE);
    for slot in [containers::SLOT_A, containers::SLOT_B] {
        let mounts = container(&p, slot).volume_mounts.clone().unwrap();
        assert!(
            mounts
                .iter()
                .any(|m| m.name == volumes::SHARED && m.mount_path == volumes::SHARED_MOUNT_PATH)
        );
        assert!(
            mounts
                .iter()
                .any(|m| m.name == volumes::TOKEN && m.read_only == Some(true))
        );
    }
    assert_eq!(
        env_of(container(&p, containers::SLOT_A), env::SLOT),
        Some("a")
    );
    assert_eq!(
        env_of(container(&p, containers::SLOT_B), env::SLOT),
        Some("b")
    );
    assert_eq!(
        container(&p, containers::SLOT_B).image.as_deref(),
        Some("baton/empty:1")
    );
}

#[test]
fn the_active_slot_exposes_the_admin_port_and_probes() {
    let (_, p) = Fixture::new().inject(&app_pod());
    let a = container(&p, containers::SLOT_A);
    let port = &a.ports.as_ref().unwrap()[0];
    assert_eq!(port.container_port, i32::from(ports::ADMIN));
    assert_eq!(port.name.as_deref(), Some(ports::ADMIN_NAME));
    let ready = a
        .readiness_probe
        .as_ref()
        .unwrap()
        .http_get
        .as_ref()
        .unwrap();
    assert_eq!(ready.path.as_deref(), Some("/ready"));
    let live = a
        .liveness_probe
        .as_ref()
        .unwrap()
        .http_get
        .as_ref()
        .unwrap();
    assert_eq!(live.path.as_deref(), Some("/live"));
    assert_eq!(
        live.port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(15020)
    );
}

#[test]
fn sidecars_run_non_root_with_a_read_only_root_and_no_capabilities() {
    let (_, p) = Fixture::new().inject(&app_pod());
    for slot in [containers::SLOT_A, containers::SLOT_B] {
        let c = container(&p, slot);
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.run_as_user, Some(SIDECAR_UID));
        assert_eq!(sc.run_as_non_root, Some(true));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(caps(c), (vec![], vec!["ALL".to_owned()]));
    }
}

#[test]
fn both_slots_ask_the_old_process_to_idle_after_a_handoff() {
    let (_, p) = Fixture::new().inject(&app_pod());
    for (slot, name) in [("a", containers::SLOT_A), ("b", containers::SLOT_B)] {
        let c = container(&p, name);
        assert_eq!(env_of(c, env::IDLE_AFTER_HANDOFF), Some("1"), "{name}");
        assert_eq!(env_of(c, env::SLOT), Some(slot), "{name}");
    }
}

#[test]
fn a_new_pod_gets_the_version_the_release_names_now() {
    // A rollout in progress (or a rollback) changes spec.version: pods
    // created from then on start on it, whatever their siblings run.
    let mut f = Fixture::new();
    f.releases = vec![release(
        "r",
        json!({"version": "0.9.0", "image": "baton/sidecar:0.9.0"}),
    )];
    let (inj, p) = f.inject(&app_pod());
    assert_eq!(inj.version, "0.9.0");
    assert_eq!(annotation(&p, annotations::VERSION), Some("0.9.0"));
    assert_eq!(annotation(&p, annotations::ACTIVE_SLOT), Some("a"));
    assert_eq!(
        container(&p, containers::SLOT_A).image.as_deref(),
        Some("baton/sidecar:0.9.0")
    );
    assert_eq!(
        container(&p, containers::SLOT_B).image.as_deref(),
        Some("baton/empty:1")
    );
}

#[test]
fn both_slots_carry_the_release_s_requests_and_limits() {
    // Whichever slot serves after an upgrade has what the release asks
    // for: Kubernetes 1.20 cannot resize a container in place.
    let (_, p) = Fixture::new().inject(&app_pod());
    let a = container(&p, containers::SLOT_A).resources.clone().unwrap();
    let b = container(&p, containers::SLOT_B).resources.clone().unwrap();
    assert_eq!(a.requests.as_ref().unwrap()["cpu"].0, "100m");
    assert_eq!(a.limits.as_ref().unwrap()["memory"].0, "256Mi");
    assert_eq!(a, b);
}

#[test]
fn a_release_without_resources_gets_the_configured_defaults() {
    let mut f = Fixture::new();
    let mut r = (*release("r", json!({}))).clone();
    r.spec.resources = None;
    f.releases = vec![Arc::new(r)];
    let (_, p) = f.inject(&app_pod());
    let a = container(&p, containers::SLOT_A).resources.clone().unwrap();
    assert_eq!(a, f.config.default_resources);
}

// ---- capture ------------------------------------------------------------------

#[test]
fn transparent_capture_adds_the_only_privileged_container() {
    let (inj, p) = Fixture::new().inject(&app_pod());
    assert_eq!(inj.capture, CaptureMode::Transparent);
    let init = container(&p, containers::INIT);
    assert_eq!(init.args.as_deref(), Some(&["init".to_owned()][..]));
    assert_eq!(init.image.as_deref(), Some("baton/sidecar:1.2.0"));
    let (add, drop) = caps(init);
    assert_eq!(add, ["NET_ADMIN", "NET_RAW"]);
    assert_eq!(drop, ["ALL"]);
    assert_eq!(
        init.security_context.as_ref().unwrap().run_as_non_root,
        Some(false)
    );
    assert_eq!(
        annotation(&p, annotations::CAPTURE_MODE),
        Some("transparent")
    );
    // Nobody else gets NET_ADMIN.
    for c in &p.spec.as_ref().unwrap().containers {
        if let Some(sc) = &c.security_context {
            let add = sc
                .capabilities
                .as_ref()
                .and_then(|c| c.add.clone())
                .unwrap_or_default();
            assert!(!add.iter().any(|c| c == "NET_ADMIN"), "{}", c.name);
        }
    }
}

#[test]
fn exclusions_come_from_annotations_and_always_spare_the_admin_port() {
    let mut p = app_pod();
    let a = p.metadata.annotations.as_mut().unwrap();
    a.insert(
        annotations::EXCLUDE_INBOUND_PORTS.into(),
        "8081, 9090".into(),
    );
    a.insert(annotations::EXCLUDE_OUTBOUND_PORTS.into(), "5432".into());
    a.insert(
        annotations::EXCLUDE_OUTBOUND_CIDRS.into(),
        "10.0.0.0/8,fd00::/8".into(),
    );
    let (_, p) = Fixture::new().inject(&p);
    let init = container(&p, containers::INIT);
    assert_eq!(
        env_of(init, env::EXCLUDE_INBOUND_PORTS),
        Some("8081,9090,15020")
    );
    assert_eq!(env_of(init, env::EXCLUDE_OUTBOUND_PORTS), Some("5432"));
    assert_eq!(
        env_of(init, env::EXCLUDE_OUTBOUND_CIDRS),
        Some("10.0.0.0/8,fd00::/8")
    );
}

#[test]
fn malformed_exclusions_are_refused_with_the_offending_value() {
    for (key, value, needle) in [
        (annotations::EXCLUDE_INBOUND_PORTS, "80,http", "\"http\""),
        (annotations::EXCLUDE_OUTBOUND_PORTS, "70000", "\"70000\""),
        (annotations::EXCLUDE_OUTBOUND_PORTS, "0", "\"0\""),
        (
            annotations::EXCLUDE_OUTBOUND_CIDRS,
            "10.0.0.0/33",
            "\"10.0.0.0/33\"",
        ),
        (
            annotations::EXCLUDE_OUTBOUND_CIDRS,
            "10.0.0.1",
            "\"10.0.0.1\"",
        ),
    ] {
        let mut p = app_pod();
        p.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(key.into(), value.into());
        let d = Fixture::new().deny(&p);
        assert_eq!(d.reason, DenialReason::InvalidAnnotation);
        assert!(
            d.message.contains(key) && d.message.contains(needle),
            "{}",
            d.message
        );
    }
}

#[test]
fn explicit_capture_sets_env_on_every_app_container_and_no_init_container() {
    let mut p = app_pod();
    p.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(annotations::CAPTURE_MODE.into(), "explicit".into());
    let spec = p.spec.as_mut().unwrap();
    spec.containers.push(Container {
        name: "worker".into(),
        env: Some(vec![
            spec::env_value("HTTP_PROXY", "http://corp-proxy:3128"),
            spec::env_value("X", "1"),
        ]),
        ..Container::default()
    });
    let (inj, p) = Fixture::new().inject(&p);
    assert_eq!(inj.capture, CaptureMode::Explicit);
    assert!(p.spec.as_ref().unwrap().init_containers.is_none());
    let app = container(&p, "app");
    assert_eq!(env_of(app, env::OUTBOUND_PROXY), Some("127.0.0.1:15001"));
    assert_eq!(env_of(app, env::HTTP_PROXY), Some("http://127.0.0.1:15001"));
    let worker = container(&p, "worker");
    // The user's own HTTP_PROXY is kept; the missing var is appended.
    assert_eq!(
        env_of(worker, env::HTTP_PROXY),
        Some("http://corp-proxy:3128")
    );
    assert_eq!(env_of(worker, env::OUTBOUND_PROXY), Some("127.0.0.1:15001"));
    assert_eq!(env_of(worker, "X"), Some("1"));
    assert_eq!(annotation(&p, annotations::CAPTURE_MODE), Some("explicit"));
}

#[test]
fn the_default_capture_mode_is_configurable() {
    let mut f = Fixture::new();
    f.config.default_capture = CaptureMode::Explicit;
    let (inj, _) = f.inject(&app_pod());
    assert_eq!(inj.capture, CaptureMode::Explicit);
}

#[test]
fn an_unknown_capture_mode_is_refused() {
    let mut p = app_pod();
    p.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(annotations::CAPTURE_MODE.into(), "magic".into());
    let d = Fixture::new().deny(&p);
    assert_eq!(d.reason, DenialReason::InvalidAnnotation);
    assert!(d.message.contains("\"magic\""), "{}", d.message);
}

// ---- metadata maps and lists that are absent or present ---------------------------

#[test]
fn absent_annotation_and_label_maps_are_added_whole() {
    let p = pod(
        json!({"metadata": {"generateName": "web-"}, "spec": {"containers": [{"name": "app"}]}}),
    );
    let (inj, patched) = Fixture::new().inject(&p);
    let paths: Vec<String> = inj.patch.0.iter().map(|op| op.path().to_string()).collect();
    assert!(
        paths.contains(&"/metadata/annotations".to_owned()),
        "{paths:?}"
    );
    assert!(paths.contains(&"/metadata/labels".to_owned()), "{paths:?}");
    assert!(paths.contains(&"/spec/volumes".to_owned()), "{paths:?}");
    assert!(
        paths.contains(&"/spec/initContainers".to_owned()),
        "{paths:?}"
    );
    assert_eq!(
        patched.metadata.labels.as_ref().unwrap()[labels::INJECTED],
        "true"
    );
    assert_eq!(annotation(&patched, annotations::ACTIVE_SLOT), Some("a"));
}

#[test]
fn present_maps_get_one_escaped_entry_each_and_keep_user_entries() {
    let (inj, p) = Fixture::new().inject(&app_pod());
    let paths: Vec<String> = inj.patch.0.iter().map(|op| op.path().to_string()).collect();
    assert!(
        paths.contains(&"/metadata/annotations/baton.dev~1status".to_owned()),
        "{paths:?}"
    );
    assert_eq!(annotation(&p, "team"), Some("a"));
    assert_eq!(p.metadata.labels.as_ref().unwrap()["app"], "web");
}

#[test]
fn existing_volumes_are_kept_and_ours_appended() {
    let mut p = app_pod();
    p.spec.as_mut().unwrap().volumes = Some(vec![
        serde_json::from_value(json!({"name": "data", "emptyDir": {}})).unwrap(),
    ]);
    let (_, p) = Fixture::new().inject(&p);
    let names: Vec<&str> = p
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(
        names,
        ["data", volumes::SHARED, volumes::TOKEN, volumes::TRUST]
    );
}

#[test]
fn every_annotation_the_operator_reads_is_recorded() {
    let (inj, p) = Fixture::new().inject(&app_pod());
    assert_eq!(annotation(&p, annotations::RELEASE), Some("default"));
    assert_eq!(annotation(&p, annotations::VERSION), Some("1.2.0"));
    assert_eq!(
        annotation(&p, annotations::CONFIG_HASH),
        Some(inj.config_hash.as_str())
    );
    assert_eq!(inj.config_hash.len(), 16);
    assert_eq!(annotation(&p, annotations::ACTIVE_SLOT), Some("a"));
    assert_eq!(annotation(&p, annotations::STATUS), Some("injected"));
    assert_eq!(annotation(&p, annotations::OFFLOAD), Some("disabled"));
}

#[test]
fn the_config_hash_changes_with_the_injected_spec() {
    let f = Fixture::new();
    let (a, _) = f.inject(&app_pod());
    let mut g = Fixture::new();
    g.releases = vec![release("default", json!({"image": "baton/sidecar:1.2.1"}))];
    let (b, _) = g.inject(&app_pod());
    assert_ne!(a.config_hash, b.config_hash);
}

// ---- collisions --------------------------------------------------------------------

#[test]
fn a_user_container_with_a_reserved_name_is_refused() {
    for name in [containers::SLOT_A, containers::SLOT_B, containers::INIT] {
        let mut p = app_pod();
        p.spec.as_mut().unwrap().containers.push(Container {
            name: name.into(),
            ..Container::default()
        });
        let d = Fixture::new().deny(&p);
        assert_eq!(d.reason, DenialReason::ReservedName);
        assert!(d.message.contains(name), "{}", d.message);
    }
    let mut p = app_pod();
    p.spec.as_mut().unwrap().init_containers = Some(vec![Container {
        name: containers::INIT.into(),
        ..Container::default()
    }]);
    assert_eq!(Fixture::new().deny(&p).reason, DenialReason::ReservedName);
}

#[test]
fn a_user_volume_with_a_reserved_name_is_refused() {
    let mut p = app_pod();
    p.spec.as_mut().unwrap().volumes = Some(vec![
        serde_json::from_value(json!({"name": volumes::TOKEN, "emptyDir": {}})).unwrap(),
    ]);
    let d = Fixture::new().deny(&p);
    assert_eq!(d.reason, DenialReason::ReservedName);
    assert!(d.message.contains(volumes::TOKEN), "{}", d.message);
}

#[test]
fn a_pod_without_spec_is_refused_not_half_injected() {
    let p = pod(json!({"metadata": {"name": "x"}}));
    assert_eq!(Fixture::new().deny(&p).reason, DenialReason::NoSpec);
}

// ---- QAT offload ---------------------------------------------------------------------

fn qat_fixture(mode: &str, pools: Vec<Arc<AcceleratorPool>>, nodes: Vec<Arc<Node>>) -> Fixture {
    let mut f = Fixture::new();
    f.policies = vec![policy(
        "apps",
        "tls",
        json!({"matchLabels": {"app": "web"}}),
        json!({"mode": mode}),
    )];
    f.pools = pools;
    f.nodes = nodes;
    f
}

#[test]
fn qat_is_granted_from_node_allocatable_when_the_pool_has_no_status_yet() {
    let f = qat_fixture(
        "Preferred",
        vec![pool("qat", json!(null))],
        vec![node("n1", Some("4"))],
    );
    let (inj, p) = f.inject(&app_pod());
    assert!(matches!(inj.offload, Offload::Granted { devices: 1, .. }));
    let a = container(&p, containers::SLOT_A);
    let limits = a.resources.as_ref().unwrap().limits.as_ref().unwrap();
    assert_eq!(limits["qat.intel.com/cy"].0, "1");
    assert_eq!(caps(a).0, ["IPC_LOCK"]);
    assert_eq!(env_of(a, env::OFFLOAD_ENGINE), Some("openssl"));
    assert_eq!(env_of(a, env::OFFLOAD_MODE), Some("Preferred"));
    assert_eq!(annotation(&p, annotations::OFFLOAD), Some("qat"));
    assert_eq!(annotation(&p, annotations::ACCELERATOR_POOL), Some("qat"));
    assert_eq!(annotation(&p, annotations::OFFLOAD_GRANT), Some("req-this"));
    // The standby slot gets the same: its own device, the capability, the
    // engine and the mode, so a sidecar upgraded into it signs with a
    // device too.
    let b = container(&p, containers::SLOT_B);
    assert_eq!(env_of(b, env::OFFLOAD_ENGINE), Some("openssl"));
    assert_eq!(env_of(b, env::OFFLOAD_MODE), Some("Preferred"));
    assert_eq!(b.resources, a.resources);
    assert_eq!(caps(b).0, ["IPC_LOCK"]);
    assert_eq!(inj.offload.total_devices(), 2);
}

#[test]
fn a_node_with_one_free_device_cannot_hold_both_slots_of_a_required_pod() {
    let one_free = json!({"capacity": 3, "allocated": 2, "nodes": [{"node": "n1", "capacity": 3, "allocated": 2}]});
    let f = qat_fixture(
        "Required",
        vec![pool("qat", one_free)],
        vec![node("n1", Some("3"))],
    );
    let denial = f.deny(&app_pod());
    assert_eq!(denial.reason, DenialReason::OffloadUnavailable);
    assert!(
        denial.message.contains("2 free device(s)"),
        "{}",
        denial.message
    );
}

#[test]
fn qat_capacity_comes_from_the_pool_status_once_the_operator_writes_it() {
    let full = json!({"capacity": 4, "allocated": 4, "nodes": [{"node": "n1", "capacity": 4, "allocated": 4}]});
    let f = qat_fixture(
        "Preferred",
        vec![pool("qat", full)],
        vec![node("n1", Some("4"))],
    );
    let (inj, _) = f.inject(&app_pod());
    assert!(
        matches!(inj.offload, Offload::Fallback { .. }),
        "{:?}",
        inj.offload
    );
}

#[test]
fn exhausted_preferred_offload_falls_back_with_an_annotation_and_no_device() {
    let full = json!({"capacity": 2, "allocated": 2, "nodes": [{"node": "n1", "capacity": 2, "allocated": 2}]});
    let f = qat_fixture(
        "Preferred",
        vec![pool("qat", full)],
        vec![node("n1", Some("2"))],
    );
    let (inj, p) = f.inject(&app_pod());
    let Offload::Fallback { reason, pool } = &inj.offload else {
        panic!("{:?}", inj.offload)
    };
    assert!(reason.contains("0 free"), "{reason}");
    assert_eq!(pool.as_deref(), Some("qat"));
    // The pool is recorded so its status counts the fallback.
    assert_eq!(annotation(&p, annotations::ACCELERATOR_POOL), Some("qat"));
    assert_eq!(
        annotation(&p, annotations::OFFLOAD),
        Some("software-fallback")
    );
    assert!(annotation(&p, annotations::OFFLOAD_FALLBACK_REASON).is_some());
    let a = container(&p, containers::SLOT_A);
    assert!(
        !a.resources
            .as_ref()
            .unwrap()
            .limits
            .as_ref()
            .unwrap()
            .contains_key("qat.intel.com/cy")
    );
    assert!(caps(a).0.is_empty());
    assert_eq!(env_of(a, env::OFFLOAD_ENGINE), Some("software"));
}

#[test]
fn required_offload_without_capacity_is_a_clear_denial() {
    let f = qat_fixture(
        "Required",
        vec![pool("qat", json!(null))],
        vec![node("n1", None)],
    );
    let d = f.deny(&app_pod());
    assert_eq!(d.reason, DenialReason::OffloadUnavailable);
    assert!(
        d.message
            .contains("TlsPolicy tls requires private-key offload"),
        "{}",
        d.message
    );
    assert!(d.reason.wants_event());
}

#[test]
fn required_offload_without_any_pool_is_a_clear_denial() {
    let f = qat_fixture("Required", vec![], vec![]);
    let d = f.deny(&app_pod());
    assert!(
        d.message
            .contains("no AcceleratorPool has resourceName qat.intel.com/cy"),
        "{}",
        d.message
    );
}

#[test]
fn nodes_outside_the_pool_selector_do_not_count() {
    let mut other: Node = (*node("n2", Some("8"))).clone();
    other.metadata.labels = Some(BTreeMap::new());
    let f = qat_fixture(
        "Required",
        vec![pool("qat", json!(null))],
        vec![Arc::new(other)],
    );
    assert_eq!(f.deny(&app_pod()).reason, DenialReason::OffloadUnavailable);
}

#[test]
fn a_policy_that_does_not_select_the_pod_or_lives_elsewhere_is_ignored() {
    let mut f = qat_fixture("Required", vec![], vec![]);
    f.policies = vec![
        policy(
            "apps",
            "db-only",
            json!({"matchLabels": {"app": "db"}}),
            json!({"mode": "Required"}),
        ),
        policy("other", "tls", json!({}), json!({"mode": "Required"})),
    ];
    let (inj, _) = f.inject(&app_pod());
    assert_eq!(inj.offload, Offload::Disabled);
}

#[test]
fn a_pod_already_bound_to_a_node_only_counts_that_node() {
    let mut p = app_pod();
    p.spec.as_mut().unwrap().node_name = Some("n2".into());
    let f = qat_fixture(
        "Required",
        vec![pool("qat", json!(null))],
        vec![node("n1", Some("4")), node("n2", None)],
    );
    assert_eq!(f.deny(&p).reason, DenialReason::OffloadUnavailable);
    let mut p = app_pod();
    p.spec.as_mut().unwrap().node_name = Some("n1".into());
    assert!(matches!(f.inject(&p).0.offload, Offload::Granted { .. }));
}

#[test]
fn granted_qat_keeps_the_release_resources() {
    let f = qat_fixture(
        "Required",
        vec![pool("qat", json!(null))],
        vec![node("n1", Some("2"))],
    );
    let (_, p) = f.inject(&app_pod());
    let r = container(&p, containers::SLOT_A).resources.clone().unwrap();
    assert_eq!(r.requests.unwrap()["cpu"].0, "100m");
    assert_eq!(r.limits.unwrap()["memory"].0, "256Mi");
}

#[test]
fn pending_grants_in_the_pool_status_take_free_devices() {
    let books = json!({"capacity": 2, "allocated": 1, "pending": 1,
        "nodes": [{"node": "n1", "capacity": 2, "allocated": 1}]});
    let f = qat_fixture(
        "Preferred",
        vec![pool("qat", books)],
        vec![node("n1", Some("2"))],
    );
    let (inj, _) = f.inject(&app_pod());
    assert!(
        matches!(inj.offload, Offload::Fallback { .. }),
        "{:?}",
        inj.offload
    );
}

fn grant_at(pool: &str, second: i64) -> RecentGrant {
    RecentGrant {
        id: format!("req-{pool}-{second}"),
        pool: pool.to_owned(),
        // A pod's grant: one device for each of its two slots.
        devices: 2,
        at: k8s_openapi::jiff::Timestamp::from_second(second).unwrap(),
    }
}

#[test]
fn this_replicas_recent_grants_count_until_the_books_list_them() {
    let mut f = qat_fixture(
        "Required",
        vec![pool("qat", json!(null))],
        vec![node("n1", Some("4"))],
    );
    f.recent_grants = vec![grant_at("qat", 100)];
    assert!(matches!(
        f.inject(&app_pod()).0.offload,
        Offload::Granted { .. }
    ));
    f.recent_grants = vec![grant_at("qat", 100), grant_at("qat", 101)];
    let d = f.deny(&app_pod());
    assert!(
        d.message.contains("no node with 2 free device(s)"),
        "{}",
        d.message
    );
    // Grants for another pool do not count here.
    f.recent_grants = vec![grant_at("other", 100), grant_at("other", 101)];
    assert!(matches!(
        f.inject(&app_pod()).0.offload,
        Offload::Granted { .. }
    ));
    // Books that hold a grant (here: one allocated, listed) do not count it
    // twice, however soon after the grant they were computed: the case
    // that refused a Required pod at exact capacity.
    let books = |listed: &[&str]| {
        json!({"computedAt": "1970-01-01T00:01:41.010000Z", "pending": 0,
        "recentGrants": listed,
        "nodes": [{"node": "n1", "capacity": 4, "allocated": 2}]})
    };
    f.pools = vec![pool("qat", books(&["req-qat-101"]))];
    f.recent_grants = vec![grant_at("qat", 101)];
    assert!(matches!(
        f.inject(&app_pod()).0.offload,
        Offload::Granted { .. }
    ));
    // Books that do not list it yet (computed before the pod reached the
    // operator) do not hold it: it still counts, whatever their time.
    let mut later = books(&[]);
    later["computedAt"] = json!("1970-01-01T00:02:00.000000Z");
    later["nodes"][0]["allocated"] = json!(2);
    f.pools = vec![pool("qat", later)];
    f.recent_grants = vec![grant_at("qat", 101)];
    assert_eq!(f.deny(&app_pod()).reason, DenialReason::OffloadUnavailable);
}

#[test]
fn without_a_grant_list_books_computed_after_the_grant_settled_hold_it() {
    // An operator older than this webhook writes no `recentGrants`.
    let mut f = qat_fixture(
        "Required",
        vec![pool("qat", json!(null))],
        vec![node("n1", Some("4"))],
    );
    let books = |computed: &str| {
        json!({"computedAt": computed, "pending": 2,
        "nodes": [{"node": "n1", "capacity": 4, "allocated": 0}]})
    };
    f.pools = vec![pool("qat", books("1970-01-01T00:01:42.000000Z"))];
    f.recent_grants = vec![grant_at("qat", 101)];
    assert!(matches!(
        f.inject(&app_pod()).0.offload,
        Offload::Granted { .. }
    ));
    // Books computed before the grant settled do not hold it yet.
    f.pools = vec![pool("qat", books("1970-01-01T00:01:41.100000Z"))];
    assert_eq!(f.deny(&app_pod()).reason, DenialReason::OffloadUnavailable);
}

#[test]
fn a_fallback_without_any_pool_names_none() {
    let f = qat_fixture("Preferred", vec![], vec![]);
    let (inj, p) = f.inject(&app_pod());
    assert!(
        matches!(&inj.offload, Offload::Fallback { pool: None, .. }),
        "{:?}",
        inj.offload
    );
    assert_eq!(annotation(&p, annotations::ACCELERATOR_POOL), None);
}

#[test]
fn the_slots_take_config_from_the_operator_with_the_trust_bundle_copied_into_the_pod() {
    let (_, p) = Fixture::new().inject(&app_pod());
    // The bundle as of admission, in the Pod's own annotation...
    assert_eq!(annotation(&p, annotations::TRUST_BUNDLE), Some(BUNDLE));
    // ...which a downwardAPI volume shows as the file the sidecar reads:
    // no ConfigMap of the Pod's namespace is involved.
    let vols = p.spec.as_ref().unwrap().volumes.as_ref().unwrap();
    let trust = vols.iter().find(|v| v.name == volumes::TRUST).unwrap();
    assert!(trust.config_map.is_none());
    let items = trust.downward_api.as_ref().unwrap().items.clone().unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(
        volumes::TRUST_BUNDLE_PATH,
        format!("{}/{}", volumes::TRUST_MOUNT_PATH, items[0].path)
    );
    assert_eq!(
        items[0].field_ref.as_ref().unwrap().field_path,
        format!("metadata.annotations['{}']", annotations::TRUST_BUNDLE)
    );
    for slot in [containers::SLOT_A, containers::SLOT_B] {
        let c = container(&p, slot);
        let mounts = c.volume_mounts.clone().unwrap();
        assert!(mounts.iter().any(|m| m.name == volumes::TRUST
            && m.mount_path == volumes::TRUST_MOUNT_PATH
            && m.read_only == Some(true)));
        assert_eq!(env_of(c, env::CONFIG_PUSH), Some("true"));
        assert_eq!(
            env_of(c, env::CONTROL_PLANE_CA),
            Some(volumes::TRUST_BUNDLE_PATH)
        );
        // Where a slot keeps the newest bundle it learns, for the next
        // process: on the volume both slots share.
        assert_eq!(env_of(c, env::TRUST_STATE), Some(volumes::TRUST_STATE_FILE));
        assert!(volumes::TRUST_STATE_FILE.starts_with(volumes::SHARED_MOUNT_PATH));
        assert!(mounts.iter().any(|m| m.name == volumes::SHARED
            && m.mount_path == volumes::SHARED_MOUNT_PATH
            && m.read_only != Some(true)));
    }
    let mut fx = Fixture::new();
    fx.config.config_push = false;
    let (_, p) = fx.inject(&app_pod());
    assert_eq!(
        env_of(container(&p, containers::SLOT_A), env::CONFIG_PUSH),
        Some("false")
    );
}

#[test]
fn without_a_published_trust_bundle_an_opted_in_pod_is_refused_saying_why() {
    let mut f = Fixture::new();
    f.trust_bundle = None;
    let denial = f.run(&app_pod()).unwrap_err();
    assert_eq!(denial.reason, DenialReason::NoTrustBundle);
    assert!(denial.reason.wants_event());
    for part in [
        "apps/web-1",
        "trust bundle",
        "ConfigMap baton-system/baton-mesh-trust",
        "baton-operator",
    ] {
        assert!(denial.message.contains(part), "{part}: {}", denial.message);
    }
    // A Pod that did not opt in is not the bundle's business.
    let mut pod = app_pod();
    pod.metadata.labels.as_mut().unwrap().insert(
        labels::INJECT.to_owned(),
        labels::INJECT_DISABLED.to_owned(),
    );
    assert!(matches!(f.run(&pod), Ok(Outcome::Skipped(_))));
    // Sidecars that take no config from the operator need no bundle.
    f.config.config_push = false;
    let (_, p) = f.inject(&app_pod());
    assert_eq!(annotation(&p, annotations::TRUST_BUNDLE), None);
}

fn secret_policy(name: &str, selector: Value, secret: &str) -> Arc<TlsPolicy> {
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "TlsPolicy",
            "metadata": {"name": name, "namespace": "apps"},
            "spec": {"podSelector": selector,
                     "certificate": {"source": "Secret", "secretRef": {"name": secret}}},
        }))
        .unwrap(),
    )
}

#[test]
fn a_secret_certificate_is_mounted_read_only_into_both_slots_and_nothing_else() {
    use baton_crds::contract::volumes;
    let mut f = Fixture::new();
    f.releases = vec![release("default", json!({"emptyImage": "baton/empty:1"}))];
    f.policies = vec![secret_policy(
        "web-cert",
        json!({"matchLabels": {"app": "web"}}),
        "web-tls",
    )];
    let (_, p) = f.inject(&app_pod());
    let spec = p.spec.as_ref().unwrap();
    let vol = spec
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == volumes::TLS_SECRET)
        .expect("the Secret's volume");
    let secret = vol.secret.as_ref().unwrap();
    assert_eq!(secret.secret_name.as_deref(), Some("web-tls"));
    assert_eq!(
        secret.optional,
        Some(true),
        "a missing Secret never blocks the app"
    );
    for slot in [containers::SLOT_A, containers::SLOT_B] {
        let m = container(&p, slot)
            .volume_mounts
            .as_ref()
            .unwrap()
            .iter()
            .find(|m| m.name == volumes::TLS_SECRET)
            .unwrap_or_else(|| panic!("{slot} mounts the Secret"));
        assert_eq!(m.mount_path, volumes::TLS_SECRET_MOUNT_PATH);
        assert_eq!(m.read_only, Some(true));
    }
    let app = container(&p, "app");
    assert!(
        app.volume_mounts
            .iter()
            .flatten()
            .all(|m| m.name != volumes::TLS_SECRET),
        "the application never sees the key"
    );
}

#[test]
fn pods_a_secret_policy_does_not_select_get_no_secret_volume() {
    use baton_crds::contract::volumes;
    let mut f = Fixture::new();
    f.policies = vec![
        secret_policy("other", json!({"matchLabels": {"app": "db"}}), "db-tls"),
        // A Mesh policy selecting the pod mounts nothing either.
        policy(
            "apps",
            "web",
            json!({"matchLabels": {"app": "web"}}),
            json!({"mode": "Disabled"}),
        ),
    ];
    let (_, p) = f.inject(&app_pod());
    let spec = p.spec.as_ref().unwrap();
    assert!(
        spec.volumes
            .iter()
            .flatten()
            .all(|v| v.name != volumes::TLS_SECRET)
    );
    assert!(
        container(&p, containers::SLOT_A)
            .volume_mounts
            .iter()
            .flatten()
            .all(|m| m.name != volumes::TLS_SECRET)
    );
}
