//! The cluster facts `mutate` reads (its `ClusterView`): from a file
//! (offline, `--release FILE`) or read once from the cluster.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use anyhow::{Context as _, anyhow};
use baton_crds::{
    AcceleratorPool, SidecarRelease, TlsPolicy,
    contract::{SYSTEM_NAMESPACE, identity, labels},
    tls_policy::OffloadMode,
};
use baton_webhook::inject::ServerVersion;
use k8s_openapi::api::{
    apps::v1::Deployment,
    core::v1::{ConfigMap, Namespace, Node},
};
use kube::{Api, api::ListParams};
use serde_json::Value;

use super::settings::{self, WebhookFlags};
use crate::Ctx;

/// Label the API server puts on every namespace (1.21+).
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// The newest Kubernetes minor this build knows (the k8s-openapi API level
/// the workspace is built for): the offline default of
/// `--kubernetes-version`. From 1.32 on the webhook injects native
/// sidecars, so the default shows what current clusters get.
pub const NEWEST_KNOWN_VERSION: ServerVersion = ServerVersion::new(1, 33);

/// What the injection reads about the cluster.
#[derive(Debug, Clone)]
pub struct Facts {
    pub releases: Vec<Arc<SidecarRelease>>,
    /// TlsPolicies (of any namespace: `mutate` filters them).
    pub tls_policies: Vec<Arc<TlsPolicy>>,
    pub pools: Vec<Arc<AcceleratorPool>>,
    pub nodes: Vec<Arc<Node>>,
    /// Labels of the namespaces that are known; the others get
    /// [`Self::assumed_labels`] (offline: opted in).
    pub namespace_labels: BTreeMap<String, BTreeMap<String, String>>,
    pub server_version: ServerVersion,
    /// The mesh trust bundle the webhook would copy into the Pod: ConfigMap
    /// `baton-system/baton-mesh-trust` of the cluster, or one in the files.
    pub trust_bundle: Option<String>,
    /// Where the facts came from, for messages (`the file x.yaml`, `the
    /// cluster`).
    pub source: String,
}

impl Facts {
    /// The labels `namespace` has (or is assumed to have offline:
    /// `baton.dev/inject=enabled` and its name label).
    pub fn labels_of(&self, namespace: &str) -> BTreeMap<String, String> {
        self.namespace_labels
            .get(namespace)
            .cloned()
            .unwrap_or_else(|| assumed_labels(namespace))
    }

    /// `a, b` (for the "no release selects it" error).
    pub fn release_names(&self) -> String {
        let names: Vec<&str> = self
            .releases
            .iter()
            .map(|r| r.metadata.name.as_deref().unwrap_or("<unnamed>"))
            .collect();
        names.join(", ")
    }
}

/// An opted-in namespace named `namespace`.
pub fn assumed_labels(namespace: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (labels::INJECT.to_owned(), labels::INJECT_ENABLED.to_owned()),
        (NAMESPACE_NAME_LABEL.to_owned(), namespace.to_owned()),
    ])
}

/// Adds the objects of one document (Lists flattened) to `facts`.
fn collect(doc: &Value, facts: &mut Facts, what: &str) -> anyhow::Result<()> {
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or_default();
    if let Some(items) = doc.get("items").and_then(Value::as_array)
        && kind.ends_with("List")
    {
        for item in items {
            collect(item, facts, what)?;
        }
        return Ok(());
    }
    let name = doc
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("<unnamed>");
    let typed = |e: serde_json::Error| anyhow!("{what}: {kind} {name} is not valid: {e}");
    match kind {
        "SidecarRelease" => facts.releases.push(Arc::new(
            serde_json::from_value(doc.clone()).map_err(typed)?,
        )),
        "TlsPolicy" => facts.tls_policies.push(Arc::new(
            serde_json::from_value(doc.clone()).map_err(typed)?,
        )),
        "AcceleratorPool" => facts.pools.push(Arc::new(
            serde_json::from_value(doc.clone()).map_err(typed)?,
        )),
        "Node" => facts.nodes.push(Arc::new(
            serde_json::from_value(doc.clone()).map_err(typed)?,
        )),
        "ConfigMap" if name == identity::TRUST_CONFIG_MAP => {
            let cm: ConfigMap = serde_json::from_value(doc.clone()).map_err(typed)?;
            facts.trust_bundle = cm.data.and_then(|mut d| d.remove(identity::TRUST_KEY));
        }
        "Namespace" => {
            let ns: Namespace = serde_json::from_value(doc.clone()).map_err(typed)?;
            let mut l = ns.metadata.labels.unwrap_or_default();
            l.insert(NAMESPACE_NAME_LABEL.to_owned(), name.to_owned());
            facts.namespace_labels.insert(name.to_owned(), l);
        }
        _ => {}
    }
    Ok(())
}

/// Offline facts: the SidecarReleases (and any TlsPolicies,
/// AcceleratorPools, Nodes, Namespaces) of the `--release` files, already
/// parsed into documents. Namespaces not in them count as opted in.
pub fn offline(
    files: &[(String, Vec<Value>)],
    server_version: ServerVersion,
) -> anyhow::Result<Facts> {
    let mut facts = Facts {
        releases: Vec::new(),
        tls_policies: Vec::new(),
        pools: Vec::new(),
        nodes: Vec::new(),
        namespace_labels: BTreeMap::new(),
        server_version,
        trust_bundle: None,
        source: String::new(),
    };
    for (name, docs) in files {
        for doc in docs {
            collect(doc, &mut facts, name)?;
        }
    }
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    facts.source = format!("--release {}", names.join(", "));
    if facts.releases.is_empty() {
        anyhow::bail!(
            "{} holds no SidecarRelease: give a file with at least one \
             (kubectl get sidecarreleases -o yaml > releases.yaml)",
            names.join(", ")
        );
    }
    Ok(facts)
}

/// Facts read from the cluster, each call bounded: every SidecarRelease,
/// the labels and TlsPolicies of `namespaces`, AcceleratorPools and Nodes
/// when one of those policies asks for offload, and the server version
/// (unless `version` is given).
pub async fn from_cluster(
    ctx: &Ctx,
    namespaces: &BTreeSet<String>,
    version: Option<ServerVersion>,
) -> anyhow::Result<Facts> {
    let client = ctx.client().await?;
    let server_version = match version {
        Some(v) => v,
        None => {
            let info = ctx
                .bounded("reading the API server version", async {
                    client
                        .apiserver_version()
                        .await
                        .context("reading the API server version")
                })
                .await?;
            ServerVersion::parse(&info.major, &info.minor).ok_or_else(|| {
                anyhow!(
                    "the API server reports version {:?}.{:?}, which does not parse: pass --kubernetes-version",
                    info.major,
                    info.minor
                )
            })?
        }
    };
    let releases = ctx
        .bounded("listing SidecarReleases", async {
            Api::<SidecarRelease>::all(client.clone())
                .list(&ListParams::default())
                .await
                .context("listing SidecarReleases")
        })
        .await?;
    let mut namespace_labels = BTreeMap::new();
    let mut tls_policies = Vec::new();
    for ns in namespaces {
        let got = ctx
            .bounded(&format!("reading namespace {ns}"), async {
                Api::<Namespace>::all(client.clone())
                    .get_opt(ns)
                    .await
                    .with_context(|| format!("reading namespace {ns}"))
            })
            .await?;
        match got {
            Some(n) => {
                namespace_labels.insert(ns.clone(), n.metadata.labels.unwrap_or_default());
            }
            None => {
                eprintln!(
                    "note: namespace {ns} does not exist (yet): injecting as if it were opted in"
                );
            }
        }
        let policies = ctx
            .bounded(&format!("listing TlsPolicies in {ns}"), async {
                Api::<TlsPolicy>::namespaced(client.clone(), ns)
                    .list(&ListParams::default())
                    .await
                    .with_context(|| format!("listing TlsPolicies in {ns}"))
            })
            .await?;
        tls_policies.extend(policies.items.into_iter().map(Arc::new));
    }
    // As the webhook: pools and nodes only matter to offload.
    let offload = tls_policies
        .iter()
        .any(|p| p.spec.private_key_offload.mode != OffloadMode::Disabled);
    let (pools, nodes) = if offload {
        let pools = ctx
            .bounded("listing AcceleratorPools", async {
                Api::<AcceleratorPool>::all(client.clone())
                    .list(&ListParams::default())
                    .await
                    .context("listing AcceleratorPools")
            })
            .await?;
        let nodes = ctx
            .bounded("listing Nodes", async {
                Api::<Node>::all(client.clone())
                    .list(&ListParams::default())
                    .await
                    .context("listing Nodes")
            })
            .await?;
        (
            pools.items.into_iter().map(Arc::new).collect(),
            nodes.items.into_iter().map(Arc::new).collect(),
        )
    } else {
        (Vec::new(), Vec::new())
    };
    let trust = ctx
        .bounded("reading the mesh trust bundle", async {
            Api::<ConfigMap>::namespaced(client.clone(), SYSTEM_NAMESPACE)
                .get_opt(identity::TRUST_CONFIG_MAP)
                .await
                .context("reading ConfigMap baton-system/baton-mesh-trust")
        })
        .await?;
    Ok(Facts {
        releases: releases.items.into_iter().map(Arc::new).collect(),
        tls_policies,
        pools,
        nodes,
        namespace_labels,
        server_version,
        trust_bundle: trust.and_then(|cm| cm.data?.remove(identity::TRUST_KEY)),
        source: "the cluster".to_owned(),
    })
}

/// The webhook's settings as its Deployment sets them; when it cannot be
/// read (RBAC, another install layout), a note and the webhook's defaults.
pub async fn webhook_flags_from_cluster(ctx: &Ctx, namespace: &str) -> WebhookFlags {
    let read = async {
        let client = ctx.client().await?;
        ctx.bounded("reading the webhook's Deployment", async {
            Api::<Deployment>::namespaced(client, namespace)
                .get_opt(settings::WEBHOOK_DEPLOYMENT)
                .await
                .context("reading the webhook's Deployment")
        })
        .await
    };
    match read.await {
        Ok(Some(d)) => match settings::flags_from_deployment(&d) {
            Ok(flags) => flags,
            Err(e) => {
                eprintln!(
                    "note: cannot read the settings of Deployment {namespace}/{}: {e:#}; using the webhook's defaults",
                    settings::WEBHOOK_DEPLOYMENT
                );
                WebhookFlags::default()
            }
        },
        Ok(None) => {
            eprintln!(
                "note: no Deployment {namespace}/{} (pass --webhook-namespace if the webhook runs elsewhere); using the webhook's default settings",
                settings::WEBHOOK_DEPLOYMENT
            );
            WebhookFlags::default()
        }
        Err(e) => {
            eprintln!(
                "note: cannot read Deployment {namespace}/{}: {e:#}; using the webhook's default settings",
                settings::WEBHOOK_DEPLOYMENT
            );
            WebhookFlags::default()
        }
    }
}
