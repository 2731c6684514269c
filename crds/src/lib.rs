//! `baton-crds`: Baton's Kubernetes API (group `baton.dev`, version `v1alpha1`),
//! re-exporting the kube-free [`contract`] of names shared by every part.
//!
//! The CRD types are the single source of truth for `manifests/crds/`: the
//! `crdgen` binary renders them and CI fails when the committed YAML drifts.
//! The sidecar, its config model and the handoff never depend on this crate:
//! they use the `baton-contract` crate alone.
//!
//! Layout:
//!
//! ```text
//! sidecar_release  SidecarRelease  cluster  which sidecar version runs where, rollout knobs
//! route            Route           ns       L7/L4 routing for one Service port
//! tls_policy       TlsPolicy       ns       mTLS mode, TLS version/ciphers, key offload
//! authorization_policy AuthorizationPolicy ns who may call which port, method, path
//! accelerator_pool AcceleratorPool cluster  QAT devices the operator hands to sidecars
//! common           shared field types (backend refs, durations, header names)
//! conditions       status condition types, reasons and an upsert helper
//! selector         pure LabelSelector matching
//! validation       FieldError + the `Validate` trait every kind implements
//! objects          validates a JSON object of any Baton kind (dispatch by kind)
//! accelerator      pure QAT grant decision shared by webhook and operator
//! sidecars         the operator's `/sidecars` report (config sync per Pod), read by the CLI
//! schema           CRD post-processing for old API servers + the full CRD list
//! yaml             the one place that talks YAML
//! ```

/// The kube-free names, re-exported from `baton-contract` so the control
/// plane keeps one import path for names and types.
pub use baton_contract as contract;

pub mod accelerator;
pub mod accelerator_pool;
pub mod authorization_policy;
pub mod common;
pub mod conditions;
pub mod objects;
pub mod route;
pub mod schema;
pub mod selector;
pub mod sidecar_release;
pub mod sidecars;
pub mod tls_policy;
pub mod validation;
pub mod yaml;

pub use accelerator_pool::{AcceleratorPool, AcceleratorPoolSpec, AcceleratorPoolStatus};
pub use authorization_policy::{
    AuthorizationPolicy, AuthorizationPolicySpec, AuthorizationPolicyStatus,
};
pub use route::{Route, RouteSpec, RouteStatus};
pub use sidecar_release::{SidecarRelease, SidecarReleaseSpec, SidecarReleaseStatus};
pub use tls_policy::{TlsPolicy, TlsPolicySpec, TlsPolicyStatus};
pub use validation::{FieldError, Validate};
