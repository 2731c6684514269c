#!/usr/bin/env bash
# Where the leading operator's memory goes per admitted Pod (issue #37,
# decision 0063: the leader grew ~50 KiB per Pod created, the standby
# ~1.4 KiB). On the local cluster with Baton installed: the operator
# Deployment scaled to 0 and the same binary (the `control` build the image
# holds) run on the host as the only replica, so the leader, under
# heaptrack; PODS Pods admitted through the webhook into one namespace with
# a SidecarRelease (as propagation-bench.sh admits them: never scheduled),
# held HOLD seconds, then the operator stopped. Reports the operator's RSS
# before and after the Pods and heaptrack's largest consumers at the peak
# and at the end.
#
#   bench/operator-heap.sh [OUTDIR]
#
# Env: PODS (default 2000), HOLD (default 30), HEAPTRACK=0 (RSS only, no
# profiler: heaptrack slows every allocation), OPERATOR_ENV (more env for
# the host operator, e.g. "MALLOC_ARENA_MAX=2").
# The host operator listens on loopback only. Brings the local cluster up
# and always tears it down (e2e/cluster.sh).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
E2E_DIR="$BENCH_ROOT/e2e"
# shellcheck source=e2e/scripts/common.sh
. "$BENCH_ROOT/e2e/scripts/common.sh"
bench_init operator-heap "${1:-}"
need kubectl jq ctr
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/baton/target-$(rustc --version | awk '{print $2}')}"
PODS=${PODS:-2000}
HOLD=${HOLD:-30}
HEAPTRACK=${HEAPTRACK:-1}
[ "$HEAPTRACK" = 0 ] || need heaptrack heaptrack_print

# shellcheck source=bench/lib-cluster.sh
. "$(dirname "$0")/lib-cluster.sh"
cluster_bench_up

log "the operator Deployment scaled to 0; the host operator takes the Lease"
kc -n baton-system scale deployment/baton-operator --replicas=0 >/dev/null
kc -n baton-system wait --for=delete pod -l app.kubernetes.io/name=baton-operator --timeout=120s >/dev/null
profiler=()
[ "$HEAPTRACK" = 0 ] || profiler=(heaptrack -o "$WORK/heap")
# shellcheck disable=SC2086
start_bg operator "" env KUBECONFIG="$KUBECONFIG_ADMIN" BATON_POD_NAME=operator-heap \
  BATON_NAMESPACE=baton-system BATON_LOG=info \
  BATON_ADMIN_ADDR="127.0.0.1:$(free_port)" BATON_IDENTITY_ADDR="127.0.0.1:$(free_port)" \
  ${OPERATOR_ENV:-} "${profiler[@]}" "$(bin_path baton-operator)"
operator=$LAST_PID
# The operator's own process (heaptrack runs it as a child).
op_pid() { pgrep -g "$operator" -x baton-operator | head -1; }
rss_kb() { awk '/^VmRSS/ { print $2 }' "/proc/$(op_pid)/status"; }
for _ in $(seq 120); do
  holder=$(kc -n baton-system get lease -o jsonpath='{range .items[*]}{.spec.holderIdentity}{"\n"}{end}' | grep -c '^operator-heap$' || true)
  [ "$holder" -ge 1 ] && break
  kill -0 "$operator" 2>/dev/null || { cat "$WORK/operator.log"; die "the host operator exited"; }
  sleep 1
done
[ "$holder" -ge 1 ] || die "the host operator did not take the Lease in 120 s"
sleep 10   # its controllers' first lists
before=$(rss_kb)
log "leader; RSS $before kB; admitting $PODS Pods"
t0=$(date +%s)
"$(tool_bin bench-propagation)" --streams "$PODS" --namespace bench-heap \
  --pods-only-hold-seconds "$HOLD" >"$WORK/tool.log" 2>&1 &
tool=$!
peak=$before r=$before
while kill -0 "$tool" 2>/dev/null; do
  r=$(rss_kb)
  [ "$r" -gt "$peak" ] && peak=$r
  echo "$(( $(date +%s) - t0 )) $r" >>"$WORK/rss.samples"
  sleep 1
done
wait "$tool" || { cat "$WORK/tool.log"; die "admitting the Pods failed"; }
after=$r   # the last sample, while the Pods were still held
# SIGTERM to the operator alone (it releases the Lease and exits), then
# heaptrack writes its data: up to 120 s before the group is killed.
kill -TERM "$(op_pid)" 2>/dev/null || true
for _ in $(seq 240); do kill -0 "$operator" 2>/dev/null || break; sleep 0.5; done
stop_pid "$operator"
{
  bench_header
  echo "host operator (the leader, alone${OPERATOR_ENV:+, env $OPERATOR_ENV}${profiler:+, under heaptrack}); $PODS Pods admitted, held $HOLD s"
  echo "RSS: before $before kB, peak $peak kB, after $after kB: $(( (after - before) / PODS )) kB per Pod held, $(( (peak - before) / PODS )) kB per Pod at the peak"
  grep -E "pods admitted" "$WORK/tool.log" || true
} >"$OUT/summary.txt"
if [ "$HEAPTRACK" != 0 ]; then
  data=$(compgen -G "$WORK/heap*.zst" || compgen -G "$WORK/heap*.gz" || true)
  [ -n "$data" ] || die "heaptrack wrote no data file in $WORK"
  heaptrack_print -f "$data" --print-peaks 1 --print-allocators 0 --print-temporary 0 \
    --peak-limit 25 --sub-peak-limit 3 >"$OUT/peaks.txt" 2>&1 || true
  heaptrack_print -f "$data" --print-peaks 0 --print-allocators 0 --print-temporary 0 \
    --print-leaks 1 --peak-limit 25 --sub-peak-limit 3 >"$OUT/at-exit.txt" 2>&1 || true
  heaptrack_print -f "$data" --flamegraph-cost-type peak -F "$OUT/peak.stacks" >/dev/null 2>&1 || true
  echo "heaptrack: $OUT/peaks.txt (largest consumers at the peak), $OUT/at-exit.txt, $OUT/peak.stacks" >>"$OUT/summary.txt"
fi
show_results "$OUT/summary.txt"
