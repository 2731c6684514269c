#!/usr/bin/env bash
# A flaky-test hunt: runs one multi-process test N times in a row while busy
# loops keep every core saturated (as under a parallel build or CI on a
# shared machine), and prints the pass/fail count. A failed run's whole
# output is kept in OUT/run-K.log (the load clients name the stalled
# exchange, connection, handoff and process, with the sidecars' log tails).
#
#   bench/flaky-handoffs.sh [N] [OUTDIR]      N runs (default 50)
#
# Env: TEST (test name filter in the sidecar's integration test binary,
# default "handoff::consecutive_handoffs_lose_no_request_no_byte_and_no_counter";
# e.g. "retire::a_retired" or "proxy::reload"), BUSY (busy loops, default one per core),
# RUN_SECS (each run's limit, default 300), DEADLINE_SECS (the whole hunt's,
# default 5400: the runs left are skipped and reported). Builds the test
# binary once (debug, as `cargo test` does). Bounded: N runs, each and all
# in time; the busy loops are this script's own processes, stopped by
# process group on exit, and each also ends by itself after DEADLINE_SECS.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
N=${1:-50}
bench_init flaky-handoffs "${2:-}"
test_bin=integration
test_filter="${TEST:-handoff::consecutive_handoffs_lose_no_request_no_byte_and_no_counter}"
BUSY=${BUSY:-$(nproc)}
RUN_SECS=${RUN_SECS:-300}
DEADLINE_SECS=${DEADLINE_SECS:-5400}
cd "$BENCH_ROOT"

log "building the $test_bin test binary"
bin=$(cargo test --locked -p baton-sidecar --test "$test_bin" --no-run --message-format=json 2>/dev/null |
  jq -r 'select(.reason == "compiler-artifact" and .target.kind == ["test"]) | .executable' | tail -1)
[[ -x $bin ]] || die "no test binary for $test_bin"

for i in $(seq "$BUSY"); do
  # A shell spinning without a syscall: a full core's worth of demand.
  start_bg "busy-$i" "" timeout "$DEADLINE_SECS" bash -c 'while :; do :; done'
done
log "$BUSY busy loop(s) running (pids ${BENCH_PIDS[*]}); $N runs of $test_bin::$test_filter"

pass=0 fail=0 t_end=$(($(date +%s) + DEADLINE_SECS))
for k in $(seq "$N"); do
  if [[ $(date +%s) -ge $t_end ]]; then
    log "deadline reached after $((pass + fail)) of $N runs"
    break
  fi
  t0=$(date +%s)
  if timeout "$RUN_SECS" "$bin" --exact "$test_filter" --test-threads 1 >"$OUT/run-$k.log" 2>&1; then
    pass=$((pass + 1)) verdict=pass
    rm -f "$OUT/run-$k.log"
  else
    fail=$((fail + 1)) verdict="FAIL (output: $OUT/run-$k.log)"
  fi
  log "run $k/$N: $verdict in $(($(date +%s) - t0)) s; load $(cut -d' ' -f1 /proc/loadavg)"
done
for p in "${BENCH_PIDS[@]}"; do stop_pid "$p"; done

echo "$test_bin::$test_filter under $BUSY busy loop(s): $((pass + fail)) of $N runs"
echo "flaky-handoffs: $pass passed, $fail failed"
[[ $fail -eq 0 && $((pass + fail)) -eq $N ]]
