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
