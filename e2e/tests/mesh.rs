//! Routes and TlsPolicies made live by the operator's config push, on the
//! installed control plane (issue #19): `kubectl apply` of a CRD changes
//! what meshed Pods' sidecars do, within seconds, without a restart.
//!
//! The scene: a meshed server with v1 and v2 Deployments behind one Service
//! `server` (plus `server-v1` / `server-v2` for the Route's backends), and
//! a meshed client Pod running `demo-fetch`, which sends requests to the
//! Service's ClusterIP — its own sidecar captures them and applies the
//! Routes compiled for it — and reports statuses and the answering server
//! per request. The test process asks it over the Pod network.
//!
//! `#[ignore]`d: run with `e2e/run.sh route_` / `e2e/run.sh tlspolicy_`.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use baton_crds::contract::labels;
use baton_e2e::demo::FLAKY_PATH;
use baton_e2e::fetch::{self, FetchProtocol, FetchReport, FetchSpec};
use baton_e2e::install::{self as baton};
use baton_e2e::rollout::ReleaseGuard;
use baton_e2e::{Check, kubectl_ok, pods, wait, wait_for, with_temp_ns_labelled};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

const PORT: u16 = 8080;
/// The application's UID in the driver Pods (any but the sidecar's).
const APP_UID: i64 = 1000;
const READY: Duration = Duration::from_secs(180);
/// A CRD change reaches every sidecar (debounce + push + apply) well within this.
const PROPAGATION: Duration = Duration::from_secs(60);
/// Tests share the cluster's operator; one scene at a time keeps the
/// failure messages about one thing.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn echo_deployment(name: &str, version: &str, replicas: i32) -> Deployment {
    let mut c = pods::container(
        "echo",
        "demo-http-echo",
        &["--listen", &format!("0.0.0.0:{PORT}")],
    );
    c.readiness_probe = Some(
        serde_json::from_value(json!({"tcpSocket": {"port": PORT}, "periodSeconds": 1})).unwrap(),
    );
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "server", "version": version}},
            "template": {
                "metadata": {"labels": {"app": "server", "version": version}},
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "automountServiceAccountToken": false,
                    "containers": [c],
                }
            }
        }
    }))
    .expect("a valid deployment")
}

fn service(name: &str, selector: serde_json::Value) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name},
        "spec": {"selector": selector, "ports": [{"name": "http", "port": PORT, "targetPort": PORT}]}
    }))
    .expect("a valid service")
}

/// The `demo-fetch` driver Pod; `meshed: false` opts it out of injection.
fn driver_pod(name: &str, meshed: bool) -> Pod {
    let mut c = pods::container("fetch", "demo-fetch", &[]);
    // Not the image's user: that is the sidecar's UID, whose traffic the
    // capture rules exempt (it would bypass the client's own sidecar).
    c.security_context = Some(k8s_openapi::api::core::v1::SecurityContext {
        run_as_user: Some(APP_UID),
        run_as_group: Some(APP_UID),
        ..Default::default()
    });
    c.readiness_probe = Some(
        serde_json::from_value(json!({"tcpSocket": {"port": fetch::PORT}, "periodSeconds": 1}))
            .unwrap(),
    );
    let mut p = pods::pod(name, vec![c]);
    if !meshed {
        p.metadata.labels.get_or_insert_with(BTreeMap::new).insert(
            labels::INJECT.to_owned(),
            labels::INJECT_DISABLED.to_owned(),
        );
    }
    p
}

struct Scene {
    client: Client,
    ns: String,
    /// The `server` Service's ClusterIP:port.
    server: SocketAddr,
    server_v1: SocketAddr,
    /// The meshed driver's `demo-fetch` address.
    driver: SocketAddr,
    _release: ReleaseGuard,
}

async fn service_addr(client: &Client, ns: &str, name: &str) -> SocketAddr {
    let svc = Api::<Service>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .unwrap_or_else(|e| panic!("service {name}: {e}"));
    let ip: IpAddr = svc
        .spec
        .and_then(|s| s.cluster_ip)
        .expect("a ClusterIP")
        .parse()
        .expect("an IP");
    SocketAddr::new(ip, PORT)
}

async fn ready_pod(client: &Client, ns: &str, pod: &Pod) -> Pod {
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), pod)
        .await
        .unwrap_or_else(|e| panic!("creating pod {:?}: {e}", pod.metadata.name));
    let name = pod.metadata.name.clone().expect("named");
    wait::pod_ready(client, ns, &name, READY)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Pods of the scene Ready, every one of them injected.
async fn scene(client: Client, ns: String, scope: &str) -> Scene {
    let release = format!("mesh-{scope}-{}", &ns[ns.len().saturating_sub(8)..]);
    baton::create_release(&client, &release, scope).await;
    let guard = ReleaseGuard(release);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    for (name, version) in [("server-v1", "v1"), ("server-v2", "v2")] {
        deployments
            .create(&PostParams::default(), &echo_deployment(name, version, 1))
            .await
            .unwrap_or_else(|e| panic!("deployment {name}: {e}"));
    }
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    for (name, selector) in [
        ("server", json!({"app": "server"})),
        ("server-v1", json!({"app": "server", "version": "v1"})),
        ("server-v2", json!({"app": "server", "version": "v2"})),
    ] {
        services
            .create(&PostParams::default(), &service(name, selector))
            .await
            .unwrap_or_else(|e| panic!("service {name}: {e}"));
    }
    let driver = ready_pod(&client, &ns, &driver_pod("client", true)).await;
    assert!(
        driver
            .metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(labels::INJECTED)),
        "the client Pod is injected"
    );
    wait_servers(&client, &ns, "app=server", 2).await;
    Scene {
        server: service_addr(&client, &ns, "server").await,
        server_v1: service_addr(&client, &ns, "server-v1").await,
        driver: SocketAddr::new(wait::pod_ip(&driver), fetch::PORT),
        client,
        ns,
        _release: guard,
    }
}

/// Programmed counts the sidecars on both operator replicas (each publishes
/// its push tally, the leader adds them up), so the scene's three sidecars
/// (client, server v1 and v2) are all in its "n/m" — whichever replica each
/// stream reached — and both replicas' tallies exist.
async fn programmed_on_every_replica(client: &Client, condition: &serde_json::Value) {
    let message = condition["message"].as_str().unwrap_or_default();
    let counts = message
        .split_once(" sidecars")
        .and_then(|(n, _)| n.split_once('/'))
        .and_then(|(a, t)| Some((a.parse::<usize>().ok()?, t.parse::<usize>().ok()?)));
    assert!(
        counts.is_some_and(|(acked, total)| acked == total && total >= 3),
        "Programmed counts every sidecar of the scene: {message}"
    );
    let tallies = Api::<ConfigMap>::namespaced(client.clone(), "baton-system")
        .list(&kube::api::ListParams::default().labels("baton.dev/push-tally=true"))
        .await
        .expect("list push tallies");
    assert!(
        tallies.items.len() >= 2,
        "each operator replica publishes its push tally: {:?}",
        tallies
            .items
            .iter()
            .map(|c| &c.metadata.name)
            .collect::<Vec<_>>()
    );
}

async fn wait_servers(client: &Client, ns: &str, selector: &str, n: usize) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait_for(&format!("{n} ready pods {selector}"), READY, || {
        let api = api.clone();
        async move {
            let pods = match api
                .list(&kube::api::ListParams::default().labels(selector))
                .await
            {
                Ok(l) => l.items,
                Err(e) => return Check::NotYet(e.to_string()),
            };
            let ready = pods.iter().filter(|p| wait::is_ready(p)).count();
            if ready == n && pods.len() == n {
                Check::Done(())
            } else {
                Check::NotYet(format!("{ready}/{} ready", pods.len()))
            }
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

impl Scene {
    fn spec(&self, target: SocketAddr, path: &str, count: usize) -> FetchSpec {
        FetchSpec {
            target,
            path: path.to_owned(),
            count,
            concurrency: 4,
            headers: BTreeMap::new(),
            protocol: FetchProtocol::Http1,
        }
    }

    async fn fetch(&self, spec: &FetchSpec) -> FetchReport {
        self.fetch_via(self.driver, spec).await
    }

    async fn fetch_via(&self, driver: SocketAddr, spec: &FetchSpec) -> FetchReport {
        fetch_from(driver, spec).await
    }

    /// Fetches (small batches) until `done` holds for a batch: the wait for
    /// a pushed config to reach the client's sidecar.
    async fn until(&self, what: &str, spec: &FetchSpec, done: impl Fn(&FetchReport) -> bool) {
        until_via(self.driver, what, spec, done).await;
    }

    async fn apply(&self, manifest: serde_json::Value) {
        let what = format!("{} {}", manifest["kind"], manifest["metadata"]["name"]);
        self.try_apply(manifest)
            .await
            .unwrap_or_else(|e| panic!("apply {what}: {e}"));
    }

    async fn try_apply(&self, manifest: serde_json::Value) -> Result<(), kube::Error> {
        let kind = manifest["kind"].as_str().expect("kind").to_owned();
        let name = manifest["metadata"]["name"]
            .as_str()
            .expect("name")
            .to_owned();
        let params = PatchParams::apply("baton-e2e").force();
        match kind.as_str() {
            "Route" => Api::<baton_crds::Route>::namespaced(self.client.clone(), &self.ns)
                .patch(&name, &params, &Patch::Apply(&manifest))
                .await
                .map(|_| ()),
            "TlsPolicy" => Api::<baton_crds::TlsPolicy>::namespaced(self.client.clone(), &self.ns)
                .patch(&name, &params, &Patch::Apply(&manifest))
                .await
                .map(|_| ()),
            other => panic!("cannot apply {other}"),
        }
    }

    /// Waits until the Route's condition `type_` has `status` (and, when
    /// given, `reason`) for its current generation; returns the condition.
    async fn route_condition(
        &self,
        name: &str,
        type_: &str,
        status: &str,
        reason: Option<&str>,
    ) -> serde_json::Value {
        let api = Api::<baton_crds::Route>::namespaced(self.client.clone(), &self.ns);
        wait_for(
            &format!("Route {name} {type_}={status}"),
            PROPAGATION,
            || {
                let api = api.clone();
                async move {
                    let route = match api.get(name).await {
                        Ok(r) => serde_json::to_value(r).expect("routes serialize"),
                        Err(e) => return Check::NotYet(e.to_string()),
                    };
                    let generation = route["metadata"]["generation"].clone();
                    let found = route["status"]["conditions"]
                        .as_array()
                        .and_then(|cs| cs.iter().find(|c| c["type"] == type_).cloned());
                    match found {
                        Some(c)
                            if c["status"] == status
                                && c["observedGeneration"] == generation
                                && reason.is_none_or(|r| c["reason"] == r) =>
                        {
                            Check::Done(c)
                        }
                        other => Check::NotYet(format!("{other:?}")),
                    }
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }
}

/// What `driver` reports for `spec`; panics when the driver fails.
async fn fetch_from(driver: SocketAddr, spec: &FetchSpec) -> FetchReport {
    fetch::fetch_via(driver, spec)
        .await
        .unwrap_or_else(|e| panic!("fetch {spec:?}: {e}"))
}

/// [`Scene::until`] through any driver (the meshed one or an outsider).
async fn until_via(
    driver: SocketAddr,
    what: &str,
    spec: &FetchSpec,
    done: impl Fn(&FetchReport) -> bool,
) {
    let done = &done;
    wait_for(what, PROPAGATION, || async move {
        match fetch::fetch_via(driver, spec).await {
            Ok(r) if done(&r) => Check::Done(()),
            Ok(r) => Check::NotYet(format!("{r:?}")),
            Err(e) => Check::NotYet(e),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

fn v2_share(r: &FetchReport) -> f64 {
    r.from_servers("server-v2-") as f64 / r.responses().max(1) as f64
}

#[tokio::test]
#[ignore = "needs the e2e cluster (e2e/run.sh)"]
async fn route_split_match_fault_retry_and_deletion_reach_the_clients_sidecar_and_scaling_loses_nothing()
 {
    let _serial = SERIAL.lock().await;
    let scope = "route-traffic";
    with_temp_ns_labelled(
        baton::injected_namespace_labels(scope),
        |client, ns| async move {
            let s = scene(client, ns, scope).await;

            // No Route: plain Service balancing over both versions, once
            // the endpoints of the Pod that became Ready last reached the
            // client's sidecar (Ready → Endpoints → operator → push).
            s.until(
                "plain Service balancing reaches both versions",
                &s.spec(s.server, "/", 200),
                |r| {
                    r.status(200) == 200
                        && r.from_servers("server-v1-") > 0
                        && r.from_servers("server-v2-") > 0
                },
            )
            .await;
            // The flaky path fails half the time without a retry policy.
            let flaky = s.fetch(&s.spec(s.server_v1, FLAKY_PATH, 40)).await;
            assert_eq!(
                flaky.status(503),
                4,
                "the backend is flaky without retries: {flaky:?}"
            );

            s.apply(json!({
                "apiVersion": "baton.dev/v1alpha1", "kind": "Route",
                "metadata": {"name": "server"},
                "spec": {
                    "parentRef": {"name": "server", "port": PORT},
                    "protocol": "http",
                    "rules": [
                        {"name": "canary",
                         "matches": [{"headers": [{"name": "x-canary", "value": "1"}]}],
                         "backendRefs": [{"name": "server-v2", "port": PORT}]},
                        {"name": "fault",
                         "matches": [{"path": {"type": "PathPrefix", "value": "/fault"}}],
                         "fault": {"abort": {"httpStatus": 418, "percent": 100}},
                         "backendRefs": [{"name": "server-v1", "port": PORT}]},
                        {"name": "flaky",
                         "matches": [{"path": {"type": "PathPrefix", "value": FLAKY_PATH}}],
                         "retries": {"attempts": 2, "retryOn": ["503"]},
                         "backendRefs": [{"name": "server-v1", "port": PORT}]},
                        {"name": "split",
                         "backendRefs": [
                            {"name": "server-v1", "port": PORT, "weight": 90},
                            {"name": "server-v2", "port": PORT, "weight": 10}]}
                    ]
                }
            }))
            .await;
            s.route_condition("server", "Accepted", "True", None).await;
            s.route_condition("server", "ResolvedRefs", "True", None)
                .await;
            let programmed = s
                .route_condition("server", "Programmed", "True", None)
                .await;
            eprintln!("Route server: {}", programmed["message"]);
            programmed_on_every_replica(&s.client, &programmed).await;

            let mut canary = s.spec(s.server, "/", 20);
            canary.headers.insert("x-canary".into(), "1".into());
            s.until("the canary header reaches v2 only", &canary, |r| {
                r.status(200) == 20 && r.from_servers("server-v2-") == 20
            })
            .await;

            // 90/10 over 1,000 requests: binomial sd ~9.5, the band is ±5 sd.
            let split = s.fetch(&s.spec(s.server, "/", 1000)).await;
            eprintln!("split: {split:?}");
            assert_eq!(split.errors, 0, "{split:?}");
            assert_eq!(split.status(200), 1000, "{split:?}");
            let share = v2_share(&split);
            assert!(
                (0.05..=0.15).contains(&share),
                "v2 got {share:.3} of 1,000: {split:?}"
            );

            canary.count = 100;
            let r = s.fetch(&canary).await;
            assert_eq!(r.from_servers("server-v2-"), 100, "header match: {r:?}");

            let fault = s.fetch(&s.spec(s.server, "/fault/x", 50)).await;
            assert_eq!(fault.status(418), 50, "fault abort: {fault:?}");
            assert_eq!(
                fault.from_servers("server-"),
                0,
                "a fault never reaches a server: {fault:?}"
            );

            let mut retried = s.spec(s.server, FLAKY_PATH, 100);
            retried.concurrency = 1;
            let r = s.fetch(&retried).await;
            assert_eq!(
                r.status(200),
                100,
                "the retry policy hides the flaky backend: {r:?}"
            );

            // Scale v1 up under traffic: endpoints follow without a failed request.
            let load = {
                let (driver, mut spec) = (s.driver, s.spec(s.server, "/", 3000));
                spec.concurrency = 2;
                tokio::spawn(async move { fetch::fetch_via(driver, &spec).await })
            };
            kubectl_ok(&["-n", &s.ns, "scale", "deployment/server-v1", "--replicas=3"]);
            wait_servers(&s.client, &s.ns, "app=server,version=v1", 3).await;
            let during = load.await.expect("load task").expect("load report");
            eprintln!("during scale-up: {during:?}");
            assert_eq!(during.errors, 0, "{during:?}");
            assert_eq!(during.status(200), during.responses(), "{during:?}");
            s.until(
                "requests reach all three v1 pods",
                &s.spec(s.server, "/", 200),
                |r| {
                    r.errors == 0
                        && r.servers
                            .keys()
                            .filter(|k| k.starts_with("server-v1-"))
                            .count()
                            == 3
                },
            )
            .await;

            // Deleting the Route returns to plain Service balancing.
            Api::<baton_crds::Route>::namespaced(s.client.clone(), &s.ns)
                .delete("server", &DeleteParams::default())
                .await
                .expect("delete the Route");
            s.until(
                "the fault rule is gone",
                &s.spec(s.server, "/fault/x", 20),
                |r| r.status(200) == 20,
            )
            .await;
            let r = s.fetch(&canary).await;
            assert!(
                r.from_servers("server-v1-") > 0,
                "the header no longer routes: {r:?}"
            );
        },
    )
    .await;
}

#[tokio::test]
#[ignore = "needs the e2e cluster (e2e/run.sh)"]
async fn route_status_names_missing_backends_and_a_second_route_on_a_port_is_refused() {
    let _serial = SERIAL.lock().await;
    let scope = "route-status";
    with_temp_ns_labelled(
        baton::injected_namespace_labels(scope),
        |client, ns| async move {
            let s = scene(client, ns, scope).await;
            let route = |name: &str, parent: &str, backend: &str| {
                json!({
                    "apiVersion": "baton.dev/v1alpha1", "kind": "Route",
                    "metadata": {"name": name},
                    "spec": {
                        "parentRef": {"name": parent, "port": PORT},
                        "protocol": "http",
                        "rules": [{"fault": {"abort": {"httpStatus": 418, "percent": 100}},
                                   "backendRefs": [{"name": backend, "port": PORT}]}]
                    }
                })
            };
            s.apply(route("broken", "server-v2", "missing")).await;
            s.apply(route("older", "server", "server-v1")).await;
            let c = s
                .route_condition("broken", "ResolvedRefs", "False", Some("BackendNotFound"))
                .await;
            assert!(
                c["message"].as_str().unwrap_or("").contains("missing"),
                "{c}"
            );
            // The other Route keeps working.
            s.route_condition("older", "Programmed", "True", None).await;
            s.until("the older Route applies", &s.spec(s.server, "/", 20), |r| {
                r.status(418) == 20
            })
            .await;

            // A second Route on the same Service port is refused at
            // admission with the one that holds it named (the operator's
            // Conflicted status covers Routes that got past a webhook that
            // was down: operator/src/mesh/status.rs tests).
            let err = s
                .try_apply(route("newer", "server", "server-v2"))
                .await
                .expect_err("a second Route on server:8080 is refused");
            assert!(err.to_string().contains("older"), "{err}");
            s.route_condition("older", "Accepted", "True", None).await;
        },
    )
    .await;
}

#[tokio::test]
#[ignore = "needs the e2e cluster (e2e/run.sh)"]
async fn tlspolicy_strict_refuses_an_unmeshed_pods_plaintext_and_permissive_accepts_both() {
    let _serial = SERIAL.lock().await;
    let scope = "tlspolicy";
    with_temp_ns_labelled(
        baton::injected_namespace_labels(scope),
        |client, ns| async move {
            let s = scene(client, ns, scope).await;
            let outsider = ready_pod(&s.client, &s.ns, &driver_pod("outsider", false)).await;
            assert!(
                !outsider
                    .metadata
                    .labels
                    .as_ref()
                    .is_some_and(|l| l.contains_key(labels::INJECTED)),
                "the outsider is not injected"
            );
            let outsider = SocketAddr::new(wait::pod_ip(&outsider), fetch::PORT);
            let policy = |mode: &str| {
                json!({
                    "apiVersion": "baton.dev/v1alpha1", "kind": "TlsPolicy",
                    "metadata": {"name": "server"},
                    "spec": {"podSelector": {"matchLabels": {"app": "server"}},
                             "mtls": {"mode": mode},
                             "certificate": {"source": "Mesh"}}
                })
            };
            s.apply(policy("Strict")).await;
            // The server's sidecars get certificates and refuse plaintext; the
            // meshed client's sidecar originates mTLS to them.
            let probe = s.spec(s.server_v1, "/", 10);
            until_via(
                outsider,
                "the outsider's plaintext is refused",
                &probe,
                |r| r.responses() == 0 && r.errors == 10,
            )
            .await;
            s.until("the meshed client is served over mTLS", &probe, |r| {
                r.status(200) == 10
            })
            .await;
            let r = s.fetch(&s.spec(s.server, "/", 200)).await;
            assert_eq!(r.status(200), 200, "meshed client under Strict: {r:?}");
            let server = Api::<Pod>::namespaced(s.client.clone(), &s.ns)
                .list(&kube::api::ListParams::default().labels("app=server,version=v1"))
                .await
                .expect("list")
                .items
                .remove(0);
            let handshakes = server_handshakes(wait::pod_ip(&server)).await;
            assert!(handshakes > 0, "the server's sidecar terminated mTLS");

            s.apply(policy("Permissive")).await;
            until_via(outsider, "Permissive serves the outsider", &probe, |r| {
                r.status(200) == 10
            })
            .await;
            let r = s.fetch(&s.spec(s.server, "/", 100)).await;
            assert_eq!(r.status(200), 100, "meshed client under Permissive: {r:?}");
        },
    )
    .await;
}

/// Server-side TLS handshakes that succeeded, from the sidecar's metrics.
async fn server_handshakes(ip: IpAddr) -> u64 {
    sidecar_metric(ip, |l| {
        l.contains("handshakes_total{")
            && l.contains("side=\"server\"")
            && l.contains("result=\"ok\"")
    })
    .await as u64
}

/// The sum of the sidecar's metric lines that `pick` selects (admin port,
/// readable from the node).
async fn sidecar_metric(ip: IpAddr, pick: impl Fn(&str) -> bool) -> f64 {
    let addr = SocketAddr::new(ip, baton_crds::contract::ports::ADMIN);
    let spec = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("admin port");
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(spec.as_bytes()).await.expect("write");
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out))
        .await
        .expect("metrics in time")
        .expect("read");
    out.lines()
        .filter(|l| pick(l))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

// ------------------------------------------------------------ tcp Route
//
// NOT YET RUN on a cluster (written with the tcp Route feature, compiled
// with `cargo test -p baton-e2e --no-run`). Run with `e2e/run.sh route_tcp`.

/// The tcp echo backends' port.
const ECHO_PORT: u16 = 7000;

/// `replicas` Pods of `demo-tcp-echo` labelled `app: tcp, version`.
fn tcp_echo_deployment(name: &str, version: &str) -> Deployment {
    let mut c = pods::container(
        "echo",
        "demo-tcp-echo",
        &["--listen", &format!("0.0.0.0:{ECHO_PORT}")],
    );
    c.readiness_probe = Some(
        serde_json::from_value(json!({"tcpSocket": {"port": ECHO_PORT}, "periodSeconds": 1}))
            .unwrap(),
    );
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "tcp", "version": version}},
            "template": {
                "metadata": {"labels": {"app": "tcp", "version": version}},
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "automountServiceAccountToken": false,
                    "containers": [c],
                }
            }
        }
    }))
    .expect("a valid deployment")
}

/// TCP connections the sidecar of the Pod at `ip` accepted inbound.
async fn inbound_tcp_connections(ip: IpAddr) -> f64 {
    sidecar_metric(ip, |l| {
        l.starts_with("baton_sidecar_connections_total{")
            && l.contains("listener=\"inbound\"")
            && l.contains("protocol=\"tcp\"")
    })
    .await
}

/// `n` TCP connections from the meshed driver to `target`, one echo
/// exchange each (a fetch of one exchange opens one connection).
async fn tcp_connections(driver: SocketAddr, target: SocketAddr, n: usize) -> FetchReport {
    let spec = FetchSpec {
        target,
        path: "/".into(),
        count: 1,
        concurrency: 1,
        headers: BTreeMap::new(),
        protocol: FetchProtocol::Tcp,
    };
    let mut total = FetchReport::default();
    for _ in 0..n / 8 {
        let batch = futures::future::join_all((0..8).map(|_| fetch_from(driver, &spec))).await;
        for r in batch {
            total.merge(r);
        }
    }
    total
}

#[tokio::test]
#[ignore = "needs the e2e cluster (e2e/run.sh)"]
async fn route_tcp_splits_new_connections_three_to_one_and_echoes_every_byte() {
    let _serial = SERIAL.lock().await;
    let scope = "route-tcp";
    with_temp_ns_labelled(
        baton::injected_namespace_labels(scope),
        |client, ns| async move {
            let s = scene(client, ns, scope).await;
            let deployments: Api<Deployment> = Api::namespaced(s.client.clone(), &s.ns);
            for (name, version) in [("tcp-v1", "v1"), ("tcp-v2", "v2")] {
                deployments
                    .create(&PostParams::default(), &tcp_echo_deployment(name, version))
                    .await
                    .unwrap_or_else(|e| panic!("deployment {name}: {e}"));
            }
            let services: Api<Service> = Api::namespaced(s.client.clone(), &s.ns);
            for (name, selector) in [
                ("tcp", json!({"app": "tcp"})),
                ("tcp-v1", json!({"app": "tcp", "version": "v1"})),
                ("tcp-v2", json!({"app": "tcp", "version": "v2"})),
            ] {
                let svc: Service = serde_json::from_value(json!({
                    "apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": name},
                    "spec": {"selector": selector,
                             "ports": [{"name": "tcp", "port": ECHO_PORT, "targetPort": ECHO_PORT}]}
                }))
                .expect("a valid service");
                services
                    .create(&PostParams::default(), &svc)
                    .await
                    .unwrap_or_else(|e| panic!("service {name}: {e}"));
            }
            wait_servers(&s.client, &s.ns, "app=tcp", 2).await;
            let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.ns);
            let pod_ip = |version: &'static str| {
                let pods = pods.clone();
                async move {
                    let list = pods
                        .list(
                            &kube::api::ListParams::default()
                                .labels(&format!("app=tcp,version={version}")),
                        )
                        .await
                        .expect("list tcp pods");
                    wait::pod_ip(&list.items[0])
                }
            };
            let (v1, v2) = (pod_ip("v1").await, pod_ip("v2").await);
            let mut tcp = service_addr(&s.client, &s.ns, "tcp").await;
            tcp.set_port(ECHO_PORT);

            s.apply(json!({
                "apiVersion": "baton.dev/v1alpha1", "kind": "Route",
                "metadata": {"name": "tcp-split"},
                "spec": {
                    "parentRef": {"name": "tcp", "port": ECHO_PORT},
                    "protocol": "tcp",
                    "rules": [{"timeout": "2s", "backendRefs": [
                        {"name": "tcp-v1", "port": ECHO_PORT, "weight": 3},
                        {"name": "tcp-v2", "port": ECHO_PORT, "weight": 1}
                    ]}]
                }
            }))
            .await;
            s.route_condition("tcp-split", "Accepted", "True", Some("Accepted"))
                .await;
            s.route_condition("tcp-split", "ResolvedRefs", "True", None)
                .await;
            let programmed = s
                .route_condition("tcp-split", "Programmed", "True", None)
                .await;
            programmed_on_every_replica(&s.client, &programmed).await;

            // Programmed: the client's sidecar ACKed the route. Every new
            // connection now picks v1 or v2 by weight.
            let (before1, before2) = (
                inbound_tcp_connections(v1).await,
                inbound_tcp_connections(v2).await,
            );
            let n = 400;
            let r = tcp_connections(s.driver, tcp, n).await;
            assert_eq!((r.echoed, r.errors), (n, 0), "every byte echoed: {r:?}");
            let to_v1 = inbound_tcp_connections(v1).await - before1;
            let to_v2 = inbound_tcp_connections(v2).await - before2;
            eprintln!("tcp Route 3:1 over {n} connections: v1 {to_v1}, v2 {to_v2}");
            // Binomial(400, 0.75): sd ~8.7; 240..=360 is ~7 sd either side
            // (a probe connection or two on the backends does not matter).
            assert!(
                (240.0..=360.0).contains(&to_v1) && to_v1 + to_v2 >= n as f64,
                "v1 {to_v1}, v2 {to_v2} of {n}"
            );

            // Deleting the Route: connections go to the `tcp` Service's
            // own endpoints again, bytes still intact.
            Api::<baton_crds::Route>::namespaced(s.client.clone(), &s.ns)
                .delete("tcp-split", &DeleteParams::default())
                .await
                .expect("delete the Route");
            let r = tcp_connections(s.driver, tcp, 40).await;
            assert_eq!((r.echoed, r.errors), (40, 0), "after deletion: {r:?}");
        },
    )
    .await;
}

// ------------------------------------------------------------ identity
//
// Mesh identity on the cluster: the SPIFFE identities the operator issues
// carry Strict mTLS for HTTP/1.1, HTTP/2 and TCP between meshed
// Deployments, decide who may call whom (`mtls.allowedClients`), survive
// the operator's absence and a root rotation. Run with `e2e/run.sh
// identity_`.

/// Workload certificate lifetime of the e2e install
/// (`BATON_IDENTITY_CERT_LIFETIME_SECONDS` in e2e/overlay): short enough that
/// renewals happen within a test.
const CERT_LIFETIME: Duration = Duration::from_secs(180);
/// How far the operator backdates a certificate's `notBefore`
/// (`operator::identity::issue` default).
const CERT_BACKDATE: Duration = Duration::from_secs(60);
/// The Service port that names HTTP/2 (its cluster speaks h2 over the mesh).
const H2_PORT: u16 = 8081;
/// The server's TCP echo port.
const TCP_PORT: u16 = 7070;
/// Traffic batches sent while the control plane changes under it.
const LOAD_BATCH: usize = 100;
/// The longest a background load may run, whatever the test does.
const LOAD_LIMIT: Duration = Duration::from_secs(900);

fn service_account(name: &str) -> k8s_openapi::api::core::v1::ServiceAccount {
    serde_json::from_value(json!({"metadata": {"name": name}})).expect("a valid service account")
}

/// The server: `replicas` Pods with HTTP echo on [`PORT`] and TCP echo on
/// [`TCP_PORT`], as ServiceAccount `server`.
fn identity_server(replicas: i32) -> Deployment {
    let mut d = echo_deployment("server", "v1", replicas);
    let mut tcp = pods::container(
        "tcp",
        "demo-tcp-echo",
        &["--listen", &format!("0.0.0.0:{TCP_PORT}")],
    );
    // Named, for AuthorizationPolicy `ports` by name.
    tcp.ports = Some(vec![container_port("tcp-echo", TCP_PORT)]);
    tcp.readiness_probe = Some(
        serde_json::from_value(json!({"tcpSocket": {"port": TCP_PORT}, "periodSeconds": 1}))
            .unwrap(),
    );
    let spec = d
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
        .expect("a pod spec");
    spec.containers[0].ports = Some(vec![container_port("http", PORT)]);
    spec.containers.push(tcp);
    spec.service_account_name = Some("server".into());
    d
}

fn container_port(name: &str, port: u16) -> k8s_openapi::api::core::v1::ContainerPort {
    k8s_openapi::api::core::v1::ContainerPort {
        name: Some(name.to_owned()),
        container_port: i32::from(port),
        ..Default::default()
    }
}

/// A Deployment of one `demo-fetch` driver running as ServiceAccount `name`.
fn fetch_deployment(name: &str) -> Deployment {
    let pod = driver_pod(name, true);
    let mut spec = pod.spec.expect("a pod spec");
    spec.service_account_name = Some(name.to_owned());
    spec.termination_grace_period_seconds = Some(2);
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec}
        }
    }))
    .expect("a valid deployment")
}

/// Two meshed Deployments and an intruder: `server` (Service `server`:
/// http 8080, http2 8081, tcp 7070), `client` and `intruder` drivers, each
/// under its own ServiceAccount.
struct IdScene {
    client: Client,
    ns: String,
    /// The `server` Service's ClusterIP.
    server: IpAddr,
    /// `client`'s driver.
    driver: SocketAddr,
    /// `intruder`'s driver.
    intruder: SocketAddr,
    server_pod: IpAddr,
    client_pod: IpAddr,
    release: ReleaseGuard,
}

async fn id_scene(client: Client, ns: String, scope: &str) -> IdScene {
    id_scene_with(client, ns, scope, 1).await
}

/// [`id_scene`] with `servers` server Pods.
async fn id_scene_with(client: Client, ns: String, scope: &str, servers: i32) -> IdScene {
    // A test before this one may have taken the operator away (and failed
    // before it was whole again): sidecars need it to start.
    baton::wait_whole(&client, "operator", READY)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let release = format!("mesh-{scope}-{}", &ns[ns.len().saturating_sub(8)..]);
    baton::create_release(&client, &release, scope).await;
    let guard = ReleaseGuard(release);
    let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(client.clone(), &ns);
    for sa in ["server", "client", "intruder"] {
        sas.create(&PostParams::default(), &service_account(sa))
            .await
            .unwrap_or_else(|e| panic!("service account {sa}: {e}"));
    }
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    for d in [
        identity_server(servers),
        fetch_deployment("client"),
        fetch_deployment("intruder"),
    ] {
        deployments
            .create(&PostParams::default(), &d)
            .await
            .unwrap_or_else(|e| panic!("deployment {:?}: {e}", d.metadata.name));
    }
    let svc: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "server"},
        "spec": {"selector": {"app": "server"}, "ports": [
            {"name": "http", "port": PORT, "targetPort": PORT},
            {"name": "http2", "port": H2_PORT, "targetPort": PORT},
            {"name": "tcp", "port": TCP_PORT, "targetPort": TCP_PORT}]}
    }))
    .expect("a valid service");
    Api::<Service>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &svc)
        .await
        .expect("service server");
    let mut ips = BTreeMap::new();
    for (app, n) in [("server", servers as usize), ("client", 1), ("intruder", 1)] {
        wait_servers(&client, &ns, &format!("app={app}"), n).await;
        let pod = Api::<Pod>::namespaced(client.clone(), &ns)
            .list(&kube::api::ListParams::default().labels(&format!("app={app}")))
            .await
            .expect("list")
            .items
            .remove(0);
        assert!(
            pod.metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key(labels::INJECTED)),
            "{app} is injected"
        );
        ips.insert(app, wait::pod_ip(&pod));
    }
    let server = service_addr(&client, &ns, "server").await.ip();
    IdScene {
        server,
        driver: SocketAddr::new(ips["client"], fetch::PORT),
        intruder: SocketAddr::new(ips["intruder"], fetch::PORT),
        server_pod: ips["server"],
        client_pod: ips["client"],
        client,
        ns,
        release: guard,
    }
}

impl IdScene {
    fn spec(&self, protocol: FetchProtocol, count: usize) -> FetchSpec {
        let port = match protocol {
            FetchProtocol::Http1 => PORT,
            FetchProtocol::Http2 => H2_PORT,
            FetchProtocol::Tcp => TCP_PORT,
        };
        FetchSpec {
            target: SocketAddr::new(self.server, port),
            path: "/".into(),
            count,
            concurrency: 2,
            headers: BTreeMap::new(),
            protocol,
        }
    }

    async fn policy(&self, allowed: &[String]) {
        self.policy_mode("Strict", allowed).await;
    }

    /// TlsPolicy `server` in `mode` (Strict, Permissive) for the server.
    async fn policy_mode(&self, mode: &str, allowed: &[String]) {
        let api = Api::<baton_crds::TlsPolicy>::namespaced(self.client.clone(), &self.ns);
        let manifest = json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "TlsPolicy",
            "metadata": {"name": "server"},
            "spec": {"podSelector": {"matchLabels": {"app": "server"}},
                     "mtls": {"mode": mode, "allowedClients": allowed},
                     "certificate": {"source": "Mesh"}}
        });
        api.patch(
            "server",
            &PatchParams::apply("baton-e2e").force(),
            &Patch::Apply(&manifest),
        )
        .await
        .unwrap_or_else(|e| panic!("apply TlsPolicy server: {e}"));
    }

    /// Waits until the client is served over Strict mTLS in all three
    /// protocols. Being served alone says nothing of mTLS: before the policy
    /// reaches the sidecars the client is served in plaintext. Nor does a
    /// certificate: a sidecar also gets one to originate mTLS to another
    /// test's Strict server. The client's sidecar originates mTLS to this
    /// server only once its config carries the policy, so the first
    /// handshake the server's sidecar counts says the client switched (on a
    /// fresh pool: a cluster whose mTLS changed drops its plaintext
    /// connections). Without this wait the next requests raced the policy:
    /// a request on a pooled plaintext connection met the server's new
    /// allow-list and was refused 403 (no identity), 1 to 38 of 200 in 9 of
    /// 53 runs beside a root rotation (docs/crds.md, allowedClients).
    async fn meshed(&self) {
        let (driver, spec) = (self.driver, self.spec(FetchProtocol::Http1, 5));
        let (server, spec) = (self.server_pod, &spec);
        wait_for(
            "the client's sidecar originates mTLS to the server",
            PROPAGATION,
            || async move {
                // Traffic opens the connection whose handshake is counted.
                let r = fetch::fetch_via(driver, spec).await;
                match server_handshakes(server).await {
                    0 => Check::NotYet(format!("no handshake yet; last batch {r:?}")),
                    n => Check::Done(n),
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        for p in [FetchProtocol::Http1, FetchProtocol::Http2] {
            until_via(
                self.driver,
                &format!("the client is served over {p:?}"),
                &self.spec(p, 10),
                |r| r.status(200) == 10,
            )
            .await;
        }
        until_via(
            self.driver,
            "the client's TCP is echoed",
            &self.spec(FetchProtocol::Tcp, 10),
            |r| r.echoed == 10,
        )
        .await;
    }

    /// The `notAfter` of the certificates the server's and the client's
    /// sidecars hold.
    async fn cert_expiries(&self) -> [u64; 2] {
        wait_for(
            "both sidecars report their certificate's notAfter",
            PROPAGATION,
            || async move {
                let mut out = [0; 2];
                for (i, ip) in [self.server_pod, self.client_pod].into_iter().enumerate() {
                    out[i] = sidecar_metric(ip, |l| {
                        l.starts_with("baton_sidecar_tls_cert_expiry_timestamp_seconds")
                    })
                    .await as u64;
                }
                if out.iter().all(|e| *e > 0) {
                    Check::Done(out)
                } else {
                    Check::NotYet(format!("notAfter {out:?}"))
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Waits until both sidecars hold a certificate issued after `t`
    /// (unix seconds): its notAfter is past `t` + the lifetime.
    async fn renewed_after(&self, what: &str, t: u64) -> [u64; 2] {
        let bound = t + CERT_LIFETIME.as_secs();
        wait_for(
            what,
            CERT_LIFETIME + Duration::from_secs(60),
            || async move {
                let e = self.cert_expiries().await;
                if e.iter().all(|e| *e > bound) {
                    Check::Done(e)
                } else {
                    Check::NotYet(format!("notAfter {e:?}, want > {bound}"))
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Restart counts of every container in the namespace, by Pod.
    async fn restarts(&self) -> BTreeMap<String, i32> {
        Api::<Pod>::namespaced(self.client.clone(), &self.ns)
            .list(&kube::api::ListParams::default())
            .await
            .expect("list pods")
            .items
            .into_iter()
            .map(|p| {
                let n = p
                    .status
                    .iter()
                    .flat_map(|s| {
                        s.container_statuses
                            .iter()
                            .flatten()
                            .chain(s.init_container_statuses.iter().flatten())
                    })
                    .map(|c| c.restart_count)
                    .sum();
                (p.metadata.name.unwrap_or_default(), n)
            })
            .collect()
    }

    /// HTTP/1.1 and TCP traffic from the client until [`Load::finish`]:
    /// TCP batches open new connections, so new mTLS handshakes happen
    /// throughout; HTTP/1.1 rides the client sidecar's pooled connections.
    fn load(&self) -> Load {
        self.load_from(&[self.driver], &[FetchProtocol::Http1, FetchProtocol::Tcp])
    }

    /// Traffic in every one of `protocols` from every one of `drivers`
    /// until [`Load::finish`], in batches of [`LOAD_BATCH`].
    fn load_from(&self, drivers: &[SocketAddr], protocols: &[FetchProtocol]) -> Load {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut tasks = Vec::new();
        for &driver in drivers {
            for &p in protocols {
                let (spec, stop) = (self.spec(p, LOAD_BATCH), stop.clone());
                let task = tokio::spawn(async move {
                    let started = std::time::Instant::now();
                    let mut total = FetchReport::default();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed)
                        && started.elapsed() < LOAD_LIMIT
                    {
                        match fetch::fetch_via(driver, &spec).await {
                            Ok(r) => total.merge(r),
                            Err(e) => {
                                total.errors += spec.count;
                                total.error_samples.push(format!("driver: {e}"));
                            }
                        }
                    }
                    total
                });
                tasks.push((p, task));
            }
        }
        Load { stop, tasks }
    }

    /// Successful server-side mTLS handshakes of every server Pod's sidecar
    /// (carried across handoffs, so the sum only grows).
    async fn server_handshakes(&self) -> u64 {
        let mut total = 0;
        for pod in self.pods("app=server").await {
            total += server_handshakes(wait::pod_ip(&pod)).await;
        }
        total
    }

    async fn pods_all(&self) -> Vec<Pod> {
        Api::<Pod>::namespaced(self.client.clone(), &self.ns)
            .list(&kube::api::ListParams::default())
            .await
            .expect("list pods")
            .items
    }

    async fn pods(&self, selector: &str) -> Vec<Pod> {
        Api::<Pod>::namespaced(self.client.clone(), &self.ns)
            .list(&kube::api::ListParams::default().labels(selector))
            .await
            .expect("list pods")
            .items
    }
}

struct Load {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<(FetchProtocol, tokio::task::JoinHandle<FetchReport>)>,
}

impl Load {
    /// Stops the traffic; (HTTP/1.1 report, TCP report) of a [`IdScene::load`].
    async fn finish(self) -> (FetchReport, FetchReport) {
        let mut by = self.finish_by_protocol().await;
        (
            by.remove(&FetchProtocol::Http1).unwrap_or_default(),
            by.remove(&FetchProtocol::Tcp).unwrap_or_default(),
        )
    }

    /// Stops the traffic; the reports merged by protocol.
    async fn finish_by_protocol(self) -> BTreeMap<FetchProtocol, FetchReport> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut out: BTreeMap<FetchProtocol, FetchReport> = BTreeMap::new();
        for (p, task) in self.tasks {
            out.entry(p)
                .or_default()
                .merge(task.await.expect("load task"));
        }
        out
    }
}

/// Asserts a load saw no failure at all, and prints its numbers.
fn no_failures(what: &str, (h1, tcp): &(FetchReport, FetchReport)) {
    eprintln!(
        "{what}: HTTP/1.1 {} requests, {} not 200, {} errors; TCP {} exchanges echoed, {} errors",
        h1.responses() + h1.errors,
        h1.responses() - h1.status(200),
        h1.errors,
        tcp.echoed,
        tcp.errors
    );
    assert!(h1.responses() > 0 && tcp.echoed > 0, "{what}: traffic ran");
    assert_eq!(h1.errors, 0, "{what}: {h1:?}");
    assert_eq!(h1.status(200), h1.responses(), "{what}: {h1:?}");
    assert_eq!(tcp.errors, 0, "{what}: {tcp:?}");
}

#[tokio::test]
#[ignore = "needs the e2e cluster (e2e/run.sh)"]
async fn identity_strict_mtls_carries_http1_http2_and_tcp_and_allowed_clients_decide_by_identity() {
    let _serial = SERIAL.lock().await;
    let scope = "identity-authz";
    with_temp_ns_labelled(
        baton::injected_namespace_labels(scope),
        |client, ns| async move {
            let s = id_scene(client, ns, scope).await;
            s.policy(&[format!("{}/client", s.ns)]).await;
            s.meshed().await;

            for p in [FetchProtocol::Http1, FetchProtocol::Http2] {
                let r = fetch_from(s.driver, &s.spec(p, 200)).await;
                assert_eq!(r.status(200), 200, "allowed client over {p:?}: {r:?}");
                assert_eq!(r.from_servers("server-"), 200, "{r:?}");
            }
            let tcp = fetch_from(s.driver, &s.spec(FetchProtocol::Tcp, 200)).await;
            assert_eq!((tcp.echoed, tcp.errors), (200, 0), "{tcp:?}");

            // The intruder is meshed too (its mTLS handshake succeeds), but
            // its identity is not on the list. The client being served says
            // nothing of whether the list reached the server's sidecar yet
            // (an empty list allows every mesh identity): wait for that.
            until_via(
                s.intruder,
                "the allow-list reaches the server's sidecar",
                &s.spec(FetchProtocol::Http1, 5),
                |r| r.status(403) == 5,
            )
            .await;
            for p in [FetchProtocol::Http1, FetchProtocol::Http2] {
                let r = fetch_from(s.intruder, &s.spec(p, 20)).await;
                assert_eq!(r.status(403), 20, "intruder over {p:?}: {r:?}");
                assert_eq!(r.from_servers("server-"), 0, "{r:?}");
            }
            let r = fetch_from(s.intruder, &s.spec(FetchProtocol::Tcp, 5)).await;
            assert_eq!((r.echoed, r.errors), (0, 5), "intruder over TCP: {r:?}");

            // What the server's sidecar saw: mTLS handshakes, HTTP/2 inside
            // them (the http2 port's cluster speaks h2 over the mesh), and
            // the refusals by identity.
            let ip = s.server_pod;
            let handshakes = server_handshakes(ip).await;
            let h2 = sidecar_metric(ip, |l| {
                l.starts_with("baton_sidecar_connections_total{")
                    && l.contains("listener=\"inbound\"")
                    && l.contains("protocol=\"http2\"")
            })
            .await;
            let denied = sidecar_metric(ip, |l| {
                l.starts_with("baton_sidecar_local_responses_total{")
                    && l.contains("reason=\"rbac_denied\"")
            })
            .await;
            eprintln!("server sidecar: {handshakes} mTLS handshakes, {h2} inbound h2 connections, {denied} rbac refusals");
            assert!(handshakes > 0 && h2 > 0.0 && denied > 0.0);

            // The list changes live: now only the intruder gets through.
            s.policy(&[format!("spiffe://cluster.local/ns/{}/sa/intruder", s.ns)])
                .await;
            until_via(
                s.intruder,
                "the intruder is allowed",
                &s.spec(FetchProtocol::Http1, 10),
                |r| r.status(200) == 10,
            )
            .await;
            let r = fetch_from(s.driver, &s.spec(FetchProtocol::Http1, 10)).await;
            assert_eq!(r.status(403), 10, "the client is no longer allowed: {r:?}");
        },
    )
    .await;
}

// ------------------------------------------------ certificate from a Secret
//
// Run with `e2e/run.sh tlspolicy_secret`.

/// A leaf for `uri` signed by the mesh CA (the operator's CA Secret),
/// valid until `not_after` (unix seconds): distinct values tell the
/// certificates apart through the sidecar's expiry metric. (PEM chain, PEM
/// key.)
async fn mesh_leaf(client: &Client, uri: &str, not_after: u64) -> (String, String) {
    use baton_crds::contract::{SYSTEM_NAMESPACE, identity};
    let ca =
        Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), SYSTEM_NAMESPACE)
            .get(identity::CA_SECRET)
            .await
            .expect("the mesh CA Secret");
    let data = ca.data.expect("the CA Secret has data");
    let pem = |k: &str| {
        String::from_utf8(
            data.get(k)
                .unwrap_or_else(|| panic!("CA Secret {k}"))
                .0
                .clone(),
        )
        .expect("PEM text")
    };
    let ca_key = rcgen::KeyPair::from_pem(&pem("tls.key")).expect("the CA key parses");
    let issuer = rcgen::Issuer::from_ca_cert_pem(&pem("tls.crt"), ca_key).expect("the CA cert");
    let key = rcgen::KeyPair::generate().expect("P-256 key");
    let mut params = rcgen::CertificateParams::default();
    params.subject_alt_names = vec![rcgen::SanType::URI(uri.try_into().expect("a valid URI"))];
    // What cert-manager writes for a workload certificate.
    params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let epoch = rcgen::date_time_ymd(1970, 1, 1);
    params.not_before = epoch + Duration::from_secs(unix_now() - 300);
    params.not_after = epoch + Duration::from_secs(not_after);
    let cert = params
        .signed_by(&key, &issuer)
        .expect("signed by the mesh CA");
    (cert.pem(), key.serialize_pem())
}

/// Creates or replaces the `kubernetes.io/tls` Secret `name`.
async fn put_tls_secret(client: &Client, ns: &str, name: &str, (crt, key): (String, String)) {
    let api = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), ns);
    let secret = json!({
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": name},
        "stringData": {"tls.crt": crt, "tls.key": key},
    });
    api.patch(
        name,
        &PatchParams::apply("baton-e2e").force(),
        &Patch::Apply(&secret),
    )
    .await
    .unwrap_or_else(|e| panic!("apply Secret {name}: {e}"));
}

#[tokio::test]
#[ignore = "needs the e2e cluster (e2e/run.sh)"]
async fn tlspolicy_secret_certificate_is_served_replaced_without_a_restart_and_kept_across_a_handoff()
 {
    use baton_e2e::rollout::{
        app_restarts, complete_on, make_versions, restarts, sidecar_image, wait_release,
    };
    let _serial = SERIAL.lock().await;
    let scope = "tls-secret";
    with_temp_ns_labelled(
        baton::injected_namespace_labels(scope),
        |client, ns| async move {
            make_versions(&["s2"], &[]).unwrap_or_else(|e| panic!("tagging s2: {e}"));
            let uri = format!("spiffe://cluster.local/ns/{ns}/sa/server");
            let now = unix_now();
            let first = now + 3 * 86_400 + 17;
            put_tls_secret(
                &client,
                &ns,
                "server-tls",
                mesh_leaf(&client, &uri, first).await,
            )
            .await;
            // The policy before the Pods: the webhook mounts the Secret into
            // the Pods it admits while the policy selects them.
            let policy = json!({
                "apiVersion": "baton.dev/v1alpha1", "kind": "TlsPolicy",
                "metadata": {"name": "server"},
                "spec": {"podSelector": {"matchLabels": {"app": "server"}},
                         "mtls": {"mode": "Strict"},
                         "certificate": {"source": "Secret", "secretRef": {"name": "server-tls"}}}
            });
            Api::<baton_crds::TlsPolicy>::namespaced(client.clone(), &ns)
                .patch(
                    "server",
                    &PatchParams::apply("baton-e2e").force(),
                    &Patch::Apply(&policy),
                )
                .await
                .unwrap_or_else(|e| panic!("apply TlsPolicy server: {e}"));
            let s = id_scene(client, ns, scope).await;
            // Served over Strict mTLS: the client's sidecar verified the
            // server's certificate against the mesh roots and its SPIFFE ID.
            s.meshed().await;
            let server_expiry = |s: &IdScene| {
                let ip = s.server_pod;
                async move {
                    sidecar_metric(ip, |l| {
                        l.starts_with("baton_sidecar_tls_cert_expiry_timestamp_seconds")
                    })
                    .await as u64
                }
            };
            assert_eq!(
                server_expiry(&s).await,
                first,
                "the server's sidecar serves the Secret's certificate"
            );
            let before = restarts(&s.pods_all().await);
            let load = s.load();

            // A replaced Secret is served without a restart (the kubelet
            // refreshes the mount on its sync, 10 s on this cluster).
            let second = now + 4 * 86_400 + 29;
            put_tls_secret(
                &s.client,
                &s.ns,
                "server-tls",
                mesh_leaf(&s.client, &uri, second).await,
            )
            .await;
            let t0 = std::time::Instant::now();
            wait_for(
                "the server's sidecar serves the replaced Secret",
                Duration::from_secs(120),
                || async {
                    match server_expiry(&s).await {
                        e if e == second => Check::Done(()),
                        e => Check::NotYet(format!("notAfter {e}")),
                    }
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            eprintln!("replaced Secret served after {:?}", t0.elapsed());
            let mid = restarts(&s.pods_all().await);
            assert_eq!(
                before, mid,
                "no container restarted for the new certificate"
            );

            // A hot upgrade: the next process reads the same mount.
            let release = s.release.0.clone();
            let patch = json!({"spec": {"version": "s2", "image": sidecar_image("s2")}});
            Api::<baton_crds::SidecarRelease>::all(s.client.clone())
                .patch(&release, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .unwrap_or_else(|e| panic!("patching {release} to s2: {e}"));
            wait_release(
                &s.client,
                &release,
                "every Pod on s2",
                Duration::from_secs(240),
                |st| complete_on(st, "s2", 3),
                |_| {},
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            let server_pod = s.pods("app=server").await.remove(0);
            assert_eq!(
                baton_e2e::rollout::last_handoff(&server_pod)
                    .map(|(v, _)| v)
                    .as_deref(),
                Some("s2"),
                "the server's sidecar was handed off"
            );
            assert_eq!(
                server_expiry(&s).await,
                second,
                "the new process serves the Secret's certificate"
            );
            // Still served through the mesh after the handoff.
            until_via(
                s.driver,
                "the client is served after the handoff",
                &s.spec(FetchProtocol::Http1, 10),
                |r| r.status(200) == 10,
            )
            .await;
            no_failures("Secret replaced, then a hot upgrade", &load.finish().await);
            let after = restarts(&s.pods_all().await);
            assert!(
                app_restarts(&before, &after).is_empty(),
                "application containers restarted: {:?}",
                app_restarts(&before, &after)
            );
        },
    )
    .await;
}

/// Server-side applies AuthorizationPolicy `name` with `spec` in `ns`.
async fn apply_authz(client: &Client, ns: &str, name: &str, spec: serde_json::Value) {
    let api = Api::<baton_crds::AuthorizationPolicy>::namespaced(client.clone(), ns);
    let manifest = json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "AuthorizationPolicy",
        "metadata": {"name": name}, "spec": spec
    });
    api.patch(
        name,
        &PatchParams::apply("baton-e2e").force(),
        &Patch::Apply(&manifest),
    )
    .await
    .unwrap_or_else(|e| panic!("apply AuthorizationPolicy {name}: {e}"));
}

/// `baton_sidecar_authz_total` of one rule and verdict on a Pod's sidecar.
async fn authz_count(ip: IpAddr, rule: &str, verdict: &str) -> f64 {
    let (rule, verdict) = (format!("rule=\"{rule}\""), format!("verdict=\"{verdict}\""));
    sidecar_metric(ip, |l| {
        l.starts_with("baton_sidecar_authz_total{") && l.contains(&rule) && l.contains(&verdict)
    })
    .await
}

#[tokio::test]
#[ignore = "needs the e2e cluster (e2e/run.sh)"]
async fn authz_policy_allows_a_service_account_one_path_denies_tcp_audits_and_changes_live() {
    let _serial = SERIAL.lock().await;
    let scope = "authz";
    with_temp_ns_labelled(
        baton::injected_namespace_labels(scope),
        |client, ns| async move {
            let s = id_scene(client, ns, scope).await;
            s.policy(&[]).await;
            s.meshed().await;
            let before = s.restarts().await;
            let get = |driver: SocketAddr, path: &str, n: usize| {
                let mut spec = s.spec(FetchProtocol::Http1, n);
                spec.path = path.to_owned();
                (driver, spec)
            };

            // Allow: the client's ServiceAccount may GET /public on the
            // http port; on that port nothing else is allowed.
            apply_authz(&s.client, &s.ns, "web", json!({
                "podSelector": {"matchLabels": {"app": "server"}},
                "ports": [PORT],
                "rules": [{"from": {"serviceAccounts": ["client"]},
                           "to": {"methods": ["GET"], "paths": [{"exact": "/public"}]}}]
            }))
            .await;
            let (d, private) = get(s.driver, "/private", 5);
            until_via(d, "the Allow policy reaches the server's sidecar", &private, |r| {
                r.status(403) == 5
            })
            .await;
            let (d, public) = get(s.driver, "/public", 50);
            let r = fetch_from(d, &public).await;
            assert_eq!(r.status(200), 50, "client GET /public: {r:?}");
            let (d, private) = get(s.driver, "/private", 20);
            let r = fetch_from(d, &private).await;
            assert_eq!(r.status(403), 20, "client GET /private: {r:?}");
            assert_eq!(r.from_servers("server-"), 0, "a 403 never reached the app: {r:?}");
            let (d, public) = get(s.intruder, "/public", 20);
            let r = fetch_from(d, &public).await;
            assert_eq!(r.status(403), 20, "intruder GET /public: {r:?}");
            // Ports no Allow policy selects keep the default: TCP echoes.
            let tcp = fetch_from(s.driver, &s.spec(FetchProtocol::Tcp, 20)).await;
            assert_eq!((tcp.echoed, tcp.errors), (20, 0), "{tcp:?}");

            // Programmed, with the server's one sidecar counted.
            let api = Api::<baton_crds::AuthorizationPolicy>::namespaced(s.client.clone(), &s.ns);
            wait_for("AuthorizationPolicy web is Programmed 1/1", PROPAGATION, || {
                let api = api.clone();
                async move {
                    let p = api.get("web").await.expect("get web");
                    let status = p.status.clone().unwrap_or_default();
                    let programmed = status.conditions.iter().find(|c| c.type_ == "Programmed");
                    match programmed {
                        Some(c) if c.status == "True" && c.message == "1/1 sidecars ACKed"
                            && status.observed_generation == p.metadata.generation => Check::Done(()),
                        _ => Check::NotYet(format!("{status:?}")),
                    }
                }
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));

            // Deny on the TCP port: the connection is closed, nothing echoed.
            apply_authz(&s.client, &s.ns, "no-tcp", json!({
                "podSelector": {"matchLabels": {"app": "server"}},
                "ports": [TCP_PORT], "action": "Deny", "rules": [{}]
            }))
            .await;
            until_via(s.driver, "the Deny policy closes TCP connections", &s.spec(FetchProtocol::Tcp, 5), |r| {
                r.echoed == 0 && r.errors == 5
            })
            .await;
            let r = fetch_from(s.driver, &s.spec(FetchProtocol::Tcp, 20)).await;
            assert_eq!((r.echoed, r.errors), (0, 20), "denied TCP: {r:?}");
            let denied = authz_count(s.server_pod, &format!("{}/no-tcp/rules[0]", s.ns), "deny").await;
            assert!(denied >= 20.0, "the deny rule counted its connections: {denied}");

            // Audit: lets the client through and the counter names the rule.
            apply_authz(&s.client, &s.ns, "watch", json!({
                "podSelector": {"matchLabels": {"app": "server"}},
                "action": "Audit",
                "rules": [{"from": {"namespaces": [s.ns.clone()]}, "to": {"paths": [{"prefix": "/pub"}]}}]
            }))
            .await;
            let audit_rule = format!("{}/watch/rules[0]", s.ns);
            let (d, public) = get(s.driver, "/public", 10);
            wait_for("the Audit policy records the client's requests", PROPAGATION, || {
                let (public, audit_rule) = (&public, &audit_rule);
                async move {
                    let r = fetch_from(d, public).await;
                    let audited = authz_count(s.server_pod, audit_rule, "audit").await;
                    if r.status(200) == 10 && audited >= 10.0 {
                        Check::Done(())
                    } else {
                        Check::NotYet(format!("{r:?}, {audited} audited"))
                    }
                }
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));

            // A live change: the intruder's ServiceAccount is added, no
            // restart anywhere.
            apply_authz(&s.client, &s.ns, "web", json!({
                "podSelector": {"matchLabels": {"app": "server"}},
                "ports": [PORT],
                "rules": [{"from": {"serviceAccounts": ["client", "intruder"]},
                           "to": {"methods": ["GET"], "paths": [{"exact": "/public"}]}}]
            }))
            .await;
            let started = std::time::Instant::now();
            let (d, public) = get(s.intruder, "/public", 5);
            until_via(d, "the edited policy lets the intruder in", &public, |r| r.status(200) == 5).await;
            eprintln!("policy edit live after {:?}", started.elapsed());
            assert_eq!(s.restarts().await, before, "no container restarted");
        },
    )
    .await;
}

/// Sets the namespace's `baton.dev/default-authorization` annotation.
async fn set_default_authorization(client: &Client, ns: &str, value: &str) {
    let patch = json!({"metadata": {"annotations": {
        baton_crds::contract::annotations::DEFAULT_AUTHORIZATION: value
    }}});
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .patch(ns, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_or_else(|e| panic!("annotating namespace {ns} {value}: {e}"));
}

#[tokio::test]
#[ignore = "needs the e2e cluster (e2e/run.sh)"]
async fn authz_all_authenticated_default_refuses_an_unmeshed_pod_serves_meshed_ones_and_reverts_live()
 {
    let _serial = SERIAL.lock().await;
    let scope = "authz-default";
    with_temp_ns_labelled(
        baton::injected_namespace_labels(scope),
        |client, ns| async move {
            let s = id_scene(client, ns, scope).await;
            // Permissive: the server's sidecar takes plaintext as well as
            // mTLS, so what refuses the outsider below is the default
            // authorization, not the TLS mode.
            s.policy_mode("Permissive", &[]).await;
            s.meshed().await;
            let outsider = ready_pod(&s.client, &s.ns, &driver_pod("outsider", false)).await;
            assert!(
                !outsider
                    .metadata
                    .labels
                    .as_ref()
                    .is_some_and(|l| l.contains_key(labels::INJECTED)),
                "the outsider is not injected"
            );
            let outsider = SocketAddr::new(wait::pod_ip(&outsider), fetch::PORT);
            let probe = s.spec(FetchProtocol::Http1, 10);
            until_via(
                outsider,
                "the outsider is served in plaintext by default",
                &probe,
                |r| r.status(200) == 10,
            )
            .await;
            let before = s.restarts().await;
            // The default is the namespace's, so it would also refuse this
            // test process (plaintext, no identity) on the meshed drivers'
            // control port: an Allow policy keeps that port open to anyone
            // (Allow policies come before the default), as a user exempts a
            // port. Programmed before the default changes.
            apply_authz(
                &s.client,
                &s.ns,
                "drivers-control",
                json!({
                    "podSelector": {"matchExpressions": [
                        {"key": "app", "operator": "In", "values": ["client", "intruder"]}]},
                    "ports": [fetch::PORT], "rules": [{}]
                }),
            )
            .await;
            let api = Api::<baton_crds::AuthorizationPolicy>::namespaced(s.client.clone(), &s.ns);
            wait_for(
                "AuthorizationPolicy drivers-control is Programmed 2/2",
                PROPAGATION,
                || {
                    let api = api.clone();
                    async move {
                        let p = api
                            .get("drivers-control")
                            .await
                            .expect("get drivers-control");
                        let status = p.status.clone().unwrap_or_default();
                        match status.conditions.iter().find(|c| c.type_ == "Programmed") {
                            Some(c)
                                if c.status == "True"
                                    && c.message == "2/2 sidecars ACKed"
                                    && status.observed_generation == p.metadata.generation =>
                            {
                                Check::Done(())
                            }
                            _ => Check::NotYet(format!("{status:?}")),
                        }
                    }
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));

            set_default_authorization(&s.client, &s.ns, "all-authenticated").await;
            let started = std::time::Instant::now();
            until_via(
                outsider,
                "all-authenticated refuses the outsider",
                &probe,
                |r| r.status(403) == 10,
            )
            .await;
            eprintln!("all-authenticated live after {:?}", started.elapsed());
            let r = fetch_from(outsider, &s.spec(FetchProtocol::Http1, 50)).await;
            assert_eq!(r.status(403), 50, "unmeshed under all-authenticated: {r:?}");
            assert_eq!(
                r.from_servers("server-"),
                0,
                "no refused request reached the app: {r:?}"
            );
            for (who, driver) in [("client", s.driver), ("intruder", s.intruder)] {
                for p in [FetchProtocol::Http1, FetchProtocol::Http2] {
                    let r = fetch_from(driver, &s.spec(p, 50)).await;
                    assert_eq!(
                        (r.status(200), r.errors),
                        (50, 0),
                        "meshed {who} over {p:?} under all-authenticated: {r:?}"
                    );
                }
            }
            let tcp = fetch_from(s.driver, &s.spec(FetchProtocol::Tcp, 20)).await;
            assert_eq!((tcp.echoed, tcp.errors), (20, 0), "meshed TCP: {tcp:?}");
            let denied = authz_count(s.server_pod, "default", "deny").await;
            assert!(
                denied >= 50.0,
                "the default's deny counted the outsider's requests: {denied}"
            );

            set_default_authorization(&s.client, &s.ns, "all-unauthenticated").await;
            let started = std::time::Instant::now();
            until_via(
                outsider,
                "all-unauthenticated serves the outsider again",
                &probe,
                |r| r.status(200) == 10,
            )
            .await;
            eprintln!("all-unauthenticated live after {:?}", started.elapsed());
            let r = fetch_from(outsider, &s.spec(FetchProtocol::Http1, 50)).await;
            assert_eq!(
                r.status(200),
                50,
                "unmeshed under all-unauthenticated: {r:?}"
            );
            let r = fetch_from(s.driver, &s.spec(FetchProtocol::Http1, 50)).await;
            assert_eq!(r.status(200), 50, "meshed under all-unauthenticated: {r:?}");
            assert_eq!(s.restarts().await, before, "no container restarted");
        },
    )
    .await;
}

#[tokio::test]
#[ignore = "needs the e2e cluster (e2e/run.sh)"]
async fn authz_denials_hold_across_a_sidecar_hot_upgrade_and_allowed_requests_all_succeed() {
    use baton_e2e::rollout::{
        app_restarts, complete_on, last_handoff, make_versions, restarts, sidecar_image,
        wait_release,
    };
    let _serial = SERIAL.lock().await;
    let scope = "authz-upgrade";
    with_temp_ns_labelled(
        baton::injected_namespace_labels(scope),
        |client, ns| async move {
            make_versions(&["z2"], &[]).unwrap_or_else(|e| panic!("tagging z2: {e}"));
            let s = id_scene(client, ns, scope).await;
            s.policy(&[]).await;
            s.meshed().await;
            // The intruder's ServiceAccount is denied on every HTTP request
            // (a rule with `to` never matches raw TCP, so its TCP is not
            // part of this test).
            apply_authz(&s.client, &s.ns, "no-intruder", json!({
                "podSelector": {"matchLabels": {"app": "server"}},
                "action": "Deny",
                "rules": [{"from": {"serviceAccounts": ["intruder"]}, "to": {"paths": [{"prefix": "/"}]}}]
            }))
            .await;
            until_via(
                s.intruder,
                "the Deny policy reaches the server's sidecar",
                &s.spec(FetchProtocol::Http1, 10),
                |r| r.status(403) == 10,
            )
            .await;
            let server_before = s.pods("app=server").await.remove(0);
            let before = restarts(&s.pods_all().await);

            let allowed = s.load_from(
                &[s.driver],
                &[FetchProtocol::Http1, FetchProtocol::Http2, FetchProtocol::Tcp],
            );
            let denied = s.load_from(&[s.intruder], &[FetchProtocol::Http1, FetchProtocol::Http2]);
            // Traffic flows before the handoff starts.
            tokio::time::sleep(Duration::from_secs(2)).await;
            let release = s.release.0.clone();
            let t0 = std::time::Instant::now();
            let patch = json!({"spec": {"version": "z2", "image": sidecar_image("z2")}});
            Api::<baton_crds::SidecarRelease>::all(s.client.clone())
                .patch(&release, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .unwrap_or_else(|e| panic!("patching {release} to z2: {e}"));
            wait_release(
                &s.client,
                &release,
                "every Pod on z2",
                ROLLOUT,
                |st| complete_on(st, "z2", 3),
                |_| {},
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            eprintln!("authz upgrade to z2: {:?}", t0.elapsed());
            // The new process answers for a while before the load stops.
            tokio::time::sleep(Duration::from_secs(2)).await;
            let allowed = allowed.finish_by_protocol().await;
            let denied = denied.finish_by_protocol().await;

            for (p, r) in &allowed {
                eprintln!(
                    "allowed {p:?} across the upgrade: {} responses, {} not 200, {} TCP echoed, {} errors",
                    r.responses(),
                    r.responses() - r.status(200),
                    r.echoed,
                    r.errors
                );
                assert_eq!(r.errors, 0, "allowed {p:?}: {r:?}");
                if *p == FetchProtocol::Tcp {
                    assert!(r.echoed > 0, "TCP traffic ran");
                } else {
                    assert!(r.responses() > 0, "{p:?} traffic ran");
                    assert_eq!(r.status(200), r.responses(), "allowed {p:?}: {r:?}");
                }
            }
            for (p, r) in &denied {
                eprintln!(
                    "denied {p:?} across the upgrade: {} responses, {} not 403, {} reached the app, {} errors",
                    r.responses(),
                    r.responses() - r.status(403),
                    r.from_servers("server-"),
                    r.errors
                );
                assert!(r.responses() > 0, "denied {p:?} traffic ran");
                assert_eq!(r.status(403), r.responses(), "no denied {p:?} request admitted: {r:?}");
                assert_eq!(r.from_servers("server-"), 0, "denied {p:?} reached the app: {r:?}");
                assert_eq!(r.errors, 0, "denied {p:?}: {r:?}");
            }

            // In place: the same Pod, handed off to z2, no application
            // container restarted. (The sidecar's slot containers restart
            // for their image swap by design: that is the handoff.)
            let server_after = s.pods("app=server").await.remove(0);
            assert_eq!(
                server_after.metadata.uid, server_before.metadata.uid,
                "the server Pod was not replaced"
            );
            assert_eq!(
                last_handoff(&server_after).map(|(v, _)| v).as_deref(),
                Some("z2"),
                "the server's sidecar was handed off"
            );
            let after = restarts(&s.pods_all().await);
            assert!(
                app_restarts(&before, &after).is_empty(),
                "application containers restarted: {:?}",
                app_restarts(&before, &after)
            );
            // The new process still enforces the policy.
            let r = fetch_from(s.intruder, &s.spec(FetchProtocol::Http1, 20)).await;
            assert_eq!(r.status(403), 20, "intruder after the upgrade: {r:?}");
            let r = fetch_from(s.driver, &s.spec(FetchProtocol::Http1, 20)).await;
            assert_eq!(r.status(200), 20, "client after the upgrade: {r:?}");
        },
    )
    .await;
}

/// Server-side applies AuthorizationPolicy `name`; the API server's (or
/// the webhook's) refusal message when it is refused.
async fn try_apply_authz(
    client: &Client,
    ns: &str,
    name: &str,
    spec: serde_json::Value,
) -> Result<(), String> {
    let api = Api::<baton_crds::AuthorizationPolicy>::namespaced(client.clone(), ns);
    let manifest = json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "AuthorizationPolicy",
        "metadata": {"name": name}, "spec": spec
    });
    match api
        .patch(
            name,
            &PatchParams::apply("baton-e2e").force(),
            &Patch::Apply(&manifest),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) => Err(e.message),
        Err(e) => panic!("apply AuthorizationPolicy {name}: {e}"),
    }
}

#[tokio::test]
#[ignore = "needs the e2e cluster (e2e/run.sh)"]
async fn authz_port_names_resolve_on_the_pod_and_unknown_or_malformed_names_are_refused_at_admission()
 {
    let _serial = SERIAL.lock().await;
    let scope = "authz-ports";
    with_temp_ns_labelled(
        baton::injected_namespace_labels(scope),
        |client, ns| async move {
            let s = id_scene(client, ns, scope).await;
            s.policy(&[]).await;
            s.meshed().await;
            let server = json!({"matchLabels": {"app": "server"}});

            // A name the server does not declare: refused, with the names it does.
            let m = try_apply_authz(&s.client, &s.ns, "typo", json!({
                "podSelector": server, "ports": ["grpc"], "rules": [{}]
            }))
            .await
            .expect_err("an unknown port name is refused");
            assert!(
                m.contains("spec.ports[0]: no Pod the policy selects (1 of them) declares a container port named \"grpc\"; they declare http, tcp-echo"),
                "{m}"
            );
            // A malformed name: refused with what a name is.
            let m = try_apply_authz(&s.client, &s.ns, "bad", json!({
                "podSelector": server, "ports": ["Tcp_Echo"], "rules": [{}]
            }))
            .await
            .expect_err("a malformed port name is refused");
            assert!(m.contains("\"Tcp_Echo\" is not a port name: a name (IANA_SVC_NAME)"), "{m}");
            // So is a malformed identity: by the schema (minLength 9,
            // pattern `^spiffe://`), which the API server checks before the
            // webhook, naming the value and the form it must have. (The
            // webhook's own, longer message is what a value matching the
            // pattern but malformed after it gets: crds' unit tests.)
            let m = try_apply_authz(&s.client, &s.ns, "bad-id", json!({
                "podSelector": server, "rules": [{"from": {"identities": ["shop/web-frontend"]}}]
            }))
            .await
            .expect_err("a malformed identity is refused");
            assert!(
                m.contains("spec.rules.from.identities") && m.contains("\"shop/web-frontend\"") && m.contains("'^spiffe://'"),
                "{m}"
            );

            // Deny by name: `tcp-echo` resolves to the server's 7070, so TCP
            // connections are closed and HTTP on 8080 is untouched.
            apply_authz(&s.client, &s.ns, "no-tcp", json!({
                "podSelector": server, "ports": ["tcp-echo"], "action": "Deny", "rules": [{}]
            }))
            .await;
            until_via(s.driver, "the Deny by port name closes TCP", &s.spec(FetchProtocol::Tcp, 5), |r| {
                r.echoed == 0 && r.errors == 5
            })
            .await;
            let r = fetch_from(s.driver, &s.spec(FetchProtocol::Http1, 20)).await;
            assert_eq!(r.status(200), 20, "HTTP is another port: {r:?}");

            // A name only some selected Pods declare: admitted, and the
            // status names the Pods without it.
            apply_authz(&s.client, &s.ns, "everyone-http", json!({
                "podSelector": {}, "ports": ["http"], "action": "Audit", "rules": [{}]
            }))
            .await;
            let api = Api::<baton_crds::AuthorizationPolicy>::namespaced(s.client.clone(), &s.ns);
            let message = wait_for("ResolvedRefs is False with UnknownPort", PROPAGATION, || {
                let api = api.clone();
                async move {
                    let p = api.get("everyone-http").await.expect("get everyone-http");
                    let status = p.status.clone().unwrap_or_default();
                    match status.conditions.iter().find(|c| c.type_ == "ResolvedRefs") {
                        Some(c) if c.status == "False" && c.reason == "UnknownPort" => {
                            Check::Done(c.message.clone())
                        }
                        _ => Check::NotYet(format!("{status:?}")),
                    }
                }
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            assert!(
                message.contains("declares no container port named \"http\"") && message.contains("client-"),
                "{message}"
            );
            assert!(!message.contains("server-"), "the server declares http: {message}");
        },
    )
    .await;
}

/// Scales the operator Deployment back to two replicas when dropped, so a
/// failing test never leaves the cluster without its control plane.
struct OperatorBack;

impl Drop for OperatorBack {
    fn drop(&mut self) {
        let _ = baton_e2e::kubectl(&[
            "-n",
            baton_crds::contract::SYSTEM_NAMESPACE,
            "scale",
            "deployment/baton-operator",
            "--replicas=2",
        ]);
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
}

#[tokio::test]
#[ignore = "needs the e2e cluster (e2e/run.sh)"]
async fn identity_sidecars_serve_strict_mtls_while_both_operator_pods_are_gone_and_renew_when_they_return()
 {
    let _serial = SERIAL.lock().await;
    let scope = "identity-outage";
    with_temp_ns_labelled(
        baton::injected_namespace_labels(scope),
        |client, ns| async move {
            let s = id_scene(client, ns, scope).await;
            s.policy(&[]).await;
            s.meshed().await;
            let load = s.load();

            // Take the operator away shortly before the sidecars' renewal
            // point so their renewal fails while it is gone and succeeds
            // after. A sidecar renews at 2/3 of its certificate's validity
            // ± 5 %, and the operator backdates `notBefore` by
            // CERT_BACKDATE: the validity is lifetime + backdate (240 s), so
            // renewal falls at notAfter − 80 s ± 12 s (the first version of
            // this test assumed notAfter − 60 s ± 9 s and lost the race).
            // The Pods are deleted without a grace period: a graceful stop
            // (lease release, drain) outlasted the margin on a busy machine.
            let held = s.cert_expiries().await;
            let validity = (CERT_LIFETIME + CERT_BACKDATE).as_secs();
            let earliest = held[0].min(held[1]) - validity / 3 - validity / 20;
            let latest = held[0].max(held[1]) - validity / 3 + validity / 20;
            let start = earliest.saturating_sub(15);
            while unix_now() < start {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            let restarts = s.restarts().await;
            let handshakes_before = server_handshakes(s.server_pod).await;
            let _back = OperatorBack;
            kubectl_ok(&[
                "-n",
                baton_crds::contract::SYSTEM_NAMESPACE,
                "scale",
                "deployment/baton-operator",
                "--replicas=0",
            ]);
            kubectl_ok(&[
                "-n",
                baton_crds::contract::SYSTEM_NAMESPACE,
                "delete",
                "pods",
                "-l",
                "app.kubernetes.io/name=baton-operator",
                "--grace-period=0",
                "--force",
                "--wait=false",
            ]);
            wait_for("both operator pods gone", READY, || async {
                let n = baton::component_pods(&s.client, "operator").await.len();
                if n == 0 {
                    Check::Done(())
                } else {
                    Check::NotYet(format!("{n} pods"))
                }
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            let gone = unix_now();
            // Past the renewal point, with nobody to renew from.
            while unix_now() < latest + 5 {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            assert_eq!(
                s.cert_expiries().await,
                held,
                "no certificate can be issued while the operator is gone"
            );
            let during = server_handshakes(s.server_pod).await - handshakes_before;
            let away = unix_now() - gone;
            kubectl_ok(&[
                "-n",
                baton_crds::contract::SYSTEM_NAMESPACE,
                "scale",
                "deployment/baton-operator",
                "--replicas=2",
            ]);
            baton::wait_whole(&s.client, "operator", READY)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let back = unix_now();
            let renewed = s
                .renewed_after(
                    "renewal once the operator is back",
                    held[0].max(held[1]) - CERT_LIFETIME.as_secs(),
                )
                .await;
            eprintln!(
                "operator gone {away} s (+{} s until Ready), {during} new mTLS handshakes meanwhile; notAfter {held:?} -> {renewed:?}",
                back - gone - away
            );
            assert!(during > 0, "new handshakes were served with the held certificates");
            let report = load.finish().await;
            no_failures("operator outage", &report);
            assert_eq!(s.restarts().await, restarts, "no Pod restarted");
        },
    )
    .await;
}

/// An annotation of the operator namespace's trust ConfigMap
/// (`baton.dev/trust-<name>`: the rotation phase the operator observes).
fn trust_annotation(name: &str) -> String {
    kubectl_ok(&[
        "-n",
        baton_crds::contract::SYSTEM_NAMESPACE,
        "get",
        "configmap",
        baton_crds::contract::identity::TRUST_CONFIG_MAP,
        "-o",
        &format!("jsonpath={{.metadata.annotations.baton\\.dev/trust-{name}}}"),
    ])
}

/// Runs one step of the root rotation runbook (docs/tls.md) as a user
/// types it: bash in `dir`, `kubectl` on the e2e cluster. Returns stdout.
fn runbook(dir: &std::path::Path, step: &str) -> String {
    const PRELUDE: &str = r#"NS=baton-system S=baton-identity-ca
get() { kubectl -n $NS get secret $S -o jsonpath="{.data.$1}" | base64 -d; }
"#;
    // Bounded: a step that waits for the operator gives up after 3 minutes.
    let out = std::process::Command::new("timeout")
        // No pipefail: `kubectl logs … | grep -q` must not fail when grep
        // stops reading early (as in a user's interactive shell).
        .args(["180", "bash", "-eu", "-c", &format!("{PRELUDE}{step}")])
        .env("KUBECONFIG", baton_e2e::cluster::kubeconfig_path())
        .current_dir(dir)
        .output()
        .expect("running bash");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "runbook step failed:\n{step}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stdout
}

/// Decision 0058: the scene's Pods were admitted before the rotation, so
/// the bundle the webhook copied into them names the old root only, and
/// the operator now serves a certificate of the new one. Replacing the
/// operator's Pods makes every config stream reconnect: each must verify
/// the new operator with the bundle its sidecar kept on the Pod's shared
/// volume (no sidecar restarts; the caller checks that).
async fn reconnect_with_the_kept_bundle(s: &IdScene, dir: &std::path::Path) {
    let old_root = std::fs::read_to_string(dir.join("old-root.crt")).expect("old-root.crt");
    let new_root = std::fs::read_to_string(dir.join("new-root.crt")).expect("new-root.crt");
    let pods = Api::<Pod>::namespaced(s.client.clone(), &s.ns)
        .list(&kube::api::ListParams::default().labels(baton_crds::contract::labels::INJECTED))
        .await
        .expect("list pods");
    assert!(pods.items.len() >= 2, "the scene's meshed Pods");
    for p in &pods.items {
        let injected = p
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(baton_crds::contract::annotations::TRUST_BUNDLE))
            .unwrap_or_else(|| panic!("{:?} carries no trust bundle", p.metadata.name));
        assert!(
            injected.contains(old_root.trim()),
            "admitted with the old root"
        );
        assert!(
            !injected.contains(new_root.trim()),
            "the injected bundle predates the new root"
        );
    }
    let sidecars = [s.server_pod, s.client_pod];
    let reconnects = |ip| {
        sidecar_metric(ip, |l| {
            l.starts_with("baton_sidecar_control_stream_reconnects_total")
        })
    };
    let mut before = Vec::new();
    for ip in sidecars {
        before.push(reconnects(ip).await);
    }
    kubectl_ok(&[
        "-n",
        baton_crds::contract::SYSTEM_NAMESPACE,
        "rollout",
        "restart",
        "deployment/baton-operator",
    ]);
    kubectl_ok(&[
        "-n",
        baton_crds::contract::SYSTEM_NAMESPACE,
        "rollout",
        "status",
        "deployment/baton-operator",
        "--timeout=180s",
    ]);
    baton::wait_whole(&s.client, "operator", READY)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // Bounded: 90 polls, 2 s apart.
    let mut last = String::new();
    for _ in 0..90 {
        let mut all = true;
        last.clear();
        for (ip, b) in sidecars.iter().zip(&before) {
            let r = reconnects(*ip).await;
            let up = sidecar_metric(*ip, |l| {
                l.starts_with("baton_sidecar_control_stream_connected")
            })
            .await;
            last.push_str(&format!("{ip}: reconnects {b} -> {r}, connected {up}; "));
            all &= r > *b && up == 1.0;
        }
        if all {
            eprintln!("config streams back on the new operator: {last}");
            return;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    panic!("config streams did not reconnect to the operator of the new root: {last}");
}

#[tokio::test]
#[ignore = "needs the e2e cluster (e2e/run.sh)"]
async fn identity_root_rotation_by_the_runbook_under_strict_mtls_traffic_fails_nothing_and_restarts_nothing()
 {
    let _serial = SERIAL.lock().await;
    let scope = "identity-rotation";
    with_temp_ns_labelled(
        baton::injected_namespace_labels(scope),
        |client, ns| async move {
            let s = id_scene(client, ns, scope).await;
            s.policy(&[]).await;
            s.meshed().await;
            let restarts = s.restarts().await;
            let dir = tempfile::tempdir().expect("a work dir");
            let dir = dir.path();
            let load = s.load();

            let started = std::time::Instant::now();
            runbook(
                dir,
                r#"get 'tls\.crt' > old-root.crt; get 'tls\.key' > old-root.key; get 'ca\.crt' > old-bundle.crt

# 0. A new root (any CA works; this is what the operator itself would generate).
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -keyout new-root.key -out new-root.crt -days 3650 \
  -subj "/CN=baton-identity-root-2/O=cluster.local" \
  -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"

# 1. Trust both roots; still issue from the old one.
cat old-bundle.crt new-root.crt > both.crt
T1=$(date +%s)
kubectl -n $NS patch secret $S --type merge \
  -p "{\"data\":{\"ca.crt\":\"$(base64 -w0 both.crt)\"}}"

# 2. Wait until every sidecar holds a certificate with the two-root bundle.
kubectl -n $NS wait configmap/baton-mesh-trust --timeout=3m \
  --for=jsonpath='{.metadata.annotations.baton\.dev/trust-phase}'=NewRootTrusted
"#,
            );
            let step2 = started.elapsed();
            let t1 = unix_now() - step2.as_secs();
            // Observed by the operator, and true of the sidecars: both hold
            // a certificate issued after the patch.
            let e2 = s.renewed_after("step 2: certificates issued after T1", t1).await;
            let progress2 = trust_annotation("progress");

            let t3 = unix_now();
            runbook(
                dir,
                r#"# 3. Issue from the new root (tls.crt and tls.key in ONE patch).
kubectl -n $NS patch secret $S --type merge -p "{\"data\":{
  \"tls.crt\":\"$(base64 -w0 new-root.crt)\",\"tls.key\":\"$(base64 -w0 new-root.key)\"}}"

# 4. Wait until every sidecar holds a certificate from the new root.
kubectl -n $NS wait configmap/baton-mesh-trust --timeout=3m \
  --for=jsonpath='{.metadata.annotations.baton\.dev/trust-phase}'=OldRootRemovable
"#,
            );
            let step4 = started.elapsed();
            let e4 = s.renewed_after("step 4: certificates issued after T3", t3).await;

            runbook(
                dir,
                r#"# 5. Drop the old root, and wait until every sidecar holds the one-root bundle.
kubectl -n $NS patch secret $S --type merge \
  -p "{\"data\":{\"ca.crt\":\"$(base64 -w0 new-root.crt)\"}}"
shred -u old-root.key new-root.key
kubectl -n $NS wait configmap/baton-mesh-trust --timeout=3m \
  --for=jsonpath='{.metadata.annotations.baton\.dev/trust-phase}'=TrustStable
"#,
            );
            let rotation = started.elapsed();
            let described = kubectl_ok(&[
                "-n",
                baton_crds::contract::SYSTEM_NAMESPACE,
                "describe",
                "configmap",
                baton_crds::contract::identity::TRUST_CONFIG_MAP,
            ]);
            eprintln!(
                "rotation: step 2 observed after {step2:?}, step 4 after {step4:?}, complete after {rotation:?}\n{progress2}\n{described}"
            );
            // Every phase of the runbook was observed and recorded.
            for phase in [
                "TrustingNewRoot",
                "NewRootTrusted",
                "IssuingFromNewRoot",
                "OldRootRemovable",
                "TrustStable",
            ] {
                assert!(described.contains(phase), "no {phase} Event:\n{described}");
            }
            // The scene's two sidecars at least were counted.
            let counted: usize = progress2
                .split('/')
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            assert!(counted >= 2, "sidecars counted at step 2: {progress2}");
            assert!(
                rotation <= Duration::from_secs(120),
                "a full rotation within two minutes, took {rotation:?}"
            );
            // New handshakes keep working with the old root gone from the
            // Secret (TCP batches open new connections).
            tokio::time::sleep(Duration::from_secs(20)).await;
            let issuer = runbook(
                dir,
                "get 'tls\\.crt' | openssl x509 -noout -subject",
            );
            assert!(issuer.contains("baton-identity-root-2"), "{issuer}");
            // The re-issues went on the sidecars' config stream connections,
            // not on new ones (decision 0056). Read before the operator's
            // Pods are replaced below (their counters start again at 0).
            let mut on_streams = 0.0;
            for pod in baton::component_pods(&s.client, "operator").await {
                let name = pod.metadata.name.unwrap_or_default();
                let text = kubectl_ok(&[
                    "get",
                    "--raw",
                    &format!(
                        "/api/v1/namespaces/{}/pods/{name}:9090/proxy/metrics",
                        baton_crds::contract::SYSTEM_NAMESPACE
                    ),
                ]);
                on_streams += text
                    .lines()
                    .filter(|l| l.starts_with("baton_operator_push_sign_requests_total "))
                    .filter_map(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
                    .sum::<f64>();
            }
            eprintln!("rotation: {on_streams} certificate requests on config stream connections");
            assert!(
                on_streams > 0.0,
                "no certificate request came on a config stream's connection"
            );
            reconnect_with_the_kept_bundle(&s, dir).await;
            let report = load.finish().await;
            eprintln!("rotation: notAfter after step 2 {e2:?}, after step 4 {e4:?}");
            no_failures("root rotation", &report);
            assert_eq!(s.restarts().await, restarts, "no Pod restarted");
        },
    )
    .await;
}

// ------------------------------------------------------------ mesh rollout
//
// The headline on the path users run: Pod → Service → Pod through two
// sidecars under Strict mesh mTLS, both handed off by one rollout. Run with
// `e2e/run.sh mesh_rollout`.

/// How long one rollout of the scene's five Pods may take.
const ROLLOUT: Duration = Duration::from_secs(180);

#[tokio::test]
#[ignore = "needs the e2e cluster (e2e/run.sh)"]
async fn mesh_rollout_of_clients_and_servers_under_strict_mtls_fails_no_exchange_and_restarts_nothing()
 {
    use baton_e2e::rollout::{complete_on, make_versions, sidecar_image, wait_release};
    let _serial = SERIAL.lock().await;
    let scope = "mesh-rollout";
    with_temp_ns_labelled(
        baton::injected_namespace_labels(scope),
        |client, ns| async move {
            make_versions(&["r2"], &[]).unwrap_or_else(|e| panic!("tagging r2: {e}"));
            // Three servers behind the Service, two meshed clients (the
            // scene's `client` and `intruder`, both allowed here): five Pods
            // under one release, handed off two at a time.
            let s = id_scene_with(client, ns, scope, 3).await;
            let release = s.release.0.clone();
            let pods = 5;
            let api = Api::<baton_crds::SidecarRelease>::all(s.client.clone());
            let upgrade = json!({"spec": {"upgrade": {"maxUnavailable": 2, "handoffTimeoutSeconds": 30}}});
            api.patch(&release, &PatchParams::default(), &Patch::Merge(&upgrade))
                .await
                .unwrap_or_else(|e| panic!("maxUnavailable on {release}: {e}"));
            s.policy(&[]).await;
            s.meshed().await;
            until_via(
                s.intruder,
                "the second client is served over mTLS",
                &s.spec(FetchProtocol::Http1, 10),
                |r| r.status(200) == 10,
            )
            .await;
            let outsider = ready_pod(&s.client, &s.ns, &driver_pod("outsider", false)).await;
            let outsider = SocketAddr::new(wait::pod_ip(&outsider), fetch::PORT);
            // Slots restart for their image swaps (two per Pod per
            // version); application containers must not restart at all.
            let restarts = baton_e2e::rollout::restarts(&s.pods_all().await);
            let handshakes = s.server_handshakes().await;

            let load = s.load_from(
                &[s.driver, s.intruder],
                &[FetchProtocol::Http1, FetchProtocol::Http2, FetchProtocol::Tcp],
            );
            let rollout = |version: &'static str, image: String| {
                let (client, release) = (s.client.clone(), release.clone());
                async move {
                    let t0 = std::time::Instant::now();
                    let patch = json!({"spec": {"version": version, "image": image}});
                    Api::<baton_crds::SidecarRelease>::all(client.clone())
                        .patch(&release, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .unwrap_or_else(|e| panic!("patching {release} to {version}: {e}"));
                    wait_release(
                        &client,
                        &release,
                        &format!("every Pod on {version}"),
                        ROLLOUT,
                        |st| complete_on(st, version, pods),
                        |_| {},
                    )
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                    eprintln!("mesh rollout to {version}: {:?}", t0.elapsed());
                }
            };
            // Traffic flows before the first handoff.
            tokio::time::sleep(Duration::from_secs(2)).await;
            rollout("r2", sidecar_image("r2")).await;
            rollout(baton::RELEASE_VERSION, pods::image("sidecar")).await;
            tokio::time::sleep(Duration::from_secs(2)).await;
            let reports = load.finish_by_protocol().await;

            for (p, r) in &reports {
                eprintln!(
                    "mesh rollout {p:?}: {} requests ({} not 200, {} re-sent after the connection closed unprocessed), {} TCP exchanges echoed, {} errors",
                    r.responses(),
                    r.responses() - r.status(200),
                    r.retried,
                    r.echoed,
                    r.errors
                );
                assert_eq!(r.errors, 0, "{p:?}: {r:?}");
                if *p == FetchProtocol::Tcp {
                    assert!(r.echoed > 0, "TCP traffic ran");
                } else {
                    assert!(r.responses() > 0, "{p:?} traffic ran");
                    assert_eq!(r.status(200), r.responses(), "{p:?}: {r:?}");
                }
            }
            let after = baton_e2e::rollout::restarts(&s.pods_all().await);
            assert_eq!(
                baton_e2e::rollout::app_restarts(&restarts, &after),
                Vec::<String>::new(),
                "no application container restarted: {after:?}"
            );
            // mTLS held: the servers' sidecars kept terminating it, and a Pod
            // outside the mesh is still refused.
            let after = s.server_handshakes().await;
            assert!(after > handshakes, "server handshakes {handshakes} → {after}");
            let r = fetch_from(outsider, &s.spec(FetchProtocol::Http1, 10)).await;
            assert_eq!(
                (r.responses(), r.errors),
                (0, 10),
                "plaintext from outside the mesh after the rollout: {r:?}"
            );
        },
    )
    .await;
}
