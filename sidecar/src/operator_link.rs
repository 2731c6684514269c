//! The HTTP/2 connection to the operator that the config stream holds,
//! shared with the certificate client (decision 0056).
//!
//! Every injected sidecar keeps one long-lived HTTP/2 + TLS connection to an
//! operator replica for its config stream. A certificate request sent as
//! one more stream on that connection pays no TCP or TLS handshake, which
//! was two thirds of the CA's CPU per certificate on a new connection. The
//! config stream publishes its request sender here while its stream is
//! open and withdraws it when the stream ends; the certificate client tries
//! it first and falls back to a connection of its own when it is absent or
//! fails (an operator from before this endpoint answers 404 there).
//!
//! This module owns only the slot, so the config stream client and the TLS
//! layer share it without depending on each other.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::client::conn::http2::SendRequest;

/// The request body type on the operator connection: the config stream's
/// reply frames and a certificate request's JSON share it.
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// The slot for the operator connection's request sender (cheap to clone:
/// every clone is the same slot).
#[derive(Clone, Default)]
pub struct OperatorLink(Arc<Mutex<Option<Held>>>);

#[derive(Clone)]
struct Held {
    sender: SendRequest<Body>,
    /// `https://<server name>`: the authority requests on it carry.
    origin: String,
}

impl std::fmt::Debug for OperatorLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OperatorLink")
            .field("held", &self.lock().is_some())
            .finish()
    }
}

impl OperatorLink {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Held>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes the sender of a connection whose config stream is open;
    /// `server_name` is the operator's name it was verified against.
    /// Returns a guard that withdraws it when dropped (the stream ended).
    pub fn publish(&self, sender: SendRequest<Body>, server_name: &str) -> Published {
        *self.lock() = Some(Held {
            sender,
            origin: format!("https://{server_name}"),
        });
        Published(self.clone())
    }

    /// The held connection's sender and origin, if a config stream is open
    /// on a connection that can still take requests.
    pub fn sender(&self) -> Option<(SendRequest<Body>, String)> {
        let held = self.lock();
        let h = held.as_ref()?;
        (!h.sender.is_closed()).then(|| (h.sender.clone(), h.origin.clone()))
    }
}

/// Withdraws the published sender when dropped.
#[derive(Debug)]
pub struct Published(OperatorLink);

impl Drop for Published {
    fn drop(&mut self) {
        *self.0.lock() = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_link_has_no_sender() {
        let link = OperatorLink::default();
        assert!(link.sender().is_none());
        assert!(format!("{link:?}").contains("held: false"));
    }
}
