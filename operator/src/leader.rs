//! Leader election on a `coordination.k8s.io/v1` Lease.
//!
//! The operator runs two replicas for availability, but only one may write
//! status at a time. Each candidate reads the Lease and, through
//! [`decide`] (pure), acquires it when it is free or expired, renews it when it
//! holds it, and waits otherwise. Writes are `replace` calls carrying the
//! Lease's `resourceVersion`, so two candidates racing for an expired Lease
//! cannot both win: the loser gets a 409 and reads again.
//!
//! A leader that shuts down (SIGTERM: a rollout, a drain, a deleted Pod)
//! stops its controllers and then releases the Lease ([`released_spec`]:
//! no holder, as client-go's `ReleaseOnCancel` does), so the standby takes
//! over at its next round instead of waiting out the lease duration.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::api::{ObjectMeta, PostParams};

use crate::metrics::Metrics;

/// What a candidate should do with the Lease it just read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The Lease is free or its holder stopped renewing: take it.
    Acquire,
    /// We hold it: renew it.
    Renew,
    /// Someone else holds a live Lease.
    Held { holder: String },
}

/// Decides from the Lease's current spec. Pure, so every branch is tested.
pub fn decide(spec: Option<&LeaseSpec>, me: &str, now: Timestamp) -> Decision {
    let Some(spec) = spec else {
        return Decision::Acquire;
    };
    let holder = match spec.holder_identity.as_deref() {
        None | Some("") => return Decision::Acquire,
        Some(holder) => holder,
    };
    if holder == me {
        return Decision::Renew;
    }
    let duration = SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(15)));
    let last = spec
        .renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .map(|t| t.0);
    match last {
        Some(last) if now.duration_since(last) < duration => Decision::Held {
            holder: holder.to_owned(),
        },
        _ => Decision::Acquire,
    }
}

/// The spec a candidate writes when it acquires or renews.
pub fn next_spec(
    current: Option<&LeaseSpec>,
    me: &str,
    duration: Duration,
    now: Timestamp,
) -> LeaseSpec {
    let current = current.cloned().unwrap_or_default();
    let renewing = current.holder_identity.as_deref() == Some(me);
    LeaseSpec {
        holder_identity: Some(me.to_owned()),
        lease_duration_seconds: Some(i32::try_from(duration.as_secs()).unwrap_or(i32::MAX)),
        acquire_time: if renewing {
            current.acquire_time.clone()
        } else {
            Some(MicroTime(now))
        },
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(
            current.lease_transitions.unwrap_or(0)
                + i32::from(!renewing && current.holder_identity.is_some()),
        ),
        ..Default::default()
    }
}

/// The spec a leader writes when it steps down: no holder, so any
/// candidate's next round acquires it ([`decide`] treats an empty holder as
/// free). Transitions are left as they are: the next holder counts its own.
pub fn released_spec(current: &LeaseSpec, now: Timestamp) -> LeaseSpec {
    LeaseSpec {
        holder_identity: None,
        lease_duration_seconds: Some(1),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        lease_transitions: current.lease_transitions,
        ..Default::default()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading or writing Lease {name}: {source}")]
    Api {
        name: String,
        #[source]
        source: kube::Error,
    },
}

/// A candidate for one Lease.
pub struct LeaderElector {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
}

impl LeaderElector {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        name: &str,
        identity: &str,
        duration: Duration,
    ) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_owned(),
            identity: identity.to_owned(),
            duration,
        }
    }

    /// One read-decide-write round. `Ok(true)` when we hold the Lease after it.
    pub async fn try_once(&self) -> Result<bool, Error> {
        let api_err = |source| Error::Api {
            name: self.name.clone(),
            source,
        };
        let now = Timestamp::now();
        let Some(mut lease) = self.api.get_opt(&self.name).await.map_err(api_err)? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..Default::default()
                },
                spec: Some(next_spec(None, &self.identity, self.duration, now)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(api_err(e)),
            };
        };
        match decide(lease.spec.as_ref(), &self.identity, now) {
            Decision::Held { .. } => Ok(false),
            Decision::Acquire | Decision::Renew => {
                lease.spec = Some(next_spec(
                    lease.spec.as_ref(),
                    &self.identity,
                    self.duration,
                    now,
                ));
                match self
                    .api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await
                {
                    Ok(_) => Ok(true),
                    // Someone else wrote first: we read again next round.
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                    Err(e) => Err(api_err(e)),
                }
            }
        }
    }

    /// Gives the Lease up if this candidate holds it (a conflicting write
    /// is retried from a fresh read). `Ok(true)` when it was released.
    pub async fn release(&self) -> Result<bool, Error> {
        let api_err = |source| Error::Api {
            name: self.name.clone(),
            source,
        };
        for _attempt in 0..3 {
            let Some(mut lease) = self.api.get_opt(&self.name).await.map_err(api_err)? else {
                return Ok(false);
            };
            let current = lease.spec.clone().unwrap_or_default();
            if current.holder_identity.as_deref() != Some(self.identity.as_str()) {
                return Ok(false);
            }
            lease.spec = Some(released_spec(&current, Timestamp::now()));
            match self
                .api
                .replace(&self.name, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => return Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(api_err(e)),
            }
        }
        Ok(false)
    }

    /// Waits until this candidate leads, then keeps renewing in the
    /// background. [`Leadership::lost`] completes (with the reason) when
    /// leadership is lost: the caller must stop writing at once.
    pub async fn acquire(self, metrics: Arc<Metrics>) -> Result<Leadership, Error> {
        let this = Arc::new(self);
        let retry = this.duration / 3;
        loop {
            match this.try_once().await {
                Ok(true) => break,
                Ok(false) => {}
                Err(error) => tracing::warn!(%error, "leader election round failed"),
            }
            tokio::time::sleep(retry).await;
        }
        metrics.set_leader(true);
        let elector = this.clone();
        let renew_metrics = metrics.clone();
        let renew = tokio::spawn(async move {
            let this = elector;
            let metrics = renew_metrics;
            let mut last_renewed = tokio::time::Instant::now();
            loop {
                tokio::time::sleep(retry).await;
                match this.try_once().await {
                    Ok(true) => last_renewed = tokio::time::Instant::now(),
                    Ok(false) => {
                        metrics.set_leader(false);
                        return "another replica took the Lease".to_owned();
                    }
                    Err(error) => tracing::warn!(%error, "renewing the Lease failed"),
                }
                // Stop before the Lease can expire under us: past this point
                // another replica may legitimately take over.
                if last_renewed.elapsed() >= this.duration.saturating_sub(retry) {
                    metrics.set_leader(false);
                    return "could not renew the Lease in time".to_owned();
                }
            }
        });
        Ok(Leadership {
            elector: this,
            renew,
            metrics,
        })
    }
}

/// Held leadership: renewed in the background until lost or released.
pub struct Leadership {
    elector: Arc<LeaderElector>,
    renew: tokio::task::JoinHandle<String>,
    metrics: Arc<Metrics>,
}

impl Leadership {
    /// Completes with the reason once leadership is lost.
    pub async fn lost(&mut self) -> String {
        match (&mut self.renew).await {
            Ok(reason) => reason,
            Err(e) => format!("the renewing task ended: {e}"),
        }
    }

    /// Stops renewing and gives the Lease up, so a standby takes over at
    /// once. Call after the controllers stopped writing.
    pub async fn release(self) -> Result<bool, Error> {
        self.renew.abort();
        self.metrics.set_leader(false);
        self.elector.release().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn held_by(holder: &str, renewed: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(at(renewed))),
            ..Default::default()
        }
    }

    #[test]
    fn a_missing_or_unheld_lease_is_acquired() {
        assert_eq!(decide(None, "me", at(0)), Decision::Acquire);
        assert_eq!(
            decide(Some(&LeaseSpec::default()), "me", at(0)),
            Decision::Acquire
        );
        let empty = LeaseSpec {
            holder_identity: Some(String::new()),
            ..Default::default()
        };
        assert_eq!(decide(Some(&empty), "me", at(0)), Decision::Acquire);
    }

    #[test]
    fn our_own_lease_is_renewed_even_when_expired() {
        assert_eq!(
            decide(Some(&held_by("me", 0)), "me", at(100)),
            Decision::Renew
        );
    }

    #[test]
    fn a_live_lease_of_another_holder_is_respected() {
        assert_eq!(
            decide(Some(&held_by("other", 0)), "me", at(14)),
            Decision::Held {
                holder: "other".into()
            }
        );
    }

    #[test]
    fn an_expired_lease_of_another_holder_is_taken_over() {
        assert_eq!(
            decide(Some(&held_by("other", 0)), "me", at(15)),
            Decision::Acquire
        );
    }

    #[test]
    fn a_lease_without_times_is_taken_over() {
        let spec = LeaseSpec {
            holder_identity: Some("other".into()),
            ..Default::default()
        };
        assert_eq!(decide(Some(&spec), "me", at(0)), Decision::Acquire);
    }

    #[test]
    fn taking_over_counts_a_transition_and_renewing_keeps_acquire_time() {
        let taken = next_spec(
            Some(&held_by("other", 0)),
            "me",
            Duration::from_secs(15),
            at(20),
        );
        assert_eq!(taken.holder_identity.as_deref(), Some("me"));
        assert_eq!(taken.lease_transitions, Some(1));
        assert_eq!(taken.acquire_time, Some(MicroTime(at(20))));
        let renewed = next_spec(Some(&taken), "me", Duration::from_secs(15), at(25));
        assert_eq!(renewed.lease_transitions, Some(1));
        assert_eq!(renewed.acquire_time, Some(MicroTime(at(20))));
        assert_eq!(renewed.renew_time, Some(MicroTime(at(25))));
    }

    #[test]
    fn a_released_lease_has_no_holder_and_is_free_for_the_next_candidate_at_once() {
        let held = next_spec(
            Some(&held_by("other", 0)),
            "me",
            Duration::from_secs(15),
            at(20),
        );
        let released = released_spec(&held, at(21));
        assert_eq!(released.holder_identity, None);
        assert_eq!(released.lease_transitions, held.lease_transitions);
        // Well inside what would have been our lease duration.
        assert_eq!(
            decide(Some(&released), "standby", at(22)),
            Decision::Acquire
        );
        // The standby taking it over counts no transition from "nobody".
        let taken = next_spec(Some(&released), "standby", Duration::from_secs(15), at(22));
        assert_eq!(taken.lease_transitions, held.lease_transitions);
    }

    #[test]
    fn the_first_holder_starts_at_zero_transitions() {
        let first = next_spec(None, "me", Duration::from_secs(15), at(0));
        assert_eq!(first.lease_transitions, Some(0));
        assert_eq!(first.lease_duration_seconds, Some(15));
    }

    #[tokio::test]
    async fn releasing_writes_an_empty_holder_only_when_we_hold_the_lease() {
        use http::{Request, Response};
        use kube::client::Body;
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "baton-system");
        let path = "/apis/coordination.k8s.io/v1/namespaces/baton-system/leases/baton-operator";
        let lease = |holder: &str| {
            serde_json::json!({
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": "baton-operator", "namespace": "baton-system", "resourceVersion": "9"},
                "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "leaseTransitions": 3,
                         "renewTime": "2026-01-01T00:00:00.000000Z"},
            })
        };
        let respond = |send: tower_test::mock::SendResponse<Response<Body>>,
                       body: &serde_json::Value| {
            send.send_response(
                Response::builder()
                    .status(200)
                    .body(Body::from(serde_json::to_vec(body).unwrap()))
                    .unwrap(),
            );
        };
        let server = tokio::spawn(async move {
            // Ours: released with a replace carrying the resourceVersion read.
            let (request, send) = handle.next_request().await.unwrap();
            assert_eq!(
                (request.method().as_str(), request.uri().path()),
                ("GET", path)
            );
            respond(send, &lease("me"));
            let (request, send) = handle.next_request().await.unwrap();
            assert_eq!(
                (request.method().as_str(), request.uri().path()),
                ("PUT", path)
            );
            let body: serde_json::Value =
                serde_json::from_slice(&request.into_body().collect_bytes().await.unwrap())
                    .unwrap();
            assert_eq!(body["metadata"]["resourceVersion"], "9");
            assert!(
                body["spec"]
                    .get("holderIdentity")
                    .is_none_or(serde_json::Value::is_null),
                "{body}"
            );
            assert_eq!(body["spec"]["leaseTransitions"], 3);
            respond(send, &body);
            // Someone else's: only read, never written.
            let (request, send) = handle.next_request().await.unwrap();
            assert_eq!(request.method().as_str(), "GET");
            respond(send, &lease("other"));
        });
        let elector = LeaderElector::new(
            client,
            "baton-system",
            "baton-operator",
            "me",
            Duration::from_secs(15),
        );
        assert!(elector.release().await.unwrap());
        assert!(!elector.release().await.unwrap());
        server.await.unwrap();
    }
}
