//! The one body type the proxy sends and receives: a streamed hyper body, a
//! buffered one (retries, mirrors, local responses) or nothing. An enum
//! rather than a boxed trait object, so the hot path does not allocate.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::sync::Notify;

use crate::access_log::Pending;

/// Requests in flight on one downstream connection. The HTTP/1 park path
/// waits for zero (a safe point between requests).
#[derive(Debug, Default)]
pub struct InFlight {
    count: AtomicUsize,
    idle: Notify,
}

impl InFlight {
    pub fn enter(self: &Arc<Self>) -> InFlightGuard {
        self.count.fetch_add(1, Ordering::AcqRel);
        InFlightGuard(self.clone())
    }

    pub fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Resolves when no request is in flight.
    pub async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.count() == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// One request in flight; released when the response body ends or drops.
#[derive(Debug)]
pub struct InFlightGuard(Arc<InFlight>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

#[derive(Debug, Default)]
pub enum ProxyBody {
    #[default]
    Empty,
    Full(Option<Bytes>),
    Streamed {
        body: Incoming,
        done: Option<InFlightGuard>,
        /// Counts the body's bytes into an access-log line, released at
        /// the end like `done`.
        tap: Option<Tap>,
        /// Runs once, when the body has ended (not when it is dropped
        /// before its end): gives the upstream connection back.
        at_end: Option<EndHook>,
    },
}

/// What a streamed body does when it has ended.
pub struct EndHook(Box<dyn FnOnce() + Send + Sync>);

impl EndHook {
    pub fn new(f: impl FnOnce() + Send + Sync + 'static) -> Self {
        Self(Box::new(f))
    }
}

impl std::fmt::Debug for EndHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EndHook")
    }
}

/// Which byte count of an access-log line a body feeds.
#[derive(Debug)]
pub enum Tap {
    /// A request body (client → upstream).
    In(Arc<Pending>),
    /// A response body (upstream → client).
    Out(Arc<Pending>),
}

impl Tap {
    fn count(&self, n: usize) {
        match self {
            Tap::In(p) => p.add_in(n as u64),
            Tap::Out(p) => p.add_out(n as u64),
        }
    }
}

impl ProxyBody {
    pub fn full(b: impl Into<Bytes>) -> Self {
        ProxyBody::Full(Some(b.into()))
    }

    pub fn streamed(body: Incoming) -> Self {
        ProxyBody::Streamed {
            body,
            done: None,
            tap: None,
            at_end: None,
        }
    }

    /// Run `hook` when the body has ended; a buffered or empty body has
    /// ended already, so it runs now.
    pub fn with_end_hook(mut self, hook: Option<EndHook>) -> Self {
        let Some(hook) = hook else { return self };
        match &mut self {
            // An empty body is never read: it has ended already.
            ProxyBody::Streamed { body, at_end, .. } if !body.is_end_stream() => {
                *at_end = Some(hook)
            }
            _ => (hook.0)(),
        }
        self
    }

    /// Attach a completion callback (kept until end-of-stream or drop).
    pub fn with_done(self, done: Option<InFlightGuard>) -> Self {
        match (self, done) {
            (
                ProxyBody::Streamed {
                    body, tap, at_end, ..
                },
                Some(d),
            ) => ProxyBody::Streamed {
                body,
                done: Some(d),
                tap,
                at_end,
            },
            (other, _) => other, // buffered bodies finish immediately; the guard drops here
        }
    }

    /// Count this body into an access-log line. A buffered body is
    /// counted whole, now; a streamed one as its frames pass.
    pub fn with_tap(mut self, new: Option<Tap>) -> Self {
        let Some(new) = new else { return self };
        match &mut self {
            ProxyBody::Streamed { tap, .. } => *tap = Some(new),
            ProxyBody::Full(Some(b)) => new.count(b.len()),
            ProxyBody::Full(None) | ProxyBody::Empty => {}
        }
        self
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            ProxyBody::Empty => Poll::Ready(None),
            ProxyBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            ProxyBody::Streamed {
                body,
                done,
                tap,
                at_end,
            } => {
                let r = Pin::new(&mut *body).poll_frame(cx);
                match &r {
                    Poll::Ready(Some(Ok(f))) => {
                        if let (Some(t), Some(d)) = (tap.as_ref(), f.data_ref()) {
                            t.count(d.len());
                        }
                        // A reader that knows the length stops here,
                        // without asking for the end (hyper's HTTP/2 does).
                        if body.is_end_stream()
                            && let Some(hook) = at_end.take()
                        {
                            (hook.0)();
                        }
                    }
                    Poll::Ready(None) => {
                        done.take();
                        tap.take();
                        if let Some(hook) = at_end.take() {
                            (hook.0)();
                        }
                    }
                    Poll::Ready(Some(Err(_))) => {
                        done.take();
                        tap.take();
                        at_end.take();
                    }
                    Poll::Pending => {}
                }
                r
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Empty => true,
            ProxyBody::Full(b) => b.is_none(),
            ProxyBody::Streamed { body, .. } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Empty => SizeHint::with_exact(0),
            ProxyBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            ProxyBody::Streamed { body, .. } => body.size_hint(),
        }
    }
}
