//! Whether a sidecar gets QAT devices for private-key offload: a pure
//! decision the webhook (at pod admission) and the operator's pool
//! controller (when it explains allocations in status) both call, so they
//! can never disagree.
//!
//! The decision happens at admission, before the scheduler picks a node. A
//! grant therefore means "request `count` devices of `resource` on the
//! sidecar container": the scheduler then only places the pod on a node with
//! free devices, and the device plugin hands them over. The decision checks
//! there is somewhere to go first, so a `Preferred` pod never waits for a
//! device that does not exist:
//!
//! ```text
//! mode Disabled ───────────────────────────────────────────────► Disabled
//! no pool / pool resource ≠ policy resource / no node in pool /
//!   no node with `count` free (after pending grants) ──► Preferred: Fallback(reason)
//!                                                        Required:  Deny(reason)
//! otherwise ───────────────────────────────────────────────────► Grant
//! ```

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::Node;

use crate::accelerator_pool::AcceleratorPool;
use crate::selector;
use crate::tls_policy::{OffloadMode, PrivateKeyOffload};

/// What one node offers, as the caller observed it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInventory {
    /// Node name.
    pub name: String,
    /// Node labels (matched against the pool's `nodeSelector`).
    pub labels: BTreeMap<String, String>,
    /// Devices of the resource the node advertises as allocatable.
    pub allocatable: i64,
    /// Devices already requested by pods bound to the node.
    pub allocated: i64,
}

impl NodeInventory {
    /// Reads name, labels and `status.allocatable[resource]` from a Node;
    /// `allocated` comes from the caller's pod index.
    pub fn from_node(node: &Node, resource: &str, allocated: i64) -> Self {
        let allocatable = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get(resource))
            .map_or(0, |q| device_count(&q.0));
        Self {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            allocatable,
            allocated,
        }
    }

    /// Devices no pod holds, never below zero.
    pub fn free(&self) -> i64 {
        (self.allocatable - self.allocated).max(0)
    }
}

/// Parses an extended-resource quantity. Device counts are plain integers;
/// anything else (fractions, suffixes) counts as no devices, failing closed.
pub fn device_count(quantity: &str) -> i64 {
    quantity.trim().parse::<i64>().unwrap_or(0).max(0)
}

/// Everything the decision looks at.
#[derive(Clone, Copy, Debug)]
pub struct OffloadInput<'a> {
    /// The TlsPolicy's `privateKeyOffload`; `None` when no policy selects the
    /// pod (offload then is Disabled).
    pub offload: Option<&'a PrivateKeyOffload>,
    /// The pool chosen with [`select_pool`], if any.
    pub pool: Option<&'a AcceleratorPool>,
    /// Every node the caller knows (the decision filters by the pool's
    /// selector and by `pinned_node`).
    pub nodes: &'a [NodeInventory],
    /// Devices granted to pods not yet bound to a node: they will take free
    /// devices somewhere, so they are subtracted from the pool's total.
    pub pending: i64,
    /// `spec.nodeName` when the pod is created already bound (static or
    /// DaemonSet-style pods): only that node counts.
    pub pinned_node: Option<&'a str>,
    /// Sidecar containers of the pod that each request the pool's
    /// `devicesPerSidecar`: 2 with a standby slot (both slots carry the
    /// device, so a hot upgrade into either keeps it), 1 without. Values
    /// below 1 count as 1.
    pub slots: i64,
}

/// The outcome for one sidecar.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OffloadDecision {
    /// No offload asked for: software keys, no annotation of a fallback.
    Disabled,
    /// Request `count` devices of `resource` on each sidecar container
    /// (`count` × [`OffloadInput::slots`] for the pod).
    Grant {
        resource: String,
        count: i64,
        pool: String,
    },
    /// Offload was Preferred but is not possible: run in software and record
    /// why on the pod.
    Fallback { reason: NoGrant },
    /// Offload is Required but not possible: refuse the pod.
    Deny { reason: NoGrant },
}

impl OffloadDecision {
    /// Value of the `baton.dev/offload` pod annotation, `None` when the pod
    /// is refused.
    pub fn annotation(&self) -> Option<&'static str> {
        match self {
            Self::Disabled => Some("disabled"),
            Self::Grant { .. } => Some("qat"),
            Self::Fallback { .. } => Some("software-fallback"),
            Self::Deny { .. } => None,
        }
    }
}

/// Why no device was granted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoGrant {
    /// No AcceleratorPool serves the resource (or the named pool is missing).
    NoPool {
        resource: String,
        pool: Option<String>,
    },
    /// The named pool hands out a different resource than the policy asks for.
    ResourceMismatch {
        pool: String,
        pool_resource: String,
        wanted: String,
    },
    /// No node of the pool advertises any device (or the pinned node is not
    /// in the pool).
    NoNodes { pool: String },
    /// Devices exist but none of the pool's nodes has `needed` free ones.
    Exhausted {
        pool: String,
        needed: i64,
        free: i64,
    },
}

impl NoGrant {
    /// Short stable code (for metrics labels and the pool status).
    pub fn code(&self) -> &'static str {
        match self {
            Self::NoPool { .. } => "NoPool",
            Self::ResourceMismatch { .. } => "ResourceMismatch",
            Self::NoNodes { .. } => "NoNodes",
            Self::Exhausted { .. } => "Exhausted",
        }
    }
}

impl fmt::Display for NoGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoPool {
                resource,
                pool: Some(p),
            } => write!(
                f,
                "AcceleratorPool {p:?} (named by the TlsPolicy) does not exist; create it or remove privateKeyOffload.pool (resource {resource})"
            ),
            Self::NoPool {
                resource,
                pool: None,
            } => write!(
                f,
                "no AcceleratorPool has resourceName {resource}: create one to offload private keys"
            ),
            Self::ResourceMismatch {
                pool,
                pool_resource,
                wanted,
            } => write!(
                f,
                "AcceleratorPool {pool:?} provides {pool_resource} but the TlsPolicy asks for {wanted}"
            ),
            Self::NoNodes { pool } => write!(
                f,
                "no node of AcceleratorPool {pool:?} advertises devices (check its nodeSelector and the device plugin)"
            ),
            Self::Exhausted { pool, needed, free } => write!(
                f,
                "AcceleratorPool {pool:?} has no node with {needed} free device(s) ({free} free in total after pending grants)"
            ),
        }
    }
}

/// The pool a policy draws from: the one it names, else the alphabetically
/// first pool whose `resourceName` is the policy's resource.
pub fn select_pool<'a>(
    offload: &PrivateKeyOffload,
    pools: &'a [AcceleratorPool],
) -> Option<&'a AcceleratorPool> {
    match &offload.pool {
        Some(name) => pools
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(name.as_str())),
        None => pools
            .iter()
            .filter(|p| p.spec.resource_name == offload.resource)
            .min_by(|a, b| a.metadata.name.cmp(&b.metadata.name)),
    }
}

/// Whether `node` belongs to `pool` (by the pool's node selector).
pub fn in_pool(pool: &AcceleratorPool, node: &NodeInventory) -> bool {
    selector::matches_opt(pool.spec.node_selector.as_ref(), &node.labels)
}

/// Decides offload for one sidecar. See the module docs for the rules.
pub fn decide_offload(input: &OffloadInput<'_>) -> OffloadDecision {
    let Some(offload) = input.offload else {
        return OffloadDecision::Disabled;
    };
    let refuse = |reason| match offload.mode {
        OffloadMode::Disabled => OffloadDecision::Disabled,
        OffloadMode::Preferred => OffloadDecision::Fallback { reason },
        OffloadMode::Required => OffloadDecision::Deny { reason },
    };
    if offload.mode == OffloadMode::Disabled {
        return OffloadDecision::Disabled;
    }
    let Some(pool) = input.pool else {
        return refuse(NoGrant::NoPool {
            resource: offload.resource.clone(),
            pool: offload.pool.clone(),
        });
    };
    let pool_name = pool.metadata.name.clone().unwrap_or_default();
    if offload.pool.as_ref().is_some_and(|p| *p != pool_name) {
        // The caller passed a pool other than the one the policy names:
        // treat as missing rather than silently drawing from the wrong pool.
        return refuse(NoGrant::NoPool {
            resource: offload.resource.clone(),
            pool: offload.pool.clone(),
        });
    }
    if pool.spec.resource_name != offload.resource {
        return refuse(NoGrant::ResourceMismatch {
            pool: pool_name,
            pool_resource: pool.spec.resource_name.clone(),
            wanted: offload.resource.clone(),
        });
    }
    let per_sidecar = i64::from(pool.spec.devices_per_sidecar.max(1));
    let needed = per_sidecar * input.slots.max(1);
    let eligible: Vec<&NodeInventory> = input
        .nodes
        .iter()
        .filter(|n| in_pool(pool, n))
        .filter(|n| input.pinned_node.is_none_or(|p| p == n.name))
        .filter(|n| n.allocatable > 0)
        .collect();
    if eligible.is_empty() {
        return refuse(NoGrant::NoNodes { pool: pool_name });
    }
    let free_total: i64 = eligible.iter().map(|n| n.free()).sum::<i64>() - input.pending.max(0);
    let fits_somewhere = eligible.iter().any(|n| n.free() >= needed);
    if !fits_somewhere || free_total < needed {
        return refuse(NoGrant::Exhausted {
            pool: pool_name,
            needed,
            free: free_total.max(0),
        });
    }
    OffloadDecision::Grant {
        resource: pool.spec.resource_name.clone(),
        count: per_sidecar,
        pool: pool_name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accelerator_pool::AcceleratorPoolSpec;
    use crate::contract::DEFAULT_QAT_RESOURCE;
    use k8s_openapi::api::core::v1::NodeStatus;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

    fn pool(name: &str, resource: &str, per_sidecar: i32, qat_label: bool) -> AcceleratorPool {
        AcceleratorPool::new(
            name,
            AcceleratorPoolSpec {
                resource_name: resource.into(),
                node_selector: qat_label.then(|| LabelSelector {
                    match_labels: Some(BTreeMap::from([("qat".to_string(), "yes".to_string())])),
                    match_expressions: None,
                }),
                devices_per_sidecar: per_sidecar,
            },
        )
    }

    fn node(name: &str, qat: bool, allocatable: i64, allocated: i64) -> NodeInventory {
        let mut labels = BTreeMap::new();
        if qat {
            labels.insert("qat".to_string(), "yes".to_string());
        }
        NodeInventory {
            name: name.into(),
            labels,
            allocatable,
            allocated,
        }
    }

    fn offload(mode: OffloadMode) -> PrivateKeyOffload {
        PrivateKeyOffload {
            mode,
            ..PrivateKeyOffload::default()
        }
    }

    fn decide(
        o: &PrivateKeyOffload,
        p: Option<&AcceleratorPool>,
        nodes: &[NodeInventory],
        pending: i64,
        pinned: Option<&str>,
    ) -> OffloadDecision {
        decide_offload(&OffloadInput {
            offload: Some(o),
            pool: p,
            nodes,
            pending,
            pinned_node: pinned,
            slots: 1,
        })
    }

    fn grant(pool: &str, count: i64) -> OffloadDecision {
        OffloadDecision::Grant {
            resource: DEFAULT_QAT_RESOURCE.into(),
            count,
            pool: pool.into(),
        }
    }

    #[test]
    fn no_policy_means_disabled() {
        let p = pool("qat", DEFAULT_QAT_RESOURCE, 1, false);
        let d = decide_offload(&OffloadInput {
            offload: None,
            pool: Some(&p),
            nodes: &[node("n1", true, 4, 0)],
            pending: 0,
            pinned_node: None,
            slots: 1,
        });
        assert_eq!(d, OffloadDecision::Disabled);
        assert_eq!(d.annotation(), Some("disabled"));
    }

    #[test]
    fn mode_disabled_never_grants_even_with_free_devices() {
        let p = pool("qat", DEFAULT_QAT_RESOURCE, 1, false);
        let d = decide(
            &offload(OffloadMode::Disabled),
            Some(&p),
            &[node("n1", true, 4, 0)],
            0,
            None,
        );
        assert_eq!(d, OffloadDecision::Disabled);
    }

    #[test]
    fn preferred_with_free_devices_is_granted_the_pools_count() {
        let p = pool("qat", DEFAULT_QAT_RESOURCE, 2, true);
        let d = decide(
            &offload(OffloadMode::Preferred),
            Some(&p),
            &[node("n1", true, 4, 1)],
            0,
            None,
        );
        assert_eq!(d, grant("qat", 2));
        assert_eq!(d.annotation(), Some("qat"));
    }

    #[test]
    fn a_pod_with_two_slots_needs_devices_for_both_on_one_node() {
        let p = pool("qat", DEFAULT_QAT_RESOURCE, 2, false);
        let two_slots = |nodes: &[NodeInventory], pending| {
            decide_offload(&OffloadInput {
                offload: Some(&offload(OffloadMode::Required)),
                pool: Some(&p),
                nodes,
                pending,
                pinned_node: None,
                slots: 2,
            })
        };
        // 2 per sidecar × 2 slots = 4 on one node; the grant names the
        // count each slot requests.
        assert_eq!(two_slots(&[node("n1", false, 4, 0)], 0), grant("qat", 2));
        // Three free on each of two nodes: enough in total, not on one.
        let split = [node("n1", false, 3, 0), node("n2", false, 3, 0)];
        assert_eq!(
            two_slots(&split, 0),
            OffloadDecision::Deny {
                reason: NoGrant::Exhausted {
                    pool: "qat".into(),
                    needed: 4,
                    free: 6
                }
            }
        );
        // Pending grants count against the total.
        assert!(matches!(
            two_slots(&[node("n1", false, 5, 0)], 2),
            OffloadDecision::Deny { .. }
        ));
    }

    #[test]
    fn required_with_free_devices_is_granted() {
        let p = pool("qat", DEFAULT_QAT_RESOURCE, 1, false);
        let d = decide(
            &offload(OffloadMode::Required),
            Some(&p),
            &[node("n1", false, 1, 0)],
            0,
            None,
        );
        assert_eq!(d, grant("qat", 1));
    }

    #[test]
    fn missing_pool_falls_back_when_preferred_and_denies_when_required() {
        let nodes = [node("n1", true, 4, 0)];
        let want = NoGrant::NoPool {
            resource: DEFAULT_QAT_RESOURCE.into(),
            pool: None,
        };
        assert_eq!(
            decide(&offload(OffloadMode::Preferred), None, &nodes, 0, None),
            OffloadDecision::Fallback {
                reason: want.clone()
            }
        );
        let d = decide(&offload(OffloadMode::Required), None, &nodes, 0, None);
        assert_eq!(d, OffloadDecision::Deny { reason: want });
        assert_eq!(d.annotation(), None);
    }

    #[test]
    fn a_pool_other_than_the_named_one_is_treated_as_missing() {
        let p = pool("other", DEFAULT_QAT_RESOURCE, 1, false);
        let mut o = offload(OffloadMode::Preferred);
        o.pool = Some("wanted".into());
        let d = decide(&o, Some(&p), &[node("n1", true, 4, 0)], 0, None);
        assert_eq!(
            d,
            OffloadDecision::Fallback {
                reason: NoGrant::NoPool {
                    resource: DEFAULT_QAT_RESOURCE.into(),
                    pool: Some("wanted".into())
                }
            }
        );
    }

    #[test]
    fn pool_with_another_resource_is_a_mismatch() {
        let p = pool("qat", "qat.intel.com/asym", 1, false);
        let mut o = offload(OffloadMode::Required);
        o.pool = Some("qat".into());
        let d = decide(&o, Some(&p), &[node("n1", true, 4, 0)], 0, None);
        assert!(matches!(
            d,
            OffloadDecision::Deny {
                reason: NoGrant::ResourceMismatch { .. }
            }
        ));
    }

    #[test]
    fn nodes_outside_the_selector_do_not_count() {
        let p = pool("qat", DEFAULT_QAT_RESOURCE, 1, true);
        let d = decide(
            &offload(OffloadMode::Preferred),
            Some(&p),
            &[node("n1", false, 8, 0)],
            0,
            None,
        );
        assert_eq!(
            d,
            OffloadDecision::Fallback {
                reason: NoGrant::NoNodes { pool: "qat".into() }
            }
        );
    }

    #[test]
    fn nodes_without_devices_mean_no_nodes() {
        let p = pool("qat", DEFAULT_QAT_RESOURCE, 1, false);
        let d = decide(
            &offload(OffloadMode::Required),
            Some(&p),
            &[node("n1", true, 0, 0)],
            0,
            None,
        );
        assert_eq!(
            d,
            OffloadDecision::Deny {
                reason: NoGrant::NoNodes { pool: "qat".into() }
            }
        );
    }

    #[test]
    fn fully_allocated_pool_is_exhausted() {
        let p = pool("qat", DEFAULT_QAT_RESOURCE, 1, false);
        let nodes = [node("n1", true, 2, 2), node("n2", true, 1, 1)];
        let d = decide(&offload(OffloadMode::Preferred), Some(&p), &nodes, 0, None);
        assert_eq!(
            d,
            OffloadDecision::Fallback {
                reason: NoGrant::Exhausted {
                    pool: "qat".into(),
                    needed: 1,
                    free: 0
                }
            }
        );
        assert_eq!(d.annotation(), Some("software-fallback"));
    }

    #[test]
    fn free_devices_split_across_nodes_do_not_satisfy_a_multi_device_sidecar() {
        let p = pool("qat", DEFAULT_QAT_RESOURCE, 2, false);
        let nodes = [node("n1", true, 2, 1), node("n2", true, 2, 1)];
        let d = decide(&offload(OffloadMode::Required), Some(&p), &nodes, 0, None);
        assert_eq!(
            d,
            OffloadDecision::Deny {
                reason: NoGrant::Exhausted {
                    pool: "qat".into(),
                    needed: 2,
                    free: 2
                }
            }
        );
    }

    #[test]
    fn pending_grants_consume_free_devices() {
        let p = pool("qat", DEFAULT_QAT_RESOURCE, 1, false);
        let nodes = [node("n1", true, 2, 0)];
        assert_eq!(
            decide(&offload(OffloadMode::Preferred), Some(&p), &nodes, 1, None),
            grant("qat", 1)
        );
        assert!(matches!(
            decide(&offload(OffloadMode::Preferred), Some(&p), &nodes, 2, None),
            OffloadDecision::Fallback {
                reason: NoGrant::Exhausted { free: 0, .. }
            }
        ));
    }

    #[test]
    fn overcommitted_nodes_count_as_zero_free_not_negative() {
        let p = pool("qat", DEFAULT_QAT_RESOURCE, 1, false);
        let nodes = [node("n1", true, 1, 5), node("n2", true, 1, 0)];
        assert_eq!(
            decide(&offload(OffloadMode::Required), Some(&p), &nodes, 0, None),
            grant("qat", 1)
        );
    }

    #[test]
    fn a_pinned_pod_only_considers_its_node() {
        let p = pool("qat", DEFAULT_QAT_RESOURCE, 1, false);
        let nodes = [node("full", true, 1, 1), node("free", true, 4, 0)];
        assert!(matches!(
            decide(
                &offload(OffloadMode::Required),
                Some(&p),
                &nodes,
                0,
                Some("full")
            ),
            OffloadDecision::Deny {
                reason: NoGrant::Exhausted { .. }
            }
        ));
        assert_eq!(
            decide(
                &offload(OffloadMode::Required),
                Some(&p),
                &nodes,
                0,
                Some("free")
            ),
            grant("qat", 1)
        );
        assert!(matches!(
            decide(
                &offload(OffloadMode::Required),
                Some(&p),
                &nodes,
                0,
                Some("elsewhere")
            ),
            OffloadDecision::Deny {
                reason: NoGrant::NoNodes { .. }
            }
        ));
    }

    #[test]
    fn select_pool_prefers_the_named_pool() {
        let pools = [
            pool("a", DEFAULT_QAT_RESOURCE, 1, false),
            pool("b", DEFAULT_QAT_RESOURCE, 1, false),
        ];
        let mut o = offload(OffloadMode::Preferred);
        o.pool = Some("b".into());
        assert_eq!(
            select_pool(&o, &pools).and_then(|p| p.metadata.name.as_deref()),
            Some("b")
        );
        o.pool = Some("missing".into());
        assert!(select_pool(&o, &pools).is_none());
    }

    #[test]
    fn select_pool_without_a_name_takes_the_first_pool_for_the_resource() {
        let pools = [
            pool("z", DEFAULT_QAT_RESOURCE, 1, false),
            pool("a-other", "qat.intel.com/asym", 1, false),
            pool("m", DEFAULT_QAT_RESOURCE, 1, false),
        ];
        let o = offload(OffloadMode::Preferred);
        assert_eq!(
            select_pool(&o, &pools).and_then(|p| p.metadata.name.as_deref()),
            Some("m")
        );
        let mut other = offload(OffloadMode::Preferred);
        other.resource = "vendor.example/none".into();
        assert!(select_pool(&other, &pools).is_none());
    }

    #[test]
    fn inventory_reads_allocatable_from_the_node_status() {
        let n = Node {
            metadata: kube::api::ObjectMeta {
                name: Some("n1".into()),
                labels: Some(BTreeMap::from([("qat".to_string(), "yes".to_string())])),
                ..Default::default()
            },
            status: Some(NodeStatus {
                allocatable: Some(BTreeMap::from([
                    (DEFAULT_QAT_RESOURCE.to_string(), Quantity("3".into())),
                    ("cpu".to_string(), Quantity("2".into())),
                ])),
                ..Default::default()
            }),
            ..Default::default()
        };
        let inv = NodeInventory::from_node(&n, DEFAULT_QAT_RESOURCE, 1);
        assert_eq!(inv, node("n1", true, 3, 1));
        assert_eq!(
            NodeInventory::from_node(&n, "qat.intel.com/asym", 0).allocatable,
            0
        );
    }

    #[test]
    fn device_counts_that_are_not_plain_integers_count_as_zero() {
        assert_eq!(device_count("4"), 4);
        assert_eq!(device_count("1500m"), 0);
        assert_eq!(device_count("-2"), 0);
        assert_eq!(device_count("1k"), 0);
    }

    #[test]
    fn refusal_messages_say_what_to_do() {
        let r = NoGrant::NoPool {
            resource: DEFAULT_QAT_RESOURCE.into(),
            pool: None,
        };
        assert!(r.to_string().contains("create one"));
        assert_eq!(r.code(), "NoPool");
        let r = NoGrant::Exhausted {
            pool: "qat".into(),
            needed: 2,
            free: 1,
        };
        assert!(r.to_string().contains("no node with 2 free device(s)"));
    }
}
