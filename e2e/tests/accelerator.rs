//! AcceleratorPool books on the real API server with the installed operator
//! and webhook: the test gives the node devices of its own extended resource
//! by patching the Node's status (as an administrator would before a device
//! plugin exists), then creates meshed pods with Preferred and Required
//! offload up to and past capacity, and checks that the pool's status, the
//! Events and the pods' annotations agree, and that deleting a pod frees
//! its device in the status.
//!
//! The resource and the pool are unique to the run and removed afterwards
//! (also when the test fails), so other tests never see them.
//!
//! `#[ignore]`d: run with `e2e/run.sh accelerator_`.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use baton_crds::contract::annotations;
use baton_crds::{AcceleratorPool, AcceleratorPoolStatus, TlsPolicy};
use baton_e2e::install as baton;
use baton_e2e::{Check, pods, wait_for, with_temp_ns_labelled};
use futures::FutureExt;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use rand::Rng;
use serde_json::json;

const STATUS_WAIT: Duration = Duration::from_secs(30);

/// A pod of the test's app, selected by the TlsPolicy for `mode`.
fn app(name: &str, mode: &str) -> Pod {
    let mut pod = pods::pod(
        name,
        vec![pods::container(
            "app",
            "demo-http-echo",
            &["--listen", "0.0.0.0:8080"],
        )],
    );
    pod.metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert("offload".into(), mode.to_lowercase());
    pod
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

async fn policy(client: &Client, ns: &str, mode: &str, resource: &str, pool: &str) {
    let p: TlsPolicy = serde_json::from_value(json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "TlsPolicy",
        "metadata": {"name": mode.to_lowercase()},
        "spec": {
            "podSelector": {"matchLabels": {"offload": mode.to_lowercase()}},
            "privateKeyOffload": {"mode": mode, "resource": resource, "pool": pool},
        },
    }))
    .unwrap();
    Api::<TlsPolicy>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &p)
        .await
        .unwrap_or_else(|e| panic!("creating TlsPolicy {mode}: {e}"));
}

/// Waits until the pool's status satisfies `want`.
async fn books(
    client: &Client,
    pool: &str,
    what: &str,
    want: impl Fn(&AcceleratorPoolStatus) -> bool,
) -> AcceleratorPoolStatus {
    let api = Api::<AcceleratorPool>::all(client.clone());
    wait_for(
        &format!("AcceleratorPool {pool}: {what}"),
        STATUS_WAIT,
        || {
            let api = api.clone();
            let want = &want;
            async move {
                match api.get(pool).await {
                    Ok(p) => match p.status {
                        Some(s) if want(&s) => Check::Done(s),
                        other => Check::NotYet(format!("{other:?}")),
                    },
                    Err(e) => Check::NotYet(e.to_string()),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

async fn bound(client: &Client, ns: &str, name: &str) -> Pod {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait_for(
        &format!("pod {name} scheduled"),
        Duration::from_secs(60),
        || {
            let api = api.clone();
            async move {
                match api.get(name).await {
                    Ok(p) if p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some() => {
                        Check::Done(p)
                    }
                    Ok(p) => Check::NotYet(baton_e2e::wait::pod_state(&p)),
                    Err(e) => Check::NotYet(e.to_string()),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The Event with `reason` about the object named `about`, in namespace
/// `ns` (Events about cluster-scoped objects, such as the Namespace a
/// refusal is reported on, live in `default`).
async fn event_with(client: &Client, ns: &str, reason: &str, about: &str) -> Event {
    let api: Api<Event> = Api::namespaced(client.clone(), ns);
    wait_for(
        &format!("Event {reason} about {about}"),
        STATUS_WAIT,
        || {
            let api = api.clone();
            async move {
                match api.list(&ListParams::default()).await {
                    Ok(list) => match list.items.into_iter().find(|e| {
                        e.reason.as_deref() == Some(reason)
                            && e.involved_object.name.as_deref() == Some(about)
                    }) {
                        Some(e) => Check::Done(e),
                        None => Check::NotYet("not yet".into()),
                    },
                    Err(e) => Check::NotYet(e.to_string()),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Waits until the webhook's caches hold the TlsPolicy for `mode`: a
/// dry-run create of such a pod comes back granted (dry runs book nothing).
async fn wait_policy_seen(api: &Api<Pod>, mode: &str) {
    let probe = app(&format!("probe-{}", mode.to_lowercase()), mode);
    wait_for(
        &format!("the webhook grants a {mode} pod (dry run)"),
        Duration::from_secs(30),
        || {
            let (api, probe) = (api.clone(), probe.clone());
            async move {
                let params = PostParams {
                    dry_run: true,
                    ..PostParams::default()
                };
                match api.create(&params, &probe).await {
                    Ok(p) if annotation(&p, annotations::OFFLOAD) == Some("qat") => Check::Done(()),
                    Ok(p) => Check::NotYet(format!("{:?}", p.metadata.annotations)),
                    Err(e) => Check::NotYet(e.to_string()),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

async fn set_devices(client: &Client, node: &str, resource: &str, count: Option<&str>) {
    let patch =
        json!({"status": {"capacity": {resource: count}, "allocatable": {resource: count}}});
    Api::<Node>::all(client.clone())
        .patch_status(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_or_else(|e| panic!("patching node {node} status: {e}"));
}

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn accelerator_pool_books_grants_fallbacks_refusals_and_frees_a_deleted_pods_device() {
    let id = format!("{:08x}", rand::rng().random::<u32>());
    let scope = format!("accel-{id}");
    let resource = format!("e2e.baton.dev/qat-{id}");
    let pool_name = format!("e2e-{id}");
    let labels = baton::injected_namespace_labels(&scope);
    with_temp_ns_labelled(labels, |client, ns| async move {
        let node = Api::<Node>::all(client.clone())
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .next()
            .and_then(|n| n.metadata.name)
            .expect("the cluster's node");
        baton::create_release(&client, &ns, &scope).await;
        set_devices(&client, &node, &resource, Some("2")).await;
        let pools = Api::<AcceleratorPool>::all(client.clone());
        let body = AssertUnwindSafe(async {
            let pool: AcceleratorPool = serde_json::from_value(json!({
                "apiVersion": "baton.dev/v1alpha1", "kind": "AcceleratorPool",
                "metadata": {"name": pool_name},
                "spec": {"resourceName": resource, "devicesPerSidecar": 1},
            }))
            .unwrap();
            pools
                .create(&PostParams::default(), &pool)
                .await
                .expect("creating the pool");
            let s = books(&client, &pool_name, "2 devices on 1 node", |s| {
                s.capacity == 2 && s.node_count == 1
            })
            .await;
            assert_eq!((s.allocated, s.free, s.fallbacks), (0, 2, 0), "{s:?}");
            policy(&client, &ns, "Preferred", &resource, &pool_name).await;
            policy(&client, &ns, "Required", &resource, &pool_name).await;

            // Up to capacity: both granted, each asking for one device.
            let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
            wait_policy_seen(&api, "Preferred").await;
            wait_policy_seen(&api, "Required").await;
            let mut granted = Vec::new();
            for name in ["preferred-0", "required-0"] {
                let mode = if name.starts_with("required") {
                    "Required"
                } else {
                    "Preferred"
                };
                let created = baton_e2e::accepts(&api, &app(name, mode)).await;
                assert_eq!(
                    annotation(&created, annotations::OFFLOAD),
                    Some("qat"),
                    "{name}"
                );
                assert_eq!(
                    annotation(&created, annotations::ACCELERATOR_POOL),
                    Some(pool_name.as_str())
                );
                granted.push(bound(&client, &ns, name).await);
            }
            let s = books(&client, &pool_name, "2 allocated", |s| s.allocated == 2).await;
            assert_eq!((s.free, s.pending), (0, 0), "{s:?}");
            let row = &s.nodes[0];
            assert_eq!(row.node, node);
            assert_eq!(
                (row.capacity, row.allocated, row.sidecars),
                (2, 2, 2),
                "{row:?}"
            );
            assert_eq!(
                row.pods,
                vec![format!("{ns}/preferred-0"), format!("{ns}/required-0")]
            );
            let exhausted = s
                .conditions
                .iter()
                .find(|c| c.type_ == "Exhausted")
                .unwrap();
            assert_eq!(exhausted.status, "True", "{exhausted:?}");

            // Past capacity: Preferred falls back (annotated, counted, an
            // Event on the pod); Required is refused with the reason.
            let fell_back = baton_e2e::accepts(&api, &app("preferred-1", "Preferred")).await;
            assert_eq!(
                annotation(&fell_back, annotations::OFFLOAD),
                Some("software-fallback")
            );
            let reason = annotation(&fell_back, annotations::OFFLOAD_FALLBACK_REASON)
                .expect("fallback reason")
                .to_owned();
            assert!(reason.contains("free device"), "{reason}");
            let s = books(&client, &pool_name, "1 fallback", |s| s.fallbacks == 1).await;
            assert_eq!(s.recent_fallbacks[0].pod, "preferred-1");
            assert_eq!(s.recent_fallbacks[0].reason, reason);
            assert_eq!(s.allocated, 2, "a fallback holds no device: {s:?}");
            let e = event_with(&client, &ns, "OffloadFallback", "preferred-1").await;
            assert_eq!(e.type_.as_deref(), Some("Warning"));

            let refused = baton_e2e::rejects(&api, &app("required-1", "Required")).await;
            assert!(
                refused.message.contains("requires private-key offload"),
                "{}",
                refused.message
            );
            // No owner: the webhook reports the refusal on the Namespace.
            let e = event_with(&client, "default", "OffloadUnavailable", &ns).await;
            assert!(
                e.message
                    .as_deref()
                    .unwrap_or_default()
                    .contains("required-1"),
                "{e:?}"
            );

            // Deleting a holder frees its device in the books.
            let t = Instant::now();
            api.delete("preferred-0", &DeleteParams::default().grace_period(0))
                .await
                .expect("deleting preferred-0");
            let s = books(&client, &pool_name, "1 allocated after the delete", |s| {
                s.allocated == 1 && s.free == 1
            })
            .await;
            eprintln!(
                "accelerator e2e: device freed in the pool status {:?} after the delete",
                t.elapsed()
            );
            assert_eq!(s.nodes[0].pods, vec![format!("{ns}/required-0")]);
            assert_eq!(
                s.conditions
                    .iter()
                    .find(|c| c.type_ == "Exhausted")
                    .unwrap()
                    .status,
                "False"
            );

            // And the freed device is granted again.
            let again = baton_e2e::accepts(&api, &app("required-2", "Required")).await;
            assert_eq!(annotation(&again, annotations::OFFLOAD), Some("qat"));
            books(&client, &pool_name, "2 allocated again", |s| {
                s.allocated == 2
            })
            .await;
        })
        .catch_unwind()
        .await;
        // Clean-up whatever happened: the pool and the node's devices.
        if let Err(error) = pools.delete(&pool_name, &DeleteParams::default()).await {
            tracing::warn!(%error, "deleting the pool");
        }
        set_devices(&client, &node, &resource, None).await;
        baton::delete_release(&client, &ns).await;
        if let Err(panic) = body {
            std::panic::resume_unwind(panic);
        }
    })
    .await;
}
