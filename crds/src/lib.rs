//! `baton-crds`: Baton's Kubernetes API (group `baton.dev`, version `v1alpha1`)
//! and the kube-free [`contract`] of names shared by every part.
//!
//! The CRD types are the single source of truth for `manifests/crds/`: the
//! `crdgen` binary renders them and CI fails when the committed YAML drifts.
//! The sidecar depends only on the `contract` module (build this crate with
//! `default-features = false` to drop kube entirely).

pub mod contract;
