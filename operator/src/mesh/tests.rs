//! The compiler's behaviour, with objects fed straight into the index. Every
//! compiled snapshot is also run through the sidecar's own validation
//! (`baton_sidecar::config::compile` and its TLS settings), so "the operator
//! produced it" implies "a sidecar accepts it".

use std::collections::BTreeSet;
use std::net::SocketAddr;

use baton_config::tls::TlsMode;
use baton_config::{ClusterConfig, RouteConfig, Snapshot, TcpRouteConfig, WeightedBackend};
use baton_crds::{Route, TlsPolicy};
use k8s_openapi::api::core::v1::{Endpoints, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{Value, json};

use super::compile::{
    Attachments, CompileKey, IdentitySource, MeshParams, WorkloadConfig, attach_routes, compile,
    compile_key, tls_policy_refusal,
};
use super::index::{Index, ObjKey};

const NS: &str = "shop";

fn from<T: serde::de::DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).expect("test object")
}

fn service(name: &str, ip: &str, ports: &[(&str, u16)]) -> Service {
    let ports: Vec<Value> = ports
        .iter()
        .map(|(n, p)| {
            let mut v = json!({"port": p, "protocol": "TCP"});
            if !n.is_empty() {
                v["name"] = json!(n);
            }
            v
        })
        .collect();
    from(json!({
        "metadata": {"name": name, "namespace": NS},
        "spec": {"clusterIP": ip, "ports": ports}
    }))
}

/// One EndpointSlice of `svc`: (pod name, ip, ready), every address serving
/// `ports` (port name, number).
fn slice(
    svc: &str,
    name: &str,
    addrs: &[(&str, &str, bool)],
    ports: &[(&str, u16)],
) -> EndpointSlice {
    let endpoints: Vec<Value> = addrs
        .iter()
        .map(|(pod, ip, ready)| {
            json!({
                "addresses": [ip],
                "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "name": pod, "namespace": NS}
            })
        })
        .collect();
    let ports: Vec<Value> = ports
        .iter()
        .map(|(n, p)| json!({"name": n, "port": p, "protocol": "TCP"}))
        .collect();
    from(json!({
        "metadata": {"name": name, "namespace": NS,
                     "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": ports
    }))
}

fn pod(name: &str, ip: &str, sa: &str, labels: Value) -> Pod {
    let mut labels = labels;
    labels["baton.dev/injected"] = json!("true");
    from(json!({
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {"serviceAccountName": sa, "containers": [{"name": "app"}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
    }))
}

fn route(name: &str, created: &str, spec: Value) -> Route {
    from(json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "Route",
        "metadata": {"name": name, "namespace": NS, "creationTimestamp": created},
        "spec": spec
    }))
}

fn tls_policy(name: &str, selector: Value, mode: &str) -> TlsPolicy {
    from(json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "TlsPolicy",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"podSelector": selector, "mtls": {"mode": mode}}
    }))
}

/// A policy named `server` selecting the server's Pods.
fn server_policy(mode: &str) -> TlsPolicy {
    tls_policy("server", json!({"matchLabels": {"app": "server"}}), mode)
}

fn params() -> MeshParams {
    MeshParams {
        trust_domain: "cluster.local".into(),
        cluster_domain: "cluster.local".into(),
        identity: Some(IdentitySource {
            url: "https://baton-identity.baton-system.svc:8443/v1/sign".into(),
            ca_bundle: Some("/var/run/secrets/baton.dev/ca/ca.crt".into()),
        }),
        default_authorization: Default::default(),
    }
}

/// A shop: `client` Pod, `server` Service (port 80 → 8080) with v1 and v2
/// Pods behind it, and `server-v1`/`server-v2` Services for each version.
fn shop() -> Index {
    let mut ix = Index::default();
    ix.apply_pod(&pod(
        "client",
        "10.1.0.1",
        "client",
        json!({"app": "client"}),
    ));
    for (i, v) in ["v1", "v2"].iter().enumerate() {
        let ip = format!("10.1.1.{}", i + 1);
        ix.apply_pod(&pod(
            &format!("server-{v}"),
            &ip,
            "server",
            json!({"app": "server", "version": v}),
        ));
        ix.apply_service(&service(
            &format!("server-{v}"),
            &format!("10.96.0.{}", i + 11),
            &[("http", 80)],
        ));
        ix.apply_endpoint_slice(&slice(
            &format!("server-{v}"),
            &format!("server-{v}-abc"),
            &[(&format!("server-{v}"), &ip, true)],
            &[("http", 8080)],
        ));
    }
    ix.apply_service(&service("server", "10.96.0.10", &[("http", 80)]));
    ix.apply_endpoint_slice(&slice(
        "server",
        "server-abc",
        &[
            ("server-v1", "10.1.1.1", true),
            ("server-v2", "10.1.1.2", true),
        ],
        &[("http", 8080)],
    ));
    ix
}

fn client() -> ObjKey {
    ObjKey::new(NS, "client")
}

/// Compile for `pod`, checking the sidecar accepts the result.
fn compiled(ix: &Index, pod: &ObjKey) -> WorkloadConfig {
    compiled_with(ix, &params(), pod)
}

fn compiled_with(ix: &Index, params: &MeshParams, pod: &ObjKey) -> WorkloadConfig {
    let out = compile(ix, &attach_routes(ix), params, pod).unwrap();
    sidecar_accepts(&out.snapshot);
    out
}

fn sidecar_accepts(snapshot: &Snapshot) {
    if let Err(e) = baton_sidecar::config::compile(snapshot) {
        panic!("the sidecar refuses the compiled snapshot: {e}\n{snapshot:#?}");
    }
    // `config::compile` validated the tls section too; this builds its
    // rustls objects, as the sidecar's TLS layer does on apply.
    if let Some(tls) = &snapshot.tls {
        baton_sidecar::tls::settings::compile(tls).expect("tls section compiles");
    }
}

fn route_named<'s>(s: &'s Snapshot, name: &str) -> &'s RouteConfig {
    s.routes
        .iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("no route {name}: {:?}", names(s)))
}

fn names(s: &Snapshot) -> Vec<&str> {
    s.routes.iter().map(|r| r.name.as_str()).collect()
}

fn cluster<'s>(s: &'s Snapshot, name: &str) -> &'s ClusterConfig {
    s.clusters
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no cluster {name}"))
}

fn addrs(list: &[&str]) -> Vec<SocketAddr> {
    list.iter().map(|a| a.parse().unwrap()).collect()
}

// ------------------------------------------------------------ no Route

#[test]
fn without_a_route_service_traffic_goes_to_its_ready_endpoints_on_the_target_port() {
    let mut ix = shop();
    ix.apply_endpoint_slice(&slice(
        "server",
        "server-abc",
        &[
            ("server-v1", "10.1.1.1", true),
            ("server-v2", "10.1.1.2", false),
        ],
        &[("http", 8080)],
    ));
    let s = compiled(&ix, &client()).snapshot;
    let r = route_named(&s, "service:shop/server:80");
    assert_eq!(r.backends.len(), 1);
    assert_eq!(r.backends[0].cluster, "shop/server:80");
    assert_eq!(r.matches.ports, vec![80]);
    assert_eq!(
        r.matches.hosts,
        vec![
            "server",
            "server.shop",
            "server.shop.svc",
            "server.shop.svc.cluster.local",
            "10.96.0.10"
        ]
    );
    assert_eq!(r.listeners, vec!["outbound"]);
    assert_eq!(
        cluster(&s, "shop/server:80").endpoints,
        addrs(&["10.1.1.1:8080"])
    );
    // The in-pod default stays underneath: other traffic passes through.
    assert!(s.listeners.iter().all(|l| l.passthrough));
}

#[test]
fn the_short_service_name_is_a_host_only_for_clients_in_its_namespace() {
    let mut ix = shop();
    let mut other = pod("elsewhere", "10.2.0.1", "default", json!({}));
    other.metadata.namespace = Some("other".into());
    ix.apply_pod(&other);
    let s = compiled(&ix, &ObjKey::new("other", "elsewhere")).snapshot;
    let hosts = &route_named(&s, "service:shop/server:80").matches.hosts;
    assert!(!hosts.contains(&"server".to_string()), "{hosts:?}");
    assert!(hosts.contains(&"server.shop".to_string()));
}

#[test]
fn two_ports_of_one_service_route_to_their_own_endpoints_ports() {
    let mut ix = shop();
    ix.apply_service(&service(
        "multi",
        "10.96.0.20",
        &[("web", 80), ("admin", 9000)],
    ));
    ix.apply_endpoint_slice(&slice(
        "multi",
        "multi-1",
        &[("server-v1", "10.1.1.1", true)],
        &[("web", 8080), ("admin", 9901)],
    ));
    let s = compiled(&ix, &client()).snapshot;
    assert_eq!(
        route_named(&s, "service:shop/multi:80").matches.ports,
        vec![80]
    );
    assert_eq!(
        route_named(&s, "service:shop/multi:9000").matches.ports,
        vec![9000]
    );
    assert_eq!(
        cluster(&s, "shop/multi:80").endpoints,
        addrs(&["10.1.1.1:8080"])
    );
    assert_eq!(
        cluster(&s, "shop/multi:9000").endpoints,
        addrs(&["10.1.1.1:9901"])
    );
}

#[test]
fn unnamed_ports_headless_services_and_udp_ports_compile_as_expected() {
    let mut ix = Index::default();
    ix.apply_pod(&pod("client", "10.1.0.1", "client", json!({})));
    ix.apply_service(&service("plain", "10.96.0.30", &[("", 80)]));
    ix.apply_endpoint_slice(&slice(
        "plain",
        "plain-1",
        &[("p", "10.1.3.1", true)],
        &[("", 8080)],
    ));
    ix.apply_service(&service("headless", "None", &[("http", 80)]));
    let mut dns = service("dns", "10.96.0.53", &[("dns", 53)]);
    dns.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].protocol = Some("UDP".into());
    ix.apply_service(&dns);
    let s = compiled(&ix, &client()).snapshot;
    assert_eq!(
        cluster(&s, "shop/plain:80").endpoints,
        addrs(&["10.1.3.1:8080"])
    );
    let headless = route_named(&s, "service:shop/headless:80");
    assert!(headless.matches.hosts.iter().all(|h| h != "None"));
    assert_eq!(headless.matches.hosts.len(), 4);
    assert!(
        !names(&s).contains(&"service:shop/dns:53"),
        "UDP is not meshed"
    );
}

// ------------------------------------------------------------ endpoints

/// The endpoints the client's sidecar gets for `shop/server:80`.
fn server_endpoints(ix: &Index) -> Vec<SocketAddr> {
    compiled(ix, &client())
        .snapshot
        .clusters
        .into_iter()
        .find(|c| c.name == "shop/server:80")
        .unwrap()
        .endpoints
}

#[test]
fn endpoints_follow_pods_as_they_come_go_and_change_readiness() {
    let mut ix = shop();
    let eps = server_endpoints;
    assert_eq!(eps(&ix), addrs(&["10.1.1.1:8080", "10.1.1.2:8080"]));
    // v2 turns not ready.
    ix.apply_endpoint_slice(&slice(
        "server",
        "server-abc",
        &[
            ("server-v1", "10.1.1.1", true),
            ("server-v2", "10.1.1.2", false),
        ],
        &[("http", 8080)],
    ));
    assert_eq!(eps(&ix), addrs(&["10.1.1.1:8080"]));
    // A scale-up lands in a second slice; both slices count.
    let extra = slice(
        "server",
        "server-def",
        &[("server-v3", "10.1.1.3", true)],
        &[("http", 8080)],
    );
    ix.apply_endpoint_slice(&extra);
    assert_eq!(eps(&ix), addrs(&["10.1.1.1:8080", "10.1.1.3:8080"]));
    // The slice goes away with its Pods.
    ix.delete_endpoint_slice(&extra);
    assert_eq!(eps(&ix), addrs(&["10.1.1.1:8080"]));
    // An address with no ready condition counts as ready (the API's rule).
    let mut unknown = slice(
        "server",
        "server-abc",
        &[("server-v2", "10.1.1.2", true)],
        &[("http", 8080)],
    );
    unknown.endpoints[0].conditions = None;
    ix.apply_endpoint_slice(&unknown);
    assert_eq!(eps(&ix), addrs(&["10.1.1.2:8080"]));
}

/// `pod()` mid hot upgrade: `status` of each slot and of the app
/// container, the active slot and the upgrade record's target slot.
fn upgrading_pod(
    name: &str,
    ip: &str,
    app_ready: bool,
    slots: (bool, bool),
    active: &str,
    upgrade_to: Option<&str>,
) -> Pod {
    let mut p = pod(name, ip, "server", json!({"app": "server"}));
    let mut ann = json!({"baton.dev/active-slot": active});
    if let Some(slot) = upgrade_to {
        ann["baton.dev/upgrade"] = json!(format!(r#"{{"version":"2","slot":"{slot}"}}"#));
    }
    p.metadata.annotations = Some(from(ann));
    p.status = Some(from(json!({
        "podIP": ip,
        "conditions": [{"type": "Ready", "status": "False"}],
        "containerStatuses": [
            {"name": "app", "ready": app_ready, "restartCount": 0, "image": "app", "imageID": ""},
            {"name": "baton-sidecar-a", "ready": slots.0, "restartCount": 0, "image": "s", "imageID": ""},
            {"name": "baton-sidecar-b", "ready": slots.1, "restartCount": 1, "image": "s", "imageID": ""},
        ]
    })));
    p
}

#[test]
fn a_pod_whose_sidecar_slot_restarts_for_an_upgrade_stays_an_endpoint() {
    let mut ix = shop();
    let eps = server_endpoints;
    // Both server Pods are not Ready to the API: their standby slots restart.
    ix.apply_endpoint_slice(&slice(
        "server",
        "server-abc",
        &[
            ("server-v1", "10.1.1.1", false),
            ("server-v2", "10.1.1.2", false),
        ],
        &[("http", 8080)],
    ));
    let both = addrs(&["10.1.1.1:8080", "10.1.1.2:8080"]);
    // v1: upgrade a → b under way, b restarting, a serving.
    ix.apply_pod(&upgrading_pod(
        "server-v1",
        "10.1.1.1",
        true,
        (true, false),
        "a",
        Some("b"),
    ));
    // v2: upgrade finished (no record), the retired slot a restarting to the
    // idle image, b active and serving.
    ix.apply_pod(&upgrading_pod(
        "server-v2",
        "10.1.1.2",
        true,
        (false, true),
        "b",
        None,
    ));
    assert_eq!(eps(&ix), both);

    // During the takeover the old slot may stop being ready while the new
    // one (the upgrade's target) is: still serving.
    ix.apply_pod(&upgrading_pod(
        "server-v1",
        "10.1.1.1",
        true,
        (false, true),
        "a",
        Some("b"),
    ));
    assert_eq!(eps(&ix), both);

    // An application container not ready: the API's verdict stands.
    ix.apply_pod(&upgrading_pod(
        "server-v1",
        "10.1.1.1",
        false,
        (true, false),
        "a",
        Some("b"),
    ));
    assert_eq!(eps(&ix), addrs(&["10.1.1.2:8080"]));

    // The serving slot not ready (only the idle standby is): not serving.
    ix.apply_pod(&upgrading_pod(
        "server-v2",
        "10.1.1.2",
        true,
        (false, true),
        "a",
        None,
    ));
    assert_eq!(eps(&ix), Vec::<SocketAddr>::new());

    // A terminating Pod is gone whatever its slots say.
    let mut leaving = upgrading_pod("server-v1", "10.1.1.1", true, (true, false), "a", Some("b"));
    leaving.metadata.deletion_timestamp = Some(from(json!("2026-12-06T00:00:00Z")));
    ix.apply_pod(&leaving);
    assert_eq!(eps(&ix), Vec::<SocketAddr>::new());

    // After the takeover: the old slot a no longer ready, the new slot b
    // running but its first readiness probe not passed yet: still serving.
    let mut taking_over = upgrading_pod(
        "server-v1",
        "10.1.1.1",
        true,
        (false, false),
        "a",
        Some("b"),
    );
    let running = json!({"running": {"startedAt": "2026-12-06T00:00:00Z"}});
    taking_over
        .status
        .as_mut()
        .unwrap()
        .container_statuses
        .as_mut()
        .unwrap()[2]
        .state = Some(from(running.clone()));
    ix.apply_pod(&taking_over);
    assert_eq!(eps(&ix), addrs(&["10.1.1.1:8080"]));
    // Finished (b active, no record in progress), a restarting to the idle
    // image, b running but not ready yet: kept only with a handoff record,
    // so a Pod that is still starting keeps the API's verdict.
    let mut finished = upgrading_pod("server-v1", "10.1.1.1", true, (false, false), "b", None);
    finished
        .status
        .as_mut()
        .unwrap()
        .container_statuses
        .as_mut()
        .unwrap()[2]
        .state = Some(from(running));
    ix.apply_pod(&finished);
    assert_eq!(eps(&ix), Vec::<SocketAddr>::new());
    finished.metadata.annotations.as_mut().unwrap().insert(
        "baton.dev/last-handoff".into(),
        r#"{"version":"2","slot":"b"}"#.into(),
    );
    ix.apply_pod(&finished);
    assert_eq!(eps(&ix), addrs(&["10.1.1.1:8080"]));

    // Not Ready with every slot ready and no upgrade: the API's verdict.
    ix.apply_pod(&upgrading_pod(
        "server-v1",
        "10.1.1.1",
        true,
        (true, true),
        "a",
        None,
    ));
    assert_eq!(eps(&ix), Vec::<SocketAddr>::new());
}

#[test]
fn core_v1_endpoints_give_the_same_endpoints_as_slices() {
    let mut ix = shop();
    ix.endpoints.clear();
    let eps: Endpoints = from(json!({
        "metadata": {"name": "server", "namespace": NS},
        "subsets": [{
            "addresses": [{"ip": "10.1.1.1", "targetRef": {"kind": "Pod", "name": "server-v1"}}],
            "notReadyAddresses": [{"ip": "10.1.1.2", "targetRef": {"kind": "Pod", "name": "server-v2"}}],
            "ports": [{"name": "http", "port": 8080}]
        }]
    }));
    ix.apply_endpoints(&eps);
    let s = compiled(&ix, &client()).snapshot;
    assert_eq!(
        cluster(&s, "shop/server:80").endpoints,
        addrs(&["10.1.1.1:8080"])
    );
    ix.delete_endpoints(&ObjKey::new(NS, "server"));
    let s = compiled(&ix, &client()).snapshot;
    assert!(cluster(&s, "shop/server:80").endpoints.is_empty());
}

// ------------------------------------------------------------ Routes

fn split_route(name: &str, created: &str, v1: i32, v2: i32) -> Route {
    route(
        name,
        created,
        json!({
            "parentRef": {"name": "server", "port": 80},
            "rules": [{"backendRefs": [
                {"name": "server-v1", "port": 80, "weight": v1},
                {"name": "server-v2", "port": 80, "weight": v2}
            ]}]
        }),
    )
}

#[test]
fn a_split_route_replaces_the_default_route_with_weighted_backends() {
    let mut ix = shop();
    ix.apply_route(&split_route("split", "2026-01-01T00:00:00Z", 90, 10));
    let out = compiled(&ix, &client());
    let s = &out.snapshot;
    assert!(
        !names(s).contains(&"service:shop/server:80"),
        "{:?}",
        names(s)
    );
    let r = route_named(s, "route:shop/split/0");
    let backends: Vec<(&str, u32)> = r
        .backends
        .iter()
        .map(|b| (b.cluster.as_str(), b.weight))
        .collect();
    assert_eq!(
        backends,
        vec![("shop/server-v1:80", 90), ("shop/server-v2:80", 10)]
    );
    assert_eq!(r.matches.ports, vec![80]);
    assert!(r.matches.hosts.contains(&"10.96.0.10".to_string()));
    assert_eq!(
        cluster(s, "shop/server-v1:80").endpoints,
        addrs(&["10.1.1.1:8080"])
    );
    assert_eq!(
        cluster(s, "shop/server-v2:80").endpoints,
        addrs(&["10.1.1.2:8080"])
    );
    assert_eq!(out.routes, BTreeSet::from([ObjKey::new(NS, "split")]));
    // Deleting the Route brings plain Service balancing back.
    ix.delete_route(&ObjKey::new(NS, "split"));
    let s = compiled(&ix, &client()).snapshot;
    assert_eq!(
        route_named(&s, "service:shop/server:80").backends[0].cluster,
        "shop/server:80"
    );
}

#[test]
fn a_rule_with_several_matches_becomes_one_route_per_match_in_rule_order() {
    let mut ix = shop();
    ix.apply_route(&route(
        "canary",
        "2026-01-01T00:00:00Z",
        json!({
            "parentRef": {"name": "server", "port": 80},
            "rules": [
                {"name": "canary",
                 "matches": [
                    {"headers": [{"name": "x-canary", "value": "true"}]},
                    {"path": {"type": "Exact", "value": "/beta"}, "method": "GET",
                     "queryParams": [{"type": "RegularExpression", "name": "u", "value": "[0-9]+"}]}
                 ],
                 "backendRefs": [{"name": "server-v2", "port": 80}]},
                {"backendRefs": [{"name": "server-v1", "port": 80}]}
            ]
        }),
    ));
    let s = compiled(&ix, &client()).snapshot;
    assert_eq!(
        names(&s)
            .into_iter()
            .filter(|n| n.starts_with("route:"))
            .collect::<Vec<_>>(),
        vec![
            "route:shop/canary/canary#0",
            "route:shop/canary/canary#1",
            "route:shop/canary/1"
        ]
    );
    let header = &route_named(&s, "route:shop/canary/canary#0").matches;
    assert_eq!(header.headers[0].name, "x-canary");
    assert_eq!(header.headers[0].exact.as_deref(), Some("true"));
    let path = &route_named(&s, "route:shop/canary/canary#1").matches;
    assert_eq!(path.path.as_ref().unwrap().exact.as_deref(), Some("/beta"));
    assert_eq!(path.methods, vec!["GET"]);
    assert_eq!(path.query[0].regex.as_deref(), Some("[0-9]+"));
    assert_eq!(route_named(&s, "route:shop/canary/1").matches.path, None);
}

#[test]
fn a_zero_timeout_means_none_rather_than_a_config_every_sidecar_refuses() {
    let mut ix = shop();
    ix.apply_route(&route(
        "untimed",
        "2026-01-01T00:00:00Z",
        json!({
            "parentRef": {"name": "server", "port": 80},
            "rules": [{
                "backendRefs": [{"name": "server-v1", "port": 80}],
                "timeout": "0s",
                "retries": {"attempts": 2, "perTryTimeout": "0s"}
            }]
        }),
    ));
    let s = compiled(&ix, &client()).snapshot;
    let r = route_named(&s, "route:shop/untimed/0");
    assert_eq!(r.timeout_ms, None);
    assert_eq!(r.retry.as_ref().unwrap().per_try_timeout_ms, None);
}

#[test]
fn retries_faults_timeouts_mirrors_and_header_rewrites_carry_over() {
    let mut ix = shop();
    ix.apply_route(&route(
        "policy",
        "2026-01-01T00:00:00Z",
        json!({
            "parentRef": {"name": "server", "port": 80},
            "rules": [{
                "backendRefs": [{"name": "server-v1", "port": 80}],
                "timeout": "2s",
                "retries": {"attempts": 3, "perTryTimeout": "500ms", "retryOn": ["gateway-error", "connect-failure", "404"]},
                "fault": {"delay": {"fixedDelay": "1s500ms", "percent": 10},
                          "abort": {"httpStatus": 418, "percent": 50}},
                "mirror": {"backendRef": {"name": "server-v2", "port": 80}, "percent": 25},
                "requestHeaderModifier": {"set": [{"name": "x-a", "value": "1"}], "remove": ["x-b"]},
                "responseHeaderModifier": {"add": [{"name": "x-c", "value": "2"}]}
            }]
        }),
    ));
    let s = compiled(&ix, &client()).snapshot;
    let r = route_named(&s, "route:shop/policy/0");
    assert_eq!(r.timeout_ms, Some(2_000));
    let retry = r.retry.as_ref().unwrap();
    assert_eq!(retry.attempts, 3);
    assert_eq!(retry.per_try_timeout_ms, Some(500));
    assert!(retry.on_connect_failure);
    assert!(!retry.on_reset);
    // 404 is not retried by the sidecar (5xx only); gateway-error is 502-504.
    assert_eq!(retry.on_statuses, vec![502, 503, 504]);
    let fault = r.fault.as_ref().unwrap();
    let delay = fault.delay.as_ref().unwrap();
    assert_eq!((delay.ms, delay.percent), (1_500, 10.0));
    let abort = fault.abort.as_ref().unwrap();
    assert_eq!((abort.status, abort.percent), (418, 50.0));
    let mirror = r.mirror.as_ref().unwrap();
    assert_eq!(
        (mirror.cluster.as_str(), mirror.percent),
        ("shop/server-v2:80", 25.0)
    );
    assert_eq!(r.request_headers.set["x-a"], "1");
    assert_eq!(r.request_headers.remove, vec!["x-b"]);
    assert_eq!(r.response_headers.add["x-c"], "2");
}

#[test]
fn retries_without_retry_on_use_the_documented_default() {
    let mut ix = shop();
    ix.apply_route(&route(
        "r",
        "2026-01-01T00:00:00Z",
        json!({"parentRef": {"name": "server", "port": 80},
               "rules": [{"backendRefs": [{"name": "server", "port": 80}], "retries": {"attempts": 2}}]}),
    ));
    let s = compiled(&ix, &client()).snapshot;
    let retry = route_named(&s, "route:shop/r/0").retry.clone().unwrap();
    assert!(retry.on_connect_failure && retry.on_reset);
    assert_eq!(retry.on_statuses, vec![503]);
}

#[test]
fn a_missing_backend_is_unresolved_and_gets_an_empty_cluster_while_other_routes_work() {
    let mut ix = shop();
    ix.apply_service(&service("other", "10.96.0.40", &[("http", 80)]));
    ix.apply_route(&route(
        "broken",
        "2026-01-01T00:00:00Z",
        json!({"parentRef": {"name": "server", "port": 80},
               "rules": [{"backendRefs": [{"name": "ghost", "port": 80}, {"name": "server-v1", "port": 81}]}]}),
    ));
    ix.apply_route(&route(
        "fine",
        "2026-01-01T00:00:00Z",
        json!({"parentRef": {"name": "other", "port": 80},
               "rules": [{"backendRefs": [{"name": "server-v1", "port": 80}]}]}),
    ));
    let att = attach_routes(&ix);
    let broken = &att.verdicts[&ObjKey::new(NS, "broken")];
    assert_eq!(broken.accepted, Ok(()));
    assert_eq!(broken.unresolved, vec!["ghost:80", "server-v1:81"]);
    let fine = &att.verdicts[&ObjKey::new(NS, "fine")];
    assert_eq!((&fine.accepted, fine.unresolved.len()), (&Ok(()), 0));
    let s = compiled(&ix, &client()).snapshot;
    assert!(cluster(&s, "shop/ghost:80").endpoints.is_empty());
    assert!(cluster(&s, "shop/server-v1:81").endpoints.is_empty());
    assert_eq!(
        route_named(&s, "route:shop/fine/0").backends[0].cluster,
        "shop/server-v1:80"
    );
}

#[test]
fn of_two_routes_on_one_service_port_the_older_wins_whatever_the_event_order() {
    let older = split_route("b-older", "2026-01-01T00:00:00Z", 1, 1);
    let newer = split_route("a-newer", "2026-02-01T00:00:00Z", 1, 0);
    for order in [[&older, &newer], [&newer, &older]] {
        let mut ix = shop();
        for r in order {
            ix.apply_route(r);
        }
        let att = attach_routes(&ix);
        assert_eq!(att.verdicts[&ObjKey::new(NS, "b-older")].accepted, Ok(()));
        let lost = att.verdicts[&ObjKey::new(NS, "a-newer")]
            .accepted
            .clone()
            .unwrap_err();
        assert_eq!(lost.reason, "Conflicted");
        assert!(lost.message.contains("b-older"), "{}", lost.message);
        let out = compiled(&ix, &client());
        assert_eq!(out.routes, BTreeSet::from([ObjKey::new(NS, "b-older")]));
    }
    // Same timestamp: the name decides, so every replica agrees.
    let mut ix = shop();
    ix.apply_route(&split_route("y", "2026-01-01T00:00:00Z", 1, 1));
    ix.apply_route(&split_route("x", "2026-01-01T00:00:00Z", 1, 1));
    let att = attach_routes(&ix);
    assert_eq!(
        att.by_parent[&(ObjKey::new(NS, "server"), 80)],
        ObjKey::new(NS, "x")
    );
}

#[test]
fn invalid_and_parentless_routes_are_refused_with_their_reason() {
    let mut ix = shop();
    ix.apply_route(&route(
        "invalid",
        "2026-01-01T00:00:00Z",
        json!({"parentRef": {"name": "server", "port": 80},
               "rules": [{"backendRefs": [{"name": "server", "port": 80, "weight": 0}]}]}),
    ));
    ix.apply_route(&route(
        "no-port",
        "2026-01-01T00:00:00Z",
        json!({"parentRef": {"name": "server", "port": 81},
               "rules": [{"backendRefs": [{"name": "server", "port": 80}]}]}),
    ));
    ix.apply_service(&service("headless", "None", &[("db", 5432)]));
    ix.apply_route(&route(
        "tcp-headless",
        "2026-01-01T00:00:00Z",
        json!({"parentRef": {"name": "headless", "port": 5432}, "protocol": "tcp",
               "rules": [{"backendRefs": [{"name": "server", "port": 80}]}]}),
    ));
    let att = attach_routes(&ix);
    let refusal = |n: &str| {
        att.verdicts[&ObjKey::new(NS, n)]
            .accepted
            .clone()
            .unwrap_err()
    };
    assert_eq!(refusal("invalid").reason, "Invalid");
    assert_eq!(refusal("no-port").reason, "NoMatchingParent");
    let headless = refusal("tcp-headless");
    assert_eq!(headless.reason, "NoMatchingParent");
    assert!(
        headless.message.contains("headless"),
        "{}",
        headless.message
    );
    assert!(att.by_parent.is_empty());
    let s = compiled(&ix, &client()).snapshot;
    assert!(
        names(&s).iter().all(|n| n.starts_with("service:")),
        "{:?}",
        names(&s)
    );
}

// ------------------------------------------------------------ tcp Routes

/// `db` (ClusterIP 10.96.0.20) with an HTTP port 80 and a TCP port 5432,
/// and a tcp Route on 5432 splitting `v1`:`v2` over `db-v1` and `db-v2`.
fn db(ix: &mut Index, v1: i32, v2: i32, timeout: Option<&str>) {
    ix.apply_service(&service("db", "10.96.0.20", &[("http", 80), ("pg", 5432)]));
    for (i, v) in ["v1", "v2"].iter().enumerate() {
        let name = format!("db-{v}");
        let ip = format!("10.1.2.{}", i + 1);
        ix.apply_pod(&pod(&name, &ip, "db", json!({"app": "db", "version": v})));
        ix.apply_service(&service(
            &name,
            &format!("10.96.0.{}", i + 21),
            &[("pg", 5432)],
        ));
        ix.apply_endpoint_slice(&slice(
            &name,
            &format!("{name}-abc"),
            &[(&name, &ip, true)],
            &[("pg", 15432)],
        ));
    }
    let mut rule = json!({"backendRefs": [
        {"name": "db-v1", "port": 5432, "weight": v1},
        {"name": "db-v2", "port": 5432, "weight": v2}
    ]});
    if let Some(t) = timeout {
        rule["timeout"] = json!(t);
    }
    ix.apply_route(&route(
        "db-split",
        "2026-01-01T00:00:00Z",
        json!({"parentRef": {"name": "db", "port": 5432}, "protocol": "tcp", "rules": [rule]}),
    ));
}

#[test]
fn a_tcp_route_compiles_to_a_weighted_tcp_route_on_the_cluster_ip_and_port() {
    let mut ix = shop();
    db(&mut ix, 3, 1, Some("1s500ms"));
    let att = attach_routes(&ix);
    let key = ObjKey::new(NS, "db-split");
    assert_eq!(att.verdicts[&key].accepted, Ok(()));
    assert!(att.verdicts[&key].unresolved.is_empty());
    let out = compiled(&ix, &client());
    let s = &out.snapshot;
    assert_eq!(
        s.tcp_routes,
        vec![TcpRouteConfig {
            name: "route:shop/db-split".into(),
            listeners: vec!["outbound".into()],
            destinations: addrs(&["10.96.0.20:5432"]),
            backends: vec![
                WeightedBackend {
                    cluster: "shop/db-v1:5432".into(),
                    weight: 3
                },
                WeightedBackend {
                    cluster: "shop/db-v2:5432".into(),
                    weight: 1
                },
            ],
            connect_timeout_ms: Some(1_500),
        }]
    );
    assert_eq!(
        cluster(s, "shop/db-v1:5432").endpoints,
        addrs(&["10.1.2.1:15432"])
    );
    assert_eq!(
        cluster(s, "shop/db-v2:5432").endpoints,
        addrs(&["10.1.2.2:15432"])
    );
    // The tcp Route owns port 5432: no HTTP route there; port 80 keeps its
    // default route.
    assert!(
        !names(s).contains(&"service:shop/db:5432"),
        "{:?}",
        names(s)
    );
    assert!(names(s).contains(&"service:shop/db:80"));
    assert_eq!(out.routes, BTreeSet::from([key.clone()]));
    // The sidecar makes the destination opaque and draws 3:1.
    let c = baton_sidecar::config::compile(s).unwrap();
    let outbound = c.listener("outbound").unwrap();
    let dst: SocketAddr = "10.96.0.20:5432".parse().unwrap();
    assert!(outbound.is_opaque(dst));
    assert!(!outbound.is_opaque("10.96.0.20:80".parse().unwrap()));
    let r = outbound.tcp_route(dst).unwrap();
    let to_v1 = (0..4)
        .filter(|d| r.pick_backend(*d) == r.backends[0].0)
        .count();
    assert_eq!(to_v1, 3);

    // Deleting the Route gives the port back to the Service's endpoints.
    ix.delete_route(&key);
    let s = compiled(&ix, &client()).snapshot;
    assert!(s.tcp_routes.is_empty());
    assert_eq!(
        route_named(&s, "service:shop/db:5432").backends[0].cluster,
        "shop/db:5432"
    );
}

#[test]
fn a_tcp_route_without_timeout_or_with_0s_keeps_the_clusters_connect_timeout() {
    for timeout in [None, Some("0s")] {
        let mut ix = shop();
        db(&mut ix, 1, 1, timeout);
        let s = compiled(&ix, &client()).snapshot;
        assert_eq!(s.tcp_routes[0].connect_timeout_ms, None, "{timeout:?}");
    }
}

#[test]
fn an_http_route_and_a_tcp_route_on_two_ports_of_one_service_both_apply() {
    let mut ix = shop();
    db(&mut ix, 3, 1, None);
    ix.apply_route(&route(
        "db-http",
        "2026-01-01T00:00:00Z",
        json!({"parentRef": {"name": "db", "port": 80},
               "rules": [{"backendRefs": [{"name": "server-v2", "port": 80}]}]}),
    ));
    let att = attach_routes(&ix);
    assert_eq!(att.verdicts[&ObjKey::new(NS, "db-http")].accepted, Ok(()));
    assert_eq!(att.verdicts[&ObjKey::new(NS, "db-split")].accepted, Ok(()));
    let out = compiled(&ix, &client());
    let s = &out.snapshot;
    let http = route_named(s, "route:shop/db-http/0");
    assert_eq!(http.matches.ports, vec![80]);
    assert_eq!(http.backends[0].cluster, "shop/server-v2:80");
    assert_eq!(s.tcp_routes.len(), 1);
    assert_eq!(s.tcp_routes[0].destinations, addrs(&["10.96.0.20:5432"]));
    assert_eq!(
        out.routes,
        BTreeSet::from([ObjKey::new(NS, "db-http"), ObjKey::new(NS, "db-split")])
    );
}

#[test]
fn a_tcp_route_to_a_missing_backend_is_unresolved_and_its_connections_find_no_endpoint() {
    let mut ix = shop();
    db(&mut ix, 1, 1, None);
    ix.apply_route(&route(
        "db-split",
        "2026-01-01T00:00:00Z",
        json!({"parentRef": {"name": "db", "port": 5432}, "protocol": "tcp",
               "rules": [{"backendRefs": [{"name": "ghost", "port": 5432}, {"name": "db-v1", "port": 5432}]}]}),
    ));
    let att = attach_routes(&ix);
    let v = &att.verdicts[&ObjKey::new(NS, "db-split")];
    assert_eq!(v.accepted, Ok(()));
    assert_eq!(v.unresolved, vec!["ghost:5432"]);
    let s = compiled(&ix, &client()).snapshot;
    assert!(cluster(&s, "shop/ghost:5432").endpoints.is_empty());
    assert_eq!(s.tcp_routes[0].backends[0].cluster, "shop/ghost:5432");
}

#[test]
fn of_two_tcp_routes_on_one_service_port_the_older_wins() {
    let mut ix = shop();
    db(&mut ix, 1, 1, None);
    ix.apply_route(&route(
        "db-newer",
        "2026-02-01T00:00:00Z",
        json!({"parentRef": {"name": "db", "port": 5432}, "protocol": "tcp",
               "rules": [{"backendRefs": [{"name": "db-v2", "port": 5432}]}]}),
    ));
    let att = attach_routes(&ix);
    let lost = att.verdicts[&ObjKey::new(NS, "db-newer")]
        .accepted
        .clone()
        .unwrap_err();
    assert_eq!(lost.reason, "Conflicted");
    let s = compiled(&ix, &client()).snapshot;
    assert_eq!(s.tcp_routes.len(), 1);
    assert_eq!(s.tcp_routes[0].name, "route:shop/db-split");
}

// ------------------------------------------------------------ TLS

fn server_v1() -> ObjKey {
    ObjKey::new(NS, "server-v1")
}

#[test]
fn the_selected_tls_policy_gives_the_inbound_mode() {
    for (mode, want) in [
        ("Strict", TlsMode::Strict),
        ("Permissive", TlsMode::Permissive),
        ("Disabled", TlsMode::Disabled),
    ] {
        let mut ix = shop();
        ix.apply_tls_policy(&server_policy(mode));
        let out = compiled(&ix, &server_v1());
        let tls = out.snapshot.tls.expect("a selected pod gets a tls section");
        assert_eq!(tls.mode, want);
        assert_eq!(
            tls.identity.local.as_deref(),
            Some("spiffe://cluster.local/ns/shop/sa/server")
        );
        assert_eq!(out.tls_policy, Some(ObjKey::new(NS, "server")));
    }
}

#[test]
fn versions_suites_and_offload_come_from_the_policy() {
    let mut ix = shop();
    let mut p = tls_policy("server", json!({}), "Strict");
    p.spec.min_version = baton_crds::tls_policy::TlsVersion::Tls13;
    p.spec.cipher_suites = vec!["TLS13_AES_256_GCM_SHA384".into()];
    p.spec.private_key_offload.mode = baton_crds::tls_policy::OffloadMode::Preferred;
    ix.apply_tls_policy(&p);
    let tls = compiled(&ix, &server_v1()).snapshot.tls.unwrap();
    assert_eq!(tls.min_version, baton_config::tls::TlsVersion::Tls13);
    assert_eq!(tls.cipher_suites, ["TLS13_AES_256_GCM_SHA384"]);
    assert_eq!(tls.offload.mode, baton_config::tls::OffloadMode::Preferred);
}

/// The typed section is the JSON the operator sent when it built the
/// section by hand (`serde_json::json!`, before decision 0033): equal JSON
/// values, so a sidecar of the previous version reads the same settings.
/// The expected values are that builder's output, written out.
#[test]
fn the_typed_tls_section_serializes_to_the_json_the_operator_sent_before() {
    let identity_service = json!({"identity_service": {
        "url": "https://baton-identity.baton-system.svc:8443/v1/sign",
        "ca_bundle": "/var/run/secrets/baton.dev/ca/ca.crt",
    }});
    let section = |mode: &str, min: &str, suites: Value, offload: &str, sa: &str| {
        json!({
            "mode": mode,
            "min_version": min,
            "cipher_suites": suites,
            "identity": {
                "trust_domain": "cluster.local",
                "local": format!("spiffe://cluster.local/ns/shop/sa/{sa}"),
            },
            "source": identity_service,
            "offload": {"mode": offload},
        })
    };
    // Equal both ways: the typed section writes the old JSON, and the old
    // JSON reads as the typed section.
    let same = |s: &Snapshot, old: Value| {
        let tls = s.tls.as_ref().expect("a tls section");
        assert_eq!(serde_json::to_value(tls).unwrap(), old);
        assert_eq!(
            &serde_json::from_value::<baton_config::TlsSettings>(old).unwrap(),
            tls
        );
    };

    // A Strict policy with a version, a suite and offload.
    let mut ix = shop();
    let mut p = server_policy("Strict");
    p.spec.min_version = baton_crds::tls_policy::TlsVersion::Tls13;
    p.spec.cipher_suites = vec!["TLS13_AES_256_GCM_SHA384".into()];
    p.spec.private_key_offload.mode = baton_crds::tls_policy::OffloadMode::Required;
    ix.apply_tls_policy(&p);
    same(
        &compiled(&ix, &server_v1()).snapshot,
        section(
            "Strict",
            "1.3",
            json!(["TLS13_AES_256_GCM_SHA384"]),
            "Required",
            "server",
        ),
    );
    // A client without a policy, originating mTLS to that server.
    same(
        &compiled(&ix, &client()).snapshot,
        section("Permissive", "1.2", json!([]), "Disabled", "client"),
    );
    // A Disabled policy with the CRD's defaults.
    let mut ix = shop();
    ix.apply_tls_policy(&server_policy("Disabled"));
    same(
        &compiled(&ix, &server_v1()).snapshot,
        section("Disabled", "1.2", json!([]), "Disabled", "server"),
    );
}

/// The TlsPolicy CRD's cipher-suite list (its schema's enum) names only
/// suites the config model accepts, for the same TLS version: a policy the
/// API server admits compiles into a section the sidecar accepts.
#[test]
fn every_cipher_suite_the_crd_admits_is_known_to_the_config_model() {
    for (name, version) in baton_crds::tls_policy::CIPHER_SUITES {
        let known = baton_config::tls::cipher_suite(name)
            .unwrap_or_else(|| panic!("{name} is not in baton_config::tls::CIPHER_SUITES"));
        let version = match version {
            baton_crds::tls_policy::TlsVersion::Tls12 => baton_config::tls::TlsVersion::Tls12,
            baton_crds::tls_policy::TlsVersion::Tls13 => baton_config::tls::TlsVersion::Tls13,
        };
        assert_eq!(known.version, version, "{name}");
    }
}

#[test]
fn of_several_matching_policies_the_alphabetically_first_applies_and_others_select_nothing() {
    let mut ix = shop();
    ix.apply_tls_policy(&tls_policy(
        "b",
        json!({"matchLabels": {"app": "server"}}),
        "Permissive",
    ));
    ix.apply_tls_policy(&tls_policy(
        "a",
        json!({"matchLabels": {"app": "server"}}),
        "Strict",
    ));
    ix.apply_tls_policy(&tls_policy(
        "0-other",
        json!({"matchLabels": {"app": "nope"}}),
        "Disabled",
    ));
    let out = compiled(&ix, &server_v1());
    assert_eq!(out.tls_policy, Some(ObjKey::new(NS, "a")));
    assert_eq!(out.snapshot.tls.unwrap().mode, TlsMode::Strict);
    // A policy in another namespace never applies.
    let mut ix = shop();
    let mut foreign = tls_policy("a", json!({}), "Strict");
    foreign.metadata.namespace = Some("other".into());
    ix.apply_tls_policy(&foreign);
    assert_eq!(compiled(&ix, &server_v1()).tls_policy, None);
}

#[test]
fn a_secret_certificate_source_is_served_from_the_files_the_webhook_mounts() {
    use baton_crds::contract::volumes;
    let mut ix = shop();
    let mut p = tls_policy("server", json!({}), "Strict");
    p.spec.certificate.source = baton_crds::tls_policy::CertificateSourceKind::Secret;
    p.spec.certificate.secret_ref = Some(baton_crds::tls_policy::SecretRef { name: "s".into() });
    assert!(tls_policy_refusal(&p).is_none());
    ix.apply_tls_policy(&p);
    let out = compiled(&ix, &server_v1());
    assert_eq!(out.tls_policy, Some(ObjKey::new(NS, "server")));
    let tls = out.snapshot.tls.expect("a tls section");
    assert_eq!(tls.mode, TlsMode::Strict);
    assert_eq!(
        tls.source,
        Some(baton_config::tls::CertSource::Files {
            cert_chain: volumes::TLS_SECRET_CERT_PATH.into(),
            key: volumes::TLS_SECRET_KEY_PATH.into(),
            trust_bundle: volumes::TRUST_BUNDLE_PATH.into(),
            poll_interval_ms: baton_config::tls::DEFAULT_POLL_MS,
        })
    );
    // The workload's identity stays what peers expect: the sidecar refuses
    // a Secret whose certificate names another.
    assert_eq!(
        tls.identity.local.as_deref(),
        Some("spiffe://cluster.local/ns/shop/sa/server")
    );
}

#[test]
fn clients_originate_mtls_to_strict_or_permissive_meshed_servers_expecting_their_identity() {
    for mode in ["Strict", "Permissive"] {
        let mut ix = shop();
        ix.apply_tls_policy(&server_policy(mode));
        let s = compiled(&ix, &client()).snapshot;
        let mtls = cluster(&s, "shop/server:80")
            .mtls
            .clone()
            .expect("mtls to a meshed server");
        assert_eq!(
            mtls.identity.as_deref(),
            Some("spiffe://cluster.local/ns/shop/sa/server")
        );
        // The client has no policy: it gets certificates to originate, and
        // keeps accepting plaintext inbound as before.
        let tls = s.tls.expect("client gets a tls section to originate");
        assert_eq!(tls.mode, TlsMode::Permissive);
        assert_eq!(
            tls.identity.local.as_deref(),
            Some("spiffe://cluster.local/ns/shop/sa/client")
        );
    }
}

#[test]
fn mtls_is_not_originated_to_disabled_mixed_or_unmeshed_endpoints_nor_by_disabled_clients() {
    // Server Disabled: plaintext, and the client needs no certificates.
    let mut ix = shop();
    ix.apply_tls_policy(&server_policy("Disabled"));
    let s = compiled(&ix, &client()).snapshot;
    assert_eq!(cluster(&s, "shop/server:80").mtls, None);
    assert_eq!(s.tls, None);

    // Only v1 Strict: the shared Service has a plaintext v2 endpoint.
    let mut ix = shop();
    ix.apply_tls_policy(&tls_policy(
        "v1",
        json!({"matchLabels": {"version": "v1"}}),
        "Strict",
    ));
    let s = compiled(&ix, &client()).snapshot;
    assert_eq!(cluster(&s, "shop/server:80").mtls, None);
    assert!(cluster(&s, "shop/server-v1:80").mtls.is_some());

    // An endpoint Pod without a sidecar.
    let mut ix = shop();
    ix.apply_tls_policy(&server_policy("Strict"));
    let mut bare = pod("server-v2", "10.1.1.2", "server", json!({"app": "server"}));
    bare.metadata
        .labels
        .as_mut()
        .unwrap()
        .remove("baton.dev/injected");
    ix.apply_pod(&bare);
    let s = compiled(&ix, &client()).snapshot;
    assert_eq!(cluster(&s, "shop/server:80").mtls, None);

    // A client whose own policy is Disabled originates plaintext.
    let mut ix = shop();
    ix.apply_tls_policy(&server_policy("Strict"));
    ix.apply_tls_policy(&tls_policy(
        "client",
        json!({"matchLabels": {"app": "client"}}),
        "Disabled",
    ));
    let s = compiled(&ix, &client()).snapshot;
    assert_eq!(cluster(&s, "shop/server:80").mtls, None);
    assert_eq!(s.tls.unwrap().mode, TlsMode::Disabled);
}

#[test]
fn endpoints_under_two_service_accounts_stay_plaintext() {
    let mut ix = shop();
    ix.apply_tls_policy(&server_policy("Strict"));
    ix.apply_pod(&pod(
        "server-v2",
        "10.1.1.2",
        "server-two",
        json!({"app": "server", "version": "v2"}),
    ));
    let s = compiled(&ix, &client()).snapshot;
    assert_eq!(cluster(&s, "shop/server:80").mtls, None);
}

#[test]
fn without_an_identity_service_nothing_is_tls() {
    let mut ix = shop();
    ix.apply_tls_policy(&tls_policy("server", json!({}), "Strict"));
    let p = MeshParams {
        identity: None,
        ..params()
    };
    for pod in [client(), server_v1()] {
        let s = compiled_with(&ix, &p, &pod).snapshot;
        assert_eq!(s.tls, None);
        assert!(s.clusters.iter().all(|c| c.mtls.is_none()));
    }
}

// ------------------------------------------------------------ determinism

/// One object fed into an index.
type Feed = Box<dyn Fn(&mut Index)>;

#[test]
fn the_same_objects_compile_to_the_same_snapshot_in_any_order() {
    let split = split_route("split", "2026-01-01T00:00:00Z", 3, 1);
    let policy = server_policy("Strict");
    let v1 = pod(
        "server-v1",
        "10.1.1.1",
        "server",
        json!({"app": "server", "version": "v1"}),
    );
    let both = slice(
        "server",
        "server-abc",
        &[
            ("server-v1", "10.1.1.1", true),
            ("server-v2", "10.1.1.2", true),
        ],
        &[("http", 8080)],
    );
    let feeds: Vec<Feed> = vec![
        Box::new(move |ix| ix.apply_route(&split)),
        Box::new(move |ix| ix.apply_tls_policy(&policy)),
        Box::new(move |ix| ix.apply_pod(&v1)),
        Box::new(move |ix| ix.apply_endpoint_slice(&both)),
        Box::new(|ix| ix.apply_service(&service("server", "10.96.0.10", &[("http", 80)]))),
    ];
    let mut forward = shop();
    feeds.iter().for_each(|f| f(&mut forward));
    let mut backward = Index::default();
    feeds.iter().rev().for_each(|f| f(&mut backward));
    // The rest of the shop, after what shop() already fed.
    let rest = shop();
    backward.pods.extend(rest.pods.clone());
    backward.services.extend(rest.services.clone());
    for (k, v) in rest.endpoints {
        backward.endpoints.entry(k).or_default().extend(v);
    }
    for pod in [client(), server_v1()] {
        assert_eq!(compiled(&forward, &pod), compiled(&backward, &pod));
    }
}

#[test]
fn an_unknown_pod_is_an_error_not_a_default() {
    let ix = shop();
    let err = compile(
        &ix,
        &Attachments::default(),
        &params(),
        &ObjKey::new(NS, "ghost"),
    )
    .unwrap_err();
    assert!(err.to_string().contains("shop/ghost"), "{err}");
}

#[test]
fn pods_with_one_key_compile_alike() {
    // Pods of one namespace and ServiceAccount, some selected by a policy,
    // plus another ServiceAccount and another namespace.
    let mut ix = shop();
    ix.apply_pod(&pod(
        "client-2",
        "10.1.0.2",
        "client",
        json!({"app": "client"}),
    ));
    ix.apply_pod(&pod(
        "canary",
        "10.1.0.3",
        "client",
        json!({"app": "canary"}),
    ));
    let mut elsewhere = pod("client", "10.2.0.1", "client", json!({"app": "client"}));
    elsewhere.metadata.namespace = Some("other".into());
    ix.apply_pod(&elsewhere);
    ix.apply_tls_policy(&tls_policy(
        "canary",
        json!({"matchLabels": {"app": "canary"}}),
        "Strict",
    ));
    let pods = [
        client(),
        ObjKey::new(NS, "client-2"),
        ObjKey::new(NS, "canary"),
        ObjKey::new(NS, "server-v1"),
        ObjKey::new(NS, "server-v2"),
        ObjKey::new("other", "client"),
    ];
    let p = params();
    for a in &pods {
        for b in &pods {
            let (ka, kb) = (
                compile_key(&ix, "cluster.local", a),
                compile_key(&ix, "cluster.local", b),
            );
            let (sa, sb) = (
                compiled_with(&ix, &p, a).snapshot,
                compiled_with(&ix, &p, b).snapshot,
            );
            if ka == kb {
                assert_eq!(sa, sb, "{a:?} and {b:?} share {ka:?}");
            }
        }
    }
    // The groups: labels alone do not split a group, a policy does.
    assert_eq!(
        compile_key(&ix, "cluster.local", &client()),
        compile_key(&ix, "cluster.local", &ObjKey::new(NS, "client-2"))
    );
    assert_ne!(
        compile_key(&ix, "cluster.local", &client()),
        compile_key(&ix, "cluster.local", &ObjKey::new(NS, "canary"))
    );
    assert_ne!(
        compile_key(&ix, "cluster.local", &client()),
        compile_key(&ix, "cluster.local", &ObjKey::new("other", "client"))
    );
    assert_eq!(
        compile_key(&ix, "cluster.local", &ObjKey::new(NS, "gone")),
        CompileKey::Unknown(ObjKey::new(NS, "gone"))
    );
}

/// The hub's choice between a full snapshot and a delta, per stream: what
/// the stream's client declared, whether its last push is ACKed, and what it
/// resumed at.
mod push_kind {
    use std::sync::Arc;

    use baton_config::push::{Capabilities, ConfigKind, Reply, SharedPush};
    use tokio::sync::watch;

    use super::*;
    use crate::mesh::hub::{Hub, StreamId};
    use crate::mesh::metrics::PushMetrics;

    fn hub() -> Hub {
        let hub = Hub::new(params(), PushMetrics::default());
        hub.update(|ix| *ix = shop());
        hub.mark_synced();
        hub
    }

    /// The push waiting on `rx`, if a new one was sent since the last call.
    fn take(rx: &mut watch::Receiver<Option<Arc<SharedPush>>>) -> Option<Arc<SharedPush>> {
        if !rx.has_changed().unwrap() {
            return None;
        }
        rx.borrow_and_update().clone()
    }

    fn ack(hub: &Hub, id: StreamId, push: &SharedPush) {
        hub.reply(
            id,
            Reply::Ack {
                nonce: push.nonce.clone(),
                version: push.version,
            },
        );
    }

    /// Edits the split Route `n` times (a new weight each), recompiling and
    /// ACKing after each, and returns the kind of every push.
    fn edits(
        hub: &Hub,
        id: StreamId,
        rx: &mut watch::Receiver<Option<Arc<SharedPush>>>,
        n: i32,
    ) -> Vec<ConfigKind> {
        (1..=n)
            .map(|i| {
                hub.update(|ix| {
                    ix.apply_route(&split_route("split", "2026-01-01T00:00:00Z", i, 1))
                });
                assert_eq!(hub.recompile(), 1, "edit {i} reaches the sidecar");
                let push = take(rx).expect("a push per edit");
                ack(hub, id, &push);
                push.kind
            })
            .collect()
    }

    #[test]
    fn a_stream_without_the_delta_capability_gets_only_full_snapshots() {
        let hub = hub();
        let (id, mut rx) = hub.connect(client(), 0, Capabilities::default());
        assert_eq!(hub.recompile(), 1);
        let first = take(&mut rx).unwrap();
        assert_eq!((first.version, first.kind), (1, ConfigKind::Snapshot));
        ack(&hub, id, &first);
        assert_eq!(edits(&hub, id, &mut rx, 3), vec![ConfigKind::Snapshot; 3]);
        assert_eq!(hub.sidecars()[0].acked, Some(4));
    }

    #[test]
    fn a_stream_with_the_delta_capability_gets_deltas_after_its_first_ack() {
        let hub = hub();
        let (id, mut rx) = hub.connect(client(), 0, Capabilities::ALL);
        assert_eq!(hub.recompile(), 1);
        let first = take(&mut rx).unwrap();
        assert_eq!((first.version, first.kind), (1, ConfigKind::Snapshot));

        // Not yet ACKed: the sidecar's base is unknown, so the whole config.
        hub.update(|ix| ix.apply_route(&split_route("split", "2026-01-01T00:00:00Z", 9, 1)));
        assert_eq!(hub.recompile(), 1);
        let second = take(&mut rx).unwrap();
        assert_eq!((second.version, second.kind), (2, ConfigKind::Snapshot));
        // The stale reply to the first push is not an ACK of the second.
        ack(&hub, id, &first);
        ack(&hub, id, &second);

        let kinds = edits(&hub, id, &mut rx, 3);
        assert_eq!(
            kinds,
            vec![
                ConfigKind::Delta { base: 2 },
                ConfigKind::Delta { base: 3 },
                ConfigKind::Delta { base: 4 },
            ]
        );
    }

    #[test]
    fn two_streams_of_one_group_share_the_bytes_but_each_gets_its_own_kind() {
        let hub = hub();
        let (old_id, mut old_rx) = hub.connect(client(), 0, Capabilities::default());
        let (new_id, mut new_rx) = hub.connect(client(), 0, Capabilities::ALL);
        hub.recompile();
        let (a, b) = (take(&mut old_rx).unwrap(), take(&mut new_rx).unwrap());
        assert_eq!(a.json, b.json, "one serialization per group");
        ack(&hub, old_id, &a);
        ack(&hub, new_id, &b);
        hub.update(|ix| ix.apply_route(&split_route("split", "2026-01-01T00:00:00Z", 9, 1)));
        assert_eq!(hub.recompile(), 2);
        let (a, b) = (take(&mut old_rx).unwrap(), take(&mut new_rx).unwrap());
        assert_eq!(a.kind, ConfigKind::Snapshot);
        assert_eq!(b.kind, ConfigKind::Delta { base: 1 });
        assert!(
            b.json.len() < a.json.len(),
            "the delta ({} bytes) is smaller than the snapshot ({} bytes)",
            b.json.len(),
            a.json.len()
        );
    }

    #[test]
    fn a_resumed_stream_starts_with_a_full_snapshot_past_its_inherited_version() {
        // A process that took over through a handoff serves version 7 (sent
        // by another replica or before a restart: this hub never saw it).
        let hub = hub();
        let (id, mut rx) = hub.connect(client(), 7, Capabilities::ALL);
        assert_eq!(hub.sidecars()[0].acked, Some(7));
        assert_eq!(hub.recompile(), 1);
        let first = take(&mut rx).unwrap();
        assert_eq!((first.version, first.kind), (8, ConfigKind::Snapshot));
        ack(&hub, id, &first);
        // Then deltas onto what this hub sent.
        assert_eq!(
            edits(&hub, id, &mut rx, 1),
            vec![ConfigKind::Delta { base: 8 }]
        );
    }

    #[test]
    fn a_nacked_delta_is_followed_by_the_full_snapshot_and_then_deltas_again() {
        let hub = hub();
        let (id, mut rx) = hub.connect(client(), 0, Capabilities::ALL);
        hub.recompile();
        ack(&hub, id, &take(&mut rx).unwrap());
        hub.update(|ix| ix.apply_route(&split_route("split", "2026-01-01T00:00:00Z", 9, 1)));
        hub.recompile();
        let delta = take(&mut rx).unwrap();
        assert_eq!(delta.kind, ConfigKind::Delta { base: 1 });
        hub.reply(
            id,
            Reply::Nack {
                nonce: delta.nonce.clone(),
                error: "delta applies onto version 1, the sidecar serves 0".into(),
            },
        );
        // No index change: the NACK alone brings the whole config.
        assert_eq!(hub.recompile(), 1);
        let full = take(&mut rx).unwrap();
        assert_eq!((full.version, full.kind), (3, ConfigKind::Snapshot));
        ack(&hub, id, &full);
        assert_eq!(hub.sidecars()[0].nack, None);
        assert_eq!(
            edits(&hub, id, &mut rx, 1),
            vec![ConfigKind::Delta { base: 3 }]
        );
    }

    /// A tcp Route goes the way of an http one: pushed to the sidecar,
    /// Programmed once ACKed ("1/1 sidecars ACKed"), and an edit of its
    /// weights travels as a delta of the tcp routes alone.
    #[test]
    fn a_tcp_route_is_accepted_pushed_and_programmed_once_acked() {
        use crate::mesh::hub::Source;
        use crate::mesh::status::route_status;
        use baton_config::push::{Delta, Section};
        use baton_crds::conditions::route as rc;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let hub = hub();
        let mut ix = shop();
        db(&mut ix, 3, 1, None);
        hub.update(|i| *i = ix.clone());
        let (id, mut rx) = hub.connect(client(), 0, Capabilities::ALL);
        assert_eq!(hub.recompile(), 1);
        let first = take(&mut rx).unwrap();
        let sent: Snapshot = serde_json::from_slice(&first.json).unwrap();
        assert_eq!(sent.tcp_routes[0].name, "route:shop/db-split");
        let key = ObjKey::new(NS, "db-split");
        let source = Source::Route(key.clone(), 0);
        let r = ix.routes[&key].clone();
        let verdict = attach_routes(&ix).verdicts.remove(&key);
        let condition = |p: &crate::mesh::hub::Programmed, t: &str| {
            let now = Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000).unwrap());
            let s = route_status(&r, verdict.as_ref(), p, &now);
            s.conditions.into_iter().find(|c| c.type_ == t).unwrap()
        };
        let before = hub.programmed(&source);
        assert_eq!((before.acked, before.total), (0, 1));
        assert_eq!(condition(&before, rc::ACCEPTED).status, "True");
        assert_eq!(condition(&before, rc::RESOLVED_REFS).status, "True");
        assert_eq!(condition(&before, rc::PROGRAMMED).status, "False");
        ack(&hub, id, &first);
        let after = hub.programmed(&source);
        let programmed = condition(&after, rc::PROGRAMMED);
        assert_eq!(
            (programmed.status.as_str(), programmed.message.as_str()),
            ("True", "1/1 sidecars ACKed")
        );

        db(&mut ix, 1, 1, None);
        hub.update(|i| *i = ix.clone());
        assert_eq!(hub.recompile(), 1);
        let edit = take(&mut rx).unwrap();
        assert_eq!(
            edit.kind,
            ConfigKind::Delta {
                base: first.version
            }
        );
        let delta: Delta = serde_json::from_slice(&edit.json).unwrap();
        assert!(
            matches!(delta.sections.as_slice(), [Section::TcpRoutes(k)] if k.changed[0].backends[0].weight == 1),
            "{delta:?}"
        );
    }

    /// What a replica publishes for the leader's Programmed: per object, the
    /// sidecars its pushes reached and how many ACKed them.
    #[test]
    fn a_replicas_tally_counts_its_sidecars_per_object_and_their_acks() {
        use crate::mesh::tally::of_hub;
        let hub = hub();
        hub.update(|ix| ix.apply_route(&split_route("split", "2026-01-01T00:00:00Z", 9, 1)));
        let (id, mut rx) = hub.connect(client(), 0, Capabilities::default());
        assert_eq!(hub.recompile(), 1);
        let first = take(&mut rx).unwrap();
        let key = format!("Route/{NS}/split");
        let sent = of_hub(&hub, "op-a", 7);
        assert_eq!((sent.replica.as_str(), sent.at), ("op-a", 7));
        let e = &sent.objects[&key];
        assert_eq!((e.acked, e.total), (0, 1));
        ack(&hub, id, &first);
        let e = &of_hub(&hub, "op-a", 8).objects[&key];
        assert_eq!((e.acked, e.total, e.generation), (1, 1, 0));
        // Without sidecars the object stays listed (seen at its
        // generation), with nothing to count.
        hub.disconnect(id);
        let e = &of_hub(&hub, "op-a", 9).objects[&key];
        assert_eq!((e.acked, e.total, e.generation), (0, 0, 0));
    }

    /// A replica reports an object only at a generation its hub compiled:
    /// before the recompile no stream can hold it, and a peer that
    /// published "0/0" for a new Route made the leader write Programmed
    /// "0/0 sidecars ACKed" (the e2e route test caught it).
    #[test]
    fn a_tally_reports_objects_at_the_generation_last_compiled() {
        use crate::mesh::tally::of_hub;
        let hub = hub();
        let (id, mut rx) = hub.connect(client(), 0, Capabilities::default());
        assert_eq!(hub.recompile(), 1);
        ack(&hub, id, &take(&mut rx).unwrap());
        let key = format!("Route/{NS}/split");
        hub.update(|ix| ix.apply_route(&split_route("split", "2026-01-01T00:00:00Z", 9, 1)));
        assert!(!of_hub(&hub, "op-a", 1).objects.contains_key(&key));
        assert_eq!(hub.recompile(), 1);
        let e = &of_hub(&hub, "op-a", 2).objects[&key];
        assert_eq!((e.generation, e.acked, e.total), (0, 0, 1));
        // An edit not compiled yet: still reported at the old generation,
        // so the leader waits for this replica instead of counting it.
        let mut edited = split_route("split", "2026-01-01T00:00:00Z", 8, 2);
        edited.metadata.generation = Some(2);
        hub.update(|ix| ix.apply_route(&edited));
        assert_eq!(of_hub(&hub, "op-a", 3).objects[&key].generation, 0);
        hub.recompile();
        assert_eq!(of_hub(&hub, "op-a", 4).objects[&key].generation, 2);
    }

    /// Per-object bookkeeping is bounded by the objects that exist: 1,000
    /// Routes created, pushed, ACKed and deleted leave the index, the
    /// attachments, the compiled sources, the tally and the stream's
    /// snapshot where they started (issue #37: no state grows with churn).
    #[test]
    fn a_thousand_route_create_delete_cycles_leave_every_count_where_it_started() {
        use crate::mesh::tally::of_hub;
        let hub = hub();
        let (id, mut rx) = hub.connect(client(), 0, Capabilities::ALL);
        hub.recompile();
        ack(&hub, id, &take(&mut rx).unwrap());
        let counts = |hub: &Hub| {
            let o = hub.objects();
            (
                o.routes.len() + o.tls_policies.len() + o.authorization_policies.len(),
                hub.attachments().verdicts.len(),
                hub.compiled_sources().len(),
                of_hub(hub, "op-a", 0).objects.len(),
            )
        };
        let before = counts(&hub);
        for i in 0..1_000 {
            let name = format!("churn-{i}");
            hub.update(|ix| ix.apply_route(&split_route(&name, "2026-01-01T00:00:00Z", 9, 1)));
            hub.recompile();
            if let Some(push) = take(&mut rx) {
                ack(&hub, id, &push);
            }
            if i == 0 {
                // Each count does see a live Route (the test is not vacuous).
                let live = counts(&hub);
                assert!(
                    live.0 > before.0
                        && live.1 > before.1
                        && live.2 > before.2
                        && live.3 > before.3,
                    "{live:?} vs {before:?}"
                );
            }
            hub.update(|ix| ix.delete_route(&ObjKey::new(NS, &name)));
            hub.recompile();
            if let Some(push) = take(&mut rx) {
                ack(&hub, id, &push);
            }
        }
        assert_eq!(counts(&hub), before);
        let s = &hub.sidecars()[0];
        assert_eq!((s.nack.as_deref(), s.acked), (None, Some(s.version)));
    }

    /// The status writer's one pass over the streams counts each object as
    /// a pass per object would: every stream sent any generation of it
    /// counts once, ACKs count only for the generation asked about, and
    /// an object no stream holds counts nothing.
    #[test]
    fn one_pass_counts_each_object_per_generation_as_a_pass_per_object_would() {
        use crate::mesh::hub::Source;
        let hub = hub();
        hub.update(|ix| ix.apply_route(&split_route("split", "2026-01-01T00:00:00Z", 9, 1)));
        let (a, mut rx_a) = hub.connect(client(), 0, Capabilities::default());
        let (b, mut rx_b) = hub.connect(client(), 0, Capabilities::default());
        assert_eq!(hub.recompile(), 2);
        let (first_a, first_b) = (take(&mut rx_a).unwrap(), take(&mut rx_b).unwrap());
        ack(&hub, a, &first_a);
        // Generation 2: sent to both, ACKed by neither yet.
        let mut edited = split_route("split", "2026-01-01T00:00:00Z", 8, 2);
        edited.metadata.generation = Some(2);
        hub.update(|ix| ix.apply_route(&edited));
        assert_eq!(hub.recompile(), 2);
        let split = |g| Source::Route(ObjKey::new(NS, "split"), g);
        let sources = [
            split(2),
            split(0),
            Source::Route(ObjKey::new(NS, "absent"), 0),
            Source::TlsPolicy(ObjKey::new(NS, "split"), 0),
        ];
        let counts = |v: Vec<crate::mesh::hub::Programmed>| {
            v.into_iter()
                .map(|p| (p.acked, p.total))
                .collect::<Vec<_>>()
        };
        let all = counts(hub.programmed_all(&sources));
        assert_eq!(all, [(0, 2), (1, 2), (0, 0), (0, 0)]);
        assert_eq!(
            all,
            counts(sources.iter().map(|s| hub.programmed(s)).collect())
        );
        // Both ACK generation 2.
        let (next_a, next_b) = (take(&mut rx_a).unwrap(), take(&mut rx_b).unwrap());
        ack(&hub, a, &next_a);
        ack(&hub, b, &next_b);
        drop(first_b);
        assert_eq!(counts(hub.programmed_all(&sources[..2])), [(2, 2), (0, 2)]);
    }
}

// ------------------------------------------------------------ authorization

#[test]
fn allowed_clients_become_the_inbound_listeners_allow_list() {
    let mut ix = shop();
    let mut p = server_policy("Strict");
    p.spec.mtls.allowed_clients = vec![
        "shop/client".into(),
        "spiffe://cluster.local/ns/ops/sa/prober".into(),
    ];
    ix.apply_tls_policy(&p);
    let s = compiled(&ix, &server_v1()).snapshot;
    let inbound = s
        .listeners
        .iter()
        .find(|l| l.name == baton_config::INBOUND_LISTENER)
        .expect("an inbound listener");
    assert_eq!(inbound.rbac.as_deref(), Some("inbound-authorization"));
    assert_eq!(
        serde_json::to_value(&s.policies.rbac).unwrap(),
        json!([{
            "name": "inbound-authorization",
            "rules": [
                {"name": "tlspolicy:shop/server/mtls.allowedClients",
                 "action": "allow", "identities": [
                    "spiffe://cluster.local/ns/shop/sa/client",
                    "spiffe://cluster.local/ns/ops/sa/prober"]},
                {"name": "implicit-deny", "action": "deny"}
            ],
            "default_action": "allow"
        }])
    );
    // The outbound side and other Pods are untouched.
    let outbound = s
        .listeners
        .iter()
        .find(|l| l.name == baton_config::OUTBOUND_LISTENER)
        .unwrap();
    assert_eq!(outbound.rbac, None);
    let c = compiled(&ix, &client()).snapshot;
    assert!(c.policies.rbac.is_empty());
    assert!(c.listeners.iter().all(|l| l.rbac.is_none()));
}

#[test]
fn without_allowed_clients_no_rbac_is_compiled() {
    let mut ix = shop();
    ix.apply_tls_policy(&server_policy("Strict"));
    let s = compiled(&ix, &server_v1()).snapshot;
    assert!(s.policies.rbac.is_empty());
    assert!(s.listeners.iter().all(|l| l.rbac.is_none()));
}

#[test]
fn allowed_clients_without_an_identity_source_refuse_everyone() {
    let mut ix = shop();
    let mut p = server_policy("Strict");
    p.spec.mtls.allowed_clients = vec!["shop/client".into()];
    ix.apply_tls_policy(&p);
    let no_ca = MeshParams {
        identity: None,
        ..params()
    };
    let s = compiled_with(&ix, &no_ca, &server_v1()).snapshot;
    assert_eq!(s.tls, None);
    assert_eq!(s.policies.rbac.len(), 1, "an allow-list never fails open");
}

#[test]
fn invalid_allowed_clients_refuse_the_policy() {
    let mut p = server_policy("Strict");
    p.spec.mtls.allowed_clients = vec!["client".into()];
    let r = tls_policy_refusal(&p).expect("refused");
    assert_eq!(r.reason, "Invalid");
    assert!(r.message.contains("allowedClients[0]"), "{}", r.message);
    let mut ix = shop();
    ix.apply_tls_policy(&p);
    let out = compiled(&ix, &server_v1());
    assert_eq!(out.tls_policy, None);
    assert!(out.snapshot.policies.rbac.is_empty());
}

#[test]
fn service_ports_named_for_http2_get_http2_clusters() {
    for (name, want) in [
        ("http2", baton_config::UpstreamProtocol::Http2),
        ("grpc-api", baton_config::UpstreamProtocol::Http2),
        ("h2c", baton_config::UpstreamProtocol::Http2),
        ("http", baton_config::UpstreamProtocol::Http1),
        ("grpcweb", baton_config::UpstreamProtocol::Http1),
        ("", baton_config::UpstreamProtocol::Http1),
    ] {
        let mut ix = shop();
        ix.apply_service(&service("h2", "10.96.0.30", &[(name, 90)]));
        let s = compiled(&ix, &client()).snapshot;
        assert_eq!(
            cluster(&s, "shop/h2:90").protocol,
            want,
            "port name {name:?}"
        );
    }
}

// ---------------------------------------------------- AuthorizationPolicy

mod authorization {
    use super::*;
    use crate::mesh::authz;
    use baton_config::{RbacAction, RbacPolicy, RbacRule};
    use baton_crds::AuthorizationPolicy;
    use baton_crds::authorization_policy::DefaultAuthorization;

    fn policy(name: &str, spec: Value) -> AuthorizationPolicy {
        from(json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "AuthorizationPolicy",
            "metadata": {"name": name, "namespace": NS, "generation": 1},
            "spec": spec
        }))
    }

    /// [`compiled_with`]: every compiled policy is one the sidecar accepts.
    fn compile_for(ix: &Index, params: &MeshParams, pod: &ObjKey) -> WorkloadConfig {
        compiled_with(ix, params, pod)
    }

    fn rbac(ix: &Index, pod: &ObjKey) -> Option<RbacPolicy> {
        rbac_with(ix, &params(), pod)
    }

    fn rbac_with(ix: &Index, params: &MeshParams, pod: &ObjKey) -> Option<RbacPolicy> {
        let s = compile_for(ix, params, pod).snapshot;
        let inbound = s
            .listeners
            .iter()
            .find(|l| l.name == baton_config::INBOUND_LISTENER)
            .unwrap();
        assert_eq!(
            inbound.rbac.as_deref(),
            s.policies.rbac.first().map(|p| p.name.as_str()),
            "the inbound listener names the compiled policy"
        );
        assert!(s.policies.rbac.len() <= 1);
        s.policies.rbac.into_iter().next()
    }

    fn names(p: &RbacPolicy) -> Vec<(&str, RbacAction)> {
        p.rules
            .iter()
            .map(|r| (r.name.as_str(), r.action))
            .collect()
    }

    fn with_default(d: DefaultAuthorization) -> MeshParams {
        MeshParams {
            default_authorization: d,
            ..params()
        }
    }

    fn server_probed() -> Pod {
        from(json!({
            "metadata": {"name": "server-v1", "namespace": NS,
                         "labels": {"app": "server", "version": "v1", "baton.dev/injected": "true"}},
            "spec": {"serviceAccountName": "server", "containers": [
                {"name": "app", "ports": [{"name": "http", "containerPort": 8080}],
                 "readinessProbe": {"httpGet": {"port": "http", "path": "/ready?full=1"}},
                 "livenessProbe": {"httpGet": {"port": 8081}},
                 "startupProbe": {"tcpSocket": {"port": 8080}}},
                {"name": "baton-sidecar-a",
                 "readinessProbe": {"httpGet": {"port": 15021, "path": "/ready"}}}
            ]},
            "status": {"podIP": "10.1.1.1", "conditions": [{"type": "Ready", "status": "True"}]}
        }))
    }

    #[test]
    fn without_policies_the_default_default_compiles_no_rbac() {
        let ix = shop();
        assert_eq!(rbac(&ix, &server_v1()), None);
    }

    #[test]
    fn rules_compile_deny_then_audit_then_allow_then_the_implicit_deny_then_the_default() {
        let mut ix = shop();
        let sel = json!({"matchLabels": {"app": "server"}});
        ix.apply_authorization_policy(&policy("a-allow", json!({"podSelector": sel,
            "rules": [{"from": {"serviceAccounts": ["client"]}}, {"from": {"namespaces": ["ops"]}}]})));
        ix.apply_authorization_policy(&policy(
            "b-audit",
            json!({"podSelector": sel, "action": "Audit",
            "rules": [{"to": {"paths": [{"prefix": "/admin/"}]}}]}),
        ));
        ix.apply_authorization_policy(&policy(
            "c-deny",
            json!({"podSelector": sel, "action": "Deny",
            "rules": [{"from": {"ipBlocks": ["10.9.0.0/16"]}}]}),
        ));
        // Selects other Pods: not compiled here.
        ix.apply_authorization_policy(&policy(
            "d-other",
            json!({"podSelector": {"matchLabels": {"app": "client"}},
            "action": "Deny", "rules": [{}]}),
        ));
        let p = rbac(&ix, &server_v1()).unwrap();
        assert_eq!(
            names(&p),
            [
                ("shop/c-deny/rules[0]", RbacAction::Deny),
                ("shop/b-audit/rules[0]", RbacAction::Audit),
                ("shop/a-allow/rules[0]", RbacAction::Allow),
                ("shop/a-allow/rules[1]", RbacAction::Allow),
                ("implicit-deny", RbacAction::Deny),
            ]
        );
        assert_eq!(p.default_action, RbacAction::Allow);
        assert_eq!(p.rules[0].cidrs, ["10.9.0.0/16"]);
        assert_eq!(p.rules[1].path_prefixes, ["/admin/"]);
        assert_eq!(
            p.rules[2].identities,
            ["spiffe://cluster.local/ns/shop/sa/client"]
        );
        assert_eq!(p.rules[3].identities, ["spiffe://cluster.local/ns/ops/*"]);
        assert!(
            p.rules[4].ports.is_empty(),
            "an Allow policy on every port denies the rest everywhere"
        );
        let out = compile_for(&ix, &params(), &server_v1());
        assert_eq!(
            out.authorization_policies,
            ["a-allow", "b-audit", "c-deny"]
                .iter()
                .map(|n| ObjKey::new(NS, *n))
                .collect()
        );
    }

    /// An `app=api` Pod whose app container declares `ports` (name, number).
    fn api_pod(name: &str, ip: &str, ports: &[(&str, u16)]) -> Pod {
        let ports: Vec<Value> = ports
            .iter()
            .map(|(n, p)| json!({"name": n, "containerPort": p}))
            .collect();
        from(json!({
            "metadata": {"name": name, "namespace": NS,
                         "labels": {"app": "api", "baton.dev/injected": "true"}},
            "spec": {"serviceAccountName": "api", "containers": [
                {"name": "app", "ports": ports},
                {"name": "baton-sidecar-a", "ports": [{"name": "admin", "containerPort": 15021}]}
            ]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
        }))
    }

    /// Three `app=api` Pods: `http` on 8080, `http` on 9090, and one
    /// declaring only `grpc`.
    fn api_pods() -> Index {
        let mut ix = shop();
        ix.apply_pod(&api_pod("api-a", "10.1.2.1", &[("http", 8080)]));
        ix.apply_pod(&api_pod(
            "api-b",
            "10.1.2.2",
            &[("http", 9090), ("metrics", 9100)],
        ));
        ix.apply_pod(&api_pod("api-c", "10.1.2.3", &[("grpc", 7000)]));
        ix
    }

    #[test]
    fn a_port_name_resolves_per_pod_and_pods_with_other_numbers_compile_apart() {
        let mut ix = api_pods();
        ix.apply_authorization_policy(&policy(
            "web",
            json!({"podSelector": {"matchLabels": {"app": "api"}}, "ports": ["http"],
                   "rules": [{"from": {"serviceAccounts": ["client"]}}]}),
        ));
        let on = |pod: &str| rbac(&ix, &ObjKey::new(NS, pod)).unwrap();
        for (pod, port) in [("api-a", 8080), ("api-b", 9090)] {
            let p = on(pod);
            assert_eq!(
                names(&p),
                [
                    ("shop/web/rules[0]", RbacAction::Allow),
                    ("implicit-deny", RbacAction::Deny)
                ],
                "{pod}"
            );
            assert_eq!(
                p.rules[0].ports,
                [port],
                "{pod}: the rule is on its http port"
            );
            assert_eq!(
                p.rules[1].ports,
                [port],
                "{pod}: only http is implicitly denied"
            );
        }
        // api-c has no `http`: the policy applies to no port there — not
        // to every port, which an empty port list would mean.
        let p = on("api-c");
        assert!(p.rules.is_empty(), "{:?}", names(&p));
        assert_eq!(p.default_action, RbacAction::Allow);
        // Equal keys must mean equal configs: the resolved numbers differ.
        let key = |pod: &str| compile_key(&ix, "cluster.local", &ObjKey::new(NS, pod));
        assert_ne!(key("api-a"), key("api-b"));
        assert_ne!(key("api-a"), key("api-c"));
    }

    #[test]
    fn numbers_still_apply_where_a_listed_name_is_unknown_and_sidecar_ports_do_not_count() {
        let mut ix = api_pods();
        ix.apply_authorization_policy(&policy(
            "no-metrics",
            json!({"podSelector": {"matchLabels": {"app": "api"}}, "ports": [7000, "metrics", "admin"],
                   "action": "Deny", "rules": [{}]}),
        ));
        let ports = |pod: &str| {
            rbac(&ix, &ObjKey::new(NS, pod)).unwrap().rules[0]
                .ports
                .clone()
        };
        assert_eq!(ports("api-a"), [7000]);
        assert_eq!(ports("api-b"), [7000, 9100]);
        assert_eq!(
            ports("api-c"),
            [7000],
            "the sidecar's own `admin` is not the app's"
        );
    }

    #[test]
    fn an_unknown_port_name_is_reported_with_the_pods_and_the_names_they_declare() {
        let mut ix = api_pods();
        let web = policy(
            "web",
            json!({"podSelector": {"matchLabels": {"app": "api"}}, "ports": ["http", 8443],
                   "rules": [{}]}),
        );
        ix.apply_authorization_policy(&web);
        let key = ObjKey::new(NS, "web");
        let m = authz::unknown_ports(&ix, &key, &web).expect("api-c lacks http");
        assert!(
            m.starts_with(
                "Pod api-c declares no container port named \"http\" (it declares grpc):"
            ),
            "{m}"
        );
        assert!(
            m.contains("name a port they declare or use its number"),
            "{m}"
        );
        // Numbers only, or names every selected Pod declares: nothing to say.
        let numbers = policy(
            "n",
            json!({"podSelector": {"matchLabels": {"app": "api"}}, "ports": [80]}),
        );
        assert_eq!(
            authz::unknown_ports(&ix, &ObjKey::new(NS, "n"), &numbers),
            None
        );
        let grpc = policy(
            "g",
            json!({"podSelector": {"matchLabels": {"app": "api"}, "matchExpressions": [
            {"key": "app", "operator": "In", "values": ["api"]}]}, "ports": ["grpc"]}),
        );
        let m = authz::unknown_ports(&ix, &ObjKey::new(NS, "g"), &grpc).unwrap();
        assert!(m.starts_with("Pod api-a declares no container port named \"grpc\" (it declares http); Pod api-b declares no container port named \"grpc\" (it declares http, metrics):"), "{m}");

        // The status says so on ResolvedRefs; Accepted stays True.
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(1_800_000_000).unwrap(),
        );
        let p = crate::mesh::hub::Programmed::default();
        let m = authz::unknown_ports(&ix, &key, &web);
        let status = crate::mesh::status::authorization_policy_status(
            &web,
            "cluster.local",
            &p,
            m.as_deref(),
            &now,
        );
        let c = |t: &str| {
            status
                .conditions
                .iter()
                .find(|c| c.type_ == t)
                .unwrap()
                .clone()
        };
        assert_eq!(c("Accepted").status, "True");
        let r = c("ResolvedRefs");
        assert_eq!(
            (r.status.as_str(), r.reason.as_str()),
            ("False", "UnknownPort")
        );
        assert_eq!(Some(r.message), m);
        // The Pod gains the port: resolved.
        ix.apply_pod(&api_pod(
            "api-c",
            "10.1.2.3",
            &[("grpc", 7000), ("http", 8080)],
        ));
        assert_eq!(authz::unknown_ports(&ix, &key, &web), None);
        let status =
            crate::mesh::status::authorization_policy_status(&web, "cluster.local", &p, None, &now);
        let r = status
            .conditions
            .iter()
            .find(|c| c.type_ == "ResolvedRefs")
            .unwrap();
        assert_eq!(
            (r.status.as_str(), r.reason.as_str()),
            ("True", "ResolvedRefs")
        );
    }

    #[test]
    fn more_than_three_pods_without_a_name_are_counted_not_listed() {
        let mut ix = Index::default();
        for i in 0..5 {
            ix.apply_pod(&api_pod(&format!("api-{i}"), &format!("10.1.3.{i}"), &[]));
        }
        let p = policy("p", json!({"podSelector": {}, "ports": ["http"]}));
        let m = authz::unknown_ports(&ix, &ObjKey::new(NS, "p"), &p).unwrap();
        assert_eq!(m.matches("declares no container port").count(), 3, "{m}");
        assert!(m.contains("(it declares no named port)"), "{m}");
        assert!(m.contains("; and 2 more Pods:"), "{m}");
    }

    #[test]
    fn the_implicit_deny_covers_only_the_ports_allow_policies_select() {
        let mut ix = shop();
        let sel = json!({"matchLabels": {"app": "server"}});
        ix.apply_authorization_policy(&policy(
            "web",
            json!({"podSelector": sel, "ports": [8080],
            "rules": [{"to": {"methods": ["GET"], "paths": [{"exact": "/public"}]}}]}),
        ));
        ix.apply_authorization_policy(&policy(
            "admin",
            json!({"podSelector": sel, "ports": [9000, 8080],
            "rules": [{"from": {"serviceAccounts": ["ops/admin"]}}]}),
        ));
        let p = rbac(&ix, &server_v1()).unwrap();
        let deny = p.rules.last().unwrap();
        assert_eq!(
            (deny.name.as_str(), deny.action),
            ("implicit-deny", RbacAction::Deny)
        );
        assert_eq!(deny.ports, [8080, 9000]);
        assert_eq!(
            p.rules[0].ports,
            [8080, 9000],
            "a rule carries its policy's ports"
        );
        assert_eq!(p.rules[1].ports, [8080]);
        assert_eq!(p.rules[1].methods, ["GET"]);
        assert_eq!(p.rules[1].paths, ["/public"]);
        // Other ports: the default decides.
        assert_eq!(p.default_action, RbacAction::Allow);
    }

    #[test]
    fn allowed_clients_compile_like_an_allow_policy_on_every_port() {
        let mut by_tls = shop();
        let mut t = server_policy("Strict");
        t.spec.mtls.allowed_clients = vec!["shop/client".into()];
        by_tls.apply_tls_policy(&t);
        let mut by_authz = shop();
        by_authz.apply_tls_policy(&server_policy("Strict"));
        by_authz.apply_authorization_policy(&policy(
            "server",
            json!({
            "podSelector": {"matchLabels": {"app": "server"}},
            "rules": [{"from": {"identities": ["spiffe://cluster.local/ns/shop/sa/client"]}}]}),
        ));
        let strip = |mut p: RbacPolicy| {
            p.rules.iter_mut().for_each(|r| r.name.clear());
            p
        };
        let a = strip(rbac(&by_tls, &server_v1()).unwrap());
        let b = strip(rbac(&by_authz, &server_v1()).unwrap());
        assert_eq!(a, b);
        assert_eq!(a.rules.len(), 2);
    }

    #[test]
    fn every_default_compiles_to_its_documented_rule_and_action() {
        let ix = shop();
        let cases = [
            (DefaultAuthorization::AllUnauthenticated, None, None),
            (
                DefaultAuthorization::AllAuthenticated,
                Some(RbacRule {
                    name: "default:all-authenticated".into(),
                    action: RbacAction::Allow,
                    authenticated: Some(true),
                    ..Default::default()
                }),
                Some(RbacAction::Deny),
            ),
            (
                DefaultAuthorization::ClusterAuthenticated,
                Some(RbacRule {
                    name: "default:cluster-authenticated".into(),
                    action: RbacAction::Allow,
                    identities: vec!["spiffe://cluster.local/*".into()],
                    ..Default::default()
                }),
                Some(RbacAction::Deny),
            ),
            (DefaultAuthorization::Deny, None, Some(RbacAction::Deny)),
            (DefaultAuthorization::Audit, None, Some(RbacAction::Audit)),
        ];
        for (d, rule, action) in cases {
            let p = rbac_with(&ix, &with_default(d), &server_v1());
            assert_eq!(p.as_ref().map(|p| p.default_action), action, "{d}");
            assert_eq!(
                p.map(|p| p.rules).unwrap_or_default(),
                rule.into_iter().collect::<Vec<_>>(),
                "{d}"
            );
        }
    }

    #[test]
    fn a_namespace_annotation_overrides_the_flag_and_an_invalid_one_falls_back_to_it() {
        let mut ix = shop();
        let ns = |v: &str| -> k8s_openapi::api::core::v1::Namespace {
            from(json!({"metadata": {"name": NS,
                "annotations": {"baton.dev/default-authorization": v}}}))
        };
        ix.apply_namespace(&ns("deny"));
        let p = rbac(&ix, &server_v1()).unwrap();
        assert_eq!(p.default_action, RbacAction::Deny);
        // Another namespace keeps the flag's default.
        assert_eq!(
            authz::default_for(&ix, "other", DefaultAuthorization::Audit),
            DefaultAuthorization::Audit
        );
        ix.apply_namespace(&ns("nobody"));
        assert_eq!(rbac(&ix, &server_v1()), None);
        let audit = with_default(DefaultAuthorization::Audit);
        assert_eq!(
            rbac_with(&ix, &audit, &server_v1()).unwrap().default_action,
            RbacAction::Audit
        );
        ix.delete_namespace(NS);
        assert!(ix.namespace_defaults.is_empty());
    }

    #[test]
    fn http_probes_are_allowed_where_the_default_or_an_allow_policy_would_refuse_them() {
        let mut ix = shop();
        ix.apply_pod(&server_probed());
        assert_eq!(
            ix.pods[&server_v1()].probes,
            [(8080, "/ready".to_owned()), (8081, "/".to_owned())],
            "named ports resolve, queries are dropped, the sidecar's own probes and tcp probes are not taken"
        );
        // all-unauthenticated and no policy: nothing to compile.
        assert_eq!(rbac(&ix, &server_v1()), None);
        for d in [
            DefaultAuthorization::Deny,
            DefaultAuthorization::AllAuthenticated,
            DefaultAuthorization::ClusterAuthenticated,
            DefaultAuthorization::Audit,
        ] {
            let p = rbac_with(&ix, &with_default(d), &server_v1()).unwrap();
            let probes: Vec<&RbacRule> = p
                .rules
                .iter()
                .filter(|r| r.name.starts_with("probe:"))
                .collect();
            assert_eq!(probes.len(), 2, "{d}");
            assert_eq!(probes[0].name, "probe:8080/ready");
            assert_eq!(probes[0].action, RbacAction::Allow);
            assert_eq!(probes[0].ports, [8080]);
            assert_eq!(probes[0].methods, ["GET"]);
            assert_eq!(probes[0].paths, ["/ready"]);
        }
        // An Allow policy on 8080 only: the 8080 probe needs a rule, the
        // 8081 one falls to the default (allow) and needs none.
        ix.apply_authorization_policy(&policy(
            "web",
            json!({"podSelector": {}, "ports": [8080],
            "rules": [{"from": {"serviceAccounts": ["client"]}}]}),
        ));
        let p = rbac(&ix, &server_v1()).unwrap();
        assert_eq!(
            names(&p),
            [
                ("shop/web/rules[0]", RbacAction::Allow),
                ("probe:8080/ready", RbacAction::Allow),
                ("implicit-deny", RbacAction::Deny),
            ]
        );
        // An explicit Deny still comes first: a user can refuse probes.
        ix.apply_authorization_policy(&policy(
            "all",
            json!({"podSelector": {}, "action": "Deny", "rules": [{}]}),
        ));
        assert_eq!(
            rbac(&ix, &server_v1()).unwrap().rules[0].name,
            "shop/all/rules[0]"
        );
    }

    #[test]
    fn peer_fields_and_with_each_other_and_paths_or_within_a_rule() {
        let mut ix = shop();
        ix.apply_authorization_policy(&policy("p", json!({"podSelector": {}, "rules": [
            {"from": {"serviceAccounts": ["client", "ops/admin"], "namespaces": ["shop"]},
             "to": {"paths": [{"exact": "/a"}, {"prefix": "/b/"}],
                    "headers": [{"name": "X-Tenant", "exact": "t1"}]}},
            {"from": {"serviceAccounts": ["ops/admin"], "namespaces": ["shop"]}},
            {"from": {"identities": ["spiffe://cluster.local/ns/ops/sa/admin"], "namespaces": ["ops"],
                      "authenticated": true}}
        ]})));
        let p = rbac(&ix, &server_v1()).unwrap();
        assert_eq!(
            names(&p),
            [
                ("shop/p/rules[0]", RbacAction::Allow),
                ("shop/p/rules[0]", RbacAction::Allow),
                // rules[1] can match no peer (ops/admin is not in shop): gone.
                ("shop/p/rules[2]", RbacAction::Allow),
                ("implicit-deny", RbacAction::Deny),
            ]
        );
        assert_eq!(
            p.rules[0].identities,
            ["spiffe://cluster.local/ns/shop/sa/client"]
        );
        assert_eq!(
            (
                p.rules[0].paths.as_slice(),
                p.rules[0].path_prefixes.as_slice()
            ),
            (&["/a".to_owned()][..], &[][..])
        );
        assert_eq!(
            (
                p.rules[1].paths.as_slice(),
                p.rules[1].path_prefixes.as_slice()
            ),
            (&[][..], &["/b/".to_owned()][..])
        );
        assert_eq!(p.rules[1].headers[0].name, "x-tenant");
        assert_eq!(
            p.rules[2].identities,
            ["spiffe://cluster.local/ns/ops/sa/admin"]
        );
        assert_eq!(p.rules[2].authenticated, Some(true));
    }

    #[test]
    fn an_invalid_policy_or_one_of_another_trust_domain_is_not_compiled() {
        let mut ix = shop();
        ix.apply_authorization_policy(&policy(
            "foreign",
            json!({"podSelector": {}, "action": "Deny",
            "rules": [{"from": {"identities": ["spiffe://elsewhere/ns/shop/sa/client"]}}]}),
        ));
        ix.apply_authorization_policy(&policy(
            "bad",
            json!({"podSelector": {}, "action": "Deny", "rules": []}),
        ));
        assert_eq!(rbac(&ix, &server_v1()), None);
        let r = authz::refusal(
            &ix.authorization_policies[&ObjKey::new(NS, "foreign")],
            "cluster.local",
        )
        .unwrap();
        assert_eq!(r.reason, "Invalid");
        assert!(
            r.message.contains("not this mesh's \"cluster.local\""),
            "{}",
            r.message
        );
    }

    #[test]
    fn access_log_comes_from_a_selecting_policy_or_the_pod_annotation() {
        let inbound_logs = |ix: &Index, pod: &ObjKey| {
            compile_for(ix, &params(), pod)
                .snapshot
                .listeners
                .iter()
                .find(|l| l.name == baton_config::INBOUND_LISTENER)
                .unwrap()
                .access_log
        };
        let mut ix = shop();
        assert!(!inbound_logs(&ix, &server_v1()));
        ix.apply_authorization_policy(&policy(
            "log",
            json!({"podSelector": {"matchLabels": {"version": "v1"}},
            "accessLog": true, "action": "Audit", "rules": [{}]}),
        ));
        assert!(inbound_logs(&ix, &server_v1()));
        assert!(!inbound_logs(&ix, &ObjKey::new(NS, "server-v2")));
        let mut annotated = pod("client", "10.1.0.1", "client", json!({"app": "client"}));
        annotated.metadata.annotations =
            Some([("baton.dev/access-log".to_owned(), "true".to_owned())].into());
        ix.apply_pod(&annotated);
        assert!(inbound_logs(&ix, &client()));
    }

    #[test]
    fn pods_differing_in_probes_policies_or_access_log_get_different_compile_keys() {
        let mut ix = shop();
        let k = |ix: &Index| compile_key(ix, "cluster.local", &server_v1());
        let before = k(&ix);
        ix.apply_pod(&server_probed());
        let probed = k(&ix);
        assert_ne!(before, probed);
        ix.apply_authorization_policy(&policy(
            "v1",
            json!({"podSelector": {"matchLabels": {"version": "v1"}}}),
        ));
        assert_ne!(k(&ix), probed);
        assert_ne!(
            compile_key(&ix, "cluster.local", &server_v1()),
            compile_key(&ix, "cluster.local", &ObjKey::new(NS, "server-v2"))
        );
    }

    #[test]
    fn an_authorization_policy_is_programmed_once_its_pods_sidecars_ack_it() {
        use crate::mesh::hub::{Hub, Source};
        use crate::mesh::metrics::PushMetrics;
        use baton_config::push::{Capabilities, Reply};
        let hub = Hub::new(params(), PushMetrics::default());
        let ix = shop();
        hub.update(|i| *i = ix);
        hub.update(|i| {
            i.apply_authorization_policy(&policy(
                "web",
                json!({"podSelector": {"matchLabels": {"app": "server"}},
                "rules": [{"from": {"serviceAccounts": ["client"]}}]}),
            ))
        });
        hub.mark_synced();
        let (a, rx_a) = hub.connect(server_v1(), 0, Capabilities::ALL);
        let (_b, _rx_b) = hub.connect(ObjKey::new(NS, "server-v2"), 0, Capabilities::ALL);
        let (_c, _rx_c) = hub.connect(client(), 0, Capabilities::ALL);
        hub.recompile();
        let source = Source::AuthorizationPolicy(ObjKey::new(NS, "web"), 1);
        assert!(hub.compiled_sources().contains(&source));
        let p = hub.programmed(&source);
        assert_eq!(
            (p.acked, p.total),
            (0, 2),
            "two server Pods, not the client"
        );
        let nonce = rx_a.borrow().as_ref().unwrap().nonce.clone();
        hub.reply(a, Reply::Ack { nonce, version: 1 });
        let p = hub.programmed(&source);
        assert_eq!((p.acked, p.total), (1, 2));
        let status = crate::mesh::status::authorization_policy_status(
            &hub.objects().authorization_policies[0],
            "cluster.local",
            &p,
            None,
            &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::from_second(1_800_000_000).unwrap(),
            ),
        );
        let programmed = status
            .conditions
            .iter()
            .find(|c| c.type_ == "Programmed")
            .unwrap();
        assert_eq!(
            (programmed.status.as_str(), programmed.message.as_str()),
            ("False", "1/2 sidecars ACKed")
        );
        assert_eq!(status.observed_generation, Some(1));
    }
}

/// The re-issue trigger: which streams get it, and how the sidecars'
/// certificate reports are counted for the root rotation.
mod reissue {
    use std::sync::Arc;
    use std::time::Duration;

    use baton_config::push::{Capabilities, Push, Reply, SharedPush};
    use baton_config::tls::Reissue;
    use tokio::sync::watch;

    use super::*;
    use crate::mesh::hub::Hub;
    use crate::mesh::metrics::PushMetrics;

    /// The shop with a Strict server: the client originates mTLS, so its
    /// config has a TLS section.
    fn hub() -> Hub {
        let hub = Hub::new(params(), PushMetrics::default());
        hub.update(|ix| {
            *ix = shop();
            ix.apply_tls_policy(&server_policy("Strict"));
        });
        hub.mark_synced();
        hub
    }

    /// The trigger in the push waiting on `rx` (a full snapshot).
    fn trigger(rx: &mut watch::Receiver<Option<Arc<SharedPush>>>) -> Option<Reissue> {
        let push = rx.borrow_and_update().clone().expect("a push");
        let push: Push = serde_json::from_slice(&baton_config::push::encode_shared(&push)[4..])
            .expect("a push frame");
        push.snapshot
            .expect("a full snapshot")
            .tls
            .expect("a TLS section")
            .reissue
    }

    #[test]
    fn the_trigger_reaches_only_streams_that_declared_the_reissue_capability() {
        let hub = hub();
        hub.set_reissue("g1", Duration::from_secs(3));
        let (_old, mut old_rx) = hub.connect(client(), 0, Capabilities::default());
        let (_new, mut new_rx) = hub.connect(client(), 0, Capabilities::ALL);
        assert_eq!(hub.recompile(), 2);
        assert_eq!(
            trigger(&mut old_rx),
            None,
            "an earlier sidecar refuses the field"
        );
        assert_eq!(
            trigger(&mut new_rx),
            Some(Reissue {
                generation: "g1".into(),
                spread_ms: 3_000
            })
        );
    }

    #[test]
    fn a_new_generation_is_pushed_and_the_same_one_again_is_not() {
        let hub = hub();
        hub.set_reissue("g1", Duration::from_secs(1));
        let (_id, mut rx) = hub.connect(client(), 0, Capabilities::ALL);
        assert_eq!(hub.recompile(), 1);
        let _ = rx.borrow_and_update();
        hub.set_reissue("g1", Duration::from_secs(9));
        assert_eq!(hub.recompile(), 0, "same generation: nothing to push");
        hub.set_reissue("g2", Duration::from_secs(2));
        assert_eq!(hub.recompile(), 1, "a trust change reaches the sidecar");
        assert_eq!(trigger(&mut rx).unwrap().generation, "g2");
    }

    #[test]
    fn certificate_reports_are_counted_against_the_pushed_generation() {
        let hub = hub();
        assert_eq!(hub.trust_count(), None, "no generation pushed yet");
        hub.set_reissue("g2", Duration::from_secs(1));
        let (a, _rx_a) = hub.connect(client(), 0, Capabilities::ALL);
        let (b, _rx_b) = hub.connect(client(), 0, Capabilities::ALL);
        let (_quiet, _rx_c) = hub.connect(client(), 0, Capabilities::ALL);
        let report = |generation: &str| Reply::Certificate {
            generation: generation.into(),
        };
        hub.reply(a, report("g1"));
        hub.reply(b, report("g2"));
        let count = hub.trust_count().unwrap();
        // The stream that reported nothing holds no certificate to wait for.
        assert_eq!(
            (count.generation.as_str(), count.sidecars, count.current),
            ("g2", 2, 1)
        );
        hub.reply(a, report("g2"));
        assert_eq!(hub.trust_count().unwrap().current, 2);
        // A report is not an answer to a push: the stream's ACK state stays.
        assert!(hub.sidecars().iter().all(|s| s.nack.is_none()));
    }
}
