#!/usr/bin/env bash
# The one test command (README "Run the tests"; .ci/run calls it too).
# Installs what the tests need, runs the gates, the workspace tests, and the
# end-to-end suite on a local Kubernetes cluster that is always torn down.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
# Heavy dependencies compile once per toolchain and are reused by later runs on
# the same machine (cargo's fingerprints keep a shared target dir correct).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/baton/target-$(rustc --version | awk '{print $2}')}"

step() { printf '\n==> %s\n' "$*"; }

step "system packages"
scripts/deps.sh

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy (deny warnings)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "the sidecar never depends on kube"
if cargo tree -p baton-sidecar -e normal,build --locked --prefix none | grep -E '^(kube|k8s-openapi)[ -]'; then
  echo "baton-sidecar depends on kube or k8s-openapi: forbidden (one-way dependencies)" >&2
  exit 1
fi

step "no dependency cycle between top-level modules in a crate (baseline: scripts/module-cycles.baseline, empty)"
scripts/module-cycles.sh --self-test
scripts/module-cycles.sh

step "the contract crate builds alone; the sidecar, config and handoff never depend on the CRD crate"
cargo test --locked -p baton-contract
for p in baton-sidecar baton-config baton-handoff; do
  if cargo tree -p "$p" -e normal,build --locked --prefix none | grep -E '^baton-crds[ -]'; then
    echo "$p depends on baton-crds: forbidden (it uses baton-contract alone)" >&2
    exit 1
  fi
done

step "Dockerfile copies only binaries the workspace builds"
scripts/check-dockerfile.sh

step "CRD drift: manifests/crds must equal crdgen's output"
scripts/crd-drift.sh

step "workspace tests"
cargo test --workspace --locked

if [ "${BATON_SKIP_FUZZ:-0}" != 1 ]; then
  step "fuzz the HTTP/1 request-head parser and validation (bounded: 60 s per target)"
  scripts/fuzz.sh
fi

if [ "${BATON_SKIP_E2E:-0}" != 1 ]; then
  step "end-to-end suite on a local cluster"
  e2e/run.sh
fi
