//! Field-level validation shared by every kind.
//!
//! Each kind implements [`Validate`]; the webhook's `/validate` endpoint calls
//! it for every Baton object (the e2e API server, Kubernetes 1.20, has no CEL,
//! so these functions are the enforcement there) and turns the errors into an
//! admission denial. The same rules, where CEL can express them, are also in
//! the schema as `x-kubernetes-validations`, so newer clusters refuse bad
//! objects at `kubectl apply` even without the webhook.
//!
//! Messages say what to change, not just what is wrong.

use std::fmt;

/// One problem with one field, addressed by its JSON path
/// (`spec.rules[0].backendRefs[1].weight`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Dotted path with `[i]` list indices, as `kubectl explain` spells fields.
    pub path: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl FieldError {
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Validation of a whole object, beyond what the OpenAPI schema checks.
pub trait Validate {
    /// `Ok(())` when the object is acceptable; otherwise every problem found
    /// (not just the first, so a user fixes them in one round).
    fn validate(&self) -> Result<(), Vec<FieldError>>;
}

/// Joins errors into one admission message: `a: ...; b: ...`.
pub fn summarize(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Collects errors while walking an object; `into_result` finishes.
#[derive(Debug, Default)]
pub(crate) struct Errors(Vec<FieldError>);

impl Errors {
    pub(crate) fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(FieldError::new(path, message));
    }

    pub(crate) fn into_result(self) -> Result<(), Vec<FieldError>> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_error_displays_path_then_message() {
        let e = FieldError::new("spec.rules[0].name", "must be unique");
        assert_eq!(e.to_string(), "spec.rules[0].name: must be unique");
    }

    #[test]
    fn summarize_joins_every_error_with_semicolons() {
        let errs = vec![FieldError::new("a", "x"), FieldError::new("b", "y")];
        assert_eq!(summarize(&errs), "a: x; b: y");
    }

    #[test]
    fn empty_collector_is_ok_and_nonempty_is_err() {
        assert_eq!(Errors::default().into_result(), Ok(()));
        let mut e = Errors::default();
        e.push("p", "m");
        assert_eq!(e.into_result(), Err(vec![FieldError::new("p", "m")]));
    }
}
