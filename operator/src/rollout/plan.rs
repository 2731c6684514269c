//! The rollout planner: a pure function from (release, the pods it selects,
//! what each pod's sidecar says about its handoff, now) to the actions that
//! move pods towards `spec.version`, and a summary for status.
//!
//! ```text
//!            out of date, budget left          handoff complete, old slot idle
//!  Settled ───────────────────────────► Upgrading ─────────────────────────► Settled
//!  (active slot runs some version,      (standby slot runs the target,       (active = the slot
//!   standby slot idle)                   annotation baton.dev/upgrade)         that took over)
//!      │ no standby slot / Recreate /          │ crash loop, image pull error,
//!      │ native sidecar on an old kubelet /    │ timeout with the old still serving
//!      │ Required offload device in slot a     │
//!      ▼                                       ▼
//!    Evict (Eviction API: PDBs)            Fail: standby back to the idle image,
//!                                          annotation baton.dev/upgrade-failed
//! ```
//!
//! Everything the planner needs to resume lives on the pods (the
//! `baton.dev/upgrade` annotation is written in the same patch as the
//! standby slot's image), so a new leader reaches the same decisions as the
//! old one: a pod mid-upgrade is never started twice, and a pod whose
//! handoff completed is always finished (old slot back to idle) before
//! anything else happens to it.

use std::collections::{BTreeMap, BTreeSet};

use baton_crds::SidecarRelease;
use baton_crds::selector;
use baton_crds::sidecar_release::{UpgradeStrategy, resolve_max_unavailable};
use serde::{Deserialize, Serialize};

/// Container waiting reasons that mean the new sidecar will not come up.
pub const FAILED_WAITING_REASONS: &[&str] = &[
    "CrashLoopBackOff",
    "ErrImagePull",
    "ImagePullBackOff",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "InvalidImageName",
];

/// First kubelet minor that restarts a native sidecar (an init container
/// with `restartPolicy: Always`) when its image changes (the contract's
/// `kubernetes` module says why). Older kubelets accept the new image in the
/// spec and keep running the old container, so an in-place swap would never
/// start; those pods are evicted. The webhook injects native sidecars only
/// from the same version, so this is met unless a node's kubelet is older
/// than the API server.
pub const NATIVE_IMAGE_UPDATE_SINCE: (u32, u32) =
    baton_crds::contract::kubernetes::NATIVE_SIDECAR_IMAGE_UPDATE_SINCE;

/// One of the two sidecar slots the webhook injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Slot {
    #[serde(rename = "a")]
    A,
    #[serde(rename = "b")]
    B,
}

impl Slot {
    pub fn other(self) -> Slot {
        match self {
            Slot::A => Slot::B,
            Slot::B => Slot::A,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Slot::A => "a",
            Slot::B => "b",
        }
    }

    pub fn parse(s: &str) -> Option<Slot> {
        match s {
            "a" => Some(Slot::A),
            "b" => Some(Slot::B),
            _ => None,
        }
    }
}

/// What the kubelet reports about one slot's container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotState {
    /// Image in the pod spec.
    pub image: String,
    /// Image of the container the kubelet runs (status), if it reported one.
    /// Informative only: containerd reports the *first tag* of the running
    /// image's ID, so two tags of one image (`:v1` and `:v2` built from the
    /// same bits) look alike. Progress is judged by `running_since` and the
    /// sidecar's own report, never by this name (OpenKruise's trap).
    pub running_image: Option<String>,
    /// When the running container started (`state.running.startedAt`, unix
    /// seconds), if the kubelet reported it.
    pub running_since: Option<i64>,
    pub running: bool,
    pub ready: bool,
    /// `state.waiting.reason`.
    pub waiting_reason: Option<String>,
    /// Exit code when the container's current state is terminated.
    pub terminated_exit_code: Option<i32>,
    /// `restartCount`: each image swap restarts the container once.
    pub restarts: i32,
}

/// The `baton.dev/upgrade` annotation: a hot upgrade under way.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UpgradeRecord {
    /// Version the standby slot was started with.
    pub version: String,
    pub image: String,
    /// The slot that was idle and now runs `image`.
    pub slot: Slot,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_version: Option<String>,
    /// Unix seconds when the operator patched the slot.
    pub started_at: i64,
    /// The slot's image before: what it returns to (the new slot on
    /// failure, the old one on success), whatever the release says by then.
    pub idle_image: String,
}

/// The `baton.dev/last-handoff` annotation: a completed hot upgrade.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HandoffRecord {
    pub version: String,
    /// The slot that took over (serving now).
    pub slot: Slot,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_version: Option<String>,
    /// Unix seconds: the operator started the new slot / saw it serving.
    pub started_at: i64,
    pub finished_at: i64,
    pub duration_ms: u64,
    /// `restartCount` of the retired slot when the operator swapped it back
    /// to its idle image. The idle image clears the retired process's marker
    /// when it starts; until that slot has restarted past this count it may
    /// still run the retired process (with its marker), and a sidecar
    /// started there would idle instead of taking over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retired_restarts: Option<i32>,
}

/// The `baton.dev/upgrade-failed` annotation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FailureRecord {
    pub version: String,
    pub reason: String,
    /// Unix seconds.
    pub at: i64,
}

/// What the serving sidecar of a pod answers on `GET /handoff`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// Slot of the process that answered (the one holding the admin socket,
    /// i.e. the one serving).
    pub slot: Option<Slot>,
    /// Its lifecycle phase (`serving`, `adopting`, `handing_off`, ...).
    pub phase: String,
    /// Whether it became the serving process through a completed handoff.
    pub complete: bool,
    /// That handoff's duration, as the sidecar measured it.
    pub duration_ms: Option<u64>,
    /// Slots whose handed-off process idles (left a retired marker).
    pub retired: Vec<Slot>,
}

/// Everything the planner needs to know about one pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodState {
    /// `namespace/name`: the identity in actions and the stable order.
    pub key: String,
    /// `metadata.uid`: tells a pod from its same-named replacement.
    pub uid: String,
    pub labels: BTreeMap<String, String>,
    /// `baton.dev/version`.
    pub version: Option<String>,
    /// `baton.dev/active-slot` (default `a`).
    pub active: Option<Slot>,
    pub slot_a: Option<SlotState>,
    pub slot_b: Option<SlotState>,
    /// The slots are init containers with `restartPolicy: Always`.
    pub native: bool,
    /// `major.minor` of the node's kubelet, when the pod is scheduled.
    pub kubelet: Option<(u32, u32)>,
    pub terminating: bool,
    /// Owned by a controller that recreates it after an eviction.
    pub has_controller: bool,
    /// The webhook granted the pod accelerator devices (`baton.dev/offload:
    /// qat`), its TlsPolicy makes offload `Required`, and only slot a's
    /// container requests them: a pod injected before both slots carried
    /// the device (docs/decisions/0036). The devices belong to slot a's
    /// container for the pod's life, so a sidecar started in slot b has
    /// none and refuses to take over (docs/upgrade.md, A2). Pods injected
    /// since have the device in both slots and move in place either way.
    pub required_device_only_in_slot_a: bool,
    /// `baton.dev/upgrade`, or why it does not parse.
    pub upgrade: Option<Result<UpgradeRecord, String>>,
    pub failure: Option<FailureRecord>,
    /// `baton.dev/last-handoff`, when it parses.
    pub last_handoff: Option<HandoffRecord>,
    /// `GET /handoff`, probed only while an upgrade is under way.
    pub observed: Option<Observed>,
}

impl PodState {
    fn slot(&self, s: Slot) -> Option<&SlotState> {
        match s {
            Slot::A => self.slot_a.as_ref(),
            Slot::B => self.slot_b.as_ref(),
        }
    }

    fn active_slot(&self) -> Slot {
        self.active.unwrap_or(Slot::A)
    }

    /// The slot the last hot upgrade retired has not yet restarted into its
    /// idle image: its container has not restarted since the operator
    /// swapped its image back, or is not running. A release patched right
    /// after a rollout completed started the next version there while the
    /// kubelet had not run the idle image yet, so the retired process's
    /// marker was still on the shared volume and the new sidecar idled
    /// ("this slot handed off already"): the handoff failed after 30 s
    /// (1 of 5 runs of the accelerator upgrade test).
    fn retired_slot_settling(&self) -> bool {
        let Some(h) = &self.last_handoff else {
            return false;
        };
        let (Some(n), true) = (h.retired_restarts, self.active_slot() == h.slot) else {
            return false;
        };
        self.slot(h.slot.other())
            .is_some_and(|s| !s.running || s.restarts <= n)
    }

    /// The serving sidecar's container is ready.
    pub fn ready(&self) -> bool {
        self.slot(self.active_slot()).is_some_and(|s| s.ready)
    }
}

/// Why a pod is moved by eviction rather than in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictReason {
    /// `upgrade.strategy: Recreate`.
    Recreate,
    /// Injected without a standby slot (no `emptyImage` at the time).
    NoStandbySlot,
    /// Native sidecars on a kubelet that ignores image updates of them.
    NativeSidecarImageUpdateUnsupported,
    /// Required offload with devices in slot a only (a pod injected before
    /// both slots carried them), and the standby slot is b: in place, the
    /// new sidecar would have no device and refuse to take over; a
    /// recreated pod is granted devices again at admission, in both slots.
    OffloadDeviceInActiveSlot,
}

impl EvictReason {
    pub fn message(self) -> &'static str {
        match self {
            Self::Recreate => "upgrade.strategy is Recreate",
            Self::NoStandbySlot => "the pod has no standby slot",
            Self::NativeSidecarImageUpdateUnsupported => {
                "native sidecars on this kubelet (< 1.32) ignore image updates"
            }
            Self::OffloadDeviceInActiveSlot => {
                "its TlsPolicy requires private-key offload and the accelerator devices belong to slot a, which a sidecar in slot b cannot use"
            }
        }
    }
}

/// What the controller should do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Patch the idle `slot` to `record.image` and write `record` as the
    /// `baton.dev/upgrade` annotation, in one patch.
    Start {
        pod: String,
        native: bool,
        record: UpgradeRecord,
    },
    /// The process in `record.slot` took over and the old one idles: put
    /// the old slot to `record.idle_image`, record the new active slot and
    /// version, drop `baton.dev/upgrade`.
    Finish {
        pod: String,
        native: bool,
        record: UpgradeRecord,
        /// Handoff duration as the sidecar measured it, else as observed.
        duration_ms: u64,
        /// The retired slot's `restartCount` now (see [`HandoffRecord`]).
        retired_restarts: Option<i32>,
    },
    /// The upgrade failed: put `record.slot` back to `record.idle_image`
    /// (the old process never stopped serving), drop `baton.dev/upgrade`,
    /// write `baton.dev/upgrade-failed`.
    Fail {
        pod: String,
        native: bool,
        record: UpgradeRecord,
        reason: String,
    },
    /// Evict through the Eviction API (PodDisruptionBudgets apply); the
    /// pod's controller recreates it and the webhook injects `spec.version`.
    Evict { pod: String, reason: EvictReason },
}

impl Action {
    pub fn pod(&self) -> &str {
        match self {
            Action::Start { pod, .. }
            | Action::Finish { pod, .. }
            | Action::Fail { pod, .. }
            | Action::Evict { pod, .. } => pod,
        }
    }

    pub fn metric_label(&self) -> &'static str {
        match self {
            Action::Start { .. } => "start",
            Action::Finish { .. } => "finish",
            Action::Fail { .. } => "fail",
            Action::Evict { .. } => "evict",
        }
    }
}

/// Why the rollout moves no further pods right now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pause {
    /// `spec.upgrade.paused`.
    User,
    /// More pods failed than `failureThreshold` allows.
    FailureThreshold { failed: usize, threshold: i32 },
}

/// The plan and what status should say about it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub actions: Vec<Action>,
    /// Selected pods.
    pub total: usize,
    /// Pods whose serving sidecar is `spec.version`/`spec.image` (counting
    /// the ones this plan finishes).
    pub updated: usize,
    /// Pods mid-upgrade after this plan (started, not finished or failed),
    /// plus pods terminating.
    pub in_flight: usize,
    /// Pods whose upgrade to `spec.version` failed (after this plan), with
    /// the reason, by name.
    pub failed: Vec<(String, String)>,
    /// Out-of-date pods the partition keeps.
    pub held_by_partition: usize,
    /// Out-of-date pods outside the canary selector.
    pub held_by_canary: usize,
    /// Pods that need something the planner will not do, and why.
    pub blocked: Vec<(String, String)>,
    pub pause: Option<Pause>,
    /// The plan waits on pods (handoffs under way): look again soon, since
    /// a handoff's completion is not a Kubernetes event.
    pub waiting: bool,
    /// Handoffs interrupted by their pod's deletion, newest first, as the
    /// controller's [`InFlightMemory`] recalls them (the status lists those
    /// of the current version).
    pub interrupted: Vec<Interrupted>,
}

/// Computes the plan. Pure: same inputs, same plan.
pub fn plan(release: &SidecarRelease, pods: &[PodState], now: i64) -> Plan {
    let spec = &release.spec;
    let up = &spec.upgrade;
    let mut out = Plan {
        total: pods.len(),
        ..Plan::default()
    };
    let mut sorted: Vec<&PodState> = pods.iter().collect();
    // The stable order: by namespace/name. Deterministic across leaders, and
    // users can predict (and with the canary selector, choose) who goes first.
    sorted.sort_by(|a, b| a.key.cmp(&b.key));

    let total = i32::try_from(pods.len()).unwrap_or(i32::MAX);
    let max_unavailable = resolve_max_unavailable(&up.max_unavailable, total).unwrap_or(1);
    let up_to_date = |p: &PodState| -> bool {
        p.version.as_deref() == Some(spec.version.as_str())
            && p.slot(p.active_slot())
                .is_none_or(|s| s.image == spec.image)
    };

    let mut unavailable = 0usize;
    let mut waiting_to_target = 0usize;
    let mut candidates: Vec<&PodState> = Vec::new();
    for pod in &sorted {
        if pod.terminating {
            out.in_flight += 1;
            unavailable += 1;
            if up_to_date(pod) {
                out.updated += 1;
            }
            continue;
        }
        match &pod.upgrade {
            Some(Ok(record)) => {
                let step = in_flight_step(pod, record, up.handoff_timeout_seconds, now);
                match step {
                    Step::Finish { duration_ms } => {
                        // Available again only once the patch has landed.
                        unavailable += 1;
                        let finished_version =
                            record.version == spec.version && record.image == spec.image;
                        if finished_version {
                            out.updated += 1;
                        }
                        out.actions.push(Action::Finish {
                            pod: pod.key.clone(),
                            native: pod.native,
                            record: record.clone(),
                            duration_ms,
                            retired_restarts: pod.slot(record.slot.other()).map(|s| s.restarts),
                        });
                    }
                    Step::Fail(reason) => {
                        unavailable += 1;
                        if record.version == spec.version {
                            out.failed.push((pod.key.clone(), reason.clone()));
                        }
                        out.actions.push(Action::Fail {
                            pod: pod.key.clone(),
                            native: pod.native,
                            record: record.clone(),
                            reason,
                        });
                    }
                    Step::Wait => {
                        if record.version == spec.version && record.image == spec.image {
                            waiting_to_target += 1;
                        }
                        out.in_flight += 1;
                        unavailable += 1;
                        out.waiting = true;
                    }
                }
                continue;
            }
            Some(Err(why)) => {
                out.blocked.push((
                    pod.key.clone(),
                    format!("annotation baton.dev/upgrade does not parse ({why}); remove it to let the rollout continue"),
                ));
                continue;
            }
            None => {}
        }
        if up_to_date(pod) {
            out.updated += 1;
            if !pod.ready() {
                unavailable += 1;
            }
            continue;
        }
        if !pod.ready() {
            unavailable += 1;
        }
        if let Some(f) = &pod.failure
            && f.version == spec.version
        {
            out.failed.push((pod.key.clone(), f.reason.clone()));
            continue;
        }
        if pod.retired_slot_settling() {
            // Its next move goes into that slot: look again once the
            // kubelet has restarted it into the idle image.
            out.waiting = true;
            continue;
        }
        candidates.push(pod);
    }

    let failed_count = out.failed.len();
    if up.paused {
        out.pause = Some(Pause::User);
    } else if failed_count > usize::try_from(up.failure_threshold.max(0)).unwrap_or(0) {
        out.pause = Some(Pause::FailureThreshold {
            failed: failed_count,
            threshold: up.failure_threshold,
        });
    }

    // Partition: at most `total - partition` pods on the new version,
    // counting those on their way there.
    let allowed = usize::try_from((total - up.partition.max(0)).max(0)).unwrap_or(0);
    let on_target = out.updated + waiting_to_target;
    let mut partition_left = allowed.saturating_sub(on_target);
    let mut budget = usize::try_from(max_unavailable)
        .unwrap_or(1)
        .saturating_sub(unavailable);

    for pod in candidates {
        if !selector::matches_opt(up.canary_selector.as_ref(), &pod.labels) {
            out.held_by_canary += 1;
            continue;
        }
        if partition_left == 0 {
            out.held_by_partition += 1;
            continue;
        }
        let how = match how_to_move(pod, up.strategy, spec.empty_image.as_deref()) {
            Ok(how) => how,
            Err(why) => {
                out.blocked.push((pod.key.clone(), why));
                continue;
            }
        };
        if out.pause.is_some() || budget == 0 {
            // Counted as "to do": status says RollingOut/Paused.
            continue;
        }
        partition_left -= 1;
        budget -= 1;
        out.in_flight += 1;
        match how {
            Move::InPlace { slot, idle_image } => {
                out.waiting = true;
                out.actions.push(Action::Start {
                    pod: pod.key.clone(),
                    native: pod.native,
                    record: UpgradeRecord {
                        version: spec.version.clone(),
                        image: spec.image.clone(),
                        slot,
                        from_version: pod.version.clone(),
                        started_at: now,
                        idle_image: idle_image.clone(),
                    },
                });
            }
            Move::Evict(reason) => {
                if !pod.has_controller {
                    // Undo the budget: nothing happens to this pod.
                    partition_left += 1;
                    budget += 1;
                    out.in_flight -= 1;
                    out.blocked.push((
                        pod.key.clone(),
                        format!(
                            "{}, and no controller would recreate the pod after an eviction: delete it yourself",
                            reason.message()
                        ),
                    ));
                    continue;
                }
                out.actions.push(Action::Evict {
                    pod: pod.key.clone(),
                    reason,
                });
            }
        }
    }
    out
}

/// How far the node's clock may lag the operator's when comparing a
/// container's start with the moment the operator patched its image.
const CLOCK_SKEW_S: i64 = 5;

enum Step {
    Finish { duration_ms: u64 },
    Fail(String),
    Wait,
}

/// Where an upgrade under way stands.
fn in_flight_step(pod: &PodState, record: &UpgradeRecord, timeout_s: i32, now: i64) -> Step {
    let old = record.slot.other();
    let elapsed_s = now.saturating_sub(record.started_at);
    let timed_out = elapsed_s >= i64::from(timeout_s.max(1));
    let Some(new) = pod.slot(record.slot) else {
        return Step::Fail(format!(
            "the pod has no container for slot {}",
            record.slot.as_str()
        ));
    };
    if new.image != record.image {
        return Step::Fail(format!(
            "slot {} runs image {} instead of {} (changed outside Baton)",
            record.slot.as_str(),
            new.image,
            record.image
        ));
    }
    let observed = pod.observed.as_ref();
    let took_over = observed
        .is_some_and(|o| o.slot == Some(record.slot) && o.complete && o.phase == "serving")
        && new.running
        // The container the kubelet runs in the slot must have started after
        // the patch (with slack for clock skew between the operator and the
        // node): the idle process it replaced cannot answer for the slot.
        && new
            .running_since
            .is_none_or(|t| t >= record.started_at - CLOCK_SKEW_S);
    if took_over {
        let old_idle = observed.is_some_and(|o| o.retired.contains(&old));
        // The old process finishes its drain (HTTP/2 streams, requests past
        // the park timeout) before it idles; swapping its image earlier
        // would cut those. A build that never reports idling is finished
        // once the timeout has passed.
        if old_idle || timed_out {
            let duration_ms = observed
                .and_then(|o| o.duration_ms)
                .unwrap_or_else(|| u64::try_from(elapsed_s.max(0)).unwrap_or(0) * 1000);
            return Step::Finish { duration_ms };
        }
        return Step::Wait;
    }
    if let Some(reason) = new
        .waiting_reason
        .as_deref()
        .filter(|r| FAILED_WAITING_REASONS.contains(r))
    {
        return Step::Fail(format!(
            "the new sidecar in slot {} is {reason}",
            record.slot.as_str()
        ));
    }
    if let Some(code) = new.terminated_exit_code.filter(|c| *c != 0) {
        return Step::Fail(format!(
            "the new sidecar in slot {} exited with status {code}",
            record.slot.as_str()
        ));
    }
    if timed_out {
        // Never cut a handoff that is moving connections: the new process
        // acknowledged some already, and killing it would lose them (G9).
        // The sidecars' own step timeout ends a stalled one.
        let moving = observed.is_some_and(|o| o.phase == "adopting" || o.phase == "handing_off");
        // A build that does not say its slot may be the one that took over:
        // returning "its" slot to idle could stop the serving process.
        let unknown_taker = observed.is_some_and(|o| o.complete && o.slot.is_none());
        if moving || unknown_taker {
            return Step::Wait;
        }
        return Step::Fail(format!(
            "no completed handoff to slot {} within {timeout_s} s{}",
            record.slot.as_str(),
            match observed {
                None => " (the pod's admin port did not answer)".to_owned(),
                Some(o) => format!(
                    " (slot {} still serves, phase {})",
                    o.slot.map(Slot::as_str).unwrap_or("?"),
                    o.phase
                ),
            }
        ));
    }
    Step::Wait
}

/// A handoff that was under way when its pod was deleted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interrupted {
    pub pod: String,
    pub record: UpgradeRecord,
    /// The pod is gone (else it is terminating).
    pub gone: bool,
}

impl Interrupted {
    /// What status and the Events say about it.
    pub fn message(&self) -> String {
        format!(
            "deleted while its handoff to {} (slot {}) was in flight{}; the rollout continues without it, and a replacement its controller creates is injected with the release's version",
            self.record.version,
            self.record.slot.as_str(),
            if self.gone { "" } else { " (terminating)" }
        )
    }
}

/// What the controller remembers between two looks at one release's pods:
/// which pods were mid-upgrade, so that a pod deleted in between is
/// noticed and reported once. The pods themselves hold everything the plan
/// needs (a deleted pod needs nothing planned); this is only for telling
/// the user. A new leader starts empty: it reports the interrupted pods it
/// still sees terminating, not the ones gone before it took over.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InFlightMemory {
    /// Pods seen mid-upgrade and alive, by key: (uid, record).
    seen: BTreeMap<String, (String, UpgradeRecord)>,
    /// Terminating pods (key, uid) already reported.
    reported: BTreeSet<(String, String)>,
    /// Every interruption reported, newest first (at most
    /// [`RECENT_INTERRUPTED`]).
    recent: Vec<Interrupted>,
}

/// How many reported interruptions [`InFlightMemory::recent`] keeps.
pub const RECENT_INTERRUPTED: usize = 16;

impl InFlightMemory {
    /// Takes the pods as listed now and returns the handoffs interrupted
    /// since the previous call (each reported once). Pure.
    pub fn observe(&mut self, pods: &[PodState]) -> Vec<Interrupted> {
        let mut out = Vec::new();
        let listed: BTreeSet<(&str, &str)> = pods
            .iter()
            .map(|p| (p.key.as_str(), p.uid.as_str()))
            .collect();
        let mut seen = BTreeMap::new();
        for pod in pods {
            let Some(Ok(record)) = &pod.upgrade else {
                continue;
            };
            if pod.terminating {
                if self.reported.insert((pod.key.clone(), pod.uid.clone())) {
                    out.push(Interrupted {
                        pod: pod.key.clone(),
                        record: record.clone(),
                        gone: false,
                    });
                }
            } else {
                seen.insert(pod.key.clone(), (pod.uid.clone(), record.clone()));
            }
        }
        // Seen mid-upgrade last time, now not listed (or replaced by a
        // same-named pod): deleted before we saw it terminating.
        for (key, (uid, record)) in std::mem::take(&mut self.seen) {
            if !listed.contains(&(key.as_str(), uid.as_str())) {
                out.push(Interrupted {
                    pod: key,
                    record,
                    gone: true,
                });
            }
        }
        self.seen = seen;
        self.reported
            .retain(|(k, u)| listed.contains(&(k.as_str(), u.as_str())));
        out.sort_by(|a, b| a.pod.cmp(&b.pod));
        self.recent.splice(0..0, out.iter().cloned());
        self.recent.truncate(RECENT_INTERRUPTED);
        out
    }

    /// The interruptions reported so far, newest first. The status lists
    /// these, not only the ones its last read of the release carried: the
    /// release a reconcile reads can predate the status patch that listed
    /// an interruption (the watch has not delivered it yet), and a list
    /// rebuilt from that stale copy would silently drop the pod.
    pub fn recent(&self) -> &[Interrupted] {
        &self.recent
    }
}

enum Move {
    InPlace { slot: Slot, idle_image: String },
    Evict(EvictReason),
}

fn how_to_move(
    pod: &PodState,
    strategy: UpgradeStrategy,
    empty: Option<&str>,
) -> Result<Move, String> {
    if strategy == UpgradeStrategy::Recreate {
        return Ok(Move::Evict(EvictReason::Recreate));
    }
    let active = pod.active_slot();
    let standby = active.other();
    let Some(standby_state) = pod.slot(standby) else {
        return Ok(Move::Evict(EvictReason::NoStandbySlot));
    };
    if pod.slot(active).is_none() {
        return Err(format!(
            "baton.dev/active-slot says {} but the pod has no such container",
            active.as_str()
        ));
    }
    // A pod injected before both slots carried the device: moving into b
    // would start a sidecar without it, which under Required refuses to
    // take over (A2): every attempt would fail. Into a (a pod serving from
    // b) is fine. Pods injected since have it in both slots.
    if pod.required_device_only_in_slot_a && standby != Slot::A {
        return Ok(Move::Evict(EvictReason::OffloadDeviceInActiveSlot));
    }
    if let Some(empty) = empty
        && standby_state.image != empty
    {
        // Both slots would run a sidecar: never start a third one.
        return Err(format!(
            "standby slot {} runs {} instead of the idle image {empty}, without an upgrade under way",
            standby.as_str(),
            standby_state.image
        ));
    }
    if pod.native {
        match pod.kubelet {
            Some(v) if v >= NATIVE_IMAGE_UPDATE_SINCE => {}
            Some(_) => {
                return Ok(Move::Evict(
                    EvictReason::NativeSidecarImageUpdateUnsupported,
                ));
            }
            None => return Err("native sidecars on a node whose kubelet version is unknown".into()),
        }
    }
    Ok(Move::InPlace {
        slot: standby,
        idle_image: standby_state.image.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_crds::SidecarReleaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    const EMPTY: &str = "docker.io/baton/empty:1";
    const NOW: i64 = 1_800_000_000;

    fn image(v: &str) -> String {
        format!("docker.io/baton/sidecar:{v}")
    }

    fn release(version: &str) -> SidecarRelease {
        let spec: SidecarReleaseSpec = serde_json::from_value(serde_json::json!({
            "version": version,
            "image": image(version),
            "emptyImage": EMPTY,
        }))
        .unwrap();
        SidecarRelease::new("default", spec)
    }

    fn with(
        mut r: SidecarRelease,
        f: impl FnOnce(&mut baton_crds::sidecar_release::UpgradeSpec),
    ) -> SidecarRelease {
        f(&mut r.spec.upgrade);
        r
    }

    fn serving(img: &str) -> SlotState {
        SlotState {
            image: img.into(),
            running_image: Some(img.into()),
            running: true,
            ready: true,
            ..Default::default()
        }
    }

    fn idle() -> SlotState {
        SlotState {
            image: EMPTY.into(),
            running_image: Some(EMPTY.into()),
            running: true,
            ready: true,
            ..Default::default()
        }
    }

    /// A settled pod: `version` serving in slot a, slot b idle.
    fn pod(name: &str, version: &str) -> PodState {
        PodState {
            key: format!("shop/{name}"),
            uid: format!("uid-{name}"),
            version: Some(version.into()),
            active: Some(Slot::A),
            slot_a: Some(serving(&image(version))),
            slot_b: Some(idle()),
            has_controller: true,
            ..Default::default()
        }
    }

    /// A pod whose standby slot `slot` was started on `to` at `started_at`.
    fn upgrading(name: &str, from: &str, to: &str, slot: Slot, started_at: i64) -> PodState {
        let mut p = pod(name, from);
        p.active = Some(slot.other());
        let (old, new) = match slot {
            Slot::B => (&mut p.slot_a, &mut p.slot_b),
            Slot::A => (&mut p.slot_b, &mut p.slot_a),
        };
        *old = Some(serving(&image(from)));
        *new = Some(serving(&image(to)));
        p.upgrade = Some(Ok(UpgradeRecord {
            version: to.into(),
            image: image(to),
            slot,
            from_version: Some(from.into()),
            started_at,
            idle_image: EMPTY.into(),
        }));
        p
    }

    fn observed(slot: Slot, phase: &str, complete: bool, retired: &[Slot]) -> Option<Observed> {
        Some(Observed {
            slot: Some(slot),
            phase: phase.into(),
            complete,
            duration_ms: Some(42),
            retired: retired.to_vec(),
        })
    }

    fn starts(p: &Plan) -> Vec<(&str, Slot)> {
        p.actions
            .iter()
            .filter_map(|a| match a {
                Action::Start { pod, record, .. } => Some((pod.as_str(), record.slot)),
                _ => None,
            })
            .collect()
    }

    fn names(p: &Plan, label: &str) -> Vec<String> {
        p.actions
            .iter()
            .filter(|a| a.metric_label() == label)
            .map(|a| a.pod().to_owned())
            .collect()
    }

    #[test]
    fn an_out_of_date_pod_gets_its_standby_slot_started_on_the_target() {
        let p = plan(&release("2"), &[pod("web-0", "1")], NOW);
        assert_eq!(
            p.actions,
            vec![Action::Start {
                pod: "shop/web-0".into(),
                native: false,
                record: UpgradeRecord {
                    version: "2".into(),
                    image: image("2"),
                    slot: Slot::B,
                    from_version: Some("1".into()),
                    started_at: NOW,
                    idle_image: EMPTY.into(),
                },
            }]
        );
        assert_eq!((p.total, p.updated, p.in_flight), (1, 0, 1));
        assert!(p.waiting && p.pause.is_none());
    }

    #[test]
    fn up_to_date_pods_get_nothing_and_count_as_updated() {
        let p = plan(&release("2"), &[pod("a", "2"), pod("b", "2")], NOW);
        assert!(p.actions.is_empty());
        assert_eq!((p.total, p.updated, p.in_flight), (2, 2, 0));
        assert!(!p.waiting);
    }

    #[test]
    fn an_image_change_without_a_version_change_is_rolled_out() {
        let mut r = release("2");
        r.spec.image = "docker.io/baton/sidecar:2-patched".into();
        let p = plan(&r, &[pod("a", "2")], NOW);
        assert_eq!(starts(&p), vec![("shop/a", Slot::B)]);
    }

    #[test]
    fn the_standby_slot_is_whichever_is_not_active() {
        let mut p0 = pod("a", "1");
        p0.active = Some(Slot::B);
        p0.slot_a = Some(idle());
        p0.slot_b = Some(serving(&image("1")));
        let p = plan(&release("2"), &[p0], NOW);
        assert_eq!(starts(&p), vec![("shop/a", Slot::A)]);
    }

    #[test]
    fn max_unavailable_bounds_the_pods_started_at_once_in_the_stable_order() {
        let pods: Vec<_> = ["e", "c", "a", "d", "b"]
            .iter()
            .map(|n| pod(n, "1"))
            .collect();
        let r = with(release("2"), |u| u.max_unavailable = IntOrString::Int(2));
        let p = plan(&r, &pods, NOW);
        assert_eq!(starts(&p), vec![("shop/a", Slot::B), ("shop/b", Slot::B)]);
        assert_eq!(p.in_flight, 2);
    }

    #[test]
    fn a_percentage_max_unavailable_rounds_up() {
        let pods: Vec<_> = (0..5).map(|i| pod(&format!("p{i}"), "1")).collect();
        let r = with(release("2"), |u| {
            u.max_unavailable = IntOrString::String("25%".into())
        });
        // 25 % of 5 = 1.25 → 2.
        assert_eq!(starts(&plan(&r, &pods, NOW)).len(), 2);
    }

    #[test]
    fn pods_mid_upgrade_and_unready_pods_use_up_the_budget() {
        let r = with(release("2"), |u| u.max_unavailable = IntOrString::Int(2));
        let mut unready = pod("b", "1");
        unready.slot_a.as_mut().unwrap().ready = false;
        let pods = vec![
            upgrading("a", "1", "2", Slot::B, NOW),
            unready,
            pod("c", "1"),
            pod("d", "1"),
        ];
        let p = plan(&r, &pods, NOW);
        assert!(starts(&p).is_empty(), "{:?}", p.actions);
        assert_eq!(p.in_flight, 1);

        let pods = vec![
            upgrading("a", "1", "2", Slot::B, NOW),
            pod("c", "1"),
            pod("d", "1"),
        ];
        assert_eq!(starts(&plan(&r, &pods, NOW)), vec![("shop/c", Slot::B)]);
    }

    #[test]
    fn terminating_pods_count_as_unavailable_and_are_left_alone() {
        let mut gone = pod("a", "1");
        gone.terminating = true;
        let p = plan(&release("2"), &[gone, pod("b", "1")], NOW);
        assert!(p.actions.is_empty());
        assert_eq!(p.in_flight, 1);
    }

    #[test]
    fn the_partition_keeps_the_last_pods_of_the_stable_order() {
        let r = with(release("2"), |u| {
            u.partition = 2;
            u.max_unavailable = IntOrString::Int(10)
        });
        let pods: Vec<_> = ["a", "b", "c", "d"].iter().map(|n| pod(n, "1")).collect();
        let p = plan(&r, &pods, NOW);
        assert_eq!(starts(&p), vec![("shop/a", Slot::B), ("shop/b", Slot::B)]);
        assert_eq!(p.held_by_partition, 2);

        // Pods already on the target (or on their way) count against it.
        let pods = vec![
            pod("a", "2"),
            upgrading("b", "1", "2", Slot::B, NOW),
            pod("c", "1"),
            pod("d", "1"),
        ];
        let p = plan(&r, &pods, NOW);
        assert!(starts(&p).is_empty());
        assert_eq!(p.held_by_partition, 2);
    }

    #[test]
    fn a_paused_rollout_starts_nothing_but_finishes_what_is_under_way() {
        let r = with(release("2"), |u| u.paused = true);
        let mut done = upgrading("a", "1", "2", Slot::B, NOW - 5);
        done.observed = observed(Slot::B, "serving", true, &[Slot::A]);
        let p = plan(&r, &[done, pod("b", "1")], NOW);
        assert_eq!(names(&p, "finish"), vec!["shop/a"]);
        assert!(starts(&p).is_empty());
        assert_eq!(p.pause, Some(Pause::User));
        assert_eq!(p.updated, 1);
    }

    #[test]
    fn the_canary_selector_restricts_which_pods_move() {
        let mut canary = pod("z", "1");
        canary.labels.insert("track".into(), "canary".into());
        let r = with(release("2"), |u| {
            u.max_unavailable = IntOrString::Int(5);
            u.canary_selector = Some(LabelSelector {
                match_labels: Some([("track".to_owned(), "canary".to_owned())].into()),
                match_expressions: None,
            })
        });
        let p = plan(&r, &[pod("a", "1"), canary, pod("b", "1")], NOW);
        assert_eq!(starts(&p), vec![("shop/z", Slot::B)]);
        assert_eq!(p.held_by_canary, 2);
    }

    #[test]
    fn a_completed_handoff_with_the_old_process_idle_is_finished() {
        let mut p0 = upgrading("a", "1", "2", Slot::B, NOW - 3);
        p0.observed = observed(Slot::B, "serving", true, &[Slot::A]);
        let p = plan(&release("2"), &[p0.clone()], NOW);
        let Some(Ok(record)) = p0.upgrade.clone() else {
            unreachable!()
        };
        assert_eq!(
            p.actions,
            vec![Action::Finish {
                pod: "shop/a".into(),
                native: false,
                record,
                duration_ms: 42,
                retired_restarts: Some(0),
            }]
        );
        assert_eq!((p.updated, p.in_flight), (1, 0));
        assert!(!p.waiting);
    }

    #[test]
    fn the_next_upgrade_waits_until_the_retired_slot_restarted_into_its_idle_image() {
        // 1 moved from a to b; a was swapped back to idle at restartCount 0
        // and the kubelet still runs the retired process there.
        let mut p0 = pod("a", "2");
        p0.active = Some(Slot::B);
        p0.slot_b = Some(serving(&image("2")));
        p0.slot_a = Some(SlotState {
            image: EMPTY.into(),
            ..serving(&image("1"))
        });
        p0.last_handoff = Some(HandoffRecord {
            version: "2".into(),
            slot: Slot::B,
            from_version: Some("1".into()),
            started_at: NOW - 10,
            finished_at: NOW - 5,
            duration_ms: 8,
            retired_restarts: Some(0),
        });
        let p = plan(&release("3"), std::slice::from_ref(&p0), NOW);
        assert!(
            p.actions.is_empty() && p.waiting && p.blocked.is_empty(),
            "{p:?}"
        );

        // Restarted into the idle image: the upgrade starts in slot a.
        let mut p1 = p0.clone();
        p1.slot_a = Some(SlotState {
            restarts: 1,
            ..idle()
        });
        let p = plan(&release("3"), &[p1], NOW);
        assert!(
            matches!(&p.actions[..], [Action::Start { record, .. }] if record.slot == Slot::A),
            "{:?}",
            p.actions
        );

        // A record from before the count existed waits for nothing.
        let mut p2 = p0.clone();
        p2.last_handoff.as_mut().unwrap().retired_restarts = None;
        let p = plan(&release("3"), &[p2], NOW);
        assert_eq!(p.actions.len(), 1, "{:?}", p.actions);
    }

    #[test]
    fn a_completed_handoff_waits_for_the_old_process_to_idle_until_the_timeout() {
        let mut p0 = upgrading("a", "1", "2", Slot::B, NOW - 3);
        p0.observed = observed(Slot::B, "serving", true, &[]);
        let p = plan(&release("2"), &[p0.clone()], NOW);
        assert!(p.actions.is_empty() && p.waiting);
        assert_eq!(p.in_flight, 1);
        // Past handoffTimeoutSeconds (30) it is finished anyway.
        p0.upgrade.as_mut().unwrap().as_mut().unwrap().started_at = NOW - 30;
        assert_eq!(
            names(&plan(&release("2"), &[p0], NOW), "finish"),
            vec!["shop/a"]
        );
    }

    #[test]
    fn a_serving_answer_from_the_old_slot_or_an_unfinished_new_one_is_not_completion() {
        for obs in [
            observed(Slot::A, "serving", false, &[]),
            observed(Slot::A, "handing_off", false, &[]),
            observed(Slot::B, "adopting", false, &[]),
            // A previous handoff's completion, answered by the old slot.
            observed(Slot::A, "serving", true, &[Slot::B]),
            None,
        ] {
            let mut p0 = upgrading("a", "1", "2", Slot::B, NOW - 1);
            p0.observed = obs.clone();
            let p = plan(&release("2"), &[p0], NOW);
            assert!(p.actions.is_empty(), "{obs:?}: {:?}", p.actions);
            assert!(p.waiting);
        }
    }

    #[test]
    fn the_new_container_must_have_started_since_the_patch_to_count_as_taken_over() {
        let mut p0 = upgrading("a", "1", "2", Slot::B, NOW - 1);
        p0.observed = observed(Slot::B, "serving", true, &[Slot::A]);
        // The kubelet has not restarted the container yet (still the idle
        // one, started long before the patch).
        p0.slot_b.as_mut().unwrap().running_since = Some(NOW - 3_600);
        assert!(plan(&release("2"), &[p0], NOW).actions.is_empty());
    }

    #[test]
    fn two_tags_of_one_image_finish_although_the_kubelet_names_the_first_tag() {
        // containerd reports the first tag of the image ID: `:1` while the
        // spec says `:2`. The restart time and the sidecar's report decide.
        let mut p0 = upgrading("a", "1", "2", Slot::B, NOW - 1);
        p0.observed = observed(Slot::B, "serving", true, &[Slot::A]);
        let b = p0.slot_b.as_mut().unwrap();
        b.running_image = Some(image("1"));
        b.running_since = Some(NOW);
        let p = plan(&release("2"), &[p0], NOW);
        assert!(
            p.actions.iter().any(|a| matches!(a, Action::Finish { .. })),
            "{:?}",
            p.actions
        );
    }

    fn fail_reason(p: &Plan) -> Option<&str> {
        p.actions.iter().find_map(|a| match a {
            Action::Fail { reason, .. } => Some(reason.as_str()),
            _ => None,
        })
    }

    #[test]
    fn a_new_sidecar_that_cannot_start_fails_the_pod_at_once() {
        for reason in FAILED_WAITING_REASONS {
            let mut p0 = upgrading("a", "1", "2", Slot::B, NOW);
            let b = p0.slot_b.as_mut().unwrap();
            b.running = false;
            b.ready = false;
            b.waiting_reason = Some((*reason).into());
            p0.observed = observed(Slot::A, "serving", false, &[]);
            let p = plan(&release("2"), &[p0], NOW);
            let why = fail_reason(&p).expect("a failure");
            assert!(why.contains(reason), "{why}");
            assert_eq!(p.failed, vec![("shop/a".to_owned(), why.to_owned())]);
        }
        // ContainerCreating is just slow, not a failure.
        let mut p0 = upgrading("a", "1", "2", Slot::B, NOW);
        p0.slot_b.as_mut().unwrap().waiting_reason = Some("ContainerCreating".into());
        assert!(plan(&release("2"), &[p0], NOW).actions.is_empty());
    }

    #[test]
    fn a_new_sidecar_that_exited_non_zero_fails_the_pod() {
        let mut p0 = upgrading("a", "1", "2", Slot::B, NOW);
        let b = p0.slot_b.as_mut().unwrap();
        b.running = false;
        b.terminated_exit_code = Some(3);
        let p = plan(&release("2"), &[p0], NOW);
        assert!(fail_reason(&p).unwrap().contains("exited with status 3"));
    }

    #[test]
    fn a_timeout_with_the_old_process_still_serving_fails_the_pod() {
        let mut p0 = upgrading("a", "1", "2", Slot::B, NOW - 30);
        p0.observed = observed(Slot::A, "serving", false, &[]);
        let p = plan(&release("2"), &[p0.clone()], NOW);
        let why = fail_reason(&p).unwrap();
        assert!(
            why.contains("within 30 s") && why.contains("slot a still serves"),
            "{why}"
        );
        p0.observed = None;
        let p = plan(&release("2"), &[p0], NOW);
        assert!(fail_reason(&p).unwrap().contains("did not answer"));
    }

    #[test]
    fn a_timeout_never_cuts_a_handoff_that_is_moving_connections() {
        for phase in ["adopting", "handing_off"] {
            let mut p0 = upgrading("a", "1", "2", Slot::B, NOW - 300);
            p0.observed = observed(Slot::B, phase, false, &[]);
            let p = plan(&release("2"), &[p0], NOW);
            assert!(p.actions.is_empty() && p.waiting, "{phase}");
        }
    }

    #[test]
    fn a_completed_handoff_by_a_process_that_does_not_say_its_slot_is_never_failed() {
        let mut p0 = upgrading("a", "1", "2", Slot::B, NOW - 300);
        p0.observed = Some(Observed {
            slot: None,
            phase: "serving".into(),
            complete: true,
            duration_ms: None,
            retired: vec![],
        });
        let p = plan(&release("2"), &[p0], NOW);
        assert!(p.actions.is_empty() && p.waiting, "{:?}", p.actions);
    }

    #[test]
    fn a_slot_changed_outside_baton_fails_the_upgrade() {
        let mut p0 = upgrading("a", "1", "2", Slot::B, NOW);
        p0.slot_b.as_mut().unwrap().image = "someone/else:1".into();
        assert!(
            fail_reason(&plan(&release("2"), &[p0], NOW))
                .unwrap()
                .contains("outside Baton")
        );
    }

    #[test]
    fn failures_beyond_the_threshold_pause_the_rollout() {
        let failed = |n: &str| {
            let mut p = pod(n, "1");
            p.failure = Some(FailureRecord {
                version: "2".into(),
                reason: "the new sidecar in slot b is CrashLoopBackOff".into(),
                at: NOW,
            });
            p
        };
        let r = with(release("2"), |u| u.max_unavailable = IntOrString::Int(5));
        let p = plan(&r, &[failed("a"), pod("b", "1")], NOW);
        assert_eq!(
            p.pause,
            Some(Pause::FailureThreshold {
                failed: 1,
                threshold: 0
            })
        );
        assert!(p.actions.is_empty());
        assert_eq!(p.failed.len(), 1);

        let r = with(r, |u| u.failure_threshold = 1);
        let p = plan(&r, &[failed("a"), pod("b", "1")], NOW);
        assert_eq!(p.pause, None);
        assert_eq!(
            starts(&p),
            vec![("shop/b", Slot::B)],
            "a failed pod is not retried"
        );
        let p = plan(&r, &[failed("a"), failed("b"), pod("c", "1")], NOW);
        assert!(matches!(
            p.pause,
            Some(Pause::FailureThreshold { failed: 2, .. })
        ));
    }

    #[test]
    fn a_failure_in_this_plan_counts_towards_the_threshold_at_once() {
        let mut broken = upgrading("a", "1", "3", Slot::B, NOW);
        broken.slot_b.as_mut().unwrap().waiting_reason = Some("CrashLoopBackOff".into());
        let r = with(release("3"), |u| u.max_unavailable = IntOrString::Int(5));
        let p = plan(&r, &[broken, pod("b", "1")], NOW);
        assert_eq!(names(&p, "fail"), vec!["shop/a"]);
        assert!(starts(&p).is_empty());
        assert!(matches!(p.pause, Some(Pause::FailureThreshold { .. })));
    }

    #[test]
    fn rollback_is_setting_the_version_back_and_forgives_failures_of_other_versions() {
        // Pods on 2 (slot b active), one of them failed on 3: target back to 1.
        let mut on2 = pod("a", "2");
        on2.active = Some(Slot::B);
        on2.slot_a = Some(idle());
        on2.slot_b = Some(serving(&image("2")));
        let mut failed3 = on2.clone();
        failed3.key = "shop/b".into();
        failed3.failure = Some(FailureRecord {
            version: "3".into(),
            reason: "x".into(),
            at: NOW,
        });
        let r = with(release("1"), |u| u.max_unavailable = IntOrString::Int(5));
        let p = plan(&r, &[on2, failed3], NOW);
        assert_eq!(starts(&p), vec![("shop/a", Slot::A), ("shop/b", Slot::A)]);
        assert!(p.pause.is_none() && p.failed.is_empty());
    }

    #[test]
    fn a_superseded_upgrade_finishes_before_the_next_one_starts() {
        let mut p0 = upgrading("a", "1", "2", Slot::B, NOW - 2);
        p0.observed = observed(Slot::B, "serving", true, &[Slot::A]);
        let p = plan(&release("3"), &[p0.clone()], NOW);
        assert_eq!(names(&p, "finish"), vec!["shop/a"]);
        assert!(starts(&p).is_empty());
        assert_eq!(p.updated, 0, "it runs 2, not 3");
        // Not finished yet: waited for, never abandoned mid-handoff.
        p0.observed = observed(Slot::B, "adopting", false, &[]);
        let p = plan(&release("3"), &[p0], NOW);
        assert!(p.actions.is_empty() && p.waiting);
    }

    #[test]
    fn pods_without_a_standby_slot_are_evicted_within_max_unavailable() {
        let mut pods: Vec<_> = ["a", "b", "c"].iter().map(|n| pod(n, "1")).collect();
        for p in &mut pods {
            p.slot_b = None;
        }
        let r = with(release("2"), |u| u.max_unavailable = IntOrString::Int(2));
        let p = plan(&r, &pods, NOW);
        assert_eq!(
            p.actions,
            vec![
                Action::Evict {
                    pod: "shop/a".into(),
                    reason: EvictReason::NoStandbySlot
                },
                Action::Evict {
                    pod: "shop/b".into(),
                    reason: EvictReason::NoStandbySlot
                },
            ]
        );
        // The evicted pods terminate, then come back unready: still unavailable.
        pods[0].terminating = true;
        let mut replacement = pod("a-new", "2");
        replacement.slot_a.as_mut().unwrap().ready = false;
        pods.push(replacement);
        let p = plan(&r, &pods, NOW);
        assert!(p.actions.is_empty(), "{:?}", p.actions);
    }

    #[test]
    fn the_recreate_strategy_evicts_even_pods_with_a_standby_slot() {
        let r = with(release("2"), |u| u.strategy = UpgradeStrategy::Recreate);
        let p = plan(&r, &[pod("a", "1")], NOW);
        assert_eq!(
            p.actions,
            vec![Action::Evict {
                pod: "shop/a".into(),
                reason: EvictReason::Recreate
            }]
        );
    }

    #[test]
    fn pods_without_a_controller_are_never_evicted() {
        let mut bare = pod("a", "1");
        bare.has_controller = false;
        bare.slot_b = None;
        let p = plan(&release("2"), &[bare, pod("b", "1")], NOW);
        assert_eq!(
            starts(&p),
            vec![("shop/b", Slot::B)],
            "the budget goes to the next pod"
        );
        assert_eq!(p.blocked.len(), 1);
        assert!(p.blocked[0].1.contains("no controller"));
    }

    #[test]
    fn native_sidecars_move_in_place_only_on_kubelets_with_the_image_update_fix() {
        let native = |kubelet| {
            let mut p = pod("a", "1");
            p.native = true;
            p.kubelet = kubelet;
            p
        };
        let p = plan(&release("2"), &[native(Some((1, 32)))], NOW);
        assert!(matches!(
            &p.actions[..],
            [Action::Start { native: true, .. }]
        ));
        let p = plan(&release("2"), &[native(Some((1, 31)))], NOW);
        assert_eq!(
            p.actions,
            vec![Action::Evict {
                pod: "shop/a".into(),
                reason: EvictReason::NativeSidecarImageUpdateUnsupported
            }]
        );
        let p = plan(&release("2"), &[native(None)], NOW);
        assert!(p.actions.is_empty());
        assert!(p.blocked[0].1.contains("kubelet version is unknown"));
        // Finish/Fail carry the flag so the controller patches initContainers.
        let mut up = upgrading("a", "1", "2", Slot::B, NOW);
        up.native = true;
        up.slot_b.as_mut().unwrap().waiting_reason = Some("ErrImagePull".into());
        assert!(matches!(
            &plan(&release("2"), &[up], NOW).actions[..],
            [Action::Fail { native: true, .. }]
        ));
    }

    #[test]
    fn required_offload_pods_with_devices_in_slot_a_are_evicted_and_others_move_in_place() {
        let required = |name: &str| {
            let mut p = pod(name, "1");
            p.required_device_only_in_slot_a = true;
            p
        };
        let r = with(release("2"), |u| u.max_unavailable = IntOrString::Int(3));
        let mut from_b = required("c");
        from_b.active = Some(Slot::B);
        from_b.slot_b = Some(serving(&image("1")));
        from_b.slot_a = Some(idle());
        let p = plan(&r, &[required("a"), pod("b", "1"), from_b], NOW);
        assert_eq!(
            p.actions[0],
            Action::Evict {
                pod: "shop/a".into(),
                reason: EvictReason::OffloadDeviceInActiveSlot
            }
        );
        // Preferred (or no offload): in place, the new sidecar runs in
        // software (A3). Serving from b: back into a, where the device is.
        assert_eq!(starts(&p), vec![("shop/b", Slot::B), ("shop/c", Slot::A)]);
        assert!(
            EvictReason::OffloadDeviceInActiveSlot
                .message()
                .contains("slot a")
        );

        // Without a controller nothing would recreate it: blocked, and the
        // budget goes to the next pod.
        let mut bare = required("a");
        bare.has_controller = false;
        let r1 = with(release("2"), |u| u.max_unavailable = IntOrString::Int(1));
        let p = plan(&r1, &[bare, pod("b", "1")], NOW);
        assert_eq!(starts(&p), vec![("shop/b", Slot::B)]);
        assert!(
            p.blocked[0].1.contains("requires private-key offload"),
            "{:?}",
            p.blocked
        );
        assert!(
            p.blocked[0].1.contains("delete it yourself"),
            "{:?}",
            p.blocked
        );
    }

    #[test]
    fn a_standby_slot_running_a_sidecar_without_a_record_is_never_started_again() {
        let mut p0 = pod("a", "1");
        p0.slot_b = Some(serving(&image("1")));
        let p = plan(&release("2"), &[p0], NOW);
        assert!(p.actions.is_empty());
        assert!(p.blocked[0].1.contains("without an upgrade under way"));
    }

    #[test]
    fn a_malformed_upgrade_annotation_blocks_only_that_pod() {
        let mut p0 = pod("a", "1");
        p0.upgrade = Some(Err("expected value at line 1".into()));
        let p = plan(&release("2"), &[p0, pod("b", "1")], NOW);
        assert_eq!(starts(&p), vec![("shop/b", Slot::B)]);
        assert!(p.blocked[0].1.contains("does not parse"));
    }

    #[test]
    fn the_plan_does_not_depend_on_the_order_pods_are_listed_in() {
        let r = with(release("2"), |u| u.max_unavailable = IntOrString::Int(2));
        let mut pods: Vec<_> = ["d", "a", "c", "b", "e"]
            .iter()
            .map(|n| pod(n, "1"))
            .collect();
        let first = plan(&r, &pods, NOW);
        pods.reverse();
        assert_eq!(plan(&r, &pods, NOW), first);
    }

    /// A new leader sees only what the pods say. Replaying the plan's own
    /// effects on the pods and planning again (as a new leader would, at any
    /// point) must never start a pod twice, never start a pod whose standby
    /// slot is busy, and reach every pod on the target.
    #[test]
    fn replanning_from_what_the_pods_say_converges_without_starting_a_pod_twice() {
        let r = with(release("2"), |u| u.max_unavailable = IntOrString::Int(2));
        let mut pods: Vec<_> = (0..5).map(|i| pod(&format!("p{i}"), "1")).collect();
        let mut started: BTreeMap<String, usize> = BTreeMap::new();
        for round in 0..20 {
            let now = NOW + round;
            let p = plan(&r, &pods, now);
            // The same state planned twice (a leader that crashed before
            // acting, and its successor) gives the same plan.
            assert_eq!(plan(&r, &pods, now), p);
            for a in &p.actions {
                let pod = pods.iter_mut().find(|x| x.key == a.pod()).unwrap();
                match a {
                    Action::Start { record, .. } => {
                        *started.entry(pod.key.clone()).or_default() += 1;
                        assert!(pod.upgrade.is_none());
                        pod.slot_b = Some(serving(&record.image));
                        pod.upgrade = Some(Ok(record.clone()));
                    }
                    Action::Finish { record, .. } => {
                        pod.slot_a = Some(idle());
                        pod.active = Some(record.slot);
                        pod.version = Some(record.version.clone());
                        pod.upgrade = None;
                        pod.observed = None;
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            // Every pod mid-upgrade completes its handoff one round later.
            for pod in &mut pods {
                if let Some(Ok(rec)) = &pod.upgrade
                    && rec.started_at < now
                {
                    pod.observed = observed(rec.slot, "serving", true, &[rec.slot.other()]);
                }
            }
            // Never more than maxUnavailable under way.
            assert!(pods.iter().filter(|p| p.upgrade.is_some()).count() <= 2);
        }
        assert!(
            pods.iter()
                .all(|p| p.version.as_deref() == Some("2") && p.active == Some(Slot::B))
        );
        assert!(started.values().all(|n| *n == 1), "{started:?}");
        assert_eq!(started.len(), 5);
    }

    /// Exhaustive over every combination of three pods, each in one of the
    /// ten states below, with and without pause, for maxUnavailable 1..=3: the
    /// invariants hold whatever the mix.
    #[test]
    fn invariants_hold_for_every_combination_of_pod_states() {
        fn state(i: usize, name: &str) -> PodState {
            let mut p = match i {
                0 => pod(name, "1"),
                1 => pod(name, "2"),
                2 => upgrading(name, "1", "2", Slot::B, NOW - 1),
                3 => {
                    let mut p = upgrading(name, "1", "2", Slot::B, NOW - 1);
                    p.observed = observed(Slot::B, "serving", true, &[Slot::A]);
                    p
                }
                4 => {
                    let mut p = upgrading(name, "1", "2", Slot::B, NOW - 1);
                    p.slot_b.as_mut().unwrap().waiting_reason = Some("CrashLoopBackOff".into());
                    p
                }
                5 => {
                    let mut p = pod(name, "1");
                    p.failure = Some(FailureRecord {
                        version: "2".into(),
                        reason: "x".into(),
                        at: NOW,
                    });
                    p
                }
                6 => {
                    let mut p = pod(name, "1");
                    p.slot_a.as_mut().unwrap().ready = false;
                    p
                }
                7 => {
                    let mut p = pod(name, "1");
                    p.terminating = true;
                    p
                }
                8 => {
                    let mut p = pod(name, "1");
                    p.slot_b = None;
                    p
                }
                _ => {
                    let mut p = pod(name, "1");
                    p.required_device_only_in_slot_a = true;
                    p
                }
            };
            p.key = format!("shop/{name}");
            p
        }
        const STATES: usize = 10;
        for paused in [false, true] {
            for max in 1..=3 {
                let r = with(release("2"), |u| {
                    u.max_unavailable = IntOrString::Int(max);
                    u.paused = paused;
                    u.failure_threshold = 5;
                });
                for combo in 0..STATES.pow(3) {
                    let pods: Vec<_> = (0..3)
                        .map(|k| state(combo / STATES.pow(k) % STATES, &format!("p{k}")))
                        .collect();
                    let p = plan(&r, &pods, NOW);
                    let ctx = format!(
                        "paused={paused} max={max} pods={:?}",
                        pods.iter()
                            .map(|p| (&p.key, p.upgrade.is_some(), p.terminating))
                            .collect::<Vec<_>>()
                    );
                    let by_key = |k: &str| pods.iter().find(|p| p.key == k).unwrap();
                    let fresh = p
                        .actions
                        .iter()
                        .filter(|a| matches!(a, Action::Start { .. } | Action::Evict { .. }))
                        .count();
                    if paused {
                        assert_eq!(fresh, 0, "{ctx}");
                    }
                    let busy = pods
                        .iter()
                        .filter(|x| x.terminating || !x.ready() || x.upgrade.is_some())
                        .count();
                    assert!(
                        fresh <= usize::try_from(max).unwrap().saturating_sub(busy),
                        "{ctx}: {:?}",
                        p.actions
                    );
                    for a in &p.actions {
                        let pod = by_key(a.pod());
                        if let Action::Start { record, .. } = a {
                            assert!(
                                !(pod.required_device_only_in_slot_a && record.slot == Slot::B),
                                "{ctx}: a pod whose device is in slot a started in slot b"
                            );
                        }
                        match a {
                            Action::Start { .. } | Action::Evict { .. } => {
                                assert!(pod.upgrade.is_none() && !pod.terminating, "{ctx}");
                                assert!(pod.failure.is_none(), "{ctx}: a failed pod retried");
                                assert_ne!(pod.version.as_deref(), Some("2"), "{ctx}");
                            }
                            Action::Finish { .. } | Action::Fail { .. } => {
                                assert!(pod.upgrade.is_some(), "{ctx}");
                            }
                        }
                    }
                    let mut seen: Vec<&str> = p.actions.iter().map(Action::pod).collect();
                    seen.sort();
                    seen.dedup();
                    assert_eq!(seen.len(), p.actions.len(), "{ctx}: one action per pod");
                    assert!(p.updated + p.failed.len() <= p.total, "{ctx}");
                }
            }
        }
    }

    #[test]
    fn a_pod_deleted_mid_handoff_is_reported_once_whether_seen_terminating_or_not_at_all() {
        let mut memory = InFlightMemory::default();
        let a = upgrading("a", "1", "2", Slot::B, 100);
        let b = upgrading("b", "1", "2", Slot::B, 100);
        let c = pod("c", "1");
        assert!(
            memory
                .observe(&[a.clone(), b.clone(), c.clone()])
                .is_empty()
        );

        // a is terminating: reported now, and not again while it terminates
        // or once it is gone. b vanished between two looks: reported as gone.
        let mut a_terminating = a.clone();
        a_terminating.terminating = true;
        let first = memory.observe(&[a_terminating.clone(), c.clone()]);
        assert_eq!(
            first
                .iter()
                .map(|i| (i.pod.as_str(), i.gone, i.record.version.as_str()))
                .collect::<Vec<_>>(),
            [("shop/a", false, "2"), ("shop/b", true, "2")]
        );
        assert!(first[0].message().contains("handoff to 2 (slot b)"));
        assert!(memory.observe(&[a_terminating, c.clone()]).is_empty());
        assert!(memory.observe(std::slice::from_ref(&c)).is_empty());
        // Reported once, recalled after: the status keeps listing both even
        // when the release a reconcile reads predates the patch that did.
        assert_eq!(
            memory
                .recent()
                .iter()
                .map(|i| i.pod.as_str())
                .collect::<Vec<_>>(),
            ["shop/a", "shop/b"]
        );
    }

    #[test]
    fn a_finished_handoff_is_not_an_interruption_but_a_same_named_replacement_is() {
        let mut memory = InFlightMemory::default();
        let a = upgrading("a", "1", "2", Slot::B, 100);
        let s = upgrading("s-0", "1", "2", Slot::B, 100);
        memory.observe(&[a, s]);
        // a finished (record gone, same uid); s-0 was deleted and its
        // StatefulSet recreated it under the same name before we looked.
        let mut finished = pod("a", "2");
        finished.active = Some(Slot::B);
        let mut replacement = pod("s-0", "2");
        replacement.uid = "uid-s-0-new".into();
        let seen = memory.observe(&[finished, replacement]);
        assert_eq!(
            seen.iter().map(|i| i.pod.as_str()).collect::<Vec<_>>(),
            ["shop/s-0"]
        );
        assert!(seen[0].gone);
    }

    #[test]
    fn the_rollout_goes_on_past_pods_deleted_mid_handoff_and_pods_added_on_the_target() {
        // maxUnavailable 1. A pod deleted mid-handoff uses the budget only
        // while it terminates; pods the Deployment added during the rollout
        // were injected on the target and count as updated.
        let r = release("2");
        let mut gone = upgrading("a", "1", "2", Slot::B, 100);
        gone.terminating = true;
        let pods = vec![gone, pod("b", "1"), pod("new-1", "2"), pod("new-2", "2")];
        let p = plan(&r, &pods, 110);
        assert!(
            starts(&p).is_empty(),
            "the terminating pod holds the budget"
        );
        assert_eq!((p.updated, p.in_flight), (2, 1));
        // Once it is gone, the next pod starts.
        let p = plan(&r, &pods[1..], 111);
        assert_eq!(starts(&p), [("shop/b", Slot::B)]);
        assert_eq!(p.total, 3);
    }
}
