//! The CRDs as Baton installs them, adjusted for old API servers.
//!
//! kube's derive produces a structural schema, but `Option<Enum>` fields
//! still carry `null` inside `enum` (schemars lists it as an allowed value).
//! Kubernetes 1.20 — the e2e API server — refuses such a CRD with a 422 that
//! blames an unrelated field, so [`crds`] strips `null` from every `enum`
//! list (nullability is already expressed by `nullable: true`). Everything
//! else (`x-kubernetes-validations`, which 1.20 silently drops) is left as is.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use serde_json::Value;

use crate::{AcceleratorPool, AuthorizationPolicy, Route, SidecarRelease, TlsPolicy};

/// Every Baton CRD, in a stable order, ready to apply.
pub fn crds() -> Vec<CustomResourceDefinition> {
    [
        SidecarRelease::crd(),
        Route::crd(),
        TlsPolicy::crd(),
        AcceleratorPool::crd(),
        AuthorizationPolicy::crd(),
    ]
    .into_iter()
    .map(for_old_apiservers)
    .collect()
}

/// File name of a CRD under `manifests/crds/`: `<plural>.<group>.yaml`.
pub fn file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}.yaml", crd.metadata.name.as_deref().unwrap_or_default())
}

/// Applies the schema transforms described in the module docs.
pub fn for_old_apiservers(crd: CustomResourceDefinition) -> CustomResourceDefinition {
    let mut value = serde_json::to_value(&crd).expect("a CRD serializes to JSON");
    strip_null_from_enums(&mut value);
    serde_json::from_value(value).expect("the transform keeps a valid CRD")
}

/// Removes `null` from every `enum` array, recursively.
pub fn strip_null_from_enums(value: &mut Value) {
    match value {
        Value::Object(map) => {
            if let Some(Value::Array(items)) = map.get_mut("enum") {
                items.retain(|v| !v.is_null());
            }
            map.values_mut().for_each(strip_null_from_enums);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_null_from_enums),
        _ => {}
    }
}

/// Renders every CRD as YAML: `(file name, document)` pairs.
pub fn render() -> Result<Vec<(String, String)>, crate::yaml::YamlError> {
    crds()
        .iter()
        .map(|crd| Ok((file_name(crd), crate::yaml::to_string(crd)?)))
        .collect()
}

/// Joins rendered documents into one multi-document YAML stream.
pub fn stream(docs: &[(String, String)]) -> String {
    docs.iter().map(|(_, doc)| format!("---\n{doc}")).collect()
}
