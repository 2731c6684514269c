//! The process main loop with handoff: adopt from a live sidecar on the
//! handoff socket if one answers, else start fresh; then serve, answering
//! handoff requests, until a signal, `/shutdown`, or a completed handoff.
//!
//! The `baton-handoff` crate ([`crate::handoff`]) owns the mechanism (wire
//! format, both sides of the protocol, flow control); this loop owns the
//! process around it: which side to play at start, when to listen for a
//! successor, how to end, and reading the config the old process handed
//! over. It sits above [`crate::server`] and below the binary
//! ([`crate::cli`]), so the server does not import it (and the handoff crate
//! cannot).

use std::sync::Arc;
use std::time::Duration;

use crate::config::Snapshot;
use crate::handoff::session::{HandoffError, adopt, bind_restricted, connect, hand_off};
use crate::handoff::{DataPlane, HandoffConfig, HandoffMetrics, Inherited};
use crate::lifecycle::{Ending, Phase};
use crate::metrics::Metrics;
use crate::server::{Running, StartError, StartOptions, start};

/// How long a handed-off process keeps serving admin requests it already
/// accepted before it exits.
const ADMIN_LINGER: Duration = Duration::from_millis(250);

/// Errors that end [`run`].
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("handoff from the running sidecar failed: {0}")]
    Adopt(#[from] HandoffError),
    #[error("not taking over from the running sidecar, which keeps serving: {0}")]
    AdoptionRefused(String),
}

/// The sidecar's main loop with handoff (see the module docs).
///
/// `on_start` runs once the data plane serves (fresh or adopted), before the
/// first handoff request is answered: the place to attach layers that hook
/// into the running server (mesh TLS: config hook, readiness, metrics).
pub async fn run(
    snapshot: Snapshot,
    mut opts: StartOptions,
    cfg: HandoffConfig,
    on_start: impl FnOnce(&Running),
) -> Result<Ending, RunError> {
    let metrics = opts
        .metrics
        .get_or_insert_with(|| Arc::new(Metrics::new()))
        .clone();
    let hm = HandoffMetrics::default();
    metrics.register(|r| hm.register(r));
    let grace = Duration::from_millis(snapshot.runtime.drain_timeout_ms);
    let (running, listener) = match connect(&cfg.socket).await {
        Some(stream) if cfg.adopt_refusal.is_some() => {
            // Closing before the first message: the serving sidecar sees a
            // failed handoff and keeps everything (G9).
            drop(stream);
            let reason = cfg.adopt_refusal.clone().unwrap_or_default();
            tracing::error!(%reason, "refusing to take over from the serving sidecar");
            return Err(RunError::AdoptionRefused(reason));
        }
        Some(stream) => {
            // Serve what the old process served, on its sockets.
            let start_on = move |inherited: Inherited| {
                opts.inherited = inherited.listeners;
                opts.inherited_admin = inherited.admin;
                opts.adopting = true;
                start(
                    inherited_snapshot(inherited.config).unwrap_or(snapshot),
                    opts,
                )
            };
            let running = adopt(stream, start_on, &cfg, &hm, metrics.clone()).await?;
            // The path is ours now: the next sidecar asks us.
            (running, bind_restricted(&cfg.socket, &cfg.peer_uids))
        }
        None => {
            // Bind first, so a successor started right behind us waits for
            // us instead of finding no one and colliding on the ports.
            let listener = bind_restricted(&cfg.socket, &cfg.peer_uids);
            (start(snapshot, opts).await?, listener)
        }
    };
    on_start(&running);
    // Every layer has registered its metric families by now: a carried
    // series still without a family belongs to a family this build lacks.
    let unplaced = metrics.carried_unplaced();
    if !unplaced.is_empty() {
        tracing::warn!(series = ?unplaced, "handoff: carried counters whose family this build does not export");
    }
    // Shared with the handoff's thread while one runs.
    let running = Arc::new(running);
    let plane: Arc<dyn DataPlane> = running.clone();
    let lifecycle = running.shared.lifecycle.clone();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let mut handed_off = false;
    loop {
        let accept = async {
            match &listener {
                Some(l) => l.accept().await.map(|(s, _)| s),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = accept => match r {
                Ok(stream) => match hand_off(stream, &plane, &cfg, &hm).await {
                    Ok(true) => { handed_off = true; break; }
                    Ok(false) => {}
                    Err(e) => tracing::warn!(error = %e, label = e.metric_label(), "handoff failed; still serving"),
                },
                Err(e) => {
                    tracing::warn!(error = %e, "handoff socket accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {
                tracing::info!("SIGTERM: draining");
                break;
            }
            _ = tokio::signal::ctrl_c() => { tracing::info!("SIGINT: draining"); break; }
            _ = lifecycle.reached(Phase::Draining) => break,
        }
    }
    drop(listener);
    drop(plane);
    if handed_off {
        // Probes on the shared admin socket go to the new process only; the
        // few admin requests this process accepted just before finish first
        // (they take well under a millisecond; exiting would cut them off).
        running.stop_admin();
        tokio::time::sleep(ADMIN_LINGER).await;
    }
    if !handed_off {
        // The path is ours (a successor would have replaced it).
        let _ = std::fs::remove_file(&cfg.socket);
    }
    // A handoff's thread has ended (it returns only once its future, and its
    // reference, are dropped), so this is the only reference left.
    match Arc::try_unwrap(running) {
        Ok(running) => running.drain(grace).await,
        Err(_) => tracing::error!("data plane still referenced; exiting without a drain"),
    }
    if handed_off {
        // Everything is with the successor now: our exit (freeing what the
        // moved connections used) must not take the CPU from it.
        if let Err(e) = crate::sched::set_current_thread_nice(19) {
            tracing::debug!(error = %e, "cannot lower priority for exit");
        }
    }
    Ok(if handed_off {
        Ending::HandedOff
    } else {
        Ending::Stopped
    })
}

/// The config the old process served, which this one serves until the next
/// config push; `None` (serve our own) when it cannot be read.
fn inherited_snapshot(config: serde_json::Value) -> Option<Snapshot> {
    match serde_json::from_value(config) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "handoff: old config snapshot unreadable; serving our own");
            None
        }
    }
}
