#!/usr/bin/env bash
# Baton's local single-node Kubernetes 1.20 for the end-to-end suite.
#
#   e2e/cluster.sh provision   build/cache the Kubernetes binaries (apt + Debian source)
#   e2e/cluster.sh up          start etcd, apiserver, controller-manager, scheduler,
#                              containerd and kubelet; prints KUBECONFIG=<path>
#   e2e/cluster.sh images      build the OCI images from release binaries and import them
#   e2e/cluster.sh install     apply the CRDs and the e2e overlay, start webhook/operator
#   e2e/cluster.sh down        stop everything by PID and undo every side effect
#   e2e/cluster.sh status      report what runs
#
# Everything binds to 127.0.0.1 or the private bridge; egress guard chains
# (BATON-E2E-FWD, BATON-E2E-OUT) are installed on `up` and removed on `down`.
# See e2e/README.md.
set -euo pipefail

E2E_DIR="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=e2e/scripts/common.sh
. "$E2E_DIR/scripts/common.sh"

cmd="${1:-}"
shift || true
case "$cmd" in
  provision) "$E2E_DIR/scripts/provision.sh" >/dev/null ;;
  up) "$E2E_DIR/scripts/up.sh" "$@" ;;
  images) "$E2E_DIR/images.sh" "$@" ;;
  install) "$E2E_DIR/scripts/install.sh" "$@" ;;
  down) "$E2E_DIR/scripts/down.sh" "$@" ;;
  status) "$E2E_DIR/scripts/status.sh" "$@" ;;
  *)
    echo "usage: $0 provision|up|images|install|down|status" >&2
    exit 2
    ;;
esac
