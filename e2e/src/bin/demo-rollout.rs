//! `demo-rollout`: Baton's main job on a running local cluster with Baton
//! installed (`scripts/demo.sh` brings both up and tears them down).
//!
//! A Deployment of echo pods is injected with sidecar v1 and put under
//! continuous byte-checked traffic from the host (HTTP/1.1, HTTP/2, TCP, and
//! TLS the app speaks itself) and from two meshed client Pods through a
//! Service, under mesh mTLS (HTTP/1.1, HTTP/2, TCP through both Pods'
//! sidecars); one SidecarRelease selects servers and clients and is bumped
//! v1 → v2 → v1, each time
//! waiting for Complete with a progress line; then a broken v3 whose
//! sidecar exits at once, which must leave the pods serving and the release
//! Degraded and Paused. It ends with a report and exits non-zero when any
//! exchange failed, any application container restarted, or a step did not
//! end as it must.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use baton_crds::SidecarRelease;
use baton_crds::contract::labels;
use baton_e2e::fetch::{self, FetchProtocol, FetchReport};
use baton_e2e::meshed::{self, MeshTraffic};
use baton_e2e::rollout::{
    Counters, Traffic, app_restarts, complete_on, condition, create_app, create_release,
    handoff_durations, make_versions, paused_by_failures, pki, quantile, ready_now, ready_pods,
    ready_pods_labelled, restarts, set_version, wait_targets_serve,
};
use clap::Parser;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};

#[derive(Parser)]
#[command(about = "Cluster-wide lossless sidecar upgrade, under load, with a report")]
struct Args {
    /// Namespace the demo app runs in (created, labelled for injection,
    /// deleted at the end).
    #[arg(long, default_value = "baton-demo")]
    namespace: String,
    /// Pods in the demo Deployment (at most 50).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..=50))]
    replicas: u16,
    /// The release's maxUnavailable: a count or a percentage.
    #[arg(long, default_value = "25%")]
    max_unavailable: String,
    /// CPU request of the serving sidecar slot (default: the webhook's,
    /// 50m); lower it to fit 50 pods on a small node.
    #[arg(long)]
    sidecar_cpu: Option<String>,
    /// Leave the namespace and release in place at the end.
    #[arg(long)]
    keep: bool,
    /// Skip the broken-version act (benchmarks time only the rollouts).
    #[arg(long)]
    no_broken: bool,
    /// Also write the report as JSON to this file (bench/rollout-bench.sh).
    #[arg(long)]
    report_json: Option<std::path::PathBuf>,
    /// At the end, upgrade the echo Pods' sidecars the way other meshes do
    /// — the release paused on v2, `kubectl rollout restart deployment/echo`
    /// — under the same meshed traffic, and report it beside the hot
    /// upgrades (bench/rollout-bench.sh).
    #[arg(long)]
    compare_restart: bool,
}

/// Time allowed for one rollout to reach Complete.
const ROLLOUT_TIMEOUT: Duration = Duration::from_secs(300);
/// Meshed client Pods (`demo-fetch`) sending to the echo Service.
const CLIENTS: usize = 2;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = baton_e2e::client().await;
    let ns = args.namespace.clone();
    let release = ns.clone();

    make_versions(&["v1", "v2"], &["v3"]).map_err(anyhow::Error::msg)?;
    create_namespace(&client, &ns).await?;
    let outcome = run(&client, &ns, &release, &args).await;
    if !args.keep {
        step("cleaning up the demo namespace and release");
        let _ = Api::<Namespace>::all(client.clone())
            .delete(&ns, &DeleteParams::default())
            .await;
    }
    let report = outcome?;
    println!("{report}");
    if let Some(path) = &args.report_json {
        std::fs::write(path, serde_json::to_vec_pretty(&report.to_json())?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if !report.problems.is_empty() {
        bail!(
            "the demo did not end as it must:\n  {}",
            report.problems.join("\n  ")
        );
    }
    Ok(())
}

async fn create_namespace(client: &Client, ns: &str) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    let namespace: Namespace = serde_json::from_value(serde_json::json!({
        "metadata": {"name": ns, "labels": {labels::INJECT: labels::INJECT_ENABLED}}
    }))?;
    api.create(&PostParams::default(), &namespace)
        .await
        .with_context(|| {
            format!("creating namespace {ns} (left over from an earlier run? delete it)")
        })?;
    Ok(())
}

fn step(what: &str) {
    println!("\n\x1b[1m== {what}\x1b[0m");
}

#[derive(Default)]
struct Report {
    replicas: usize,
    /// Pods the release upgrades: the echo Pods and the meshed clients.
    pods: usize,
    /// Meshed client → Service → Pod traffic, by protocol.
    meshed: BTreeMap<FetchProtocol, FetchReport>,
    rollouts: Vec<(String, Duration, Vec<u64>)>,
    broken: Option<String>,
    exchanges: usize,
    failed: usize,
    resets: usize,
    bytes: u64,
    reconnects: usize,
    retried: usize,
    /// HTTP/2 connections opened in all; minus `reconnects`: kept.
    h2_connections: usize,
    app_restarts: Vec<String>,
    sidecar_restarts: i32,
    /// The `kubectl rollout restart` comparison (`--compare-restart`).
    restart: Option<RestartReport>,
    problems: Vec<String>,
}

/// Sidecars upgraded by recreating the Pods, as other meshes do.
struct RestartReport {
    /// Echo Pods Ready on the new version at the end.
    pods: usize,
    /// Every one of them was (else the restart was still under way when
    /// [`ROLLOUT_TIMEOUT`] ran out: measured, not an error of the demo).
    finished: bool,
    /// Patch of the Deployment → every live echo Pod Ready on the new
    /// version (or the timeout).
    took: Duration,
    /// Per new Pod: creation → Ready, in ms (the API's timestamps have
    /// second resolution).
    replaced_ms: Vec<u64>,
    meshed: BTreeMap<FetchProtocol, FetchReport>,
}

impl RestartReport {
    fn failed(&self) -> usize {
        self.meshed
            .iter()
            .map(|(p, r)| meshed::failures(*p, r))
            .sum()
    }

    fn exchanges(&self) -> usize {
        self.meshed
            .values()
            .map(|r| r.responses() + r.echoed + r.errors)
            .sum()
    }
}

impl Report {
    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "replicas": self.replicas,
            "pods": self.pods,
            "meshed": self.meshed.iter().map(|(p, r)| (format!("{p:?}").to_lowercase(), serde_json::json!({
                "exchanges": r.responses() + r.echoed + r.errors,
                "failed": meshed::failures(*p, r),
            }))).collect::<serde_json::Map<_, _>>(),
            "rollouts": self.rollouts.iter().map(|(to, took, d)| serde_json::json!({
                "to": to,
                "seconds": took.as_secs_f64(),
                "handoffs": d.len(),
                "handoff_ms_p50": quantile(d, 0.5),
                "handoff_ms_p90": quantile(d, 0.9),
                "handoff_ms_p99": quantile(d, 0.99),
                "handoff_ms_max": d.last(),
            })).collect::<Vec<_>>(),
            "restart": self.restart.as_ref().map(|r| serde_json::json!({
                "pods": r.pods,
                "finished": r.finished,
                "seconds": r.took.as_secs_f64(),
                "replace_ms_p50": quantile(&r.replaced_ms, 0.5),
                "replace_ms_p99": quantile(&r.replaced_ms, 0.99),
                "replace_ms_max": r.replaced_ms.last(),
                "exchanges": r.exchanges(),
                "failed": r.failed(),
                "errors": r.meshed.iter().map(|(p, r)| (format!("{p:?}").to_lowercase(), serde_json::json!({
                    "failed": meshed::failures(*p, r),
                    "statuses": r.statuses.iter().map(|(k, v)| (k.to_string(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
                    "samples": r.error_samples,
                }))).collect::<serde_json::Map<_, _>>(),
            })),
            "exchanges": self.exchanges,
            "failed": self.failed,
            "resets": self.resets,
            "bytes_checked": self.bytes,
            "h2_connections": self.h2_connections,
            "h2_kept": self.h2_connections.saturating_sub(self.reconnects),
            "h2_reconnects": self.reconnects,
            "h2_unprocessed_resent": self.retried,
            "app_restarts": self.app_restarts.len(),
            "problems": self.problems,
        })
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "\n\x1b[1m== report\x1b[0m")?;
        for (to, took, durations) in &self.rollouts {
            let p50 = quantile(durations, 0.5).map_or("-".into(), |v| format!("{v} ms"));
            let max = durations.last().map_or("-".into(), |v| format!("{v} ms"));
            writeln!(
                f,
                "  rollout to {to:<3} {} pods in place in {:>5.1} s   per-Pod handoff p50 {p50}, max {max} ({} of {} Pods on record)",
                self.pods,
                took.as_secs_f64(),
                durations.len(),
                self.pods
            )?;
        }
        if let Some(broken) = &self.broken {
            writeln!(f, "  broken v3         {broken}")?;
        }
        writeln!(
            f,
            "  host → Pod        {} exchanges, {} failed, {} resets, {:.1} MiB echoed and checked byte for byte",
            self.exchanges,
            self.failed,
            self.resets,
            self.bytes as f64 / (1024.0 * 1024.0)
        )?;
        let by = |p: FetchProtocol| self.meshed.get(&p).cloned().unwrap_or_default();
        let (h1, h2, tcp) = (
            by(FetchProtocol::Http1),
            by(FetchProtocol::Http2),
            by(FetchProtocol::Tcp),
        );
        let failed: usize = self
            .meshed
            .iter()
            .map(|(p, r)| meshed::failures(*p, r))
            .sum();
        writeln!(
            f,
            "  Pod → Pod (mTLS)  {} HTTP/1.1 + {} HTTP/2 requests, {} TCP exchanges through both sidecars, {failed} failed",
            h1.responses() + h1.errors,
            h2.responses() + h2.errors,
            tcp.echoed + tcp.errors,
        )?;
        writeln!(
            f,
            "  HTTP/2            {} connections kept open by the server, {} reopened after GOAWAY, {} unprocessed requests re-sent (RFC 9113 §8.7)",
            self.h2_connections.saturating_sub(self.reconnects),
            self.reconnects,
            self.retried
        )?;
        writeln!(
            f,
            "  restarts          {} application containers, {} sidecar slot restarts (image swaps)",
            self.app_restarts.len(),
            self.sidecar_restarts
        )?;
        if let Some(r) = &self.restart {
            let p50 = quantile(&r.replaced_ms, 0.5).map_or("-".into(), |v| format!("{v} ms"));
            let p99 = quantile(&r.replaced_ms, 0.99).map_or("-".into(), |v| format!("{v} ms"));
            writeln!(
                f,
                "  for comparison    kubectl rollout restart (how other meshes upgrade): {} Pods recreated in {:.1} s{}, per-Pod creation → Ready p50 {p50}, p99 {p99}; Pod → Pod (mTLS) {} exchanges, {} failed",
                r.pods,
                r.took.as_secs_f64(),
                if r.finished {
                    ""
                } else {
                    " (NOT finished: the rest were still being replaced)"
                },
                r.exchanges(),
                r.failed()
            )?;
        }
        if self.problems.is_empty() {
            write!(
                f,
                "  result            OK: zero failed exchanges, no application restarted"
            )
        } else {
            write!(
                f,
                "  result            FAILED ({} problems)",
                self.problems.len()
            )
        }
    }
}

/// A one-line view of the release and the traffic, printed as it changes.
fn progress_line(
    started: Instant,
    status: &serde_json::Value,
    traffic: &Counters,
    mesh: &MeshTraffic,
) -> String {
    let t = traffic.snapshot();
    let versions = status["versions"]
        .as_array()
        .map(|vs| {
            vs.iter()
                .map(|v| format!("{}:{}", v["version"].as_str().unwrap_or("?"), v["total"]))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    format!(
        "  [{:>5.1}s] pods by version {versions:<12} updated {} in flight {} failed {} | host → Pod {} exchanges, {} failed | Pod → Pod {}, {} failed",
        started.elapsed().as_secs_f64(),
        status["updated"],
        status["inFlight"],
        status["failed"],
        t.exchanges,
        t.failures.len(),
        mesh.sent.load(std::sync::atomic::Ordering::Relaxed),
        mesh.failed.load(std::sync::atomic::Ordering::Relaxed),
    )
}

async fn run(client: &Client, ns: &str, release: &str, args: &Args) -> anyhow::Result<Report> {
    let replicas = usize::from(args.replicas);
    let max_unavailable = args.max_unavailable.as_str();
    let sidecar_cpu = args.sidecar_cpu.as_deref();
    let pods_total = replicas + CLIENTS;
    let mut report = Report {
        replicas,
        pods: pods_total,
        ..Report::default()
    };
    step(&format!(
        "{replicas} pods of an echo app (HTTP/1.1 + HTTP/2, TCP, app-level TLS) injected with sidecar v1"
    ));
    let pki = pki();
    let _release = create_release(client, release, ns, "v1", max_unavailable, sidecar_cpu).await?;
    create_app(client, ns, ns, &pki, replicas).await?;
    meshed::create(client, ns, ns, CLIENTS).await?;
    let pods = ready_pods(client, ns, "v1", replicas, Duration::from_secs(300)).await?;
    wait_targets_serve(&pods, &pki)
        .await
        .map_err(anyhow::Error::msg)?;
    let client_selector = format!("app={}", meshed::CLIENT_APP);
    let clients = ready_pods_labelled(
        client,
        ns,
        &client_selector,
        "v1",
        CLIENTS,
        Duration::from_secs(300),
    )
    .await?;
    let drivers: Vec<_> = clients
        .iter()
        .map(|p| std::net::SocketAddr::new(baton_e2e::wait::pod_ip(p), fetch::PORT))
        .collect();
    let service = meshed::service_ip(client, ns).await?;
    println!(
        "  {CLIENTS} meshed client pods send to Service {} ({service}) through their own sidecar; TlsPolicy echo: mTLS Permissive",
        meshed::SERVICE
    );
    meshed::wait_served(&drivers, service, Duration::from_secs(120)).await?;
    let all_pods = [pods.clone(), clients.clone()].concat();
    let restarts_before = restarts(&all_pods);
    let uids: Vec<_> = all_pods.iter().map(|p| p.metadata.uid.clone()).collect();
    println!(
        "  {} pods ready; starting continuous traffic to every echo pod on 4 protocols from the host, and from the clients through the mesh on 3",
        all_pods.len()
    );
    let traffic = Traffic::start(&pods, &pki);
    let mesh = MeshTraffic::start(&drivers, service);
    tokio::time::sleep(Duration::from_secs(3)).await;

    for to in ["v2", "v1"] {
        step(&format!(
            "kubectl patch sidecarrelease {release} --type merge -p '{{\"spec\":{{\"version\":\"{to}\"}}}}'"
        ));
        let started = Instant::now();
        set_version(client, release, to).await?;
        let mut last = String::new();
        let status = baton_e2e::rollout::wait_release(
            client,
            release,
            &format!("release Complete on {to}"),
            ROLLOUT_TIMEOUT,
            |s| complete_on(s, to, pods_total),
            |s| {
                let line = progress_line(started, s, &traffic.counters, &mesh);
                // Print when the release moved, not every poll.
                let key = line.split_once(']').map_or("", |x| x.1).to_owned();
                if key != last {
                    println!("{line}");
                    last = key;
                }
            },
        )
        .await?;
        let took = started.elapsed();
        let mut durations = handoff_durations(client, ns, "app=echo", to).await?;
        durations.extend(handoff_durations(client, ns, &client_selector, to).await?);
        durations.sort_unstable();
        println!(
            "  Complete: {} in {:.1} s",
            condition(&status, "Complete")
                .and_then(|c| c["message"].as_str())
                .unwrap_or(""),
            took.as_secs_f64()
        );
        report.rollouts.push((to.to_owned(), took, durations));
    }

    if !args.no_broken {
        step(&format!(
            "a broken sidecar v3 (exits at once): kubectl patch sidecarrelease {release} ... v3"
        ));
        let started = Instant::now();
        set_version(client, release, "v3").await?;
        let status = baton_e2e::rollout::wait_release(
            client,
            release,
            "release Paused and Degraded",
            Duration::from_secs(180),
            paused_by_failures,
            |_| {},
        )
        .await?;
        let degraded = condition(&status, "Degraded")
            .and_then(|c| c["message"].as_str())
            .unwrap_or("")
            .to_owned();
        println!(
            "  after {:.1} s: rollout {}, {} pod(s) failed; Degraded: {degraded}",
            started.elapsed().as_secs_f64(),
            status["rollout"].as_str().unwrap_or("?"),
            status["failed"]
        );
        println!(
            "  (kubectl describe sidecarrelease {release} shows the reason and the HandoffFailed Events)"
        );
        report.broken = Some(format!(
            "paused after {} failed pod(s); every pod kept serving on v1",
            status["failed"]
        ));
    }
    // The pods must still all be on v1, the same pods, serving.
    let now = ready_pods(client, ns, "v1", replicas, Duration::from_secs(60)).await?;
    let clients_now = ready_pods_labelled(
        client,
        ns,
        &client_selector,
        "v1",
        CLIENTS,
        Duration::from_secs(60),
    )
    .await?;
    let now = [now, clients_now].concat();
    tokio::time::sleep(Duration::from_secs(2)).await;

    let totals = traffic.stop().await;
    report.meshed = mesh.stop().await;
    report.exchanges = totals.exchanges;
    report.failed = totals.failures.len();
    report.resets = totals.resets();
    report.bytes = totals.bytes;
    report.reconnects = totals.reconnects;
    report.h2_connections = totals.h2_connections;
    report.retried = totals.retried;
    let restarts_after = restarts(&now);
    report.app_restarts = app_restarts(&restarts_before, &restarts_after);
    report.sidecar_restarts = restarts_after
        .iter()
        .filter(|(k, _)| baton_e2e::rollout::is_sidecar(k))
        .map(|(k, n)| n - restarts_before.get(k).copied().unwrap_or(0))
        .sum();

    let uids_after: Vec<_> = now.iter().map(|p| p.metadata.uid.clone()).collect();
    if sorted(uids) != sorted(uids_after) {
        report.problems.push("a pod was recreated".into());
    }
    for f in totals.failures.iter().take(10) {
        report.problems.push(format!("failed exchange: {f}"));
    }
    if totals.failures.len() > 10 {
        report.problems.push(format!(
            "... and {} more failed exchanges",
            totals.failures.len() - 10
        ));
    }
    report.problems.extend(
        report
            .app_restarts
            .iter()
            .map(|r| format!("application container restarted: {r}")),
    );
    if totals.exchanges == 0 {
        report.problems.push("no traffic was sent".into());
    }
    for (p, r) in &report.meshed {
        let failed = meshed::failures(*p, r);
        if failed > 0 {
            report.problems.push(format!(
                "{failed} meshed {p:?} exchanges failed: {:?} {:?}",
                r.error_samples, r.local_samples
            ));
        }
        if r.responses() + r.echoed == 0 {
            report
                .problems
                .push(format!("no meshed {p:?} traffic was served"));
        }
    }
    if args.compare_restart {
        report.restart =
            Some(rollout_restart(client, ns, release, replicas, &drivers, service).await?);
    }
    Ok(report)
}

/// Upgrades the echo Pods' sidecars to v2 the way other meshes do: hot
/// upgrades paused, the release on v2 (the webhook injects new Pods with
/// it), `kubectl rollout restart deployment/echo`, under the same meshed
/// client traffic as the hot upgrades. Its failures are measured, not
/// judged: they are what Baton's handoff avoids.
async fn rollout_restart(
    client: &Client,
    ns: &str,
    release: &str,
    replicas: usize,
    drivers: &[std::net::SocketAddr],
    service: std::net::IpAddr,
) -> anyhow::Result<RestartReport> {
    step(&format!(
        "for comparison, how other meshes upgrade sidecars: kubectl patch sidecarrelease {release} (paused, v2); kubectl rollout restart deployment/echo"
    ));
    let releases: Api<SidecarRelease> = Api::all(client.clone());
    releases
        .patch(
            release,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"upgrade": {"paused": true}}})),
        )
        .await
        .context("pausing the release")?;
    set_version(client, release, "v2").await?;
    let mesh = MeshTraffic::start(drivers, service);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let started = Instant::now();
    let restarted_at = k8s_openapi::jiff::Timestamp::now().to_string();
    Api::<Deployment>::namespaced(client.clone(), ns)
        .patch(
            "echo",
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"spec": {"template": {"metadata": {"annotations": {
                    "kubectl.kubernetes.io/restartedAt": restarted_at
                }}}}}),
            ),
        )
        .await
        .context("restarting deployment/echo")?;
    let mut last = String::new();
    let (pods, finished) = loop {
        // Every live echo Pod recreated, Ready and on v2 (terminating old
        // Pods are not live).
        match ready_pods(client, ns, "v2", replicas, Duration::from_secs(1)).await {
            Ok(pods) => break (pods, true),
            Err(_) if started.elapsed() < ROLLOUT_TIMEOUT => {
                let line = format!(
                    "  [{:>5.1}s] Pod → Pod {}, {} failed",
                    started.elapsed().as_secs_f64(),
                    mesh.sent.load(std::sync::atomic::Ordering::Relaxed),
                    mesh.failed.load(std::sync::atomic::Ordering::Relaxed),
                );
                let key = line.split_once(']').map_or("", |x| x.1).to_owned();
                if key != last && started.elapsed().as_secs().is_multiple_of(5) {
                    println!("{line}");
                    last = key;
                }
            }
            Err(e) => {
                // A restart that does not finish is a result (the node
                // cannot hold the surge, say), not a failure of the demo.
                println!("  kubectl rollout restart did not finish: {e}");
                break (
                    ready_now(client, ns, "app=echo", "v2")
                        .await
                        .context("listing the echo Pods")?,
                    false,
                );
            }
        }
    };
    let took = started.elapsed();
    if finished {
        println!(
            "  every echo Pod recreated on v2 in {:.1} s",
            took.as_secs_f64()
        );
    }
    // The old Pods' termination grace (5 s) and the clients' endpoint
    // updates end inside this window.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let meshed = mesh.stop().await;
    let mut replaced_ms: Vec<u64> = pods.iter().filter_map(created_to_ready_ms).collect();
    replaced_ms.sort_unstable();
    Ok(RestartReport {
        pods: pods.len(),
        finished,
        took,
        replaced_ms,
        meshed,
    })
}

/// A Pod's creation → Ready time in ms (second resolution).
fn created_to_ready_ms(p: &Pod) -> Option<u64> {
    let created = p.metadata.creation_timestamp.as_ref()?.0;
    let ready = p
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready" && c.status == "True")?
        .last_transition_time
        .as_ref()?
        .0;
    u64::try_from(ready.duration_since(created).as_millis()).ok()
}

fn sorted<T: Ord>(mut v: Vec<T>) -> Vec<T> {
    v.sort();
    v
}
