//! baton-sidecar (skeleton).
pub mod handoff;
