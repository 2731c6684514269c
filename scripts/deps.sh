#!/usr/bin/env bash
# Debian packages the build and the tests need; installs only what is missing.
set -euo pipefail
# buildah and mmdebstrap: the Dockerfile's images without a Docker engine or a
# registry (e2e/images.sh).
pkgs=(build-essential pkg-config libssl-dev iptables iproute2 util-linux openssl curl jq python3 buildah mmdebstrap)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# kubectl ships with these machines; where it does not, Debian's client (1.20,
# the same version as the e2e API server) is enough for the suite.
if ! command -v kubectl >/dev/null; then
  echo "installing: kubernetes-client (kubectl)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends kubernetes-client >/dev/null
fi
