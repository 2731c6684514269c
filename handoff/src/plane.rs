//! What the handoff needs from the data plane it moves, as small traits
//! the data plane implements (the sidecar's `dataplane` module does, for its
//! running server and the state its connection tasks share).
//!
//! The mechanism (wire format, both sides, flow control) lives in this
//! crate; which sockets are listened on, how a connection is served, how
//! the process starts, which lifecycle phases it reports and how its
//! metrics are exposed are the data plane's. With these traits between them
//! the handoff cannot reach into the proxy (the compiler refuses it), and a
//! data plane shaped otherwise (a test double, another server) could be
//! handed off by the same code.
//!
//! | step | old process (serving) | new process (adopting) |
//! |---|---|---|
//! | list listening sockets | [`DataPlane::listening_sockets`], [`DataPlane::admin_socket`] | |
//! | start on them | | the `start` closure given to [`crate::session::adopt`] gets [`Inherited`] |
//! | stop accepting | [`DataPlane::pause_accepting`] | |
//! | park at a safe point | [`Serving::registry`] ([`ConnRegistry::park`]) | |
//! | resume (kept here) or adopt (moved) | [`Serving::resume`] | [`Serving::resume`] |
//! | carry counters | [`Serving::counters`] ([`CarriedCounters::export`]) | [`CarriedCounters::import`] |
//!
//! Two more layers cross through traits of their own: the TLS layer takes
//! parked sessions apart ([`crate::conn::SessionDetach`]) and exports and
//! imports the mesh identity ([`IdentityCarrier`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::Bytes;

use crate::conn::{ConnMeta, ConnRegistry, ParkedIo};
use crate::protocol::ConnKind;

/// The lifecycle phases a handoff moves the data plane through (the data
/// plane maps them onto its own, wider set of phases).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Serving: the new process once it has adopted, the old one again
    /// after a failed handoff.
    Serving,
    /// The old process, from the peer's welcome to the end of the handoff.
    HandingOff,
}

/// The running data plane, as the old side of a handoff drives it.
pub trait DataPlane: Send + Sync + 'static {
    /// The listening sockets by listener name (duplicates: the data plane
    /// keeps its own).
    fn listening_sockets(&self) -> std::io::Result<HashMap<String, std::net::TcpListener>>;
    /// The admin port's listening socket (a duplicate).
    fn admin_socket(&self) -> std::io::Result<std::net::TcpListener>;
    /// Stop accepting on every listener (the sockets stay open).
    fn pause_accepting(&self);
    /// Accept again, after a failed handoff.
    fn resume_accepting(&self) -> std::io::Result<()>;
    /// The lifecycle phase the data plane reports.
    fn set_phase(&self, phase: Phase);
    /// What the admin port shows as the last handoff's status.
    fn record_status(&self, status: serde_json::Value);
    /// The per-connection side, shared with the tasks that outlive one
    /// handoff step (it must not keep the whole data plane alive).
    fn serving(&self) -> Arc<dyn Serving>;
}

/// The state every connection task shares: where connections live and run,
/// and how one resumed or adopted is served.
pub trait Serving: Send + Sync + 'static {
    /// The runtime that serves connections (the handoff runs on a thread of
    /// its own; sockets it hands over register here).
    fn runtime(&self) -> &tokio::runtime::Handle;
    /// The live connections, each of which can be asked to park.
    fn registry(&self) -> &ConnRegistry;
    /// The process's counters, carried to the next process.
    fn counters(&self) -> &dyn CarriedCounters;
    /// The active config snapshot, for the next process (opaque here: the
    /// next process's data plane reads it, [`Inherited::config`]).
    fn config(&self) -> serde_json::Value;
    /// Serve a connection that was parked: registered again (it can move
    /// at the next handoff) and counted like any other. Called with the
    /// serving runtime entered.
    fn resume(self: Arc<Self>, conn: Resumed);
}

/// Counter continuity across a handoff, by series name (e.g.
/// `baton_sidecar_requests_total{route="r",status_class="2xx"}` → 5): the
/// old process exports every counter series, the new one adds what it
/// imports to its own, so no counter goes backwards across an upgrade. How
/// the series are read and shown is the metrics layer's; the handoff only
/// moves the map.
pub trait CarriedCounters: Send + Sync {
    /// Every counter series and its value, carried values included (so a
    /// chain of handoffs keeps counting).
    fn export(&self) -> BTreeMap<String, u64>;
    /// Adds `counters` to this process's series.
    fn import(&self, counters: &BTreeMap<String, u64>);
}

/// A connection the handoff gives back to the data plane to serve.
pub struct Resumed {
    pub kind: ConnKind,
    /// Its id is this process's old one; the data plane assigns a new one.
    pub meta: ConnMeta,
    pub down: ParkedIo,
    /// The upstream end of a raw TCP connection (`None` for HTTP/1.1).
    pub up: Option<ParkedIo>,
    /// Plaintext read from downstream and not consumed yet (HTTP/1.1: the
    /// pipelined bytes hyper read ahead).
    pub to_upstream: Bytes,
    /// Plaintext read from upstream and not written downstream yet; for
    /// HTTP/2, the connection's carried state instead.
    pub to_downstream: Bytes,
}

/// What the new process takes over before it starts serving.
#[derive(Debug, Default)]
pub struct Inherited {
    /// The old process's listening sockets by listener name.
    pub listeners: HashMap<String, std::net::TcpListener>,
    /// The admin port's socket.
    pub admin: Option<std::net::TcpListener>,
    /// The config the old process served, as it sent it ([`Serving::config`]);
    /// the data plane serves exactly that until its next config push, or its
    /// own if it cannot read it.
    pub config: serde_json::Value,
}

/// The mesh identity as the handoff carries it (PEM text). The new process
/// can then serve new handshakes before its own certificate arrives (the
/// identity service may be slow or down during an upgrade).
#[derive(Clone, PartialEq, Eq)]
pub struct IdentityPem {
    pub cert_chain: String,
    pub key: String,
    pub trust_bundle: String,
}

impl std::fmt::Debug for IdentityPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdentityPem").finish_non_exhaustive()
    }
}

/// What owns the mesh identity (the TLS layer): exports it on the old side,
/// imports it on the new one.
pub trait IdentityCarrier: Send + Sync {
    fn export(&self) -> Option<IdentityPem>;
    /// Takes over the old process's TLS state before this one serves a
    /// single connection: first the TLS policy of `config` (the snapshot the
    /// old process served, which this one serves until the next config
    /// push), then the carried identity `pem`, if any, while this process
    /// waits for its own. Without the first step a new process would serve
    /// the inherited routes and clusters under the policy it started with
    /// (in a Pod: none, until the operator pushes), and mesh mTLS would fail
    /// in both directions until then.
    ///
    /// `Ok(true)` if the carried identity is now in use, `Ok(false)` if this
    /// process already has its own (it keeps that) or none was carried.
    /// [`IdentityImportError::Policy`] refuses the handoff: the old process
    /// keeps serving.
    fn import(
        &self,
        config: &serde_json::Value,
        pem: Option<&IdentityPem>,
    ) -> Result<bool, IdentityImportError>;
}

/// Why a carried identity was not taken into use (the new process then
/// waits for its own, as on a fresh start).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityImportError {
    /// The inherited config's TLS policy cannot be put in force here; the
    /// handoff is refused and the old process keeps serving.
    #[error("the inherited TLS policy cannot be applied: {0}")]
    Policy(String),
    /// The PEM text does not hold a certificate chain, key and bundle.
    #[error("the carried identity cannot be read: {0}")]
    Unreadable(String),
    #[error("the carried certificate has expired")]
    Expired,
    /// Read, but no TLS context could be built from it.
    #[error("cannot serve with the carried identity: {0}")]
    Unusable(String),
}
