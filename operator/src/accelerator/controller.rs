//! The AcceleratorPool controller: keeps every pool's status true to the
//! Nodes and Pods of the cluster. Runs only on the leader (see `crate::run`).
//!
//! Any Pod or Node may change any pool's books (a pod anywhere can take a
//! device; a node's labels move it in or out of a pool), so instead of
//! mapping events to pools this controller is level-triggered over all of
//! them: three reflectors (pools, pods, nodes) wake one loop, which waits
//! [`DEBOUNCE`] to coalesce a burst, recomputes every pool with the pure
//! [`super::accounting::compute`] and writes only the statuses that
//! changed, by server-side apply with the operator's one field manager. A
//! pod that ends or is deleted is therefore out of the books within
//! `DEBOUNCE` plus the watch latency (about a second), and a full resync
//! runs every [`RESYNC`] regardless. Each resync also reads `/offload` from
//! every running meshed Pod that holds a device ([`super::probe`]), so a
//! sidecar whose device fails after admission counts as a fallback.
//!
//! The Pod cache holds no Pods: every Pod of the cluster is watched, so
//! each is reduced on arrival to its [`PodDevices`] (a few hundred bytes:
//! what the books and the probe read), and Pods that no pool's books can
//! ever read are not kept at all ([`PodDevices::worth_caching`];
//! [`baton_controlplane::compact`]). Nodes are trimmed to their labels and
//! allocatable.
//!
//! Events: one Warning `OffloadFallback` on each pod that fell back to
//! software (once per pod UID for this leader's lifetime; a new leader may
//! repeat it once, which the Events API aggregates).

use std::borrow::Borrow;
use std::collections::BTreeSet;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use baton_controlplane::{compact, reflect};
use baton_crds::AcceleratorPool;
use baton_crds::conditions::Time;
use baton_crds::contract;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::sync::Notify;

use super::accounting::{self, Fallback, PodDevices, RuntimeVerdicts};
use super::probe::{OffloadProbe, RuntimeFallbacks, Target};
use crate::metrics::Metrics;

const KIND: &str = "AcceleratorPool";
/// Wait after the first change before recomputing: pods come in bursts.
pub const DEBOUNCE: Duration = Duration::from_millis(500);
/// Recompute, and read the device holders' `/offload`, at least this often.
pub const RESYNC: Duration = Duration::from_secs(15);
/// Event reason on a pod whose sidecar fell back to software.
pub const EVENT_REASON_FALLBACK: &str = "OffloadFallback";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("writing status of AcceleratorPool {pool}: {source}")]
    WriteStatus {
        pool: String,
        #[source]
        source: kube::Error,
    },
}

impl Error {
    /// Low-cardinality label for the reconcile metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::WriteStatus { .. } => "write_status",
        }
    }
}

pub struct Context {
    pub client: Client,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    /// Reads a sidecar's `/offload` ([`super::probe::http_probe`]).
    pub probe: OffloadProbe,
}

impl Context {
    pub fn new(client: Client, metrics: Arc<Metrics>, instance: Option<String>) -> Self {
        let recorder = crate::events::recorder(client.clone(), instance);
        Self {
            client,
            metrics,
            recorder,
            probe: super::probe::http_probe(),
        }
    }
}

/// Pod UIDs whose fallback Event was published by this process.
#[derive(Debug, Default)]
pub struct Announced(BTreeSet<String>);

/// Recomputes every pool, writes the statuses that changed and publishes
/// the Events of new fallbacks. One pool's failed write does not stop the
/// others; the first error is returned (the loop retries on its next turn).
pub async fn reconcile_all(
    ctx: &Context,
    pools: &[Arc<AcceleratorPool>],
    nodes: &[Node],
    pods: &[impl Borrow<PodDevices>],
    runtime: &RuntimeVerdicts,
    announced: &mut Announced,
) -> Result<(), Error> {
    let now = Time(Timestamp::now());
    let mut first_error = None;
    let mut current = BTreeSet::new();
    for pool in pools {
        let name = pool.name_any();
        let mut books = accounting::compute(pool, nodes, pods, runtime, &now);
        ctx.metrics.pool_observed(&name, &books.status);
        for f in accounting::unannounced(&books.fallbacks, &announced.0) {
            publish_fallback(ctx, &name, f).await;
            announced.0.insert(f.uid.clone());
        }
        current.extend(books.fallbacks.iter().map(|f| f.uid.clone()));
        if pool.status.as_ref() == Some(&books.status) {
            ctx.metrics.reconciled(KIND, "ok");
            continue;
        }
        books.status.computed_at = Some(MicroTime(now.0));
        match write_status(ctx, &name, &books.status).await {
            Ok(()) => {
                ctx.metrics.reconciled(KIND, "ok");
                tracing::info!(
                    pool = %name,
                    capacity = books.status.capacity,
                    allocated = books.status.allocated,
                    pending = books.status.pending,
                    fallbacks = books.status.fallbacks,
                    "status written"
                );
            }
            Err(error) => {
                ctx.metrics.reconciled(KIND, error.metric_label());
                tracing::warn!(pool = %name, %error, "status not written");
                first_error.get_or_insert(error);
            }
        }
    }
    // Forget pods that are no longer fallbacks (ended, or deleted).
    announced.0.retain(|uid| current.contains(uid));
    first_error.map_or(Ok(()), Err)
}

async fn write_status(
    ctx: &Context,
    name: &str,
    status: &baton_crds::AcceleratorPoolStatus,
) -> Result<(), Error> {
    let api: Api<AcceleratorPool> = Api::all(ctx.client.clone());
    let patch = json!({
        "apiVersion": format!("{}/{}", contract::GROUP, contract::VERSION),
        "kind": KIND,
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(contract::FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map(|_| ())
    .map_err(|source| Error::WriteStatus {
        pool: name.to_owned(),
        source,
    })
}

async fn publish_fallback(ctx: &Context, pool: &str, f: &Fallback) {
    let reference = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(f.namespace.clone()),
        name: Some(f.pod.clone()),
        uid: Some(f.uid.clone()),
        ..ObjectReference::default()
    };
    let event = Event {
        type_: EventType::Warning,
        reason: EVENT_REASON_FALLBACK.into(),
        note: Some(format!(
            "sidecar signs in software instead of AcceleratorPool {pool:?}: {}",
            f.reason
        )),
        action: "AllocateAccelerator".into(),
        secondary: None,
    };
    if let Err(error) = ctx.recorder.publish(&event, &reference).await {
        tracing::warn!(%error, pod = %format!("{}/{}", f.namespace, f.pod), "cannot publish the fallback Event");
    }
}

/// The running meshed Pods granted a device, with their IPs: whose
/// `/offload` to read.
fn probe_targets(pods: &[impl Borrow<PodDevices>]) -> Vec<Target> {
    pods.iter()
        .map(Borrow::<PodDevices>::borrow)
        .filter(|p| !p.ended && p.meshed && p.offload.as_deref() == Some(accounting::OFFLOAD_QAT))
        .filter_map(|p| Some(Target::new(p.uid.to_string(), p.running_ip?)))
        .collect()
}

/// What the Pod cache keeps of a Pod: its [`PodDevices`], computed once
/// per watch event, or nothing for a Pod no pool's books read.
///
/// Every Pod of the cluster passes here, so the cache's size per Pod is
/// the operator's memory per Pod (issue #37): the leader that kept a
/// kube `Store<Pod>` of trimmed Pods held about 8.6 KiB per Pod at 10,000
/// Pods (bench/operator-heap.sh; a k8s-openapi `Pod` is 2,176 bytes
/// inline, each `Container` 2,120 more, plus strings and the Store's
/// keys), where a `PodDevices` is 176 bytes inline plus its few short
/// strings (a test pins it).
fn cached_pod(pod: &Pod) -> Option<PodDevices> {
    Some(PodDevices::from_pod(pod)).filter(PodDevices::worth_caching)
}

/// Keeps labels and allocatable (what the books read).
fn trim_node(node: &mut Node) {
    node.metadata.managed_fields = None;
    node.metadata.annotations = None;
    node.spec = None;
    if let Some(s) = node.status.as_mut() {
        *s = k8s_openapi::api::core::v1::NodeStatus {
            allocatable: s.allocatable.take(),
            ..Default::default()
        };
    }
}

/// A reflector that wakes the loop on every change (the setup is
/// [`baton_controlplane::reflect`]'s, shared with the webhook's caches);
/// it runs as long as the runtime.
fn reflect<K>(api: Api<K>, trim: fn(&mut K), wake: Arc<Notify>) -> Store<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    reflect::spawn(api, trim, move || wake.notify_one(), std::future::pending())
}

/// Runs the controller until the process stops (dropping the future stops
/// the loop; the reflector tasks end with the runtime).
pub async fn run(ctx: Arc<Context>) -> anyhow::Result<()> {
    let wake = Arc::new(Notify::new());
    let pools = reflect(
        Api::<AcceleratorPool>::all(ctx.client.clone()),
        |p| p.metadata.managed_fields = None,
        wake.clone(),
    );
    let pods = {
        let wake = wake.clone();
        compact::spawn(
            Api::<Pod>::all(ctx.client.clone()),
            cached_pod,
            move || wake.notify_one(),
            std::future::pending(),
        )
    };
    let nodes = reflect(
        Api::<Node>::all(ctx.client.clone()),
        trim_node,
        wake.clone(),
    );
    for ready in [
        pools.wait_until_ready().await.map_err(|e| e.to_string()),
        pods.wait_until_ready().await.map_err(|e| e.to_string()),
        nodes.wait_until_ready().await.map_err(|e| e.to_string()),
    ] {
        ready.map_err(|e| anyhow::anyhow!("accelerator caches: {e}"))?;
    }
    tracing::info!("accelerator pool caches synced");
    let mut announced = Announced::default();
    let mut runtime = RuntimeFallbacks::default();
    let mut next_probe = tokio::time::Instant::now();
    loop {
        let pools_now = pools.state();
        if !pools_now.is_empty() {
            let nodes_now: Vec<Node> = nodes.state().iter().map(|n| (**n).clone()).collect();
            let pods_now = pods.state();
            if tokio::time::Instant::now() >= next_probe {
                runtime.refresh(&ctx.probe, &probe_targets(&pods_now)).await;
                next_probe = tokio::time::Instant::now() + RESYNC;
            }
            let verdicts = runtime.verdicts();
            if let Err(error) = reconcile_all(
                &ctx,
                &pools_now,
                &nodes_now,
                &pods_now,
                &verdicts,
                &mut announced,
            )
            .await
            {
                tracing::warn!(%error, "accelerator reconcile failed; retrying");
                tokio::time::sleep(Duration::from_secs(2)).await;
                continue;
            }
        }
        let _ = tokio::time::timeout(RESYNC, wake.notified()).await;
        tokio::time::sleep(DEBOUNCE).await;
    }
}

#[cfg(test)]
mod tests {
    //! reconcile_all against kube's tower-test mock API server: what is
    //! written, with which field manager, and which Events, asserted per
    //! request.

    use super::*;
    use crate::accelerator::accounting::tests::{fallback, granted};
    use crate::mock_api::{self, Handle, Seen};
    use baton_crds::AcceleratorPoolSpec;
    use baton_crds::contract::DEFAULT_QAT_RESOURCE;
    use http::{Method, Request, Response};
    use k8s_openapi::api::core::v1::NodeStatus;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use kube::client::Body;
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    /// Answers every request 200 with its own body (a pool's status write:
    /// the pool with that status), or 500 for status writes when
    /// `fail_status`.
    fn fake_api(handle: Handle, fail_status: bool) -> Arc<Mutex<Vec<Seen>>> {
        mock_api::serve(handle, move |s| {
            if fail_status && s.uri.contains("/status") {
                (
                    500,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "boom", "reason": "InternalError", "code": 500}),
                )
            } else if s.uri.contains("/acceleratorpools/") {
                let mut p = serde_json::to_value(pool()).unwrap();
                p["status"] = s.body["status"].clone();
                (200, p)
            } else {
                (200, s.body.clone())
            }
        })
    }

    fn pool() -> AcceleratorPool {
        let mut p = AcceleratorPool::new(
            "qat",
            AcceleratorPoolSpec {
                resource_name: DEFAULT_QAT_RESOURCE.into(),
                node_selector: None,
                devices_per_sidecar: 1,
            },
        );
        p.metadata.generation = Some(2);
        p
    }

    fn node(devices: &str) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some("n1".into());
        n.status = Some(NodeStatus {
            allocatable: Some(BTreeMap::from([(
                DEFAULT_QAT_RESOURCE.to_owned(),
                Quantity(devices.into()),
            )])),
            ..Default::default()
        });
        n
    }

    fn context(service: tower_test::mock::Mock<Request<Body>, Response<Body>>) -> Context {
        Context::new(
            Client::new(service, "default"),
            Arc::new(Metrics::default()),
            Some("op-0".into()),
        )
    }

    #[tokio::test]
    async fn writes_the_books_by_server_side_apply_and_announces_each_fallback_once() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let seen = fake_api(handle, false);
        let ctx = context(service);
        let mut fell_back = fallback("web-1", 0);
        fell_back.fallback_reason = Some("no free device".into());
        let pods = [granted("web-0", Some("n1"), 1), fell_back];
        let mut announced = Announced::default();
        reconcile_all(
            &ctx,
            &[Arc::new(pool())],
            &[node("1")],
            &pods,
            &RuntimeVerdicts::new(),
            &mut announced,
        )
        .await
        .unwrap();
        let first = seen.lock().unwrap().clone();
        let writes: Vec<&Seen> = first.iter().filter(|s| s.method == Method::PATCH).collect();
        assert_eq!(writes.len(), 1, "{first:#?}");
        let w = writes[0];
        assert!(
            w.uri
                .starts_with("/apis/baton.dev/v1alpha1/acceleratorpools/qat/status?"),
            "{}",
            w.uri
        );
        assert!(
            w.uri.contains("fieldManager=baton.dev%2Foperator"),
            "{}",
            w.uri
        );
        assert!(w.uri.contains("force=true"), "{}", w.uri);
        assert_eq!(w.content_type, "application/apply-patch+yaml");
        let st = &w.body["status"];
        assert_eq!(
            (
                &st["capacity"],
                &st["allocated"],
                &st["free"],
                &st["fallbacks"]
            ),
            (&json!(1), &json!(1), &json!(0), &json!(1))
        );
        assert_eq!(st["observedGeneration"], json!(2));
        assert!(st["computedAt"].is_string(), "{st}");
        assert_eq!(st["nodes"][0]["pods"], json!(["shop/web-0"]));
        assert_eq!(st["recentFallbacks"][0]["pod"], json!("web-1"));
        let exhausted = st["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Exhausted")
            .unwrap();
        assert_eq!(exhausted["status"], "True");
        let events: Vec<&Seen> = first
            .iter()
            .filter(|s| s.method == Method::POST && s.uri.contains("/events"))
            .collect();
        assert_eq!(events.len(), 1, "{first:#?}");
        assert!(
            events[0].uri.contains("/namespaces/shop/events"),
            "{}",
            events[0].uri
        );
        assert_eq!(events[0].body["reason"], EVENT_REASON_FALLBACK);
        assert_eq!(events[0].body["type"], "Warning");
        assert_eq!(events[0].body["regarding"]["name"], "web-1");
        assert!(
            events[0].body["note"]
                .as_str()
                .unwrap()
                .contains("no free device")
        );

        // Same books, status already current: no write, no second Event.
        let mut current = pool();
        current.status = Some(serde_json::from_value(w.body["status"].clone()).unwrap());
        seen.lock().unwrap().clear();
        reconcile_all(
            &ctx,
            &[Arc::new(current.clone())],
            &[node("1")],
            &pods,
            &RuntimeVerdicts::new(),
            &mut announced,
        )
        .await
        .unwrap();
        assert!(
            seen.lock().unwrap().is_empty(),
            "{:#?}",
            seen.lock().unwrap()
        );

        // The holder is deleted: its device is free again in the next write.
        reconcile_all(
            &ctx,
            &[Arc::new(current)],
            &[node("1")],
            &pods[1..],
            &RuntimeVerdicts::new(),
            &mut announced,
        )
        .await
        .unwrap();
        let after = seen.lock().unwrap().clone();
        let w = after.iter().find(|s| s.method == Method::PATCH).unwrap();
        assert_eq!(
            (&w.body["status"]["allocated"], &w.body["status"]["free"]),
            (&json!(0), &json!(1))
        );
        let text = ctx.metrics.encode();
        assert!(
            text.contains("baton_operator_accelerator_devices{pool=\"qat\",state=\"free\"} 1"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_failed_status_write_is_returned_and_counted_and_other_pools_still_written() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let seen = fake_api(handle, true);
        let ctx = context(service);
        let mut second = pool();
        second.metadata.name = Some("qat-b".into());
        let err = reconcile_all(
            &ctx,
            &[Arc::new(pool()), Arc::new(second)],
            &[node("2")],
            &[] as &[PodDevices],
            &RuntimeVerdicts::new(),
            &mut Announced::default(),
        )
        .await
        .unwrap_err();
        assert_eq!(err.metric_label(), "write_status");
        assert!(err.to_string().contains("AcceleratorPool qat"), "{err}");
        let patches = seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.method == Method::PATCH)
            .count();
        assert_eq!(patches, 2);
        assert!(ctx.metrics.encode().contains(
            "baton_operator_reconciles_total{kind=\"AcceleratorPool\",result=\"write_status\"} 2"
        ));
    }

    /// The Pod of an injected workload as the API server sends it, with
    /// what neither the books nor the probe read (images, env, labels and
    /// annotations of others, a Ready condition).
    fn full_pod() -> Pod {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-0", "namespace": "shop", "uid": "u",
                "creationTimestamp": "2026-01-02T03:04:05Z",
                "labels": {"baton.dev/injected": "true", "app": "web"},
                "annotations": {"baton.dev/offload": "qat", "baton.dev/accelerator-pool": "qat",
                                "baton.dev/offload-grant": "req-1", "big": "x"}},
            "spec": {"nodeName": "n1",
                "containers": [
                    {"name": "app", "image": "app:1", "resources": {"limits": {"cpu": "1", "example.com/gpu": "2"}}},
                    {"name": "baton-sidecar-a", "image": "s:1", "env": [{"name": "A", "value": "b"}],
                     "resources": {"limits": {DEFAULT_QAT_RESOURCE: "1"}}},
                    {"name": "baton-sidecar-b", "image": "e:1",
                     "resources": {"requests": {DEFAULT_QAT_RESOURCE: "1"}, "limits": {DEFAULT_QAT_RESOURCE: "1"}}}],
                "initContainers": [{"name": "baton-init", "image": "i:1",
                    "resources": {"limits": {"example.com/gpu": "3"}}}]},
            "status": {"phase": "Running", "podIP": "10.0.0.9",
                "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap()
    }

    #[test]
    fn the_cached_pod_keeps_what_the_books_and_the_probe_read() {
        let full = full_pod();
        let cached = cached_pod(&full).expect("a granted meshed pod is kept");
        assert_eq!(cached, PodDevices::from_pod(&full));
        assert_eq!(
            (&*cached.namespace, &*cached.name, &*cached.uid),
            ("shop", "web-0", "u")
        );
        assert_eq!(cached.node.as_deref(), Some("n1"));
        assert!(cached.meshed && !cached.ended && !cached.unschedulable);
        assert_eq!(
            (
                cached.offload.as_deref(),
                cached.pool.as_deref(),
                cached.grant.as_deref()
            ),
            (Some("qat"), Some("qat"), Some("req-1"))
        );
        assert_eq!(cached.created, 1_767_323_045);
        assert_eq!(
            cached.requests.iter().cloned().collect::<BTreeMap<_, _>>(),
            BTreeMap::from([
                (DEFAULT_QAT_RESOURCE.into(), 2),
                ("example.com/gpu".into(), 3)
            ]),
            "both slots add up; the plain init container's larger request wins"
        );
        assert_eq!(
            probe_targets(std::slice::from_ref(&cached)),
            [Target::new("u".into(), [10, 0, 0, 9].into())],
            "the probe finds the running granted Pod's IP"
        );
        // The books read it as they read the Pod: it holds two devices on
        // n1 as a sidecar pod, and a fallback Event would name it.
        let books = accounting::compute(
            &pool(),
            &[node("4")],
            &[Arc::new(cached.clone())],
            &RuntimeVerdicts::from([("u".to_owned(), "SignErrors: 1".to_owned())]),
            &Time(Timestamp::from_second(1_767_323_045).unwrap()),
        );
        assert_eq!(
            (books.status.allocated, books.status.nodes[0].sidecars),
            (2, 1)
        );
        assert_eq!(books.status.nodes[0].pods, ["shop/web-0"]);
        assert_eq!(books.status.recent_grants, Some(vec!["req-1".to_owned()]));
        assert_eq!(
            books.fallbacks,
            [Fallback {
                namespace: "shop".into(),
                pod: "web-0".into(),
                uid: "u".into(),
                reason: "SignErrors: 1".into(),
            }]
        );

        // A granted pod that asks for no extended resource (devices taken
        // by another mechanism) is still probed; one that asks for nothing
        // and names no pool is not kept.
        let mut plain = full.clone();
        for c in plain.spec.as_mut().unwrap().containers.iter_mut() {
            c.resources = None;
        }
        plain.spec.as_mut().unwrap().init_containers = None;
        let v = cached_pod(&plain).expect("meshed and granted: probed");
        assert!(v.requests.is_empty());
        assert_eq!(probe_targets(&[v]).len(), 1);
        plain.metadata.annotations = None;
        assert_eq!(cached_pod(&plain), None);
        plain.metadata.labels = None;
        assert_eq!(cached_pod(&plain), None);
    }

    #[test]
    fn only_running_pods_with_an_ip_that_have_not_ended_are_probed() {
        let probed = |edit: &dyn Fn(&mut Pod)| {
            let mut p = full_pod();
            edit(&mut p);
            probe_targets(&[cached_pod(&p).unwrap()]).len()
        };
        assert_eq!(probed(&|_| ()), 1);
        assert_eq!(
            probed(&|p| p.status.as_mut().unwrap().phase = Some("Pending".into())),
            0
        );
        assert_eq!(probed(&|p| p.status.as_mut().unwrap().pod_ip = None), 0);
        assert_eq!(
            probed(&|p| p.status.as_mut().unwrap().pod_ip = Some("not-an-ip".into())),
            0
        );
        assert_eq!(
            probed(&|p| p.status.as_mut().unwrap().pod_ip = Some("fd00::9".into())),
            1,
            "IPv6"
        );
        assert_eq!(
            probed(&|p| {
                p.metadata.deletion_timestamp = p.metadata.creation_timestamp.clone();
            }),
            0,
            "being deleted: ended"
        );
        assert_eq!(
            probed(&|p| p.status.as_mut().unwrap().phase = Some("Succeeded".into())),
            0
        );
        assert_eq!(
            probed(&|p| {
                p.metadata
                    .annotations
                    .as_mut()
                    .unwrap()
                    .insert("baton.dev/offload".into(), "software-fallback".into());
            }),
            0,
            "not granted a device"
        );
    }

    #[test]
    fn an_unschedulable_fallback_pod_keeps_its_reason_and_scheduling() {
        let mut p = full_pod();
        p.spec.as_mut().unwrap().node_name = None;
        let a = p.metadata.annotations.as_mut().unwrap();
        a.insert("baton.dev/offload".into(), "software-fallback".into());
        a.insert(
            "baton.dev/offload-fallback-reason".into(),
            "no free device".into(),
        );
        let s = p.status.as_mut().unwrap();
        s.phase = Some("Pending".into());
        s.pod_ip = None;
        s.conditions = Some(vec![k8s_openapi::api::core::v1::PodCondition {
            type_: "PodScheduled".into(),
            status: "False".into(),
            reason: Some("Unschedulable".into()),
            ..Default::default()
        }]);
        let v = cached_pod(&p).unwrap();
        assert!(v.unschedulable && v.node.is_none() && v.running_ip.is_none());
        assert_eq!(v.fallback_reason.as_deref(), Some("no free device"));
        assert_eq!(v.offload.as_deref(), Some("software-fallback"));
    }

    #[test]
    fn a_cached_pod_is_a_small_fraction_of_a_pod() {
        // Every Pod of the cluster is cached (issue #37): a regression to
        // caching Pods, or a field that drags one in, fails here.
        let compact = std::mem::size_of::<PodDevices>();
        let pod = std::mem::size_of::<Pod>();
        assert!(compact <= 192, "PodDevices is {compact} bytes");
        assert!(pod > 10 * compact, "Pod {pod} bytes, PodDevices {compact}");
    }

    #[test]
    fn trimmed_nodes_keep_what_the_books_read() {
        let mut n = node("3");
        n.metadata.annotations = Some(BTreeMap::from([("a".to_owned(), "b".to_owned())]));
        let before = baton_crds::accelerator::NodeInventory::from_node(&n, DEFAULT_QAT_RESOURCE, 0);
        trim_node(&mut n);
        assert_eq!(
            baton_crds::accelerator::NodeInventory::from_node(&n, DEFAULT_QAT_RESOURCE, 0),
            before
        );
        assert!(n.metadata.annotations.is_none());
    }
}
