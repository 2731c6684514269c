//! Where the CA lives: a Secret in `baton-system`, created on first start
//! (self-managed root) or provided by the user (plug-in CA, cert-manager).
//!
//! Two replicas starting at once end with one root: each reads, and when
//! the Secret is absent generates a root and *creates* the Secret; the API
//! server accepts exactly one create, the loser gets 409 AlreadyExists and
//! reads the winner's root. The operator never overwrites the Secret: a
//! rotation is the user's edit (docs/tls.md), picked up by [`reload`].

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;
use time::OffsetDateTime;

use super::authority::{BUNDLE_KEY, CERT_KEY, CaError, CaPem, KEY_KEY, generate_root};

/// Where the CA comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaSource {
    /// A root the operator generates when `secret` does not exist.
    SelfManaged {
        secret: String,
        root_validity: Duration,
    },
    /// A Secret the user (or cert-manager) provides; never written.
    External { secret: String },
}

impl CaSource {
    pub fn secret(&self) -> &str {
        match self {
            CaSource::SelfManaged { secret, .. } | CaSource::External { secret } => secret,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("CA Secret {0}: not found (create it with tls.crt, tls.key and ca.crt)")]
    Missing(String),
    #[error("CA Secret {secret}: {source}")]
    Invalid { secret: String, source: CaError },
    #[error("CA Secret {0}: key {1} missing")]
    MissingKey(String, &'static str),
    #[error("CA Secret {0}: kept conflicting with concurrent writers")]
    Conflict(String),
    #[error("CA Secret: {0}")]
    Api(#[from] kube::Error),
}

impl StoreError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            StoreError::Missing(_) => "missing",
            StoreError::Invalid { source, .. } => source.metric_label(),
            StoreError::MissingKey(..) => "missing_key",
            StoreError::Conflict(_) => "conflict",
            StoreError::Api(_) => "api",
        }
    }
}

/// Reads the CA PEM texts out of a Secret (pure).
pub fn ca_from_secret(secret: &Secret, name: &str) -> Result<CaPem, StoreError> {
    let field = |key: &'static str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
            .filter(|s| !s.trim().is_empty())
            .ok_or_else(|| StoreError::MissingKey(name.to_owned(), key))
    };
    let cert = field(CERT_KEY)?;
    let key = field(KEY_KEY)?;
    // A self-signed root without ca.crt trusts itself; an intermediate
    // without ca.crt fails the chain check, with that message.
    let bundle = field(BUNDLE_KEY).unwrap_or_else(|_| cert.clone());
    Ok(CaPem { cert, key, bundle })
}

/// The Secret of a self-managed CA (cert-manager's TLS layout).
pub fn secret_for(ca: &CaPem, name: &str, namespace: &str) -> Secret {
    let bytes = |s: &str| ByteString(s.as_bytes().to_vec());
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([
                ("app.kubernetes.io/part-of".to_owned(), "baton".to_owned()),
                (
                    "app.kubernetes.io/component".to_owned(),
                    "identity".to_owned(),
                ),
            ])),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".to_owned()),
        data: Some(BTreeMap::from([
            (CERT_KEY.to_owned(), bytes(&ca.cert)),
            (KEY_KEY.to_owned(), bytes(&ca.key)),
            (BUNDLE_KEY.to_owned(), bytes(&ca.bundle)),
        ])),
        ..Secret::default()
    }
}

/// Loads the CA, creating a self-managed root if none exists yet. Returns
/// the PEM texts and the Secret's resourceVersion.
pub async fn ensure(
    api: &Api<Secret>,
    source: &CaSource,
    namespace: &str,
    trust_domain: &str,
) -> Result<(CaPem, Option<String>), StoreError> {
    let name = source.secret();
    for _ in 0..3 {
        if let Some(secret) = api.get_opt(name).await? {
            let rv = secret.metadata.resource_version.clone();
            return Ok((ca_from_secret(&secret, name)?, rv));
        }
        let CaSource::SelfManaged { root_validity, .. } = source else {
            return Err(StoreError::Missing(name.to_owned()));
        };
        let root = generate_root(trust_domain, OffsetDateTime::now_utc(), *root_validity).map_err(
            |source| StoreError::Invalid {
                secret: name.to_owned(),
                source,
            },
        )?;
        match api
            .create(&PostParams::default(), &secret_for(&root, name, namespace))
            .await
        {
            Ok(created) => {
                tracing::info!(secret = name, "created the mesh root CA");
                return Ok((root, created.metadata.resource_version));
            }
            // Another replica created it first: adopt its root.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                tracing::info!(
                    secret = name,
                    "another replica created the root; adopting it"
                );
                continue;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(StoreError::Conflict(name.to_owned()))
}

/// Re-reads the Secret; `Some` when it changed since `known_rv`. A deleted
/// Secret is an error, never a reason to generate a new root (that would
/// split the mesh's trust).
pub async fn reload(
    api: &Api<Secret>,
    source: &CaSource,
    known_rv: Option<&str>,
) -> Result<Option<(CaPem, Option<String>)>, StoreError> {
    let name = source.secret();
    let secret = api
        .get_opt(name)
        .await?
        .ok_or_else(|| StoreError::Missing(name.to_owned()))?;
    let rv = secret.metadata.resource_version.clone();
    if rv.is_some() && rv.as_deref() == known_rv {
        return Ok(None);
    }
    Ok(Some((ca_from_secret(&secret, name)?, rv)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Request, Response};
    use kube::Client;
    use kube::client::Body;

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    const PATH: &str = "/api/v1/namespaces/baton-system/secrets";
    const NAME: &str = "baton-identity-ca";

    fn mock() -> (Api<Secret>, Handle) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        (
            Api::namespaced(Client::new(service, "default"), "baton-system"),
            handle,
        )
    }

    async fn expect(
        handle: &mut Handle,
        method: &str,
        path: &str,
    ) -> (
        serde_json::Value,
        tower_test::mock::SendResponse<Response<Body>>,
    ) {
        let (request, send) = handle.next_request().await.expect("a request");
        assert_eq!(request.method().as_str(), method, "{}", request.uri());
        assert_eq!(request.uri().path(), path);
        let bytes = request.into_body().collect_bytes().await.unwrap();
        let body = if bytes.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        (body, send)
    }

    fn reply(
        send: tower_test::mock::SendResponse<Response<Body>>,
        code: u16,
        body: &serde_json::Value,
    ) {
        send.send_response(
            Response::builder()
                .status(code)
                .body(Body::from(serde_json::to_vec(body).unwrap()))
                .unwrap(),
        );
    }

    fn status(code: u16, reason: &str) -> serde_json::Value {
        serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                           "code": code, "reason": reason, "message": reason})
    }

    fn self_managed() -> CaSource {
        CaSource::SelfManaged {
            secret: NAME.into(),
            root_validity: Duration::from_secs(365 * 86_400),
        }
    }

    fn stored(ca: &CaPem, rv: &str) -> serde_json::Value {
        let mut v = serde_json::to_value(secret_for(ca, NAME, "baton-system")).unwrap();
        v["metadata"]["resourceVersion"] = rv.into();
        v
    }

    #[tokio::test]
    async fn a_missing_self_managed_ca_is_created_as_a_tls_secret() {
        let (api, mut handle) = mock();
        let server = tokio::spawn(async move {
            let (_, send) = expect(&mut handle, "GET", &format!("{PATH}/{NAME}")).await;
            reply(send, 404, &status(404, "NotFound"));
            let (mut body, send) = expect(&mut handle, "POST", PATH).await;
            assert_eq!(body["metadata"]["name"], NAME);
            assert_eq!(body["type"], "kubernetes.io/tls");
            for key in [CERT_KEY, KEY_KEY, BUNDLE_KEY] {
                assert!(body["data"][key].is_string(), "{key}");
            }
            body["metadata"]["resourceVersion"] = "1".into();
            reply(send, 201, &body);
        });
        let (ca, rv) = ensure(&api, &self_managed(), "baton-system", "cluster.local")
            .await
            .unwrap();
        server.await.unwrap();
        assert_eq!(rv.as_deref(), Some("1"));
        crate::identity::authority::Authority::from_pem(&ca, OffsetDateTime::now_utc()).unwrap();
    }

    #[tokio::test]
    async fn a_replica_losing_the_creation_race_adopts_the_winners_root() {
        let (api, mut handle) = mock();
        let winner = generate_root(
            "cluster.local",
            OffsetDateTime::now_utc(),
            Duration::from_secs(86_400),
        )
        .unwrap();
        let winner_secret = stored(&winner, "7");
        let server = tokio::spawn(async move {
            let get = format!("{PATH}/{NAME}");
            let (_, send) = expect(&mut handle, "GET", &get).await;
            reply(send, 404, &status(404, "NotFound"));
            let (_, send) = expect(&mut handle, "POST", PATH).await;
            reply(send, 409, &status(409, "AlreadyExists"));
            let (_, send) = expect(&mut handle, "GET", &get).await;
            reply(send, 200, &winner_secret);
        });
        let (ca, rv) = ensure(&api, &self_managed(), "baton-system", "cluster.local")
            .await
            .unwrap();
        server.await.unwrap();
        assert_eq!(ca, winner);
        assert_eq!(rv.as_deref(), Some("7"));
    }

    #[tokio::test]
    async fn a_missing_plug_in_ca_is_an_error_and_nothing_is_written() {
        let (api, mut handle) = mock();
        let server = tokio::spawn(async move {
            let (_, send) = expect(&mut handle, "GET", &format!("{PATH}/{NAME}")).await;
            reply(send, 404, &status(404, "NotFound"));
            // No further request may come: the handle is dropped with the task.
            assert!(
                tokio::time::timeout(Duration::from_millis(200), handle.next_request())
                    .await
                    .map_or(true, |r| r.is_none())
            );
        });
        let err = ensure(
            &api,
            &CaSource::External {
                secret: NAME.into(),
            },
            "baton-system",
            "cluster.local",
        )
        .await
        .unwrap_err();
        assert_eq!(err.metric_label(), "missing");
        assert!(
            err.to_string().contains("tls.crt, tls.key and ca.crt"),
            "{err}"
        );
        drop(api);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn reload_reports_the_secret_only_when_its_resource_version_moved() {
        let (api, mut handle) = mock();
        let ca =
            generate_root("td", OffsetDateTime::now_utc(), Duration::from_secs(86_400)).unwrap();
        let (v5, v6) = (stored(&ca, "5"), stored(&ca, "6"));
        let server = tokio::spawn(async move {
            let get = format!("{PATH}/{NAME}");
            let (_, send) = expect(&mut handle, "GET", &get).await;
            reply(send, 200, &v5);
            let (_, send) = expect(&mut handle, "GET", &get).await;
            reply(send, 200, &v6);
            let (_, send) = expect(&mut handle, "GET", &get).await;
            reply(send, 404, &status(404, "NotFound"));
        });
        let source = CaSource::External {
            secret: NAME.into(),
        };
        assert!(reload(&api, &source, Some("5")).await.unwrap().is_none());
        let (pem, rv) = reload(&api, &source, Some("5")).await.unwrap().unwrap();
        assert_eq!((pem, rv.as_deref()), (ca, Some("6")));
        // Deleted: an error (the caller keeps its CA), never a new root.
        assert_eq!(
            reload(&api, &source, Some("6"))
                .await
                .unwrap_err()
                .metric_label(),
            "missing"
        );
        server.await.unwrap();
    }

    #[test]
    fn a_secret_without_tls_key_names_the_missing_key() {
        let mut s = secret_for(
            &CaPem {
                cert: "c".into(),
                key: "k".into(),
                bundle: "b".into(),
            },
            NAME,
            "baton-system",
        );
        s.data.as_mut().unwrap().remove(KEY_KEY);
        assert_eq!(
            ca_from_secret(&s, NAME).unwrap_err().to_string(),
            "CA Secret baton-identity-ca: key tls.key missing"
        );
        // Without ca.crt, tls.crt is its own bundle (a bare self-signed root).
        let mut s = secret_for(
            &CaPem {
                cert: "c".into(),
                key: "k".into(),
                bundle: "b".into(),
            },
            NAME,
            "baton-system",
        );
        s.data.as_mut().unwrap().remove(BUNDLE_KEY);
        assert_eq!(ca_from_secret(&s, NAME).unwrap().bundle, "c");
    }
}
