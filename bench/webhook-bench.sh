#!/usr/bin/env bash
# Admission latency of baton-webhook: open loop at a fixed rate against the
# real HTTPS server on 127.0.0.1 (release build), with the 404 path and the
# pure mutate() as peers measured in the same run. Bounded: at most 60 s and
# 20 000 requests per phase.
#
#   bench/webhook-bench.sh                  # 200 req/s for 10 s, 2 connections
#   BATON_BENCH_RATE=500 BATON_BENCH_SECONDS=5 bench/webhook-bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export BATON_BENCH_RATE="${BATON_BENCH_RATE:-200}"
export BATON_BENCH_SECONDS="${BATON_BENCH_SECONDS:-10}"
export BATON_BENCH_CONNECTIONS="${BATON_BENCH_CONNECTIONS:-2}"
exec timeout 1800 cargo bench --locked -p baton-webhook --bench admission
