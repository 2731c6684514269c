//! `baton-contract`: every name shared between Baton's parts: labels,
//! annotations, env vars, ports, paths on the shared volume, container and
//! volume names.
//!
//! This crate is deliberately kube-free and dependency-free (plain
//! `&str`/`u16` constants) so the sidecar, its config model and the handoff
//! can depend on it without pulling in kube or the CRD types: the webhook
//! writes these names into pods, the sidecar reads them back, and the
//! operator watches them. `baton_crds::contract` re-exports it for the
//! control plane. Changing a value here is a wire-compatibility change
//! between versions.

/// API group of every Baton CRD.
pub const GROUP: &str = "baton.dev";
/// API version of every Baton CRD.
pub const VERSION: &str = "v1alpha1";
/// Namespace the control plane is installed into; never injected.
pub const SYSTEM_NAMESPACE: &str = "baton-system";
/// Namespaces that are never injected, whatever their labels say.
pub const NEVER_INJECT_NAMESPACES: &[&str] = &["kube-system", "kube-public", SYSTEM_NAMESPACE];

/// Field manager used for server-side apply by Baton's controllers.
pub const FIELD_MANAGER: &str = "baton.dev/operator";

pub mod labels {
    //! Labels users (and Baton) put on namespaces and pods.

    /// `enabled` on a namespace or pod opts in; `disabled` on a pod opts out.
    pub const INJECT: &str = "baton.dev/inject";
    pub const INJECT_ENABLED: &str = "enabled";
    pub const INJECT_DISABLED: &str = "disabled";
    /// Set on injected pods so controllers can select them cheaply.
    pub const INJECTED: &str = "baton.dev/injected";
    /// Name of the SidecarRelease an injected pod follows.
    pub const RELEASE: &str = "baton.dev/release";
}

pub mod annotations {
    //! Annotations recording what an injected pod runs, and user knobs.

    /// Name of the SidecarRelease that injected the pod.
    pub const RELEASE: &str = "baton.dev/release";
    /// Sidecar version currently running in the active slot.
    pub const VERSION: &str = "baton.dev/version";
    /// Hash of the injected sidecar spec (idempotence and drift detection).
    pub const CONFIG_HASH: &str = "baton.dev/config-hash";
    /// Which slot (`a` or `b`) holds the serving sidecar.
    pub const ACTIVE_SLOT: &str = "baton.dev/active-slot";
    /// Injection status (`injected`), written once by the webhook.
    pub const STATUS: &str = "baton.dev/status";
    /// Capture mode: `transparent` (iptables) or `explicit`.
    pub const CAPTURE_MODE: &str = "baton.dev/capture-mode";
    /// Comma-separated inbound ports not redirected to the sidecar.
    pub const EXCLUDE_INBOUND_PORTS: &str = "baton.dev/exclude-inbound-ports";
    /// Comma-separated outbound ports not redirected to the sidecar.
    pub const EXCLUDE_OUTBOUND_PORTS: &str = "baton.dev/exclude-outbound-ports";
    /// Comma-separated outbound CIDRs not redirected to the sidecar.
    pub const EXCLUDE_OUTBOUND_CIDRS: &str = "baton.dev/exclude-outbound-cidrs";
    /// Private-key offload decision: `qat`, `software-fallback` or `disabled`.
    pub const OFFLOAD: &str = "baton.dev/offload";
    /// Why offload fell back to software (free text, for `kubectl describe`).
    pub const OFFLOAD_FALLBACK_REASON: &str = "baton.dev/offload-fallback-reason";
    /// AcceleratorPool that granted the device, if any.
    pub const ACCELERATOR_POOL: &str = "baton.dev/accelerator-pool";
    /// Identifies a device grant (the admission request's uid): the pool's
    /// status lists the grants its books already count
    /// (`status.recentGrants`), so the webhook that granted stops counting
    /// it on top of them, exactly once.
    pub const OFFLOAD_GRANT: &str = "baton.dev/offload-grant";
    /// A hot upgrade in progress on the pod, written by the operator in the
    /// same patch that swaps the standby slot's image (JSON: `version`,
    /// `image`, `slot`, `fromVersion`, `startedAt`). It is what a new
    /// leader resumes from: the pod itself says what is under way.
    pub const UPGRADE: &str = "baton.dev/upgrade";
    /// The last failed hot upgrade (JSON: `version`, `reason`, `at`). A pod
    /// is not tried again for that version; removing the annotation retries.
    pub const UPGRADE_FAILED: &str = "baton.dev/upgrade-failed";
    /// The mesh trust bundle (PEM, public certificates only) the webhook
    /// copied from [`super::identity::TRUST_CONFIG_MAP`] in the operator's
    /// namespace when it admitted the pod; a downwardAPI volume shows it to
    /// both sidecar slots as [`super::volumes::TRUST_BUNDLE_PATH`] (Linkerd
    /// injects its trust anchors the same way). Later bundles reach the
    /// sidecar with its certificates (decision 0058).
    pub const TRUST_BUNDLE: &str = "baton.dev/trust-bundle";
    /// The last completed hot upgrade (JSON: `version`, `slot`,
    /// `fromVersion`, `startedAt`, `finishedAt` in unix seconds,
    /// `durationMs` as the new sidecar measured the takeover), written in
    /// the patch that ends it. The per-Pod record of every handoff: Events
    /// fold a Pod's repeats into one series, so they cannot be counted.
    pub const LAST_HANDOFF: &str = "baton.dev/last-handoff";
    /// On a Namespace: what its Pods' inbound sides do with requests no
    /// AuthorizationPolicy decides (`all-unauthenticated`,
    /// `all-authenticated`, `cluster-authenticated`, `deny`, `audit`);
    /// absent, the operator's `--default-authorization`.
    pub const DEFAULT_AUTHORIZATION: &str = "baton.dev/default-authorization";
    /// On a Pod: `"true"` writes an access log line per inbound request.
    pub const ACCESS_LOG: &str = "baton.dev/access-log";
}

pub mod containers {
    //! Container names the webhook injects.

    /// Active slot: runs the release image.
    pub const SLOT_A: &str = "baton-sidecar-a";
    /// Standby slot: runs the empty image until a hot upgrade.
    pub const SLOT_B: &str = "baton-sidecar-b";
    /// Init container that programs iptables for transparent capture.
    pub const INIT: &str = "baton-init";
}

pub mod volumes {
    //! Volumes the webhook injects and the paths the sidecar uses on them.

    /// emptyDir shared by both slots: handoff socket and status files.
    pub const SHARED: &str = "baton-shared";
    /// Where the shared volume is mounted in both slots.
    pub const SHARED_MOUNT_PATH: &str = "/var/run/baton";
    /// Unix socket the serving sidecar listens on for handoff requests.
    pub const HANDOFF_SOCKET: &str = "/var/run/baton/handoff.sock";
    /// JSON file the new sidecar writes when a handoff completes.
    pub const HANDOFF_STATUS_FILE: &str = "/var/run/baton/handoff-status.json";
    /// Prefix of the marker a handed-off sidecar leaves while it idles
    /// (`retired-a` / `retired-b` next to the handoff socket): a process
    /// the kubelet restarts in a retired slot idles instead of taking the
    /// connections back; `baton-empty` removes its slot's marker.
    pub const RETIRED_MARKER_PREFIX: &str = "retired-";
    /// Projected ServiceAccount token with the mesh audience.
    pub const TOKEN: &str = "baton-token";
    pub const TOKEN_MOUNT_PATH: &str = "/var/run/secrets/baton.dev/identity";
    pub const TOKEN_FILE: &str = "token";
    /// Audience of the projected token, checked by the identity service.
    pub const TOKEN_AUDIENCE: &str = "identity.baton.dev";
    pub const TOKEN_EXPIRATION_SECONDS: i64 = 86_400;
    /// The mesh trust bundle as of the Pod's admission: a downwardAPI
    /// volume of the Pod's own annotation
    /// [`super::annotations::TRUST_BUNDLE`] (the webhook copies it from
    /// [`super::identity::TRUST_CONFIG_MAP`] in the operator's namespace).
    pub const TRUST: &str = "baton-trust";
    pub const TRUST_MOUNT_PATH: &str = "/var/run/secrets/baton.dev/trust";
    /// The bundle file in that mount (PEM, public certificates only).
    pub const TRUST_BUNDLE_PATH: &str = "/var/run/secrets/baton.dev/trust/ca.crt";
    /// The newest trust bundle a sidecar of the Pod learned from the
    /// identity service, kept on the shared volume so a restarted or newly
    /// started slot (hot upgrade) trusts it too: the admission-time bundle
    /// may predate a root rotation. Sidecars trust the union of both.
    pub const TRUST_STATE_FILE: &str = "/var/run/baton/trust-bundle.pem";
    /// The `kubernetes.io/tls` Secret a TlsPolicy with `certificate.source:
    /// Secret` names, mounted into both slots of the Pods it selects when
    /// they are admitted. The kubelet reads it with the Pod's authority and
    /// refreshes the files when the Secret changes; the sidecar polls them
    /// (its `files` certificate source). The operator never reads Secrets.
    pub const TLS_SECRET: &str = "baton-tls-secret";
    pub const TLS_SECRET_MOUNT_PATH: &str = "/var/run/secrets/baton.dev/tls";
    /// The certificate chain in that mount (the Secret's `tls.crt`).
    pub const TLS_SECRET_CERT_PATH: &str = "/var/run/secrets/baton.dev/tls/tls.crt";
    /// The private key in that mount (the Secret's `tls.key`).
    pub const TLS_SECRET_KEY_PATH: &str = "/var/run/secrets/baton.dev/tls/tls.key";
}

pub mod kubernetes {
    //! Facts about Kubernetes versions that the webhook (how it injects) and
    //! the operator (how it upgrades) must agree on.

    /// First `(major, minor)` whose kubelet restarts a native sidecar (an
    /// init container with `restartPolicy: Always`) when its image changes:
    /// kubernetes issue 121333, fixed by PR 126525 in 1.32. Native sidecars
    /// exist from 1.29 (beta, on by default), but a kubelet before 1.32
    /// accepts the new image in the spec and keeps running the old
    /// container, so a hot upgrade of one could never start and the Pod
    /// would have to be evicted. The webhook injects native sidecars from
    /// this version on (ordinary containers before it), and the operator
    /// evicts instead of swapping in place on a node whose kubelet is older
    /// (version skew).
    pub const NATIVE_SIDECAR_IMAGE_UPDATE_SINCE: (u32, u32) = (1, 32);
}

pub mod ports {
    //! Well-known sidecar ports.

    /// Outbound listener: app → mesh (iptables REDIRECT target in transparent mode).
    pub const OUTBOUND: u16 = 15001;
    /// Inbound listener: mesh → app.
    pub const INBOUND: u16 = 15006;
    /// Admin listener: /metrics, /ready, /live, /config, /log-level, /shutdown.
    pub const ADMIN: u16 = 15020;
    /// Name of the admin port on the injected container.
    pub const ADMIN_NAME: &str = "baton-admin";
}

pub mod env {
    //! Environment variables the webhook sets and the sidecar reads.

    pub const POD_NAME: &str = "BATON_POD_NAME";
    pub const POD_NAMESPACE: &str = "BATON_POD_NAMESPACE";
    pub const POD_IP: &str = "BATON_POD_IP";
    pub const SERVICE_ACCOUNT: &str = "BATON_SERVICE_ACCOUNT";
    /// `a` or `b`: which slot this process runs in.
    pub const SLOT: &str = "BATON_SLOT";
    /// Sidecar version the release asked for (informational).
    pub const VERSION: &str = "BATON_VERSION";
    /// Host (DNS name or IP) of the control plane (the operator Service)
    /// that sidecars reach; the webhook's `--control-plane-address`.
    pub const CONTROL_PLANE_ADDRESS: &str = "BATON_CONTROL_PLANE_ADDRESS";
    /// `true`: take config from the operator's push stream.
    pub const CONFIG_PUSH: &str = "BATON_CONFIG_PUSH";
    /// CA bundle (path) that authenticates the control plane.
    pub const CONTROL_PLANE_CA: &str = "BATON_CONTROL_PLANE_CA";
    /// Where the sidecar keeps the newest trust bundle it learned
    /// (`volumes::TRUST_STATE_FILE` on injected pods; unset: kept nowhere).
    pub const TRUST_STATE: &str = "BATON_TRUST_STATE";
    /// Path of a standalone YAML config (overrides the operator stream).
    pub const CONFIG: &str = "BATON_CONFIG";
    pub const LOG: &str = "BATON_LOG";
    /// Private-key offload engine chosen at injection: `openssl`, `software`.
    pub const OFFLOAD_ENGINE: &str = "BATON_OFFLOAD_ENGINE";
    /// Offload mode from the TlsPolicy: `Disabled`, `Preferred`, `Required`.
    pub const OFFLOAD_MODE: &str = "BATON_OFFLOAD_MODE";
    /// Explicit capture: the app sends outbound traffic to this `host:port`.
    pub const OUTBOUND_PROXY: &str = "BATON_OUTBOUND_PROXY";
    /// Explicit capture for HTTP clients that honour it.
    pub const HTTP_PROXY: &str = "HTTP_PROXY";
    /// Comma-separated exclusions passed to `baton-sidecar init`.
    pub const EXCLUDE_INBOUND_PORTS: &str = "BATON_EXCLUDE_INBOUND_PORTS";
    pub const EXCLUDE_OUTBOUND_PORTS: &str = "BATON_EXCLUDE_OUTBOUND_PORTS";
    pub const EXCLUDE_OUTBOUND_CIDRS: &str = "BATON_EXCLUDE_OUTBOUND_CIDRS";
    /// Handoff socket path (default `volumes::HANDOFF_SOCKET`; tests override it).
    pub const HANDOFF_SOCKET: &str = "BATON_HANDOFF_SOCKET";
    /// Handoff status file path (default `volumes::HANDOFF_STATUS_FILE`).
    pub const HANDOFF_STATUS_FILE: &str = "BATON_HANDOFF_STATUS_FILE";
    /// A handoff step with no progress for this long fails (old keeps serving).
    pub const HANDOFF_TIMEOUT_MS: &str = "BATON_HANDOFF_TIMEOUT_MS";
    /// How long the old process waits for in-flight requests to reach a safe point.
    pub const HANDOFF_PARK_TIMEOUT_MS: &str = "BATON_HANDOFF_PARK_TIMEOUT_MS";
    /// UIDs (comma-separated) allowed to take over on the handoff socket in
    /// addition to the sidecar's own effective UID (checked with SO_PEERCRED).
    pub const HANDOFF_PEER_UIDS: &str = "BATON_HANDOFF_PEER_UIDS";
    /// `1` (the webhook sets it on both slots): after handing off, the old
    /// process stays alive and idle instead of exiting, so the kubelet does
    /// not restart it into a second sidecar that would take the connections
    /// back; the operator then swaps its slot back to the idle image.
    /// Unset (standalone use): the old process exits.
    pub const IDLE_AFTER_HANDOFF: &str = "BATON_IDLE_AFTER_HANDOFF";
    /// Testing knob: advertise protocol versions `MIN-MAX` instead of this build's.
    pub const HANDOFF_PROTOCOL_RANGE: &str = "BATON_HANDOFF_PROTOCOL_RANGE";
    /// Testing knob: the sidecar refuses (NACKs) every pushed config with a
    /// route whose name contains this value, as it refuses an invalid one,
    /// and keeps serving its last good config (e2e: a STALE sidecar).
    pub const TEST_REFUSE_ROUTE: &str = "BATON_TEST_REFUSE_ROUTE";
    /// Testing knob: the new process waits this long before each step, so
    /// chaos tests can kill it at any point of a handoff.
    pub const HANDOFF_TEST_STEP_DELAY_MS: &str = "BATON_HANDOFF_TEST_STEP_DELAY_MS";
}

pub mod webhook {
    //! Names of the admission webhook's Kubernetes objects and endpoints,
    //! shared by the manifests, the webhook (which patches `caBundle` into the
    //! configurations) and the e2e tests.

    /// Service (and Deployment) of the webhook in [`super::SYSTEM_NAMESPACE`].
    pub const SERVICE: &str = "baton-webhook";
    /// The operator's Service, which sidecars reach as
    /// `<OPERATOR_SERVICE>.<namespace>.svc` unless the webhook is told
    /// otherwise (`--control-plane-address`).
    pub const OPERATOR_SERVICE: &str = "baton-operator";
    /// Port the webhook Service exposes (and the container's HTTPS port).
    pub const PORT: u16 = 8443;
    /// Admin port of the webhook process: /ready, /live, /metrics.
    pub const ADMIN_PORT: u16 = 9443;
    /// MutatingWebhookConfiguration holding the pod injector.
    pub const MUTATING_CONFIGURATION: &str = "baton-sidecar-injector";
    /// Name of the injector webhook inside that configuration.
    pub const MUTATING_WEBHOOK: &str = "inject.baton.dev";
    /// Second injector entry of the same configuration: pods labelled
    /// `baton.dev/inject=enabled` in namespaces that did not opt in.
    pub const MUTATING_WEBHOOK_POD_OPT_IN: &str = "inject-pod.baton.dev";
    /// ValidatingWebhookConfiguration for Baton's CRDs.
    pub const VALIDATING_CONFIGURATION: &str = "baton-validator";
    /// Name of the validating webhook inside that configuration.
    pub const VALIDATING_WEBHOOK: &str = "validate.baton.dev";
    /// Secret (in [`super::SYSTEM_NAMESPACE`]) holding the self-managed CA.
    pub const CA_SECRET: &str = "baton-webhook-ca";
    /// Keys of that Secret.
    pub const CA_CERT_KEY: &str = "ca.crt";
    pub const CA_KEY_KEY: &str = "ca.key";
    /// Every CA certificate still trusted (current first, then the previous
    /// one until it expires), which is what goes into `caBundle`.
    pub const CA_BUNDLE_KEY: &str = "ca-bundle.crt";
    /// HTTP path of pod injection.
    pub const MUTATE_PODS_PATH: &str = "/mutate-pods";
    /// HTTP path of Baton CRD validation.
    pub const VALIDATE_PATH: &str = "/validate";
    /// Event reason when no SidecarRelease selects an opted-in pod.
    pub const EVENT_REASON_NO_RELEASE: &str = "NoSidecarRelease";
    /// Event reason when QAT offload is Required but no device is free.
    pub const EVENT_REASON_OFFLOAD_DENIED: &str = "OffloadUnavailable";
    /// Event reason when an opted-in pod is refused because the operator
    /// has not published the mesh trust bundle yet.
    pub const EVENT_REASON_NO_TRUST_BUNDLE: &str = "NoMeshTrustBundle";
}

pub mod identity {
    //! The operator's identity service (mesh CA): its Service, port, path
    //! and CA Secret, shared by the operator, the manifests and e2e.

    /// Service in [`super::SYSTEM_NAMESPACE`] in front of the operator's
    /// identity port.
    pub const SERVICE: &str = "baton-identity";
    /// HTTPS port of the identity endpoint on every operator replica.
    pub const PORT: u16 = 8443;
    /// Path the sidecar POSTs its CSR to.
    pub const SIGN_PATH: &str = "/v1/sign";
    /// Secret (in [`super::SYSTEM_NAMESPACE`]) holding the mesh CA:
    /// `tls.crt`, `tls.key`, `ca.crt` (cert-manager's layout).
    pub const CA_SECRET: &str = "baton-identity-ca";
    /// Trust domain of workload identities unless configured otherwise.
    pub const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";
    /// ConfigMap the operator keeps in its own namespace with the mesh
    /// trust bundle (public certificates only) and the root rotation phase;
    /// the webhook copies the bundle into each Pod it injects (annotation
    /// [`super::annotations::TRUST_BUNDLE`], decision 0058). Operators
    /// before that decision also wrote it into every namespace.
    pub const TRUST_CONFIG_MAP: &str = "baton-mesh-trust";
    /// Key of the bundle in that ConfigMap (and file name in the mount).
    pub const TRUST_KEY: &str = "ca.crt";
    /// Annotation of the operator namespace's [`TRUST_CONFIG_MAP`]: the
    /// root rotation phase the leader observes (`TrustStable`,
    /// `TrustingNewRoot`, `NewRootTrusted`, `IssuingFromNewRoot`,
    /// `OldRootRemovable`, `Reissuing`; docs/tls.md).
    pub const TRUST_PHASE_ANNOTATION: &str = "baton.dev/trust-phase";
    /// Its companion: the trust generation that phase is about.
    pub const TRUST_GENERATION_ANNOTATION: &str = "baton.dev/trust-generation";
    /// Its companion: the phase's sentence (sidecars re-issued, next step).
    pub const TRUST_PROGRESS_ANNOTATION: &str = "baton.dev/trust-progress";
    /// Port of the config push endpoint (HTTP/2 over TLS) on every replica.
    pub const CONFIG_PUSH_PORT: u16 = 8444;
}

pub mod commands {
    //! `baton-sidecar` subcommands the webhook writes into pod specs.

    /// `baton-sidecar run`: the proxy (args of the sidecar slots).
    pub const RUN: &str = "run";
    /// `baton-sidecar init`: programs iptables for transparent capture.
    pub const INIT: &str = "init";
    /// `baton-sidecar wait-ready`: blocks until the local admin port answers
    /// `/ready` 200 (postStart hook of the active slot on servers without
    /// native sidecars, so app containers start after the proxy is ready).
    pub const WAIT_READY: &str = "wait-ready";
    /// Admin path that makes the sidecar exit 0 (Jobs on servers without
    /// native sidecars call it when the app finishes).
    pub const SHUTDOWN_PATH: &str = "/shutdown";
    /// Admin readiness / liveness paths.
    pub const READY_PATH: &str = "/ready";
    pub const LIVE_PATH: &str = "/live";
}

/// UID the sidecar runs as; iptables exempts its traffic from capture.
pub const SIDECAR_UID: i64 = 2137;

/// Default extended resource name of Intel QAT crypto devices.
pub const DEFAULT_QAT_RESOURCE: &str = "qat.intel.com/cy";

/// Handoff protocol version spoken by this build. Adjacent versions
/// (N-1, N, N+1) must interoperate in both directions.
///
/// - 1: listeners, state, raw TCP / HTTP/1.1 connections, inbound TLS state.
/// - 2: raw TCP connections also move with an originated (upstream) mesh
///   mTLS session; with a version-1 peer such connections stay and drain.
/// - 3: idle HTTP/2 connections move too (decision 0062); with a version-2
///   peer they get GOAWAY and drain on the old process, as before.
pub const HANDOFF_PROTOCOL_VERSION: u32 = 3;
