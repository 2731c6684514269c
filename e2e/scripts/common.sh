# Shared settings of the e2e cluster scripts (sourced, not executed).
# Every path and port the harness uses is defined here, once.

CACHE="${BATON_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/baton}"
RUN="${BATON_E2E_RUN_DIR:-/tmp/baton-e2e}"
REPO="$(cd "$E2E_DIR/.." && pwd)"

PKI="$RUN/pki"
LOGS="$RUN/logs"
PIDS="$RUN/pids"
STATE="$RUN/state"
KUBECONFIG_ADMIN="$RUN/admin.kubeconfig"

NODE_NAME="$(hostname)"
BRIDGE=baton0
POD_SUBNET=10.88.0.0/16
POD_GATEWAY=10.88.0.1
SERVICE_RANGE=10.96.0.0/16
SERVICE_API_IP=10.96.0.1

ETCD_CLIENT_PORT=23791
ETCD_PEER_PORT=23801
APISERVER_PORT=6443
# The API server serves on the bridge gateway: the host reaches it there (a
# local address), Pods reach it through the `kubernetes` Service (kube-proxy
# DNATs 10.96.0.1:443 to this endpoint, which the API server's endpoint
# reconciler publishes). Nothing listens on other host addresses.
APISERVER_HOST=$POD_GATEWAY
APISERVER_URL="https://$APISERVER_HOST:$APISERVER_PORT"
# kube-proxy's own endpoints (loopback only).
KUBE_PROXY_METRICS=127.0.0.1:10249
KUBE_PROXY_HEALTHZ=127.0.0.1:10256
# Never answered: docker.io is pointed here so an accidental pull dies on loopback.
DEAD_REGISTRY=127.0.0.1:1

# Baton runs in Pods (e2e/overlay). The operator Service's ClusterIP is
# pinned so the webhook can inject it as the control-plane address (this
# cluster has no DNS); keep in step with e2e/overlay/kustomization.yaml.
OPERATOR_CLUSTER_IP=10.96.0.20
SYSTEM_NAMESPACE=baton-system
INSTALL_FIELD_MANAGER=baton-e2e-install

CONTAINERD_SOCK="$RUN/containerd/containerd.sock"
KUBELET_ROOT=/var/lib/kubelet
# Host paths the kubelet / libcni write outside the run dir; removed on down
# unless they existed before `up` (recorded in $STATE/preexisting).
# containerd 1.6 hard-codes its shims' socket dir /run/containerd/s.
HOST_PATHS=("$KUBELET_ROOT" /var/log/pods /var/log/containers /var/lib/cni /run/containerd)

# Sysctls the bridge plugin and the kubelet may change; recorded on up,
# restored on down.
SYSCTLS=(net/ipv4/ip_forward vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops
  kernel/keys/root_maxkeys kernel/keys/root_maxbytes net/ipv4/conf/all/route_localnet
  net/bridge/bridge-nf-call-iptables net/bridge/bridge-nf-call-ip6tables
  net/netfilter/nf_conntrack_max net/netfilter/nf_conntrack_tcp_timeout_established
  net/netfilter/nf_conntrack_tcp_timeout_close_wait)

GUARD_FWD=BATON-E2E-FWD
GUARD_OUT=BATON-E2E-OUT

IMAGE_REPO=docker.io/baton
IMAGE_TAG="${BATON_IMAGE_TAG:-e2e}"
PAUSE_IMAGE="$IMAGE_REPO/pause:$IMAGE_TAG"

# The binaries Baton ships (sidecar and its idle image, operator, webhook)
# come from scripts/build-binaries.sh, always (the sidecar's `release`
# profile, the control plane's `control` profile: decision 0057). The test tools (demo-http-echo,
# demo-tcp-echo, demo-load, demo-fetch, demo-rollout) come from
# BATON_TOOLS_DIR when it is set, as they are there: scripts/test.sh points
# it at the workspace test build, which already built them (a release build
# of the tools cost CI ~4 minutes of thin-LTO links; see decision 0043).
# Unset, the tools come from the same build (the demo and the benchmarks as a
# user runs them).
TOOLS_DIR="${BATON_TOOLS_DIR:-}"
# release_build: the one build per profile (scripts/build-binaries.sh, the
# Dockerfile's command too): the sidecar for `release`, the control plane
# (and, without BATON_TOOLS_DIR, the test tools) for `control`; a no-op when
# up to date.
release_build() {
  # scripts/test.sh built them already and runs `cargo test` beside the demo
  # (which holds the target dir's lock): no second cargo.
  [ "${BATON_RELEASE_BUILT:-0}" = 1 ] && return 0
  if [ -n "$TOOLS_DIR" ]; then
    "$REPO/scripts/build-binaries.sh" shipped
  else
    "$REPO/scripts/build-binaries.sh" all
  fi
}
# bin_path NAME: where the build above puts a binary Baton ships.
bin_path() {
  case "$1" in
    baton-sidecar | baton-empty) echo "${CARGO_TARGET_DIR:-$REPO/target}/release/$1" ;;
    *) echo "${CARGO_TARGET_DIR:-$REPO/target}/control/$1" ;;
  esac
}
# tool_bin NAME: the path of a test tool's binary.
tool_bin() { echo "${TOOLS_DIR:-${CARGO_TARGET_DIR:-$REPO/target}/control}/$1"; }

log() { printf '[e2e %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

ctr_k8s() { ctr --address "$CONTAINERD_SOCK" -n k8s.io "$@"; }
kc() { kubectl --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }

# The directory holding the cached Kubernetes binaries (provisions if needed).
k8s_bin() { "$E2E_DIR/scripts/provision.sh"; }

pid_alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
recorded_pid() { cat "$PIDS/$1.pid" 2>/dev/null || true; }

# The ledger: every process the harness starts, and every container shim
# `down` finds, as "pid starttime name" in a file OUTSIDE the run dir (which
# `down` removes). A process that outlives its run is provably this
# project's own only when its PID *and* its start time (clock ticks since
# boot, /proc/PID/stat field 22: a reused PID has another) match a line; a
# later run may stop such a process by PID. Anything else is only reported.
LEDGER="$CACHE/started-pids"
pid_starttime() { sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | awk '{ print $20 }'; }
ledger_add() { # name pid
  local st
  st="$(pid_starttime "$2")"
  [ -n "$st" ] || return 0
  mkdir -p "$CACHE"
  printf '%s %s %s\n' "$2" "$st" "$1" >>"$LEDGER"
}
ledger_name() { # pid: the recorded name when the live process is the one recorded
  local st
  st="$(pid_starttime "$1")"
  [ -n "$st" ] && [ -f "$LEDGER" ] || return 1
  awk -v p="$1" -v s="$st" '$1 == p && $2 == s { print $3; found = 1; exit } END { exit !found }' "$LEDGER"
}
ledger_prune() { # keep only lines whose process still runs as recorded
  [ -f "$LEDGER" ] || return 0
  local pid st name tmp="$LEDGER.$$"
  : >"$tmp"
  while read -r pid st name; do
    [ "$(pid_starttime "$pid")" = "$st" ] && printf '%s %s %s\n' "$pid" "$st" "$name" >>"$tmp"
  done <"$LEDGER"
  mv "$tmp" "$LEDGER"
}
# Container shims of THIS cluster's containerd: the shim's command line names
# the containerd socket in the run dir (-address), which no other containerd
# uses. Read-only; the caller stops them by PID.
our_shims() {
  local pid
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = /usr/bin/containerd-shim-runc-v2 ] || continue
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "-address $CONTAINERD_SOCK " && echo "$pid"
  done
}

# One cluster operation at a time: up, install and down serialise on a lock
# outside the run dir (a `down` racing an `up` would let the `up` recreate
# what the `down` just removed). Held until the calling script exits.
cluster_lock() {
  # A script called by the lock holder (up → down) runs under its lock.
  [ "${BATON_E2E_LOCK_HELD:-0}" = 1 ] && return 0
  export BATON_E2E_LOCK_HELD=1
  mkdir -p "$CACHE"
  exec 9>"$CACHE/cluster.lock"
  if ! flock -n 9; then
    log "waiting for another cluster operation (lock $CACHE/cluster.lock)"
    flock -w 600 9 || die "another cluster operation holds $CACHE/cluster.lock"
  fi
}
