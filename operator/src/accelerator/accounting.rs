//! The books of one AcceleratorPool as a pure function: (pool, nodes, pods)
//! → status. Nothing here talks to the API server; the controller
//! ([`super::controller`]) feeds it from its caches and writes the result.
//!
//! Who holds a device is read from what the scheduler and the kubelet act
//! on, not from what the webhook meant to do:
//!
//! - a pod **holds** `n` devices on node `N` when it is bound to `N`, has
//!   not ended (phase Succeeded/Failed, or a deletion timestamp), and its
//!   effective request of the pool's resource (the Kubernetes formula:
//!   regular and restartable init containers add up, a plain init container
//!   counts alone) is `n`. Meshed or not: any pod taking a device leaves one
//!   less for sidecars.
//! - a pod is **pending** when it requests the resource, is not bound yet,
//!   and did not end: it will take a device somewhere (the webhook subtracts
//!   these before granting more).
//! - a pod **fell back** when the webhook annotated it
//!   `baton.dev/offload=software-fallback` with this pool in
//!   `baton.dev/accelerator-pool`, and it has not ended; or when it was
//!   granted a device but its sidecar reports (`GET /offload`, read by the
//!   controller: [`super::probe`], passed in as [`RuntimeVerdicts`]) that
//!   software signs instead: the device failed its self-test at start, or
//!   signatures fail now. Such a pod still holds its device in the books
//!   (the kubelet gave it one).
//!
//! Ended pods hold nothing: the books release their devices on the first
//! reconcile after the pod's phase or deletion timestamp changes.
//!
//! Exhaustion is not re-derived: it is the shared grant decision
//! ([`baton_crds::accelerator::decide_offload`]) asked for a Required
//! sidecar with this status' numbers, so `Exhausted=True` means exactly
//! "the webhook would now refuse a Required sidecar for lack of devices".

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use baton_crds::accelerator::{self, NoGrant, NodeInventory, OffloadDecision, OffloadInput};
use baton_crds::accelerator_pool::{FallbackRecord, NodeAllocation};
use baton_crds::conditions::{self, Time, accelerator_pool as cond};
use baton_crds::contract::{annotations, labels};
use baton_crds::tls_policy::{OffloadMode, PrivateKeyOffload};
use baton_crds::{AcceleratorPool, AcceleratorPoolStatus, Validate};
use k8s_openapi::api::core::v1::{Container, Node, Pod};

/// At most this many holders are listed per node (the count is exact).
pub const MAX_PODS_PER_NODE: usize = 20;
/// At most this many fallbacks are listed (the count is exact).
pub const MAX_RECENT_FALLBACKS: usize = 10;
/// Grants of pods created this long before the books are listed in
/// `status.recentGrants`: well past the webhook's five-second memory of its
/// own grants, with room for clock skew between the API server (which
/// stamps `creationTimestamp`) and the operator.
pub const RECENT_GRANT_WINDOW_SECONDS: i64 = 60;
/// At most this many grant ids are listed; past that (a burst of more
/// device pods within the window) the webhook counts its newest grants on
/// top of the books for a few seconds more, which errs on the safe side.
pub const MAX_RECENT_GRANTS: usize = 256;
/// Sidecar slots that request devices in a pod injected for hot upgrades:
/// both (docs/decisions/0036). What `Exhausted` asks the grant decision for.
pub const SLOTS_PER_POD: i64 = 2;
/// Value of `baton.dev/offload` for a software fallback.
pub const OFFLOAD_FALLBACK: &str = "software-fallback";
/// Value of `baton.dev/offload` for a granted device.
pub const OFFLOAD_QAT: &str = "qat";

/// What the books and the probe need to know about one pod (any pod,
/// meshed or not), computed once when its watch event arrives: the
/// controller's Pod cache holds this, not the Pod ([`Self::worth_caching`]
/// says which pods it holds at all).
///
/// Every pod of the cluster may be here, so its size is the operator's
/// memory per Pod (issue #37): strings are `Box<str>` (no spare capacity,
/// 16 bytes inline), the requests a boxed slice (a `BTreeMap<String, i64>`
/// allocates a 368-byte node for one entry), and nothing is kept that
/// neither the books nor the probe read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodDevices {
    pub namespace: Box<str>,
    pub name: Box<str>,
    pub uid: Box<str>,
    /// `spec.nodeName`.
    pub node: Option<Box<str>>,
    /// Succeeded, Failed, or being deleted: holds nothing.
    pub ended: bool,
    /// Injected by Baton (label `baton.dev/injected=true`).
    pub meshed: bool,
    /// The scheduler said it cannot place the pod (PodScheduled=False,
    /// reason Unschedulable).
    pub unschedulable: bool,
    /// `status.podIP` while the phase is Running: where the probe reads the
    /// sidecar's `/offload`.
    pub running_ip: Option<IpAddr>,
    /// `baton.dev/offload`.
    pub offload: Option<Box<str>>,
    /// `baton.dev/accelerator-pool`.
    pub pool: Option<Box<str>>,
    /// `baton.dev/offload-fallback-reason`.
    pub fallback_reason: Option<Box<str>>,
    /// `baton.dev/offload-grant`.
    pub grant: Option<Box<str>>,
    /// Effective request per extended resource (only names with a `/`,
    /// only those above zero), sorted by name.
    pub requests: Box<[(Box<str>, i64)]>,
    /// `metadata.creationTimestamp` in seconds (newest fallbacks first).
    pub created: i64,
}

/// Why a granted pod's sidecar signs in software, by pod UID, as the
/// controller last read it from the sidecars ([`super::probe`]); not from
/// the Pod object, so not in [`PodDevices`].
pub type RuntimeVerdicts = BTreeMap<String, String>;

impl PodDevices {
    pub fn from_pod(pod: &Pod) -> Self {
        let meta = &pod.metadata;
        let text = |s: Option<&String>| s.map(|s| Box::from(s.as_str()));
        let annotation = |k: &str| text(meta.annotations.as_ref().and_then(|a| a.get(k)));
        let status = pod.status.as_ref();
        let phase = status.and_then(|s| s.phase.as_deref());
        let unschedulable = status
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| {
                c.type_ == "PodScheduled"
                    && c.status == conditions::FALSE
                    && c.reason.as_deref() == Some("Unschedulable")
            });
        Self {
            namespace: text(meta.namespace.as_ref()).unwrap_or_default(),
            name: text(meta.name.as_ref()).unwrap_or_default(),
            uid: text(meta.uid.as_ref()).unwrap_or_default(),
            node: text(pod.spec.as_ref().and_then(|s| s.node_name.as_ref()))
                .filter(|n| !n.is_empty()),
            ended: meta.deletion_timestamp.is_some()
                || matches!(phase, Some("Succeeded" | "Failed")),
            meshed: meta
                .labels
                .as_ref()
                .and_then(|l| l.get(labels::INJECTED))
                .is_some_and(|v| v == "true"),
            unschedulable,
            running_ip: status
                .filter(|_| phase == Some("Running"))
                .and_then(|s| s.pod_ip.as_deref()?.parse().ok()),
            offload: annotation(annotations::OFFLOAD),
            pool: annotation(annotations::ACCELERATOR_POOL),
            fallback_reason: annotation(annotations::OFFLOAD_FALLBACK_REASON),
            grant: annotation(annotations::OFFLOAD_GRANT),
            requests: pod
                .spec
                .as_ref()
                .map(|s| {
                    effective_requests(&s.containers, s.init_containers.as_deref().unwrap_or(&[]))
                })
                .unwrap_or_default()
                .into_iter()
                .map(|(name, n)| (name.into_boxed_str(), n))
                .collect(),
            created: meta
                .creation_timestamp
                .as_ref()
                .map_or(0, |t| t.0.as_second()),
        }
    }

    /// Whether [`compute`] or the probe can ever read this pod: it requests
    /// an extended resource (it may hold one), names a pool (a grant or a
    /// fallback of that pool), or is a meshed pod granted a device (whose
    /// sidecar the controller reads). Any other pod changes no pool's
    /// status, so the cache does not keep it: a cluster's plain pods, and
    /// meshed ones without offload, cost the operator nothing.
    pub fn worth_caching(&self) -> bool {
        !self.requests.is_empty()
            || self.pool.is_some()
            || (self.meshed && self.offload.as_deref() == Some(OFFLOAD_QAT))
    }

    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    fn request(&self, resource: &str) -> i64 {
        self.requests
            .iter()
            .find(|(name, _)| &**name == resource)
            .map_or(0, |(_, n)| *n)
    }
}

/// Extended-resource requests of one container: limits win (extended
/// resources are limits-only; a request, when given, must equal the limit).
fn container_requests(c: &Container) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    let Some(r) = c.resources.as_ref() else {
        return out;
    };
    for map in [r.requests.as_ref(), r.limits.as_ref()]
        .into_iter()
        .flatten()
    {
        for (name, q) in map.iter().filter(|(name, _)| name.contains('/')) {
            out.insert(name.clone(), accelerator::device_count(&q.0));
        }
    }
    out
}

/// The pod's effective request per extended resource, as the scheduler
/// computes it: regular containers and restartable (sidecar) init
/// containers add up; a plain init container runs alone, so the pod needs
/// the larger of that sum and the largest plain init request.
pub fn effective_requests(
    containers: &[Container],
    init_containers: &[Container],
) -> BTreeMap<String, i64> {
    let mut sum: BTreeMap<String, i64> = BTreeMap::new();
    let mut init_max: BTreeMap<String, i64> = BTreeMap::new();
    let restartable = |c: &Container| c.restart_policy.as_deref() == Some("Always");
    for c in containers
        .iter()
        .chain(init_containers.iter().filter(|c| restartable(c)))
    {
        for (k, v) in container_requests(c) {
            *sum.entry(k).or_default() += v;
        }
    }
    for c in init_containers.iter().filter(|c| !restartable(c)) {
        for (k, v) in container_requests(c) {
            let e = init_max.entry(k).or_default();
            *e = (*e).max(v);
        }
    }
    for (k, v) in init_max {
        let e = sum.entry(k).or_default();
        *e = (*e).max(v);
    }
    sum.retain(|_, v| *v > 0);
    sum
}

/// A fallback the controller reports with an Event (once per pod UID).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fallback {
    pub namespace: String,
    pub pod: String,
    pub uid: String,
    pub reason: String,
}

/// The status, and the fallbacks behind its count.
#[derive(Clone, Debug, PartialEq)]
pub struct Books {
    pub status: AcceleratorPoolStatus,
    pub fallbacks: Vec<Fallback>,
}

/// The status `pool` should have given `nodes`, `pods` and what their
/// sidecars said (`runtime`), keeping the transition times of conditions
/// whose status did not change.
pub fn compute(
    pool: &AcceleratorPool,
    nodes: &[Node],
    pods: &[impl Borrow<PodDevices>],
    runtime: &RuntimeVerdicts,
    now: &Time,
) -> Books {
    let all = || pods.iter().map(Borrow::<PodDevices>::borrow);
    let name = pool.metadata.name.clone().unwrap_or_default();
    let resource = pool.spec.resource_name.as_str();
    let generation = pool.metadata.generation;

    // Holders per node, and pending grants.
    let live = || all().filter(|p| !p.ended && p.request(resource) > 0);
    let mut held: BTreeMap<&str, (i64, i64, Vec<String>)> = BTreeMap::new();
    for p in live() {
        if let Some(node) = p.node.as_deref() {
            let e = held.entry(node).or_default();
            e.0 += p.request(resource);
            if p.meshed && p.offload.as_deref() == Some(OFFLOAD_QAT) {
                e.1 += 1;
            }
            e.2.push(p.key());
        }
    }
    let pending_pods: Vec<&PodDevices> = live()
        .filter(|p| p.node.is_none())
        .filter(|p| p.pool.as_deref().is_none_or(|n| n == name))
        .collect();
    let pending: i64 = pending_pods.iter().map(|p| p.request(resource)).sum();

    // Grants these books have seen, whether the pod still holds its device
    // or has already ended: either way the webhook must stop counting it.
    let since = now.0.as_second() - RECENT_GRANT_WINDOW_SECONDS;
    let mut recent: Vec<(i64, &str)> = all()
        .filter(|p| p.pool.as_deref() == Some(name.as_str()) && p.created >= since)
        .filter_map(|p| p.grant.as_deref().map(|g| (p.created, g)))
        .collect();
    // Newest first, so a cap drops the grants the webhook forgot already.
    recent.sort_by(|a, b| b.cmp(a));
    let mut recent_grants: Vec<String> = recent
        .into_iter()
        .take(MAX_RECENT_GRANTS)
        .map(|(_, g)| g.to_owned())
        .collect();
    recent_grants.sort();

    // The pool's nodes, as the grant decision sees them.
    let inventory: Vec<NodeInventory> = nodes
        .iter()
        .map(|n| {
            let node = n.metadata.name.as_deref().unwrap_or_default();
            let allocated = held.get(node).map_or(0, |h| h.0);
            NodeInventory::from_node(n, resource, allocated)
        })
        .filter(|n| accelerator::in_pool(pool, n))
        .collect();
    let mut rows: Vec<NodeAllocation> = inventory
        .iter()
        // A node that lost its devices but still has holders stays listed,
        // so the administrator sees who holds what is gone.
        .filter(|n| n.allocatable > 0 || n.allocated > 0)
        .map(|n| {
            let (_, sidecars, mut holders) = held.get(n.name.as_str()).cloned().unwrap_or_default();
            holders.sort();
            holders.truncate(MAX_PODS_PER_NODE);
            NodeAllocation {
                node: n.name.clone(),
                capacity: n.allocatable,
                allocated: n.allocated,
                free: n.free(),
                sidecars,
                pods: holders,
            }
        })
        .collect();
    rows.sort_by(|a, b| a.node.cmp(&b.node));

    // Fallbacks: meshed pods the webhook sent to software for this pool,
    // and granted pods whose sidecar signs in software anyway.
    let runtime_reason = |p: &PodDevices| runtime.get(&*p.uid);
    let mut fallback_pods: Vec<&PodDevices> = all()
        .filter(|p| !p.ended && p.meshed)
        .filter(|p| match p.offload.as_deref() {
            Some(OFFLOAD_FALLBACK) => true,
            Some(OFFLOAD_QAT) => runtime_reason(p).is_some(),
            _ => false,
        })
        .filter(|p| p.pool.as_deref() == Some(name.as_str()))
        .collect();
    fallback_pods.sort_by(|a, b| {
        b.created
            .cmp(&a.created)
            .then_with(|| a.key().cmp(&b.key()))
    });
    let fallbacks: Vec<Fallback> = fallback_pods
        .iter()
        .map(|p| Fallback {
            namespace: p.namespace.to_string(),
            pod: p.name.to_string(),
            uid: p.uid.to_string(),
            reason: runtime_reason(p)
                .map(String::as_str)
                .or(p.fallback_reason.as_deref())
                .unwrap_or("no reason recorded")
                .to_owned(),
        })
        .collect();

    let node_count = count(rows.iter().filter(|r| r.capacity > 0));
    let capacity: i64 = rows.iter().map(|r| r.capacity).sum();
    let allocated: i64 = rows.iter().map(|r| r.allocated).sum();
    let free: i64 = rows.iter().map(|r| r.free).sum();

    // Conditions.
    let mut c = pool
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let mut set = |type_: &str, status: bool, reason: &str, message: String| {
        conditions::upsert(&mut c, type_, status, reason, &message, generation, now);
    };
    let invalid = pool.validate().err().map(|errors| {
        errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    });
    match &invalid {
        Some(message) => set(
            cond::READY,
            false,
            cond::reasons::INVALID_SPEC,
            message.clone(),
        ),
        None if node_count == 0 => set(
            cond::READY,
            false,
            cond::reasons::NO_NODES,
            format!(
                "no node the pool selects advertises {resource} as allocatable (check the nodeSelector and the device plugin)"
            ),
        ),
        None => set(
            cond::READY,
            true,
            cond::reasons::DEVICES_AVAILABLE,
            format!("{node_count} node(s) advertise {capacity} device(s) of {resource}"),
        ),
    }

    // Exhausted is the grant decision's answer for a Required sidecar of a
    // pod with a standby slot (HotUpgrade, the default): both slots request
    // the devices (docs/decisions/0036).
    let probe = PrivateKeyOffload {
        mode: OffloadMode::Required,
        resource: resource.to_owned(),
        pool: Some(name.clone()),
    };
    let decision = accelerator::decide_offload(&OffloadInput {
        offload: Some(&probe),
        pool: Some(pool),
        nodes: &inventory,
        pending,
        pinned_node: None,
        slots: SLOTS_PER_POD,
    });
    match decision {
        OffloadDecision::Deny {
            reason: reason @ NoGrant::Exhausted { .. },
        } => set(
            cond::EXHAUSTED,
            true,
            cond::reasons::ALL_ALLOCATED,
            format!("{reason}; new Preferred sidecars run in software, Required ones are refused"),
        ),
        _ => set(
            cond::EXHAUSTED,
            false,
            cond::reasons::CAPACITY_LEFT,
            format!("{free} of {capacity} device(s) free, {pending} pending"),
        ),
    }

    let lost: Vec<String> = rows
        .iter()
        .filter(|r| r.allocated > r.capacity)
        .map(|r| format!("{} holds {} of {}", r.node, r.allocated, r.capacity))
        .collect();
    let stuck: Vec<String> = pending_pods
        .iter()
        .filter(|p| p.unschedulable)
        .map(|p| p.key())
        .collect();
    if let Some(message) = &invalid {
        set(
            cond::DEGRADED,
            true,
            cond::reasons::INVALID_SPEC,
            message.clone(),
        );
    } else if !lost.is_empty() {
        set(
            cond::DEGRADED,
            true,
            cond::reasons::DEVICES_LOST,
            format!(
                "pods hold more devices than their node advertises ({}): the device plugin reports fewer healthy devices",
                lost.join(", ")
            ),
        );
    } else if !stuck.is_empty() {
        set(
            cond::DEGRADED,
            true,
            cond::reasons::UNSCHEDULABLE,
            format!(
                "{} pod(s) granted devices cannot be scheduled, e.g. {}",
                stuck.len(),
                stuck.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
            ),
        );
    } else {
        set(
            cond::DEGRADED,
            false,
            cond::reasons::HEALTHY,
            "every held device is advertised and every grant is placed".to_owned(),
        );
    }

    let status = AcceleratorPoolStatus {
        observed_generation: generation,
        // Carried over: the controller stamps it only when it writes.
        computed_at: pool.status.as_ref().and_then(|s| s.computed_at.clone()),
        node_count,
        capacity,
        allocated,
        free,
        pending,
        recent_grants: Some(recent_grants),
        fallbacks: count(fallbacks.iter()),
        nodes: rows,
        recent_fallbacks: fallbacks
            .iter()
            .take(MAX_RECENT_FALLBACKS)
            .map(|f| FallbackRecord {
                namespace: f.namespace.clone(),
                pod: f.pod.clone(),
                reason: f.reason.clone(),
            })
            .collect(),
        conditions: c,
    };
    Books { status, fallbacks }
}

fn count<T>(it: impl Iterator<Item = T>) -> i64 {
    i64::try_from(it.count()).unwrap_or(i64::MAX)
}

/// UIDs of `fallbacks` not in `announced` (the controller's Events are
/// published once per pod).
pub fn unannounced<'a>(
    fallbacks: &'a [Fallback],
    announced: &BTreeSet<String>,
) -> Vec<&'a Fallback> {
    fallbacks
        .iter()
        .filter(|f| !announced.contains(&f.uid))
        .collect()
}

#[cfg(test)]
pub(crate) mod tests;
