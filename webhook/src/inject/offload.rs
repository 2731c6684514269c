//! Private-key offload at injection: which TlsPolicy governs the pod and
//! whether it gets QAT devices, falls back to software, or is refused.

use std::{collections::BTreeMap, sync::Arc};

use baton_crds::{
    AcceleratorPool, TlsPolicy,
    accelerator::{self, NodeInventory, OffloadDecision, OffloadInput},
    contract::annotations,
    selector,
    tls_policy::OffloadMode,
};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

/// A device grant this webhook replica made, remembered until the pool's
/// books (computed by the operator) include it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecentGrant {
    /// The grant's id (`baton.dev/offload-grant` on the pod).
    pub id: String,
    pub pool: String,
    pub devices: i64,
    /// Wall-clock time of the admission.
    pub at: Timestamp,
}

/// Without `status.recentGrants` (an operator older than this webhook),
/// books computed this long after a grant are taken to include the granted
/// pod: its creation reaches the operator's pod watch within a few
/// milliseconds on a healthy control plane. The margin also absorbs clock
/// skew between the webhook's and the operator's nodes.
pub const GRANT_SETTLE: SignedDuration = SignedDuration::from_millis(300);

/// Devices of `recent` granted from `pool` that its status does not count
/// yet: those whose id the books do not list in `status.recentGrants`.
/// Exact, whatever the timing: books computed before the pod reached the
/// operator do not list it, and books that count it (pending, held, or
/// already ended) do. Books without the list fall back to time: a grant
/// counts unless the books were computed at least [`GRANT_SETTLE`] after
/// it.
pub fn unbooked(pool: &AcceleratorPool, recent: &[RecentGrant]) -> i64 {
    let name = pool.metadata.name.as_deref().unwrap_or_default();
    let status = pool.status.as_ref();
    let listed = status.and_then(|s| s.recent_grants.as_ref());
    let computed = status.and_then(|s| s.computed_at.as_ref());
    recent
        .iter()
        .filter(|g| g.pool == name)
        .filter(|g| match listed {
            Some(ids) => !ids.contains(&g.id),
            None => {
                computed.is_none_or(|c| g.at.checked_add(GRANT_SETTLE).is_ok_and(|due| c.0 < due))
            }
        })
        .map(|g| g.devices)
        .sum()
}

/// The offload outcome recorded on the pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Offload {
    /// No TlsPolicy selects the pod, or its offload mode is Disabled.
    Disabled,
    /// Devices requested through the extended resource.
    Granted {
        mode: OffloadMode,
        pool: String,
        /// The grant's id, annotated on the pod (`baton.dev/offload-grant`).
        grant: String,
        resource: String,
        /// Devices each sidecar slot requests.
        devices: i64,
        /// Slots that request them (2 with a standby slot, else 1).
        slots: i64,
    },
    /// Preferred, but no capacity: software keys, and the reason. `pool`
    /// is the pool that was asked (none when no pool serves the resource):
    /// the pool's status counts the fallback through the annotation.
    Fallback {
        reason: String,
        pool: Option<String>,
    },
}

impl Offload {
    /// Value of the sidecar's `BATON_OFFLOAD_MODE`.
    pub fn mode_str(&self) -> &'static str {
        match self {
            Self::Disabled => OffloadMode::Disabled.as_str(),
            Self::Granted { mode, .. } => mode.as_str(),
            Self::Fallback { .. } => OffloadMode::Preferred.as_str(),
        }
    }

    /// Pod annotations describing the outcome.
    pub fn annotations(&self) -> Vec<(&'static str, String)> {
        match self {
            Self::Disabled => vec![(annotations::OFFLOAD, "disabled".to_owned())],
            Self::Granted { pool, grant, .. } => vec![
                (annotations::OFFLOAD, "qat".to_owned()),
                (annotations::ACCELERATOR_POOL, pool.clone()),
                (annotations::OFFLOAD_GRANT, grant.clone()),
            ],
            Self::Fallback { reason, pool } => {
                let mut a = vec![
                    (annotations::OFFLOAD, "software-fallback".to_owned()),
                    (annotations::OFFLOAD_FALLBACK_REASON, reason.clone()),
                ];
                a.extend(
                    pool.iter()
                        .map(|p| (annotations::ACCELERATOR_POOL, p.clone())),
                );
                a
            }
        }
    }

    /// Devices the pod requests in all (what the pool's books will count).
    pub fn total_devices(&self) -> i64 {
        match self {
            Self::Granted { devices, slots, .. } => devices * slots,
            _ => 0,
        }
    }

    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Disabled => "disabled",
            Self::Granted { .. } => "granted",
            Self::Fallback { .. } => "fallback",
        }
    }
}

/// The TlsPolicy governing a pod: among the policies of its namespace whose
/// podSelector matches, the first by name (overlapping policies with
/// different settings are refused by `/validate`, so the pick only matters
/// for identical ones).
pub fn policy_for<'a>(
    policies: &'a [Arc<TlsPolicy>],
    namespace: &str,
    pod_labels: &BTreeMap<String, String>,
) -> Option<&'a TlsPolicy> {
    policies
        .iter()
        .map(AsRef::as_ref)
        .filter(|p| p.metadata.namespace.as_deref() == Some(namespace))
        .filter(|p| selector::matches(&p.spec.pod_selector, pod_labels))
        .min_by(|a, b| a.metadata.name.cmp(&b.metadata.name))
}

/// Decides offload for a pod governed by `policy`, through the shared pure
/// decision in `baton_crds::accelerator` (the operator's pool controller
/// calls the same function, so both always agree). `Err` is the denial
/// message for Required without capacity.
///
/// The books are the pool's status, as the operator's pool controller
/// wrote it (one source of truth): held devices per node
/// (`status.nodes[].allocated`) and grants not yet scheduled
/// (`status.pending`); capacity is the node's `status.allocatable` from the
/// webhook's own node cache. Until the operator has written a status a
/// node counts as fully free. The status trails the cluster by the
/// operator's debounce and two watch hops (well under a second); the grants
/// this replica made itself (`recent_grants`) cover that gap for bursts of
/// pods: each counts until the books list its id ([`unbooked`]), or for
/// [`crate::handler::GRANT_MEMORY`] at most. A grant made here is named
/// `grant_id` (the admission request's uid). Grants by other webhook
/// replicas within that gap are not seen; the scheduler remains the final
/// arbiter: an over-granted pod waits Pending for a device, and the pool
/// turns Degraded (`GrantedPodsUnschedulable`).
///
/// `slots` is the number of sidecar containers the pod gets: each requests
/// the pool's `devicesPerSidecar` (docs/decisions/0036), so the pod needs
/// that many times as many free devices on one node.
pub fn decide(
    policy: Option<&TlsPolicy>,
    pools: &[Arc<AcceleratorPool>],
    nodes: &[Arc<Node>],
    pinned_node: Option<&str>,
    recent_grants: &[RecentGrant],
    grant_id: &str,
    slots: i64,
) -> Result<Offload, String> {
    let Some(policy) = policy else {
        return Ok(Offload::Disabled);
    };
    let o = &policy.spec.private_key_offload;
    if o.mode == OffloadMode::Disabled {
        return Ok(Offload::Disabled);
    }
    let owned: Vec<AcceleratorPool> = pools.iter().map(|p| (**p).clone()).collect();
    let pool = accelerator::select_pool(o, &owned);
    let inventory: Vec<NodeInventory> = match pool {
        Some(pool) => {
            let allocated: BTreeMap<&str, i64> = pool
                .status
                .iter()
                .flat_map(|s| s.nodes.iter())
                .map(|n| (n.node.as_str(), n.allocated))
                .collect();
            nodes
                .iter()
                .map(|n| {
                    let name = n.metadata.name.as_deref().unwrap_or_default();
                    let used = allocated.get(name).copied().unwrap_or(0);
                    NodeInventory::from_node(n, &pool.spec.resource_name, used)
                })
                .collect()
        }
        None => Vec::new(),
    };
    let pending = pool.map_or(0, |p| {
        p.status.as_ref().map_or(0, |s| s.pending) + unbooked(p, recent_grants)
    });
    let pool_name = pool.and_then(|p| p.metadata.name.clone());
    let decision = accelerator::decide_offload(&OffloadInput {
        offload: Some(o),
        pool,
        nodes: &inventory,
        pending,
        pinned_node,
        slots,
    });
    let policy_name = policy.metadata.name.as_deref().unwrap_or_default();
    match decision {
        OffloadDecision::Disabled => Ok(Offload::Disabled),
        OffloadDecision::Grant {
            resource,
            count,
            pool,
        } => Ok(Offload::Granted {
            mode: o.mode,
            pool,
            grant: grant_id.to_owned(),
            resource,
            devices: count,
            slots: slots.max(1),
        }),
        OffloadDecision::Fallback { reason } => Ok(Offload::Fallback {
            reason: reason.to_string(),
            pool: pool_name,
        }),
        OffloadDecision::Deny { reason } => Err(format!(
            "TlsPolicy {policy_name} requires private-key offload (mode Required) but {reason}; \
             add devices to the pool, or set privateKeyOffload.mode to Preferred"
        )),
    }
}
