#!/usr/bin/env bash
# Build Baton's container images as OCI image-layout tarballs, without a
# Docker engine, and import them into the e2e cluster's containerd under
# fully-qualified names (docker.io/baton/<name>:$BATON_IMAGE_TAG, default
# `e2e`). Pods use them with imagePullPolicy: Never.
#
#   e2e/images.sh [all|NAME...]    NAME: pause empty sidecar operator webhook
#                                  demo-http-echo demo-tcp-echo demo-load demo-fetch nettools
#
# Each image is one layer: a rootfs with the binary (release; the test
# tools' from BATON_TOOLS_DIR when set, see common.sh), the shared
# libraries `ldd` lists for it (the workspace builds glibc binaries; no musl
# target is installed), /etc/passwd and /tmp. The runtime stages of the repo's
# Dockerfile describe the same images (same binary, path, entrypoint, user).
# Tarballs are written to $BATON_CACHE/images/ (set BATON_IMAGES_NO_IMPORT=1
# to only build them; BATON_IMAGES_NO_BUILD=1 packs the release binaries
# already in target/release without running cargo).
set -euo pipefail
E2E_DIR="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=e2e/scripts/common.sh
. "$E2E_DIR/scripts/common.sh"

OUT="$CACHE/images"
RELEASE="${CARGO_TARGET_DIR:-$REPO/target}/release"
UID_BATON=2137
mkdir -p "$OUT"

names=("$@")
if [ ${#names[@]} -eq 0 ] || [ "${names[0]}" = all ]; then
  names=(pause empty sidecar operator webhook demo-http-echo demo-tcp-echo demo-load demo-fetch nettools)
fi

skipped=()
built=()

# copy_bin ROOTFS SRC DEST: the binary plus every shared library it needs.
copy_bin() {
  local rootfs=$1 src=$2 dest=$3 lib
  install -D -m 0755 "$src" "$rootfs$dest"
  if ldd "$src" >/dev/null 2>&1; then
    while read -r lib; do
      [ -n "$lib" ] && [ -e "$lib" ] || continue
      install -D -m 0755 "$(readlink -f "$lib")" "$rootfs$lib"
    done < <(ldd "$src" | awk '/=>/ { print $3 } !/=>/ && $1 ~ /^\// { print $1 }')
  fi
}

# add_iptables ROOTFS: iptables (nft backend, like the host's) with its
# dlopen()ed extensions, for containers that program a pod's netns.
add_iptables() {
  local rootfs=$1 xt so lib t
  xt="$(readlink -f /usr/sbin/xtables-nft-multi)"
  copy_bin "$rootfs" "$xt" /usr/sbin/xtables-nft-multi
  for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
    ln -sf xtables-nft-multi "$rootfs/usr/sbin/$t"
  done
  mkdir -p "$rootfs/usr/lib/x86_64-linux-gnu"
  cp -r /usr/lib/x86_64-linux-gnu/xtables "$rootfs/usr/lib/x86_64-linux-gnu/"
  for so in "$rootfs"/usr/lib/x86_64-linux-gnu/xtables/*.so; do
    while read -r lib; do
      if [ -n "$lib" ] && [ -e "$lib" ] && [ ! -e "$rootfs$lib" ]; then
        install -D -m 0755 "$(readlink -f "$lib")" "$rootfs$lib"
      fi
    done < <(ldd "$so" 2>/dev/null | awk '/=>/ { print $3 }')
  done
}

# strip_debug ROOTFS DEST: ships the binary without its debug info (the
# release profile keeps line tables for symbolized backtraces); the debug
# info goes to $OUT/debug/<name>.debug, linked by .gnu_debuglink, for
# symbolizing a core or a perf profile later.
strip_debug() {
  local rootfs=$1 dest=$2 name
  name=$(basename "$dest")
  mkdir -p "$OUT/debug"
  objcopy --only-keep-debug "$rootfs$dest" "$OUT/debug/$name.debug"
  objcopy --strip-debug --add-gnu-debuglink="$OUT/debug/$name.debug" "$rootfs$dest"
}

base_rootfs() { # ROOTFS [minimal]
  local rootfs=$1
  mkdir -p "$rootfs/etc" "$rootfs/tmp" "$rootfs/proc" "$rootfs/sys" "$rootfs/dev" "$rootfs/var/run/baton"
  chmod 1777 "$rootfs/tmp"
  printf 'root:x:0:0:root:/:/sbin/nologin\nbaton:x:%s:%s:baton:/:/sbin/nologin\n' $UID_BATON $UID_BATON >"$rootfs/etc/passwd"
  printf 'root:x:0:\nbaton:x:%s:\n' $UID_BATON >"$rootfs/etc/group"
  printf 'hosts: files\n' >"$rootfs/etc/nsswitch.conf"
  # The idle image never opens a TLS connection: no trust store.
  if [ "${2:-}" != minimal ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
  fi
}

sha() { sha256sum "$1" | cut -d' ' -f1; }

# oci_tar NAME ROOTFS ENTRYPOINT_JSON CMD_JSON USER: writes $OUT/NAME.tar and imports it.
oci_tar() {
  local name=$1 rootfs=$2 entrypoint=$3 cmd=$4 user=$5
  local ref="$IMAGE_REPO/$name:$IMAGE_TAG"
  local dir
  dir="$(mktemp -d)"
  mkdir -p "$dir/blobs/sha256"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$rootfs" -cf "$dir/layer.tar" .
  local layer_digest layer_size
  layer_digest="$(sha "$dir/layer.tar")"
  layer_size="$(stat -c %s "$dir/layer.tar")"
  mv "$dir/layer.tar" "$dir/blobs/sha256/$layer_digest"
  jq -n --argjson ep "$entrypoint" --argjson cmd "$cmd" --arg user "$user" --arg diff "sha256:$layer_digest" '{
      architecture: "amd64", os: "linux",
      config: ({Entrypoint: $ep, Env: ["PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"], WorkingDir: "/"}
               + (if $cmd == null then {} else {Cmd: $cmd} end)
               + (if $user == "" then {} else {User: $user} end)),
      rootfs: {type: "layers", diff_ids: [$diff]},
      history: [{created_by: "baton e2e/images.sh"}]
    }' >"$dir/config.json"
  local config_digest config_size
  config_digest="$(sha "$dir/config.json")"
  config_size="$(stat -c %s "$dir/config.json")"
  mv "$dir/config.json" "$dir/blobs/sha256/$config_digest"
  jq -n --arg cd "sha256:$config_digest" --argjson cs "$config_size" \
    --arg ld "sha256:$layer_digest" --argjson ls "$layer_size" '{
      schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
      config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $cd, size: $cs},
      layers: [{mediaType: "application/vnd.oci.image.layer.v1.tar", digest: $ld, size: $ls}]
    }' >"$dir/manifest.json"
  local manifest_digest manifest_size
  manifest_digest="$(sha "$dir/manifest.json")"
  manifest_size="$(stat -c %s "$dir/manifest.json")"
  mv "$dir/manifest.json" "$dir/blobs/sha256/$manifest_digest"
  jq -n --arg md "sha256:$manifest_digest" --argjson ms "$manifest_size" --arg ref "$ref" --arg tag "$IMAGE_TAG" '{
      schemaVersion: 2,
      manifests: [{mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $md, size: $ms,
                   annotations: {"io.containerd.image.name": $ref, "org.opencontainers.image.ref.name": $tag}}]
    }' >"$dir/index.json"
  printf '{"imageLayoutVersion":"1.0.0"}' >"$dir/oci-layout"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$dir" -cf "$OUT/$name.tar" oci-layout index.json blobs
  rm -rf "$dir"
  if [ "${BATON_IMAGES_NO_IMPORT:-0}" != 1 ]; then
    ctr_k8s images import "$OUT/$name.tar" >/dev/null
  fi
  built+=("$ref")
}

# cargo_bins PACKAGE: release-build a workspace package's binaries; false if it fails.
declare -A cargo_done=()
cargo_bins() {
  local pkg=$1
  if [ -z "${cargo_done[$pkg]:-}" ] && [ "${BATON_IMAGES_NO_BUILD:-0}" = 1 ]; then
    # Reuse the release binaries as they are (quick re-import after `up`).
    cargo_done[$pkg]=ok
  fi
  # The test tools are taken as they are from BATON_TOOLS_DIR when it is set.
  if [ "$pkg" = baton-e2e ] && [ -n "$TOOLS_DIR" ]; then
    return 0
  fi
  if [ -z "${cargo_done[$pkg]:-}" ]; then
    # One release build (common.sh): per-package builds unify features
    # differently and recompile the shared dependency tree once per package.
    log "release build (for $pkg)"
    if release_build >&2; then
      for p in baton-sidecar baton-operator baton-webhook baton-e2e; do cargo_done[$p]=ok; done
    fi
    cargo_done[$pkg]=${cargo_done[$pkg]:-failed}
  fi
  [ "${cargo_done[$pkg]}" = ok ]
}

# rust_image NAME PACKAGE BINARY ENTRYPOINT_JSON CMD_JSON USER [with-iptables]
rust_image() {
  local name=$1 pkg=$2 bin=$3 ep=$4 cmd=$5 user=$6 extra=${7:-}
  local src="$RELEASE/$bin"
  [ "$pkg" = baton-e2e ] && src="$(tool_bin "$bin")"
  if ! cargo_bins "$pkg" || [ ! -x "$src" ]; then
    skipped+=("$name (the build of $pkg failed or has no binary $src)")
    return 0
  fi
  local rootfs
  rootfs="$(mktemp -d)"
  if [ "$extra" = as-sidecar ]; then base_rootfs "$rootfs" minimal; else base_rootfs "$rootfs"; fi
  copy_bin "$rootfs" "$src" "/usr/local/bin/$bin"
  strip_debug "$rootfs" "/usr/local/bin/$bin"
  if [ "$extra" = with-iptables ]; then add_iptables "$rootfs"; fi
  # The idle image answers the sidecar's postStart hook (`baton-sidecar
  # wait-ready`), which stays on a slot swapped back to idle.
  if [ "$extra" = as-sidecar ]; then ln -s "$bin" "$rootfs/usr/local/bin/baton-sidecar"; fi
  # OpenSSL providers are loaded at run time (QAT offload via OPENSSL_CONF).
  if ldd "$src" 2>/dev/null | grep -q libssl && [ -d /usr/lib/x86_64-linux-gnu/ossl-modules ]; then
    mkdir -p "$rootfs/usr/lib/x86_64-linux-gnu"
    cp -r /usr/lib/x86_64-linux-gnu/ossl-modules "$rootfs/usr/lib/x86_64-linux-gnu/"
  fi
  oci_tar "$name" "$rootfs" "$ep" "$cmd" "$user"
  rm -rf "$rootfs"
}

for name in "${names[@]}"; do
  case "$name" in
    pause)
      bin_dir="$(k8s_bin)"
      rootfs="$(mktemp -d)"
      install -D -m 0755 "$bin_dir/pause" "$rootfs/pause"
      oci_tar pause "$rootfs" '["/pause"]' null "65535:65535"
      rm -rf "$rootfs"
      ;;
    empty) rust_image empty baton-sidecar baton-empty '["/usr/local/bin/baton-empty"]' null "$UID_BATON:$UID_BATON" as-sidecar ;;
    # `baton-sidecar init` (the injected init container) runs iptables.
    sidecar) rust_image sidecar baton-sidecar baton-sidecar '["/usr/local/bin/baton-sidecar"]' '["run"]' "$UID_BATON:$UID_BATON" with-iptables ;;
    operator) rust_image operator baton-operator baton-operator '["/usr/local/bin/baton-operator"]' null "$UID_BATON:$UID_BATON" ;;
    webhook) rust_image webhook baton-webhook baton-webhook '["/usr/local/bin/baton-webhook"]' null "$UID_BATON:$UID_BATON" ;;
    demo-http-echo | demo-tcp-echo | demo-load | demo-fetch)
      rust_image "$name" baton-e2e "$name" "[\"/usr/local/bin/$name\"]" null "$UID_BATON:$UID_BATON"
      ;;
    nettools)
      # Test-only image: busybox (sh, nc, wget, ip) and iptables with its
      # extensions, for init containers that program the pod's netns.
      rootfs="$(mktemp -d)"
      base_rootfs "$rootfs"
      copy_bin "$rootfs" "$(command -v busybox)" /bin/busybox
      for applet in sh nc wget ip cat echo sleep ls grep head; do ln -s busybox "$rootfs/bin/$applet"; done
      add_iptables "$rootfs"
      oci_tar nettools "$rootfs" '["/bin/sh"]' null ""
      rm -rf "$rootfs"
      ;;
    *) die "unknown image $name" ;;
  esac
done

for r in "${built[@]}"; do log "image $r"; done
if [ ${#skipped[@]} -gt 0 ]; then
  for s in "${skipped[@]}"; do log "SKIPPED image: $s"; done
  # Reported, never silent: the caller decides whether a skip is fatal.
  printf '%s\n' "${skipped[@]}" >"$OUT/skipped"
  exit 3
fi
rm -f "$OUT/skipped"
