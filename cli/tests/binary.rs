//! The `kubectl-baton` binary without a cluster: usage errors, and a clear,
//! bounded error when the API server refuses connections or never answers.

use std::net::TcpListener;
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
        let out = bin()
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--timeout", "3s"])
            .args(args)
            .output()
            .unwrap();
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

/// An API server that accepts connections and never answers: every command
/// ends on its own with a clear error (the client's read timeout and the
/// command's bound are `--timeout`), never hangs. The 120 s below only
/// tells a hang from an answer; it is not a performance bound.
#[test]
fn a_silent_api_server_ends_every_command_with_an_error_instead_of_a_hang() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // Hold every connection open without a byte in reply.
    std::thread::spawn(move || {
        let mut held = vec![];
        for conn in listener.incoming().flatten() {
            held.push(conn);
        }
    });
    let dir = std::env::temp_dir().join(format!("baton-silent-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("config");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\n\
             clusters: [{{name: c, cluster: {{server: 'https://{addr}', insecure-skip-tls-verify: true}}}}]\n\
             users: [{{name: u, user: {{token: t}}}}]\n\
             contexts: [{{name: c, context: {{cluster: c, user: u, namespace: shop}}}}]\ncurrent-context: c\n"
        ),
    )
    .unwrap();
    for args in [
        &["status"][..],
        &["check"],
        &["upgrade", "default", "--version", "0.2.0"],
        &["inject", "-f", "-"],
    ] {
        let mut child = bin()
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--timeout", "2s"])
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        {
            use std::io::Write as _;
            let mut stdin = child.stdin.take().unwrap();
            let _ = stdin.write_all(b"apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: a, image: i}]}\n");
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("{args:?} hung on a silent API server");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
