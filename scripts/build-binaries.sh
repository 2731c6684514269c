#!/usr/bin/env bash
# Builds Baton's binaries, one cargo build per profile (the Dockerfile's
# in-image build, e2e/images.sh, the demo and CI all run this):
#   release  (thin LTO)  baton-sidecar, baton-empty -> target/release/
#   control  (no LTO)    everything else            -> target/control/
# The control plane is not on the request path; LTO over kube and
# k8s-openapi bought it nothing and cost most of the build (decision 0057).
#
#   scripts/build-binaries.sh [all|shipped]
#     all      every binary of the workspace (default; what the Dockerfile
#              copies includes the demo-* workloads)
#     shipped  only the images' binaries: sidecar, empty, operator, webhook
#              (CI takes the test tools from its test build, decision 0043)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p baton-sidecar --bins
case "${1:-all}" in
  all) cargo build --profile control --locked --workspace --exclude baton-sidecar --bins ;;
  shipped) cargo build --profile control --locked -p baton-operator -p baton-webhook --bins ;;
  *) echo "usage: $0 [all|shipped]" >&2; exit 2 ;;
esac
