//! Verdicts on SidecarReleases (pure): `releases`, one check per release.
//!
//! Complete is ok; a rollout under way or held at a partition or canary is
//! a warning (it is healthy, just not done); Paused, Degraded or an invalid
//! spec is a failure, with the condition's reason and message.

use baton_crds::SidecarRelease;
use baton_crds::conditions::{TRUE, sidecar_release as cond};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::ResourceExt;

use super::Check;
use super::cluster::can_i;
use super::fetch::Got;

/// The example release (hint when none is installed).
pub const EXAMPLE: &str = "kubectl apply -f manifests/examples/sidecarrelease.yaml";

/// `releases`.
pub fn releases(got: &Got<Vec<SidecarRelease>>) -> Vec<Check> {
    match got {
        Got::Found(list) if list.is_empty() => vec![Check::warning(
            "SidecarReleases",
            "none installed: no Pod gets a sidecar",
            EXAMPLE,
        )],
        Got::Found(list) => list.iter().map(release).collect(),
        Got::Missing => vec![Check::failure(
            "SidecarReleases",
            "the API server does not know the kind (is the CRD installed?)",
            "kubectl apply -k manifests/",
        )],
        Got::Unreadable(why) => vec![Check::failure(
            "SidecarReleases",
            format!("cannot list: {why}"),
            can_i("list", "sidecarreleases.baton.dev", None),
        )],
    }
}

fn condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions
        .iter()
        .find(|c| c.type_ == type_ && c.status == TRUE)
}

fn why(c: &Condition) -> String {
    if c.message.is_empty() {
        c.reason.clone()
    } else {
        format!("{}: {}", c.reason, c.message)
    }
}

/// One release's verdict.
pub fn release(r: &SidecarRelease) -> Check {
    let name = r.name_any();
    let label = format!("SidecarRelease {name}");
    let describe = format!("kubectl describe sidecarrelease {name}");
    let version = &r.spec.version;
    let Some(status) = &r.status else {
        return Check::warning(
            label,
            format!("no status yet for version {version}"),
            "the operator writes it: kubectl -n baton-system get deployment baton-operator",
        );
    };
    let progress = format!("{}/{} pods updated", status.updated, status.total);
    let conditions = &status.conditions;
    if let Some(c) = condition(conditions, cond::DEGRADED) {
        return Check::failure(
            label,
            format!("Degraded ({}), {progress}", why(c)),
            format!("{describe}; to go back: kubectl baton rollback {name}"),
        );
    }
    let word = status.rollout.as_deref().unwrap_or_default();
    let complete = condition(conditions, cond::COMPLETE).is_some();
    if let Some(c) = condition(conditions, cond::PAUSED).filter(|_| !complete) {
        return Check::failure(
            label,
            format!("Paused ({}), {progress}", why(c)),
            format!("kubectl baton resume {name}, or kubectl baton rollback {name}"),
        );
    }
    match word {
        "Complete" => Check::ok(label, format!("version {version} complete, {progress}")),
        "Held" => Check::warning(
            label,
            format!("rollout to {version} held, {progress}"),
            format!("{describe} (a partition or canary selector holds the rest)"),
        ),
        "Invalid" => Check::failure(
            label,
            format!("invalid spec for version {version}"),
            describe,
        ),
        // RollingOut, or a status written before the `rollout` word existed.
        _ if complete => Check::ok(label, format!("version {version} complete, {progress}")),
        _ => Check::warning(
            label,
            format!("rolling out to {version}, {progress}"),
            format!("{describe}, or follow it with kubectl baton status"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::Status;
    use serde_json::json;

    fn sr(rollout: Option<&str>, conditions: serde_json::Value) -> SidecarRelease {
        let mut v = json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease",
            "metadata": {"name": "default"},
            "spec": {"version": "1.2.0", "image": "baton/sidecar:1.2.0"},
        });
        if let Some(word) = rollout {
            v["status"] = json!({"total": 4, "updated": 2, "rollout": word,
                                 "conditions": conditions});
        }
        serde_json::from_value(v).unwrap()
    }

    fn c(type_: &str, reason: &str, message: &str) -> serde_json::Value {
        json!({"type": type_, "status": "True", "reason": reason, "message": message,
               "lastTransitionTime": "2024-01-01T00:00:00Z"})
    }

    #[test]
    fn a_complete_release_is_ok_with_its_version() {
        let r = sr(
            Some("Complete"),
            json!([c("Complete", "AllPodsUpdated", "")]),
        );
        let check = release(&r);
        assert_eq!(check.status, Status::Ok);
        assert_eq!(check.name, "SidecarRelease default");
        assert_eq!(
            check.detail.as_deref(),
            Some("version 1.2.0 complete, 2/4 pods updated")
        );
    }

    #[test]
    fn a_rollout_under_way_or_held_warns_with_progress() {
        let check = release(&sr(Some("RollingOut"), json!([])));
        assert_eq!(check.status, Status::Warning);
        assert_eq!(
            check.detail.as_deref(),
            Some("rolling out to 1.2.0, 2/4 pods updated")
        );
        assert!(
            check
                .hint
                .unwrap()
                .starts_with("kubectl describe sidecarrelease default")
        );
        let check = release(&sr(
            Some("Held"),
            json!([c("Complete", "PartitionHeld", "")]),
        ));
        assert_eq!(check.status, Status::Warning);
        assert_eq!(
            check.detail.as_deref(),
            Some("rollout to 1.2.0 held, 2/4 pods updated")
        );
    }

    #[test]
    fn a_paused_release_fails_with_reason_and_message() {
        let r = sr(
            Some("Paused"),
            json!([c(
                "Paused",
                "FailureThresholdExceeded",
                "3 pods failed their handoff"
            )]),
        );
        let check = release(&r);
        assert_eq!(check.status, Status::Failure);
        assert_eq!(
            check.detail.as_deref(),
            Some(
                "Paused (FailureThresholdExceeded: 3 pods failed their handoff), 2/4 pods updated"
            )
        );
        assert_eq!(
            check.hint.as_deref(),
            Some("kubectl baton resume default, or kubectl baton rollback default")
        );
    }

    #[test]
    fn a_degraded_release_fails_even_when_complete() {
        let r = sr(
            Some("Complete"),
            json!([
                c("Complete", "AllPodsUpdated", ""),
                c("Degraded", "PodsNotReady", "1 pod not ready")
            ]),
        );
        let check = release(&r);
        assert_eq!(check.status, Status::Failure);
        assert!(
            check
                .detail
                .unwrap()
                .starts_with("Degraded (PodsNotReady: 1 pod not ready)")
        );
        assert!(
            check
                .hint
                .unwrap()
                .contains("kubectl baton rollback default")
        );
    }

    #[test]
    fn an_invalid_or_unobserved_release_is_reported() {
        assert_eq!(
            release(&sr(Some("Invalid"), json!([]))).status,
            Status::Failure
        );
        let check = release(&sr(None, json!([])));
        assert_eq!(check.status, Status::Warning);
        assert!(check.hint.unwrap().contains("baton-operator"));
    }

    #[test]
    fn no_release_warns_with_the_example_and_an_unlistable_kind_fails() {
        let checks = releases(&Got::Found(vec![]));
        assert_eq!(checks[0].status, Status::Warning);
        assert_eq!(checks[0].hint.as_deref(), Some(EXAMPLE));
        let checks = releases(&Got::Unreadable("403 Forbidden: no".into()));
        assert_eq!(checks[0].status, Status::Failure);
        let checks = releases(&Got::Found(vec![
            sr(Some("Complete"), json!([])),
            sr(None, json!([])),
        ]));
        assert_eq!(checks.len(), 2);
    }
}
