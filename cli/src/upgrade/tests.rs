//! The verdicts and progress text over constructed releases, and the
//! requests against kube's tower-test mock API server.

use std::time::Duration;

use baton_controlplane::testing::{self, Handle};
use baton_crds::SidecarRelease;
use serde_json::{Value, json};

use super::watch::{self, Goal, Sink, Verdict, Watch};
use super::*;
use crate::{Global, Outcome};

const PATH: &str = "/apis/baton.dev/v1alpha1/sidecarreleases/default";

/// A release as the API server returns it: `spec.version` `version`,
/// generation `generation`, a status describing `observed` with
/// `conditions` (type, status, reason, message).
fn release_json(
    version: &str,
    generation: i64,
    observed: i64,
    conditions: &[(&str, &str, &str, &str)],
) -> Value {
    let conditions: Vec<Value> = conditions
        .iter()
        .map(|(t, s, r, m)| {
            json!({"type": t, "status": s, "reason": r, "message": m,
                   "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": observed})
        })
        .collect();
    json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease",
        "metadata": {"name": "default", "generation": generation, "resourceVersion": "7"},
        "spec": {"version": version, "image": format!("host:5000/baton/sidecar:{version}"),
                 "emptyImage": "host:5000/baton/empty:0.1.0"},
        "status": {
            "observedGeneration": observed, "total": 5, "updated": 3, "ready": 5, "failed": 0,
            "inFlight": 1, "rollout": "RollingOut",
            "versions": [{"version": "0.1.0", "total": 2, "ready": 2, "failed": 0},
                         {"version": "0.2.0", "total": 3, "ready": 3, "failed": 0}],
            "conditions": conditions,
            "history": [{"version": "0.1.0", "image": "host:5000/baton/sidecar:0.1.0",
                         "emptyImage": "host:5000/baton/empty:0.0.9"}]
        }
    })
}

fn release(v: Value) -> SidecarRelease {
    serde_json::from_value(v).unwrap()
}

const ROLLING: &[(&str, &str, &str, &str)] = &[
    (
        "Progressing",
        "True",
        "RollingOut",
        "3 of 5 pods run 0.2.0 and are ready",
    ),
    (
        "Complete",
        "False",
        "RollingOut",
        "3 of 5 pods run 0.2.0 and are ready",
    ),
    (
        "Degraded",
        "False",
        "Healthy",
        "no pod has a failing sidecar",
    ),
    ("Paused", "False", "NotPaused", "rollout not paused"),
];

const COMPLETE: &[(&str, &str, &str, &str)] = &[
    (
        "Progressing",
        "False",
        "AllPodsUpdated",
        "all 5 pods run 0.2.0 and are ready",
    ),
    (
        "Complete",
        "True",
        "AllPodsUpdated",
        "all 5 pods run 0.2.0 and are ready",
    ),
    (
        "Degraded",
        "False",
        "Healthy",
        "no pod has a failing sidecar",
    ),
    ("Paused", "False", "NotPaused", "rollout not paused"),
];

const SELF_PAUSED: &[(&str, &str, &str, &str)] = &[
    (
        "Progressing",
        "False",
        "FailureThresholdExceeded",
        "1 pod(s) failed ...",
    ),
    (
        "Complete",
        "False",
        "RollingOut",
        "3 of 5 pods run 0.2.0 and are ready",
    ),
    (
        "Degraded",
        "True",
        "HandoffFailed",
        "1 pod(s) failed their handoff to 0.2.0",
    ),
    (
        "Paused",
        "True",
        "FailureThresholdExceeded",
        "1 pod(s) failed their handoff to 0.2.0, more than failureThreshold 0: the rollout paused itself",
    ),
];

fn with_failed_pod(mut v: Value) -> Value {
    v["status"]["failed"] = json!(1);
    v["status"]["failedPods"] = json!([{"pod": "web/api-0", "version": "0.2.0",
        "reason": "new sidecar not ready within 30s: ErrImagePull"}]);
    v
}

#[test]
fn a_status_of_an_older_generation_is_running_whatever_it_says() {
    let r = release(release_json("0.2.0", 4, 3, COMPLETE));
    assert_eq!(watch::verdict(&r, Goal::Rollout), Verdict::Running);
    assert_eq!(
        watch::progress_line(&r),
        "sidecarrelease/default: waiting for the operator to observe generation 4 (status describes 3)"
    );
}

#[test]
fn complete_at_the_current_generation_is_done() {
    let r = release(release_json("0.2.0", 4, 4, COMPLETE));
    let v = watch::verdict(&r, Goal::Rollout);
    assert!(
        matches!(&v, Verdict::Done(w) if w.reason == "AllPodsUpdated"),
        "{v:?}"
    );
    assert_eq!(
        watch::final_lines(&r, &v),
        [
            "sidecarrelease/default: rollout complete (AllPodsUpdated): all 5 pods run 0.2.0 and are ready"
        ]
    );
}

#[test]
fn rolling_out_is_running_and_the_line_counts_every_version() {
    let r = release(release_json("0.2.0", 4, 4, ROLLING));
    assert_eq!(watch::verdict(&r, Goal::Rollout), Verdict::Running);
    assert_eq!(watch::position(&r), (3, 5));
    assert_eq!(
        watch::progress_line(&r),
        "sidecarrelease/default: 3/5 pods on 0.2.0 [0.1.0 2/2 ready; 0.2.0 3/3 ready] 1 in flight, 0 failed, RollingOut"
    );
}

#[test]
fn a_self_paused_rollout_stops_with_the_reason_and_the_failed_pods() {
    let r = release(with_failed_pod(release_json("0.2.0", 4, 4, SELF_PAUSED)));
    let v = watch::verdict(&r, Goal::Rollout);
    let Verdict::Stopped { why, failed_pods } = &v else {
        panic!("{v:?}")
    };
    assert_eq!(why[0].type_, "Paused");
    assert_eq!(why[0].reason, "FailureThresholdExceeded");
    assert_eq!(why[1].type_, "Degraded");
    assert_eq!(failed_pods.len(), 1);
    let lines = watch::final_lines(&r, &v);
    assert!(
        lines[0].starts_with(
            "sidecarrelease/default: rollout stopped: Paused (FailureThresholdExceeded): 1 pod(s)"
        ),
        "{lines:?}"
    );
    assert_eq!(
        lines[1],
        "  also Degraded (HandoffFailed): 1 pod(s) failed their handoff to 0.2.0"
    );
    assert_eq!(
        lines[2],
        "  failed pod web/api-0 → 0.2.0: new sidecar not ready within 30s: ErrImagePull"
    );
    assert_eq!(lines[3], "  to roll back: kubectl baton rollback default");
}

#[test]
fn paused_by_the_user_stops_and_says_how_to_resume() {
    let mut c = ROLLING.to_vec();
    c[3] = (
        "Paused",
        "True",
        "PausedByUser",
        "spec.upgrade.paused is true",
    );
    let r = release(release_json("0.2.0", 4, 4, &c));
    let v = watch::verdict(&r, Goal::Rollout);
    let lines = watch::final_lines(&r, &v);
    assert_eq!(
        lines[0],
        "sidecarrelease/default: rollout stopped: Paused (PausedByUser): spec.upgrade.paused is true"
    );
    assert_eq!(
        lines.last().unwrap(),
        "  to continue: kubectl baton resume default"
    );
    // For `pause --watch` the same status is what it waits for.
    assert!(matches!(watch::verdict(&r, Goal::Pause), Verdict::Done(_)));
    assert!(
        watch::final_lines(&r, &watch::verdict(&r, Goal::Pause))[0]
            .starts_with("sidecarrelease/default: paused (PausedByUser)")
    );
}

#[test]
fn degraded_stops_unless_the_failure_threshold_still_tolerates_it() {
    let mut c = ROLLING.to_vec();
    c[2] = (
        "Degraded",
        "True",
        "HandoffFailed",
        "1 pod(s) failed their handoff",
    );
    let mut v = with_failed_pod(release_json("0.2.0", 4, 4, &c));
    let r = release(v.clone());
    assert!(matches!(
        watch::verdict(&r, Goal::Rollout),
        Verdict::Stopped { .. }
    ));

    v["spec"]["upgrade"] = json!({"failureThreshold": 2});
    let r = release(v.clone());
    assert_eq!(watch::verdict(&r, Goal::Rollout), Verdict::Running);

    v["status"]["failed"] = json!(3);
    let r = release(v);
    assert!(matches!(
        watch::verdict(&r, Goal::Rollout),
        Verdict::Stopped { .. }
    ));
}

#[test]
fn an_invalid_spec_stops_without_a_rollback_hint() {
    let c = [
        (
            "Progressing",
            "False",
            "InvalidSpec",
            "spec.emptyImage: needed",
        ),
        (
            "Complete",
            "False",
            "InvalidSpec",
            "spec.emptyImage: needed",
        ),
        ("Degraded", "True", "InvalidSpec", "spec.emptyImage: needed"),
    ];
    let r = release(release_json("0.2.0", 4, 4, &c));
    let lines = watch::final_lines(&r, &watch::verdict(&r, Goal::Rollout));
    assert_eq!(
        lines,
        [
            "sidecarrelease/default: rollout stopped: Degraded (InvalidSpec): spec.emptyImage: needed"
        ]
    );
}

#[test]
fn watch_timeouts_read_as_written() {
    assert_eq!(watch::human(Duration::from_secs(600)), "10m");
    assert_eq!(watch::human(Duration::from_secs(90)), "90s");
    assert_eq!(watch::human(Duration::from_secs(7200)), "2h");
    assert_eq!(watch::human(Duration::from_millis(50)), "50ms");
}

// --- against the mock API server ---

fn ctx(client: kube::Client) -> Ctx {
    let global = Global {
        context: None,
        kubeconfig: None,
        namespace: None,
        all_namespaces: false,
        output: crate::Format::Table,
        timeout: Duration::from_secs(5),
    };
    Ctx::with_client(global, client, "default")
}

/// The next request: method, path, content type, JSON body; and the means
/// to answer it.
async fn next(handle: &mut Handle) -> (String, String, String, Value, testing::Send) {
    let (request, send) = handle.next_request().await.expect("a request");
    let method = request.method().to_string();
    let path = request.uri().path().to_owned();
    let content_type = request
        .headers()
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    (method, path, content_type, body, send)
}

/// Answers the GET with `current`, then asserts the merge patch is `want`
/// and answers it with `current` merged with `want`'s spec.
async fn serve_get_then_patch(handle: &mut Handle, current: Value, want: Value) {
    let (method, path, _, _, send) = next(handle).await;
    assert_eq!((method.as_str(), path.as_str()), ("GET", PATH));
    testing::reply(send, 200, &current);
    let (method, path, content_type, body, send) = next(handle).await;
    assert_eq!((method.as_str(), path.as_str()), ("PATCH", PATH));
    assert_eq!(content_type, "application/merge-patch+json");
    assert_eq!(body, want);
    let mut patched = current;
    for (k, v) in want["spec"].as_object().unwrap() {
        if k == "upgrade" {
            patched["spec"]["upgrade"] = v.clone();
        } else {
            patched["spec"][k] = v.clone();
        }
    }
    patched["metadata"]["generation"] = json!(5);
    testing::reply(send, 200, &patched);
}

fn args(version: &str, image: Option<&str>) -> UpgradeArgs {
    UpgradeArgs {
        release: "default".into(),
        version: version.into(),
        image: image.map(Into::into),
        watch: WatchArgs {
            watch: false,
            watch_timeout: Duration::from_secs(60),
        },
    }
}

fn release_args() -> ReleaseArgs {
    ReleaseArgs {
        release: "default".into(),
        watch: WatchArgs {
            watch: false,
            watch_timeout: Duration::from_secs(60),
        },
    }
}

#[tokio::test]
async fn upgrade_merge_patches_version_and_the_image_with_its_tag_replaced() {
    let (client, mut handle) = testing::mock_client();
    let server = tokio::spawn(async move {
        serve_get_then_patch(
            &mut handle,
            release_json("0.1.0", 4, 4, COMPLETE),
            json!({"spec": {"version": "0.2.0", "image": "host:5000/baton/sidecar:0.2.0"}}),
        )
        .await;
    });
    let got = upgrade(&ctx(client), args("0.2.0", None)).await.unwrap();
    assert_eq!(got, Outcome::Success);
    server.await.unwrap();
}

#[tokio::test]
async fn upgrade_with_an_explicit_image_patches_that_image() {
    let (client, mut handle) = testing::mock_client();
    let server = tokio::spawn(async move {
        serve_get_then_patch(
            &mut handle,
            release_json("0.1.0", 4, 4, COMPLETE),
            json!({"spec": {"version": "0.2.0", "image": "other/sidecar@sha256:ab"}}),
        )
        .await;
    });
    let got = upgrade(&ctx(client), args("0.2.0", Some("other/sidecar@sha256:ab"))).await;
    assert_eq!(got.unwrap(), Outcome::Success);
    server.await.unwrap();
}

#[tokio::test]
async fn upgrade_to_the_current_version_patches_nothing() {
    let (client, mut handle) = testing::mock_client();
    let server = tokio::spawn(async move {
        let (method, _, _, _, send) = next(&mut handle).await;
        assert_eq!(method, "GET");
        testing::reply(send, 200, &release_json("0.1.0", 4, 4, COMPLETE));
        // No PATCH follows: the client is dropped with the command.
        assert!(handle.next_request().await.is_none());
    });
    let got = upgrade(&ctx(client), args("0.1.0", None)).await.unwrap();
    assert_eq!(got, Outcome::Success);
    server.await.unwrap();
}

#[tokio::test]
async fn upgrade_of_a_missing_release_says_it_is_not_found() {
    let (client, mut handle) = testing::mock_client();
    let server = tokio::spawn(async move {
        let (_, path, _, _, send) = next(&mut handle).await;
        assert_eq!(path, "/apis/baton.dev/v1alpha1/sidecarreleases/x");
        testing::reply(send, 404, &testing::status(404, "NotFound"));
    });
    let mut a = args("0.2.0", None);
    a.release = "x".into();
    let e = upgrade(&ctx(client), a).await.unwrap_err();
    assert!(
        format!("{e:#}").starts_with(r#"sidecarrelease "x" not found"#),
        "{e:#}"
    );
    server.await.unwrap();
}

#[tokio::test]
async fn upgrade_of_a_digest_pinned_image_without_image_is_refused_before_any_patch() {
    let (client, mut handle) = testing::mock_client();
    let server = tokio::spawn(async move {
        let (_, _, _, _, send) = next(&mut handle).await;
        let mut r = release_json("0.1.0", 4, 4, COMPLETE);
        r["spec"]["image"] = json!("host:5000/baton/sidecar@sha256:abcd");
        testing::reply(send, 200, &r);
        assert!(handle.next_request().await.is_none());
    });
    let e = upgrade(&ctx(client), args("0.2.0", None))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("pinned by digest"), "{e}");
    server.await.unwrap();
}

#[tokio::test]
async fn pause_and_resume_merge_patch_spec_upgrade_paused() {
    for paused in [true, false] {
        let (client, mut handle) = testing::mock_client();
        let server = tokio::spawn(async move {
            let mut current = release_json("0.2.0", 4, 4, ROLLING);
            current["spec"]["upgrade"] = json!({"paused": !paused});
            serve_get_then_patch(
                &mut handle,
                current,
                json!({"spec": {"upgrade": {"paused": paused}}}),
            )
            .await;
        });
        let got = pause(&ctx(client), release_args(), paused).await.unwrap();
        assert_eq!(got, Outcome::Success);
        server.await.unwrap();
    }
}

#[tokio::test]
async fn rollback_patches_the_previous_completed_version_with_its_empty_image() {
    let (client, mut handle) = testing::mock_client();
    let server = tokio::spawn(async move {
        serve_get_then_patch(
            &mut handle,
            release_json("0.2.0", 4, 4, SELF_PAUSED),
            json!({"spec": {"version": "0.1.0", "image": "host:5000/baton/sidecar:0.1.0",
                            "emptyImage": "host:5000/baton/empty:0.0.9"}}),
        )
        .await;
    });
    let got = rollback(&ctx(client), release_args()).await.unwrap();
    assert_eq!(got, Outcome::Success);
    server.await.unwrap();
}

#[tokio::test]
async fn rollback_without_history_patches_nothing() {
    let (client, mut handle) = testing::mock_client();
    let server = tokio::spawn(async move {
        let (_, _, _, _, send) = next(&mut handle).await;
        let mut r = release_json("0.1.0", 4, 4, COMPLETE);
        r["status"]["history"] = json!([{"version": "0.1.0", "image": "s:0.1.0"}]);
        testing::reply(send, 200, &r);
        assert!(handle.next_request().await.is_none());
    });
    let e = rollback(&ctx(client), release_args()).await.unwrap_err();
    assert!(
        e.to_string()
            .starts_with("sidecarrelease/default has no earlier completed version to roll back to"),
        "{e}"
    );
    server.await.unwrap();
}

fn quick(goal: Goal, timeout: Duration) -> Watch {
    Watch {
        goal,
        timeout,
        poll_every: Duration::from_millis(5),
        terminal: false,
        max_poll_errors: 3,
    }
}

/// Answers each GET with the next of `states`.
fn serve_states(mut handle: Handle, states: Vec<Value>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        for s in states {
            let (method, path, _, _, send) = next(&mut handle).await;
            assert_eq!((method.as_str(), path.as_str()), ("GET", PATH));
            testing::reply(send, 200, &s);
        }
    })
}

#[tokio::test]
async fn the_watch_prints_a_line_per_change_and_succeeds_on_complete() {
    // Two identical RollingOut states print one line.
    let (client, handle) = testing::mock_client();
    let server = serve_states(
        handle,
        vec![
            release_json("0.2.0", 5, 4, COMPLETE),
            release_json("0.2.0", 5, 5, ROLLING),
            release_json("0.2.0", 5, 5, ROLLING),
            release_json("0.2.0", 5, 5, COMPLETE),
        ],
    );
    let ctx = ctx(client);
    let api = Api::all(ctx.client().await.unwrap());
    let mut sink = Sink::Memory(Vec::new());
    let w = quick(Goal::Rollout, Duration::from_secs(10));
    let (outcome, last) = watch::follow(&ctx, &api, "default", &w, &mut sink)
        .await
        .unwrap();
    server.await.unwrap();
    assert_eq!(outcome, Outcome::Success);
    assert_eq!(last.unwrap().status.unwrap().observed_generation, Some(5));
    let Sink::Memory(lines) = sink else {
        unreachable!()
    };
    assert_eq!(
        lines,
        [
            "sidecarrelease/default: waiting for the operator to observe generation 5 (status describes 4)",
            "sidecarrelease/default: 3/5 pods on 0.2.0 [0.1.0 2/2 ready; 0.2.0 3/3 ready] 1 in flight, 0 failed, RollingOut",
            "sidecarrelease/default: rollout complete (AllPodsUpdated): all 5 pods run 0.2.0 and are ready",
        ]
    );
}

#[tokio::test]
async fn the_watch_fails_with_the_reason_when_the_rollout_pauses_itself() {
    let (client, handle) = testing::mock_client();
    let server = serve_states(
        handle,
        vec![
            release_json("0.2.0", 5, 5, ROLLING),
            with_failed_pod(release_json("0.2.0", 5, 5, SELF_PAUSED)),
        ],
    );
    let ctx = ctx(client);
    let api = Api::all(ctx.client().await.unwrap());
    let mut sink = Sink::Memory(Vec::new());
    let w = quick(Goal::Rollout, Duration::from_secs(10));
    let (outcome, _) = watch::follow(&ctx, &api, "default", &w, &mut sink)
        .await
        .unwrap();
    server.await.unwrap();
    assert_eq!(outcome, Outcome::Failure);
    let Sink::Memory(lines) = sink else {
        unreachable!()
    };
    assert!(
        lines.iter().any(|l| l.starts_with(
            "sidecarrelease/default: rollout stopped: Paused (FailureThresholdExceeded)"
        )),
        "{lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("failed pod web/api-0 → 0.2.0: new sidecar not ready"))
    );
}

#[tokio::test]
async fn the_watch_gives_up_at_its_timeout_with_the_last_state() {
    let (client, mut handle) = testing::mock_client();
    let server = tokio::spawn(async move {
        while let Some((_, send)) = handle.next_request().await {
            testing::reply(send, 200, &release_json("0.2.0", 5, 5, ROLLING));
        }
    });
    let ctx = ctx(client);
    let api = Api::all(ctx.client().await.unwrap());
    let mut sink = Sink::Memory(Vec::new());
    let w = quick(Goal::Rollout, Duration::from_millis(60));
    let (outcome, _) = watch::follow(&ctx, &api, "default", &w, &mut sink)
        .await
        .unwrap();
    drop((api, ctx));
    server.abort();
    assert_eq!(outcome, Outcome::Failure);
    let Sink::Memory(lines) = sink else {
        unreachable!()
    };
    assert_eq!(
        lines.last().unwrap(),
        "sidecarrelease/default: rollout not finished within 60ms (--watch-timeout); last state: 3/5 pods on 0.2.0 [0.1.0 2/2 ready; 0.2.0 3/3 ready] 1 in flight, 0 failed, RollingOut"
    );
}

#[tokio::test]
async fn the_terminal_display_clears_its_bar_and_prints_the_verdict() {
    // indicatif draws nothing when stderr is not a terminal (as under
    // `cargo test`), but the bar's path runs: length, position, clear.
    let (client, handle) = testing::mock_client();
    let server = serve_states(
        handle,
        vec![
            release_json("0.2.0", 5, 5, ROLLING),
            release_json("0.2.0", 5, 5, COMPLETE),
        ],
    );
    let ctx = ctx(client);
    let api = Api::all(ctx.client().await.unwrap());
    let mut sink = Sink::Memory(Vec::new());
    let w = Watch {
        terminal: true,
        ..quick(Goal::Rollout, Duration::from_secs(10))
    };
    let (outcome, _) = watch::follow(&ctx, &api, "default", &w, &mut sink)
        .await
        .unwrap();
    server.await.unwrap();
    assert_eq!(outcome, Outcome::Success);
    let Sink::Memory(lines) = sink else {
        unreachable!()
    };
    // No progress lines: the bar showed those.
    assert_eq!(
        lines,
        [
            "sidecarrelease/default: rollout complete (AllPodsUpdated): all 5 pods run 0.2.0 and are ready"
        ]
    );
}
