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
# Rules of anyone's chains that still name the cluster's ranges or bridge
# (kube-proxy's conntrack/mark rules live in KUBE-* chains, checked above).
for ipt in iptables ip6tables; do
  for t in filter nat mangle raw; do
    $ipt -w -t "$t" -S 2>/dev/null | grep -F -e "$POD_SUBNET" -e "$SERVICE_RANGE" -e " $BRIDGE " |
      while read -r r; do leftover "$ipt -t $t: $r"; done
  done
done
if command -v conntrack >/dev/null; then
  for range in "$POD_SUBNET" "$SERVICE_RANGE"; do
    n="$( { conntrack -L -s "$range" 2>/dev/null; conntrack -L -d "$range" 2>/dev/null; } | grep -c . || true)"
    [ "${n:-0}" = 0 ] || leftover "$n conntrack entries of $range"
  done
fi
ip link show "$BRIDGE" >/dev/null 2>&1 && leftover "bridge $BRIDGE"
ip -o link show | grep -q 'veth' && leftover "veth interfaces: $(ip -o link show | grep veth | awk -F': ' '{print $2}' | tr '\n' ' ')"
for p in "${HOST_PATHS[@]}"; do [ -e "$p" ] && leftover "path $p"; done
# Processes whose executable is one the harness starts (by path, read-only check).
for pid in $(ls /proc | grep -E '^[0-9]+$'); do
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || continue
  case "$exe" in
    */kube-apiserver | */kube-controller-manager | */kube-scheduler | */kubelet | */kube-proxy | /usr/bin/etcd | /usr/bin/containerd | /usr/bin/containerd-shim-runc-v2)
      leftover "process $pid $exe" ;;
  esac
done
# Sysctls as found before `up` (down copies the record out of the run dir).
if [ -f "$CACHE/last-run-sysctls" ]; then
  while read -r path value; do
    [ -r "/proc/sys/$path" ] || continue
    now="$(cat "/proc/sys/$path")"
    [ "$now" = "$value" ] || leftover "sysctl $path=$now (was $value before up)"
  done <"$CACHE/last-run-sysctls"
else
  echo "note: no record of the sysctls before up; net.ipv4.ip_forward=$(cat /proc/sys/net/ipv4/ip_forward)"
fi

[ "$left" = 0 ] && echo "clean: nothing left behind"
exit "$left"
