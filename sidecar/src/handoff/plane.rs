//! What the handoff needs from the data plane it moves, as two small traits
//! the data plane implements ([`crate::dataplane`] does, for
//! [`crate::server::Running`] and [`crate::http_proxy::Shared`]).
//!
//! The mechanism (wire format, both sides, flow control) lives in this
//! module; which sockets are listened on, how a connection is served and
//! how the process starts are the data plane's. With these traits between
//! them the handoff imports neither `server` nor `listener` nor
//! `http_proxy`, and a data plane shaped otherwise (a test double, another
//! server) could be handed off by the same code.
//!
//! | step | old process (serving) | new process (adopting) |
//! |---|---|---|
//! | list listening sockets | [`DataPlane::listening_sockets`], [`DataPlane::admin_socket`] | |
//! | start on them | | the `start` closure given to [`super::session::adopt`] gets [`Inherited`] |
//! | stop accepting | [`DataPlane::pause_accepting`] | |
//! | park at a safe point | [`Serving::registry`] (`ConnRegistry::park`) | |
//! | resume (kept here) or adopt (moved) | [`Serving::resume`] | [`Serving::resume`] |

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use super::protocol::ConnKind;
use crate::config::Snapshot;
use crate::conn::{ConnRegistry, ParkedIo};
use crate::filters::ConnMeta;
use crate::lifecycle::Phase;
use crate::metrics::Metrics;

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
    /// The process's metrics (counters carried to the next process).
    fn metrics(&self) -> &Metrics;
    /// The active config snapshot, for the next process.
    fn config(&self) -> serde_json::Value;
    /// Serve a connection that was parked: registered again (it can move
    /// at the next handoff) and counted like any other. Called with the
    /// serving runtime entered.
    fn resume(self: Arc<Self>, conn: Resumed);
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
    /// Plaintext read from upstream and not written downstream yet.
    pub to_downstream: Bytes,
}

/// What the new process takes over before it starts serving.
#[derive(Debug, Default)]
pub struct Inherited {
    /// The old process's listening sockets by listener name.
    pub listeners: HashMap<String, std::net::TcpListener>,
    /// The admin port's socket.
    pub admin: Option<std::net::TcpListener>,
    /// The config the old process served (`None`: unreadable, serve ours).
    pub config: Option<Snapshot>,
}
