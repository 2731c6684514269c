#!/usr/bin/env bash
# Private-key signing speed of one thread: ring vs libcrypto (OpenSSL's
# built-in software implementation) for RSA-2048 and ECDSA P-256, interleaved
# in one process, plus `openssl speed` as the ceiling of the same machine.
# This is why the software offload engine signs RSA with libcrypto and ECDSA
# with ring. No network.
#
#   bench/sign-speed.sh                 # 3 interleaved rounds
#   BATON_BENCH_ROUNDS=5 bench/sign-speed.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --release -p baton-sidecar --test integration tls_offload::signing_speed_ring_vs_libcrypto \
  -- --ignored --nocapture --test-threads 1 2>&1 | grep '^|'
echo
echo "openssl speed (sign/s, 1 core):"
openssl speed -seconds 2 rsa2048 ecdsap256 2>/dev/null | grep -E '^(rsa 2048|[ ]*256 bits ecdsa)'
