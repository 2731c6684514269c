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
