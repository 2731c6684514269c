//! Reading a pod (and what its sidecar answers on `GET /handoff`) into the
//! planner's [`PodState`]. Pure: the controller fetches, this interprets.

use std::collections::BTreeMap;

use baton_crds::contract::{annotations, containers, env};
use baton_crds::tls_policy::OffloadMode;
use k8s_openapi::api::core::v1::{Container, ContainerStatus, Pod};

use crate::accelerator::accounting::OFFLOAD_QAT;

use super::plan::{
    FailureRecord, HandoffRecord, Observed, PodState, Slot, SlotState, UpgradeRecord,
};

/// `major.minor` of a kubelet version string (`v1.32.1`, `v1.29.4-eks-1`).
pub fn parse_kubelet_version(v: &str) -> Option<(u32, u32)> {
    let v = v.strip_prefix('v').unwrap_or(v);
    let mut parts = v.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor_part = parts.next()?;
    let end = minor_part
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(minor_part.len());
    Some((major, minor_part[..end].parse().ok()?))
}

fn slot_state(spec: &Container, status: Option<&ContainerStatus>) -> SlotState {
    let state = status.and_then(|s| s.state.as_ref());
    SlotState {
        image: spec.image.clone().unwrap_or_default(),
        running_image: status.map(|s| s.image.clone()).filter(|i| !i.is_empty()),
        running: state.is_some_and(|s| s.running.is_some()),
        running_since: state
            .and_then(|s| s.running.as_ref())
            .and_then(|r| r.started_at.as_ref())
            .map(|t| t.0.as_second()),
        ready: status.is_some_and(|s| s.ready),
        waiting_reason: state
            .and_then(|s| s.waiting.as_ref())
            .and_then(|w| w.reason.clone()),
        terminated_exit_code: state
            .and_then(|s| s.terminated.as_ref())
            .map(|t| t.exit_code),
        restarts: status.map_or(0, |s| s.restart_count),
    }
}

/// The planner's view of `pod`. `kubelet` is the node's kubelet version
/// (only needed for native sidecars); `observed` what its sidecar answered.
pub fn pod_state(pod: &Pod, kubelet: Option<(u32, u32)>, observed: Option<Observed>) -> PodState {
    let meta = &pod.metadata;
    let annotation = |key: &str| meta.annotations.as_ref().and_then(|a| a.get(key));
    let spec = pod.spec.as_ref();
    let status = pod.status.as_ref();
    let find = |name: &str| -> Option<(SlotState, bool)> {
        let spec = spec?;
        let (container, native) = match spec.containers.iter().find(|c| c.name == name) {
            Some(c) => (c, false),
            None => (
                spec.init_containers
                    .iter()
                    .flatten()
                    .find(|c| c.name == name)?,
                true,
            ),
        };
        let statuses = status.and_then(|s| {
            if native {
                s.init_container_statuses.as_ref()
            } else {
                s.container_statuses.as_ref()
            }
        });
        let st = statuses.and_then(|list| list.iter().find(|c| c.name == name));
        Some((slot_state(container, st), native))
    };
    let a = find(containers::SLOT_A);
    let b = find(containers::SLOT_B);
    let native = a.as_ref().or(b.as_ref()).is_some_and(|(_, n)| *n);
    let container = |name: &str| {
        spec.into_iter()
            .flat_map(|s| {
                s.containers
                    .iter()
                    .chain(s.init_containers.iter().flatten())
            })
            .find(|c| c.name == name)
    };
    // Devices (extended resources) slot a requests that slot b does not:
    // a pod injected before both slots carried them (decision 0036).
    let devices_only_in_a = container(containers::SLOT_A).is_some_and(|a| {
        let b = container(containers::SLOT_B)
            .map(device_limits)
            .unwrap_or_default();
        device_limits(a).iter().any(|(k, v)| b.get(k) != Some(v))
    });
    // The webhook gives both slots the pod's offload mode; slot a's is read.
    let slot_a_mode = container(containers::SLOT_A)
        .and_then(|c| c.env.as_ref())
        .and_then(|vars| vars.iter().find(|v| v.name == env::OFFLOAD_MODE))
        .and_then(|v| v.value.as_deref());
    PodState {
        key: format!(
            "{}/{}",
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default()
        ),
        uid: meta.uid.clone().unwrap_or_default(),
        labels: meta.labels.clone().unwrap_or_default(),
        version: annotation(annotations::VERSION).cloned(),
        active: annotation(annotations::ACTIVE_SLOT).and_then(|s| Slot::parse(s)),
        slot_a: a.map(|(s, _)| s),
        slot_b: b.map(|(s, _)| s),
        native,
        kubelet,
        terminating: meta.deletion_timestamp.is_some(),
        has_controller: meta
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.controller == Some(true)),
        required_device_only_in_slot_a: annotation(annotations::OFFLOAD).map(String::as_str)
            == Some(OFFLOAD_QAT)
            && slot_a_mode == Some(OffloadMode::Required.as_str())
            && devices_only_in_a,
        upgrade: annotation(annotations::UPGRADE)
            .map(|v| serde_json::from_str::<UpgradeRecord>(v).map_err(|e| e.to_string())),
        // A failure record that does not parse is dropped: the pod is simply
        // tried again.
        failure: annotation(annotations::UPGRADE_FAILED)
            .and_then(|v| serde_json::from_str::<FailureRecord>(v).ok()),
        // Only read to wait for the retired slot's restart: one that does
        // not parse (or predates the count) waits for nothing.
        last_handoff: annotation(annotations::LAST_HANDOFF)
            .and_then(|v| serde_json::from_str::<HandoffRecord>(v).ok()),
        observed,
    }
}

/// A container's extended-resource limits (names with a `/`: devices).
fn device_limits(c: &Container) -> BTreeMap<&str, &str> {
    c.resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .into_iter()
        .flatten()
        .filter(|(k, _)| k.contains('/'))
        .map(|(k, v)| (k.as_str(), v.0.as_str()))
        .collect()
}

/// Interprets a sidecar's `GET /handoff` document: `phase`, `complete`,
/// `slot` (the answering process's slot), `lastHandoff.durationMs` and
/// `retired` (slots whose handed-off process idles). `None` if it is not
/// such a document.
pub fn parse_observed(body: &[u8]) -> Option<Observed> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let phase = v.get("phase")?.as_str()?.to_owned();
    Some(Observed {
        slot: v.get("slot").and_then(|s| s.as_str()).and_then(Slot::parse),
        phase,
        complete: v.get("complete").and_then(|c| c.as_bool()).unwrap_or(false),
        duration_ms: v
            .get("lastHandoff")
            .and_then(|h| h.get("durationMs"))
            .and_then(|d| d.as_u64()),
        retired: v
            .get("retired")
            .and_then(|r| r.as_array())
            .map(|list| {
                list.iter()
                    .filter_map(|s| s.as_str().and_then(Slot::parse))
                    .collect()
            })
            .unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn kubelet_versions_parse_with_or_without_a_v_and_a_suffix() {
        assert_eq!(parse_kubelet_version("v1.32.1"), Some((1, 32)));
        assert_eq!(parse_kubelet_version("1.29.4-eks-1"), Some((1, 29)));
        assert_eq!(parse_kubelet_version("v1.30+k3s"), Some((1, 30)));
        assert_eq!(parse_kubelet_version("vx"), None);
        assert_eq!(parse_kubelet_version(""), None);
    }

    #[test]
    fn an_ordinary_injected_pod_mid_upgrade_is_read_whole() {
        let record = r#"{"version":"2","image":"s:2","slot":"b","fromVersion":"1","startedAt":5,"idleImage":"e:1"}"#;
        let p = pod(serde_json::json!({
            "metadata": {"name": "web-0", "namespace": "shop", "labels": {"app": "web"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": "u", "controller": true}],
                "annotations": {annotations::VERSION: "1", annotations::ACTIVE_SLOT: "a", annotations::UPGRADE: record}},
            "spec": {"containers": [
                {"name": containers::SLOT_A, "image": "s:1"},
                {"name": containers::SLOT_B, "image": "s:2"},
                {"name": "app", "image": "app:1"}]},
            "status": {"containerStatuses": [
                {"name": containers::SLOT_A, "ready": true, "restartCount": 0, "image": "s:1", "imageID": "", "state": {"running": {}}},
                {"name": containers::SLOT_B, "ready": false, "restartCount": 2, "image": "s:2", "imageID": "",
                 "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}
        }));
        let s = pod_state(&p, None, None);
        assert_eq!(s.key, "shop/web-0");
        assert_eq!(s.version.as_deref(), Some("1"));
        assert_eq!(s.active, Some(Slot::A));
        assert!(!s.native && s.has_controller && !s.terminating && s.ready());
        assert_eq!(s.labels.get("app").map(String::as_str), Some("web"));
        let b = s.slot_b.as_ref().unwrap();
        assert_eq!(b.image, "s:2");
        assert_eq!(b.waiting_reason.as_deref(), Some("CrashLoopBackOff"));
        assert!(!b.running);
        let Some(Ok(rec)) = &s.upgrade else {
            panic!("{:?}", s.upgrade)
        };
        assert_eq!(
            (rec.slot, rec.started_at, rec.idle_image.as_str()),
            (Slot::B, 5, "e:1")
        );
    }

    #[test]
    fn native_slots_are_found_among_init_containers() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "n", "namespace": "x", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"initContainers": [
                {"name": containers::SLOT_A, "image": "s:1", "restartPolicy": "Always"}],
                "containers": [{"name": "app", "image": "app"}]},
            "status": {"initContainerStatuses": [
                {"name": containers::SLOT_A, "ready": true, "restartCount": 0, "image": "s:1", "imageID": "",
                 "state": {"terminated": {"exitCode": 137}}}]}
        }));
        let s = pod_state(&p, Some((1, 33)), None);
        assert!(s.native && s.terminating && !s.has_controller);
        assert!(s.slot_b.is_none());
        assert_eq!(s.slot_a.unwrap().terminated_exit_code, Some(137));
        assert_eq!(s.kubelet, Some((1, 33)));
    }

    #[test]
    fn a_required_pod_whose_device_is_only_in_slot_a_is_recognised() {
        let with = |offload: &str, mode: &str, b_device: bool| {
            let device = json!({"limits": {"qat.intel.com/cy": "1"}});
            pod(serde_json::json!({
                "metadata": {"name": "n", "namespace": "x",
                    "annotations": {annotations::OFFLOAD: offload}},
                "spec": {"containers": [
                    {"name": containers::SLOT_A, "image": "s:1", "resources": device,
                     "env": [{"name": env::OFFLOAD_MODE, "value": mode}]},
                    {"name": containers::SLOT_B, "image": "e:1",
                     "resources": if b_device { device.clone() } else { json!({}) },
                     "env": [{"name": env::OFFLOAD_MODE, "value": mode}]}]},
            }))
        };
        let only_a = |p: &Pod| pod_state(p, None, None).required_device_only_in_slot_a;
        // Injected before both slots carried the device.
        assert!(only_a(&with("qat", "Required", false)));
        // Injected since: the device is in both slots.
        assert!(!only_a(&with("qat", "Required", true)));
        assert!(!only_a(&with("qat", "Preferred", false)));
        assert!(!only_a(&with("software-fallback", "Preferred", false)));
        assert!(!only_a(&with("disabled", "Disabled", false)));
    }

    #[test]
    fn a_malformed_upgrade_annotation_is_kept_as_an_error_and_a_malformed_failure_dropped() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "n", "namespace": "x",
                "annotations": {annotations::UPGRADE: "{nope", annotations::UPGRADE_FAILED: "[]"}},
        }));
        let s = pod_state(&p, None, None);
        assert!(matches!(s.upgrade, Some(Err(_))));
        assert!(s.failure.is_none());
    }

    #[test]
    fn the_handoff_document_of_the_sidecar_is_understood() {
        let body =
            br#"{"phase":"serving","complete":true,"slot":"b","version":"0.1.0","retired":["a"],
            "lastHandoff":{"result":"complete","durationMs":17}}"#;
        assert_eq!(
            parse_observed(body),
            Some(Observed {
                slot: Some(Slot::B),
                phase: "serving".into(),
                complete: true,
                duration_ms: Some(17),
                retired: vec![Slot::A],
            })
        );
        // A build that reports neither slot nor retired slots.
        let old =
            parse_observed(br#"{"phase":"serving","complete":false,"lastHandoff":null}"#).unwrap();
        assert_eq!((old.slot, old.retired.len()), (None, 0));
        assert_eq!(parse_observed(b"not json"), None);
        assert_eq!(parse_observed(br#"{"complete":true}"#), None);
    }
}
