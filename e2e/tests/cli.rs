//! `kubectl baton` against the real cluster, as a user runs it (the
//! `kubectl-baton` binary of this build, `baton_e2e::cli`): `check` on a
//! healthy install and with the webhook scaled to 0, `status` for a synced
//! and a refusing sidecar, `upgrade --watch` / `pause` / `resume` /
//! `rollback` through a whole release history including a broken version,
//! `inject` against what the webhook does, and the README's quick start
//! executed as written. `#[ignore]`d: run with `e2e/run.sh`.

use std::collections::BTreeMap;
use std::time::Duration;

use baton_crds::contract::{annotations, containers, env, labels};
use baton_e2e::cli::{Run, baton, baton_with_stdin, kubectl_stdin, shell};
use baton_e2e::rollout::{
    complete_on, create_app, create_release, make_versions, pki, sidecar_image, tag_image,
    wait_release,
};
use baton_e2e::{Check, kubectl, kubectl_ok, wait_for, with_temp_ns_labelled};
use serde_json::{Value, json};

const BOUND: Duration = Duration::from_secs(120);

fn injected() -> BTreeMap<String, String> {
    BTreeMap::from([(labels::INJECT.to_owned(), labels::INJECT_ENABLED.to_owned())])
}

#[track_caller]
fn ok(run: Run, what: &str) -> Run {
    assert!(run.ok(), "{what}: {run}");
    run
}

fn json_of(run: &Run) -> Value {
    serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {run}"))
}

/// Scales a Deployment of baton-system back to `replicas` and waits for it,
/// however the test ends.
struct ScaleBack(&'static str, u32);

impl Drop for ScaleBack {
    fn drop(&mut self) {
        let (name, n) = (self.0, self.1);
        let out = kubectl(&[
            "-n",
            "baton-system",
            "scale",
            "deployment",
            name,
            &format!("--replicas={n}"),
        ]);
        if !out.success {
            eprintln!("cannot scale {name} back to {n}: {}", out.stderr);
        }
        let out = kubectl(&[
            "-n",
            "baton-system",
            "rollout",
            "status",
            &format!("deployment/{name}"),
            "--timeout=180s",
        ]);
        if !out.success {
            eprintln!("{name} not back: {}", out.stderr);
        }
    }
}

#[tokio::test]
#[ignore = "needs the e2e cluster with Baton installed: run e2e/run.sh"]
async fn cli_check_passes_on_a_healthy_install_and_names_the_fix_when_the_webhook_is_scaled_to_0() {
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    ok(baton(&["check"], BOUND), "check on a healthy install");
    let json = json_of(&ok(baton(&["check", "-o", "json"], BOUND), "check -o json"));
    assert!(json.to_string().contains("control-plane"), "{json}");

    let _back = ScaleBack("baton-webhook", 2);
    kubectl_ok(&[
        "-n",
        "baton-system",
        "scale",
        "deployment",
        "baton-webhook",
        "--replicas=0",
    ]);
    // The Deployment's status says 0 ready once its Pods are gone.
    let failed = wait_for(
        "check to fail on the webhook",
        Duration::from_secs(120),
        || async {
            let run = baton(&["check", "--category", "control-plane"], BOUND);
            if run.code == Some(1) && run.stdout.contains(HINT_WEBHOOK_SCALED_TO_0) {
                Check::Done(run)
            } else {
                Check::NotYet(run.to_string())
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("check with the webhook at 0:\n{failed}");
    assert!(failed.stdout.contains('×'), "{failed}");
    drop(_back);
    wait_for("check to pass again", Duration::from_secs(180), || async {
        let run = baton(&["check"], BOUND);
        if run.ok() {
            Check::Done(())
        } else {
            Check::NotYet(run.to_string())
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// What `check` says to do about a webhook Deployment scaled to 0.
const HINT_WEBHOOK_SCALED_TO_0: &str = "kubectl -n baton-system scale deployment baton-webhook";

/// `pod` of `ns` as the webhook would inject it, by `kubectl baton inject`.
fn injected_by_cli(ns: &str, pod: &Value) -> Value {
    let run = ok(
        baton_with_stdin(
            &["inject", "-n", ns, "-f", "-", "-o", "json"],
            Some(&pod.to_string()),
            BOUND,
        ),
        "inject",
    );
    json_of(&run)
}

fn echo_pod(name: &str, run: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "echo", baton_e2e::rollout::RUN_LABEL: run}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            // No ServiceAccount token: its admission plugin runs before the
            // webhook, and would mount the token into the CLI's injected
            // containers but not into the webhook's.
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "app",
                "image": baton_e2e::pods::image("demo-http-echo"),
                "imagePullPolicy": "Never",
                "ports": [{"containerPort": 8080}]
            }]
        }
    })
}

/// The row of `pod` in `status -o json`.
fn status_row<'a>(status: &'a Value, pod: &str) -> Option<&'a Value> {
    status[STATUS_ROWS]
        .as_array()?
        .iter()
        .find(|r| r[STATUS_POD] == pod)
}
const STATUS_ROWS: &str = "pods";
const STATUS_POD: &str = "name";
const STATUS_CONFIG: &str = "config";
const STATUS_CONFIG_ERROR: &str = "configError";

#[tokio::test]
#[ignore = "needs the e2e cluster with Baton installed: run e2e/run.sh"]
async fn cli_status_shows_synced_after_a_route_and_stale_for_a_sidecar_that_refused_it() {
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    make_versions(&["v1"], &[]).unwrap();
    with_temp_ns_labelled(injected(), |client, ns| async move {
        let _release = create_release(&client, &ns, &ns, "v1", "1", None).await.unwrap();
        // One Pod the webhook injects; one injected by the CLI whose
        // sidecars refuse any config carrying the Route below (the testing
        // knob), created as it is (the webhook leaves injected Pods alone).
        let plain = echo_pod("plain", &ns);
        create(&ns, &plain, &[]);
        let mut refuser = injected_by_cli(&ns, &echo_pod("refuser", &ns));
        let mut knobs = 0;
        for list in ["containers", "initContainers"] {
            for c in refuser["spec"][list].as_array_mut().into_iter().flatten() {
                if c["name"] == containers::SLOT_A || c["name"] == containers::SLOT_B {
                    c["env"].as_array_mut().expect("injected slots have env").push(json!({"name": env::TEST_REFUSE_ROUTE, "value": "refused-by-test"}));
                    knobs += 1;
                }
            }
        }
        assert_eq!(knobs, 2, "both slots: {refuser}");
        create(&ns, &refuser, &[]);
        for p in ["plain", "refuser"] {
            kubectl_ok(&["-n", &ns, "wait", "--for=condition=Ready", &format!("pod/{p}"), "--timeout=180s"]);
        }
        create(&ns, &json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "echo"},
            "spec": {"selector": {"app": "echo"}, "ports": [{"name": "http", "port": 8080}]}
        }), &[]);
        create(&ns, &json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "Route",
            "metadata": {"name": "refused-by-test"},
            "spec": {"parentRef": {"name": "echo", "port": 8080}, "protocol": "http",
                     "rules": [{"name": "all", "backendRefs": [{"name": "echo", "port": 8080}]}]}
        }), &[]);
        // The refuser reads STALE from the moment version N is sent to it
        // until its NACK arrives (sent N, ACKed N-1) without an error yet:
        // wait for the NACK's error too (one CI run read the status in
        // that window).
        let status = wait_for("plain SYNCED and refuser STALE with its NACK", Duration::from_secs(90), || async {
            let run = baton(&["status", "-n", &ns, "-o", "json"], BOUND);
            if !run.ok() {
                return Check::NotYet(run.to_string());
            }
            let s = json_of(&run);
            let config = |p: &str| status_row(&s, p).map(|r| r[STATUS_CONFIG].clone());
            let nacked = status_row(&s, "refuser").is_some_and(|r| !r[STATUS_CONFIG_ERROR].is_null());
            if config("plain") == Some(json!("SYNCED")) && config("refuser") == Some(json!("STALE")) && nacked {
                Check::Done(s)
            } else {
                Check::NotYet(s.to_string())
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let error = status_row(&status, "refuser").map(|r| r[STATUS_CONFIG_ERROR].to_string()).unwrap_or_default();
        assert!(error.contains("refused-by-test"), "the NACK's error names the refused Route: {status}");
        // The table a user reads says the same.
        let table = ok(baton(&["status", "-n", &ns], BOUND), "status").stdout;
        eprintln!("{table}");
        let line = |p: &str| table.lines().find(|l| l.contains(p)).unwrap_or_default().to_owned();
        assert!(line("plain").contains("SYNCED") && line("refuser").contains("STALE"), "{table}");
        assert!(line("plain").contains("v1"), "{table}");
    })
    .await;
}

/// `kubectl -n ns create -f -` of `object` (plus `extra` flags); the
/// output on success.
#[track_caller]
fn create(ns: &str, object: &Value, extra: &[&str]) -> String {
    let args: Vec<&str> = ["-n", ns, "create", "-f", "-"]
        .iter()
        .chain(extra)
        .copied()
        .collect();
    ok(
        kubectl_stdin(&args, &object.to_string(), BOUND),
        "kubectl create",
    )
    .stdout
}

async fn spec_of(client: &kube::Client, name: &str) -> Value {
    let api: kube::Api<baton_crds::SidecarRelease> = kube::Api::all(client.clone());
    serde_json::to_value(api.get(name).await.expect("the release").spec).unwrap()
}

#[tokio::test]
#[ignore = "needs the e2e cluster with Baton installed: run e2e/run.sh"]
async fn cli_upgrade_pause_resume_rollback_follow_the_release_and_a_broken_version_exits_1_with_the_reason()
 {
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    make_versions(&["v1", "v2"], &["broken"]).unwrap();
    with_temp_ns_labelled(injected(), |client, ns| async move {
        const REPLICAS: usize = 2;
        let watch = ["--watch", "--watch-timeout", "5m"];
        let _release = create_release(&client, &ns, &ns, "v1", "1", None)
            .await
            .unwrap();
        create_app(&client, &ns, &ns, &pki(), REPLICAS)
            .await
            .unwrap();
        wait_release(
            &client,
            &ns,
            "Complete on v1",
            Duration::from_secs(240),
            |s| complete_on(s, "v1", REPLICAS),
            |_| {},
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));

        // Paused: the upgrade is recorded, no Pod moves.
        ok(baton(&["pause", &ns], BOUND), "pause");
        assert_eq!(spec_of(&client, &ns).await["upgrade"]["paused"], true);
        let v2 = sidecar_image("v2");
        let run = ok(
            baton(&["upgrade", &ns, "--version", "v2", "--image", &v2], BOUND),
            "upgrade while paused",
        );
        assert!(
            run.stdout.contains("v1") && run.stdout.contains("v2"),
            "{run}"
        );
        assert!(
            format!("{}{}", run.stdout, run.stderr).contains("resume"),
            "says the rollout waits for resume: {run}"
        );
        tokio::time::sleep(Duration::from_secs(8)).await;
        let held = wait_release(
            &client,
            &ns,
            "status",
            Duration::from_secs(5),
            |_| true,
            |_| {},
        )
        .await
        .unwrap();
        assert_eq!(held["updated"], 0, "paused: nothing moved: {held}");

        // Resume and follow: exit 0 on Complete.
        let run = baton(
            &["resume", &ns]
                .iter()
                .copied()
                .chain(watch)
                .collect::<Vec<_>>(),
            Duration::from_secs(330),
        );
        eprintln!("resume --watch:\n{run}");
        assert!(run.ok(), "resume --watch: {run}");
        let s = wait_release(
            &client,
            &ns,
            "Complete on v2",
            Duration::from_secs(30),
            |s| complete_on(s, "v2", REPLICAS),
            |_| {},
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s["history"][0]["version"], "v2", "{s}");

        // Rollback: to v1, the version completed before.
        let run = baton(
            &["rollback", &ns]
                .iter()
                .copied()
                .chain(watch)
                .collect::<Vec<_>>(),
            Duration::from_secs(330),
        );
        eprintln!("rollback --watch:\n{run}");
        assert!(run.ok(), "rollback --watch: {run}");
        let spec = spec_of(&client, &ns).await;
        assert_eq!(
            (spec["version"].as_str(), spec["image"].as_str()),
            (Some("v1"), Some(sidecar_image("v1").as_str()))
        );
        wait_release(
            &client,
            &ns,
            "Complete on v1",
            Duration::from_secs(30),
            |s| complete_on(s, "v1", REPLICAS),
            |_| {},
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));

        // A version whose sidecar cannot start: the rollout pauses itself
        // and --watch exits 1 with the reason.
        let broken = sidecar_image("broken");
        let run = baton(
            &["upgrade", &ns, "--version", "broken", "--image", &broken]
                .iter()
                .copied()
                .chain(watch)
                .collect::<Vec<_>>(),
            Duration::from_secs(330),
        );
        eprintln!("upgrade broken --watch:\n{run}");
        assert_eq!(run.code, Some(1), "{run}");
        let said = format!("{}{}", run.stdout, run.stderr);
        assert!(said.contains(UPGRADE_FAILED_REASON), "the reason: {run}");
        // Every Pod still serves v1.
        let s = wait_release(
            &client,
            &ns,
            "status",
            Duration::from_secs(5),
            |_| true,
            |_| {},
        )
        .await
        .unwrap();
        assert_eq!(s["ready"], REPLICAS, "{s}");
    })
    .await;
}

/// What `upgrade --watch` prints when a rollout pauses itself.
const UPGRADE_FAILED_REASON: &str = "FailureThresholdExceeded";

/// The Baton parts of a Pod, for comparing the webhook's injection with
/// the CLI's.
fn baton_parts(pod: &Value) -> Value {
    let spec = &pod["spec"];
    let pick = |list: &str| -> Vec<Value> {
        spec[list]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["name"].as_str().is_some_and(|n| n.starts_with("baton-")))
            .cloned()
            .collect()
    };
    let volumes: Vec<Value> = spec["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["name"].as_str().is_some_and(|n| n.starts_with("baton-")))
        .cloned()
        .collect();
    let anns = &pod["metadata"]["annotations"];
    json!({
        "containers": pick("containers"),
        "initContainers": pick("initContainers"),
        "volumes": volumes,
        "release": anns[annotations::RELEASE],
        "version": anns[annotations::VERSION],
        "configHash": anns[annotations::CONFIG_HASH],
    })
}

#[tokio::test]
#[ignore = "needs the e2e cluster with Baton installed: run e2e/run.sh"]
async fn cli_inject_output_is_accepted_by_the_api_server_and_equals_what_the_webhook_injects() {
    baton_e2e::cluster::require_component("webhook");
    make_versions(&["v1"], &[]).unwrap();
    with_temp_ns_labelled(injected(), |client, ns| async move {
        let _release = create_release(&client, &ns, &ns, "v1", "1", None)
            .await
            .unwrap();
        let raw = echo_pod("web", &ns);
        // The webhook's injection, as the API server stores it (dry run).
        let by_webhook: Value =
            serde_json::from_str(&create(&ns, &raw, &["--dry-run=server", "-o", "json"])).unwrap();
        // The CLI's, then through the same API server (the webhook leaves
        // an injected Pod alone).
        let by_cli = injected_by_cli(&ns, &raw);
        let stored: Value =
            serde_json::from_str(&create(&ns, &by_cli, &["--dry-run=server", "-o", "json"]))
                .unwrap();
        let (w, c) = (baton_parts(&by_webhook), baton_parts(&stored));
        assert!(
            !w["containers"].as_array().unwrap().is_empty(),
            "the webhook injected: {by_webhook}"
        );
        assert_eq!(
            w, c,
            "webhook (left) and kubectl baton inject (right) differ"
        );
        // The application container is untouched.
        let app = |p: &Value| {
            p["spec"]["containers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["name"] == "app")
                .cloned()
        };
        assert_eq!(app(&by_webhook), app(&stored));
    })
    .await;
}

/// The README's quick start, between its markers.
fn quick_start() -> Vec<String> {
    let readme = std::fs::read_to_string(baton_e2e::cluster::repo_root().join("README.md"))
        .expect("README.md");
    let start = readme
        .find("<!-- quickstart:begin -->")
        .expect("README has <!-- quickstart:begin -->");
    let end = readme
        .find("<!-- quickstart:end -->")
        .expect("README has <!-- quickstart:end -->");
    let block = &readme[start..end];
    let body = block
        .split("```sh")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("one ```sh block between the markers");
    body.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

/// Lines of the quick start the e2e cluster already did its own way: the
/// plugin is this build's (on PATH), and Baton was installed from
/// `e2e/overlay` (Kubernetes 1.20's PodDisruptionBudgets, local images).
const DONE_BY_THE_HARNESS: &[&str] = &[
    "cargo install --locked --path cli",
    "kubectl apply -f manifests/crds/",
    "kubectl apply -k manifests/",
];

struct QuickStartCleanup;

impl Drop for QuickStartCleanup {
    fn drop(&mut self) {
        for args in [
            &[
                "delete",
                "namespace",
                "shop",
                "--ignore-not-found",
                "--wait=true",
                "--timeout=120s",
            ][..],
            &["delete", "sidecarrelease", "payments", "--ignore-not-found"][..],
        ] {
            let out = kubectl(args);
            if !out.success {
                eprintln!("cleanup: kubectl {}: {}", args.join(" "), out.stderr);
            }
        }
    }
}

#[tokio::test]
#[ignore = "needs the e2e cluster with Baton installed: run e2e/run.sh"]
async fn readme_quick_start_runs_as_written() {
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    let lines = quick_start();
    for done in DONE_BY_THE_HARNESS {
        assert!(
            lines.iter().any(|l| l.starts_with(done)),
            "the quick start no longer says {done:?}: update DONE_BY_THE_HARNESS with it"
        );
    }
    // The images the quick start names, as the e2e images.
    let tag = std::env::var("BATON_IMAGE_TAG").unwrap_or_else(|_| "e2e".into());
    for (image, as_) in [
        ("sidecar", "0.1.0"),
        ("sidecar", "0.2.0"),
        ("empty", "0.1.0"),
        ("demo-http-echo", "0.1.0"),
    ] {
        tag_image(
            &format!("docker.io/baton/{image}:{tag}"),
            &format!("docker.io/baton/{image}:{as_}"),
        )
        .unwrap();
    }
    let _cleanup = QuickStartCleanup;
    let client = baton_e2e::client().await;
    let mut statuses = vec![];
    for line in &lines {
        if DONE_BY_THE_HARNESS.iter().any(|d| line.starts_with(d)) {
            continue;
        }
        let run = shell(line, Duration::from_secs(600));
        eprintln!("$ {line}\n{run}");
        assert!(
            run.ok(),
            "the README's quick start fails at `{line}`: {run}"
        );
        if line.starts_with("kubectl baton status") {
            statuses.push(run.stdout);
        }
    }
    // What the comments promise.
    assert_eq!(statuses.len(), 2, "{statuses:?}");
    let rows = |s: &str| {
        s.lines()
            .filter(|l| l.contains("web-"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let first = rows(&statuses[0]);
    assert_eq!(first.len(), 2, "{}", statuses[0]);
    assert!(
        first
            .iter()
            .all(|r| r.contains("payments") && r.contains("0.1.0") && r.contains("SYNCED")),
        "{}",
        statuses[0]
    );
    let second = rows(&statuses[1]);
    assert!(
        second.iter().all(|r| r.contains("0.2.0")),
        "{}",
        statuses[1]
    );
    let s = wait_release(
        &client,
        "payments",
        "Complete on 0.1.0",
        Duration::from_secs(60),
        |s| complete_on(s, "0.1.0", 2),
        |_| {},
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s["history"][0]["version"], "0.1.0", "{s}");
}
