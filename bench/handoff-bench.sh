#!/usr/bin/env bash
# Handoff benchmark: duration for 100 / 1,000 / 10,000 idle keep-alive
# connections, probe latency p50/p99 in steady state vs during the handoff
# (same run), and peak RSS (VmHWM) of both processes. Loopback only.
#
#   bench/handoff-bench.sh                  # 100,1000,10000
#   BATON_BENCH_CONNS=100,1000 bench/handoff-bench.sh
#   BATON_BENCH_SLOWEST=8 ...     # when the 8 slowest requests of the window started
#   BATON_BENCH_RUNTIME='event_interval: 8' ...   # extra `runtime` keys for both sidecars
#   BATON_BENCH_UP_EXTRA='pool_max_idle_per_endpoint: 2' ...   # extra keys of the upstream cluster
#
# Prints a Markdown table (the format of docs/performance.md's handoff section).
set -euo pipefail
cd "$(dirname "$0")/.."
# 10,000 connections need ~10,100 descriptors in the client and in each
# sidecar (each process has its own table); children inherit this limit.
ulimit -n "$(ulimit -Hn)"
if [ "$(ulimit -n)" -lt 12000 ]; then
  echo "RLIMIT_NOFILE is $(ulimit -n); 10,000 connections need >= 12000" >&2
fi
exec cargo test --release -p baton-sidecar --test integration handoff_bench:: -- --ignored --nocapture --test-threads 1
