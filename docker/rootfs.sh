#!/bin/bash
# Assembles the root filesystem of each runtime image of the Dockerfile (run
# inside its `rootfs` stage, a Debian bookworm with binutils, iptables,
# libssl3 and ca-certificates installed):
#
#   baton-rootfs IN OUT           IN: the binaries (baton-sidecar, ...);
#                                 OUT/<image>/: one root per image
#   baton-rootfs --debug IN OUT   OUT/<binary>.debug: the debug info of each
#
# A root holds its binary (debug info stripped and linked by
# .gnu_debuglink), the shared libraries `ldd` lists for it (the workspace
# builds glibc binaries), /etc/passwd and /etc/group (root, baton 2137),
# /tmp, CA certificates, and the OpenSSL provider modules when the binary
# links libssl (the sidecar's `openssl` offload engine loads providers such
# as Intel's QAT provider through OPENSSL_CONF). The sidecar's root adds
# iptables (nft backend) with its extensions for `baton-sidecar init`; the
# idle image's root is the binary and the C runtime alone.
set -euo pipefail
uid=2137

if [ "${1:-}" = --debug ]; then
  in=$2 out=$3
  mkdir -p "$out"
  for b in "$in"/*; do objcopy --only-keep-debug "$b" "$out/${b##*/}.debug"; done
  exit 0
fi
in=$1 out=$2
multiarch=$(basename "$(dirname "$(readlink -f /usr/lib/*-linux-gnu/libc.so.6)")")
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

# libs ROOT FILE: every shared library FILE needs, at the path ldd gives.
libs() {
  local root=$1 file=$2 lib
  ldd "$file" >/dev/null 2>&1 || return 0 # static
  while read -r lib; do
    [ -n "$lib" ] && [ -e "$lib" ] && [ ! -e "$root$lib" ] || continue
    install -D -m 0755 "$(readlink -f "$lib")" "$root$lib"
  done < <(ldd "$file" | awk '/=>/ { print $3 } !/=>/ && $1 ~ /^\// { print $1 }')
}

# base ROOT [minimal]: the files every image has; minimal: no trust store.
base() {
  local root=$1
  mkdir -p "$root"/etc "$root"/tmp "$root"/proc "$root"/sys "$root"/dev "$root"/var/run/baton "$root"/usr/local/bin
  chmod 1777 "$root/tmp"
  printf 'root:x:0:0:root:/:/sbin/nologin\nbaton:x:%s:%s:baton:/:/sbin/nologin\n' $uid $uid >"$root/etc/passwd"
  printf 'root:x:0:\nbaton:x:%s:\n' $uid >"$root/etc/group"
  printf 'hosts: files\n' >"$root/etc/nsswitch.conf"
  if [ "${2:-}" != minimal ]; then
    install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  fi
}

# binary ROOT NAME: IN/NAME as /usr/local/bin/NAME without its debug info.
binary() {
  local root=$1 name=$2 dest=$1/usr/local/bin/$2
  objcopy --only-keep-debug "$in/$name" "$scratch/$name.debug"
  objcopy --strip-debug --add-gnu-debuglink="$scratch/$name.debug" "$in/$name" "$dest"
  chmod 0755 "$dest"
  libs "$root" "$dest"
  if ldd "$dest" 2>/dev/null | grep -q libssl && [ -d "/usr/lib/$multiarch/ossl-modules" ]; then
    mkdir -p "$root/usr/lib/$multiarch"
    cp -a "/usr/lib/$multiarch/ossl-modules" "$root/usr/lib/$multiarch/"
  fi
}

# iptables ROOT: xtables-nft-multi as iptables/ip6tables(-save/-restore),
# with the extensions it dlopen()s.
iptables() {
  local root=$1 t so
  install -D -m 0755 "$(readlink -f /usr/sbin/xtables-nft-multi)" "$root/usr/sbin/xtables-nft-multi"
  libs "$root" /usr/sbin/xtables-nft-multi
  for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
    ln -sf xtables-nft-multi "$root/usr/sbin/$t"
  done
  mkdir -p "$root/usr/lib/$multiarch"
  cp -a "/usr/lib/$multiarch/xtables" "$root/usr/lib/$multiarch/"
  for so in "$root/usr/lib/$multiarch"/xtables/*.so; do libs "$root" "$so"; done
}

for name in sidecar operator webhook; do
  base "$out/$name"
  binary "$out/$name" "baton-$name"
done
iptables "$out/sidecar"

# The idle image answers the sidecar's postStart hook (`baton-sidecar
# wait-ready`), which stays on a slot a rollout swaps back to it.
base "$out/empty" minimal
binary "$out/empty" baton-empty
ln -s baton-empty "$out/empty/usr/local/bin/baton-sidecar"

for name in demo-http-echo demo-tcp-echo demo-load demo-fetch; do
  base "$out/$name"
  binary "$out/$name" "$name"
done
