#!/usr/bin/env bash
# HTTP/2 side by side: the sidecar vs nginx and Envoy (HAProxy on request),
# plus direct h2c to the upstream, in ONE run, interleaved, repeated — over
# h2c (prior knowledge) and h2 over TLS 1.3, with unary gRPC-sized calls.
#
#   direct   h2load -> upstream nginx (h2c listener)             the floor (h2c only)
#   nginx    h2load -> nginx 1 worker (http2 [ssl]) -> upstream (HTTP/1.1 keep-alive pool)
#   envoy    h2load -> envoy --concurrency 1 (HCM, codec AUTO) -> upstream (HTTP/1.1 pool)
#   haproxy  h2load -> haproxy nbthread 1 (proto h2 / alpn h2) -> upstream (http-reuse always)
#   sidecar  h2load -> baton-sidecar, 1 worker (h2 by preface / ALPN) -> upstream (HTTP/1.1 pool)
#
# Every request is a unary gRPC-shaped call: POST, `content-type:
# application/grpc`, `te: trailers`, a 512-byte body in gRPC message framing
# (1-byte flag, 4-byte length, 507 bytes); the upstream (nginx, 1 worker,
# HTTP/1.1) answers 200 with a 256-byte body. The upstream speaks HTTP/1.1
# for every proxy (what each does by default), so trailers are not part of
# the comparison.
# Tests (h2load timing mode, -D SECONDS), named PROTO-cC-mM:
#   PROTO  h2c | tls (TLS 1.3, TLS_AES_128_GCM_SHA256, X25519, ECDSA P-256
#          certificate, no resumption; h2load is held to the one suite)
#   cC     connections (1, 16)      mM  concurrent streams per connection (1, 100)
# Reported per target: req/s, p50/p99 (h2load's per-request log), proxy CPU
# µs per request (utime+stime of the proxy's process group from /proc), and
# the median over repeats of the per-repeat ratios vs nginx and Envoy. Only
# ratios from one run mean anything on a shared machine.
#
# Envoy: ENVOY_BIN, else `envoy` on PATH, else the binary the shared peer
# harness caches (~/.cache/proxy-bench/envoy-*/envoy/_bin/envoy; fetch it once
# with /work/shared/bench/proxy-bench.sh or by hand, see docs/performance.md);
# without one Envoy is dropped with a message.
# Everything listens on 127.0.0.1 (random ports), runs from a temp dir, and
# only the processes this script started are stopped (by process group).
# CPU pinning: 2 CPUs -> client on 1, upstream+proxy on 0 (so proxy CPU shows
# as lost throughput); >=3 CPUs: upstream 0, proxy 1, client the rest.
#
# Usage: bench/h2-bench.sh [-d SECONDS] [-r REPEATS] [-o OUTDIR]
# Env:   BATON_SIDECAR_BIN (default: the release build, built if stale),
#        PEERS ("direct nginx envoy"; add haproxy), PROTOS ("h2c tls"),
#        BASE_BIN (another baton-sidecar build, run as the extra target
#        `base` with the same settings: before/after a change, same run),
#        SHAPES ("c1m1 c1m100 c16m1 c16m100"), PERF=1 (record the sidecar
#        with `perf record -F 1999 $PERF_ARGS` during its runs; perf-*.data in OUTDIR).
set -euo pipefail
. "$(dirname "$0")/lib.sh"

DURATION=5 REPEATS=3 OUT=""
while getopts "d:r:o:h" o; do
  case $o in
    d) DURATION=$OPTARG ;; r) REPEATS=$OPTARG ;; o) OUT=$OPTARG ;;
    *) sed -n '2,43p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  esac
done
[[ $DURATION =~ ^[0-9]+$ && $REPEATS =~ ^[0-9]+$ ]] || die "-d and -r take integers"
(( DURATION >= 1 && DURATION <= 60 && REPEATS >= 1 && REPEATS <= 10 )) \
  || die "refusing: 1<=DURATION<=60, 1<=REPEATS<=10"
PEERS=${PEERS-direct nginx envoy}
PROTOS=${PROTOS:-h2c tls}
SHAPES=${SHAPES:-c1m1 c1m100 c16m1 c16m100}
NEED_HINT="h2load: apt-get install nghttp2-client" need h2load nginx curl taskset setsid ss python3 openssl
[[ " $PEERS " != *" haproxy "* ]] || need haproxy
BIN=$(sidecar_bin) || exit 2

ENVOY_BIN=${ENVOY_BIN:-$(command -v envoy || true)}
if [[ -z $ENVOY_BIN ]]; then
  for e in "${XDG_CACHE_HOME:-$HOME/.cache}"/proxy-bench/envoy-*/envoy/_bin/envoy; do
    [[ -x $e ]] && ENVOY_BIN=$e
  done
fi
if [[ " $PEERS " == *" envoy "* ]] && ! { [[ -n $ENVOY_BIN ]] && timeout 20 "$ENVOY_BIN" --version >/dev/null 2>&1; }; then
  echo "envoy not found (ENVOY_BIN, PATH, ~/.cache/proxy-bench); dropping it from the peers" >&2
  PEERS=$(sed 's/\benvoy\b//' <<<"$PEERS")
fi

bench_init h2-bench "$OUT"
RESULTS=$OUT/results.tsv
printf 'rep\ttarget\ttest\trps\tp50_us\tp99_us\tlogged\tfailed\tproxy_cpu_s\tok\n' > "$RESULTS"
exec > >(tee -a "$OUT/run.log") 2>&1

NCPU=$(nproc)
if (( NCPU >= 3 )); then UP_CPUS=0 PROXY_CPUS=1 CLI_CPUS=2-$((NCPU - 1))
elif (( NCPU == 2 )); then UP_CPUS=0 PROXY_CPUS=0 CLI_CPUS=1
else UP_CPUS=0 PROXY_CPUS=0 CLI_CPUS=0; fi

# The request body: one gRPC message (flag 0, big-endian length 507, payload).
python3 -c 'import sys,struct; sys.stdout.buffer.write(b"\0"+struct.pack(">I",507)+bytes((i*7)%251 for i in range(507)))' > "$WORK/req.bin"
RESP_BODY=$(python3 -c 'print(("0123456789abcdef"*16)[:256])')
make_cert ecdsa "$WORK"
CERT=$WORK/cert.pem KEY=$WORK/key.pem

wait_h2() {    # wait_h2 URL PID NAME : bounded wait for an h2 200 with the upstream's body
  local body tls=()
  [[ $1 == https:* ]] && tls=(--http2 -k) || tls=(--http2-prior-knowledge)
  for _ in $(seq 100); do
    kill -0 "$2" 2>/dev/null || { echo "$3 exited; log:"; tail -n 20 "$WORK/$3.log"; return 1; }
    body=$(curl -s "${tls[@]}" --max-time 1 "$1" 2>/dev/null || true)
    [[ $body == "$RESP_BODY" ]] && return 0
    sleep 0.1
  done
  echo "$3 did not answer h2 at $1 with the upstream body; log:"; tail -n 20 "$WORK/$3.log"; return 1
}

nginx_common() {
  cat <<NGX
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
NGX
}

# ---------------------------------------------------------------- upstream
UP_PORT=$(free_port); UP_H2_PORT=$(free_port)
UPSTREAM=127.0.0.1:$UP_PORT
mkdir -p "$WORK/upstream"
{ nginx_common "$WORK/upstream"; cat <<NGX
  server {
    listen 127.0.0.1:$UP_PORT reuseport backlog=4096;
    listen 127.0.0.1:$UP_H2_PORT http2 reuseport backlog=4096;
    location / { default_type application/grpc; return 200 "$RESP_BODY"; }
  }
}
NGX
} > "$WORK/upstream/nginx.conf"
start_bg upstream "$UP_CPUS" nginx -p "$WORK/upstream" -e "$WORK/upstream/error.log" -c "$WORK/upstream/nginx.conf"
UP_PID=$LAST_PID
wait_h2 "http://127.0.0.1:$UP_H2_PORT/" "$UP_PID" upstream

gen_envoy() {   # gen_envoy FILE PORT [tls]
  local ts=""
  if [[ ${3:-} == tls ]]; then
    ts="      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          disable_stateless_session_resumption: true
          disable_stateful_session_resumption: true
          common_tls_context:
            alpn_protocols: [\"h2\"]
            tls_params:
              tls_minimum_protocol_version: TLSv1_3
              tls_maximum_protocol_version: TLSv1_3
              ecdh_curves: [\"X25519\"]
            tls_certificates:
            - certificate_chain: {filename: \"$CERT\"}
              private_key: {filename: \"$KEY\"}"
  fi
  cat > "$1" <<ENV
static_resources:
  listeners:
  - name: l
    address: {socket_address: {address: 127.0.0.1, port_value: $2}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          codec_type: AUTO
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                route: {cluster: up}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
$ts
  clusters:
  - name: up
    connect_timeout: 1s
    type: STATIC
    circuit_breakers:
      thresholds: [{max_connections: 100000, max_pending_requests: 100000, max_requests: 100000}]
    load_assignment:
      cluster_name: up
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $UP_PORT}}}
ENV
}

# ---------------------------------------------------------------- targets
# start_target NAME PROTO : starts NAME serving PROTO, sets URL_OF/PID_OF["NAME/PROTO"]
declare -A URL_OF PID_OF
start_target() {
  local t=$1 proto=$2 tag=$1-$2 port scheme=http
  [[ $proto == tls ]] && scheme=https
  if [[ $t == direct ]]; then
    [[ $proto == h2c ]] || return 1
    URL_OF[$t/$proto]=http://127.0.0.1:$UP_H2_PORT/; PID_OF[$t/$proto]=$UP_PID; return 0
  fi
  port=$(free_port)
  case $t in
    nginx)
      local listen="listen 127.0.0.1:$port http2 reuseport backlog=4096;"
      [[ $proto == tls ]] && listen="listen 127.0.0.1:$port ssl http2 reuseport backlog=4096;
    ssl_certificate $CERT; ssl_certificate_key $KEY; ssl_protocols TLSv1.3;
    ssl_ecdh_curve X25519; ssl_session_tickets off; ssl_session_cache off;"
      mkdir -p "$WORK/$tag"
      { nginx_common "$WORK/$tag"; cat <<NGX
  upstream up { server $UPSTREAM; keepalive 64; keepalive_requests 1000000; }
  server {
    $listen
    location / {
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering on;
    }
  }
}
NGX
      } > "$WORK/$tag/nginx.conf"
      start_bg "$tag" "$PROXY_CPUS" nginx -p "$WORK/$tag" -e "$WORK/$tag/error.log" -c "$WORK/$tag/nginx.conf" ;;
    envoy)
      gen_envoy "$WORK/$tag.yaml" "$port" "$([[ $proto == tls ]] && echo tls)"
      start_bg "$tag" "$PROXY_CPUS" "$ENVOY_BIN" -c "$WORK/$tag.yaml" --concurrency 1 \
        --base-id "$port" --log-level warn --disable-hot-restart ;;
    haproxy)
      local bind="bind 127.0.0.1:$port proto h2"
      [[ $proto == tls ]] && { cat "$CERT" "$KEY" > "$WORK/hap.pem"
        bind="bind 127.0.0.1:$port ssl crt $WORK/hap.pem alpn h2 ssl-min-ver TLSv1.3 curves X25519 no-tls-tickets"; }
      cat > "$WORK/$tag.cfg" <<HAP
global
  nbthread 1
  maxconn 4096
  tune.ssl.cachesize 0
defaults
  mode http
  option http-keep-alive
  http-reuse always
  timeout connect 5s
  timeout client 60s
  timeout server 60s
  timeout http-keep-alive 60s
frontend fe
  $bind
  default_backend be
backend be
  server up1 $UPSTREAM
HAP
      start_bg "$tag" "$PROXY_CPUS" haproxy -db -f "$WORK/$tag.cfg" ;;
    sidecar|base)
      local bin=$BIN
      [[ $t == base ]] && bin=$BASE_BIN
      if [[ $proto == tls ]]; then
        render "$BENCH_ROOT/bench/sidecar-h2-tls.yaml.tmpl" PORT="$port" UPSTREAM="$UPSTREAM" \
          CERT="$CERT" KEY="$KEY" > "$WORK/$tag.yaml"
        BATON_HANDOFF_SOCKET=$WORK/$tag-handoff.sock BATON_HANDOFF_STATUS_FILE=$WORK/$tag-handoff.json \
          start_bg "$tag" "$PROXY_CPUS" "$bin" run --config "$WORK/$tag.yaml"
      else
        BATON_HANDOFF_SOCKET=$WORK/$tag-handoff.sock BATON_HANDOFF_STATUS_FILE=$WORK/$tag-handoff.json \
          start_bg "$tag" "$PROXY_CPUS" "$bin" run --listen "127.0.0.1:$port" --upstream "$UPSTREAM" --workers 1
      fi ;;
    *) echo "unknown target $t" >&2; exit 2 ;;
  esac
  URL_OF[$t/$proto]=$scheme://127.0.0.1:$port/; PID_OF[$t/$proto]=$LAST_PID
  wait_h2 "${URL_OF[$t/$proto]}" "$LAST_PID" "$tag"
}

TARGETS=()
for p in $PEERS sidecar; do TARGETS+=("$p"); done
if [[ -n ${BASE_BIN:-} ]]; then
  [[ -x $BASE_BIN ]] || die "BASE_BIN $BASE_BIN is not executable"
  TARGETS+=(base)
fi
for proto in $PROTOS; do
  for t in "${TARGETS[@]}"; do start_target "$t" "$proto" || true; done
done

log "out=$OUT upstream=$UPSTREAM (h2c $UP_H2_PORT) targets=${TARGETS[*]} protos=$PROTOS shapes=$SHAPES ${REPEATS}x${DURATION}s"
log "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
{ h2load --version | head -n1; nginx -v 2>&1; [[ -n $ENVOY_BIN ]] && "$ENVOY_BIN" --version | grep -o 'version: [^ ]*' || true; } | tee "$OUT/versions.txt"

H2LOAD_ARGS=(-t1 -d "$WORK/req.bin" -H 'content-type: application/grpc' -H 'te: trailers'
             --tls13-ciphers=TLS_AES_128_GCM_SHA256)

PERF_PID=""
run_h2load() {   # run_h2load REP TARGET PROTO SHAPE
  local rep=$1 t=$2 proto=$3 shape=$4 key=$2/$3 c m pg c0 c1 out stats test=$3-$4
  [[ -n ${URL_OF[$key]:-} ]] || return 0
  c=${shape#c}; c=${c%m*}; m=${shape#*m}
  pg=${PID_OF[$key]}
  if [[ ${PERF:-0} == 1 && $t == sidecar ]]; then
    perf record -q -F 1999 ${PERF_ARGS:-} -p "$pg" -o "$OUT/perf-$test-$rep.data" >/dev/null 2>&1 & PERF_PID=$!
  fi
  c0=$(pg_cpu "$pg")
  out=$(timeout $((DURATION + 20)) taskset -c "$CLI_CPUS" h2load "${H2LOAD_ARGS[@]}" -c"$c" -m"$m" \
          -D "$DURATION" --log-file="$WORK/req-$rep-$t-$test.tsv" "${URL_OF[$key]}" 2>&1) || true
  c1=$(pg_cpu "$pg")
  if [[ -n $PERF_PID ]]; then kill -INT "$PERF_PID" 2>/dev/null || true; wait "$PERF_PID" 2>/dev/null || true; PERF_PID=""; fi
  echo "$out" > "$WORK/h2load-$rep-$t-$test.txt"
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
  printf '  %-8s %-13s %10s req/s  p50 %6s us  p99 %6s us  cpu %5s s  (%s logged, %s ok, %s failed)\n' \
    "$t" "$test" "${rps:-0}" "$p50" "$p99" "$cpu" "$logged" "$okd" "${failed:-?}"
  rm -f "$WORK/req-$rep-$t-$test.tsv"
}

for key in "${!URL_OF[@]}"; do   # warm-up: connections, pools, caches
  taskset -c "$CLI_CPUS" h2load "${H2LOAD_ARGS[@]}" -c16 -m10 -n 5000 "${URL_OF[$key]}" >/dev/null 2>&1 || true
done

n=${#TARGETS[@]}
for rep in $(seq 1 "$REPEATS"); do
  log "repeat $rep/$REPEATS"
  for proto in $PROTOS; do
    for shape in $SHAPES; do
      # rotate the order each repeat so no target always runs first
      for i in $(seq 0 $((n - 1))); do
        run_h2load "$rep" "${TARGETS[$(( (i + rep - 1) % n ))]}" "$proto" "$shape"
      done
    done
  done
done

# Peak RSS (VmHWM) summed over each proxy's process groups, after the load.
{
  echo "peak RSS after the run (VmHWM, summed over the process group):"
  for key in $(printf '%s\n' "${!PID_OF[@]}" | sort); do
    [[ $key == direct/* ]] && continue
    kb=0
    for st in /proc/[0-9]*/stat; do
      line=$(cat "$st" 2>/dev/null) || continue
      rest=${line##*) }; read -r _ _ pgrp _ <<<"$rest"
      [[ $pgrp == "${PID_OF[$key]}" ]] || continue
      hwm=$(awk '/^VmHWM/{print $2}' "${st%/stat}/status" 2>/dev/null || true)
      kb=$((kb + ${hwm:-0}))
    done
    printf '  %-14s %6.1f MB\n' "$key" "$(awk -v k="$kb" 'BEGIN{print k/1024}')"
  done
} | tee "$OUT/rss.txt"

python3 - "$RESULTS" <<'PY' | tee "$OUT/summary.txt"
import csv, statistics, sys
rows = list(csv.reader(open(sys.argv[1]), delimiter="\t"))[1:]
by = {}
for rep, t, test, rps, p50, p99, logged, failed, cpu, ok in rows:
    by[(rep, t, test)] = dict(rps=float(rps), p50=int(p50), p99=int(p99), n=int(logged),
                              cpu=float(cpu), failed=failed)
tests = []
for k in by:
    if k[2] not in tests:
        tests.append(k[2])
order = {"direct": 0, "nginx": 1, "envoy": 2, "haproxy": 3, "base": 4, "sidecar": 5}
targets = sorted({k[1] for k in by}, key=lambda t: order.get(t, 9))
reps = sorted({k[0] for k in by})
print("medians over repeats (cpu us/req = proxy CPU over the run / requests logged):")
print(f"{'test':14} {'target':8} {'req/s':>9} {'p50 us':>7} {'p99 us':>7} {'cpu us/req':>10} failed")
for test in tests:
    for t in targets:
        v = [by[(r, t, test)] for r in reps if (r, t, test) in by]
        if not v:
            continue
        med = lambda key: statistics.median(x[key] for x in v)
        cpu = statistics.median(x["cpu"] * 1e6 / x["n"] for x in v if x["n"]) if t != "direct" else 0
        fails = ",".join(x["failed"] for x in v)
        print(f"{test:14} {t:8} {med('rps'):9.0f} {med('p50'):7.0f} {med('p99'):7.0f} {cpu:10.1f} {fails}")
print()
print("ratios, sidecar vs peer (median of per-repeat ratios; goal: throughput >= 1.2, cpu/req <= 0.8, p99 <= 1 at c1):")
for test in tests:
    for peer in ("nginx", "envoy", "haproxy", "base"):
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
            print(f"{test:14} vs {peer:8} throughput x{statistics.median(thr):.3f}"
                  f"  cpu/req x{statistics.median(cpu) if cpu else float('nan'):.3f}"
                  f"  p99 x{statistics.median(p99) if p99 else float('nan'):.3f}")
PY
log "done; results in $RESULTS"
