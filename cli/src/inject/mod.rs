//! `kubectl baton inject`: a manifest with exactly what the webhook would
//! inject (like `linkerd inject --manual`).
//!
//! Every pod template (Pod, Deployment, StatefulSet, DaemonSet, ReplicaSet,
//! ReplicationController, Job, CronJob; inside `List`s too) is turned into
//! the Pod the webhook would see, opted in with the pod label
//! `baton.dev/inject=enabled`, and given to the webhook's own
//! [`baton_webhook::inject::mutate`]; its JSON patch is applied to the
//! template. Other objects pass through unchanged. The result carries
//! `baton.dev/status=injected`, so the webhook leaves it alone when it is
//! applied (and `inject` on its own output changes nothing).
//!
//! The cluster facts come from `--release FILE` (offline: no API call) or
//! from the cluster ([`facts`]); the injection settings are the webhook's
//! ([`settings`]).

pub mod facts;
pub mod settings;

#[cfg(test)]
mod tests;

use std::{collections::BTreeSet, io::Read as _, path::PathBuf};

use anyhow::{Context as _, anyhow, bail};
use baton_crds::contract::labels;
use baton_webhook::inject::{
    ClusterView, DenialReason, InjectConfig, Outcome as MutateOutcome, ServerVersion, Skip, mutate,
};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

use crate::{Ctx, Format, Outcome};
use facts::Facts;
use settings::WebhookFlags;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Manifest to inject (`-` for standard input): YAML documents
    /// (`---`-separated, `kind: List` too) or JSON.
    #[arg(short = 'f', long = "filename")]
    pub file: PathBuf,
    /// Inject offline: the SidecarReleases (and any TlsPolicies,
    /// AcceleratorPools, Nodes, Namespaces) are read from FILE, not from the
    /// cluster. Repeatable.
    #[arg(long = "release", value_name = "FILE")]
    pub releases: Vec<PathBuf>,
    /// The API server version the injection is for (`1.NN`): native
    /// sidecars from 1.32. Default: the cluster's (offline: 1.33, the
    /// newest this build knows).
    #[arg(long, value_name = "1.NN", value_parser = parse_version)]
    pub kubernetes_version: Option<ServerVersion>,
    #[command(flatten)]
    pub webhook: WebhookFlags,
}

/// `1.NN` (or `v1.NN`, `1.NN.P`).
pub fn parse_version(s: &str) -> Result<ServerVersion, String> {
    let t = s.trim().trim_start_matches('v');
    let mut parts = t.split('.');
    let (Some(major), Some(minor)) = (parts.next(), parts.next()) else {
        return Err(format!(
            "{s:?} is not a Kubernetes version: use 1.NN, such as 1.33"
        ));
    };
    let digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
    if !digits(major) || !digits(minor) {
        return Err(format!(
            "{s:?} is not a Kubernetes version: use 1.NN, such as 1.33"
        ));
    }
    ServerVersion::parse(major, minor)
        .ok_or_else(|| format!("{s:?} is not a Kubernetes version: use 1.NN, such as 1.33"))
}

pub async fn run(ctx: &Ctx, args: Args) -> anyhow::Result<Outcome> {
    let injected = inject(ctx, &args).await?;
    for note in &injected.notes {
        eprintln!("note: {note}");
    }
    print!("{}", render(&injected.docs, ctx.output())?);
    Ok(Outcome::Success)
}

/// Reads the manifest and the facts (file or cluster) and injects.
pub async fn inject(ctx: &Ctx, args: &Args) -> anyhow::Result<Injected> {
    let (name, text) = read_input(&args.file)?;
    let docs = parse_documents(&text).with_context(|| name.clone())?;
    let offline = !args.releases.is_empty();
    let default_namespace = if offline {
        ctx.global
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_owned())
    } else {
        ctx.namespace().await.map_err(unreachable_hint)?
    };
    let (facts, config) = if offline {
        let mut files = Vec::new();
        for path in &args.releases {
            let (name, text) = read_input(path)?;
            let docs = parse_documents(&text).with_context(|| name.clone())?;
            files.push((name, docs));
        }
        let facts = facts::offline(
            &files,
            args.kubernetes_version
                .unwrap_or(facts::NEWEST_KNOWN_VERSION),
        )?;
        (facts, args.webhook.inject_config()?)
    } else {
        let namespaces = namespaces_of(&docs, &default_namespace);
        let facts = facts::from_cluster(ctx, &namespaces, args.kubernetes_version)
            .await
            .map_err(unreachable_hint)?;
        let from_cluster = facts::webhook_flags_from_cluster(ctx, args.webhook.namespace()).await;
        let flags = args.webhook.clone().or(from_cluster);
        (facts, flags.inject_config()?)
    };
    inject_documents(docs, &facts, &config, &default_namespace)
}

fn unreachable_hint(e: anyhow::Error) -> anyhow::Error {
    e.context(
        "cannot read the mesh's state from the cluster (to inject without a cluster, \
         pass --release FILE with the SidecarReleases, e.g. from `kubectl get sidecarreleases -o yaml`)",
    )
}

fn read_input(path: &PathBuf) -> anyhow::Result<(String, String)> {
    if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("cannot read standard input")?;
        Ok(("<stdin>".to_owned(), s))
    } else {
        let s = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        Ok((path.display().to_string(), s))
    }
}

/// The documents of a YAML stream (or a JSON text), in order; empty
/// documents are skipped. An error names the document (1-based, counting
/// the non-empty ones) and the line it starts on.
pub fn parse_documents(text: &str) -> anyhow::Result<Vec<Value>> {
    let mut out = Vec::new();
    for (first_line, chunk) in split_documents(text) {
        let number = out.len() + 1;
        let docs = baton_crds::yaml::documents(&chunk)
            .map_err(|e| anyhow!("document {number} (from line {first_line}): {e}"))?;
        for doc in docs {
            if !doc.is_object() {
                bail!(
                    "document {} (from line {first_line}) is not a Kubernetes object",
                    out.len() + 1
                );
            }
            out.push(doc);
        }
    }
    Ok(out)
}

/// Splits a YAML stream at its `---` lines: each chunk with the 1-based
/// line it starts on.
fn split_documents(text: &str) -> Vec<(usize, String)> {
    let mut chunks = Vec::new();
    let mut current = String::new();
    let mut start = 1;
    for (i, line) in text.lines().enumerate() {
        let bare = line.trim_end();
        let separator = bare == "---"
            || (line.starts_with("---") && line[3..].starts_with([' ', '\t']))
            || bare == "...";
        if separator {
            chunks.push((start, std::mem::take(&mut current)));
            start = i + 2;
            // `--- {inline}` keeps its content.
            let rest = line.get(3..).unwrap_or("").trim();
            if bare != "..." && !rest.is_empty() && !rest.starts_with('#') {
                current.push_str(rest);
                current.push('\n');
                start = i + 1;
            }
        } else {
            current.push_str(line);
            current.push('\n');
        }
    }
    chunks.push((start, current));
    chunks
}

/// Namespaces the workloads of `docs` land in.
pub fn namespaces_of(docs: &[Value], default_namespace: &str) -> BTreeSet<String> {
    fn walk(doc: &Value, default_namespace: &str, out: &mut BTreeSet<String>) {
        if let Some(items) = list_items(doc) {
            for item in items {
                walk(item, default_namespace, out);
            }
        } else if template_pointer(doc).is_some() {
            out.insert(namespace_of(doc, default_namespace));
        }
    }
    let mut out = BTreeSet::new();
    for doc in docs {
        walk(doc, default_namespace, &mut out);
    }
    out
}

/// The injected documents, and what to tell the user about the others.
#[derive(Debug, Clone, Default)]
pub struct Injected {
    pub docs: Vec<Value>,
    /// One line per pod template left unchanged, naming it and why.
    pub notes: Vec<String>,
}

/// Injects every pod template of `docs` (see the module docs).
pub fn inject_documents(
    docs: Vec<Value>,
    facts: &Facts,
    config: &InjectConfig,
    default_namespace: &str,
) -> anyhow::Result<Injected> {
    let mut out = Injected::default();
    let n = docs.len();
    for (i, mut doc) in docs.into_iter().enumerate() {
        inject_object(&mut doc, facts, config, default_namespace, &mut out.notes).with_context(
            || {
                if n > 1 {
                    format!("document {}", i + 1)
                } else {
                    "the manifest".to_owned()
                }
            },
        )?;
        out.docs.push(doc);
    }
    Ok(out)
}

fn kind_of(doc: &Value) -> &str {
    doc.get("kind").and_then(Value::as_str).unwrap_or_default()
}

fn list_items(doc: &Value) -> Option<&Vec<Value>> {
    kind_of(doc)
        .ends_with("List")
        .then(|| doc.get("items").and_then(Value::as_array))
        .flatten()
}

/// JSON pointer of the pod template of a workload kind (`""`: the Pod
/// itself), `None` for kinds without one.
fn template_pointer(doc: &Value) -> Option<&'static str> {
    match kind_of(doc) {
        "Pod" => Some(""),
        "Deployment"
        | "StatefulSet"
        | "DaemonSet"
        | "ReplicaSet"
        | "ReplicationController"
        | "Job" => Some("/spec/template"),
        "CronJob" => Some("/spec/jobTemplate/spec/template"),
        _ => None,
    }
}

fn namespace_of(doc: &Value, default_namespace: &str) -> String {
    doc.pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .unwrap_or(default_namespace)
        .to_owned()
}

fn inject_object(
    doc: &mut Value,
    facts: &Facts,
    config: &InjectConfig,
    default_namespace: &str,
    notes: &mut Vec<String>,
) -> anyhow::Result<()> {
    if list_items(doc).is_some() {
        if let Some(items) = doc.get_mut("items").and_then(Value::as_array_mut) {
            for (i, item) in items.iter_mut().enumerate() {
                inject_object(item, facts, config, default_namespace, notes)
                    .with_context(|| format!("item {}", i + 1))?;
            }
        }
        return Ok(());
    }
    let Some(pointer) = template_pointer(doc) else {
        return Ok(());
    };
    let namespace = namespace_of(doc, default_namespace);
    let name = doc
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .or_else(|| {
            doc.pointer("/metadata/generateName")
                .and_then(Value::as_str)
                .map(|g| format!("{g}<generated>"))
        })
        .unwrap_or_else(|| "<unnamed>".to_owned());
    let who = format!("{} {namespace}/{name}", kind_of(doc));
    let is_pod = pointer.is_empty();
    let template = doc
        .pointer_mut(pointer)
        .filter(|t| t.is_object())
        .ok_or_else(|| anyhow!("{who} has no pod template at {pointer}"))?;
    match inject_template(template, is_pod, &namespace, &name, facts, config)
        .with_context(|| who.clone())?
    {
        None => {}
        Some(skip) => notes.push(format!(
            "{who} left unchanged: {}",
            skip_reason(skip, &namespace)
        )),
    }
    Ok(())
}

/// Why the webhook leaves a pod alone, for the user.
pub fn skip_reason(skip: Skip, namespace: &str) -> String {
    match skip {
        Skip::SystemNamespace => format!("namespace {namespace} is never injected"),
        Skip::AlreadyInjected => "already injected (baton.dev/status=injected)".to_owned(),
        Skip::OptedOut => format!(
            "opted out (label {}={})",
            labels::INJECT,
            labels::INJECT_DISABLED
        ),
        Skip::HostNetwork => {
            "hostNetwork: true (capture would redirect the node's traffic)".to_owned()
        }
        Skip::NotOptedIn => "not opted in".to_owned(),
    }
}

/// Injects one pod template (or Pod) in place; `Some(skip)` when the
/// webhook would leave it alone (then it is not touched at all).
fn inject_template(
    template: &mut Value,
    is_pod: bool,
    namespace: &str,
    name: &str,
    facts: &Facts,
    config: &InjectConfig,
) -> anyhow::Result<Option<Skip>> {
    let mut candidate = template.clone();
    let Value::Object(root) = &mut candidate else {
        bail!("the pod template is not an object");
    };
    // Opted in as the webhook sees it: the pod label (unless opted out).
    let metadata = object_at(root, "metadata");
    let pod_labels = object_at(metadata, "labels");
    if pod_labels.get(labels::INJECT).and_then(Value::as_str) != Some(labels::INJECT_DISABLED) {
        pod_labels.insert(labels::INJECT.to_owned(), json!(labels::INJECT_ENABLED));
    }

    let mut pod_json = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": candidate.get("metadata").cloned().unwrap_or(Value::Null),
        "spec": candidate.get("spec").cloned().unwrap_or(Value::Null),
    });
    if let Some(meta) = pod_json.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("namespace".to_owned(), json!(namespace));
        if !is_pod {
            // As a controller creates it: named from generateName.
            meta.insert("generateName".to_owned(), json!(format!("{name}-")));
        }
    }
    let pod: Pod =
        serde_json::from_value(pod_json).context("the pod template is not a valid Pod")?;

    let namespace_labels = facts.labels_of(namespace);
    let grant_id = format!("kubectl-baton-inject/{namespace}/{name}");
    let view = ClusterView {
        namespace,
        namespace_labels: &namespace_labels,
        releases: &facts.releases,
        tls_policies: &facts.tls_policies,
        pools: &facts.pools,
        nodes: &facts.nodes,
        recent_grants: &[],
        grant_id: &grant_id,
        server_version: facts.server_version,
        trust_bundle: facts.trust_bundle.as_deref(),
    };
    match mutate(&pod, &view, config) {
        Ok(MutateOutcome::Skipped(skip)) => Ok(Some(skip)),
        Ok(MutateOutcome::Injected(injection)) => {
            json_patch::patch(&mut candidate, &injection.patch)
                .context("the webhook's patch does not apply to the template")?;
            *template = candidate;
            Ok(None)
        }
        Err(denial) if denial.reason == DenialReason::NoRelease => {
            let existing = if facts.releases.is_empty() {
                format!("there is no SidecarRelease in {}", facts.source)
            } else {
                format!(
                    "the SidecarReleases in {} are: {}",
                    facts.source,
                    facts.release_names()
                )
            };
            Err(anyhow!(
                "the webhook would refuse it: {}; {existing}",
                denial.message
            ))
        }
        Err(denial) if denial.reason == DenialReason::NoTrustBundle => Err(anyhow!(
            "the Pod needs the mesh trust bundle, and {} has none: give it \
             (kubectl -n {} get configmap {} -o yaml, as another --release file)",
            facts.source,
            baton_crds::contract::SYSTEM_NAMESPACE,
            baton_crds::contract::identity::TRUST_CONFIG_MAP
        )),
        Err(denial) => Err(anyhow!("the webhook would refuse it: {}", denial.message)),
    }
}

/// The object at `key` of `map` (created, or made an object, if it is not).
fn object_at<'a>(
    map: &'a mut serde_json::Map<String, Value>,
    key: &str,
) -> &'a mut serde_json::Map<String, Value> {
    let entry = map
        .entry(key.to_owned())
        .or_insert_with(|| Value::Object(serde_json::Map::new()));
    if !entry.is_object() {
        *entry = Value::Object(serde_json::Map::new());
    }
    match entry {
        Value::Object(m) => m,
        _ => unreachable!("made an object above"),
    }
}

/// YAML documents (`---`-separated) by default; `-o json`: the object, or a
/// `List` of them.
pub fn render(docs: &[Value], format: Format) -> anyhow::Result<String> {
    match format {
        Format::Json => {
            let value = match docs {
                [one] => one.clone(),
                _ => json!({"apiVersion": "v1", "kind": "List", "items": docs}),
            };
            Ok(serde_json::to_string_pretty(&value)? + "\n")
        }
        Format::Yaml | Format::Table => {
            let mut out = String::new();
            for (i, doc) in docs.iter().enumerate() {
                if i > 0 {
                    out.push_str("---\n");
                }
                out.push_str(&baton_crds::yaml::to_string(doc)?);
            }
            Ok(out)
        }
    }
}
