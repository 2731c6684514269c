//! `baton-wire`: the sidecar's pure wire-format parsers, bytes in and
//! verdicts out, no I/O.
//!
//! * [`detect`] — which protocol a connection speaks, from its first bytes;
//! * [`h1valid`] — HTTP/1.1 request-head validation, run by both HTTP/1
//!   paths;
//! * [`h1framing`] — the HTTP/1 framing shadow the general path reads
//!   through, and where a chunked body ends (the fast path);
//! * [`h2_state`] — an HTTP/2 connection's state followed from its frames,
//!   and its carried form at a handoff.
//!
//! Why a crate of its own: these are what the fuzz targets
//! (`sidecar/fuzz`) exercise, and an instrumented build of the whole sidecar
//! (hyper, rustls, the data plane) cost CI about 90 s of a core on every
//! run; this crate builds in seconds. The sidecar re-exports the modules
//! under their old names (`baton_sidecar::h1valid`, …). With thin LTO in
//! the sidecar's release profile, the crate boundary does not stop
//! inlining on the request path.

pub mod detect;
pub mod h1framing;
pub mod h1valid;
pub mod h2_state;
