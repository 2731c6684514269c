//! The objects Baton adds to a pod: the two sidecar slots, the capture init
//! container and the volumes. Pure constructors over k8s-openapi types.

use std::collections::BTreeMap;

use baton_crds::contract::{self, SIDECAR_UID, commands, containers, env, ports, volumes};
use k8s_openapi::{
    api::core::v1::{
        Capabilities, Container, ContainerPort, DownwardAPIVolumeFile, DownwardAPIVolumeSource,
        EmptyDirVolumeSource, EnvVar, EnvVarSource, ExecAction, HTTPGetAction, Lifecycle,
        LifecycleHandler, ObjectFieldSelector, Probe, ProjectedVolumeSource, ResourceRequirements,
        SecretVolumeSource, SecurityContext, ServiceAccountTokenProjection, Volume, VolumeMount,
        VolumeProjection,
    },
    apimachinery::pkg::{api::resource::Quantity, util::intstr::IntOrString},
};

use super::config::InjectConfig;

/// What the slots need to know about the grant of QAT devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceGrant {
    pub resource: String,
    pub count: i64,
}

/// Inputs of the slot builders, resolved by `mutate`.
#[derive(Clone, Debug)]
pub struct SlotInputs<'a> {
    pub image: &'a str,
    pub empty_image: Option<&'a str>,
    pub version: &'a str,
    pub resources: &'a ResourceRequirements,
    pub native: bool,
    pub offload_mode: &'a str,
    pub grant: Option<&'a DeviceGrant>,
    /// The Secret of the TlsPolicy that selects the Pod, when its
    /// certificate comes from one (`certificate.source: Secret`).
    pub tls_secret: Option<&'a str>,
    pub config: &'a InjectConfig,
}

pub fn env_value(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value.into()),
        value_from: None,
    }
}

fn env_field(name: &str, field_path: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: field_path.to_owned(),
                api_version: None,
            }),
            ..EnvVarSource::default()
        }),
    }
}

fn http_probe(path: &str, period: i32, failure_threshold: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::Int(i32::from(ports::ADMIN)),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failure_threshold),
        timeout_seconds: Some(1),
        ..Probe::default()
    }
}

fn sidecar_security_context(extra_caps: Vec<String>) -> SecurityContext {
    SecurityContext {
        run_as_user: Some(SIDECAR_UID),
        run_as_group: Some(SIDECAR_UID),
        run_as_non_root: Some(true),
        read_only_root_filesystem: Some(true),
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        capabilities: Some(Capabilities {
            add: (!extra_caps.is_empty()).then_some(extra_caps),
            drop: Some(vec!["ALL".to_owned()]),
        }),
        ..SecurityContext::default()
    }
}

fn sidecar_mounts(tls_secret: Option<&str>) -> Vec<VolumeMount> {
    let mut mounts = vec![
        VolumeMount {
            name: volumes::SHARED.to_owned(),
            mount_path: volumes::SHARED_MOUNT_PATH.to_owned(),
            ..VolumeMount::default()
        },
        VolumeMount {
            name: volumes::TOKEN.to_owned(),
            mount_path: volumes::TOKEN_MOUNT_PATH.to_owned(),
            read_only: Some(true),
            ..VolumeMount::default()
        },
        VolumeMount {
            name: volumes::TRUST.to_owned(),
            mount_path: volumes::TRUST_MOUNT_PATH.to_owned(),
            read_only: Some(true),
            ..VolumeMount::default()
        },
    ];
    if tls_secret.is_some() {
        mounts.push(VolumeMount {
            name: volumes::TLS_SECRET.to_owned(),
            mount_path: volumes::TLS_SECRET_MOUNT_PATH.to_owned(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
    }
    mounts
}

fn common_env(
    slot: &str,
    version: &str,
    offload_mode: &str,
    engine: &str,
    config: &InjectConfig,
) -> Vec<EnvVar> {
    vec![
        env_field(env::POD_NAME, "metadata.name"),
        env_field(env::POD_NAMESPACE, "metadata.namespace"),
        env_field(env::POD_IP, "status.podIP"),
        env_field(env::SERVICE_ACCOUNT, "spec.serviceAccountName"),
        env_value(env::SLOT, slot),
        env_value(env::VERSION, version),
        env_value(env::OFFLOAD_MODE, offload_mode),
        env_value(env::OFFLOAD_ENGINE, engine),
        // After a hot upgrade the old process idles until the operator
        // swaps its slot back to the idle image; exiting would make the
        // kubelet restart it into a second sidecar (docs/upgrade.md).
        env_value(env::IDLE_AFTER_HANDOFF, "1"),
        env_value(
            env::CONTROL_PLANE_ADDRESS,
            config.control_plane_address.clone(),
        ),
        env_value(
            env::CONFIG_PUSH,
            if config.config_push { "true" } else { "false" },
        ),
        env_value(env::CONTROL_PLANE_CA, volumes::TRUST_BUNDLE_PATH),
        // On the shared volume: a restarted slot, or the next process of a
        // hot upgrade, trusts the roots an earlier one learned after the
        // Pod was admitted (a root rotation; decision 0058).
        env_value(env::TRUST_STATE, volumes::TRUST_STATE_FILE),
    ]
}

/// The resources and extra capabilities of either slot: the release's
/// requests and limits, plus the granted devices. Both slots get exactly
/// the same (docs/decisions/0035, 0036): a hot upgrade hands the serving
/// role to the other slot, and Kubernetes before 1.33 cannot resize a
/// container in place, so whichever slot serves must already carry what
/// the release asks for, and the device a `Required` sidecar needs.
fn slot_resources(inputs: &SlotInputs<'_>) -> (ResourceRequirements, Vec<String>) {
    let mut resources = inputs.resources.clone();
    let mut caps = Vec::new();
    if let Some(grant) = inputs.grant {
        // Extended resources are limits-only (requests default to limits);
        // the scheduler then places the pod on a node with free devices.
        resources
            .limits
            .get_or_insert_with(BTreeMap::new)
            .insert(grant.resource.clone(), Quantity(grant.count.to_string()));
        if let Some(req) = resources.requests.as_mut() {
            req.remove(&grant.resource);
        }
        // QAT user-space drivers pin DMA memory.
        caps.push("IPC_LOCK".to_owned());
    }
    (resources, caps)
}

/// The active slot: the release image, serving from the start.
pub fn slot_a(inputs: &SlotInputs<'_>) -> Container {
    let (resources, caps) = slot_resources(inputs);
    let engine = offload_engine(inputs);
    let mut c = Container {
        name: containers::SLOT_A.to_owned(),
        image: Some(inputs.image.to_owned()),
        image_pull_policy: inputs.config.image_pull_policy.clone(),
        args: Some(vec![commands::RUN.to_owned()]),
        env: Some(common_env(
            "a",
            inputs.version,
            inputs.offload_mode,
            engine,
            inputs.config,
        )),
        ports: Some(vec![ContainerPort {
            name: Some(ports::ADMIN_NAME.to_owned()),
            container_port: i32::from(ports::ADMIN),
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        readiness_probe: Some(http_probe(commands::READY_PATH, 2, 3)),
        liveness_probe: Some(http_probe(commands::LIVE_PATH, 10, 3)),
        resources: Some(resources),
        security_context: Some(sidecar_security_context(caps)),
        volume_mounts: Some(sidecar_mounts(inputs.tls_secret)),
        termination_message_policy: Some("FallbackToLogsOnError".to_owned()),
        ..Container::default()
    };
    if inputs.native {
        // Native sidecar: the kubelet starts app containers only once the
        // startup probe passes, and stops the sidecar after they exit (so
        // Job pods complete).
        c.restart_policy = Some("Always".to_owned());
        c.startup_probe = Some(http_probe(commands::READY_PATH, 1, 120));
    } else {
        // Ordinary container placed first: the kubelet starts containers in
        // order and runs each postStart hook to completion before starting
        // the next container, so the app starts after the proxy is ready.
        c.lifecycle = Some(Lifecycle {
            post_start: Some(LifecycleHandler {
                exec: Some(ExecAction {
                    command: Some(vec![
                        inputs.config.sidecar_binary.clone(),
                        commands::WAIT_READY.to_owned(),
                        format!(
                            "--timeout-secs={}",
                            inputs.config.wait_ready_timeout_seconds
                        ),
                    ]),
                }),
                ..LifecycleHandler::default()
            }),
            ..Lifecycle::default()
        });
    }
    c
}

/// The offload engine both slots are told to use: the device's (OpenSSL
/// with the QAT provider) when the pod was granted devices. Each slot
/// requests its own devices (a device plugin allocates a device to one
/// container), so a sidecar upgraded into either slot finds a working
/// engine (docs/upgrade.md, "Accelerators").
fn offload_engine(inputs: &SlotInputs<'_>) -> &'static str {
    if inputs.grant.is_some() {
        "openssl"
    } else {
        "software"
    }
}

/// The standby slot: idles in the empty image until a hot upgrade swaps the
/// new sidecar into it, which then serves the pod until the next upgrade.
/// Its resources are slot a's (see [`slot_resources`]): the idle image uses
/// next to nothing of them, but the scheduler reserves them, which is the
/// price of a serving sidecar that never runs starved.
pub fn slot_b(inputs: &SlotInputs<'_>, empty_image: &str) -> Container {
    let (resources, caps) = slot_resources(inputs);
    Container {
        name: containers::SLOT_B.to_owned(),
        image: Some(empty_image.to_owned()),
        image_pull_policy: inputs.config.image_pull_policy.clone(),
        // The empty image ignores its arguments; when a hot upgrade swaps
        // the sidecar image in, this is what makes it run the proxy.
        args: Some(vec![commands::RUN.to_owned()]),
        env: Some(common_env(
            "b",
            inputs.version,
            inputs.offload_mode,
            offload_engine(inputs),
            inputs.config,
        )),
        resources: Some(resources),
        security_context: Some(sidecar_security_context(caps)),
        volume_mounts: Some(sidecar_mounts(inputs.tls_secret)),
        restart_policy: inputs.native.then(|| "Always".to_owned()),
        termination_message_policy: Some("FallbackToLogsOnError".to_owned()),
        ..Container::default()
    }
}

/// Port and CIDR exclusions for transparent capture.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Exclusions {
    pub inbound_ports: Vec<u16>,
    pub outbound_ports: Vec<u16>,
    pub outbound_cidrs: Vec<String>,
}

fn join<T: ToString>(v: &[T]) -> String {
    v.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The init container that programs iptables (transparent capture only).
/// It is the only container with NET_ADMIN/NET_RAW, runs as root, and exits.
pub fn init_container(image: &str, exclusions: &Exclusions, config: &InjectConfig) -> Container {
    Container {
        name: containers::INIT.to_owned(),
        image: Some(image.to_owned()),
        image_pull_policy: config.image_pull_policy.clone(),
        args: Some(vec![commands::INIT.to_owned()]),
        env: Some(vec![
            env_value(env::EXCLUDE_INBOUND_PORTS, join(&exclusions.inbound_ports)),
            env_value(
                env::EXCLUDE_OUTBOUND_PORTS,
                join(&exclusions.outbound_ports),
            ),
            env_value(
                env::EXCLUDE_OUTBOUND_CIDRS,
                exclusions.outbound_cidrs.join(","),
            ),
        ]),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_owned(), Quantity("10m".to_owned())),
                ("memory".to_owned(), Quantity("16Mi".to_owned())),
            ])),
            limits: Some(BTreeMap::from([(
                "memory".to_owned(),
                Quantity("64Mi".to_owned()),
            )])),
            ..ResourceRequirements::default()
        }),
        security_context: Some(SecurityContext {
            run_as_user: Some(0),
            run_as_group: Some(0),
            // Overrides a pod-level runAsNonRoot for this container only.
            run_as_non_root: Some(false),
            read_only_root_filesystem: Some(true),
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            capabilities: Some(Capabilities {
                add: Some(vec!["NET_ADMIN".to_owned(), "NET_RAW".to_owned()]),
                drop: Some(vec!["ALL".to_owned()]),
            }),
            ..SecurityContext::default()
        }),
        termination_message_policy: Some("FallbackToLogsOnError".to_owned()),
        ..Container::default()
    }
}

/// The env vars explicit capture gives app containers.
pub fn explicit_capture_env() -> Vec<EnvVar> {
    let outbound = format!("127.0.0.1:{}", ports::OUTBOUND);
    vec![
        env_value(env::OUTBOUND_PROXY, outbound.clone()),
        env_value(env::HTTP_PROXY, format!("http://{outbound}")),
    ]
}

/// The downwardAPI field of the trust bundle annotation.
pub fn trust_field_path() -> String {
    format!(
        "metadata.annotations['{}']",
        contract::annotations::TRUST_BUNDLE
    )
}

/// The shared emptyDir, the projected mesh-identity token, the mesh
/// trust bundle (from the Pod's annotation), and the TlsPolicy's Secret when the certificate comes
/// from one.
pub fn injected_volumes(tls_secret: Option<&str>) -> Vec<Volume> {
    let mut out = vec![
        Volume {
            name: volumes::SHARED.to_owned(),
            empty_dir: Some(EmptyDirVolumeSource {
                // tmpfs: the handoff socket and status files are tiny, and
                // nothing of the handoff should ever touch the node's disk.
                medium: Some("Memory".to_owned()),
                size_limit: Some(Quantity("16Mi".to_owned())),
            }),
            ..Volume::default()
        },
        Volume {
            name: volumes::TOKEN.to_owned(),
            projected: Some(ProjectedVolumeSource {
                sources: Some(vec![VolumeProjection {
                    service_account_token: Some(ServiceAccountTokenProjection {
                        audience: Some(volumes::TOKEN_AUDIENCE.to_owned()),
                        expiration_seconds: Some(volumes::TOKEN_EXPIRATION_SECONDS),
                        path: volumes::TOKEN_FILE.to_owned(),
                    }),
                    ..VolumeProjection::default()
                }]),
                // The default 0644: the sidecar runs as its own uid, and the
                // token is only useful to the mesh audience anyway.
                default_mode: None,
            }),
            ..Volume::default()
        },
        Volume {
            name: volumes::TRUST.to_owned(),
            // The bundle the webhook put in the Pod's own annotation: a
            // Pod can mount no ConfigMap of another namespace, and a copy
            // per namespace would need the operator to write ConfigMaps
            // everywhere (decision 0058). The file path is the one the
            // per-namespace ConfigMap used to have.
            downward_api: Some(DownwardAPIVolumeSource {
                items: Some(vec![DownwardAPIVolumeFile {
                    path: contract::identity::TRUST_KEY.to_owned(),
                    field_ref: Some(ObjectFieldSelector {
                        field_path: trust_field_path(),
                        ..ObjectFieldSelector::default()
                    }),
                    ..DownwardAPIVolumeFile::default()
                }]),
                ..DownwardAPIVolumeSource::default()
            }),
            ..Volume::default()
        },
    ];
    if let Some(name) = tls_secret {
        out.push(Volume {
            name: volumes::TLS_SECRET.to_owned(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(name.to_owned()),
                // A missing Secret must not keep the application from
                // starting: the sidecar finds no certificate, stays
                // not-ready with that reason and NACKs the config, which
                // the TlsPolicy's status shows; the kubelet fills the mount
                // once the Secret exists.
                optional: Some(true),
                // The default 0644 of the files: the sidecar runs as its
                // own uid without an fsGroup, and only the sidecar
                // containers mount the volume.
                default_mode: None,
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
    }
    out
}

/// Names of the volumes Baton injects.
pub fn reserved_volume_names() -> [&'static str; 4] {
    [
        contract::volumes::SHARED,
        contract::volumes::TOKEN,
        contract::volumes::TRUST,
        contract::volumes::TLS_SECRET,
    ]
}
