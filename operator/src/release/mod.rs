//! SidecarRelease: status from the pods a release injected.

pub mod controller;
pub mod status;
