#!/usr/bin/env bash
# Build Baton's container images and import them into the e2e cluster's
# containerd under fully-qualified names (docker.io/baton/<name>:$BATON_IMAGE_TAG,
# default `e2e`). Pods use them with imagePullPolicy: Never.
#
#   e2e/images.sh [all|NAME...]    NAME: pause empty sidecar operator webhook
#                                  demo-http-echo demo-tcp-echo demo-load demo-fetch nettools
#
# Every image Baton ships (and the demo-* workloads) is a target of the
# repo's Dockerfile, built by buildah (no Docker engine) with the command the
# README gives users, with the binaries built outside it:
#
#   buildah bud --build-arg BINARIES=prebuilt --target NAME -f Dockerfile CONTEXT
#
# CONTEXT ($BATON_CACHE/images/context) holds docker/rootfs.sh and the
# binaries as target/release/ (sidecar, empty) and target/control/ (the rest),
# as scripts/build-binaries.sh lays them out (the shipped ones from it; the
# test tools from BATON_TOOLS_DIR when set, see common.sh). The Dockerfile's
# FROM debian:bookworm-slim is a root that mmdebstrap makes from the
# machine's apt sources once per BASE_VERSION (no registry is reached: every
# build runs with --pull=never), kept in buildah's storage under
# $BATON_CACHE/buildah with the packages the Dockerfile installs on it (a
# layer cache), so a warm run only assembles and copies fresh binaries.
# Each image is exported as a docker-archive tarball to $BATON_CACHE/images/
# (BATON_IMAGES_OUT overrides) and imported with ctr (BATON_IMAGES_NO_IMPORT=1: only build them;
# BATON_IMAGES_NO_BUILD=1: pack the release binaries as they are, without
# running cargo). Every image's config is checked (a user other than root)
# and its size written to $BATON_CACHE/images/sizes.tsv: the sidecar image
# must stay within 30 MiB uncompressed.
#
# pause and nettools are test plumbing, not shipped, and not in the
# Dockerfile: each is one layer assembled here (pause from the Kubernetes
# tree, nettools from busybox and the host's iptables).
set -euo pipefail
E2E_DIR="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=e2e/scripts/common.sh
. "$E2E_DIR/scripts/common.sh"

OUT="${BATON_IMAGES_OUT:-$CACHE/images}"
UID_BATON=2137
mkdir -p "$OUT"

names=("$@")
rm -f "$OUT/sizes.tsv"
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

# The Dockerfile's images: buildah's storage, the base, the build context.
BUILDAH_DIR="$CACHE/buildah"
# Bump to rebuild the base root (and the packages on it) from the archive.
BASE_VERSION=bookworm-1
BASE_REF=docker.io/library/debian:bookworm-slim
BASE_TAG="localhost/baton-build/base:$BASE_VERSION"
PACKAGES_TAG="localhost/baton-build/rootfs-packages:$BASE_VERSION"
# The binaries and roots of the latest build: tagged, so a second run on the
# same binaries (the demo, then the suite) finds them in the layer cache.
PREBUILT_TAG="localhost/baton-build/prebuilt:latest"
ROOTFS_TAG="localhost/baton-build/rootfs:latest"
BASE_DIR="$CACHE/images/base"
CONTEXT="$OUT/context"
SIDECAR_MAX_BYTES=$((30 * 1024 * 1024))
bh() { buildah --root "$BUILDAH_DIR/storage" --runroot "$BUILDAH_DIR/run" --storage-driver overlay "$@"; }
# Build containers buildah leaves behind (a failed build can keep
# one) are removed on exit, pass or fail (they are this storage's own), and
# with them every mount under the storage (the containers' and the one its
# overlay driver keeps while a layer is mounted).
used_buildah=""
bh_cleanup() {
  [ -n "$used_buildah" ] || return 0
  bh rm --all >/dev/null 2>&1 || true
  local m
  for m in $(awk -v d="$BUILDAH_DIR/" 'index($2, d) == 1 { print $2 }' /proc/self/mounts | sort -r); do
    umount "$m" 2>/dev/null || log "could not unmount $m (buildah storage)"
  done
}
trap bh_cleanup EXIT

# base_image: the Dockerfile's FROM debian:bookworm-slim, made once per
# BASE_VERSION by mmdebstrap (variant minbase, what the slim image is) from
# this machine's apt sources, and the packages the Dockerfile's rootfs stage
# installs on it (tagged, so the layer cache keeps them).
base_image() {
  if bh inspect --type image "$BASE_TAG" >/dev/null 2>&1 && bh inspect --type image "$PACKAGES_TAG" >/dev/null 2>&1; then
    return 0
  fi
  command -v mmdebstrap >/dev/null && command -v buildah >/dev/null || die "buildah and mmdebstrap are needed (scripts/deps.sh)"
  local tar="$BASE_DIR/debian-$BASE_VERSION.tar" sources=() f c
  if [ ! -s "$tar" ]; then
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
      # Binary package sources only (a deb-src file would fetch source indexes).
      [ -s "$f" ] && grep -qE '^(deb |Types:(.* )?deb( |$))' "$f" && sources+=("$f")
    done
    [ ${#sources[@]} -gt 0 ] || die "no apt sources on this machine for the base image"
    log "base image $BASE_VERSION: mmdebstrap from ${sources[*]} (once per BASE_VERSION)"
    mkdir -p "$BASE_DIR"
    rm -f "$BASE_DIR"/debian-*.tar
    mmdebstrap --quiet --variant=minbase --mode=root --format=tar \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
      --aptopt='Acquire::Languages "none"' \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
      bookworm "$tar.tmp" "${sources[@]}" >&2
    mv "$tar.tmp" "$tar"
  fi
  log "base image $BASE_VERSION: importing into buildah's storage as $BASE_REF"
  # An older base and everything built on it go.
  bh rm --all >/dev/null 2>&1 || true
  bh rmi --all --force >/dev/null 2>&1 || true
  c=$(bh from --pull=never scratch)
  bh add "$c" "$tar" / >/dev/null
  bh config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd bash "$c"
  bh commit --quiet "$c" "$BASE_REF" >/dev/null
  bh rm "$c" >/dev/null
  bh tag "$BASE_REF" "$BASE_TAG"
  log "base image $BASE_VERSION: the Dockerfile's rootfs-packages stage (apt, once)"
  dockerfile_build rootfs-packages "$PACKAGES_TAG" >&2
}

# dockerfile_build TARGET REF: the README's command, with prebuilt binaries.
dockerfile_build() {
  bh bud --quiet --layers --pull=never --isolation chroot \
    --build-arg BINARIES=prebuilt --target "$1" -t "$2" -f "$REPO/Dockerfile" "$CONTEXT"
}

# context: the build context of a prebuilt build (the paths the Dockerfile's
# `prebuilt` stage copies). The binaries are staged without their debug info
# (objcopy --strip-debug: what the images ship anyway; the Dockerfile strips
# again and links an empty .gnu_debuglink), so that buildah's cache check,
# which hashes the copied files once per target, reads ~60 MiB rather than
# the ~250 MiB of release binaries with line tables plus the test tools'
# debug builds. Unchanged binaries keep their staged copy (and the cache).
context_ready=""
context() {
  [ -n "$context_ready" ] && return 0
  local b src stamp dir
  if ! cargo_bins baton-sidecar; then
    return 1
  fi
  mkdir -p "$CONTEXT/target/release" "$CONTEXT/target/control" "$CONTEXT/docker"
  cp "$REPO/docker/rootfs.sh" "$CONTEXT/docker/"
  for b in baton-operator baton-webhook baton-sidecar baton-empty demo-http-echo demo-tcp-echo demo-load demo-fetch; do
    case "$b" in baton-*) src="$(bin_path "$b")" ;; *) src="$(tool_bin "$b")" ;; esac
    [ -x "$src" ] || { log "no binary $src"; return 1; }
    # Restaged only when the source changed (inode, size, mtime).
    stamp="$(stat -L -c '%i %s %Y' "$src") $src"
    # The Dockerfile's prebuilt stage copies each from its profile's dir.
    case "$b" in baton-sidecar | baton-empty) dir="$CONTEXT/target/release" ;; *) dir="$CONTEXT/target/control" ;; esac
    if [ ! -e "$dir/$b" ] || [ "$(cat "$CONTEXT/$b.stamp" 2>/dev/null)" != "$stamp" ]; then
      objcopy --strip-debug "$src" "$dir/$b.tmp"
      mv "$dir/$b.tmp" "$dir/$b"
      printf '%s\n' "$stamp" >"$CONTEXT/$b.stamp"
    fi
  done
  context_ready=1
}

rootfs_ready=""
# dockerfile_image NAME: the Dockerfile's target NAME, checked, exported, imported.
dockerfile_image() {
  local name=$1 ref="$IMAGE_REPO/$1:$IMAGE_TAG" user size
  if ! context; then
    skipped+=("$name (the release build failed or a binary is missing)")
    return 0
  fi
  used_buildah=1
  base_image
  if [ -z "$rootfs_ready" ]; then
    dockerfile_build prebuilt "$PREBUILT_TAG" >/dev/null
    dockerfile_build rootfs "$ROOTFS_TAG" >/dev/null
    rootfs_ready=1
  fi
  dockerfile_build "$name" "$ref" >/dev/null
  # Every image runs as a user other than root (its config says so; the
  # injected init container alone is run as root, by its Pod spec).
  user=$(bh inspect --type image --format '{{.OCIv1.Config.User}}' "$ref")
  case "${user%%:*}" in
    "" | 0 | root) die "image $ref runs as root (User '$user')" ;;
  esac
  rm -f "$OUT/$name.tar"
  bh push --quiet "$ref" "docker-archive:$OUT/$name.tar:$ref"
  # Uncompressed: the layers as the archive holds them (tar streams).
  size=$(tar -tvf "$OUT/$name.tar" | awk '$6 ~ /\.tar$/ && $1 !~ /^l/ { s += $3 } END { print s + 0 }')
  printf '%s\t%s\t%s\n' "$name" "$size" "$user" >>"$OUT/sizes.tsv"
  log "image $name: $(awk -v b="$size" 'BEGIN { printf "%.1f MiB", b / 1048576 }') uncompressed, user $user"
  if [ "$name" = sidecar ] && [ "$size" -gt "$SIDECAR_MAX_BYTES" ]; then
    die "the sidecar image is $size bytes uncompressed, over the 30 MiB budget"
  fi
  if [ "${BATON_IMAGES_NO_IMPORT:-0}" != 1 ]; then
    ctr_k8s images import "$OUT/$name.tar" >/dev/null
  fi
  built+=("$ref")
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
    empty | sidecar | operator | webhook | demo-http-echo | demo-tcp-echo | demo-load | demo-fetch)
      dockerfile_image "$name"
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

# Layers of earlier builds no tag needs (the base and the packages stay).
if [ -n "$used_buildah" ]; then
  bh_cleanup
  bh rmi --prune >/dev/null 2>&1 || true
fi
for r in "${built[@]}"; do log "image $r"; done
if [ ${#skipped[@]} -gt 0 ]; then
  for s in "${skipped[@]}"; do log "SKIPPED image: $s"; done
  # Reported, never silent: the caller decides whether a skip is fatal.
  printf '%s\n' "${skipped[@]}" >"$OUT/skipped"
  exit 3
fi
rm -f "$OUT/skipped"
