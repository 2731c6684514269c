//! SidecarRelease: status from the pods a release injected (pure; written
//! by the rollout controller, `crate::rollout::controller`).

pub mod status;
