#!/usr/bin/env bash
# Provision the local cluster's binaries: Debian runtime packages (installed
# only when missing, services never auto-started) and kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet and kube-proxy built from Debian's
# `kubernetes` source package with Debian's Go. The build is cached under
# $BATON_CACHE/k8s/<debian-version>/bin, so a second run costs seconds.
#
# Fixes applied (see the shared notes on the local cluster): GOPATH mode
# (GO111MODULE=off, CGO_ENABLED=0, GOPROXY=off), `make gen_openapi` first,
# vendored modern-go/reflect2 1.0.1 replaced by Debian's 1.0.2 (the old one
# panics the apiserver on the first custom-resource create under Go >= 1.18),
# and version ldflags so components report v1.20.x.
set -euo pipefail

log() { printf '[provision %s] %s\n' "$(date +%T)" "$*" >&2; }

CACHE="${BATON_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/baton}"
RUNTIME_PKGS=(golang-go rsync jq dpkg-dev gcc libc6-dev make etcd-server containerd runc
  containernetworking-plugins conntrack iptables iproute2 openssl
  golang-github-modern-go-reflect2-dev busybox-static)
DEBSRC=/etc/apt/sources.list.d/baton-deb-src.sources

# --- apt: packages and the deb-src stanza --------------------------------
# Package maintainer scripts must never start services (containerd would
# otherwise come up on the host's default socket): a policy-rc.d that denies
# every start is put in place for the duration of the install if none exists.
with_no_service_start() {
  local installed_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    installed_policy=1
  fi
  local rc=0
  "$@" || rc=$?
  if [ "$installed_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  return "$rc"
}

apt_updated=0
apt_update_once() {
  if [ "$apt_updated" = 0 ]; then
    apt-get update -qq
    apt_updated=1
  fi
}

missing=()
for p in "${RUNTIME_PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt_update_once
  with_no_service_start apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -f "$DEBSRC" ]; then
  log "adding deb-src stanza $DEBSRC"
  sed -e 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources >"$DEBSRC"
  apt_updated=0
fi

# The Debian version of the source package keys the cache.
version_of_source() {
  apt-cache showsrc kubernetes 2>/dev/null | awk '/^Version:/{print $2}' | sort -V | tail -1
}
VER="$(version_of_source || true)"
if [ -z "$VER" ]; then
  apt_update_once
  VER="$(version_of_source || true)"
fi
[ -n "$VER" ] || { log "cannot find the kubernetes source package"; exit 1; }

KDIR="$CACHE/k8s/$VER"
BIN="$KDIR/bin"
COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
done_stamp="$BIN/.complete"
if [ -f "$done_stamp" ]; then
  for c in "${COMPONENTS[@]}" pause; do [ -x "$BIN/$c" ] || rm -f "$done_stamp"; done
fi
if [ -f "$done_stamp" ]; then
  log "cached: $BIN (kubernetes source $VER)"
  echo "$BIN"
  exit 0
fi

# --- source -----------------------------------------------------------------
GOPATH_DIR="$KDIR/gopath"
TREE="$GOPATH_DIR/src/k8s.io/kubernetes"
if [ ! -f "$TREE/.baton-extracted" ]; then
  log "apt-get source kubernetes=$VER"
  rm -rf "$KDIR/dl" "$TREE"
  mkdir -p "$KDIR/dl" "$(dirname "$TREE")"
  (cd "$KDIR/dl" && apt-get source -qq "kubernetes=$VER" >/dev/null 2>&1 ||
    { apt_update_once; cd "$KDIR/dl" && apt-get source -qq "kubernetes=$VER"; })
  src="$(find "$KDIR/dl" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -1)"
  [ -n "$src" ] || { log "apt-get source produced no tree"; exit 1; }
  mv "$src" "$TREE"
  rm -rf "$KDIR/dl"
  # Fix 3: Debian's reflect2 1.0.2 instead of the vendored 1.0.1.
  r2=/usr/share/gocode/src/github.com/modern-go/reflect2
  [ -d "$r2" ] || { log "missing $r2 (golang-github-modern-go-reflect2-dev)"; exit 1; }
  rm -rf "$TREE/vendor/github.com/modern-go/reflect2"
  cp -r "$r2" "$TREE/vendor/github.com/modern-go/reflect2"
  touch "$TREE/.baton-extracted"
fi

# --- build --------------------------------------------------------------------
export GOPATH="$GOPATH_DIR" GO111MODULE=off CGO_ENABLED=0 GOPROXY=off GOFLAGS= GOTOOLCHAIN=local
export GOCACHE="$CACHE/go-build"
cd "$TREE"
UPSTREAM="$(sed -n 's/^\([0-9.]*\).*/\1/p' <<<"${VER#*really}")"
[ -n "$UPSTREAM" ] || UPSTREAM=1.20.2
MAJOR="${UPSTREAM%%.*}"; rest="${UPSTREAM#*.}"; MINOR="${rest%%.*}"
BUILD_DATE="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

if [ ! -f pkg/generated/openapi/zz_generated.openapi.go ]; then
  log "make gen_openapi"
  make gen_openapi >"$KDIR/gen_openapi.log" 2>&1 || { tail -30 "$KDIR/gen_openapi.log" >&2; exit 1; }
fi

ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  for prefix in "" "k8s.io/kubernetes/vendor/"; do
    p="$prefix$pkg"
    ldflags+=" -X $p.gitVersion=v$UPSTREAM -X $p.gitMajor=$MAJOR -X $p.gitMinor=$MINOR"
    ldflags+=" -X $p.gitCommit=debian-$VER -X $p.gitTreeState=clean -X $p.buildDate=$BUILD_DATE"
  done
done

mkdir -p "$BIN"
log "go build ${COMPONENTS[*]} ($(go version))"
t0=$(date +%s)
pkgs=()
for c in "${COMPONENTS[@]}"; do pkgs+=("./cmd/$c"); done
go build -trimpath -ldflags "-s -w $ldflags" -o "$BIN/" "${pkgs[@]}"
log "go build took $(( $(date +%s) - t0 )) s"

# The sandbox (pause) image's binary, from the same tree.
log "gcc -static pause"
gcc -Os -Wall -static -DVERSION="v$UPSTREAM-baton" -o "$BIN/pause" build/pause/linux/pause.c

echo "$VER" >"$BIN/.version"
touch "$done_stamp"
log "done: $BIN"
echo "$BIN"
