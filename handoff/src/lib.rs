//! `baton-handoff`: the mechanism of Baton's hot upgrade.
//!
//! Two `baton-sidecar` processes in one Pod hand listening sockets,
//! connections and state over a Unix socket (`docs/upgrade.md` states the
//! guarantees). This crate is what both ends must agree on, bottom up:
//! - [`fd`]: descriptors over a Unix socket (`SCM_RIGHTS`), the only unsafe
//!   code besides the thread priority in [`sched`];
//! - [`protocol`]: framed, versioned messages on the handoff socket (a pure
//!   codec, [`protocol::encode`] and [`protocol::Decoder`]) and the thin
//!   [`protocol::Channel`] over [`fd::FdStream`];
//! - [`conn`]: the registry of live connections and the parked-connection
//!   types (how a connection is asked to stop at a safe point, and what it
//!   hands back);
//! - [`plane`]: what the handoff needs from the data plane it moves, as
//!   traits the data plane implements;
//! - [`session`]: both sides of the protocol ([`session::adopt`] in the new
//!   process, [`session::hand_off`] in the old) and their flow control,
//!   moving each connection as a [`transit`] value; configured by
//!   [`config`], observed through [`metrics`]; each side runs on a thread of
//!   its own at a lower priority ([`sched`]).
//!
//! The data plane (the sidecar) implements the traits of [`plane`] and
//! answers park requests at its own safe points; it owns the process main
//! loop that chooses a side to play. This crate does not depend on it, so
//! the mechanism cannot reach into the proxy.
//!
//! A TLS session crosses as record-layer state, [`TlsWireState`], from the
//! leaf crate `baton-tls-record`, which the sidecar's TLS layer also uses.

pub mod config;
pub mod conn;
pub mod fd;
pub mod metrics;
pub mod plane;
pub mod protocol;
pub mod sched;
pub mod session;
mod transit;

pub use baton_tls_record::{DirectionSecrets, TlsWireState};
pub use config::HandoffConfig;
pub use metrics::HandoffMetrics;
pub use plane::{DataPlane, IdentityCarrier, IdentityPem, Inherited, Resumed, Serving};
pub use session::{HandoffError, HandoffStatus};
