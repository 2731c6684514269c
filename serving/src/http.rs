//! One HTTP connection served by hyper (HTTP/1.1, or h2 by its preface),
//! and the small responses every admin port answers with.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;

/// The content type of the Prometheus text exposition every `/metrics`
/// answers with.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A response with `body` and, when it parses as a header value,
/// `content_type`.
pub fn response(
    status: StatusCode,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = header::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    r
}

/// Serves one connection with `handler` until the client is done, or
/// until `stop`: then the request in flight finishes and the connection
/// closes (HTTP/1.1 `Connection: close`, h2 GOAWAY). Errors end only this
/// connection and are logged at debug level (clients cause them).
pub async fn serve_connection<I, H, Fut>(
    io: I,
    handler: H,
    stop: CancellationToken,
    what: &'static str,
    peer: SocketAddr,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let response = handler(req);
        async move { Ok::<_, Infallible>(response.await) }
    });
    let builder = auto::Builder::new(TokioExecutor::new());
    let mut conn = std::pin::pin!(builder.serve_connection(TokioIo::new(io), service));
    let ended = tokio::select! {
        ended = conn.as_mut() => ended,
        () = stop.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(error) = ended {
        tracing::debug!(%peer, %error, endpoint = what, "connection ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_carries_its_status_body_and_content_type() {
        let r = response(StatusCode::NOT_FOUND, "text/plain", "nope\n");
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "text/plain");
        let r = response(StatusCode::OK, "bad\nvalue", "x");
        assert!(r.headers().get(header::CONTENT_TYPE).is_none());
    }
}
