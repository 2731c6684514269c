//! The `crdgen` binary itself: `--out DIR` writes exactly the committed
//! manifests, and stdout carries the same documents as one stream.

use std::path::Path;
use std::process::Command;

fn committed() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests/crds");
    let mut out: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read_to_string(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn crdgen_out_writes_one_file_per_crd_identical_to_the_committed_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("nested/crds");
    let status = Command::new(env!("CARGO_BIN_EXE_crdgen"))
        .arg("--out")
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let mut written: Vec<(String, String)> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read_to_string(&p).unwrap(),
            )
        })
        .collect();
    written.sort();
    assert_eq!(written, committed());
}

#[test]
fn crdgen_without_out_prints_every_crd_to_stdout() {
    let output = Command::new(env!("CARGO_BIN_EXE_crdgen")).output().unwrap();
    assert!(output.status.success());
    let stdout = String::from_utf8(output.stdout).unwrap();
    let docs = baton_crds::yaml::documents(&stdout).unwrap();
    let names: Vec<&str> = docs
        .iter()
        .map(|d| d["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "sidecarreleases.baton.dev",
            "routes.baton.dev",
            "tlspolicies.baton.dev",
            "acceleratorpools.baton.dev",
            "authorizationpolicies.baton.dev"
        ]
    );
    for (_, doc) in committed() {
        assert!(stdout.contains(&doc));
    }
}

#[test]
fn crdgen_fails_with_a_message_when_it_cannot_write() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("not-a-dir");
    std::fs::write(&file, "x").unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_crdgen"))
        .arg("--out")
        .arg(&file)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("creating"), "{stderr}");
}
