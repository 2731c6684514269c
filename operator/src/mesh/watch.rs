//! The watchers that fill the hub's index from the API server: Services,
//! endpoints, injected Pods, Routes, TlsPolicies, AuthorizationPolicies and
//! Namespaces (for their default-authorization annotation).
//!
//! Endpoints come from `discovery.k8s.io/v1` EndpointSlices where the API
//! server serves that group version, and from core/v1 Endpoints otherwise
//! (Kubernetes 1.20, the e2e cluster, has only `v1beta1` slices). The choice
//! is made by asking discovery, never by parsing a version string.
//!
//! A (re)list replaces the kind's entries as a whole: `InitApply` events
//! are indexed on the side until `InitDone` and swapped in with one index
//! update (only the index's compact form is held meanwhile), so a
//! watch restart never leaves deleted objects behind nor shows a half-listed
//! kind to the compiler. The hub pushes nothing until every kind has listed
//! once.

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use baton_crds::contract;
use baton_crds::{AuthorizationPolicy, Route, TlsPolicy};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Endpoints, Namespace, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;

use super::hub::Hub;
use super::index::{Index, ObjKey};

/// Where endpoints are read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointsSource {
    Slices,
    CoreV1,
}

/// Asks discovery whether `discovery.k8s.io/v1` is served.
pub async fn endpoints_source(client: &Client) -> EndpointsSource {
    match client.list_api_group_resources("discovery.k8s.io/v1").await {
        Ok(list) if list.resources.iter().any(|r| r.name == "endpointslices") => {
            EndpointsSource::Slices
        }
        Ok(_) | Err(_) => EndpointsSource::CoreV1,
    }
}

/// How one kind lands in the index.
trait Indexed: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static {
    /// The kind, as a metric label.
    const KIND: &'static str;
    /// Replaces every object of this kind in `index` with those of
    /// `listed` (a relist, indexed on the side as it arrived).
    fn adopt(index: &mut Index, listed: &mut Index);
    fn apply(&self, index: &mut Index);
    fn delete(&self, index: &mut Index);
}

impl Indexed for Service {
    const KIND: &'static str = "Service";
    fn adopt(index: &mut Index, listed: &mut Index) {
        index.services = std::mem::take(&mut listed.services);
    }
    fn apply(&self, index: &mut Index) {
        index.apply_service(self);
    }
    fn delete(&self, index: &mut Index) {
        index.delete_service(&ObjKey::of(self));
    }
}

impl Indexed for EndpointSlice {
    const KIND: &'static str = "EndpointSlice";
    fn adopt(index: &mut Index, listed: &mut Index) {
        index.endpoints = std::mem::take(&mut listed.endpoints);
    }
    fn apply(&self, index: &mut Index) {
        index.apply_endpoint_slice(self);
    }
    fn delete(&self, index: &mut Index) {
        index.delete_endpoint_slice(self);
    }
}

impl Indexed for Endpoints {
    const KIND: &'static str = "Endpoints";
    fn adopt(index: &mut Index, listed: &mut Index) {
        index.endpoints = std::mem::take(&mut listed.endpoints);
    }
    fn apply(&self, index: &mut Index) {
        index.apply_endpoints(self);
    }
    fn delete(&self, index: &mut Index) {
        index.delete_endpoints(&ObjKey::of(self));
    }
}

impl Indexed for Pod {
    const KIND: &'static str = "Pod";
    fn adopt(index: &mut Index, listed: &mut Index) {
        index.pods = std::mem::take(&mut listed.pods);
    }
    fn apply(&self, index: &mut Index) {
        index.apply_pod(self);
    }
    fn delete(&self, index: &mut Index) {
        index.delete_pod(&ObjKey::of(self));
    }
}

impl Indexed for Route {
    const KIND: &'static str = "Route";
    fn adopt(index: &mut Index, listed: &mut Index) {
        index.routes = std::mem::take(&mut listed.routes);
    }
    fn apply(&self, index: &mut Index) {
        index.apply_route(self);
    }
    fn delete(&self, index: &mut Index) {
        index.delete_route(&ObjKey::of(self));
    }
}

impl Indexed for TlsPolicy {
    const KIND: &'static str = "TlsPolicy";
    fn adopt(index: &mut Index, listed: &mut Index) {
        index.tls_policies = std::mem::take(&mut listed.tls_policies);
    }
    fn apply(&self, index: &mut Index) {
        index.apply_tls_policy(self);
    }
    fn delete(&self, index: &mut Index) {
        index.delete_tls_policy(&ObjKey::of(self));
    }
}

impl Indexed for AuthorizationPolicy {
    const KIND: &'static str = "AuthorizationPolicy";
    fn adopt(index: &mut Index, listed: &mut Index) {
        index.authorization_policies = std::mem::take(&mut listed.authorization_policies);
    }
    fn apply(&self, index: &mut Index) {
        index.apply_authorization_policy(self);
    }
    fn delete(&self, index: &mut Index) {
        index.delete_authorization_policy(&ObjKey::of(self));
    }
}

impl Indexed for Namespace {
    const KIND: &'static str = "Namespace";
    fn adopt(index: &mut Index, listed: &mut Index) {
        index.namespace_defaults = std::mem::take(&mut listed.namespace_defaults);
    }
    fn apply(&self, index: &mut Index) {
        index.apply_namespace(self);
    }
    fn delete(&self, index: &mut Index) {
        index.delete_namespace(&kube::ResourceExt::name_any(self));
    }
}

/// Counts kinds still waiting for their first complete list.
#[derive(Debug)]
struct Resync {
    hub: Arc<Hub>,
    pending: AtomicUsize,
}

impl Resync {
    fn listed_once(&self) {
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            tracing::info!("every kind listed; config pushes start");
            self.hub.mark_synced();
        }
    }
}

/// Feeds one kind's watch events into the hub; returns only if the watch
/// stream ends (it retries internally with back-off).
async fn feed<K: Indexed>(
    api: Api<K>,
    config: watcher::Config,
    hub: Arc<Hub>,
    resync: Arc<Resync>,
) {
    // A relist is indexed on the side as it arrives, in the index's compact
    // form: buffering the listed objects whole held every injected Pod at
    // once (tens of KiB each) at every start and relist.
    let mut listed = Index::default();
    let mut first = true;
    let mut events = watcher::watcher(api, config).default_backoff().boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Apply(obj)) => hub.update(|ix| obj.apply(ix)),
            Ok(Event::Delete(obj)) => hub.update(|ix| obj.delete(ix)),
            Ok(Event::Init) => listed = Index::default(),
            Ok(Event::InitApply(obj)) => obj.apply(&mut listed),
            Ok(Event::InitDone) => {
                hub.update(|ix| K::adopt(ix, &mut listed));
                if std::mem::take(&mut first) {
                    resync.listed_once();
                }
            }
            Err(error) => {
                hub.metrics()
                    .watch_errors
                    .get_or_create(&super::metrics::WatchLabels { kind: K::KIND })
                    .inc();
                tracing::warn!(kind = K::KIND, %error, "watch failed; retrying");
            }
        }
    }
}

/// Runs every watcher until the process ends.
pub async fn run(client: Client, hub: Arc<Hub>) {
    let source = endpoints_source(&client).await;
    tracing::info!(?source, "endpoints source chosen by discovery");
    let resync = Arc::new(Resync {
        hub: hub.clone(),
        pending: AtomicUsize::new(7),
    });
    let all = watcher::Config::default();
    let injected =
        watcher::Config::default().labels(&format!("{}=true", contract::labels::INJECTED));
    let endpoints = match source {
        EndpointsSource::Slices => tokio::spawn(feed(
            Api::<EndpointSlice>::all(client.clone()),
            all.clone(),
            hub.clone(),
            resync.clone(),
        )),
        EndpointsSource::CoreV1 => tokio::spawn(feed(
            Api::<Endpoints>::all(client.clone()),
            all.clone(),
            hub.clone(),
            resync.clone(),
        )),
    };
    let _ = tokio::join!(
        endpoints,
        feed(
            Api::<Service>::all(client.clone()),
            all.clone(),
            hub.clone(),
            resync.clone()
        ),
        feed(
            Api::<Pod>::all(client.clone()),
            injected,
            hub.clone(),
            resync.clone()
        ),
        feed(
            Api::<Route>::all(client.clone()),
            all.clone(),
            hub.clone(),
            resync.clone()
        ),
        feed(
            Api::<TlsPolicy>::all(client.clone()),
            all.clone(),
            hub.clone(),
            resync.clone()
        ),
        feed(
            Api::<AuthorizationPolicy>::all(client.clone()),
            all.clone(),
            hub.clone(),
            resync.clone()
        ),
        feed(Api::<Namespace>::all(client), all, hub, resync),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "shop",
                         "labels": {(contract::labels::INJECTED): "true"}},
            "spec": {"containers": [{"name": "app"}]}
        }))
        .unwrap()
    }

    #[test]
    fn a_relist_replaces_its_kind_and_leaves_the_others() {
        let mut index = Index::default();
        pod("gone").apply(&mut index);
        let svc: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "shop"}, "spec": {}
        }))
        .unwrap();
        svc.apply(&mut index);
        let mut listed = Index::default();
        pod("kept").apply(&mut listed);
        Pod::adopt(&mut index, &mut listed);
        let pods: Vec<_> = index.pods.keys().map(|k| k.name.as_str()).collect();
        assert_eq!(pods, ["kept"]);
        assert_eq!(index.services.len(), 1, "other kinds are untouched");
        assert!(listed.pods.is_empty(), "moved, not copied");
    }
}
