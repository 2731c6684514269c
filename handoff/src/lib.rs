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
//!   traits the data plane implements.
//!
//! A TLS session crosses as record-layer state, [`TlsWireState`], from the
//! leaf crate `baton-tls-record`, which the sidecar's TLS layer also uses.

pub mod conn;
pub mod fd;
pub mod plane;
pub mod protocol;
pub mod sched;

pub use baton_tls_record::{DirectionSecrets, TlsWireState};
