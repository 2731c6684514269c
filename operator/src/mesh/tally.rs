//! Programmed across replicas: every replica serves sidecar streams, only
//! the leader writes status, so each replica publishes how many of *its*
//! sidecars serve each Route and TlsPolicy, and the leader adds them up.
//!
//! A replica's [`Tally`] goes into ConfigMap `baton-push-tally-<pod>` in the
//! operator's namespace (label [`LABEL`], owned by the replica's Pod so the
//! garbage collector removes it with the Pod), rewritten when it changes and
//! at least every [`HEARTBEAT`]. The leader lists them on every status pass
//! and ignores its own (it reads its hub directly) and any older than
//! [`MAX_AGE`] — a replica that died without its Pod being deleted, whose
//! sidecars are reconnecting to the survivors anyway.
//!
//! Why the API server and not replica-to-replica calls: the replicas share
//! nothing else, the leader already talks to the API server every second,
//! and a tally is a few bytes per object, written when ACKs change (not per
//! ACK). A tally lists every object the replica's index holds, so a peer
//! that has not yet seen (or not yet reported) the generation the leader
//! sees keeps the object Pending ("waiting for operator replica …"):
//! Programmed turns True only once every live replica reported that
//! generation and all their sidecars ACKed it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{ListParams, ObjectMeta, Patch, PatchParams};
use kube::{Api, Client};
use serde::{Deserialize, Serialize};

use super::hub::{Hub, Programmed, Source};

/// The label on every tally ConfigMap (`key=value`).
pub const LABEL: &str = "baton.dev/push-tally=true";
/// The ConfigMap key holding the tally's JSON.
const DATA_KEY: &str = "tally.json";
/// A replica rewrites its tally at least this often, changed or not.
pub const HEARTBEAT: Duration = Duration::from_secs(15);
/// The leader ignores tallies older than this (three missed heartbeats).
pub const MAX_AGE: Duration = Duration::from_secs(45);
/// The field manager of the tally ConfigMaps.
const MANAGER: &str = "baton-operator";

/// One replica's count, per object, of the sidecars it serves.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tally {
    /// The replica (its Pod's name).
    pub replica: String,
    /// When it was computed, in Unix seconds.
    pub at: i64,
    /// By [`key`]: `Route/<ns>/<name>`, `TlsPolicy/<ns>/<name>` or
    /// `AuthorizationPolicy/<ns>/<name>`.
    pub objects: BTreeMap<String, Entry>,
    /// The sidecars reporting the certificate they hold, against the trust
    /// generation this replica pushes (root rotation,
    /// [`crate::identity::rotation`]); absent before it has one, and in
    /// tallies of replicas from before re-issue triggers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trust: Option<crate::identity::rotation::Count>,
}

/// How many of one replica's sidecars serve one object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The object's generation as this replica's index holds it.
    pub generation: i64,
    pub acked: usize,
    pub total: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nack: Option<String>,
}

/// The tally key of an object, and the generation `source` names.
fn key(source: &Source) -> (String, i64) {
    match source {
        Source::Route(k, g) => (format!("Route/{k}"), *g),
        Source::TlsPolicy(k, g) => (format!("TlsPolicy/{k}"), *g),
        Source::AuthorizationPolicy(k, g) => (format!("AuthorizationPolicy/{k}"), *g),
    }
}

/// This replica's tally: every object in its index, at the generation it
/// holds, with its sidecars' counts (zero when none serves it) — so the
/// leader can tell "no sidecar here" from "not seen here yet".
pub fn of_hub(hub: &Hub, replica: &str, at: i64) -> Tally {
    // As of the last compile: an object in the index that no stream could
    // have been sent yet must not be reported at its new generation with
    // nothing to count (the leader would add it up to "0/0 ACKed").
    let sources: Vec<Source> = hub.compiled_sources().iter().cloned().collect();
    let objects = hub
        .programmed_all(&sources)
        .into_iter()
        .zip(&sources)
        .map(|(p, source)| {
            let (key, generation) = key(source);
            (
                key,
                Entry {
                    generation,
                    acked: p.acked,
                    total: p.total,
                    nack: p.nack,
                },
            )
        })
        .collect();
    Tally {
        replica: replica.to_owned(),
        at,
        objects,
        trust: hub.trust_count(),
    }
}

/// This replica's count of `source` plus every peer's. A peer whose tally
/// does not hold `source`'s generation (it has not seen it, or not
/// published since) is `waiting`: its sidecars cannot be counted yet.
pub fn merged(mut own: Programmed, source: &Source, peers: &[Tally]) -> Programmed {
    let (key, generation) = key(source);
    for peer in peers {
        match peer.objects.get(&key) {
            Some(entry) if entry.generation == generation => {
                own.total += entry.total;
                own.acked += entry.acked;
                if own.nack.is_none() {
                    own.nack.clone_from(&entry.nack);
                }
            }
            _ => own.waiting.push(peer.replica.clone()),
        }
    }
    own
}

/// The ConfigMap name of `replica`'s tally.
pub fn configmap_name(replica: &str) -> String {
    format!("baton-push-tally-{replica}")
}

/// The ConfigMap carrying `tally`, owned by the replica's Pod when its uid
/// is known.
pub fn configmap(tally: &Tally, namespace: &str, pod_uid: Option<&str>) -> ConfigMap {
    let (label, value) = LABEL.split_once('=').expect("LABEL is key=value");
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(configmap_name(&tally.replica)),
            namespace: Some(namespace.to_owned()),
            labels: Some([(label.to_owned(), value.to_owned())].into()),
            owner_references: pod_uid.map(|uid| {
                vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Pod".into(),
                    name: tally.replica.clone(),
                    uid: uid.to_owned(),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        },
        data: Some(
            [(
                DATA_KEY.to_owned(),
                serde_json::to_string(tally).expect("a tally serializes"),
            )]
            .into(),
        ),
        ..Default::default()
    }
}

/// The peers' tallies among `configmaps`: not `own`'s, not older than
/// [`MAX_AGE`] at `now` (Unix seconds), parseable.
pub fn peers(configmaps: &[ConfigMap], own: &str, now: i64) -> Vec<Tally> {
    configmaps
        .iter()
        .filter_map(|cm| {
            let json = cm.data.as_ref()?.get(DATA_KEY)?;
            match serde_json::from_str::<Tally>(json) {
                Ok(t) => Some(t),
                Err(error) => {
                    tracing::warn!(%error, configmap = ?cm.metadata.name, "unreadable push tally ignored");
                    None
                }
            }
        })
        .filter(|t| t.replica != own && now - t.at <= MAX_AGE.as_secs() as i64)
        .collect()
}

/// Unix seconds now.
pub fn unix_now() -> i64 {
    k8s_openapi::jiff::Timestamp::now().as_second()
}

/// Reads the peers' tallies (leader, each status pass). A failed list is
/// logged and counts no peer: Programmed then shows this replica's share.
pub async fn read_peers(client: &Client, namespace: &str, own: &str) -> Vec<Tally> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    match api.list(&ListParams::default().labels(LABEL)).await {
        Ok(list) => peers(&list.items, own, unix_now()),
        Err(error) => {
            tracing::warn!(%error, "push tallies of the other replicas not read");
            Vec::new()
        }
    }
}

/// Publishes this replica's tally every `period` when it changed, and every
/// [`HEARTBEAT`] regardless, until dropped (every replica).
pub async fn publish(
    client: Client,
    hub: Arc<Hub>,
    namespace: String,
    replica: String,
    pod_uid: Option<String>,
    period: Duration,
) {
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let params = PatchParams::apply(MANAGER).force();
    let mut last: Option<Tally> = None;
    let mut tick = tokio::time::interval(period);
    loop {
        tick.tick().await;
        if !hub.is_synced() {
            continue;
        }
        let tally = of_hub(&hub, &replica, unix_now());
        let due = match &last {
            None => true,
            Some(l) => {
                l.objects != tally.objects
                    || l.trust != tally.trust
                    || tally.at - l.at >= HEARTBEAT.as_secs() as i64
            }
        };
        if !due {
            continue;
        }
        let cm = configmap(&tally, &namespace, pod_uid.as_deref());
        match api
            .patch(&configmap_name(&replica), &params, &Patch::Apply(&cm))
            .await
        {
            Ok(_) => last = Some(tally),
            Err(error) => tracing::warn!(%error, "push tally not published; retrying"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::index::ObjKey;

    fn source(generation: i64) -> Source {
        Source::Route(ObjKey::new("shop", "split"), generation)
    }

    fn tally(replica: &str, at: i64, generation: i64, acked: usize, total: usize) -> Tally {
        Tally {
            replica: replica.into(),
            at,
            objects: [(
                "Route/shop/split".to_owned(),
                Entry {
                    generation,
                    acked,
                    total,
                    nack: None,
                },
            )]
            .into(),
            trust: None,
        }
    }

    fn own(acked: usize, total: usize) -> Programmed {
        Programmed {
            acked,
            total,
            ..Default::default()
        }
    }

    #[test]
    fn peers_at_the_same_generation_add_their_sidecars_and_acks() {
        let p = merged(own(2, 3), &source(4), &[tally("b", 0, 4, 5, 5)]);
        assert_eq!((p.acked, p.total), (7, 8));
    }

    #[test]
    fn a_peer_that_has_not_reported_the_generation_keeps_the_object_waiting() {
        for peer_generation in [3, 5] {
            let p = merged(
                own(3, 3),
                &source(4),
                &[tally("b", 0, peer_generation, 5, 5)],
            );
            assert_eq!(
                (p.acked, p.total, p.waiting),
                (3, 3, vec!["b".to_owned()]),
                "peer at {peer_generation}"
            );
        }
        // A peer that has not published since the object appeared.
        let mut silent = tally("c", 0, 4, 0, 0);
        silent.objects.clear();
        let p = merged(own(1, 1), &source(4), &[silent, tally("b", 0, 4, 0, 0)]);
        assert_eq!((p.acked, p.total, p.waiting), (1, 1, vec!["c".to_owned()]));
    }

    #[test]
    fn a_peer_nack_lands_when_this_replica_has_none_and_other_objects_do_not_count() {
        let mut t = tally("b", 0, 4, 1, 2);
        t.objects.get_mut("Route/shop/split").unwrap().nack = Some("bad".into());
        t.objects.insert(
            "TlsPolicy/shop/split".into(),
            Entry {
                generation: 4,
                acked: 9,
                total: 9,
                nack: None,
            },
        );
        let p = merged(own(0, 0), &source(4), &[t.clone()]);
        assert_eq!(
            p,
            Programmed {
                acked: 1,
                total: 2,
                nack: Some("bad".into()),
                waiting: vec![],
            }
        );
        let mut mine = own(0, 1);
        mine.nack = Some("mine".into());
        assert_eq!(merged(mine, &source(4), &[t]).nack.as_deref(), Some("mine"));
    }

    #[test]
    fn peers_skip_this_replica_stale_and_unreadable_tallies() {
        let ns = "baton-system";
        let fresh = configmap(&tally("b", 100, 1, 1, 1), ns, Some("uid-b"));
        let stale = configmap(&tally("c", 100 - 46, 1, 1, 1), ns, None);
        let mine = configmap(&tally("a", 100, 1, 1, 1), ns, None);
        let mut broken = configmap(&tally("d", 100, 1, 1, 1), ns, None);
        broken
            .data
            .as_mut()
            .unwrap()
            .insert(DATA_KEY.into(), "{".into());
        let got = peers(&[fresh, stale, mine, broken], "a", 100);
        assert_eq!(got, vec![tally("b", 100, 1, 1, 1)]);
    }

    #[test]
    fn the_configmap_is_labelled_and_owned_by_the_replicas_pod() {
        let cm = configmap(&tally("op-1", 7, 1, 1, 1), "baton-system", Some("u1"));
        assert_eq!(cm.metadata.name.as_deref(), Some("baton-push-tally-op-1"));
        assert_eq!(
            cm.metadata
                .labels
                .unwrap()
                .get("baton.dev/push-tally")
                .map(String::as_str),
            Some("true")
        );
        let owner = &cm.metadata.owner_references.unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("Pod", "op-1", "u1")
        );
        let back: Tally = serde_json::from_str(&cm.data.unwrap()[DATA_KEY]).unwrap();
        assert_eq!(back, tally("op-1", 7, 1, 1, 1));
    }
}
