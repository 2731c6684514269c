//! Injection settings that come from the webhook's flags, not from the
//! cluster (those come from the SidecarRelease and TlsPolicies).

use std::collections::BTreeMap;

use baton_crds::contract::{SYSTEM_NAMESPACE, webhook as webhook_names};

use k8s_openapi::{
    api::core::v1::ResourceRequirements, apimachinery::pkg::api::resource::Quantity,
};

/// How app traffic reaches the sidecar.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CaptureMode {
    /// iptables REDIRECT programmed by the `baton-init` init container.
    #[default]
    Transparent,
    /// No iptables: the app is pointed at the sidecar by env vars.
    Explicit,
}

impl CaptureMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Transparent => "transparent",
            Self::Explicit => "explicit",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "transparent" => Some(Self::Transparent),
            "explicit" => Some(Self::Explicit),
            _ => None,
        }
    }
}

/// Whether sidecars are injected as native sidecars.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum NativeSidecars {
    /// From the API server version: native from 1.32, where a native
    /// sidecar's image can be swapped in place (see `NATIVE_SIDECARS_SINCE`).
    #[default]
    Auto,
    Always,
    Never,
}

/// Everything `mutate` needs that is not in the pod or the cluster.
#[derive(Clone, Debug)]
pub struct InjectConfig {
    /// Capture mode when the pod has no `baton.dev/capture-mode` annotation.
    pub default_capture: CaptureMode,
    pub native_sidecars: NativeSidecars,
    /// Path of the sidecar binary inside the sidecar image (exec hooks).
    pub sidecar_binary: String,
    /// Requests and limits of each sidecar slot when the release sets
    /// none (both slots get the same: docs/decisions/0035).
    pub default_resources: ResourceRequirements,
    /// Seconds the postStart hook waits for `/ready` (ordinary-container
    /// sidecars: servers before 1.32).
    pub wait_ready_timeout_seconds: u32,
    /// `imagePullPolicy` of injected containers (`None`: the default).
    pub image_pull_policy: Option<String>,
    /// Host (DNS name or IP) of the control plane that sidecars reach,
    /// injected as `BATON_CONTROL_PLANE_ADDRESS`. A cluster with DNS uses
    /// the operator Service's name; one without (the e2e cluster) its
    /// ClusterIP.
    pub control_plane_address: String,
    /// Injected sidecars take their config from the operator's push stream
    /// (`BATON_CONFIG_PUSH`), authenticating it with the mesh trust bundle
    /// the webhook copies into the Pod at admission (so a Pod is refused
    /// while there is none to copy). Off: they
    /// run the in-pod default (transparent passthrough) and Routes and
    /// TlsPolicies have no effect on them.
    pub config_push: bool,
    /// The mesh's SPIFFE trust domain (the operator's `--trust-domain`):
    /// admission refuses AuthorizationPolicies naming identities of another.
    pub trust_domain: String,
    /// Namespace of ConfigMap `baton-mesh-trust`, the operator's (the
    /// webhook's own): where the bundle copied into each Pod comes from.
    pub trust_namespace: String,
}

/// The operator Service's DNS name in `namespace`:
/// `baton-operator.<namespace>.svc`.
pub fn default_control_plane_address(namespace: &str) -> String {
    format!("{}.{namespace}.svc", webhook_names::OPERATOR_SERVICE)
}

fn quantities(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
        .collect()
}

impl Default for InjectConfig {
    fn default() -> Self {
        Self {
            default_capture: CaptureMode::Transparent,
            native_sidecars: NativeSidecars::Auto,
            sidecar_binary: "/usr/local/bin/baton-sidecar".to_owned(),
            default_resources: ResourceRequirements {
                requests: Some(quantities(&[("cpu", "50m"), ("memory", "32Mi")])),
                limits: Some(quantities(&[("memory", "128Mi")])),
                ..ResourceRequirements::default()
            },
            wait_ready_timeout_seconds: 60,
            image_pull_policy: None,
            control_plane_address: default_control_plane_address(SYSTEM_NAMESPACE),
            config_push: true,
            trust_domain: baton_crds::contract::identity::DEFAULT_TRUST_DOMAIN.to_owned(),
            trust_namespace: SYSTEM_NAMESPACE.to_owned(),
        }
    }
}
