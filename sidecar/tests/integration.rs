//! The sidecar's in-process integration tests (real sockets, real TLS, the
//! real `baton-sidecar` binary in child processes), as one test binary:
//! each file below is a module, named after what it covers
//! (`cargo test -p baton-sidecar --test integration handoff::`).
//!
//! One binary instead of one per file: each separate binary compiled and
//! linked the same dependencies' generic code again, which was a third of
//! CI's test build (decision 0061). Tests still run two at a time by
//! default, as before, because the files used to run one binary after
//! another with two test threads each.

mod handoff_support;
mod log_sink;
mod tls_support;

mod admin_access;
mod app_tls;
mod authz;
mod h1_validation;
mod h2_hpack_reset;
mod handoff;
mod handoff_authz;
mod handoff_bench;
mod handoff_h2;
mod handoff_mesh;
mod observe;
mod opaque_tls;
mod proxy;
mod retire;
mod tcp_route;
mod tls_dataplane;
mod tls_identity;
mod tls_mtls;
mod tls_offload;
mod tls_rotation;
mod transparent;
