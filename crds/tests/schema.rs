//! The generated CRDs: pinned to the committed manifests (snapshot), and
//! checked for what the e2e API server (Kubernetes 1.20) needs — structural
//! schemas, no `null` inside `enum`, int-or-string marked as such — plus the
//! things users see: descriptions everywhere (`kubectl explain`), printer
//! columns that point at real fields, short names, and CEL rules that
//! compile.

mod support;

use std::path::Path;

use baton_crds::schema::{crds, file_name, render, stream, strip_null_from_enums};
use serde_json::{Value, json};
use support::schema_of;

const KINDS: [&str; 5] = [
    "SidecarRelease",
    "Route",
    "TlsPolicy",
    "AcceleratorPool",
    "AuthorizationPolicy",
];

fn walk<'a>(path: &str, v: &'a Value, visit: &mut dyn FnMut(&str, &'a Value)) {
    visit(path, v);
    match v {
        Value::Object(m) => {
            for (k, c) in m {
                walk(&format!("{path}/{k}"), c, visit);
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate() {
                walk(&format!("{path}/{i}"), c, visit);
            }
        }
        _ => {}
    }
}

#[test]
fn generated_crds_match_the_committed_manifests() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/crds");
    let docs = render().unwrap();
    assert_eq!(docs.len(), 5);
    for (name, doc) in &docs {
        let committed = std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| {
            panic!("manifests/crds/{name}: {e}; run crdgen --out manifests/crds")
        });
        assert!(
            committed == *doc,
            "manifests/crds/{name} is stale: run `cargo run -p baton-crds --bin crdgen -- --out manifests/crds`"
        );
    }
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    let mut generated: Vec<String> = docs.iter().map(|(n, _)| n.clone()).collect();
    generated.sort();
    assert_eq!(
        on_disk, generated,
        "manifests/crds holds files crdgen does not write"
    );
}

#[test]
fn crds_are_named_plural_dot_group_with_expected_scope_and_short_names() {
    let want = [
        ("sidecarreleases.baton.dev", "Cluster", "sr"),
        ("routes.baton.dev", "Namespaced", "brt"),
        ("tlspolicies.baton.dev", "Namespaced", "tlsp"),
        ("acceleratorpools.baton.dev", "Cluster", "accpool"),
        ("authorizationpolicies.baton.dev", "Namespaced", "authz"),
    ];
    let got: Vec<(String, String, String)> = crds()
        .iter()
        .map(|c| {
            (
                c.metadata.name.clone().unwrap(),
                c.spec.scope.clone(),
                c.spec
                    .names
                    .short_names
                    .clone()
                    .unwrap_or_default()
                    .join(","),
            )
        })
        .collect();
    let want: Vec<(String, String, String)> = want
        .iter()
        .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
        .collect();
    assert_eq!(got, want);
    for c in crds() {
        assert_eq!(file_name(&c), format!("{}.yaml", c.metadata.name.unwrap()));
        assert_eq!(c.spec.group, baton_crds::contract::GROUP);
        let v = &c.spec.versions[0];
        assert_eq!(v.name, baton_crds::contract::VERSION);
        assert!(v.served && v.storage);
        assert!(
            v.subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some(),
            "{} has no status subresource",
            c.spec.names.kind
        );
        assert_eq!(
            c.spec.names.categories.as_deref(),
            Some(&["baton".to_string()][..])
        );
    }
}

#[test]
fn no_enum_contains_null_which_kubernetes_1_20_rejects() {
    for kind in KINDS {
        walk("", &schema_of(kind), &mut |path, v| {
            if let Some(Value::Array(items)) = v.get("enum") {
                assert!(
                    !items.iter().any(Value::is_null),
                    "{kind}{path}: enum contains null"
                );
            }
        });
    }
}

#[test]
fn strip_null_from_enums_removes_null_at_any_depth_and_keeps_other_values() {
    let mut v = json!({
        "enum": ["A", null, "B"],
        "properties": { "x": { "items": { "enum": [null, 1] } } }
    });
    strip_null_from_enums(&mut v);
    assert_eq!(
        v,
        json!({ "enum": ["A", "B"], "properties": { "x": { "items": { "enum": [1] } } } })
    );
}

#[test]
fn schemas_are_structural_without_refs_or_junctors() {
    for kind in KINDS {
        walk("", &schema_of(kind), &mut |path, v| {
            if let Value::Object(m) = v {
                for banned in [
                    "$ref",
                    "anyOf",
                    "oneOf",
                    "allOf",
                    "not",
                    "definitions",
                    "$defs",
                ] {
                    assert!(
                        !m.contains_key(banned) || path.ends_with("/properties"),
                        "{kind}{path}: has {banned}"
                    );
                }
            }
        });
    }
}

/// Every schema node below `properties`/`items` declares a type, except
/// int-or-string and preserve-unknown-fields nodes.
fn check_types(kind: &str, path: &str, node: &Value) {
    let int_or_string = node.get("x-kubernetes-int-or-string") == Some(&json!(true));
    let preserve = node.get("x-kubernetes-preserve-unknown-fields") == Some(&json!(true));
    if int_or_string {
        assert!(
            node.get("type").is_none(),
            "{kind}{path}: int-or-string must not set type"
        );
    } else if !preserve {
        assert!(node.get("type").is_some(), "{kind}{path}: no type");
    }
    if let Some(Value::Object(props)) = node.get("properties") {
        assert_eq!(
            node.get("type"),
            Some(&json!("object")),
            "{kind}{path}: properties without type object"
        );
        for (k, child) in props {
            check_types(kind, &format!("{path}.{k}"), child);
        }
    }
    if let Some(items) = node.get("items") {
        check_types(kind, &format!("{path}[]"), items);
    }
    if let Some(add) = node.get("additionalProperties").filter(|a| a.is_object()) {
        check_types(kind, &format!("{path}{{}}"), add);
    }
}

#[test]
fn every_schema_node_has_a_type_or_is_int_or_string() {
    for kind in KINDS {
        check_types(kind, "", &schema_of(kind));
    }
}

#[test]
fn int_or_percent_fields_are_marked_int_or_string() {
    let s = schema_of("SidecarRelease");
    let mu = &s["properties"]["spec"]["properties"]["upgrade"]["properties"]["maxUnavailable"];
    assert_eq!(mu["x-kubernetes-int-or-string"], json!(true));
    assert_eq!(mu["default"], json!(1));
}

fn check_descriptions(kind: &str, path: &str, node: &Value, missing: &mut Vec<String>) {
    if let Some(Value::Object(props)) = node.get("properties") {
        for (k, child) in props {
            let p = format!("{path}.{k}");
            let top_level =
                path.is_empty() && matches!(k.as_str(), "apiVersion" | "kind" | "metadata");
            if !top_level
                && child
                    .get("description")
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty)
            {
                missing.push(format!("{kind}{p}"));
            }
            check_descriptions(kind, &p, child, missing);
        }
    }
    if let Some(items) = node.get("items") {
        check_descriptions(kind, &format!("{path}[]"), items, missing);
    }
}

#[test]
fn every_field_has_a_description_for_kubectl_explain() {
    let mut missing = vec![];
    for kind in KINDS {
        let s = schema_of(kind);
        assert!(
            s.get("description").is_some(),
            "{kind}: no kind description"
        );
        check_descriptions(kind, "", &s, &mut missing);
    }
    assert!(
        missing.is_empty(),
        "fields without description: {missing:#?}"
    );
}

fn resolve<'a>(schema: &'a Value, json_path: &str) -> Option<&'a Value> {
    // `.spec.a.b` or `.status.conditions[?(...)].status`
    // Drop filter expressions (`[?(@.type=="Accepted")]` -> `[]`): they
    // contain dots of their own.
    let mut simple = String::new();
    let mut rest = json_path;
    while let Some(start) = rest.find("[?(") {
        let end = rest[start..].find(")]").expect("closed filter") + start + 2;
        simple.push_str(&rest[..start]);
        simple.push_str("[]");
        rest = &rest[end..];
    }
    simple.push_str(rest);
    let mut node = schema;
    for seg in simple.trim_start_matches('.').split('.') {
        let (name, filtered) = match seg.split_once('[') {
            Some((n, _)) => (n, true),
            None => (seg, false),
        };
        if name == "metadata" {
            return Some(node);
        }
        node = node.get("properties")?.get(name)?;
        if filtered {
            node = node.get("items")?;
        }
    }
    Some(node)
}

#[test]
fn printer_columns_point_at_fields_of_the_declared_type() {
    for crd in crds() {
        let kind = crd.spec.names.kind.clone();
        let v = &crd.spec.versions[0];
        let schema = serde_json::to_value(
            v.schema
                .as_ref()
                .unwrap()
                .open_api_v3_schema
                .as_ref()
                .unwrap(),
        )
        .unwrap();
        let cols = v
            .additional_printer_columns
            .as_ref()
            .expect("printer columns");
        assert!(cols.len() >= 4, "{kind}: too few printer columns");
        assert_eq!(cols.last().unwrap().name, "Age");
        for c in cols {
            let field = resolve(&schema, &c.json_path).unwrap_or_else(|| {
                panic!(
                    "{kind}: column {} points at missing {}",
                    c.name, c.json_path
                )
            });
            if c.type_ != "date" {
                assert_eq!(
                    field.get("type").and_then(Value::as_str),
                    Some(c.type_.as_str()),
                    "{kind}: column {} type",
                    c.name
                );
            }
        }
    }
}

fn rules(schema: &Value) -> Vec<String> {
    let mut out = vec![];
    walk("", schema, &mut |_, v| {
        if let Some(Value::Array(rs)) = v.get("x-kubernetes-validations") {
            for r in rs {
                out.push(r["rule"].as_str().unwrap().to_owned());
                assert!(
                    r["message"].as_str().is_some_and(|m| !m.is_empty()),
                    "rule without message: {r}"
                );
            }
        }
    });
    out
}

#[test]
fn every_cel_rule_compiles() {
    let mut total = 0;
    for kind in KINDS {
        let s = schema_of(kind);
        total += rules(&s).len();
        let compiled = kube_cel::compile_schema(&s);
        assert!(
            !compiled.has_errors(),
            "{kind}: CEL compilation errors: {:?}",
            compiled.compilation_errors()
        );
    }
    assert_eq!(total, 15, "CEL rule count changed: update docs/crds.md");
}

#[test]
fn stdout_stream_is_a_multi_document_yaml_with_every_crd() {
    let docs = render().unwrap();
    let s = stream(&docs);
    assert_eq!(s.matches("---\n").count(), 5);
    for (_, doc) in &docs {
        assert!(s.contains(doc.as_str()));
    }
    for doc in s.split("---\n").filter(|d| !d.is_empty()) {
        let crd: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition =
            baton_crds::yaml::from_str(doc).unwrap();
        assert_eq!(crd.spec.group, "baton.dev");
    }
}

#[test]
fn cel_rules_stay_within_the_cost_budget_with_bounded_lists_and_strings() {
    // The analyzer does flag an unbounded list, so silence below means bounded.
    let unbounded = json!({
        "type": "object",
        "properties": { "xs": { "type": "array", "items": { "type": "string" } } }
    });
    let rule = "self.xs.all(a, self.xs.exists(b, a == b))";
    assert!(!kube_cel::estimate_rule_cost(rule, &kube_cel::compile_schema(&unbounded)).is_empty());

    for kind in KINDS {
        let mut warnings = vec![];
        walk("", &schema_of(kind), &mut |path, node| {
            let Some(Value::Array(rs)) = node.get("x-kubernetes-validations") else {
                return;
            };
            let compiled = kube_cel::compile_schema(node);
            for r in rs {
                let rule = r["rule"].as_str().unwrap();
                // Scope analysis is skipped: kube-cel 0.8 reports macro
                // variables (`r` in `all(r, ...)`) as out of scope.
                for w in kube_cel::estimate_rule_cost(rule, &compiled) {
                    warnings.push(format!("{kind}{path}: {}: {}", w.rule, w.message));
                }
            }
        });
        assert!(warnings.is_empty(), "{warnings:#?}");
    }
}

#[test]
fn the_raw_derive_output_has_the_null_enum_trap_that_crds_removes() {
    use kube::CustomResourceExt;
    let count_nulls = |v: &Value| {
        let mut n = 0;
        walk("", v, &mut |_, node| {
            if let Some(Value::Array(items)) = node.get("enum") {
                n += items.iter().filter(|i| i.is_null()).count();
            }
        });
        n
    };
    // Option<HttpMethod> (spec.rules[].matches[].method) is the case today.
    let raw = serde_json::to_value(baton_crds::Route::crd()).unwrap();
    assert!(
        count_nulls(&raw) > 0,
        "kube/schemars no longer emit null in enum; the transform may go"
    );
    let ours = serde_json::to_value(
        crds()
            .into_iter()
            .find(|c| c.spec.names.kind == "Route")
            .unwrap(),
    )
    .unwrap();
    assert_eq!(count_nulls(&ours), 0);
}
