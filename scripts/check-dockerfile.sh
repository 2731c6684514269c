#!/usr/bin/env bash
# Every binary the Dockerfile copies must be one the workspace builds, and every
# runtime target the e2e images use must exist in the Dockerfile.
set -euo pipefail
cd "$(dirname "$0")/.."
bins=$(cargo metadata --no-deps --format-version 1 --locked \
  | jq -r '.packages[].targets[] | select(.kind[] == "bin") | .name' | sort -u)
status=0
for b in $(grep -oE 'target/release/baton-[a-z0-9-]+' Dockerfile | sed 's|target/release/||' | sort -u); do
  if ! grep -qx "$b" <<<"$bins"; then
    echo "Dockerfile copies $b, which no workspace crate builds" >&2; status=1
  fi
done
for t in operator webhook sidecar empty; do
  grep -qE "^FROM .* AS $t\$" Dockerfile || { echo "Dockerfile lacks runtime target '$t'" >&2; status=1; }
done
[ $status = 0 ] && echo "Dockerfile binaries and targets match the workspace"
exit $status
