//! Publishes the mesh trust bundle to every namespace.
//!
//! An injected sidecar must authenticate the operator before it can take
//! config from it, and it must trust the mesh roots before it holds a
//! certificate of its own. The bundle (public certificates only: `ca.crt`
//! of the CA Secret, or `tls.crt` when that is a bare root) goes into a
//! ConfigMap `baton-mesh-trust` in every namespace — Istio's
//! `istio-ca-root-cert` pattern — which the webhook mounts into both slots
//! (`optional`, so a Pod admitted before the ConfigMap exists still starts).
//!
//! Why a ConfigMap per namespace rather than the bundle in the Pod spec
//! (Linkerd's trust-anchor environment variable): a mounted ConfigMap
//! follows a root rotation without restarting anything — the kubelet
//! refreshes the file, and the sidecar's config stream reads it on every
//! connection — while an injected variable is frozen at admission.
//!
//! Only the leader writes. A pass re-reads the Secret every `interval` and
//! writes, with server-side apply, where the namespace has not yet been
//! given the current bundle by this process; a failed write is retried on
//! the next pass. The private key never leaves this module's read of the
//! Secret.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use baton_crds::contract::{self, identity as names};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use kube::api::{Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};

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

/// Whether a namespace can take the ConfigMap (a terminating one refuses
/// new objects).
pub fn accepts_writes(ns: &Namespace) -> bool {
    ns.metadata.deletion_timestamp.is_none()
        && ns.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Terminating")
}

/// Namespaces whose ConfigMap is not known to carry `bundle`.
pub fn stale<'a>(
    live: &'a BTreeSet<String>,
    written: &BTreeMap<String, String>,
    bundle: &str,
) -> Vec<&'a str> {
    live.iter()
        .filter(|ns| written.get(*ns).map(String::as_str) != Some(bundle))
        .map(String::as_str)
        .collect()
}

/// Keeps the bundle published until the task is dropped (leader only).
pub async fn run(client: Client, ca_namespace: String, ca_secret: String, interval: Duration) {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ca_namespace);
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let mut events = watcher(namespaces, watcher::Config::default()).boxed();
    let mut live = BTreeSet::new();
    let mut written: BTreeMap<String, String> = BTreeMap::new();
    let mut bundle: Option<String> = None;
    let mut tick = tokio::time::interval(interval);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                match secrets.get_opt(&ca_secret).await {
                    Ok(Some(s)) => match ca_from_secret(&s, &ca_secret) {
                        Ok(pem) => bundle = Some(pem.bundle),
                        Err(error) => tracing::warn!(%error, "mesh CA Secret unreadable; trust bundle not republished"),
                    },
                    Ok(None) => tracing::debug!(secret = %ca_secret, "no mesh CA Secret yet"),
                    Err(error) => tracing::warn!(%error, "mesh CA Secret not read"),
                }
            }
            event = events.next() => match event {
                Some(Ok(watcher::Event::Apply(ns) | watcher::Event::InitApply(ns))) => {
                    if accepts_writes(&ns) {
                        live.insert(ns.name_any());
                    } else {
                        live.remove(&ns.name_any());
                    }
                }
                Some(Ok(watcher::Event::Delete(ns))) => {
                    live.remove(&ns.name_any());
                    written.remove(&ns.name_any());
                }
                Some(Ok(watcher::Event::Init | watcher::Event::InitDone)) => {}
                Some(Err(error)) => {
                    tracing::warn!(%error, "namespace watch error; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                None => return,
            },
        }
        let Some(bundle) = bundle.as_deref() else {
            continue;
        };
        for ns in stale(&live, &written, bundle) {
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
            let params = PatchParams::apply(contract::FIELD_MANAGER).force();
            match api
                .patch(
                    names::TRUST_CONFIG_MAP,
                    &params,
                    &Patch::Apply(config_map(ns, bundle)),
                )
                .await
            {
                Ok(_) => {
                    written.insert(ns.to_owned(), bundle.to_owned());
                }
                Err(error) => {
                    tracing::warn!(namespace = %ns, %error, "trust bundle not published; retrying on the next pass");
                }
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
    fn only_namespaces_without_the_current_bundle_are_written() {
        let live: BTreeSet<String> = ["a", "b", "c"].map(String::from).into();
        let written = BTreeMap::from([
            ("a".to_owned(), "new".to_owned()),
            ("b".to_owned(), "old".to_owned()),
            ("gone".to_owned(), "new".to_owned()),
        ]);
        assert_eq!(stale(&live, &written, "new"), ["b", "c"]);
        // A rotation (a new bundle) rewrites every namespace.
        assert_eq!(stale(&live, &written, "newer"), ["a", "b", "c"]);
    }

    #[test]
    fn terminating_namespaces_are_skipped() {
        let mut ns = Namespace::default();
        assert!(accepts_writes(&ns));
        ns.status = Some(k8s_openapi::api::core::v1::NamespaceStatus {
            phase: Some("Terminating".into()),
            ..Default::default()
        });
        assert!(!accepts_writes(&ns));
    }
}
