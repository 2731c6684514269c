//! The HTTP plumbing of admission: what the handlers see (method, path and
//! the whole body, read with a limit) and the listener that feeds them.
//! Accepting, the TLS handshake and the connection itself are
//! [`baton_serving`]'s, shared with the operator and the sidecar; request
//! handling lives in [`crate::handler`] and [`crate::admin`].

use std::{future::Future, net::SocketAddr, sync::Arc};

use baton_serving::accept::{self, Connections};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpListener,
};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

pub use baton_serving::http::response;

/// Largest body accepted. An AdmissionReview carries the object and, on
/// UPDATE, the old object; etcd caps objects at 1.5 MiB.
pub const MAX_BODY: usize = 8 * 1024 * 1024;

/// What the handlers see: method, path and the whole body.
#[derive(Debug)]
pub struct SimpleRequest {
    pub method: http::Method,
    pub path: String,
    pub body: Bytes,
}

pub type SimpleResponse = Response<Full<Bytes>>;

/// Reads `req`'s body (at most [`MAX_BODY`]: 413 beyond, 400 when it
/// cannot be read) and hands the whole request to `handler`.
pub async fn read<F, Fut>(req: Request<Incoming>, handler: Arc<F>) -> SimpleResponse
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
            return response(status, "text/plain", format!("cannot read body: {e}\n"));
        }
    };
    handler(SimpleRequest {
        method: parts.method,
        path: parts.uri.path().to_owned(),
        body,
    })
    .await
}

/// Serves `handler` on `listener` until `stop`, over TLS if `tls` is set.
/// In-flight requests finish before this returns (bounded by the caller);
/// the listening socket closes at `stop`, so new connections are refused.
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
    let conn_stop = stop.clone();
    match tls {
        Some(acceptor) => {
            let serve_conn =
                move |io, peer| connection(io, handler.clone(), conn_stop.clone(), peer);
            accept::serve_tls(
                listener,
                acceptor,
                "admission",
                stop,
                Connections::Drained,
                serve_conn,
            )
            .await;
        }
        None => {
            let serve_conn =
                move |io, peer| connection(io, handler.clone(), conn_stop.clone(), peer);
            accept::serve_plain(
                listener,
                "admission",
                stop,
                Connections::Drained,
                serve_conn,
            )
            .await;
        }
    }
}

fn connection<I, F, Fut>(
    io: I,
    handler: Arc<F>,
    stop: CancellationToken,
    peer: SocketAddr,
) -> impl Future<Output = ()> + Send + 'static
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn(SimpleRequest) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = SimpleResponse> + Send + 'static,
{
    let handle = move |req| read(req, handler.clone());
    baton_serving::http::serve_connection(io, handle, stop, "admission", peer)
}
