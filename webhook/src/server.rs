//! The HTTP plumbing: an HTTPS listener for admission and a plain listener
//! for the admin port, both hyper 1 (HTTP/1.1 and HTTP/2) with graceful
//! shutdown. Request handling lives in [`crate::handler`] and
//! [`crate::admin`]; this module only accepts, terminates TLS and frames.

use std::{convert::Infallible, future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

/// Largest body accepted. An AdmissionReview carries the object and, on
/// UPDATE, the old object; etcd caps objects at 1.5 MiB.
pub const MAX_BODY: usize = 8 * 1024 * 1024;
/// A client that has not finished its TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the handlers see: method, path and the whole body.
#[derive(Debug)]
pub struct SimpleRequest {
    pub method: http::Method,
    pub path: String,
    pub body: Bytes,
}

pub type SimpleResponse = Response<Full<Bytes>>;

pub fn response(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> SimpleResponse {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    r
}

async fn read<F, Fut>(req: Request<Incoming>, handler: Arc<F>) -> Result<SimpleResponse, Infallible>
where
    F: Fn(SimpleRequest) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = SimpleResponse> + Send,
{
    let (parts, body) = req.into_parts();
    let body = match Limited::new(body, MAX_BODY).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            let status = if e
                .downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                StatusCode::PAYLOAD_TOO_LARGE
            } else {
                StatusCode::BAD_REQUEST
            };
            return Ok(response(
                status,
                "text/plain",
                format!("cannot read body: {e}\n"),
            ));
        }
    };
    Ok(handler(SimpleRequest {
        method: parts.method,
        path: parts.uri.path().to_owned(),
        body,
    })
    .await)
}

/// Serves `handler` on `listener` until `stop`, over TLS if `tls` is set.
/// In-flight requests finish before this returns (bounded by the caller).
pub async fn serve<F, Fut>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    handler: F,
    stop: CancellationToken,
) where
    F: Fn(SimpleRequest) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = SimpleResponse> + Send + 'static,
{
    let handler = Arc::new(handler);
    let tracker = TaskTracker::new();
    loop {
        let (tcp, peer) = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(error) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let handler = handler.clone();
        let tls = tls.clone();
        let stop = stop.clone();
        tracker.spawn(async move {
            match tls {
                Some(acceptor) => {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => serve_io(stream, handler, stop).await,
                        Ok(Err(error)) => tracing::debug!(%peer, %error, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                }
                None => serve_io(tcp, handler, stop).await,
            }
        });
    }
    // Close the socket now: a connection the kernel would queue from here on
    // could never be served (and would be reset at exit); refused, the
    // client's next attempt goes to another replica.
    drop(listener);
    tracker.close();
    tracker.wait().await;
}

async fn serve_io<I, F, Fut>(io: I, handler: Arc<F>, stop: CancellationToken)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    F: Fn(SimpleRequest) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = SimpleResponse> + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| read(req, handler.clone()));
    let builder = auto::Builder::new(TokioExecutor::new());
    let mut conn = std::pin::pin!(builder.serve_connection(TokioIo::new(io), service));
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(error) = result {
                tracing::debug!(%error, "connection ended with an error");
            }
        }
        () = stop.cancelled() => {
            conn.as_mut().graceful_shutdown();
            if let Err(error) = conn.await {
                tracing::debug!(%error, "connection ended with an error during shutdown");
            }
        }
    }
}
