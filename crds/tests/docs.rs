//! docs/crds.md documents every field of every kind: each schema path
//! (`spec.rules[].backendRefs[].weight`) appears in backticks, or its parent
//! row names it. Embedded Kubernetes types (selectors, resources,
//! conditions) are documented by reference and not descended into.

mod support;

use serde_json::Value;
use support::schema_of;

const EMBEDDED: &[&str] = &[
    "namespaceSelector",
    "podSelector",
    "canarySelector",
    "nodeSelector",
    "resources",
    "conditions",
];

fn paths(prefix: &str, node: &Value, out: &mut Vec<String>) {
    let Some(props) = node.get("properties").and_then(Value::as_object) else {
        return;
    };
    for (name, child) in props {
        let mut p = format!("{prefix}.{name}");
        let is_array = child.get("type").and_then(Value::as_str) == Some("array");
        if is_array {
            p.push_str("[]");
        }
        out.push(p.clone());
        if EMBEDDED.contains(&name.as_str()) {
            continue;
        }
        let inner = if is_array { &child["items"] } else { child };
        paths(&p, inner, out);
    }
}

fn documented(doc: &str, path: &str) -> bool {
    if doc.contains(&format!("`{path}`")) {
        return true;
    }
    // A parent row that names the leaf: `spec.x` ... `leaf`.
    let (parent, leaf) = path.rsplit_once('.').unwrap();
    let leaf = leaf.trim_end_matches("[]");
    doc.lines()
        .any(|l| l.contains(&format!("`{parent}`")) && l.contains(&format!("`{leaf}`")))
}

#[test]
fn docs_crds_md_documents_every_field_of_every_kind() {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/crds.md")).unwrap();
    let mut missing = vec![];
    for kind in baton_crds::objects::KINDS {
        assert!(doc.contains(&format!("## {kind}")), "no section for {kind}");
        let schema = schema_of(kind);
        let mut all = vec![];
        for top in ["spec", "status"] {
            paths(top, &schema["properties"][top], &mut all);
        }
        for p in all {
            // responseHeaderModifier has exactly requestHeaderModifier's fields,
            // documented once.
            let alias = p.replace("responseHeaderModifier.", "requestHeaderModifier.");
            if !documented(&doc, &p) && !documented(&doc, &alias) {
                missing.push(format!("{kind}: {p}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "undocumented fields in docs/crds.md: {missing:#?}"
    );
}
