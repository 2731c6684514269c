//! Where the CA lives: a Secret in `baton-system`, created on first start
//! (self-managed root) or provided by the user (plug-in CA, cert-manager),
//! in cert-manager's `kubernetes.io/tls` layout.
//!
//! Reading, writing and the create-or-adopt race between replicas are
//! [`baton_controlplane::ca_secret`]'s (shared with the webhook's CA); what
//! is decided here: a self-managed root is generated only when the Secret
//! is absent, a provided one never, and the operator never overwrites the
//! Secret: a rotation is the user's edit (docs/tls.md), picked up by
//! [`reload`].

use std::time::Duration;

use baton_controlplane::ca_secret::{self, Layout, Loaded, SecretError};
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
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

/// Why the CA Secret was not loaded; the material's own refusals are
/// [`CaError`]s.
pub type StoreError = SecretError<CaError>;

/// The metric label of a [`StoreError`].
pub fn error_label(error: &StoreError) -> &'static str {
    error.metric_label(CaError::metric_label)
}

/// The mesh CA's Secret `name` in `namespace` (cert-manager's TLS layout).
pub fn layout(name: &str, namespace: &str) -> Layout {
    Layout {
        name: name.to_owned(),
        namespace: namespace.to_owned(),
        type_: "kubernetes.io/tls",
        cert_key: CERT_KEY,
        key_key: KEY_KEY,
        bundle_key: BUNDLE_KEY,
        labels: &[
            ("app.kubernetes.io/part-of", "baton"),
            ("app.kubernetes.io/component", "identity"),
        ],
        what: "mesh root CA",
    }
}

/// Reads the CA PEM texts out of a Secret (pure).
pub fn ca_from_secret(secret: &Secret, name: &str) -> Result<CaPem, StoreError> {
    layout(name, "").read(secret)
}

/// Loads the CA, creating a self-managed root if none exists yet. Returns
/// the PEM texts and the Secret's resourceVersion.
pub async fn ensure(
    api: &Api<Secret>,
    source: &CaSource,
    namespace: &str,
    trust_domain: &str,
) -> Result<Loaded, StoreError> {
    let generate = match source {
        CaSource::SelfManaged { root_validity, .. } => {
            Some(|| generate_root(trust_domain, OffsetDateTime::now_utc(), *root_validity))
        }
        CaSource::External { .. } => None,
    };
    // Whatever is stored is kept: rotating the mesh CA is the user's edit.
    let keep = |_: &CaPem| Ok(None);
    ca_secret::ensure(api, &layout(source.secret(), namespace), generate, keep).await
}

/// Re-reads the Secret; `Some` when it changed since `known_rv`. A deleted
/// Secret is an error, never a reason to generate a new root (that would
/// split the mesh's trust).
pub async fn reload(
    api: &Api<Secret>,
    source: &CaSource,
    namespace: &str,
    known_rv: Option<&str>,
) -> Result<Option<Loaded>, StoreError> {
    ca_secret::reload(api, &layout(source.secret(), namespace), known_rv).await
}

#[cfg(test)]
mod tests {
    //! The mesh CA's own decisions; the Secret mechanics are tested in
    //! `baton_controlplane::ca_secret`.

    use super::*;
    use baton_controlplane::testing::{expect, mock_client, reply, status};

    const PATH: &str = "/api/v1/namespaces/baton-system/secrets";
    const NAME: &str = "baton-identity-ca";

    fn self_managed() -> CaSource {
        CaSource::SelfManaged {
            secret: NAME.into(),
            root_validity: Duration::from_secs(365 * 86_400),
        }
    }

    #[tokio::test]
    async fn a_missing_self_managed_ca_is_created_as_a_tls_secret_holding_a_usable_root() {
        let (client, mut handle) = mock_client();
        let server = tokio::spawn(async move {
            let (_, send) = expect(&mut handle, "GET", &format!("{PATH}/{NAME}")).await;
            reply(send, 404, &status(404, "NotFound"));
            let (mut body, send) = expect(&mut handle, "POST", PATH).await;
            assert_eq!(body["type"], "kubernetes.io/tls");
            assert_eq!(
                body["metadata"]["labels"]["app.kubernetes.io/component"],
                "identity"
            );
            for key in [CERT_KEY, KEY_KEY, BUNDLE_KEY] {
                assert!(body["data"][key].is_string(), "{key}");
            }
            body["metadata"]["resourceVersion"] = "1".into();
            reply(send, 201, &body);
        });
        let api = Api::namespaced(client, "baton-system");
        let (ca, rv) = ensure(&api, &self_managed(), "baton-system", "cluster.local")
            .await
            .unwrap();
        server.await.unwrap();
        assert_eq!(rv.as_deref(), Some("1"));
        crate::identity::authority::Authority::from_pem(&ca, OffsetDateTime::now_utc()).unwrap();
    }

    #[tokio::test]
    async fn a_stored_ca_is_never_rotated_by_the_operator() {
        let (client, mut handle) = mock_client();
        let old = generate_root(
            "cluster.local",
            OffsetDateTime::now_utc() - time::Duration::days(300),
            Duration::from_secs(301 * 86_400),
        )
        .unwrap();
        let mut stored =
            serde_json::to_value(layout(NAME, "baton-system").secret_for(&old)).unwrap();
        stored["metadata"]["resourceVersion"] = "9".into();
        let server = tokio::spawn(async move {
            let (_, send) = expect(&mut handle, "GET", &format!("{PATH}/{NAME}")).await;
            reply(send, 200, &stored);
            // The client is dropped after the read: no write follows.
            assert!(handle.next_request().await.is_none());
        });
        let api = Api::namespaced(client, "baton-system");
        let (ca, rv) = ensure(&api, &self_managed(), "baton-system", "cluster.local")
            .await
            .unwrap();
        drop(api);
        server.await.unwrap();
        assert_eq!((ca, rv.as_deref()), (old, Some("9")));
    }

    #[tokio::test]
    async fn a_missing_plug_in_ca_is_an_error_naming_the_keys_to_create() {
        let (client, mut handle) = mock_client();
        let server = tokio::spawn(async move {
            let (_, send) = expect(&mut handle, "GET", &format!("{PATH}/{NAME}")).await;
            reply(send, 404, &status(404, "NotFound"));
        });
        let api = Api::namespaced(client, "baton-system");
        let source = CaSource::External {
            secret: NAME.into(),
        };
        let err = ensure(&api, &source, "baton-system", "cluster.local")
            .await
            .unwrap_err();
        server.await.unwrap();
        assert_eq!(error_label(&err), "missing");
        assert_eq!(
            err.to_string(),
            "CA Secret baton-identity-ca: not found (create it with tls.crt, tls.key and ca.crt)"
        );
    }

    #[test]
    fn a_secret_without_tls_key_names_the_missing_key() {
        let ca = CaPem {
            cert: "c".into(),
            key: "k".into(),
            bundle: "b".into(),
        };
        let mut s = layout(NAME, "baton-system").secret_for(&ca);
        s.data.as_mut().unwrap().remove(KEY_KEY);
        assert_eq!(
            ca_from_secret(&s, NAME).unwrap_err().to_string(),
            "CA Secret baton-identity-ca: key tls.key missing"
        );
    }
}
