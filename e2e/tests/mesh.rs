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
use baton_e2e::fetch::{self, FetchReport, FetchSpec};
use baton_e2e::install::{self as baton};
use baton_e2e::rollout::ReleaseGuard;
use baton_e2e::{Check, kubectl_ok, pods, wait, wait_for, with_temp_ns_labelled};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
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
        }
    }

    async fn fetch(&self, spec: &FetchSpec) -> FetchReport {
        self.fetch_via(self.driver, spec).await
    }

    async fn fetch_via(&self, driver: SocketAddr, spec: &FetchSpec) -> FetchReport {
        fetch::fetch_via(driver, spec)
            .await
            .unwrap_or_else(|e| panic!("fetch {spec:?}: {e}"))
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

            // No Route: plain Service balancing over both versions.
            let plain = s.fetch(&s.spec(s.server, "/", 200)).await;
            assert_eq!(plain.status(200), 200, "{plain:?}");
            assert!(
                plain.from_servers("server-v1-") > 0 && plain.from_servers("server-v2-") > 0,
                "{plain:?}"
            );
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

/// Server-side TLS handshakes that succeeded, from the sidecar's metrics
/// (admin port, readable from the node).
async fn server_handshakes(ip: IpAddr) -> u64 {
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
        .filter(|l| {
            l.contains("handshakes_total{")
                && l.contains("side=\"server\"")
                && l.contains("result=\"ok\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}
