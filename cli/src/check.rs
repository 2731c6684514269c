//! `kubectl baton check`: is the mesh healthy? (being built)

use crate::{Ctx, Outcome};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Before install: server version, the caller's permissions, conflicting
    /// webhook configurations.
    #[arg(long)]
    pub pre: bool,
    /// Run only this category of checks.
    #[arg(long)]
    pub category: Option<String>,
}

pub async fn run(_ctx: &Ctx, _args: Args) -> anyhow::Result<Outcome> {
    anyhow::bail!("check: being built")
}
