//! Access to the e2e cluster: the kubeconfig comes from
//! `BATON_E2E_KUBECONFIG` only (never the user's own `KUBECONFIG`, so an
//! e2e test can never touch a real cluster by accident), plus `kubectl` for
//! the steps a user would do with it (apply -f, apply -k, get).

use std::path::{Path, PathBuf};
use std::process::Command;

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// Environment variable naming the e2e cluster's kubeconfig (set by
/// `e2e/run.sh` from `e2e/cluster.sh up`).
pub const KUBECONFIG_ENV: &str = "BATON_E2E_KUBECONFIG";

/// Path of the e2e cluster's kubeconfig.
///
/// # Panics
/// When `BATON_E2E_KUBECONFIG` is unset: e2e tests are `#[ignore]`d and only
/// meant to run through `e2e/run.sh`.
pub fn kubeconfig_path() -> PathBuf {
    match std::env::var_os(KUBECONFIG_ENV) {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => panic!(
            "{KUBECONFIG_ENV} is not set: e2e tests need the local cluster; run them with e2e/run.sh \
             (or `eval $(e2e/cluster.sh up | tail -1)` and export {KUBECONFIG_ENV})"
        ),
    }
}

/// A client for the e2e cluster.
pub async fn client() -> Client {
    // More than one rustls crypto backend is compiled into the workspace:
    // pick ring (the workspace's choice) explicitly, once per process.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let path = kubeconfig_path();
    let kubeconfig =
        Kubeconfig::read_from(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap_or_else(|e| panic!("kubeconfig {}: {e}", path.display()));
    Client::try_from(config).expect("building a kube client")
}

/// The repository root (the e2e crate's parent directory).
pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the e2e crate lives inside the repository")
}

/// Output of a finished `kubectl` run.
#[derive(Debug)]
pub struct KubectlOutput {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `kubectl` against the e2e cluster from the repository root.
pub fn kubectl(args: &[&str]) -> KubectlOutput {
    let output = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .args(args)
        .current_dir(repo_root())
        .output()
        .expect("running kubectl");
    KubectlOutput {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Runs `kubectl` and panics with its output when it fails.
#[track_caller]
pub fn kubectl_ok(args: &[&str]) -> String {
    let out = kubectl(args);
    assert!(
        out.success,
        "kubectl {} failed:\nstdout:\n{}\nstderr:\n{}",
        args.join(" "),
        out.stdout,
        out.stderr
    );
    out.stdout
}

/// Environment variable listing the components `e2e/run.sh` had to skip
/// (their binary did not build), `;`-separated.
pub const SKIPPED_ENV: &str = "BATON_E2E_SKIPPED";

/// Panics with a clear message when `component` (e.g. `webhook`) was skipped
/// by the harness: a test that needs it must fail, never pass silently.
#[track_caller]
pub fn require_component(component: &str) {
    let skipped = std::env::var(SKIPPED_ENV).unwrap_or_default();
    if let Some(entry) = skipped_entry(&skipped, component) {
        panic!("this test needs the {component}, which the harness skipped: {entry}");
    }
}

/// The entry of `component` in a `;`-separated skip list whose entries start
/// with the component's name (`webhook (release build failed)`,
/// `operator: no usable release binary ...`).
pub fn skipped_entry<'a>(list: &'a str, component: &str) -> Option<&'a str> {
    list.split(';').map(str::trim).find(|entry| {
        entry
            .split_whitespace()
            .next()
            .map(|w| w.trim_end_matches(':'))
            == Some(component)
    })
}

#[cfg(test)]
mod tests {
    use super::skipped_entry;

    #[test]
    fn a_skipped_component_is_found_by_its_leading_name_only() {
        let list =
            "webhook (release build of baton-webhook failed);operator: no usable release binary;";
        assert_eq!(
            skipped_entry(list, "webhook"),
            Some("webhook (release build of baton-webhook failed)")
        );
        assert_eq!(
            skipped_entry(list, "operator"),
            Some("operator: no usable release binary")
        );
        assert_eq!(skipped_entry(list, "sidecar"), None);
        assert_eq!(skipped_entry("", "webhook"), None);
    }
}
