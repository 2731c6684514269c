#!/usr/bin/env bash
# Tear the local cluster down and undo every side effect of `up`, whatever
# state it is in (after a failed test, a half-failed up, or twice in a row).
# Processes are stopped by recorded PID only (containers and shims by the PID
# files containerd wrote for them), never by name.
#
# Order: host processes (none by default; a stale run's) → kube-proxy →
# kubelet → containers and shims → containerd → mounts → control plane →
# cgroups → iptables chains → ip_forward → bridge → host dirs → run dir.
set -uo pipefail
E2E_DIR="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=e2e/scripts/common.sh
. "$E2E_DIR/scripts/common.sh"

[ "$(id -u)" = 0 ] || die "down needs root"
cluster_lock
problems=0
problem() { log "LEFT BEHIND: $*"; problems=$((problems + 1)); }

# stop_pid name pid [grace-seconds]: SIGTERM, wait, then SIGKILL.
stop_pid() {
  local name=$1 pid=$2 grace=${3:-10}
  pid_alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null
  local i
  for ((i = 0; i < grace * 10; i++)); do
    pid_alive "$pid" || return 0
    sleep 0.1
  done
  log "$name ($pid) ignored SIGTERM: SIGKILL"
  kill -KILL "$pid" 2>/dev/null
  for ((i = 0; i < 50; i++)); do
    pid_alive "$pid" || return 0
    sleep 0.1
  done
  problem "$name still running as PID $pid"
}
stop_recorded() {
  local name=$1 grace=${2:-10}
  local pid
  pid="$(recorded_pid "$name")"
  [ -n "$pid" ] && stop_pid "$name" "$pid" "$grace"
  # A survivor keeps its PID file: the final sweep retries and reports it.
  pid_alive "$pid" || rm -f "$PIDS/$name.pid"
}

if [ -d "$RUN" ]; then
  # Baton's own Pods' logs first, while the API server still answers: a
  # failed test's post-mortem needs the webhook's and the operator's side.
  if [ -d "$LOGS" ] && [ -s "$KUBECONFIG_ADMIN" ]; then
    for pod in $(timeout 10 kubectl --kubeconfig "$KUBECONFIG_ADMIN" -n baton-system get pods \
        -o jsonpath='{.items[*].metadata.name}' 2>/dev/null); do
      timeout 10 kubectl --kubeconfig "$KUBECONFIG_ADMIN" -n baton-system logs "$pod" \
        --all-containers --tail=2000 >"$LOGS/baton-$pod.log" 2>&1 || true
    done
  fi
  log "stopping cluster in $RUN"
  for f in "$PIDS"/host-*.pid; do
    [ -e "$f" ] || continue
    n="$(basename "$f" .pid)"
    stop_recorded "$n" 5
  done
  # Container shims, found BEFORE anything is stopped: the shim.pid files
  # containerd wrote, and the shims whose command line names this cluster's
  # containerd socket. They used to be read from the shim.pid files only,
  # after the container processes were killed: by then containerd had
  # already handled some of the exits and deleted those tasks' bundles (the
  # shim.pid with them) while their shims still ran, and those shims
  # outlived `down` (five after the demo). Each is recorded in the ledger so
  # a later run can still prove it ours if it survives.
  task_root="$RUN/containerd/state/io.containerd.runtime.v2.task"
  shims=()
  if [ -d "$task_root" ]; then
    while IFS= read -r f; do
      p="$(cat "$f" 2>/dev/null)"
      pid_alive "$p" && shims+=("$p")
    done < <(find "$task_root" -name shim.pid 2>/dev/null)
  fi
  mapfile -t -O "${#shims[@]}" shims < <(our_shims)
  mapfile -t shims < <(printf '%s\n' "${shims[@]:-}" | grep -E '^[0-9]+$' | sort -un)
  for p in "${shims[@]:-}"; do [ -n "$p" ] && ledger_add containerd-shim "$p"; done

  # kube-proxy first: once stopped it cannot re-create the chains removed below.
  stop_recorded kube-proxy 5
  stop_recorded kubelet 10
  log "kube-proxy and kubelet stopped"

  # Containers: kill every container process (by the init.pid files
  # containerd wrote for each task), then containerd, then the shims.
  if [ -d "$task_root" ]; then
    while IFS= read -r f; do
      p="$(cat "$f" 2>/dev/null)"
      pid_alive "$p" && kill -KILL "$p" 2>/dev/null
    done < <(find "$task_root" -name init.pid 2>/dev/null)
  fi
  stop_recorded containerd 10
  # Shims started after the list above (none once the kubelet is stopped,
  # but a sandbox being created at that moment could add one).
  mapfile -t -O "${#shims[@]}" shims < <(our_shims)
  # All at once: one by one, a 3 s grace each made the demo's teardown
  # (a dozen shims) take half a minute.
  mapfile -t shims < <(printf '%s\n' "${shims[@]:-}" | grep -E '^[0-9]+$' | sort -un)
  for p in "${shims[@]}"; do
    stop_pid containerd-shim "$p" 3 &
  done
  wait
  # (a subshell's `problem` does not count here: check again)
  for p in "${shims[@]}"; do
    pid_alive "$p" && problem "containerd-shim still running as PID $p"
  done
  log "containers, containerd and shims stopped"
fi

# Mounts under the kubelet root and the run dir (deepest first).
unmount_under() {
  local prefix=$1 m
  for _ in 1 2 3; do
    mapfile -t mounts < <(awk -v p="$prefix" '$2 == p || index($2, p "/") == 1 { print $2 }' /proc/self/mounts | sort -r)
    [ ${#mounts[@]} -eq 0 ] && return 0
    for m in "${mounts[@]}"; do
      m="$(printf '%b' "$m")"
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done
  done
  awk -v p="$prefix" '$2 == p || index($2, p "/") == 1 { print $2 }' /proc/self/mounts | while read -r m; do
    problem "mount $m"
  done
}
unmount_under "$KUBELET_ROOT"
unmount_under "$RUN"

if [ -d "$RUN" ]; then
  # The control plane stops in parallel (each takes 1-3 s); etcd last.
  stop_recorded kube-scheduler 5 &
  stop_recorded kube-controller-manager 5 &
  stop_recorded kube-apiserver 10 &
  wait
  stop_recorded etcd 10
  log "control plane stopped"
  for f in "$PIDS"/*.pid; do
    [ -e "$f" ] && stop_recorded "$(basename "$f" .pid)" 5
  done
fi

# kubepods cgroups (cgroup v1: one tree per controller; v2: one tree).
for root in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods /sys/fs/cgroup/*/kubepods.slice /sys/fs/cgroup/kubepods.slice; do
  [ -d "$root" ] || continue
  for _ in 1 2 3 4 5; do
    find "$root" -depth -type d -exec rmdir {} \; 2>/dev/null
    [ -d "$root" ] || break
    sleep 0.5
  done
  [ -d "$root" ] && problem "cgroup $root"
done

# iptables: jumps from built-in chains into KUBE-*, CNI-* and the guard
# chains, then the chains themselves (in every table, IPv4 and IPv6).
ours='^(KUBE-|CNI-|BATON-E2E-)'
for ipt in iptables ip6tables; do
  command -v "$ipt" >/dev/null || continue
  for table in filter nat mangle raw; do
    rules="$($ipt -w -t "$table" -S 2>/dev/null)" || continue
    # Delete rules in built-in chains that jump to one of our chains.
    while IFS= read -r rule; do
      [ -z "$rule" ] && continue
      # iptables -S quotes comments the way a shell does: eval re-splits them.
      eval "$ipt -w -t $table -D ${rule#-A }" 2>/dev/null || problem "$ipt -t $table rule: $rule"
    done < <(printf '%s\n' "$rules" | awk '$1 == "-A" && $2 !~ /^(KUBE-|CNI-|BATON-E2E-)/ && / -j (KUBE-|CNI-|BATON-E2E-)/')
    chains="$(printf '%s\n' "$rules" | awk '$1 == "-N" { print $2 }' | grep -E "$ours")"
    for c in $chains; do $ipt -w -t "$table" -F "$c" 2>/dev/null; done
    for c in $chains; do $ipt -w -t "$table" -X "$c" 2>/dev/null || problem "$ipt -t $table chain $c"; done
  done
done

# Connection-tracking entries of the cluster's ranges (Service DNATs, pod
# flows): nothing that outlives the cluster may still translate addresses.
if command -v conntrack >/dev/null; then
  for range in "$POD_SUBNET" "$SERVICE_RANGE"; do
    for dir in -s -d; do conntrack -D "$dir" "$range" >/dev/null 2>&1 || true; done
    conntrack -D --reply-src "$range" >/dev/null 2>&1 || true
  done
fi

# Sysctls the bridge plugin and the kubelet change (ip_forward, kernel panic
# and overcommit defaults, ...), restored to the values recorded by `up`.
if [ -f "$STATE/sysctls" ]; then
  while read -r path value; do
    [ -w "/proc/sys/$path" ] || continue
    [ "$(cat "/proc/sys/$path")" = "$value" ] && continue
    printf '%s\n' "$value" >"/proc/sys/$path" 2>/dev/null || problem "sysctl $path (want $value)"
  done <"$STATE/sysctls"
fi

if ip link show "$BRIDGE" >/dev/null 2>&1; then
  ip link delete "$BRIDGE" type bridge || problem "bridge $BRIDGE"
fi

for p in "${HOST_PATHS[@]}"; do
  if [ -e "$p" ] && ! grep -qxF "$p" "$STATE/preexisting" 2>/dev/null; then
    rm -rf "$p" 2>/dev/null || problem "$p"
  fi
done

if [ -d "$RUN" ]; then
  # Keep the logs of the last run for post-mortems, outside the run dir.
  if [ -d "$LOGS" ]; then
    rm -rf "$CACHE/last-run-logs"
    mkdir -p "$CACHE"
    cp -r "$LOGS" "$CACHE/last-run-logs" 2>/dev/null
    cp "$STATE/sysctls" "$CACHE/last-run-sysctls" 2>/dev/null
  fi
  rm -rf "$RUN" 2>/dev/null || problem "run dir $RUN"
fi

ledger_prune
if [ "$problems" -gt 0 ]; then
  log "down finished with $problems thing(s) left behind"
  exit 1
fi
# What down itself stopped is gone; e2e/scripts/check-clean.sh checks the
# whole machine (the teardown of every script that brings a cluster up runs
# it: e2e/scripts/teardown.sh).
log "down: everything it stopped is gone (logs of the run: $CACHE/last-run-logs)"
