//! The one place Baton reads and writes YAML (serde_yaml_ng), so the
//! dependency can be swapped without touching callers.

use serde::{Serialize, de::DeserializeOwned};

/// A YAML (de)serialization failure.
#[derive(Debug, thiserror::Error)]
#[error("yaml: {0}")]
pub struct YamlError(#[from] serde_yaml_ng::Error);

/// Renders `value` as one YAML document (no leading `---`).
pub fn to_string<T: Serialize>(value: &T) -> Result<String, YamlError> {
    Ok(serde_yaml_ng::to_string(value)?)
}

/// Parses one YAML document.
pub fn from_str<T: DeserializeOwned>(s: &str) -> Result<T, YamlError> {
    Ok(serde_yaml_ng::from_str(s)?)
}

/// Parses a multi-document stream (`---` separated); empty documents
/// (comments only) are skipped.
pub fn documents(s: &str) -> Result<Vec<serde_json::Value>, YamlError> {
    use serde::Deserialize as _;
    let mut out = vec![];
    for doc in serde_yaml_ng::Deserializer::from_str(s) {
        let v = serde_json::Value::deserialize(doc)?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_splits_a_stream_and_skips_empty_documents() {
        let docs = documents("# only a comment\n---\na: 1\n---\n---\nb: [x]\n").unwrap();
        assert_eq!(
            docs,
            vec![serde_json::json!({"a": 1}), serde_json::json!({"b": ["x"]})]
        );
    }

    #[test]
    fn round_trips_a_value() {
        let v = serde_json::json!({"k": ["a", 1, true]});
        let back: serde_json::Value = from_str(&to_string(&v).unwrap()).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn malformed_yaml_is_an_error() {
        assert!(documents("a: [1, 2").is_err());
    }
}
