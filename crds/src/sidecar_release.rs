//! `SidecarRelease` (cluster-scoped): which sidecar version the webhook
//! injects into which pods, and how the operator rolls a new version out to
//! running pods (hot upgrade through the standby slot, or recreate).
//!
//! Modelled on Kruise `SidecarSet` (selectors, `updateStrategy` with
//! `partition`, `maxUnavailable`, `paused`) and Istio revisions (`version`).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::selector;
use crate::validation::{Errors, FieldError, Validate};

/// Which sidecar version runs in which pods, and how upgrades roll out.
// Each printcolumn(...) repeats `type_ = ...`; clippy reads that as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "baton.dev",
    doc = "SidecarRelease: which sidecar version Baton injects into which pods, and how running pods are upgraded to it.",
    version = "v1alpha1",
    kind = "SidecarRelease",
    status = "SidecarReleaseStatus",
    shortname = "sr",
    category = "baton",
    derive = "PartialEq",
    printcolumn(
        name = "Version",
        type_ = "string",
        json_path = ".spec.version",
        description = "Sidecar version injected and rolled out"
    ),
    printcolumn(
        name = "Strategy",
        type_ = "string",
        json_path = ".spec.upgrade.strategy",
        description = "HotUpgrade or Recreate"
    ),
    printcolumn(
        name = "Total",
        type_ = "integer",
        json_path = ".status.total",
        description = "Pods selected"
    ),
    printcolumn(
        name = "Updated",
        type_ = "integer",
        json_path = ".status.updated",
        description = "Pods running spec.version"
    ),
    printcolumn(
        name = "Ready",
        type_ = "integer",
        json_path = ".status.ready",
        description = "Pods whose sidecar is ready"
    ),
    printcolumn(
        name = "Failed",
        type_ = "integer",
        json_path = ".status.failed",
        description = "Pods whose handoff to spec.version failed"
    ),
    printcolumn(
        name = "Rollout",
        type_ = "string",
        json_path = ".status.rollout",
        description = "Rollout state at a glance: RollingOut, Complete, Paused, Degraded, Held"
    ),
    printcolumn(
        name = "Paused",
        type_ = "boolean",
        json_path = ".spec.upgrade.paused",
        priority = 1,
        description = "Rollout paused"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("self.upgrade.strategy != 'HotUpgrade' || has(self.emptyImage)").message("upgrade.strategy HotUpgrade needs emptyImage (the idle image of the standby slot): set emptyImage or use strategy Recreate"))]
#[serde(rename_all = "camelCase")]
pub struct SidecarReleaseSpec {
    /// Version of the sidecar, recorded on every injected pod
    /// (annotation `baton.dev/version`) and counted in status. Changing it
    /// starts a rollout.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
    )]
    pub version: String,

    /// Container image of the sidecar at `version`.
    #[schemars(length(min = 1, max = 512))]
    pub image: String,

    /// Image the standby slot idles in until a hot upgrade swaps the new
    /// sidecar into it. Required for strategy HotUpgrade.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub empty_image: Option<String>,

    /// Namespaces whose pods this release covers. Absent selects every
    /// namespace that opted in with the label `baton.dev/inject=enabled`
    /// (namespaces kube-system, kube-public and baton-system never are).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,

    /// Pods (within the selected namespaces) this release covers.
    /// Absent selects every pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,

    /// When several releases select a pod, the highest priority wins; ties go
    /// to the alphabetically first name.
    #[serde(default)]
    #[schemars(range(min = -1000, max = 1000))]
    pub priority: i32,

    /// Resource requests and limits of each sidecar slot. Both slots get
    /// the same (and the granted devices): an upgrade hands the serving
    /// role to the other slot, so whichever serves has the release's
    /// resources; the idle slot's requests are reserved, unused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// How running pods move to a new `version`.
    #[serde(default)]
    pub upgrade: UpgradeSpec,
}

/// How running pods move to a new version.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[x_kube(validation = Rule::new("string(self.maxUnavailable).matches('^([1-9][0-9]*|([1-9][0-9]?|100)%)$')").message("maxUnavailable must be an integer >= 1 or a percentage between 1% and 100%"))]
#[serde(rename_all = "camelCase")]
pub struct UpgradeSpec {
    /// HotUpgrade: start the new sidecar in the standby slot and hand the
    /// listening sockets and live connections over without restarting the
    /// pod. Recreate: new pods get the new version; existing pods are evicted
    /// (respecting PodDisruptionBudgets) so their controllers recreate them.
    #[serde(default)]
    pub strategy: UpgradeStrategy,

    /// Pods upgraded at the same time: an integer, or a percentage of the
    /// selected pods (rounded up, at least 1). Default 1.
    #[serde(default = "default_max_unavailable")]
    pub max_unavailable: IntOrString,

    /// Number of selected pods kept on their current version (a canary
    /// hold): the operator upgrades only `total - partition` pods. 0 upgrades
    /// all.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub partition: i32,

    /// Stop moving pods; pods already mid-handoff finish. New pods still get
    /// `version`.
    #[serde(default)]
    pub paused: bool,

    /// Seconds a handoff may take before the operator gives up on the pod,
    /// leaves the old sidecar serving and marks the release Degraded.
    #[serde(default = "default_handoff_timeout")]
    #[schemars(range(min = 1, max = 3600))]
    pub handoff_timeout_seconds: i32,

    /// Canary: when set, only selected pods that also match this selector
    /// move to `version`; the others keep theirs until the selector is
    /// widened or removed (Kruise `SidecarSet.updateStrategy.selector`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary_selector: Option<LabelSelector>,

    /// Pods whose handoff to `version` may fail before the rollout pauses
    /// itself (Degraded and Paused, reason FailureThresholdExceeded): it
    /// pauses once more than this many have failed. 0 pauses at the first
    /// failure.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub failure_threshold: i32,
}

impl Default for UpgradeSpec {
    fn default() -> Self {
        Self {
            strategy: UpgradeStrategy::default(),
            max_unavailable: default_max_unavailable(),
            partition: 0,
            paused: false,
            handoff_timeout_seconds: default_handoff_timeout(),
            canary_selector: None,
            failure_threshold: 0,
        }
    }
}

fn default_max_unavailable() -> IntOrString {
    IntOrString::Int(1)
}

fn default_handoff_timeout() -> i32 {
    30
}

/// Upgrade strategy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum UpgradeStrategy {
    /// Swap the sidecar in place through the standby slot; the pod keeps
    /// running and keeps its connections.
    #[default]
    HotUpgrade,
    /// Replace pods to change their sidecar.
    Recreate,
}

/// Observed rollout state.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SidecarReleaseStatus {
    /// `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Pods this release selects.
    #[serde(default)]
    pub total: i32,
    /// Selected pods whose serving sidecar runs `spec.version`.
    #[serde(default)]
    pub updated: i32,
    /// Selected pods whose serving sidecar is ready (any version).
    #[serde(default)]
    pub ready: i32,
    /// Selected pods whose last handoff failed or whose sidecar crashed.
    #[serde(default)]
    pub failed: i32,
    /// Pod counts per sidecar version currently serving.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub versions: Vec<VersionCount>,
    /// Pods mid-handoff (standby slot started on `spec.version`) or evicted
    /// and not yet replaced.
    #[serde(default)]
    pub in_flight: i32,
    /// One word for `kubectl get`: `RollingOut`, `Complete`, `Held`
    /// (partition or canary), `Paused`, `Degraded` or `Invalid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<String>,
    /// Pods whose handoff to `spec.version` failed, with the reason (at
    /// most 10, by name).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed_pods: Vec<FailedPod>,
    /// Pods deleted while their handoff to `spec.version` was in flight
    /// (most recent first, at most 10). The rollout continues without them;
    /// also a `HandoffInterrupted` Event on the release.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interrupted_pods: Vec<InterruptedPod>,
    /// Progressing, Complete, Degraded, Paused.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Versions every selected pod reached (Complete, AllPodsUpdated or
    /// NoPodsSelected), newest first, each once, at most 10: what
    /// `kubectl baton rollback` returns to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<ReleaseRevision>,
}

/// A version the release completed a rollout to.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseRevision {
    /// `spec.version` then.
    pub version: String,
    /// `spec.image` then.
    pub image: String,
    /// `spec.emptyImage` then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub empty_image: Option<String>,
}

/// How many completed versions `status.history` keeps.
pub const HISTORY_LIMIT: usize = 10;

/// `history` after a rollout to `spec` completed: `spec` first, each
/// version once, at most [`HISTORY_LIMIT`].
pub fn history_after(
    history: &[ReleaseRevision],
    spec: &SidecarReleaseSpec,
) -> Vec<ReleaseRevision> {
    let now = ReleaseRevision {
        version: spec.version.clone(),
        image: spec.image.clone(),
        empty_image: spec.empty_image.clone(),
    };
    std::iter::once(now)
        .chain(
            history
                .iter()
                .filter(|r| r.version != spec.version)
                .cloned(),
        )
        .take(HISTORY_LIMIT)
        .collect()
}

impl SidecarReleaseStatus {
    /// The newest completed version other than `current`: where a rollback
    /// goes.
    pub fn previous(&self, current: &str) -> Option<&ReleaseRevision> {
        self.history.iter().find(|r| r.version != current)
    }
}

/// A pod deleted while its handoff was in flight.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InterruptedPod {
    /// `namespace/name`.
    pub pod: String,
    /// Version the handoff was moving to.
    pub version: String,
    /// What happened (the operator's words; also in the release's Events).
    pub message: String,
}

/// A pod whose handoff failed, and why.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailedPod {
    /// `namespace/name`.
    pub pod: String,
    /// Version the handoff was moving to.
    pub version: String,
    /// Why it failed (the operator's words; also in the pod's Events).
    pub reason: String,
}

/// Pods serving one sidecar version.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VersionCount {
    /// Sidecar version.
    pub version: String,
    /// Pods whose serving sidecar runs this version.
    pub total: i32,
    /// Of those, pods whose sidecar is ready.
    pub ready: i32,
    /// Of those, pods whose last handoff to or from this version failed.
    pub failed: i32,
}

impl SidecarRelease {
    /// Whether this release covers a pod with `pod_labels` in a namespace
    /// with `ns_labels`. Opt-in/opt-out labels and the never-inject
    /// namespaces are the webhook's concern; this is selectors only.
    pub fn selects(
        &self,
        ns_labels: &BTreeMap<String, String>,
        pod_labels: &BTreeMap<String, String>,
    ) -> bool {
        selector::matches_opt(self.spec.namespace_selector.as_ref(), ns_labels)
            && selector::matches_opt(self.spec.pod_selector.as_ref(), pod_labels)
    }

    /// The release that governs a pod among `releases`: highest priority
    /// among those that select it, ties broken by name.
    pub fn pick<'a>(
        releases: impl IntoIterator<Item = &'a SidecarRelease>,
        ns_labels: &BTreeMap<String, String>,
        pod_labels: &BTreeMap<String, String>,
    ) -> Option<&'a SidecarRelease> {
        releases
            .into_iter()
            .filter(|r| r.selects(ns_labels, pod_labels))
            .min_by(|a, b| {
                b.spec
                    .priority
                    .cmp(&a.spec.priority)
                    .then_with(|| a.metadata.name.cmp(&b.metadata.name))
            })
    }
}

/// Resolves `maxUnavailable` against `total` selected pods: percentages
/// round up, and the result is at least 1 so a rollout always progresses.
/// `None` when the value is malformed.
pub fn resolve_max_unavailable(value: &IntOrString, total: i32) -> Option<i32> {
    let n = match value {
        IntOrString::Int(n) if *n >= 1 => *n,
        IntOrString::Int(_) => return None,
        IntOrString::String(s) => {
            let pct: i64 = s.strip_suffix('%')?.parse().ok()?;
            if !(1..=100).contains(&pct) || s.starts_with('+') || s.starts_with('0') {
                return None;
            }
            let t = i64::from(total.max(0));
            i32::try_from((t * pct + 99) / 100).ok()?
        }
    };
    Some(n.max(1))
}

impl Validate for SidecarRelease {
    fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut e = Errors::default();
        let s = &self.spec;
        if s.version.is_empty()
            || s.version.len() > 63
            || !s.version.starts_with(|c: char| c.is_ascii_alphanumeric())
            || !s
                .version
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._+-".contains(c))
        {
            e.push(
                "spec.version",
                format!(
                    "{:?} is not a version: use 1-63 letters, digits, '.', '_', '+' or '-', starting with a letter or digit",
                    s.version
                ),
            );
        }
        if s.image.trim().is_empty() {
            e.push("spec.image", "must name the sidecar image");
        }
        match &s.empty_image {
            Some(img) if img.trim().is_empty() => {
                e.push("spec.emptyImage", "must name an image or be omitted")
            }
            None if s.upgrade.strategy == UpgradeStrategy::HotUpgrade => e.push(
                "spec.emptyImage",
                "upgrade.strategy HotUpgrade needs emptyImage (the idle image of the standby slot): set emptyImage or use strategy Recreate",
            ),
            _ => {}
        }
        if let Some(sel) = &s.namespace_selector {
            selector::check(&mut e, "spec.namespaceSelector", sel);
        }
        if let Some(sel) = &s.pod_selector {
            selector::check(&mut e, "spec.podSelector", sel);
        }
        if !(-1000..=1000).contains(&s.priority) {
            e.push("spec.priority", "must be between -1000 and 1000");
        }
        let u = &s.upgrade;
        if resolve_max_unavailable(&u.max_unavailable, 100).is_none() {
            e.push(
                "spec.upgrade.maxUnavailable",
                "must be an integer >= 1 or a percentage between 1% and 100%",
            );
        }
        if u.partition < 0 {
            e.push(
                "spec.upgrade.partition",
                "must be >= 0 (the number of pods kept on their current version)",
            );
        }
        if let Some(sel) = &u.canary_selector {
            selector::check(&mut e, "spec.upgrade.canarySelector", sel);
        }
        if u.failure_threshold < 0 {
            e.push(
                "spec.upgrade.failureThreshold",
                "must be >= 0 (failed pods tolerated before the rollout pauses)",
            );
        }
        if !(1..=3600).contains(&u.handoff_timeout_seconds) {
            e.push(
                "spec.upgrade.handoffTimeoutSeconds",
                "must be between 1 and 3600 seconds",
            );
        }
        e.into_result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn release(
        name: &str,
        priority: i32,
        ns: Option<LabelSelector>,
        pod: Option<LabelSelector>,
    ) -> SidecarRelease {
        SidecarRelease::new(
            name,
            SidecarReleaseSpec {
                version: "1.0.0".into(),
                image: "sidecar:1.0.0".into(),
                empty_image: Some("empty:1".into()),
                namespace_selector: ns,
                pod_selector: pod,
                priority,
                resources: None,
                upgrade: UpgradeSpec::default(),
            },
        )
    }

    fn match_labels(pairs: &[(&str, &str)]) -> Option<LabelSelector> {
        Some(LabelSelector {
            match_labels: Some(labels(pairs)),
            match_expressions: None,
        })
    }

    #[test]
    fn a_release_without_selectors_selects_every_pod() {
        let r = release("all", 0, None, None);
        assert!(r.selects(&labels(&[]), &labels(&[])));
    }

    #[test]
    fn selects_requires_both_the_namespace_and_the_pod_selector() {
        let r = release(
            "r",
            0,
            match_labels(&[("team", "a")]),
            Some(LabelSelector {
                match_labels: None,
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: "app".into(),
                    operator: "In".into(),
                    values: Some(vec!["web".into(), "api".into()]),
                }]),
            }),
        );
        let team_a = labels(&[("team", "a")]);
        assert!(r.selects(&team_a, &labels(&[("app", "api")])));
        assert!(!r.selects(&team_a, &labels(&[("app", "db")])));
        assert!(!r.selects(&labels(&[("team", "b")]), &labels(&[("app", "web")])));
    }

    #[test]
    fn pick_prefers_the_highest_priority_release_that_selects_the_pod() {
        let rs = [
            release("low", 0, None, None),
            release("high", 10, None, None),
            release(
                "higher-but-elsewhere",
                20,
                match_labels(&[("team", "x")]),
                None,
            ),
        ];
        let got = SidecarRelease::pick(&rs, &labels(&[]), &labels(&[]));
        assert_eq!(got.and_then(|r| r.metadata.name.as_deref()), Some("high"));
    }

    #[test]
    fn pick_breaks_priority_ties_by_name() {
        let rs = [release("b", 5, None, None), release("a", 5, None, None)];
        let got = SidecarRelease::pick(&rs, &labels(&[]), &labels(&[]));
        assert_eq!(got.and_then(|r| r.metadata.name.as_deref()), Some("a"));
    }

    #[test]
    fn pick_returns_none_when_no_release_selects_the_pod() {
        let rs = [release("r", 0, None, match_labels(&[("app", "web")]))];
        assert!(SidecarRelease::pick(&rs, &labels(&[]), &labels(&[("app", "db")])).is_none());
    }

    #[test]
    fn max_unavailable_integers_are_used_as_is() {
        assert_eq!(resolve_max_unavailable(&IntOrString::Int(3), 10), Some(3));
        assert_eq!(resolve_max_unavailable(&IntOrString::Int(30), 10), Some(30));
    }

    #[test]
    fn max_unavailable_percentages_round_up_and_are_at_least_one() {
        let pct = |s: &str| IntOrString::String(s.into());
        assert_eq!(resolve_max_unavailable(&pct("25%"), 10), Some(3));
        assert_eq!(resolve_max_unavailable(&pct("100%"), 7), Some(7));
        assert_eq!(resolve_max_unavailable(&pct("1%"), 10), Some(1));
        assert_eq!(resolve_max_unavailable(&pct("50%"), 0), Some(1));
    }

    #[test]
    fn malformed_max_unavailable_resolves_to_none() {
        for bad in ["0%", "101%", "10", "abc", "%", "+5%", "05%", "-5%"] {
            assert_eq!(
                resolve_max_unavailable(&IntOrString::String(bad.into()), 10),
                None,
                "{bad}"
            );
        }
        assert_eq!(resolve_max_unavailable(&IntOrString::Int(0), 10), None);
        assert_eq!(resolve_max_unavailable(&IntOrString::Int(-1), 10), None);
    }

    #[test]
    fn default_upgrade_spec_is_hot_upgrade_one_at_a_time() {
        let u = UpgradeSpec::default();
        assert_eq!(u.strategy, UpgradeStrategy::HotUpgrade);
        assert_eq!(u.max_unavailable, IntOrString::Int(1));
        assert_eq!(
            (u.partition, u.paused, u.handoff_timeout_seconds),
            (0, false, 30)
        );
    }

    #[test]
    fn a_release_parsed_from_yaml_gets_the_same_defaults() {
        let r: SidecarRelease = crate::yaml::from_str(
            "apiVersion: baton.dev/v1alpha1\nkind: SidecarRelease\nmetadata: {name: r}\nspec: {version: '1', image: i, emptyImage: e}\n",
        )
        .unwrap();
        assert_eq!(r.spec.upgrade, UpgradeSpec::default());
        assert_eq!(r.spec.priority, 0);
    }
}
