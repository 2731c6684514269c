//! Every verb Baton's manifests grant, held to the table that justifies it.
//!
//! docs/operations.md has one table, "RBAC: every verb and why", with a row
//! per (account, API group, resources, verbs, scope, names). [`granted`]
//! reads every Role, ClusterRole and binding in `manifests/` (plain YAML, no
//! cluster) and expands them into [`Grant`]s; [`listed`] expands the table
//! the same way; the tests fail on a grant the table does not list, and on
//! a row no manifest grants, so the table stays the whole truth.
//!
//! Scope is where a grant applies: `cluster` (a ClusterRoleBinding) or a
//! namespace (a RoleBinding there). A ClusterRole no manifest binds is an
//! error: what it would grant depends on a binding the table cannot see.

use std::collections::BTreeSet;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

/// One permitted request shape.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Grant {
    /// ServiceAccount the grant is for.
    pub account: String,
    /// API group, `core` for the empty group.
    pub api_group: String,
    pub resource: String,
    pub verb: String,
    /// `cluster` or a namespace.
    pub scope: String,
    /// `resourceNames`, sorted, comma-joined; `—` when any name.
    pub names: String,
}

impl std::fmt::Display for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} {}/{} in {} (names: {})",
            self.account, self.verb, self.api_group, self.resource, self.scope, self.names
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RbacError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Yaml {
        path: String,
        source: serde_yaml_ng::Error,
    },
    #[error("{0}")]
    Shape(String),
}

/// Every YAML document of every `.yaml` file under `dir`, recursively.
pub fn documents(dir: &Path) -> Result<Vec<Value>, RbacError> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|source| RbacError::Read {
            path: d.display().to_string(),
            source,
        })?;
        for entry in entries {
            let path = entry
                .map_err(|source| RbacError::Read {
                    path: d.display().to_string(),
                    source,
                })?
                .path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml") {
                let text = std::fs::read_to_string(&path).map_err(|source| RbacError::Read {
                    path: path.display().to_string(),
                    source,
                })?;
                for doc in serde_yaml_ng::Deserializer::from_str(&text) {
                    let value = Value::deserialize(doc).map_err(|source| RbacError::Yaml {
                        path: path.display().to_string(),
                        source,
                    })?;
                    if !value.is_null() {
                        out.push(value);
                    }
                }
            }
        }
    }
    Ok(out)
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter().try_fold(v, |v, k| v.get(k))?.as_str()
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

fn is_rbac(doc: &Value, kind: &str) -> bool {
    str_at(doc, &["kind"]) == Some(kind)
        && str_at(doc, &["apiVersion"]).is_some_and(|v| v.starts_with("rbac.authorization.k8s.io/"))
}

/// The grants the RBAC objects among `docs` make.
pub fn granted(docs: &[Value]) -> Result<BTreeSet<Grant>, RbacError> {
    // (kind of role, role name, role namespace or None) -> rules.
    let role = |kind: &str, name: &str, ns: Option<&str>| -> Option<&Value> {
        docs.iter().find(|d| {
            is_rbac(d, kind)
                && str_at(d, &["metadata", "name"]) == Some(name)
                && (kind == "ClusterRole" || str_at(d, &["metadata", "namespace"]) == ns)
        })
    };
    let mut out = BTreeSet::new();
    let mut bound: BTreeSet<String> = BTreeSet::new();
    for doc in docs {
        let cluster_wide = is_rbac(doc, "ClusterRoleBinding");
        if !cluster_wide && !is_rbac(doc, "RoleBinding") {
            continue;
        }
        let name = str_at(doc, &["metadata", "name"]).unwrap_or("?");
        let ns = str_at(doc, &["metadata", "namespace"]);
        let scope = if cluster_wide {
            "cluster".to_owned()
        } else {
            ns.ok_or_else(|| RbacError::Shape(format!("RoleBinding {name} has no namespace")))?
                .to_owned()
        };
        let role_kind = str_at(doc, &["roleRef", "kind"]).unwrap_or("?");
        let role_name = str_at(doc, &["roleRef", "name"]).unwrap_or("?");
        let rules = role(role_kind, role_name, ns).ok_or_else(|| {
            RbacError::Shape(format!(
                "binding {name} refers to a missing {role_kind} {role_name}"
            ))
        })?;
        if role_kind == "ClusterRole" {
            bound.insert(role_name.to_owned());
        }
        let subjects = doc
            .get("subjects")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for subject in &subjects {
            let account = str_at(subject, &["name"]).unwrap_or("?");
            expand(account, &scope, rules, &mut out)?;
        }
    }
    for doc in docs.iter().filter(|d| is_rbac(d, "ClusterRole")) {
        let name = str_at(doc, &["metadata", "name"]).unwrap_or("?");
        if !bound.contains(name) {
            return Err(RbacError::Shape(format!(
                "ClusterRole {name} is bound by no manifest"
            )));
        }
    }
    Ok(out)
}

fn expand(
    account: &str,
    scope: &str,
    role: &Value,
    out: &mut BTreeSet<Grant>,
) -> Result<(), RbacError> {
    let rules = role
        .get("rules")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for rule in &rules {
        let mut names = strings(rule.get("resourceNames"));
        names.sort();
        let names = if names.is_empty() {
            "—".to_owned()
        } else {
            names.join(",")
        };
        for group in strings(rule.get("apiGroups")) {
            for resource in strings(rule.get("resources")) {
                for verb in strings(rule.get("verbs")) {
                    out.insert(Grant {
                        account: account.to_owned(),
                        api_group: if group.is_empty() {
                            "core".to_owned()
                        } else {
                            group.clone()
                        },
                        resource: resource.clone(),
                        verb,
                        scope: scope.to_owned(),
                        names: names.clone(),
                    });
                }
            }
        }
    }
    Ok(())
}

/// Heading of the table in docs/operations.md.
pub const TABLE_HEADING: &str = "## RBAC: every verb and why";

/// The grants the table under [`TABLE_HEADING`] lists. Cells may list
/// several values, comma-separated, each in backticks or not.
pub fn listed(markdown: &str) -> Result<BTreeSet<Grant>, RbacError> {
    let section = markdown
        .split_once(TABLE_HEADING)
        .map(|(_, rest)| rest)
        .ok_or_else(|| RbacError::Shape(format!("no section {TABLE_HEADING:?}")))?;
    let rows: Vec<Vec<String>> = section
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            l.trim()
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_owned())
                .collect()
        })
        .collect();
    let Some((header, body)) = rows.split_first() else {
        return Err(RbacError::Shape("the RBAC section has no table".into()));
    };
    let expected = [
        "Account",
        "API group",
        "Resource",
        "Verbs",
        "Scope",
        "Names",
        "Why",
    ];
    if header.iter().map(String::as_str).ne(expected) {
        return Err(RbacError::Shape(format!(
            "the RBAC table's columns are {header:?}, expected {expected:?}"
        )));
    }
    let values = |cell: &str| -> Vec<String> {
        cell.split(',')
            .map(|v| v.trim().trim_matches('`').trim().to_owned())
            .filter(|v| !v.is_empty())
            .collect()
    };
    let mut out = BTreeSet::new();
    // The row after the header is the `|---|` separator.
    for row in body.iter().skip(1) {
        if row.len() != expected.len() {
            return Err(RbacError::Shape(format!(
                "RBAC table row {row:?}: {} cells",
                row.len()
            )));
        }
        let mut names = values(&row[5]);
        names.sort();
        let names = if names.is_empty() || names == ["—"] {
            "—".to_owned()
        } else {
            names.join(",")
        };
        for account in values(&row[0]) {
            for group in values(&row[1]) {
                for resource in values(&row[2]) {
                    for verb in values(&row[3]) {
                        out.insert(Grant {
                            account: account.clone(),
                            api_group: group.clone(),
                            resource: resource.clone(),
                            verb,
                            scope: row[4].trim_matches('`').to_owned(),
                            names: names.clone(),
                        });
                    }
                }
            }
        }
    }
    Ok(out)
}

/// What `a` has that `b` lacks, one line each.
pub fn missing_from(a: &BTreeSet<Grant>, b: &BTreeSet<Grant>) -> Vec<String> {
    a.difference(b).map(ToString::to_string).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo() -> &'static Path {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace")
    }

    fn manifests() -> BTreeSet<Grant> {
        granted(&documents(&repo().join("manifests")).unwrap()).unwrap()
    }

    fn table() -> BTreeSet<Grant> {
        let doc = std::fs::read_to_string(repo().join("docs/operations.md")).unwrap();
        listed(&doc).unwrap()
    }

    #[test]
    fn every_verb_the_manifests_grant_is_listed_in_the_operations_table() {
        let unlisted = missing_from(&manifests(), &table());
        assert!(
            unlisted.is_empty(),
            "manifests/ grants what docs/operations.md ({TABLE_HEADING}) does not list; add a row with its reason, or drop the grant:\n{}",
            unlisted.join("\n")
        );
    }

    #[test]
    fn every_row_of_the_operations_table_is_granted_by_a_manifest() {
        let stale = missing_from(&table(), &manifests());
        assert!(
            stale.is_empty(),
            "docs/operations.md ({TABLE_HEADING}) lists what no manifest grants:\n{}",
            stale.join("\n")
        );
    }

    /// Decision 0058: ConfigMaps are touched in baton-system only, by
    /// anyone; the webhook only reads the trust bundle, by name.
    #[test]
    fn configmaps_are_granted_in_baton_system_only_and_the_webhook_reads_one_by_name() {
        let cm: Vec<Grant> = manifests()
            .into_iter()
            .filter(|g| g.resource == "configmaps")
            .collect();
        assert!(!cm.is_empty());
        for g in &cm {
            assert_eq!(g.scope, "baton-system", "{g}");
            if g.account == "baton-webhook" {
                assert!(["get", "list", "watch"].contains(&g.verb.as_str()), "{g}");
                assert_eq!(g.names, "baton-mesh-trust", "{g}");
            }
        }
    }

    const CLUSTER_ROLE: &str = r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: op}
rules:
  - apiGroups: ["", "events.k8s.io"]
    resources: ["events"]
    verbs: ["create"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: op}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: op}
subjects: [{kind: ServiceAccount, name: baton-operator, namespace: baton-system}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: cm, namespace: baton-system}
rules:
  - apiGroups: [""]
    resources: ["configmaps"]
    resourceNames: ["b", "a"]
    verbs: ["patch"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: cm, namespace: baton-system}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: cm}
subjects: [{kind: ServiceAccount, name: baton-operator, namespace: baton-system}]
"#;

    fn docs(yaml: &str) -> Vec<Value> {
        serde_yaml_ng::Deserializer::from_str(yaml)
            .map(|d| Value::deserialize(d).unwrap())
            .collect()
    }

    const TABLE: &str = "intro\n\n## RBAC: every verb and why\n\ntext\n\n\
| Account | API group | Resource | Verbs | Scope | Names | Why |\n\
|---|---|---|---|---|---|---|\n\
| `baton-operator` | `core`, `events.k8s.io` | `events` | `create` | cluster | — | describe |\n\
| `baton-operator` | `core` | `configmaps` | `patch` | baton-system | `a`, `b` | tally |\n\
\nafter\n";

    #[test]
    fn a_table_listing_each_grant_matches_the_manifests_scope_by_scope() {
        let g = granted(&docs(CLUSTER_ROLE)).unwrap();
        assert_eq!(g.len(), 3, "{g:?}");
        assert_eq!(g, listed(TABLE).unwrap());
    }

    #[test]
    fn a_verb_added_to_a_manifest_is_named_as_unlisted() {
        let yaml = CLUSTER_ROLE.replace(r#"verbs: ["patch"]"#, r#"verbs: ["patch", "delete"]"#);
        let unlisted = missing_from(&granted(&docs(&yaml)).unwrap(), &listed(TABLE).unwrap());
        assert_eq!(
            unlisted,
            ["baton-operator: delete core/configmaps in baton-system (names: a,b)"]
        );
    }

    #[test]
    fn a_grant_moved_to_another_scope_or_losing_its_names_is_unlisted() {
        // The Role's ConfigMap write bound cluster-wide instead.
        let wider = CLUSTER_ROLE.replace(
            "kind: Role\nmetadata: {name: cm, namespace: baton-system}",
            "kind: ClusterRole\nmetadata: {name: cm}",
        );
        let wider = wider.replace(
            "kind: RoleBinding\nmetadata: {name: cm, namespace: baton-system}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: cm}",
            "kind: ClusterRoleBinding\nmetadata: {name: cm}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: cm}",
        );
        let unlisted = missing_from(&granted(&docs(&wider)).unwrap(), &listed(TABLE).unwrap());
        assert_eq!(
            unlisted,
            ["baton-operator: patch core/configmaps in cluster (names: a,b)"]
        );
        let unnamed = CLUSTER_ROLE.replace(r#"    resourceNames: ["b", "a"]"#, "");
        let unlisted = missing_from(&granted(&docs(&unnamed)).unwrap(), &listed(TABLE).unwrap());
        assert_eq!(
            unlisted,
            ["baton-operator: patch core/configmaps in baton-system (names: —)"]
        );
    }

    #[test]
    fn a_binding_to_a_missing_role_is_an_error_not_a_silent_pass() {
        let yaml = CLUSTER_ROLE.replace("kind: Role, name: cm}", "kind: Role, name: gone}");
        assert!(matches!(granted(&docs(&yaml)), Err(RbacError::Shape(_))));
    }

    #[test]
    fn a_cluster_role_bound_by_nothing_is_an_error_not_a_silent_pass() {
        let yaml = format!(
            "{CLUSTER_ROLE}---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\n\
             metadata: {{name: loose}}\nrules: [{{apiGroups: [\"\"], resources: [configmaps], verbs: [patch]}}]\n"
        );
        let err = granted(&docs(&yaml)).unwrap_err();
        assert!(err.to_string().contains("loose"), "{err}");
    }
}
