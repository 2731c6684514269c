//! Baton's control plane losing a Pod while it works, on the installed
//! Deployments (2 operator and 2 webhook replicas):
//!
//! - the operator leader's Pod is deleted: it releases the Lease on SIGTERM,
//!   the standby holds it well within the lease duration, and release status
//!   keeps being written;
//! - a webhook Pod is deleted while 50 Pods are created in an injected
//!   namespace (`failurePolicy: Fail`): the terminating Pod keeps serving
//!   while not ready, drains, and the other replica takes the rest; every
//!   Pod is admitted and injected, none refused.
//!
//! Each test waits at the end until its Deployment is whole again, so the
//! tests after it find the installation as `e2e/cluster.sh install` left it.
//!
//! `#[ignore]`d: run with `e2e/run.sh`.

use std::time::{Duration, Instant};

use baton_crds::contract::{SYSTEM_NAMESPACE, containers};
use baton_e2e::install::{self as baton, LEASE_DURATION};
use baton_e2e::{Check, wait_for, with_temp_ns_labelled};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, PostParams};

/// How long Baton's Deployments may take to be whole again.
const WHOLE: Duration = Duration::from_secs(120);
/// Pods created while a webhook replica goes away.
const PODS: usize = 50;
/// Spacing of those creates: 50 × 300 ms spans the terminating replica's
/// not-ready delay (5 s), its drain, and its replacement's start.
const SPACING: Duration = Duration::from_millis(300);

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn failover_the_standby_operator_leads_within_the_lease_duration_and_keeps_writing_status() {
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    let scope = format!("opfail-{}", rand::random::<u32>());
    let labels = baton::injected_namespace_labels(&scope);
    with_temp_ns_labelled(labels, |client, ns| async move {
        let operators = baton::wait_whole(&client, "operator", WHOLE)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let names: Vec<String> = operators
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        let leader = wait_for("a leader", LEASE_DURATION * 2, || async {
            match baton::lease_holder(&client).await {
                Some(h) if names.contains(&h) => Check::Done(h),
                other => Check::NotYet(format!("holder {other:?}, pods {names:?}")),
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));

        baton::create_release(&client, &ns, &scope).await;
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let outcome = async {
            pods.create(&PostParams::default(), &baton::unscheduled_pod("before"))
                .await
                .expect("create pod");
            baton::wait_release_total(&client, &ns, 1, Duration::from_secs(60))
                .await
                .unwrap_or_else(|e| panic!("status before the failover: {e}"));

            // Delete the leader's Pod the way a drain or rollout would
            // (SIGTERM, grace period), and time the takeover.
            let system: Api<Pod> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
            let deleted = Instant::now();
            system
                .delete(&leader, &DeleteParams::default())
                .await
                .expect("delete the leader pod");
            let new_leader = wait_for(
                "another replica holding the Lease",
                LEASE_DURATION,
                || async {
                    match baton::lease_holder(&client).await {
                        Some(h) if h != leader => Check::Done(h),
                        other => Check::NotYet(format!("holder {other:?}")),
                    }
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            let takeover = deleted.elapsed();
            eprintln!("operator failover: {leader} -> {new_leader} in {takeover:?}");

            // The new leader writes status.
            pods.create(&PostParams::default(), &baton::unscheduled_pod("after"))
                .await
                .expect("create pod");
            baton::wait_release_total(&client, &ns, 2, Duration::from_secs(60))
                .await
                .unwrap_or_else(|e| panic!("status after the failover: {e}"));
            takeover
        }
        .await;
        baton::delete_release(&client, &ns).await;
        assert!(outcome < LEASE_DURATION, "takeover took {outcome:?}");
        baton::wait_whole(&client, "operator", WHOLE)
            .await
            .unwrap_or_else(|e| panic!("the operator Deployment did not recover: {e}"));
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn failover_deleting_a_webhook_pod_while_50_pods_are_created_refuses_none() {
    baton_e2e::cluster::require_component("webhook");
    let scope = format!("whfail-{}", rand::random::<u32>());
    let labels = baton::injected_namespace_labels(&scope);
    with_temp_ns_labelled(labels, |client, ns| async move {
        let webhooks = baton::wait_whole(&client, "webhook", WHOLE)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let victim = webhooks[0].metadata.name.clone().expect("pod name");
        baton::create_release(&client, &ns, &scope).await;

        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let creator = {
            let pods = pods.clone();
            tokio::spawn(async move {
                let mut results = Vec::with_capacity(PODS);
                for i in 0..PODS {
                    let started = Instant::now();
                    let result = pods
                        .create(
                            &PostParams::default(),
                            &baton::unscheduled_pod(&format!("p-{i}")),
                        )
                        .await;
                    results.push((i, started.elapsed(), result));
                    tokio::time::sleep(SPACING).await;
                }
                results
            })
        };
        // A few creates in, take a replica away.
        tokio::time::sleep(SPACING * 5).await;
        let system: Api<Pod> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
        system
            .delete(&victim, &DeleteParams::default())
            .await
            .expect("delete a webhook pod");
        let results = creator.await.expect("creator task");
        baton::delete_release(&client, &ns).await;

        let refused: Vec<String> = results
            .iter()
            .filter_map(|(i, _, r)| r.as_ref().err().map(|e| format!("p-{i}: {e}")))
            .collect();
        assert!(
            refused.is_empty(),
            "refused while {victim} went away: {refused:#?}"
        );
        let not_injected: Vec<usize> = results
            .iter()
            .filter_map(|(i, _, r)| {
                let pod = r.as_ref().ok()?;
                let injected = pod
                    .spec
                    .as_ref()
                    .is_some_and(|s| s.containers.iter().any(|c| c.name == containers::SLOT_A));
                (!injected).then_some(*i)
            })
            .collect();
        assert!(
            not_injected.is_empty(),
            "admitted without injection: {not_injected:?}"
        );
        let slowest = results.iter().map(|(_, d, _)| *d).max().unwrap_or_default();
        eprintln!("webhook failover: {PODS} pods created, slowest create {slowest:?}");

        // The replacement replica comes up and the Deployment is whole again.
        let after = baton::wait_whole(&client, "webhook", WHOLE)
            .await
            .unwrap_or_else(|e| panic!("the webhook Deployment did not recover: {e}"));
        assert!(
            after
                .iter()
                .all(|p| p.metadata.name.as_deref() != Some(victim.as_str())),
            "{victim} is still there"
        );
    })
    .await;
}
