//! Field types shared by several kinds, named as in Gateway API so users
//! recognise them: backend references, durations, header names.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::validation::Errors;

/// Gateway API duration syntax (GEP-2257): one to four `<number><unit>`
/// groups, unit `h`, `m`, `s` or `ms`, e.g. `1s`, `500ms`, `1m30s`.
/// A subset of Go's `time.ParseDuration`, so CEL's `duration()` accepts it.
pub const DURATION_PATTERN: &str = r"^([0-9]{1,5}(h|m|s|ms)){1,4}$";

/// An HTTP header field name (RFC 7230 token).
pub const HEADER_NAME_PATTERN: &str = r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$";

/// A DNS-1035 label: what a Service name must be.
pub const DNS_LABEL_PATTERN: &str = r"^[a-z]([-a-z0-9]*[a-z0-9])?$";

/// Parses a [`DURATION_PATTERN`] string. `None` when it does not match.
pub fn parse_duration(s: &str) -> Option<std::time::Duration> {
    let bytes = s.as_bytes();
    let (mut i, mut groups, mut total_ms) = (0usize, 0u32, 0u128);
    if bytes.is_empty() {
        return None;
    }
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        let digits = i - start;
        if digits == 0 || digits > 5 {
            return None;
        }
        let n: u128 = s[start..i].parse().ok()?;
        let unit_ms: u128 = if s[i..].starts_with("ms") {
            i += 2;
            1
        } else {
            let u = *bytes.get(i)?;
            i += 1;
            match u {
                b'h' => 3_600_000,
                b'm' => 60_000,
                b's' => 1_000,
                _ => return None,
            }
        };
        total_ms += n * unit_ms;
        groups += 1;
        if groups > 4 {
            return None;
        }
    }
    Some(std::time::Duration::from_millis(
        u64::try_from(total_ms).ok()?,
    ))
}

/// Checks an optional duration field, pushing an error that shows the syntax.
pub(crate) fn check_duration(errors: &mut Errors, path: &str, value: Option<&str>) {
    if let Some(v) = value
        && parse_duration(v).is_none()
    {
        errors.push(
            path,
            format!(
                "{v:?} is not a duration: use one to four <number><unit> groups with unit h, m, s or ms, e.g. \"500ms\" or \"1m30s\""
            ),
        );
    }
}

/// A Service in the Route's namespace, and one of its ports.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServicePort {
    /// Name of a Service in the same namespace.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = DNS_LABEL_PATTERN)
    )]
    pub name: String,
    /// Port number of the Service (its `port`, not the `targetPort`).
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
}

/// Where traffic goes: a Service port with a relative weight.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackendRef {
    /// Name of a Service in the same namespace.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = DNS_LABEL_PATTERN)
    )]
    pub name: String,
    /// Port number of the Service.
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// Share of requests (or connections, for tcp) relative to the other
    /// backends of the rule: weights 1 and 3 mean 25% and 75%. 0 sends nothing
    /// (drains a backend) but at least one backend of a rule must be non-zero.
    #[serde(default = "default_weight")]
    #[schemars(range(min = 0, max = 1000000))]
    pub weight: i32,
}

fn default_weight() -> i32 {
    1
}

pub(crate) fn check_port(errors: &mut Errors, path: &str, port: i32) {
    if !(1..=65535).contains(&port) {
        errors.push(path, format!("{port} is not a port: use 1-65535"));
    }
}

pub(crate) fn check_service_name(errors: &mut Errors, path: &str, name: &str) {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.as_bytes()[0].is_ascii_lowercase()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.ends_with('-');
    if !ok {
        errors.push(
            path,
            format!(
                "{name:?} is not a Service name: use at most 63 lowercase letters, digits and '-', starting with a letter"
            ),
        );
    }
}

pub(crate) fn check_percent(errors: &mut Errors, path: &str, percent: i32) {
    if !(0..=100).contains(&percent) {
        errors.push(path, format!("{percent} is not a percentage: use 0-100"));
    }
}

pub(crate) fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn parses_single_unit_durations() {
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("2s"), Some(Duration::from_secs(2)));
        assert_eq!(parse_duration("3m"), Some(Duration::from_secs(180)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("0s"), Some(Duration::ZERO));
    }

    #[test]
    fn parses_compound_durations_by_summing_groups() {
        assert_eq!(parse_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(
            parse_duration("1h2m3s4ms"),
            Some(Duration::from_millis(3_723_004))
        );
    }

    #[test]
    fn rejects_durations_outside_the_gateway_api_grammar() {
        for bad in [
            "",
            "1",
            "s",
            "1.5s",
            "-1s",
            "1d",
            "1us",
            "123456s",
            "1h1h1h1h1h",
            " 1s",
            "1s ",
            "1S",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad:?} should be rejected");
        }
    }

    #[test]
    fn header_names_are_rfc7230_tokens() {
        assert!(is_header_name("x-request-id"));
        assert!(is_header_name("X_Custom.1~"));
        assert!(!is_header_name(""));
        assert!(!is_header_name("bad header"));
        assert!(!is_header_name("colon:"));
    }

    #[test]
    fn service_name_check_accepts_dns_labels_only() {
        let mut e = Errors::default();
        check_service_name(&mut e, "a", "reviews-v2");
        assert!(e.into_result().is_ok());
        for bad in ["", "Reviews", "1abc", "abc-", "a_b", &"a".repeat(64)] {
            let mut e = Errors::default();
            check_service_name(&mut e, "p", bad);
            assert!(e.into_result().is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn the_schema_duration_pattern_and_the_parser_agree() {
        let re = regex::Regex::new(DURATION_PATTERN).unwrap();
        let samples = [
            "0s",
            "1ms",
            "500ms",
            "2s",
            "3m",
            "1h",
            "1m30s",
            "1h2m3s4ms",
            "99999ms",
            "",
            "1",
            "s",
            "1.5s",
            "-1s",
            "1d",
            "1us",
            "123456s",
            "1h1h1h1h1h",
            " 1s",
            "1s ",
            "1S",
            "ms",
            "1m1",
        ];
        for s in samples {
            assert_eq!(re.is_match(s), parse_duration(s).is_some(), "{s:?}");
        }
    }

    #[test]
    fn the_schema_header_and_service_patterns_agree_with_the_checks() {
        let header = regex::Regex::new(HEADER_NAME_PATTERN).unwrap();
        for s in [
            "x-request-id",
            "X_Custom.1~",
            "",
            "bad header",
            "colon:",
            "a/b",
            "é",
        ] {
            assert_eq!(header.is_match(s), is_header_name(s), "{s:?}");
        }
        let dns = regex::Regex::new(DNS_LABEL_PATTERN).unwrap();
        for s in [
            "reviews-v2",
            "a",
            "",
            "Reviews",
            "1abc",
            "abc-",
            "a_b",
            "a.b",
        ] {
            let mut e = Errors::default();
            check_service_name(&mut e, "p", s);
            assert_eq!(dns.is_match(s), e.into_result().is_ok(), "{s:?}");
        }
    }
}
