#!/usr/bin/env bash
# Event-loop latency under handshake load, private-key offload on vs off.
#
# The point of offload: while full TLS handshakes saturate the signer, plain
# requests on *other* connections served by the same event loop must not
# wait behind the signatures. One sidecar (1 tokio worker, 1 crypto worker)
# with a Permissive listener (TLS and plaintext on one port, RSA-2048 key:
# the expensive signature), forwarding to nginx (`return 200`). Three runs in
# one go, each with a 1-connection plaintext probe (wrk --latency):
#   idle       probe only
#   inline     probe + handshake flood (wrk -c16, Connection: close), offload Disabled
#   offload    probe + handshake flood, offload Preferred (software pool)
#   control    probe to an idle sidecar while the same flood (offload on)
#              hits a second sidecar on the same CPUs: what the machine
#              itself (shared cores, the flood client next to the probe
#              client) adds, without the probed event loop serving the flood
# Reported: probe p50/p99 and the p99 ratio to idle, handshakes/s. Ratios
# from one run only (shared 2-core machine).
#
# Usage: bench/tls-offload.sh [-d SECONDS] [-r REPEATS] [-o OUTDIR]
# Env:   BATON_SIDECAR_BIN (default target/release/baton-sidecar),
#        KEY_KIND rsa|ecdsa (default rsa), FLOOD_CONNS (16).
set -euo pipefail

DURATION=5 REPEATS=2 OUT=""
while getopts "d:r:o:h" o; do
  case $o in
    d) DURATION=$OPTARG ;; r) REPEATS=$OPTARG ;; o) OUT=$OPTARG ;;
    *) sed -n '2,20p' "$0"; exit 0 ;;
  esac
done
BIN=${BATON_SIDECAR_BIN:-target/release/baton-sidecar}
KEY_KIND=${KEY_KIND:-rsa}
FLOOD_CONNS=${FLOOD_CONNS:-16}
(( DURATION <= 60 && REPEATS <= 10 )) || { echo "refusing: DURATION<=60, REPEATS<=10" >&2; exit 2; }
[[ -x $BIN ]] || { echo "no sidecar binary at $BIN (cargo build --release -p baton-sidecar)" >&2; exit 2; }
for t in wrk nginx openssl taskset ss; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 2; }; done
OUT=${OUT:-${TMPDIR:-/tmp}/tls-offload/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
WORK=$OUT/work; mkdir -p "$WORK"
NCPU=$(nproc)
if (( NCPU >= 3 )); then SRV_CPUS=0,1 CLI_CPUS=2-$((NCPU - 1)); else SRV_CPUS=0 CLI_CPUS=$((NCPU - 1)); fi

PROBE_NICE=""
(( EUID == 0 )) && PROBE_NICE="nice -n -10"

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null || true; done
  sleep 0.3
  for p in "${PIDS[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM

free_port() {
  local p
  while :; do
    p=$(( 20000 + RANDOM % 12000 ))
    ss -ltn "sport = :$p" | grep -q ":$p" || { echo "$p"; return; }
  done
}

wait_port() {   # wait_port PORT PID
  for _ in $(seq 100); do
    kill -0 "$2" 2>/dev/null || return 1
    ss -ltn "sport = :$1" | grep -q ":$1" && return 0
    sleep 0.05
  done
  return 1
}

# Upstream: nginx, 1 worker, 10-byte body.
UP=$(free_port)
mkdir -p "$WORK/nginx/logs"
cat > "$WORK/nginx/nginx.conf" <<NGX
worker_processes 1; daemon off; pid $WORK/nginx/nginx.pid; error_log $WORK/nginx/error.log;
events { worker_connections 1024; }
http { access_log off; server { listen 127.0.0.1:$UP; location / { return 200 "0123456789"; } } }
NGX
setsid taskset -c "$SRV_CPUS" nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" >/dev/null 2>&1 &
PIDS+=($!); wait_port "$UP" "$!" || { echo "nginx did not start" >&2; exit 1; }

# Certificate.
if [[ $KEY_KIND == rsa ]]; then
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$WORK/key.pem" -out "$WORK/cert.pem" -days 2 \
    -subj /CN=localhost -addext subjectAltName=IP:127.0.0.1 2>/dev/null
else
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$WORK/key.pem" \
    -out "$WORK/cert.pem" -days 2 -subj /CN=localhost -addext subjectAltName=IP:127.0.0.1 2>/dev/null
fi

start_sidecar() {   # start_sidecar MODE [TAG] -> sets SC_PID SC_PORT
  # TAG keeps a second sidecar's files (and handoff socket) apart.
  local mode=$1 tag=${2:-$1} port; port=$(free_port)
  cat > "$WORK/sc-$tag.yaml" <<YAML
version: 1
admin: {address: "127.0.0.1:0"}
runtime: {worker_threads: 1}
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
    setsid taskset -c "$SRV_CPUS" "$BIN" run --config "$WORK/sc-$tag.yaml" >"$WORK/sc-$tag.log" 2>&1 &
  SC_PID=$!; PIDS+=($SC_PID); SC_PORT=$port
  wait_port "$port" "$SC_PID" || { echo "sidecar ($tag) did not start; see $WORK/sc-$tag.log" >&2; exit 1; }
}

stop_pid() { kill -TERM -- "-$1" 2>/dev/null || true; for _ in $(seq 40); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.05; done; kill -KILL -- "-$1" 2>/dev/null || true; }

# wrk's --latency percentile line -> milliseconds
pct() { awk -v q="$1" '$1==q {v=$2; if (v ~ /us$/) {sub(/us/,"",v); v/=1000} else if (v ~ /ms$/) {sub(/ms/,"",v)} else if (v ~ /s$/) {sub(/s/,"",v); v*=1000}; print v}' "$2"; }

run_case() {   # run_case NAME MODE FLOOD(0|1|2) REP   (2: flood a second sidecar)
  local name=$1 mode=$2 flood=$3 rep=$4 fpid="" flood_pid="" flood_port
  start_sidecar "$mode"
  local base="$OUT/$name-$rep" probe_pid=$SC_PID probe_port=$SC_PORT
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
  timeout $((DURATION + 10)) $PROBE_NICE taskset -c "$CLI_CPUS" wrk -t1 -c1 -d"${DURATION}s" --latency \
    "http://127.0.0.1:$probe_port/" >"$base.probe" 2>&1 || true
  [[ -n $fpid ]] && wait "$fpid" || true
  stop_pid "$probe_pid"
  [[ -n $flood_pid ]] && stop_pid "$flood_pid"
  local p50 p99 hs=""
  p50=$(pct 50% "$base.probe"); p99=$(pct 99% "$base.probe")
  (( flood )) && hs=$(awk '/Requests\/sec/ {print $2}' "$base.flood")
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rep" "$p50" "$p99" "${hs:--}" >> "$OUT/results.tsv"
}

printf 'case\trep\tprobe_p50_ms\tprobe_p99_ms\thandshakes_per_s\n' > "$OUT/results.tsv"
{
  echo "date: $(date -u)"; echo "host: $(uname -r), $NCPU cpus, load: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "sidecar: $BIN ($KEY_KIND key, TLS 1.2, 1 worker, 1 crypto worker), server cpus $SRV_CPUS, client cpus $CLI_CPUS"
  echo "duration ${DURATION}s x $REPEATS repeats, flood: wrk -c$FLOOD_CONNS Connection: close over https, probe client: ${PROBE_NICE:-default priority}"
} > "$OUT/header.txt"
for ((rep = 1; rep <= REPEATS; rep++)); do
  run_case idle Preferred 0 "$rep"
  run_case inline Disabled 1 "$rep"
  run_case offload Preferred 1 "$rep"
  run_case control Preferred 2 "$rep"
done

awk -F'\t' 'NR>1 { n[$1]++; p50[$1]+=$3; p99[$1]+=$4; if ($5 != "-") hs[$1]+=$5 }
  END {
    printf "%-8s %12s %12s %14s %14s\n", "case", "p50_ms", "p99_ms", "p99/idle", "handshakes/s"
    for (c in n) { a50[c]=p50[c]/n[c]; a99[c]=p99[c]/n[c] }
    split("idle inline offload control", order, " ")
    for (i = 1; i <= 4; i++) { c = order[i]; if (!(c in n)) continue
      printf "%-8s %12.3f %12.3f %14.2f %14s\n", c, a50[c], a99[c], (a99["idle"] > 0 ? a99[c]/a99["idle"] : 0), (c in hs ? sprintf("%.0f", hs[c]/n[c]) : "-") }
  }' "$OUT/results.tsv" > "$OUT/summary.txt"
cat "$OUT/header.txt" "$OUT/summary.txt"
echo "raw: $OUT"
