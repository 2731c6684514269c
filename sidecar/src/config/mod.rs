//! The sidecar's configuration: the [`Snapshot`] model (from the kube-free
//! `baton-config` crate, shared with the operator that compiles Routes into
//! it), its validation and compilation into serving structures
//! ([`compile`]), and the [`store::ConfigStore`] that swaps a compiled
//! snapshot in atomically.
//!
//! Everything in `baton_config` is re-exported here. The modules this one
//! compiles snapshots into (`filters`, `routing`, `upstream`) import the
//! model from `baton_config` directly, never through this module, so the
//! dependencies run one way: model → filters, routing, upstream → compile
//! and store → protocol handlers (`scripts/module-cycles.sh` checks it).

pub mod compile;
pub mod store;

pub use baton_config::*;
pub use compile::{CompiledConfig, ConfigError, TlsRefusal, compile};
