//! The HTTPS endpoint: rustls + hyper on its own port, one route
//! (`POST /v1/sign`), answering with the wire format of the sidecar's
//! `identity_client`. Every replica serves; no leader is involved.
//!
//! The serving certificate is issued by the mesh CA itself (so sidecars
//! verify the endpoint with the trust bundle they already hold) and lives in
//! a swappable resolver: a CA change or renewal applies to the next
//! handshake.

use std::sync::Arc;

use baton_serving::accept::{self, Connections};
use baton_serving::http::serve_connection;
use baton_serving::tls;
use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use super::cluster::Cluster;
use super::issue::Refusal;
use super::service::{IdentityService, RefusalBody, SignResponse};

/// Largest request body accepted.
const MAX_BODY: usize = 64 * 1024;

/// The serving certificate, swapped in place (the identity endpoint's and
/// the config push's: both present the same one).
pub use baton_serving::tls::CertStore as ServingCert;

/// A TLS acceptor serving whatever `cert` holds (HTTP/1.1 and h2 by ALPN).
///
/// Tuned for many short-lived clients (decision 0019): the server's suite
/// order wins (SHA-256 first), and no TLS 1.3 session tickets are sent — a
/// sidecar asks again only after hours, when any ticket would be useless,
/// and each ticket costs key-schedule work on every handshake.
pub fn acceptor(cert: Arc<ServingCert>) -> TlsAcceptor {
    let mut config = tls::server_config(cert, tls::provider_sha256_first())
        .expect("ring supports the default protocol versions");
    config.ignore_client_order = true;
    config.send_tls13_tickets = 0;
    TlsAcceptor::from(Arc::new(config))
}

/// One certificate request, whichever transport carried it: the
/// `Authorization` header's value and the body.
#[derive(Debug, Clone)]
pub struct SignRequest {
    pub authorization: Option<String>,
    pub body: Bytes,
}

/// Largest certificate request body accepted (a CSR and a few fields).
pub const MAX_SIGN_BODY: usize = MAX_BODY;

/// Routes and answers one HTTP request.
pub async fn respond<C: Cluster>(
    service: &IdentityService<C>,
    path: &str,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    match read_request(path, req).await {
        Ok(req) => sign(service, &req).await,
        Err(refused) => refused,
    }
}

/// The certificate request an HTTP request carries, or the answer that
/// refuses it (wrong path or method, a body too large).
pub async fn read_request(
    path: &str,
    req: Request<Incoming>,
) -> Result<SignRequest, Response<Full<Bytes>>> {
    if req.uri().path() != path {
        return Err(json(
            StatusCode::NOT_FOUND,
            &RefusalBody {
                reason: "not_found".into(),
                message: format!("the identity service answers POST {path}"),
            },
        ));
    }
    if req.method() != http::Method::POST {
        return Err(json(
            StatusCode::METHOD_NOT_ALLOWED,
            &RefusalBody {
                reason: "method_not_allowed".into(),
                message: format!("use POST {path}"),
            },
        ));
    }
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => Ok(SignRequest {
            authorization,
            body: b.to_bytes(),
        }),
        Err(e) => Err(refusal(&Refusal::BadRequest(format!(
            "body unreadable or over {MAX_BODY} bytes: {e}"
        )))),
    }
}

/// Answers one certificate request.
pub async fn sign<C: Cluster>(
    service: &IdentityService<C>,
    req: &SignRequest,
) -> Response<Full<Bytes>> {
    if req.body.len() > MAX_BODY {
        return refusal(&Refusal::BadRequest(format!("body over {MAX_BODY} bytes")));
    }
    match service
        .handle(req.authorization.as_deref(), &req.body)
        .await
    {
        Ok(issued) => json(
            StatusCode::OK,
            &SignResponse {
                certificate_chain: issued.certificate_chain_pem,
                trust_bundle: issued.trust_bundle_pem,
                trust_generation: issued.trust_generation,
            },
        ),
        Err(r) => refusal(&r),
    }
}

/// The answer while the service is not running yet (the CA not loaded):
/// 503, retried by the sidecar like any failed attempt.
pub fn starting() -> Response<Full<Bytes>> {
    let mut response = json(
        StatusCode::SERVICE_UNAVAILABLE,
        &RefusalBody {
            reason: "starting".into(),
            message: "the identity service is starting".into(),
        },
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    response
}

fn refusal(r: &Refusal) -> Response<Full<Bytes>> {
    let status = StatusCode::from_u16(r.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = json(
        status,
        &RefusalBody {
            reason: r.metric_label().to_owned(),
            message: r.to_string(),
        },
    );
    if let Refusal::RateLimited {
        retry_after_secs, ..
    }
    | Refusal::ReissueDeferred { retry_after_secs } = r
        && let Ok(v) = header::HeaderValue::from_str(&retry_after_secs.to_string())
    {
        response.headers_mut().insert(header::RETRY_AFTER, v);
    }
    response
}

fn json<T: serde::Serialize>(status: StatusCode, body: &T) -> Response<Full<Bytes>> {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let mut response = Response::new(Full::new(Bytes::from(bytes)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

/// Accepts TLS connections on `listener` until the task is dropped: the
/// connections are owned by this future, so dropping it (aborting its
/// task) closes every one, as a process exit would.
pub async fn serve<C: Cluster>(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    service: Arc<IdentityService<C>>,
    path: &'static str,
) -> std::io::Result<()> {
    let never = CancellationToken::new();
    let conn_stop = never.clone();
    accept::serve_tls(
        listener,
        acceptor,
        "identity",
        never,
        Connections::Owned,
        move |tls, peer| {
            let service = service.clone();
            let handler = move |req: Request<Incoming>| {
                let service = service.clone();
                async move { respond(&service, path, req).await }
            };
            serve_connection(tls, handler, conn_stop.clone(), "identity", peer)
        },
    )
    .await;
    Ok(())
}
