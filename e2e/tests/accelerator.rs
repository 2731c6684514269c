//! AcceleratorPool books on the real API server with the installed operator
//! and webhook: the test gives the node devices of its own extended resource
//! by patching the Node's status (as an administrator would before a device
//! plugin exists), then creates meshed pods with Preferred and Required
//! offload up to and past capacity, and checks that the pool's status, the
//! Events and the pods' annotations agree, and that deleting a pod frees
//! its devices in the status within seconds. Each pod holds one device per
//! sidecar slot (two), so that either slot has one after a hot upgrade
//! (docs/decisions/0036); a Required pod then upgrades in place.
//!
//! The pods are created for real (not dry runs): the scheduler must place
//! them for the books to count them, and the webhook books grants and
//! publishes refusal Events only for real requests.
//!
//! The resource and the pool are unique to the run and removed afterwards
//! (also when the test fails), so other tests never see them.
//!
//! `#[ignore]`d: run with `e2e/run.sh accelerator_`.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use baton_config::report::OffloadReport;
use baton_crds::contract::{annotations, containers, ports};
use baton_crds::{AcceleratorPool, AcceleratorPoolStatus, TlsPolicy};
use baton_e2e::install as baton;
use baton_e2e::rollout::{complete_on, make_versions, ready_pods_labelled, set_version};
use baton_e2e::{Check, pods, wait_for, with_temp_ns_labelled};
use futures::FutureExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use rand::Rng;
use serde_json::json;

const STATUS_WAIT: Duration = Duration::from_secs(30);
/// How soon a deleted holder's device must be free in the status: the
/// operator's pod watch plus its 0.5 s debounce, with room for a busy
/// two-core machine. The issue asks for "within seconds".
const FREED_WITHIN: Duration = Duration::from_secs(10);

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
    books_within(client, pool, what, STATUS_WAIT, want).await
}

/// [`books`] with its own deadline.
async fn books_within(
    client: &Client,
    pool: &str,
    what: &str,
    within: Duration,
    want: impl Fn(&AcceleratorPoolStatus) -> bool,
) -> AcceleratorPoolStatus {
    let api = Api::<AcceleratorPool>::all(client.clone());
    wait_for(&format!("AcceleratorPool {pool}: {what}"), within, || {
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
    })
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

/// Pod `name`'s sidecar's `GET /offload` (admin port, from the node) once
/// it serves TLS: the document the operator's books read.
async fn offload_of(api: &Api<Pod>, name: &str) -> OffloadReport {
    wait_for(
        &format!("{name}'s sidecar reports its offload engine"),
        Duration::from_secs(60),
        || {
            let api = api.clone();
            async move {
                let ip = match api.get(name).await {
                    Ok(p) => p.status.and_then(|s| s.pod_ip),
                    Err(e) => return Check::NotYet(e.to_string()),
                };
                let Some(ip) = ip.and_then(|ip| ip.parse().ok()) else {
                    return Check::NotYet("no pod IP yet".into());
                };
                let addr = std::net::SocketAddr::new(ip, ports::ADMIN);
                match baton_e2e::admin::get_ok(addr, "/offload").await {
                    Ok(body) => match serde_json::from_str::<OffloadReport>(&body) {
                        Ok(r) if r.configured => Check::Done(r),
                        Ok(r) => Check::NotYet(format!("{r:?}")),
                        Err(e) => Check::NotYet(format!("{e}: {body}")),
                    },
                    Err(e) => Check::NotYet(e),
                }
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The Event with `reason` about the object named `about`, in namespace
/// `ns` (the webhook records a refusal about a Namespace in that namespace).
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

/// What a test gets from [`with_pool`].
struct Devices {
    client: Client,
    ns: String,
    /// The node given the devices.
    node: String,
    /// The extended resource, unique to the run.
    resource: String,
    /// The AcceleratorPool serving it.
    pool: String,
}

/// Runs `test` in a fresh injected namespace with its own SidecarRelease
/// (named after the namespace), the cluster's node advertising `devices`
/// devices of a resource unique to the run, and an AcceleratorPool of it
/// (one device per sidecar) whose books already show them. The pool, the
/// node's devices and the release are removed afterwards, also when the
/// test fails.
async fn with_pool<F, Fut>(devices: i64, test: F)
where
    F: FnOnce(Devices) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
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
        set_devices(
            &client,
            &node,
            &resource,
            Some(devices.to_string().as_str()),
        )
        .await;
        let pools = Api::<AcceleratorPool>::all(client.clone());
        let t = Devices {
            client: client.clone(),
            ns: ns.clone(),
            node: node.clone(),
            resource: resource.clone(),
            pool: pool_name.clone(),
        };
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
            let s = books(&client, &pool_name, "devices on 1 node", |s| {
                s.capacity == devices && s.node_count == 1
            })
            .await;
            assert_eq!((s.allocated, s.free, s.fallbacks), (0, devices, 0), "{s:?}");
            test(t).await;
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

#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn accelerator_pool_books_grants_fallbacks_refusals_and_frees_a_deleted_pods_device() {
    with_pool(4, |t| async move {
        let (client, ns) = (&t.client, &t.ns);
        policy(client, ns, "Preferred", &t.resource, &t.pool).await;
        policy(client, ns, "Required", &t.resource, &t.pool).await;

        // Up to capacity: both granted, each slot of each asking for one
        // device (two per pod).
        let api: Api<Pod> = Api::namespaced(client.clone(), ns);
        wait_policy_seen(&api, "Preferred").await;
        wait_policy_seen(&api, "Required").await;
        let mut granted = Vec::new();
        for name in ["preferred-0", "required-0"] {
            let mode = if name.starts_with("required") {
                "Required"
            } else {
                "Preferred"
            };
            let created = baton_e2e::creates(&api, &app(name, mode)).await;
            assert_eq!(
                annotation(&created, annotations::OFFLOAD),
                Some("qat"),
                "{name}"
            );
            assert_eq!(
                annotation(&created, annotations::ACCELERATOR_POOL),
                Some(t.pool.as_str())
            );
            let grant = annotation(&created, annotations::OFFLOAD_GRANT)
                .unwrap_or_else(|| panic!("{name}: no grant id"))
                .to_owned();
            bound(client, ns, name).await;
            granted.push(grant);
        }
        // Each holder's sidecar signs with the device's engine (OpenSSL's
        // default provider stands in for QAT's here): what the operator
        // reads from `/offload`, so neither is a fallback in the books.
        for name in ["preferred-0", "required-0"] {
            let r = offload_of(&api, name).await;
            assert_eq!(
                (r.requested.as_str(), r.active.as_str()),
                ("openssl", "openssl"),
                "{name}: {r:?}"
            );
            assert_eq!(r.falling_back_since(None), None, "{name}: {r:?}");
        }
        let s = books(client, &t.pool, "4 allocated", |s| s.allocated == 4).await;
        assert_eq!((s.free, s.pending), (0, 0), "{s:?}");
        // The books name the grants they hold, so the webhook stops
        // counting them on top (the second grant above came right after the
        // first: counted twice, it would have been refused).
        let listed = s.recent_grants.clone().unwrap_or_default();
        for grant in &granted {
            assert!(listed.contains(grant), "{grant} not in {listed:?}");
        }
        let row = &s.nodes[0];
        assert_eq!(row.node, t.node);
        assert_eq!(
            (row.capacity, row.allocated, row.sidecars),
            (4, 4, 2),
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
        let fell_back = baton_e2e::creates(&api, &app("preferred-1", "Preferred")).await;
        assert_eq!(
            annotation(&fell_back, annotations::OFFLOAD),
            Some("software-fallback")
        );
        let reason = annotation(&fell_back, annotations::OFFLOAD_FALLBACK_REASON)
            .expect("fallback reason")
            .to_owned();
        assert!(reason.contains("free device"), "{reason}");
        let s = books(client, &t.pool, "1 fallback", |s| s.fallbacks == 1).await;
        assert_eq!(s.recent_fallbacks[0].pod, "preferred-1");
        assert_eq!(s.recent_fallbacks[0].reason, reason);
        assert_eq!(s.allocated, 4, "a fallback holds no device: {s:?}");
        let e = event_with(client, ns, "OffloadFallback", "preferred-1").await;
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert!(
            e.message.as_deref().unwrap_or_default().contains(&reason),
            "{e:?}"
        );

        let refused = baton_e2e::refuses(&api, &app("required-1", "Required")).await;
        assert!(
            refused.message.contains("requires private-key offload"),
            "{}",
            refused.message
        );
        // No owner: the webhook reports the refusal on the Namespace.
        let e = event_with(client, ns, "OffloadUnavailable", ns).await;
        assert!(
            e.message
                .as_deref()
                .unwrap_or_default()
                .contains("required-1"),
            "{e:?}"
        );

        // Deleting a holder (an ordinary delete: the pod terminates
        // gracefully) frees its devices in the books within seconds.
        let started = Instant::now();
        api.delete("preferred-0", &DeleteParams::default())
            .await
            .expect("deleting preferred-0");
        let s = books_within(
            client,
            &t.pool,
            "2 allocated after the delete",
            FREED_WITHIN,
            |s| s.allocated == 2 && s.free == 2,
        )
        .await;
        eprintln!(
            "accelerator e2e: device freed in the pool status {:?} after the delete",
            started.elapsed()
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

        // And the freed devices are granted again.
        let again = baton_e2e::creates(&api, &app("required-2", "Required")).await;
        assert_eq!(annotation(&again, annotations::OFFLOAD), Some("qat"));
        bound(client, ns, "required-2").await;
        let s = books(client, &t.pool, "4 allocated again", |s| s.allocated == 4).await;
        assert_eq!(
            s.nodes[0].pods,
            vec![format!("{ns}/required-0"), format!("{ns}/required-2")]
        );
    })
    .await;
}

/// A Deployment of one pod whose TlsPolicy requires offload.
fn required_deployment() -> Deployment {
    let mut template = app("held", "Required");
    let labels = template.metadata.labels.clone();
    template.metadata.name = None;
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "held"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "held"}},
            "template": {"metadata": {"labels": labels}, "spec": template.spec},
        },
    }))
    .expect("the deployment literal is valid")
}

/// The one pod of the `held` Deployment, once it is Ready on `version`
/// and no other is left.
async fn held_pod(client: &Client, ns: &str, version: &str) -> Pod {
    ready_pods_labelled(client, ns, "app=held", version, 1, Duration::from_secs(180))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .remove(0)
}

/// The device limit of `slot` in `pod`'s spec.
fn slot_devices(pod: &Pod, slot: &str, resource: &str) -> Option<String> {
    pod.spec
        .as_ref()?
        .containers
        .iter()
        .find(|c| c.name == slot)?
        .resources
        .as_ref()?
        .limits
        .as_ref()?
        .get(resource)
        .map(|q| q.0.clone())
}

/// Each sidecar slot holds a device of its own (docs/decisions/0036), so a
/// Deployment's pod whose TlsPolicy requires offload moves to a new
/// version in place, into slot b and back into slot a, never evicted: the
/// same pod, a device in both slots, the serving sidecar signing with the
/// device's engine after each move, and the books unchanged.
#[tokio::test]
#[ignore = "needs the local cluster: run e2e/run.sh"]
async fn accelerator_required_pods_upgrade_in_place_with_a_device_in_every_slot() {
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    make_versions(&["v2", "v3"], &[]).unwrap();
    with_pool(2, |t| async move {
        let (client, ns) = (&t.client, &t.ns);
        policy(client, ns, "Required", &t.resource, &t.pool).await;
        let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
        wait_policy_seen(&pods, "Required").await;
        Api::<Deployment>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &required_deployment())
            .await
            .expect("creating the Deployment");
        let first = held_pod(client, ns, baton::RELEASE_VERSION).await;
        let name = first.metadata.name.clone().unwrap();
        assert_eq!(annotation(&first, annotations::OFFLOAD), Some("qat"));
        for slot in [containers::SLOT_A, containers::SLOT_B] {
            assert_eq!(
                slot_devices(&first, slot, &t.resource).as_deref(),
                Some("1"),
                "{slot}"
            );
        }
        let held = |s: &AcceleratorPoolStatus| {
            s.allocated == 2
                && s.nodes
                    .first()
                    .is_some_and(|n| n.pods == vec![format!("{ns}/{name}")] && n.sidecars == 1)
        };
        books(client, &t.pool, "the pod holds a device per slot", held).await;
        let app_restarts = |p: &Pod| -> i32 {
            p.status
                .iter()
                .flat_map(|s| s.container_statuses.iter().flatten())
                .filter(|c| c.name == "app")
                .map(|c| c.restart_count)
                .sum()
        };

        for (version, serving) in [("v2", "b"), ("v3", "a")] {
            set_version(client, ns, version)
                .await
                .unwrap_or_else(|e| panic!("patching the release to {version}: {e}"));
            let now = held_pod(client, ns, version).await;
            assert_eq!(
                now.metadata.uid, first.metadata.uid,
                "moved in place, not recreated"
            );
            assert_eq!(annotation(&now, annotations::ACTIVE_SLOT), Some(serving));
            assert_eq!(app_restarts(&now), app_restarts(&first));
            let r = offload_of(&pods, &name).await;
            assert_eq!(
                (r.requested.as_str(), r.active.as_str()),
                ("openssl", "openssl"),
                "{version}: {r:?}"
            );
            assert_eq!(r.falling_back_since(None), None, "{version}: {r:?}");
            let s = books(client, &t.pool, "the same pod holds the devices", held).await;
            assert_eq!((s.pending, s.fallbacks), (0, 0), "{s:?}");
            baton_e2e::rollout::wait_release(
                client,
                ns,
                &format!("release Complete on {version}"),
                Duration::from_secs(90),
                |s| complete_on(s, version, 1),
                |_| {},
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        }
        let evicted: Vec<Event> = Api::<Event>::namespaced(client.clone(), ns)
            .list(&ListParams::default().fields("reason=Evicted"))
            .await
            .expect("listing Events")
            .items;
        assert!(evicted.is_empty(), "{evicted:?}");
    })
    .await;
}
