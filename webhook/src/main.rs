//! `baton-webhook`: parse flags, run the library.
use clap::Parser;

fn main() -> anyhow::Result<()> {
    let args = baton_webhook::Args::parse();
    baton_webhook::init_tracing();
    baton_webhook::run_blocking(args)?;
    Ok(())
}
