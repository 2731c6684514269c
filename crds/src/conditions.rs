//! Status conditions: the types and reasons each kind reports, and a pure
//! upsert that keeps `lastTransitionTime` stable while the status is unchanged
//! (so `kubectl get` shows how long a condition has held, and server-side
//! apply of an unchanged status is a no-op).
//!
//! Conditions are the standard `metav1.Condition` (type, status, reason,
//! message, observedGeneration, lastTransitionTime).

pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// `status` values of a condition.
pub const TRUE: &str = "True";
pub const FALSE: &str = "False";
pub const UNKNOWN: &str = "Unknown";

pub mod sidecar_release {
    //! SidecarRelease conditions. Exactly one of Progressing/Complete is True
    //! at a time; Degraded and Paused are orthogonal.

    /// Pods are being moved to `spec.version`.
    pub const PROGRESSING: &str = "Progressing";
    /// Every selected pod (outside the partition) runs `spec.version` and is ready.
    pub const COMPLETE: &str = "Complete";
    /// At least one pod failed its handoff or is not ready on the new version.
    pub const DEGRADED: &str = "Degraded";
    /// `spec.upgrade.paused` is set: the operator moves no further pods.
    pub const PAUSED: &str = "Paused";

    pub mod reasons {
        //! Machine-readable `reason` values (CamelCase, stable).
        pub const ROLLING_OUT: &str = "RollingOut";
        pub const ALL_PODS_UPDATED: &str = "AllPodsUpdated";
        pub const PARTITION_HELD: &str = "PartitionHeld";
        pub const NO_PODS_SELECTED: &str = "NoPodsSelected";
        pub const HANDOFF_FAILED: &str = "HandoffFailed";
        pub const PODS_NOT_READY: &str = "PodsNotReady";
        pub const HEALTHY: &str = "Healthy";
        pub const PAUSED_BY_USER: &str = "PausedByUser";
        pub const NOT_PAUSED: &str = "NotPaused";
        pub const INVALID_SPEC: &str = "InvalidSpec";
        /// More pods failed their handoff than `failureThreshold` allows:
        /// the rollout paused itself.
        pub const FAILURE_THRESHOLD: &str = "FailureThresholdExceeded";
        /// Every pod the canary selector allows runs `spec.version`.
        pub const CANARY_HELD: &str = "CanaryHeld";
    }
}

pub mod route {
    //! Route conditions, as in Gateway API.

    /// The Route is valid and attached to its Service port.
    pub const ACCEPTED: &str = "Accepted";
    /// Every referenced Service and port exists.
    pub const RESOLVED_REFS: &str = "ResolvedRefs";
    /// The compiled config reached the sidecars.
    pub const PROGRAMMED: &str = "Programmed";

    pub mod reasons {
        pub const ACCEPTED: &str = "Accepted";
        pub const INVALID: &str = "Invalid";
        pub const NO_MATCHING_PARENT: &str = "NoMatchingParent";
        pub const CONFLICTED: &str = "Conflicted";
        pub const RESOLVED_REFS: &str = "ResolvedRefs";
        pub const BACKEND_NOT_FOUND: &str = "BackendNotFound";
        pub const PROGRAMMED: &str = "Programmed";
        pub const PENDING: &str = "Pending";
    }
}

pub mod tls_policy {
    //! TlsPolicy conditions.

    /// The policy is valid and its certificate source resolves.
    pub const ACCEPTED: &str = "Accepted";
    /// The policy reached the sidecars of the pods it selects.
    pub const PROGRAMMED: &str = "Programmed";

    pub mod reasons {
        pub const ACCEPTED: &str = "Accepted";
        pub const INVALID: &str = "Invalid";
        pub const SECRET_NOT_FOUND: &str = "SecretNotFound";
        pub const OVERLAPPING: &str = "Overlapping";
        pub const PROGRAMMED: &str = "Programmed";
        pub const PENDING: &str = "Pending";
    }
}

pub mod authorization_policy {
    //! AuthorizationPolicy conditions.

    /// The policy is valid (its identities are in this mesh's trust domain).
    pub const ACCEPTED: &str = "Accepted";
    /// The policy reached the sidecars of the pods it selects.
    pub const PROGRAMMED: &str = "Programmed";
    /// Every port name in `spec.ports` is a container port of every Pod
    /// the policy selects.
    pub const RESOLVED_REFS: &str = "ResolvedRefs";

    pub mod reasons {
        pub const ACCEPTED: &str = "Accepted";
        pub const INVALID: &str = "Invalid";
        pub const PROGRAMMED: &str = "Programmed";
        pub const PENDING: &str = "Pending";
        pub const RESOLVED_REFS: &str = "ResolvedRefs";
        /// A selected Pod declares no container port of a listed name.
        pub const UNKNOWN_PORT: &str = "UnknownPort";
    }
}

pub mod accelerator_pool {
    //! AcceleratorPool conditions. Ready and Exhausted describe capacity;
    //! Degraded says the books and the nodes disagree (devices lost) or
    //! granted sidecars cannot be placed.

    /// At least one node of the pool advertises the resource and the spec
    /// is valid: sidecars can be granted devices.
    pub const READY: &str = "Ready";
    /// No node has `devicesPerSidecar` free devices (after pending grants);
    /// new Preferred sidecars fall back to software, Required ones are
    /// refused.
    pub const EXHAUSTED: &str = "Exhausted";
    /// Sidecars hold more devices than a node advertises (device plugin
    /// marked devices unhealthy, node shrank), or granted pods wait
    /// unschedulable for a device.
    pub const DEGRADED: &str = "Degraded";

    pub mod reasons {
        pub const DEVICES_AVAILABLE: &str = "DevicesAvailable";
        pub const NO_NODES: &str = "NoNodes";
        pub const INVALID_SPEC: &str = "InvalidSpec";
        pub const ALL_ALLOCATED: &str = "AllAllocated";
        pub const CAPACITY_LEFT: &str = "CapacityLeft";
        pub const DEVICES_LOST: &str = "DevicesLost";
        pub const UNSCHEDULABLE: &str = "GrantedPodsUnschedulable";
        pub const HEALTHY: &str = "Healthy";
    }
}

/// Inserts or updates the condition `type_` in `conditions`.
///
/// `lastTransitionTime` moves to `now` only when the status changes (or the
/// condition is new); reason, message and observedGeneration always update.
/// Returns whether anything changed, so callers can skip a no-op write.
pub fn upsert(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    observed_generation: Option<i64>,
    now: &Time,
) -> bool {
    let status = if status { TRUE } else { FALSE };
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            let before = c.clone();
            if c.status != status {
                c.status = status.to_owned();
                c.last_transition_time = now.clone();
            }
            c.reason = reason.to_owned();
            c.message = message.to_owned();
            c.observed_generation = observed_generation;
            *c != before
        }
        None => {
            conditions.push(Condition {
                type_: type_.to_owned(),
                status: status.to_owned(),
                reason: reason.to_owned(),
                message: message.to_owned(),
                observed_generation,
                last_transition_time: now.clone(),
            });
            true
        }
    }
}

/// Whether `type_` is present with status `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == TRUE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(secs).unwrap())
    }

    #[test]
    fn upsert_adds_a_missing_condition_with_the_given_time() {
        let mut cs = vec![];
        assert!(upsert(
            &mut cs,
            "Ready",
            true,
            "Ok",
            "fine",
            Some(3),
            &at(10)
        ));
        assert_eq!(cs.len(), 1);
        assert_eq!(cs[0].status, TRUE);
        assert_eq!(cs[0].last_transition_time, at(10));
        assert_eq!(cs[0].observed_generation, Some(3));
    }

    #[test]
    fn upsert_keeps_transition_time_when_status_is_unchanged() {
        let mut cs = vec![];
        upsert(&mut cs, "Ready", true, "Ok", "fine", Some(1), &at(10));
        assert!(upsert(
            &mut cs,
            "Ready",
            true,
            "Ok",
            "still fine",
            Some(2),
            &at(20)
        ));
        assert_eq!(cs[0].last_transition_time, at(10));
        assert_eq!(cs[0].message, "still fine");
        assert_eq!(cs[0].observed_generation, Some(2));
    }

    #[test]
    fn upsert_moves_transition_time_when_status_flips() {
        let mut cs = vec![];
        upsert(&mut cs, "Ready", true, "Ok", "fine", None, &at(10));
        upsert(&mut cs, "Ready", false, "Broken", "bad", None, &at(20));
        assert_eq!(cs[0].status, FALSE);
        assert_eq!(cs[0].reason, "Broken");
        assert_eq!(cs[0].last_transition_time, at(20));
    }

    #[test]
    fn upsert_reports_no_change_for_an_identical_condition() {
        let mut cs = vec![];
        upsert(&mut cs, "Ready", true, "Ok", "fine", Some(1), &at(10));
        assert!(!upsert(
            &mut cs,
            "Ready",
            true,
            "Ok",
            "fine",
            Some(1),
            &at(99)
        ));
        assert_eq!(cs[0].last_transition_time, at(10));
    }

    #[test]
    fn upsert_touches_only_the_named_condition() {
        let mut cs = vec![];
        upsert(&mut cs, "A", true, "r", "m", None, &at(1));
        upsert(&mut cs, "B", false, "r", "m", None, &at(2));
        upsert(&mut cs, "B", true, "r", "m", None, &at(3));
        assert_eq!(cs.len(), 2);
        assert!(is_true(&cs, "A") && is_true(&cs, "B"));
        assert_eq!(cs[0].last_transition_time, at(1));
        assert!(!is_true(&cs, "C"));
    }
}
