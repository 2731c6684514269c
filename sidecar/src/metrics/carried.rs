//! Counter continuity across a handoff.
//!
//! The old process exports every counter series from its Prometheus text
//! exposition (so counters other layers registered travel too); the new
//! process keeps them in a carried store and adds them to the same series of
//! its own exposition, so no counter ever goes backwards across an upgrade.
//! Both directions are generic (by series name): a family registered late
//! (the TLS layer's, once it is attached) or added to the code later
//! continues like any other. Export reads the exposition with the carried
//! values included, so a chain of handoffs keeps counting.
//!
//! It lives with the metrics, not the handoff: the exposition itself adds
//! the carried values ([`Metrics::encode`]), and the handoff only moves the
//! `series → value` map ([`export`], [`import`]), through the
//! `baton_handoff::plane::CarriedCounters` that [`Metrics`] implements here.

use std::collections::BTreeMap;

use super::Metrics;

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

/// Adds `counters` to `metrics` (see [`Metrics::carry`]): every series
/// continues from the old process's value, whichever module registers its
/// family in this process and whenever, with no per-family code here (a
/// family added later cannot be forgotten).
pub fn import(metrics: &Metrics, counters: &BTreeMap<String, u64>) {
    metrics.carry(counters);
}

impl baton_handoff::plane::CarriedCounters for Metrics {
    fn export(&self) -> BTreeMap<String, u64> {
        export(self)
    }

    fn import(&self, counters: &BTreeMap<String, u64>) {
        import(self, counters)
    }
}

/// Pure: `text` (an OpenMetrics exposition) with each `carried` counter
/// series added to its sample, and the carried series this process has not
/// produced yet shown with the carried value: inside their family's block,
/// or, for a registered counter family (`families`: full name → help) that
/// has no series here yet (the exposition omits such a family), in a block
/// of its own before `# EOF`. Series of families not registered are left out
/// (see [`unplaced`]); gauges and histograms are never touched.
pub fn add_carried(
    text: &str,
    carried: &BTreeMap<String, u64>,
    families: &BTreeMap<String, String>,
) -> String {
    // Family name (as in `# TYPE`) → its carried series, in order.
    let mut by_family: BTreeMap<&str, Vec<(&str, u64)>> = BTreeMap::new();
    for (series, v) in carried {
        if let Some(family) = family_of(series) {
            by_family.entry(family).or_default().push((series, *v));
        }
    }
    let mut out = String::with_capacity(text.len() + 64 * carried.len());
    let mut present = std::collections::HashSet::new();
    // The counter family whose samples are being read, and which of its
    // carried series were already added to a sample.
    let mut current: Option<(&str, Vec<bool>)> = None;
    // At the end of a family's block: its carried series not seen yet.
    fn flush(
        out: &mut String,
        current: &mut Option<(&str, Vec<bool>)>,
        by_family: &BTreeMap<&str, Vec<(&str, u64)>>,
    ) {
        if let Some((family, seen)) = current.take() {
            for ((series, v), seen) in by_family[family].iter().zip(seen) {
                if !seen {
                    out.push_str(&format!("{series} {v}\n"));
                }
            }
        }
    }
    // Registered counter families with carried series but no block.
    let absent = |out: &mut String, present: &std::collections::HashSet<&str>| {
        for (family, series) in &by_family {
            if present.contains(family) {
                continue;
            }
            if let Some(help) = families.get(*family) {
                out.push_str(&format!(
                    "# HELP {family} {help}.\n# TYPE {family} counter\n"
                ));
                for (series, v) in series {
                    out.push_str(&format!("{series} {v}\n"));
                }
            }
        }
    };
    let mut eof = false;
    for line in text.lines() {
        if line.starts_with('#') {
            let family_line = line
                .strip_prefix("# TYPE ")
                .or_else(|| line.strip_prefix("# HELP "))
                .or_else(|| line.strip_prefix("# UNIT "));
            let family = family_line.and_then(|r| r.split_whitespace().next());
            if family != current.as_ref().map(|(f, _)| *f) {
                flush(&mut out, &mut current, &by_family);
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut it = rest.split_whitespace();
                if let Some(name) = it.next()
                    && let Some((family, series)) = by_family.get_key_value(name)
                {
                    present.insert(*family);
                    if it.next() == Some("counter") {
                        current = Some((*family, vec![false; series.len()]));
                    }
                }
            }
            if line == "# EOF" {
                absent(&mut out, &present);
                eof = true;
            }
            out.push_str(line);
            out.push('\n');
            continue;
        }
        if let Some((family, seen)) = current.as_mut()
            && let Some((series, value)) = line.rsplit_once(' ')
            && let Some(i) = by_family[*family].iter().position(|(s, _)| *s == series)
            && let Some(local) = value
                .parse::<u64>()
                .ok()
                .or_else(|| value.parse::<f64>().ok().map(|f| f as u64))
        {
            seen[i] = true;
            let total = local.saturating_add(by_family[*family][i].1);
            out.push_str(&format!("{series} {total}\n"));
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    flush(&mut out, &mut current, &by_family);
    if !eof {
        absent(&mut out, &present);
    }
    out
}

/// `name_total{...}` → `name` (a counter sample's family).
fn family_of(series: &str) -> Option<&str> {
    series.split('{').next()?.strip_suffix("_total")
}

/// Pure: the carried series whose family is not a registered counter family.
pub fn unplaced(
    carried: &BTreeMap<String, u64>,
    families: &BTreeMap<String, String>,
) -> Vec<String> {
    carried
        .keys()
        .filter(|s| family_of(s).is_none_or(|f| !families.contains_key(f)))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::handoff::HandoffMetrics;
    use crate::metrics::{ConnLabels, RequestLabels, RouteMetrics, StatusClass};
    use crate::tls::TlsMetrics;

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
        old.h1_fast_path_fallback("framing");
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
        import(&new, &exported);
        assert!(new.carried_unplaced().is_empty());
        let after = export(&new);
        assert_eq!(
            after[r#"baton_sidecar_requests_total{route="r1",status_class="2xx"}"#],
            42
        );
        for (k, v) in &exported {
            assert!(after[k] >= *v, "{k} went backwards");
        }
        assert!(!new.encode().contains("config_version 9"));

        // A second handoff carries the sum on (export includes the carried).
        let third = Metrics::new();
        import(&third, &after);
        assert_eq!(
            export(&third)[r#"baton_sidecar_requests_total{route="r1",status_class="2xx"}"#],
            42
        );
    }

    #[test]
    fn a_family_registered_after_the_import_continues_from_the_carried_value() {
        let old = Metrics::new();
        let old_tls = TlsMetrics::default();
        old.register(|r| old_tls.register_into(r));
        for _ in 0..20 {
            old_tls.handshake("server", "ok");
        }
        let exported = export(&old);
        let series = r#"baton_sidecar_tls_handshakes_total{side="server",result="ok"}"#;
        assert_eq!(exported[series], 20);

        let new = Metrics::new();
        import(&new, &exported);
        // Not registered yet: held, not shown, reported as unplaced.
        assert!(!new.encode().contains("tls_handshakes"));
        assert_eq!(new.carried_unplaced(), vec![series.to_string()]);
        let tls = TlsMetrics::default();
        new.register(|r| tls.register_into(r));
        // Registered but no handshake yet: the series shows the carried value.
        assert_eq!(export(&new)[series], 20);
        tls.handshake("server", "ok");
        assert_eq!(export(&new)[series], 21);
        assert!(new.carried_unplaced().is_empty());
    }

    #[test]
    fn carried_series_are_added_inside_their_family_block_and_empty_registered_families_get_one() {
        let text = "# HELP a_x X.\n# TYPE a_x counter\na_x_total{k=\"1\"} 2\n\
                    # HELP a_g G.\n# TYPE a_g gauge\na_g 7\n\
                    # HELP a_y Y.\n# TYPE a_y counter\na_y_total 1\n# EOF\n";
        let mut carried = BTreeMap::new();
        carried.insert(r#"a_x_total{k="1"}"#.to_string(), 5);
        carried.insert(r#"a_x_total{k="2"}"#.to_string(), 3);
        carried.insert("a_y_total".to_string(), 10);
        // A gauge of the same name is never changed; an unknown family is left out.
        carried.insert("a_g_total".to_string(), 100);
        carried.insert("a_z_total".to_string(), 1);
        let mut families = BTreeMap::new();
        for f in ["a_x", "a_y", "a_w"] {
            families.insert(f.to_string(), format!("{f} help"));
        }
        carried.insert("a_w_total".to_string(), 4);
        let out = add_carried(text, &carried, &families);
        assert_eq!(
            out,
            "# HELP a_x X.\n# TYPE a_x counter\na_x_total{k=\"1\"} 7\na_x_total{k=\"2\"} 3\n\
             # HELP a_g G.\n# TYPE a_g gauge\na_g 7\n\
             # HELP a_y Y.\n# TYPE a_y counter\na_y_total 11\n\
             # HELP a_w a_w help.\n# TYPE a_w counter\na_w_total 4\n# EOF\n"
        );
        assert_eq!(
            unplaced(&carried, &families),
            vec!["a_g_total", "a_z_total"]
        );
    }

    /// Every counter family the process can export (the data plane's, the
    /// handoff's, the TLS layer's), each with a series: all of them continue
    /// in a new process that registers its layers after the import, as the
    /// sidecar does. A family added without a series in `populate` fails the
    /// first assertion, so it cannot be forgotten.
    #[test]
    fn every_counter_series_the_process_exports_continues_after_a_handoff() {
        fn layers(m: &Metrics) -> (HandoffMetrics, TlsMetrics) {
            let hm = HandoffMetrics::default();
            m.register(|r| hm.register(r));
            let tls = TlsMetrics::default();
            m.register(|r| tls.register_into(r));
            (hm, tls)
        }
        fn populate(m: &Metrics, hm: &HandoffMetrics, tls: &TlsMetrics) {
            RouteMetrics::resolve(m, &Arc::from("r")).record(200, 0.001);
            m.connections
                .get_or_create(&ConnLabels {
                    listener: Arc::from("in"),
                    protocol: "http1",
                })
                .inc();
            m.bytes
                .get_or_create(&vec![("direction", "downstream_rx")])
                .inc_by(10);
            m.upstream_error("connect");
            m.retries.get_or_create(&vec![("outcome", "sent")]).inc();
            m.outlier_ejections.inc();
            m.mirror.get_or_create(&vec![("outcome", "sent")]).inc();
            m.config_applies.inc();
            m.control_reconnects.inc();
            m.config_apply_errors
                .get_or_create(&vec![("reason", "invalid")])
                .inc();
            m.local_response("no_route");
            m.h1_fast_path_requests.inc();
            m.h1_fast_path_fallback("head");
            m.admin_refused("/shutdown");
            m.authz
                .get_or_create(&crate::metrics::AuthzLabels {
                    policy: Arc::from("p"),
                    rule: Arc::from("default"),
                    verdict: "deny",
                })
                .inc();
            hm.handoffs
                .get_or_create(&vec![("role", "old"), ("result", "complete")])
                .inc();
            hm.connections
                .get_or_create(&vec![("outcome", "moved")])
                .inc();
            let e = tls.engine("software");
            e.errors.inc();
            e.signatures.inc();
            e.jobs.inc();
            tls.fallback("engine_unavailable");
            tls.handshake("server", "ok");
            tls.plaintext_refused.inc();
            tls.plaintext_accepted.inc();
            tls.app_tls_passthrough.inc();
            tls.app_tls_refused.inc();
        }
        let old = Metrics::new();
        let (hm, tls) = layers(&old);
        populate(&old, &hm, &tls);
        let text = old.encode();
        let exported = parse_counters(&text);
        for family in text.lines().filter_map(|l| {
            let rest = l.strip_prefix("# TYPE ")?;
            rest.ends_with(" counter")
                .then(|| rest.split_whitespace().next().unwrap_or_default())
        }) {
            assert!(
                exported.iter().any(|(s, v)| *v > 0
                    && s.split('{').next() == Some(format!("{family}_total").as_str())),
                "counter family {family} has no series: give it one in populate()"
            );
        }

        let new = Metrics::new();
        import(&new, &exported);
        let (hm2, tls2) = layers(&new);
        assert!(
            new.carried_unplaced().is_empty(),
            "{:?}",
            new.carried_unplaced()
        );
        // Before this process touches any of them: every series is there,
        // with the old value.
        let nonzero: BTreeMap<String, u64> = exported
            .iter()
            .filter(|(_, v)| **v > 0)
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        assert_eq!(export(&new), nonzero);
        populate(&new, &hm2, &tls2);
        let after = export(&new);
        for (series, v) in &exported {
            assert_eq!(
                after.get(series),
                Some(&(2 * v)),
                "{series} did not continue"
            );
        }
    }
}
