//! What the rollout adds to a SidecarRelease's status: the failures with
//! their reasons, pods in flight, the self-pause once failures exceed the
//! threshold, the canary hold, and one word for `kubectl get`. Pure: it
//! refines the counts [`crate::release::status::compute`] made from the pods.

use baton_crds::conditions::{self, Time, sidecar_release as cond};
use baton_crds::sidecar_release::{FailedPod, InterruptedPod};
use baton_crds::{SidecarRelease, SidecarReleaseStatus, Validate};

use super::plan::{Pause, Plan};

/// Failed pods listed in status at most.
const MAX_FAILED_LISTED: usize = 10;
/// Interrupted handoffs listed in status at most.
const MAX_INTERRUPTED_LISTED: usize = 10;

/// Applies `plan` to `status` (computed from the same pods).
pub fn overlay(
    status: &mut SidecarReleaseStatus,
    release: &SidecarRelease,
    plan: &Plan,
    now: &Time,
) {
    let spec = &release.spec;
    let generation = release.metadata.generation;
    let set = |c: &mut Vec<_>, type_: &str, value: bool, reason: &str, message: String| {
        conditions::upsert(c, type_, value, reason, &message, generation, now);
    };

    status.in_flight = i32::try_from(plan.in_flight).unwrap_or(i32::MAX);
    status.failed = status
        .failed
        .max(i32::try_from(plan.failed.len()).unwrap_or(i32::MAX));
    status.failed_pods = plan
        .failed
        .iter()
        .take(MAX_FAILED_LISTED)
        .map(|(pod, reason)| FailedPod {
            pod: pod.clone(),
            version: spec.version.clone(),
            reason: reason.clone(),
        })
        .collect();

    // Interrupted handoffs: the controller's memory of them first (newest
    // first), then those the status already listed for this version (a new
    // version starts a new list; a new leader's memory starts empty).
    let earlier = release
        .status
        .iter()
        .flat_map(|s| s.interrupted_pods.iter())
        .filter(|p| p.version == spec.version);
    let mut interrupted: Vec<InterruptedPod> = plan
        .interrupted
        .iter()
        .filter(|i| i.record.version == spec.version)
        .map(|i| InterruptedPod {
            pod: i.pod.clone(),
            version: i.record.version.clone(),
            message: i.message(),
        })
        .collect();
    for p in earlier {
        if !interrupted
            .iter()
            .any(|i| i.pod == p.pod && i.version == p.version)
        {
            interrupted.push(p.clone());
        }
    }
    interrupted.truncate(MAX_INTERRUPTED_LISTED);
    status.interrupted_pods = interrupted;

    if !plan.failed.is_empty() {
        let examples: Vec<String> = plan
            .failed
            .iter()
            .take(3)
            .map(|(p, r)| format!("{p}: {r}"))
            .collect();
        set(
            &mut status.conditions,
            cond::DEGRADED,
            true,
            cond::reasons::HANDOFF_FAILED,
            format!(
                "{} pod(s) failed their handoff to {} and keep serving their previous version; {}",
                plan.failed.len(),
                spec.version,
                examples.join("; ")
            ),
        );
    }

    if let Some(Pause::FailureThreshold { failed, threshold }) = &plan.pause {
        let message = format!(
            "{failed} pod(s) failed their handoff to {}, more than failureThreshold {threshold}: \
             the rollout paused itself. Set spec.version back to roll back, or fix the image and \
             remove the annotation baton.dev/upgrade-failed from the failed pods to retry them",
            spec.version
        );
        set(
            &mut status.conditions,
            cond::PAUSED,
            true,
            cond::reasons::FAILURE_THRESHOLD,
            message.clone(),
        );
        if !conditions::is_true(&status.conditions, cond::COMPLETE) {
            set(
                &mut status.conditions,
                cond::PROGRESSING,
                false,
                cond::reasons::FAILURE_THRESHOLD,
                message,
            );
        }
    }

    let nothing_moving = plan.in_flight == 0 && plan.actions.is_empty();
    if plan.held_by_canary > 0
        && nothing_moving
        && plan.pause.is_none()
        && plan.updated + plan.held_by_canary + plan.held_by_partition + plan.failed.len()
            >= plan.total
    {
        let message = format!(
            "every pod the canary selector allows runs {}; {} pod(s) outside it keep their version",
            spec.version, plan.held_by_canary
        );
        set(
            &mut status.conditions,
            cond::PROGRESSING,
            false,
            cond::reasons::CANARY_HELD,
            message.clone(),
        );
        set(
            &mut status.conditions,
            cond::COMPLETE,
            true,
            cond::reasons::CANARY_HELD,
            message,
        );
    }

    if !plan.blocked.is_empty() && !conditions::is_true(&status.conditions, cond::COMPLETE) {
        let examples: Vec<String> = plan
            .blocked
            .iter()
            .take(3)
            .map(|(p, r)| format!("{p}: {r}"))
            .collect();
        if let Some(c) = status
            .conditions
            .iter_mut()
            .find(|c| c.type_ == cond::PROGRESSING)
        {
            c.message = format!(
                "{}; {} pod(s) cannot move: {}",
                c.message,
                plan.blocked.len(),
                examples.join("; ")
            );
        }
    }

    status.rollout = Some(summary(status, release).to_owned());
}

/// One word for the `Rollout` printer column.
fn summary(status: &SidecarReleaseStatus, release: &SidecarRelease) -> &'static str {
    let c = &status.conditions;
    let reason_of = |t: &str| {
        c.iter()
            .find(|x| x.type_ == t)
            .map(|x| x.reason.as_str())
            .unwrap_or_default()
    };
    if release.validate().is_err() {
        "Invalid"
    } else if conditions::is_true(c, cond::COMPLETE) {
        match reason_of(cond::COMPLETE) {
            cond::reasons::PARTITION_HELD | cond::reasons::CANARY_HELD => "Held",
            _ => "Complete",
        }
    } else if conditions::is_true(c, cond::PAUSED) {
        "Paused"
    } else if conditions::is_true(c, cond::DEGRADED) {
        "Degraded"
    } else {
        "RollingOut"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::release::status::{PodView, compute};
    use baton_crds::SidecarReleaseSpec;
    use k8s_openapi::jiff::Timestamp;

    fn release() -> SidecarRelease {
        let spec: SidecarReleaseSpec = serde_json::from_value(serde_json::json!({
            "version": "3", "image": "s:3", "emptyImage": "e:1"
        }))
        .unwrap();
        let mut r = SidecarRelease::new("default", spec);
        r.metadata.generation = Some(4);
        r
    }

    fn now() -> Time {
        Time(Timestamp::from_second(1_800_000_000).unwrap())
    }

    fn view(name: &str, version: &str) -> PodView {
        PodView {
            name: name.into(),
            version: Some(version.into()),
            ready: true,
            failed: false,
        }
    }

    fn condition<'a>(
        s: &'a SidecarReleaseStatus,
        t: &str,
    ) -> &'a baton_crds::conditions::Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn failures_past_the_threshold_read_as_degraded_and_paused_with_the_reason() {
        let r = release();
        let mut s = compute(&r, &[view("shop/a", "2"), view("shop/b", "2")], &now());
        let plan = Plan {
            total: 2,
            failed: vec![(
                "shop/a".into(),
                "the new sidecar in slot b is CrashLoopBackOff".into(),
            )],
            pause: Some(Pause::FailureThreshold {
                failed: 1,
                threshold: 0,
            }),
            ..Plan::default()
        };
        overlay(&mut s, &r, &plan, &now());
        let degraded = condition(&s, cond::DEGRADED);
        assert_eq!(
            (degraded.status.as_str(), degraded.reason.as_str()),
            ("True", cond::reasons::HANDOFF_FAILED)
        );
        assert!(
            degraded
                .message
                .contains("shop/a: the new sidecar in slot b is CrashLoopBackOff")
        );
        let paused = condition(&s, cond::PAUSED);
        assert_eq!(
            (paused.status.as_str(), paused.reason.as_str()),
            ("True", cond::reasons::FAILURE_THRESHOLD)
        );
        assert_eq!(condition(&s, cond::PROGRESSING).status, "False");
        assert_eq!(s.failed, 1);
        assert_eq!(s.failed_pods[0].version, "3");
        assert_eq!(s.rollout.as_deref(), Some("Paused"));
        assert_eq!(paused.observed_generation, Some(4));
    }

    #[test]
    fn a_rollout_under_way_says_so_with_the_pods_in_flight_and_the_blocked_ones() {
        let r = release();
        let mut s = compute(&r, &[view("shop/a", "2"), view("shop/b", "3")], &now());
        let plan = Plan {
            total: 2,
            updated: 1,
            in_flight: 1,
            blocked: vec![("shop/c".into(), "no controller".into())],
            ..Plan::default()
        };
        overlay(&mut s, &r, &plan, &now());
        assert_eq!(s.in_flight, 1);
        assert_eq!(s.rollout.as_deref(), Some("RollingOut"));
        assert!(
            condition(&s, cond::PROGRESSING)
                .message
                .contains("shop/c: no controller")
        );
    }

    #[test]
    fn a_finished_rollout_reads_complete_and_a_canary_hold_reads_held() {
        let r = release();
        let mut s = compute(&r, &[view("shop/a", "3")], &now());
        overlay(
            &mut s,
            &r,
            &Plan {
                total: 1,
                updated: 1,
                ..Plan::default()
            },
            &now(),
        );
        assert_eq!(s.rollout.as_deref(), Some("Complete"));

        let mut s = compute(&r, &[view("shop/a", "3"), view("shop/b", "2")], &now());
        let plan = Plan {
            total: 2,
            updated: 1,
            held_by_canary: 1,
            ..Plan::default()
        };
        overlay(&mut s, &r, &plan, &now());
        assert_eq!(
            condition(&s, cond::COMPLETE).reason,
            cond::reasons::CANARY_HELD
        );
        assert_eq!(s.rollout.as_deref(), Some("Held"));
    }

    #[test]
    fn interrupted_pods_are_listed_newest_first_for_the_current_version() {
        use crate::rollout::plan::{Interrupted, Slot, UpgradeRecord};
        use baton_crds::sidecar_release::InterruptedPod;
        let interrupted = |pod: &str, version: &str| Interrupted {
            pod: pod.into(),
            record: UpgradeRecord {
                version: version.into(),
                image: format!("s:{version}"),
                slot: Slot::B,
                from_version: Some("2".into()),
                started_at: 1,
                idle_image: "e:1".into(),
            },
            gone: true,
        };
        let mut r = release();
        // Listed earlier: one for this version, one for an older rollout.
        r.status = Some(SidecarReleaseStatus {
            interrupted_pods: vec![
                InterruptedPod {
                    pod: "shop/old".into(),
                    version: "3".into(),
                    message: "earlier".into(),
                },
                InterruptedPod {
                    pod: "shop/older".into(),
                    version: "2".into(),
                    message: "another rollout".into(),
                },
            ],
            ..SidecarReleaseStatus::default()
        });
        let mut s = compute(&r, &[view("shop/a", "3")], &now());
        let plan = Plan {
            total: 1,
            updated: 1,
            interrupted: vec![interrupted("shop/new", "3")],
            ..Plan::default()
        };
        overlay(&mut s, &r, &plan, &now());
        let listed: Vec<(&str, &str)> = s
            .interrupted_pods
            .iter()
            .map(|p| (p.pod.as_str(), p.version.as_str()))
            .collect();
        assert_eq!(listed, [("shop/new", "3"), ("shop/old", "3")]);
        assert!(
            s.interrupted_pods[0]
                .message
                .contains("deleted while its handoff to 3"),
            "{}",
            s.interrupted_pods[0].message
        );
        // Nothing new: the list stays as it was.
        r.status = Some(s.clone());
        let mut again = compute(&r, &[view("shop/a", "3")], &now());
        overlay(
            &mut again,
            &r,
            &Plan {
                total: 1,
                updated: 1,
                ..Plan::default()
            },
            &now(),
        );
        assert_eq!(again.interrupted_pods, s.interrupted_pods);
    }
}
