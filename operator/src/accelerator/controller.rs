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
//! Pods and Nodes are trimmed in the caches to the fields the books read
//! (a pod keeps its containers' resources, not its env or volumes).
//!
//! Events: one Warning `OffloadFallback` on each pod that fell back to
//! software (once per pod UID for this leader's lifetime; a new leader may
//! repeat it once, which the Events API aggregates).

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use baton_controlplane::reflect;
use baton_crds::AcceleratorPool;
use baton_crds::conditions::Time;
use baton_crds::contract::{self, annotations};
use k8s_openapi::api::core::v1::{
    Container, Node, ObjectReference, Pod, PodSpec, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::Store;
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::sync::Notify;

use super::accounting::{self, Fallback, PodDevices};
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
    pods: &[PodDevices],
    announced: &mut Announced,
) -> Result<(), Error> {
    let now = Time(Timestamp::now());
    let mut first_error = None;
    let mut current = BTreeSet::new();
    for pool in pools {
        let name = pool.name_any();
        let mut books = accounting::compute(pool, nodes, pods, &now);
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
fn probe_targets(pods: &[Arc<Pod>], books: &[PodDevices]) -> Vec<Target> {
    pods.iter()
        .zip(books)
        .filter(|(_, b)| {
            !b.ended && b.meshed && b.offload.as_deref() == Some(accounting::OFFLOAD_QAT)
        })
        .filter_map(|(p, b)| {
            let status = p.status.as_ref()?;
            if status.phase.as_deref() != Some("Running") {
                return None;
            }
            let ip = status.pod_ip.as_deref()?.parse().ok()?;
            Some(Target::new(b.uid.clone(), ip))
        })
        .collect()
}

/// The one container a cached Pod keeps (see [`trim_pod`]).
const FOLDED_CONTAINER: &str = "requests";

/// Keeps only what [`PodDevices::from_pod`] and [`probe_targets`] read.
///
/// Every Pod of the cluster is in this cache, so its size per Pod is the
/// operator's memory per Pod: a `Container` is 2 KiB before any of its
/// strings (k8s-openapi 0.29), and an injected Pod has three or four. The
/// containers are folded into at most one that carries the Pod's effective
/// extended-resource request ([`accounting::effective_requests`], the only
/// thing read from them), and none when it requests nothing. With 2,000
/// injected Pods the leader held 31 MB in this cache before (issue #37,
/// bench/operator-heap.sh).
fn trim_pod(pod: &mut Pod) {
    let m = &mut pod.metadata;
    m.managed_fields = None;
    m.owner_references = None;
    if let Some(a) = m.annotations.as_mut() {
        a.retain(|k, _| {
            [
                annotations::OFFLOAD,
                annotations::ACCELERATOR_POOL,
                annotations::OFFLOAD_FALLBACK_REASON,
                annotations::OFFLOAD_GRANT,
            ]
            .contains(&k.as_str())
        });
    }
    if let Some(spec) = pod.spec.as_mut() {
        let requests = accounting::effective_requests(
            &spec.containers,
            spec.init_containers.as_deref().unwrap_or(&[]),
        );
        let containers = if requests.is_empty() {
            Vec::new()
        } else {
            let limits = requests
                .into_iter()
                .map(|(name, n)| (name, Quantity(n.to_string())))
                .collect();
            vec![Container {
                name: FOLDED_CONTAINER.into(),
                resources: Some(ResourceRequirements {
                    limits: Some(limits),
                    ..ResourceRequirements::default()
                }),
                ..Container::default()
            }]
        };
        *spec = PodSpec {
            node_name: spec.node_name.take(),
            containers,
            ..PodSpec::default()
        };
    }
    if let Some(s) = pod.status.as_mut() {
        s.container_statuses = None;
        s.init_container_statuses = None;
        s.ephemeral_container_statuses = None;
        if let Some(cs) = s.conditions.as_mut() {
            cs.retain(|c| c.type_ == "PodScheduled");
        }
    }
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
    let pods = reflect(Api::<Pod>::all(ctx.client.clone()), trim_pod, wake.clone());
    let nodes = reflect(
        Api::<Node>::all(ctx.client.clone()),
        trim_node,
        wake.clone(),
    );
    for ready in [
        pools.wait_until_ready().await,
        pods.wait_until_ready().await,
        nodes.wait_until_ready().await,
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
            let pods_state = pods.state();
            let mut pods_now: Vec<PodDevices> =
                pods_state.iter().map(|p| PodDevices::from_pod(p)).collect();
            if tokio::time::Instant::now() >= next_probe {
                let targets = probe_targets(&pods_state, &pods_now);
                runtime.refresh(&ctx.probe, &targets).await;
                next_probe = tokio::time::Instant::now() + RESYNC;
            }
            for p in &mut pods_now {
                p.runtime_fallback = runtime.reason(&p.uid);
            }
            if let Err(error) =
                reconcile_all(&ctx, &pools_now, &nodes_now, &pods_now, &mut announced).await
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
            &[],
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

    #[test]
    fn trimmed_pods_and_nodes_keep_what_the_books_read() {
        let raw = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-0", "namespace": "shop", "uid": "u",
                "labels": {"baton.dev/injected": "true", "app": "web"},
                "annotations": {"baton.dev/offload": "qat", "baton.dev/accelerator-pool": "qat", "big": "x"}},
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
        });
        let full: Pod = serde_json::from_value(raw).unwrap();
        let mut trimmed = full.clone();
        trim_pod(&mut trimmed);
        let books = PodDevices::from_pod(&full);
        assert_eq!(PodDevices::from_pod(&trimmed), books);
        assert_eq!(
            books.requests,
            BTreeMap::from([
                (DEFAULT_QAT_RESOURCE.to_owned(), 2),
                ("example.com/gpu".to_owned(), 3)
            ]),
            "both slots add up; the plain init container's larger request wins"
        );
        let spec = trimmed.spec.as_ref().unwrap();
        assert_eq!(spec.containers.len(), 1, "folded into one: {spec:?}");
        assert!(spec.containers[0].env.is_none() && spec.init_containers.is_none());
        assert!(!trimmed.annotations().contains_key("big"));
        assert_eq!(
            probe_targets(&[Arc::new(trimmed)], std::slice::from_ref(&books)).len(),
            1,
            "the probe still finds the running granted Pod's IP"
        );

        // A Pod that asks for no extended resource keeps no container.
        let mut plain = full.clone();
        for c in plain.spec.as_mut().unwrap().containers.iter_mut() {
            c.resources = None;
        }
        plain.spec.as_mut().unwrap().init_containers = None;
        let mut trimmed_plain = plain.clone();
        trim_pod(&mut trimmed_plain);
        assert_eq!(
            PodDevices::from_pod(&trimmed_plain),
            PodDevices::from_pod(&plain)
        );
        assert!(trimmed_plain.spec.unwrap().containers.is_empty());

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
