//! Installing Baton the way a user does: `kubectl apply -f manifests/crds/`,
//! then the install set through the e2e overlay, server-side (with
//! `--validate=false`, which kubectl needs against a 1.20 server because its
//! OpenAPI does not know `x-kubernetes-validations`). The CRDs'
//! schemas are enforced by the 1.20 API server (OpenAPI validation only:
//! 1.20 drops `x-kubernetes-validations`, those rules are the validating
//! webhook's job there) and `kubectl get` shows their printer columns.
//!
//! The `install_*` tests check what that install runs: the operator and
//! webhook Deployments' four Pods Ready and no Baton process on the host, a
//! labelled namespace's Pods injected through the webhook's Service (and how
//! the API server resolved it), the operator Pod that leads writing release
//! status, and one CA behind both webhook Pods.
//!
//! `#[ignore]`d: run with `e2e/run.sh`.

use std::path::PathBuf;
use std::time::Duration;

use baton_crds::contract::{self, containers, env as env_names, labels, webhook as webhook_names};
use baton_e2e::install::{self as baton, OPERATOR_CLUSTER_IP};
use baton_e2e::{Check, kubectl, kubectl_ok, rejects, wait_for, with_temp_ns};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use kube::{Api, Client, ResourceExt};
use rustls_pki_types::pem::PemObject as _;
use serde_json::json;

/// Where the install set's overlay for this cluster lives.
const OVERLAY: &str = "e2e/overlay";
/// Field manager of every apply the harness and the tests do.
const FIELD_MANAGER: &str = "baton-e2e-install";

/// The `.yaml` files of `manifests/<sub>`, sorted; never none.
fn manifest_files(sub: &str) -> Vec<PathBuf> {
    let dir = baton_e2e::cluster::repo_root().join("manifests").join(sub);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in {}", dir.display());
    files
}

fn crd_files() -> Vec<PathBuf> {
    manifest_files("crds")
}

fn read_crd(path: &PathBuf) -> CustomResourceDefinition {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Applies the CRDs like a user and waits until each is Established.
async fn apply_crds(client: &Client) -> Vec<CustomResourceDefinition> {
    // kubectl validates client-side against the server's OpenAPI; 1.20's
    // does not know `x-kubernetes-validations`, so a 1.20 user must pass
    // --validate=false (the server then drops the CEL rules).
    kubectl_ok(&["apply", "--validate=false", "-f", "manifests/crds/"]);
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut crds = Vec::new();
    for path in crd_files() {
        let crd = read_crd(&path);
        let name = crd.metadata.name.clone().expect("CRD name");
        let established = wait_for(
            &format!("CRD {name} Established"),
            Duration::from_secs(30),
            || async {
                match api.get_opt(&name).await {
                    Ok(Some(c)) => {
                        let ok = c
                            .status
                            .as_ref()
                            .and_then(|s| s.conditions.as_ref())
                            .is_some_and(|cs| {
                                cs.iter()
                                    .any(|c| c.type_ == "Established" && c.status == "True")
                            });
                        if ok {
                            Check::Done(c)
                        } else {
                            Check::NotYet(format!("{:?}", c.status))
                        }
                    }
                    other => Check::NotYet(format!("{other:?}")),
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        crds.push(established);
    }
    crds
}

fn api_resource(crd: &CustomResourceDefinition) -> ApiResource {
    let version = &crd
        .spec
        .versions
        .iter()
        .find(|v| v.storage)
        .expect("a storage version")
        .name;
    let gvk = GroupVersionKind::gvk(&crd.spec.group, version, &crd.spec.names.kind);
    ApiResource::from_gvk_with_plural(&gvk, &crd.spec.names.plural)
}

fn dynamic_api(client: &Client, crd: &CustomResourceDefinition, ns: &str) -> Api<DynamicObject> {
    let ar = api_resource(crd);
    if crd.spec.scope == "Namespaced" {
        Api::namespaced_with(client.clone(), ns, &ar)
    } else {
        Api::all_with(client.clone(), &ar)
    }
}

/// A minimal valid spec per kind (what a user would write first).
fn valid_spec(kind: &str) -> serde_json::Value {
    match kind {
        "SidecarRelease" => json!({
            "image": "docker.io/baton/sidecar:e2e",
            "emptyImage": "docker.io/baton/empty:e2e",
            "version": "1.2.3"
        }),
        "Route" => json!({
            "parentRef": {"name": "web", "port": 8080},
            "rules": [{"backendRefs": [{"name": "web-v1", "port": 8080}]}]
        }),
        "TlsPolicy" => json!({"podSelector": {}}),
        "AcceleratorPool" => json!({}),
        "AuthorizationPolicy" => json!({
            "podSelector": {},
            "rules": [{"from": {"authenticated": true}}]
        }),
        other => panic!("no example spec for new kind {other}: add one to e2e/tests/install.rs"),
    }
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn crds_apply_and_kubectl_get_shows_their_printer_columns() {
    // Creating Baton objects goes through the validating webhook
    // (failurePolicy: Fail), so this test needs it running.
    baton_e2e::cluster::require_component("webhook");
    with_temp_ns(|client, ns| async move {
        let crds = apply_crds(&client).await;
        assert!(crds.iter().all(|c| c.spec.group == contract::GROUP));
        for crd in &crds {
            let kind = &crd.spec.names.kind;
            let api = dynamic_api(&client, crd, &ns);
            // Cluster-scoped objects outlive the namespace: name them after it.
            let name = format!("{ns}-{}", kind.to_lowercase());
            let obj = DynamicObject::new(&name, &api_resource(crd))
                .data(json!({"spec": valid_spec(kind)}));
            api.create(&PostParams::default(), &obj)
                .await
                .unwrap_or_else(|e| panic!("creating a valid {kind}: {e}"));

            let resource = format!("{}.{}", crd.spec.names.plural, crd.spec.group);
            // `-o wide` also shows the columns with a non-zero priority.
            let mut args = vec!["get", resource.as_str(), name.as_str(), "-o", "wide"];
            if crd.spec.scope == "Namespaced" {
                args.extend(["-n", ns.as_str()]);
            }
            let table = kubectl_ok(&args);
            let header = table.lines().next().unwrap_or_default().to_owned();
            let columns: Vec<&str> = header.split_whitespace().collect();
            let version = crd
                .spec
                .versions
                .iter()
                .find(|v| v.served)
                .expect("a served version");
            for column in version.additional_printer_columns.iter().flatten() {
                let wanted = column.name.to_uppercase();
                assert!(
                    columns.contains(&wanted.as_str()),
                    "kubectl get {resource}: column {wanted} missing from {header:?}\n{table}"
                );
            }
            assert!(table.contains(&name), "{table}");

            if crd.spec.scope != "Namespaced" {
                api.delete(&name, &DeleteParams::default())
                    .await
                    .unwrap_or_else(|e| panic!("deleting {kind} {name}: {e}"));
            }
        }
        // Printed values come from the spec: a SidecarRelease shows its version.
        let release = crds.iter().find(|c| c.spec.names.kind == "SidecarRelease");
        if let Some(crd) = release {
            let api = dynamic_api(&client, crd, &ns);
            let name = format!("{ns}-shown");
            let obj = DynamicObject::new(&name, &api_resource(crd))
                .data(json!({"spec": valid_spec("SidecarRelease")}));
            api.create(&PostParams::default(), &obj)
                .await
                .expect("create release");
            let table = kubectl_ok(&["get", "sidecarreleases.baton.dev", &name]);
            let _ = api.delete(&name, &DeleteParams::default()).await;
            let row = table.lines().nth(1).unwrap_or_default();
            assert!(row.split_whitespace().any(|w| w == "1.2.3"), "{table}");
        }
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn crd_instances_violating_the_schema_are_refused_with_the_schema_message() {
    with_temp_ns(|client, ns| async move {
        let crds = apply_crds(&client).await;
        let by_kind = |kind: &str| {
            crds.iter()
                .find(|c| c.spec.names.kind == kind)
                .unwrap_or_else(|| panic!("no CRD of kind {kind}"))
        };
        let cases = [
            (
                "Route",
                json!({"parentRef": {"name": "web", "port": 0}, "rules": [{"backendRefs": [{"name": "web-v1", "port": 8080}]}]}),
                vec!["spec.parentRef.port", "greater than or equal to 1"],
            ),
            (
                "Route",
                json!({"parentRef": {"name": "web", "port": 8080}, "rules": []}),
                vec!["spec.rules", "should have at least 1 items"],
            ),
            (
                "SidecarRelease",
                json!({"image": "docker.io/baton/sidecar:e2e", "version": "not a version!"}),
                vec!["spec.version", "should match"],
            ),
            ("SidecarRelease", json!({"version": "1.0.0"}), vec!["spec.image", "Required value"]),
            ("TlsPolicy", json!("not-an-object"), vec!["spec", "must be of type object"]),
        ];
        for (kind, spec, needles) in cases {
            let crd = by_kind(kind);
            let api = dynamic_api(&client, crd, &ns);
            let obj = DynamicObject::new(&format!("{ns}-invalid"), &api_resource(crd)).data(json!({"spec": spec}));
            let refusal = rejects(&api, &obj).await;
            assert_eq!(refusal.code, 422, "{kind} {spec}: {refusal:?}");
            for needle in needles {
                assert!(
                    refusal.message.contains(needle),
                    "{kind} {spec}: refusal message lacks {needle:?}: {}",
                    refusal.message
                );
            }
        }
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn the_install_set_applies_server_side_dry_run_first_then_for_real() {
    let client = baton_e2e::client().await;
    apply_crds(&client).await;
    let apply = |dry_run: bool| {
        let mut args = vec![
            "apply",
            "--server-side",
            "--validate=false",
            "--field-manager",
            FIELD_MANAGER,
            "-k",
            OVERLAY,
        ];
        if dry_run {
            args.push("--dry-run=server");
        }
        kubectl_ok(&args)
    };
    let dry = apply(true);
    assert!(dry.contains("(server dry run)"), "{dry}");
    let real = apply(false);
    assert!(!real.trim().is_empty(), "apply printed nothing");

    // Every object of the rendered overlay now exists on the server.
    let rendered = kubectl_ok(&["kustomize", OVERLAY]);
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("install.yaml");
    std::fs::write(&file, &rendered).expect("write rendered overlay");
    let file_arg = file.to_string_lossy().into_owned();
    let got = kubectl(&["get", "-f", &file_arg, "-o", "name"]);
    assert!(
        got.success,
        "objects of the install set are missing:\n{}{}",
        got.stdout, got.stderr
    );
    let expected_objects =
        rendered.matches("\nkind: ").count() + usize::from(rendered.starts_with("kind: "));
    assert_eq!(
        got.stdout.lines().count(),
        expected_objects,
        "kubectl get -f listed:\n{}",
        got.stdout
    );
    // The system namespace is part of the install set.
    let ns = kubectl_ok(&["get", "namespace", contract::SYSTEM_NAMESPACE, "-o", "name"]);
    assert_eq!(
        ns.trim(),
        format!("namespace/{}", contract::SYSTEM_NAMESPACE)
    );
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn a_cel_rule_that_1_20_drops_is_enforced_by_the_validating_webhook_instead() {
    baton_e2e::cluster::require_component("webhook");
    with_temp_ns(|client, ns| async move {
        let crds = apply_crds(&client).await;
        let crd = crds
            .iter()
            .find(|c| c.spec.names.kind == "SidecarRelease")
            .expect("SidecarRelease CRD");
        // The CRD states this rule in x-kubernetes-validations, which the
        // 1.20 API server drops; the refusal comes from the webhook (403).
        let api = dynamic_api(&client, crd, &ns);
        let obj = DynamicObject::new(&format!("{ns}-no-empty"), &api_resource(crd)).data(
            json!({"spec": {
                "image": "docker.io/baton/sidecar:e2e",
                "version": "1.2.3",
                "upgrade": {"strategy": "HotUpgrade"}
            }}),
        );
        let refusal = rejects(&api, &obj).await;
        assert_eq!(refusal.code, 403, "{refusal:?}");
        assert!(
            refusal.message.contains("validate.baton.dev")
                && refusal.message.contains("emptyImage"),
            "{}",
            refusal.message
        );
        // With the empty image set, the same object is admitted.
        let mut valid = obj.clone();
        valid.data["spec"]["emptyImage"] = json!("docker.io/baton/empty:e2e");
        baton_e2e::accepts(&api, &valid).await;
    })
    .await;
}

// ---- Baton's own Pods: what `e2e/cluster.sh install` leaves running ----

/// How long Baton's Deployments may take to be whole again.
const WHOLE: Duration = Duration::from_secs(120);

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn install_runs_four_ready_baton_pods_and_no_baton_process_on_the_host() {
    baton_e2e::cluster::require_component("webhook");
    baton_e2e::cluster::require_component("operator");
    let client = baton_e2e::client().await;
    for component in ["webhook", "operator"] {
        let pods = baton::wait_whole(&client, component, WHOLE)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pods.len(), 2, "{component}: replicas as in manifests/");
        for pod in &pods {
            let spec = pod.spec.as_ref().expect("spec");
            assert_eq!(
                spec.containers[0].image.as_deref(),
                Some(baton_e2e::pods::image(component).as_str()),
                "{component} runs the locally imported image"
            );
            // The shipped hardening is what runs (the overlay does not touch it).
            let sc = spec.containers[0]
                .security_context
                .as_ref()
                .expect("securityContext");
            assert_eq!(sc.read_only_root_filesystem, Some(true));
            assert_eq!(
                spec.security_context
                    .as_ref()
                    .and_then(|s| s.run_as_non_root),
                Some(true)
            );
        }
    }
    // Every running baton-webhook / baton-operator is inside a Pod.
    let processes = baton::baton_processes(&["baton-webhook", "baton-operator"]);
    let on_host: Vec<_> = processes.iter().filter(|p| !p.in_pod).collect();
    assert!(
        on_host.is_empty(),
        "Baton processes on the host: {on_host:?}"
    );
    for binary in ["baton-webhook", "baton-operator"] {
        let in_pods = processes
            .iter()
            .filter(|p| p.in_pod && p.exe.ends_with(binary))
            .count();
        assert!(
            in_pods >= 2,
            "{binary}: {in_pods} processes in Pods: {processes:?}"
        );
    }
}

/// What the cluster made of the Dockerfile's images (e2e/images.sh builds
/// them from it): every Baton container of the install and of an injected
/// Pod is specified with a read-only root filesystem, and every Baton
/// process in a Pod (operator, webhook, the serving sidecar, the idle slot)
/// runs as a user other than root with `/` mounted read-only, as `/proc`
/// shows it. The init container alone runs as root (it programs iptables).
#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn install_baton_containers_run_as_non_root_on_a_read_only_root_filesystem() {
    use baton_e2e::rollout::{create_app, create_release, make_versions, pki, ready_pods};
    baton_e2e::cluster::require_component("webhook");
    baton_e2e::cluster::require_component("operator");
    make_versions(&["v1"], &[]).unwrap_or_else(|e| panic!("{e}"));
    let injected = std::collections::BTreeMap::from([(
        labels::INJECT.to_owned(),
        labels::INJECT_ENABLED.to_owned(),
    )]);
    baton_e2e::with_temp_ns_labelled(injected, |client, ns| async move {
        let mut specs: Vec<(String, k8s_openapi::api::core::v1::Container)> = Vec::new();
        for component in ["webhook", "operator"] {
            for pod in baton::wait_whole(&client, component, WHOLE)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
            {
                let spec = pod.spec.expect("spec");
                for c in spec.containers {
                    specs.push((component.to_owned(), c));
                }
            }
        }
        let pki = pki();
        let _release = create_release(&client, &ns, &ns, "v1", "1", None)
            .await
            .unwrap_or_else(|e| panic!("creating the release: {e}"));
        create_app(&client, &ns, &ns, &pki, 1)
            .await
            .unwrap_or_else(|e| panic!("creating the app: {e}"));
        let pods = ready_pods(&client, &ns, "v1", 1, Duration::from_secs(180))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let app = &pods[0];
        let uid = app.metadata.uid.clone().expect("uid");
        let spec = app.spec.clone().expect("spec");
        let baton_names = [containers::INIT, containers::SLOT_A, containers::SLOT_B];
        for c in spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
        {
            if baton_names.contains(&c.name.as_str()) {
                specs.push(("injected".to_owned(), c.clone()));
            }
        }
        assert_eq!(
            specs.iter().filter(|(w, _)| w == "injected").count(),
            3,
            "{specs:?}"
        );
        for (whose, c) in &specs {
            let sc = c.security_context.as_ref();
            assert_eq!(
                sc.and_then(|s| s.read_only_root_filesystem),
                Some(true),
                "{whose} container {}: {sc:?}",
                c.name
            );
        }

        // What runs: every Baton process of those Pods, from /proc.
        let processes = baton::baton_processes(&[
            "baton-webhook",
            "baton-operator",
            "baton-sidecar",
            "baton-empty",
        ]);
        let mut seen = std::collections::BTreeMap::<&str, usize>::new();
        for p in processes.iter().filter(|p| p.in_pod) {
            let binary = p.exe.rsplit('/').next().unwrap_or_default();
            let ours = match binary {
                "baton-webhook" | "baton-operator" => true,
                _ => p.in_pod_uid(&uid),
            };
            if !ours {
                continue; // another test's injected Pod
            }
            let how = baton::confinement(p.pid).unwrap_or_else(|e| panic!("{p:?}: {e}"));
            assert_ne!(
                how.euid, 0,
                "{binary} (pid {}) runs as root: {how:?}",
                p.pid
            );
            assert!(
                how.root_read_only,
                "{binary} (pid {}) has a writable root filesystem: {how:?}",
                p.pid
            );
            *seen
                .entry(match binary {
                    "baton-webhook" => "baton-webhook",
                    "baton-operator" => "baton-operator",
                    "baton-sidecar" => "baton-sidecar",
                    _ => "baton-empty",
                })
                .or_default() += 1;
        }
        // The two of each Deployment, and the app Pod's serving sidecar and
        // idle slot.
        for (binary, at_least) in [
            ("baton-webhook", 2),
            ("baton-operator", 2),
            ("baton-sidecar", 1),
            ("baton-empty", 1),
        ] {
            assert!(
                seen.get(binary).copied().unwrap_or(0) >= at_least,
                "{binary}: {seen:?} among {processes:?}"
            );
        }
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn install_injects_a_labelled_namespaces_pods_through_the_webhook_service() {
    baton_e2e::cluster::require_component("webhook");
    let scope = format!("inject-{}", rand::random::<u32>());
    let labels = baton::injected_namespace_labels(&scope);
    baton_e2e::with_temp_ns_labelled(labels, |client, ns| async move {
        let webhook_pods = baton::wait_whole(&client, "webhook", WHOLE)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        // The installed configuration calls the Service, not a URL.
        let config = Api::<MutatingWebhookConfiguration>::all(client.clone())
            .get(webhook_names::MUTATING_CONFIGURATION)
            .await
            .expect("mutating configuration");
        for hook in config.webhooks.iter().flatten() {
            let cc = &hook.client_config;
            assert!(cc.url.is_none(), "{}: {cc:?}", hook.name);
            assert_eq!(
                cc.service.as_ref().map(|s| s.name.as_str()),
                Some(webhook_names::SERVICE)
            );
            assert!(cc.ca_bundle.as_ref().is_some_and(|b| !b.0.is_empty()));
        }

        baton::create_release(&client, &ns, &scope).await;
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let created = api
            .create(&PostParams::default(), &baton::unscheduled_pod("app"))
            .await;
        baton::delete_release(&client, &ns).await;
        let created = created.expect("an injected pod is admitted");
        let spec = created.spec.as_ref().expect("spec");
        let names: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
        assert!(names.contains(&containers::SLOT_A), "{names:?}");
        assert!(names.contains(&containers::SLOT_B), "{names:?}");
        assert_eq!(
            created.labels().get(labels::INJECTED).map(String::as_str),
            Some("true"),
            "{:?}",
            created.labels()
        );
        // The control-plane address the overlay configured (no DNS here).
        let slot_a = spec
            .containers
            .iter()
            .find(|c| c.name == containers::SLOT_A)
            .expect("slot a");
        let address = slot_a
            .env
            .iter()
            .flatten()
            .find(|e| e.name == env_names::CONTROL_PLANE_ADDRESS)
            .and_then(|e| e.value.clone());
        assert_eq!(address.as_deref(), Some(OPERATOR_CLUSTER_IP));

        // How the API server reached the webhook: through the Service's
        // ClusterIP, translated by kube-proxy on the host (a conntrack entry
        // whose original destination is the ClusterIP and whose replies come
        // from a webhook Pod), not by dialling a Pod IP itself.
        let vip = baton::cluster_ip(&client, webhook_names::SERVICE).await;
        let pod_ips: Vec<std::net::IpAddr> =
            webhook_pods.iter().map(baton_e2e::wait::pod_ip).collect();
        let flows = baton::flows_to(std::net::SocketAddr::new(vip, webhook_names::PORT));
        assert!(
            flows.iter().any(|f| pod_ips.contains(&f.reply_src.ip())
                && f.reply_src.port() == webhook_names::PORT),
            "no connection to {vip}:{} answered by a webhook pod {pod_ips:?}: {flows:?}",
            webhook_names::PORT
        );
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn install_status_of_a_sidecar_release_is_written_by_the_operator_pod_that_leads() {
    baton_e2e::cluster::require_component("webhook");
    baton_e2e::cluster::require_component("operator");
    let scope = format!("status-{}", rand::random::<u32>());
    let labels = baton::injected_namespace_labels(&scope);
    baton_e2e::with_temp_ns_labelled(labels, |client, ns| async move {
        let operators = baton::wait_whole(&client, "operator", WHOLE)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        baton::create_release(&client, &ns, &scope).await;
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let outcome = async {
            for name in ["one", "two"] {
                api.create(&PostParams::default(), &baton::unscheduled_pod(name))
                    .await
                    .expect("create pod");
            }
            let status = baton::wait_release_total(&client, &ns, 2, Duration::from_secs(60))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let table = kubectl_ok(&["get", "sidecarreleases", &ns]);
            (status, table)
        }
        .await;
        let release = Api::<baton_crds::SidecarRelease>::all(client.clone())
            .get(&ns)
            .await
            .expect("release");
        baton::delete_release(&client, &ns).await;
        let (status, table) = outcome;
        assert_eq!(status.observed_generation, Some(1));
        assert!(!status.conditions.is_empty(), "{status:?}");
        let row = table.lines().nth(1).unwrap_or_default();
        assert!(row.starts_with(&ns), "{table}");
        // Written by the operator's field manager...
        let managers: Vec<String> = release
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .filter_map(|m| m.manager.clone())
            .collect();
        assert!(
            managers.iter().any(|m| m == contract::FIELD_MANAGER),
            "{managers:?}"
        );
        // ...from the operator Pod holding the Lease (its identity is its
        // Pod name).
        let holder = baton::lease_holder(&client).await.expect("a leader");
        let names: Vec<String> = operators
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        assert!(
            names.contains(&holder),
            "leader {holder} is not one of {names:?}"
        );
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn install_both_webhook_pods_serve_certificates_of_the_one_ca_in_the_bundle() {
    baton_e2e::cluster::require_component("webhook");
    let client = baton_e2e::client().await;
    let pods = baton::wait_whole(&client, "webhook", WHOLE)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let secret = Api::<Secret>::namespaced(client.clone(), contract::SYSTEM_NAMESPACE)
        .get(webhook_names::CA_SECRET)
        .await
        .expect("the CA Secret");
    let data = secret.data.expect("CA data");
    let bundle = String::from_utf8(data[webhook_names::CA_BUNDLE_KEY].0.clone()).expect("utf-8");
    let ca = String::from_utf8(data[webhook_names::CA_CERT_KEY].0.clone()).expect("utf-8");
    assert_eq!(bundle.matches("BEGIN CERTIFICATE").count(), 1, "one CA");
    assert_eq!(bundle.trim(), ca.trim());
    // The API server trusts exactly that bundle.
    let config = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get(webhook_names::MUTATING_CONFIGURATION)
        .await
        .expect("mutating configuration");
    for hook in config.webhooks.iter().flatten() {
        assert_eq!(
            hook.client_config.ca_bundle.as_ref().map(|b| b.0.clone()),
            Some(bundle.as_bytes().to_vec()),
            "{}",
            hook.name
        );
    }
    // Each Pod's serving certificate verifies against it, for the name the
    // API server dials.
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_slice_iter(bundle.as_bytes()) {
        roots.add(cert.expect("PEM")).expect("a CA certificate");
    }
    let config = std::sync::Arc::new(
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("protocols")
        .with_root_certificates(roots)
        .with_no_client_auth(),
    );
    let name = rustls_pki_types::ServerName::try_from(format!(
        "{}.{}.svc",
        webhook_names::SERVICE,
        contract::SYSTEM_NAMESPACE
    ))
    .expect("server name");
    for pod in &pods {
        let addr = std::net::SocketAddr::new(baton_e2e::wait::pod_ip(pod), webhook_names::PORT);
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        tokio_rustls::TlsConnector::from(config.clone())
            .connect(name.clone(), tcp)
            .await
            .unwrap_or_else(|e| panic!("{addr}: the serving certificate does not verify: {e}"));
    }
}

/// Deletes the cluster-scoped objects an example created, however the test
/// ends.
struct ClusterScoped(Vec<(String, String)>);

impl Drop for ClusterScoped {
    fn drop(&mut self) {
        for (kind, name) in &self.0 {
            let out = kubectl(&["delete", kind, name, "--ignore-not-found", "--wait=false"]);
            if !out.success {
                eprintln!("cannot delete {kind} {name}: {}", out.stderr);
            }
        }
    }
}

/// The condition `type_` of `object`'s status, as (status, reason).
fn condition_of(object: &serde_json::Value, type_: &str) -> Option<(String, String)> {
    object["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_owned(),
                c["reason"].as_str().unwrap_or_default().to_owned(),
            )
        })
}

/// Whether `object` (of `kind`) reached what its documentation promises a
/// valid object reaches with nothing else in the cluster: Routes Accepted,
/// ResolvedRefs and Programmed; TlsPolicies Accepted and Programmed; a
/// SidecarRelease observed and Complete; an AcceleratorPool observed with a
/// valid spec (Ready, or NoNodes where no node has its devices).
fn example_settled(kind: &str, object: &serde_json::Value) -> Result<(), String> {
    let is = |t: &str, want: &str| condition_of(object, t).is_some_and(|(s, _)| s == want);
    let observed = object["status"]["observedGeneration"] == object["metadata"]["generation"];
    let ok = match kind {
        "Route" => is("Accepted", "True") && is("ResolvedRefs", "True") && is("Programmed", "True"),
        "TlsPolicy" | "AuthorizationPolicy" => is("Accepted", "True") && is("Programmed", "True"),
        "SidecarRelease" => observed && is("Complete", "True"),
        "AcceleratorPool" => {
            observed
                && condition_of(object, "Ready")
                    .is_some_and(|(s, reason)| s == "True" || reason == "NoNodes")
        }
        other => panic!("manifests/examples/ has a {other}: teach this test what it reaches"),
    };
    if ok {
        Ok(())
    } else {
        Err(object["status"].to_string())
    }
}

#[tokio::test]
#[ignore = "needs the e2e cluster with Baton installed: run e2e/run.sh"]
async fn install_every_example_manifest_is_accepted_and_programmed() {
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    with_temp_ns(|_client, ns| async move {
        let mut objects = vec![];
        for f in &manifest_files("examples") {
            let text = std::fs::read_to_string(f).unwrap();
            for doc in baton_crds::yaml::documents(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display())) {
                objects.push((f.clone(), doc));
            }
        }
        // The Services the examples' Routes name (no Pods behind them: a
        // Route resolves against Services and their ports).
        let mut services = std::collections::BTreeMap::<String, i64>::new();
        for (_, o) in &objects {
            if o["kind"] == "Route" {
                let spec = &o["spec"];
                services.insert(spec["parentRef"]["name"].as_str().unwrap().to_owned(), spec["parentRef"]["port"].as_i64().unwrap());
                for rule in spec["rules"].as_array().into_iter().flatten() {
                    let mirror = rule["mirror"].get("backendRef").into_iter();
                    for b in rule["backendRefs"].as_array().into_iter().flatten().chain(mirror) {
                        services.insert(b["name"].as_str().unwrap().to_owned(), b["port"].as_i64().unwrap());
                    }
                }
            }
        }
        for (name, port) in &services {
            let svc = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
                             "spec": {"ports": [{"port": port}]}});
            apply_json(&svc);
        }
        let mut cleanup = ClusterScoped(vec![]);
        let mut applied = vec![];
        for (file, mut o) in objects {
            let kind = o["kind"].as_str().unwrap().to_owned();
            let name = o["metadata"]["name"].as_str().unwrap().to_owned();
            if o["metadata"].get("namespace").is_some() {
                // Into the test's namespace instead of the example's own.
                o["metadata"]["namespace"] = json!(ns);
            } else {
                cleanup.0.push((kind.to_lowercase(), name.clone()));
            }
            apply_json(&o);
            eprintln!("applied {kind} {name} from {}", file.display());
            applied.push((kind, name, o["metadata"].get("namespace").is_some()));
        }
        for (kind, name, namespaced) in &applied {
            let mut get = vec!["get".to_owned(), format!("{}.baton.dev", kind.to_lowercase()), name.clone(), "-o".into(), "json".into()];
            if *namespaced {
                get.extend(["-n".to_owned(), ns.clone()]);
            }
            wait_for(&format!("{kind} {name} settled"), Duration::from_secs(90), || async {
                let args: Vec<&str> = get.iter().map(String::as_str).collect();
                let out = kubectl(&args);
                if !out.success {
                    return Check::NotYet(out.stderr);
                }
                let object: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
                match example_settled(kind, &object) {
                    Ok(()) => Check::Done(()),
                    Err(status) => Check::NotYet(status),
                }
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        }
    })
    .await;
}

/// `kubectl apply -f -` of one object.
#[track_caller]
fn apply_json(object: &serde_json::Value) {
    let run = baton_e2e::cli::kubectl_stdin(
        &["apply", "-f", "-"],
        &object.to_string(),
        Duration::from_secs(60),
    );
    assert!(
        run.ok(),
        "kubectl apply {}: {run}",
        object["metadata"]["name"]
    );
}
