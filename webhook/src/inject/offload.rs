//! Private-key offload at injection: which TlsPolicy governs the pod and
//! whether it gets QAT devices, falls back to software, or is refused.

use std::{collections::BTreeMap, sync::Arc};

use baton_crds::{
    AcceleratorPool, TlsPolicy,
    contract::annotations,
    selector,
    tls_policy::OffloadMode,
};
use k8s_openapi::api::core::v1::Node;

/// The offload outcome recorded on the pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Offload {
    /// No TlsPolicy selects the pod, or its offload mode is Disabled.
    Disabled,
    /// Devices requested through the extended resource.
    Granted {
        mode: OffloadMode,
        pool: String,
        resource: String,
        devices: i64,
    },
    /// Preferred, but no capacity: software keys, and the reason.
    Fallback { reason: String },
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
            Self::Granted { pool, .. } => vec![
                (annotations::OFFLOAD, "qat".to_owned()),
                (annotations::ACCELERATOR_POOL, pool.clone()),
            ],
            Self::Fallback { reason } => vec![
                (annotations::OFFLOAD, "software-fallback".to_owned()),
                (annotations::OFFLOAD_FALLBACK_REASON, reason.clone()),
            ],
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

/// Decides offload for a pod governed by `policy`. `Err` is the denial
/// message for Required without capacity.
pub fn decide(
    policy: Option<&TlsPolicy>,
    pools: &[Arc<AcceleratorPool>],
    nodes: &[Arc<Node>],
) -> Result<Offload, String> {
    let Some(policy) = policy else {
        return Ok(Offload::Disabled);
    };
    let o = &policy.spec.private_key_offload;
    if o.mode == OffloadMode::Disabled {
        return Ok(Offload::Disabled);
    }
    let policy_name = policy.metadata.name.as_deref().unwrap_or_default();
    let mut pools: Vec<&AcceleratorPool> = pools
        .iter()
        .map(AsRef::as_ref)
        .filter(|p| p.spec.resource_name == o.resource)
        .filter(|p| o.pool.is_none() || p.metadata.name == o.pool)
        .collect();
    pools.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let node_refs: Vec<&Node> = nodes.iter().map(AsRef::as_ref).collect();
    let mut reasons = Vec::new();
    for pool in &pools {
        let name = pool.metadata.name.clone().unwrap_or_default();
        let free = free_devices(pool, &node_refs);
        let need = i64::from(pool.spec.devices_per_sidecar);
        if free >= need {
            return Ok(Offload::Granted {
                mode: o.mode,
                pool: name,
                resource: o.resource.clone(),
                devices: need,
            });
        }
        reasons.push(format!("AcceleratorPool {name} has {free} free {} (needs {need})", o.resource));
    }
    let reason = if pools.is_empty() {
        match &o.pool {
            Some(p) => format!("no AcceleratorPool {p} offers {}", o.resource),
            None => format!("no AcceleratorPool offers {}", o.resource),
        }
    } else {
        reasons.join("; ")
    };
    match o.mode {
        OffloadMode::Required => Err(format!(
            "TlsPolicy {policy_name} requires private-key offload (mode Required) but {reason}; \
             add devices or nodes to the pool, or set privateKeyOffload.mode to Preferred"
        )),
        _ => Ok(Offload::Fallback { reason }),
    }
}

/// Devices of `pool` not yet allocated. The operator's pool controller
/// writes per-node capacity and allocations to the pool's status; until it
/// has, capacity is read from the allocatable of the nodes the pool selects.
fn free_devices(pool: &AcceleratorPool, nodes: &[&Node]) -> i64 {
    let status = pool.status.clone().unwrap_or_default();
    let capacity = if status.nodes.is_empty() && status.capacity == 0 {
        nodes
            .iter()
            .filter(|n| {
                selector::matches_opt(
                    pool.spec.node_selector.as_ref(),
                    n.metadata.labels.as_ref().unwrap_or(&BTreeMap::new()),
                )
            })
            .filter_map(|n| {
                n.status
                    .as_ref()?
                    .allocatable
                    .as_ref()?
                    .get(&pool.spec.resource_name)
                    .and_then(|q| q.0.parse::<i64>().ok())
            })
            .sum()
    } else {
        status.capacity
    };
    (capacity - status.allocated).max(0)
}
