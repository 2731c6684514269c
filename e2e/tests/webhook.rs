//! The admission webhook on the real 1.20 API server: injection of a
//! Deployment's pods, opt-out, idempotent re-submission, refusal of invalid
//! Baton objects with the webhook's message, and what happens when the
//! webhook is down (`failurePolicy: Fail` for opted-in namespaces).
//!
//! Each test starts its own `baton-webhook` (the release binary that
//! `e2e/images.sh` builds) as a host process on 127.0.0.1, with its own
//! Mutating/ValidatingWebhookConfiguration pointing at it by URL and scoped
//! to the test's namespace by a label, so stopping it never disturbs other
//! tests or the shared installation. The process runs the self-managed CA:
//! it creates its CA Secret in the test namespace and patches `caBundle`
//! into its configurations itself, which these tests wait for — so the
//! certificate path is exercised end to end, not bypassed.
//!
//! `#[ignore]`d: run with `e2e/run.sh`.

use std::{
    collections::BTreeMap,
    net::{SocketAddr, TcpListener},
    path::PathBuf,
    process::Stdio,
    time::Duration,
};

use baton_crds::contract::{annotations, containers, labels, volumes, webhook as names};
use baton_e2e::{
    Check, accepts, kubectl, kubectl_ok, pods, rejects, wait_for, with_temp_ns_labelled,
};
use k8s_openapi::api::{
    admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration},
    apps::v1::Deployment,
    core::v1::Pod,
};
use kube::{
    Api, Client,
    api::{ListParams, PostParams},
};
use rand::Rng;
use serde_json::json;

/// Namespace label that scopes a test's webhook configurations.
const SCOPE_LABEL: &str = "baton.dev/e2e-webhook";

fn webhook_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("BATON_WEBHOOK_BIN") {
        return PathBuf::from(p);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| baton_e2e::cluster::repo_root().join("target"));
    let bin = target.join("release/baton-webhook");
    assert!(
        bin.exists(),
        "{} is missing: e2e/images.sh builds it (or run `cargo build --release -p baton-webhook`)",
        bin.display()
    );
    bin
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `baton-webhook` host process plus its two configurations and the
/// SidecarRelease for the test namespace. Dropping it kills the process (by
/// its PID, through the child handle) and deletes the cluster objects.
struct TestWebhook {
    id: String,
    child: Option<tokio::process::Child>,
    admin: SocketAddr,
    log: PathBuf,
    _logdir: tempfile::TempDir,
}

impl TestWebhook {
    fn mutating(&self) -> String {
        format!("baton-e2e-{}-injector", self.id)
    }
    fn validating(&self) -> String {
        format!("baton-e2e-{}-validator", self.id)
    }
    fn release(&self) -> String {
        format!("baton-e2e-{}", self.id)
    }

    async fn start(client: &Client, ns: &str, id: &str) -> Self {
        kubectl_ok(&["apply", "--validate=false", "-f", "manifests/crds/"]);
        let port = free_port();
        let admin: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let logdir = tempfile::tempdir().unwrap();
        let mut me = Self {
            id: id.to_owned(),
            child: None,
            admin,
            log: logdir.path().join("webhook.log"),
            _logdir: logdir,
        };
        me.create_configurations(client, port).await;
        me.create_release(client).await;

        let log = std::fs::File::create(&me.log).unwrap();
        let child = tokio::process::Command::new(webhook_binary())
            .env("KUBECONFIG", baton_e2e::cluster::kubeconfig_path())
            .env("RUST_LOG", "info,kube=warn")
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin-listen", &admin.to_string()])
            .args(["--namespace", ns])
            .args(["--extra-san", "127.0.0.1"])
            .args(["--mutating-configuration", &me.mutating()])
            .args(["--validating-configuration", &me.validating()])
            .args(["--image-pull-policy", "Never"])
            .args(["--ca-bundle-sync-secs", "2"])
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .expect("starting baton-webhook");
        me.child = Some(child);
        me.wait_ready(client).await;
        me.wait_wired(client, ns).await;
        me
    }

    async fn create_configurations(&self, client: &Client, port: u16) {
        let scope = json!({"matchLabels": {SCOPE_LABEL: self.id}});
        // Mirrors manifests/: Fail for opted-in namespaces, pod opt-out via
        // objectSelector, reinvocation, no side effects, short timeout.
        let mutating: MutatingWebhookConfiguration = serde_json::from_value(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": self.mutating()},
            "webhooks": [{
                "name": names::MUTATING_WEBHOOK,
                "clientConfig": {"url": format!("https://127.0.0.1:{port}{}", names::MUTATE_PODS_PATH)},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"], "scope": "Namespaced"}],
                "namespaceSelector": scope,
                "objectSelector": {"matchExpressions": [{"key": labels::INJECT, "operator": "NotIn", "values": [labels::INJECT_DISABLED]}]},
                "failurePolicy": "Fail",
                "reinvocationPolicy": "IfNeeded",
                "sideEffects": "None",
                "timeoutSeconds": 5,
                "admissionReviewVersions": ["v1"],
            }],
        }))
        .unwrap();
        let validating: ValidatingWebhookConfiguration = serde_json::from_value(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": self.validating()},
            "webhooks": [{
                "name": names::VALIDATING_WEBHOOK,
                "clientConfig": {"url": format!("https://127.0.0.1:{port}{}", names::VALIDATE_PATH)},
                // Namespaced kinds only: a namespaceSelector does not
                // scope cluster-scoped objects, and this webhook is stopped
                // by one test.
                "rules": [{"apiGroups": ["baton.dev"], "apiVersions": ["v1alpha1"], "operations": ["CREATE", "UPDATE"],
                           "resources": ["routes", "tlspolicies"], "scope": "Namespaced"}],
                "namespaceSelector": scope,
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "timeoutSeconds": 5,
                "admissionReviewVersions": ["v1"],
            }],
        }))
        .unwrap();
        Api::<MutatingWebhookConfiguration>::all(client.clone())
            .create(&PostParams::default(), &mutating)
            .await
            .unwrap();
        Api::<ValidatingWebhookConfiguration>::all(client.clone())
            .create(&PostParams::default(), &validating)
            .await
            .unwrap();
    }

    async fn create_release(&self, client: &Client) {
        let release: baton_crds::SidecarRelease = serde_json::from_value(json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease",
            "metadata": {"name": self.release()},
            "spec": {
                "version": "0.1.0-e2e",
                "image": pods::image("sidecar"),
                "emptyImage": pods::image("empty"),
                // Only this test's namespace, and ahead of any other release.
                "namespaceSelector": {"matchLabels": {SCOPE_LABEL: self.id}},
                "priority": 1000,
            },
        }))
        .unwrap();
        Api::<baton_crds::SidecarRelease>::all(client.clone())
            .create(&PostParams::default(), &release)
            .await
            .unwrap();
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Ready on the admin port (certificate + caches) and caBundle patched
    /// into both configurations.
    async fn wait_ready(&mut self, client: &Client) {
        let admin = self.admin;
        let ready = wait_for(
            "baton-webhook /ready",
            Duration::from_secs(90),
            || async move {
                match baton_e2e::admin::get(admin, "/ready").await {
                    Ok((200, _)) => Check::Done(()),
                    Ok((code, body)) => Check::NotYet(format!("{code} {body}")),
                    Err(e) => Check::NotYet(e),
                }
            },
        )
        .await;
        if let Err(e) = ready {
            panic!("{e}\nwebhook log:\n{}", self.log_tail());
        }
        let mapi: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
        let vapi: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        let (m, v) = (self.mutating(), self.validating());
        let patched = wait_for(
            "caBundle in both configurations",
            Duration::from_secs(60),
            || {
                let (mapi, vapi, m, v) = (mapi.clone(), vapi.clone(), m.clone(), v.clone());
                async move {
                    let mb = mapi
                        .get(&m)
                        .await
                        .ok()
                        .and_then(|c| c.webhooks?.first()?.client_config.ca_bundle.clone());
                    let vb = vapi
                        .get(&v)
                        .await
                        .ok()
                        .and_then(|c| c.webhooks?.first()?.client_config.ca_bundle.clone());
                    match (mb, vb) {
                        (Some(a), Some(b)) if !a.0.is_empty() && a == b => Check::Done(()),
                        other => Check::NotYet(format!("{other:?}")),
                    }
                }
            },
        )
        .await;
        if let Err(e) = patched {
            panic!("{e}\nwebhook log:\n{}", self.log_tail());
        }
    }

    /// The API server learns about new webhook configurations through an
    /// informer, so for a moment after creation it may not call this
    /// webhook yet. Dry-run a probe pod until this process has counted a
    /// `/mutate-pods` admission (bounded).
    async fn wait_wired(&self, client: &Client, ns: &str) {
        let api: Api<Pod> = Api::namespaced(client.clone(), ns);
        let probe = pods::pod("probe", vec![pods::container("app", "demo-http-echo", &[])]);
        let admin = self.admin;
        let wired = wait_for(
            "the API server calling this webhook",
            Duration::from_secs(30),
            || {
                let (api, probe) = (api.clone(), probe.clone());
                async move {
                    let dry = PostParams {
                        dry_run: true,
                        field_manager: None,
                    };
                    let created = api.create(&dry, &probe).await;
                    match baton_e2e::admin::get(admin, "/metrics").await {
                        Ok((200, m))
                            if m.contains(
                                r#"baton_webhook_admissions_total{endpoint="mutate-pods""#,
                            ) =>
                        {
                            Check::Done(())
                        }
                        other => Check::NotYet(format!(
                            "create: {:?}; metrics: {other:?}",
                            created.map(|_| ())
                        )),
                    }
                }
            },
        )
        .await;
        if let Err(e) = wired {
            panic!("{e}\nwebhook log:\n{}", self.log_tail());
        }
    }

    /// Stops the process (SIGKILL through the child handle) and reaps it.
    async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }
}

impl Drop for TestWebhook {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.start_kill();
        }
        for (kind, name) in [
            ("mutatingwebhookconfiguration", self.mutating()),
            ("validatingwebhookconfiguration", self.validating()),
            ("sidecarreleases.baton.dev", self.release()),
        ] {
            let out = kubectl(&["delete", kind, &name, "--ignore-not-found", "--wait=false"]);
            if !out.success {
                eprintln!("cleanup: deleting {kind} {name}: {}", out.stderr);
            }
        }
    }
}

fn scope_id() -> String {
    format!("{:08x}", rand::rng().random::<u32>())
}

fn opted_in(id: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (labels::INJECT.to_owned(), labels::INJECT_ENABLED.to_owned()),
        (SCOPE_LABEL.to_owned(), id.to_owned()),
    ])
}

fn names_of(cs: &[k8s_openapi::api::core::v1::Container]) -> Vec<String> {
    cs.iter().map(|c| c.name.clone()).collect()
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

/// The pod spec a 1.20 server gets: ordinary containers placed first,
/// capture init container, handoff volume and identity token.
fn assert_injected(pod: &Pod, release: &str) {
    let spec = pod.spec.as_ref().unwrap();
    let names = names_of(&spec.containers);
    assert_eq!(
        &names[..2],
        [containers::SLOT_A, containers::SLOT_B],
        "{names:?}"
    );
    assert_eq!(
        names
            .iter()
            .filter(|n| n.as_str() == containers::SLOT_A)
            .count(),
        1,
        "{names:?}"
    );
    let init = names_of(spec.init_containers.as_deref().unwrap_or_default());
    assert_eq!(init, [containers::INIT]);
    let vols: Vec<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert!(
        vols.contains(&volumes::SHARED) && vols.contains(&volumes::TOKEN),
        "{vols:?}"
    );
    assert_eq!(annotation(pod, annotations::STATUS), Some("injected"));
    assert_eq!(annotation(pod, annotations::RELEASE), Some(release));
    assert_eq!(annotation(pod, annotations::VERSION), Some("0.1.0-e2e"));
    assert_eq!(annotation(pod, annotations::ACTIVE_SLOT), Some("a"));
    assert!(annotation(pod, annotations::CONFIG_HASH).is_some());
}

#[tokio::test]
#[ignore = "needs the e2e cluster: run e2e/run.sh"]
async fn a_deployment_in_a_labelled_namespace_gets_injected_pods() {
    let id = scope_id();
    with_temp_ns_labelled(opted_in(&id), |client, ns| async move {
        let webhook = TestWebhook::start(&client, &ns, &id).await;
        let deployment: Deployment = serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {"terminationGracePeriodSeconds": 1,
                             "containers": [pods::container("app", "demo-http-echo", &["--listen", "0.0.0.0:8080"])]},
                },
            },
        }))
        .unwrap();
        Api::<Deployment>::namespaced(client.clone(), &ns)
            .create(&PostParams::default(), &deployment)
            .await
            .unwrap();
        let pods_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let created = wait_for("2 pods of Deployment web", Duration::from_secs(60), || async {
            match pods_api.list(&ListParams::default().labels("app=web")).await {
                Ok(list) if list.items.len() == 2 => Check::Done(list.items),
                other => Check::NotYet(format!("{:?}", other.map(|l| l.items.len()))),
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\nwebhook log:\n{}", webhook.log_tail()));
        for pod in &created {
            assert_injected(pod, &webhook.release());
            // The app container is untouched and last.
            let spec = pod.spec.as_ref().unwrap();
            assert_eq!(spec.containers.last().unwrap().name, "app");
            assert_eq!(annotation(pod, "kubectl.kubernetes.io/default-container"), Some("app"));
        }
        // The webhook counted the injections.
        let (_, metrics) = baton_e2e::admin::get(webhook.admin, "/metrics").await.unwrap();
        assert!(metrics.contains(r#"baton_webhook_injection_decisions_total{decision="injected"}"#), "{metrics}");
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the e2e cluster: run e2e/run.sh"]
async fn an_opted_out_pod_is_left_untouched_and_an_injected_pod_is_not_injected_twice() {
    let id = scope_id();
    with_temp_ns_labelled(opted_in(&id), |client, ns| async move {
        let webhook = TestWebhook::start(&client, &ns, &id).await;
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns);

        let mut opted_out = pods::pod("plain", vec![pods::container("app", "demo-http-echo", &[])]);
        opted_out
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert(labels::INJECT.into(), labels::INJECT_DISABLED.into());
        let admitted = accepts(&api, &opted_out).await;
        assert_eq!(
            names_of(&admitted.spec.as_ref().unwrap().containers),
            ["app"]
        );
        assert!(annotation(&admitted, annotations::STATUS).is_none());

        // Create one injected pod for real, then submit its stored spec
        // again under a new name: the webhook must leave it exactly as is.
        let pod = pods::pod(
            "meshed",
            vec![pods::container("app", "demo-http-echo", &[])],
        );
        let injected = api.create(&PostParams::default(), &pod).await.unwrap();
        assert_injected(&injected, &webhook.release());
        let mut again = injected.clone();
        again.metadata = kube::api::ObjectMeta {
            name: Some("meshed-again".into()),
            labels: injected.metadata.labels.clone(),
            annotations: injected.metadata.annotations.clone(),
            ..Default::default()
        };
        again.status = None;
        if let Some(spec) = again.spec.as_mut() {
            spec.node_name = None;
        }
        let readmitted = accepts(&api, &again).await;
        assert_eq!(
            serde_json::to_value(&readmitted.spec.as_ref().unwrap().containers).unwrap(),
            serde_json::to_value(&injected.spec.as_ref().unwrap().containers).unwrap(),
        );
        assert_eq!(
            readmitted.metadata.annotations,
            injected.metadata.annotations
        );
        let (_, metrics) = baton_e2e::admin::get(webhook.admin, "/metrics")
            .await
            .unwrap();
        assert!(
            metrics.contains(r#"decision="skip_already_injected""#),
            "{metrics}"
        );
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the e2e cluster: run e2e/run.sh"]
async fn invalid_routes_and_conflicting_tls_policies_are_refused_with_the_webhooks_message() {
    let id = scope_id();
    with_temp_ns_labelled(opted_in(&id), |client, ns| async move {
        let _webhook = TestWebhook::start(&client, &ns, &id).await;
        // All backend weights zero: the schema allows each 0, only the
        // cross-field rule (CEL on newer servers, the webhook here) refuses.
        let routes: Api<baton_crds::Route> = Api::namespaced(client.clone(), &ns);
        let route: baton_crds::Route = serde_json::from_value(json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "Route", "metadata": {"name": "zero"},
            "spec": {"parentRef": {"name": "web", "port": 80},
                     "rules": [{"backendRefs": [{"name": "web-v1", "port": 80, "weight": 0}, {"name": "web-v2", "port": 80, "weight": 0}]}]},
        }))
        .unwrap();
        let status = rejects(&routes, &route).await;
        assert!(status.message.contains("is invalid") && status.message.contains("weight"), "{}", status.message);

        let policies: Api<baton_crds::TlsPolicy> = Api::namespaced(client.clone(), &ns);
        let strict: baton_crds::TlsPolicy = serde_json::from_value(json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "TlsPolicy", "metadata": {"name": "strict"},
            "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "mtls": {"mode": "Strict"}},
        }))
        .unwrap();
        policies.create(&PostParams::default(), &strict).await.unwrap();
        // The validator reads TlsPolicies from its cache: wait until the
        // conflict is seen (bounded), then check the message.
        let loose: baton_crds::TlsPolicy = serde_json::from_value(json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "TlsPolicy", "metadata": {"name": "loose"},
            "spec": {"podSelector": {}, "mtls": {"mode": "Permissive"}},
        }))
        .unwrap();
        let message = wait_for("conflicting TlsPolicy refused", Duration::from_secs(20), || async {
            match policies.create(&PostParams { dry_run: true, field_manager: None }, &loose).await {
                Err(kube::Error::Api(s)) => Check::Done(s.message),
                other => Check::NotYet(format!("{other:?}")),
            }
        })
        .await
        .unwrap();
        assert!(message.contains("TlsPolicy") && message.contains("strict") && message.contains("mtls.mode"), "{message}");
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the e2e cluster: run e2e/run.sh"]
async fn with_the_webhook_down_opted_in_pods_are_refused_and_opted_out_pods_still_run() {
    let id = scope_id();
    with_temp_ns_labelled(opted_in(&id), |client, ns| async move {
        let mut webhook = TestWebhook::start(&client, &ns, &id).await;
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let pod = pods::pod(
            "while-down",
            vec![pods::container("app", "demo-http-echo", &[])],
        );
        accepts(&api, &pod).await;

        webhook.stop().await;
        // failurePolicy Fail: never admitted unmeshed. The API server
        // reports the failed call as an internal error (500), naming the
        // webhook.
        match api
            .create(
                &PostParams {
                    dry_run: true,
                    field_manager: None,
                },
                &pod,
            )
            .await
        {
            Err(kube::Error::Api(status)) => {
                assert!(
                    status.message.contains("failed calling webhook"),
                    "{}",
                    status.message
                );
                assert!(
                    status.message.contains(names::MUTATING_WEBHOOK),
                    "{}",
                    status.message
                );
            }
            other => panic!("expected a refusal while the webhook is down, got {other:?}"),
        }
        // The opt-out is outside the webhook's objectSelector: unaffected.
        let mut opted_out = pods::pod(
            "opted-out",
            vec![pods::container("app", "demo-http-echo", &[])],
        );
        opted_out
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert(labels::INJECT.into(), labels::INJECT_DISABLED.into());
        accepts(&api, &opted_out).await;
    })
    .await;
}
