//! The process lifecycle as an explicit phase on a watch channel.
//!
//! Every long-running task (accept loops, the admin server, the config
//! watcher, the handoff) observes the same [`Phase`]; transitions are logged
//! and exported as `baton_sidecar_lifecycle_phase{phase}` so an operator can
//! see where a process is without reading logs.

use std::sync::Arc;

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

#[cfg(test)]
mod tests {
    use super::*;

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
