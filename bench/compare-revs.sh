#!/usr/bin/env bash
# Before/after for the HTTP/1.1 data plane: the sidecar built at two git
# revisions, each measured in the shared side-by-side harness against nginx
# (bench/sidecar-proxy-bench.sh), the two alternating round by round so both
# see the same machine. Because absolute numbers on a shared machine mean
# little, the answer is each revision's ratio against nginx measured in the
# same run, and the after/before quotient of those ratios.
#
#   PROXY_BENCH=/path/to/proxy-bench.sh bench/compare-revs.sh BEFORE [AFTER]
#
# BEFORE/AFTER: any git revision (AFTER defaults to HEAD). Env: ROUNDS
# (alternations, default 2), and every harness variable (DURATION, REPEATS,
# PEERS: default "direct nginx", TESTS, …). Binaries are built once per revision into
# ~/.cache/baton/compare-revs/ (kept; keyed by commit).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[[ ${1:-} == -h || -z ${1:-} ]] && { sed -n '2,14p' "$0"; exit 0; }
[[ -n ${PROXY_BENCH:-} && -x ${PROXY_BENCH:-} ]] \
  || die "set PROXY_BENCH to the shared harness's proxy-bench.sh (not part of this repository)"
need git cargo python3
bench_init compare-revs "${OUT:-}"
CACHE_DIR=${BATON_CACHE:-$HOME/.cache/baton}/compare-revs
mkdir -p "$CACHE_DIR/bin"

build_rev() {   # build_rev REV : prints the path of that commit's release sidecar
  local commit src bin
  commit=$(git -C "$BENCH_ROOT" rev-parse --verify "$1^{commit}") || die "unknown revision $1"
  bin=$CACHE_DIR/bin/baton-sidecar-$commit
  if [[ ! -x $bin ]]; then
    src=$WORK/src-$commit
    mkdir -p "$src"
    # -m: the files get the extraction time, not the commit's. With the
    # commit's mtimes, cargo takes the workspace crates another revision
    # left in the shared target dir for fresh (they are newer).
    git -C "$BENCH_ROOT" archive "$commit" | tar -x -m -C "$src"
    log "building the sidecar at ${commit:0:10}" >&2
    (cd "$src" && CARGO_TARGET_DIR=$CACHE_DIR/target \
      cargo build --locked --release -q -p baton-sidecar --bin baton-sidecar) >&2 \
      || die "the sidecar at ${commit:0:10} does not build"
    cp "$CACHE_DIR/target/release/baton-sidecar" "$bin"
    rm -rf "$src"
  fi
  echo "$bin"
}

BEFORE=$1 AFTER=${2:-HEAD}
BIN_BEFORE=$(build_rev "$BEFORE")
BIN_AFTER=$(build_rev "$AFTER")
# Two revisions that differ in the sidecar give different binaries: equal
# ones mean a build reused the other's artifacts, and the comparison would
# be A/A.
if [[ $(git -C "$BENCH_ROOT" rev-parse "$BEFORE^{commit}") != $(git -C "$BENCH_ROOT" rev-parse "$AFTER^{commit}") ]] \
  && cmp -s "$BIN_BEFORE" "$BIN_AFTER"; then
  die "the builds of $BEFORE and $AFTER are identical; remove them from $CACHE_DIR/bin and retry"
fi
export PEERS=${PEERS:-direct nginx} DURATION=${DURATION:-5} LAT_DURATION=${LAT_DURATION:-3} REPEATS=${REPEATS:-2}
# Each build runs with its own revision's bench/ (candidate commands and
# config templates): a config one revision needs (a new listener setting)
# is one the other may refuse.
bench_of() {   # bench_of REV : a directory holding that commit's bench/
  local commit dir
  commit=$(git -C "$BENCH_ROOT" rev-parse --verify "$1^{commit}")
  dir=$WORK/bench-$commit
  if [[ ! -d $dir ]]; then
    mkdir -p "$dir"
    git -C "$BENCH_ROOT" archive "$commit" bench | tar -x -m -C "$dir"
  fi
  if [[ -x $dir/bench/sidecar-proxy-bench.sh ]]; then
    echo "$dir"
  else   # older than the script: this checkout's bench/ runs it
    log "$1 has no bench/sidecar-proxy-bench.sh; using this checkout's bench/" >&2
    echo "$BENCH_ROOT"
  fi
}
DIR_BEFORE=$(bench_of "$BEFORE")
DIR_AFTER=$(bench_of "$AFTER")
for round in $(seq "${ROUNDS:-2}"); do
  for side in before after; do
    bin=BIN_${side^^} dir=DIR_${side^^}
    log "round $round: $side (${!bin##*/})"
    BATON_SIDECAR_BIN=${!bin} CANDIDATE_NAME=$side OUT_DIR=$OUT/$side-$round \
      "${!dir}/bench/sidecar-proxy-bench.sh" >"$OUT/$side-$round.log" 2>&1 \
      || { tail -20 "$OUT/$side-$round.log"; die "the harness failed ($side, round $round)"; }
  done
done

# Each summary's ratio lines: "plain/sat   before vs nginx:  throughput x1.234  cpu/req x0.567 …".
python3 - "$OUT" "${ROUNDS:-2}" <<'PY' | tee "$OUT/compare.txt"
import re, statistics as st, sys
out, rounds = sys.argv[1], int(sys.argv[2])
# TLS lines name the candidate and peer with their kind and version:
# "tls/hs    after-ecdsa-1.3 vs nginx-ecdsa-1.3:  throughput x0.807 …".
pat = re.compile(r"^(\S+)\s+(before|after)(?:-\S+)? vs (\S+):\s+(.*)$")
vals = {}   # (test, peer, metric, side) -> [ratio per round]
for side in ("before", "after"):
    for r in range(1, rounds + 1):
        for line in open(f"{out}/{side}-{r}/summary.txt"):
            m = pat.match(line.strip())
            if not m:
                continue
            test, _, peer, rest = m.groups()
            for metric, x in re.findall(r"([\w/-]+) x([0-9.]+)", rest):
                vals.setdefault((test, peer, metric, side), []).append(float(x))
print(f"{'test':<12}{'metric':<16}{'before/peer':>12}{'after/peer':>12}{'after/before':>14}")
for (test, peer, metric, side) in sorted(vals):
    if side != "before" or (test, peer, metric, "after") not in vals:
        continue
    b = st.median(vals[(test, peer, metric, "before")])
    a = st.median(vals[(test, peer, metric, "after")])
    print(f"{test:<12}{metric + ' vs ' + peer:<16}{b:>12.3f}{a:>12.3f}{a / b:>14.3f}")
print("ratios are medians over rounds of each run's median ratio against the peer;")
print("throughput: >1 is better; cpu/req and overheads: <1 is better.")
PY
log "results: $OUT"
