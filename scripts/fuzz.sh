#!/usr/bin/env bash
# Bounded fuzz run for CI (scripts/test.sh calls it): libFuzzer over the
# sidecar's HTTP/1 request-head parsing and validation, tls-record's state
# and record parsing, the carried form of an HTTP/2 connection's state
# (`h2_state`, decision 0060) and the config stream's frames as an operator
# reads them (`push_frames`, decision 0066) (sidecar/fuzz), on the
# repository's pinned stable toolchain. Fails on the first crash or failed
# assertion; the crashing input is left in sidecar/fuzz/artifacts/<target>/.
#
#   BATON_FUZZ_BUDGET   seconds of fuzzing for the whole run, shared evenly
#                       by the targets (default 60; at least 10 per target)
#   BATON_FUZZ_SECONDS  seconds per target instead (overrides the budget)
#   BATON_FUZZ_TARGETS  targets to run (default: h1_head h1_framing tls_record
#                       h2_state push_frames)
#
# Why `--sanitizer none` (docs/decisions/0022-h1-fuzzing-in-ci.md): with it
# cargo-fuzz passes only stable rustc flags (SanitizerCoverage through
# `-Cpasses`/`-Cllvm-args`), so no nightly compiler is needed; the targets
# fuzz safe Rust (`unsafe` is forbidden in the code they reach), where
# AddressSanitizer finds nothing that panics and assertions do not.
set -euo pipefail
cd "$(dirname "$0")/.."
targets="${BATON_FUZZ_TARGETS:-h1_head h1_framing tls_record h2_state push_frames}"
# One budget for the run, not per target: a new target must not add a
# minute to every CI run (docs/decisions/0043-ci-time-budget.md).
n_targets=$(wc -w <<<"$targets")
seconds="${BATON_FUZZ_SECONDS:-$(( ${BATON_FUZZ_BUDGET:-60} / n_targets ))}"
[ "$seconds" -ge 10 ] || seconds=10

# cargo-fuzz from the crates registry, pinned (the README's version).
if ! cargo fuzz --version 2>/dev/null | grep -q '0\.13\.'; then
  cargo install cargo-fuzz --locked --version 0.13.2
fi

cd sidecar/fuzz
# Its own workspace (not a member of the root one): start from the root's
# lock file so it builds the dependency versions the sidecar is tested with.
[ -f Cargo.lock ] || cp ../../Cargo.lock Cargo.lock
# Instrumented builds must not share fingerprints with the workspace's.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/baton/target}/fuzz"
for t in $targets; do
  mkdir -p "corpus/$t"
  seeds=()
  [ -d "seeds/$t" ] && seeds=("seeds/$t")
  echo "fuzz: $t for ${seconds}s"
  cargo fuzz run --sanitizer none --debug-assertions "$t" "corpus/$t" "${seeds[@]}" -- \
    -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1
done
