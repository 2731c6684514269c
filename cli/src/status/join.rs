//! The pure heart of `status`: Pods, releases and the operator replicas'
//! reports joined into one row per Pod and one summary per release.

use std::collections::{BTreeMap, HashMap};

use baton_crds::contract::{annotations, containers, labels};
use baton_crds::sidecars::{Sidecar, Sync};
use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Serialize};

use super::fetch::Fetched;

/// The whole answer (also the JSON / YAML document).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    pub pods: Vec<PodRow>,
    pub releases: Vec<ReleaseSummary>,
    pub reports: Coverage,
}

/// How many operator replicas answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Coverage {
    /// Running operator replicas.
    pub replicas: usize,
    /// Of those, the ones whose report was read.
    pub answered: usize,
    /// Every replica answered: a Pod absent from every report was sent
    /// nothing (NOT SENT), and has no certificate.
    pub complete: bool,
}

/// One injected Pod.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodRow {
    pub namespace: String,
    pub name: String,
    /// SidecarRelease (annotation, else label, `baton.dev/release`).
    pub release: Option<String>,
    /// Sidecar version of the serving slot (`baton.dev/version`).
    pub version: Option<String>,
    /// Serving slot, `a` or `b` (`baton.dev/active-slot`).
    pub slot: Option<String>,
    /// Config sync; `null` when no replica that answered holds a stream
    /// for the Pod and some replica did not answer (unknown).
    pub config: Option<Sync>,
    /// The last NACK's error (a STALE sidecar refused the newest config).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config_error: Option<String>,
    /// Generation sent on the Pod's stream, and the one it ACKed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config_sent: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config_acked: Option<u64>,
    /// Expiry (unix seconds) of the newest certificate issued to the Pod.
    pub certificate_not_after: Option<i64>,
    /// Seconds until that expiry (negative: expired).
    pub certificate_expires_in: Option<i64>,
    /// The last completed hot upgrade (`baton.dev/last-handoff`).
    pub last_handoff: Option<Handoff>,
    /// A hot upgrade in flight (`baton.dev/upgrade`).
    pub upgrade: Option<Upgrade>,
    /// The last failed hot upgrade (`baton.dev/upgrade-failed`).
    pub upgrade_failed: Option<Failure>,
    /// Restarts of the application's containers (every container but
    /// Baton's, native sidecars and init containers included).
    pub restarts: i32,
}

/// `baton.dev/last-handoff`, read leniently (an unreadable annotation has
/// version `?`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Handoff {
    pub version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_at: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// Seconds since `finishedAt` (else `startedAt`), at the time of the query.
    #[serde(skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub seconds_ago: Option<i64>,
}

/// `baton.dev/upgrade`, read leniently.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Upgrade {
    pub version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_at: Option<i64>,
}

/// `baton.dev/upgrade-failed`, read leniently.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Failure {
    pub version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at: Option<i64>,
}

/// One release, over the Pods listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseSummary {
    pub name: String,
    /// `spec.version`; `null` when the release was not found (or releases
    /// could not be listed).
    pub spec_version: Option<String>,
    /// `status.rollout`: RollingOut, Complete, Held, Paused, Degraded, Invalid.
    pub rollout: Option<String>,
    /// Listed Pods following the release.
    pub pods: usize,
    /// Those Pods per serving version (`?`: no version annotation).
    pub versions: BTreeMap<String, usize>,
    pub synced: usize,
    pub stale: usize,
    pub not_sent: usize,
    /// Config sync unknown (a replica did not answer).
    pub unknown: usize,
    /// Pods with an upgrade in flight.
    pub upgrading: usize,
    /// Pods whose last upgrade failed.
    pub failed: usize,
}

/// Joins at `now` (unix seconds). `all_releases`: list every release, even
/// those with no Pod in the listing (`-A`); otherwise only those with Pods.
pub fn join(fetched: &Fetched, now: i64, all_releases: bool) -> Status {
    let reports = &fetched.reports;
    let complete = reports.complete();
    // The best stream per Pod: Synced over a NACK over any other.
    let mut streams: HashMap<&str, &Sidecar> = HashMap::new();
    let mut certs: HashMap<&str, i64> = HashMap::new();
    for report in &reports.reports {
        for s in &report.sidecars {
            streams
                .entry(s.pod.as_str())
                .and_modify(|best| {
                    if rank(s) > rank(best) {
                        *best = s;
                    }
                })
                .or_insert(s);
        }
        for c in &report.certificates {
            certs
                .entry(c.pod.as_str())
                .and_modify(|t| *t = (*t).max(c.not_after))
                .or_insert(c.not_after);
        }
    }

    let mut pods: Vec<PodRow> = fetched
        .pods
        .iter()
        .map(|pod| {
            let namespace = pod.metadata.namespace.clone().unwrap_or_default();
            let name = pod.metadata.name.clone().unwrap_or_default();
            let key = format!("{namespace}/{name}");
            let stream = streams.get(key.as_str()).copied();
            let config = match stream {
                Some(s) => Some(s.sync()),
                None if complete => Some(Sync::NotSent),
                None => None,
            };
            let not_after = certs.get(key.as_str()).copied();
            row(pod, namespace, name, now, config, stream, not_after)
        })
        .collect();
    pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));

    let mut summaries: BTreeMap<String, ReleaseSummary> = BTreeMap::new();
    let blank = |name: &str| ReleaseSummary {
        name: name.to_owned(),
        spec_version: None,
        rollout: None,
        pods: 0,
        versions: BTreeMap::new(),
        synced: 0,
        stale: 0,
        not_sent: 0,
        unknown: 0,
        upgrading: 0,
        failed: 0,
    };
    for r in fetched.releases.iter().flatten() {
        let name = r.metadata.name.clone().unwrap_or_default();
        let mut s = blank(&name);
        s.spec_version = Some(r.spec.version.clone());
        s.rollout = r.status.as_ref().and_then(|st| st.rollout.clone());
        summaries.insert(name, s);
    }
    for p in &pods {
        let name = p.release.as_deref().unwrap_or("?");
        let s = summaries
            .entry(name.to_owned())
            .or_insert_with(|| blank(name));
        s.pods += 1;
        *s.versions
            .entry(p.version.clone().unwrap_or_else(|| "?".into()))
            .or_default() += 1;
        match p.config {
            Some(Sync::Synced) => s.synced += 1,
            Some(Sync::Stale) => s.stale += 1,
            Some(Sync::NotSent) => s.not_sent += 1,
            None => s.unknown += 1,
        }
        s.upgrading += usize::from(p.upgrade.is_some());
        s.failed += usize::from(p.upgrade_failed.is_some());
    }
    let releases = summaries
        .into_values()
        .filter(|s| all_releases || s.pods > 0)
        .collect();

    Status {
        pods,
        releases,
        reports: Coverage {
            replicas: reports.replicas,
            answered: reports.reports.len(),
            complete,
        },
    }
}

fn rank(s: &Sidecar) -> u8 {
    match (s.sync(), &s.nack) {
        (Sync::Synced, _) => 2,
        (_, Some(_)) => 1,
        _ => 0,
    }
}

fn row(
    pod: &Pod,
    namespace: String,
    name: String,
    now: i64,
    config: Option<Sync>,
    stream: Option<&Sidecar>,
    not_after: Option<i64>,
) -> PodRow {
    let meta = &pod.metadata;
    let annotation = |key: &str| meta.annotations.as_ref().and_then(|a| a.get(key));
    let release = annotation(annotations::RELEASE)
        .or_else(|| meta.labels.as_ref().and_then(|l| l.get(labels::RELEASE)))
        .cloned();
    let last_handoff = annotation(annotations::LAST_HANDOFF).map(|v| {
        let mut h: Handoff = lenient(v);
        h.seconds_ago = h.finished_at.or(h.started_at).map(|t| now - t);
        h
    });
    PodRow {
        namespace,
        name,
        release,
        version: annotation(annotations::VERSION).cloned(),
        slot: annotation(annotations::ACTIVE_SLOT).cloned(),
        config,
        config_error: stream.and_then(|s| s.nack.clone()),
        config_sent: stream.map(|s| s.sent),
        config_acked: stream.and_then(|s| s.acked),
        certificate_not_after: not_after,
        certificate_expires_in: not_after.map(|t| t - now),
        last_handoff,
        upgrade: annotation(annotations::UPGRADE).map(|v| lenient(v)),
        upgrade_failed: annotation(annotations::UPGRADE_FAILED).map(|v| lenient(v)),
        restarts: app_restarts(pod),
    }
}

/// The annotation's record; one that does not parse has version `?`.
trait Versioned: Default + for<'de> Deserialize<'de> {
    fn unknown() -> Self;
    fn version(&self) -> &str;
}

macro_rules! versioned {
    ($($t:ty),*) => {$(
        impl Versioned for $t {
            fn unknown() -> Self {
                Self { version: "?".into(), ..Self::default() }
            }
            fn version(&self) -> &str {
                &self.version
            }
        }
    )*};
}
versioned!(Handoff, Upgrade, Failure);

fn lenient<T: Versioned>(value: &str) -> T {
    match serde_json::from_str::<T>(value) {
        Ok(record) if !record.version().is_empty() => record,
        _ => T::unknown(),
    }
}

/// Restarts of every container that is not Baton's (slots and init).
pub fn app_restarts(pod: &Pod) -> i32 {
    let Some(status) = &pod.status else { return 0 };
    status
        .container_statuses
        .iter()
        .flatten()
        .chain(status.init_container_statuses.iter().flatten())
        .filter(|c| {
            ![containers::SLOT_A, containers::SLOT_B, containers::INIT].contains(&c.name.as_str())
        })
        .map(|c| c.restart_count)
        .sum()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::status::fetch::Reports;
    use baton_crds::SidecarRelease;
    use baton_crds::sidecars::{Certificate, Report};
    use serde_json::json;

    pub const NOW: i64 = 1_800_000_000;

    /// An injected Pod with `annotations`, its containers (`(name,
    /// restarts)`) and init containers.
    pub fn pod(
        ns: &str,
        name: &str,
        annotations: serde_json::Value,
        containers: &[(&str, i32)],
        init: &[(&str, i32)],
    ) -> Pod {
        let statuses = |list: &[(&str, i32)]| {
            list.iter()
                .map(|(n, r)| json!({"name": n, "restartCount": r, "ready": true, "image": "i", "imageID": ""}))
                .collect::<Vec<_>>()
        };
        serde_json::from_value(json!({
            "metadata": {"namespace": ns, "name": name,
                         "labels": {"baton.dev/injected": "true"},
                         "annotations": annotations},
            "status": {"containerStatuses": statuses(containers),
                       "initContainerStatuses": statuses(init)}
        }))
        .unwrap()
    }

    pub fn basic(ns: &str, name: &str) -> Pod {
        pod(
            ns,
            name,
            json!({"baton.dev/release": "default", "baton.dev/version": "v1", "baton.dev/active-slot": "a"}),
            &[("app", 0), ("baton-sidecar-a", 0), ("baton-sidecar-b", 0)],
            &[],
        )
    }

    pub fn stream(pod: &str, sent: u64, acked: Option<u64>, nack: Option<&str>) -> Sidecar {
        Sidecar {
            pod: pod.into(),
            sent,
            acked,
            nack: nack.map(Into::into),
        }
    }

    pub fn report(sidecars: Vec<Sidecar>, certificates: Vec<(&str, i64)>) -> Report {
        Report {
            config_push: true,
            sidecars,
            certificates: certificates
                .into_iter()
                .map(|(pod, not_after)| Certificate {
                    pod: pod.into(),
                    not_after,
                })
                .collect(),
        }
    }

    pub fn release(name: &str, version: &str, rollout: Option<&str>) -> SidecarRelease {
        serde_json::from_value(json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease",
            "metadata": {"name": name},
            "spec": {"version": version, "image": "s", "emptyImage": "e"},
            "status": {"rollout": rollout}
        }))
        .unwrap()
    }

    pub fn fetched(pods: Vec<Pod>, reports: Vec<Report>, replicas: usize) -> Fetched {
        Fetched {
            pods,
            releases: Some(vec![release("default", "v2", Some("RollingOut"))]),
            releases_error: None,
            reports: Reports {
                replicas,
                errors: (reports.len()..replicas)
                    .map(|i| format!("operator op-{i}: forbidden"))
                    .collect(),
                reports,
            },
        }
    }

    fn by_name<'a>(s: &'a Status, name: &str) -> &'a PodRow {
        s.pods.iter().find(|p| p.name == name).unwrap()
    }

    #[test]
    fn config_sync_merges_the_replicas_and_prefers_a_synced_stream() {
        let pods = ["synced", "stale", "nacked", "silent", "moved"]
            .iter()
            .map(|n| basic("shop", n))
            .collect();
        let f = fetched(
            pods,
            vec![
                report(
                    vec![
                        stream("shop/synced", 3, Some(3), None),
                        stream("shop/stale", 4, Some(3), None),
                        stream("shop/moved", 5, Some(4), None),
                    ],
                    vec![],
                ),
                report(
                    vec![
                        stream(
                            "shop/nacked",
                            4,
                            Some(3),
                            Some("route web: no such cluster"),
                        ),
                        stream("shop/moved", 5, Some(5), None),
                    ],
                    vec![],
                ),
            ],
            2,
        );
        let s = join(&f, NOW, false);
        assert!(s.reports.complete);
        assert_eq!(by_name(&s, "synced").config, Some(Sync::Synced));
        assert_eq!(by_name(&s, "stale").config, Some(Sync::Stale));
        assert_eq!(by_name(&s, "stale").config_error, None);
        assert_eq!(by_name(&s, "stale").config_sent, Some(4));
        assert_eq!(by_name(&s, "stale").config_acked, Some(3));
        let nacked = by_name(&s, "nacked");
        assert_eq!(nacked.config, Some(Sync::Stale));
        assert_eq!(
            nacked.config_error.as_deref(),
            Some("route web: no such cluster")
        );
        assert_eq!(by_name(&s, "silent").config, Some(Sync::NotSent));
        assert_eq!(by_name(&s, "moved").config, Some(Sync::Synced));
    }

    #[test]
    fn a_missing_report_makes_unstreamed_pods_unknown_not_unsent() {
        let f = fetched(
            vec![basic("shop", "seen"), basic("shop", "unseen")],
            vec![report(vec![stream("shop/seen", 1, Some(1), None)], vec![])],
            2,
        );
        let s = join(&f, NOW, false);
        assert!(!s.reports.complete);
        assert_eq!(by_name(&s, "seen").config, Some(Sync::Synced));
        assert_eq!(by_name(&s, "unseen").config, None);
        // No replica at all: everything unknown.
        let s = join(&fetched(vec![basic("shop", "p")], vec![], 0), NOW, false);
        assert_eq!(s.pods[0].config, None);
        assert_eq!(s.releases[0].unknown, 1);
    }

    #[test]
    fn the_certificate_is_the_latest_across_replicas() {
        let f = fetched(
            vec![basic("shop", "a"), basic("shop", "b"), basic("shop", "c")],
            vec![
                report(vec![], vec![("shop/a", NOW + 100), ("shop/b", NOW - 5)]),
                report(vec![], vec![("shop/a", NOW + 83_520)]),
            ],
            2,
        );
        let s = join(&f, NOW, false);
        assert_eq!(by_name(&s, "a").certificate_not_after, Some(NOW + 83_520));
        assert_eq!(by_name(&s, "a").certificate_expires_in, Some(83_520));
        assert_eq!(by_name(&s, "b").certificate_expires_in, Some(-5));
        assert_eq!(by_name(&s, "c").certificate_not_after, None);
    }

    #[test]
    fn annotations_give_release_version_slot_handoff_and_upgrades() {
        let handoff = json!({"version": "v2", "slot": "b", "fromVersion": "v1",
                             "startedAt": NOW - 301, "finishedAt": NOW - 300,
                             "durationMs": 412, "retiredRestarts": 0})
        .to_string();
        let upgrading = pod(
            "shop",
            "upgrading",
            json!({"baton.dev/release": "default", "baton.dev/version": "v2", "baton.dev/active-slot": "b",
                   "baton.dev/last-handoff": handoff,
                   "baton.dev/upgrade": json!({"version": "v3", "image": "s:3", "slot": "a",
                                               "fromVersion": "v2", "startedAt": NOW - 2,
                                               "idleImage": "e"}).to_string()}),
            &[("app", 0)],
            &[],
        );
        let failed = pod(
            "shop",
            "failed",
            json!({"baton.dev/version": "v1",
                   "baton.dev/upgrade-failed": json!({"version": "v2", "reason": "handoff timed out", "at": NOW - 60}).to_string()}),
            &[("app", 0)],
            &[],
        );
        let garbled = pod(
            "shop",
            "garbled",
            json!({"baton.dev/last-handoff": "{nope", "baton.dev/upgrade": "[]"}),
            &[],
            &[],
        );
        let mut labelled = basic("shop", "labelled");
        labelled
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .remove("baton.dev/release");
        labelled
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("baton.dev/release".into(), "canary".into());
        let s = join(
            &fetched(vec![upgrading, failed, garbled, labelled], vec![], 0),
            NOW,
            false,
        );
        let u = by_name(&s, "upgrading");
        assert_eq!(u.release.as_deref(), Some("default"));
        assert_eq!(u.version.as_deref(), Some("v2"));
        assert_eq!(u.slot.as_deref(), Some("b"));
        let h = u.last_handoff.as_ref().unwrap();
        assert_eq!(
            (h.version.as_str(), h.duration_ms, h.seconds_ago),
            ("v2", Some(412), Some(300))
        );
        assert_eq!(h.from_version.as_deref(), Some("v1"));
        assert_eq!(u.upgrade.as_ref().unwrap().version, "v3");
        assert_eq!(u.upgrade.as_ref().unwrap().slot.as_deref(), Some("a"));
        let f = by_name(&s, "failed");
        assert_eq!(f.release, None);
        assert_eq!(f.last_handoff, None);
        assert_eq!(f.upgrade, None);
        let failure = f.upgrade_failed.as_ref().unwrap();
        assert_eq!(failure.version, "v2");
        assert_eq!(failure.reason.as_deref(), Some("handoff timed out"));
        let g = by_name(&s, "garbled");
        assert_eq!(g.last_handoff.as_ref().unwrap().version, "?");
        assert_eq!(g.last_handoff.as_ref().unwrap().seconds_ago, None);
        assert_eq!(g.upgrade.as_ref().unwrap().version, "?");
        assert_eq!(g.version, None);
        assert_eq!(by_name(&s, "labelled").release.as_deref(), Some("canary"));
    }

    #[test]
    fn restarts_count_the_application_only_native_sidecars_included() {
        let classic = pod(
            "shop",
            "classic",
            json!({}),
            &[
                ("app", 2),
                ("log-shipper", 1),
                ("baton-sidecar-a", 7),
                ("baton-sidecar-b", 3),
            ],
            &[("baton-init", 1), ("migrate", 1)],
        );
        let native = pod(
            "shop",
            "native",
            json!({}),
            &[("app", 4)],
            &[
                ("baton-init", 2),
                ("baton-sidecar-a", 9),
                ("baton-sidecar-b", 5),
                ("app-sidecar", 1),
            ],
        );
        let bare: Pod =
            serde_json::from_value(json!({"metadata": {"name": "bare", "namespace": "shop"}}))
                .unwrap();
        assert_eq!(app_restarts(&classic), 4);
        assert_eq!(app_restarts(&native), 5);
        assert_eq!(app_restarts(&bare), 0);
    }

    #[test]
    fn summaries_count_versions_and_sync_per_release() {
        let mut v2 = basic("shop", "b");
        v2.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert("baton.dev/version".into(), "v2".into());
        let mut orphan = basic("other", "c");
        orphan
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert("baton.dev/release".into(), "gone".into());
        let mut f = fetched(
            vec![basic("shop", "a"), v2, orphan],
            vec![report(
                vec![
                    stream("shop/a", 1, Some(1), None),
                    stream("shop/b", 2, Some(1), None),
                ],
                vec![],
            )],
            1,
        );
        f.releases
            .as_mut()
            .unwrap()
            .push(release("idle", "v9", Some("Complete")));
        let s = join(&f, NOW, false);
        assert_eq!(
            s.pods.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
            ["c", "a", "b"],
            "sorted by namespace, then name"
        );
        let names: Vec<_> = s.releases.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["default", "gone"], "idle has no Pod listed");
        let d = &s.releases[0];
        assert_eq!(d.spec_version.as_deref(), Some("v2"));
        assert_eq!(d.rollout.as_deref(), Some("RollingOut"));
        assert_eq!(d.pods, 2);
        assert_eq!(
            d.versions,
            BTreeMap::from([("v1".into(), 1), ("v2".into(), 1)])
        );
        assert_eq!((d.synced, d.stale, d.not_sent, d.unknown), (1, 1, 0, 0));
        let gone = &s.releases[1];
        assert_eq!(gone.spec_version, None);
        assert_eq!(gone.not_sent, 1);
        let all = join(&f, NOW, true);
        assert_eq!(all.releases.len(), 3);
        assert_eq!(all.releases[2].name, "idle");
        assert_eq!(all.releases[2].pods, 0);
    }
}
