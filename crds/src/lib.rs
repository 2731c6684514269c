//! `baton-crds`: Baton's Kubernetes API (group `baton.dev`, version `v1alpha1`)
//! and the kube-free [`contract`] of names shared by every part.
//!
//! The CRD types are the single source of truth for `manifests/crds/`: the
//! `crdgen` binary renders them and CI fails when the committed YAML drifts.
//! The sidecar depends only on the `contract` module (build this crate with
//! `default-features = false` to drop kube entirely).
//!
//! Layout (with the `kube` feature):
//!
//! ```text
//! sidecar_release  SidecarRelease  cluster  which sidecar version runs where, rollout knobs
//! route            Route           ns       L7/L4 routing for one Service port
//! tls_policy       TlsPolicy       ns       mTLS mode, TLS version/ciphers, key offload
//! accelerator_pool AcceleratorPool cluster  QAT devices the operator hands to sidecars
//! common           shared field types (backend refs, durations, header names)
//! conditions       status condition types, reasons and an upsert helper
//! selector         pure LabelSelector matching
//! validation       FieldError + the `Validate` trait every kind implements
//! objects          validates a JSON object of any Baton kind (dispatch by kind)
//! accelerator      pure QAT grant decision shared by webhook and operator
//! schema           CRD post-processing for old API servers + the full CRD list
//! yaml             the one place that talks YAML
//! ```

pub mod contract;

#[cfg(feature = "kube")]
pub mod accelerator;
#[cfg(feature = "kube")]
pub mod accelerator_pool;
#[cfg(feature = "kube")]
pub mod common;
#[cfg(feature = "kube")]
pub mod conditions;
#[cfg(feature = "kube")]
pub mod objects;
#[cfg(feature = "kube")]
pub mod route;
#[cfg(feature = "kube")]
pub mod schema;
#[cfg(feature = "kube")]
pub mod selector;
#[cfg(feature = "kube")]
pub mod sidecar_release;
#[cfg(feature = "kube")]
pub mod tls_policy;
#[cfg(feature = "kube")]
pub mod validation;
#[cfg(feature = "kube")]
pub mod yaml;

#[cfg(feature = "kube")]
pub use accelerator_pool::{AcceleratorPool, AcceleratorPoolSpec, AcceleratorPoolStatus};
#[cfg(feature = "kube")]
pub use route::{Route, RouteSpec, RouteStatus};
#[cfg(feature = "kube")]
pub use sidecar_release::{SidecarRelease, SidecarReleaseSpec, SidecarReleaseStatus};
#[cfg(feature = "kube")]
pub use tls_policy::{TlsPolicy, TlsPolicySpec, TlsPolicyStatus};
#[cfg(feature = "kube")]
pub use validation::{FieldError, Validate};
