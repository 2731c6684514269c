#!/usr/bin/env bash
# The Dockerfile against the workspace and the e2e harness:
# - every binary it copies (in-image build and prebuilt) is one the workspace
#   builds, and both ways of getting binaries copy the same list;
# - every image e2e/images.sh builds from it (all but pause and nettools,
#   test plumbing) is a runtime target of it, FROM scratch with a non-root
#   USER, and docker/rootfs.sh assembles its root;
# - no stage but the in-image build names an image a registry would have to
#   serve beyond the Debian base (e2e builds with --pull=never).
set -euo pipefail
cd "$(dirname "$0")/.."
bins=$(cargo metadata --no-deps --format-version 1 --locked \
  | jq -r '.packages[].targets[] | select(.kind[] == "bin") | .name' | sort -u)
status=0
fail() { echo "$*" >&2; status=1; }
# The binaries of each stage's list of target/{release,control}/ paths.
stage_bins() {
  awk -v s="$1" '/^FROM / { on = ($NF == s) } on' Dockerfile \
    | grep -oE 'target/(release|control)/(baton|demo)-[a-z0-9-]+' | sort -u
}
built=$(stage_bins build)
prebuilt=$(stage_bins prebuilt)
[ -n "$built" ] || fail "cannot read the binaries of the Dockerfile's build stage"
[ "$built" = "$prebuilt" ] || fail "the build and prebuilt stages copy different binaries: $(diff <(echo "$built") <(echo "$prebuilt") | grep '^[<>]' | tr '\n' ' ')"
for b in $built; do
  grep -q "^!$b\$" .dockerignore || fail ".dockerignore leaves $b out of the build context"
  b=${b##*/}
  grep -qx "$b" <<<"$bins" || fail "Dockerfile copies $b, which no workspace crate builds"
  grep -qE "^  for b in .*\\b$b\\b" e2e/images.sh || fail "e2e/images.sh does not stage $b into the build context"
done
e2e_images=$(sed -n 's/^  names=(\([a-z].*\))$/\1/p' e2e/images.sh | tr ' ' '\n' | grep -vxE 'pause|nettools')
[ -n "$e2e_images" ] || { echo "cannot read the image list of e2e/images.sh" >&2; exit 1; }
for t in $e2e_images; do
  if ! grep -qE "^FROM scratch AS $t\$" Dockerfile; then
    fail "Dockerfile lacks the runtime target '$t' (FROM scratch AS $t)"
    continue
  fi
  user=$(awk -v s="$t" '/^FROM / { on = ($NF == s) } on && /^USER / { print $2 }' Dockerfile | tail -1)
  case "${user%%:*}" in "" | 0 | root) fail "target $t runs as root (USER '$user')" ;; esac
  grep -q "/roots/$t/" Dockerfile || fail "target $t copies no root from the rootfs stage"
  grep -qE "\"\\\$out/$t\"|\\\$out/\\\$name|for name in .*\\b$t\\b" docker/rootfs.sh || fail "docker/rootfs.sh does not assemble $t"
done
for img in $(awk '/^FROM / { print $2 }' Dockerfile | sort -u); do
  case "$img" in
    scratch | debian:bookworm-slim | 'rust:${RUST_VERSION}-bookworm' | '${BINARIES}') ;;
    *) grep -qE "^FROM .* AS $img\$" Dockerfile || fail "Dockerfile uses the image $img, which e2e cannot build from (only debian:bookworm-slim is made locally)" ;;
  esac
done
[ $status = 0 ] && echo "Dockerfile binaries and targets match the workspace and e2e/images.sh"
exit $status
