//! The pure heart of the control plane: (indexes, one workload) → that
//! workload's sidecar [`Snapshot`].
//!
//! Outbound, traffic a Pod sends to a Service — by its ClusterIP:port
//! (transparent capture; the Host header names the IP or a DNS name) or by
//! one of its DNS names — follows the Route attached to that Service port, or
//! goes straight to the Service's ready endpoints when none is. Routes match
//! on the Service's host names *and* its port, so two ports of one Service
//! stay apart. Inbound, the TlsPolicy selecting the Pod gives the mTLS mode,
//! versions, suites and offload mode; outbound clusters whose endpoints are
//! all meshed Pods that accept mTLS originate it, expecting their SPIFFE ID.
//! A tcp Route makes its Service port opaque: every new connection to the
//! ClusterIP and port picks one backend by weight (a sidecar `tcp_routes`
//! entry). Raw TCP to other Service ports goes to the Service's endpoints;
//! everything else (unknown destinations) keeps the in-pod default:
//! passthrough to the original destination.
//!
//! Route acceptance is decided once per index change by [`attach_routes`]
//! (validation, conflicts — the older Route wins — and missing backends),
//! because it is cluster-wide; [`compile`] then runs per workload. Both are
//! deterministic: the same index always yields the same snapshot, so the
//! push layer can tell "changed for this sidecar" by comparing snapshots.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;

use baton_config::{
    ClusterConfig, ClusterMtls, FaultAbort, FaultConfig, FaultDelay, HeaderRewrite,
    INBOUND_LISTENER, MatchConfig, MirrorConfig, OUTBOUND_LISTENER, PathMatch, RetryConfig,
    RouteConfig, Snapshot, TcpRouteConfig, TlsSettings, UpstreamProtocol, ValueMatch,
    WeightedBackend, tls,
};
use baton_crds::Validate;
use baton_crds::authorization_policy::DefaultAuthorization;
use baton_crds::common::parse_duration;
use baton_crds::route::{
    HeaderModifier, HttpMethod, PathMatchType, RouteMatch, RouteProtocol, RouteRule,
    StringMatchType,
};
use baton_crds::tls_policy::{MtlsMode, OffloadMode, TlsVersion};
use baton_crds::{Route, TlsPolicy};

use super::authz;
use super::index::{EndpointInfo, Index, ObjKey, ServiceInfo, creation};

/// Cluster-wide settings the compiled snapshots depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshParams {
    /// SPIFFE trust domain of workload identities.
    pub trust_domain: String,
    /// DNS suffix of the cluster (`cluster.local`).
    pub cluster_domain: String,
    /// Where sidecars get their certificates. `None`: no TLS section is
    /// compiled and every connection stays plaintext (a mesh without a CA).
    pub identity: Option<IdentitySource>,
    /// What inbound sides do with requests no AuthorizationPolicy decides,
    /// in namespaces without a `baton.dev/default-authorization` annotation.
    pub default_authorization: DefaultAuthorization,
}

/// The identity service as sidecars reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentitySource {
    /// `https://host:port/path` of the signing endpoint.
    pub url: String,
    /// CA bundle (path inside the sidecar) that authenticates it.
    pub ca_bundle: Option<PathBuf>,
}

/// Why an object is not (fully) used, as a status condition reason and a
/// message a user can act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: &'static str,
    pub message: String,
}

/// How one Route fared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteVerdict {
    /// `Ok` when valid and attached; else Accepted=False with this reason.
    pub accepted: Result<(), Refusal>,
    /// Backends (`name:port`) whose Service or port does not exist:
    /// ResolvedRefs=False. Traffic a rule sends there gets 503.
    pub unresolved: Vec<String>,
}

/// Route attachment for the whole cluster: which Route steers which Service
/// port, and every Route's verdict.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attachments {
    /// (Service, port) → the Route attached to it.
    pub by_parent: BTreeMap<(ObjKey, u16), ObjKey>,
    pub verdicts: BTreeMap<ObjKey, RouteVerdict>,
}

/// Decide which Routes are accepted (valid, parent exists, not conflicting)
/// and which backends resolve. Two Routes on one Service port: the older
/// (creationTimestamp, then name) wins, the newer is `Conflicted`.
pub fn attach_routes(index: &Index) -> Attachments {
    let mut out = Attachments::default();
    let mut claims: BTreeMap<(ObjKey, u16), Vec<&Route>> = BTreeMap::new();
    for (key, route) in &index.routes {
        let spec = &route.spec;
        let parent = ObjKey::new(&key.namespace, &spec.parent_ref.name);
        let port = u16::try_from(spec.parent_ref.port).unwrap_or(0);
        let unresolved = route_backends(&route.spec.rules)
            .filter(|(name, port)| !service_port_exists(index, &key.namespace, name, *port))
            .map(|(name, port)| format!("{name}:{port}"))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let accepted = if let Err(errors) = route.validate() {
            Err(Refusal {
                reason: "Invalid",
                message: baton_crds::validation::summarize(&errors),
            })
        } else if !service_port_exists(index, &key.namespace, &parent.name, port) {
            Err(Refusal {
                reason: "NoMatchingParent",
                message: format!("Service {parent} has no port {port}"),
            })
        } else if spec.protocol == RouteProtocol::Tcp
            && index
                .services
                .get(&parent)
                .and_then(|s| s.cluster_ip)
                .is_none()
        {
            // A raw connection names nothing but its destination address;
            // to a headless Service that is a Pod's IP, which no tcp route
            // can own (HTTP Routes still match such a Service by name).
            Err(Refusal {
                reason: "NoMatchingParent",
                message: format!(
                    "Service {parent} is headless: a tcp Route steers connections to a \
                     Service's ClusterIP, and it has none"
                ),
            })
        } else {
            claims.entry((parent, port)).or_default().push(route);
            Ok(())
        };
        out.verdicts.insert(
            key.clone(),
            RouteVerdict {
                accepted,
                unresolved,
            },
        );
    }
    for (parent, mut routes) in claims {
        routes.sort_by_key(|r| creation(r));
        let winner = ObjKey::of(routes[0]);
        for loser in &routes[1..] {
            if let Some(v) = out.verdicts.get_mut(&ObjKey::of(*loser)) {
                v.accepted = Err(Refusal {
                    reason: "Conflicted",
                    message: format!(
                        "Service {} port {} is already routed by the older Route {}",
                        parent.0, parent.1, winner.name
                    ),
                });
            }
        }
        out.by_parent.insert(parent, winner);
    }
    out
}

/// Every `(service name, port)` a Route's rules send traffic to (backends
/// and mirrors).
fn route_backends(rules: &[RouteRule]) -> impl Iterator<Item = (&str, u16)> {
    rules.iter().flat_map(|r| {
        r.backend_refs
            .iter()
            .map(|b| (b.name.as_str(), b.port))
            .chain(
                r.mirror
                    .iter()
                    .map(|m| (m.backend_ref.name.as_str(), m.backend_ref.port)),
            )
            .map(|(n, p)| (n, u16::try_from(p).unwrap_or(0)))
    })
}

fn service_port_exists(index: &Index, namespace: &str, name: &str, port: u16) -> bool {
    index
        .services
        .get(&ObjKey::new(namespace, name))
        .is_some_and(|s| s.ports.iter().any(|p| p.port == port))
}

/// Why a TlsPolicy cannot be programmed, if it cannot.
pub fn tls_policy_refusal(policy: &TlsPolicy) -> Option<Refusal> {
    if let Err(errors) = policy.validate() {
        return Some(Refusal {
            reason: "Invalid",
            message: baton_crds::validation::summarize(&errors),
        });
    }
    None
}

/// The TlsPolicy that applies to a Pod: among the accepted policies of its
/// namespace whose selector matches its labels, the alphabetically first
/// (the CRD's documented rule).
pub fn select_tls_policy<'i>(
    index: &'i Index,
    pod: &ObjKey,
) -> Option<(&'i ObjKey, &'i TlsPolicy)> {
    let info = index.pods.get(pod)?;
    index
        .tls_policies
        .range(ObjKey::new(&pod.namespace, "")..)
        .take_while(|(k, _)| k.namespace == pod.namespace)
        .find(|(_, p)| {
            baton_crds::selector::matches(&p.spec.pod_selector, &info.labels)
                && tls_policy_refusal(p).is_none()
        })
        .map(|(k, p)| (k, p.as_ref()))
}

/// The mTLS mode a meshed Pod's inbound side enforces; `None` when no
/// policy selects it (plaintext accepted, as without Baton).
fn inbound_mode(index: &Index, pod: &ObjKey) -> Option<MtlsMode> {
    select_tls_policy(index, pod).map(|(_, p)| p.spec.mtls.mode)
}

/// A workload's compiled config and what went into it (for status).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadConfig {
    /// Version 0: the push layer stamps the version it sends.
    pub snapshot: Snapshot,
    /// Routes programmed into this snapshot.
    pub routes: BTreeSet<ObjKey>,
    /// The TlsPolicy that gave its TLS settings.
    pub tls_policy: Option<ObjKey>,
    /// The AuthorizationPolicies compiled into its inbound authorization.
    pub authorization_policies: BTreeSet<ObjKey>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CompileError {
    #[error("pod {0} is not in the index")]
    UnknownPod(ObjKey),
}

/// Compile one Pod's snapshot. Pure: reads only its arguments.
/// Everything [`compile`]'s output depends on besides the index and the
/// parameters: Pods with equal keys compile to equal snapshots, so the push
/// hub compiles once per key. A change to [`compile`] that reads more of the
/// Pod must add it here (`pods_with_one_key_compile_alike` checks it).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CompileKey {
    Group {
        namespace: String,
        service_account: String,
        tls_policy: Option<ObjKey>,
        authorization_policies: Vec<ObjKey>,
        /// The Pod's httpGet probes and access-log annotation: inbound
        /// authorization and logging read them.
        probes: Vec<(u16, String)>,
        access_log: bool,
        /// The port names its AuthorizationPolicies list, as they resolve
        /// on the Pod.
        port_names: Vec<(String, Option<u16>)>,
    },
    /// A Pod the index does not hold (its compile fails on its own).
    Unknown(ObjKey),
}

pub fn compile_key(index: &Index, trust_domain: &str, pod: &ObjKey) -> CompileKey {
    match index.pods.get(pod) {
        Some(info) => {
            let authorization = authz::select(index, trust_domain, pod);
            CompileKey::Group {
                namespace: pod.namespace.clone(),
                service_account: info.service_account.clone(),
                tls_policy: select_tls_policy(index, pod).map(|(k, _)| k.clone()),
                port_names: authz::resolved_names(info, &authorization),
                authorization_policies: authorization.into_iter().map(|(k, _)| k.clone()).collect(),
                probes: info.probes.clone(),
                access_log: info.access_log,
            }
        }
        None => CompileKey::Unknown(pod.clone()),
    }
}

pub fn compile(
    index: &Index,
    attachments: &Attachments,
    params: &MeshParams,
    pod: &ObjKey,
) -> Result<WorkloadConfig, CompileError> {
    let info = index
        .pods
        .get(pod)
        .ok_or_else(|| CompileError::UnknownPod(pod.clone()))?;
    let policy = select_tls_policy(index, pod);
    let own_mode = policy.map(|(_, p)| p.spec.mtls.mode);
    // Originating mTLS needs certificates (an identity source) and a mode
    // that allows TLS: Disabled originates plaintext.
    let can_originate = params.identity.is_some() && own_mode != Some(MtlsMode::Disabled);

    let mut out = Outbound {
        index,
        params,
        client_namespace: &pod.namespace,
        can_originate,
        clusters: BTreeMap::new(),
        routes: Vec::new(),
        tcp_routes: Vec::new(),
        programmed: BTreeSet::new(),
    };
    for (key, svc) in &index.services {
        for port in svc.ports.iter().filter(|p| p.tcp) {
            match attachments.by_parent.get(&(key.clone(), port.port)) {
                Some(route_key) => {
                    let route = &index.routes[route_key];
                    match route.spec.protocol {
                        RouteProtocol::Http => out.route(key, svc, port.port, route_key, route),
                        RouteProtocol::Tcp => out.tcp_route(svc, port.port, route_key, route),
                    }
                }
                None => out.default_route(key, svc, port.port),
            }
        }
    }

    let mut snapshot = baton_config::pod_default();
    let any_mtls = out.clusters.values().any(|c| c.mtls.is_some());
    snapshot.clusters = out.clusters.into_values().collect();
    snapshot.routes = out.routes;
    snapshot.tcp_routes = out.tcp_routes;
    snapshot.tls = params.identity.as_ref().and_then(|identity| {
        // Without a policy and without a peer that needs mTLS, nothing asks
        // for certificates: the sidecar stays as it was before Baton pushed.
        if policy.is_none() && !any_mtls {
            return None;
        }
        Some(tls_section(
            params,
            identity,
            pod,
            &info.service_account,
            policy.map(|(_, p)| p),
        ))
    });
    let authorization = authz::select(index, &params.trust_domain, pod);
    let inbound = authz::compile(
        &params.trust_domain,
        authz::default_for(index, &pod.namespace, params.default_authorization),
        info,
        policy,
        &authorization,
    );
    for l in snapshot
        .listeners
        .iter_mut()
        .filter(|l| l.name == INBOUND_LISTENER)
    {
        l.rbac = inbound.rbac.as_ref().map(|p| p.name.clone());
        l.access_log |= inbound.access_log;
    }
    snapshot.policies.rbac.extend(inbound.rbac);
    Ok(WorkloadConfig {
        snapshot,
        routes: out.programmed,
        tls_policy: policy.map(|(k, _)| k.clone()),
        authorization_policies: authorization.into_iter().map(|(k, _)| k.clone()).collect(),
    })
}

/// How a cluster speaks HTTP to its endpoints: HTTP/2 when the Service
/// port's name says so (Istio's convention: `http2`, `grpc`, `h2c`, alone or
/// as a `-` prefix), else HTTP/1.1.
fn upstream_protocol(port_name: Option<&str>) -> UpstreamProtocol {
    let h2 = port_name.is_some_and(|n| {
        ["http2", "grpc", "h2c"]
            .iter()
            .any(|p| n == *p || n.strip_prefix(p).is_some_and(|rest| rest.starts_with('-')))
    });
    if h2 {
        UpstreamProtocol::Http2
    } else {
        UpstreamProtocol::Http1
    }
}

/// The sidecar's `tls` section. Every field the policy does not decide
/// keeps the section's default.
fn tls_section(
    params: &MeshParams,
    identity: &IdentitySource,
    pod: &ObjKey,
    service_account: &str,
    policy: Option<&TlsPolicy>,
) -> TlsSettings {
    // No policy: a meshed client that must originate mTLS to a peer still
    // accepts plaintext inbound, as it did before.
    let (mode, min_version, cipher_suites, offload) = match policy {
        Some(p) => (
            match p.spec.mtls.mode {
                MtlsMode::Strict => tls::TlsMode::Strict,
                MtlsMode::Permissive => tls::TlsMode::Permissive,
                MtlsMode::Disabled => tls::TlsMode::Disabled,
            },
            match p.spec.min_version {
                TlsVersion::Tls12 => tls::TlsVersion::Tls12,
                TlsVersion::Tls13 => tls::TlsVersion::Tls13,
            },
            p.spec.cipher_suites.clone(),
            p.spec.private_key_offload.mode,
        ),
        None => (
            tls::TlsMode::Permissive,
            tls::TlsVersion::Tls12,
            Vec::new(),
            OffloadMode::Disabled,
        ),
    };
    TlsSettings {
        mode,
        min_version,
        cipher_suites,
        identity: tls::IdentitySettings {
            trust_domain: params.trust_domain.clone(),
            local: Some(spiffe_id(
                &params.trust_domain,
                &pod.namespace,
                service_account,
            )),
            expected_peers: BTreeMap::new(),
        },
        source: Some(cert_source(identity, policy)),
        offload: tls::OffloadSettings {
            mode: match offload {
                OffloadMode::Disabled => tls::OffloadMode::Disabled,
                OffloadMode::Preferred => tls::OffloadMode::Preferred,
                OffloadMode::Required => tls::OffloadMode::Required,
            },
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Where the sidecar's certificate comes from: the identity service, or
/// with `certificate.source: Secret` the files of the Secret the webhook
/// mounted into both slots (polled by the sidecar, so a changed Secret is
/// served without a restart, and the next process of a hot upgrade reads
/// the same files). Peers check it like any mesh certificate: it must chain
/// to the mesh trust bundle and name the workload's SPIFFE ID.
fn cert_source(identity: &IdentitySource, policy: Option<&TlsPolicy>) -> tls::CertSource {
    use baton_crds::contract::volumes;
    if policy.is_some_and(|p| p.spec.certificate.secret_name().is_some()) {
        return tls::CertSource::Files {
            cert_chain: volumes::TLS_SECRET_CERT_PATH.into(),
            key: volumes::TLS_SECRET_KEY_PATH.into(),
            trust_bundle: volumes::TRUST_BUNDLE_PATH.into(),
            poll_interval_ms: tls::DEFAULT_POLL_MS,
        };
    }
    tls::CertSource::IdentityService {
        url: identity.url.clone(),
        ca_bundle: identity.ca_bundle.clone(),
        token_path: None,
        key_type: tls::KeyType::default(),
    }
}

fn spiffe_id(trust_domain: &str, namespace: &str, service_account: &str) -> String {
    format!("spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}")
}

/// Name of the cluster holding a Service port's endpoints.
pub fn cluster_name(service: &ObjKey, port: u16) -> String {
    format!("{}/{}:{port}", service.namespace, service.name)
}

/// Builds the outbound half of one workload's snapshot.
struct Outbound<'a> {
    index: &'a Index,
    params: &'a MeshParams,
    client_namespace: &'a str,
    can_originate: bool,
    clusters: BTreeMap<String, ClusterConfig>,
    routes: Vec<RouteConfig>,
    tcp_routes: Vec<TcpRouteConfig>,
    programmed: BTreeSet<ObjKey>,
}

impl Outbound<'_> {
    /// Host names a client may use for a Service: the short name only from
    /// its own namespace (elsewhere it names another Service), the
    /// qualified names, and the ClusterIP (transparent capture of a client
    /// that dialled the IP).
    fn hosts(&self, key: &ObjKey, svc: &ServiceInfo) -> Vec<String> {
        let (name, ns) = (&key.name, &key.namespace);
        let mut hosts = Vec::with_capacity(5);
        if ns == self.client_namespace {
            hosts.push(name.clone());
        }
        hosts.push(format!("{name}.{ns}"));
        hosts.push(format!("{name}.{ns}.svc"));
        hosts.push(format!("{name}.{ns}.svc.{}", self.params.cluster_domain));
        if let Some(ip) = svc.cluster_ip {
            hosts.push(ip.to_string());
        }
        hosts
    }

    /// The cluster for `namespace/name:port`, created on first use: the
    /// Service's ready endpoints (and those whose Pods serve through a slot
    /// swap) on the port the endpoints name after the Service port. A
    /// missing Service or port yields an empty cluster (requests get 503;
    /// the Route reports ResolvedRefs=False).
    fn cluster(&mut self, namespace: &str, name: &str, port: u16) -> String {
        let key = ObjKey::new(namespace, name);
        let cluster = cluster_name(&key, port);
        if self.clusters.contains_key(&cluster) {
            return cluster;
        }
        let port_name = self
            .index
            .services
            .get(&key)
            .and_then(|s| s.ports.iter().find(|p| p.port == port))
            .map(|p| p.name.clone().unwrap_or_default());
        let ready: Vec<_> = match &port_name {
            Some(port_name) => self
                .index
                .service_endpoints(&key)
                .into_iter()
                .filter(|e| e.ready || self.serving_through_swap(e))
                .filter_map(|e| Some((e, *e.ports.get(port_name)?)))
                .collect(),
            None => Vec::new(),
        };
        let mtls = self.mtls_for(ready.iter().map(|(e, _)| e.pod.as_ref()));
        let mut endpoints: Vec<SocketAddr> = ready
            .iter()
            .map(|(e, p)| SocketAddr::new(e.ip, *p))
            .collect();
        endpoints.sort();
        endpoints.dedup();
        self.clusters.insert(
            cluster.clone(),
            ClusterConfig {
                mtls,
                protocol: upstream_protocol(port_name.as_deref()),
                ..ClusterConfig::new(cluster.clone(), endpoints)
            },
        );
        cluster
    }

    /// A not-ready address whose Pod serves through a sidecar slot's image
    /// swap (see [`super::index::serving_through_swap`]).
    fn serving_through_swap(&self, e: &EndpointInfo) -> bool {
        e.pod
            .as_ref()
            .and_then(|p| self.index.pods.get(p))
            .is_some_and(|p| p.serving_through_swap)
    }

    /// mTLS for a cluster when this client can originate it and every
    /// endpoint is a meshed Pod that accepts it under one ServiceAccount
    /// (one expected identity per cluster). Anything mixed stays plaintext.
    fn mtls_for<'p>(
        &self,
        mut pods: impl Iterator<Item = Option<&'p ObjKey>>,
    ) -> Option<ClusterMtls> {
        if !self.can_originate {
            return None;
        }
        let mut identity = None;
        let all = pods.all(|pod| {
            let Some(pod) = pod else { return false };
            let Some(info) = self.index.pods.get(pod).filter(|i| i.injected) else {
                return false;
            };
            if !matches!(
                inbound_mode(self.index, pod),
                Some(MtlsMode::Strict | MtlsMode::Permissive)
            ) {
                return false;
            }
            let id = spiffe_id(
                &self.params.trust_domain,
                &pod.namespace,
                &info.service_account,
            );
            *identity.get_or_insert_with(|| id.clone()) == id
        });
        (all && identity.is_some()).then_some(ClusterMtls { identity })
    }

    /// No Route: the Service port's traffic goes to its ready endpoints.
    fn default_route(&mut self, key: &ObjKey, svc: &ServiceInfo, port: u16) {
        let cluster = self.cluster(&key.namespace, &key.name, port);
        self.routes.push(RouteConfig {
            name: format!("service:{}", cluster),
            listeners: vec![OUTBOUND_LISTENER.into()],
            matches: MatchConfig {
                hosts: self.hosts(key, svc),
                ports: vec![port],
                ..Default::default()
            },
            backends: vec![WeightedBackend { cluster, weight: 1 }],
            timeout_ms: None,
            retry: None,
            fault: None,
            mirror: None,
            request_headers: HeaderRewrite::default(),
            response_headers: HeaderRewrite::default(),
        });
    }

    /// An attached Route: one sidecar route per (rule, match), in rule
    /// order (a rule's matches are OR-ed; a sidecar match is AND-ed).
    fn route(&mut self, key: &ObjKey, svc: &ServiceInfo, port: u16, rk: &ObjKey, route: &Route) {
        let hosts = self.hosts(key, svc);
        for (i, rule) in route.spec.rules.iter().enumerate() {
            let rule_name = rule.name.clone().unwrap_or_else(|| i.to_string());
            let backends = self.backends(&rk.namespace, &rule.backend_refs);
            let mirror = rule.mirror.as_ref().map(|m| MirrorConfig {
                cluster: self.cluster(
                    &rk.namespace,
                    &m.backend_ref.name,
                    to_port(m.backend_ref.port),
                ),
                percent: f64::from(m.percent),
            });
            let matches: Vec<Option<&RouteMatch>> = if rule.matches.is_empty() {
                vec![None]
            } else {
                rule.matches.iter().map(Some).collect()
            };
            let several = matches.len() > 1;
            for (j, m) in matches.into_iter().enumerate() {
                let mut name = format!("route:{rk}/{rule_name}");
                if several {
                    name.push_str(&format!("#{j}"));
                }
                self.routes.push(RouteConfig {
                    name,
                    listeners: vec![OUTBOUND_LISTENER.into()],
                    matches: match_config(hosts.clone(), port, m),
                    backends: backends.clone(),
                    timeout_ms: rule.timeout.as_deref().and_then(timeout_ms),
                    retry: rule.retries.as_ref().map(retry_config),
                    fault: rule.fault.as_ref().map(|f| FaultConfig {
                        delay: f.delay.as_ref().map(|d| FaultDelay {
                            percent: f64::from(d.percent),
                            ms: duration_ms(&d.fixed_delay).unwrap_or(0),
                        }),
                        abort: f.abort.as_ref().map(|a| FaultAbort {
                            percent: f64::from(a.percent),
                            status: u16::try_from(a.http_status).unwrap_or(500),
                        }),
                    }),
                    mirror: mirror.clone(),
                    request_headers: rewrite(rule.request_header_modifier.as_ref()),
                    response_headers: rewrite(rule.response_header_modifier.as_ref()),
                });
            }
        }
        self.programmed.insert(rk.clone());
    }
}

impl Outbound<'_> {
    /// A rule's weighted backends, each as its cluster (http and tcp alike).
    fn backends(
        &mut self,
        namespace: &str,
        refs: &[baton_crds::common::BackendRef],
    ) -> Vec<WeightedBackend> {
        refs.iter()
            .map(|b| WeightedBackend {
                cluster: self.cluster(namespace, &b.name, to_port(b.port)),
                weight: u32::try_from(b.weight).unwrap_or(0),
            })
            .collect()
    }

    /// An attached tcp Route: connections to the Service's ClusterIP and
    /// port pick one backend by weight, and the port is opaque (the
    /// sidecar never parses HTTP there), so no HTTP route is compiled for
    /// it. `attach_routes` accepted it only with a ClusterIP and exactly
    /// one rule (admission and its own validation).
    fn tcp_route(&mut self, svc: &ServiceInfo, port: u16, rk: &ObjKey, route: &Route) {
        let (Some(ip), Some(rule)) = (svc.cluster_ip, route.spec.rules.first()) else {
            return;
        };
        let backends = self.backends(&rk.namespace, &rule.backend_refs);
        self.tcp_routes.push(TcpRouteConfig {
            name: format!("route:{rk}"),
            listeners: vec![OUTBOUND_LISTENER.into()],
            destinations: vec![SocketAddr::new(ip, port)],
            backends,
            // `0s` (Gateway API: no timeout) keeps the cluster's connect
            // timeout: a connect never waits forever, and the sidecar
            // refuses 0.
            connect_timeout_ms: rule
                .timeout
                .as_deref()
                .and_then(duration_ms)
                .filter(|ms| *ms > 0),
        });
        self.programmed.insert(rk.clone());
    }
}

fn to_port(p: i32) -> u16 {
    u16::try_from(p).unwrap_or(0)
}

fn duration_ms(s: &str) -> Option<u64> {
    parse_duration(s).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A request or per-try timeout: `0s` disables it (Gateway API), which the
/// sidecar's model says with no timeout at all; it refuses a zero one, so
/// passing `0s` through would make every sidecar NACK the whole config.
fn timeout_ms(s: &str) -> Option<u64> {
    duration_ms(s).filter(|ms| *ms > 0)
}

fn match_config(hosts: Vec<String>, port: u16, m: Option<&RouteMatch>) -> MatchConfig {
    let mut out = MatchConfig {
        hosts,
        ports: vec![port],
        ..Default::default()
    };
    let Some(m) = m else { return out };
    out.path = m.path.as_ref().map(|p| {
        let v = Some(p.value.clone());
        match p.type_ {
            PathMatchType::Exact => PathMatch {
                exact: v,
                ..Default::default()
            },
            PathMatchType::PathPrefix => PathMatch {
                prefix: v,
                ..Default::default()
            },
            PathMatchType::RegularExpression => PathMatch {
                regex: v,
                ..Default::default()
            },
        }
    });
    out.methods = m.method.iter().map(|m| method_name(*m).into()).collect();
    let value = |type_: StringMatchType, name: &str, value: &str| {
        let (exact, regex) = match type_ {
            StringMatchType::Exact => (Some(value.to_owned()), None),
            StringMatchType::RegularExpression => (None, Some(value.to_owned())),
        };
        ValueMatch {
            name: name.to_owned(),
            exact,
            regex,
            invert: false,
        }
    };
    out.headers = m
        .headers
        .iter()
        .map(|h| value(h.type_, &h.name, &h.value))
        .collect();
    out.query = m
        .query_params
        .iter()
        .map(|q| value(q.type_, &q.name, &q.value))
        .collect();
    out
}

fn method_name(m: HttpMethod) -> &'static str {
    match m {
        HttpMethod::Get => "GET",
        HttpMethod::Head => "HEAD",
        HttpMethod::Post => "POST",
        HttpMethod::Put => "PUT",
        HttpMethod::Delete => "DELETE",
        HttpMethod::Connect => "CONNECT",
        HttpMethod::Options => "OPTIONS",
        HttpMethod::Trace => "TRACE",
        HttpMethod::Patch => "PATCH",
    }
}

/// Istio's `retryOn` words onto the sidecar's retry triggers. The sidecar
/// retries 5xx statuses only (for idempotent methods); `retriable-4xx` and
/// 4xx codes have no effect. Empty `retryOn`: the CRD's documented default
/// (connect-failure, refused-stream, reset, 503).
fn retry_config(r: &baton_crds::route::RetryPolicy) -> RetryConfig {
    let words: Vec<&str> = if r.retry_on.is_empty() {
        vec!["connect-failure", "refused-stream", "reset", "503"]
    } else {
        r.retry_on.iter().map(String::as_str).collect()
    };
    let mut statuses = BTreeSet::new();
    for w in &words {
        match *w {
            "5xx" => statuses.extend(500..=599),
            "gateway-error" => statuses.extend([502, 503, 504]),
            code => {
                if let Ok(c) = code.parse::<u16>()
                    && (500..=599).contains(&c)
                {
                    statuses.insert(c);
                }
            }
        }
    }
    RetryConfig {
        on_connect_failure: words.contains(&"connect-failure"),
        on_reset: words
            .iter()
            .any(|w| matches!(*w, "reset" | "refused-stream")),
        on_statuses: statuses.into_iter().collect(),
        per_try_timeout_ms: r.per_try_timeout.as_deref().and_then(timeout_ms),
        ..RetryConfig::new(u32::try_from(r.attempts).unwrap_or(0))
    }
}

fn rewrite(m: Option<&HeaderModifier>) -> HeaderRewrite {
    let Some(m) = m else {
        return HeaderRewrite::default();
    };
    HeaderRewrite {
        set: m
            .set
            .iter()
            .map(|h| (h.name.clone(), h.value.clone()))
            .collect(),
        add: m
            .add
            .iter()
            .map(|h| (h.name.clone(), h.value.clone()))
            .collect(),
        remove: m.remove.clone(),
    }
}
