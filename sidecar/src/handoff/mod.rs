//! Lossless handoff between two `baton-sidecar` processes.
//!
//! See `docs/upgrade.md` for the guarantees. Layers, bottom up:
//! - [`fd`]: descriptors over a Unix socket (`SCM_RIGHTS`), the only unsafe code;
//! - [`protocol`]: framed, versioned messages on the handoff socket (pure codec);
//! - [`session`]: both sides of a handoff wired to the data plane (the
//!   process main loop that adopts or starts fresh is
//!   [`crate::process::run`]);
//! - metric counters are carried by [`crate::metrics::carried`].
//!
//! The userspace TLS record layer that continues a rustls connection in
//! another process from its extracted secrets is a leaf of its own,
//! [`crate::tls_record`], which both this module and [`crate::tls`] use; the
//! mesh identity crosses as [`crate::tls::material::IdentityPem`] through the
//! [`crate::tls::material::IdentityCarrier`] the TLS layer implements, so the
//! TLS layer never imports the handoff.
pub mod fd;
pub mod protocol;
pub mod session;

pub use session::{HandoffConfig, HandoffMetrics, IdentityCarrier, IdentityPem};
