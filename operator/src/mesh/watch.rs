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
//! are buffered until `InitDone` and swapped in with one index update, so a
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
    /// Remove every object of this kind (before a relist is swapped in).
    fn clear(index: &mut Index);
    fn apply(&self, index: &mut Index);
    fn delete(&self, index: &mut Index);
}

impl Indexed for Service {
    const KIND: &'static str = "Service";
    fn clear(index: &mut Index) {
        index.services.clear();
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
    fn clear(index: &mut Index) {
        index.endpoints.clear();
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
    fn clear(index: &mut Index) {
        index.endpoints.clear();
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
    fn clear(index: &mut Index) {
        index.pods.clear();
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
    fn clear(index: &mut Index) {
        index.routes.clear();
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
    fn clear(index: &mut Index) {
        index.tls_policies.clear();
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
    fn clear(index: &mut Index) {
        index.authorization_policies.clear();
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
    fn clear(index: &mut Index) {
        index.namespace_defaults.clear();
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
    let mut buffer: Vec<K> = Vec::new();
    let mut first = true;
    let mut events = watcher::watcher(api, config).default_backoff().boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Apply(obj)) => hub.update(|ix| obj.apply(ix)),
            Ok(Event::Delete(obj)) => hub.update(|ix| obj.delete(ix)),
            Ok(Event::Init) => buffer.clear(),
            Ok(Event::InitApply(obj)) => buffer.push(obj),
            Ok(Event::InitDone) => {
                let listed = std::mem::take(&mut buffer);
                hub.update(|ix| {
                    K::clear(ix);
                    listed.iter().for_each(|o| o.apply(ix));
                });
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
