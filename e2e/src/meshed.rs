//! Meshed traffic for the rollout scenario: client Pods whose own sidecar
//! carries their requests to a Service over the echo Pods, under mesh mTLS
//! — the path users run (Pod → Service → Pod through two sidecars), beside
//! the scenario's host → Pod traffic ([`crate::rollout::Traffic`]).
//!
//! The clients are `demo-fetch` drivers ([`crate::fetch`]) whose app runs
//! as a UID other than the sidecar's, so its traffic is captured by its own
//! sidecar. They carry the scenario's run label, so the release that
//! upgrades the echo Pods upgrades them too: a rollout hands off both ends
//! of every connection. The echo Pods get a `TlsPolicy` in Permissive mode:
//! meshed clients reach them over mTLS, while the host's traffic (plaintext
//! and the app's own TLS, from outside the mesh) keeps being served.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

use crate::fetch::{self, FetchProtocol, FetchReport, FetchSpec};
use crate::pods::container;
use crate::rollout::{HTTP_PORT, RUN_LABEL, TCP_PORT};
use crate::wait::{Check, Timeout, wait_for};

/// The client Pods' `app` label.
pub const CLIENT_APP: &str = "demo-client";
/// The Service over the echo Pods.
pub const SERVICE: &str = "echo";
/// The Service port named `http2`: its cluster speaks h2c over the mesh.
pub const H2_PORT: u16 = 8081;
/// The client's app UID (any but the sidecar's, whose traffic bypasses it).
const APP_UID: i64 = 1000;
/// Requests (or TCP exchanges) per `/fetch` batch.
const BATCH: usize = 100;
/// The longest the traffic runs, whatever the caller does.
const LIMIT: Duration = Duration::from_secs(900);
/// Every protocol of the meshed traffic.
pub const PROTOCOLS: [FetchProtocol; 3] = [
    FetchProtocol::Http1,
    FetchProtocol::Http2,
    FetchProtocol::Tcp,
];

/// The Service, the echo Pods' `TlsPolicy` (Permissive, mesh certificates)
/// and a Deployment of `clients` client Pods labelled with `run`.
pub async fn create(
    client: &Client,
    ns: &str,
    run: &str,
    clients: usize,
) -> Result<(), kube::Error> {
    let service: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": SERVICE},
        "spec": {"selector": {"app": "echo"}, "ports": [
            {"name": "http", "port": HTTP_PORT, "targetPort": HTTP_PORT},
            {"name": "http2", "port": H2_PORT, "targetPort": HTTP_PORT},
            {"name": "tcp", "port": TCP_PORT, "targetPort": TCP_PORT}]}
    }))
    .expect("the service literal is valid");
    Api::<Service>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &service)
        .await?;
    let policy = json!({
        "apiVersion": "baton.dev/v1alpha1", "kind": "TlsPolicy",
        "metadata": {"name": "echo"},
        "spec": {"podSelector": {"matchLabels": {"app": "echo"}},
                 "mtls": {"mode": "Permissive"},
                 "certificate": {"source": "Mesh"}}
    });
    Api::<baton_crds::TlsPolicy>::namespaced(client.clone(), ns)
        .patch(
            "echo",
            &PatchParams::apply("baton-demo").force(),
            &Patch::Apply(&policy),
        )
        .await?;
    let mut fetch = container("fetch", "demo-fetch", &[]);
    fetch.security_context = Some(k8s_openapi::api::core::v1::SecurityContext {
        run_as_user: Some(APP_UID),
        run_as_group: Some(APP_UID),
        ..Default::default()
    });
    let mut fetch = serde_json::to_value(fetch).expect("containers serialize");
    fetch["readinessProbe"] = json!({"tcpSocket": {"port": fetch::PORT}, "periodSeconds": 1});
    let deployment: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": CLIENT_APP},
        "spec": {
            "replicas": clients,
            "selector": {"matchLabels": {"app": CLIENT_APP}},
            "template": {
                "metadata": {"labels": {"app": CLIENT_APP, RUN_LABEL: run}},
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "automountServiceAccountToken": false,
                    "containers": [fetch],
                }
            }
        }
    }))
    .expect("the deployment literal is valid");
    Api::<Deployment>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &deployment)
        .await?;
    Ok(())
}

/// The Service's ClusterIP.
pub async fn service_ip(client: &Client, ns: &str) -> Result<IpAddr, kube::Error> {
    let svc = Api::<Service>::namespaced(client.clone(), ns)
        .get(SERVICE)
        .await?;
    Ok(svc
        .spec
        .and_then(|s| s.cluster_ip)
        .and_then(|ip| ip.parse().ok())
        .expect("a Service with a ClusterIP"))
}

fn spec(service: IpAddr, protocol: FetchProtocol, count: usize) -> FetchSpec {
    let port = match protocol {
        FetchProtocol::Http1 => HTTP_PORT,
        FetchProtocol::Http2 => H2_PORT,
        FetchProtocol::Tcp => TCP_PORT,
    };
    FetchSpec {
        target: SocketAddr::new(service, port),
        path: "/".into(),
        count,
        concurrency: 2,
        headers: BTreeMap::new(),
        protocol,
    }
}

/// Whether a batch came back whole: every request answered 200 by an echo
/// Pod, every TCP exchange echoed.
fn clean(protocol: FetchProtocol, r: &FetchReport, count: usize) -> bool {
    match protocol {
        FetchProtocol::Tcp => r.echoed == count && r.errors == 0,
        _ => r.status(200) == count && r.errors == 0,
    }
}

/// Waits until every driver is served on every protocol (the policy and
/// the certificates have reached both ends).
pub async fn wait_served(
    drivers: &[SocketAddr],
    service: IpAddr,
    within: Duration,
) -> Result<(), Timeout> {
    for &driver in drivers {
        for p in PROTOCOLS {
            wait_for(
                &format!("{driver} served over {p:?} through the mesh"),
                within,
                || async move {
                    match fetch::fetch_via(driver, &spec(service, p, 10)).await {
                        Ok(r) if clean(p, &r, 10) => Check::Done(()),
                        Ok(r) => Check::NotYet(format!("{r:?}")),
                        Err(e) => Check::NotYet(e),
                    }
                },
            )
            .await?;
        }
    }
    Ok(())
}

/// Continuous meshed traffic: every driver, every protocol, in batches,
/// until [`MeshTraffic::stop`] (or [`LIMIT`]).
#[derive(Debug)]
pub struct MeshTraffic {
    stop: Arc<AtomicBool>,
    /// Exchanges done and failed so far (the progress display).
    pub sent: Arc<AtomicUsize>,
    pub failed: Arc<AtomicUsize>,
    tasks: Vec<(FetchProtocol, tokio::task::JoinHandle<FetchReport>)>,
}

impl MeshTraffic {
    pub fn start(drivers: &[SocketAddr], service: IpAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for &driver in drivers {
            for p in PROTOCOLS {
                let (stop, sent, failed) = (stop.clone(), sent.clone(), failed.clone());
                let batch = spec(service, p, BATCH);
                tasks.push((
                    p,
                    tokio::spawn(async move {
                        let started = Instant::now();
                        let mut total = FetchReport::default();
                        while !stop.load(Ordering::Relaxed) && started.elapsed() < LIMIT {
                            let r = match fetch::fetch_via(driver, &batch).await {
                                Ok(r) => r,
                                Err(e) => FetchReport {
                                    errors: batch.count,
                                    error_samples: vec![format!("driver {driver}: {e}")],
                                    ..FetchReport::default()
                                },
                            };
                            sent.fetch_add(batch.count, Ordering::Relaxed);
                            failed.fetch_add(failures(p, &r), Ordering::Relaxed);
                            total.merge(r);
                        }
                        total
                    }),
                ));
            }
        }
        Self {
            stop,
            sent,
            failed,
            tasks,
        }
    }

    /// Stops sending; the reports merged by protocol.
    pub async fn stop(self) -> BTreeMap<FetchProtocol, FetchReport> {
        self.stop.store(true, Ordering::Relaxed);
        let mut out: BTreeMap<FetchProtocol, FetchReport> = BTreeMap::new();
        for (p, task) in self.tasks {
            out.entry(p)
                .or_default()
                .merge(task.await.expect("a meshed traffic task panicked"));
        }
        out
    }
}

/// Failed exchanges of a report: errors, and (HTTP) answers other than 200.
pub fn failures(protocol: FetchProtocol, r: &FetchReport) -> usize {
    match protocol {
        FetchProtocol::Tcp => r.errors,
        _ => r.errors + (r.responses() - r.status(200)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_non_200_answer_is_a_failed_exchange_and_tcp_counts_errors() {
        let mut r = FetchReport::default();
        r.statuses.insert(200, 97);
        r.statuses.insert(503, 2);
        r.errors = 1;
        assert_eq!(failures(FetchProtocol::Http1, &r), 3);
        assert!(!clean(FetchProtocol::Http1, &r, 100));
        let tcp = FetchReport {
            echoed: 10,
            ..FetchReport::default()
        };
        assert_eq!(failures(FetchProtocol::Tcp, &tcp), 0);
        assert!(clean(FetchProtocol::Tcp, &tcp, 10));
    }

    #[test]
    fn each_protocol_goes_to_its_service_port() {
        let ip: IpAddr = "10.96.0.9".parse().unwrap();
        assert_eq!(spec(ip, FetchProtocol::Http1, 1).target.port(), HTTP_PORT);
        assert_eq!(spec(ip, FetchProtocol::Http2, 1).target.port(), H2_PORT);
        assert_eq!(spec(ip, FetchProtocol::Tcp, 1).target.port(), TCP_PORT);
    }
}
