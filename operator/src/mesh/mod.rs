//! The control plane's config model: what the operator knows of the
//! cluster, and how it becomes each sidecar's snapshot.
//!
//! ```text
//!  watchers ──► index (pure in-memory records of Services, endpoints,
//!                      injected Pods, Routes, TlsPolicies,
//!                      AuthorizationPolicies, namespace defaults)
//!                 │
//!                 ├─► attach_routes(index)            cluster-wide: which Route
//!                 │                                   steers which Service port
//!                 └─► compile(index, attachments, pod) → that Pod's Snapshot
//!                       └─ authz::compile              its inbound RbacPolicy
//! ```
//!
//! [`index`] and [`compile`] are pure (tested with objects fed straight
//! in); [`watch`] fills the index, [`hub`] turns index changes into pushes,
//! [`server`] serves the sidecars' streams, [`tally`] counts them across
//! replicas for [`status`].

pub mod authz;
pub mod compile;
pub mod hub;
pub mod index;
pub mod metrics;
pub mod server;
pub mod status;
pub mod tally;
pub mod watch;

#[cfg(test)]
mod tests;
