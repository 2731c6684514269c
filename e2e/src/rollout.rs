//! The cluster-wide rollout scenario, shared by the `rollout_*` e2e tests and
//! the `demo-rollout` binary (the README's main job, `scripts/demo.sh`):
//! a Deployment of injected echo pods (HTTP/1.1 + HTTP/2, TCP, and a TCP
//! echo speaking TLS itself), a SidecarRelease selecting only those pods,
//! continuous byte-checked traffic to every pod on every protocol, and the
//! observations a report needs (release status, restart counts, the
//! per-Pod handoff durations the operator records on each Pod).
//!
//! Sidecar versions are image tags made in the cluster's containerd with
//! `ctr images tag`: `v1` and `v2` are the same sidecar image under two
//! names (a version bump is a tag change, as in a real release), and a
//! broken version is the nettools image, whose shell entrypoint exits at
//! once on the sidecar's `run` argument.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_crds::SidecarRelease;
use baton_crds::contract::{annotations, containers};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

use crate::pods::{IMAGE_REPO, container, image};
use crate::traffic::{self, Load, Protocol, Tls};
use crate::wait::{Check, Timeout, pod_ip, wait_for};

pub const HTTP_PORT: u16 = 8080;
pub const TCP_PORT: u16 = 9000;
pub const TLS_PORT: u16 = 9443;
pub const TLS_NAME: &str = "echo.rollout.test";
/// Label on the scenario's pods; the release selects exactly these.
pub const RUN_LABEL: &str = "rollout-run";

/// Tag of the images the harness imported (`BATON_IMAGE_TAG`, default `e2e`).
pub fn tag() -> String {
    std::env::var("BATON_IMAGE_TAG").unwrap_or_else(|_| "e2e".to_owned())
}

/// `ctr images tag` in the cluster's containerd (the harness runs as root).
pub fn tag_image(from: &str, to: &str) -> Result<(), String> {
    // `ctr images tag --force` deletes the target, then creates it: two
    // tests tagging the same version at once (a binary's test threads, or
    // two binaries) can see the other's delete and fail with "not found".
    // Every caller tags the same source, so one process at a time, and a
    // retry for the rare overlap with another process, converge.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let run = std::env::var("BATON_E2E_RUN_DIR").unwrap_or_else(|_| "/tmp/baton-e2e".to_owned());
    let mut last = String::new();
    for attempt in 0..5 {
        if attempt > 0 {
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        let out = std::process::Command::new("ctr")
            .args(["--address", &format!("{run}/containerd/containerd.sock")])
            .args(["-n", "k8s.io", "images", "tag", "--force", from, to])
            .output()
            .map_err(|e| format!("cannot run ctr: {e}"))?;
        if out.status.success() {
            return Ok(());
        }
        last = String::from_utf8_lossy(&out.stderr).into_owned();
        if !last.contains("not found") {
            break;
        }
    }
    Err(format!("ctr images tag {from} {to}: {last}"))
}

/// The sidecar image under the tag of version `v`.
pub fn sidecar_image(v: &str) -> String {
    format!("{IMAGE_REPO}/sidecar:{}-{v}", tag())
}

/// Makes versions `good` (the built sidecar under new tags) and `broken`
/// (an image whose process exits at once) available in the cluster.
pub fn make_versions(good: &[&str], broken: &[&str]) -> Result<(), String> {
    let sidecar = format!("{IMAGE_REPO}/sidecar:{}", tag());
    let nettools = format!("{IMAGE_REPO}/nettools:{}", tag());
    for v in good {
        tag_image(&sidecar, &sidecar_image(v))?;
    }
    for v in broken {
        tag_image(&nettools, &sidecar_image(v))?;
    }
    Ok(())
}

/// Deletes the (cluster-scoped) release however the scenario ends.
#[derive(Debug)]
pub struct ReleaseGuard(pub String);

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        let out = crate::kubectl(&[
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

/// Creates release `name` selecting the pods labelled `rollout-run=<run>`,
/// with a priority above any other release. `sidecar_cpu` overrides each
/// slot's CPU request (both slots carry the release's resources,
/// docs/decisions/0035: the default 50m, twice per pod, fits about 18 pods
/// on a 2-CPU node beside Baton's own).
pub async fn create_release(
    client: &Client,
    name: &str,
    run: &str,
    version: &str,
    max_unavailable: &str,
    sidecar_cpu: Option<&str>,
) -> Result<ReleaseGuard, kube::Error> {
    let api: Api<SidecarRelease> = Api::all(client.clone());
    let mut release: SidecarRelease = serde_json::from_value(json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease",
        "metadata": {"name": name},
        "spec": {
            "version": version,
            "image": sidecar_image(version),
            "emptyImage": image("empty"),
            "priority": 1000,
            "podSelector": {"matchLabels": {RUN_LABEL: run}},
            "upgrade": {
                "maxUnavailable": int_or_percent(max_unavailable),
                "handoffTimeoutSeconds": 30
            }
        }
    }))
    .expect("the release literal matches the CRD type");
    if let Some(cpu) = sidecar_cpu {
        release.spec.resources = Some(
            serde_json::from_value(json!({
                "requests": {"cpu": cpu, "memory": "32Mi"},
                "limits": {"memory": "128Mi"}
            }))
            .expect("valid resources"),
        );
    }
    api.create(&PostParams::default(), &release).await?;
    Ok(ReleaseGuard(name.to_owned()))
}

fn int_or_percent(v: &str) -> serde_json::Value {
    v.parse::<i64>().map_or_else(|_| json!(v), |n| json!(n))
}

/// Sets the release's version and image: the user's one-field change.
pub async fn set_version(client: &Client, name: &str, version: &str) -> Result<(), kube::Error> {
    let api: Api<SidecarRelease> = Api::all(client.clone());
    let patch = json!({"spec": {"version": version, "image": sidecar_image(version)}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|_| ())
}

/// The certificate the app's TLS echo serves and the client that trusts it.
pub struct Pki {
    pub cert_pem: String,
    pub key_pem: String,
    pub client: Arc<rustls::ClientConfig>,
}

pub fn pki() -> Pki {
    let key = rcgen::KeyPair::generate().expect("P-256 key generation");
    let cert = rcgen::CertificateParams::new(vec![TLS_NAME.to_owned()])
        .expect("a valid DNS name")
        .self_signed(&key)
        .expect("self-signing");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der().clone()).expect("a valid certificate");
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("ring supports the default versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    Pki {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        client: Arc::new(client),
    }
}

/// The demo app: HTTP/1.1 + HTTP/2 echo, TCP echo, and a TCP echo speaking
/// TLS itself (certificate from the Secret `echo-tls`).
pub fn deployment(run: &str, replicas: usize) -> Deployment {
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
            .expect("a valid volume mount"),
    ]);
    let mut http = serde_json::to_value(http).expect("containers serialize");
    http["readinessProbe"] = json!({"tcpSocket": {"port": HTTP_PORT}, "periodSeconds": 1});
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "echo"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "echo"}},
            "template": {
                "metadata": {"labels": {"app": "echo", RUN_LABEL: run}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "automountServiceAccountToken": false,
                    "containers": [http, tcp, tls],
                    "volumes": [{"name": "tls", "secret": {"secretName": "echo-tls"}}]
                }
            }
        }
    }))
    .expect("the deployment literal is valid")
}

/// Creates the app's TLS Secret and Deployment in `ns`.
pub async fn create_app(
    client: &Client,
    ns: &str,
    run: &str,
    pki: &Pki,
    replicas: usize,
) -> Result<(), kube::Error> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let secret: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "echo-tls"},
        "type": "kubernetes.io/tls",
        "stringData": {"tls.crt": pki.cert_pem, "tls.key": pki.key_pem}
    }))
    .expect("the secret literal is valid");
    secrets.create(&PostParams::default(), &secret).await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    deployments
        .create(&PostParams::default(), &deployment(run, replicas))
        .await?;
    Ok(())
}

/// The app's pods once exactly `replicas` are Ready and injected with
/// `version`.
pub async fn ready_pods(
    client: &Client,
    ns: &str,
    version: &str,
    replicas: usize,
    within: Duration,
) -> Result<Vec<Pod>, Timeout> {
    ready_pods_labelled(client, ns, "app=echo", version, replicas, within).await
}

/// The live (not terminating) pods of `ns` matching the label `selector`
/// that are Ready and injected with `version`, now.
pub async fn ready_now(
    client: &Client,
    ns: &str,
    selector: &str,
    version: &str,
) -> kube::Result<Vec<Pod>> {
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(selector))
        .await?;
    Ok(pods
        .items
        .into_iter()
        .filter(|p| {
            p.metadata.deletion_timestamp.is_none()
                && annotation(p, annotations::VERSION) == Some(version)
                && is_ready(p)
        })
        .collect())
}

/// The live (not terminating) pods of `ns` matching the label `selector`,
/// once exactly `replicas` are Ready and injected with `version`.
pub async fn ready_pods_labelled(
    client: &Client,
    ns: &str,
    selector: &str,
    version: &str,
    replicas: usize,
    within: Duration,
) -> Result<Vec<Pod>, Timeout> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait_for(
        &format!("{replicas} ready pods ({selector}) on {version}"),
        within,
        || async {
            let pods = match api.list(&ListParams::default().labels(selector)).await {
                Ok(l) => l.items,
                Err(e) => return Check::NotYet(e.to_string()),
            };
            let live: Vec<Pod> = pods
                .into_iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .collect();
            let good = live
                .iter()
                .filter(|p| annotation(p, annotations::VERSION) == Some(version) && is_ready(p));
            if live.len() == replicas && good.count() == replicas {
                Check::Done(live)
            } else {
                Check::NotYet(
                    live.iter()
                        .map(crate::wait::pod_state)
                        .collect::<Vec<_>>()
                        .join("; "),
                )
            }
        },
    )
    .await
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

pub fn annotation<'a>(p: &'a Pod, key: &str) -> Option<&'a str> {
    p.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

/// Restart counts of every container, by `pod/container`.
pub fn restarts(pods: &[Pod]) -> BTreeMap<String, i32> {
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

/// Whether a `pod/container` key names a sidecar slot.
pub fn is_sidecar(key: &str) -> bool {
    key.ends_with(containers::SLOT_A) || key.ends_with(containers::SLOT_B)
}

/// Application containers whose restart count changed between two
/// observations (sidecar slots excluded: their image swaps restart them).
pub fn app_restarts(before: &BTreeMap<String, i32>, after: &BTreeMap<String, i32>) -> Vec<String> {
    after
        .iter()
        .filter(|(k, _)| !is_sidecar(k))
        .filter(|(k, n)| before.get(*k) != Some(n))
        .map(|(k, n)| format!("{k}: {:?} -> {n}", before.get(k)))
        .collect()
}

/// The load each Pod gets: HTTP/1.1, HTTP/2, TCP, and TLS the app speaks.
pub fn targets(pods: &[Pod], pki: &Pki) -> Vec<(SocketAddr, Load)> {
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
                    server_name: rustls_pki_types::ServerName::try_from(TLS_NAME)
                        .expect("a valid server name"),
                }),
        ));
    }
    targets
}

/// Waits (bounded) until one exchange of every target succeeds. A Pod is
/// Ready when its sidecar is: the kubelet's probes are captured by the
/// sidecar like any inbound connection, so readiness cannot tell whether
/// each echo behind it listens yet; a connection that arrives first is
/// refused by the app and the sidecar closes it.
pub async fn wait_targets_serve(pods: &[Pod], pki: &Pki) -> Result<(), String> {
    for (addr, load) in targets(pods, pki) {
        let one = load.clone().exchanges(1).concurrency(1);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let report = traffic::run(addr, &one).await;
            if report.attempted > 0 && report.succeeded == report.attempted {
                break;
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{addr} {} never served: {:?}",
                    one.protocol, report.failures
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    Ok(())
}

/// Totals of the continuous traffic, readable while it runs.
#[derive(Debug, Default)]
pub struct Counters {
    pub exchanges: AtomicUsize,
    pub ok: AtomicUsize,
    pub bytes: AtomicU64,
    /// HTTP/2 requests re-sent after a drain, provably unprocessed.
    pub retried: AtomicUsize,
    /// HTTP/2 connections reopened after the server drained one (GOAWAY).
    pub reconnects: AtomicUsize,
    /// HTTP/2 connections opened in all (the reconnects included).
    pub h2_connections: AtomicUsize,
    pub failures: Mutex<Vec<String>>,
}

/// A snapshot of [`Counters`].
#[derive(Debug, Default, Clone)]
pub struct Totals {
    pub exchanges: usize,
    pub ok: usize,
    pub bytes: u64,
    pub retried: usize,
    pub reconnects: usize,
    pub h2_connections: usize,
    pub failures: Vec<String>,
}

impl Totals {
    /// Failures that were a connection reset (by either side).
    pub fn resets(&self) -> usize {
        self.failures
            .iter()
            .filter(|f| f.to_ascii_lowercase().contains("reset"))
            .count()
    }
}

impl Counters {
    pub fn snapshot(&self) -> Totals {
        Totals {
            exchanges: self.exchanges.load(Ordering::Relaxed),
            ok: self.ok.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            reconnects: self.reconnects.load(Ordering::Relaxed),
            h2_connections: self.h2_connections.load(Ordering::Relaxed),
            failures: self.failures.lock().expect("not poisoned").clone(),
        }
    }
}

/// Continuous traffic to every pod on every protocol until stopped,
/// bounded by [`Traffic::MAX_ROUNDS`] runs per (pod, protocol) and 15
/// minutes overall.
#[derive(Debug)]
pub struct Traffic {
    pub counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Traffic {
    pub const MAX_ROUNDS: usize = 5_000;

    pub fn start(pods: &[Pod], pki: &Pki) -> Self {
        let counters = Arc::new(Counters::default());
        let stop = Arc::new(AtomicBool::new(false));
        let deadline = Instant::now() + Duration::from_secs(900);
        let tasks = targets(pods, pki)
            .into_iter()
            .enumerate()
            .map(|(i, (addr, mut load))| {
                let (stop, c) = (stop.clone(), counters.clone());
                tokio::spawn(async move {
                    for round in 0..Self::MAX_ROUNDS {
                        if stop.load(Ordering::Relaxed) || Instant::now() > deadline {
                            break;
                        }
                        load.seed = (i as u64) << 32 | round as u64;
                        let report = traffic::run(addr, &load).await;
                        c.exchanges.fetch_add(report.attempted, Ordering::Relaxed);
                        c.ok.fetch_add(report.succeeded, Ordering::Relaxed);
                        c.bytes.fetch_add(report.bytes_echoed, Ordering::Relaxed);
                        c.retried
                            .fetch_add(report.retried_unprocessed, Ordering::Relaxed);
                        c.reconnects.fetch_add(report.reconnects, Ordering::Relaxed);
                        c.h2_connections
                            .fetch_add(report.h2_connections, Ordering::Relaxed);
                        if !report.failures.is_empty() {
                            c.failures.lock().expect("not poisoned").extend(
                                report
                                    .failures
                                    .iter()
                                    .map(|f| format!("{addr} {}: {f}", load.protocol)),
                            );
                        }
                    }
                })
            })
            .collect();
        Self {
            counters,
            stop,
            tasks,
        }
    }

    /// Stops sending, waits for the runs in flight, and returns the totals.
    pub async fn stop(self) -> Totals {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("a traffic task panicked");
        }
        self.counters.snapshot()
    }
}

/// Waits until the release's status satisfies `pred`; `progress` sees every
/// status observed (the demo's progress display).
pub async fn wait_release(
    client: &Client,
    name: &str,
    what: &str,
    within: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
    mut progress: impl FnMut(&serde_json::Value),
) -> Result<serde_json::Value, Timeout> {
    let api: Api<SidecarRelease> = Api::all(client.clone());
    let deadline = Instant::now() + within;
    loop {
        let last = match api.get(name).await {
            Ok(r) => {
                let status = serde_json::to_value(&r.status).unwrap_or_default();
                progress(&status);
                if pred(&status) {
                    return Ok(status);
                }
                status.to_string()
            }
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(Timeout {
                what: what.to_owned(),
                timeout: within,
                last,
            });
        }
        tokio::time::sleep(crate::wait::POLL).await;
    }
}

pub fn condition<'a>(status: &'a serde_json::Value, type_: &str) -> Option<&'a serde_json::Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// Every one of `replicas` pods updated to `version`, nothing in flight,
/// Complete=True.
pub fn complete_on(status: &serde_json::Value, version: &str, replicas: usize) -> bool {
    status["updated"] == replicas
        && status["inFlight"] == 0
        && condition(status, "Complete").is_some_and(|c| c["status"] == "True")
        && status["versions"]
            .as_array()
            .is_some_and(|v| v.len() == 1 && v[0]["version"] == version)
}

/// Paused after failures, Degraded, nothing in flight.
pub fn paused_by_failures(status: &serde_json::Value) -> bool {
    condition(status, "Paused")
        .is_some_and(|c| c["status"] == "True" && c["reason"] == "FailureThresholdExceeded")
        && condition(status, "Degraded").is_some_and(|c| c["status"] == "True")
        && status["inFlight"] == 0
}

/// Handoff durations (ms), sorted, of the Pods of `ns` matching `selector`
/// whose last completed handoff (the operator's `baton.dev/last-handoff`
/// record on the Pod) took them to `version`: one per Pod, every rollout
/// (Events cannot count them: the recorder folds a Pod's later
/// `HandoffComplete` into the series of its first).
pub async fn handoff_durations(
    client: &Client,
    ns: &str,
    selector: &str,
    version: &str,
) -> Result<Vec<u64>, kube::Error> {
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(selector))
        .await?;
    let mut out: Vec<u64> = pods
        .items
        .iter()
        .filter_map(last_handoff)
        .filter(|(v, _)| v == version)
        .map(|(_, ms)| ms)
        .collect();
    out.sort_unstable();
    Ok(out)
}

/// (version, duration in ms) of a Pod's `baton.dev/last-handoff` record.
pub fn last_handoff(pod: &Pod) -> Option<(String, u64)> {
    let record: serde_json::Value =
        serde_json::from_str(annotation(pod, annotations::LAST_HANDOFF)?).ok()?;
    Some((
        record["version"].as_str()?.to_owned(),
        record["durationMs"].as_u64()?,
    ))
}

/// The `q`-quantile (0..=1) of sorted values, nearest rank.
pub fn quantile(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_duration_is_read_from_the_pods_handoff_record() {
        let mut pod = Pod::default();
        assert_eq!(last_handoff(&pod), None);
        pod.metadata.annotations = Some(BTreeMap::from([(
            annotations::LAST_HANDOFF.to_owned(),
            r#"{"version":"v2","slot":"b","startedAt":1,"finishedAt":2,"durationMs":812}"#
                .to_owned(),
        )]));
        assert_eq!(last_handoff(&pod), Some(("v2".to_owned(), 812)));
    }

    #[test]
    fn quantiles_use_the_nearest_rank() {
        let v = [10, 20, 30, 40, 50];
        assert_eq!(quantile(&v, 0.5), Some(30));
        assert_eq!(quantile(&v, 1.0), Some(50));
        assert_eq!(quantile(&v, 0.0), Some(10));
        assert_eq!(quantile(&[], 0.5), None);
    }

    #[test]
    fn app_restarts_ignore_sidecar_slots() {
        let a = format!("p/{}", containers::SLOT_A);
        let before = BTreeMap::from([(a.clone(), 0), ("p/http".to_owned(), 0)]);
        let after = BTreeMap::from([(a, 2), ("p/http".to_owned(), 0)]);
        assert!(app_restarts(&before, &after).is_empty());
        let after = BTreeMap::from([("p/http".to_owned(), 1)]);
        assert_eq!(app_restarts(&before, &after).len(), 1);
    }

    #[test]
    fn max_unavailable_is_a_count_or_a_percentage() {
        assert_eq!(int_or_percent("2"), json!(2));
        assert_eq!(int_or_percent("25%"), json!("25%"));
    }
}
