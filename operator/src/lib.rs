//! `baton-operator`: Baton's reconcilers.
//!
//! ```text
//!   SidecarRelease (cluster) ──selects──► injected Pods (label baton.dev/release=<name>)
//!          ▲                                  │ annotations: baton.dev/version,
//!          │ status (server-side apply):      │ baton.dev/active-slot; container readiness
//!          │ total/updated/ready/failed,      │
//!          └─ per-version counts, conditions ◄┘
//! ```
//!
//! Today the operator runs one controller, the rollout: for every
//! SidecarRelease it moves the pods the webhook injected to `spec.version`
//! (a hot upgrade through the standby slot, or an eviction), and keeps the
//! release's status true to them (counts per version, failures with their
//! reasons, the Progressing / Complete / Degraded / Paused conditions
//! `kubectl get sr` shows). It runs replicated; a Lease elects the one
//! replica that acts and writes.
//!
//! Layout follows controller-rs: [`rollout::plan`] is a pure function from
//! (release, pods, what their sidecars say) to actions, [`release::status`]
//! a pure function from (release, pods) to status, [`rollout::controller`]
//! only reads, plans, acts and writes; [`leader`] and [`admin`] are the
//! process plumbing.

pub mod admin;
pub mod leader;
pub mod metrics;
pub mod release;
pub mod rollout;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use baton_crds::contract;
use tokio::sync::watch;

/// Command-line arguments (each also settable from the environment).
#[derive(Debug, clap::Parser)]
#[command(name = "baton-operator", version, about = "Baton's reconcilers")]
pub struct Args {
    /// Admin listener: /live, /ready, /metrics.
    #[arg(long, env = "BATON_ADMIN_ADDR", default_value = "0.0.0.0:9090")]
    pub admin_addr: SocketAddr,
    /// Namespace holding the leader-election Lease.
    #[arg(long, env = "BATON_NAMESPACE", default_value = contract::SYSTEM_NAMESPACE)]
    pub namespace: String,
    /// This replica's identity in the Lease (the pod name in a cluster).
    #[arg(long, env = "BATON_POD_NAME")]
    pub identity: Option<String>,
    /// Seconds a leader holds the Lease without renewing it.
    #[arg(long, default_value_t = 15)]
    pub lease_seconds: u64,
    /// Log filter (tracing `EnvFilter` syntax).
    #[arg(long, env = "BATON_LOG", default_value = "info")]
    pub log: String,
}

/// Installs the global tracing subscriber.
pub fn init_tracing(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).init();
}

/// Runs the operator until SIGTERM/SIGINT or the loss of leadership.
pub async fn run(args: Args) -> anyhow::Result<()> {
    // kube's TLS stack needs a process-wide rustls provider; the workspace
    // builds rustls with ring only, chosen here explicitly.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes client configuration (in-cluster or KUBECONFIG)")?;
    let metrics = Arc::new(metrics::Metrics::default());
    let (ready_tx, ready_rx) = watch::channel(false);
    let admin = tokio::spawn(admin::serve(args.admin_addr, metrics.clone(), ready_rx));

    let identity = args.identity.clone().unwrap_or_else(default_identity);
    let elector = leader::LeaderElector::new(
        client.clone(),
        &args.namespace,
        "baton-operator",
        &identity,
        Duration::from_secs(args.lease_seconds),
    );
    // Standby replicas are ready too: readiness means "able to take over".
    let _ = ready_tx.send(true);
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    tracing::info!(%identity, "waiting for leadership");
    let mut leadership = tokio::select! {
        leadership = elector.acquire(metrics.clone()) => leadership?,
        () = &mut shutdown => {
            tracing::info!("shutting down (not leading)");
            return Ok(());
        }
    };
    tracing::info!(%identity, "leading; starting controllers");

    let ctx = Arc::new(rollout::controller::Context::new(
        client,
        metrics.clone(),
        rollout::controller::http_probe(),
        Some(identity.clone()),
    ));
    let result = tokio::select! {
        result = rollout::controller::run(ctx) => result,
        lost = leadership.lost() => {
            // Like client-go's OnStoppedLeading: exit, let the pod restart and
            // rejoin as a candidate, so two replicas never write at once.
            anyhow::bail!("lost leadership: {lost}")
        }
        result = admin => result.context("admin server task")?,
        () = &mut shutdown => {
            tracing::info!("shutting down");
            Ok(())
        }
    };
    // The controllers are stopped (their futures dropped above): give the
    // Lease up so the standby takes over now, not after the lease duration.
    match leadership.release().await {
        Ok(true) => tracing::info!(%identity, "released the Lease"),
        Ok(false) => tracing::info!(%identity, "the Lease was no longer ours"),
        Err(error) => tracing::warn!(%error, "releasing the Lease failed; it expires on its own"),
    }
    result
}

fn default_identity() -> String {
    std::env::var("HOSTNAME").unwrap_or_else(|_| format!("baton-operator-{}", std::process::id()))
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
