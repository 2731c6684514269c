//! `baton-handoff`: the wire format of Baton's hot upgrade.
//!
//! Two `baton-sidecar` processes in one Pod hand listening sockets,
//! connections and state over a Unix socket (`docs/upgrade.md` states the
//! guarantees). This crate is what both ends must agree on, bottom up:
//! - [`fd`]: descriptors over a Unix socket (`SCM_RIGHTS`), the only unsafe
//!   code;
//! - [`protocol`]: framed, versioned messages on the handoff socket (a pure
//!   codec, [`protocol::encode`] and [`protocol::Decoder`]) and the thin
//!   [`protocol::Channel`] over [`fd::FdStream`].
//!
//! A TLS session crosses as record-layer state, [`TlsWireState`], from the
//! leaf crate `baton-tls-record`, which the sidecar's TLS layer also uses.
//!
//! Both sides of the protocol and their flow control drive the data plane
//! through the traits in the sidecar's `handoff::plane` and stay in the
//! sidecar for now (they park connections through its connection registry);
//! see `docs/decisions/0030-handoff-and-tls-record-crates.md`.

pub mod fd;
pub mod protocol;

pub use baton_tls_record::{DirectionSecrets, TlsWireState};
