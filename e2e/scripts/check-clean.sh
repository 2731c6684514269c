#!/usr/bin/env bash
# Verify that `down` left nothing behind: processes from the run, mounts,
# kubepods cgroups, KUBE-/CNI-/BATON-E2E- chains, the bridge, host dirs,
# sysctls. Prints every leftover; exit 1 when there is any.
set -uo pipefail
E2E_DIR="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=e2e/scripts/common.sh
. "$E2E_DIR/scripts/common.sh"

left=0
leftover() { echo "leftover: $*"; left=1; }

[ -d "$RUN" ] && leftover "run dir $RUN"
awk -v a="$KUBELET_ROOT" -v b="$RUN" 'index($2, a) == 1 || index($2, b) == 1 || $2 ~ /^\/run\/netns\/cni-/ { print $2 }' /proc/self/mounts |
  while read -r m; do leftover "mount $m"; done
for c in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods /sys/fs/cgroup/*/kubepods.slice; do
  [ -d "$c" ] && leftover "cgroup $c"
done
for ipt in iptables ip6tables; do
  for t in filter nat mangle raw; do
    $ipt -w -t "$t" -S 2>/dev/null | grep -E -- '(-N|-j) (KUBE-|CNI-|BATON-E2E-)' | while read -r r; do leftover "$ipt -t $t: $r"; done
  done
done
ip link show "$BRIDGE" >/dev/null 2>&1 && leftover "bridge $BRIDGE"
ip -o link show | grep -q 'veth' && leftover "veth interfaces: $(ip -o link show | grep veth | awk -F': ' '{print $2}' | tr '\n' ' ')"
for p in "${HOST_PATHS[@]}"; do [ -e "$p" ] && leftover "path $p"; done
# Processes whose executable is one the harness starts (by path, read-only check).
for pid in $(ls /proc | grep -E '^[0-9]+$'); do
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || continue
  case "$exe" in
    */kube-apiserver | */kube-controller-manager | */kube-scheduler | */kubelet | /usr/bin/etcd | /usr/bin/containerd | /usr/bin/containerd-shim-runc-v2)
      leftover "process $pid $exe" ;;
  esac
done
[ "$(cat /proc/sys/net/ipv4/ip_forward)" = 0 ] || echo "note: net.ipv4.ip_forward=$(cat /proc/sys/net/ipv4/ip_forward) (restored to its value before up)"

[ "$left" = 0 ] && echo "clean: nothing left behind"
exit "$left"
