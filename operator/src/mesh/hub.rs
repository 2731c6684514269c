//! The push hub: the index, the connected sidecar streams, and the loop that
//! turns index changes into pushes.
//!
//! Watchers write into the index through [`Hub::update`]; every write marks
//! the hub dirty. The debouncer waits [`Hub::DEBOUNCE`] after the first
//! write (so a burst of changes — a Deployment scaling, a Route and its
//! Services applied together — becomes one push), then recompiles every
//! connected sidecar and sends a new version only to those whose snapshot
//! changed. Nothing is pushed before every watcher has listed its kind once
//! (resync complete), so an operator restart or failover never sends a
//! partial config. Each stream holds only the latest push (a `watch`
//! channel): a slow sidecar gets the newest config, never a backlog.
//!
//! A push is a delta ([`baton_config::push::Delta`]: the sections that
//! changed) when the stream declared the `delta` capability
//! ([`Capabilities`]), the sidecar has ACKed the last push and nothing is
//! pending; otherwise — a sidecar from before deltas, — first push of a stream, a push still unanswered, a
//! NACK — it is the full snapshot. A NACKed delta is followed at once by the
//! full snapshot (the sidecar's base may not be what the hub thinks).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_config::Snapshot;
use baton_config::push::{Capabilities, ConfigKind, Delta, Reply, SharedPush};
use baton_config::tls::Reissue;
use bytes::Bytes;
use tokio::sync::{Notify, watch};

use super::compile::{Attachments, MeshParams, attach_routes, compile, compile_key};
use super::index::{Index, ObjKey};
use super::metrics::PushMetrics;

/// Identifies one connected stream.
pub type StreamId = u64;

/// An object that went into a snapshot, at its generation: what status
/// counts as programmed once the snapshot is ACKed.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Source {
    Route(ObjKey, i64),
    TlsPolicy(ObjKey, i64),
    AuthorizationPolicy(ObjKey, i64),
}

/// What a Source names, whatever its generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Route,
    TlsPolicy,
    AuthorizationPolicy,
}

impl Source {
    /// Every one of `routes`, `policies` and `authorization` at its
    /// generation: Routes first, in order, then the TlsPolicies, then the
    /// AuthorizationPolicies.
    pub fn all_of<'a>(
        routes: impl IntoIterator<Item = &'a Arc<baton_crds::Route>>,
        policies: impl IntoIterator<Item = &'a Arc<baton_crds::TlsPolicy>>,
        authorization: impl IntoIterator<Item = &'a Arc<baton_crds::AuthorizationPolicy>>,
    ) -> Vec<Source> {
        let generation = |g: Option<i64>| g.unwrap_or(0);
        routes
            .into_iter()
            .map(|r| Source::Route(ObjKey::of(r.as_ref()), generation(r.metadata.generation)))
            .chain(policies.into_iter().map(|p| {
                Source::TlsPolicy(ObjKey::of(p.as_ref()), generation(p.metadata.generation))
            }))
            .chain(authorization.into_iter().map(|p| {
                Source::AuthorizationPolicy(
                    ObjKey::of(p.as_ref()),
                    generation(p.metadata.generation),
                )
            }))
            .collect()
    }

    /// The object, whatever its generation.
    fn object(&self) -> (Kind, &ObjKey) {
        match self {
            Source::Route(k, _) => (Kind::Route, k),
            Source::TlsPolicy(k, _) => (Kind::TlsPolicy, k),
            Source::AuthorizationPolicy(k, _) => (Kind::AuthorizationPolicy, k),
        }
    }
}

/// How many sidecars serve an object's current generation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Programmed {
    /// Sidecars whose last ACKed snapshot holds this generation.
    pub acked: usize,
    /// Sidecars the object is programmed into (its last push holds it).
    pub total: usize,
    /// A NACK of a snapshot holding this generation, if any.
    pub nack: Option<String>,
    /// Other operator replicas whose tally does not show this generation
    /// yet ([`super::tally`]): their sidecars are not counted, so the
    /// object is not Programmed until they report.
    pub waiting: Vec<String>,
}

/// One compiled snapshot, shared by every stream it was compiled for:
/// sidecars of one namespace, ServiceAccount and TlsPolicy get the same
/// config ([`compile_key`]), so a change costs one compile and one
/// serialization per such group, not per sidecar.
#[derive(Debug, PartialEq)]
struct Compiled {
    snapshot: Snapshot,
    json: Bytes,
    /// Shared by the group's streams, which hold it as what they were sent
    /// and ACKed: a snapshot can name hundreds of Routes, and a copy per
    /// stream was most of a connected sidecar's cost to the operator.
    sources: Arc<BTreeSet<Source>>,
}

/// What the hub knows of one stream.
#[derive(Debug)]
struct Stream {
    pod: ObjKey,
    /// What the client declared it understands: without `delta`, every
    /// push is a full snapshot.
    caps: Capabilities,
    tx: watch::Sender<Option<Arc<SharedPush>>>,
    /// The last snapshot sent, to tell whether a change affects this
    /// sidecar.
    sent: Option<Arc<Compiled>>,
    /// What went into the last push, and into the last ACKed one.
    sent_sources: Arc<BTreeSet<Source>>,
    acked_sources: Arc<BTreeSet<Source>>,
    version: u64,
    /// Push awaiting its reply: nonce, when it was sent, whether it was a
    /// delta.
    pending: Option<(String, Instant, ConfigKind)>,
    acked: Option<u64>,
    /// The last NACK's error, cleared by the next ACK.
    nack: Option<String>,
    /// The trust generation of the certificate the sidecar reported
    /// holding ([`Reply::Certificate`]; capability `reissue` only).
    held: Option<String>,
}

#[derive(Debug, Default)]
struct Inner {
    index: Index,
    attachments: Arc<Attachments>,
    /// Every Route and TlsPolicy at the generation the last recompile saw:
    /// what status may count (a newer generation has reached no stream).
    compiled_sources: Arc<BTreeSet<Source>>,
    streams: HashMap<StreamId, Stream>,
    next_id: StreamId,
    /// The re-issue trigger pushed to every `reissue`-capable stream with
    /// a TLS section: the CA's current trust generation and the spread.
    reissue: Option<Reissue>,
}

/// The objects status is written for, as the index holds them.
#[derive(Debug, Clone, Default)]
pub struct Objects {
    pub routes: Vec<Arc<baton_crds::Route>>,
    pub tls_policies: Vec<Arc<baton_crds::TlsPolicy>>,
    pub authorization_policies: Vec<Arc<baton_crds::AuthorizationPolicy>>,
}

impl Objects {
    /// Every object at its generation, in [`Source::all_of`]'s order.
    pub fn sources(&self) -> Vec<Source> {
        Source::all_of(
            &self.routes,
            &self.tls_policies,
            &self.authorization_policies,
        )
    }
}

/// State of one sidecar's config, as status reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidecarState {
    pub pod: ObjKey,
    pub version: u64,
    pub acked: Option<u64>,
    pub nack: Option<String>,
}

#[derive(Debug)]
pub struct Hub {
    inner: Mutex<Inner>,
    params: MeshParams,
    dirty: Notify,
    synced: watch::Sender<bool>,
    metrics: PushMetrics,
}

impl Hub {
    /// Coalescing window after the first change of a burst.
    pub const DEBOUNCE: Duration = Duration::from_millis(100);

    pub fn new(params: MeshParams, metrics: PushMetrics) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            params,
            dirty: Notify::new(),
            synced: watch::channel(false).0,
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Change the index (a watcher event) and schedule a recompile.
    pub fn update(&self, f: impl FnOnce(&mut Index)) {
        f(&mut self.lock().index);
        self.dirty.notify_one();
    }

    /// Every watcher has listed its kind once: pushes may start.
    pub fn mark_synced(&self) {
        self.synced.send_replace(true);
        self.dirty.notify_one();
    }

    pub fn metrics(&self) -> &PushMetrics {
        &self.metrics
    }

    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// A sidecar connected for `pod`, serving `version` (a process that
    /// took over through a handoff resumes at the inherited one), its client
    /// understanding `caps`. Its first push comes with the next recompile,
    /// which this schedules, and is the full snapshot at `version + 1`
    /// whatever it serves: the hub does not know which config that version
    /// stood for (another replica, or this one before a restart, sent it),
    /// so there is no base a delta could safely name.
    pub fn connect(
        &self,
        pod: ObjKey,
        version: u64,
        caps: Capabilities,
    ) -> (StreamId, watch::Receiver<Option<Arc<SharedPush>>>) {
        let (tx, rx) = watch::channel(None);
        let id = {
            let mut inner = self.lock();
            let id = inner.next_id;
            inner.next_id += 1;
            inner.streams.insert(
                id,
                Stream {
                    pod,
                    caps,
                    tx,
                    sent: None,
                    sent_sources: Arc::default(),
                    acked_sources: Arc::default(),
                    version,
                    pending: None,
                    acked: (version > 0).then_some(version),
                    nack: None,
                    held: None,
                },
            );
            self.metrics.connected.set(inner.streams.len() as i64);
            id
        };
        self.dirty.notify_one();
        (id, rx)
    }

    pub fn disconnect(&self, id: StreamId) {
        let mut inner = self.lock();
        inner.streams.remove(&id);
        self.metrics.connected.set(inner.streams.len() as i64);
    }

    /// A sidecar answered. Replies naming another nonce than the pending
    /// push (a stale reply) are counted and ignored.
    pub fn reply(&self, id: StreamId, reply: Reply) {
        let mut inner = self.lock();
        let Some(s) = inner.streams.get_mut(&id) else {
            return;
        };
        let nonce = match reply {
            Reply::Ack { ref nonce, .. } | Reply::Nack { ref nonce, .. } => nonce,
            // Not an answer to a push: no nonce, nothing pending changes.
            Reply::Certificate { generation } => {
                s.held = Some(generation);
                return;
            }
        };
        let Some((pending, sent_at, kind)) = s.pending.take_if(|(n, _, _)| n == nonce) else {
            self.metrics
                .replies
                .get_or_create(&reply_labels("stale"))
                .inc();
            return;
        };
        debug_assert_eq!(&pending, nonce);
        match reply {
            Reply::Ack { version, .. } => {
                self.metrics
                    .push_to_ack
                    .observe(sent_at.elapsed().as_secs_f64());
                self.metrics
                    .replies
                    .get_or_create(&reply_labels("ack"))
                    .inc();
                s.acked = Some(version);
                s.acked_sources = s.sent_sources.clone();
                s.nack = None;
            }
            Reply::Certificate { .. } => {}
            Reply::Nack { error, .. } => {
                self.metrics
                    .replies
                    .get_or_create(&reply_labels("nack"))
                    .inc();
                tracing::warn!(pod = %s.pod, version = s.version, %error, "sidecar refused its config; it keeps its last good one");
                s.nack = Some(error);
                if matches!(kind, ConfigKind::Delta { .. }) {
                    // The delta may have met another base than the hub
                    // assumed: the next recompile sends the full snapshot
                    // (which gets its own ACK or NACK).
                    s.sent = None;
                    drop(inner);
                    self.dirty.notify_one();
                }
            }
        }
    }

    /// Connected streams.
    pub fn connected(&self) -> usize {
        self.lock().streams.len()
    }

    /// Pushes `generation` as the re-issue trigger, with `spread`, to every
    /// `reissue`-capable stream whose config has a TLS section. The spread
    /// is fixed when the generation changes (the caller scales it to the
    /// streams then): a new or lost stream never changes every snapshot.
    pub fn set_reissue(&self, generation: &str, spread: Duration) {
        {
            let mut inner = self.lock();
            if inner
                .reissue
                .as_ref()
                .is_some_and(|r| r.generation == generation)
            {
                return;
            }
            inner.reissue = Some(Reissue {
                generation: generation.to_owned(),
                spread_ms: u64::try_from(spread.as_millis()).unwrap_or(u64::MAX),
            });
        }
        self.dirty.notify_one();
    }

    /// This replica's count of the sidecars reporting the certificate they
    /// hold, against the generation it pushes (`None` before it has one).
    pub fn trust_count(&self) -> Option<crate::identity::rotation::Count> {
        let inner = self.lock();
        let generation = inner.reissue.as_ref()?.generation.clone();
        let mut count = crate::identity::rotation::Count {
            generation,
            ..Default::default()
        };
        for held in inner.streams.values().filter_map(|s| s.held.as_deref()) {
            count.sidecars += 1;
            count.current += usize::from(held == count.generation);
        }
        Some(count)
    }

    /// Each connected sidecar's state (for status).
    pub fn sidecars(&self) -> Vec<SidecarState> {
        self.lock()
            .streams
            .values()
            .map(|s| SidecarState {
                pod: s.pod.clone(),
                version: s.version,
                acked: s.acked,
                nack: s.nack.clone(),
            })
            .collect()
    }

    /// How many of this replica's sidecars serve `source` (a Route or
    /// TlsPolicy at its current generation).
    pub fn programmed(&self, source: &Source) -> Programmed {
        self.programmed_all(std::slice::from_ref(source))
            .pop()
            .unwrap_or_default()
    }

    /// [`Hub::programmed`] of every one of `sources`, in order, in one pass
    /// over the streams: the status writer and the tally ask for every
    /// object each second, and a pass per object would cost objects ×
    /// streams × the sources each stream was sent.
    pub fn programmed_all(&self, sources: &[Source]) -> Vec<Programmed> {
        // Object → where it is asked for (once per generation asked).
        let mut wanted: HashMap<(Kind, &ObjKey), Vec<usize>> = HashMap::new();
        for (i, s) in sources.iter().enumerate() {
            wanted.entry(s.object()).or_default().push(i);
        }
        let mut out = vec![Programmed::default(); sources.len()];
        // The last stream (numbered from 1) that counted each object: a
        // stream counts once per object whatever generations it was sent.
        let mut counted_by = vec![0usize; sources.len()];
        let inner = self.lock();
        for (n, s) in inner.streams.values().enumerate() {
            for sent in s.sent_sources.iter() {
                let Some(asked) = wanted.get(&sent.object()) else {
                    continue;
                };
                for &i in asked {
                    if counted_by[i] == n + 1 {
                        continue;
                    }
                    counted_by[i] = n + 1;
                    let (want, p) = (&sources[i], &mut out[i]);
                    p.total += 1;
                    if s.acked_sources.contains(want) {
                        p.acked += 1;
                    } else if s.sent_sources.contains(want) && p.nack.is_none() {
                        p.nack = s.nack.clone();
                    }
                }
            }
        }
        out
    }

    /// The Routes, TlsPolicies and AuthorizationPolicies in the index (for
    /// the status writer).
    pub fn objects(&self) -> Objects {
        let inner = self.lock();
        Objects {
            routes: inner.index.routes.values().cloned().collect(),
            tls_policies: inner.index.tls_policies.values().cloned().collect(),
            authorization_policies: inner
                .index
                .authorization_policies
                .values()
                .cloned()
                .collect(),
        }
    }

    /// Per AuthorizationPolicy naming ports some selected Pod does not
    /// declare, the UnknownPort message ([`super::authz::unknown_ports`]).
    pub fn unknown_ports(&self) -> BTreeMap<ObjKey, String> {
        let inner = self.lock();
        let index = &inner.index;
        index
            .authorization_policies
            .iter()
            .filter_map(|(k, p)| super::authz::unknown_ports(index, k, p).map(|m| (k.clone(), m)))
            .collect()
    }

    /// The cluster-wide parameters the hub compiles with.
    pub fn params(&self) -> &MeshParams {
        &self.params
    }

    /// Route attachment as of the last recompile.
    pub fn attachments(&self) -> Arc<Attachments> {
        self.lock().attachments.clone()
    }

    /// Every Route and TlsPolicy at the generation the last recompile saw.
    pub fn compiled_sources(&self) -> Arc<BTreeSet<Source>> {
        self.lock().compiled_sources.clone()
    }

    /// Recompile every stream and push where the snapshot changed. Returns
    /// how many pushes were sent.
    pub fn recompile(&self) -> usize {
        if !self.is_synced() {
            return 0;
        }
        let started = Instant::now();
        let mut inner = self.lock();
        let attachments = Arc::new(attach_routes(&inner.index));
        inner.attachments = attachments.clone();
        inner.compiled_sources = Arc::new(
            Source::all_of(
                inner.index.routes.values(),
                inner.index.tls_policies.values(),
                inner.index.authorization_policies.values(),
            )
            .into_iter()
            .collect(),
        );
        let Inner {
            index,
            streams,
            reissue,
            ..
        } = &mut *inner;
        // One compile per group of sidecars that get the same config (and
        // per Pod whose group cannot be told yet: it is not in the index).
        let mut compiled: HashMap<_, Option<Arc<Compiled>>> = HashMap::new();
        // Whether a stream's last snapshot equals its new one, once per
        // (old, new) pair: the streams of a group share both.
        let mut same: HashMap<(*const Compiled, *const Compiled), bool> = HashMap::new();
        // The delta from one snapshot to another, serialized once per pair.
        let mut deltas: HashMap<(*const Compiled, *const Compiled), Bytes> = HashMap::new();
        let mut pushes = 0;
        for s in streams.values_mut() {
            // A stream that follows re-issue triggers gets its group's
            // snapshot with the trigger in: a group per capability.
            let trigger = reissue.as_ref().filter(|_| s.caps.reissue);
            let key = (
                compile_key(index, &self.params.trust_domain, &s.pod),
                trigger.is_some(),
            );
            let Some(new) = compiled
                .entry(key)
                .or_insert_with(
                    || match compile(index, &attachments, &self.params, &s.pod) {
                        Ok(mut c) => {
                            if let (Some(tls), Some(trigger)) = (c.snapshot.tls.as_mut(), trigger) {
                                tls.reissue = Some(trigger.clone());
                            }
                            let generation =
                                |meta: &kube::api::ObjectMeta| meta.generation.unwrap_or(0);
                            let sources = c
                                .routes
                                .iter()
                                .filter_map(|k| {
                                    let r = index.routes.get(k)?;
                                    Some(Source::Route(k.clone(), generation(&r.metadata)))
                                })
                                .chain(c.tls_policy.iter().filter_map(|k| {
                                    let p = index.tls_policies.get(k)?;
                                    Some(Source::TlsPolicy(k.clone(), generation(&p.metadata)))
                                }))
                                .chain(c.authorization_policies.iter().filter_map(|k| {
                                    let p = index.authorization_policies.get(k)?;
                                    Some(Source::AuthorizationPolicy(
                                        k.clone(),
                                        generation(&p.metadata),
                                    ))
                                }))
                                .collect::<BTreeSet<_>>()
                                .into();
                            Some(Arc::new(Compiled {
                                json: SharedPush::snapshot_json(&c.snapshot),
                                snapshot: c.snapshot,
                                sources,
                            }))
                        }
                        Err(error) => {
                            // The Pod is not (yet) in the index: it connected
                            // before its watch event arrived. Its push follows
                            // that event.
                            tracing::debug!(%error, "no config for a connected sidecar yet");
                            None
                        }
                    },
                )
                .clone()
            else {
                continue;
            };
            let unchanged = s.sent.as_ref().is_some_and(|old| {
                *same
                    .entry((Arc::as_ptr(old), Arc::as_ptr(&new)))
                    .or_insert_with(|| old.snapshot == new.snapshot)
            });
            if unchanged {
                // Same config: a new generation that compiles the same
                // (a cosmetic edit) counts as served once the current
                // snapshot is ACKed.
                if s.sent_sources != new.sources {
                    if s.pending.is_none() && s.acked_sources == s.sent_sources {
                        s.acked_sources = new.sources.clone();
                    }
                    s.sent_sources = new.sources.clone();
                }
                // Keep the newest Arc so the next pass compares pointers.
                s.sent = Some(new);
                continue;
            }
            // A delta only to a client that applies them, and only onto what
            // the sidecar is known to serve: the last push, ACKed, with
            // nothing in flight.
            let base = s.sent.as_ref().filter(|_| {
                s.caps.delta
                    && s.pending.is_none()
                    && s.nack.is_none()
                    && s.acked == Some(s.version)
            });
            let (kind, json) = match base {
                Some(old) => (
                    ConfigKind::Delta { base: s.version },
                    deltas
                        .entry((Arc::as_ptr(old), Arc::as_ptr(&new)))
                        .or_insert_with(|| {
                            SharedPush::delta_json(&Delta::between(&old.snapshot, &new.snapshot))
                        })
                        .clone(),
                ),
                None => (ConfigKind::Snapshot, new.json.clone()),
            };
            s.sent_sources = new.sources.clone();
            s.version += 1;
            let nonce = format!("{}-{}", s.version, rand::random::<u32>());
            s.pending = Some((nonce.clone(), Instant::now(), kind));
            // The sidecar stamps the push's version on the snapshot it
            // applies, so the shared JSON carries none of its own.
            s.tx.send_replace(Some(Arc::new(SharedPush {
                version: s.version,
                nonce,
                kind,
                json,
            })));
            s.sent = Some(new);
            pushes += 1;
        }
        drop(inner);
        self.metrics.pushes.inc_by(pushes as u64);
        self.metrics
            .compile_seconds
            .observe(started.elapsed().as_secs_f64());
        pushes
    }

    /// The debounce loop: runs until the process ends.
    pub async fn run(self: Arc<Self>) {
        let mut synced = self.synced.subscribe();
        // A connect or update before the first resync only waits for it.
        let _ = synced.wait_for(|s| *s).await;
        loop {
            self.dirty.notified().await;
            tokio::time::sleep(Self::DEBOUNCE).await;
            self.recompile();
        }
    }
}

fn reply_labels(kind: &'static str) -> super::metrics::ReplyLabels {
    super::metrics::ReplyLabels { kind }
}
