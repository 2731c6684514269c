//! `kubectl baton inject`: what the webhook would inject. (being built)

use std::path::PathBuf;

use crate::{Ctx, Outcome};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Manifest to inject (`-` for standard input).
    #[arg(short = 'f', long = "filename")]
    pub file: PathBuf,
}

pub async fn run(_ctx: &Ctx, _args: Args) -> anyhow::Result<Outcome> {
    anyhow::bail!("inject: being built")
}
