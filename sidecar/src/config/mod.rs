//! The sidecar's configuration: the [`Snapshot`] model (from the kube-free
//! `baton-config` crate, shared with the operator that compiles Routes into
//! it), its validation and compilation into serving structures
//! ([`compile`]), and the [`store::ConfigStore`] that swaps a compiled
//! snapshot in atomically.
//!
//! Everything in `baton_config` is re-exported here so the rest of the
//! sidecar names config types as `crate::config::X` whatever crate holds them.

pub mod compile;
pub mod store;

pub use baton_config::*;
pub use compile::{CompiledConfig, ConfigError, compile};
