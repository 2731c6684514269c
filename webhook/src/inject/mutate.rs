//! `mutate`: the whole injection decision and patch, as one pure function.
//!
//! Inputs are the pod as the API server sent it and a [`ClusterView`] (the
//! caches' contents at the time of the call); the output is either a skip
//! (allowed, no patch), a JSON patch, or a [`Denial`] with the message the
//! user sees. Nothing here does I/O, so every case is a plain unit test.
//!
//! The patch only ever *adds*: it never rewrites or removes anything the
//! user wrote, so applying it to the object it was computed from cannot
//! clobber a concurrent change (the API server applies it to exactly that
//! object). Missing maps and lists are added whole; present ones get one
//! `add` per entry.

use std::{collections::BTreeMap, sync::Arc};

use baton_crds::{
    AcceleratorPool, SidecarRelease, TlsPolicy,
    contract::{annotations, labels, ports},
};
use json_patch::{AddOperation, Patch, PatchOperation, jsonptr::PointerBuf};
use k8s_openapi::api::core::v1::{Container, EnvVar, Node, Pod, ResourceRequirements};
use serde_json::Value;

use super::{
    config::{CaptureMode, InjectConfig, NativeSidecars},
    decision::{STATUS_INJECTED, Skip, reserved_container_names, should_inject},
    offload::{self, Offload},
    spec::{self, DeviceGrant, Exclusions, SlotInputs},
    version::ServerVersion,
};

/// The cluster state `mutate` reads (a snapshot of the caches).
#[derive(Clone, Copy, Debug)]
pub struct ClusterView<'a> {
    /// Namespace of the pod (from the admission request: on CREATE the
    /// pod's own `metadata.namespace` may be empty).
    pub namespace: &'a str,
    pub namespace_labels: &'a BTreeMap<String, String>,
    pub releases: &'a [Arc<SidecarRelease>],
    /// TlsPolicies of every namespace (filtered here).
    pub tls_policies: &'a [Arc<TlsPolicy>],
    pub pools: &'a [Arc<AcceleratorPool>],
    pub nodes: &'a [Arc<Node>],
    /// Devices this webhook replica granted in the last
    /// [`crate::handler::GRANT_MEMORY`] (maybe not yet in the pools' status).
    pub recent_grants: &'a [offload::RecentGrant],
    /// Names a device grant this admission makes: the admission request's
    /// uid, unique per request (the pod has no name or uid yet when it is
    /// created from `generateName`).
    pub grant_id: &'a str,
    pub server_version: ServerVersion,
    /// The mesh trust bundle (PEM) of ConfigMap `baton-mesh-trust` in the
    /// operator's namespace, `None` until the operator published it.
    pub trust_bundle: Option<&'a str>,
}

/// What `mutate` decided.
#[derive(Clone, Debug)]
pub enum Outcome {
    Skipped(Skip),
    Injected(Box<Injection>),
}

/// A successful injection: the patch and what it records.
#[derive(Clone, Debug)]
pub struct Injection {
    pub patch: Patch,
    pub release: String,
    pub version: String,
    pub native_sidecars: bool,
    pub capture: CaptureMode,
    pub offload: Offload,
    pub config_hash: String,
}

/// Why a pod is refused. Refusing (rather than admitting unmeshed) is the
/// safe side: `failurePolicy: Fail` already says opted-in pods never run
/// without the mesh, and a refusal carries a message saying what to fix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    pub reason: DenialReason,
    pub message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenialReason {
    /// Opted in, but no SidecarRelease selects the pod.
    NoRelease,
    /// TlsPolicy offload Required and no device is free.
    OffloadUnavailable,
    /// The pod already uses a container or volume name Baton injects.
    ReservedName,
    /// A `baton.dev/*` annotation on the pod does not parse.
    InvalidAnnotation,
    /// The pod has no spec.
    NoSpec,
    /// The sidecars take config from the operator, but the operator has not
    /// published the mesh trust bundle they would authenticate it with.
    NoTrustBundle,
}

impl DenialReason {
    pub fn metric_label(self) -> &'static str {
        match self {
            Self::NoRelease => "deny_no_release",
            Self::OffloadUnavailable => "deny_offload_unavailable",
            Self::ReservedName => "deny_reserved_name",
            Self::InvalidAnnotation => "deny_invalid_annotation",
            Self::NoSpec => "deny_no_spec",
            Self::NoTrustBundle => "deny_no_trust_bundle",
        }
    }

    /// Whether the denial deserves an Event on the namespace (things an
    /// operator fixes in the cluster, not typos in one manifest).
    pub fn wants_event(self) -> bool {
        matches!(
            self,
            Self::NoRelease | Self::OffloadUnavailable | Self::NoTrustBundle
        )
    }
}

impl Outcome {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Skipped(skip) => skip.metric_label(),
            Self::Injected(_) => "injected",
        }
    }
}

fn deny(reason: DenialReason, message: impl Into<String>) -> Denial {
    Denial {
        reason,
        message: message.into(),
    }
}

/// How the pod is named in messages (`generateName` on CREATE from a
/// controller, where `name` is still empty).
pub fn pod_display_name(pod: &Pod, namespace: &str) -> String {
    let m = &pod.metadata;
    let name = m
        .name
        .clone()
        .or_else(|| m.generate_name.as_ref().map(|g| format!("{g}<generated>")))
        .unwrap_or_else(|| "<unnamed>".to_owned());
    format!("{namespace}/{name}")
}

/// Computes the injection for `pod`. See the module docs.
pub fn mutate(pod: &Pod, view: &ClusterView<'_>, config: &InjectConfig) -> Result<Outcome, Denial> {
    if let Err(skip) = should_inject(pod, view.namespace, view.namespace_labels) {
        return Ok(Outcome::Skipped(skip));
    }
    let who = pod_display_name(pod, view.namespace);
    let spec = pod
        .spec
        .as_ref()
        .ok_or_else(|| deny(DenialReason::NoSpec, format!("pod {who} has no spec")))?;
    check_reserved_names(pod, &who)?;

    let empty = BTreeMap::new();
    let pod_labels = pod.metadata.labels.as_ref().unwrap_or(&empty);
    let pod_annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);

    let release = SidecarRelease::pick(
        view.releases.iter().map(AsRef::as_ref),
        view.namespace_labels,
        pod_labels,
    )
    .ok_or_else(|| {
        deny(
            DenialReason::NoRelease,
            format!(
                "pod {who} opted in to the Baton mesh ({} = {}), but no SidecarRelease selects it; \
                 create a SidecarRelease whose namespaceSelector and podSelector match, \
                 or label the pod {} = {} to run it without the mesh",
                labels::INJECT,
                labels::INJECT_ENABLED,
                labels::INJECT,
                labels::INJECT_DISABLED
            ),
        )
    })?;
    let release_name = release.metadata.name.clone().unwrap_or_default();
    // Without it the sidecars could not authenticate the operator: the Pod
    // would start but never turn ready. Refused instead, saying why (the
    // handler re-reads the ConfigMap live before it refuses).
    let trust_bundle = match view.trust_bundle {
        Some(b) => Some(b),
        None if config.config_push => {
            return Err(deny(
                DenialReason::NoTrustBundle,
                format!(
                    "pod {who} opted in to the Baton mesh, but the operator has not published the mesh \
                     trust bundle yet (ConfigMap {}/{}, key {}), which its sidecars need to \
                     authenticate the operator; check that baton-operator is running and has a CA \
                     (kubectl baton check), then retry",
                    config.trust_namespace,
                    baton_crds::contract::identity::TRUST_CONFIG_MAP,
                    baton_crds::contract::identity::TRUST_KEY
                ),
            ));
        }
        None => None,
    };

    let capture = match pod_annotations.get(annotations::CAPTURE_MODE) {
        None => config.default_capture,
        Some(v) => CaptureMode::parse(v).ok_or_else(|| {
            deny(
                DenialReason::InvalidAnnotation,
                format!(
                    "pod {who}: annotation {} = {v:?} is not a capture mode: use \"transparent\" or \"explicit\"",
                    annotations::CAPTURE_MODE
                ),
            )
        })?,
    };
    let exclusions = exclusions(pod_annotations, &who)?;

    let policy = offload::policy_for(view.tls_policies, view.namespace, pod_labels);
    let tls_secret = policy.and_then(|p| p.spec.certificate.secret_name());
    let pinned_node = spec.node_name.as_deref();
    let offload = offload::decide(
        policy,
        view.pools,
        view.nodes,
        pinned_node,
        view.recent_grants,
        view.grant_id,
        // Both slots request the device (a standby slot exists when the
        // release names an idle image).
        if release.spec.empty_image.is_some() {
            2
        } else {
            1
        },
    )
    .map_err(|message| {
        deny(
            DenialReason::OffloadUnavailable,
            format!("pod {who}: {message}"),
        )
    })?;

    let native = match config.native_sidecars {
        NativeSidecars::Auto => view.server_version.supports_native_sidecars(),
        NativeSidecars::Always => true,
        NativeSidecars::Never => false,
    };
    let resources: &ResourceRequirements = release
        .spec
        .resources
        .as_ref()
        .unwrap_or(&config.default_resources);
    let grant = match &offload {
        Offload::Granted {
            resource, devices, ..
        } => Some(DeviceGrant {
            resource: resource.clone(),
            count: *devices,
        }),
        _ => None,
    };
    let inputs = SlotInputs {
        image: &release.spec.image,
        empty_image: release.spec.empty_image.as_deref(),
        version: &release.spec.version,
        resources,
        native,
        offload_mode: offload.mode_str(),
        grant: grant.as_ref(),
        tls_secret,
        config,
    };
    let slot_a = spec::slot_a(&inputs);
    let slot_b = inputs.empty_image.map(|img| spec::slot_b(&inputs, img));
    let init = (capture == CaptureMode::Transparent)
        .then(|| spec::init_container(&release.spec.image, &exclusions, config));
    let volumes = spec::injected_volumes(tls_secret);

    let config_hash = config_hash(&slot_a, slot_b.as_ref(), init.as_ref(), capture);

    let mut ops = Ops::default();
    // Metadata first; values as recorded for the operator and the sidecar.
    let mut new_annotations: Vec<(&str, String)> = vec![
        (annotations::STATUS, STATUS_INJECTED.to_owned()),
        (annotations::RELEASE, release_name.clone()),
        (annotations::VERSION, release.spec.version.clone()),
        (annotations::CONFIG_HASH, config_hash.clone()),
        (annotations::ACTIVE_SLOT, "a".to_owned()),
        (annotations::CAPTURE_MODE, capture.as_str().to_owned()),
    ];
    new_annotations.extend(offload.annotations());
    if let Some(bundle) = trust_bundle {
        // Read by the sidecars through the downwardAPI volume (spec.rs).
        new_annotations.push((annotations::TRUST_BUNDLE, bundle.to_owned()));
    }
    if !native && !pod_annotations.contains_key(DEFAULT_CONTAINER_ANNOTATION) {
        // The sidecar is placed first: keep `kubectl logs/exec` on the app.
        if let Some(app) = spec.containers.first() {
            new_annotations.push((DEFAULT_CONTAINER_ANNOTATION, app.name.clone()));
        }
    }
    ops.add_map_entries(
        &["metadata", "annotations"],
        pod.metadata.annotations.is_some(),
        &new_annotations,
    );
    ops.add_map_entries(
        &["metadata", "labels"],
        pod.metadata.labels.is_some(),
        &[
            (labels::INJECTED, "true".to_owned()),
            (labels::RELEASE, release_name.clone()),
        ],
    );

    // Env of app containers (explicit capture), on the original indices,
    // before any container is inserted in front of them.
    if capture == CaptureMode::Explicit {
        let wanted = spec::explicit_capture_env();
        for (i, c) in spec.containers.iter().enumerate() {
            add_env(&mut ops, i, c, &wanted);
        }
    }

    ops.append_all(&["spec", "volumes"], spec.volumes.is_some(), &volumes);

    let has_init = spec.init_containers.is_some();
    if native {
        // [baton-init, slot a, slot b, ...user init containers]: user init
        // containers run after the proxy is ready, with the mesh.
        let mut front: Vec<Container> = Vec::new();
        front.extend(init);
        front.push(slot_a);
        front.extend(slot_b);
        ops.insert_front(&["spec", "initContainers"], has_init, &front);
    } else {
        // Ordinary containers placed first. baton-init goes last among the
        // init containers so user init containers keep plain network (no
        // proxy is running yet on these servers).
        if let Some(init) = init {
            ops.append_all(&["spec", "initContainers"], has_init, &[init]);
        }
        let mut front = vec![slot_a];
        front.extend(slot_b);
        ops.insert_front(&["spec", "containers"], true, &front);
    }

    Ok(Outcome::Injected(Box::new(Injection {
        patch: Patch(ops.0),
        release: release_name,
        version: release.spec.version.clone(),
        native_sidecars: native,
        capture,
        offload,
        config_hash,
    })))
}

/// `kubectl logs/exec` default container.
pub const DEFAULT_CONTAINER_ANNOTATION: &str = "kubectl.kubernetes.io/default-container";

fn check_reserved_names(pod: &Pod, who: &str) -> Result<(), Denial> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(());
    };
    let reserved = reserved_container_names();
    let taken = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .map(|c: &Container| c.name.as_str())
        .find(|n| reserved.contains(n));
    if let Some(name) = taken {
        return Err(deny(
            DenialReason::ReservedName,
            format!(
                "pod {who} has a container named {name:?}, which Baton injects: rename it, \
                 or label the pod {} = {} to run it without the mesh",
                labels::INJECT,
                labels::INJECT_DISABLED
            ),
        ));
    }
    let reserved = spec::reserved_volume_names();
    if let Some(v) = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| reserved.contains(&v.name.as_str()))
    {
        return Err(deny(
            DenialReason::ReservedName,
            format!(
                "pod {who} has a volume named {:?}, which Baton injects: rename it",
                v.name
            ),
        ));
    }
    Ok(())
}

fn parse_ports(value: &str, annotation: &str, who: &str) -> Result<Vec<u16>, Denial> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
                deny(
                    DenialReason::InvalidAnnotation,
                    format!(
                        "pod {who}: annotation {annotation} has {s:?}, which is not a port (1-65535); \
                         use a comma-separated list such as \"8080,9090\""
                    ),
                )
            })
        })
        .collect()
}

fn parse_cidrs(value: &str, annotation: &str, who: &str) -> Result<Vec<String>, Denial> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            if is_cidr(s) {
                Ok(s.to_owned())
            } else {
                Err(deny(
                    DenialReason::InvalidAnnotation,
                    format!(
                        "pod {who}: annotation {annotation} has {s:?}, which is not a CIDR; \
                         use a comma-separated list such as \"10.0.0.0/8,fd00::/8\""
                    ),
                ))
            }
        })
        .collect()
}

fn is_cidr(s: &str) -> bool {
    let Some((addr, len)) = s.split_once('/') else {
        return false;
    };
    let Ok(len) = len.parse::<u8>() else {
        return false;
    };
    match addr.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(_)) => len <= 32,
        Ok(std::net::IpAddr::V6(_)) => len <= 128,
        Err(_) => false,
    }
}

fn exclusions(pod_annotations: &BTreeMap<String, String>, who: &str) -> Result<Exclusions, Denial> {
    let get = |k: &str| pod_annotations.get(k).map(String::as_str).unwrap_or("");
    let mut inbound_ports = parse_ports(
        get(annotations::EXCLUDE_INBOUND_PORTS),
        annotations::EXCLUDE_INBOUND_PORTS,
        who,
    )?;
    // Kubelet probes the admin port on the pod IP: never redirect it.
    if !inbound_ports.contains(&ports::ADMIN) {
        inbound_ports.push(ports::ADMIN);
    }
    Ok(Exclusions {
        inbound_ports,
        outbound_ports: parse_ports(
            get(annotations::EXCLUDE_OUTBOUND_PORTS),
            annotations::EXCLUDE_OUTBOUND_PORTS,
            who,
        )?,
        outbound_cidrs: parse_cidrs(
            get(annotations::EXCLUDE_OUTBOUND_CIDRS),
            annotations::EXCLUDE_OUTBOUND_CIDRS,
            who,
        )?,
    })
}

fn add_env(ops: &mut Ops, index: usize, c: &Container, wanted: &[EnvVar]) {
    let idx = index.to_string();
    match &c.env {
        None => ops.add(&["spec", "containers", &idx, "env"], to_value(wanted)),
        Some(existing) => {
            for var in wanted {
                // Never override what the user set.
                if !existing.iter().any(|e| e.name == var.name) {
                    ops.add(&["spec", "containers", &idx, "env", "-"], to_value(var));
                }
            }
        }
    }
}

/// Stable FNV-1a 64 over the injected objects' JSON (k8s-openapi types
/// serialize deterministically). Used by the operator to detect drift.
fn config_hash(
    a: &Container,
    b: Option<&Container>,
    init: Option<&Container>,
    capture: CaptureMode,
) -> String {
    let doc = serde_json::json!({"a": a, "b": b, "init": init, "capture": capture.as_str()});
    let bytes = serde_json::to_vec(&doc).unwrap_or_default();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        h ^= u64::from(byte);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn to_value<T: serde::Serialize + ?Sized>(v: &T) -> Value {
    // k8s-openapi types and strings always serialize.
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// Accumulates `add` operations.
#[derive(Debug, Default)]
struct Ops(Vec<PatchOperation>);

impl Ops {
    fn add(&mut self, path: &[&str], value: Value) {
        self.0.push(PatchOperation::Add(AddOperation {
            path: PointerBuf::from_tokens(path.iter().copied()),
            value,
        }));
    }

    /// Adds string entries to a map, creating the map whole if absent.
    fn add_map_entries(&mut self, path: &[&str], present: bool, entries: &[(&str, String)]) {
        if present {
            for (k, v) in entries {
                let mut p = path.to_vec();
                p.push(k);
                self.add(&p, Value::String(v.clone()));
            }
        } else {
            let map: serde_json::Map<String, Value> = entries
                .iter()
                .map(|(k, v)| ((*k).to_owned(), Value::String(v.clone())))
                .collect();
            self.add(path, Value::Object(map));
        }
    }

    /// Appends items to a list, creating the list whole if absent.
    fn append_all<T: serde::Serialize>(&mut self, path: &[&str], present: bool, items: &[T]) {
        if items.is_empty() {
            return;
        }
        if present {
            for item in items {
                let mut p = path.to_vec();
                p.push("-");
                self.add(&p, to_value(item));
            }
        } else {
            self.add(path, to_value(&items));
        }
    }

    /// Inserts items at the front of a list, in order.
    fn insert_front<T: serde::Serialize>(&mut self, path: &[&str], present: bool, items: &[T]) {
        if items.is_empty() {
            return;
        }
        if present {
            for (i, item) in items.iter().enumerate() {
                let idx = i.to_string();
                let mut p = path.to_vec();
                p.push(&idx);
                self.add(&p, to_value(item));
            }
        } else {
            self.add(path, to_value(&items));
        }
    }
}
