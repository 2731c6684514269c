//! `with_temp_ns`: every e2e test runs in a namespace of its own, created
//! for it and deleted afterwards, inside a tracing span named after the test.
//! When the test fails (panics), the namespace's pods, events and container
//! logs are printed before it is deleted, so a CI log explains the failure.
//!
//! Modelled on linkerd2's `policy-test` crate.

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt;
use k8s_openapi::api::core::v1::{Event, Namespace, Pod, ServiceAccount};
use kube::api::{DeleteParams, ListParams, LogParams, ObjectMeta, PostParams};
use kube::{Api, Client};
use rand::Rng;
use tracing::Instrument;

use crate::wait::{Check, pod_state, wait_for};

/// Label put on every namespace the e2e suite creates.
pub const E2E_LABEL: &str = "baton.dev/e2e";

/// Runs `test` with a client and the name of a fresh namespace, then deletes
/// the namespace. A panic inside `test` dumps the namespace and is re-raised.
pub async fn with_temp_ns<F, Fut>(test: F)
where
    F: FnOnce(Client, String) -> Fut,
    Fut: Future<Output = ()>,
{
    with_temp_ns_labelled(BTreeMap::new(), test).await;
}

/// Like [`with_temp_ns`], with extra labels on the namespace (e.g. the
/// injection opt-in label).
pub async fn with_temp_ns_labelled<F, Fut>(labels: BTreeMap<String, String>, test: F)
where
    F: FnOnce(Client, String) -> Fut,
    Fut: Future<Output = ()>,
{
    init_tracing();
    let client = crate::cluster::client().await;
    let test_name = current_test_name();
    let ns = namespace_name(&test_name, rand::rng().random::<u32>());
    let span = tracing::info_span!("e2e", test = %test_name, %ns);

    async {
        create_namespace(&client, &ns, labels).await;
        tracing::info!("namespace created");
        let outcome = AssertUnwindSafe(test(client.clone(), ns.clone()))
            .catch_unwind()
            .await;
        if outcome.is_err() {
            eprintln!("==== e2e test {test_name} failed; state of namespace {ns}:");
            eprintln!("{}", dump_namespace(&client, &ns).await);
        }
        delete_namespace(&client, &ns).await;
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    }
    .instrument(span)
    .await;
}

/// Initialises a test-writer tracing subscriber once (RUST_LOG honoured).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("info,kube=warn,hyper=warn")
            }),
        )
        .with_test_writer()
        .with_ansi(false)
        .try_init();
}

/// The name of the running test (libtest names each test's thread after it;
/// `#[tokio::test]` runs the body on that thread).
fn current_test_name() -> String {
    std::thread::current()
        .name()
        .filter(|n| *n != "main")
        .unwrap_or("e2e")
        .to_owned()
}

/// A DNS-1123 label from a test path and a random suffix: `e2e-<last path
/// segment, sanitised, at most 40 chars>-<8 hex digits>`.
pub fn namespace_name(test_name: &str, suffix: u32) -> String {
    let last = test_name.rsplit("::").next().unwrap_or(test_name);
    let mut stem: String = last
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    stem.truncate(40);
    let stem = stem.trim_matches('-');
    if stem.is_empty() {
        format!("e2e-{suffix:08x}")
    } else {
        format!("e2e-{stem}-{suffix:08x}")
    }
}

async fn create_namespace(client: &Client, ns: &str, mut labels: BTreeMap<String, String>) {
    labels.insert(E2E_LABEL.to_owned(), "true".to_owned());
    let api: Api<Namespace> = Api::all(client.clone());
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(ns.to_owned()),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    api.create(&PostParams::default(), &namespace)
        .await
        .unwrap_or_else(|e| panic!("creating namespace {ns}: {e}"));
    // Pods are refused until the service-account controller created the
    // namespace's `default` ServiceAccount.
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    wait_for(
        &format!("ServiceAccount {ns}/default"),
        Duration::from_secs(30),
        || async {
            match sas.get_opt("default").await {
                Ok(Some(_)) => Check::Done(()),
                other => Check::NotYet(format!("{other:?}")),
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

async fn delete_namespace(client: &Client, ns: &str) {
    let api: Api<Namespace> = Api::all(client.clone());
    // Pods in test namespaces don't need a graceful stop.
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let _ = pods
        .delete_collection(
            &DeleteParams::default().grace_period(0),
            &ListParams::default(),
        )
        .await;
    if let Err(error) = api.delete(ns, &DeleteParams::default()).await {
        tracing::warn!(%error, "deleting namespace {ns}");
    }
}

/// Pods (state), events and the logs of every container of `ns`.
pub async fn dump_namespace(client: &Client, ns: &str) -> String {
    let mut out = String::new();
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    match pods.list(&ListParams::default()).await {
        Ok(list) => {
            for pod in &list.items {
                let name = pod.metadata.name.clone().unwrap_or_default();
                out.push_str(&format!("--- pod {name}: {}\n", pod_state(pod)));
                let spec = pod.spec.as_ref();
                let containers = spec
                    .and_then(|s| s.init_containers.as_ref())
                    .into_iter()
                    .flatten()
                    .chain(spec.map(|s| s.containers.iter()).into_iter().flatten());
                for container in containers {
                    let params = LogParams {
                        container: Some(container.name.clone()),
                        tail_lines: Some(100),
                        ..LogParams::default()
                    };
                    match pods.logs(&name, &params).await {
                        Ok(logs) => out.push_str(&format!(
                            "    logs of {} ({}):\n{}\n",
                            container.name,
                            container.image.as_deref().unwrap_or("?"),
                            indent(&logs)
                        )),
                        Err(e) => out.push_str(&format!(
                            "    logs of {}: unavailable ({e})\n",
                            container.name
                        )),
                    }
                }
            }
        }
        Err(e) => out.push_str(&format!("listing pods failed: {e}\n")),
    }
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    match events.list(&ListParams::default()).await {
        Ok(list) => {
            out.push_str("--- events:\n");
            for e in &list.items {
                out.push_str(&format!(
                    "    {} {}/{} {}: {}\n",
                    e.type_.as_deref().unwrap_or(""),
                    e.involved_object.kind.as_deref().unwrap_or(""),
                    e.involved_object.name.as_deref().unwrap_or(""),
                    e.reason.as_deref().unwrap_or(""),
                    e.message.as_deref().unwrap_or("")
                ));
            }
        }
        Err(e) => out.push_str(&format!("listing events failed: {e}\n")),
    }
    out
}

fn indent(text: &str) -> String {
    text.lines()
        .map(|l| format!("      {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_names_are_dns_labels_derived_from_the_test_name() {
        let name = namespace_name("install::crds_apply_and_show_printer_columns", 0xdead_beef);
        assert_eq!(name, "e2e-crds-apply-and-show-printer-columns-deadbeef");
        assert!(name.len() <= 63);
    }

    #[test]
    fn long_test_names_are_truncated_to_fit_a_dns_label() {
        let name = namespace_name(&"x".repeat(200), 1);
        assert!(name.len() <= 63, "{name}");
        assert!(name.ends_with("-00000001"));
    }

    #[test]
    fn names_without_usable_characters_still_make_a_label() {
        assert_eq!(namespace_name("__", 2), "e2e-00000002");
    }
}
