//! `kubectl baton` as a user runs it: the `kubectl-baton` binary of this
//! build (`BATON_CLI`, which `e2e/scripts/run-tests.sh` takes from the same
//! cargo build as the test binaries) against the e2e cluster's kubeconfig,
//! and `kubectl` with that binary on its PATH, so `kubectl baton …` works
//! as the plugin convention says.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::cluster::{kubeconfig_path, repo_root};

/// Environment variable naming the `kubectl-baton` binary under test.
pub const CLI_ENV: &str = "BATON_CLI";

/// The `kubectl-baton` binary.
///
/// # Panics
/// When `BATON_CLI` is unset or names no file: the harness sets it.
pub fn cli_path() -> PathBuf {
    match std::env::var_os(CLI_ENV) {
        Some(p) if PathBuf::from(&p).is_file() => PathBuf::from(p),
        other => panic!(
            "{CLI_ENV} ({other:?}) does not name the kubectl-baton binary: e2e/scripts/run-tests.sh sets it"
        ),
    }
}

/// A finished run.
#[derive(Debug)]
pub struct Run {
    /// The exit status (`None`: killed by a signal or by the bound).
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn ok(&self) -> bool {
        self.code == Some(0)
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout\n{}--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// A PATH with the plugin's directory first, for `kubectl baton` and for
/// shell blocks (the README's).
pub fn path_with_plugin() -> String {
    let dir = cli_path()
        .parent()
        .expect("the binary has a directory")
        .to_path_buf();
    let path = std::env::var("PATH").unwrap_or_default();
    format!("{}:{path}", dir.display())
}

/// Runs `command` with `stdin`, killed past `bound` (no run may hang a test).
fn run_bounded(mut command: Command, stdin: Option<&str>, bound: Duration) -> Run {
    command
        .current_dir(repo_root())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().expect("starting the command");
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        use std::io::Write as _;
        pipe.write_all(input.as_bytes()).expect("writing stdin");
    }
    // Drain both pipes on threads so a chatty child never blocks on them.
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    let deadline = Instant::now() + bound;
    let code = loop {
        match child.try_wait().expect("waiting for the command") {
            Some(status) => break status.code(),
            None if Instant::now() >= deadline => {
                // Our own child, by PID.
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let mut stderr = err_t.join().unwrap_or_default();
    if code.is_none() {
        stderr.push_str(&format!("\n[killed: still running after {bound:?}]\n"));
    }
    Run {
        code,
        stdout: out_t.join().unwrap_or_default(),
        stderr,
    }
}

/// `kubectl-baton --kubeconfig <e2e> ARGS`, at most `bound`.
pub fn baton(args: &[&str], bound: Duration) -> Run {
    baton_with_stdin(args, None, bound)
}

/// [`baton`] with `stdin` fed to it.
pub fn baton_with_stdin(args: &[&str], stdin: Option<&str>, bound: Duration) -> Run {
    let mut c = Command::new(cli_path());
    c.arg("--kubeconfig").arg(kubeconfig_path()).args(args);
    run_bounded(c, stdin, bound)
}

/// A shell command line as a user types it, with the e2e kubeconfig as
/// `KUBECONFIG` and the plugin on PATH, at most `bound`.
pub fn shell(line: &str, bound: Duration) -> Run {
    let mut c = Command::new("bash");
    c.args(["-euo", "pipefail", "-c", line])
        .env("KUBECONFIG", kubeconfig_path())
        .env("PATH", path_with_plugin());
    run_bounded(c, None, bound)
}

/// `kubectl --kubeconfig <e2e> ARGS` with `stdin`, at most `bound`.
pub fn kubectl_stdin(args: &[&str], stdin: &str, bound: Duration) -> Run {
    let mut c = Command::new("kubectl");
    c.arg("--kubeconfig").arg(kubeconfig_path()).args(args);
    run_bounded(c, Some(stdin), bound)
}
