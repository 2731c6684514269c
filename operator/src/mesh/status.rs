//! Route, TlsPolicy and AuthorizationPolicy status: what users read in
//! `kubectl get brt,tlsp,authz`.
//!
//! [`route_status`], [`tls_policy_status`] and
//! [`authorization_policy_status`] are pure (object, verdict,
//! how many sidecars serve it → status); [`run`] is the leader's writer,
//! applying a status only when it changed (server-side apply, the
//! operator's one field manager).
//!
//! Programmed counts the sidecars connected to every replica: the leader's
//! own from its hub, the others' from the tallies they publish
//! ([`super::tally`]).

use std::sync::Arc;
use std::time::Duration;

use baton_crds::conditions::{authorization_policy as ac, route as rc, tls_policy as tc, upsert};
use baton_crds::{
    AuthorizationPolicy, AuthorizationPolicyStatus, Route, RouteStatus, TlsPolicy, TlsPolicyStatus,
    contract,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client};

/// Programmed=False reason when a sidecar NACKed the object's generation.
pub const REFUSED: &str = "Refused";

use super::compile::{RouteVerdict, tls_policy_refusal};
use super::hub::{Hub, Programmed};
use super::index::ObjKey;
use super::tally::{self, Tally};

/// Programmed=True when every sidecar it is programmed into ACKed the
/// current generation; a NACK names its error; "n/m" in the message.
fn programmed(
    conditions: &mut Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
    type_: &str,
    accepted: bool,
    p: &Programmed,
    generation: Option<i64>,
    now: &Time,
) {
    let (ok, reason, message) = if !accepted {
        (false, rc::reasons::PENDING, "not accepted".to_owned())
    } else if let Some(error) = &p.nack {
        (
            false,
            REFUSED,
            format!(
                "{}/{} sidecars ACKed; a sidecar refused it: {error}",
                p.acked, p.total
            ),
        )
    } else if !p.waiting.is_empty() {
        (
            false,
            rc::reasons::PENDING,
            format!(
                "{}/{} sidecars ACKed; waiting for operator replica {} to report",
                p.acked,
                p.total,
                p.waiting.join(", ")
            ),
        )
    } else if p.acked < p.total {
        (
            false,
            rc::reasons::PENDING,
            format!("{}/{} sidecars ACKed", p.acked, p.total),
        )
    } else {
        (
            true,
            rc::reasons::PROGRAMMED,
            format!("{}/{} sidecars ACKed", p.acked, p.total),
        )
    };
    upsert(conditions, type_, ok, reason, &message, generation, now);
}

/// A Route's status from its verdict and how many sidecars serve it.
pub fn route_status(
    route: &Route,
    verdict: Option<&RouteVerdict>,
    p: &Programmed,
    now: &Time,
) -> RouteStatus {
    let generation = route.metadata.generation;
    let mut status = route.status.clone().unwrap_or_default();
    status.observed_generation = generation;
    let c = &mut status.conditions;
    let accepted = match verdict.map(|v| &v.accepted) {
        Some(Ok(())) => {
            upsert(
                c,
                rc::ACCEPTED,
                true,
                rc::reasons::ACCEPTED,
                "attached to its Service port",
                generation,
                now,
            );
            true
        }
        Some(Err(refusal)) => {
            upsert(
                c,
                rc::ACCEPTED,
                false,
                refusal.reason,
                &refusal.message,
                generation,
                now,
            );
            false
        }
        None => {
            upsert(
                c,
                rc::ACCEPTED,
                false,
                rc::reasons::PENDING,
                "not compiled yet",
                generation,
                now,
            );
            false
        }
    };
    match verdict.map(|v| v.unresolved.as_slice()) {
        Some([]) | None => upsert(
            c,
            rc::RESOLVED_REFS,
            true,
            rc::reasons::RESOLVED_REFS,
            "every backend Service port exists",
            generation,
            now,
        ),
        Some(missing) => upsert(
            c,
            rc::RESOLVED_REFS,
            false,
            rc::reasons::BACKEND_NOT_FOUND,
            &format!(
                "no such Service port: {} (traffic for it gets 503)",
                missing.join(", ")
            ),
            generation,
            now,
        ),
    };
    programmed(c, rc::PROGRAMMED, accepted, p, generation, now);
    status
}

/// A TlsPolicy's status.
pub fn tls_policy_status(policy: &TlsPolicy, p: &Programmed, now: &Time) -> TlsPolicyStatus {
    let generation = policy.metadata.generation;
    let mut status = policy.status.clone().unwrap_or_default();
    status.observed_generation = generation;
    let c = &mut status.conditions;
    let accepted = match tls_policy_refusal(policy) {
        None => {
            upsert(
                c,
                tc::ACCEPTED,
                true,
                tc::reasons::ACCEPTED,
                "valid",
                generation,
                now,
            );
            true
        }
        Some(refusal) => {
            upsert(
                c,
                tc::ACCEPTED,
                false,
                refusal.reason,
                &refusal.message,
                generation,
                now,
            );
            false
        }
    };
    programmed(c, tc::PROGRAMMED, accepted, p, generation, now);
    status
}

/// An AuthorizationPolicy's status: Accepted unless invalid or naming
/// identities outside `trust_domain`; Programmed counts the sidecars of the
/// Pods it selects; ResolvedRefs is False (UnknownPort, with
/// `unknown_ports` as its message) while a selected Pod lacks a port name
/// it lists ([`super::authz::unknown_ports`]).
pub fn authorization_policy_status(
    policy: &AuthorizationPolicy,
    trust_domain: &str,
    p: &Programmed,
    unknown_ports: Option<&str>,
    now: &Time,
) -> AuthorizationPolicyStatus {
    let generation = policy.metadata.generation;
    let mut status = policy.status.clone().unwrap_or_default();
    status.observed_generation = generation;
    let c = &mut status.conditions;
    let accepted = match super::authz::refusal(policy, trust_domain) {
        None => {
            upsert(
                c,
                ac::ACCEPTED,
                true,
                ac::reasons::ACCEPTED,
                "valid",
                generation,
                now,
            );
            true
        }
        Some(refusal) => {
            upsert(
                c,
                ac::ACCEPTED,
                false,
                refusal.reason,
                &refusal.message,
                generation,
                now,
            );
            false
        }
    };
    programmed(c, ac::PROGRAMMED, accepted, p, generation, now);
    let (resolved, reason, message) = match unknown_ports {
        Some(m) => (false, ac::reasons::UNKNOWN_PORT, m),
        None if policy.spec.port_names().next().is_some() => (
            true,
            ac::reasons::RESOLVED_REFS,
            "every selected Pod declares the named ports",
        ),
        None => (true, ac::reasons::RESOLVED_REFS, "no port names to resolve"),
    };
    upsert(
        c,
        ac::RESOLVED_REFS,
        resolved,
        reason,
        message,
        generation,
        now,
    );
    status
}

/// Writes changed statuses every `period` until dropped (leader only).
/// `namespace` holds the replicas' tallies; `replica` is this one's name.
pub async fn run(client: Client, hub: Arc<Hub>, period: Duration, namespace: &str, replica: &str) {
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "baton-operator".into(),
            instance: None,
        },
    );
    let mut tick = tokio::time::interval(period);
    loop {
        tick.tick().await;
        if hub.is_synced() {
            let peers = tally::read_peers(&client, namespace, replica).await;
            let now = Time(k8s_openapi::jiff::Timestamp::now());
            write_once(&client, Some(&recorder), &hub, &peers, &now).await;
        }
    }
}

/// A Warning Event on the object a sidecar refused (`kubectl describe`
/// shows the sidecar's error). Published with the status change that first
/// carries the refusal, so once per distinct refusal.
async fn refusal_event(
    recorder: &Recorder,
    kind: &str,
    meta: &kube::api::ObjectMeta,
    message: &str,
) {
    let reference = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some(format!("{}/{}", contract::GROUP, contract::VERSION)),
        kind: Some(kind.into()),
        name: meta.name.clone(),
        namespace: meta.namespace.clone(),
        uid: meta.uid.clone(),
        ..Default::default()
    };
    let event = Event {
        type_: EventType::Warning,
        reason: "ConfigRefused".into(),
        note: Some(message.chars().take(1000).collect()),
        action: "PushConfig".into(),
        secondary: None,
    };
    if let Err(error) = recorder.publish(&event, &reference).await {
        tracing::debug!(%error, "config refusal event not published");
    }
}

/// The Programmed condition's message when it reports a refusal.
fn refused(
    conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
) -> Option<&str> {
    conditions
        .iter()
        .find(|c| c.type_ == rc::PROGRAMMED && c.reason == REFUSED)
        .map(|c| c.message.as_str())
}

/// One pass: applies every Route and TlsPolicy status that differs from the
/// one the object carries, counting `peers`' sidecars with the hub's.
/// Returns how many were written. A failed write is logged and retried on
/// the next pass.
pub async fn write_once(
    client: &Client,
    recorder: Option<&Recorder>,
    hub: &Hub,
    peers: &[Tally],
    now: &Time,
) -> usize {
    let attachments = hub.attachments();
    let objects = hub.objects();
    let sources = objects.sources();
    let super::hub::Objects {
        routes,
        tls_policies: policies,
        authorization_policies,
    } = objects;
    let mut counts = hub.programmed_all(&sources).into_iter().zip(&sources);
    // An object whose generation the hub has not compiled yet waits for
    // the next pass: no stream can have been sent it, and "0/0 ACKed"
    // would read as Programmed.
    let compiled = hub.compiled_sources();
    let mut written = 0;
    for route in routes {
        let key = ObjKey::of(route.as_ref());
        let verdict = attachments.verdicts.get(&key);
        let (own, source) = counts.next().expect("one count per route");
        if !compiled.contains(source) {
            continue;
        }
        let p = tally::merged(own, source, peers);
        let status = route_status(&route, verdict, &p, now);
        let before = route.status.as_ref().map(|s| s.conditions.as_slice());
        if route.status.as_ref() != Some(&status)
            && apply_status(
                client,
                recorder,
                route.as_ref(),
                before,
                &status.conditions,
                &status,
            )
            .await
        {
            written += 1;
        }
    }
    for policy in policies {
        let (own, source) = counts.next().expect("one count per policy");
        if !compiled.contains(source) {
            continue;
        }
        let p = tally::merged(own, source, peers);
        let status = tls_policy_status(&policy, &p, now);
        let before = policy.status.as_ref().map(|s| s.conditions.as_slice());
        if policy.status.as_ref() != Some(&status)
            && apply_status(
                client,
                recorder,
                policy.as_ref(),
                before,
                &status.conditions,
                &status,
            )
            .await
        {
            written += 1;
        }
    }
    let trust_domain = &hub.params().trust_domain;
    let unknown = hub.unknown_ports();
    for policy in authorization_policies {
        let (own, source) = counts.next().expect("one count per authorization policy");
        if !compiled.contains(source) {
            continue;
        }
        let p = tally::merged(own, source, peers);
        let unknown = unknown
            .get(&ObjKey::of(policy.as_ref()))
            .map(String::as_str);
        let status = authorization_policy_status(&policy, trust_domain, &p, unknown, now);
        let before = policy.status.as_ref().map(|s| s.conditions.as_slice());
        if policy.status.as_ref() != Some(&status)
            && apply_status(
                client,
                recorder,
                policy.as_ref(),
                before,
                &status.conditions,
                &status,
            )
            .await
        {
            written += 1;
        }
    }
    written
}

/// Server-side applies `status` to `obj` and, when the new conditions
/// carry a refusal the old ones did not, publishes its Event. Whether the
/// write succeeded.
async fn apply_status<K>(
    client: &Client,
    recorder: Option<&Recorder>,
    obj: &K,
    before: Option<&[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition]>,
    after: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    status: &impl serde::Serialize,
) -> bool
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let kind = K::kind(&());
    let key = ObjKey::of(obj);
    let api: Api<K> = Api::namespaced(client.clone(), &key.namespace);
    let patch = serde_json::json!({
        "apiVersion": format!("{}/{}", contract::GROUP, contract::VERSION),
        "kind": kind,
        "status": status,
    });
    let params = PatchParams::apply(contract::FIELD_MANAGER).force();
    if let Err(error) = api
        .patch_status(&key.name, &params, &Patch::Apply(&patch))
        .await
    {
        tracing::warn!(%kind, object = %key, %error, "status not written");
        return false;
    }
    let was = before.and_then(refused);
    if let (Some(recorder), Some(message)) = (recorder, refused(after))
        && was != Some(message)
    {
        refusal_event(recorder, &kind, obj.meta(), message).await;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::compile::Refusal;
    use baton_crds::conditions;

    fn route(generation: i64) -> Route {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "Route",
            "metadata": {"name": "r", "namespace": "shop", "generation": generation},
            "spec": {"parentRef": {"name": "server", "port": 80},
                     "rules": [{"backendRefs": [{"name": "server", "port": 80}]}]}
        }))
        .unwrap()
    }

    fn cond<'s>(
        s: &'s RouteStatus,
        t: &str,
    ) -> &'s k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    fn now() -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000).unwrap())
    }

    #[test]
    fn an_accepted_route_acked_by_every_sidecar_is_programmed_n_of_n() {
        let v = RouteVerdict {
            accepted: Ok(()),
            unresolved: vec![],
        };
        let p = Programmed {
            acked: 37,
            total: 37,
            nack: None,
            ..Default::default()
        };
        let s = route_status(&route(3), Some(&v), &p, &now());
        assert_eq!(s.observed_generation, Some(3));
        for t in [rc::ACCEPTED, rc::RESOLVED_REFS, rc::PROGRAMMED] {
            assert_eq!(cond(&s, t).status, conditions::TRUE, "{t}");
            assert_eq!(cond(&s, t).observed_generation, Some(3));
        }
        assert_eq!(cond(&s, rc::PROGRAMMED).message, "37/37 sidecars ACKed");
    }

    #[test]
    fn pending_acks_a_nack_and_missing_backends_show_in_their_conditions() {
        let v = RouteVerdict {
            accepted: Ok(()),
            unresolved: vec!["ghost:80".into()],
        };
        let pending = route_status(
            &route(1),
            Some(&v),
            &Programmed {
                acked: 2,
                total: 5,
                nack: None,
                ..Default::default()
            },
            &now(),
        );
        assert_eq!(cond(&pending, rc::PROGRAMMED).reason, rc::reasons::PENDING);
        assert_eq!(cond(&pending, rc::PROGRAMMED).message, "2/5 sidecars ACKed");
        assert_eq!(
            cond(&pending, rc::RESOLVED_REFS).reason,
            rc::reasons::BACKEND_NOT_FOUND
        );
        assert!(
            cond(&pending, rc::RESOLVED_REFS)
                .message
                .contains("ghost:80")
        );
        let nack = Programmed {
            acked: 4,
            total: 5,
            nack: Some("invalid config: x".into()),
            ..Default::default()
        };
        let refused = route_status(&route(1), Some(&v), &nack, &now());
        assert_eq!(cond(&refused, rc::PROGRAMMED).status, conditions::FALSE);
        assert!(
            cond(&refused, rc::PROGRAMMED)
                .message
                .contains("invalid config: x")
        );
    }

    #[test]
    fn a_route_is_not_programmed_while_another_replica_has_not_reported_it() {
        let v = RouteVerdict {
            accepted: Ok(()),
            unresolved: vec![],
        };
        let p = Programmed {
            acked: 2,
            total: 2,
            nack: None,
            waiting: vec!["baton-operator-b".into()],
        };
        let s = route_status(&route(1), Some(&v), &p, &now());
        let c = cond(&s, "Programmed");
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "Pending"));
        assert_eq!(
            c.message,
            "2/2 sidecars ACKed; waiting for operator replica baton-operator-b to report"
        );
    }

    #[test]
    fn a_conflicted_route_is_not_accepted_nor_programmed() {
        let v = RouteVerdict {
            accepted: Err(Refusal {
                reason: "Conflicted",
                message: "older Route a".into(),
            }),
            unresolved: vec![],
        };
        let s = route_status(&route(1), Some(&v), &Programmed::default(), &now());
        assert_eq!(cond(&s, rc::ACCEPTED).reason, "Conflicted");
        assert_eq!(cond(&s, rc::ACCEPTED).status, conditions::FALSE);
        assert_eq!(cond(&s, rc::PROGRAMMED).status, conditions::FALSE);
    }

    #[test]
    fn an_unchanged_status_keeps_its_transition_times() {
        let v = RouteVerdict {
            accepted: Ok(()),
            unresolved: vec![],
        };
        let p = Programmed {
            acked: 1,
            total: 1,
            nack: None,
            ..Default::default()
        };
        let mut r = route(1);
        r.status = Some(route_status(&r, Some(&v), &p, &now()));
        let later = Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_100).unwrap());
        assert_eq!(
            r.status.as_ref(),
            Some(&route_status(&r, Some(&v), &p, &later))
        );
    }

    #[test]
    fn a_tls_policy_with_a_secret_source_is_not_accepted() {
        let mut p: TlsPolicy = serde_json::from_value(serde_json::json!({
            "apiVersion": "baton.dev/v1alpha1", "kind": "TlsPolicy",
            "metadata": {"name": "p", "namespace": "shop", "generation": 2},
            "spec": {"podSelector": {}, "mtls": {"mode": "Strict"}}
        }))
        .unwrap();
        let ok = tls_policy_status(
            &p,
            &Programmed {
                acked: 3,
                total: 3,
                nack: None,
                ..Default::default()
            },
            &now(),
        );
        assert!(ok.conditions.iter().all(|c| c.status == conditions::TRUE));
        // An invalid policy (one that got past admission) is refused.
        p.spec.certificate.source = baton_crds::tls_policy::CertificateSourceKind::Secret;
        p.spec.certificate.secret_ref = None;
        let refused = tls_policy_status(&p, &Programmed::default(), &now());
        let accepted = refused
            .conditions
            .iter()
            .find(|c| c.type_ == tc::ACCEPTED)
            .unwrap();
        assert_eq!(accepted.reason, "Invalid");
        assert_eq!(refused.observed_generation, Some(2));
    }

    #[tokio::test]
    async fn the_writer_applies_a_changed_status_once_with_the_operators_field_manager() {
        use crate::mesh::compile::MeshParams;
        use crate::mesh::metrics::PushMetrics;
        use http::{Request, Response};
        use kube::client::Body;

        let hub = Hub::new(
            MeshParams {
                trust_domain: "cluster.local".into(),
                cluster_domain: "cluster.local".into(),
                identity: None,
                default_authorization: Default::default(),
            },
            PushMetrics::default(),
        );
        let svc: k8s_openapi::api::core::v1::Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "server", "namespace": "shop"},
            "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]}
        }))
        .unwrap();
        hub.update(|ix| {
            ix.apply_service(&svc);
            ix.apply_route(&route(4));
        });
        hub.mark_synced();
        hub.recompile();

        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let server = tokio::spawn(async move {
            let (request, send) = handle.next_request().await.expect("a status patch");
            assert_eq!(request.method(), http::Method::PATCH);
            assert_eq!(
                request.uri().path(),
                "/apis/baton.dev/v1alpha1/namespaces/shop/routes/r/status"
            );
            let query = request.uri().query().unwrap_or_default().to_owned();
            assert!(
                query.contains("fieldManager=baton.dev%2Foperator"),
                "{query}"
            );
            assert!(query.contains("force=true"), "{query}");
            let body: serde_json::Value =
                serde_json::from_slice(&request.into_body().collect_bytes().await.unwrap())
                    .unwrap();
            assert_eq!(body["kind"], "Route");
            assert_eq!(body["status"]["observedGeneration"], 4);
            let accepted = body["status"]["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["type"] == "Accepted")
                .unwrap()
                .clone();
            assert_eq!(accepted["status"], "True");
            // No sidecar connected: nothing to wait for.
            let programmed = body["status"]["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["type"] == "Programmed")
                .unwrap()
                .clone();
            assert_eq!(programmed["message"], "0/0 sidecars ACKed");
            let mut echoed = serde_json::to_value(route(4)).unwrap();
            echoed["status"] = body["status"].clone();
            send.send_response(
                Response::builder()
                    .status(200)
                    .body(Body::from(serde_json::to_vec(&echoed).unwrap()))
                    .unwrap(),
            );
            handle
        });
        assert_eq!(write_once(&client, None, &hub, &[], &now()).await, 1);
        let mut handle = server.await.unwrap();

        // Once the Route carries that status, the next pass writes nothing.
        let mut written = route(4);
        written.status = Some(route_status(
            &written,
            hub.attachments().verdicts.get(&ObjKey::new("shop", "r")),
            &Programmed::default(),
            &now(),
        ));
        hub.update(|ix| ix.apply_route(&written));
        assert_eq!(write_once(&client, None, &hub, &[], &now()).await, 0);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), handle.next_request())
                .await
                .is_err(),
            "no request when nothing changed"
        );
    }

    #[tokio::test]
    async fn a_nack_lands_in_programmed_and_in_one_warning_event_on_the_route() {
        use crate::mesh::compile::MeshParams;
        use crate::mesh::metrics::PushMetrics;
        use baton_config::push::{Capabilities, Reply};
        use http::{Request, Response};
        use kube::client::Body;

        let hub = Hub::new(
            MeshParams {
                trust_domain: "cluster.local".into(),
                cluster_domain: "cluster.local".into(),
                identity: None,
                default_authorization: Default::default(),
            },
            PushMetrics::default(),
        );
        let svc: k8s_openapi::api::core::v1::Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "server", "namespace": "shop"},
            "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]}
        }))
        .unwrap();
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "client", "namespace": "shop",
                         "labels": {"baton.dev/injected": "true"}},
            "spec": {"containers": [{"name": "app"}]}
        }))
        .unwrap();
        hub.update(|ix| {
            ix.apply_service(&svc);
            ix.apply_pod(&pod);
            ix.apply_route(&route(2));
        });
        hub.mark_synced();
        let (id, rx) = hub.connect(ObjKey::new("shop", "client"), 0, Capabilities::ALL);
        hub.recompile();
        let nonce = rx.borrow().as_ref().expect("a push").nonce.clone();
        hub.reply(
            id,
            Reply::Nack {
                nonce,
                error: "invalid config: routes[0]: bad".into(),
            },
        );

        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "baton-operator".into(),
                instance: None,
            },
        );
        let server = tokio::spawn(async move {
            let (request, send) = handle.next_request().await.expect("a status patch");
            assert!(request.uri().path().ends_with("/routes/r/status"));
            let body: serde_json::Value =
                serde_json::from_slice(&request.into_body().collect_bytes().await.unwrap())
                    .unwrap();
            let programmed = body["status"]["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["type"] == "Programmed")
                .unwrap()
                .clone();
            assert_eq!(programmed["reason"], REFUSED);
            assert!(
                programmed["message"]
                    .as_str()
                    .unwrap()
                    .contains("routes[0]: bad")
            );
            let mut echoed = serde_json::to_value(route(2)).unwrap();
            echoed["status"] = body["status"].clone();
            send.send_response(
                Response::builder()
                    .status(200)
                    .body(Body::from(serde_json::to_vec(&echoed).unwrap()))
                    .unwrap(),
            );
            let (request, send) = handle.next_request().await.expect("an event");
            assert_eq!(request.method(), http::Method::POST);
            assert!(
                request.uri().path().ends_with("/namespaces/shop/events"),
                "{}",
                request.uri()
            );
            let event: serde_json::Value =
                serde_json::from_slice(&request.into_body().collect_bytes().await.unwrap())
                    .unwrap();
            assert_eq!(event["type"], "Warning");
            assert_eq!(event["reason"], "ConfigRefused");
            assert_eq!(event["regarding"]["kind"], "Route");
            assert!(event["note"].as_str().unwrap().contains("routes[0]: bad"));
            send.send_response(
                Response::builder()
                    .status(201)
                    .body(Body::from(serde_json::to_vec(&event).unwrap()))
                    .unwrap(),
            );
        });
        assert_eq!(
            write_once(&client, Some(&recorder), &hub, &[], &now()).await,
            1
        );
        server.await.unwrap();
    }
}
