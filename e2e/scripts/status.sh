#!/usr/bin/env bash
# Report what the local cluster runs: recorded processes, node, guards.
# Exit 0 when every recorded process is alive and the apiserver is ready.
set -uo pipefail
E2E_DIR="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=e2e/scripts/common.sh
. "$E2E_DIR/scripts/common.sh"

if [ ! -d "$PIDS" ]; then
  echo "cluster: down (no run dir $RUN)"
  exit 1
fi
ok=0
echo "run dir: $RUN"
for f in "$PIDS"/*.pid; do
  [ -e "$f" ] || continue
  n="$(basename "$f" .pid)"
  p="$(cat "$f")"
  if pid_alive "$p"; then
    printf '  %-26s pid %-8s running  rss %s kB\n' "$n" "$p" "$(awk '/VmRSS/ { print $2 }' "/proc/$p/status" 2>/dev/null)"
  else
    printf '  %-26s pid %-8s DEAD (log: %s)\n' "$n" "$p" "$LOGS/$n.log"
    ok=1
  fi
done
if kc get --raw /readyz >/dev/null 2>&1; then
  echo "apiserver: ready ($(kc version -o json 2>/dev/null | jq -r .serverVersion.gitVersion))"
  kc get nodes -o wide 2>/dev/null | sed 's/^/  /'
  echo "pods: $(kc get pods -A --no-headers 2>/dev/null | wc -l)"
else
  echo "apiserver: not answering"
  ok=1
fi
if curl -fsS -o /dev/null "http://$KUBE_PROXY_HEALTHZ/healthz" 2>/dev/null; then
  echo "kube-proxy: healthy (iptables mode, $(iptables -w -t nat -S 2>/dev/null | grep -c '^-N KUBE-SVC-') service chains)"
else
  echo "kube-proxy: not healthy (log: $LOGS/kube-proxy.log)"
  ok=1
fi
echo "egress guards (packets dropped):"
for ipt in iptables ip6tables; do
  for c in "$GUARD_FWD" "$GUARD_OUT"; do
    n="$($ipt -w -L "$c" -v -x -n 2>/dev/null | awk 'NR > 2 { s += $1 } END { print s + 0 }')"
    $ipt -w -S "$c" >/dev/null 2>&1 && printf '  %-9s %-14s %s\n' "$ipt" "$c" "$n" || { printf '  %-9s %-14s MISSING\n' "$ipt" "$c"; ok=1; }
  done
done
echo "KUBECONFIG=$KUBECONFIG_ADMIN"
exit $ok
