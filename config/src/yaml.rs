//! The one place YAML is read or written (serde_yaml_ng), plus redaction for
//! `/config`. Everything else deals in typed [`Snapshot`]s.

use crate::Snapshot;

/// Parse error with a line/column the user can act on.
#[derive(Debug, thiserror::Error)]
#[error("invalid config YAML: {0}")]
pub struct ParseError(#[from] serde_yaml_ng::Error);

/// Parse a snapshot from YAML text (unknown fields are errors, not ignored:
/// a typo must not silently turn a feature off).
pub fn parse(text: &str) -> Result<Snapshot, ParseError> {
    Ok(serde_yaml_ng::from_str(text)?)
}

/// Render a snapshot as YAML.
pub fn to_string(snapshot: &Snapshot) -> Result<String, ParseError> {
    Ok(serde_yaml_ng::to_string(snapshot)?)
}

/// Key names whose values never leave the process through `/config`.
const SECRET_KEYS: &[&str] = &[
    "key",
    "key_pem",
    "private_key",
    "password",
    "secret",
    "token",
];

/// The snapshot as JSON with every secret-looking value replaced, for
/// `/config`. Works on the serialized tree, by key name, so a field added
/// later (an inline key in the `tls` section, say) is covered without being
/// listed here.
pub fn redacted_json(snapshot: &Snapshot) -> serde_json::Value {
    let mut value = serde_json::to_value(snapshot).unwrap_or(serde_json::Value::Null);
    redact(&mut value);
    value
}

fn redact(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                let lower = k.to_ascii_lowercase();
                let secret = SECRET_KEYS
                    .iter()
                    .any(|s| lower == *s || lower.ends_with(&format!("_{s}")));
                // Paths to key files are not secrets; inline material is.
                if secret && !lower.ends_with("_file") && !lower.ends_with("_path") {
                    *v = serde_json::Value::String("<redacted>".into());
                } else {
                    redact(v);
                }
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(redact),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_are_rejected_with_their_name() {
        let err = parse("version: 1\nlistenres: []\n").unwrap_err();
        assert!(err.to_string().contains("listenres"), "{err}");
    }

    #[test]
    fn snapshot_round_trips_through_yaml() {
        let text = include_str!("../../examples/standalone.yaml");
        let snap = parse(text).unwrap();
        let again = parse(&to_string(&snap).unwrap()).unwrap();
        assert_eq!(snap, again);
    }

    #[test]
    fn redaction_hides_inline_keys_but_keeps_file_paths() {
        let mut v = serde_json::json!({
            "key_pem": "-----BEGIN PRIVATE KEY-----",
            "key_file": "/etc/key.pem",
            "nested": [{"token": "abc"}]
        });
        redact(&mut v);
        assert_eq!(v["key_pem"], "<redacted>");
        assert_eq!(v["key_file"], "/etc/key.pem");
        assert_eq!(v["nested"][0]["token"], "<redacted>");
    }

    #[test]
    fn redaction_hides_the_tls_sections_key_and_keeps_the_rest() {
        let snap = parse(
            "tls:\n  source:\n    files: {cert_chain: /tls/cert.pem, key: /tls/key.pem, trust_bundle: /tls/ca.pem}\n",
        )
        .unwrap();
        let v = redacted_json(&snap);
        let files = &v["tls"]["source"]["files"];
        assert_eq!(files["key"], "<redacted>");
        assert_eq!(files["cert_chain"], "/tls/cert.pem");
        assert_eq!(files["trust_bundle"], "/tls/ca.pem");
        assert_eq!(v["tls"]["mode"], "Strict");
        assert!(!v.to_string().contains("key.pem"), "{v}");
    }
}
