//! `baton-sidecar` binary: parse arguments, hand over to the library.
use clap::Parser;

fn main() -> anyhow::Result<()> {
    baton_sidecar::cli::run(baton_sidecar::cli::Cli::parse())?;
    Ok(())
}
