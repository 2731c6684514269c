#!/usr/bin/env bash
# The e2e suite, start to finish: provision (cached), cluster up, images,
# install Baton, run the e2e tests, and ALWAYS tear the cluster down (trap),
# even when a step fails. Exits non-zero when anything failed, including a
# teardown that left something behind.
#
#   e2e/run.sh [extra args for the test binaries, e.g. a test name filter]
#
# Env: BATON_E2E_KEEP=1 leaves the cluster up for debugging (then run
# `e2e/cluster.sh down` yourself); BATON_E2E_JOBS (test binaries at once,
# default 2), BATON_E2E_TEST_THREADS (default 2).
set -euo pipefail
E2E_DIR="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=e2e/scripts/common.sh
. "$E2E_DIR/scripts/common.sh"
cd "$REPO"

T0=$(date +%s)
stamp() { echo "$(( $(date +%s) - T0 ))s"; }
# Stage seconds, for scripts/test.sh's table (BATON_STAGE_TIMES: a file it
# collects; "seconds<TAB>result<TAB>name" lines).
stage_t=$T0 stage_label=""
stage() { # next-stage-label (empty: just close the current one)
  local now rc=${2:-ok}
  now=$(date +%s)
  if [ -n "$stage_label" ] && [ -n "${BATON_STAGE_TIMES:-}" ]; then
    printf '%s\t%s\t  e2e: %s\n' "$((now - stage_t))" "$rc" "$stage_label" >>"$BATON_STAGE_TIMES"
  fi
  stage_t=$now stage_label=$1
}
teardown() {
  local rc=$?
  stage teardown "$([ "$rc" = 0 ] && echo ok || echo FAILED)"
  if [ "${BATON_E2E_KEEP:-0}" = 1 ]; then
    log "BATON_E2E_KEEP=1: cluster left up (KUBECONFIG=$KUBECONFIG_ADMIN); run e2e/cluster.sh down"
  else
    log "teardown"
    td=ok
    if ! "$E2E_DIR/scripts/teardown.sh" "$BASELINE"; then
      log "teardown: this run left something behind"
      rc=1 td=FAILED
    fi
  fi
  rm -f "$BASELINE"
  stage "" "${td:-kept}"
  log "e2e finished after $(stamp) with exit code $rc"
  exit "$rc"
}
# One run at a time: the whole run holds the cluster lock (up, install and
# down, called from here, run under it), so another run cannot find this
# cluster "already up", use it, and tear it down under this one.
cluster_lock
# What an earlier run left behind: its provably own processes are stopped,
# the rest is listed with the command that removes it and does not fail this
# run (e2e/scripts/check-clean.sh).
BASELINE="$(mktemp /tmp/baton-e2e-baseline.XXXXXX)"
trap teardown EXIT
trap 'exit 130' INT TERM
log "leftovers of earlier runs"
"$E2E_DIR/scripts/check-clean.sh" --before "$BASELINE"

stage provision
log "provision (cached after the first run)"
"$E2E_DIR/scripts/provision.sh" >/dev/null
stage "cluster up"
log "cluster up"
"$E2E_DIR/cluster.sh" up | tail -1
stage images
log "images"
# Every image must build: a skipped image (exit 3) fails the suite too.
"$E2E_DIR/images.sh" all
stage "install Baton"
log "install Baton"
"$E2E_DIR/scripts/install.sh" || {
  rc=$?
  [ "$rc" = 3 ] || exit "$rc"
  log "WARNING: continuing with skipped components (see SKIPPED lines above)"
}
# Tests that need a skipped component check this list and fail loudly.
BATON_E2E_SKIPPED="$(cat "$CACHE/images/skipped" "$STATE/install-skipped" 2>/dev/null | tr '\n' ';' || true)"
export BATON_E2E_SKIPPED

stage tests
log "e2e tests"
export BATON_E2E_KUBECONFIG="$KUBECONFIG_ADMIN"
# Every test binary at once, then the ones that must run alone
# (e2e/scripts/run-tests.sh, e2e/exclusive-tests).
"$E2E_DIR/scripts/run-tests.sh" "$@"
log "e2e tests passed after $(stamp)"
