//! `accepts` / `rejects`: assert what the API server's admission chain (CRD
//! schema validation, Baton's webhooks, built-in plugins) says about an
//! object, with a server-side dry run so nothing is persisted.
//!
//! `creates` / `refuses`: the same assertions on a real create, for tests
//! that need the object to exist afterwards (a pod the scheduler must
//! place) or the side effects a dry run never has (the webhook books a
//! grant and publishes refusal Events only for real requests).

use std::fmt::Debug;

use kube::api::PostParams;
use kube::core::Status;
use kube::{Api, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;

fn params(dry_run: bool) -> PostParams {
    PostParams {
        dry_run,
        field_manager: Some("baton-e2e".to_owned()),
    }
}

/// Asserts that creating `obj` is admitted and returns the object as the
/// server would store it (after every mutating webhook ran).
#[track_caller]
pub fn accepts<'a, K>(api: &'a Api<K>, obj: &'a K) -> impl Future<Output = K> + 'a
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
{
    admitted(api, obj, true, std::panic::Location::caller())
}

/// [`accepts`], but the object is created for real; returns it as stored.
#[track_caller]
pub fn creates<'a, K>(api: &'a Api<K>, obj: &'a K) -> impl Future<Output = K> + 'a
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
{
    admitted(api, obj, false, std::panic::Location::caller())
}

async fn admitted<K>(api: &Api<K>, obj: &K, dry_run: bool, caller: &std::panic::Location<'_>) -> K
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
{
    match api.create(&params(dry_run), obj).await {
        Ok(admitted) => admitted,
        Err(error) => {
            panic!("{caller}: expected the API server to admit {obj:#?}\nbut it refused: {error}")
        }
    }
}

/// Asserts that creating `obj` is refused by the API server (a 4xx status,
/// not a transport error) and returns the refusal for message checks.
#[track_caller]
pub fn rejects<'a, K>(api: &'a Api<K>, obj: &'a K) -> impl Future<Output = Status> + 'a
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
{
    refused(api, obj, true, std::panic::Location::caller())
}

/// [`rejects`] on a real create request (what a controller or `kubectl
/// apply` sends), so the refusal has its side effects (Events).
#[track_caller]
pub fn refuses<'a, K>(api: &'a Api<K>, obj: &'a K) -> impl Future<Output = Status> + 'a
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
{
    refused(api, obj, false, std::panic::Location::caller())
}

async fn refused<K>(
    api: &Api<K>,
    obj: &K,
    dry_run: bool,
    caller: &std::panic::Location<'_>,
) -> Status
where
    K: Resource + Clone + Debug + Serialize + DeserializeOwned,
{
    match api.create(&params(dry_run), obj).await {
        Ok(admitted) => panic!(
            "{caller}: expected the API server to refuse {obj:#?}\nbut it admitted {admitted:#?}"
        ),
        Err(kube::Error::Api(status)) if (400..500).contains(&status.code) => *status,
        Err(error) => {
            panic!("{caller}: expected an admission refusal, got a different error: {error}")
        }
    }
}
