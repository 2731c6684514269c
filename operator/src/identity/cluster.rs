//! What the identity service asks the API server — TokenReview, the caller's
//! Pod, Events — behind a trait, so the server's tests and benchmark run
//! with a substitute and no API server.

use std::future::Future;

use baton_crds::contract::labels;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client};

use super::issue::{Caller, Refusal, ReviewResult};

/// Extra keys the ServiceAccount authenticator sets for a Pod-bound token.
pub const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";
pub const POD_UID_EXTRA: &str = "authentication.kubernetes.io/pod-uid";

/// Whether the Pod a token is bound to may hold a mesh identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodState {
    Meshed,
    NotMeshed,
    /// Deleted, or replaced by a Pod of the same name (UID differs).
    Gone,
}

/// Decides from the Pod's metadata as read (pure). A Pod is meshed when the
/// webhook injected it (`baton.dev/injected=true`, which it sets only in
/// meshed namespaces or on Pods that opted in).
pub fn pod_state(pod: Option<&ObjectMeta>, token_uid: Option<&str>) -> PodState {
    let Some(meta) = pod else {
        return PodState::Gone;
    };
    if let (Some(want), Some(have)) = (token_uid, meta.uid.as_deref())
        && want != have
    {
        return PodState::Gone;
    }
    let injected = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(labels::INJECTED))
        .is_some_and(|v| v == "true");
    if injected {
        PodState::Meshed
    } else {
        PodState::NotMeshed
    }
}

/// The projection of a TokenReview's status the issuer needs (pure).
pub fn review_result(review: &TokenReview) -> ReviewResult {
    let Some(status) = review.status.as_ref() else {
        return ReviewResult {
            error: Some("the API server returned no status".into()),
            ..ReviewResult::default()
        };
    };
    let user = status.user.as_ref();
    let extra = |key: &str| {
        user.and_then(|u| u.extra.as_ref())
            .and_then(|e| e.get(key))
            .and_then(|v| v.first())
            .cloned()
    };
    ReviewResult {
        authenticated: status.authenticated.unwrap_or(false),
        audiences: status.audiences.clone().unwrap_or_default(),
        username: user.and_then(|u| u.username.clone()).unwrap_or_default(),
        pod_name: extra(POD_NAME_EXTRA),
        pod_uid: extra(POD_UID_EXTRA),
        error: status.error.clone(),
    }
}

/// The API calls of one certificate request.
pub trait Cluster: Send + Sync + 'static {
    /// TokenReview of `token` for `audience`.
    fn review(
        &self,
        token: &str,
        audience: &str,
    ) -> impl Future<Output = Result<ReviewResult, Refusal>> + Send;
    /// State of the Pod the token is bound to.
    fn pod(
        &self,
        namespace: &str,
        name: &str,
        uid: Option<&str>,
    ) -> impl Future<Output = Result<PodState, Refusal>> + Send;
    /// Publishes a Warning Event on the caller's Pod (best effort).
    fn refusal_event(
        &self,
        caller: &Caller,
        reason: &'static str,
        note: String,
    ) -> impl Future<Output = ()> + Send;
}

/// The real API server.
#[derive(Clone)]
pub struct KubeCluster {
    client: Client,
    recorder: Recorder,
}

impl KubeCluster {
    pub fn new(client: Client, instance: Option<String>) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "baton-identity".into(),
                instance,
            },
        );
        KubeCluster { client, recorder }
    }
}

impl Cluster for KubeCluster {
    async fn review(&self, token: &str, audience: &str) -> Result<ReviewResult, Refusal> {
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                audiences: Some(vec![audience.to_owned()]),
            },
            ..TokenReview::default()
        };
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| Refusal::ReviewUnavailable(e.to_string()))?;
        Ok(review_result(&answer))
    }

    async fn pod(
        &self,
        namespace: &str,
        name: &str,
        uid: Option<&str>,
    ) -> Result<PodState, Refusal> {
        // Metadata only: labels and UID are all that decide, and a whole
        // injected Pod is tens of KiB — thousands of sidecars connecting at
        // once (an operator restart) read as many Pods at the same moment.
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let pod = api
            .get_metadata_opt(name)
            .await
            .map_err(|e| Refusal::ReviewUnavailable(format!("read pod: {e}")))?;
        Ok(pod_state(pod.as_ref().map(|p| &p.metadata), uid))
    }

    async fn refusal_event(&self, caller: &Caller, reason: &'static str, note: String) {
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(caller.pod_name.clone()),
            namespace: Some(caller.identity.namespace.clone()),
            uid: caller.pod_uid.clone(),
            ..ObjectReference::default()
        };
        let event = Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(note.chars().take(1000).collect()),
            action: "IssueCertificate".into(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, &reference).await {
            tracing::debug!(%error, "identity refusal event not published");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::authentication::v1::{TokenReviewStatus, UserInfo};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use std::collections::BTreeMap;

    fn pod(uid: &str, injected: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("web-1".into()),
                uid: Some(uid.into()),
                labels: injected
                    .map(|v| BTreeMap::from([(labels::INJECTED.to_owned(), v.to_owned())])),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    #[test]
    fn only_an_injected_pod_with_the_tokens_uid_is_meshed() {
        assert_eq!(
            pod_state(Some(&pod("u1", Some("true")).metadata), Some("u1")),
            PodState::Meshed
        );
        assert_eq!(
            pod_state(Some(&pod("u1", Some("true")).metadata), None),
            PodState::Meshed
        );
        assert_eq!(
            pod_state(Some(&pod("u1", None).metadata), Some("u1")),
            PodState::NotMeshed
        );
        assert_eq!(
            pod_state(Some(&pod("u1", Some("false")).metadata), Some("u1")),
            PodState::NotMeshed
        );
        assert_eq!(
            pod_state(Some(&pod("u2", Some("true")).metadata), Some("u1")),
            PodState::Gone
        );
        assert_eq!(pod_state(None, Some("u1")), PodState::Gone);
    }

    #[test]
    fn a_bound_tokens_review_yields_its_pod_and_audiences() {
        let review = TokenReview {
            status: Some(TokenReviewStatus {
                authenticated: Some(true),
                audiences: Some(vec!["identity.baton.dev".into()]),
                user: Some(UserInfo {
                    username: Some("system:serviceaccount:shop:cart".into()),
                    extra: Some(BTreeMap::from([
                        (POD_NAME_EXTRA.to_owned(), vec!["cart-7d9".to_owned()]),
                        (POD_UID_EXTRA.to_owned(), vec!["abc".to_owned()]),
                    ])),
                    ..UserInfo::default()
                }),
                error: None,
            }),
            ..TokenReview::default()
        };
        let r = review_result(&review);
        assert!(r.authenticated);
        assert_eq!(r.username, "system:serviceaccount:shop:cart");
        assert_eq!(r.pod_name.as_deref(), Some("cart-7d9"));
        assert_eq!(r.pod_uid.as_deref(), Some("abc"));
        assert_eq!(r.audiences, vec!["identity.baton.dev".to_owned()]);
        assert!(!review_result(&TokenReview::default()).authenticated);
    }
}
