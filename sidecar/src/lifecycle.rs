//! The process lifecycle as an explicit phase on a watch channel.
//!
//! Every long-running task (accept loops, the admin server, the config
//! watcher, the handoff) observes the same [`Phase`]; transitions are logged
//! and exported as `baton_sidecar_lifecycle_phase{phase}` so an operator can
//! see where a process is without reading logs.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use baton_contract as contract;
use tokio::sync::watch;

use crate::metrics::Metrics;

/// Where the process is in its life. Ordered: phases only move forward,
/// except that a failed handoff returns a process to `Serving`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// Binding or adopting listeners, applying the first config.
    Starting,
    /// New process of a handoff: accepting on the passed listeners and
    /// adopting the old process's connections (see `handoff`).
    Adopting,
    /// Accepting and serving.
    Serving,
    /// Old process of a handoff: passing listeners, state and connections to
    /// the new process; returns to `Serving` if the handoff fails.
    HandingOff,
    /// Not accepting; finishing in-flight work within the grace period.
    Draining,
    /// Everything closed; the process is about to exit.
    Stopped,
}

impl Phase {
    /// Every phase, for exporting one gauge per phase.
    pub const ALL: &'static [Phase] = &[
        Phase::Starting,
        Phase::Adopting,
        Phase::Serving,
        Phase::HandingOff,
        Phase::Draining,
        Phase::Stopped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Adopting => "adopting",
            Phase::Serving => "serving",
            Phase::HandingOff => "handing_off",
            Phase::Draining => "draining",
            Phase::Stopped => "stopped",
        }
    }

    /// Whether the process serves traffic (readiness): both sides of a
    /// handoff do, so the pod stays Ready throughout.
    pub fn serves(self) -> bool {
        matches!(self, Phase::Adopting | Phase::Serving | Phase::HandingOff)
    }

    /// Accept loops stop accepting from this phase on.
    pub fn stops_accepting(self) -> bool {
        self >= Phase::Draining
    }
}

/// Owner of the phase channel. Cheap to clone (shares the sender).
#[derive(Debug, Clone)]
pub struct Lifecycle {
    tx: Arc<watch::Sender<Phase>>,
    /// Flips to `true` once, when the phase reaches Draining. Per-connection
    /// tasks wait on this rather than on the phase: a phase step wakes every
    /// receiver, and waking 10,000 idle connections on a current-thread
    /// runtime at the start of a handoff stalled it for ~50 ms.
    draining: Arc<watch::Sender<bool>>,
    metrics: Arc<Metrics>,
}

impl Lifecycle {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        let (tx, _) = watch::channel(Phase::Starting);
        let (draining, _) = watch::channel(false);
        let lc = Self {
            tx: Arc::new(tx),
            draining: Arc::new(draining),
            metrics,
        };
        lc.export(Phase::Starting);
        lc
    }

    pub fn current(&self) -> Phase {
        *self.tx.borrow()
    }

    pub fn subscribe(&self) -> watch::Receiver<Phase> {
        self.tx.subscribe()
    }

    /// Resolves (`wait_until(&mut rx, |d| *d)`) once the process stops
    /// accepting; unlike [`Lifecycle::subscribe`], not woken by other steps.
    pub fn drain_signal(&self) -> watch::Receiver<bool> {
        self.draining.subscribe()
    }

    /// Move to `phase` (no-op, waking no one, when already there); logs and
    /// exports.
    pub fn set(&self, phase: Phase) {
        let mut prev = phase;
        self.tx.send_if_modified(|p| {
            prev = std::mem::replace(p, phase);
            prev != phase
        });
        if prev != phase {
            tracing::info!(from = prev.as_str(), to = phase.as_str(), "lifecycle phase");
            self.export(phase);
            if phase.stops_accepting() {
                self.draining
                    .send_if_modified(|d| !std::mem::replace(d, true));
            }
        }
    }

    fn export(&self, phase: Phase) {
        for p in Phase::ALL {
            self.metrics
                .phase
                .get_or_create(&vec![("phase", p.as_str())])
                .set(i64::from(*p == phase));
        }
    }

    /// Resolves once the phase is at least `phase`.
    pub async fn reached(&self, phase: Phase) {
        wait_until(&mut self.subscribe(), |p| *p >= phase).await;
    }
}

/// Wait until `pred` holds for the channel's value (or the sender is gone).
/// Unlike `Receiver::wait_for`, holds no borrow guard across the await, so
/// futures using it stay `Send`.
pub async fn wait_until<T>(rx: &mut watch::Receiver<T>, pred: impl FnMut(&T) -> bool) {
    let _ = rx.wait_for(pred).await;
}

/// How a process's serving life ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// A signal, `/shutdown`, or the end of the data plane.
    Stopped,
    /// Everything went to a successor through a handoff.
    HandedOff,
}

/// The old process of an in-pod handoff idles instead of exiting.
///
/// In a pod the kubelet restarts a container whose process exits, and a
/// sidecar restarted in the slot it just left would find the successor on
/// the handoff socket and take everything back (then the successor's slot
/// would do the same: ping-pong). So when the webhook asked for it
/// (`BATON_IDLE_AFTER_HANDOFF=1`), the old process leaves a marker
/// `retired-<slot>` next to the handoff socket and stays alive, idle,
/// until the operator swaps its slot back to the idle image (SIGTERM). A
/// process the kubelet starts in a slot that has a marker (the idle one was
/// killed some other way) idles too rather than take over. `baton-empty`,
/// the idle image, removes its slot's marker: from then on the slot may
/// host the next upgrade.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retirement {
    dir: PathBuf,
    slot: Option<String>,
    idle: bool,
}

impl Retirement {
    /// `dir` holds the handoff socket; `slot` is this process's (`a`/`b`).
    pub fn new(dir: impl Into<PathBuf>, slot: Option<String>, idle: bool) -> Self {
        Self {
            dir: dir.into(),
            slot: slot.filter(|s| matches!(s.as_str(), "a" | "b")),
            idle,
        }
    }

    /// From the environment the webhook sets (`BATON_SLOT`,
    /// `BATON_IDLE_AFTER_HANDOFF`, `BATON_HANDOFF_SOCKET`).
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let socket = var(contract::env::HANDOFF_SOCKET)
            .unwrap_or_else(|| contract::volumes::HANDOFF_SOCKET.to_owned());
        let dir = Path::new(&socket)
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        Self::new(
            dir,
            var(contract::env::SLOT),
            var(contract::env::IDLE_AFTER_HANDOFF).as_deref() == Some("1"),
        )
    }

    /// This process's slot, if it runs in one.
    pub fn slot(&self) -> Option<&str> {
        self.slot.as_deref()
    }

    /// Idling after a handoff was asked for, and the slot is known.
    pub fn enabled(&self) -> bool {
        self.idle && self.slot.is_some()
    }

    fn marker(&self, slot: &str) -> PathBuf {
        self.dir.join(format!(
            "{}{slot}",
            contract::volumes::RETIRED_MARKER_PREFIX
        ))
    }

    /// Whether this process's slot was retired by an earlier handoff.
    pub fn is_retired(&self) -> bool {
        self.enabled()
            && self
                .slot
                .as_deref()
                .is_some_and(|s| self.marker(s).exists())
    }

    /// Leaves this slot's marker (pid and time, for people reading it).
    pub fn retire(&self) -> std::io::Result<()> {
        let Some(slot) = self.slot.as_deref() else {
            return Ok(());
        };
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        std::fs::write(
            self.marker(slot),
            format!("{{\"pid\":{},\"since\":{since}}}\n", std::process::id()),
        )
    }

    /// Removes this slot's marker (the idle image does, at start).
    pub fn clear(&self) -> std::io::Result<()> {
        let Some(slot) = self.slot.as_deref() else {
            return Ok(());
        };
        match std::fs::remove_file(self.marker(slot)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Slots whose handed-off process idles (for `GET /handoff`).
    pub fn retired_slots(&self) -> Vec<&'static str> {
        ["a", "b"]
            .into_iter()
            .filter(|s| self.marker(s).exists())
            .collect()
    }
}

/// Idles until SIGTERM or SIGINT (the operator swapping the slot's image,
/// or the pod going away). The data plane is gone by then; this only keeps
/// the container from being restarted into a second sidecar.
pub async fn idle_until_terminated(why: &str) {
    tracing::info!(why, "idle until terminated");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("terminated while idle");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retired_slot_is_marked_listed_and_cleared_by_the_idle_image() {
        let dir = tempfile::tempdir().unwrap();
        let a = Retirement::new(dir.path(), Some("a".into()), true);
        let b = Retirement::new(dir.path(), Some("b".into()), true);
        assert!(!a.is_retired() && a.retired_slots().is_empty());
        a.retire().unwrap();
        assert!(a.is_retired() && !b.is_retired());
        assert_eq!(b.retired_slots(), vec!["a"]);
        let marker = std::fs::read_to_string(dir.path().join("retired-a")).unwrap();
        assert!(
            marker.contains(&format!("\"pid\":{}", std::process::id())),
            "{marker}"
        );
        a.clear().unwrap();
        a.clear().unwrap();
        assert!(!a.is_retired() && b.retired_slots().is_empty());
    }

    #[test]
    fn without_the_webhook_s_setting_or_a_slot_nothing_idles() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("retired-a"), "{}").unwrap();
        assert!(!Retirement::new(dir.path(), Some("a".into()), false).is_retired());
        assert!(!Retirement::new(dir.path(), None, true).enabled());
        assert!(!Retirement::new(dir.path(), Some("../x".into()), true).enabled());
    }

    #[tokio::test]
    async fn phases_are_observed_in_order_and_exported() {
        let metrics = Arc::new(Metrics::new());
        let lc = Lifecycle::new(metrics.clone());
        let mut rx = lc.subscribe();
        assert_eq!(*rx.borrow_and_update(), Phase::Starting);
        lc.set(Phase::Serving);
        rx.changed().await.unwrap();
        assert_eq!(*rx.borrow_and_update(), Phase::Serving);
        lc.set(Phase::Draining);
        lc.reached(Phase::Draining).await;
        let text = metrics.encode();
        assert!(
            text.contains("baton_sidecar_lifecycle_phase{phase=\"draining\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("baton_sidecar_lifecycle_phase{phase=\"serving\"} 0"),
            "{text}"
        );
        assert!(Phase::Draining.stops_accepting() && !Phase::Serving.stops_accepting());
    }

    #[test]
    fn only_reaching_draining_signals_connections_and_repeats_wake_no_one() {
        let lc = Lifecycle::new(Arc::new(Metrics::new()));
        let mut phase = lc.subscribe();
        let mut drain = lc.drain_signal();
        lc.set(Phase::Serving);
        assert!(phase.has_changed().unwrap());
        phase.borrow_and_update();
        lc.set(Phase::Serving);
        assert!(
            !phase.has_changed().unwrap(),
            "same phase again notifies no one"
        );
        lc.set(Phase::HandingOff);
        lc.set(Phase::Serving);
        assert!(
            !drain.has_changed().unwrap(),
            "handoff steps do not wake connections"
        );
        lc.set(Phase::Draining);
        assert!(drain.has_changed().unwrap());
        assert!(*drain.borrow_and_update());
        lc.set(Phase::Stopped);
        assert!(!drain.has_changed().unwrap(), "signalled once");
    }
}
