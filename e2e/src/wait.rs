//! Polling with a deadline: the one way e2e tests wait for the cluster.
//!
//! Polling (rather than watches) keeps the helpers independent of watch
//! semantics that differ between Kubernetes 1.20 and current servers, and a
//! timeout error names what was awaited and the last thing seen.

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client};

/// Interval between two checks.
pub const POLL: Duration = Duration::from_millis(250);

/// A wait that ran out of time.
#[derive(Debug, thiserror::Error)]
#[error("timed out after {timeout:?} waiting for {what}; last observation: {last}")]
pub struct Timeout {
    pub what: String,
    pub timeout: Duration,
    pub last: String,
}

/// What one check saw: done with a value, or not yet (with a description of
/// the current state for the timeout message).
#[derive(Debug)]
pub enum Check<T> {
    Done(T),
    NotYet(String),
}

/// Calls `check` every [`POLL`] until it returns [`Check::Done`] or `timeout`
/// passes.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T, Timeout>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Check<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match check().await {
            Check::Done(value) => return Ok(value),
            Check::NotYet(state) => state,
        };
        if Instant::now() >= deadline {
            return Err(Timeout {
                what: what.to_owned(),
                timeout,
                last,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Summary of a pod's state for timeout messages and failure dumps.
pub fn pod_state(pod: &Pod) -> String {
    let Some(status) = &pod.status else {
        return "no status".to_owned();
    };
    let mut out = format!("phase={}", status.phase.as_deref().unwrap_or("?"));
    for c in status.conditions.iter().flatten() {
        out.push_str(&format!(" {}={}", c.type_, c.status));
    }
    let statuses = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten());
    for cs in statuses {
        let state = match &cs.state {
            Some(s) if s.running.is_some() => "running".to_owned(),
            Some(s) => match (&s.waiting, &s.terminated) {
                (Some(w), _) => format!("waiting({})", w.reason.as_deref().unwrap_or("")),
                (_, Some(t)) => format!(
                    "terminated({},{})",
                    t.exit_code,
                    t.reason.as_deref().unwrap_or("")
                ),
                _ => "unknown".to_owned(),
            },
            None => "none".to_owned(),
        };
        out.push_str(&format!(
            " [{}: {} ready={} restarts={}]",
            cs.name, state, cs.ready, cs.restart_count
        ));
    }
    out
}

pub fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Waits until the pod is Ready and returns it.
pub async fn pod_ready(
    client: &Client,
    ns: &str,
    name: &str,
    timeout: Duration,
) -> Result<Pod, Timeout> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait_for(&format!("pod {ns}/{name} Ready"), timeout, || async {
        match api.get_opt(name).await {
            Ok(Some(pod)) if is_ready(&pod) => Check::Done(pod),
            Ok(Some(pod)) => Check::NotYet(pod_state(&pod)),
            Ok(None) => Check::NotYet("not found".to_owned()),
            Err(e) => Check::NotYet(format!("get failed: {e}")),
        }
    })
    .await
}

/// Waits until the pod reached phase `Succeeded` or `Failed` and returns it.
pub async fn pod_finished(
    client: &Client,
    ns: &str,
    name: &str,
    timeout: Duration,
) -> Result<Pod, Timeout> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait_for(&format!("pod {ns}/{name} finished"), timeout, || async {
        match api.get_opt(name).await {
            Ok(Some(pod)) => {
                let phase = pod
                    .status
                    .as_ref()
                    .and_then(|s| s.phase.clone())
                    .unwrap_or_default();
                if phase == "Succeeded" || phase == "Failed" {
                    Check::Done(pod)
                } else {
                    Check::NotYet(pod_state(&pod))
                }
            }
            Ok(None) => Check::NotYet("not found".to_owned()),
            Err(e) => Check::NotYet(format!("get failed: {e}")),
        }
    })
    .await
}

/// The pod's IP, once it has one.
pub fn pod_ip(pod: &Pod) -> std::net::IpAddr {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .unwrap_or_else(|| panic!("pod {:?} has no IP", pod.metadata.name))
        .parse()
        .expect("pod IPs parse")
}

/// Debug-formats an object for a failure message.
pub fn show<T: Debug>(value: &T) -> String {
    format!("{value:#?}")
}
