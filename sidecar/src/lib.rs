//! `baton-sidecar`: Baton's per-pod data plane.
//!
//! A small, fast L4/L7 proxy: per-connection protocol detection (HTTP/1.1,
//! HTTP/2, TLS, raw TCP), precompiled routing with retries, timeouts,
//! faults, mirroring and header rewrites, pooled upstreams with outlier
//! ejection, ordered filter chains, an admin port, and a config snapshot
//! that is validated and swapped atomically. It never depends on kube: only
//! on the kube-free `baton_contract` names.
//!
//! Layout (each module's docs say why it is shaped that way; a module is
//! public only where another crate uses it: the binaries, the operator's
//! tests, the fuzz targets, the integration tests):
//! * [`config`] — the snapshot type, YAML, validation/compilation, the store;
//! * [`routing`] — compiled route tables and the pure matcher;
//! * [`filters`] — network and stream filter chains, RBAC, faults;
//!   [`path_norm`] — the path policies match and the upstream gets;
//! * [`detect`], [`client_hello`], [`listener`], [`conn`] — accepting and
//!   classifying connections (mesh TLS vs the application's own TLS by the
//!   ClientHello), the live-connection registry used by the handoff;
//! * [`http_proxy`], [`h1fast`], [`http_conn`], [`tcp_proxy`], [`upstream`], [`body`] — proxying;
//! * [`h1valid`] — the HTTP/1.1 request-head validation both HTTP/1 paths
//!   run; it, [`detect`], the HTTP/1 framing shadow and [`h2_state`] are
//!   the leaf crate `baton-wire` (pure parsers, small so they fuzz fast);
//! * [`admin`], [`metrics`], [`loop_lag`], [`lifecycle`] — operating it;
//!   [`access_log`], [`trace`], [`route_metrics`] — what happened to each
//!   request: JSON access-log lines, W3C trace context, golden metrics per
//!   route and peer identity;
//! * [`init`], [`orig_dst`] — transparent capture;
//! * [`handoff`] — the hot upgrade's mechanism (the `baton-handoff` crate:
//!   wire format, both sides, flow control, the connection registry),
//!   driving the data plane through the traits [`dataplane`] implements;
//!   [`tls_record`] — the userspace TLS record layer it and [`tls`] share
//!   (the leaf crate `baton-tls-record`);
//! * [`server`], [`process`], [`cli`] — assembling a process: the data
//!   plane, the main loop with the handoff, the command line.

mod access_log;
pub mod admin;
mod body;
pub mod cli;
pub mod client_hello;
mod coarse_timer;
pub mod config;
pub mod conn;
pub mod control;
mod dataplane;
mod filters;
mod h1fast;
mod h2_shim;
mod http_conn;
mod http_proxy;
mod init;
pub mod lifecycle;
mod linger;
mod listener;
mod loop_lag;
pub mod metrics;
pub mod operator_link;
mod orig_dst;
mod path_norm;
mod process;
mod route_metrics;
mod routing;
mod sched;
pub mod server;
mod tcp_proxy;
pub mod tls;
mod tls_settings;
mod trace;
mod upstream;

/// The handoff mechanism, under the name the sidecar has always used.
pub use baton_handoff as handoff;
/// The userspace TLS record layer, a leaf crate the TLS layer and the
/// handoff both use (named here as the module it was).
pub use baton_tls_record as tls_record;
/// The pure wire-format parsers (the leaf crate `baton-wire`), under the
/// module names they had in this crate.
pub use baton_wire::{detect, h1valid, h2_state};
