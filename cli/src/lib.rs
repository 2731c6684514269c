//! `baton-cli`: the `kubectl-baton` plugin, Baton's answer to `linkerd
//! check`, `istioctl proxy-status` and `linkerd inject`.
//!
//! ```text
//! check    is the mesh healthy? grouped checks, each with a hint (check/)
//! status   one row per injected Pod: version, slot, config sync, cert, handoff
//! upgrade  patch a SidecarRelease and follow its rollout (pause, resume, rollback)
//! inject   what the webhook would inject, offline (the webhook's own `mutate`)
//! ```
//!
//! Every command is bounded: each API call by `--timeout` through the
//! client's connect / read / write timeouts, and the whole command by the
//! same budget ([`Ctx::bounded`]), except `upgrade --watch`, which follows a
//! rollout for at most `--watch-timeout`. An unreachable cluster is a clear
//! error inside the budget, never a hang. Exit status: 0 on success, 1 when
//! the answer is "no" (a failed check, a rollout that paused) or on an
//! error, 2 on a usage error (clap's).
//!
//! Each command keeps its verdicts pure (plain functions over API objects,
//! unit-tested with recorded objects) and its I/O in a thin `run`.

pub mod check;
pub mod client;
pub mod inject;
pub mod output;
pub mod status;
pub mod upgrade;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

pub use client::Ctx;
pub use output::Format;

/// `kubectl baton`: see and steer the Baton mesh.
#[derive(Debug, Parser)]
#[command(name = "kubectl-baton", bin_name = "kubectl baton", version, about)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Flags every command takes, as kubectl spells them.
#[derive(Debug, Clone, clap::Args)]
pub struct Global {
    /// Kubeconfig context to use (default: the current context).
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// Path of the kubeconfig (default: $KUBECONFIG, then ~/.kube/config).
    #[arg(long, global = true, env = "KUBECONFIG")]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Namespace (default: the context's namespace, then `default`).
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    /// Every namespace.
    #[arg(short = 'A', long, global = true)]
    pub all_namespaces: bool,
    /// Output format.
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Format::Table)]
    pub output: Format,
    /// Bound on every API call and on the whole command (`30s`, `2m`, `500ms`
    /// or plain seconds).
    #[arg(long, global = true, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Is the mesh healthy? Grouped checks with a hint for each failure.
    Check(check::Args),
    /// One row per injected Pod: release, version, slot, config sync,
    /// certificate expiry, last handoff; and a summary per release.
    Status(status::Args),
    /// Move a SidecarRelease to a new version, and follow the rollout.
    Upgrade(upgrade::UpgradeArgs),
    /// Pause a SidecarRelease's rollout.
    Pause(upgrade::ReleaseArgs),
    /// Resume a paused rollout.
    Resume(upgrade::ReleaseArgs),
    /// Return a SidecarRelease to the previous version it completed.
    Rollback(upgrade::ReleaseArgs),
    /// Print a manifest with what the webhook would inject (the webhook's
    /// own mutation; offline with `--release FILE`).
    Inject(inject::Args),
}

/// Runs the command; the exit status is the process's.
pub fn main(cli: Cli) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(Outcome::Success) => ExitCode::SUCCESS,
        Ok(Outcome::Failure) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// What a command concluded (errors are `Err`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Exit 0.
    Success,
    /// Exit 1: the command ran and its answer is "no" (it printed why).
    Failure,
}

impl Outcome {
    pub fn from_ok(ok: bool) -> Self {
        if ok { Self::Success } else { Self::Failure }
    }
}

/// Dispatches one command.
pub async fn run(cli: Cli) -> anyhow::Result<Outcome> {
    // kube's TLS stack needs a process-wide rustls provider; the workspace
    // builds rustls with ring only.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ctx = Ctx::new(cli.global);
    match cli.command {
        Command::Check(args) => check::run(&ctx, args).await,
        Command::Status(args) => status::run(&ctx, args).await,
        Command::Upgrade(args) => upgrade::upgrade(&ctx, args).await,
        Command::Pause(args) => upgrade::pause(&ctx, args, true).await,
        Command::Resume(args) => upgrade::pause(&ctx, args, false).await,
        Command::Rollback(args) => upgrade::rollback(&ctx, args).await,
        Command::Inject(args) => inject::run(&ctx, args).await,
    }
}

/// `30s`, `2m`, `1h`, `500ms`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a duration: use 30s, 2m, 1h, 500ms or seconds"))?;
    let d = match unit {
        "" | "s" => Duration::from_secs(n),
        "ms" => Duration::from_millis(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use ms, s, m or h)")),
    };
    if d.is_zero() {
        return Err("a timeout of zero would fail every call".into());
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_as_kubectl_spells_them() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("3d").unwrap_err().contains("unknown unit"));
        assert!(
            parse_duration("soon")
                .unwrap_err()
                .contains("not a duration")
        );
    }

    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
