//! Publishes the mesh trust bundle in the operator's own namespace.
//!
//! An injected sidecar must authenticate the operator before it can take
//! config from it, and it must trust the mesh roots before it holds a
//! certificate of its own. The bundle (public certificates only: `ca.crt`
//! of the CA Secret, or `tls.crt` when that is a bare root) goes into
//! ConfigMap `baton-mesh-trust` of the operator's namespace, and nowhere
//! else: the webhook copies it into each Pod it injects (an annotation the
//! sidecar slots read through a downwardAPI volume, as Linkerd injects its
//! trust anchors), and later bundles reach each sidecar with its
//! certificates from the identity service, which the sidecar keeps on the
//! Pod's shared volume for its next process (decision 0058).
//!
//! Why not a ConfigMap per namespace (Istio's `istio-ca-root-cert`, and
//! this operator before decision 0058): it needs ConfigMap create and patch
//! in every namespace, cluster-wide, for a copy of what a Pod can be handed
//! at admission. Operators before 0058 left such ConfigMaps behind; nothing
//! reads them any more and this one can no longer delete them
//! (docs/operations.md says how).
//!
//! Only the leader writes. A pass re-reads the Secret every `interval` and
//! applies the ConfigMap when the bundle differs from what this process
//! last wrote, and again every [`REFRESH_PASSES`] passes (a deleted
//! ConfigMap comes back; an unchanged apply is a no-op for the API
//! server). The private key never leaves this module's read of the Secret.
//! The rotation observer (`rotation`) writes the phase annotations on the
//! same object under a field manager of its own.

use std::collections::BTreeMap;
use std::time::Duration;

use baton_crds::contract::{self, identity as names};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

use super::store::ca_from_secret;

/// The ConfigMap holding `bundle` (PEM) in `namespace`.
pub fn config_map(namespace: &str, bundle: &str) -> ConfigMap {
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some(names::TRUST_CONFIG_MAP.to_owned());
    cm.metadata.namespace = Some(namespace.to_owned());
    cm.metadata.labels = Some(BTreeMap::from([
        ("app.kubernetes.io/part-of".to_owned(), "baton".to_owned()),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            "baton-operator".to_owned(),
        ),
    ]));
    cm.data = Some(BTreeMap::from([(
        names::TRUST_KEY.to_owned(),
        bundle.to_owned(),
    )]));
    cm
}

/// Passes between two writes of an unchanged bundle.
pub const REFRESH_PASSES: u32 = 30;

/// Whether this pass writes: the bundle is not the one written last, or
/// [`REFRESH_PASSES`] passes went by since. Pure.
pub fn due(written: Option<&str>, bundle: &str, passes_since: u32) -> bool {
    written != Some(bundle) || passes_since >= REFRESH_PASSES
}

/// Keeps the bundle published in `namespace` (the operator's, where the CA
/// Secret is) until the task is dropped (leader only). Every request this
/// task makes is to that namespace.
pub async fn run(client: Client, namespace: String, ca_secret: String, interval: Duration) {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let config_maps: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let params = PatchParams::apply(contract::FIELD_MANAGER).force();
    let mut written: Option<String> = None;
    let mut passes_since = 0u32;
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        passes_since = passes_since.saturating_add(1);
        let bundle = match secrets.get_opt(&ca_secret).await {
            Ok(Some(s)) => match ca_from_secret(&s, &ca_secret) {
                Ok(pem) => pem.bundle,
                Err(error) => {
                    tracing::warn!(%error, "mesh CA Secret unreadable; trust bundle not republished");
                    continue;
                }
            },
            Ok(None) => {
                tracing::debug!(secret = %ca_secret, "no mesh CA Secret yet");
                continue;
            }
            Err(error) => {
                tracing::warn!(%error, "mesh CA Secret not read");
                continue;
            }
        };
        if !due(written.as_deref(), &bundle, passes_since) {
            continue;
        }
        match config_maps
            .patch(
                names::TRUST_CONFIG_MAP,
                &params,
                &Patch::Apply(config_map(&namespace, &bundle)),
            )
            .await
        {
            Ok(_) => {
                written = Some(bundle);
                passes_since = 0;
            }
            Err(error) => {
                tracing::warn!(%namespace, %error, "trust bundle not published; retrying on the next pass");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_map_carries_only_the_bundle() {
        let cm = config_map("shop", "-----BEGIN CERTIFICATE-----\n");
        assert_eq!(cm.metadata.name.as_deref(), Some(names::TRUST_CONFIG_MAP));
        assert_eq!(cm.metadata.namespace.as_deref(), Some("shop"));
        let data = cm.data.unwrap();
        assert_eq!(data.len(), 1);
        assert_eq!(data[names::TRUST_KEY], "-----BEGIN CERTIFICATE-----\n");
        // The key the webhook's mount reads.
        assert!(contract::volumes::TRUST_BUNDLE_PATH.ends_with(names::TRUST_KEY));
    }

    #[test]
    fn a_changed_bundle_is_written_at_once_and_an_unchanged_one_now_and_then() {
        assert!(due(None, "b", 1));
        assert!(due(Some("a"), "b", 1));
        assert!(!due(Some("b"), "b", 1));
        assert!(!due(Some("b"), "b", REFRESH_PASSES - 1));
        assert!(due(Some("b"), "b", REFRESH_PASSES));
    }

    /// The publisher against a fake API server: it reads the CA Secret and
    /// writes the ConfigMap in its own namespace, and sends nothing to any
    /// other namespace (no namespace list or watch, no write elsewhere).
    #[tokio::test]
    async fn the_bundle_is_published_in_the_operators_namespace_only() {
        use crate::mock_api::serve;
        let root = crate::identity::authority::generate_root(
            "cluster.local",
            time::OffsetDateTime::now_utc(),
            Duration::from_secs(86_400),
        )
        .unwrap();
        let secret = serde_json::to_value(
            super::super::store::layout(names::CA_SECRET, "baton-system").secret_for(&root),
        )
        .unwrap();
        let (service, handle) = tower_test::mock::pair();
        let client = Client::new(service, "default");
        let seen = serve(handle, move |s| {
            if s.method == http::Method::GET {
                (200, secret.clone())
            } else {
                (200, s.body.clone())
            }
        });
        let task = tokio::spawn(run(
            client,
            "baton-system".into(),
            names::CA_SECRET.into(),
            Duration::from_millis(10),
        ));
        let mut writes = Vec::new();
        for _ in 0..500 {
            writes = seen
                .lock()
                .unwrap()
                .iter()
                .filter(|s| s.method == http::Method::PATCH)
                .cloned()
                .collect::<Vec<_>>();
            if !writes.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // A few more passes: an unchanged bundle is not written again.
        let reads_before = seen.lock().unwrap().len();
        for _ in 0..500 {
            if seen.lock().unwrap().len() >= reads_before + 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task.abort();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(writes.len(), 1, "{seen:#?}");
        let w = &writes[0];
        assert!(
            w.uri
                .starts_with("/api/v1/namespaces/baton-system/configmaps/baton-mesh-trust?"),
            "{}",
            w.uri
        );
        assert_eq!(w.body["data"][names::TRUST_KEY], root.bundle);
        assert_eq!(
            seen.iter()
                .filter(|s| s.method == http::Method::PATCH)
                .count(),
            1,
            "one write for an unchanged bundle"
        );
        for s in &seen {
            assert!(
                s.uri.starts_with("/api/v1/namespaces/baton-system/"),
                "a request outside the operator's namespace: {} {}",
                s.method,
                s.uri
            );
        }
    }
}
