//! `kubectl-baton`: on PATH, kubectl runs it as `kubectl baton`.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = baton_cli::Cli::parse();
    baton_cli::main(cli)
}
