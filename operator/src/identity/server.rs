//! The HTTPS endpoint: rustls + hyper on its own port, one route
//! (`POST /v1/sign`), answering with the wire format of the sidecar's
//! `identity_client`. Every replica serves; no leader is involved.
//!
//! The serving certificate is issued by the mesh CA itself (so sidecars
//! verify the endpoint with the trust bundle they already hold) and lives in
//! a swappable resolver: a CA change or renewal applies to the next
//! handshake.

use std::convert::Infallible;
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::cluster::Cluster;
use super::issue::Refusal;
use super::service::{IdentityService, RefusalBody, SignResponse};

/// Largest request body accepted.
const MAX_BODY: usize = 64 * 1024;

/// The serving certificate, swapped in place.
#[derive(Debug, Default)]
pub struct ServingCert {
    current: ArcSwapOption<CertifiedKey>,
}

impl ServingCert {
    /// Parses PEM chain + key and serves them from the next handshake on.
    pub fn store_pem(&self, chain_pem: &str, key_pem: &str) -> Result<(), String> {
        let chain = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("serving chain: {e}"))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|_| "serving key does not parse".to_owned())?;
        let signing = provider()
            .key_provider
            .load_private_key(key)
            .map_err(|e| format!("serving key: {e}"))?;
        self.current
            .store(Some(Arc::new(CertifiedKey::new(chain, signing))));
        Ok(())
    }

    pub fn is_loaded(&self) -> bool {
        self.current.load().is_some()
    }
}

impl ResolvesServerCert for ServingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.load_full()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The provider with the SHA-256 suites first: the handshake's transcript
/// and key schedule hash with the suite's hash, and SHA-256 runs on the
/// CPU's SHA extensions where SHA-384 cannot (decision 0019: SHA-384 was a
/// fifth of the endpoint's handshake CPU).
fn provider_sha256_first() -> Arc<rustls::crypto::CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    use rustls::CipherSuite as S;
    // Stable sort: the provider's order otherwise.
    provider.cipher_suites.sort_by_key(|s| {
        matches!(
            s.suite(),
            S::TLS13_AES_256_GCM_SHA384
                | S::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
                | S::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384
        )
    });
    Arc::new(provider)
}

/// A TLS acceptor serving whatever `cert` holds (HTTP/1.1 and h2 by ALPN).
///
/// Tuned for many short-lived clients (decision 0019): the server's suite
/// order wins (SHA-256 first), and no TLS 1.3 session tickets are sent — a
/// sidecar asks again only after hours, when any ticket would be useless,
/// and each ticket costs key-schedule work on every handshake.
pub fn acceptor(cert: Arc<ServingCert>) -> TlsAcceptor {
    let mut config = rustls::ServerConfig::builder_with_provider(provider_sha256_first())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_no_client_auth()
        .with_cert_resolver(cert);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config.ignore_client_order = true;
    config.send_tls13_tickets = 0;
    TlsAcceptor::from(Arc::new(config))
}

/// Routes and answers one HTTP request.
pub async fn respond<C: Cluster>(
    service: &IdentityService<C>,
    path: &str,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    if req.uri().path() != path {
        return json(
            StatusCode::NOT_FOUND,
            &RefusalBody {
                reason: "not_found".into(),
                message: format!("the identity service answers POST {path}"),
            },
        );
    }
    if req.method() != http::Method::POST {
        return json(
            StatusCode::METHOD_NOT_ALLOWED,
            &RefusalBody {
                reason: "method_not_allowed".into(),
                message: format!("use POST {path}"),
            },
        );
    }
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return refusal(&Refusal::BadRequest(format!(
                "body unreadable or over {MAX_BODY} bytes: {e}"
            )));
        }
    };
    match service.handle(authorization.as_deref(), &body).await {
        Ok(issued) => json(
            StatusCode::OK,
            &SignResponse {
                certificate_chain: issued.certificate_chain_pem,
                trust_bundle: issued.trust_bundle_pem,
            },
        ),
        Err(r) => refusal(&r),
    }
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
    } = r
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

/// Accepts TLS connections on `listener` until the task is dropped.
pub async fn serve<C: Cluster>(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    service: Arc<IdentityService<C>>,
    path: &'static str,
) -> std::io::Result<()> {
    accept_tls(listener, acceptor, "identity", move |tls, peer| {
        let service = service.clone();
        async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let service = service.clone();
                async move { Ok::<_, Infallible>(respond(&service, path, req).await) }
            });
            if let Err(error) = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tls), svc)
                .await
            {
                tracing::debug!(%peer, %error, "identity connection ended");
            }
        }
    })
    .await
}

/// The accept loop of the operator's TLS endpoints (identity, config
/// push): accepts on `listener`, completes the TLS handshake within 10 s in
/// the connection's own task and hands the stream to `serve_conn`. A failed
/// accept (out of descriptors) or handshake costs only that connection. The
/// connections are owned by this future: dropping it (aborting its task)
/// closes every one, as a process exit would.
pub async fn accept_tls<F, Fut>(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    what: &'static str,
    serve_conn: F,
) -> std::io::Result<()>
where
    F: Fn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>, std::net::SocketAddr) -> Fut
        + Send
        + Sync
        + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let serve_conn = Arc::new(serve_conn);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(_) = connections.join_next() => continue,
        };
        let (tcp, peer) = match accepted {
            Ok(conn) => conn,
            // Out of descriptors or similar: keep serving the rest.
            Err(error) => {
                tracing::warn!(%error, endpoint = what, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let serve_conn = serve_conn.clone();
        connections.spawn(async move {
            match tokio::time::timeout(std::time::Duration::from_secs(10), acceptor.accept(tcp))
                .await
            {
                Ok(Ok(tls)) => serve_conn(tls, peer).await,
                Ok(Err(error)) => {
                    tracing::debug!(%peer, %error, endpoint = what, "TLS handshake failed");
                }
                Err(_) => {
                    tracing::debug!(%peer, endpoint = what, "TLS handshake timed out");
                }
            }
        });
    }
}
