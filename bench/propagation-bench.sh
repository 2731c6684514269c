#!/usr/bin/env bash
# Config propagation through the deployed operator on the local cluster
# (issue #37 items 1 and 6): for each size in SIZES (default "1000 5000
# 10000"), N Pods admitted through the webhook and never scheduled, a token
# bound to each, N push streams (one per Pod) on the operator replicas' real
# endpoints, then CHANGES (default 20) Routes created through the API
# server: time to the N-th ACK per change (p50 / p99 / max), each stream's
# p50 / p99, and the time until the Route's status counts N/N. At
# FAILOVER_AT streams (default 1000, issue #37 item 6) the leader's Pod is
# then deleted under its streams. The operator's CPU seconds and peak RSS over each size (both
# replicas, /proc of their container processes, sampled every second), and
# whether a replica was OOM-killed against its memory limit.
#
#   bench/propagation-bench.sh [OUTDIR]
#
# Env: SIZES, CHANGES, FAILOVER_AT (a size, or 0 for no failover),
# OPERATOR_ENV (e.g. "MALLOC_ARENA_MAX=2": set on the operator Deployment
# before the first size, for a comparison run).
# Brings the local cluster up and always tears it down (e2e/cluster.sh).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
E2E_DIR="$BENCH_ROOT/e2e"
# shellcheck source=e2e/scripts/common.sh
. "$BENCH_ROOT/e2e/scripts/common.sh"
bench_init propagation-bench "${1:-}"
need kubectl jq ctr
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/baton/target-$(rustc --version | awk '{print $2}')}"
SIZES=${SIZES:-1000 5000 10000}
CHANGES=${CHANGES:-20}
FAILOVER_AT=${FAILOVER_AT:-1000}

# shellcheck source=bench/lib-cluster.sh
. "$(dirname "$0")/lib-cluster.sh"
cluster_bench_up
if [ -n "${OPERATOR_ENV:-}" ]; then
  # shellcheck disable=SC2086
  kc -n baton-system set env deployment/baton-operator $OPERATOR_ENV >/dev/null
  kc -n baton-system rollout status deployment/baton-operator --timeout=180s >/dev/null
fi

# sample FILE : every second, "<epoch> <pid> <utime+stime ticks> <rss kB>" for
# each operator process (re-listed every 10 s: the failover starts a new
# one), at most 3,600 samples (1 h).
sample() {
  local file=$1 i pid pids=()
  for i in $(seq 1 3600); do
    if [ $((i % 10)) = 1 ]; then mapfile -t pids < <(operator_pids); fi
    for pid in "${pids[@]}"; do
      [ -r "/proc/$pid/stat" ] || continue
      printf '%s %s %s %s\n' "$(date +%s)" "$pid" \
        "$(awk '{ print $14 + $15 }' "/proc/$pid/stat" 2>/dev/null)" \
        "$(awk '/^VmRSS/ { print $2 }' "/proc/$pid/status" 2>/dev/null)" >>"$file"
    done
    sleep 1
  done
}
# Container restarts of the operator Pods (an OOM kill is one).
operator_restarts() {
  kc -n baton-system get pods -l app.kubernetes.io/name=baton-operator -o json \
    | jq '[.items[].status.containerStatuses[]?.restartCount] | add // 0'
}
export -f sample operator_pids kc ctr_k8s
export KUBECONFIG_ADMIN CONTAINERD_SOCK

bench_header >"$OUT/summary.txt"
limit=$(kc -n baton-system get deployment baton-operator \
  -o jsonpath='{.spec.template.spec.containers[0].resources.limits.memory}')
echo "operator: 2 replicas, memory limit $limit${OPERATOR_ENV:+, env $OPERATOR_ENV}; $CHANGES Route creations per size" >>"$OUT/summary.txt"
ticks=$(getconf CLK_TCK)
for n in $SIZES; do
  restarts_before=$(operator_restarts)
  log "$n streams"
  : >"$WORK/operator-$n.samples"
  start_bg "sampler-$n" "" bash -c 'sample "$@"' _ "$WORK/operator-$n.samples"
  sampler=$LAST_PID
  fo=()
  if [ "$n" = "$FAILOVER_AT" ]; then fo=(--failover); fi
  ok=1
  "$(tool_bin bench-propagation)" --streams "$n" --changes "$CHANGES" --namespace "bench-prop-$n" \
    "${fo[@]}" --report-json "$OUT/propagation-$n.json" >"$WORK/run-$n.log" 2>&1 || ok=0
  stop_pid "$sampler"
  cpu=$(awk -v t="$ticks" '{ if (!($2 in a)) a[$2] = $3; b[$2] = $3 } END { s = 0; for (p in a) s += b[p] - a[p]; printf "%.1f", s / t }' "$WORK/operator-$n.samples")
  rss=$(awk '$4 > m { m = $4 } END { printf "%.1f", m / 1024 }' "$WORK/operator-$n.samples")
  # Each operator process's own peak (the leader holds more than the
  # standby: the rollout's and the accelerator's caches).
  rss_each=$(awk '$4 > m[$2] { m[$2] = $4 } END { s = ""; for (p in m) s = s sprintf("%s%.1f", (s == "" ? "" : ", "), m[p] / 1024); print s }' "$WORK/operator-$n.samples")
  restarts_after=$(operator_restarts)
  oom=$(kc -n baton-system get pods -l app.kubernetes.io/name=baton-operator \
    -o jsonpath='{range .items[*]}{.status.containerStatuses[0].lastState.terminated.reason}{" "}{end}')
  if [ "$ok" = 1 ] && [ -s "$OUT/propagation-$n.json" ]; then
    jq -r --arg cpu "$cpu" --arg rss "$rss" --arg each "$rss_each" '
      "\(.streams) streams: Route create -> N-th ACK p50 \(.nth_ack_ms.p50) ms, p99 \(.nth_ack_ms.p99) ms, max \(.nth_ack_ms.max) ms over \(.changes) changes; per stream p50 \(.per_stream_ms.p50) ms, p99 \(.per_stream_ms.p99) ms; status N/N p50 \(.status_ms.p50) ms, max \(.status_ms.max) ms"
      + "\n  setup \(.setup_s | . * 10 | round / 10) s (Pods + tokens), streams connected in \(.connect_s | . * 10 | round / 10) s, \(.stream_errors) stream errors\(if (.stream_error_kinds // {}) == {} then "" else " (" + ([.stream_error_kinds | to_entries[] | "\(.value) \(.key)"] | join(", ")) + ")" end); a full snapshot \(.snapshot_bytes / 1024 | . * 10 | round / 10) KiB"
      + (if .failover then "\n  failover (leader Pod deleted): new leader after \(.failover.new_leader_s | . * 10 | round / 10) s (Lease \(.failover.lease_duration_s) s), its \(.failover.streams_moved) streams back on the other replicas after \(.failover.streams_back_s | . * 10 | round / 10) s; next change N-th ACK \(.failover.nth_ack_ms) ms, status \"\(.failover.status)\" after \(.failover.status_ms) ms" else "" end)
      + "\n  operator (both replicas): \($cpu) CPU s over the size, peak RSS \($rss) MiB (each process: \($each) MiB)"' \
      "$OUT/propagation-$n.json" >>"$OUT/summary.txt"
  else
    echo "$n streams: FAILED ($(tail -1 "$WORK/run-$n.log")); operator peak RSS $rss MiB" >>"$OUT/summary.txt"
  fi
  if [ "$restarts_after" != "$restarts_before" ]; then
    echo "  operator containers restarted during this size (last termination: ${oom:-?})" >>"$OUT/summary.txt"
  fi
  # The namespace's Pods must be gone before the next size (the tool deletes
  # it; a run that was killed did not).
  kc delete namespace "bench-prop-$n" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  kc wait --for=delete "namespace/bench-prop-$n" --timeout=300s >/dev/null 2>&1 || true
done
show_results "$OUT/summary.txt"
