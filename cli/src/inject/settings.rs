//! The webhook's injection settings (its flags), so that `inject` computes
//! the patch with the same [`InjectConfig`] the running webhook uses.
//!
//! Precedence, per setting: a flag given to `kubectl baton inject`, then
//! (cluster mode) what the webhook's Deployment sets (its container args,
//! then its literal env values, as clap reads them in the webhook), then
//! the webhook's own defaults. The mapping from flags to [`InjectConfig`] is
//! the webhook's ([`baton_webhook::Args::inject_config`]), never a copy.

use baton_crds::contract::{SYSTEM_NAMESPACE, webhook as webhook_names};
use baton_webhook::{
    inject::InjectConfig,
    run::{CaptureArg, NativeArg},
};
use clap::{CommandFactory, FromArgMatches, parser::ValueSource};
use k8s_openapi::api::apps::v1::Deployment;

/// The webhook flags that shape the injection (same names as the
/// webhook's; unset: the webhook's setting, see the module docs).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct WebhookFlags {
    /// Capture mode for pods without a baton.dev/capture-mode annotation
    /// (webhook: --capture-mode).
    #[arg(long, value_enum, help_heading = "Webhook settings")]
    pub capture_mode: Option<CaptureArg>,
    /// Native sidecars: from the server version (auto), or forced
    /// (webhook: --native-sidecars).
    #[arg(long, value_enum, help_heading = "Webhook settings")]
    pub native_sidecars: Option<NativeArg>,
    /// Path of the sidecar binary in the sidecar image (webhook:
    /// --sidecar-binary).
    #[arg(long, help_heading = "Webhook settings")]
    pub sidecar_binary: Option<String>,
    /// imagePullPolicy of injected containers (webhook:
    /// --image-pull-policy / BATON_INJECT_IMAGE_PULL_POLICY).
    #[arg(long, help_heading = "Webhook settings")]
    pub image_pull_policy: Option<String>,
    /// Control-plane host injected as BATON_CONTROL_PLANE_ADDRESS (webhook:
    /// --control-plane-address / BATON_CONTROL_PLANE_ADDRESS; default
    /// baton-operator.<webhook namespace>.svc).
    #[arg(long, help_heading = "Webhook settings")]
    pub control_plane_address: Option<String>,
    /// Sidecars take their config from the operator's push stream (webhook:
    /// --config-push / BATON_INJECT_CONFIG_PUSH).
    #[arg(long, action = clap::ArgAction::Set, help_heading = "Webhook settings")]
    pub config_push: Option<bool>,
    /// Seconds the postStart hook of ordinary-container sidecars waits for
    /// the proxy (webhook: --wait-ready-timeout-secs).
    #[arg(long, help_heading = "Webhook settings")]
    pub wait_ready_timeout_secs: Option<u32>,
    /// Namespace the webhook runs in: where its Deployment is read (cluster
    /// mode) and what the default control-plane address names (webhook:
    /// --namespace / POD_NAMESPACE; default baton-system).
    #[arg(long, help_heading = "Webhook settings")]
    pub webhook_namespace: Option<String>,
}

impl WebhookFlags {
    /// `self`'s settings where set, else `other`'s.
    pub fn or(self, other: Self) -> Self {
        Self {
            capture_mode: self.capture_mode.or(other.capture_mode),
            native_sidecars: self.native_sidecars.or(other.native_sidecars),
            sidecar_binary: self.sidecar_binary.or(other.sidecar_binary),
            image_pull_policy: self.image_pull_policy.or(other.image_pull_policy),
            control_plane_address: self.control_plane_address.or(other.control_plane_address),
            config_push: self.config_push.or(other.config_push),
            wait_ready_timeout_secs: self
                .wait_ready_timeout_secs
                .or(other.wait_ready_timeout_secs),
            webhook_namespace: self.webhook_namespace.or(other.webhook_namespace),
        }
    }

    /// The namespace the webhook runs in.
    pub fn namespace(&self) -> &str {
        self.webhook_namespace
            .as_deref()
            .unwrap_or(SYSTEM_NAMESPACE)
    }

    /// The [`InjectConfig`] of a webhook running with these flags (and its defaults for the rest), through the webhook's
    /// own flag parser and mapping. The process environment (the webhook
    /// also reads `BATON_*` and `POD_NAMESPACE`) never leaks in: every
    /// setting it could fill is set explicitly.
    pub fn inject_config(&self) -> anyhow::Result<InjectConfig> {
        let mut args = parse_webhook_args(&[])?;
        self.namespace().clone_into(&mut args.namespace);
        if let Some(v) = self.capture_mode {
            args.capture_mode = v;
        }
        if let Some(v) = self.native_sidecars {
            args.native_sidecars = v;
        }
        if let Some(v) = &self.sidecar_binary {
            args.sidecar_binary.clone_from(v);
        }
        args.image_pull_policy.clone_from(&self.image_pull_policy);
        args.control_plane_address
            .clone_from(&self.control_plane_address);
        // The webhook's default (`default_value_t = true`), unless its env
        // var was set in this process.
        args.config_push = self.config_push.unwrap_or(true);
        if let Some(v) = self.wait_ready_timeout_secs {
            args.wait_ready_timeout_secs = v;
        }
        Ok(args.inject_config())
    }
}

fn parse_webhook_args(flags: &[String]) -> anyhow::Result<baton_webhook::Args> {
    let matches = webhook_command().try_get_matches_from(
        std::iter::once("baton-webhook".to_owned()).chain(flags.iter().cloned()),
    )?;
    Ok(baton_webhook::Args::from_arg_matches(&matches)?)
}

fn webhook_command() -> clap::Command {
    baton_webhook::Args::command()
}

/// Name of the webhook's Deployment (as the manifests install it).
pub const WEBHOOK_DEPLOYMENT: &str = webhook_names::SERVICE;

/// The injection settings a webhook Deployment runs with: its container's
/// command-line flags, then the literal values of the env vars the webhook
/// reads (values from Secrets or fields are not followed). Unknown flags
/// are an error (a webhook newer than this CLI).
pub fn flags_from_deployment(deployment: &Deployment) -> anyhow::Result<WebhookFlags> {
    let Some(container) = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| {
            s.containers
                .iter()
                .find(|c| c.name == "webhook")
                .or_else(|| s.containers.first())
        })
    else {
        return Ok(WebhookFlags::default());
    };
    let mut argv: Vec<String> = container
        .command
        .iter()
        .flatten()
        .skip(1)
        .cloned()
        .collect();
    argv.extend(container.args.iter().flatten().cloned());
    let matches = webhook_command().try_get_matches_from(
        std::iter::once("baton-webhook".to_owned()).chain(argv.iter().cloned()),
    )?;
    let given = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    let args = baton_webhook::Args::from_arg_matches(&matches)?;
    let env = |name: &str| {
        container
            .env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
    };
    let mut flags = WebhookFlags {
        capture_mode: given("capture_mode").then_some(args.capture_mode),
        native_sidecars: given("native_sidecars").then_some(args.native_sidecars),
        sidecar_binary: given("sidecar_binary").then(|| args.sidecar_binary.clone()),
        image_pull_policy: args
            .image_pull_policy
            .clone()
            .filter(|_| given("image_pull_policy")),
        control_plane_address: args
            .control_plane_address
            .clone()
            .filter(|_| given("control_plane_address")),
        config_push: given("config_push").then_some(args.config_push),
        wait_ready_timeout_secs: given("wait_ready_timeout_secs")
            .then_some(args.wait_ready_timeout_secs),
        // POD_NAMESPACE comes from the Pod's own namespace in the manifests.
        webhook_namespace: if given("namespace") {
            Some(args.namespace.clone())
        } else {
            deployment.metadata.namespace.clone()
        },
    };
    if flags.image_pull_policy.is_none() {
        flags.image_pull_policy = env("BATON_INJECT_IMAGE_PULL_POLICY");
    }
    if flags.control_plane_address.is_none() {
        flags.control_plane_address = env("BATON_CONTROL_PLANE_ADDRESS");
    }
    if flags.config_push.is_none()
        && let Some(v) = env("BATON_INJECT_CONFIG_PUSH")
    {
        flags.config_push = Some(v.trim().parse().map_err(|_| {
            anyhow::anyhow!("the webhook's BATON_INJECT_CONFIG_PUSH is {v:?}, not true or false")
        })?);
    }
    Ok(flags)
}
