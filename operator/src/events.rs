//! Events for `kubectl describe`: one Recorder per controller, reporting as
//! `baton-operator` with this replica's identity.

use kube::Client;
use kube::runtime::events::{Recorder, Reporter};

/// The operator's Event recorder (`instance`: this replica, the Lease
/// identity).
pub fn recorder(client: Client, instance: Option<String>) -> Recorder {
    Recorder::new(
        client,
        Reporter {
            controller: "baton-operator".into(),
            instance,
        },
    )
}

/// Publishes `event` about `reference`. An Event about a cluster-scoped
/// object (a SidecarRelease) goes to `default` with an empty reference
/// namespace, which API servers before 1.22 refuse for events.k8s.io/v1
/// ("involvedObject.namespace ... does not match event.namespace"): then it
/// is published once more with the reference in `default`, so the Event
/// exists (`kubectl get events -n default`) on every supported server.
pub async fn publish(
    recorder: &Recorder,
    event: &kube::runtime::events::Event,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
) -> Result<(), kube::Error> {
    match recorder.publish(event, reference).await {
        Err(kube::Error::Api(status))
            if status.code == 422
                && reference.namespace.is_none()
                && status.message.contains("does not match event.namespace") =>
        {
            let mut in_default = reference.clone();
            in_default.namespace = Some("default".into());
            recorder.publish(event, &in_default).await
        }
        other => other,
    }
}
