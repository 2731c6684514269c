//! Lossless handoff between two `baton-sidecar` processes.
//!
//! See `docs/upgrade.md` for the guarantees. Layers, bottom up:
//! - [`fd`]: descriptors over a Unix socket (`SCM_RIGHTS`), the only unsafe code;
//! - [`protocol`]: framed, versioned messages on the handoff socket (pure codec);
//! - [`session`]: both sides of a handoff wired to the data plane, and the
//!   process main loop ([`run`]) that adopts or starts fresh;
//! - [`counters`]: metric counters carried across;
//! - [`tls_record`]: a userspace TLS record layer that continues a rustls
//!   connection in another process from its extracted secrets.
pub mod counters;
pub mod fd;
pub mod protocol;
pub mod session;
pub mod tls_record;

pub use session::{HandoffConfig, HandoffMetrics, IdentityCarrier, IdentityPem, RunError, run};
