#!/usr/bin/env bash
# Baton's main job, locally (README "Set-up commands"): a cluster-wide
# sidecar upgrade under load with zero failed requests.
#
#  1. Builds what it needs and brings up a real local Kubernetes
#     (e2e/cluster.sh: apiserver, etcd, scheduler, controller-manager,
#     kubelet, containerd, kube-proxy from Debian's archive).
#  2. Installs Baton with `kubectl apply` of manifests/ (two operator Pods,
#     two webhook Pods behind their Services).
#  3. demo-rollout: 5 injected echo pods under continuous byte-checked
#     traffic (HTTP/1.1, HTTP/2, TCP, app-level TLS); the SidecarRelease is
#     bumped v1 -> v2 -> v1 with a progress display, then to a broken v3
#     that must pause the rollout while every pod keeps serving; a report:
#     pods upgraded per version, exchanges sent / failed, resets, bytes
#     checked, per-Pod handoff time p50 / max, application restarts.
#  4. Tears the cluster down (BATON_DEMO_KEEP=1 keeps it up; then run
#     `e2e/cluster.sh down` yourself).
#
# BATON_DEMO_REPLICAS (default 5, at most 50) and BATON_DEMO_MAX_UNAVAILABLE
# (default 25%) size the scenario. Everything listens on 127.0.0.1 or the
# cluster's private bridge; every load is bounded; no packet leaves the
# machine (the cluster's egress guards, e2e/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/baton/target-$(rustc --version | awk '{print $2}')}"

# One cluster run at a time on the machine: the demo holds the cluster lock
# from `up` to the end of its teardown (e2e/scripts/common.sh).
E2E_DIR="$PWD/e2e"
# shellcheck source=e2e/scripts/common.sh
. e2e/scripts/common.sh
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
k8s_up=0
baseline=""
cleanup() {
  local rc=$?
  if [ "$k8s_up" = 1 ]; then
    if [ "${BATON_DEMO_KEEP:-0}" = 1 ]; then
      say "cluster left up (BATON_DEMO_KEEP=1): KUBECONFIG=${KUBECONFIG:-}; e2e/cluster.sh down removes it"
    else
      # The same teardown and check as e2e/run.sh: down, then every process,
      # mount, chain, ... verified gone (e2e/scripts/check-clean.sh).
      say "tearing the local cluster down and checking nothing is left behind"
      if ! e2e/scripts/teardown.sh "$baseline"; then
        echo "the demo's teardown left something behind (above)" >&2
        rc=1
      fi
    fi
  fi
  [ -n "$baseline" ] && rm -f "$baseline"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "installing packages and building (release; the first run also builds Kubernetes, ~10 min)"
scripts/deps.sh
# The same build as e2e/images.sh (e2e/scripts/common.sh: every workspace
# binary, release, unless BATON_TOOLS_DIR names where the test tools are):
# one build serves the demo and the images, and e2e/run.sh after the demo.
release_build 2>&1 | tail -1
e2e/cluster.sh provision

say "bringing up a local Kubernetes"
# What an earlier run left behind: stopped when provably this project's own
# (recorded PID and start time), otherwise listed with its removal command.
cluster_lock
baseline="$(mktemp /tmp/baton-demo-baseline.XXXXXX)"
e2e/scripts/check-clean.sh --before "$baseline"
k8s_up=1
KUBECONFIG=$(e2e/cluster.sh up | sed -n 's/^KUBECONFIG=//p' | tail -1)
export KUBECONFIG BATON_E2E_KUBECONFIG="$KUBECONFIG"
e2e/cluster.sh images
say "installing Baton: kubectl apply -f manifests/crds/ && kubectl apply -k manifests/ (e2e overlay)"
e2e/cluster.sh install
kubectl -n baton-system get deployments,pods -o wide
echo "operator leader: $(kubectl -n baton-system get lease baton-operator -o jsonpath='{.spec.holderIdentity}')"

keep=()
[ "${BATON_DEMO_KEEP:-0}" = 1 ] && keep=(--keep)
"$(tool_bin demo-rollout)" \
  --replicas "${BATON_DEMO_REPLICAS:-5}" \
  --max-unavailable "${BATON_DEMO_MAX_UNAVAILABLE:-25%}" \
  "${keep[@]}"
