//! Rollouts and the two sidecar slots, on the real cluster with the
//! installed operator and webhook (issue #33, items 2 and 3):
//!
//! - after v1 → v2 → v1 the serving sidecar — in slot b after the first
//!   move, in slot a after the second — has exactly the release's requests
//!   and limits (both slots carry them: docs/decisions/0035), while the
//!   operator's leader Pod is deleted in the middle of the first rollout:
//!   the standby finishes it, every pod is handed off exactly once per
//!   version (its sidecar's carried `handoffs_total` counter), and the
//!   byte-checked traffic loses nothing;
//! - the app's Deployment scaled up and down mid-rollout: pods added are
//!   injected on the target version, deleted pods do not stall it;
//! - a pod deleted while its handoff is in flight: the rollout completes
//!   and says so (`status.interruptedPods`, a `HandoffInterrupted` Event).
//!
//! The scenario's pieces are `baton_e2e::rollout`'s. `#[ignore]`d: run
//! with `e2e/run.sh slots_`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use baton_crds::SidecarRelease;
use baton_crds::contract::{SYSTEM_NAMESPACE, annotations, containers, labels, ports};
use baton_e2e::install::{self as baton, LEASE_DURATION};
use baton_e2e::rollout::{
    Pki, Traffic, annotation, complete_on, create_app, create_release, make_versions, pki,
    restarts, sidecar_image, wait_targets_serve,
};
use baton_e2e::wait::pod_ip;
use baton_e2e::{Check, kubectl_ok, wait_for, with_temp_ns_labelled};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, ResourceRequirements};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;

const ROLLOUT: Duration = Duration::from_secs(240);

fn injected() -> BTreeMap<String, String> {
    BTreeMap::from([(labels::INJECT.to_owned(), labels::INJECT_ENABLED.to_owned())])
}

async fn ready_pods(client: &Client, ns: &str, version: &str, replicas: usize) -> Vec<Pod> {
    baton_e2e::rollout::ready_pods(client, ns, version, replicas, Duration::from_secs(180))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn wait_release(
    client: &Client,
    name: &str,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    baton_e2e::rollout::wait_release(client, name, what, ROLLOUT, pred, |_| {})
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn patch_version(client: &Client, name: &str, version: &str) {
    baton_e2e::rollout::set_version(client, name, version)
        .await
        .unwrap_or_else(|e| panic!("patching release {name} to {version}: {e}"));
}

/// The app (Deployment `echo`, `replicas` pods) on v1, serving.
async fn start(client: &Client, ns: &str, pki: &Pki, replicas: usize) -> Vec<Pod> {
    create_app(client, ns, ns, pki, replicas)
        .await
        .unwrap_or_else(|e| panic!("creating the app: {e}"));
    let pods = ready_pods(client, ns, "v1", replicas).await;
    wait_targets_serve(&pods, pki)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    pods
}

fn name(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

/// The resources of `pod`'s container `slot`.
fn resources(pod: &Pod, slot: &str) -> ResourceRequirements {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == slot))
        .and_then(|c| c.resources.clone())
        .unwrap_or_else(|| panic!("{}: no resources on {slot}", name(pod)))
}

fn slot_container(slot: &str) -> &'static str {
    match slot {
        "a" => containers::SLOT_A,
        "b" => containers::SLOT_B,
        other => panic!("no slot {other}"),
    }
}

/// Completed handoffs this pod's sidecars took part in as the new process:
/// the counter travels from process to process (docs/upgrade.md, G8), so
/// the serving one reports the pod's whole history.
async fn handoffs(pod: &Pod) -> u64 {
    let addr = SocketAddr::new(pod_ip(pod), ports::ADMIN);
    let metrics = baton_e2e::admin::get_ok(addr, "/metrics")
        .await
        .unwrap_or_else(|e| panic!("{}: /metrics: {e}", name(pod)));
    let series = r#"baton_sidecar_handoffs_total{role="new",result="complete"}"#;
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series))
        .map_or(0, |v| {
            v.trim()
                .parse::<f64>()
                .unwrap_or_else(|e| panic!("{}: {series} {v:?}: {e}", name(pod))) as u64
        })
}

/// Asserts what every pod must show after the move to `version`.
async fn check_moved(
    pods: &[Pod],
    version: &str,
    serving: &str,
    want: &ResourceRequirements,
    moves: u64,
) {
    for p in pods {
        let who = name(p);
        assert_eq!(
            annotation(p, annotations::ACTIVE_SLOT),
            Some(serving),
            "{who}"
        );
        let spec = p.spec.as_ref().unwrap();
        let img = |n: &str| {
            spec.containers
                .iter()
                .find(|c| c.name == n)
                .and_then(|c| c.image.clone())
        };
        assert_eq!(
            img(slot_container(serving)),
            Some(sidecar_image(version)),
            "{who}"
        );
        // The serving container has exactly the release's resources, and
        // so has the idle one (the next upgrade's).
        assert_eq!(
            &resources(p, slot_container(serving)),
            want,
            "{who}: serving slot {serving}"
        );
        assert_eq!(
            resources(p, containers::SLOT_A),
            resources(p, containers::SLOT_B),
            "{who}: slots differ"
        );
        assert_eq!(
            handoffs(p).await,
            moves,
            "{who}: handoffs after the move to {version}"
        );
    }
}

#[tokio::test]
#[ignore = "needs the e2e cluster with Baton installed: run e2e/run.sh"]
async fn slots_after_v1_v2_v1_with_the_leader_deleted_the_serving_sidecar_has_the_release_s_resources_and_each_pod_moved_once_per_version()
 {
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    make_versions(&["v1", "v2"], &[]).unwrap();
    const REPLICAS: usize = 3;
    with_temp_ns_labelled(injected(), |client, ns| async move {
        let pki = pki();
        let _release = create_release(&client, &ns, &ns, "v1", "1", Some("30m"))
            .await
            .unwrap();
        let want = Api::<SidecarRelease>::all(client.clone())
            .get(&ns)
            .await
            .unwrap()
            .spec
            .resources
            .expect("the release sets resources");
        let before = start(&client, &ns, &pki, REPLICAS).await;
        check_moved(&before, "v1", "a", &want, 0).await;
        let uids: BTreeSet<_> = before.iter().map(|p| p.metadata.uid.clone()).collect();
        let traffic = Traffic::start(&before, &pki);
        tokio::time::sleep(Duration::from_secs(2)).await;

        // v1 → v2, the operator's leader Pod deleted as soon as the first
        // pod is on its way.
        let leader = baton::lease_holder(&client).await.expect("a leader");
        patch_version(&client, &ns, "v2").await;
        wait_release(&client, &ns, "a pod in flight to v2", |s| {
            s["inFlight"].as_i64().unwrap_or(0) >= 1
        })
        .await;
        Api::<Pod>::namespaced(client.clone(), SYSTEM_NAMESPACE)
            .delete(&leader, &DeleteParams::default())
            .await
            .expect("deleting the leader's Pod");
        let new_leader = wait_for("another operator holding the Lease", LEASE_DURATION * 2, || async {
            match baton::lease_holder(&client).await {
                Some(h) if h != leader => Check::Done(h),
                other => Check::NotYet(format!("holder {other:?}")),
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        eprintln!("slots e2e: leader {leader} deleted mid-rollout, {new_leader} took over");
        wait_release(&client, &ns, "release Complete on v2", |s| complete_on(s, "v2", REPLICAS)).await;
        let on_v2 = ready_pods(&client, &ns, "v2", REPLICAS).await;
        check_moved(&on_v2, "v2", "b", &want, 1).await;

        // v2 → v1: back into slot a.
        patch_version(&client, &ns, "v1").await;
        let status = wait_release(&client, &ns, "release Complete on v1", |s| complete_on(s, "v1", REPLICAS)).await;
        let after = ready_pods(&client, &ns, "v1", REPLICAS).await;
        check_moved(&after, "v1", "a", &want, 2).await;

        let totals = traffic.stop().await;
        eprintln!(
            "slots e2e: {} exchanges, {} ok, {} bytes echoed through two rollouts and a leader failover",
            totals.exchanges, totals.ok, totals.bytes
        );
        assert!(totals.exchanges > 0 && totals.bytes > 0);
        assert!(
            totals.failures.is_empty(),
            "{} failed exchanges: {:#?}",
            totals.failures.len(),
            &totals.failures[..totals.failures.len().min(20)]
        );
        assert_eq!(status["failed"], 0);
        let uids_after: BTreeSet<_> = after.iter().map(|p| p.metadata.uid.clone()).collect();
        assert_eq!(uids, uids_after, "no pod may be recreated");
        // Each slot restarted only for its two image swaps.
        for (k, n) in restarts(&after) {
            if baton_e2e::rollout::is_sidecar(&k) {
                assert!(n <= 2, "{k} restarted {n} times");
            }
        }
        baton::wait_whole(&client, "operator", Duration::from_secs(120))
            .await
            .unwrap_or_else(|e| panic!("the operator Deployment did not recover: {e}"));
    })
    .await;
}

async fn scale(client: &Client, ns: &str, replicas: usize) {
    Api::<Deployment>::namespaced(client.clone(), ns)
        .patch(
            "echo",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"replicas": replicas}})),
        )
        .await
        .unwrap_or_else(|e| panic!("scaling echo to {replicas}: {e}"));
}

async fn live_pods(client: &Client, ns: &str) -> Vec<Pod> {
    Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels("app=echo"))
        .await
        .expect("listing pods")
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect()
}

#[tokio::test]
#[ignore = "needs the e2e cluster with Baton installed: run e2e/run.sh"]
async fn slots_scaling_the_deployment_mid_rollout_neither_stalls_it_nor_leaves_a_pod_on_the_old_version()
 {
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    make_versions(&["v1", "v2"], &[]).unwrap();
    with_temp_ns_labelled(injected(), |client, ns| async move {
        let pki = pki();
        let _release = create_release(&client, &ns, &ns, "v1", "1", None)
            .await
            .unwrap();
        let before = start(&client, &ns, &pki, 3).await;
        let first: BTreeSet<String> = before.iter().map(name).collect();

        patch_version(&client, &ns, "v2").await;
        wait_release(&client, &ns, "one pod on v2", |s| {
            s["updated"].as_i64().unwrap_or(0) >= 1
        })
        .await;
        // Up: the new pods are injected on the target version directly.
        scale(&client, &ns, 5).await;
        let added = wait_for("5 pods, 2 of them new", Duration::from_secs(60), || async {
            let live = live_pods(&client, &ns).await;
            let new: Vec<Pod> = live
                .into_iter()
                .filter(|p| !first.contains(&name(p)))
                .collect();
            if new.len() == 2 {
                Check::Done(new)
            } else {
                Check::NotYet(format!("{} new", new.len()))
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        for p in &added {
            assert_eq!(
                annotation(p, annotations::VERSION),
                Some("v2"),
                "{}",
                name(p)
            );
            assert_eq!(
                annotation(p, annotations::ACTIVE_SLOT),
                Some("a"),
                "{}",
                name(p)
            );
            let spec = p.spec.as_ref().unwrap();
            let a = spec
                .containers
                .iter()
                .find(|c| c.name == containers::SLOT_A)
                .unwrap();
            assert_eq!(a.image.as_deref(), Some(sidecar_image("v2").as_str()));
        }
        // Down, while pods are still moving: whichever the ReplicaSet
        // deletes (mid-handoff or not), the rollout finishes.
        scale(&client, &ns, 2).await;
        let status = wait_release(&client, &ns, "release Complete on v2 with 2 pods", |s| {
            complete_on(s, "v2", 2) && s["total"] == 2
        })
        .await;
        let after = ready_pods(&client, &ns, "v2", 2).await;
        assert_eq!(after.len(), 2);
        assert_eq!(status["failed"], 0, "{status}");
        eprintln!(
            "slots e2e: scaled 3 → 5 → 2 mid-rollout; interrupted: {}",
            status["interruptedPods"]
        );
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the e2e cluster with Baton installed: run e2e/run.sh"]
async fn slots_a_pod_deleted_while_its_handoff_is_in_flight_is_reported_and_the_rollout_completes()
{
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    make_versions(&["v1", "v2"], &[]).unwrap();
    const REPLICAS: usize = 3;
    with_temp_ns_labelled(injected(), |client, ns| async move {
        let pki = pki();
        let _release = create_release(&client, &ns, &ns, "v1", "1", None)
            .await
            .unwrap();
        start(&client, &ns, &pki, REPLICAS).await;

        patch_version(&client, &ns, "v2").await;
        // The first pod the operator starts, deleted at once.
        let victim = wait_for("a pod mid-upgrade", Duration::from_secs(60), || async {
            match live_pods(&client, &ns)
                .await
                .into_iter()
                .find(|p| annotation(p, annotations::UPGRADE).is_some())
            {
                Some(p) => Check::Done(name(&p)),
                None => Check::NotYet("no pod has baton.dev/upgrade".into()),
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        Api::<Pod>::namespaced(client.clone(), &ns)
            .delete(&victim, &DeleteParams::default())
            .await
            .expect("deleting the pod mid-handoff");

        let status = wait_release(
            &client,
            &ns,
            "release Complete on v2, the deletion reported",
            |s| {
                complete_on(s, "v2", REPLICAS)
                    && s["interruptedPods"]
                        .as_array()
                        .is_some_and(|l| l.iter().any(|i| i["pod"] == format!("{ns}/{victim}")))
            },
        )
        .await;
        let listed = status["interruptedPods"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["pod"] == format!("{ns}/{victim}"))
            .unwrap();
        assert_eq!(listed["version"], "v2", "{listed}");
        assert!(
            listed["message"]
                .as_str()
                .unwrap_or_default()
                .contains("handoff to v2"),
            "{listed}"
        );
        let after = ready_pods(&client, &ns, "v2", REPLICAS).await;
        assert!(after.iter().all(|p| name(p) != victim));
        // The Warning Event on the release, as a user lists it (the
        // release is cluster-scoped: its Events are in `default`; kubectl
        // 1.20's `describe` of a cluster-scoped custom resource shows none).
        let selector = format!(
            "reason=HandoffInterrupted,involvedObject.kind=SidecarRelease,involvedObject.name={ns}"
        );
        let events = wait_for(
            "the HandoffInterrupted Event",
            Duration::from_secs(30),
            || async {
                let out = kubectl_ok(&["get", "events", "-A", "--field-selector", &selector]);
                if out.contains(&victim) {
                    Check::Done(out)
                } else {
                    Check::NotYet(out)
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        eprintln!("slots e2e: {events}");
    })
    .await;
}
