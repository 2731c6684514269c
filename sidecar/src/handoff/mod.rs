//! Lossless handoff between two `baton-sidecar` processes.
//!
//! See `docs/upgrade.md` for the guarantees. Layers, bottom up:
//! - [`fd`], [`protocol`]: the wire format (descriptors over a Unix socket,
//!   framed versioned messages), in the `baton-handoff` crate;
//! - [`plane`]: what the handoff needs from the data plane (list listening
//!   sockets, park a connection at a safe point, resume, adopt), as traits
//!   the data plane implements ([`crate::dataplane`]);
//! - [`session`]: both sides of a handoff and their flow control, driving a
//!   [`plane::DataPlane`] (the process main loop that adopts or starts
//!   fresh is [`crate::process::run`]);
//! - metric counters are carried by [`crate::metrics::carried`].
//!
//! The userspace TLS record layer that continues a rustls connection in
//! another process from its extracted secrets is a leaf of its own,
//! [`crate::tls_record`], which both this module and [`crate::tls`] use; the
//! mesh identity crosses as [`crate::conn::IdentityPem`] through the
//! [`crate::conn::IdentityCarrier`] the TLS layer implements, so neither
//! imports the other.
pub mod plane;
pub mod session;

/// The wire format lives in the `baton-handoff` crate; these paths keep the
/// names the rest of the sidecar (and its tests) use.
pub use baton_handoff::{fd, protocol};

pub use plane::{DataPlane, Inherited, Resumed, Serving};
pub use session::{HandoffConfig, HandoffMetrics, IdentityCarrier, IdentityPem};
