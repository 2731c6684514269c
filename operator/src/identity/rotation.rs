//! Root rotation on observed state: what the mesh's certificates are issued
//! under now (the *trust generation*), how many sidecars already hold one of
//! it, and which rotation phase that makes.
//!
//! ```text
//!  CA Secret ──reload──► TrustState {generation, roots, issuer root}
//!                              │ every replica's hub pushes the generation
//!                              ▼ (TLS section `reissue`, capability `reissue`)
//!  sidecar: held generation ≠ pushed ──► jittered CSR ──► Reply::Certificate
//!                              │ each replica counts its streams (tally)
//!                              ▼
//!  leader: Progress (all replicas) + TrustState ──► Phase
//!          └─► annotations + Event on ConfigMap baton-system/baton-mesh-trust,
//!              `identity_rotation_phase` and `identity_reissue_pending` metrics
//! ```
//!
//! Pure heart: [`TrustState`], [`Progress::merge`], [`Phase::of`] and
//! [`spread`] take values and return values; [`run`] is the leader's thin
//! loop around them.
//!
//! Why the sidecars' own reports and not the identity ledger: each replica
//! issues on its own, so a ledger is one replica's view, and an issued
//! certificate is not one the sidecar holds (its context may refuse it). A
//! sidecar's config stream is with exactly one replica, authenticated by its
//! Pod's token, and the tally already adds the replicas' counts up for
//! Route status.

use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference};
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use kube::{Api, Client};
use tokio::sync::watch;

use super::metrics::IdentityMetrics;

/// What certificates are issued under now, from the CA material alone (so
/// every replica derives the same from the same Secret).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TrustState {
    /// Digest of the issuing chain and the trust bundle: changes with
    /// either, and only with them.
    pub generation: String,
    /// Roots in the trust bundle.
    pub roots: usize,
    /// Subject of the bundle root the issuer chains to.
    pub issuer_root: String,
    /// With several roots: the issuer chains to the newest of them (by
    /// `notBefore`): a rotation has switched issuance to its new root.
    pub issuer_root_is_newest: bool,
}

/// One replica's count of the sidecars on its config streams that report
/// the certificate they hold (each sidecar has one stream, so the counts of
/// the replicas add up).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Count {
    /// The generation the replica pushes (its CA material's).
    pub generation: String,
    /// Sidecars that reported a certificate.
    pub sidecars: usize,
    /// Of those, the ones holding one of `generation`.
    pub current: usize,
}

/// The fleet's progress towards one generation.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Progress {
    pub generation: String,
    pub sidecars: usize,
    pub current: usize,
    /// Replicas that push another generation (they have not re-read the
    /// Secret yet): their sidecars cannot be counted for this one.
    pub waiting: Vec<String>,
}

impl Progress {
    /// This replica's `own` count plus its `peers'` (replica name, count;
    /// `None` for a peer that reports no count: no trust state yet).
    pub fn merge(own: &Count, peers: &[(String, Option<Count>)]) -> Progress {
        let mut p = Progress {
            generation: own.generation.clone(),
            sidecars: own.sidecars,
            current: own.current,
            waiting: Vec::new(),
        };
        for (replica, count) in peers {
            match count {
                Some(c) if c.generation == own.generation => {
                    p.sidecars += c.sidecars;
                    p.current += c.current;
                }
                _ => p.waiting.push(replica.clone()),
            }
        }
        p
    }

    /// Sidecars still holding a certificate of an earlier generation.
    pub fn pending(&self) -> usize {
        self.sidecars.saturating_sub(self.current)
    }

    /// Every replica pushes this generation and every reporting sidecar
    /// holds a certificate of it.
    pub fn converged(&self) -> bool {
        self.waiting.is_empty() && self.pending() == 0
    }
}

/// Where a root rotation (docs/tls.md, "Root rotation runbook") stands, as
/// the observed state says: the CA Secret's roots and issuer, and whether
/// every sidecar holds a certificate of the current generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// One root; every sidecar holds a certificate of it. Nothing to do.
    Stable,
    /// One root, sidecars still re-issuing (an old root was just dropped,
    /// or the issuer changed without a second root).
    Reissuing,
    /// Step 1 done, step 2 under way: several roots, the issuer is still
    /// the older root; sidecars are taking the bundle with the new root.
    TrustingNewRoot,
    /// Step 2 done: every sidecar trusts the new root. Next: issue from it.
    NewRootTrusted,
    /// Step 3 done, step 4 under way: the issuer chains to the newest root;
    /// sidecars are taking certificates from it.
    IssuingFromNewRoot,
    /// Step 4 done: every sidecar holds a certificate of the new root.
    /// Next: drop the old root.
    OldRootRemovable,
}

impl Phase {
    pub const ALL: [Phase; 6] = [
        Phase::Stable,
        Phase::Reissuing,
        Phase::TrustingNewRoot,
        Phase::NewRootTrusted,
        Phase::IssuingFromNewRoot,
        Phase::OldRootRemovable,
    ];

    /// The phase of `trust` with the fleet `converged` or not. Pure.
    pub fn of(trust: &TrustState, converged: bool) -> Phase {
        match (trust.roots > 1, trust.issuer_root_is_newest, converged) {
            (false, _, true) => Phase::Stable,
            (false, _, false) => Phase::Reissuing,
            (true, false, false) => Phase::TrustingNewRoot,
            (true, false, true) => Phase::NewRootTrusted,
            (true, true, false) => Phase::IssuingFromNewRoot,
            (true, true, true) => Phase::OldRootRemovable,
        }
    }

    /// The Event reason (and metric label).
    pub fn reason(self) -> &'static str {
        match self {
            Phase::Stable => "TrustStable",
            Phase::Reissuing => "Reissuing",
            Phase::TrustingNewRoot => "TrustingNewRoot",
            Phase::NewRootTrusted => "NewRootTrusted",
            Phase::IssuingFromNewRoot => "IssuingFromNewRoot",
            Phase::OldRootRemovable => "OldRootRemovable",
        }
    }

    /// The sentence `kubectl describe secret` shows.
    pub fn message(self, trust: &TrustState, p: &Progress) -> String {
        let held = format!(
            "{}/{} sidecars hold a certificate of trust generation {}",
            p.current, p.sidecars, p.generation
        );
        let waiting = if p.waiting.is_empty() {
            String::new()
        } else {
            format!(
                "; waiting for operator replica(s) {} to re-read the CA Secret",
                p.waiting.join(", ")
            )
        };
        let roots = trust.roots;
        let issuer = &trust.issuer_root;
        match self {
            Phase::Stable => format!("{held}; one root ({issuer}): no rotation in progress"),
            Phase::Reissuing => format!("{held}{waiting}; one root ({issuer})"),
            Phase::TrustingNewRoot => {
                format!("{held}{waiting}; {roots} roots trusted, issuing from the older ({issuer})")
            }
            Phase::NewRootTrusted => format!(
                "{held}: every sidecar trusts all {roots} roots; next step: issue from the new root"
            ),
            Phase::IssuingFromNewRoot => {
                format!("{held}{waiting}; issuing from the newest root ({issuer})")
            }
            Phase::OldRootRemovable => format!(
                "{held}: every sidecar holds a certificate of the new root ({issuer}); next step: drop the old root(s) from ca.crt"
            ),
        }
    }
}

/// The window one replica's sidecars spread their re-issue requests over:
/// long enough that `sidecars` requests arrive at about `rate_per_second`,
/// never under [`MIN_SPREAD`] nor over [`MAX_SPREAD`]. Pure.
pub fn spread(sidecars: usize, rate_per_second: u32) -> Duration {
    let rate = f64::from(rate_per_second.max(1));
    Duration::from_secs_f64(sidecars as f64 / rate).clamp(MIN_SPREAD, MAX_SPREAD)
}

/// Shortest spread: a handful of sidecars still do not ask in the same
/// millisecond.
pub const MIN_SPREAD: Duration = Duration::from_secs(1);
/// Longest spread: past this the fleet asks faster than the rate (the CA's
/// re-issue bucket then answers 429 and the sidecars back off).
pub const MAX_SPREAD: Duration = Duration::from_secs(300);

/// The annotations the leader keeps on the operator namespace's trust
/// ConfigMap (`kubectl describe configmap baton-mesh-trust -n
/// baton-system` shows them with the phase Events). Pure.
pub fn annotations(phase: Phase, generation: &str, note: &str) -> [(&'static str, String); 3] {
    use baton_crds::contract::identity as names;
    [
        (names::TRUST_PHASE_ANNOTATION, phase.reason().to_owned()),
        (names::TRUST_GENERATION_ANNOTATION, generation.to_owned()),
        (names::TRUST_PROGRESS_ANNOTATION, note.to_owned()),
    ]
}

/// Field manager of the annotations (the trust publisher owns the data).
const MANAGER: &str = "baton-operator-rotation";

/// Leader: every `period`, merges this replica's count with the peers'
/// (`counts`), derives the phase, and when the phase or its sentence
/// changes writes the annotations, records an Event (on a change of phase
/// or generation) and sets the metrics. Runs until dropped.
pub async fn run<F, Fut>(
    client: Client,
    namespace: String,
    instance: String,
    mut trust: watch::Receiver<Option<TrustState>>,
    metrics: IdentityMetrics,
    period: Duration,
    counts: F,
) where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Option<Progress>>,
{
    use baton_crds::contract::identity as names;
    let recorder = crate::events::recorder(client.clone(), Some(instance));
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let params = PatchParams::apply(MANAGER).force();
    let mut reference = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("ConfigMap".into()),
        name: Some(names::TRUST_CONFIG_MAP.into()),
        namespace: Some(namespace.clone()),
        ..Default::default()
    };
    // (phase, generation) of the last Event, and the last sentence written.
    let mut evented: Option<(Phase, String)> = None;
    let mut written: Option<String> = None;
    let mut tick = tokio::time::interval(period);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            changed = trust.changed() => if changed.is_err() { return },
        }
        let Some(state) = trust.borrow().clone() else {
            continue;
        };
        let Some(progress) = counts().await else {
            continue;
        };
        if progress.generation != state.generation {
            // This replica's hub has not taken its newest material yet.
            continue;
        }
        let phase = Phase::of(&state, progress.converged());
        metrics.set_rotation(phase, progress.pending());
        let note = phase.message(&state, &progress);
        if written.as_deref() != Some(note.as_str()) {
            let patch = serde_json::json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {
                    "name": names::TRUST_CONFIG_MAP,
                    "namespace": namespace,
                    "annotations": annotations(phase, &state.generation, &note)
                        .into_iter()
                        .collect::<std::collections::BTreeMap<_, _>>(),
                },
            });
            match api
                .patch(names::TRUST_CONFIG_MAP, &params, &Patch::Apply(&patch))
                .await
            {
                Ok(cm) => {
                    written = Some(note.clone());
                    reference.uid = cm.metadata.uid;
                }
                Err(error) => {
                    tracing::warn!(%error, "trust phase annotations not written; retrying");
                    continue;
                }
            }
        }
        if evented.as_ref() == Some(&(phase, state.generation.clone())) {
            continue;
        }
        tracing::info!(phase = phase.reason(), %note, "mesh trust phase");
        let event = Event {
            type_: EventType::Normal,
            reason: phase.reason().into(),
            note: Some(note),
            action: "Rotate".into(),
            secondary: None,
        };
        match crate::events::publish(&recorder, &event, &reference).await {
            Ok(()) => evented = Some((phase, state.generation.clone())),
            Err(error) => tracing::warn!(%error, "trust phase Event not recorded; retrying"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trust(roots: usize, newest: bool) -> TrustState {
        TrustState {
            generation: "g2".into(),
            roots,
            issuer_root: "CN=root".into(),
            issuer_root_is_newest: newest,
        }
    }

    fn count(generation: &str, sidecars: usize, current: usize) -> Count {
        Count {
            generation: generation.into(),
            sidecars,
            current,
        }
    }

    #[test]
    fn the_runbook_s_steps_read_as_phases_in_order() {
        // Step 1 applied: two roots, still issuing from the old one.
        assert_eq!(Phase::of(&trust(2, false), false), Phase::TrustingNewRoot);
        // Step 2 observed: everyone re-issued.
        assert_eq!(Phase::of(&trust(2, false), true), Phase::NewRootTrusted);
        // Step 3 applied: issuing from the newest root.
        assert_eq!(Phase::of(&trust(2, true), false), Phase::IssuingFromNewRoot);
        // Step 4 observed.
        assert_eq!(Phase::of(&trust(2, true), true), Phase::OldRootRemovable);
        // Step 5 applied: one root left, sidecars take the smaller bundle.
        assert_eq!(Phase::of(&trust(1, false), false), Phase::Reissuing);
        assert_eq!(Phase::of(&trust(1, false), true), Phase::Stable);
    }

    #[test]
    fn progress_adds_up_the_replicas_on_the_same_generation() {
        let p = Progress::merge(&count("g2", 3, 1), &[("b".into(), Some(count("g2", 4, 4)))]);
        assert_eq!((p.sidecars, p.current, p.pending()), (7, 5, 2));
        assert!(!p.converged());
        let p = Progress::merge(&count("g2", 3, 3), &[("b".into(), Some(count("g2", 4, 4)))]);
        assert!(p.converged());
    }

    #[test]
    fn a_replica_on_another_generation_keeps_the_phase_from_advancing() {
        for peer in [Some(count("g1", 4, 4)), None] {
            let p = Progress::merge(&count("g2", 3, 3), &[("b".into(), peer.clone())]);
            assert_eq!(p.waiting, ["b"], "{peer:?}");
            assert_eq!(p.sidecars, 3, "its sidecars are not counted");
            assert!(!p.converged());
        }
    }

    #[test]
    fn a_fleet_without_reports_is_converged() {
        // No sidecar reports (none meshed yet, or all from before the
        // trigger): nothing holds an old generation.
        assert!(Progress::merge(&count("g", 0, 0), &[]).converged());
    }

    #[test]
    fn the_spread_keeps_the_fleet_near_the_rate_within_its_bounds() {
        assert_eq!(spread(5_000, 100), Duration::from_secs(50));
        assert_eq!(spread(10_000, 100), Duration::from_secs(100));
        assert_eq!(spread(10, 100), MIN_SPREAD);
        assert_eq!(spread(1_000_000, 100), MAX_SPREAD);
        assert_eq!(
            spread(100, 0),
            Duration::from_secs(100),
            "a rate of 0 reads as 1"
        );
    }

    #[test]
    fn every_phase_names_its_progress_and_its_next_step() {
        let p = Progress {
            generation: "g2".into(),
            sidecars: 10,
            current: 4,
            waiting: vec!["op-b".into()],
        };
        for phase in Phase::ALL {
            let m = phase.message(&trust(2, true), &p);
            assert!(m.starts_with("4/10 sidecars hold"), "{phase:?}: {m}");
        }
        assert!(
            Phase::NewRootTrusted
                .message(&trust(2, false), &p)
                .contains("next step: issue from the new root")
        );
        assert!(
            Phase::OldRootRemovable
                .message(&trust(2, true), &p)
                .contains("next step: drop the old root")
        );
        assert!(
            Phase::TrustingNewRoot
                .message(&trust(2, false), &p)
                .contains("waiting for operator replica(s) op-b")
        );
    }
}
