//! `-o table|json|yaml`: tables aligned like kubectl's, JSON and YAML for
//! scripts.

use serde::Serialize;

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
    Yaml,
}

/// Renders `value` as JSON or YAML (`None` for [`Format::Table`]: the
/// command prints its own table).
pub fn structured<T: Serialize>(format: Format, value: &T) -> anyhow::Result<Option<String>> {
    Ok(match format {
        Format::Table => None,
        Format::Json => Some(serde_json::to_string_pretty(value)? + "\n"),
        Format::Yaml => Some(baton_crds::yaml::to_string(value)?),
    })
}

/// Columns padded to their widest cell, three spaces apart (kubectl's look).
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                l.push_str("   ");
            }
            l.push_str(cell);
            let width = widths.get(i).copied().unwrap_or(0);
            let pad = width.saturating_sub(cell.chars().count());
            l.extend(std::iter::repeat_n(' ', pad));
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// `3m12s`-style age of a duration in seconds (kubectl's short form).
pub fn age(seconds: i64) -> String {
    let s = seconds.max(0);
    match s {
        0..=119 => format!("{s}s"),
        120..=3599 => format!("{}m{}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h{}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d{}h", s / 86_400, (s % 86_400) / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_on_the_widest_cell() {
        let t = table(
            &["NAME", "V"],
            &[
                vec!["a".into(), "v1".into()],
                vec!["longer".into(), "v2".into()],
            ],
        );
        assert_eq!(t, "NAME     V\na        v1\nlonger   v2\n");
    }

    #[test]
    fn ages_read_like_kubectl() {
        assert_eq!(age(5), "5s");
        assert_eq!(age(192), "3m12s");
        assert_eq!(age(7_260), "2h1m");
        assert_eq!(age(90_000), "1d1h");
    }
}
