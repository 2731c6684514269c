//! `baton-serving`: how every Baton process serves a socket, in one place.
//!
//! The sidecar's, the webhook's and the operator's admin ports, the
//! webhook's admission endpoint and the operator's identity and config-push
//! endpoints all accept, (optionally) complete a TLS handshake and serve
//! HTTP the same way; each keeps only its own routes.
//!
//! ```text
//! accept   one accept loop: back off on a failed accept, who owns the
//!          connections (Owned / Detached / Drained), the TLS handshake
//!          with its timeout
//! http     one connection served by hyper (HTTP/1.1 and h2), graceful on
//!          stop; plain-text and OpenMetrics responses
//! admin    accept + http for a plain admin port: the handler gets the
//!          request and the caller's address
//! tls      the rustls provider (and its SHA-256-first variant), the
//!          swappable serving certificate, the server configuration
//! ```
//!
//! Kube-free on purpose: the sidecar depends on it and must never link kube
//! (CI checks with `cargo tree`).

pub mod accept;
pub mod admin;
pub mod http;
pub mod tls;
