//! `kubectl baton status`: one row per injected Pod. (being built)

use crate::{Ctx, Outcome};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Label selector on Pods (`app=web,tier!=db`).
    #[arg(short = 'l', long)]
    pub selector: Option<String>,
}

pub async fn run(_ctx: &Ctx, _args: Args) -> anyhow::Result<Outcome> {
    anyhow::bail!("status: being built")
}
