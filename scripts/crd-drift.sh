#!/usr/bin/env bash
# Regenerates manifests/crds from the Rust types and fails on any difference.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cargo run -q --locked -p baton-crds --bin crdgen -- --out "$tmp"
if ! diff -ru manifests/crds "$tmp"; then
  echo "manifests/crds is stale: run 'cargo run -p baton-crds --bin crdgen -- --out manifests/crds'" >&2
  exit 1
fi
echo "CRDs match the Rust types"
