#!/usr/bin/env bash
# The sidecar in the shared side-by-side proxy harness (proxy-bench.sh: nginx,
# HAProxy and optionally Envoy against the same upstream, in one run,
# interleaved, reporting ratios). The harness is not part of this repository:
# point PROXY_BENCH at it. This fills in the sidecar's candidate commands
# (bench/sidecar.cmd; with -t or TLS=1 also bench/sidecar-tls.cmd, which
# renders bench/sidecar-tls.yaml.tmpl) and the peers docs/performance.md
# compares against; every other harness variable and option passes through.
#
#   PROXY_BENCH=/path/to/proxy-bench.sh bench/sidecar-proxy-bench.sh                 # plain HTTP/1.1
#   PROXY_BENCH=… TLS=1 TLS_KINDS="rsa ecdsa" TLS_VERSIONS="1.2 1.3" bench/sidecar-proxy-bench.sh
#   PROXY_BENCH=… DURATION=2 LAT_DURATION=1 REPEATS=1 bench/sidecar-proxy-bench.sh   # smoke run
#
# Env: BATON_SIDECAR_BIN (default: the release build, built if stale),
#      BATON_BENCH_OFFLOAD (TLS offload mode, default Preferred),
#      PEERS (default "direct nginx haproxy"), WITH_ENVOY (default 0).
# What a policy or an access log costs the sidecar itself (variants of one
# sidecar against each other, same upstream): bench/authz-bench.sh.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[[ ${1:-} == -h ]] && { sed -n '2,19p' "$0"; exit 0; }
[[ -n ${PROXY_BENCH:-} && -x ${PROXY_BENCH:-} ]] \
  || die "set PROXY_BENCH to the shared harness's proxy-bench.sh (not part of this repository)"
BATON_SIDECAR_BIN=$(sidecar_bin) || exit 2
export BATON_SIDECAR_BIN
cd "$BENCH_ROOT"   # the candidate commands name bench/ files relative to the repository
export CANDIDATE_NAME=${CANDIDATE_NAME:-baton}
CANDIDATE_CMD=$(<bench/sidecar.cmd)
CANDIDATE_TLS_CMD=$(<bench/sidecar-tls.cmd)
export CANDIDATE_CMD CANDIDATE_TLS_CMD
export PEERS=${PEERS:-direct nginx haproxy} WITH_ENVOY=${WITH_ENVOY:-0}
exec "$PROXY_BENCH" "$@"
