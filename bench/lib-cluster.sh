# shellcheck shell=bash
# For the benches that run on the local cluster (rollout-bench.sh,
# propagation-bench.sh, operator-heap.sh); sourced after bench/lib.sh and
# e2e/scripts/common.sh. One bring-up and one teardown for all of them, the
# same as e2e/run.sh's.

# cluster_bench_up: the release build the images use, the cluster up with
# Baton installed (e2e/cluster.sh), the cluster lock held to the end; on
# exit, whatever happens, every process start_bg made is stopped and the
# cluster torn down and checked clean.
cluster_bench_up() {
  cluster_up=0
  baseline="$WORK/leftovers-before"
  trap cluster_bench_teardown EXIT
  log "building (release; e2e/scripts/common.sh's one release build, which the images use too)"
  release_build >/dev/null 2>&1 || release_build
  "$BENCH_ROOT/e2e/cluster.sh" provision
  log "cluster up, images, install"
  cluster_lock   # held to the end of the teardown: one cluster run at a time
  "$BENCH_ROOT/e2e/scripts/check-clean.sh" --before "$baseline" >&2
  cluster_up=1
  "$BENCH_ROOT/e2e/cluster.sh" up >/dev/null
  "$BENCH_ROOT/e2e/cluster.sh" images >/dev/null
  "$BENCH_ROOT/e2e/cluster.sh" install >/dev/null
  export BATON_E2E_KUBECONFIG="$KUBECONFIG_ADMIN"
}

cluster_bench_teardown() {
  local rc=$?
  bench_cleanup
  # The same teardown and check as e2e/run.sh (down, then check-clean.sh).
  if [ "${cluster_up:-0}" = 1 ] && ! "$BENCH_ROOT/e2e/scripts/teardown.sh" "$baseline" >&2; then
    log "the bench's teardown left something behind (above)"
    rc=1
  fi
  exit "$rc"
}

# operator_pids: PIDs (host view) of the operator containers' processes.
operator_pids() {
  local id
  for id in $(kc -n baton-system get pods -l app.kubernetes.io/name=baton-operator \
      -o jsonpath='{range .items[*]}{.status.containerStatuses[0].containerID}{"\n"}{end}' | sed 's|.*://||'); do
    ctr_k8s tasks ls | awk -v id="$id" '$1 == id { print $2 }'
  done
}
