//! Sidecar injection: the opt-in decision, the objects added to a pod, the
//! offload grant, and [`mutate`], which turns all of it into a JSON patch.

pub mod config;
pub mod decision;
pub mod mutate;
pub mod offload;
pub mod spec;
pub mod version;

#[cfg(test)]
mod tests;

pub use config::{CaptureMode, InjectConfig, NativeSidecars, default_control_plane_address};
pub use decision::Skip;
pub use mutate::{ClusterView, Denial, DenialReason, Injection, Outcome, mutate};
pub use offload::{GRANT_SETTLE, Offload, RecentGrant};
pub use version::ServerVersion;
