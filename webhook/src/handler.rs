//! Admission request handling: routing, decoding, calling the pure cores,
//! encoding the answer, metrics and Events. The only place where
//! `mutate`/`validate` meet I/O.
//!
//! HTTP status policy (what the API server handles well):
//! * 200 with an AdmissionReview for every request we can attribute to a
//!   review `uid` — allowed, patched or denied with a message;
//! * 400 (plain text) for a body with no recoverable `uid` (see
//!   [`crate::review`]): the API server counts it as a failed call and
//!   applies `failurePolicy`;
//! * 404 for any other path, 405 for a non-POST to an admission path.
//!
//! Never 500: every failure inside is mapped to one of the above.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use baton_crds::{
    SidecarRelease,
    contract::{self, webhook as names},
};
use http::{Method, StatusCode};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ObjectReference, Pod};
use kube::{
    Api, Client,
    api::ListParams,
    core::{
        DynamicObject, Status,
        admission::{AdmissionRequest, AdmissionResponse, Operation},
    },
    runtime::events::{Event, EventType, Recorder, Reporter},
};

use crate::{
    cache::ClusterState,
    inject::{self, Denial, DenialReason, InjectConfig, Outcome, RecentGrant, Skip},
    metrics::{DecisionLabels, Metrics},
    review::{self, Decoded},
    server::{SimpleRequest, SimpleResponse, response},
    validate::{self, ValidationView, Verdict},
};

/// Longest a device grant this replica made counts against its pool on top
/// of the pool's status, should no newer status arrive (the pod was refused
/// later by another admission step, or the operator is down).
pub const GRANT_MEMORY: Duration = Duration::from_secs(5);

/// The devices this replica granted in the last [`GRANT_MEMORY`].
#[derive(Debug, Default)]
pub struct GrantLedger(Mutex<VecDeque<(Instant, RecentGrant)>>);

impl GrantLedger {
    pub fn record(&self, grant: RecentGrant, now: Instant) {
        let mut q = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        q.push_back((now, grant));
    }

    /// Grants younger than [`GRANT_MEMORY`] (older ones are dropped).
    pub fn recent(&self, now: Instant) -> Vec<RecentGrant> {
        let mut q = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while q
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) >= GRANT_MEMORY)
        {
            q.pop_front();
        }
        q.iter().map(|(_, g)| g.clone()).collect()
    }
}

/// Everything a request needs.
pub struct Admission {
    pub state: Arc<dyn ClusterState>,
    pub config: InjectConfig,
    pub metrics: Arc<Metrics>,
    /// For the live namespace re-check and Events; `None` in tests.
    pub client: Option<Client>,
    recorder: Option<Recorder>,
    grants: GrantLedger,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

const MUTATE: &str = "mutate-pods";
const VALIDATE: &str = "validate";

impl Admission {
    pub fn new(
        state: Arc<dyn ClusterState>,
        config: InjectConfig,
        metrics: Arc<Metrics>,
        client: Option<Client>,
    ) -> Self {
        let recorder = client.clone().map(|c| {
            Recorder::new(
                c,
                Reporter {
                    controller: names::SERVICE.to_owned(),
                    instance: std::env::var("POD_NAME").ok(),
                },
            )
        });
        Self {
            state,
            config,
            metrics,
            client,
            recorder,
            grants: GrantLedger::default(),
        }
    }

    /// Answers one HTTP request.
    pub async fn handle(&self, req: SimpleRequest) -> SimpleResponse {
        let start = Instant::now();
        let (endpoint, result, resp) = match (req.path.as_str(), &req.method) {
            (names::MUTATE_PODS_PATH, &Method::POST) => {
                let (result, resp) = self.mutate_pods(&req.body).await;
                (MUTATE, result, resp)
            }
            (names::VALIDATE_PATH, &Method::POST) => {
                let (result, resp) = self.validate(&req.body);
                (VALIDATE, result, resp)
            }
            (names::MUTATE_PODS_PATH | names::VALIDATE_PATH, _) => (
                "other",
                "method_not_allowed",
                response(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "use POST\n"),
            ),
            _ => (
                "other",
                "not_found",
                response(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
            ),
        };
        self.metrics.observe(endpoint, result, start.elapsed());
        resp
    }

    async fn mutate_pods(&self, body: &[u8]) -> (&'static str, SimpleResponse) {
        let request = match decode(body) {
            Ok(r) => r,
            Err(answer) => return *answer,
        };
        let span = tracing::info_span!("mutate", uid = %request.uid, ns = ?request.namespace, name = %request.name);
        let _guard = span.enter();
        let base = AdmissionResponse::from(request.as_ref());
        if request.kind.kind != "Pod" || !request.kind.group.is_empty() {
            let message = format!(
                "the Baton injector only handles core/v1 Pods, got {}/{} {}: check the MutatingWebhookConfiguration rules",
                request.kind.group, request.kind.version, request.kind.kind
            );
            return ("denied", answer(denied(base, &message)));
        }
        if request.operation != Operation::Create {
            // Injection happens once, at creation; pod specs are immutable
            // in the parts we touch.
            return ("allowed", answer(base));
        }
        let pod: Pod = match review::typed_object(&request) {
            Ok(p) => p,
            Err(message) => return ("denied", answer(denied(base, &message))),
        };
        let namespace = request
            .namespace
            .clone()
            .or_else(|| pod.metadata.namespace.clone())
            .unwrap_or_else(|| "default".to_owned());
        drop(_guard);
        let outcome = self.decide(&pod, &namespace, &request.uid).await;
        let _guard = span.enter();
        match outcome {
            Ok(Outcome::Skipped(skip)) => {
                self.count_decision(skip.metric_label());
                tracing::debug!(?skip, "not injected");
                ("allowed", answer(base))
            }
            Ok(Outcome::Injected(injection)) => {
                self.count_decision("injected");
                if let inject::Offload::Granted { pool, grant, .. } = &injection.offload
                    && !request.dry_run
                {
                    let grant = RecentGrant {
                        id: grant.clone(),
                        pool: pool.clone(),
                        devices: injection.offload.total_devices(),
                        at: k8s_openapi::jiff::Timestamp::now(),
                    };
                    self.grants.record(grant, Instant::now());
                }
                self.count_decision(match injection.offload.metric_label() {
                    "granted" => "offload_granted",
                    "fallback" => "offload_fallback",
                    _ => "offload_disabled",
                });
                tracing::info!(
                    release = %injection.release, version = %injection.version,
                    native = injection.native_sidecars, capture = injection.capture.as_str(),
                    offload = injection.offload.metric_label(), "injected"
                );
                match base.clone().with_patch(injection.patch) {
                    Ok(patched) => ("patched", answer(patched)),
                    Err(e) => (
                        "denied",
                        answer(denied(base, &format!("cannot encode the patch: {e}"))),
                    ),
                }
            }
            Err(denial) => {
                self.count_decision(denial.reason.metric_label());
                tracing::info!(reason = denial.reason.metric_label(), message = %denial.message, "refused");
                if denial.reason.wants_event() && !request.dry_run {
                    self.publish_event(&pod, &namespace, &denial);
                }
                ("denied", answer(denied(base, &denial.message)))
            }
        }
    }

    /// Runs `mutate` on a snapshot, re-reading live what the cache may not
    /// have seen yet before it answers from a possibly stale view:
    ///
    /// - the namespace, if the cache does not know it or says it did not opt
    ///   in (the API server only sends pods its selectors matched, so that
    ///   suggests the cache lags a fresh label);
    /// - the SidecarReleases, if the pod opted in but none selects it (a
    ///   release applied a moment before its first pod must not refuse that
    ///   pod; refusals are rare, so one consistent LIST costs little);
    /// - the mesh trust bundle (ConfigMap `baton-mesh-trust` of the
    ///   operator's namespace), if that is all the Pod is refused for.
    async fn decide(&self, pod: &Pod, namespace: &str, uid: &str) -> Result<Outcome, Denial> {
        let (mut snapshot, known) = self.state.snapshot(namespace);
        snapshot.recent_grants = self.grants.recent(Instant::now());
        snapshot.grant_id = uid.to_owned();
        let first = inject::mutate(pod, &snapshot.cluster_view(), &self.config);
        let stale_namespace = !known || matches!(first, Ok(Outcome::Skipped(Skip::NotOptedIn)));
        let no_release = matches!(&first, Err(d) if d.reason == DenialReason::NoRelease);
        let Some(client) = self.client.as_ref() else {
            return first;
        };
        let reread = (stale_namespace || no_release)
            && self
                .reread(client, &mut snapshot, namespace, no_release)
                .await;
        let result = if reread {
            inject::mutate(pod, &snapshot.cluster_view(), &self.config)
        } else {
            first
        };
        if !matches!(&result, Err(d) if d.reason == DenialReason::NoTrustBundle) {
            return result;
        }
        // Published a moment ago (a fresh install: the operator's first pass
        // and the first Pods race), and the reflector has not delivered it.
        match Api::<ConfigMap>::namespaced(client.clone(), &self.config.trust_namespace)
            .get_opt(contract::identity::TRUST_CONFIG_MAP)
            .await
        {
            Ok(cm) => match cm.as_ref().and_then(crate::cache::trust_bundle) {
                Some(bundle) => {
                    snapshot.trust_bundle = Some(bundle);
                    inject::mutate(pod, &snapshot.cluster_view(), &self.config)
                }
                None => result,
            },
            Err(error) => {
                tracing::warn!(%error, "live read of the mesh trust bundle failed; using the cache");
                result
            }
        }
    }

    /// The live reads before deciding on what the cache may lag behind:
    /// the namespace's labels, and with `releases` the SidecarReleases.
    /// Whether anything differs from the cache.
    async fn reread(
        &self,
        client: &Client,
        snapshot: &mut crate::cache::Snapshot,
        namespace: &str,
        releases: bool,
    ) -> bool {
        let mut changed = false;
        match Api::<Namespace>::all(client.clone())
            .get_opt(namespace)
            .await
        {
            Ok(Some(ns)) => {
                let labels = ns.metadata.labels.unwrap_or_default();
                if labels != snapshot.namespace_labels {
                    snapshot.namespace_labels = labels;
                    changed = true;
                }
            }
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(%error, namespace, "live namespace read failed; using the cache");
            }
        }
        if releases {
            match Api::<SidecarRelease>::all(client.clone())
                .list(&ListParams::default())
                .await
            {
                Ok(list) => {
                    tracing::debug!(
                        cached = snapshot.releases.len(),
                        live = list.items.len(),
                        "no cached SidecarRelease selects the pod; re-read them live"
                    );
                    snapshot.releases = list.items.into_iter().map(Arc::new).collect();
                    changed = true;
                }
                Err(error) => {
                    tracing::warn!(%error, "live SidecarRelease list failed; using the cache");
                }
            }
        }
        changed
    }

    fn count_decision(&self, decision: &'static str) {
        self.metrics
            .injection_decisions
            .get_or_create(&DecisionLabels { decision })
            .inc();
    }

    /// Records the refusal where `kubectl describe` shows it: on the pod's
    /// controller (a ReplicaSet, Job...) when there is one, else on the
    /// namespace (the Event in that namespace). Fire and forget: admission never waits for it.
    fn publish_event(&self, pod: &Pod, namespace: &str, denial: &Denial) {
        let Some(recorder) = self.recorder.clone() else {
            return;
        };
        let reference = pod
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true))
            .map(|o| ObjectReference {
                api_version: Some(o.api_version.clone()),
                kind: Some(o.kind.clone()),
                name: Some(o.name.clone()),
                namespace: Some(namespace.to_owned()),
                uid: Some(o.uid.clone()),
                ..ObjectReference::default()
            })
            // The Event lives in the pod's own namespace, where its owner
            // looks (`kubectl get events -n <ns>`). It cannot go to
            // `default` with an empty reference namespace: API servers
            // before 1.22 refuse an events.k8s.io/v1 Event whose namespace
            // differs from its object's ("does not match event.namespace").
            .unwrap_or_else(|| ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Namespace".to_owned()),
                name: Some(namespace.to_owned()),
                namespace: Some(namespace.to_owned()),
                ..ObjectReference::default()
            });
        let reason = match denial.reason {
            inject::DenialReason::OffloadUnavailable => names::EVENT_REASON_OFFLOAD_DENIED,
            inject::DenialReason::NoTrustBundle => names::EVENT_REASON_NO_TRUST_BUNDLE,
            _ => names::EVENT_REASON_NO_RELEASE,
        };
        let event = Event {
            type_: EventType::Warning,
            reason: reason.to_owned(),
            note: Some(truncate(&denial.message, 1000)),
            action: "InjectSidecar".to_owned(),
            secondary: None,
        };
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            if let Err(error) = recorder.publish(&event, &reference).await {
                tracing::warn!(%error, "could not publish the refusal Event");
                metrics
                    .errors
                    .get_or_create(&crate::metrics::ErrorLabels { error: "event" })
                    .inc();
            }
        });
    }

    fn validate(&self, body: &[u8]) -> (&'static str, SimpleResponse) {
        let request = match decode(body) {
            Ok(r) => r,
            Err(answer) => return *answer,
        };
        let _guard = tracing::info_span!("validate", uid = %request.uid, kind = %request.kind.kind, name = %request.name).entered();
        let base = AdmissionResponse::from(request.as_ref());
        if request.operation == Operation::Delete || request.operation == Operation::Connect {
            return ("allowed", answer(base));
        }
        let Some(object) = request.object.as_ref() else {
            let message = format!(
                "{} {} request has no object",
                request.kind.kind, request.name
            );
            return ("denied", answer(denied(base, &message)));
        };
        let value = match serde_json::to_value(object) {
            Ok(v) => v,
            Err(e) => {
                return (
                    "denied",
                    answer(denied(base, &format!("object does not encode: {e}"))),
                );
            }
        };
        let namespace = request.namespace.clone().unwrap_or_default();
        let (snapshot, _) = self.state.snapshot(&namespace);
        let pods = if request.kind.kind == "AuthorizationPolicy" {
            self.state.pods(&namespace)
        } else {
            Vec::new()
        };
        let view = ValidationView {
            trust_domain: &self.config.trust_domain,
            pods: &pods,
            ..snapshot.validation_view()
        };
        match validate::validate(&request.kind.group, &request.kind.kind, &value, &view) {
            Verdict::Allowed(warnings) => {
                let mut resp = base;
                if !warnings.is_empty() {
                    resp.warnings = Some(warnings);
                }
                ("allowed", answer(resp))
            }
            Verdict::Denied(message) => {
                tracing::info!(%message, "refused");
                ("denied", answer(denied(base, &message)))
            }
        }
    }
}

type Answer = (&'static str, SimpleResponse);

fn decode(body: &[u8]) -> Result<Box<AdmissionRequest<DynamicObject>>, Box<Answer>> {
    match review::decode(body) {
        Ok(Decoded::Request(r)) => Ok(r),
        Ok(Decoded::Refused(resp)) => Err(Box::new(("denied", answer(*resp)))),
        Err(e) => Err(Box::new((
            "invalid",
            response(StatusCode::BAD_REQUEST, "text/plain", format!("{e}\n")),
        ))),
    }
}

fn answer(resp: AdmissionResponse) -> SimpleResponse {
    response(StatusCode::OK, "application/json", review::encode(resp))
}

/// A denial with a message and a 403 code, which the API server shows as
/// `admission webhook "..." denied the request: <message>`.
fn denied(base: AdmissionResponse, message: &str) -> AdmissionResponse {
    let mut resp = base.deny(message);
    resp.result = Status::failure(message, "Forbidden").with_code(403);
    resp
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    //! The handler's I/O edges against a tower-test mock API server: the
    //! live namespace re-check and the refusal Event.

    use std::sync::Arc;

    use baton_crds::contract::labels;
    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::json;

    use super::*;
    use crate::{cache::Snapshot, inject::ServerVersion};

    const BUNDLE: &str = "-----BEGIN CERTIFICATE-----\nMIIBroot\n-----END CERTIFICATE-----\n";

    /// A cache that does not know the namespace yet.
    struct Lagging(Snapshot);

    impl ClusterState for Lagging {
        fn snapshot(&self, namespace: &str) -> (Snapshot, bool) {
            let mut s = self.0.clone();
            s.namespace = namespace.to_owned();
            (s, false)
        }
        fn is_synced(&self) -> bool {
            true
        }
    }

    fn release(selector: serde_json::Value) -> Arc<baton_crds::SidecarRelease> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarRelease", "metadata": {"name": "r"},
                "spec": {"version": "1", "image": "s", "emptyImage": "e", "podSelector": selector},
            }))
            .unwrap(),
        )
    }

    fn review(pod: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "namespace": "fresh", "operation": "CREATE", "userInfo": {}, "object": pod}
        }))
        .unwrap()
    }

    fn admission(
        state: Arc<dyn ClusterState>,
    ) -> (
        Admission,
        tower_test::mock::Handle<Request<Body>, Response<Body>>,
    ) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let a = Admission::new(
            state,
            InjectConfig::default(),
            Arc::new(Metrics::unregistered()),
            Some(client),
        );
        (a, handle)
    }

    fn json_response(code: u16, body: &serde_json::Value) -> Response<Body> {
        Response::builder()
            .status(code)
            .body(Body::from(serde_json::to_vec(body).unwrap()))
            .unwrap()
    }

    async fn post(a: &Admission, body: Vec<u8>) -> serde_json::Value {
        let resp = a
            .handle(SimpleRequest {
                method: Method::POST,
                path: names::MUTATE_PODS_PATH.to_owned(),
                body: body.into(),
            })
            .await;
        assert_eq!(resp.status(), StatusCode::OK);
        let bytes = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap()
            .to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test]
    async fn a_namespace_missing_from_the_cache_is_read_live_before_deciding() {
        let snapshot = Snapshot {
            releases: vec![release(json!({}))],
            server_version: Some(ServerVersion::new(1, 20)),
            trust_bundle: Some(BUNDLE.into()),
            ..Snapshot::default()
        };
        let (a, mut handle) = admission(Arc::new(Lagging(snapshot)));
        let server = tokio::spawn(async move {
            let (request, send) = handle.next_request().await.unwrap();
            assert_eq!(request.method(), "GET");
            assert_eq!(request.uri().path(), "/api/v1/namespaces/fresh");
            send.send_response(json_response(200, &json!({
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": "fresh", "labels": {labels::INJECT: labels::INJECT_ENABLED}},
            })));
        });
        let out = post(
            &a,
            review(json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "app"}]}})),
        )
        .await;
        server.await.unwrap();
        assert_eq!(out["response"]["allowed"], true);
        assert_eq!(out["response"]["patchType"], "JSONPatch");
    }

    /// Answers the live reads `decide` makes before a "no release" refusal:
    /// the namespace (opted in) and the SidecarReleases (one per selector).
    async fn serve_live_reads(
        handle: &mut tower_test::mock::Handle<Request<Body>, Response<Body>>,
        selectors: serde_json::Value,
    ) {
        let (request, send) = handle.next_request().await.unwrap();
        assert_eq!(request.uri().path(), "/api/v1/namespaces/fresh");
        send.send_response(json_response(
            200,
            &json!({
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": "fresh", "labels": {labels::INJECT: labels::INJECT_ENABLED}},
            }),
        ));
        let (request, send) = handle.next_request().await.unwrap();
        assert_eq!(request.method(), "GET");
        assert_eq!(
            request.uri().path(),
            "/apis/baton.dev/v1alpha1/sidecarreleases"
        );
        let items: Vec<_> = selectors
            .as_array()
            .unwrap()
            .iter()
            .map(|s| serde_json::to_value(&*release(s.clone())).unwrap())
            .collect();
        send.send_response(json_response(
            200,
            &json!({
                "apiVersion": "baton.dev/v1alpha1", "kind": "SidecarReleaseList",
                "metadata": {"resourceVersion": "7"}, "items": items,
            }),
        ));
    }

    #[tokio::test]
    async fn a_release_the_cache_has_not_seen_yet_is_read_live_before_refusing() {
        // The namespace opted in; the release was applied a moment ago and
        // the reflector has not delivered it.
        let snapshot = Snapshot {
            namespace_labels: [(labels::INJECT.to_owned(), labels::INJECT_ENABLED.to_owned())]
                .into(),
            server_version: Some(ServerVersion::new(1, 20)),
            trust_bundle: Some(BUNDLE.into()),
            ..Snapshot::default()
        };
        let (a, mut handle) = admission(Arc::new(crate::cache::StaticState(snapshot)));
        let server = tokio::spawn(async move { serve_live_reads(&mut handle, json!([{}])).await });
        let out = post(
            &a,
            review(json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "app"}]}})),
        )
        .await;
        server.await.unwrap();
        assert_eq!(out["response"]["allowed"], true, "{out}");
        assert_eq!(out["response"]["patchType"], "JSONPatch");
    }

    #[tokio::test]
    async fn a_refusal_for_want_of_a_release_is_recorded_on_the_pods_controller() {
        let snapshot = Snapshot {
            namespace_labels: [(labels::INJECT.to_owned(), labels::INJECT_ENABLED.to_owned())]
                .into(),
            releases: vec![release(json!({"matchLabels": {"app": "other"}}))],
            server_version: Some(ServerVersion::new(1, 20)),
            trust_bundle: Some(BUNDLE.into()),
            ..Snapshot::default()
        };
        let (a, mut handle) = admission(Arc::new(crate::cache::StaticState(snapshot)));
        // Before refusing, the namespace and the releases are read live;
        // the API server has no other release either.
        let server = tokio::spawn(async move {
            serve_live_reads(&mut handle, json!([{"matchLabels": {"app": "other"}}])).await;
            handle
        });
        let pod = json!({"metadata": {"generateName": "web-", "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-abc", "uid": "rs-uid", "controller": true}]},
            "spec": {"containers": [{"name": "app"}]}});
        let out = post(&a, review(pod)).await;
        assert_eq!(out["response"]["allowed"], false);
        assert!(
            out["response"]["status"]["message"]
                .as_str()
                .unwrap()
                .contains("no SidecarRelease selects it")
        );
        let mut handle = server.await.unwrap();
        // The Event is published in the background: the refusal did not wait.
        let (request, send) =
            tokio::time::timeout(std::time::Duration::from_secs(10), handle.next_request())
                .await
                .expect("an Event request")
                .unwrap();
        assert_eq!(request.method(), "POST");
        assert_eq!(
            request.uri().path(),
            "/apis/events.k8s.io/v1/namespaces/fresh/events"
        );
        let body: serde_json::Value =
            serde_json::from_slice(&request.into_body().collect_bytes().await.unwrap()).unwrap();
        assert_eq!(body["reason"], names::EVENT_REASON_NO_RELEASE);
        assert_eq!(body["type"], "Warning");
        assert_eq!(body["regarding"]["kind"], "ReplicaSet");
        assert_eq!(body["regarding"]["name"], "web-abc");
        send.send_response(json_response(201, &body));
    }

    /// A cache that knows the namespace and the release, and no bundle.
    fn without_bundle() -> Snapshot {
        Snapshot {
            namespace_labels: [(labels::INJECT.to_owned(), labels::INJECT_ENABLED.to_owned())]
                .into(),
            releases: vec![release(json!({}))],
            server_version: Some(ServerVersion::new(1, 20)),
            ..Snapshot::default()
        }
    }

    /// Expects the live read of ConfigMap baton-system/baton-mesh-trust and
    /// answers it with `answer` (404 when `None`).
    async fn serve_trust_read(
        handle: &mut tower_test::mock::Handle<Request<Body>, Response<Body>>,
        answer: Option<&str>,
    ) {
        let (request, send) = handle.next_request().await.unwrap();
        assert_eq!(request.method(), "GET");
        assert_eq!(
            request.uri().path(),
            "/api/v1/namespaces/baton-system/configmaps/baton-mesh-trust"
        );
        match answer {
            Some(bundle) => send.send_response(json_response(
                200,
                &json!({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": "baton-mesh-trust", "namespace": "baton-system"},
                        "data": {"ca.crt": bundle}}),
            )),
            None => send.send_response(json_response(
                404,
                &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "code": 404, "reason": "NotFound", "message": "not found"}),
            )),
        }
    }

    #[tokio::test]
    async fn a_trust_bundle_the_cache_has_not_seen_yet_is_read_live_and_injected() {
        let (a, mut handle) = admission(Arc::new(crate::cache::StaticState(without_bundle())));
        let server = tokio::spawn(async move { serve_trust_read(&mut handle, Some(BUNDLE)).await });
        let out = post(
            &a,
            review(json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "app"}]}})),
        )
        .await;
        server.await.unwrap();
        assert_eq!(out["response"]["allowed"], true, "{out}");
        let patch: k8s_openapi::ByteString =
            serde_json::from_value(out["response"]["patch"].clone()).unwrap();
        let patch = String::from_utf8(patch.0).unwrap();
        assert!(patch.contains("baton.dev/trust-bundle"), "{patch}");
        assert!(patch.contains("MIIBroot"), "{patch}");
    }

    #[tokio::test]
    async fn without_a_trust_bundle_anywhere_an_opted_in_pod_is_refused_with_an_event() {
        let (a, mut handle) = admission(Arc::new(crate::cache::StaticState(without_bundle())));
        let server = tokio::spawn(async move {
            serve_trust_read(&mut handle, None).await;
            handle
        });
        let out = post(
            &a,
            review(json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "app"}]}})),
        )
        .await;
        assert_eq!(out["response"]["allowed"], false, "{out}");
        let message = out["response"]["status"]["message"].as_str().unwrap();
        assert!(
            message.contains("has not published the mesh trust bundle yet (ConfigMap baton-system/baton-mesh-trust"),
            "{message}"
        );
        let mut handle = server.await.unwrap();
        let (request, send) =
            tokio::time::timeout(std::time::Duration::from_secs(10), handle.next_request())
                .await
                .expect("an Event request")
                .unwrap();
        let body: serde_json::Value =
            serde_json::from_slice(&request.into_body().collect_bytes().await.unwrap()).unwrap();
        assert_eq!(body["reason"], names::EVENT_REASON_NO_TRUST_BUNDLE);
        send.send_response(json_response(201, &body));
    }

    #[test]
    fn the_grant_ledger_keeps_grants_for_grant_memory_then_forgets_them() {
        let ledger = GrantLedger::default();
        let t0 = Instant::now();
        let grant = |pool: &str| RecentGrant {
            id: format!("req-{pool}"),
            pool: pool.to_owned(),
            devices: 1,
            at: k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        };
        ledger.record(grant("qat"), t0);
        ledger.record(grant("other"), t0 + Duration::from_millis(600));
        let pools = |v: Vec<RecentGrant>| v.into_iter().map(|g| g.pool).collect::<Vec<_>>();
        assert_eq!(
            pools(ledger.recent(t0 + Duration::from_secs(1))),
            ["qat", "other"]
        );
        assert_eq!(
            pools(ledger.recent(t0 + GRANT_MEMORY + Duration::from_millis(100))),
            ["other"]
        );
        assert!(ledger.recent(t0 + GRANT_MEMORY * 2).is_empty());
    }
}
