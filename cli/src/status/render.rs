//! The pure rendering of `status`: the Pod table and the release summary,
//! or the same data as JSON / YAML.

use baton_crds::sidecars::Sync;

use super::join::{PodRow, ReleaseSummary, Status};
use crate::output::{self, Format};

/// Headers of the Pod table (`NAMESPACE` first with `-A`).
pub const POD_HEADERS: [&str; 9] = [
    "POD",
    "RELEASE",
    "VERSION",
    "SLOT",
    "CONFIG",
    "CERT",
    "LAST HANDOFF",
    "UPGRADE",
    "RESTARTS",
];

/// Headers of the release summary.
pub const RELEASE_HEADERS: [&str; 8] = [
    "RELEASE", "VERSION", "ROLLOUT", "PODS", "VERSIONS", "SYNCED", "STALE", "NOT SENT",
];

/// The command's stdout in `format`.
pub fn render(status: &Status, format: Format, all_namespaces: bool) -> anyhow::Result<String> {
    Ok(match output::structured(format, status)? {
        Some(text) => text,
        None => table(status, all_namespaces),
    })
}

/// The Pod table, a blank line, the release summary. Empty when there is
/// nothing to show.
pub fn table(status: &Status, all_namespaces: bool) -> String {
    let mut out = String::new();
    if !status.pods.is_empty() {
        let mut headers: Vec<&str> = Vec::with_capacity(POD_HEADERS.len() + 1);
        if all_namespaces {
            headers.push("NAMESPACE");
        }
        headers.extend(POD_HEADERS);
        let rows: Vec<Vec<String>> = status
            .pods
            .iter()
            .map(|p| pod_cells(p, status.reports.complete, all_namespaces))
            .collect();
        out.push_str(&output::table(&headers, &rows));
    }
    if !status.releases.is_empty() {
        if !out.is_empty() {
            out.push('\n');
        }
        let known = status.reports.answered > 0;
        let rows: Vec<Vec<String>> = status
            .releases
            .iter()
            .map(|r| release_cells(r, known))
            .collect();
        out.push_str(&output::table(&RELEASE_HEADERS, &rows));
    }
    out
}

/// One Pod's cells. `complete`: every operator replica answered (a Pod
/// with no certificate then has none: `-`, else `?`).
pub fn pod_cells(p: &PodRow, complete: bool, all_namespaces: bool) -> Vec<String> {
    let dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    let mut cells = Vec::with_capacity(10);
    if all_namespaces {
        cells.push(p.namespace.clone());
    }
    cells.push(p.name.clone());
    cells.push(dash(&p.release));
    cells.push(dash(&p.version));
    cells.push(dash(&p.slot));
    cells.push(config_cell(p.config, p.config_error.is_some()));
    cells.push(match p.certificate_expires_in {
        Some(s) if s <= 0 => "expired".into(),
        Some(s) => output::age(s),
        None if complete => "-".into(),
        None => "?".into(),
    });
    cells.push(match &p.last_handoff {
        None => "-".into(),
        Some(h) => {
            let ago = h
                .seconds_ago
                .map_or_else(|| "?".into(), |s| format!("{} ago", output::age(s)));
            match h.duration_ms {
                Some(ms) => format!("{ago} ({})", millis(ms)),
                None => ago,
            }
        }
    });
    cells.push(match (&p.upgrade, &p.upgrade_failed) {
        (Some(u), _) => format!("→ {}", u.version),
        (None, Some(f)) => format!("failed: {}", f.version),
        (None, None) => "-".into(),
    });
    cells.push(p.restarts.to_string());
    cells
}

fn config_cell(sync: Option<Sync>, nacked: bool) -> String {
    match sync {
        None => "?".into(),
        Some(Sync::Stale) if nacked => "STALE (NACK)".into(),
        Some(s) => s.as_str().into(),
    }
}

/// `412ms`, `1.5s`, `42s`.
pub fn millis(ms: u64) -> String {
    match ms {
        0..=999 => format!("{ms}ms"),
        1000..=9_999 => format!("{:.1}s", ms as f64 / 1000.0),
        _ => format!("{}s", ms / 1000),
    }
}

/// One release's cells. `known`: some report was read (else the sync
/// counts are `?`).
pub fn release_cells(r: &ReleaseSummary, known: bool) -> Vec<String> {
    let mut versions: Vec<(&String, &usize)> = r.versions.iter().collect();
    // The spec version first, then by count.
    versions.sort_by_key(|(v, n)| (Some(*v) != r.spec_version.as_ref(), std::cmp::Reverse(**n)));
    let versions = versions
        .iter()
        .map(|(v, n)| format!("{v}={n}"))
        .collect::<Vec<_>>()
        .join(" ");
    let count = |n: usize| if known { n.to_string() } else { "?".into() };
    vec![
        r.name.clone(),
        r.spec_version.clone().unwrap_or_else(|| "?".into()),
        r.rollout.clone().unwrap_or_else(|| "-".into()),
        r.pods.to_string(),
        if versions.is_empty() {
            "-".into()
        } else {
            versions
        },
        count(r.synced),
        count(r.stale),
        count(r.not_sent),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::join::join;
    use crate::status::join::tests::{NOW, basic, fetched, pod, report, stream};
    use serde_json::json;

    fn sample(replicas: usize) -> Status {
        let handoff = json!({"version": "v2", "slot": "b", "startedAt": NOW - 301,
                             "finishedAt": NOW - 300, "durationMs": 412})
        .to_string();
        let web = pod(
            "shop",
            "web-1",
            json!({"baton.dev/release": "default", "baton.dev/version": "v2",
                   "baton.dev/active-slot": "b", "baton.dev/last-handoff": handoff}),
            &[("app", 1)],
            &[("baton-sidecar-a", 3), ("baton-sidecar-b", 0)],
        );
        let up = pod(
            "shop",
            "web-2",
            json!({"baton.dev/release": "default", "baton.dev/version": "v1", "baton.dev/active-slot": "a",
                   "baton.dev/upgrade": json!({"version": "v2", "slot": "b"}).to_string()}),
            &[("app", 0)],
            &[],
        );
        let failed = pod(
            "pay",
            "api-0",
            json!({"baton.dev/release": "default", "baton.dev/version": "v1", "baton.dev/active-slot": "a",
                   "baton.dev/upgrade-failed": json!({"version": "v2", "reason": "x", "at": NOW}).to_string()}),
            &[("app", 0)],
            &[],
        );
        let reports = if replicas == 0 {
            vec![]
        } else {
            vec![report(
                vec![
                    stream("shop/web-1", 4, Some(4), None),
                    stream("shop/web-2", 4, Some(3), Some("bad route")),
                ],
                vec![("shop/web-1", NOW + 83_520), ("shop/web-2", NOW - 1)],
            )]
        };
        join(
            &fetched(
                vec![web, up, failed, basic("pay", "api-1")],
                reports,
                replicas.max(1),
            ),
            NOW,
            true,
        )
    }

    #[test]
    fn the_table_shows_every_column() {
        let text = table(&sample(1), true);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "NAMESPACE   POD     RELEASE   VERSION   SLOT   CONFIG         CERT      LAST HANDOFF       UPGRADE      RESTARTS"
        );
        assert_eq!(
            lines[1],
            "pay         api-0   default   v1        a      NOT SENT       -         -                  failed: v2   0"
        );
        assert_eq!(
            lines[3],
            "shop        web-1   default   v2        b      SYNCED         23h12m    5m0s ago (412ms)   -            1"
        );
        assert_eq!(
            lines[4],
            "shop        web-2   default   v1        a      STALE (NACK)   expired   -                  → v2         0"
        );
        assert_eq!(lines[5], "");
        assert_eq!(
            lines[6],
            "RELEASE   VERSION   ROLLOUT      PODS   VERSIONS    SYNCED   STALE   NOT SENT"
        );
        assert_eq!(
            lines[7],
            "default   v2        RollingOut   4      v2=1 v1=3   1        1       2"
        );
    }

    #[test]
    fn without_reports_config_cert_and_counts_are_unknown() {
        let s = sample(0);
        assert!(!s.reports.complete);
        let text = table(&s, false);
        let web = text.lines().find(|l| l.starts_with("web-1")).unwrap();
        let cells: Vec<&str> = web
            .split("   ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .collect();
        assert_eq!(cells[4], "?", "{web}");
        assert_eq!(cells[5], "?", "{web}");
        assert!(
            text.lines().next().unwrap().starts_with("POD "),
            "no NAMESPACE without -A"
        );
        let summary = text.lines().last().unwrap();
        assert!(summary.ends_with("?        ?       ?"), "{summary}");
    }

    #[test]
    fn durations_read_short() {
        assert_eq!(millis(412), "412ms");
        assert_eq!(millis(1_520), "1.5s");
        assert_eq!(millis(42_000), "42s");
    }

    #[test]
    fn json_and_yaml_carry_the_same_data_with_the_nack() {
        let s = sample(1);
        let text = render(&s, Format::Json, true).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let web2 = v["pods"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "web-2")
            .unwrap();
        assert_eq!(web2["config"], "STALE");
        assert_eq!(web2["configError"], "bad route");
        assert_eq!(web2["upgrade"]["version"], "v2");
        assert_eq!(web2["certificateExpiresIn"], -1);
        let web1 = v["pods"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "web-1")
            .unwrap();
        assert_eq!(web1["lastHandoff"]["durationMs"], 412);
        assert_eq!(web1["lastHandoff"]["secondsAgo"], 300);
        assert_eq!(web1["restarts"], 1);
        let api1 = v["pods"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "api-1")
            .unwrap();
        assert_eq!(api1["config"], "NOT_SENT");
        assert_eq!(v["releases"][0]["versions"]["v1"], 3);
        assert_eq!(v["reports"]["complete"], true);
        let yaml = render(&s, Format::Yaml, true).unwrap();
        assert!(yaml.contains("configError: bad route"), "{yaml}");
    }

    #[test]
    fn nothing_found_renders_nothing() {
        let empty = join(&Default::default(), NOW, false);
        assert_eq!(table(&empty, false), "");
    }
}
