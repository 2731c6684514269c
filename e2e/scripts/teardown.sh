#!/usr/bin/env bash
# The one teardown of every script that brings the cluster up (e2e/run.sh,
# scripts/demo.sh, bench/rollout-bench.sh): `down` (stop what the run
# started, by PID, and undo its side effects), then the same independent
# check for all of them (check-clean.sh) against the leftovers recorded
# before the run (check-clean.sh --before BASELINE). Exit 1 only when THIS
# run left something behind; an earlier run's leftovers are listed with the
# command that removes them.
#
#   e2e/scripts/teardown.sh BASELINE
set -uo pipefail
E2E_DIR="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=e2e/scripts/common.sh
. "$E2E_DIR/scripts/common.sh"
baseline="${1:?usage: teardown.sh BASELINE (from check-clean.sh --before)}"

rc=0
"$E2E_DIR/scripts/down.sh" || rc=1
"$E2E_DIR/scripts/check-clean.sh" --baseline "$baseline" || rc=1
exit "$rc"
