#!/usr/bin/env bash
# Cluster-wide rollout under load on the local cluster: for each size in
# SIZES (default "10 50"), a Deployment of that many injected echo pods
# under continuous byte-checked traffic (HTTP/1.1, HTTP/2, TCP, app TLS from
# the host; HTTP/1.1, HTTP/2, TCP from 2 meshed client Pods through the
# Service under mesh mTLS), SidecarRelease v1 -> v2 -> v1 with maxUnavailable
# 25 %, then, in the same run, the way other meshes upgrade sidecars: the
# release paused on v2 and `kubectl rollout restart deployment/echo` under the
# same meshed traffic. Reports per size: seconds from the version bump to
# Complete (each way) and of the restart, per-Pod handoff time p50 / p99 /
# max (from the Pods' baton.dev/last-handoff records) and the restart's
# per-Pod creation -> Ready, exchanges sent / failed, resets, and the
# operator's CPU seconds and peak RSS over the run (both replicas, read from
# /proc of their container processes).
#
#   bench/rollout-bench.sh [OUTDIR]
#
# Env: SIZES (default "10 50"; at most 50 each), MAX_UNAVAILABLE (25%),
# SIDECAR_CPU (each slot's CPU request; default: the release's default, as
# users get it). A size that does not fit the node's free CPU with that
# request (both slots, the restart's 25 % surge and the 2 clients counted)
# is lowered to the most that fit, and the summary says so.
# Brings the local cluster up and always tears it down (e2e/cluster.sh).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
E2E_DIR="$BENCH_ROOT/e2e"
# shellcheck source=e2e/scripts/common.sh
. "$BENCH_ROOT/e2e/scripts/common.sh"
bench_init rollout-bench "${1:-}"
need kubectl jq ctr
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/baton/target-$(rustc --version | awk '{print $2}')}"
SIZES=${SIZES:-10 50}
# Each slot's CPU request: the webhook's default unless set (what users get).
DEFAULT_SIDECAR_CPU_M=50
SIDECAR_CPU=${SIDECAR_CPU:-}

# shellcheck source=bench/lib-cluster.sh
. "$(dirname "$0")/lib-cluster.sh"
cluster_bench_up

# sample FILE PID... : every second, "<epoch> <pid> <utime+stime ticks> <rss kB>"
# per PID, at most 1,800 samples (30 min).
sample() {
  local file=$1 i pid
  shift
  for i in $(seq 1 1800); do
    for pid in "$@"; do
      [ -r "/proc/$pid/stat" ] || continue
      printf '%s %s %s %s\n' "$(date +%s)" "$pid" \
        "$(awk '{ print $14 + $15 }' "/proc/$pid/stat")" \
        "$(awk '/^VmRSS/ { print $2 }' "/proc/$pid/status")" >>"$file"
    done
    sleep 1
  done
}

bench_header >"$OUT/summary.txt"
ticks=$(getconf CLK_TCK)
# millicores MILLI_OR_CORES: "50m" -> 50, "1" -> 1000, "1.5" -> 1500.
millicores() { case "$1" in *m) echo "${1%m}" ;; *) awk -v c="$1" 'BEGIN { printf "%d", c * 1000 }' ;; esac; }
# The most echo Pods that fit the node's free CPU: each Pod's two slots, the
# restart's surge (25 %, rounded up) and the 2 meshed clients on top.
most_that_fit() {
  local alloc used per
  alloc=$(millicores "$(kc get nodes -o jsonpath='{.items[0].status.allocatable.cpu}')")
  used=$(kc get pods -A --field-selector=status.phase!=Succeeded,status.phase!=Failed -o json \
    | jq '[.items[].spec.containers[].resources.requests.cpu // "0"
           | if endswith("m") then (.[:-1] | tonumber) else (tonumber * 1000) end] | add // 0 | floor')
  per=$((2 * $(millicores "${SIDECAR_CPU:-${DEFAULT_SIDECAR_CPU_M}m}")))
  echo $(( ((alloc - used) / per - 2) * 4 / 5 ))
}
for n in $SIZES; do
  # The previous size's namespace is deleted at its end: wait until its Pods
  # are gone, or they count against this size's fit.
  for ns in $(kc get namespaces -o name | grep '^namespace/bench-' || true); do
    kc wait --for=delete "$ns" --timeout=180s >/dev/null || die "$ns is not gone after 180 s"
  done
  fit=$(most_that_fit)
  if [ "$n" -gt "$fit" ]; then
    echo "$n pods do not fit the node with ${SIDECAR_CPU:-the default ${DEFAULT_SIDECAR_CPU_M}m} CPU per sidecar slot (both slots, restart surge and clients counted): $fit pods instead" >>"$OUT/summary.txt"
    log "$n pods do not fit; running $fit"
    n=$fit
  fi
  log "rollout of $n pods"
  mapfile -t pids < <(operator_pids)
  [ ${#pids[@]} -gt 0 ] || die "cannot find the operator's processes"
  : >"$WORK/operator-$n.samples"
  export -f sample
  start_bg "sampler-$n" "" bash -c 'sample "$@"' _ "$WORK/operator-$n.samples" "${pids[@]}"
  sampler=$LAST_PID
  "$(tool_bin demo-rollout)" --namespace "bench-$n" --replicas "$n" \
    --max-unavailable "${MAX_UNAVAILABLE:-25%}" --no-broken --compare-restart \
    ${SIDECAR_CPU:+--sidecar-cpu "$SIDECAR_CPU"} \
    --report-json "$OUT/rollout-$n.json" >"$WORK/demo-$n.log" 2>&1 \
    || { tail -30 "$WORK/demo-$n.log"; log "rollout of $n pods failed (report above)"; }
  stop_pid "$sampler"
  # CPU: ticks used between each PID's first and last sample; RSS: peak.
  cpu=$(awk -v t="$ticks" '{ if (!($2 in a)) a[$2] = $3; b[$2] = $3 } END { s = 0; for (p in a) s += b[p] - a[p]; printf "%.1f", s / t }' "$WORK/operator-$n.samples")
  rss=$(awk '$4 > m { m = $4 } END { printf "%.1f", m / 1024 }' "$WORK/operator-$n.samples")
  if [ -s "$OUT/rollout-$n.json" ]; then
    jq -r --arg cpu "$cpu" --arg rss "$rss" '
      "\(.replicas) echo pods + 2 meshed clients: hot upgrade " + ([.rollouts[] | "to \(.to) \(.seconds * 10 | round / 10) s (handoff p50 \(.handoff_ms_p50) ms, p99 \(.handoff_ms_p99) ms, max \(.handoff_ms_max) ms, \(.handoffs) on record)"] | join("; "))
      + "\n  traffic: host -> Pod \(.exchanges) exchanges, \(.failed) failed, \(.resets) resets; Pod -> Pod (mTLS) \([.meshed[].exchanges] | add) exchanges, \([.meshed[].failed] | add) failed; HTTP/2 connections kept \(.h2_kept // "?"), reconnects \(.h2_reconnects), unprocessed re-sent \(.h2_unprocessed_resent); app restarts \(.app_restarts)"
      + (if .restart then "\n  kubectl rollout restart: \(.restart.pods) pods recreated in \(.restart.seconds * 10 | round / 10) s\(if .restart.finished then "" else " (NOT finished: the rest were still being replaced)" end) (creation -> Ready p50 \(.restart.replace_ms_p50) ms, p99 \(.restart.replace_ms_p99) ms); Pod -> Pod (mTLS) \(.restart.exchanges) exchanges, \(.restart.failed) failed \(.restart.errors | tojson)" else "" end)
      + "\n  operator (2 replicas): \($cpu) CPU s over the run, peak RSS \($rss) MiB"' \
      "$OUT/rollout-$n.json" >>"$OUT/summary.txt"
  else
    echo "$n pods: no report (see $WORK/demo-$n.log)" >>"$OUT/summary.txt"
  fi
done
show_results "$OUT/summary.txt"
