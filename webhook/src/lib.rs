//! `baton-webhook`: how pods join the Baton mesh.
//!
//! A Kubernetes admission webhook with two endpoints:
//!
//! * `/mutate-pods` injects the two sidecar slots, the capture init
//!   container, the identity token and the QAT grant into opted-in pods. The
//!   whole decision and patch is the pure function [`inject::mutate`].
//! * `/validate` refuses invalid Baton objects (per-object rules from the
//!   `baton-crds` validators plus cross-object rules), so clusters without CEL
//!   (such as 1.20) still reject them at `kubectl apply`.
//!
//! ```text
//!            API server ──HTTPS──► server (hyper + rustls, CertStore ◄── ca / files)
//!                                     │
//!                                     ▼
//!                       handler ── decode (review) ── inject::mutate / validate
//!                                     ▲
//!            reflectors ──► cache (SidecarRelease, TlsPolicy, AcceleratorPool,
//!                                  Namespace, Node, server version)
//!            admin port: /ready (cert loaded + caches synced), /live, /metrics
//! ```
//!
//! I/O is kept thin around pure cores: the review decoder, `mutate` and the
//! validators are plain functions tested without a network; the server is
//! tested in-process on port 0 with real TLS.

pub mod admin;
pub mod ca;
pub mod cache;
pub mod error;
pub mod handler;
pub mod inject;
pub mod metrics;
pub mod review;
pub mod run;
pub mod server;
pub mod tls;
pub mod validate;

pub use error::{Error, Result};
pub use run::{Args, init_tracing, run, run_blocking, spawn_servers};
