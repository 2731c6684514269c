//! `accepts` / `rejects`: assert what the API server's admission chain (CRD
//! schema validation, Baton's webhooks, built-in plugins) says about an
//! object, with a server-side dry run so nothing is persisted.

use std::fmt::Debug;

use kube::api::PostParams;
use kube::core::Status;
use kube::{Api, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;

fn dry_run() -> PostParams {
    PostParams {
        dry_run: true,
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
    let caller = std::panic::Location::caller();
    async move {
        match api.create(&dry_run(), obj).await {
            Ok(admitted) => admitted,
            Err(error) => panic!(
                "{caller}: expected the API server to admit {obj:#?}\nbut it refused: {error}"
            ),
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
    let caller = std::panic::Location::caller();
    async move {
        match api.create(&dry_run(), obj).await {
            Ok(admitted) => panic!(
                "{caller}: expected the API server to refuse {obj:#?}\nbut it admitted {admitted:#?}"
            ),
            Err(kube::Error::Api(status)) if (400..500).contains(&status.code) => *status,
            Err(error) => {
                panic!("{caller}: expected an admission refusal, got a different error: {error}")
            }
        }
    }
}
