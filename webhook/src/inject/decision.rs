//! Whether a pod is injected at all, before any cluster state is consulted.
//!
//! The order matters and is part of the contract: system namespaces and
//! already-injected pods are settled first (nothing can re-inject them),
//! then the pod's own opt-out, then hostNetwork (iptables would capture the
//! node's traffic), and only then the opt-in labels.

use std::collections::BTreeMap;

use baton_crds::contract::{NEVER_INJECT_NAMESPACES, annotations, containers, labels};
use k8s_openapi::api::core::v1::Pod;

/// Why a pod is left untouched (the admission is allowed with no patch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    /// kube-system, kube-public or baton-system.
    SystemNamespace,
    /// Already carries Baton's injection (second call under
    /// `reinvocationPolicy: IfNeeded`, or a copied spec).
    AlreadyInjected,
    /// Pod label `baton.dev/inject=disabled`.
    OptedOut,
    /// `hostNetwork: true`: capture would redirect the node's traffic.
    HostNetwork,
    /// Neither the namespace nor the pod carries `baton.dev/inject=enabled`.
    NotOptedIn,
}

impl Skip {
    pub fn metric_label(self) -> &'static str {
        match self {
            Self::SystemNamespace => "skip_system_namespace",
            Self::AlreadyInjected => "skip_already_injected",
            Self::OptedOut => "skip_opted_out",
            Self::HostNetwork => "skip_host_network",
            Self::NotOptedIn => "skip_not_opted_in",
        }
    }
}

/// True if the pod carries Baton's injection status annotation.
pub fn is_injected(pod: &Pod) -> bool {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(annotations::STATUS))
        .is_some_and(|s| s == STATUS_INJECTED)
}

/// Value of `baton.dev/status` on injected pods.
pub const STATUS_INJECTED: &str = "injected";

/// `Ok(())` if the pod should be injected, or why not.
pub fn should_inject(
    pod: &Pod,
    namespace: &str,
    namespace_labels: &BTreeMap<String, String>,
) -> Result<(), Skip> {
    if NEVER_INJECT_NAMESPACES.contains(&namespace) {
        return Err(Skip::SystemNamespace);
    }
    if is_injected(pod) {
        return Err(Skip::AlreadyInjected);
    }
    let pod_label = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(labels::INJECT))
        .map(String::as_str);
    if pod_label == Some(labels::INJECT_DISABLED) {
        return Err(Skip::OptedOut);
    }
    if pod
        .spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false)
    {
        return Err(Skip::HostNetwork);
    }
    let ns_enabled =
        namespace_labels.get(labels::INJECT).map(String::as_str) == Some(labels::INJECT_ENABLED);
    if ns_enabled || pod_label == Some(labels::INJECT_ENABLED) {
        Ok(())
    } else {
        Err(Skip::NotOptedIn)
    }
}

/// Names Baton injects; a pod that uses one without being injected is
/// refused rather than half-patched.
pub fn reserved_container_names() -> [&'static str; 3] {
    [containers::SLOT_A, containers::SLOT_B, containers::INIT]
}
