//! A watch-backed cache that keeps, per object, only a small value computed
//! once when the object's event arrives, instead of the object.
//!
//! [`crate::reflect`] keeps whole (trimmed) objects: right for a few
//! hundred pools or nodes, too much for every Pod of a cluster, where even
//! an empty k8s-openapi `Pod` is over 2 KiB inline and each container 2 KiB
//! more. Here a `project` function maps each object to what its reader
//! needs (`None`: nothing, the object is not kept), and the cache holds
//! that value under `namespace/name` (`name` when cluster-scoped).
//!
//! The watcher's semantics are kept as kube-runtime's `Store` keeps them:
//! a (re)list (`Init`, `InitApply`…, `InitDone`) fills a new map on the
//! side and swaps it in at `InitDone`, so objects deleted while the watch
//! was down disappear; `Apply` inserts or replaces, `Delete` removes; the
//! cache is ready after the first `InitDone`. [`Writer::apply`] is that
//! logic with no I/O, tested event by event; [`spawn`] feeds it from a
//! watcher with [`crate::reflect`]'s config and backoff.
//!
//! The wake-up runs only when what readers see changed: an object update
//! whose projected value is unchanged (most Pod status updates, for a
//! reader that needs a few fields) does not wake the reader.

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::sync::{Arc, PoisonError, RwLock, RwLockWriteGuard};

use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

/// `namespace/name`, or `name` for a cluster-scoped object (neither part
/// can contain a `/`, so the two never collide).
type Key = Box<str>;
type Map<V> = HashMap<Key, Arc<V>>;

/// The watch task ended (stopped, or the runtime shut down) before the
/// first list was in.
#[derive(Debug, thiserror::Error)]
#[error("the cache's watch ended before its first list was in")]
pub struct WriterDropped;

/// The readers' end: cheap to clone, every clone sees the same values.
pub struct Cache<V> {
    map: Arc<RwLock<Map<V>>>,
    ready: watch::Receiver<bool>,
}

impl<V> Clone for Cache<V> {
    fn clone(&self) -> Self {
        Self {
            map: self.map.clone(),
            ready: self.ready.clone(),
        }
    }
}

impl<V> Cache<V> {
    /// Every value now in the cache, in no particular order (like
    /// `Store::state`: clones of `Arc`s, the lock is held only to copy them).
    pub fn state(&self) -> Vec<Arc<V>> {
        self.read(|m| m.values().cloned().collect())
    }

    /// The value of one object.
    pub fn get(&self, namespace: Option<&str>, name: &str) -> Option<Arc<V>> {
        let key = key_of(namespace, name);
        self.read(|m| m.get(&key).cloned())
    }

    pub fn len(&self) -> usize {
        self.read(HashMap::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the first list is in.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Resolves once the first list is in (at once if it already is).
    pub async fn wait_until_ready(&self) -> Result<(), WriterDropped> {
        let mut ready = self.ready.clone();
        ready
            .wait_for(|r| *r)
            .await
            .map(|_| ())
            .map_err(|_| WriterDropped)
    }

    fn read<T>(&self, f: impl FnOnce(&Map<V>) -> T) -> T {
        // A writer that panicked mid-event left a map that is still a map:
        // readers go on (the level-triggered reader recomputes anyway).
        f(&self.map.read().unwrap_or_else(PoisonError::into_inner))
    }
}

/// The writer's end: applies watcher events to the map its [`Cache`]s read.
pub struct Writer<K, V> {
    project: fn(&K) -> Option<V>,
    map: Arc<RwLock<Map<V>>>,
    /// The (re)list in progress, swapped in at `InitDone`.
    relist: Option<Map<V>>,
    ready: watch::Sender<bool>,
}

impl<K: Resource, V: PartialEq> Writer<K, V> {
    /// An empty, not yet ready cache and its writer.
    pub fn new(project: fn(&K) -> Option<V>) -> (Cache<V>, Self) {
        let map = Arc::new(RwLock::new(Map::new()));
        let (ready_tx, ready_rx) = watch::channel(false);
        let cache = Cache {
            map: map.clone(),
            ready: ready_rx,
        };
        let writer = Self {
            project,
            map,
            relist: None,
            ready: ready_tx,
        };
        (cache, writer)
    }

    /// Applies one watcher event; returns whether what readers see changed
    /// (the caller's cue to wake its reader).
    pub fn apply(&mut self, event: watcher::Event<K>) -> bool {
        match event {
            watcher::Event::Apply(obj) => {
                let key = key(&obj);
                let value = (self.project)(&obj);
                drop(obj);
                let mut map = self.write();
                match value {
                    // An update that changes nothing the reader keeps (a
                    // container restart, a readiness flip) is no news.
                    Some(v) if map.get(&key).is_some_and(|old| **old == v) => false,
                    Some(v) => {
                        map.insert(key, Arc::new(v));
                        true
                    }
                    // Changed into an object the reader does not keep.
                    None => map.remove(&key).is_some(),
                }
            }
            watcher::Event::Delete(obj) => self.write().remove(&key(&obj)).is_some(),
            watcher::Event::Init => {
                // A relist that broke off before its InitDone is dropped.
                self.relist = Some(Map::new());
                false
            }
            watcher::Event::InitApply(obj) => {
                if let Some(v) = (self.project)(&obj) {
                    self.relist
                        .get_or_insert_default()
                        .insert(key(&obj), Arc::new(v));
                }
                false
            }
            watcher::Event::InitDone => {
                let fresh = self.relist.take().unwrap_or_default();
                let old = std::mem::replace(&mut *self.write(), fresh);
                // The old map is freed after the lock is released.
                drop(old);
                self.ready.send_replace(true);
                true
            }
        }
    }

    fn write(&self) -> RwLockWriteGuard<'_, Map<V>> {
        self.map.write().unwrap_or_else(PoisonError::into_inner)
    }
}

fn key<K: Resource>(obj: &K) -> Key {
    let meta = obj.meta();
    key_of(
        meta.namespace.as_deref(),
        meta.name.as_deref().unwrap_or_default(),
    )
}

fn key_of(namespace: Option<&str>, name: &str) -> Key {
    match namespace {
        Some(ns) => format!("{ns}/{name}").into(),
        None => name.into(),
    }
}

/// Starts a watch of `api`'s objects in a task of its own, keeping
/// `project(object)` per object, and returns the cache at once
/// ([`Cache::wait_until_ready`] says when the first list is in).
/// `on_change` runs after each event that changed what readers see (a
/// wake-up for a controller loop). The watcher config and backoff are
/// [`crate::reflect::spawn`]'s (list then watch, pages of 500, the
/// default backoff). The task ends when `stop` resolves, or with the
/// runtime.
pub fn spawn<K, V>(
    api: Api<K>,
    project: fn(&K) -> Option<V>,
    on_change: impl Fn() + Send + 'static,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Cache<V>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + 'static,
    V: PartialEq + Send + Sync + 'static,
{
    let (cache, mut writer) = Writer::new(project);
    let stream = watcher(api, watcher::Config::default()).default_backoff();
    tokio::spawn(crate::reflect::drive(
        K::kind(&()).into_owned(),
        stream,
        stop,
        move |event| {
            if writer.apply(event) {
                on_change();
            }
        },
    ));
    cache
}

#[cfg(test)]
mod tests {
    //! The event logic fed event by event with no API server, then one run
    //! of [`spawn`] against the tower-test mock API server.

    use std::sync::atomic::{AtomicUsize, Ordering};

    use k8s_openapi::api::core::v1::ConfigMap;
    use watcher::Event;

    use super::*;
    use crate::testing::{mock_client, reply};

    /// What the tests keep of a ConfigMap: its `v` entry; none without one.
    fn project(c: &ConfigMap) -> Option<String> {
        c.data.as_ref()?.get("v").cloned()
    }

    fn cm(name: &str, v: Option<&str>) -> ConfigMap {
        let mut c = ConfigMap::default();
        c.metadata.name = Some(name.into());
        c.metadata.namespace = Some("ns".into());
        c.data = v.map(|v| [("v".to_owned(), v.to_owned())].into());
        c
    }

    fn values(cache: &Cache<String>) -> Vec<String> {
        let mut v: Vec<String> = cache.state().iter().map(|s| (**s).clone()).collect();
        v.sort();
        v
    }

    fn listed(writer: &mut Writer<ConfigMap, String>, objects: &[ConfigMap]) {
        assert!(!writer.apply(Event::Init));
        for o in objects {
            assert!(!writer.apply(Event::InitApply(o.clone())), "not yet seen");
        }
        assert!(writer.apply(Event::InitDone));
    }

    #[test]
    fn the_first_list_is_seen_whole_at_init_done_and_makes_the_cache_ready() {
        let (cache, mut writer) = Writer::new(project);
        assert!(!cache.is_ready());
        writer.apply(Event::Init);
        writer.apply(Event::InitApply(cm("a", Some("1"))));
        writer.apply(Event::InitApply(cm("skipped", None)));
        assert!(
            cache.is_empty() && !cache.is_ready(),
            "half a list is not shown"
        );
        assert!(writer.apply(Event::InitDone));
        assert!(cache.is_ready());
        assert_eq!(values(&cache), ["1"]);
        assert_eq!(
            cache.get(Some("ns"), "a").as_deref().map(String::as_str),
            Some("1")
        );
        assert!(
            cache.get(Some("ns"), "skipped").is_none(),
            "projected to nothing"
        );
        assert!(cache.get(None, "a").is_none(), "keyed by namespace too");
    }

    #[test]
    fn a_relist_swaps_in_whole_so_objects_deleted_while_away_disappear() {
        let (cache, mut writer) = Writer::new(project);
        listed(&mut writer, &[cm("a", Some("1")), cm("b", Some("2"))]);
        // Reconnected: b was deleted and a changed while the watch was down.
        writer.apply(Event::Init);
        writer.apply(Event::InitApply(cm("a", Some("1b"))));
        assert_eq!(values(&cache), ["1", "2"], "the old list until InitDone");
        writer.apply(Event::InitDone);
        assert_eq!(values(&cache), ["1b"]);
        // A relist that broke off is dropped: the next one starts afresh.
        writer.apply(Event::Init);
        writer.apply(Event::InitApply(cm("stale", Some("x"))));
        listed(&mut writer, &[cm("c", Some("3"))]);
        assert_eq!(values(&cache), ["3"]);
    }

    #[test]
    fn apply_inserts_or_replaces_and_wakes_only_on_a_changed_value() {
        let (cache, mut writer) = Writer::new(project);
        listed(&mut writer, &[]);
        assert!(writer.apply(Event::Apply(cm("a", Some("1")))));
        assert!(writer.apply(Event::Apply(cm("a", Some("2")))));
        assert_eq!(values(&cache), ["2"]);
        let mut same = cm("a", Some("2"));
        same.metadata.labels = Some([("other".to_owned(), "field".to_owned())].into());
        assert!(!writer.apply(Event::Apply(same)), "same value: no news");
        // An object that no longer projects to anything leaves the cache.
        assert!(writer.apply(Event::Apply(cm("a", None))));
        assert!(cache.is_empty());
        assert!(!writer.apply(Event::Apply(cm("b", None))), "never kept");
        assert!(cache.is_empty());
    }

    #[test]
    fn delete_removes_and_wakes_only_if_the_object_was_kept() {
        let (cache, mut writer) = Writer::new(project);
        listed(&mut writer, &[cm("a", Some("1")), cm("b", Some("2"))]);
        assert!(writer.apply(Event::Delete(cm("a", Some("1")))));
        assert_eq!(values(&cache), ["2"]);
        assert!(!writer.apply(Event::Delete(cm("a", Some("1")))));
        assert!(!writer.apply(Event::Delete(cm("never", None))));
        assert_eq!(cache.len(), 1);
    }

    #[tokio::test]
    async fn readiness_waits_for_the_first_init_done_and_fails_if_the_writer_is_gone() {
        let (cache, mut writer) = Writer::new(project);
        let waiting = tokio::spawn({
            let cache = cache.clone();
            async move { cache.wait_until_ready().await }
        });
        writer.apply(Event::Init);
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        writer.apply(Event::InitDone);
        waiting.await.unwrap().unwrap();
        // Ready stays ready, through relists and after the writer ends.
        writer.apply(Event::Init);
        assert!(cache.is_ready());
        drop(writer);
        cache.wait_until_ready().await.unwrap();

        let (never, writer) = Writer::<ConfigMap, String>::new(project);
        drop(writer);
        assert!(never.wait_until_ready().await.is_err());
    }

    #[tokio::test]
    async fn spawn_lists_projects_wakes_and_stops() {
        let (client, mut handle) = mock_client();
        let wakes = Arc::new(AtomicUsize::new(0));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let counted = wakes.clone();
        let cache = spawn(
            Api::<ConfigMap>::all(client),
            project,
            move || {
                counted.fetch_add(1, Ordering::SeqCst);
            },
            async move {
                let _ = stop_rx.await;
            },
        );
        let (request, send) = handle.next_request().await.expect("the initial list");
        assert_eq!(request.uri().path(), "/api/v1/configmaps");
        assert!(
            request.uri().query().unwrap_or("").contains("limit=500"),
            "paged like reflect::spawn: {}",
            request.uri()
        );
        reply(
            send,
            200,
            &serde_json::json!({
                "apiVersion": "v1", "kind": "ConfigMapList", "metadata": {"resourceVersion": "5"},
                "items": [
                    {"metadata": {"name": "a", "namespace": "ns", "resourceVersion": "5"},
                     "data": {"v": "1"}},
                    {"metadata": {"name": "b", "namespace": "ns", "resourceVersion": "5"}}],
            }),
        );
        cache.wait_until_ready().await.unwrap();
        assert_eq!(values(&cache), ["1"]);
        // The watch is asked for after the list's event was applied.
        let (watch, _pending) = handle.next_request().await.expect("the watch");
        assert_eq!(wakes.load(Ordering::SeqCst), 1, "one wake for the list");
        assert!(
            watch.uri().query().unwrap_or("").contains("watch=true"),
            "{}",
            watch.uri()
        );
        stop_tx.send(()).unwrap();
        let next = tokio::time::timeout(std::time::Duration::from_secs(10), handle.next_request())
            .await
            .expect("the watch task ends on stop");
        assert!(next.is_none());
    }
}
