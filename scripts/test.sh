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
# No incremental state: a clean clone compiles the workspace's own crates
# afresh, so it saves no time there, and it piled up in the shared target dir
# (27 GB after a day of runs here filled the disk and the kubelet's disk
# pressure left Baton's Pods Pending). Earlier runs' state is dropped too.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
[ "$CARGO_INCREMENTAL" = 0 ] && rm -rf "$CARGO_TARGET_DIR/debug/incremental"

# Each stage's seconds, printed as a table at the end, pass or fail, so a
# regression shows at once. e2e/run.sh adds its own stages (cluster up,
# images, install, tests, teardown) to the same file.
BATON_STAGE_TIMES="$(mktemp /tmp/baton-stage-times.XXXXXX)"
export BATON_STAGE_TIMES
T_START=$(date +%s)
stage_name="" stage_t0=0
stage_end() { # result
  if [ -n "$stage_name" ]; then
    printf '%s\t%s\t%s\n' "$(($(date +%s) - stage_t0))" "$1" "$stage_name" >>"$BATON_STAGE_TIMES"
  fi
  stage_name=""
}
step() {
  stage_end ok
  stage_name="$*" stage_t0=$(date +%s)
  printf '\n==> %s\n' "$*"
}
stage_table() { # [EXIT_STATUS]
  local rc=${1:-$?}
  stage_end "$([ "$rc" = 0 ] && echo ok || echo "FAILED (exit $rc)")"
  printf '\n==> stage times (seconds)\n'
  awk -F'\t' '{ printf "%7d  %-8s %s\n", $1, $2, $3 }' "$BATON_STAGE_TIMES"
  printf '%7d  %-8s %s\n' "$(($(date +%s) - T_START))" "$([ "$rc" = 0 ] && echo ok || echo FAILED)" "total"
  rm -f "$BATON_STAGE_TIMES"
  exit "$rc"
}
trap stage_table EXIT

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

step "Dockerfile: the binaries it copies, its non-root FROM scratch targets and e2e/images.sh agree"
scripts/check-dockerfile.sh

step "CRD drift: manifests/crds must equal crdgen's output"
scripts/crd-drift.sh

step "workspace tests: build"
cargo test --workspace --locked --no-run

# Work that goes beside other stages, each in its own process group (killed
# on exit, pass or fail) with its own log, printed when it is waited for; it
# writes its own row of the stage table. On two cores, stages that mostly
# wait (the unit tests on sockets and timers, the demo on its cluster) left
# a core idle for minutes when they ran one after another (decisions 0057,
# 0061).
declare -A bg_pid=() bg_log=()
bg_start() { # NAME STAGE-TITLE COMMAND...
  local name=$1 title=$2
  shift 2
  bg_log[$name]="$(mktemp "/tmp/baton-$name.XXXXXX")"
  setsid bash -c '
    log=$1 title=$2; shift 2
    t0=$(date +%s)
    "$@" >"$log" 2>&1 && r=ok || r="FAILED (exit $?)"
    printf "%s\t%s\t%s\n" "$(($(date +%s) - t0))" "$r" "$title" >>"$BATON_STAGE_TIMES"
    [ "$r" = ok ]' "$name" "${bg_log[$name]}" "$title" "$@" &
  bg_pid[$name]=$!
}
bg_wait() { # NAME SUMMARY-REGEX FAILURE-HINT: waits; prints the log's summary lines, or all of it and fails
  local name=$1 summary=$2 hint=$3
  [ -n "${bg_pid[$name]:-}" ] || return 0
  step "$name: waiting for the run started beside the other stages"
  if wait "${bg_pid[$name]}"; then
    grep -E "$summary" "${bg_log[$name]}" || true
  else
    cat "${bg_log[$name]}"
    echo "$hint" >&2
    bg_pid[$name]=""
    exit 1
  fi
  bg_pid[$name]=""
}
bg_stop_all() {
  local name
  for name in "${!bg_pid[@]}"; do
    local pid=${bg_pid[$name]}
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      kill -- "-$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    fi
    rm -f "${bg_log[$name]}"
  done
}
trap 'r=$?; bg_stop_all; stage_table "$r"' EXIT

# Fuzzing (one core, pure CPU) goes beside the release build and the demo.
if [ "${BATON_SKIP_FUZZ:-0}" != 1 ]; then
  bg_start fuzz "fuzz the HTTP/1 request-head parser and validation, the TLS record layer and the HTTP/2 carried state (bounded: ${BATON_FUZZ_BUDGET:-60} s for all targets; beside the next stages)" \
    scripts/fuzz.sh
fi

if [ "${BATON_SKIP_E2E:-0}" != 1 ]; then
  # The test tools (echo servers, load generators, demo-rollout) are the
  # ones the workspace test build above made, as they are; only the binaries
  # Baton ships are built for release (e2e/scripts/common.sh, decision 0043).
  export BATON_TOOLS_DIR="$CARGO_TARGET_DIR/debug"
  step "release build of the shipped binaries (scripts/build-binaries.sh shipped: sidecar with thin LTO, operator and webhook without)"
  (E2E_DIR="$PWD/e2e" && . e2e/scripts/common.sh && release_build)
  # Everything is built: the demo and e2e/images.sh need no cargo of their
  # own (cargo test, running beside the demo, holds the target dir's lock).
  export BATON_RELEASE_BUILT=1
fi

if [ "${BATON_SKIP_E2E:-0}" != 1 ] && [ "${BATON_SKIP_DEMO:-0}" != 1 ]; then
  # The unit and in-process tests mostly wait on sockets and timers, and so
  # does the demo on its cluster: they go side by side.
  bg_start "workspace tests" "workspace tests: run (beside the demo)" \
    cargo test --workspace --locked
  # The README's first command as a newcomer runs it, then the suite on the
  # same machine: the demo's teardown must leave nothing that fails it.
  step "the README's demo (BATON_DEMO_REPLICAS=${BATON_DEMO_REPLICAS:-2}), then the suite on the same machine"
  BATON_DEMO_REPLICAS="${BATON_DEMO_REPLICAS:-2}" scripts/demo.sh
  bg_wait "workspace tests" '^(test result:|failures:)' "workspace tests failed"
else
  step "workspace tests: run"
  cargo test --workspace --locked
fi

bg_wait fuzz '^(fuzz:|Done [0-9]+ runs)' "fuzzing failed (the crashing input is under sidecar/fuzz/artifacts/)"

if [ "${BATON_SKIP_E2E:-0}" != 1 ]; then
  step "end-to-end suite on a local cluster"
  # The e2e test binaries of the workspace test build above, as they are.
  BATON_E2E_BUILD=--workspace e2e/run.sh
fi
