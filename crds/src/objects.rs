//! Validation of a Baton object as the webhook receives it: JSON in, the
//! kind's [`Validate`] result out. Kept apart from `validation` so that the
//! error types every kind imports do not themselves import every kind (the
//! module graph stays acyclic: kinds -> validation, objects -> kinds).

use crate::validation::{FieldError, Validate};

/// Kinds [`validate_object`] knows.
pub const KINDS: &[&str] = &[
    "SidecarRelease",
    "Route",
    "TlsPolicy",
    "AcceleratorPool",
    "AuthorizationPolicy",
];

/// Validates a Baton object as the webhook receives it (JSON, already
/// defaulted by the API server or not): parses it as `kind`, then runs the
/// kind's [`Validate`]. A value that does not even parse (unknown enum value,
/// wrong type) is reported as one error on `spec` carrying serde's message,
/// which names the expected values. `None` when `kind` is not a Baton kind.
pub fn validate_object(
    kind: &str,
    object: &serde_json::Value,
) -> Option<Result<(), Vec<FieldError>>> {
    fn run<K: serde::de::DeserializeOwned + Validate>(
        object: &serde_json::Value,
    ) -> Result<(), Vec<FieldError>> {
        match K::deserialize(object) {
            Ok(k) => k.validate(),
            Err(e) => Err(vec![FieldError::new(
                "spec",
                format!("invalid object: {e}"),
            )]),
        }
    }
    Some(match kind {
        "SidecarRelease" => run::<crate::SidecarRelease>(object),
        "Route" => run::<crate::Route>(object),
        "TlsPolicy" => run::<crate::TlsPolicy>(object),
        "AcceleratorPool" => run::<crate::AcceleratorPool>(object),
        "AuthorizationPolicy" => run::<crate::AuthorizationPolicy>(object),
        _ => return None,
    })
}
