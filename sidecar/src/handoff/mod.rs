//! Lossless handoff between two `baton-sidecar` processes.
pub mod fd;
