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
# The e2e harness packs these images without Docker (pause and nettools are
# test plumbing, not shipped); each must have a Dockerfile runtime target.
e2e_images=$(sed -n 's/^  names=(\([a-z].*\))$/\1/p' e2e/images.sh | tr ' ' '\n' | grep -vxE 'pause|nettools')
[ -n "$e2e_images" ] || { echo "cannot read the image list of e2e/images.sh" >&2; exit 1; }
for t in $e2e_images; do
  grep -qE "^FROM .* AS $t\$" Dockerfile || { echo "Dockerfile lacks runtime target '$t'" >&2; status=1; }
done
[ $status = 0 ] && echo "Dockerfile binaries and targets match the workspace"
exit $status
