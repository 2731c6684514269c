//! Lossless handoff between two `baton-sidecar` processes.
//!
//! See `docs/upgrade.md` for the guarantees. Layers, bottom up:
//! - [`fd`], [`protocol`]: the wire format (descriptors over a Unix socket,
//!   framed versioned messages), in the `baton-handoff` crate;
//! - [`plane`]: what the handoff needs from the data plane (list listening
//!   sockets, park a connection at a safe point, resume, adopt, carry
//!   counters), as traits the data plane implements ([`crate::dataplane`]),
//!   also in `baton-handoff`, with the connection registry they park
//!   through (`baton_handoff::conn`, re-exported as [`crate::conn`]);
//! - [`session`]: both sides of a handoff and their flow control, driving a
//!   [`plane::DataPlane`] (the process main loop that adopts or starts
//!   fresh is [`crate::process::run`]);
//! - metric counters are carried by [`crate::metrics::carried`].
pub mod session;

/// The wire format and the traits live in the `baton-handoff` crate; these
/// paths keep the names the rest of the sidecar (and its tests) use.
pub use baton_handoff::{fd, plane, protocol};

pub use plane::{DataPlane, Inherited, Resumed, Serving};
pub use session::{HandoffConfig, HandoffMetrics, IdentityCarrier, IdentityPem};
