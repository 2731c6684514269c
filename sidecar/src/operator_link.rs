//! The connection to the operator that the config stream holds, shared
//! with the certificate client (decisions 0056 and 0066).
//!
//! Every injected sidecar keeps one long-lived TLS connection to an
//! operator replica for its config stream. A certificate request sent on
//! that connection pays no TCP or TLS handshake, which was two thirds of
//! the CA's CPU per certificate on a new connection. The config stream
//! publishes a handle here while its stream is open and withdraws it when
//! the stream ends; the certificate client tries it first and falls back to
//! a connection of its own when it is absent or fails (an operator from
//! before this endpoint answers 404 there).
//!
//! The handle depends on what the operator selected by ALPN:
//! * HTTP/2 (`h2`): the connection's request sender; a certificate request
//!   is one more HTTP/2 stream on it ([`Held::Http2`]);
//! * the framed transport ([`baton_config::framed`]): a queue into the
//!   config stream's task, which writes each request as a SIGN frame and
//!   answers it when the SIGNED frame with its id arrives ([`Held::Framed`],
//!   [`SignJob`]). When the stream ends its unanswered jobs are dropped, so
//!   the requester sees the answer channel closed and falls back.
//!
//! This module owns only the slot, so the config stream client and the TLS
//! layer share it without depending on each other.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::client::conn::http2::SendRequest;
use tokio::sync::{mpsc, oneshot};

/// The request body type on an HTTP/2 operator connection: the config
/// stream's reply frames and a certificate request's JSON share it.
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// What a certificate request on the held connection is answered with: the
/// HTTP status and body the identity endpoint would have answered, or why
/// the stream could not send it.
pub type SignAnswer = Result<(u16, Bytes), String>;

/// One certificate request for the framed stream's task to send.
#[derive(Debug)]
pub struct SignJob {
    /// The token the identity service reviews.
    pub token: String,
    /// The identity service's request body (JSON).
    pub request: Bytes,
    /// Answered when the SIGNED frame arrives; dropped unanswered when the
    /// stream ends first.
    pub answer: oneshot::Sender<SignAnswer>,
}

impl SignJob {
    /// A job and the receiver of its answer.
    pub fn new(token: &str, request: Bytes) -> (SignJob, oneshot::Receiver<SignAnswer>) {
        let (answer, rx) = oneshot::channel();
        let job = SignJob {
            token: token.to_owned(),
            request,
            answer,
        };
        (job, rx)
    }
}

/// The slot for the operator connection's handle (cheap to clone: every
/// clone is the same slot).
#[derive(Clone, Default)]
pub struct OperatorLink(Arc<Mutex<Option<Held>>>);

/// The handle of the connection an open config stream holds.
#[derive(Clone)]
pub enum Held {
    /// An HTTP/2 connection: send a request on `sender`.
    Http2 {
        sender: SendRequest<Body>,
        /// `https://<server name>`: the authority requests on it carry.
        origin: String,
    },
    /// A framed stream: queue a [`SignJob`] for its task.
    Framed(mpsc::Sender<SignJob>),
}

impl Held {
    /// Whether the connection behind it is gone (a stream that ended has
    /// withdrawn its handle already; this covers the moment in between).
    fn is_closed(&self) -> bool {
        match self {
            Held::Http2 { sender, .. } => sender.is_closed(),
            Held::Framed(jobs) => jobs.is_closed(),
        }
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Held::Http2 { origin, .. } => f.debug_struct("Http2").field("origin", origin).finish(),
            Held::Framed(_) => f.write_str("Framed"),
        }
    }
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

    fn put(&self, held: Held) -> Published {
        *self.lock() = Some(held);
        Published(self.clone())
    }

    /// Publishes the sender of an HTTP/2 connection whose config stream is
    /// open; `server_name` is the operator's name it was verified against.
    /// Returns a guard that withdraws it when dropped (the stream ended).
    pub fn publish(&self, sender: SendRequest<Body>, server_name: &str) -> Published {
        self.put(Held::Http2 {
            sender,
            origin: format!("https://{server_name}"),
        })
    }

    /// Publishes the job queue of a framed config stream that is open.
    /// Returns a guard that withdraws it when dropped (the stream ended).
    pub fn publish_framed(&self, jobs: mpsc::Sender<SignJob>) -> Published {
        self.put(Held::Framed(jobs))
    }

    /// The held connection's handle, if a config stream is open on a
    /// connection that can still take requests.
    pub fn held(&self) -> Option<Held> {
        let held = self.lock();
        held.as_ref().filter(|h| !h.is_closed()).cloned()
    }
}

/// Withdraws the published handle when dropped.
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
        assert!(link.held().is_none());
        assert!(format!("{link:?}").contains("held: false"));
    }

    #[test]
    fn a_framed_handle_is_held_while_published_and_its_stream_lives() {
        let link = OperatorLink::default();
        let (jobs, rx) = mpsc::channel(1);
        let published = link.publish_framed(jobs);
        assert!(matches!(link.held(), Some(Held::Framed(_))));
        drop(published);
        assert!(link.held().is_none(), "withdrawn when the stream ends");

        let (jobs, rx2) = mpsc::channel(1);
        let _published = link.publish_framed(jobs);
        drop(rx2);
        assert!(
            link.held().is_none(),
            "a stream task that is gone takes no requests"
        );
        drop(rx);
    }
}
