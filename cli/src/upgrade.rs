//! `kubectl baton upgrade | pause | resume | rollback`. (being built)

use std::time::Duration;

use crate::{Ctx, Outcome};

#[derive(Debug, clap::Args)]
pub struct UpgradeArgs {
    /// The SidecarRelease (cluster-scoped).
    pub release: String,
    /// Sidecar version to roll out.
    #[arg(long)]
    pub version: String,
    /// Sidecar image (default: the release's image with its tag set to
    /// `--version`).
    #[arg(long)]
    pub image: Option<String>,
    #[command(flatten)]
    pub watch: WatchArgs,
}

#[derive(Debug, clap::Args)]
pub struct ReleaseArgs {
    /// The SidecarRelease (cluster-scoped).
    pub release: String,
    #[command(flatten)]
    pub watch: WatchArgs,
}

#[derive(Debug, Clone, clap::Args)]
pub struct WatchArgs {
    /// Follow the rollout until it is Complete (exit 0) or Paused /
    /// Degraded (exit 1, with the reason).
    #[arg(long, short = 'w')]
    pub watch: bool,
    /// Bound on `--watch`.
    #[arg(long, default_value = "10m", value_parser = crate::parse_duration)]
    pub watch_timeout: Duration,
}

pub async fn upgrade(_ctx: &Ctx, _args: UpgradeArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("upgrade: being built")
}

pub async fn pause(_ctx: &Ctx, _args: ReleaseArgs, _paused: bool) -> anyhow::Result<Outcome> {
    anyhow::bail!("pause: being built")
}

pub async fn rollback(_ctx: &Ctx, _args: ReleaseArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("rollback: being built")
}
