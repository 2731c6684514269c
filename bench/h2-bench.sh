#!/usr/bin/env bash
# HTTP/2 (prior-knowledge h2c) side by side: the sidecar vs nginx and HAProxy,
# plus direct h2c to the upstream, in ONE run, interleaved, repeated.
#
#   direct   h2load -> upstream nginx (h2c listener)          the floor
#   nginx    h2load -> nginx 1 worker (listen ... http2) -> upstream (HTTP/1.1 keep-alive pool)
#   haproxy  h2load -> haproxy nbthread 1 (bind ... proto h2) -> upstream (http-reuse always)
#   sidecar  h2load -> baton-sidecar --workers 1 (h2 detected by preface) -> upstream (HTTP/1.1 pool)
#
# The upstream is the one the shared proxy harness (proxy-bench.sh) uses (nginx, 1 worker,
# `return 200` with a 10-byte body), with a second, h2c listener for `direct`.
# Tests (h2load timing mode; one 5000-request warm-up per target first):
#   c16m1   16 connections, 1 stream each     (the HTTP/1.1 `sat` shape)
#   c1m16   1 connection, 16 concurrent streams (multiplexing)
# Reported per target: req/s, p50/p99 (from h2load's per-request log), proxy
# CPU µs per request (utime+stime of the proxy's process group from
# /proc/<pid>/stat), and per repeat the ratios vs nginx; the summary gives the
# median of the per-repeat ratios, and each proxy's peak RSS. Only ratios
# from one run mean anything on a shared machine.
#
# Everything listens on 127.0.0.1 (random ports), runs from a temp dir, and
# only the processes this script started are stopped (by process group).
# CPU pinning as proxy-bench.sh: 2 CPUs -> client on 1, upstream+proxy on 0.
#
# Usage: bench/h2-bench.sh [-d SECONDS] [-r REPEATS] [-o OUTDIR]
# Env:   BATON_SIDECAR_BIN (default: the release build, built if stale),
#        PEERS ("direct nginx haproxy"), TESTS ("c16m1 c1m16").
set -euo pipefail
. "$(dirname "$0")/lib.sh"

DURATION=5 REPEATS=3 OUT=""
while getopts "d:r:o:h" o; do
  case $o in
    d) DURATION=$OPTARG ;; r) REPEATS=$OPTARG ;; o) OUT=$OPTARG ;;
    *) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  esac
done
[[ $DURATION =~ ^[0-9]+$ && $REPEATS =~ ^[0-9]+$ ]] || die "-d and -r take integers"
(( DURATION >= 1 && DURATION <= 60 && REPEATS >= 1 && REPEATS <= 10 )) \
  || die "refusing: 1<=DURATION<=60, 1<=REPEATS<=10"
PEERS=${PEERS:-direct nginx haproxy}
TESTS=${TESTS:-c16m1 c1m16}
NEED_HINT="h2load: apt-get install nghttp2-client" need h2load nginx haproxy curl taskset setsid ss python3
BIN=$(sidecar_bin) || exit 2

bench_init h2-bench "$OUT"
RESULTS=$OUT/results.tsv
printf 'rep\ttarget\ttest\trps\tp50_us\tp99_us\tlogged\tfailed\tproxy_cpu_s\tok\n' > "$RESULTS"
exec > >(tee -a "$OUT/run.log") 2>&1

NCPU=$(nproc)
if (( NCPU >= 3 )); then UP_CPUS=0 PROXY_CPUS=1 CLI_CPUS=2-$((NCPU - 1))
elif (( NCPU == 2 )); then UP_CPUS=0 PROXY_CPUS=0 CLI_CPUS=1
else UP_CPUS=0 PROXY_CPUS=0 CLI_CPUS=0; fi

wait_h2() {    # wait_h2 PORT PID NAME : bounded wait for an h2c 200 with the upstream's body
  local body
  for _ in $(seq 100); do
    kill -0 "$2" 2>/dev/null || { echo "$3 exited; log:"; tail -n 20 "$WORK/$3.log"; return 1; }
    body=$(curl -s --http2-prior-knowledge --max-time 1 "http://127.0.0.1:$1/" 2>/dev/null || true)
    [[ $body == 0123456789 ]] && return 0
    sleep 0.1
  done
  echo "$3 did not answer h2c on port $1 with the upstream body; log:"; tail -n 20 "$WORK/$3.log"; return 1
}

nginx_common() {   # as proxy-bench.sh
  cat <<EOF
worker_processes 1;
daemon off;
master_process on;
pid $1/nginx.pid;
error_log $1/error.log warn;
worker_rlimit_nofile 65536;
events { worker_connections 16384; multi_accept on; }
http {
  access_log off;
  client_body_temp_path $1/tmp-body;
  proxy_temp_path $1/tmp-proxy;
  fastcgi_temp_path $1/tmp-fcgi;
  uwsgi_temp_path $1/tmp-uwsgi;
  scgi_temp_path $1/tmp-scgi;
  keepalive_requests 1000000;
  keepalive_timeout 60s;
  server_tokens off;
EOF
}

# ---------------------------------------------------------------- upstream
UP_PORT=$(free_port); UP_H2_PORT=$(free_port)
UPSTREAM=127.0.0.1:$UP_PORT
mkdir -p "$WORK/upstream"
{ nginx_common "$WORK/upstream"; cat <<EOF
  server {
    listen 127.0.0.1:$UP_PORT reuseport backlog=4096;
    listen 127.0.0.1:$UP_H2_PORT http2 reuseport backlog=4096;
    location / { default_type text/plain; return 200 "0123456789"; }
  }
}
EOF
} > "$WORK/upstream/nginx.conf"
start_bg upstream "$UP_CPUS" nginx -p "$WORK/upstream" -e "$WORK/upstream/error.log" -c "$WORK/upstream/nginx.conf"
UP_PID=$LAST_PID
wait_h2 "$UP_H2_PORT" "$UP_PID" upstream

# ---------------------------------------------------------------- targets
declare -A PORT_OF PID_OF
PORT_OF[direct]=$UP_H2_PORT; PID_OF[direct]=$UP_PID
TARGETS=()
for p in $PEERS; do
  case $p in
    direct) ;;
    nginx)
      port=$(free_port); mkdir -p "$WORK/nginx"
      { nginx_common "$WORK/nginx"; cat <<EOF
  upstream up { server $UPSTREAM; keepalive 64; keepalive_requests 1000000; }
  server {
    listen 127.0.0.1:$port http2 reuseport backlog=4096;
    location / {
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering on;
    }
  }
}
EOF
      } > "$WORK/nginx/nginx.conf"
      start_bg nginx "$PROXY_CPUS" nginx -p "$WORK/nginx" -e "$WORK/nginx/error.log" -c "$WORK/nginx/nginx.conf" ;;
    haproxy)
      port=$(free_port)
      cat > "$WORK/haproxy.cfg" <<EOF
global
  nbthread 1
  maxconn 4096
defaults
  mode http
  option http-keep-alive
  http-reuse always
  timeout connect 5s
  timeout client 60s
  timeout server 60s
  timeout http-keep-alive 60s
frontend fe
  bind 127.0.0.1:$port proto h2
  default_backend be
backend be
  server up1 $UPSTREAM
EOF
      start_bg haproxy "$PROXY_CPUS" haproxy -db -f "$WORK/haproxy.cfg" ;;
    *) echo "unknown peer $p" >&2; exit 2 ;;
  esac
  TARGETS+=("$p")
  [[ $p == direct ]] && continue
  PORT_OF[$p]=$port; PID_OF[$p]=$LAST_PID
  wait_h2 "$port" "$LAST_PID" "$p"
done
port=$(free_port)
start_bg sidecar "$PROXY_CPUS" "$BIN" run --listen "127.0.0.1:$port" --upstream "$UPSTREAM" --workers 1
PORT_OF[sidecar]=$port; PID_OF[sidecar]=$LAST_PID
wait_h2 "$port" "$LAST_PID" sidecar
TARGETS+=(sidecar)

log "out=$OUT upstream=$UPSTREAM (h2c $UP_H2_PORT) targets=${TARGETS[*]} tests=$TESTS ${REPEATS}x${DURATION}s"
log "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
h2load --version | head -n1

run_h2load() {   # run_h2load REP TARGET TEST
  local rep=$1 t=$2 test=$3 c m pg c0 c1 out stats
  c=${test#c}; c=${c%m*}; m=${test#*m}
  pg=${PID_OF[$t]}
  c0=$(pg_cpu "$pg")
  out=$(timeout $((DURATION + 20)) taskset -c "$CLI_CPUS" h2load -t1 -c"$c" -m"$m" \
          -D "$DURATION" --log-file="$WORK/req-$rep-$t-$test.tsv" \
          "http://127.0.0.1:${PORT_OF[$t]}/" 2>&1) || true
  c1=$(pg_cpu "$pg")
  echo "$out" > "$WORK/h2load-$rep-$t-$test.txt"
  # Proxy CPU over the whole h2load run per request logged in it (no
  # warm-up phase inside the measured run: h2load does not log warm-up
  # requests, but the proxy would burn CPU on them).
  stats=$(python3 - "$WORK/req-$rep-$t-$test.tsv" <<'PY'
import sys
lat = []
ok = 0
with open(sys.argv[1]) as f:
    for line in f:
        cols = line.split("\t")
        if len(cols) >= 3:
            lat.append(int(cols[2]))
            ok += cols[1] == "200"
lat.sort()
q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] if lat else 0
print(len(lat), ok, q(0.50), q(0.99))
PY
)
  read -r logged okd p50 p99 <<<"$stats"
  local rps failed cpu
  rps=$(grep -oE 'finished in [0-9.]+s, [0-9.]+ req/s' <<<"$out" | awk '{print $4}')
  failed=$(grep -oE '[0-9]+ failed' <<<"$out" | head -n1 | awk '{print $1}')
  cpu=$(awk -v a="$c0" -v b="$c1" 'BEGIN{printf "%.2f", b-a}')
  [[ $t == direct ]] && cpu=0
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$rep" "$t" "$test" "${rps:-0}" "$p50" "$p99" \
    "$logged" "${failed:-?}" "$cpu" "$okd" >> "$RESULTS"
  printf '  %-8s %-6s %10s req/s  p50 %5s us  p99 %6s us  cpu %5s s  (%s logged, %s ok, %s failed)\n' \
    "$t" "$test" "${rps:-0}" "$p50" "$p99" "$cpu" "$logged" "$okd" "${failed:-?}"
  rm -f "$WORK/req-$rep-$t-$test.tsv"
}

for t in "${TARGETS[@]}"; do   # warm-up: connections, pools, caches
  taskset -c "$CLI_CPUS" h2load -t1 -c16 -m1 -n 5000 "http://127.0.0.1:${PORT_OF[$t]}/" >/dev/null 2>&1 || true
done

n=${#TARGETS[@]}
for rep in $(seq 1 "$REPEATS"); do
  log "repeat $rep/$REPEATS"
  for test in $TESTS; do
    # rotate the order each repeat so no target always runs first
    for i in $(seq 0 $((n - 1))); do
      run_h2load "$rep" "${TARGETS[$(( (i + rep - 1) % n ))]}" "$test"
    done
  done
done

# Peak RSS (VmHWM) summed over each proxy's process group (nginx: master +
# worker), after all the load above.
{
  echo "peak RSS after the run (VmHWM, summed over the process group):"
  for t in "${TARGETS[@]}"; do
    [[ $t == direct ]] && continue
    kb=0
    for st in /proc/[0-9]*/stat; do
      line=$(cat "$st" 2>/dev/null) || continue
      rest=${line##*) }; read -r _ _ pgrp _ <<<"$rest"
      [[ $pgrp == "${PID_OF[$t]}" ]] || continue
      hwm=$(awk '/^VmHWM/{print $2}' "${st%/stat}/status" 2>/dev/null || true)
      kb=$((kb + ${hwm:-0}))
    done
    printf '  %-8s %6.1f MB\n' "$t" "$(awk -v k="$kb" 'BEGIN{print k/1024}')"
  done
} | tee "$OUT/rss.txt"

python3 - "$RESULTS" <<'PY' | tee "$OUT/summary.txt"
import csv, statistics, sys
rows = list(csv.reader(open(sys.argv[1]), delimiter="\t"))[1:]
by = {}
for rep, t, test, rps, p50, p99, logged, failed, cpu, ok in rows:
    by[(rep, t, test)] = dict(rps=float(rps), p50=int(p50), p99=int(p99), n=int(logged), cpu=float(cpu))
tests = sorted({k[2] for k in by}, reverse=True)
targets = []
for k in by:
    if k[1] not in targets:
        targets.append(k[1])
reps = sorted({k[0] for k in by})
print("medians over repeats (cpu us/req = proxy CPU over the run / requests logged):")
print(f"{'test':7} {'target':8} {'req/s':>9} {'p50 us':>7} {'p99 us':>7} {'+p50':>6} {'cpu us/req':>10}")
for test in tests:
    for t in targets:
        v = [by[(r, t, test)] for r in reps if (r, t, test) in by]
        d = [by[(r, "direct", test)] for r in reps if (r, "direct", test) in by]
        if not v:
            continue
        med = lambda key: statistics.median(x[key] for x in v)
        cpu = statistics.median(x["cpu"] * 1e6 / x["n"] for x in v if x["n"]) if t != "direct" else 0
        add = med("p50") - statistics.median(x["p50"] for x in d) if d else 0
        print(f"{test:7} {t:8} {med('rps'):9.0f} {med('p50'):7.0f} {med('p99'):7.0f} {add:6.0f} {cpu:10.1f}")
print()
print("ratios (median of per-repeat ratios):")
for test in tests:
    for peer in ("nginx", "haproxy"):
        if not any((r, peer, test) in by for r in reps):
            continue
        thr, cpu, p99 = [], [], []
        for r in reps:
            s, p = by.get((r, "sidecar", test)), by.get((r, peer, test))
            if not s or not p or not p["rps"] or not p["n"] or not s["n"]:
                continue
            thr.append(s["rps"] / p["rps"])
            if p["cpu"] > 0:
                cpu.append((s["cpu"] / s["n"]) / (p["cpu"] / p["n"]))
            if p["p99"]:
                p99.append(s["p99"] / p["p99"])
        if thr:
            print(f"h2/{test:6} sidecar vs {peer:8} throughput x{statistics.median(thr):.3f}"
                  f"  cpu/req x{statistics.median(cpu) if cpu else float('nan'):.3f}"
                  f"  p99 x{statistics.median(p99) if p99 else float('nan'):.3f}")
PY
log "done; results in $RESULTS"
