//! `demo-load`: a bounded load client (count and time) that sends
//! byte-checked TCP streams, HTTP/1.1 requests or HTTP/2 streams to an echo
//! server, prints a report and exits non-zero when any exchange failed.

use std::time::Duration;

use baton_e2e::traffic::{self, Load, Protocol};
use clap::Parser;

#[derive(Parser)]
#[command(about = "Bounded byte-checked load client")]
struct Args {
    /// Echo server address (ip:port).
    #[arg(long)]
    target: std::net::SocketAddr,
    /// tcp, http1 or http2.
    #[arg(long, default_value = "http1")]
    protocol: Protocol,
    /// Number of exchanges (bounded; at most 1,000,000).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    exchanges: u32,
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    #[arg(long, default_value_t = 4096)]
    payload_bytes: usize,
    /// Time limit of one exchange, seconds.
    #[arg(long, default_value_t = 5)]
    timeout_secs: u64,
    /// Time limit of the whole run, seconds (at most 3600).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    deadline_secs: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let load = Load::new(args.protocol)
        .exchanges(args.exchanges as usize)
        .concurrency(args.concurrency)
        .payload_bytes(args.payload_bytes)
        .timeout(Duration::from_secs(args.timeout_secs))
        .deadline(Duration::from_secs(args.deadline_secs));
    let report = traffic::run(args.target, &load).await;
    println!("{report}");
    if !report.ok() {
        anyhow::bail!(
            "{} of {} exchanges failed",
            report.failures.len(),
            report.attempted
        );
    }
    Ok(())
}
