//! Counter continuity across a handoff.
//!
//! The old process exports every counter series from its Prometheus text
//! exposition (so counters other layers registered travel too); the new
//! process adds those values to its own families before it serves, so no
//! counter ever goes backwards across an upgrade. Export is generic; import
//! knows the data plane's typed families and reports series it could not
//! place (they are logged, never silently dropped).

use std::collections::BTreeMap;
use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::metrics::{ConnLabels, Metrics, RequestLabels, StatusClass};

/// `series → value` for every counter sample, e.g.
/// `baton_sidecar_requests_total{route="r",status_class="2xx"} → 5`.
pub fn export(metrics: &Metrics) -> BTreeMap<String, u64> {
    parse_counters(&metrics.encode())
}

/// Pure: counter samples of an OpenMetrics/Prometheus text exposition.
pub fn parse_counters(text: &str) -> BTreeMap<String, u64> {
    let mut counters = std::collections::HashSet::new();
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            if let (Some(name), Some("counter")) = (it.next(), it.next()) {
                counters.insert(format!("{name}_total"));
            }
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let name = series.split('{').next().unwrap_or(series);
        if !counters.contains(name) {
            continue;
        }
        if let Ok(v) = value.parse::<u64>() {
            out.insert(series.to_string(), v);
        } else if let Ok(v) = value.parse::<f64>() {
            out.insert(series.to_string(), v as u64);
        }
    }
    out
}

/// Pure: split `name{a="x",b="y"}` into the name and label pairs.
pub fn parse_series(series: &str) -> Option<(&str, Vec<(String, String)>)> {
    let Some((name, rest)) = series.split_once('{') else {
        return Some((series, Vec::new()));
    };
    let body = rest.strip_suffix('}')?;
    let b = body.as_bytes();
    let mut labels = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b',' {
            i += 1;
            continue;
        }
        let eq = body[i..].find("=\"")? + i;
        let key = body[i..eq].to_string();
        i = eq + 2;
        let mut value = String::new();
        loop {
            match *b.get(i)? {
                b'\\' => {
                    value.push(match *b.get(i + 1)? {
                        b'n' => '\n',
                        other => other as char,
                    });
                    i += 2;
                }
                b'"' => {
                    i += 1;
                    break;
                }
                _ => {
                    let ch = body[i..].chars().next()?;
                    value.push(ch);
                    i += ch.len_utf8();
                }
            }
        }
        labels.push((key, value));
    }
    Some((name, labels))
}

/// Label values of the `&'static str` families come from a bounded set
/// (directions, classes, reasons); interning keeps them `'static` without
/// leaking per import.
fn intern(s: &str) -> &'static str {
    use std::sync::Mutex;
    static TABLE: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(x) = t.iter().find(|x| **x == s) {
        return x;
    }
    let leaked: &'static str = Box::leak(s.to_string().into_boxed_str());
    t.push(leaked);
    leaked
}

type StaticLabels = Vec<(&'static str, &'static str)>;

fn static_labels(labels: &[(String, String)]) -> StaticLabels {
    labels.iter().map(|(k, v)| (intern(k), intern(v))).collect()
}

fn status_class(s: &str) -> Option<StatusClass> {
    Some(match s {
        "1xx" => StatusClass::C1xx,
        "2xx" => StatusClass::C2xx,
        "3xx" => StatusClass::C3xx,
        "4xx" => StatusClass::C4xx,
        "5xx" => StatusClass::C5xx,
        _ => return None,
    })
}

fn label<'a>(labels: &'a [(String, String)], key: &str) -> Option<&'a str> {
    labels
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// Extra families (the handoff's own) the import should also restore.
pub type ExtraFamilies<'a> = &'a [(&'a str, &'a Family<StaticLabels, Counter>)];

/// Adds `counters` to `metrics`. Returns the series it could not place.
pub fn import(
    metrics: &Metrics,
    extra: ExtraFamilies<'_>,
    counters: &BTreeMap<String, u64>,
) -> Vec<String> {
    let mut skipped = Vec::new();
    let labelled: [(&str, &Family<StaticLabels, Counter>); 7] = [
        ("baton_sidecar_bytes_total", &metrics.bytes),
        (
            "baton_sidecar_upstream_errors_total",
            &metrics.upstream_errors,
        ),
        ("baton_sidecar_retries_total", &metrics.retries),
        ("baton_sidecar_mirror_requests_total", &metrics.mirror),
        (
            "baton_sidecar_config_apply_errors_total",
            &metrics.config_apply_errors,
        ),
        (
            "baton_sidecar_local_responses_total",
            &metrics.local_responses,
        ),
        (
            "baton_sidecar_h1_fast_path_fallbacks_total",
            &metrics.h1_fast_path_fallbacks,
        ),
    ];
    for (series, &v) in counters {
        let Some((name, labels)) = parse_series(series) else {
            skipped.push(series.clone());
            continue;
        };
        let placed = match name {
            "baton_sidecar_requests_total" => {
                match (label(&labels, "route"), label(&labels, "status_class")) {
                    (Some(r), Some(c)) => status_class(c).map(|c| {
                        metrics
                            .requests
                            .get_or_create(&RequestLabels {
                                route: Arc::from(r),
                                status_class: c,
                            })
                            .inc_by(v);
                    }),
                    _ => None,
                }
            }
            "baton_sidecar_connections_total" => {
                match (label(&labels, "listener"), label(&labels, "protocol")) {
                    (Some(l), Some(p)) => {
                        metrics
                            .connections
                            .get_or_create(&ConnLabels {
                                listener: Arc::from(l),
                                protocol: intern(p),
                            })
                            .inc_by(v);
                        Some(())
                    }
                    _ => None,
                }
            }
            "baton_sidecar_outlier_ejections_total" => {
                metrics.outlier_ejections.inc_by(v);
                Some(())
            }
            "baton_sidecar_config_applies_total" => {
                metrics.config_applies.inc_by(v);
                Some(())
            }
            "baton_sidecar_h1_fast_path_requests_total" => {
                metrics.h1_fast_path_requests.inc_by(v);
                Some(())
            }
            other => labelled
                .iter()
                .chain(extra.iter())
                .find(|(n, _)| *n == other)
                .map(|(_, fam)| {
                    fam.get_or_create(&static_labels(&labels)).inc_by(v);
                }),
        };
        if placed.is_none() {
            skipped.push(series.clone());
        }
    }
    skipped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_with_labels_and_escapes_parse() {
        let (n, l) = parse_series(r#"x_total{a="1",b="q\"uo,te",c=""}"#).unwrap();
        assert_eq!(n, "x_total");
        assert_eq!(
            l,
            vec![
                ("a".into(), "1".into()),
                ("b".into(), "q\"uo,te".into()),
                ("c".into(), "".into())
            ]
        );
        assert_eq!(
            parse_series("plain_total").unwrap(),
            ("plain_total", vec![])
        );
        assert!(parse_series("bad{a=\"1\"").is_none());
    }

    #[test]
    fn counters_survive_export_and_import_into_a_fresh_registry() {
        let old = Metrics::new();
        old.requests
            .get_or_create(&RequestLabels {
                route: Arc::from("r1"),
                status_class: StatusClass::C2xx,
            })
            .inc_by(41);
        old.connections
            .get_or_create(&ConnLabels {
                listener: Arc::from("out"),
                protocol: "tcp",
            })
            .inc_by(7);
        old.bytes
            .get_or_create(&vec![("direction", "downstream_rx")])
            .inc_by(1000);
        old.local_response("connection_limit");
        old.config_applies.inc_by(3);
        old.h1_fast_path_requests.inc_by(11);
        old.h1_fast_path_fallback(crate::h1fast::Fallback::Framing);
        // Gauges are state, not history: never exported.
        old.config_version.set(9);
        let exported = export(&old);
        assert!(
            exported.keys().all(|k| k.contains("_total")),
            "{exported:?}"
        );

        let new = Metrics::new();
        new.requests
            .get_or_create(&RequestLabels {
                route: Arc::from("r1"),
                status_class: StatusClass::C2xx,
            })
            .inc();
        let skipped = import(&new, &[], &exported);
        assert!(skipped.is_empty(), "{skipped:?}");
        let after = export(&new);
        assert_eq!(
            after[r#"baton_sidecar_requests_total{route="r1",status_class="2xx"}"#],
            42
        );
        for (k, v) in &exported {
            assert!(after[k] >= *v, "{k} went backwards");
        }
        assert!(!new.encode().contains("config_version 9"));
    }

    #[test]
    fn unknown_series_are_reported_not_dropped_silently() {
        let m = Metrics::new();
        let mut c = BTreeMap::new();
        c.insert("some_other_total{x=\"1\"}".to_string(), 5);
        assert_eq!(
            import(&m, &[], &c),
            vec!["some_other_total{x=\"1\"}".to_string()]
        );
    }
}
