//! Pure status computation for a SidecarRelease: counts per version and the
//! Progressing / Complete / Degraded / Paused conditions.
//!
//! A pod counts for a release when the webhook labelled it
//! `baton.dev/release=<name>`. Its version is the `baton.dev/version`
//! annotation, its readiness that of the container in the active slot
//! (`baton.dev/active-slot`, `a` by default) — found among init containers too,
//! where native sidecars live.

use std::collections::BTreeMap;

use baton_crds::conditions::{self, Time, sidecar_release as cond};
use baton_crds::contract::{annotations, containers};
use baton_crds::sidecar_release::{VersionCount, history_after};
use baton_crds::{SidecarRelease, SidecarReleaseStatus, Validate};
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

/// Waiting reasons that mean the sidecar will not come up without help.
const FAILED_WAITING_REASONS: &[&str] = &[
    "CrashLoopBackOff",
    "ErrImagePull",
    "ImagePullBackOff",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "InvalidImageName",
];

/// What the status needs to know about one injected pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodView {
    pub name: String,
    pub version: Option<String>,
    pub ready: bool,
    pub failed: bool,
}

impl PodView {
    pub fn from_pod(pod: &Pod) -> Self {
        let meta = &pod.metadata;
        let annotation = |key: &str| meta.annotations.as_ref().and_then(|a| a.get(key)).cloned();
        let slot = match annotation(annotations::ACTIVE_SLOT).as_deref() {
            Some("b") => containers::SLOT_B,
            _ => containers::SLOT_A,
        };
        let status = pod.status.as_ref();
        let sidecar: Option<&ContainerStatus> = status.and_then(|s| {
            s.container_statuses
                .iter()
                .flatten()
                .chain(s.init_container_statuses.iter().flatten())
                .find(|c| c.name == slot)
        });
        let failed = sidecar
            .and_then(|c| c.state.as_ref())
            .and_then(|s| s.waiting.as_ref())
            .and_then(|w| w.reason.as_deref())
            .is_some_and(|r| FAILED_WAITING_REASONS.contains(&r));
        Self {
            name: format!(
                "{}/{}",
                meta.namespace.as_deref().unwrap_or_default(),
                meta.name.as_deref().unwrap_or_default()
            ),
            version: annotation(annotations::VERSION),
            ready: sidecar.is_some_and(|c| c.ready),
            failed,
        }
    }
}

/// The status `release` should have given `pods`, keeping the transition
/// times of conditions whose status did not change.
pub fn compute(release: &SidecarRelease, pods: &[PodView], now: &Time) -> SidecarReleaseStatus {
    let spec = &release.spec;
    let generation = release.metadata.generation;
    let previous = release.status.clone().unwrap_or_default();
    let mut history = previous.history.clone();

    let count = |f: &dyn Fn(&PodView) -> bool| {
        i32::try_from(pods.iter().filter(|p| f(p)).count()).unwrap_or(i32::MAX)
    };
    let total = count(&|_| true);
    let updated = count(&|p| p.version.as_deref() == Some(spec.version.as_str()));
    let updated_ready = count(&|p| p.ready && p.version.as_deref() == Some(spec.version.as_str()));
    let ready = count(&|p| p.ready);
    let failed = count(&|p| p.failed);

    let mut by_version: BTreeMap<&str, VersionCount> = BTreeMap::new();
    for pod in pods {
        let version = pod.version.as_deref().unwrap_or("unknown");
        let entry = by_version.entry(version).or_insert_with(|| VersionCount {
            version: version.to_owned(),
            ..Default::default()
        });
        entry.total += 1;
        entry.ready += i32::from(pod.ready);
        entry.failed += i32::from(pod.failed);
    }

    // Pods the partition holds back are not expected to move.
    let target = (total - spec.upgrade.partition.max(0)).max(0);
    let mut c = previous.conditions;
    let mut set = |type_: &str, status: bool, reason: &str, message: String| {
        conditions::upsert(&mut c, type_, status, reason, &message, generation, now);
    };

    let invalid = release.validate().err();
    let complete = updated_ready >= target;
    if let Some(errors) = &invalid {
        let message = errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        set(
            cond::PROGRESSING,
            false,
            cond::reasons::INVALID_SPEC,
            message.clone(),
        );
        set(cond::COMPLETE, false, cond::reasons::INVALID_SPEC, message);
    } else if total == 0 {
        history = history_after(&history, spec);
        set(
            cond::PROGRESSING,
            false,
            cond::reasons::NO_PODS_SELECTED,
            "no injected pod follows this release".into(),
        );
        set(
            cond::COMPLETE,
            true,
            cond::reasons::NO_PODS_SELECTED,
            "no injected pod follows this release".into(),
        );
    } else if complete {
        let (reason, message) = if target < total {
            (
                cond::reasons::PARTITION_HELD,
                format!(
                    "{updated_ready} of {total} pods run {} and are ready; partition holds {}",
                    spec.version,
                    total - target
                ),
            )
        } else {
            history = history_after(&history, spec);
            (
                cond::reasons::ALL_PODS_UPDATED,
                format!("all {total} pods run {} and are ready", spec.version),
            )
        };
        set(cond::PROGRESSING, false, reason, message.clone());
        set(cond::COMPLETE, true, reason, message);
    } else {
        let message = format!(
            "{updated_ready} of {target} pods run {} and are ready",
            spec.version
        );
        set(
            cond::PROGRESSING,
            true,
            cond::reasons::ROLLING_OUT,
            message.clone(),
        );
        set(cond::COMPLETE, false, cond::reasons::ROLLING_OUT, message);
    }

    if let Some(errors) = &invalid {
        let message = errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        set(cond::DEGRADED, true, cond::reasons::INVALID_SPEC, message);
    } else if failed > 0 {
        let names: Vec<&str> = pods
            .iter()
            .filter(|p| p.failed)
            .take(3)
            .map(|p| p.name.as_str())
            .collect();
        set(
            cond::DEGRADED,
            true,
            cond::reasons::HANDOFF_FAILED,
            format!(
                "{failed} pod(s) have a failing sidecar, e.g. {}",
                names.join(", ")
            ),
        );
    } else {
        set(
            cond::DEGRADED,
            false,
            cond::reasons::HEALTHY,
            "no pod has a failing sidecar".into(),
        );
    }

    if spec.upgrade.paused {
        set(
            cond::PAUSED,
            true,
            cond::reasons::PAUSED_BY_USER,
            "spec.upgrade.paused is true".into(),
        );
    } else {
        set(
            cond::PAUSED,
            false,
            cond::reasons::NOT_PAUSED,
            "rollout not paused".into(),
        );
    }

    SidecarReleaseStatus {
        observed_generation: generation,
        total,
        updated,
        ready,
        failed,
        versions: by_version.into_values().collect(),
        conditions: c,
        history,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_crds::SidecarReleaseSpec;
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateWaiting, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use k8s_openapi::jiff::Timestamp;

    fn release(version: &str, partition: i32, paused: bool) -> SidecarRelease {
        let mut spec: SidecarReleaseSpec = serde_json::from_value(serde_json::json!({
            "version": version,
            "image": format!("docker.io/baton/sidecar:{version}"),
            "emptyImage": "docker.io/baton/empty:0.1.0",
        }))
        .unwrap();
        spec.upgrade.partition = partition;
        spec.upgrade.paused = paused;
        let mut r = SidecarRelease::new("default", spec);
        r.metadata.generation = Some(3);
        r
    }

    fn pod(name: &str, version: &str, ready: bool) -> PodView {
        PodView {
            name: name.into(),
            version: Some(version.into()),
            ready,
            failed: false,
        }
    }

    fn now() -> Time {
        Time(Timestamp::from_second(1_800_000_000).unwrap())
    }

    fn condition<'a>(
        s: &'a SidecarReleaseStatus,
        t: &str,
    ) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn no_pods_is_complete_with_reason_no_pods_selected() {
        let s = compute(&release("1.0", 0, false), &[], &now());
        assert_eq!((s.total, s.updated, s.ready), (0, 0, 0));
        assert_eq!(condition(&s, cond::COMPLETE).status, "True");
        assert_eq!(
            condition(&s, cond::COMPLETE).reason,
            cond::reasons::NO_PODS_SELECTED
        );
        assert_eq!(condition(&s, cond::PROGRESSING).status, "False");
        assert_eq!(s.observed_generation, Some(3));
    }

    #[test]
    fn mixed_versions_are_progressing_and_counted_per_version() {
        let pods = [
            pod("ns/a", "1.0", true),
            pod("ns/b", "2.0", true),
            pod("ns/c", "2.0", false),
        ];
        let s = compute(&release("2.0", 0, false), &pods, &now());
        assert_eq!((s.total, s.updated, s.ready, s.failed), (3, 2, 2, 0));
        assert_eq!(s.versions.len(), 2);
        assert_eq!(s.versions[0].version, "1.0");
        assert_eq!((s.versions[1].total, s.versions[1].ready), (2, 1));
        assert_eq!(condition(&s, cond::PROGRESSING).status, "True");
        assert_eq!(
            condition(&s, cond::PROGRESSING).message,
            "1 of 3 pods run 2.0 and are ready"
        );
        assert_eq!(condition(&s, cond::COMPLETE).status, "False");
    }

    #[test]
    fn all_pods_updated_and_ready_is_complete() {
        let pods = [pod("ns/a", "2.0", true), pod("ns/b", "2.0", true)];
        let s = compute(&release("2.0", 0, false), &pods, &now());
        assert_eq!(condition(&s, cond::COMPLETE).status, "True");
        assert_eq!(
            condition(&s, cond::COMPLETE).reason,
            cond::reasons::ALL_PODS_UPDATED
        );
        assert_eq!(condition(&s, cond::DEGRADED).status, "False");
    }

    #[test]
    fn a_completed_rollout_enters_the_history_newest_first_and_once() {
        let mut r = release("1.0", 0, false);
        let s = compute(&r, &[pod("ns/a", "1.0", true)], &now());
        assert_eq!(s.history.len(), 1);
        // Under way to 2.0: the history still ends at 1.0.
        r.status = Some(s);
        r.spec.version = "2.0".into();
        r.spec.image = "baton/sidecar:2.0".into();
        let s = compute(&r, &[pod("ns/a", "1.0", true)], &now());
        let versions = |s: &SidecarReleaseStatus| {
            s.history
                .iter()
                .map(|h| h.version.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(versions(&s), ["1.0"]);
        assert_eq!(s.previous("2.0").map(|h| h.version.as_str()), Some("1.0"));
        // Done: 2.0 first; back to 1.0 and done again: 1.0 moves to the
        // front rather than appearing twice.
        r.status = Some(s);
        let s = compute(&r, &[pod("ns/a", "2.0", true)], &now());
        assert_eq!(versions(&s), ["2.0", "1.0"]);
        assert_eq!(s.history[0].image, "baton/sidecar:2.0");
        r.status = Some(s);
        r.spec.version = "1.0".into();
        let s = compute(&r, &[pod("ns/a", "1.0", true)], &now());
        assert_eq!(versions(&s), ["1.0", "2.0"]);
        // A partition holding pods back is not a completed version.
        r.status = Some(s);
        r.spec.version = "3.0".into();
        r.spec.upgrade.partition = 1;
        let s = compute(
            &r,
            &[pod("ns/a", "1.0", true), pod("ns/b", "3.0", true)],
            &now(),
        );
        assert_eq!(versions(&s), ["1.0", "2.0"]);
        assert_eq!(s.previous("1.0").map(|h| h.version.as_str()), Some("2.0"));
    }

    #[test]
    fn partition_holds_pods_back_without_blocking_completion() {
        let pods = [pod("ns/a", "1.0", true), pod("ns/b", "2.0", true)];
        let s = compute(&release("2.0", 1, false), &pods, &now());
        assert_eq!(condition(&s, cond::COMPLETE).status, "True");
        assert_eq!(
            condition(&s, cond::COMPLETE).reason,
            cond::reasons::PARTITION_HELD
        );
    }

    #[test]
    fn a_failing_sidecar_degrades_the_release_and_names_the_pod() {
        let mut bad = pod("ns/bad", "2.0", false);
        bad.failed = true;
        let s = compute(&release("2.0", 0, false), &[bad], &now());
        assert_eq!(s.failed, 1);
        let d = condition(&s, cond::DEGRADED);
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", cond::reasons::HANDOFF_FAILED)
        );
        assert!(d.message.contains("ns/bad"), "{}", d.message);
    }

    #[test]
    fn paused_is_reported() {
        let s = compute(&release("2.0", 0, true), &[], &now());
        assert_eq!(condition(&s, cond::PAUSED).status, "True");
        let s = compute(&release("2.0", 0, false), &[], &now());
        assert_eq!(condition(&s, cond::PAUSED).status, "False");
    }

    #[test]
    fn unchanged_conditions_keep_their_transition_time() {
        let r0 = release("2.0", 0, false);
        let first = compute(&r0, &[], &now());
        let mut r1 = r0.clone();
        r1.status = Some(first.clone());
        let later = Time(Timestamp::from_second(1_800_000_600).unwrap());
        let second = compute(&r1, &[], &later);
        assert_eq!(
            condition(&first, cond::COMPLETE).last_transition_time,
            condition(&second, cond::COMPLETE).last_transition_time
        );
        assert_eq!(first, second);
    }

    #[test]
    fn pod_view_reads_version_active_slot_readiness_and_crash_loops() {
        let mut pod = Pod {
            metadata: ObjectMeta {
                name: Some("web-1".into()),
                namespace: Some("shop".into()),
                annotations: Some(
                    [
                        (annotations::VERSION.to_owned(), "2.0".to_owned()),
                        (annotations::ACTIVE_SLOT.to_owned(), "b".to_owned()),
                    ]
                    .into(),
                ),
                ..Default::default()
            },
            spec: None,
            status: Some(PodStatus {
                init_container_statuses: Some(vec![
                    ContainerStatus {
                        name: containers::SLOT_A.into(),
                        ready: false,
                        ..Default::default()
                    },
                    ContainerStatus {
                        name: containers::SLOT_B.into(),
                        ready: true,
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            }),
        };
        let view = PodView::from_pod(&pod);
        assert_eq!(
            view,
            PodView {
                name: "shop/web-1".into(),
                version: Some("2.0".into()),
                ready: true,
                failed: false
            }
        );

        let statuses = pod
            .status
            .as_mut()
            .unwrap()
            .init_container_statuses
            .as_mut()
            .unwrap();
        statuses[1].ready = false;
        statuses[1].state = Some(ContainerState {
            waiting: Some(ContainerStateWaiting {
                reason: Some("CrashLoopBackOff".into()),
                ..Default::default()
            }),
            ..Default::default()
        });
        let view = PodView::from_pod(&pod);
        assert!(view.failed && !view.ready);
    }
}
