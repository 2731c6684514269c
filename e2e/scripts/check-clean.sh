#!/usr/bin/env bash
# Verify that the cluster's teardown left nothing behind: processes of the
# harness (kube-*, etcd, containerd, container shims), mounts, kubepods
# cgroups, KUBE-/CNI-/BATON-E2E- chains, rules naming the cluster's ranges,
# conntrack entries, the bridge, veths, host dirs, sysctls. Every leftover is
# printed with the command that removes it.
#
#   check-clean.sh                   every leftover fails (exit 1)
#   check-clean.sh --before FILE     before a run brings a cluster up: stops
#                                    the leftover processes that are provably
#                                    this project's own (PID and start time in
#                                    the ledger, e2e/scripts/common.sh), reports
#                                    the rest, records them in FILE; exit 0
#   check-clean.sh --baseline FILE   after the run's teardown: a leftover that
#                                    FILE lists was there before the run (an
#                                    earlier run's, or not ours): reported with
#                                    its command, not a failure; anything else
#                                    is this run's and fails (exit 1)
#
# Every script that brings a cluster up (e2e/run.sh, scripts/demo.sh,
# bench/rollout-bench.sh) calls `--before` first and e2e/scripts/teardown.sh
# (down, then `--baseline`) last.
set -uo pipefail
E2E_DIR="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=e2e/scripts/common.sh
. "$E2E_DIR/scripts/common.sh"

mode=after baseline=
case "${1:-}" in
  --before) mode=before baseline="${2:?--before FILE}" ;;
  --baseline) baseline="${2:?--baseline FILE}" ;;
  "") ;;
  *) die "usage: $0 [--before FILE | --baseline FILE]" ;;
esac

# Each leftover: a stable key (compared with the baseline) and the command
# that removes it, as "key<TAB>command" lines.
found=()
leftover() { found+=("$1"$'\t'"$2"); }

[ -d "$RUN" ] && leftover "run dir $RUN" "e2e/cluster.sh down"
while read -r m; do
  [ -n "$m" ] && leftover "mount $m" "umount -l '$m'"
done < <(awk -v a="$KUBELET_ROOT" -v b="$RUN" 'index($2, a) == 1 || index($2, b) == 1 || $2 ~ /^\/run\/netns\/cni-/ { print $2 }' /proc/self/mounts)
for c in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods /sys/fs/cgroup/*/kubepods.slice; do
  [ -d "$c" ] && leftover "cgroup $c" "find '$c' -depth -type d -exec rmdir {} \\;"
done
for ipt in iptables ip6tables; do
  for t in filter nat mangle raw; do
    while read -r r; do
      [ -n "$r" ] && leftover "$ipt -t $t: $r" "e2e/cluster.sh down"
    done < <($ipt -w -t "$t" -S 2>/dev/null | grep -E -- '(-N|-j) (KUBE-|CNI-|BATON-E2E-)')
    # Rules of anyone's chains that still name the cluster's ranges or bridge
    # (kube-proxy's conntrack/mark rules live in KUBE-* chains, checked above).
    while read -r r; do
      [ -n "$r" ] && leftover "$ipt -t $t: $r" "$ipt -w -t $t -D ${r#-A }"
    done < <($ipt -w -t "$t" -S 2>/dev/null | grep -F -e "$POD_SUBNET" -e "$SERVICE_RANGE" -e " $BRIDGE " | grep -vE -- '(-N|-j) (KUBE-|CNI-|BATON-E2E-)')
  done
done
if command -v conntrack >/dev/null; then
  for range in "$POD_SUBNET" "$SERVICE_RANGE"; do
    n="$( { conntrack -L -s "$range" 2>/dev/null; conntrack -L -d "$range" 2>/dev/null; } | grep -c . || true)"
    [ "${n:-0}" = 0 ] || leftover "conntrack entries of $range ($n now)" "conntrack -D -s $range; conntrack -D -d $range"
  done
fi
ip link show "$BRIDGE" >/dev/null 2>&1 && leftover "bridge $BRIDGE" "ip link delete $BRIDGE type bridge"
while read -r v; do
  [ -n "$v" ] && leftover "veth $v" "ip link delete $v"
done < <(ip -o link show type veth 2>/dev/null | awk -F': ' '{ sub(/@.*/, "", $2); print $2 }')
for p in "${HOST_PATHS[@]}"; do [ -e "$p" ] && leftover "path $p" "rm -rf '$p'"; done
# Processes whose executable is one the harness starts (read-only check by
# path; stopping is by PID, below, and only for the provably own).
for pid in $(ls /proc | grep -E '^[0-9]+$'); do
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || continue
  case "$exe" in
    */kube-apiserver | */kube-controller-manager | */kube-scheduler | */kubelet | */kube-proxy | /usr/bin/etcd | /usr/bin/containerd | /usr/bin/containerd-shim-runc-v2)
      if name="$(ledger_name "$pid")"; then
        leftover "process $pid $exe (started by this project as $name)" "kill $pid"
      else
        leftover "process $pid $exe (not in this project's ledger $LEDGER: check it is not someone else's)" "kill $pid"
      fi
      ;;
  esac
done
# Sysctls as found before `up` (down copies the record out of the run dir).
if [ -f "$CACHE/last-run-sysctls" ]; then
  while read -r path value; do
    [ -r "/proc/sys/$path" ] || continue
    now="$(cat "/proc/sys/$path")"
    [ "$now" = "$value" ] || leftover "sysctl $path=$now (was $value before up)" "echo $value > /proc/sys/$path"
  done <"$CACHE/last-run-sysctls"
fi

key() { printf '%s\n' "${1%%$'\t'*}" | sed 's/ ([0-9]* now)$//'; }
cmd() { printf '%s\n' "${1#*$'\t'}"; }

if [ "$mode" = before ]; then
  : >"$baseline"
  [ "${#found[@]}" = 0 ] && echo "clean: nothing left by an earlier run"
  for f in "${found[@]}"; do
    k="$(key "$f")"
    pid="$(printf '%s\n' "$k" | sed -n 's/^process \([0-9]*\) .*(started by this project as .*$/\1/p')"
    if [ -n "$pid" ]; then
      # Provably ours (PID and start time recorded when it was started):
      # an earlier run's survivor. Stop it by PID.
      kill -TERM "$pid" 2>/dev/null
      for _ in $(seq 1 30); do pid_alive "$pid" || break; sleep 0.1; done
      pid_alive "$pid" && kill -KILL "$pid" 2>/dev/null
      for _ in $(seq 1 30); do pid_alive "$pid" || break; sleep 0.1; done
      if ! pid_alive "$pid"; then
        echo "cleaned: $k (an earlier run's)"
        continue
      fi
    fi
    echo "left by an earlier run (not this one's): $k"
    echo "  remove with: $(cmd "$f")"
    printf '%s\n' "$k" >>"$baseline"
  done
  ledger_prune
  exit 0
fi

failed=0 earlier=0
for f in "${found[@]}"; do
  k="$(key "$f")"
  if [ -n "$baseline" ] && grep -qxF -- "$k" "$baseline" 2>/dev/null; then
    echo "left by an earlier run (there before this one; not a failure): $k"
    echo "  remove with: $(cmd "$f")"
    earlier=$((earlier + 1))
  else
    echo "leftover: $k"
    echo "  remove with: $(cmd "$f")"
    failed=1
  fi
done
if [ "$failed" = 0 ]; then
  if [ "$earlier" = 0 ]; then
    echo "clean: nothing left behind"
  else
    echo "clean: this run left nothing behind ($earlier leftover(s) of an earlier run listed above)"
  fi
fi
exit "$failed"
