//! The `kubectl-baton` binary's upgrade commands without a cluster: usage
//! errors, and a clear, bounded error when the API server is unreachable.

use std::process::Command;
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kubectl-baton"))
}

#[test]
fn upgrade_requires_a_version() {
    let out = bin().args(["upgrade", "default"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--version"));
}

#[test]
fn an_unreachable_cluster_is_a_clear_error_within_the_timeout() {
    let dir = std::env::temp_dir().join(format!("baton-upgrade-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("config");
    // Port 1 on loopback: refused at once (nothing listens there).
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\n\
         clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1', insecure-skip-tls-verify: true}}]\n\
         users: [{name: u, user: {token: t}}]\n\
         contexts: [{name: c, context: {cluster: c, user: u}}]\ncurrent-context: c\n",
    )
    .unwrap();
    for args in [
        &["upgrade", "default", "--version", "0.2.0", "--watch"][..],
        &["pause", "default"],
        &["resume", "default"],
        &["rollback", "default"],
    ] {
        let started = Instant::now();
        let out = bin()
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--timeout", "3s"])
            .args(args)
            .output()
            .unwrap();
        assert!(started.elapsed() < Duration::from_secs(10), "{args:?}");
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr
                .starts_with("error: get sidecarrelease \"default\": cannot reach the API server"),
            "{args:?}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
