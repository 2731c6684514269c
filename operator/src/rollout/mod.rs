//! Rolling a new sidecar version out to running pods: the pure planner
//! ([`plan`]), reading pods into its inputs ([`pods`]), what status says
//! about the rollout ([`status`]), and the controller that reads, plans,
//! acts and writes ([`controller`]). See `docs/upgrade.md`, "Rolling out a
//! version".

pub mod controller;
pub mod plan;
pub mod pods;
pub mod status;
