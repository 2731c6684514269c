//! `inject` without a cluster: recorded manifests in, the webhook's own
//! `mutate` underneath.

use baton_crds::contract::{annotations, containers, labels, volumes};
use baton_webhook::inject::{ClusterView, InjectConfig, Outcome as MutateOutcome, mutate};
use clap::Parser as _;
use k8s_openapi::api::{apps::v1::Deployment, core::v1::Pod};
use serde_json::{Value, json};

use super::*;

const RELEASES: &str = r"
apiVersion: baton.dev/v1alpha1
kind: SidecarRelease
metadata:
  name: default
spec:
  version: 1.2.0
  image: baton/sidecar:1.2.0
  emptyImage: baton/empty:1
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: baton-mesh-trust
  namespace: baton-system
data:
  ca.crt: |
    -----BEGIN CERTIFICATE-----
    MIIBroot
    -----END CERTIFICATE-----
";

const DEPLOYMENT: &str = r"
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  namespace: shop
spec:
  replicas: 2
  selector:
    matchLabels: {app: web}
  template:
    metadata:
      labels: {app: web}
    spec:
      containers:
        - name: app
          image: web:1
          ports: [{containerPort: 8080}]
";

const CRONJOB: &str = r"
apiVersion: batch/v1
kind: CronJob
metadata:
  name: report
spec:
  schedule: '*/5 * * * *'
  jobTemplate:
    spec:
      template:
        spec:
          restartPolicy: OnFailure
          containers:
            - name: app
              image: report:1
";

const CONFIGMAP: &str = r"
apiVersion: v1
kind: ConfigMap
metadata:
  name: settings
  namespace: shop
  labels: {app: web}
data:
  key: value
  multi: |
    line one
    line two
";

fn facts_at(version: ServerVersion) -> Facts {
    let docs = parse_documents(RELEASES).unwrap();
    facts::offline(&[("releases.yaml".to_owned(), docs)], version).unwrap()
}

fn facts() -> Facts {
    facts_at(facts::NEWEST_KNOWN_VERSION)
}

fn config() -> InjectConfig {
    WebhookFlags::default().inject_config().unwrap()
}

fn inject(text: &str) -> anyhow::Result<Injected> {
    inject_documents(parse_documents(text)?, &facts(), &config(), "default")
}

fn names(list: Option<&Value>) -> Vec<String> {
    list.and_then(Value::as_array)
        .map(|l| {
            l.iter()
                .map(|c| c["name"].as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The template carries the webhook's injection: slots, init container,
/// volumes, annotations and labels; the app container is untouched.
fn assert_injected(template: &Value, app: &Value) {
    let spec = &template["spec"];
    assert_eq!(
        names(spec.get("initContainers")),
        [containers::INIT, containers::SLOT_A, containers::SLOT_B],
        "native sidecars at 1.33: {spec:#}"
    );
    assert_eq!(
        spec["containers"],
        json!([app]),
        "the app container is unchanged"
    );
    let vols = names(spec.get("volumes"));
    for v in [volumes::SHARED, volumes::TOKEN, volumes::TRUST] {
        assert!(vols.iter().any(|n| n == v), "{v} in {vols:?}");
    }
    let meta = &template["metadata"];
    assert_eq!(meta["annotations"][annotations::STATUS], "injected");
    assert_eq!(meta["annotations"][annotations::RELEASE], "default");
    assert_eq!(meta["annotations"][annotations::VERSION], "1.2.0");
    assert!(meta["annotations"][annotations::CONFIG_HASH].is_string());
    assert_eq!(meta["labels"][labels::INJECT], labels::INJECT_ENABLED);
    assert_eq!(meta["labels"][labels::INJECTED], "true");
}

#[test]
fn a_deployment_gets_what_the_webhook_injects() {
    let out = inject(DEPLOYMENT).unwrap();
    assert!(out.notes.is_empty(), "{:?}", out.notes);
    let [doc] = out.docs.as_slice() else {
        panic!("one document")
    };
    let original = &parse_documents(DEPLOYMENT).unwrap()[0];
    assert_injected(
        &doc["spec"]["template"],
        &original["spec"]["template"]["spec"]["containers"][0],
    );
    // Nothing outside the template moves.
    assert_eq!(doc["metadata"], original["metadata"]);
    assert_eq!(doc["spec"]["selector"], original["spec"]["selector"]);
    assert_eq!(doc["spec"]["replicas"], 2);
    // Ordinary containers before 1.32, as the webhook does there.
    let old = inject_documents(
        parse_documents(DEPLOYMENT).unwrap(),
        &facts_at(ServerVersion::new(1, 20)),
        &config(),
        "default",
    )
    .unwrap();
    let spec = &old.docs[0]["spec"]["template"]["spec"];
    assert_eq!(
        names(spec.get("containers")),
        [containers::SLOT_A, containers::SLOT_B, "app"]
    );
    assert_eq!(names(spec.get("initContainers")), [containers::INIT]);
}

#[test]
fn a_cronjob_is_injected_in_its_job_template() {
    let out = inject(CRONJOB).unwrap();
    let original = &parse_documents(CRONJOB).unwrap()[0];
    let template = &out.docs[0]["spec"]["jobTemplate"]["spec"]["template"];
    assert_injected(
        template,
        &original["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0],
    );
    assert_eq!(template["spec"]["restartPolicy"], "OnFailure");
    assert_eq!(out.docs[0]["spec"]["schedule"], "*/5 * * * *");
}

#[test]
fn the_items_of_a_list_are_injected() {
    let deployment = &parse_documents(DEPLOYMENT).unwrap()[0];
    let configmap = &parse_documents(CONFIGMAP).unwrap()[0];
    let list = json!({"apiVersion": "v1", "kind": "List", "items": [configmap, deployment]});
    let out = inject(&list.to_string()).unwrap();
    let items = out.docs[0]["items"].as_array().unwrap();
    assert_eq!(&items[0], configmap);
    assert_injected(
        &items[1]["spec"]["template"],
        &deployment["spec"]["template"]["spec"]["containers"][0],
    );
}

#[test]
fn a_multi_document_file_is_injected_in_order() {
    let text = format!("# app\n---\n{CONFIGMAP}---\n{DEPLOYMENT}\n---\n{CRONJOB}");
    let out = inject(&text).unwrap();
    let kinds: Vec<&str> = out.docs.iter().map(kind_of).collect();
    assert_eq!(kinds, ["ConfigMap", "Deployment", "CronJob"]);
    assert!(
        out.docs[1]["spec"]["template"]["metadata"]["annotations"][annotations::STATUS]
            == "injected"
    );
    assert!(
        out.docs[2]["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["annotations"]
            [annotations::STATUS]
            == "injected"
    );
    // YAML out: three documents, which read back as they were.
    let yaml = render(&out.docs, Format::Yaml).unwrap();
    assert_eq!(yaml.matches("\n---\n").count(), 2, "{yaml}");
    assert_eq!(parse_documents(&yaml).unwrap(), out.docs);
    // JSON out: a List of them; one document alone is itself.
    let list: Value = serde_json::from_str(&render(&out.docs, Format::Json).unwrap()).unwrap();
    assert_eq!(list["kind"], "List");
    assert_eq!(list["items"], json!(out.docs));
    let one: Value = serde_json::from_str(&render(&out.docs[..1], Format::Json).unwrap()).unwrap();
    assert_eq!(one, out.docs[0]);
}

#[test]
fn injecting_the_output_again_changes_nothing() {
    let text = format!("{CONFIGMAP}---\n{DEPLOYMENT}---\n{CRONJOB}");
    let once = inject(&text).unwrap();
    let yaml = render(&once.docs, Format::Yaml).unwrap();
    let twice = inject(&yaml).unwrap();
    assert_eq!(twice.docs, once.docs);
    assert_eq!(render(&twice.docs, Format::Yaml).unwrap(), yaml);
    assert_eq!(twice.notes.len(), 2, "{:?}", twice.notes);
    assert!(twice.notes[0].contains("Deployment shop/web left unchanged: already injected"));
    assert!(twice.notes[1].contains("CronJob default/report"));
}

#[test]
fn a_configmap_passes_through_unchanged() {
    let out = inject(CONFIGMAP).unwrap();
    assert!(out.notes.is_empty());
    assert_eq!(out.docs, parse_documents(CONFIGMAP).unwrap());
    let yaml = render(&out.docs, Format::Yaml).unwrap();
    assert_eq!(
        yaml,
        baton_crds::yaml::to_string(&parse_documents(CONFIGMAP).unwrap()[0]).unwrap()
    );
}

/// The CLI's Pod equals the Pod with `mutate`'s patch applied directly,
/// with the webhook's own default settings (its flags parsed with none
/// given), before and after native sidecars.
#[test]
fn a_pod_comes_out_as_the_webhooks_patch_makes_it() {
    let pod_json = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-1", "namespace": "shop",
                     "labels": {"app": "web", "baton.dev/inject": "enabled"},
                     "annotations": {"team": "a"}},
        "spec": {"containers": [{"name": "app", "image": "web:1"}],
                 "volumes": [{"name": "data", "emptyDir": {}}]},
    });
    let webhook_config = baton_webhook::Args::try_parse_from(["baton-webhook"])
        .unwrap()
        .inject_config();
    for version in [ServerVersion::new(1, 20), ServerVersion::new(1, 33)] {
        let facts = facts_at(version);
        let pod: Pod = serde_json::from_value(pod_json.clone()).unwrap();
        let ns_labels = facts.labels_of("shop");
        let view = ClusterView {
            namespace: "shop",
            namespace_labels: &ns_labels,
            releases: &facts.releases,
            tls_policies: &[],
            pools: &[],
            nodes: &[],
            recent_grants: &[],
            grant_id: "uid",
            server_version: version,
            trust_bundle: facts.trust_bundle.as_deref(),
        };
        let Ok(MutateOutcome::Injected(injection)) = mutate(&pod, &view, &webhook_config) else {
            panic!("the webhook injects it")
        };
        let mut expected = pod_json.clone();
        json_patch::patch(&mut expected, &injection.patch).unwrap();

        let out = inject_documents(vec![pod_json.clone()], &facts, &config(), "default").unwrap();
        assert_eq!(out.docs, [expected], "at {version}");
    }
}

#[test]
fn the_cli_defaults_are_the_webhooks() {
    let webhook = baton_webhook::Args::try_parse_from(["baton-webhook"])
        .unwrap()
        .inject_config();
    assert_eq!(format!("{:?}", config()), format!("{webhook:?}"));
    // And the Deployment the manifests install sets nothing else.
    let deployment: Deployment =
        baton_crds::yaml::from_str(include_str!("../../../manifests/webhook/deployment.yaml"))
            .unwrap();
    let flags = settings::flags_from_deployment(&deployment).unwrap();
    assert_eq!(flags.namespace(), "baton-system");
    assert_eq!(
        format!("{:?}", flags.inject_config().unwrap()),
        format!("{webhook:?}")
    );
}

#[test]
fn the_webhooks_deployment_settings_are_followed_and_flags_win() {
    let mut deployment: Value = serde_json::to_value(
        baton_crds::yaml::from_str::<Deployment>(include_str!(
            "../../../manifests/webhook/deployment.yaml"
        ))
        .unwrap(),
    )
    .unwrap();
    // As the e2e overlay patches it.
    let c = &mut deployment["spec"]["template"]["spec"]["containers"][0];
    let env = c["env"].as_array_mut().unwrap();
    env.push(json!({"name": "BATON_CONTROL_PLANE_ADDRESS", "value": "10.96.0.20"}));
    env.push(json!({"name": "BATON_INJECT_IMAGE_PULL_POLICY", "value": "Never"}));
    c["args"] = json!(["--native-sidecars=never", "--wait-ready-timeout-secs", "30"]);
    let deployment: Deployment = serde_json::from_value(deployment).unwrap();
    let from_cluster = settings::flags_from_deployment(&deployment).unwrap();
    let config = from_cluster.clone().inject_config().unwrap();
    assert_eq!(config.control_plane_address, "10.96.0.20");
    assert_eq!(config.image_pull_policy.as_deref(), Some("Never"));
    assert_eq!(
        config.native_sidecars,
        baton_webhook::inject::NativeSidecars::Never
    );
    assert_eq!(config.wait_ready_timeout_seconds, 30);
    assert!(config.config_push);

    let cli = crate::Cli::try_parse_from([
        "kubectl-baton",
        "inject",
        "-f",
        "app.yaml",
        "--control-plane-address",
        "1.2.3.4",
        "--config-push",
        "false",
    ])
    .unwrap();
    let crate::Command::Inject(args) = cli.command else {
        panic!("inject")
    };
    let config = args.webhook.or(from_cluster).inject_config().unwrap();
    assert_eq!(config.control_plane_address, "1.2.3.4");
    assert!(!config.config_push);
    assert_eq!(config.image_pull_policy.as_deref(), Some("Never"));
}

#[test]
fn an_opted_out_pod_passes_through_with_a_note() {
    let text = r"
apiVersion: v1
kind: Pod
metadata:
  name: legacy
  labels: {baton.dev/inject: disabled}
spec:
  containers: [{name: app, image: legacy:1}]
";
    let out = inject(text).unwrap();
    assert_eq!(out.docs, parse_documents(text).unwrap());
    assert_eq!(
        out.notes,
        ["Pod default/legacy left unchanged: opted out (label baton.dev/inject=disabled)"]
    );
}

#[test]
fn host_network_and_system_namespaces_pass_through_with_a_note() {
    let text = r"
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: agent}
spec:
  selector: {matchLabels: {app: agent}}
  template:
    metadata: {labels: {app: agent}}
    spec:
      hostNetwork: true
      containers: [{name: agent, image: agent:1}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: dns, namespace: kube-system}
spec:
  selector: {matchLabels: {app: dns}}
  template:
    metadata: {labels: {app: dns}}
    spec:
      containers: [{name: dns, image: dns:1}]
";
    let out = inject(text).unwrap();
    assert_eq!(out.docs, parse_documents(text).unwrap());
    assert!(out.notes[0].starts_with("DaemonSet default/agent left unchanged: hostNetwork"));
    assert_eq!(
        out.notes[1],
        "Deployment kube-system/dns left unchanged: namespace kube-system is never injected"
    );
}

#[test]
fn bad_yaml_names_the_document() {
    let text = format!("{CONFIGMAP}---\nkind: Pod\nmetadata: [unclosed\n");
    let err = inject(&text).unwrap_err().to_string();
    assert!(err.contains("document 2 (from line 14)"), "{err}");
    let err = inject("---\n- just\n- a list\n").unwrap_err().to_string();
    assert!(
        err.contains("document 1") && err.contains("not a Kubernetes object"),
        "{err}"
    );
}

#[test]
fn a_pod_no_release_selects_is_an_error_naming_it_and_the_releases() {
    let releases = r"
apiVersion: baton.dev/v1alpha1
kind: SidecarRelease
metadata: {name: payments-only}
spec:
  version: 1.2.0
  image: baton/sidecar:1.2.0
  namespaceSelector: {matchLabels: {team: payments}}
";
    let facts = facts::offline(
        &[("r.yaml".to_owned(), parse_documents(releases).unwrap())],
        facts::NEWEST_KNOWN_VERSION,
    )
    .unwrap();
    let err = inject_documents(
        parse_documents(&format!("{CONFIGMAP}---\n{DEPLOYMENT}")).unwrap(),
        &facts,
        &config(),
        "default",
    )
    .unwrap_err();
    let err = format!("{err:#}");
    assert!(
        err.starts_with("document 2: Deployment shop/web: "),
        "{err}"
    );
    assert!(err.contains("no SidecarRelease selects it"), "{err}");
    assert!(
        err.contains("the SidecarReleases in --release r.yaml are: payments-only"),
        "{err}"
    );
}

#[test]
fn a_denial_is_an_error_naming_the_object() {
    let text = r"
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: db, namespace: data}
spec:
  selector: {matchLabels: {app: db}}
  template:
    metadata: {labels: {app: db}}
    spec:
      containers: [{name: baton-sidecar-a, image: db:1}]
";
    let err = format!("{:#}", inject(text).unwrap_err());
    assert!(
        err.contains("StatefulSet data/db: the webhook would refuse it"),
        "{err}"
    );
    assert!(err.contains("baton-sidecar-a"), "{err}");
}

#[test]
fn namespaces_come_from_the_document_else_the_default() {
    let out = inject_documents(
        parse_documents(CRONJOB).unwrap(),
        &facts(),
        &config(),
        "team-a",
    )
    .unwrap();
    let env = &out.docs[0]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["initContainers"];
    assert!(env.is_array());
    let docs = parse_documents(&format!("{CONFIGMAP}---\n{DEPLOYMENT}---\n{CRONJOB}")).unwrap();
    let namespaces: Vec<String> = namespaces_of(&docs, "team-a").into_iter().collect();
    assert_eq!(namespaces, ["shop", "team-a"]);
}

#[test]
fn a_release_file_without_releases_is_an_error() {
    let err = facts::offline(
        &[("r.yaml".to_owned(), parse_documents(CONFIGMAP).unwrap())],
        facts::NEWEST_KNOWN_VERSION,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("r.yaml holds no SidecarRelease"), "{err}");
}

#[test]
fn kubernetes_versions_parse() {
    assert_eq!(parse_version("1.30"), Ok(ServerVersion::new(1, 30)));
    assert_eq!(parse_version("v1.29.3"), Ok(ServerVersion::new(1, 29)));
    assert!(parse_version("1").is_err());
    assert!(parse_version("1.x").is_err());
}

fn global(output: Format) -> crate::Global {
    crate::Global {
        context: None,
        kubeconfig: None,
        namespace: None,
        all_namespaces: false,
        output,
        timeout: std::time::Duration::from_secs(2),
    }
}

fn write(dir: &std::path::Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("baton-inject-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Offline mode never makes a client (the context has none to make).
#[tokio::test]
async fn offline_mode_calls_no_cluster() {
    let dir = tempdir("offline");
    let args = Args {
        file: write(&dir, "app.yaml", DEPLOYMENT),
        releases: vec![write(&dir, "r.yaml", RELEASES)],
        kubernetes_version: Some(ServerVersion::new(1, 30)),
        webhook: WebhookFlags::default(),
    };
    let mut g = global(Format::Yaml);
    g.kubeconfig = Some(dir.join("no-such-kubeconfig"));
    let ctx = Ctx::new(g);
    assert_eq!(run(&ctx, args).await.unwrap(), Outcome::Success);
    let _ = std::fs::remove_dir_all(dir);
}

/// Without `--release`, a cluster that does not answer is a clear error
/// that points at offline mode.
#[tokio::test]
async fn an_unreachable_cluster_suggests_offline_mode() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempdir("unreachable");
    let args = Args {
        file: write(&dir, "app.yaml", DEPLOYMENT),
        releases: vec![],
        kubernetes_version: None,
        webhook: WebhookFlags::default(),
    };
    let mut config = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
    config.connect_timeout = Some(std::time::Duration::from_secs(1));
    let client = kube::Client::try_from(config).unwrap();
    let ctx = Ctx::with_client(global(Format::Yaml), client, "default");
    let err = format!("{:#}", run(&ctx, args).await.unwrap_err());
    assert!(err.contains("pass --release FILE"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

fn json_response(body: &Value) -> http::Response<kube::client::Body> {
    http::Response::builder()
        .status(if body["kind"] == "Status" { 404 } else { 200 })
        .body(kube::client::Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap()
}

/// Cluster mode reads the version, the releases, the namespace's labels
/// and TlsPolicies, and the webhook Deployment's settings, and injects with
/// them (here: 1.20, so ordinary containers, and the e2e overlay's
/// control-plane address and pull policy).
#[tokio::test]
async fn cluster_mode_reads_the_facts_and_the_webhooks_settings() {
    let (service, mut handle) = tower_test::mock::pair::<
        http::Request<kube::client::Body>,
        http::Response<kube::client::Body>,
    >();
    let release: Value = serde_json::to_value(&*facts().releases[0]).unwrap();
    let mut deployment: Value = serde_json::to_value(
        baton_crds::yaml::from_str::<Deployment>(include_str!(
            "../../../manifests/webhook/deployment.yaml"
        ))
        .unwrap(),
    )
    .unwrap();
    let env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array_mut()
        .unwrap();
    env.push(json!({"name": "BATON_CONTROL_PLANE_ADDRESS", "value": "10.96.0.20"}));
    env.push(json!({"name": "BATON_INJECT_IMAGE_PULL_POLICY", "value": "Never"}));
    let server = tokio::spawn(async move {
        let mut paths = Vec::new();
        while let Some((request, send)) = handle.next_request().await {
            let path = request.uri().path().to_owned();
            let body = match path.as_str() {
                "/version" => json!({"major": "1", "minor": "20", "gitVersion": "v1.20.15"}),
                "/apis/baton.dev/v1alpha1/sidecarreleases" => json!({
                    "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarReleaseList",
                    "metadata": {}, "items": [release.clone()]}),
                "/api/v1/namespaces/shop" => json!({
                    "apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": "shop", "labels": {"baton.dev/inject": "enabled"}}}),
                "/apis/baton.dev/v1alpha1/namespaces/shop/tlspolicies" => json!({
                    "apiVersion": "baton.dev/v1alpha1", "kind": "TlsPolicyList",
                    "metadata": {}, "items": []}),
                "/apis/apps/v1/namespaces/baton-system/deployments/baton-webhook" => {
                    deployment.clone()
                }
                "/api/v1/namespaces/baton-system/configmaps/baton-mesh-trust" => json!({
                    "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": "baton-mesh-trust", "namespace": "baton-system"},
                    "data": {"ca.crt": "-----BEGIN CERTIFICATE-----\nMIIBlive\n-----END CERTIFICATE-----\n"}}),
                _ => json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "reason": "NotFound", "code": 404, "message": "not found"}),
            };
            paths.push(path);
            send.send_response(json_response(&body));
        }
        paths
    });
    let dir = tempdir("cluster");
    let args = Args {
        file: write(&dir, "app.yaml", DEPLOYMENT),
        releases: vec![],
        kubernetes_version: None,
        webhook: WebhookFlags::default(),
    };
    let ctx = Ctx::with_client(
        global(Format::Yaml),
        kube::Client::new(service, "default"),
        "default",
    );
    let out = super::inject(&ctx, &args).await.unwrap();
    drop(ctx);
    let paths = server.await.unwrap();
    assert_eq!(
        paths,
        [
            "/version",
            "/apis/baton.dev/v1alpha1/sidecarreleases",
            "/api/v1/namespaces/shop",
            "/apis/baton.dev/v1alpha1/namespaces/shop/tlspolicies",
            "/api/v1/namespaces/baton-system/configmaps/baton-mesh-trust",
            "/apis/apps/v1/namespaces/baton-system/deployments/baton-webhook",
        ]
    );
    // The cluster's bundle, as the webhook would copy it.
    assert!(
        out.docs[0]["spec"]["template"]["metadata"]["annotations"][annotations::TRUST_BUNDLE]
            .as_str()
            .unwrap()
            .contains("MIIBlive")
    );
    let spec = &out.docs[0]["spec"]["template"]["spec"];
    assert_eq!(
        names(spec.get("containers")),
        [containers::SLOT_A, containers::SLOT_B, "app"]
    );
    let slot = &spec["containers"][0];
    assert_eq!(slot["imagePullPolicy"], "Never");
    assert!(
        slot["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "BATON_CONTROL_PLANE_ADDRESS" && e["value"] == "10.96.0.20"),
        "{slot:#}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_trust_bundle_comes_from_the_files_and_without_one_injection_says_where_to_get_it() {
    let out = inject(DEPLOYMENT).unwrap();
    let text = serde_json::to_string(&out.docs).unwrap();
    assert!(text.contains(annotations::TRUST_BUNDLE), "{text}");
    assert!(text.contains("MIIBroot"));
    let only_releases = RELEASES.split("---").next().unwrap();
    let facts = facts::offline(
        &[(
            "releases.yaml".to_owned(),
            parse_documents(only_releases).unwrap(),
        )],
        facts::NEWEST_KNOWN_VERSION,
    )
    .unwrap();
    let err = inject_documents(
        parse_documents(DEPLOYMENT).unwrap(),
        &facts,
        &config(),
        "default",
    )
    .unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("kubectl -n baton-system get configmap baton-mesh-trust -o yaml"),
        "{msg}"
    );
}
