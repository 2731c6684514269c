//! A reflector-backed cache of one kind: list then watch, trimmed before it
//! is stored, retried with backoff, stopped by a signal.
//!
//! Watchers use the default `watcher::Config` (list then watch), not
//! streaming lists, which the 1.20 API server of the e2e suite lacks.

use std::fmt::Debug;
use std::future::Future;

use futures::{Stream, StreamExt, TryStreamExt};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

/// Starts a reflector of `api`'s objects in a task of its own and returns
/// its store at once (`wait_until_ready` says when the first list is in).
/// `trim` drops what the reader never looks at before an object is stored
/// (managed fields, images: memory per object); `on_change` runs after each
/// event the store applied (a wake-up for a controller loop). The task
/// ends when `stop` resolves, or with the runtime.
pub fn spawn<K>(
    api: Api<K>,
    trim: fn(&mut K),
    on_change: impl Fn() + Send + 'static,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Store<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    spawn_with(api, watcher::Config::default(), trim, on_change, stop)
}

/// [`spawn`] with a watcher config of its own: a field selector
/// `metadata.name=<name>` makes a list and watch of one object, which RBAC
/// can then grant by `resourceNames`.
pub fn spawn_with<K>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
    on_change: impl Fn() + Send + 'static,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Store<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (reader, writer) = reflector::store();
    let stream = watcher(api, config)
        .default_backoff()
        .map_ok(move |ev| ev.modify(trim));
    let stream = reflector::reflector(writer, stream);
    tokio::spawn(drive(K::kind(&()).into_owned(), stream, stop, move |_| {
        on_change()
    }));
    reader
}

/// Polls a watch stream until it ends or `stop` resolves: `on_event` for
/// each event, a warning for each error (the stream's backoff retries, so
/// an error is news, not an end). Shared by [`spawn_with`] and
/// [`crate::compact::spawn`], so both caches stop and log alike.
pub(crate) async fn drive<T>(
    kind: String,
    stream: impl Stream<Item = Result<T, watcher::Error>>,
    stop: impl Future<Output = ()>,
    mut on_event: impl FnMut(T),
) {
    let mut stream = std::pin::pin!(stream);
    let mut stop = std::pin::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => return,
            item = stream.next() => match item {
                None => return,
                Some(Ok(event)) => on_event(event),
                Some(Err(error)) => tracing::warn!(
                    %kind, %error, "watch failed; retrying with backoff"
                ),
            },
        }
    }
}

/// The trim every cache applies: managed fields are never read and are
/// often the bulk of an object.
pub fn trim_managed_fields(meta: &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) {
    meta.managed_fields = None;
}

#[cfg(test)]
mod tests {
    //! Against the tower-test mock API server: the initial list fills the
    //! store trimmed, wakes the caller, and stop ends the task.

    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::reflector::ObjectRef;

    use super::*;
    use crate::testing::{mock_client, reply};

    #[tokio::test]
    async fn the_first_list_fills_the_store_trimmed_and_wakes_the_caller() {
        let (client, mut handle) = mock_client();
        let wakes = Arc::new(AtomicUsize::new(0));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let counted = wakes.clone();
        let store = spawn(
            Api::<ConfigMap>::all(client),
            |c: &mut ConfigMap| trim_managed_fields(&mut c.metadata),
            move || {
                counted.fetch_add(1, Ordering::SeqCst);
            },
            async move {
                let _ = stop_rx.await;
            },
        );
        let (request, send) = handle.next_request().await.expect("the initial list");
        assert_eq!(request.uri().path(), "/api/v1/configmaps");
        reply(
            send,
            200,
            &serde_json::json!({
                "apiVersion": "v1", "kind": "ConfigMapList", "metadata": {"resourceVersion": "5"},
                "items": [{"metadata": {"name": "a", "namespace": "ns", "resourceVersion": "5",
                           "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
                           "data": {"k": "v"}}],
            }),
        );
        store.wait_until_ready().await.unwrap();
        let cached = store.get(&ObjectRef::new("a").within("ns")).unwrap();
        assert_eq!(cached.data.as_ref().unwrap()["k"], "v");
        assert!(cached.metadata.managed_fields.is_none(), "trimmed");
        assert!(wakes.load(Ordering::SeqCst) >= 1);
        // The watch that follows the list: stop before answering it.
        let (watch, _pending) = handle.next_request().await.expect("the watch");
        assert!(
            watch.uri().query().unwrap_or("").contains("watch=true"),
            "{}",
            watch.uri()
        );
        stop_tx.send(()).unwrap();
        // The task ended and dropped its client: no further request comes
        // (the bound only keeps a regression from hanging the suite).
        let next = tokio::time::timeout(std::time::Duration::from_secs(10), handle.next_request())
            .await
            .expect("the reflector task ends on stop");
        assert!(next.is_none());
    }
}
