//! `AcceleratorPool` (cluster-scoped): a set of nodes whose Intel QAT
//! devices (advertised by the device plugin as an extended resource) Baton
//! hands to sidecars for private-key offload.
//!
//! The webhook asks [`crate::accelerator::decide_offload`] whether a new pod's
//! sidecar gets devices (by requesting the extended resource, so the
//! scheduler places it); the operator keeps the status (capacity per node,
//! allocations, fallbacks) current from Nodes and Pods.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, MicroTime};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::contract::DEFAULT_QAT_RESOURCE;
use crate::selector;
use crate::tls_policy::is_extended_resource_name;
use crate::validation::{Errors, FieldError, Validate};

/// Nodes with QAT devices that Baton allocates to sidecars.
// Each printcolumn(...) repeats `type_ = ...`; clippy reads that as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, JsonSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "baton.dev",
    doc = "AcceleratorPool: nodes whose Intel QAT devices Baton allocates to sidecars for private-key offload.",
    version = "v1alpha1",
    kind = "AcceleratorPool",
    status = "AcceleratorPoolStatus",
    shortname = "accpool",
    category = "baton",
    derive = "PartialEq",
    printcolumn(
        name = "Resource",
        type_ = "string",
        json_path = ".spec.resourceName",
        description = "Extended resource of the devices"
    ),
    printcolumn(
        name = "Per-Sidecar",
        type_ = "integer",
        json_path = ".spec.devicesPerSidecar",
        description = "Devices each sidecar gets"
    ),
    printcolumn(
        name = "Nodes",
        type_ = "integer",
        json_path = ".status.nodeCount",
        description = "Nodes of the pool that advertise devices"
    ),
    printcolumn(
        name = "Capacity",
        type_ = "integer",
        json_path = ".status.capacity",
        description = "Devices on the pool's nodes"
    ),
    printcolumn(
        name = "Allocated",
        type_ = "integer",
        json_path = ".status.allocated",
        description = "Devices held by sidecars"
    ),
    printcolumn(
        name = "Free",
        type_ = "integer",
        json_path = ".status.free",
        description = "Devices no sidecar holds"
    ),
    printcolumn(
        name = "Fallbacks",
        type_ = "integer",
        json_path = ".status.fallbacks",
        description = "Sidecars running in software fallback"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct AcceleratorPoolSpec {
    /// Extended resource name under which the device plugin advertises the
    /// devices on each node.
    #[serde(default = "default_resource_name")]
    #[schemars(
        length(min = 3, max = 253),
        regex(
            pattern = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)+[a-z0-9]([-a-z0-9]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
        )
    )]
    pub resource_name: String,

    /// Nodes in the pool (by their labels). Absent: every node that
    /// advertises `resourceName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,

    /// Devices each offloading sidecar requests.
    #[serde(default = "default_devices_per_sidecar")]
    #[schemars(range(min = 1, max = 16))]
    pub devices_per_sidecar: i32,
}

fn default_resource_name() -> String {
    DEFAULT_QAT_RESOURCE.to_owned()
}

fn default_devices_per_sidecar() -> i32 {
    1
}

/// Observed devices and their use, written by the operator's pool
/// controller (leader only, server-side apply) from Nodes and Pods.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AcceleratorPoolStatus {
    /// `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// When the operator computed these books (set on each write).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub computed_at: Option<MicroTime>,
    /// Nodes of the pool that advertise at least one device.
    #[serde(default)]
    pub node_count: i64,
    /// Allocatable devices summed over the pool's nodes.
    #[serde(default)]
    pub capacity: i64,
    /// Devices held by running sidecars, summed over the pool's nodes.
    #[serde(default)]
    pub allocated: i64,
    /// Devices no sidecar holds (per node, never below zero), summed.
    #[serde(default)]
    pub free: i64,
    /// Devices granted at admission to pods the scheduler has not placed
    /// yet: they will take free devices somewhere, so the webhook subtracts
    /// them before it grants more.
    #[serde(default)]
    pub pending: i64,
    /// Grant ids (`baton.dev/offload-grant`) of the pods created in the
    /// last minute that these books have seen, sorted, at most 256. A
    /// webhook replica counts a grant it made on top of the books until its
    /// id appears here; absent (an older operator), until books computed
    /// after the grant arrive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recent_grants: Option<Vec<String>>,
    /// Sidecars whose policy asked for offload (Preferred) but that run in
    /// software because the pool had no free device at admission.
    #[serde(default)]
    pub fallbacks: i64,
    /// Per node: capacity, allocations and the pods holding devices.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<NodeAllocation>,
    /// The most recent software fallbacks (at most 10), newest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recent_fallbacks: Vec<FallbackRecord>,
    /// Ready, Exhausted, Degraded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Devices on one node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeAllocation {
    /// Node name.
    pub node: String,
    /// Allocatable devices the node advertises (`status.allocatable`).
    pub capacity: i64,
    /// Devices requested by sidecars of pods bound to the node.
    pub allocated: i64,
    /// `capacity - allocated`, never below zero.
    #[serde(default)]
    pub free: i64,
    /// Offloading sidecars on the node.
    #[serde(default)]
    pub sidecars: i64,
    /// The pods holding devices (`namespace/name`), sorted, at most 20.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<String>,
}

/// One sidecar that fell back to software.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FallbackRecord {
    /// Namespace of the pod.
    pub namespace: String,
    /// Name of the pod.
    pub pod: String,
    /// Why no device was granted.
    pub reason: String,
}

impl Validate for AcceleratorPool {
    fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut e = Errors::default();
        let s = &self.spec;
        if !is_extended_resource_name(&s.resource_name) {
            e.push(
                "spec.resourceName",
                format!(
                    "{:?} is not an extended resource name: use <domain>/<name> with a domain outside kubernetes.io, e.g. {DEFAULT_QAT_RESOURCE}",
                    s.resource_name
                ),
            );
        }
        if let Some(sel) = &s.node_selector {
            selector::check(&mut e, "spec.nodeSelector", sel);
        }
        if !(1..=16).contains(&s.devices_per_sidecar) {
            e.push("spec.devicesPerSidecar", "must be between 1 and 16");
        }
        e.into_result()
    }
}
