//! Helpers shared by the integration tests: build objects as users write
//! them (JSON/YAML), and judge them both ways — the Rust `Validate` the
//! webhook runs, and the CEL rules the API server runs from the schema.

#![allow(dead_code)]

use baton_crds::objects::validate_object;
use baton_crds::schema::crds;
use serde_json::{Value, json};

/// The `openAPIV3Schema` of `kind` as generated.
pub fn schema_of(kind: &str) -> Value {
    let crd = crds()
        .into_iter()
        .find(|c| c.spec.names.kind == kind)
        .unwrap_or_else(|| panic!("no CRD for {kind}"));
    let schema = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("every version has a schema");
    serde_json::to_value(schema).unwrap()
}

/// A full object of `kind` with `spec`.
pub fn object(kind: &str, spec: Value) -> Value {
    let namespaced = matches!(kind, "Route" | "TlsPolicy" | "AuthorizationPolicy");
    let mut metadata = json!({ "name": "sample", "generation": 1 });
    if namespaced {
        metadata["namespace"] = json!("default");
    }
    json!({
        "apiVersion": "baton.dev/v1alpha1",
        "kind": kind,
        "metadata": metadata,
        "spec": spec,
    })
}

/// Paths of the errors the webhook's validation reports (empty when valid).
pub fn rust_errors(kind: &str, obj: &Value) -> Vec<String> {
    match validate_object(kind, obj).expect("a Baton kind") {
        Ok(()) => vec![],
        Err(errs) => errs
            .into_iter()
            .map(|e| format!("{}: {}", e.path, e.message))
            .collect(),
    }
}

/// Messages of the CEL rules that fail, evaluated like the API server does
/// (schema defaults applied first).
pub fn cel_errors(kind: &str, obj: &Value) -> Vec<String> {
    match kube_cel::validate(&schema_of(kind), obj, None) {
        Ok(()) => vec![],
        Err(errs) => errs.iter().map(|e| e.to_string()).collect(),
    }
}

/// Applies a JSON merge-patch-like edit: sets `path` (dotted, with numeric
/// segments for list indices) to `value`, or removes it when `value` is null.
pub fn set(mut obj: Value, path: &str, value: Value) -> Value {
    let parts: Vec<&str> = path.split('.').collect();
    let (last, parents) = parts.split_last().unwrap();
    let mut cur = &mut obj;
    for p in parents {
        cur = match p.parse::<usize>() {
            Ok(i) => &mut cur[i],
            Err(_) => {
                if cur.get(*p).is_none() {
                    cur[*p] = json!({});
                }
                &mut cur[*p]
            }
        };
    }
    match (last.parse::<usize>(), value.is_null()) {
        (Ok(i), _) => {
            let list = cur.as_array_mut().expect("numeric segment indexes a list");
            if i == list.len() {
                list.push(value);
            } else {
                list[i] = value;
            }
        }
        (Err(_), true) => {
            cur.as_object_mut().unwrap().remove(*last);
        }
        (Err(_), false) => cur[*last] = value,
    }
    obj
}
