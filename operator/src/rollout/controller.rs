//! The rollout controller: reads a SidecarRelease's pods (and, for pods
//! mid-upgrade, what their sidecar says on `GET /handoff`), plans with
//! [`super::plan::plan`], acts (pod patches, evictions, Events, metrics) and
//! writes status by server-side apply. It runs only on the leader (see
//! `crate::run`).
//!
//! Every pod patch carries the `resourceVersion` the plan was made from, so
//! a patch computed from a stale view (another writer, or a previous leader
//! still finishing) fails with a conflict instead of acting twice; the next
//! reconcile plans again from what the pod says.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use baton_crds::conditions::Time;
use baton_crds::contract::{self, annotations, containers, labels, ports};
use baton_crds::{SidecarRelease, Validate};
use futures::StreamExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::api::{EvictParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action as Requeue, Controller};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;

use super::plan::{
    self, Action, FailureRecord, HandoffRecord, InFlightMemory, Interrupted, Observed, PodState,
    Slot,
};
use super::pods::{parse_kubelet_version, parse_observed, pod_state};
use super::status::overlay;
use crate::metrics::Metrics;
use crate::release::status::{PodView, compute};

const KIND: &str = "SidecarRelease";

/// How often to look at pods while a handoff is under way: its completion
/// is an answer on the pod's admin port, not a Kubernetes event.
const WAITING_REQUEUE: Duration = Duration::from_secs(2);
/// Resync otherwise (pod and release events trigger reconciles anyway).
const IDLE_REQUEUE: Duration = Duration::from_secs(300);
/// Longest wait for a sidecar's `/handoff` answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("listing pods of release {release}: {source}")]
    ListPods {
        release: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing status of release {release}: {source}")]
    WriteStatus {
        release: String,
        #[source]
        source: kube::Error,
    },
}

impl Error {
    /// Low-cardinality label for the reconcile metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::ListPods { .. } => "list_pods",
            Error::WriteStatus { .. } => "write_status",
        }
    }
}

/// Asks a pod's sidecar how its handoff stands (`GET /handoff` on the admin
/// port). A function so tests can answer for the pods.
pub type Probe = Arc<dyn Fn(SocketAddr) -> BoxFuture<'static, Option<Observed>> + Send + Sync>;

pub struct Context {
    pub client: Client,
    pub metrics: Arc<Metrics>,
    pub probe: Probe,
    pub recorder: Recorder,
    /// Per release: the pods last seen mid-upgrade, to notice (and report
    /// once) a pod deleted while its handoff was in flight.
    pub in_flight: std::sync::Mutex<BTreeMap<String, InFlightMemory>>,
}

impl Context {
    pub fn new(
        client: Client,
        metrics: Arc<Metrics>,
        probe: Probe,
        instance: Option<String>,
    ) -> Self {
        let recorder = crate::events::recorder(client.clone(), instance);
        Self {
            client,
            metrics,
            probe,
            recorder,
            in_flight: std::sync::Mutex::new(BTreeMap::new()),
        }
    }
}

/// The real probe: one HTTP/1.1 GET over a fresh connection, bounded by
/// [`PROBE_TIMEOUT`]. Any failure is "no answer" (the planner decides what
/// that means).
pub fn http_probe() -> Probe {
    Arc::new(|addr| {
        Box::pin(async move {
            let body = crate::sidecar_admin::get(addr, "/handoff", PROBE_TIMEOUT).await?;
            parse_observed(&body)
        })
    })
}

/// Maps an injected pod to the release that injected it.
fn release_of(pod: Pod) -> Option<ObjectRef<SidecarRelease>> {
    pod.labels().get(labels::RELEASE).map(|n| ObjectRef::new(n))
}

fn now_secs() -> i64 {
    Timestamp::now().as_second()
}

fn slot_container(slot: Slot) -> &'static str {
    match slot {
        Slot::A => containers::SLOT_A,
        Slot::B => containers::SLOT_B,
    }
}

/// The strategic-merge patch of one action (pure). `None` for evictions.
/// Images and annotations change in one patch, so the pod never says one
/// thing and runs another; `resourceVersion` makes it conditional.
pub fn patch_for(
    action: &Action,
    resource_version: Option<&str>,
    now: i64,
) -> Option<serde_json::Value> {
    let list = |native: bool| {
        if native {
            "initContainers"
        } else {
            "containers"
        }
    };
    let (native, container, image, annotations) = match action {
        Action::Start { native, record, .. } => (
            *native,
            slot_container(record.slot),
            record.image.clone(),
            json!({
                annotations::UPGRADE: serde_json::to_string(record).ok(),
                annotations::UPGRADE_FAILED: null,
            }),
        ),
        Action::Finish {
            native,
            record,
            duration_ms,
            retired_restarts,
            ..
        } => (
            *native,
            slot_container(record.slot.other()),
            record.idle_image.clone(),
            json!({
                annotations::UPGRADE: null,
                annotations::ACTIVE_SLOT: record.slot.as_str(),
                annotations::VERSION: record.version,
                annotations::LAST_HANDOFF: serde_json::to_string(&HandoffRecord {
                    version: record.version.clone(),
                    slot: record.slot,
                    from_version: record.from_version.clone(),
                    started_at: record.started_at,
                    finished_at: now,
                    duration_ms: *duration_ms,
                    retired_restarts: *retired_restarts,
                }).ok(),
            }),
        ),
        Action::Fail {
            native,
            record,
            reason,
            ..
        } => (
            *native,
            slot_container(record.slot),
            record.idle_image.clone(),
            json!({
                annotations::UPGRADE: null,
                annotations::UPGRADE_FAILED: serde_json::to_string(&FailureRecord {
                    version: record.version.clone(),
                    reason: reason.clone(),
                    at: now,
                }).ok(),
            }),
        ),
        Action::Evict { .. } => return None,
    };
    let mut metadata = json!({ "annotations": annotations });
    if let Some(rv) = resource_version {
        metadata["resourceVersion"] = json!(rv);
    }
    Some(json!({
        "metadata": metadata,
        "spec": { list(native): [ { "name": container, "image": image } ] },
    }))
}

fn pod_reference(pod: &Pod) -> ObjectReference {
    pod.object_ref(&())
}

/// The Event an action produces (type, reason, note).
fn event_for(action: &Action) -> (EventType, &'static str, String) {
    match action {
        Action::Start { record, .. } => (
            EventType::Normal,
            "HandoffStarted",
            format!(
                "starting sidecar {} in slot {} ({}); it takes over from {}",
                record.version,
                record.slot.as_str(),
                record.image,
                record
                    .from_version
                    .as_deref()
                    .unwrap_or("the serving sidecar")
            ),
        ),
        Action::Finish {
            record,
            duration_ms,
            ..
        } => (
            EventType::Normal,
            "HandoffComplete",
            format!(
                "sidecar {} in slot {} took over in {duration_ms} ms; slot {} returned to idle",
                record.version,
                record.slot.as_str(),
                record.slot.other().as_str()
            ),
        ),
        Action::Fail { record, reason, .. } => (
            EventType::Warning,
            "HandoffFailed",
            format!(
                "handoff to {} failed: {reason}; slot {} returned to idle, the previous sidecar keeps serving",
                record.version,
                record.slot.as_str()
            ),
        ),
        Action::Evict { reason, .. } => (
            EventType::Normal,
            "Evicted",
            format!(
                "evicted so that its controller recreates it with the release's version: {}",
                reason.message()
            ),
        ),
    }
}

async fn publish(
    ctx: &Context,
    reference: &ObjectReference,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note),
        action: "Rollout".into(),
        secondary: None,
    };
    if let Err(error) = crate::events::publish(&ctx.recorder, &event, reference).await {
        tracing::warn!(%error, reason, "cannot publish event");
    }
}

/// Tells the user about a handoff its pod's deletion interrupted: a
/// Warning Event on the release (the pod may be gone) and, while it still
/// exists, on the pod.
async fn report_interrupted(
    ctx: &Context,
    release: &SidecarRelease,
    pods: &[ObjectMeta],
    interrupted: &Interrupted,
) {
    let note = interrupted.message();
    tracing::warn!(pod = %interrupted.pod, %note, "handoff interrupted");
    ctx.metrics.rollout_action("interrupted", "observed");
    publish(
        ctx,
        &release.object_ref(&()),
        EventType::Warning,
        "HandoffInterrupted",
        format!("{}: {note}", interrupted.pod),
    )
    .await;
    if let Some(meta) = pods.iter().find(|m| pod_key(m) == interrupted.pod) {
        publish(
            ctx,
            &pod_reference(&kept_pod(meta)),
            EventType::Warning,
            "HandoffInterrupted",
            note,
        )
        .await;
    }
}

/// Executes one action. `Err` carries why it could not (the pod is then
/// reported as blocked; the next reconcile plans again).
async fn execute(
    ctx: &Context,
    release: &SidecarRelease,
    pod: &Pod,
    action: &Action,
) -> Result<(), String> {
    let name = pod.name_any();
    let namespace = pod.namespace().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
    match action {
        Action::Evict { .. } => match api.evict(&name, &EvictParams::default()).await {
            Ok(_) => {}
            // A PodDisruptionBudget says not now.
            Err(kube::Error::Api(s)) if s.code == 429 => {
                return Err(format!(
                    "eviction refused by a PodDisruptionBudget: {}",
                    s.message
                ));
            }
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
            Err(e) => return Err(format!("eviction failed: {e}")),
        },
        _ => {
            let body = patch_for(action, pod.metadata.resource_version.as_deref(), now_secs())
                .expect("only evictions have no patch");
            match api
                .patch(&name, &PatchParams::default(), &Patch::Strategic(&body))
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    return Err("the pod changed since it was read; planning again".into());
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    return Err("the pod was deleted since it was read".into());
                }
                Err(e) => return Err(format!("patching the pod failed: {e}")),
            }
        }
    }
    let (type_, reason, note) = event_for(action);
    publish(ctx, &pod_reference(pod), type_, reason, note.clone()).await;
    if let Action::Fail { .. } = action {
        // Also on the release, so `kubectl describe sidecarrelease` shows it.
        let note = format!("{}/{name}: {note}", namespace);
        publish(ctx, &release.object_ref(&()), type_, reason, note).await;
    }
    if let Action::Finish { duration_ms, .. } = action {
        ctx.metrics.handoff_completed(*duration_ms);
    }
    Ok(())
}

/// Pods listed per page by [`read_release_pods`]: a release of 10,000
/// Pods read in one response held every Pod whole at once (issue #37: the
/// leader's peak RSS).
const LIST_PAGE: u32 = 100;

/// A release's Pods as one reconcile needs them, in list order: what the
/// planner reads ([`PodState`]), what the status counts ([`PodView`]), and
/// each Pod reduced to [`metadata_only`] for the patches and Events (a
/// `Pod` with no spec is still 2,176 bytes inline, its `ObjectMeta` 360).
#[derive(Default)]
struct ReleasePods {
    pods: Vec<ObjectMeta>,
    states: Vec<PodState>,
    views: Vec<PodView>,
}

/// The release's Pods, read fresh (the patches are conditional on their
/// resourceVersion) one page at a time. Each listed Pod is turned into
/// what the reconcile reads as soon as its page arrives and then dropped:
/// an injected Pod is 10–15 KiB in memory (k8s-openapi's `Container` alone
/// is 2 KiB inline), and holding a whole release of them made the rollout
/// the largest of the leader's memory per Pod (32 KiB per Pod at the peak
/// with 2,000 Pods; decision 0065, bench/operator-heap.sh).
async fn read_release_pods(ctx: &Context, release: &str) -> Result<ReleasePods, Error> {
    let api: Api<Pod> = Api::all(ctx.client.clone());
    let mut params = ListParams::default()
        .labels(&format!("{}={}", labels::RELEASE, release))
        .limit(LIST_PAGE);
    // Kubelet versions, only for native sidecars (the planner needs them to
    // know whether an in-place image update restarts the container).
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let mut kubelets: BTreeMap<String, Option<(u32, u32)>> = BTreeMap::new();
    let mut out = ReleasePods::default();
    loop {
        let page = api.list(&params).await.map_err(|source| Error::ListPods {
            release: release.to_owned(),
            source,
        })?;
        for pod in page.items {
            let kubelet = match (
                native_slots(&pod),
                pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            ) {
                (true, Some(node)) => {
                    if !kubelets.contains_key(&node) {
                        let v = match nodes.get_opt(&node).await {
                            Ok(n) => n
                                .and_then(|n| n.status)
                                .and_then(|s| s.node_info)
                                .and_then(|i| parse_kubelet_version(&i.kubelet_version)),
                            Err(error) => {
                                tracing::warn!(%error, %node, "cannot read the node's kubelet version");
                                None
                            }
                        };
                        kubelets.insert(node.clone(), v);
                    }
                    kubelets[&node]
                }
                _ => None,
            };
            let mid_upgrade = pod.annotations().contains_key(annotations::UPGRADE);
            let ip = pod
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|ip| ip.parse().ok());
            let observed = match (mid_upgrade, ip) {
                (true, Some(ip)) => (ctx.probe)(SocketAddr::new(ip, ports::ADMIN)).await,
                _ => None,
            };
            out.states.push(pod_state(&pod, kubelet, observed));
            out.views.push(PodView::from_pod(&pod));
            out.pods.push(metadata_only(pod));
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(out),
        }
    }
}

/// Whether the sidecar slots are init containers (`restartPolicy: Always`).
fn native_slots(pod: &Pod) -> bool {
    pod.spec.as_ref().is_some_and(|s| {
        s.init_containers
            .iter()
            .flatten()
            .any(|c| c.name == containers::SLOT_A || c.name == containers::SLOT_B)
    })
}

/// What [`execute`] and the Events read of a Pod once its state is
/// computed: the name, namespace, UID and resourceVersion (patches are
/// conditional on it; Events name the Pod by reference).
fn metadata_only(pod: Pod) -> ObjectMeta {
    let m = pod.metadata;
    ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        ..ObjectMeta::default()
    }
}

/// The Pod [`metadata_only`] kept, as the API calls take it.
fn kept_pod(meta: &ObjectMeta) -> Pod {
    Pod {
        metadata: meta.clone(),
        ..Pod::default()
    }
}

/// `namespace/name`, the key actions and interruptions name a Pod by.
fn pod_key(meta: &ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default()
    )
}

#[tracing::instrument(skip_all, fields(kind = KIND, name = %release.name_any()))]
pub async fn reconcile(release: Arc<SidecarRelease>, ctx: Arc<Context>) -> Result<Requeue, Error> {
    let name = release.name_any();
    let ReleasePods {
        pods,
        states,
        views,
    } = read_release_pods(&ctx, &name).await?;

    let (interrupted, recent_interrupted) = {
        let mut memory = ctx.in_flight.lock().expect("not poisoned");
        let memory = memory.entry(name.clone()).or_default();
        let new = memory.observe(&states);
        (new, memory.recent().to_vec())
    };
    for i in &interrupted {
        report_interrupted(&ctx, &release, &pods, i).await;
    }

    let now = now_secs();
    let invalid = release.validate().is_err();
    let mut plan = if invalid {
        // Never act on a release the webhook would refuse.
        plan::Plan {
            total: pods.len(),
            ..plan::Plan::default()
        }
    } else {
        plan::plan(&release, &states, now)
    };
    plan.interrupted = recent_interrupted;
    for action in plan.actions.clone() {
        let Some(meta) = pods.iter().find(|m| pod_key(m) == action.pod()) else {
            continue;
        };
        let result = execute(&ctx, &release, &kept_pod(meta), &action).await;
        ctx.metrics.rollout_action(
            action.metric_label(),
            if result.is_ok() { "ok" } else { "error" },
        );
        match result {
            Ok(()) => tracing::info!(
                pod = action.pod(),
                action = action.metric_label(),
                "rollout step"
            ),
            Err(why) => {
                tracing::warn!(pod = action.pod(), action = action.metric_label(), %why, "rollout step not taken");
                plan.blocked.push((action.pod().to_owned(), why));
                plan.waiting = true;
            }
        }
    }

    let time = Time(Timestamp::now());
    let mut status = compute(&release, &views, &time);
    // Failed = pods whose serving sidecar fails, or whose handoff failed.
    let failing: BTreeSet<&str> = views
        .iter()
        .filter(|v| v.failed)
        .map(|v| v.name.as_str())
        .chain(plan.failed.iter().map(|(p, _)| p.as_str()))
        .collect();
    status.failed = i32::try_from(failing.len()).unwrap_or(i32::MAX);
    overlay(&mut status, &release, &plan, &time);
    if release.status.as_ref() != Some(&status) {
        let api: Api<SidecarRelease> = Api::all(ctx.client.clone());
        let patch = json!({
            "apiVersion": format!("{}/{}", contract::GROUP, contract::VERSION),
            "kind": KIND,
            "status": status,
        });
        api.patch_status(
            &name,
            &PatchParams::apply(contract::FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(|source| Error::WriteStatus {
            release: name.clone(),
            source,
        })?;
        tracing::info!(
            total = status.total,
            updated = status.updated,
            in_flight = status.in_flight,
            failed = status.failed,
            "status written"
        );
    }
    ctx.metrics.reconciled(KIND, "ok");
    Ok(if plan.waiting || !plan.actions.is_empty() {
        Requeue::requeue(WAITING_REQUEUE)
    } else if !plan.blocked.is_empty() {
        Requeue::requeue(Duration::from_secs(30))
    } else {
        Requeue::requeue(IDLE_REQUEUE)
    })
}

fn error_policy(_release: Arc<SidecarRelease>, error: &Error, ctx: Arc<Context>) -> Requeue {
    tracing::warn!(%error, "reconcile failed");
    ctx.metrics.reconciled(KIND, error.metric_label());
    Requeue::requeue(Duration::from_secs(5))
}

/// Runs the controller until its watch streams end.
pub async fn run(ctx: Arc<Context>) -> anyhow::Result<()> {
    let releases: Api<SidecarRelease> = Api::all(ctx.client.clone());
    let pods: Api<Pod> = Api::all(ctx.client.clone());
    // The default watcher config (list + watch) on purpose: streaming lists
    // are refused by older API servers (1.20 in e2e) and retried for ever.
    let injected = watcher::Config::default().labels(labels::RELEASE);
    Controller::new(releases, watcher::Config::default())
        .watches(pods, injected, release_of)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "controller event");
            }
        })
        .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Reconcile against kube's tower-test mock API server (controller-rs's
    //! approach): a small fake answers by method and path and records every
    //! request, which the tests then assert.

    use super::*;
    use crate::mock_api::{Handle, Seen};
    use crate::rollout::plan::UpgradeRecord;
    use http::{Method, Request, Response};
    use kube::client::Body;
    use std::sync::Mutex;

    type Answer = Box<dyn Fn(&Seen) -> Option<(u16, serde_json::Value)> + Send>;

    /// Serves until the client is dropped; `answer` may claim a request
    /// (status, body); unclaimed writes echo their body, events are created.
    fn fake_api(
        handle: Handle,
        pods: Vec<serde_json::Value>,
        answer: Answer,
    ) -> Arc<Mutex<Vec<Seen>>> {
        crate::mock_api::serve(handle, move |s| {
            answer(s).unwrap_or_else(|| {
            if s.method == Method::GET && s.uri.starts_with("/api/v1/pods?") {
                (200, json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": pods}))
            } else {
                // Echo the write; a status apply answers the whole
                // release with that status.
                let mut echoed = s.body.clone();
                if s.method == Method::PATCH && s.uri.contains("/pods/") {
                    // A patched pod answers the pod (null annotation
                    // values in the patch are removals).
                    if let Some(p) = pods.iter().find(|p| {
                        s.uri.contains(&format!("/pods/{}?", p["metadata"]["name"].as_str().unwrap_or_default()))
                    }) {
                        echoed = p.clone();
                    }
                }
                if s.uri.contains("/sidecarreleases/") {
                    let mut r = serde_json::to_value(release(json!({}))).unwrap();
                    r["status"] = s.body["status"].clone();
                    echoed = r;
                }
                (200, echoed)
            }
        })
        })
    }

    fn release(extra: serde_json::Value) -> SidecarRelease {
        let mut spec = json!({"version": "2", "image": "sidecar:2", "emptyImage": "empty:1"});
        json_patch::merge(&mut spec, &extra);
        serde_json::from_value(json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease",
            "metadata": {"name": "default", "generation": 3, "uid": "r-uid"},
            "spec": spec
        }))
        .unwrap()
    }

    fn status_of(image: &str, ready: bool, waiting: Option<&str>, name: &str) -> serde_json::Value {
        let state = match waiting {
            Some(reason) => json!({"waiting": {"reason": reason}}),
            None => json!({"running": {}}),
        };
        json!({"name": name, "ready": ready, "restartCount": 0, "image": image, "imageID": "", "state": state})
    }

    /// A pod on `version` in slot a with slot b idle; `annotations` added.
    fn pod(
        name: &str,
        version: &str,
        b_image: Option<&str>,
        annotations: serde_json::Value,
        b_waiting: Option<&str>,
    ) -> serde_json::Value {
        let mut ann = json!({annotations::VERSION: version, annotations::ACTIVE_SLOT: "a"});
        json_patch::merge(&mut ann, &annotations);
        let mut containers =
            vec![json!({"name": containers::SLOT_A, "image": format!("sidecar:{version}")})];
        let mut statuses = vec![status_of(
            &format!("sidecar:{version}"),
            true,
            None,
            containers::SLOT_A,
        )];
        if let Some(b) = b_image {
            containers.push(json!({"name": containers::SLOT_B, "image": b}));
            statuses.push(status_of(
                b,
                b_waiting.is_none(),
                b_waiting,
                containers::SLOT_B,
            ));
        }
        containers.push(json!({"name": "app", "image": "app:1"}));
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "shop", "uid": format!("uid-{name}"), "resourceVersion": "41",
                "labels": {labels::RELEASE: "default"}, "annotations": ann,
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": "rs", "controller": true}]},
            "spec": {"containers": containers, "nodeName": "node-1"},
            "status": {"podIP": "10.88.0.7", "containerStatuses": statuses}
        })
    }

    fn record(started_at: i64) -> serde_json::Value {
        json!(
            serde_json::to_string(&UpgradeRecord {
                version: "2".into(),
                image: "sidecar:2".into(),
                slot: Slot::B,
                from_version: Some("1".into()),
                started_at,
                idle_image: "empty:1".into(),
            })
            .unwrap()
        )
    }

    fn no_probe() -> Probe {
        Arc::new(|_| Box::pin(async { None }))
    }

    fn answering(observed: Observed) -> Probe {
        Arc::new(move |addr| {
            assert_eq!(addr, "10.88.0.7:15020".parse().unwrap());
            let o = observed.clone();
            Box::pin(async move { Some(o) })
        })
    }

    fn context(
        service: tower_test::mock::Mock<Request<Body>, Response<Body>>,
        probe: Probe,
    ) -> Arc<Context> {
        let client = Client::new(service, "default");
        Arc::new(Context::new(
            client,
            Arc::new(Metrics::default()),
            probe,
            Some("op-0".into()),
        ))
    }

    fn find<'a>(seen: &'a [Seen], method: Method, prefix: &str) -> Vec<&'a Seen> {
        seen.iter()
            .filter(|s| s.method == method && s.uri.starts_with(prefix))
            .collect()
    }

    /// The `status` of the first status patch of the release `default`.
    fn patched_status(seen: &[Seen]) -> &serde_json::Value {
        &find(
            seen,
            Method::PATCH,
            "/apis/baton.dev/v1alpha1/sidecarreleases/default/status?",
        )[0]
        .body["status"]
    }

    #[tokio::test]
    async fn reconcile_starts_the_standby_slot_with_one_conditional_patch_and_an_event() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let pods = vec![
            pod("web-0", "1", Some("empty:1"), json!({}), None),
            pod("web-1", "1", Some("empty:1"), json!({}), None),
        ];
        let seen = fake_api(handle, pods, Box::new(|_| None));
        let ctx = context(service, no_probe());
        let requeue = reconcile(Arc::new(release(json!({}))), ctx.clone())
            .await
            .unwrap();
        assert_eq!(requeue, Requeue::requeue(WAITING_REQUEUE));
        let seen = seen.lock().unwrap().clone();

        let patches = find(&seen, Method::PATCH, "/api/v1/namespaces/shop/pods/");
        assert_eq!(patches.len(), 1, "maxUnavailable 1: {seen:#?}");
        let p = patches[0];
        assert!(
            p.uri.starts_with("/api/v1/namespaces/shop/pods/web-0?"),
            "{}",
            p.uri
        );
        assert_eq!(p.content_type, "application/strategic-merge-patch+json");
        assert_eq!(p.body["metadata"]["resourceVersion"], "41");
        assert_eq!(
            p.body["spec"]["containers"],
            json!([{"name": containers::SLOT_B, "image": "sidecar:2"}])
        );
        let rec: UpgradeRecord = serde_json::from_str(
            p.body["metadata"]["annotations"][annotations::UPGRADE]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            (rec.slot, rec.version.as_str(), rec.idle_image.as_str()),
            (Slot::B, "2", "empty:1")
        );

        let events = find(
            &seen,
            Method::POST,
            "/apis/events.k8s.io/v1/namespaces/shop/events",
        );
        assert_eq!(
            events.len(),
            1,
            "{:#?}",
            seen.iter().map(|s| (&s.method, &s.uri)).collect::<Vec<_>>()
        );
        assert_eq!(events[0].body["reason"], "HandoffStarted");
        assert_eq!(events[0].body["regarding"]["name"], "web-0");

        let status = find(
            &seen,
            Method::PATCH,
            "/apis/baton.dev/v1alpha1/sidecarreleases/default/status?",
        );
        assert_eq!(status.len(), 1);
        let st = &status[0].body["status"];
        assert_eq!(
            (
                st["total"].as_i64(),
                st["inFlight"].as_i64(),
                st["updated"].as_i64()
            ),
            (Some(2), Some(1), Some(0))
        );
        assert_eq!(st["rollout"], "RollingOut");
        assert!(
            ctx.metrics
                .encode()
                .contains("action=\"start\",result=\"ok\"} 1")
        );
    }

    #[tokio::test]
    async fn reconcile_finishes_a_completed_handoff_and_records_its_duration() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let pods = vec![pod(
            "web-0",
            "1",
            Some("sidecar:2"),
            json!({annotations::UPGRADE: record(now_secs() - 2)}),
            None,
        )];
        let seen = fake_api(handle, pods, Box::new(|_| None));
        let ctx = context(
            service,
            answering(Observed {
                slot: Some(Slot::B),
                phase: "serving".into(),
                complete: true,
                duration_ms: Some(37),
                retired: vec![Slot::A],
            }),
        );
        reconcile(Arc::new(release(json!({}))), ctx.clone())
            .await
            .unwrap();
        let seen = seen.lock().unwrap().clone();
        let patches = find(&seen, Method::PATCH, "/api/v1/namespaces/shop/pods/web-0");
        assert_eq!(patches.len(), 1);
        let body = &patches[0].body;
        assert_eq!(
            body["spec"]["containers"],
            json!([{"name": containers::SLOT_A, "image": "empty:1"}])
        );
        let ann = &body["metadata"]["annotations"];
        assert_eq!(ann[annotations::UPGRADE], serde_json::Value::Null);
        assert_eq!(ann[annotations::ACTIVE_SLOT], "b");
        assert_eq!(ann[annotations::VERSION], "2");
        let events = find(
            &seen,
            Method::POST,
            "/apis/events.k8s.io/v1/namespaces/shop/events",
        );
        assert_eq!(events[0].body["reason"], "HandoffComplete");
        assert!(
            events[0].body["note"]
                .as_str()
                .unwrap()
                .contains("in 37 ms")
        );
        let m = ctx.metrics.encode();
        assert!(
            m.contains("baton_operator_handoff_duration_seconds_count 1"),
            "{m}"
        );
        assert!(
            m.contains("baton_operator_handoff_duration_seconds_sum 0.037"),
            "{m}"
        );
    }

    #[tokio::test]
    async fn a_failed_handoff_returns_the_slot_to_idle_and_pauses_the_rollout_with_the_reason() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let pods = vec![
            pod(
                "web-0",
                "1",
                Some("sidecar:2"),
                json!({annotations::UPGRADE: record(now_secs())}),
                Some("CrashLoopBackOff"),
            ),
            pod("web-1", "1", Some("empty:1"), json!({}), None),
        ];
        let seen = fake_api(handle, pods, Box::new(|_| None));
        let ctx = context(service, no_probe());
        reconcile(Arc::new(release(json!({}))), ctx).await.unwrap();
        let seen = seen.lock().unwrap().clone();
        let patches = find(&seen, Method::PATCH, "/api/v1/namespaces/shop/pods/");
        assert_eq!(patches.len(), 1, "nothing new starts: {seen:#?}");
        let body = &patches[0].body;
        assert_eq!(
            body["spec"]["containers"],
            json!([{"name": containers::SLOT_B, "image": "empty:1"}])
        );
        let failure: FailureRecord = serde_json::from_str(
            body["metadata"]["annotations"][annotations::UPGRADE_FAILED]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(failure.version, "2");
        assert!(failure.reason.contains("CrashLoopBackOff"));
        // One Warning on the pod, one on the release (kubectl describe sr).
        let warnings: Vec<_> = find(&seen, Method::POST, "/apis/events.k8s.io/v1/namespaces/")
            .into_iter()
            .filter(|s| s.body["type"] == "Warning")
            .collect();
        assert_eq!(warnings.len(), 2);
        assert!(
            warnings
                .iter()
                .any(|w| w.body["regarding"]["kind"] == "SidecarRelease")
        );
        let st = patched_status(&seen);
        assert_eq!(st["failed"], 1);
        assert_eq!(st["rollout"], "Paused");
        assert_eq!(st["failedPods"][0]["pod"], "shop/web-0");
        let cond = |t: &str| {
            st["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["type"] == t)
                .unwrap()
                .clone()
        };
        assert_eq!(
            (
                cond("Degraded")["status"].as_str(),
                cond("Paused")["reason"].as_str()
            ),
            (Some("True"), Some("FailureThresholdExceeded"))
        );
        assert!(
            cond("Degraded")["message"]
                .as_str()
                .unwrap()
                .contains("CrashLoopBackOff")
        );
    }

    #[tokio::test]
    async fn a_pod_gone_mid_handoff_is_reported_on_the_release_and_in_status_once() {
        let interrupted = |seen: &[Seen]| -> Vec<serde_json::Value> {
            find(seen, Method::POST, "/apis/events.k8s.io/v1/namespaces/")
                .into_iter()
                .filter(|s| s.body["reason"] == "HandoffInterrupted")
                .map(|s| s.body.clone())
                .collect()
        };
        // First look: web-0 is mid-upgrade.
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let pods = vec![
            pod(
                "web-0",
                "1",
                Some("sidecar:2"),
                json!({annotations::UPGRADE: record(now_secs())}),
                None,
            ),
            pod("web-1", "2", Some("empty:1"), json!({}), None),
        ];
        let seen = fake_api(handle, pods, Box::new(|_| None));
        let first = context(service, no_probe());
        reconcile(Arc::new(release(json!({}))), first.clone())
            .await
            .unwrap();
        assert!(interrupted(&seen.lock().unwrap()).is_empty());

        // Next look (the same leader): web-0 is gone.
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let pods = vec![pod("web-1", "2", Some("empty:1"), json!({}), None)];
        let seen = fake_api(handle, pods.clone(), Box::new(|_| None));
        let second = context(service, no_probe());
        *second.in_flight.lock().unwrap() = first.in_flight.lock().unwrap().clone();
        reconcile(Arc::new(release(json!({}))), second.clone())
            .await
            .unwrap();
        let seen = seen.lock().unwrap().clone();
        let events = interrupted(&seen);
        assert_eq!(
            events.len(),
            1,
            "on the release only (the pod is gone): {events:#?}"
        );
        assert_eq!(events[0]["type"], "Warning");
        assert_eq!(events[0]["regarding"]["kind"], "SidecarRelease");
        let note = events[0]["note"].as_str().unwrap();
        assert!(
            note.starts_with("shop/web-0: deleted while its handoff to 2"),
            "{note}"
        );
        let st = patched_status(&seen);
        assert_eq!(st["interruptedPods"][0]["pod"], "shop/web-0");
        assert_eq!(st["interruptedPods"][0]["version"], "2");

        // And once: the look after that reports nothing new. Its copy of
        // the release predates the status patch above (the watch has not
        // delivered it), yet the status it writes still lists web-0.
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let seen = fake_api(handle, pods, Box::new(|_| None));
        let third = context(service, no_probe());
        *third.in_flight.lock().unwrap() = second.in_flight.lock().unwrap().clone();
        reconcile(Arc::new(release(json!({}))), third)
            .await
            .unwrap();
        let seen = seen.lock().unwrap().clone();
        assert!(interrupted(&seen).is_empty());
        let st = patched_status(&seen);
        assert_eq!(st["interruptedPods"][0]["pod"], "shop/web-0", "{st}");
    }

    #[tokio::test]
    async fn an_eviction_a_disruption_budget_refuses_is_reported_in_status() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let pods = vec![pod("web-0", "1", None, json!({}), None)];
        let seen = fake_api(
            handle,
            pods,
            Box::new(|s| {
                s.uri.contains("/eviction").then(|| {
                    (429, json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 429,
                        "reason": "TooManyRequests", "message": "Cannot evict pod as it would violate the pod's disruption budget."}))
                })
            }),
        );
        let ctx = context(service, no_probe());
        reconcile(Arc::new(release(json!({}))), ctx.clone())
            .await
            .unwrap();
        let seen = seen.lock().unwrap().clone();
        let evictions = find(
            &seen,
            Method::POST,
            "/api/v1/namespaces/shop/pods/web-0/eviction",
        );
        assert_eq!(evictions.len(), 1);
        assert!(
            find(&seen, Method::POST, "/apis/events.k8s.io/").is_empty(),
            "no event for a step not taken"
        );
        let st = patched_status(&seen);
        let progressing = st["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Progressing")
            .unwrap();
        assert!(
            progressing["message"]
                .as_str()
                .unwrap()
                .contains("PodDisruptionBudget"),
            "{progressing}"
        );
        assert!(
            ctx.metrics
                .encode()
                .contains("action=\"evict\",result=\"error\"} 1")
        );
    }

    #[tokio::test]
    async fn a_patch_refused_for_a_stale_resource_version_is_not_acted_on() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let pods = vec![pod("web-0", "1", Some("empty:1"), json!({}), None)];
        let seen = fake_api(
            handle,
            pods,
            Box::new(|s| {
                (s.method == Method::PATCH && s.uri.starts_with("/api/v1/namespaces/shop/pods/")).then(|| {
                    (409, json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 409,
                        "reason": "Conflict", "message": "the object has been modified"}))
                })
            }),
        );
        let ctx = context(service, no_probe());
        let requeue = reconcile(Arc::new(release(json!({}))), ctx).await.unwrap();
        assert_eq!(requeue, Requeue::requeue(WAITING_REQUEUE));
        let seen = seen.lock().unwrap().clone();
        assert!(find(&seen, Method::POST, "/apis/events.k8s.io/").is_empty());
    }

    #[tokio::test]
    async fn native_sidecars_are_patched_in_init_containers_after_asking_the_node_s_kubelet() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let mut p = pod("web-0", "1", Some("empty:1"), json!({}), None);
        let slots: Vec<_> = p["spec"]["containers"].as_array().unwrap()[..2].to_vec();
        p["spec"]["initContainers"] = json!(slots);
        p["spec"]["containers"] = json!([{"name": "app", "image": "app:1"}]);
        let statuses = p["status"]["containerStatuses"].clone();
        p["status"]["initContainerStatuses"] = statuses;
        p["status"]["containerStatuses"] = json!([]);
        let seen = fake_api(
            handle,
            vec![p],
            Box::new(|s| {
                s.uri.starts_with("/api/v1/nodes/node-1").then(|| {
                    (200, json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"},
                        "status": {"nodeInfo": {"kubeletVersion": "v1.33.2", "architecture": "", "bootID": "",
                            "containerRuntimeVersion": "", "kernelVersion": "", "kubeProxyVersion": "",
                            "machineID": "", "operatingSystem": "", "osImage": "", "systemUUID": ""}}}))
                })
            }),
        );
        let ctx = context(service, no_probe());
        reconcile(Arc::new(release(json!({}))), ctx).await.unwrap();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(find(&seen, Method::GET, "/api/v1/nodes/node-1").len(), 1);
        let patch = &find(&seen, Method::PATCH, "/api/v1/namespaces/shop/pods/web-0")[0].body;
        assert_eq!(
            patch["spec"]["initContainers"],
            json!([{"name": containers::SLOT_B, "image": "sidecar:2"}])
        );
    }

    #[tokio::test]
    async fn pods_are_listed_a_page_at_a_time_and_every_page_counts() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let first = pod("web-0", "2", Some("empty:1"), json!({}), None);
        let second = pod("web-1", "2", Some("empty:1"), json!({}), None);
        let seen = fake_api(
            handle,
            vec![],
            Box::new(move |s| {
                if s.method != Method::GET || !s.uri.starts_with("/api/v1/pods?") {
                    return None;
                }
                let (items, next) = if s.uri.contains("continue=page-2") {
                    (vec![second.clone()], json!({}))
                } else {
                    (vec![first.clone()], json!({"continue": "page-2"}))
                };
                Some((
                    200,
                    json!({"apiVersion": "v1", "kind": "PodList", "metadata": next, "items": items}),
                ))
            }),
        );
        let ctx = context(service, no_probe());
        reconcile(Arc::new(release(json!({}))), ctx).await.unwrap();
        let seen = seen.lock().unwrap().clone();
        let lists = find(&seen, Method::GET, "/api/v1/pods?");
        assert_eq!(lists.len(), 2, "{lists:#?}");
        assert!(
            lists[0].uri.contains(&format!("limit={LIST_PAGE}")),
            "{}",
            lists[0].uri
        );
        assert!(lists[1].uri.contains("continue=page-2"), "{}", lists[1].uri);
        assert_eq!(patched_status(&seen)["total"], 2);
    }

    #[test]
    fn a_read_pod_keeps_only_what_patches_and_events_name_it_by() {
        let full: Pod = serde_json::from_value(pod(
            "web-0",
            "1",
            Some("empty:1"),
            json!({annotations::TRUST_BUNDLE: "-----BEGIN CERTIFICATE-----"}),
            None,
        ))
        .unwrap();
        let kept = kept_pod(&metadata_only(full.clone()));
        assert_eq!(
            format!("{:?}", pod_reference(&kept)),
            format!("{:?}", pod_reference(&full)),
            "Events name the same Pod"
        );
        assert_eq!(
            kept.metadata.resource_version, full.metadata.resource_version,
            "patches stay conditional on the version read"
        );
        assert!(kept.metadata.annotations.is_none() && kept.metadata.labels.is_none());
        assert_eq!(pod_key(&kept.metadata), "shop/web-0");
    }

    #[tokio::test]
    async fn an_invalid_release_moves_no_pod() {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let pods = vec![pod("web-0", "1", Some("empty:1"), json!({}), None)];
        let seen = fake_api(handle, pods, Box::new(|_| None));
        let ctx = context(service, no_probe());
        reconcile(
            Arc::new(release(json!({"upgrade": {"partition": -1}}))),
            ctx,
        )
        .await
        .unwrap();
        let seen = seen.lock().unwrap().clone();
        assert!(find(&seen, Method::PATCH, "/api/v1/").is_empty());
        let st = &find(&seen, Method::PATCH, "/apis/baton.dev/")[0].body["status"];
        assert_eq!(st["rollout"], "Invalid");
    }

    #[tokio::test]
    async fn the_http_probe_reads_a_real_admin_endpoint() {
        use http_body_util::Full;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let svc = hyper::service::service_fn(
                |req: Request<hyper::body::Incoming>| async move {
                    assert_eq!(req.uri().path(), "/handoff");
                    Ok::<_, std::convert::Infallible>(Response::new(Full::new(hyper::body::Bytes::from_static(
                    br#"{"phase":"serving","complete":true,"slot":"b","retired":["a"],"lastHandoff":{"durationMs":9}}"#,
                ))))
                },
            );
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
        });
        let observed = http_probe()(addr).await.expect("an answer");
        assert_eq!(observed.slot, Some(Slot::B));
        assert_eq!(observed.duration_ms, Some(9));
        assert_eq!(observed.retired, vec![Slot::A]);
        server.await.unwrap();
        // Nobody listening any more: no answer.
        assert!(http_probe()(addr).await.is_none());
    }

    #[test]
    fn pods_map_to_the_release_named_in_their_label() {
        let p: Pod = serde_json::from_value(pod("a", "1", None, json!({}), None)).unwrap();
        assert_eq!(release_of(p), Some(ObjectRef::new("default")));
        assert_eq!(release_of(Pod::default()), None);
    }

    #[test]
    fn an_eviction_has_no_patch_and_a_patch_without_resource_version_is_unconditional() {
        let evict = Action::Evict {
            pod: "a/b".into(),
            reason: plan::EvictReason::Recreate,
        };
        assert_eq!(patch_for(&evict, Some("1"), 0), None);
        let fail = Action::Fail {
            pod: "a/b".into(),
            native: false,
            record: serde_json::from_str(record(5).as_str().unwrap()).unwrap(),
            reason: "r".into(),
        };
        let p = patch_for(&fail, None, 9).unwrap();
        assert!(p["metadata"].get("resourceVersion").is_none());
        assert_eq!(p["spec"]["containers"][0]["name"], containers::SLOT_B);
    }

    #[test]
    fn a_finished_handoff_leaves_its_record_on_the_pod() {
        let record: plan::UpgradeRecord =
            serde_json::from_str(record(5).as_str().unwrap()).unwrap();
        let finish = Action::Finish {
            pod: "a/b".into(),
            native: false,
            record: record.clone(),
            duration_ms: 812,
            retired_restarts: Some(3),
        };
        let p = patch_for(&finish, Some("7"), 42).unwrap();
        let text = p["metadata"]["annotations"][annotations::LAST_HANDOFF]
            .as_str()
            .expect("the record is a JSON string");
        let kept: plan::HandoffRecord = serde_json::from_str(text).unwrap();
        assert_eq!(kept.version, record.version);
        assert_eq!(kept.slot, record.slot);
        assert_eq!((kept.started_at, kept.finished_at), (record.started_at, 42));
        assert_eq!(kept.duration_ms, 812);
        assert_eq!(kept.retired_restarts, Some(3));
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        assert_eq!(v["durationMs"], 812, "camelCase, as the other records");
        // A failed handoff leaves the last completed one in place.
        let fail = Action::Fail {
            pod: "a/b".into(),
            native: false,
            record,
            reason: "r".into(),
        };
        let p = patch_for(&fail, None, 43).unwrap();
        assert!(
            p["metadata"]["annotations"]
                .get(annotations::LAST_HANDOFF)
                .is_none()
        );
    }
}
