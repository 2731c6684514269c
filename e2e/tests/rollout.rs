//! The rollout on a real cluster: a Deployment of 5 injected pods under
//! continuous byte-checked traffic (HTTP/1.1, HTTP/2, TCP streams, and TLS
//! the application speaks itself, carried by the sidecar as opaque bytes),
//! `kubectl patch` of the SidecarRelease v1 → v2 → v1 with zero failed
//! exchanges, every pod on the target version, the same pods (no pod
//! recreated) and unchanged application restart counts; then a broken
//! version whose sidecar exits at once: the pods keep serving, the release
//! is Degraded and paused, the reason in `kubectl describe`.
//!
//! The scenario's pieces live in `baton_e2e::rollout` (the demo runs the
//! same). Needs the operator and webhook installed (`e2e/scripts/install.sh`)
//! and the images `docker.io/baton/{sidecar,empty,nettools,demo-http-echo,
//! demo-tcp-echo}:$BATON_IMAGE_TAG`. `#[ignore]`d: run with `e2e/run.sh`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use baton_crds::contract::{annotations, containers, labels};
use baton_e2e::pods::image;
use baton_e2e::rollout::{
    Pki, Traffic, annotation, app_restarts, complete_on, create_app, create_release,
    handoff_durations, is_sidecar, make_versions, paused_by_failures, pki, restarts, sidecar_image,
    wait_targets_serve,
};
use baton_e2e::{kubectl_ok, with_temp_ns_labelled};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;

const REPLICAS: usize = 5;

async fn ready_pods(client: &Client, ns: &str, version: &str) -> Vec<Pod> {
    baton_e2e::rollout::ready_pods(client, ns, version, REPLICAS, Duration::from_secs(180))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn wait_release(
    client: &Client,
    name: &str,
    what: &str,
    within: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    baton_e2e::rollout::wait_release(client, name, what, within, pred, |_| {})
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn patch_version(client: &Client, name: &str, version: &str) {
    baton_e2e::rollout::set_version(client, name, version)
        .await
        .unwrap_or_else(|e| panic!("patching release {name} to {version}: {e}"));
}

async fn start(client: &Client, ns: &str, pki: &Pki) -> Vec<Pod> {
    create_app(client, ns, ns, pki, REPLICAS)
        .await
        .unwrap_or_else(|e| panic!("creating the app: {e}"));
    let pods = ready_pods(client, ns, "v1").await;
    wait_targets_serve(&pods, pki)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    pods
}

fn injected() -> BTreeMap<String, String> {
    BTreeMap::from([(labels::INJECT.to_owned(), labels::INJECT_ENABLED.to_owned())])
}

#[tokio::test]
#[ignore = "needs the e2e cluster with Baton installed: run e2e/run.sh"]
async fn rollout_v1_to_v2_and_back_loses_no_exchange_and_restarts_no_app_container() {
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    make_versions(&["v1", "v2"], &[]).unwrap();
    with_temp_ns_labelled(injected(), |client, ns| async move {
        let pki = pki();
        let _release = create_release(&client, &ns, &ns, "v1", "2", None).await.unwrap();
        let before = start(&client, &ns, &pki).await;
        let uids: Vec<_> = before.iter().map(|p| p.metadata.uid.clone()).collect();
        let restarts_before = restarts(&before);
        let traffic = Traffic::start(&before, &pki);
        tokio::time::sleep(Duration::from_secs(3)).await;

        let started = Instant::now();
        patch_version(&client, &ns, "v2").await;
        wait_release(&client, &ns, "release Complete on v2", Duration::from_secs(300), |s| complete_on(s, "v2", REPLICAS)).await;
        let to_v2 = started.elapsed();
        let on_v2 = ready_pods(&client, &ns, "v2").await;
        for p in &on_v2 {
            assert_eq!(annotation(p, annotations::ACTIVE_SLOT), Some("b"), "{:?}", p.metadata.name);
            assert!(annotation(p, annotations::UPGRADE).is_none());
        }

        let started = Instant::now();
        patch_version(&client, &ns, "v1").await;
        let status = wait_release(&client, &ns, "release Complete on v1", Duration::from_secs(300), |s| complete_on(s, "v1", REPLICAS)).await;
        let to_v1 = started.elapsed();
        let after = ready_pods(&client, &ns, "v1").await;

        let totals = traffic.stop().await;
        eprintln!("rollout v1→v2 {to_v2:?}, v2→v1 {to_v1:?}; traffic: {} exchanges, {} ok, {} bytes echoed; HTTP/2: {} reconnects after GOAWAY, {} unprocessed requests re-sent", totals.exchanges, totals.ok, totals.bytes, totals.reconnects, totals.retried);
        assert!(totals.exchanges > 0 && totals.bytes > 0);
        assert!(totals.failures.is_empty(), "{} failed exchanges: {:#?}", totals.failures.len(), &totals.failures[..totals.failures.len().min(20)]);

        // The same pods, in place; every one back on v1 in slot a, slot b idle.
        let uids_after: Vec<_> = after.iter().map(|p| p.metadata.uid.clone()).collect();
        assert_eq!(sorted(uids), sorted(uids_after), "no pod may be recreated");
        let empty = image("empty");
        for p in &after {
            assert_eq!(annotation(p, annotations::ACTIVE_SLOT), Some("a"));
            let spec = p.spec.as_ref().unwrap();
            let img = |n: &str| spec.containers.iter().find(|c| c.name == n).and_then(|c| c.image.clone());
            assert_eq!(img(containers::SLOT_A), Some(sidecar_image("v1")));
            assert_eq!(img(containers::SLOT_B), Some(empty.clone()));
        }
        // Application containers never restarted; each sidecar slot
        // restarted only for its image swaps (two each), never ping-ponged.
        let restarts_after = restarts(&after);
        for (k, n) in &restarts_after {
            if is_sidecar(k) {
                assert!(*n <= 2, "{k} restarted {n} times: {restarts_after:?}");
            }
        }
        assert_eq!(app_restarts(&restarts_before, &restarts_after), Vec::<String>::new());
        assert_eq!(status["failed"], 0);
        // Every Pod's last handoff is on record with its duration (the
        // move back to v1; Events would have folded it into the first).
        let durations = handoff_durations(&client, &ns, "app=echo", "v1").await.unwrap();
        assert_eq!(durations.len(), REPLICAS, "a handoff record per Pod: {durations:?}");
    })
    .await;
}

fn sorted<T: Ord>(mut v: Vec<T>) -> Vec<T> {
    v.sort();
    v
}

#[tokio::test]
#[ignore = "needs the e2e cluster with Baton installed: run e2e/run.sh"]
async fn rollout_of_a_broken_version_pauses_degraded_while_pods_keep_serving() {
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    make_versions(&["v1"], &["v3"]).unwrap();
    with_temp_ns_labelled(injected(), |client, ns| async move {
        let pki = pki();
        let _release = create_release(&client, &ns, &ns, "v1", "2", None)
            .await
            .unwrap();
        let pods = start(&client, &ns, &pki).await;
        let restarts_before = restarts(&pods);
        let traffic = Traffic::start(&pods, &pki);
        tokio::time::sleep(Duration::from_secs(3)).await;

        patch_version(&client, &ns, "v3").await;
        let status = wait_release(
            &client,
            &ns,
            "release paused by failures",
            Duration::from_secs(180),
            paused_by_failures,
        )
        .await;
        assert!(status["failed"].as_i64().unwrap_or(0) >= 1, "{status}");
        assert_eq!(status["rollout"], "Paused");
        // No pod moved past the first failure's batch, and every failed pod's
        // standby slot is idle again.
        let now = ready_pods(&client, &ns, "v1").await;
        for p in &now {
            let spec = p.spec.as_ref().unwrap();
            let b = spec
                .containers
                .iter()
                .find(|c| c.name == containers::SLOT_B)
                .and_then(|c| c.image.clone());
            assert_eq!(b, Some(image("empty")), "{:?}", p.metadata.name);
        }
        let described = kubectl_ok(&["describe", "sidecarrelease", &ns]);
        assert!(
            described.contains("FailureThresholdExceeded"),
            "{described}"
        );
        assert!(described.contains("HandoffFailed"), "{described}");

        let totals = traffic.stop().await;
        assert!(totals.exchanges > 0);
        assert!(
            totals.failures.is_empty(),
            "{:#?}",
            &totals.failures[..totals.failures.len().min(20)]
        );
        assert_eq!(
            app_restarts(&restarts_before, &restarts(&now)),
            Vec::<String>::new()
        );
    })
    .await;
}
