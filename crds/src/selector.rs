//! Pure `metav1.LabelSelector` matching, as the API server defines it:
//! every `matchLabels` pair and every `matchExpressions` requirement must
//! hold (AND). An empty selector matches everything; an absent one is the
//! caller's decision (Baton treats it as "everything").
//!
//! An unknown operator matches nothing, so a malformed selector fails closed
//! (validation rejects such selectors before they are stored anyway).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

use crate::validation::Errors;

/// Whether `labels` satisfy `selector`.
pub fn matches(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let labels_ok = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    labels_ok
        && selector
            .match_expressions
            .iter()
            .flatten()
            .all(|r| requirement_matches(r, labels))
}

/// Like [`matches`], with `None` meaning "select everything".
pub fn matches_opt(selector: Option<&LabelSelector>, labels: &BTreeMap<String, String>) -> bool {
    selector.is_none_or(|s| matches(s, labels))
}

fn requirement_matches(r: &LabelSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let value = labels.get(&r.key);
    let values = r.values.as_deref().unwrap_or_default();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        _ => false,
    }
}

/// Structural checks the API server does for built-in selectors but not for
/// CRD fields: known operators, values present exactly when required.
pub(crate) fn check(errors: &mut Errors, path: &str, selector: &LabelSelector) {
    for (i, r) in selector.match_expressions.iter().flatten().enumerate() {
        let p = format!("{path}.matchExpressions[{i}]");
        let has_values = r.values.as_ref().is_some_and(|v| !v.is_empty());
        if r.key.is_empty() {
            errors.push(
                format!("{p}.key"),
                "must not be empty: name the label to test",
            );
        }
        match r.operator.as_str() {
            "In" | "NotIn" if !has_values => errors.push(
                format!("{p}.values"),
                format!("operator {} needs at least one value", r.operator),
            ),
            "Exists" | "DoesNotExist" if has_values => errors.push(
                format!("{p}.values"),
                format!("operator {} takes no values: remove them", r.operator),
            ),
            "In" | "NotIn" | "Exists" | "DoesNotExist" => {}
            other => errors.push(
                format!("{p}.operator"),
                format!("unknown operator {other:?}: use In, NotIn, Exists or DoesNotExist"),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn req(key: &str, op: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: if values.is_empty() {
                None
            } else {
                Some(values.iter().map(|v| v.to_string()).collect())
            },
        }
    }

    fn exprs(rs: Vec<LabelSelectorRequirement>) -> LabelSelector {
        LabelSelector {
            match_expressions: Some(rs),
            match_labels: None,
        }
    }

    #[test]
    fn empty_selector_matches_everything() {
        assert!(matches(&LabelSelector::default(), &labels(&[])));
        assert!(matches(&LabelSelector::default(), &labels(&[("a", "b")])));
    }

    #[test]
    fn absent_selector_matches_everything() {
        assert!(matches_opt(None, &labels(&[])));
    }

    #[test]
    fn match_labels_require_every_pair() {
        let s = LabelSelector {
            match_labels: Some(labels(&[("app", "web"), ("tier", "fe")])),
            match_expressions: None,
        };
        assert!(matches(
            &s,
            &labels(&[("app", "web"), ("tier", "fe"), ("x", "y")])
        ));
        assert!(!matches(&s, &labels(&[("app", "web")])));
        assert!(!matches(&s, &labels(&[("app", "web"), ("tier", "be")])));
    }

    #[test]
    fn in_requires_the_label_with_one_of_the_values() {
        let s = exprs(vec![req("env", "In", &["prod", "staging"])]);
        assert!(matches(&s, &labels(&[("env", "prod")])));
        assert!(!matches(&s, &labels(&[("env", "dev")])));
        assert!(!matches(&s, &labels(&[])));
    }

    #[test]
    fn not_in_matches_when_the_label_is_absent_or_has_another_value() {
        let s = exprs(vec![req("env", "NotIn", &["prod"])]);
        assert!(matches(&s, &labels(&[])));
        assert!(matches(&s, &labels(&[("env", "dev")])));
        assert!(!matches(&s, &labels(&[("env", "prod")])));
    }

    #[test]
    fn exists_and_does_not_exist_ignore_the_value() {
        let e = exprs(vec![req("canary", "Exists", &[])]);
        let d = exprs(vec![req("canary", "DoesNotExist", &[])]);
        let with = labels(&[("canary", "")]);
        assert!(matches(&e, &with) && !matches(&d, &with));
        assert!(!matches(&e, &labels(&[])) && matches(&d, &labels(&[])));
    }

    #[test]
    fn labels_and_expressions_are_anded() {
        let s = LabelSelector {
            match_labels: Some(labels(&[("app", "web")])),
            match_expressions: Some(vec![req("env", "In", &["prod"])]),
        };
        assert!(matches(&s, &labels(&[("app", "web"), ("env", "prod")])));
        assert!(!matches(&s, &labels(&[("app", "web"), ("env", "dev")])));
        assert!(!matches(&s, &labels(&[("app", "api"), ("env", "prod")])));
    }

    #[test]
    fn unknown_operator_matches_nothing() {
        let s = exprs(vec![req("env", "Near", &["prod"])]);
        assert!(!matches(&s, &labels(&[("env", "prod")])));
    }

    #[test]
    fn check_rejects_unknown_operators_and_misplaced_values() {
        let s = exprs(vec![
            req("a", "In", &[]),
            req("b", "Exists", &["x"]),
            req("c", "Near", &["x"]),
            req("", "Exists", &[]),
            req("ok", "NotIn", &["x"]),
        ]);
        let mut e = Errors::default();
        check(&mut e, "spec.podSelector", &s);
        let paths: Vec<String> = e
            .into_result()
            .unwrap_err()
            .into_iter()
            .map(|e| e.path)
            .collect();
        assert_eq!(
            paths,
            [
                "spec.podSelector.matchExpressions[0].values",
                "spec.podSelector.matchExpressions[1].values",
                "spec.podSelector.matchExpressions[2].operator",
                "spec.podSelector.matchExpressions[3].key",
            ]
        );
    }
}
