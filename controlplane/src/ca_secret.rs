//! A CA kept in a Secret: where its PEM texts live ([`Layout`]), reading
//! and writing them, and how replicas agree on one CA.
//!
//! Two replicas starting at once end with one CA: each reads, and when the
//! Secret is absent generates a CA and *creates* the Secret; the API server
//! accepts exactly one create, the loser gets 409 AlreadyExists and reads
//! the winner's CA on its next attempt. A rotation replaces the Secret with
//! the resourceVersion it read as a precondition, so a concurrent writer
//! makes it start over from a fresh read instead of overwriting. Whether a
//! CA may be generated and when one is due is the owner's decision
//! ([`ensure`]'s `generate` and `renew`).

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;

/// How many times [`ensure`] starts over after losing a race.
pub const ATTEMPTS: usize = 5;

/// The PEM texts of a CA: its certificate (and any intermediates after it),
/// its key, and the bundle of CAs to trust. `Debug` redacts the key.
#[derive(Clone, PartialEq, Eq)]
pub struct CaPem {
    pub cert: String,
    pub key: String,
    pub bundle: String,
}

impl fmt::Debug for CaPem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaPem")
            .field("cert", &self.cert)
            .field("key", &"<redacted>")
            .field("bundle", &self.bundle)
            .finish()
    }
}

/// Where a CA's texts live and what a Secret written for it looks like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The Secret's name and namespace.
    pub name: String,
    pub namespace: String,
    /// `type` of a Secret this side writes (`Opaque`, `kubernetes.io/tls`).
    pub type_: &'static str,
    /// Data keys of the certificate, the key and the bundle.
    pub cert_key: &'static str,
    pub key_key: &'static str,
    pub bundle_key: &'static str,
    /// Labels of a Secret this side writes.
    pub labels: &'static [(&'static str, &'static str)],
    /// What the CA is, for logs ("webhook CA", "mesh root CA").
    pub what: &'static str,
}

/// Why a CA could not be loaded from, or written to, its Secret. `E` is
/// the owner's error for material it generated or refused.
#[derive(Debug, thiserror::Error)]
pub enum SecretError<E: std::error::Error + 'static> {
    #[error("CA Secret {0}: not found (create it with {1}, {2} and {3})")]
    Missing(String, &'static str, &'static str, &'static str),
    #[error("CA Secret {0}: key {1} missing")]
    MissingKey(String, &'static str),
    #[error("CA Secret {0}: kept conflicting with concurrent writers")]
    Conflict(String),
    #[error("CA Secret {secret}: {source}")]
    Material { secret: String, source: E },
    #[error("CA Secret: {0}")]
    Api(#[from] kube::Error),
}

impl<E: std::error::Error + 'static> SecretError<E> {
    /// Short label for metrics and logs; `material` labels the owner's own
    /// errors.
    pub fn metric_label(&self, material: impl FnOnce(&E) -> &'static str) -> &'static str {
        match self {
            SecretError::Missing(..) => "missing",
            SecretError::MissingKey(..) => "missing_key",
            SecretError::Conflict(_) => "conflict",
            SecretError::Material { source, .. } => material(source),
            SecretError::Api(_) => "api",
        }
    }
}

impl Layout {
    /// Reads the CA texts out of `secret` (pure). An empty value counts as
    /// missing; without a bundle the certificate is its own (a bare
    /// self-signed CA trusts itself).
    pub fn read<E: std::error::Error>(&self, secret: &Secret) -> Result<CaPem, SecretError<E>> {
        let field = |key: &'static str| {
            secret
                .data
                .as_ref()
                .and_then(|d| d.get(key))
                .map(|b| String::from_utf8_lossy(&b.0).into_owned())
                .filter(|s| !s.trim().is_empty())
                .ok_or_else(|| SecretError::MissingKey(self.name.clone(), key))
        };
        let cert = field(self.cert_key)?;
        let key = field(self.key_key)?;
        let bundle = field(self.bundle_key).unwrap_or_else(|_| cert.clone());
        Ok(CaPem { cert, key, bundle })
    }

    /// The Secret holding `ca` (resourceVersion left to the caller).
    pub fn secret_for(&self, ca: &CaPem) -> Secret {
        let bytes = |s: &str| ByteString(s.as_bytes().to_vec());
        let labels = self
            .labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<BTreeMap<_, _>>();
        Secret {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                labels: Some(labels),
                ..ObjectMeta::default()
            },
            type_: Some(self.type_.to_owned()),
            data: Some(BTreeMap::from([
                (self.cert_key.to_owned(), bytes(&ca.cert)),
                (self.key_key.to_owned(), bytes(&ca.key)),
                (self.bundle_key.to_owned(), bytes(&ca.bundle)),
            ])),
            ..Secret::default()
        }
    }

    fn missing<E: std::error::Error>(&self) -> SecretError<E> {
        SecretError::Missing(
            self.name.clone(),
            self.cert_key,
            self.key_key,
            self.bundle_key,
        )
    }
}

/// A CA as loaded: its texts and the Secret's resourceVersion.
pub type Loaded = (CaPem, Option<String>);

/// Loads the CA from its Secret; when the Secret does not exist, creates it
/// with what `generate` returns (`None`: the CA is provided by someone
/// else, and its absence is [`SecretError::Missing`]); when `renew` says
/// the stored CA is due, replaces it with the CA `renew` returns (under the
/// resourceVersion read). Losing a create or replace race starts over from
/// a fresh read, at most [`ATTEMPTS`] times.
pub async fn ensure<E, G, R>(
    api: &Api<Secret>,
    layout: &Layout,
    generate: Option<G>,
    renew: R,
) -> Result<Loaded, SecretError<E>>
where
    E: std::error::Error + 'static,
    G: Fn() -> Result<CaPem, E>,
    R: Fn(&CaPem) -> Result<Option<CaPem>, E>,
{
    let material = |source| SecretError::Material {
        secret: layout.name.clone(),
        source,
    };
    let name = layout.name.as_str();
    for _ in 0..ATTEMPTS {
        let Some(secret) = api.get_opt(name).await? else {
            let Some(generate) = generate.as_ref() else {
                return Err(layout.missing());
            };
            let ca = generate().map_err(material)?;
            match api
                .create(&PostParams::default(), &layout.secret_for(&ca))
                .await
            {
                Ok(created) => {
                    tracing::info!(secret = name, "created the {}", layout.what);
                    return Ok((ca, created.metadata.resource_version));
                }
                // Another replica created it first: adopt its CA.
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    tracing::info!(
                        secret = name,
                        "another replica created the {}; adopting it",
                        layout.what
                    );
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        };
        let rv = secret.metadata.resource_version.clone();
        let current = layout.read(&secret)?;
        let Some(next) = renew(&current).map_err(material)? else {
            return Ok((current, rv));
        };
        let mut replacement = layout.secret_for(&next);
        replacement.metadata.resource_version = rv;
        match api
            .replace(name, &PostParams::default(), &replacement)
            .await
        {
            Ok(replaced) => {
                tracing::info!(secret = name, "rotated the {}", layout.what);
                return Ok((next, replaced.metadata.resource_version));
            }
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(SecretError::Conflict(name.to_owned()))
}

/// Re-reads the Secret; `Some` when it changed since `known_rv`. A deleted
/// Secret is an error, never a reason to generate a new CA (that would
/// split the trust of everything the old one signed).
pub async fn reload<E: std::error::Error + 'static>(
    api: &Api<Secret>,
    layout: &Layout,
    known_rv: Option<&str>,
) -> Result<Option<Loaded>, SecretError<E>> {
    let secret = api
        .get_opt(&layout.name)
        .await?
        .ok_or_else(|| layout.missing())?;
    let rv = secret.metadata.resource_version.clone();
    if rv.is_some() && rv.as_deref() == known_rv {
        return Ok(None);
    }
    Ok(Some((layout.read(&secret)?, rv)))
}

#[cfg(test)]
mod tests {
    //! Pure reading and writing, then [`ensure`] and [`reload`] against the
    //! tower-test mock API server, every request asserted. The texts need
    //! not be real certificates: this module never parses them.

    use std::cell::Cell;

    use super::*;
    use crate::testing::{expect, mock_client, reply, status};

    type E = std::io::Error;

    const PATH: &str = "/api/v1/namespaces/ns/secrets";

    fn layout() -> Layout {
        Layout {
            name: "the-ca".into(),
            namespace: "ns".into(),
            type_: "kubernetes.io/tls",
            cert_key: "tls.crt",
            key_key: "tls.key",
            bundle_key: "ca.crt",
            labels: &[("app.kubernetes.io/part-of", "baton")],
            what: "test CA",
        }
    }

    fn pem(name: &str) -> CaPem {
        CaPem {
            cert: format!("{name}-cert"),
            key: format!("{name}-key"),
            bundle: format!("{name}-bundle"),
        }
    }

    fn stored(ca: &CaPem, rv: &str) -> serde_json::Value {
        let mut v = serde_json::to_value(layout().secret_for(ca)).unwrap();
        v["metadata"]["resourceVersion"] = rv.into();
        v
    }

    fn api(client: kube::Client) -> Api<Secret> {
        Api::namespaced(client, "ns")
    }

    fn keep(_: &CaPem) -> Result<Option<CaPem>, E> {
        Ok(None)
    }

    #[test]
    fn a_written_secret_reads_back_and_never_prints_its_key() {
        let l = layout();
        let secret = l.secret_for(&pem("a"));
        assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
        assert_eq!(
            secret.metadata.labels.as_ref().unwrap()["app.kubernetes.io/part-of"],
            "baton"
        );
        assert_eq!(l.read::<E>(&secret).unwrap(), pem("a"));
        let shown = format!("{:?}", pem("a"));
        assert!(
            !shown.contains("a-key") && shown.contains("<redacted>"),
            "{shown}"
        );
    }

    #[test]
    fn a_missing_or_empty_key_is_named_and_a_missing_bundle_is_the_certificate() {
        let l = layout();
        let mut s = l.secret_for(&pem("a"));
        s.data.as_mut().unwrap().remove("tls.key");
        let err = l.read::<E>(&s).unwrap_err();
        assert_eq!(err.to_string(), "CA Secret the-ca: key tls.key missing");
        assert_eq!(err.metric_label(|_| "material"), "missing_key");
        let mut s = l.secret_for(&pem("a"));
        s.data
            .as_mut()
            .unwrap()
            .insert("tls.crt".into(), ByteString(b" \n".to_vec()));
        assert_eq!(
            l.read::<E>(&s).unwrap_err().to_string(),
            "CA Secret the-ca: key tls.crt missing"
        );
        let mut s = l.secret_for(&pem("a"));
        s.data.as_mut().unwrap().remove("ca.crt");
        assert_eq!(l.read::<E>(&s).unwrap().bundle, "a-cert");
    }

    #[tokio::test]
    async fn a_missing_secret_is_created_from_the_generated_ca() {
        let (client, mut handle) = mock_client();
        let server = tokio::spawn(async move {
            let (_, send) = expect(&mut handle, "GET", &format!("{PATH}/the-ca")).await;
            reply(send, 404, &status(404, "NotFound"));
            let (mut body, send) = expect(&mut handle, "POST", PATH).await;
            assert_eq!(body["metadata"]["name"], "the-ca");
            assert_eq!(body["type"], "kubernetes.io/tls");
            for key in ["tls.crt", "tls.key", "ca.crt"] {
                assert!(body["data"][key].is_string(), "{key}");
            }
            body["metadata"]["resourceVersion"] = "1".into();
            reply(send, 201, &body);
        });
        let loaded = ensure(&api(client), &layout(), Some(|| Ok(pem("new"))), keep)
            .await
            .unwrap();
        server.await.unwrap();
        assert_eq!(loaded, (pem("new"), Some("1".to_owned())));
    }

    #[tokio::test]
    async fn a_replica_losing_the_creation_race_adopts_the_winners_ca() {
        let (client, mut handle) = mock_client();
        let winner = stored(&pem("winner"), "7");
        let server = tokio::spawn(async move {
            let get = format!("{PATH}/the-ca");
            let (_, send) = expect(&mut handle, "GET", &get).await;
            reply(send, 404, &status(404, "NotFound"));
            let (_, send) = expect(&mut handle, "POST", PATH).await;
            reply(send, 409, &status(409, "AlreadyExists"));
            let (_, send) = expect(&mut handle, "GET", &get).await;
            reply(send, 200, &winner);
        });
        let loaded = ensure(&api(client), &layout(), Some(|| Ok(pem("loser"))), keep)
            .await
            .unwrap();
        server.await.unwrap();
        assert_eq!(loaded, (pem("winner"), Some("7".to_owned())));
    }

    #[tokio::test]
    async fn a_missing_provided_ca_is_an_error_naming_the_keys_and_nothing_is_written() {
        let (client, mut handle) = mock_client();
        let server = tokio::spawn(async move {
            let (_, send) = expect(&mut handle, "GET", &format!("{PATH}/the-ca")).await;
            reply(send, 404, &status(404, "NotFound"));
            // The client is dropped after the error: no write follows.
            assert!(handle.next_request().await.is_none());
        });
        let none: Option<fn() -> Result<CaPem, E>> = None;
        let err = ensure(&api(client), &layout(), none, keep)
            .await
            .unwrap_err();
        assert_eq!(err.metric_label(|_| "material"), "missing");
        assert_eq!(
            err.to_string(),
            "CA Secret the-ca: not found (create it with tls.crt, tls.key and ca.crt)"
        );
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_due_ca_is_replaced_under_the_version_read_and_a_lost_race_reads_again() {
        let (client, mut handle) = mock_client();
        let (old, peers) = (stored(&pem("old"), "3"), stored(&pem("peers"), "4"));
        let server = tokio::spawn(async move {
            let get = format!("{PATH}/the-ca");
            let (_, send) = expect(&mut handle, "GET", &get).await;
            reply(send, 200, &old);
            let (body, send) = expect(&mut handle, "PUT", &get).await;
            // Optimistic concurrency: the replace carries what was read.
            assert_eq!(body["metadata"]["resourceVersion"], "3");
            reply(send, 409, &status(409, "Conflict"));
            // Another replica rotated first: its CA is current, kept.
            let (_, send) = expect(&mut handle, "GET", &get).await;
            reply(send, 200, &peers);
        });
        let renews = Cell::new(0);
        let renew = |ca: &CaPem| {
            renews.set(renews.get() + 1);
            Ok::<_, E>((ca.cert == "old-cert").then(|| pem("rotated")))
        };
        let none: Option<fn() -> Result<CaPem, E>> = None;
        let loaded = ensure(&api(client), &layout(), none, renew).await.unwrap();
        server.await.unwrap();
        assert_eq!(loaded, (pem("peers"), Some("4".to_owned())));
        assert_eq!(renews.get(), 2);
    }

    #[tokio::test]
    async fn a_rotation_that_keeps_losing_gives_up_with_a_conflict() {
        let (client, mut handle) = mock_client();
        let old = stored(&pem("old"), "3");
        let server = tokio::spawn(async move {
            let get = format!("{PATH}/the-ca");
            for _ in 0..ATTEMPTS {
                let (_, send) = expect(&mut handle, "GET", &get).await;
                reply(send, 200, &old);
                let (_, send) = expect(&mut handle, "PUT", &get).await;
                reply(send, 409, &status(409, "Conflict"));
            }
        });
        let none: Option<fn() -> Result<CaPem, E>> = None;
        let err = ensure(&api(client), &layout(), none, |_: &CaPem| {
            Ok::<_, E>(Some(pem("mine")))
        })
        .await
        .unwrap_err();
        server.await.unwrap();
        assert_eq!(err.metric_label(|_| "material"), "conflict");
    }

    #[tokio::test]
    async fn an_owner_refusing_the_stored_ca_gets_its_own_error_back() {
        let (client, mut handle) = mock_client();
        let old = stored(&pem("old"), "3");
        let server = tokio::spawn(async move {
            let (_, send) = expect(&mut handle, "GET", &format!("{PATH}/the-ca")).await;
            reply(send, 200, &old);
        });
        let none: Option<fn() -> Result<CaPem, E>> = None;
        let err = ensure(&api(client), &layout(), none, |_: &CaPem| {
            Err(E::other("not a CA"))
        })
        .await
        .unwrap_err();
        server.await.unwrap();
        assert_eq!(err.to_string(), "CA Secret the-ca: not a CA");
        assert_eq!(err.metric_label(|_| "material"), "material");
    }

    #[tokio::test]
    async fn reload_reports_the_secret_only_when_its_resource_version_moved() {
        let (client, mut handle) = mock_client();
        let (v5, v6) = (stored(&pem("a"), "5"), stored(&pem("b"), "6"));
        let server = tokio::spawn(async move {
            let get = format!("{PATH}/the-ca");
            let (_, send) = expect(&mut handle, "GET", &get).await;
            reply(send, 200, &v5);
            let (_, send) = expect(&mut handle, "GET", &get).await;
            reply(send, 200, &v6);
            let (_, send) = expect(&mut handle, "GET", &get).await;
            reply(send, 404, &status(404, "NotFound"));
        });
        let api = api(client);
        let l = layout();
        assert!(reload::<E>(&api, &l, Some("5")).await.unwrap().is_none());
        let loaded = reload::<E>(&api, &l, Some("5")).await.unwrap().unwrap();
        assert_eq!(loaded, (pem("b"), Some("6".to_owned())));
        // Deleted: an error (the caller keeps its CA), never a new one.
        let err = reload::<E>(&api, &l, Some("6")).await.unwrap_err();
        assert_eq!(err.metric_label(|_| "material"), "missing");
        server.await.unwrap();
    }
}
