#!/usr/bin/env bash
# Event-loop latency under handshake load, private-key offload on vs off.
#
# The point of offload: while full TLS handshakes saturate the signer, plain
# requests on *other* connections served by the same event loop must not
# wait behind the signatures. One sidecar (1 tokio worker, 1 crypto worker)
# with a Permissive listener (TLS and plaintext on one port, RSA-2048 key:
# the expensive signature), forwarding to nginx (`return 200`). Four cases in
# one go, each with a 1-connection plaintext probe (wrk --latency):
#   idle       probe only
#   inline     probe + handshake flood (wrk -c16, Connection: close), offload Disabled
#   offload    probe + handshake flood, offload Preferred (software pool)
#   control    probe to an idle sidecar while the same flood (offload on)
#              hits a second sidecar on the same CPUs: what the machine
#              itself (shared cores, the flood client next to the probe
#              client) adds, without the probed event loop serving the flood
# Reported: probe p50/p99 and the p99 ratio to idle, handshakes/s, and the
# probed sidecar's own event-loop lag p50/p99 (baton_sidecar_event_loop_lag_seconds,
# from the histogram's delta between two /metrics scrapes around the probe
# window; quantiles interpolated linearly inside a bucket, so they are
# estimates within one 1-2-5 bucket) with its p99 ratio to idle. Ratios are
# taken per repeat against that repeat's idle case; the summary gives the
# mean and the min-max over repeats (shared 2-core machine). Also from the
# probed event-loop thread's /proc schedstat over the same window (with one
# worker the runtime runs on the main thread): its CPU share and its mean
# run-queue wait per time slice, i.e. how much of the lag is waiting for a
# core rather than for other tasks.
#
# Usage: bench/tls-offload.sh [-d SECONDS] [-r REPEATS] [-o OUTDIR]
# Env:   BATON_SIDECAR_BIN (default: the release build, built if stale),
#        KEY_KIND rsa|ecdsa (default rsa), FLOOD_CONNS (16),
#        SIDECAR_RUNTIME: extra runtime keys for every sidecar, e.g.
#        "global_queue_interval: 4" (default: none, tokio's defaults),
#        CRYPTO_CPUS: pin the sidecars' crypto workers there (default: with
#        the rest of the sidecar on the server cpus).
set -euo pipefail
. "$(dirname "$0")/lib.sh"

DURATION=5 REPEATS=2 OUT=""
while getopts "d:r:o:h" o; do
  case $o in
    d) DURATION=$OPTARG ;; r) REPEATS=$OPTARG ;; o) OUT=$OPTARG ;;
    *) sed -n '2,36p' "$0"; exit 0 ;;
  esac
done
KEY_KIND=${KEY_KIND:-rsa}
FLOOD_CONNS=${FLOOD_CONNS:-16}
SIDECAR_RUNTIME=${SIDECAR_RUNTIME:-}
CRYPTO_CPUS=${CRYPTO_CPUS:-}
[[ $DURATION =~ ^[0-9]+$ && $REPEATS =~ ^[0-9]+$ ]] || die "-d and -r take integers"
(( DURATION >= 1 && DURATION <= 60 && REPEATS >= 1 && REPEATS <= 10 )) || die "refusing: 1<=DURATION<=60, 1<=REPEATS<=10"
need wrk nginx openssl taskset setsid ss curl
BIN=$(sidecar_bin) || exit 2
bench_init tls-offload "$OUT"
NCPU=$(nproc)
if (( NCPU >= 3 )); then SRV_CPUS=0,1 CLI_CPUS=2-$((NCPU - 1)); else SRV_CPUS=0 CLI_CPUS=$((NCPU - 1)); fi

PROBE_NICE=""
(( EUID == 0 )) && PROBE_NICE="nice -n -10"

# Upstream: nginx, 1 worker, 10-byte body.
UP=$(free_port)
nginx_upstream "$SRV_CPUS" "$UP" || exit 2

make_cert "$KEY_KIND" "$WORK"

start_sidecar() {   # start_sidecar MODE [TAG] -> sets SC_PID SC_PORT SC_ADMIN
  # TAG keeps a second sidecar's files (and handoff socket) apart.
  local mode=$1 tag=${2:-$1} port admin; port=$(free_port); admin=$(free_port)
  cat > "$WORK/sc-$tag.yaml" <<YAML
version: 1
admin: {address: "127.0.0.1:$admin"}
runtime: {worker_threads: 1${SIDECAR_RUNTIME:+, $SIDECAR_RUNTIME}}
listeners:
- {name: in, address: "127.0.0.1:$port", direction: inbound}
clusters:
- {name: up, endpoints: ["127.0.0.1:$UP"]}
routes:
- {name: r, backends: [{cluster: up}]}
tls:
  mode: Permissive
  min_version: "1.2"
  max_version: "1.2"
  alpn: ["http/1.1"]
  session_resumption: false
  require_client_cert: false
  source: {files: {cert_chain: "$WORK/cert.pem", key: "$WORK/key.pem", trust_bundle: "$WORK/cert.pem"}}
  offload: {mode: $mode, workers: 1}
YAML
  BATON_HANDOFF_SOCKET=$WORK/handoff-$tag.sock BATON_HANDOFF_STATUS_FILE=$WORK/handoff-$tag.json \
    start_bg "sc-$tag" "$SRV_CPUS" "$BIN" run --config "$WORK/sc-$tag.yaml"
  SC_PID=$LAST_PID SC_PORT=$port SC_ADMIN=$admin
  wait_port "$port" "$SC_PID" || die "sidecar ($tag) did not start; see $WORK/sc-$tag.log"
  if [[ -n $CRYPTO_CPUS ]]; then
    # The crypto workers (comm "baton-crypto-…") on their own cores, as a pod
    # with more than one core (or a QAT device) runs them.
    local t
    for t in /proc/"$SC_PID"/task/*; do
      if [[ $(cat "$t/comm" 2>/dev/null) == baton-crypto* ]]; then
        taskset -p -c "$CRYPTO_CPUS" "${t##*/}" >/dev/null
      fi
    done
  fi
}

# The event-loop lag histogram's cumulative buckets (le count), from /metrics.
scrape_lag() {   # scrape_lag ADMIN_PORT OUTFILE
  curl -s --max-time 2 "http://127.0.0.1:$1/metrics" |
    awk -F'[{}" ]+' '/^baton_sidecar_event_loop_lag_seconds_bucket/ {print $3, $NF}' > "$2" || true
}

# The event-loop thread's schedstat (run ns, run-queue wait ns, time slices)
# and a timestamp (ns).
sched_snap() {   # sched_snap PID OUTFILE
  { cat "/proc/$1/task/$1/schedstat" 2>/dev/null || echo "0 0 0"; } | awk -v t="$(date +%s%N)" '{print $1, $2, $3, t}' > "$2"
}

# Lag quantile from the delta of two scrapes, in ms: linear interpolation
# inside the bucket holding the rank (the first bucket's lower bound is 0).
# A rank in the +Inf bucket reports the last finite bound (a lower bound).
lag_q() {   # lag_q Q BEFORE AFTER
  awk -v q="$1" 'FILENAME == ARGV[1] {b[$1]=$2; next}
    {le[n]=$1; c[n]=$2-b[$1]; n++}
    END {
      if (n == 0 || c[n-1] <= 0) { print "-"; exit }
      t = q * c[n-1]; lo = 0; pc = 0
      for (i = 0; i < n; i++) {
        if (le[i] == "+Inf") { print lo * 1000; exit }
        if (c[i] >= t) { up = le[i] + 0; v = (c[i] > pc) ? lo + (up - lo) * (t - pc) / (c[i] - pc) : up; printf "%.4f\n", v * 1000; exit }
        lo = le[i] + 0; pc = c[i]
      }
    }' "$2" "$3"
}

# wrk's --latency percentile line -> milliseconds
pct() { awk -v q="$1" '$1==q {v=$2; if (v ~ /us$/) {sub(/us/,"",v); v/=1000} else if (v ~ /ms$/) {sub(/ms/,"",v)} else if (v ~ /s$/) {sub(/s/,"",v); v*=1000}; print v}' "$2"; }

run_case() {   # run_case NAME MODE FLOOD(0|1|2) REP   (2: flood a second sidecar)
  local name=$1 mode=$2 flood=$3 rep=$4 fpid="" flood_pid="" flood_port
  start_sidecar "$mode"
  local base="$OUT/$name-$rep" probe_pid=$SC_PID probe_port=$SC_PORT SC_ADMIN_PROBE=$SC_ADMIN
  flood_port=$SC_PORT
  if (( flood == 2 )); then
    start_sidecar "$mode" "$mode-flood"; flood_pid=$SC_PID; flood_port=$SC_PORT
  fi
  if (( flood )); then
    timeout $((DURATION + 10)) taskset -c "$CLI_CPUS" wrk -t1 -c"$FLOOD_CONNS" -d"$((DURATION + 1))s" \
      -H 'Connection: close' "https://127.0.0.1:$flood_port/" >"$base.flood" 2>&1 &
    fpid=$!
    sleep 0.5
  fi
  # The probe client shares its CPU with the flood client; as root it runs at
  # a higher priority so the flood client does not delay the measurement.
  scrape_lag "$SC_ADMIN_PROBE" "$base.lag-before"
  sched_snap "$probe_pid" "$base.sched-before"
  timeout $((DURATION + 10)) $PROBE_NICE taskset -c "$CLI_CPUS" wrk -t1 -c1 -d"${DURATION}s" --latency \
    "http://127.0.0.1:$probe_port/" >"$base.probe" 2>&1 || true
  sched_snap "$probe_pid" "$base.sched-after"
  scrape_lag "$SC_ADMIN_PROBE" "$base.lag-after"
  [[ -n $fpid ]] && wait "$fpid" || true
  stop_pid "$probe_pid"
  [[ -n $flood_pid ]] && stop_pid "$flood_pid"
  local p50 p99 hs="" l50 l99 ln cpu rqw
  p50=$(pct 50% "$base.probe"); p99=$(pct 99% "$base.probe")
  (( flood )) && hs=$(awk '/Requests\/sec/ {print $2}' "$base.flood")
  l50=$(lag_q 0.5 "$base.lag-before" "$base.lag-after"); l99=$(lag_q 0.99 "$base.lag-before" "$base.lag-after")
  ln=$(awk 'FILENAME == ARGV[1] {b[$1]=$2; next} $1=="+Inf" {print $2-b[$1]}' "$base.lag-before" "$base.lag-after")
  read -r cpu rqw < <(paste -d' ' "$base.sched-before" "$base.sched-after" |
    awk '{ dt = $8 - $4; ds = $7 - $3; printf "%.1f %.1f\n", (dt > 0 ? 100 * ($5 - $1) / dt : 0), (ds > 0 ? ($6 - $2) / ds / 1000 : 0) }')
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rep" "$p50" "$p99" "${hs:--}" "$l50" "$l99" "${ln:--}" "$cpu" "$rqw" >> "$OUT/results.tsv"
}

printf 'case\trep\tprobe_p50_ms\tprobe_p99_ms\thandshakes_per_s\tlag_p50_ms\tlag_p99_ms\tlag_samples\tloop_cpu_pct\tloop_rq_wait_us\n' > "$OUT/results.tsv"
{
  bench_header
  echo "sidecar: $BIN ($KEY_KIND key, TLS 1.2, 1 worker, 1 crypto worker), runtime extra: ${SIDECAR_RUNTIME:-none}, crypto cpus ${CRYPTO_CPUS:-server cpus}, server cpus $SRV_CPUS, client cpus $CLI_CPUS"
  echo "duration ${DURATION}s x $REPEATS repeats, flood: wrk -c$FLOOD_CONNS Connection: close over https, probe client: ${PROBE_NICE:-default priority}"
} > "$OUT/header.txt"
for ((rep = 1; rep <= REPEATS; rep++)); do
  run_case idle Preferred 0 "$rep"
  run_case inline Disabled 1 "$rep"
  run_case offload Preferred 1 "$rep"
  run_case control Preferred 2 "$rep"
done

# Per repeat: ratio to that repeat's idle p99 (end to end and event-loop lag);
# per case: means, and the ratios' min-max over repeats.
awk -F'\t' 'NR>1 { c=$1; r=$2; n[c]++; p50[c]+=$3; p99[c]+=$4; if ($5 != "-") hs[c]+=$5
    l50[c]+=$6; l99[c]+=$7; cpu[c]+=$9; rqw[c]+=$10; e99[c, r]=$4; g99[c, r]=$7; reps[r]=1 }
  function rng(a, c,   r, x, lo, hi) { lo=""; hi=""
    for (r in reps) { if (!((c, r) in a) || a["idle", r] <= 0) continue; x = a[c, r] / a["idle", r]
      if (lo == "" || x < lo) lo = x; if (hi == "" || x > hi) hi = x }
    return lo == "" ? "-" : sprintf("%.2f-%.2f", lo, hi) }
  END {
    printf "%-8s %9s %9s %9s %11s %10s %10s %9s %13s %13s %8s %7s\n", "case", "p50_ms", "p99_ms", "p99/idle", "range", "lag_p50_ms", "lag_p99_ms", "lag/idle", "range", "handshakes/s", "loop_cpu%", "rq_us"
    for (c in n) { a50[c]=p50[c]/n[c]; a99[c]=p99[c]/n[c]; b50[c]=l50[c]/n[c]; b99[c]=l99[c]/n[c] }
    split("idle inline offload control", order, " ")
    for (i = 1; i <= 4; i++) { c = order[i]; if (!(c in n)) continue
      printf "%-8s %9.3f %9.3f %9.2f %11s %10.3f %10.3f %9.2f %13s %13s %8.1f %7.1f\n", c, a50[c], a99[c],
        (a99["idle"] > 0 ? a99[c]/a99["idle"] : 0), rng(e99, c), b50[c], b99[c],
        (b99["idle"] > 0 ? b99[c]/b99["idle"] : 0), rng(g99, c), (c in hs ? sprintf("%.0f", hs[c]/n[c]) : "-"),
        cpu[c]/n[c], rqw[c]/n[c] }
  }' "$OUT/results.tsv" > "$OUT/summary.txt"
show_results "$OUT/header.txt" "$OUT/summary.txt"
