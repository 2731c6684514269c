//! The I/O of `check`: reads what the selected categories need into a plain
//! [`Observed`], each call bounded by `--timeout`.
//!
//! An object that is missing (404) or that the caller may not read (403, or
//! any other API status) is recorded as [`Got::Missing`] or
//! [`Got::Unreadable`], so its category fails with a hint instead of the
//! command aborting. Only a call that gets no API answer at all (connection
//! refused, TLS failure, the `--timeout` bound) aborts the command: then no
//! check could say anything true.

use std::future::Future;

use anyhow::Context as _;
use baton_crds::SidecarRelease;
use baton_crds::contract::{self, SYSTEM_NAMESPACE, annotations, identity, labels, webhook};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Endpoints, Namespace, Pod, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::version::Info;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};

use super::Category;
use super::cluster::{INSTALL_PERMISSIONS, OPERATOR, Permission};
use crate::Ctx;

/// One object (or list) as the API server answered.
#[derive(Debug, Clone, PartialEq)]
pub enum Got<T> {
    Found(T),
    /// 404.
    Missing,
    /// Any other API answer: forbidden, an unexpected body. The text says
    /// which (`403 Forbidden: ...`).
    Unreadable(String),
}

impl<T> Got<T> {
    pub fn as_ref(&self) -> Got<&T> {
        match self {
            Self::Found(t) => Got::Found(t),
            Self::Missing => Got::Missing,
            Self::Unreadable(why) => Got::Unreadable(why.clone()),
        }
    }

    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Got<U> {
        match self {
            Self::Found(t) => Got::Found(f(t)),
            Self::Missing => Got::Missing,
            Self::Unreadable(why) => Got::Unreadable(why),
        }
    }
}

/// What the checks of an installed mesh look at. `None`: not fetched,
/// because no selected category needs it.
#[derive(Debug, Clone)]
pub struct Observed {
    /// Unix seconds when the objects were read.
    pub now: i64,
    pub categories: Vec<Category>,
    pub version: Got<Info>,
    /// Each Baton CRD's name with what is installed under it.
    pub crds: Option<Vec<(String, Got<CustomResourceDefinition>)>>,
    pub control_plane: Option<ControlPlane>,
    pub webhook: Option<WebhookObjects>,
    /// Secret baton-system/baton-identity-ca (identity and data-plane).
    pub identity_ca: Option<Got<Secret>>,
    pub data_plane: Option<DataPlane>,
    pub releases: Option<Got<Vec<SidecarRelease>>>,
}

/// The control plane's Deployments and the operator's leader Lease.
#[derive(Debug, Clone)]
pub struct ControlPlane {
    pub operator: Got<Deployment>,
    pub webhook: Got<Deployment>,
    pub lease: Got<Lease>,
}

/// What the API server needs to call the webhook.
#[derive(Debug, Clone)]
pub struct WebhookObjects {
    pub endpoints: Got<Endpoints>,
    pub mutating: Got<MutatingWebhookConfiguration>,
    pub validating: Got<ValidatingWebhookConfiguration>,
    /// Secret baton-system/baton-webhook-ca.
    pub ca: Got<Secret>,
}

/// Where sidecars run and the trust bundle the webhook copies into them.
#[derive(Debug, Clone)]
pub struct DataPlane {
    /// Namespaces labelled `baton.dev/inject=enabled`.
    pub opted_in: Got<Vec<String>>,
    /// The namespace of every Pod labelled `baton.dev/injected`.
    pub injected_pods: Got<Vec<String>>,
    /// `namespace/name` of the injected Pods without the trust bundle
    /// annotation: injected before decision 0058, they mount their
    /// namespace's old `baton-mesh-trust` ConfigMap.
    pub legacy_pods: Got<Vec<String>>,
    /// ConfigMap `baton-mesh-trust` of baton-system, the one the operator
    /// publishes and the webhook copies.
    pub trust: Got<ConfigMap>,
}

/// What the pre-install checks look at.
#[derive(Debug, Clone)]
pub struct PreObserved {
    pub version: Got<Info>,
    /// Whether the caller may do each of [`INSTALL_PERMISSIONS`].
    pub permissions: Vec<(Permission, Got<bool>)>,
    /// The names of every MutatingWebhookConfiguration.
    pub mutating: Got<Vec<String>>,
}

/// Sorts a kube answer into a [`Got`]; `Err` only when there was no API
/// answer at all.
pub fn classify<T>(result: Result<T, kube::Error>) -> anyhow::Result<Got<T>> {
    match result {
        Ok(v) => Ok(Got::Found(v)),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(Got::Missing),
        Err(kube::Error::Api(s)) => Ok(Got::Unreadable(format!(
            "{} {}: {}",
            s.code, s.reason, s.message
        ))),
        Err(kube::Error::SerdeError(e)) => Ok(Got::Unreadable(format!("unexpected answer: {e}"))),
        Err(e) => Err(anyhow::Error::new(e).context("cannot reach the API server")),
    }
}

/// One bounded call.
async fn read<T>(
    ctx: &Ctx,
    step: &str,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> anyhow::Result<Got<T>> {
    ctx.bounded(step, async { classify(call.await) })
        .await
        .with_context(|| step.to_owned())
}

/// Reads what `categories` need.
pub async fn observe(ctx: &Ctx, categories: &[Category]) -> anyhow::Result<Observed> {
    let client = ctx.client().await?;
    let wants = |c: Category| categories.contains(&c);
    // The version call goes first and alone: if the server is unreachable,
    // it is the one error the user sees.
    let version = version(ctx, &client).await?;
    let (crds, control_plane, webhook, identity_ca, data_plane, releases) = futures::try_join!(
        optional(wants(Category::Crds), crds(ctx, &client)),
        optional(wants(Category::ControlPlane), control_plane(ctx, &client)),
        optional(wants(Category::Webhook), webhook_objects(ctx, &client)),
        optional(
            wants(Category::Identity) || wants(Category::DataPlane),
            identity_ca(ctx, &client)
        ),
        optional(wants(Category::DataPlane), data_plane(ctx, &client)),
        optional(wants(Category::Releases), releases(ctx, &client)),
    )?;
    Ok(Observed {
        now: time::OffsetDateTime::now_utc().unix_timestamp(),
        categories: categories.to_vec(),
        version,
        crds,
        control_plane,
        webhook,
        identity_ca,
        data_plane,
        releases,
    })
}

/// Runs `fetch` if `wanted`. Boxed: six categories' futures side by side
/// would otherwise sit on the stack, which debug builds overflow.
async fn optional<T>(
    wanted: bool,
    fetch: impl Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<Option<T>> {
    if wanted {
        Box::pin(fetch).await.map(Some)
    } else {
        Ok(None)
    }
}

/// `GET /version`.
pub async fn version(ctx: &Ctx, client: &Client) -> anyhow::Result<Got<Info>> {
    read(ctx, "GET /version", client.apiserver_version()).await
}

/// Each Baton CRD by name.
pub async fn crds(
    ctx: &Ctx,
    client: &Client,
) -> anyhow::Result<Vec<(String, Got<CustomResourceDefinition>)>> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut out = Vec::new();
    for crd in baton_crds::schema::crds() {
        let name = crd.metadata.name.unwrap_or_default();
        let got = read(ctx, &format!("get crd {name}"), api.get(&name)).await?;
        out.push((name, got));
    }
    Ok(out)
}

/// The two Deployments and the Lease, in that order.
pub async fn control_plane(ctx: &Ctx, client: &Client) -> anyhow::Result<ControlPlane> {
    let ns = contract::SYSTEM_NAMESPACE;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    Ok(ControlPlane {
        operator: read(
            ctx,
            "get deployment baton-operator",
            deployments.get(OPERATOR),
        )
        .await?,
        webhook: read(
            ctx,
            "get deployment baton-webhook",
            deployments.get(webhook::SERVICE),
        )
        .await?,
        lease: read(ctx, "get lease baton-operator", leases.get(OPERATOR)).await?,
    })
}

pub async fn webhook_objects(ctx: &Ctx, client: &Client) -> anyhow::Result<WebhookObjects> {
    let ns = contract::SYSTEM_NAMESPACE;
    let endpoints: Api<Endpoints> = Api::namespaced(client.clone(), ns);
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let validating: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    Ok(WebhookObjects {
        endpoints: read(
            ctx,
            "get endpoints baton-webhook",
            endpoints.get(webhook::SERVICE),
        )
        .await?,
        mutating: read(
            ctx,
            "get mutatingwebhookconfiguration",
            mutating.get(webhook::MUTATING_CONFIGURATION),
        )
        .await?,
        validating: read(
            ctx,
            "get validatingwebhookconfiguration",
            validating.get(webhook::VALIDATING_CONFIGURATION),
        )
        .await?,
        ca: read(
            ctx,
            "get secret baton-webhook-ca",
            secrets.get(webhook::CA_SECRET),
        )
        .await?,
    })
}

pub async fn identity_ca(ctx: &Ctx, client: &Client) -> anyhow::Result<Got<Secret>> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), contract::SYSTEM_NAMESPACE);
    read(
        ctx,
        "get secret baton-identity-ca",
        secrets.get(identity::CA_SECRET),
    )
    .await
}

pub async fn data_plane(ctx: &Ctx, client: &Client) -> anyhow::Result<DataPlane> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let pods: Api<Pod> = Api::all(client.clone());
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), SYSTEM_NAMESPACE);
    // Every namespace (metadata only): the opted-in ones, and the ones being
    // deleted, whose Pods may still be listed: those are no part of the
    // mesh any more.
    let all = read(
        ctx,
        "list namespaces",
        namespaces.list_metadata(&ListParams::default()),
    )
    .await?;
    let terminating: std::collections::BTreeSet<String> = match &all {
        Got::Found(list) => list
            .items
            .iter()
            .filter(|n| n.metadata.deletion_timestamp.is_some())
            .filter_map(|n| n.metadata.name.clone())
            .collect(),
        _ => Default::default(),
    };
    let opted_in = all.map(|list| {
        list.items
            .into_iter()
            .filter(|n| {
                n.metadata.deletion_timestamp.is_none()
                    && n.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(labels::INJECT))
                        .is_some_and(|v| v == labels::INJECT_ENABLED)
            })
            .filter_map(|n| n.metadata.name)
            .collect()
    });
    // Metadata only: the namespaces of injected Pods are all that matters,
    // and a mesh can hold many Pods.
    let injected_pods = read(
        ctx,
        "list injected pods",
        pods.list_metadata(&ListParams::default().labels(labels::INJECTED)),
    )
    .await?
    .map(|list| {
        list.items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| {
                p.metadata
                    .namespace
                    .as_ref()
                    .is_some_and(|ns| !terminating.contains(ns))
            })
            .collect::<Vec<_>>()
    });
    let legacy_pods = injected_pods.clone().map(|pods| {
        pods.iter()
            .filter(|p| {
                !p.metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(annotations::TRUST_BUNDLE))
            })
            .map(|p| {
                format!(
                    "{}/{}",
                    p.metadata.namespace.as_deref().unwrap_or_default(),
                    p.metadata.name.as_deref().unwrap_or_default()
                )
            })
            .collect()
    });
    let injected_pods = injected_pods.map(|pods| {
        pods.into_iter()
            .filter_map(|p| p.metadata.namespace)
            .collect()
    });
    let trust = read(
        ctx,
        "get configmap baton-mesh-trust",
        config_maps.get(identity::TRUST_CONFIG_MAP),
    )
    .await?;
    Ok(DataPlane {
        opted_in,
        injected_pods,
        legacy_pods,
        trust,
    })
}

pub async fn releases(ctx: &Ctx, client: &Client) -> anyhow::Result<Got<Vec<SidecarRelease>>> {
    let api: Api<SidecarRelease> = Api::all(client.clone());
    Ok(read(
        ctx,
        "list sidecarreleases",
        api.list(&ListParams::default()),
    )
    .await?
    .map(|l| l.items))
}

/// Reads what the pre-install checks need.
pub async fn pre(ctx: &Ctx) -> anyhow::Result<PreObserved> {
    let client = ctx.client().await?;
    let version = version(ctx, &client).await?;
    let reviews: Api<SelfSubjectAccessReview> = Api::all(client.clone());
    let permissions = futures::future::try_join_all(INSTALL_PERMISSIONS.iter().map(|p| {
        let reviews = reviews.clone();
        async move {
            let review = access_review(p);
            let got = read(
                ctx,
                "create selfsubjectaccessreview",
                reviews.create(&PostParams::default(), &review),
            )
            .await?;
            let allowed = got.map(|r| r.status.is_some_and(|s| s.allowed));
            Ok::<_, anyhow::Error>((*p, allowed))
        }
    }))
    .await?;
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let mutating = read(
        ctx,
        "list mutatingwebhookconfigurations",
        mutating.list_metadata(&ListParams::default()),
    )
    .await?
    .map(|l| {
        l.items
            .into_iter()
            .filter_map(|m| m.metadata.name)
            .collect()
    });
    Ok(PreObserved {
        version,
        permissions,
        mutating,
    })
}

/// "May I `verb` `resource`?", as a SelfSubjectAccessReview.
pub fn access_review(p: &Permission) -> SelfSubjectAccessReview {
    SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                verb: Some(p.verb.to_owned()),
                group: Some(p.group.to_owned()),
                resource: Some(p.resource.to_owned()),
                namespace: p.namespace.map(str::to_owned),
                ..ResourceAttributes::default()
            }),
            ..SelfSubjectAccessReviewSpec::default()
        },
        ..SelfSubjectAccessReview::default()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use baton_controlplane::testing::{expect, mock_client, reply, status};
    use serde_json::json;

    use super::*;
    use crate::check::{Args, Status};
    use crate::{Format, Global, Outcome};

    fn ctx(client: Client, timeout: Duration) -> Ctx {
        let global = Global {
            context: None,
            kubeconfig: None,
            namespace: None,
            all_namespaces: false,
            output: Format::Json,
            timeout,
        };
        Ctx::with_client(global, client, "default")
    }

    const DEPLOYMENTS: &str = "/apis/apps/v1/namespaces/baton-system/deployments";

    #[tokio::test]
    async fn control_plane_reads_record_found_missing_and_forbidden_objects() {
        let (client, mut handle) = mock_client();
        let server = tokio::spawn(async move {
            let (_, send) =
                expect(&mut handle, "GET", &format!("{DEPLOYMENTS}/baton-operator")).await;
            reply(
                send,
                200,
                &json!({"apiVersion": "apps/v1", "kind": "Deployment",
                        "metadata": {"name": "baton-operator"},
                        "spec": {"replicas": 2, "selector": {}, "template": {}},
                        "status": {"readyReplicas": 2}}),
            );
            let (_, send) =
                expect(&mut handle, "GET", &format!("{DEPLOYMENTS}/baton-webhook")).await;
            reply(send, 404, &status(404, "NotFound"));
            let path = "/apis/coordination.k8s.io/v1/namespaces/baton-system/leases/baton-operator";
            let (_, send) = expect(&mut handle, "GET", path).await;
            reply(send, 403, &status(403, "Forbidden"));
        });
        let ctx = ctx(client.clone(), Duration::from_secs(5));
        let cp = control_plane(&ctx, &client).await.unwrap();
        server.await.unwrap();
        assert!(matches!(cp.operator, Got::Found(_)));
        assert_eq!(cp.webhook.clone().map(|_| ()), Got::Missing);
        assert_eq!(
            cp.lease.clone().map(|_| ()),
            Got::Unreadable("403 Forbidden: Forbidden".into())
        );
        let checks = super::super::cluster::control_plane(&cp, 0);
        let statuses: Vec<Status> = checks.iter().map(|c| c.status).collect();
        assert_eq!(statuses, [Status::Ok, Status::Failure, Status::Failure]);
    }

    #[tokio::test]
    async fn a_category_run_reads_version_then_its_objects_and_fails_on_a_scaled_down_webhook() {
        let (client, mut handle) = mock_client();
        let server = tokio::spawn(async move {
            let (_, send) = expect(&mut handle, "GET", "/version").await;
            reply(
                send,
                200,
                &json!({"major": "1", "minor": "20", "gitVersion": "v1.20.15",
                        "gitCommit": "", "gitTreeState": "", "buildDate": "",
                        "goVersion": "", "compiler": "", "platform": ""}),
            );
            for name in ["baton-operator", "baton-webhook"] {
                let (_, send) = expect(&mut handle, "GET", &format!("{DEPLOYMENTS}/{name}")).await;
                reply(
                    send,
                    200,
                    &json!({"apiVersion": "apps/v1", "kind": "Deployment",
                            "metadata": {"name": name},
                            "spec": {"replicas": if name == "baton-webhook" { 0 } else { 2 },
                                     "selector": {}, "template": {}},
                            "status": {"readyReplicas": 2}}),
                );
            }
            let path = "/apis/coordination.k8s.io/v1/namespaces/baton-system/leases/baton-operator";
            let (_, send) = expect(&mut handle, "GET", path).await;
            reply(send, 404, &status(404, "NotFound"));
        });
        let ctx = ctx(client, Duration::from_secs(5));
        let args = Args {
            pre: false,
            category: Some("control-plane".into()),
        };
        assert_eq!(
            crate::check::run(&ctx, args).await.unwrap(),
            Outcome::Failure
        );
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_silent_api_server_is_a_clear_error_within_the_timeout() {
        let (client, handle) = mock_client();
        let ctx = ctx(client, Duration::from_millis(200));
        let args = Args {
            pre: false,
            category: None,
        };
        let err = crate::check::run(&ctx, args).await.unwrap_err();
        drop(handle);
        let text = format!("{err:#}");
        assert!(
            text.contains("no answer from the API server within 200ms"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn an_unreachable_api_server_aborts_instead_of_failing_a_check() {
        let (client, handle) = mock_client();
        drop(handle);
        let ctx = ctx(client.clone(), Duration::from_secs(5));
        let err = version(&ctx, &client).await.unwrap_err();
        assert!(
            format!("{err:#}").contains("cannot reach the API server"),
            "{err:#}"
        );
    }

    #[test]
    fn access_reviews_ask_for_the_verb_resource_and_namespace() {
        let review = access_review(&INSTALL_PERMISSIONS[6]);
        let attrs = review.spec.resource_attributes.unwrap();
        assert_eq!(attrs.verb.as_deref(), Some("create"));
        assert_eq!(attrs.group.as_deref(), Some("apps"));
        assert_eq!(attrs.resource.as_deref(), Some("deployments"));
        assert_eq!(attrs.namespace.as_deref(), Some("baton-system"));
    }
}
