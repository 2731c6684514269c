//! Lossless handoff between two `baton-sidecar` processes.
//!
//! See `docs/upgrade.md` for the guarantees. Layers, bottom up:
//! - [`fd`]: descriptors over a Unix socket (`SCM_RIGHTS`), the only unsafe code;
//! - [`protocol`]: framed, versioned messages on the handoff socket (pure codec);
//! - [`tls_record`]: a userspace TLS record layer that continues a rustls
//!   connection in another process from its extracted secrets.
pub mod fd;
pub mod protocol;
pub mod tls_record;
