//! The SidecarRelease status controller: reads the release and its pods,
//! computes status with [`super::status::compute`], writes it by server-side
//! apply under Baton's field manager. It writes nothing else.

use std::sync::Arc;
use std::time::Duration;

use baton_crds::SidecarRelease;
use baton_crds::conditions::Time;
use baton_crds::contract::{self, labels};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};

use super::status::{PodView, compute};
use crate::metrics::Metrics;

const KIND: &str = "SidecarRelease";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("listing pods of release {release}: {source}")]
    ListPods {
        release: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing status of release {release}: {source}")]
    WriteStatus {
        release: String,
        #[source]
        source: kube::Error,
    },
}

impl Error {
    /// Low-cardinality label for the reconcile metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::ListPods { .. } => "list_pods",
            Error::WriteStatus { .. } => "write_status",
        }
    }
}

struct Context {
    client: Client,
    metrics: Arc<Metrics>,
}

/// Maps an injected pod to the release that injected it.
fn release_of(pod: Pod) -> Option<ObjectRef<SidecarRelease>> {
    pod.labels()
        .get(labels::RELEASE)
        .map(|name| ObjectRef::new(name))
}

#[tracing::instrument(skip_all, fields(kind = KIND, name = %release.name_any()))]
async fn reconcile(release: Arc<SidecarRelease>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = release.name_any();
    let pods: Api<Pod> = Api::all(ctx.client.clone());
    let selector = format!("{}={}", labels::RELEASE, name);
    let list = pods
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(|source| Error::ListPods {
            release: name.clone(),
            source,
        })?;
    let views: Vec<PodView> = list.items.iter().map(PodView::from_pod).collect();
    let status = compute(&release, &views, &Time(Timestamp::now()));
    if release.status.as_ref() != Some(&status) {
        let api: Api<SidecarRelease> = Api::all(ctx.client.clone());
        let patch = serde_json::json!({
            "apiVersion": format!("{}/{}", contract::GROUP, contract::VERSION),
            "kind": KIND,
            "status": status,
        });
        api.patch_status(
            &name,
            &PatchParams::apply(contract::FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(|source| Error::WriteStatus {
            release: name.clone(),
            source,
        })?;
        tracing::info!(
            total = status.total,
            updated = status.updated,
            ready = status.ready,
            "status written"
        );
    }
    ctx.metrics.reconciled(KIND, "ok");
    // Pod events trigger reconciles; the periodic resync only heals missed ones.
    Ok(Action::requeue(Duration::from_secs(300)))
}

fn error_policy(_release: Arc<SidecarRelease>, error: &Error, ctx: Arc<Context>) -> Action {
    tracing::warn!(%error, "reconcile failed");
    ctx.metrics.reconciled(KIND, error.metric_label());
    Action::requeue(Duration::from_secs(5))
}

/// Runs the controller until its watch streams end.
pub async fn run(client: Client, metrics: Arc<Metrics>) -> anyhow::Result<()> {
    let releases: Api<SidecarRelease> = Api::all(client.clone());
    let pods: Api<Pod> = Api::all(client.clone());
    // The default watcher config (list + watch) on purpose: streaming lists
    // are refused by older API servers (1.20 in e2e) and retried for ever.
    let injected = watcher::Config::default().labels(labels::RELEASE);
    let ctx = Arc::new(Context { client, metrics });
    Controller::new(releases, watcher::Config::default())
        .watches(pods, injected, release_of)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "controller event");
            }
        })
        .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Reconcile against kube's tower-test mock API server: every request the
    //! reconciler makes is asserted, in order (controller-rs's approach).

    use super::*;
    use http::{Method, Request, Response};
    use kube::client::Body;

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn release() -> SidecarRelease {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "baton.dev/v1alpha1",
            "kind": "SidecarRelease",
            "metadata": {"name": "default", "generation": 2},
            "spec": {"version": "2.0", "image": "docker.io/baton/sidecar:2.0", "emptyImage": "docker.io/baton/empty:0.1.0"}
        }))
        .unwrap()
    }

    fn injected_pod(name: &str, version: &str, ready: bool) -> serde_json::Value {
        serde_json::json!({
            "metadata": {"name": name, "namespace": "shop",
                "labels": {labels::RELEASE: "default"},
                "annotations": {contract::annotations::VERSION: version}},
            "status": {"containerStatuses": [{"name": contract::containers::SLOT_A, "ready": ready,
                "restartCount": 0, "image": "i", "imageID": ""}]}
        })
    }

    async fn body_json(request: Request<Body>) -> serde_json::Value {
        let bytes = request.into_body().collect_bytes().await.unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    fn json_response(value: serde_json::Value) -> Response<Body> {
        Response::builder()
            .body(Body::from(serde_json::to_vec(&value).unwrap()))
            .unwrap()
    }

    async fn expect_pod_list(handle: &mut Handle, pods: Vec<serde_json::Value>) {
        let (request, send) = handle.next_request().await.expect("a pod list");
        assert_eq!(request.method(), Method::GET);
        let uri = request.uri().to_string();
        assert!(uri.starts_with("/api/v1/pods?"), "{uri}");
        assert!(
            uri.contains("labelSelector=baton.dev%2Frelease%3Ddefault"),
            "{uri}"
        );
        send.send_response(json_response(serde_json::json!({
            "apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": pods
        })));
    }

    #[tokio::test]
    async fn reconcile_lists_the_release_pods_and_applies_their_counts_as_status() {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let server = tokio::spawn(async move {
            expect_pod_list(
                &mut handle,
                vec![
                    injected_pod("a", "1.0", true),
                    injected_pod("b", "2.0", true),
                ],
            )
            .await;
            let (request, send) = handle.next_request().await.expect("a status patch");
            assert_eq!(request.method(), Method::PATCH);
            let uri = request.uri().to_string();
            assert!(
                uri.starts_with("/apis/baton.dev/v1alpha1/sidecarreleases/default/status?"),
                "{uri}"
            );
            assert!(uri.contains("fieldManager=baton.dev%2Foperator"), "{uri}");
            assert!(uri.contains("force=true"), "{uri}");
            let body = body_json(request).await;
            let status = &body["status"];
            assert_eq!(
                (
                    status["total"].as_i64(),
                    status["updated"].as_i64(),
                    status["ready"].as_i64()
                ),
                (Some(2), Some(1), Some(2))
            );
            assert_eq!(status["observedGeneration"], 2);
            let mut echoed = release();
            echoed.status = serde_json::from_value(status.clone()).unwrap();
            send.send_response(json_response(serde_json::to_value(echoed).unwrap()));
        });
        let ctx = Arc::new(Context {
            client,
            metrics: Arc::new(Metrics::default()),
        });
        let action = reconcile(Arc::new(release()), ctx.clone()).await.unwrap();
        assert_eq!(action, Action::requeue(Duration::from_secs(300)));
        server.await.unwrap();
        assert!(ctx.metrics.encode().contains("result=\"ok\"} 1"));
    }

    #[tokio::test]
    async fn reconcile_skips_the_write_when_status_is_already_current() {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let mut current = release();
        current.status = Some(compute(&current, &[], &Time(Timestamp::now())));
        let server = tokio::spawn(async move {
            expect_pod_list(&mut handle, vec![]).await;
            // No further request: dropping the handle makes any write fail.
        });
        let ctx = Arc::new(Context {
            client,
            metrics: Arc::new(Metrics::default()),
        });
        reconcile(Arc::new(current), ctx).await.unwrap();
        server.await.unwrap();
    }

    #[test]
    fn pods_map_to_the_release_named_in_their_label() {
        let pod: Pod = serde_json::from_value(injected_pod("a", "1.0", true)).unwrap();
        assert_eq!(release_of(pod), Some(ObjectRef::new("default")));
        assert_eq!(release_of(Pod::default()), None);
    }
}
