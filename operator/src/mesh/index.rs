//! In-memory indexes of what the config compiler reads: Services, their
//! endpoints, injected Pods, Routes, TlsPolicies, AuthorizationPolicies and
//! the namespaces' default-authorization annotations.
//!
//! Why our own index rather than kube-runtime's reflector stores: the
//! compiler runs for every affected sidecar on every change, so it must read
//! small, pre-digested records (a Service's ports and ClusterIP, an
//! endpoint's address and readiness) instead of walking full API objects;
//! and each kind of endpoints object (`discovery.k8s.io/v1` EndpointSlices
//! or core/v1 Endpoints, whichever the API server serves) lands in one
//! shape. Everything here is pure: `apply_*`/`delete_*` take the API object,
//! so unit tests feed objects straight in with no API server (linkerd2's
//! policy controller index is the model).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use baton_crds::contract;
use baton_crds::{AuthorizationPolicy, Route, TlsPolicy};
use k8s_openapi::api::core::v1::{Container, Endpoints, Namespace, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

/// A namespaced object's name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjKey {
    pub namespace: String,
    pub name: String,
}

impl ObjKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// The key of a namespaced API object (`default` namespace when unset).
    pub fn of<K: kube::Resource>(obj: &K) -> Self {
        Self::new(
            obj.meta().namespace.as_deref().unwrap_or("default"),
            obj.meta().name.as_deref().unwrap_or_default(),
        )
    }
}

impl std::fmt::Display for ObjKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One port of a Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePortInfo {
    pub port: u16,
    /// Port name; endpoints name their ports after it.
    pub name: Option<String>,
    /// Only TCP ports are meshed (the sidecar proxies TCP).
    pub tcp: bool,
}

/// What the compiler needs of a Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceInfo {
    /// `None` for headless Services.
    pub cluster_ip: Option<IpAddr>,
    pub ports: Vec<ServicePortInfo>,
}

/// One endpoint address of a Service and the ports it serves, by the
/// Service port's name (`""` for an unnamed port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInfo {
    pub ip: IpAddr,
    pub ready: bool,
    /// The Pod behind the address (`targetRef`), when it is one.
    pub pod: Option<ObjKey>,
    pub ports: BTreeMap<String, u16>,
}

/// What the compiler needs of an injected Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    pub ip: Option<IpAddr>,
    pub labels: BTreeMap<String, String>,
    pub service_account: String,
    pub ready: bool,
    /// Not Ready only because a sidecar slot restarts for a hot upgrade's
    /// image swap while the serving slot serves: see [`serving_through_swap`].
    pub serving_through_swap: bool,
    /// Carries Baton's sidecar (the webhook's `baton.dev/injected` label).
    pub injected: bool,
    /// The application containers' httpGet probes (port, path without the
    /// query), which the inbound authorization lets through.
    pub probes: Vec<(u16, String)>,
    /// The `baton.dev/access-log: "true"` annotation.
    pub access_log: bool,
    /// Named container ports of the application containers (name → port),
    /// which AuthorizationPolicy `ports` names resolve against.
    pub port_names: BTreeMap<String, u16>,
}

/// The named ports of the Pod's application containers (not the sidecar
/// slots'); the first container declaring a name wins, as for probes.
pub fn port_names(pod: &Pod) -> BTreeMap<String, u16> {
    let mut out = BTreeMap::new();
    for c in pod.spec.iter().flat_map(|s| s.containers.iter()) {
        if c.name == contract::containers::SLOT_A || c.name == contract::containers::SLOT_B {
            continue;
        }
        for p in c.ports.iter().flatten() {
            if let (Some(name), Ok(port)) = (&p.name, u16::try_from(p.container_port)) {
                out.entry(name.clone()).or_insert(port);
            }
        }
    }
    out
}

/// Every httpGet probe (readiness, liveness, startup) of the Pod's
/// application containers: the kubelet sends them through the inbound
/// sidecar, so authorization must admit them. A named port is resolved
/// against the container's own ports; one that names none is skipped.
pub fn http_probes(pod: &Pod) -> Vec<(u16, String)> {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let is_sidecar = |c: &Container| {
        c.name == contract::containers::SLOT_A || c.name == contract::containers::SLOT_B
    };
    let mut out: Vec<(u16, String)> = pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .filter(|c| !is_sidecar(c))
        .flat_map(|c| {
            [&c.readiness_probe, &c.liveness_probe, &c.startup_probe]
                .into_iter()
                .flatten()
                .filter_map(|p| p.http_get.as_ref())
                .filter_map(move |h| {
                    let port = match &h.port {
                        IntOrString::Int(n) => u16::try_from(*n).ok()?,
                        IntOrString::String(name) => c
                            .ports
                            .iter()
                            .flatten()
                            .find(|p| p.name.as_deref() == Some(name.as_str()))
                            .and_then(|p| u16::try_from(p.container_port).ok())?,
                    };
                    let path = h.path.as_deref().unwrap_or("/");
                    let path = path.split(['?', '#']).next().unwrap_or("/");
                    let path = if path.starts_with('/') {
                        path.to_owned()
                    } else {
                        format!("/{path}")
                    };
                    Some((port, path))
                })
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Whether a Pod serves although the API may call it not Ready, because a
/// hot upgrade restarts one of its sidecar slots.
///
/// A hot upgrade swaps a slot's image (the standby's to the new version,
/// then the retired slot's back to the idle image), and the kubelet
/// restarts that container: for those seconds the Pod's `Ready` condition
/// is False and the endpoints controller lists its address as not ready,
/// although the other slot keeps serving every connection. Dropping the
/// address would make a Service whose Pods upgrade together (maxUnavailable
/// ≥ 2 of a few Pods) briefly have no endpoints for meshed clients — 226 of
/// 15,500 requests were answered 503 "no endpoints" that way (#33). So the
/// mesh keeps such a Pod while every application container is ready and the
/// slot that serves (the active one, or the one an upgrade in progress
/// moves to) is ready — or, on a Pod a hot upgrade has touched, running:
/// after a takeover the old slot's probe turns false before the new slot's
/// first probe passes — and a slot restarts or an upgrade is under way.
/// Anything else — an application container not ready, a terminating Pod,
/// no serving slot — follows the API's readiness. (The slot and record are
/// read here, not with `rollout::plan`'s types: `mesh` must not depend on
/// `rollout`, whose status reaches back into it.)
pub fn serving_through_swap(pod: &Pod) -> bool {
    use contract::{annotations, containers};
    if pod.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let Some(statuses) = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
    else {
        return false;
    };
    let slot_name = |slot: &str| match slot {
        "a" => Some(containers::SLOT_A),
        "b" => Some(containers::SLOT_B),
        _ => None,
    };
    let ann = pod.annotations();
    let upgrade = ann.get(annotations::UPGRADE);
    let upgrade_slot = upgrade
        .and_then(|u| serde_json::from_str::<serde_json::Value>(u).ok())
        .and_then(|v| v.get("slot")?.as_str().and_then(slot_name));
    let active_slot = ann.get(annotations::ACTIVE_SLOT).and_then(|s| slot_name(s));
    let is_slot = |name: &str| name == containers::SLOT_A || name == containers::SLOT_B;
    let apps_ready = statuses
        .iter()
        .filter(|c| !is_slot(&c.name))
        .all(|c| c.ready);
    // Running, not ready: after a takeover the old slot's probe turns
    // false before the new slot's first probe passes, while the new
    // process already serves the moved listeners. Only for Pods a hot
    // upgrade has touched (a record in progress or a finished one), so a
    // Pod that is still starting keeps Kubernetes' readiness.
    let upgraded = upgrade.is_some() || ann.contains_key(annotations::LAST_HANDOFF);
    let serving_slot_running = statuses.iter().any(|c| {
        let serving = Some(c.name.as_str()) == active_slot || Some(c.name.as_str()) == upgrade_slot;
        let running = c.state.as_ref().is_some_and(|s| s.running.is_some());
        serving && (c.ready || (upgraded && running))
    });
    let slot_restarting = statuses.iter().any(|c| is_slot(&c.name) && !c.ready);
    apps_ready && serving_slot_running && (slot_restarting || upgrade.is_some())
}

/// Everything the compiler reads, keyed for lookups by the compiler.
#[derive(Debug, Default, Clone)]
pub struct Index {
    pub services: BTreeMap<ObjKey, ServiceInfo>,
    /// Service → endpoints source (one EndpointSlice, or the Service's one
    /// Endpoints object, by name) → its endpoints. Slices of one Service are
    /// kept apart so a slice's update replaces only its own addresses.
    pub endpoints: BTreeMap<ObjKey, BTreeMap<String, Vec<EndpointInfo>>>,
    pub pods: BTreeMap<ObjKey, PodInfo>,
    pub routes: BTreeMap<ObjKey, Arc<Route>>,
    pub tls_policies: BTreeMap<ObjKey, Arc<TlsPolicy>>,
    pub authorization_policies: BTreeMap<ObjKey, Arc<AuthorizationPolicy>>,
    /// Namespace → its `baton.dev/default-authorization` annotation, for
    /// namespaces that carry one.
    pub namespace_defaults: BTreeMap<String, String>,
}

/// Label of an EndpointSlice naming its Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

impl Index {
    pub fn apply_service(&mut self, svc: &Service) {
        let spec = svc.spec.as_ref();
        let cluster_ip = spec
            .and_then(|s| s.cluster_ip.as_deref())
            .and_then(|ip| ip.parse().ok());
        let ports = spec
            .and_then(|s| s.ports.as_ref())
            .map(|ports| {
                ports
                    .iter()
                    .filter_map(|p| {
                        Some(ServicePortInfo {
                            port: u16::try_from(p.port).ok()?,
                            name: p.name.clone().filter(|n| !n.is_empty()),
                            tcp: p.protocol.as_deref().is_none_or(|p| p == "TCP"),
                        })
                    })
                    .collect()
            })
            .unwrap_or_default();
        self.services
            .insert(ObjKey::of(svc), ServiceInfo { cluster_ip, ports });
    }

    pub fn delete_service(&mut self, key: &ObjKey) {
        self.services.remove(key);
    }

    /// An EndpointSlice replaces what the same slice said before. Addresses
    /// without a `ready` condition count as ready (the API's rule).
    pub fn apply_endpoint_slice(&mut self, slice: &EndpointSlice) {
        let Some(service) = slice_service(slice) else {
            return;
        };
        let ports = port_map(slice.ports.iter().flatten().map(|p| (&p.name, p.port)));
        let endpoints = slice
            .endpoints
            .iter()
            .flat_map(|e| {
                let ready = e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
                let pod = pod_ref(e.target_ref.as_ref(), &service.namespace);
                let ports = ports.clone();
                e.addresses.iter().filter_map(move |a| {
                    Some(EndpointInfo {
                        ip: a.parse().ok()?,
                        ready,
                        pod: pod.clone(),
                        ports: ports.clone(),
                    })
                })
            })
            .collect();
        self.endpoints
            .entry(service)
            .or_default()
            .insert(slice.name_any(), endpoints);
    }

    pub fn delete_endpoint_slice(&mut self, slice: &EndpointSlice) {
        if let Some(service) = slice_service(slice) {
            self.remove_endpoints_source(&service, &slice.name_any());
        }
    }

    /// core/v1 Endpoints (API servers without `discovery.k8s.io/v1`): one
    /// object per Service, same name; `notReadyAddresses` are not ready.
    pub fn apply_endpoints(&mut self, eps: &Endpoints) {
        let service = ObjKey::of(eps);
        let mut endpoints = Vec::new();
        for subset in eps.subsets.iter().flatten() {
            let ports = port_map(
                subset
                    .ports
                    .iter()
                    .flatten()
                    .map(|p| (&p.name, Some(p.port))),
            );
            for (list, ready) in [
                (&subset.addresses, true),
                (&subset.not_ready_addresses, false),
            ] {
                for a in list.iter().flatten() {
                    let Ok(ip) = a.ip.parse() else { continue };
                    endpoints.push(EndpointInfo {
                        ip,
                        ready,
                        pod: pod_ref(a.target_ref.as_ref(), &service.namespace),
                        ports: ports.clone(),
                    });
                }
            }
        }
        let source = service.name.clone();
        self.endpoints
            .entry(service)
            .or_default()
            .insert(source, endpoints);
    }

    pub fn delete_endpoints(&mut self, key: &ObjKey) {
        self.remove_endpoints_source(key, &key.name.clone());
    }

    fn remove_endpoints_source(&mut self, service: &ObjKey, source: &str) {
        if let Some(sources) = self.endpoints.get_mut(service) {
            sources.remove(source);
            if sources.is_empty() {
                self.endpoints.remove(service);
            }
        }
    }

    pub fn apply_pod(&mut self, pod: &Pod) {
        let status = pod.status.as_ref();
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let info = PodInfo {
            ip: status
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|ip| ip.parse().ok()),
            labels: pod.labels().clone(),
            service_account: pod
                .spec
                .as_ref()
                .and_then(|s| s.service_account_name.clone())
                .unwrap_or_else(|| "default".into()),
            ready,
            serving_through_swap: serving_through_swap(pod),
            injected: pod
                .labels()
                .get(contract::labels::INJECTED)
                .is_some_and(|v| v == "true"),
            probes: http_probes(pod),
            port_names: port_names(pod),
            access_log: pod
                .annotations()
                .get(contract::annotations::ACCESS_LOG)
                .is_some_and(|v| v == "true"),
        };
        self.pods.insert(ObjKey::of(pod), info);
    }

    pub fn delete_pod(&mut self, key: &ObjKey) {
        self.pods.remove(key);
    }

    pub fn apply_route(&mut self, route: &Route) {
        self.routes
            .insert(ObjKey::of(route), Arc::new(route.clone()));
    }

    pub fn delete_route(&mut self, key: &ObjKey) {
        self.routes.remove(key);
    }

    pub fn apply_tls_policy(&mut self, policy: &TlsPolicy) {
        self.tls_policies
            .insert(ObjKey::of(policy), Arc::new(policy.clone()));
    }

    pub fn delete_tls_policy(&mut self, key: &ObjKey) {
        self.tls_policies.remove(key);
    }

    pub fn apply_authorization_policy(&mut self, policy: &AuthorizationPolicy) {
        self.authorization_policies
            .insert(ObjKey::of(policy), Arc::new(policy.clone()));
    }

    pub fn delete_authorization_policy(&mut self, key: &ObjKey) {
        self.authorization_policies.remove(key);
    }

    /// A Namespace's default-authorization annotation (only the annotation
    /// is kept: a namespace without one takes no room).
    pub fn apply_namespace(&mut self, ns: &Namespace) {
        let name = ns.name_any();
        match ns
            .annotations()
            .get(contract::annotations::DEFAULT_AUTHORIZATION)
        {
            Some(v) => {
                self.namespace_defaults.insert(name, v.clone());
            }
            None => {
                self.namespace_defaults.remove(&name);
            }
        }
    }

    pub fn delete_namespace(&mut self, name: &str) {
        self.namespace_defaults.remove(name);
    }

    /// The endpoints of `service` (every source merged, duplicates of one
    /// address kept once, ready wins).
    pub fn service_endpoints(&self, service: &ObjKey) -> Vec<&EndpointInfo> {
        let mut seen = BTreeSet::new();
        let mut all: Vec<&EndpointInfo> = self
            .endpoints
            .get(service)
            .into_iter()
            .flat_map(|sources| sources.values().flatten())
            .collect();
        // Ready addresses first so a duplicate not-ready copy never hides one.
        all.sort_by_key(|e| (!e.ready, e.ip));
        all.retain(|e| seen.insert(e.ip));
        all
    }
}

/// Endpoint ports by name (`""` for the unnamed port); out-of-range
/// numbers are dropped.
fn port_map<'a>(
    ports: impl Iterator<Item = (&'a Option<String>, Option<i32>)>,
) -> BTreeMap<String, u16> {
    ports
        .filter_map(|(name, port)| {
            Some((name.clone().unwrap_or_default(), u16::try_from(port?).ok()?))
        })
        .collect()
}

/// The Service an EndpointSlice belongs to (its `kubernetes.io/service-name`
/// label), `None` for slices no Service owns.
fn slice_service(slice: &EndpointSlice) -> Option<ObjKey> {
    let name = slice.labels().get(SERVICE_NAME_LABEL)?;
    Some(ObjKey::new(
        slice.namespace().unwrap_or_else(|| "default".into()),
        name.clone(),
    ))
}

fn pod_ref(
    target: Option<&k8s_openapi::api::core::v1::ObjectReference>,
    namespace: &str,
) -> Option<ObjKey> {
    let t = target?;
    (t.kind.as_deref() == Some("Pod")).then(|| {
        ObjKey::new(
            t.namespace.as_deref().unwrap_or(namespace),
            t.name.clone().unwrap_or_default(),
        )
    })
}

/// A Route's age for conflict resolution: older wins; equal timestamps are
/// ordered by name so the outcome never depends on event order.
pub fn creation(route: &Route) -> (Option<&Time>, String) {
    (route.metadata.creation_timestamp.as_ref(), route.name_any())
}
