//! In-memory caches feeding admission: kube-runtime reflectors on the
//! objects `mutate` and `validate` read, plus the API server's version.
//!
//! Admission never calls the API server on its hot path (the timeout budget
//! is a few seconds and pods are created in bursts); it reads a
//! [`Snapshot`] of these stores. Readiness (`/ready`) waits until every
//! store has received its initial list, so a fresh replica never answers
//! "no SidecarRelease selects this pod" just because it has not listed yet.

use std::{
    collections::BTreeMap,
    fmt::Debug,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use arc_swap::ArcSwapOption;
use baton_controlplane::reflect::{self, trim_managed_fields};
use baton_crds::{AcceleratorPool, Route, SidecarRelease, TlsPolicy, tls_policy::OffloadMode};
use k8s_openapi::api::core::v1::{ConfigMap, Container, Namespace, Node, Pod, PodSpec};
use kube::{
    Api, Client, Resource,
    runtime::{
        reflector::{ObjectRef, Store},
        watcher,
    },
};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::{
    inject::{ClusterView, ServerVersion},
    validate::{PodPorts, ValidationView},
};

/// The caches' contents at one instant, owned (cheap: `Arc`s).
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub namespace: String,
    pub namespace_labels: BTreeMap<String, String>,
    pub releases: Vec<Arc<SidecarRelease>>,
    pub tls_policies: Vec<Arc<TlsPolicy>>,
    pub pools: Vec<Arc<AcceleratorPool>>,
    pub nodes: Vec<Arc<Node>>,
    pub routes: Vec<Arc<Route>>,
    pub server_version: Option<ServerVersion>,
    /// Filled by the handler from its grant ledger, not by the caches.
    pub recent_grants: Vec<crate::inject::RecentGrant>,
    /// Filled by the handler: the admission request's uid.
    pub grant_id: String,
    /// The namespace's Pods, for AuthorizationPolicy port names: only what
    /// [`ClusterState::pods`] returns (the reflector-backed snapshot leaves
    /// it empty, Pod admissions never read it).
    pub pods: Vec<PodPorts>,
    /// The mesh trust bundle (PEM) of ConfigMap `baton-mesh-trust` in the
    /// operator's namespace, copied into every injected Pod.
    pub trust_bundle: Option<Arc<str>>,
}

impl Snapshot {
    /// The view `mutate` reads. An unknown server version counts as the
    /// oldest supported (ordinary containers work everywhere).
    pub fn cluster_view(&self) -> ClusterView<'_> {
        ClusterView {
            namespace: &self.namespace,
            namespace_labels: &self.namespace_labels,
            releases: &self.releases,
            tls_policies: &self.tls_policies,
            pools: &self.pools,
            nodes: &self.nodes,
            recent_grants: &self.recent_grants,
            grant_id: &self.grant_id,
            server_version: self.server_version.unwrap_or(ServerVersion::new(1, 0)),
            trust_bundle: self.trust_bundle.as_deref(),
        }
    }

    pub fn validation_view(&self) -> ValidationView<'_> {
        ValidationView {
            tls_policies: &self.tls_policies,
            routes: &self.routes,
            // A setting, not cluster state: the handler fills it in.
            trust_domain: "",
            pods: &self.pods,
        }
    }
}

/// Where admission gets cluster state from: the reflectors in production,
/// a fixed [`Snapshot`] in tests.
pub trait ClusterState: Send + Sync + 'static {
    /// State relevant to an object in `namespace`, and whether the
    /// namespace itself is known (a fresh namespace may not be cached yet).
    fn snapshot(&self, namespace: &str) -> (Snapshot, bool);
    /// Every cache has listed at least once and the version is known.
    fn is_synced(&self) -> bool;
    /// The Pods of `namespace` as port-name validation sees them (only
    /// AuthorizationPolicy reviews ask: copying them for every Pod
    /// admission would cost for nothing).
    fn pods(&self, namespace: &str) -> Vec<PodPorts> {
        self.snapshot(namespace).0.pods
    }
}

/// A fixed state (tests and benchmarks).
#[derive(Debug, Clone)]
pub struct StaticState(pub Snapshot);

impl ClusterState for StaticState {
    fn snapshot(&self, namespace: &str) -> (Snapshot, bool) {
        let mut s = self.0.clone();
        s.namespace = namespace.to_owned();
        (s, true)
    }

    fn is_synced(&self) -> bool {
        true
    }
}

/// The reflector-backed caches.
#[derive(Clone)]
pub struct Caches {
    releases: Store<SidecarRelease>,
    tls_policies: Store<TlsPolicy>,
    pools: Store<AcceleratorPool>,
    routes: Store<Route>,
    namespaces: Store<Namespace>,
    nodes: Store<Node>,
    pods: Store<Pod>,
    /// ConfigMap `baton-mesh-trust` of the operator's namespace, alone.
    trust: Store<ConfigMap>,
    trust_namespace: String,
    synced: Arc<AtomicBool>,
    version: Arc<ArcSwapOption<ServerVersion>>,
}

impl Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches")
            .field("synced", &self.synced.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A reflector that stops with the webhook (the setup is
/// [`baton_controlplane::reflect`]'s, shared with the operator).
fn spawn_reflector<K>(api: Api<K>, trim: fn(&mut K), stop: CancellationToken) -> Store<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    reflect::spawn(api, trim, || {}, stop.cancelled_owned())
}

impl Caches {
    /// Starts every reflector and the version poller; returns immediately.
    /// `trust_namespace`: the operator's, where it publishes the mesh
    /// trust bundle.
    pub fn start(client: Client, trust_namespace: &str, stop: CancellationToken) -> Self {
        let caches = Self {
            releases: spawn_reflector(
                Api::all(client.clone()),
                |o: &mut SidecarRelease| trim_managed_fields(&mut o.metadata),
                stop.clone(),
            ),
            tls_policies: spawn_reflector(
                Api::all(client.clone()),
                |o: &mut TlsPolicy| trim_managed_fields(&mut o.metadata),
                stop.clone(),
            ),
            pools: spawn_reflector(
                Api::all(client.clone()),
                |o: &mut AcceleratorPool| trim_managed_fields(&mut o.metadata),
                stop.clone(),
            ),
            routes: spawn_reflector(
                Api::all(client.clone()),
                |o: &mut Route| trim_managed_fields(&mut o.metadata),
                stop.clone(),
            ),
            namespaces: spawn_reflector(
                Api::all(client.clone()),
                |n: &mut Namespace| {
                    trim_managed_fields(&mut n.metadata);
                    n.metadata.annotations = None;
                },
                stop.clone(),
            ),
            nodes: spawn_reflector(
                Api::all(client.clone()),
                |n: &mut Node| {
                    // Only labels and allocatable are read: drop the bulk
                    // (images alone can be tens of kilobytes per node).
                    trim_managed_fields(&mut n.metadata);
                    n.metadata.annotations = None;
                    if let Some(s) = n.status.as_mut() {
                        s.images = None;
                        s.conditions = None;
                        s.volumes_attached = None;
                        s.volumes_in_use = None;
                    }
                },
                stop.clone(),
            ),
            pods: spawn_reflector(Api::all(client.clone()), trim_pod, stop.clone()),
            // One object by name (RBAC: get, list, watch on that name only).
            trust: reflect::spawn_with(
                Api::namespaced(client.clone(), trust_namespace),
                watcher::Config::default().fields(&format!(
                    "metadata.name={}",
                    baton_crds::contract::identity::TRUST_CONFIG_MAP
                )),
                |c: &mut ConfigMap| trim_managed_fields(&mut c.metadata),
                || {},
                stop.clone().cancelled_owned(),
            ),
            trust_namespace: trust_namespace.to_owned(),
            synced: Arc::new(AtomicBool::new(false)),
            version: Arc::new(ArcSwapOption::empty()),
        };
        let me = caches.clone();
        let stop2 = stop.clone();
        tokio::spawn(async move {
            let all = async {
                me.releases.wait_until_ready().await.ok();
                me.tls_policies.wait_until_ready().await.ok();
                me.pools.wait_until_ready().await.ok();
                me.routes.wait_until_ready().await.ok();
                me.namespaces.wait_until_ready().await.ok();
                me.nodes.wait_until_ready().await.ok();
                me.pods.wait_until_ready().await.ok();
                me.trust.wait_until_ready().await.ok();
            };
            tokio::select! {
                () = stop2.cancelled() => {}
                () = all => {
                    me.synced.store(true, Ordering::Release);
                    tracing::info!("caches synced");
                }
            }
        });
        let version = caches.version.clone();
        tokio::spawn(async move {
            // The version decides native vs ordinary sidecars; clusters are
            // upgraded under running webhooks, so it is re-read periodically.
            loop {
                let wait = match client.apiserver_version().await {
                    Ok(info) => {
                        match ServerVersion::parse(&info.major, &info.minor) {
                            Some(v) => {
                                if version.load().as_deref() != Some(&v) {
                                    tracing::info!(version = %v, native_sidecars = v.supports_native_sidecars(), "API server version");
                                }
                                version.store(Some(Arc::new(v)));
                            }
                            None => {
                                tracing::warn!(major = %info.major, minor = %info.minor, "unparsable API server version")
                            }
                        }
                        Duration::from_secs(300)
                    }
                    Err(error) => {
                        tracing::warn!(%error, "cannot read the API server version");
                        Duration::from_secs(5)
                    }
                };
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(wait) => {}
                }
            }
        });
        caches
    }
}

impl ClusterState for Caches {
    fn snapshot(&self, namespace: &str) -> (Snapshot, bool) {
        let ns = self.namespaces.get(&ObjectRef::new(namespace));
        let known = ns.is_some();
        let tls_policies = self
            .tls_policies
            .state_filter(|p| p.metadata.namespace.as_deref() == Some(namespace));
        // Pools and nodes only matter to offload: skip copying them (there
        // may be thousands of nodes) unless a policy here asks for it.
        let offload = tls_policies
            .iter()
            .any(|p| p.spec.private_key_offload.mode != OffloadMode::Disabled);
        let snapshot = Snapshot {
            namespace: namespace.to_owned(),
            namespace_labels: ns
                .and_then(|n| n.metadata.labels.clone())
                .unwrap_or_default(),
            releases: self.releases.state(),
            tls_policies,
            pools: if offload {
                self.pools.state()
            } else {
                Vec::new()
            },
            nodes: if offload {
                self.nodes.state()
            } else {
                Vec::new()
            },
            routes: self
                .routes
                .state_filter(|r| r.metadata.namespace.as_deref() == Some(namespace)),
            server_version: self.version.load().as_deref().copied(),
            recent_grants: Vec::new(),
            grant_id: String::new(),
            pods: Vec::new(),
            trust_bundle: self
                .trust
                .get(
                    &ObjectRef::new(baton_crds::contract::identity::TRUST_CONFIG_MAP)
                        .within(&self.trust_namespace),
                )
                .as_deref()
                .and_then(trust_bundle),
        };
        (snapshot, known)
    }

    fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire) && self.version.load().is_some()
    }

    fn pods(&self, namespace: &str) -> Vec<PodPorts> {
        self.pods
            .state_filter(|p| p.metadata.namespace.as_deref() == Some(namespace))
            .iter()
            .map(|p| PodPorts::of(p))
            .collect()
    }
}

/// The bundle of a `baton-mesh-trust` ConfigMap; `None` when it holds none
/// (no certificate: nothing a sidecar could verify the operator with).
pub fn trust_bundle(cm: &ConfigMap) -> Option<Arc<str>> {
    cm.data
        .as_ref()?
        .get(baton_crds::contract::identity::TRUST_KEY)
        .filter(|pem| pem.contains("-----BEGIN CERTIFICATE-----"))
        .map(|pem| Arc::from(pem.as_str()))
}

/// Keeps of a cached Pod only what [`PodPorts`] reads: name, namespace,
/// labels and its containers' names and ports. A cluster's Pods are its
/// most numerous objects; whole ones (env, volumes, status) would be most
/// of the webhook's memory.
fn trim_pod(p: &mut Pod) {
    trim_managed_fields(&mut p.metadata);
    p.metadata.annotations = None;
    p.metadata.owner_references = None;
    p.status = None;
    if let Some(spec) = p.spec.as_mut() {
        let containers = std::mem::take(&mut spec.containers)
            .into_iter()
            .map(|c| Container {
                name: c.name,
                ports: c.ports,
                ..Container::default()
            })
            .collect();
        *spec = PodSpec {
            containers,
            ..PodSpec::default()
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trimmed_pod_keeps_what_port_names_read_and_drops_the_rest() {
        let mut pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web-1", "namespace": "shop", "labels": {"app": "web"},
                         "annotations": {"big": "x"}},
            "spec": {"serviceAccountName": "web", "volumes": [{"name": "v", "emptyDir": {}}],
                     "containers": [
                {"name": "app", "image": "web", "env": [{"name": "A", "value": "1"}],
                 "ports": [{"name": "http", "containerPort": 8080}, {"containerPort": 9000}]},
                {"name": "baton-sidecar-a", "image": "s",
                 "ports": [{"name": "admin", "containerPort": 15021}]}]},
            "status": {"podIP": "10.0.0.1"}
        }))
        .unwrap();
        let before = PodPorts::of(&pod);
        trim_pod(&mut pod);
        assert_eq!(PodPorts::of(&pod), before);
        assert_eq!(
            before.port_names.iter().collect::<Vec<_>>(),
            ["http"],
            "the sidecar's own ports are not the application's"
        );
        let spec = pod.spec.as_ref().unwrap();
        assert!(spec.volumes.is_none() && spec.service_account_name.is_none());
        assert!(spec.containers[0].env.is_none() && spec.containers[0].image.is_none());
        assert!(pod.status.is_none() && pod.metadata.annotations.is_none());
    }
}
