//! The rollout on a real cluster: a Deployment of 5 injected pods under
//! continuous byte-checked traffic (HTTP/1.1, HTTP/2, TCP streams, and TLS
//! the application speaks itself, carried by the sidecar as opaque bytes),
//! `kubectl patch` of the SidecarRelease v1 → v2 → v1 with zero failed
//! exchanges, every pod on the target version, the same pods (no pod
//! recreated) and unchanged application restart counts; then a broken
//! version whose sidecar exits at once: the pods keep serving, the release
//! is Degraded and paused, the reason in `kubectl describe`.
//!
//! Needs the operator and webhook installed (`e2e/scripts/install.sh`) and
//! the images `docker.io/baton/{sidecar,empty,nettools,demo-http-echo,
//! demo-tcp-echo}:$BATON_IMAGE_TAG`; the extra sidecar tags are made here
//! with `ctr images tag` (the same image under another name, or nettools,
//! whose shell exits at once on the sidecar's `run` argument, as the broken
//! version). `#[ignore]`d: run with `e2e/run.sh`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use baton_crds::SidecarRelease;
use baton_crds::contract::{annotations, containers, labels};
use baton_e2e::pods::{IMAGE_REPO, container, image};
use baton_e2e::traffic::{self, Load, Protocol, Tls};
use baton_e2e::{Check, kubectl, kubectl_ok, wait_for, with_temp_ns_labelled};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

const REPLICAS: usize = 5;
const HTTP_PORT: u16 = 8080;
const TCP_PORT: u16 = 9000;
const TLS_PORT: u16 = 9443;
const TLS_NAME: &str = "echo.rollout.test";

fn tag() -> String {
    std::env::var("BATON_IMAGE_TAG").unwrap_or_else(|_| "e2e".to_owned())
}

/// `ctr images tag` in the cluster's containerd (the harness runs as root).
fn tag_image(from: &str, to: &str) {
    let run = std::env::var("BATON_E2E_RUN_DIR").unwrap_or_else(|_| "/tmp/baton-e2e".to_owned());
    let out = std::process::Command::new("ctr")
        .args(["--address", &format!("{run}/containerd/containerd.sock")])
        .args(["-n", "k8s.io", "images", "tag", "--force", from, to])
        .output()
        .expect("run ctr");
    assert!(
        out.status.success(),
        "ctr images tag {from} {to}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The sidecar image under the tag of version `v`.
fn sidecar_image(v: &str) -> String {
    format!("{IMAGE_REPO}/sidecar:{}-{v}", tag())
}

/// Deletes the (cluster-scoped) release however the test ends.
struct ReleaseGuard(String);

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        let out = kubectl(&[
            "delete",
            "sidecarrelease",
            &self.0,
            "--ignore-not-found",
            "--wait=false",
        ]);
        if !out.success {
            eprintln!("cannot delete SidecarRelease {}: {}", self.0, out.stderr);
        }
    }
}

/// A release for the test's pods only (label `rollout-run=<ns>`), with a
/// priority above any other release.
async fn create_release(client: &Client, ns: &str, version: &str) -> ReleaseGuard {
    let api: Api<SidecarRelease> = Api::all(client.clone());
    let release: SidecarRelease = serde_json::from_value(json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease",
        "metadata": {"name": ns},
        "spec": {
            "version": version,
            "image": sidecar_image(version),
            "emptyImage": image("empty"),
            "priority": 1000,
            "podSelector": {"matchLabels": {"rollout-run": ns}},
            "upgrade": {"maxUnavailable": 2, "handoffTimeoutSeconds": 30}
        }
    }))
    .unwrap();
    api.create(&PostParams::default(), &release)
        .await
        .unwrap_or_else(|e| panic!("creating SidecarRelease {ns}: {e}"));
    ReleaseGuard(ns.to_owned())
}

struct Pki {
    cert_pem: String,
    key_pem: String,
    client: Arc<rustls::ClientConfig>,
}

fn pki() -> Pki {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec![TLS_NAME.to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der().clone()).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    Pki {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        client: Arc::new(client),
    }
}

/// The demo app: HTTP/1.1 + HTTP/2 echo, TCP echo, and a TCP echo speaking
/// TLS itself (certificate from a Secret).
fn deployment(ns: &str) -> Deployment {
    let http = container(
        "http",
        "demo-http-echo",
        &["--listen", &format!("0.0.0.0:{HTTP_PORT}")],
    );
    let tcp = container(
        "tcp",
        "demo-tcp-echo",
        &["--listen", &format!("0.0.0.0:{TCP_PORT}")],
    );
    let mut tls = container(
        "tls",
        "demo-tcp-echo",
        &[
            "--listen",
            &format!("0.0.0.0:{TLS_PORT}"),
            "--tls-cert",
            "/tls/tls.crt",
            "--tls-key",
            "/tls/tls.key",
        ],
    );
    tls.volume_mounts = Some(vec![
        serde_json::from_value(json!({"name": "tls", "mountPath": "/tls", "readOnly": true}))
            .unwrap(),
    ]);
    let mut http = serde_json::to_value(http).unwrap();
    http["readinessProbe"] = json!({"tcpSocket": {"port": HTTP_PORT}, "periodSeconds": 1});
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "echo", "namespace": ns},
        "spec": {
            "replicas": REPLICAS,
            "selector": {"matchLabels": {"app": "echo"}},
            "template": {
                "metadata": {"labels": {"app": "echo", "rollout-run": ns}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "automountServiceAccountToken": false,
                    "containers": [http, tcp, tls],
                    "volumes": [{"name": "tls", "secret": {"secretName": "echo-tls"}}]
                }
            }
        }
    }))
    .unwrap()
}

async fn create_app(client: &Client, ns: &str, pki: &Pki) {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let secret: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "echo-tls"},
        "type": "kubernetes.io/tls",
        "stringData": {"tls.crt": pki.cert_pem, "tls.key": pki.key_pem}
    }))
    .unwrap();
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    deployments
        .create(&PostParams::default(), &deployment(ns))
        .await
        .unwrap();
}

/// The deployment's pods once all `REPLICAS` are Ready, injected with `version`.
async fn ready_pods(client: &Client, ns: &str, version: &str) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait_for(
        &format!("{REPLICAS} ready pods on {version}"),
        Duration::from_secs(180),
        || async {
            let pods = match api.list(&ListParams::default().labels("app=echo")).await {
                Ok(l) => l.items,
                Err(e) => return Check::NotYet(e.to_string()),
            };
            let live: Vec<Pod> = pods
                .into_iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .collect();
            let good = live.iter().filter(|p| {
                annotation(p, annotations::VERSION) == Some(version)
                    && p.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|cs| {
                            cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                        })
            });
            if live.len() == REPLICAS && good.count() == REPLICAS {
                Check::Done(live)
            } else {
                Check::NotYet(
                    live.iter()
                        .map(baton_e2e::wait::pod_state)
                        .collect::<Vec<_>>()
                        .join("; "),
                )
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

fn annotation<'a>(p: &'a Pod, key: &str) -> Option<&'a str> {
    p.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

fn pod_ip(p: &Pod) -> std::net::IpAddr {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .expect("pod IP")
        .parse()
        .unwrap()
}

/// Restart counts of every container, by `pod/container`.
fn restarts(pods: &[Pod]) -> BTreeMap<String, i32> {
    pods.iter()
        .flat_map(|p| {
            let name = p.metadata.name.clone().unwrap_or_default();
            p.status
                .iter()
                .flat_map(|s| s.container_statuses.iter().flatten())
                .map(move |c| (format!("{name}/{}", c.name), c.restart_count))
        })
        .collect()
}

fn is_sidecar(key: &str) -> bool {
    key.ends_with(containers::SLOT_A) || key.ends_with(containers::SLOT_B)
}

/// Totals of the continuous traffic.
#[derive(Default, Debug)]
struct Totals {
    exchanges: usize,
    ok: usize,
    bytes: u64,
    failures: Vec<String>,
}

/// Continuous traffic to every pod on every protocol until `stop`, bounded
/// by `MAX_ROUNDS` runs per (pod, protocol) and 15 minutes overall.
/// Waits (bounded) until one exchange of every target succeeds. A Pod is
/// Ready when its sidecar is: the kubelet's probes are captured by the
/// sidecar like any inbound connection, so readiness cannot tell whether
/// each echo behind it listens yet; a connection that arrives first is
/// refused by the app and the sidecar closes it.
async fn wait_targets_serve(pods: &[Pod], pki: &Pki) {
    for (addr, load) in targets(pods, pki) {
        let one = load.clone().exchanges(1).concurrency(1);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let report = traffic::run(addr, &one).await;
            if report.attempted > 0 && report.succeeded == report.attempted {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{addr} {} never served: {:?}",
                one.protocol,
                report.failures
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

fn start_traffic(
    pods: &[Pod],
    pki: &Pki,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Totals> {
    const MAX_ROUNDS: usize = 5_000;
    let targets = targets(pods, pki);
    tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(900);
        let tasks: Vec<_> = targets
            .into_iter()
            .enumerate()
            .map(|(i, (addr, load))| {
                let stop = stop.clone();
                tokio::spawn(async move {
                    let mut t = Totals::default();
                    let mut load = load;
                    for round in 0..MAX_ROUNDS {
                        if stop.load(Ordering::Relaxed) || Instant::now() > deadline {
                            break;
                        }
                        load.seed = (i as u64) << 32 | round as u64;
                        let report = traffic::run(addr, &load).await;
                        t.exchanges += report.attempted;
                        t.ok += report.succeeded;
                        t.bytes += report.bytes_echoed;
                        t.failures.extend(
                            report
                                .failures
                                .iter()
                                .map(|f| format!("{addr} {}: {f:?}", load.protocol)),
                        );
                    }
                    t
                })
            })
            .collect();
        let mut all = Totals::default();
        for task in tasks {
            let t = task.await.expect("traffic task");
            all.exchanges += t.exchanges;
            all.ok += t.ok;
            all.bytes += t.bytes;
            all.failures.extend(t.failures);
        }
        all
    })
}

/// The load each Pod gets: HTTP/1.1, HTTP/2, TCP, and TLS the app speaks.
fn targets(pods: &[Pod], pki: &Pki) -> Vec<(SocketAddr, Load)> {
    let mut targets: Vec<(SocketAddr, Load)> = Vec::new();
    for p in pods {
        let ip = pod_ip(p);
        targets.push((
            SocketAddr::new(ip, HTTP_PORT),
            Load::new(Protocol::Http1).exchanges(10).concurrency(2),
        ));
        targets.push((
            SocketAddr::new(ip, HTTP_PORT),
            Load::new(Protocol::Http2).exchanges(20).concurrency(4),
        ));
        targets.push((
            SocketAddr::new(ip, TCP_PORT),
            Load::new(Protocol::Tcp)
                .exchanges(10)
                .concurrency(2)
                .payload_bytes(64 * 1024),
        ));
        targets.push((
            SocketAddr::new(ip, TLS_PORT),
            Load::new(Protocol::Tcp)
                .exchanges(10)
                .concurrency(2)
                .tls(Tls {
                    config: pki.client.clone(),
                    server_name: rustls_pki_types::ServerName::try_from(TLS_NAME).unwrap(),
                }),
        ));
    }
    targets
}

fn patch_version(name: &str, version: &str) {
    kubectl_ok(&[
        "patch",
        "sidecarrelease",
        name,
        "--type",
        "merge",
        "-p",
        &json!({"spec": {"version": version, "image": sidecar_image(version)}}).to_string(),
    ]);
}

/// Waits until the release's status satisfies `pred`.
async fn wait_release(
    client: &Client,
    name: &str,
    what: &str,
    within: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let api: Api<SidecarRelease> = Api::all(client.clone());
    wait_for(what, within, || async {
        match api.get(name).await {
            Ok(r) => {
                let status = serde_json::to_value(&r.status).unwrap_or_default();
                if pred(&status) {
                    Check::Done(status)
                } else {
                    Check::NotYet(status.to_string())
                }
            }
            Err(e) => Check::NotYet(e.to_string()),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

fn condition<'a>(status: &'a serde_json::Value, type_: &str) -> Option<&'a serde_json::Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

fn complete_on(status: &serde_json::Value, version: &str) -> bool {
    status["updated"] == REPLICAS
        && status["inFlight"] == 0
        && condition(status, "Complete").is_some_and(|c| c["status"] == "True")
        && status["versions"]
            .as_array()
            .is_some_and(|v| v.len() == 1 && v[0]["version"] == version)
}

fn injected() -> BTreeMap<String, String> {
    BTreeMap::from([(labels::INJECT.to_owned(), labels::INJECT_ENABLED.to_owned())])
}

#[tokio::test]
#[ignore = "needs the e2e cluster with Baton installed: run e2e/run.sh"]
async fn rollout_v1_to_v2_and_back_loses_no_exchange_and_restarts_no_app_container() {
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    let base = format!("{IMAGE_REPO}/sidecar:{}", tag());
    tag_image(&base, &sidecar_image("v1"));
    tag_image(&base, &sidecar_image("v2"));
    with_temp_ns_labelled(injected(), |client, ns| async move {
        let pki = pki();
        let _release = create_release(&client, &ns, "v1").await;
        create_app(&client, &ns, &pki).await;
        let before = ready_pods(&client, &ns, "v1").await;
        let uids: Vec<_> = before.iter().map(|p| p.metadata.uid.clone()).collect();
        let restarts_before = restarts(&before);

        let stop = Arc::new(AtomicBool::new(false));
        wait_targets_serve(&before, &pki).await;
        let traffic = start_traffic(&before, &pki, stop.clone());
        tokio::time::sleep(Duration::from_secs(3)).await;

        let started = Instant::now();
        patch_version(&ns, "v2");
        wait_release(&client, &ns, "release Complete on v2", Duration::from_secs(300), |s| complete_on(s, "v2")).await;
        let to_v2 = started.elapsed();
        let on_v2 = ready_pods(&client, &ns, "v2").await;
        for p in &on_v2 {
            assert_eq!(annotation(p, annotations::ACTIVE_SLOT), Some("b"), "{:?}", p.metadata.name);
            assert!(annotation(p, annotations::UPGRADE).is_none());
        }

        let started = Instant::now();
        patch_version(&ns, "v1");
        let status = wait_release(&client, &ns, "release Complete on v1", Duration::from_secs(300), |s| complete_on(s, "v1")).await;
        let to_v1 = started.elapsed();
        let after = ready_pods(&client, &ns, "v1").await;

        stop.store(true, Ordering::Relaxed);
        let totals = traffic.await.unwrap();
        eprintln!("rollout v1→v2 {to_v2:?}, v2→v1 {to_v1:?}; traffic: {} exchanges, {} ok, {} bytes echoed", totals.exchanges, totals.ok, totals.bytes);
        assert!(totals.exchanges > 0 && totals.bytes > 0);
        assert!(totals.failures.is_empty(), "{} failed exchanges: {:#?}", totals.failures.len(), &totals.failures[..totals.failures.len().min(20)]);

        // The same pods, in place; every one back on v1 in slot a, slot b idle.
        let uids_after: Vec<_> = after.iter().map(|p| p.metadata.uid.clone()).collect();
        assert_eq!(sorted(uids), sorted(uids_after), "no pod may be recreated");
        let empty = image("empty");
        for p in &after {
            assert_eq!(annotation(p, annotations::ACTIVE_SLOT), Some("a"));
            let spec = p.spec.as_ref().unwrap();
            let img = |n: &str| spec.containers.iter().find(|c| c.name == n).and_then(|c| c.image.clone());
            assert_eq!(img(containers::SLOT_A), Some(sidecar_image("v1")));
            assert_eq!(img(containers::SLOT_B), Some(empty.clone()));
        }
        // Application containers never restarted; each sidecar slot
        // restarted only for its image swaps (two each), never ping-ponged.
        let restarts_after = restarts(&after);
        for (k, n) in &restarts_after {
            if is_sidecar(k) {
                assert!(*n <= 2, "{k} restarted {n} times: {restarts_after:?}");
            } else {
                assert_eq!(restarts_before.get(k), Some(n), "{k}: {restarts_before:?} → {restarts_after:?}");
            }
        }
        assert_eq!(status["failed"], 0);
    })
    .await;
}

fn sorted<T: Ord>(mut v: Vec<T>) -> Vec<T> {
    v.sort();
    v
}

#[tokio::test]
#[ignore = "needs the e2e cluster with Baton installed: run e2e/run.sh"]
async fn rollout_of_a_broken_version_pauses_degraded_while_pods_keep_serving() {
    baton_e2e::cluster::require_component("operator");
    baton_e2e::cluster::require_component("webhook");
    tag_image(
        &format!("{IMAGE_REPO}/sidecar:{}", tag()),
        &sidecar_image("v1"),
    );
    // nettools' entrypoint is a shell: `sh run` exits at once.
    tag_image(
        &format!("{IMAGE_REPO}/nettools:{}", tag()),
        &sidecar_image("v3"),
    );
    with_temp_ns_labelled(injected(), |client, ns| async move {
        let pki = pki();
        let _release = create_release(&client, &ns, "v1").await;
        create_app(&client, &ns, &pki).await;
        let pods = ready_pods(&client, &ns, "v1").await;
        let restarts_before = restarts(&pods);
        let stop = Arc::new(AtomicBool::new(false));
        wait_targets_serve(&pods, &pki).await;
        let traffic = start_traffic(&pods, &pki, stop.clone());
        tokio::time::sleep(Duration::from_secs(3)).await;

        patch_version(&ns, "v3");
        let status = wait_release(
            &client,
            &ns,
            "release paused by failures",
            Duration::from_secs(180),
            |s| {
                condition(s, "Paused").is_some_and(|c| {
                    c["status"] == "True" && c["reason"] == "FailureThresholdExceeded"
                }) && condition(s, "Degraded").is_some_and(|c| c["status"] == "True")
                    && s["inFlight"] == 0
            },
        )
        .await;
        assert!(status["failed"].as_i64().unwrap_or(0) >= 1, "{status}");
        assert_eq!(status["rollout"], "Paused");
        // No pod moved past the first failure's batch, and every failed pod's
        // standby slot is idle again.
        let now = ready_pods(&client, &ns, "v1").await;
        for p in &now {
            let spec = p.spec.as_ref().unwrap();
            let b = spec
                .containers
                .iter()
                .find(|c| c.name == containers::SLOT_B)
                .and_then(|c| c.image.clone());
            assert_eq!(b, Some(image("empty")), "{:?}", p.metadata.name);
        }
        let described = kubectl_ok(&["describe", "sidecarrelease", &ns]);
        assert!(
            described.contains("FailureThresholdExceeded"),
            "{described}"
        );
        assert!(described.contains("HandoffFailed"), "{described}");

        stop.store(true, Ordering::Relaxed);
        let totals = traffic.await.unwrap();
        assert!(totals.exchanges > 0);
        assert!(
            totals.failures.is_empty(),
            "{:#?}",
            &totals.failures[..totals.failures.len().min(20)]
        );
        let restarts_after = restarts(&now);
        for (k, n) in &restarts_after {
            if !is_sidecar(k) {
                assert_eq!(restarts_before.get(k), Some(n), "{k}");
            }
        }
    })
    .await;
}
