//! `baton-sidecar` binary: parse arguments, hand over to the library.
use clap::Parser;

/// jemalloc instead of glibc malloc: see docs/performance.md (allocator).
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> anyhow::Result<()> {
    baton_sidecar::cli::run(baton_sidecar::cli::Cli::parse())?;
    Ok(())
}
