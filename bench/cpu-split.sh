#!/usr/bin/env bash
# Where a proxied request's CPU goes: user vs kernel microseconds per request,
# sidecar vs nginx (1 worker, keep-alive upstream pool), plain HTTP/1.1 and
# HTTPS (TLS 1.3, ECDSA P-256, no resumption), keep-alive, wrk -c16.
#
# Both proxies forward to the same nginx upstream (`return 200`, 10 bytes);
# proxies and upstream share CPU 0, wrk runs on CPU 1 (as the shared proxy
# harness does). CPU comes from /proc/<pid>/stat utime/stime of the proxy process
# (the nginx worker, the whole sidecar process incl. its crypto thread)
# around each wrk run. Runs are interleaved and repeated; compare the ratios
# of one run only (shared, noisy machine).
#
# Usage: bench/cpu-split.sh [-d SECONDS] [-r REPEATS] [-o OUTDIR]
# Env:   BATON_SIDECAR_BIN (default: the release build, built if stale)
#        BATON_SIDECAR_BIN_B: a second build, measured in the same runs
#        (rows sidecarB-*), to compare two builds against the same nginx
#        SIDECAR_B_RUNTIME: extra runtime keys for sidecar B only (e.g.
#        "h1_fast_path: true"; without BATON_SIDECAR_BIN_B, B runs the same
#        build), to compare two settings
set -euo pipefail
. "$(dirname "$0")/lib.sh"

DURATION=4 REPEATS=3 OUT=""
while getopts "d:r:o:h" o; do
  case $o in
    d) DURATION=$OPTARG ;; r) REPEATS=$OPTARG ;; o) OUT=$OPTARG ;;
    *) sed -n '2,19p' "$0"; exit 0 ;;
  esac
done
[[ $DURATION =~ ^[0-9]+$ && $REPEATS =~ ^[0-9]+$ ]] || die "-d and -r take integers"
(( DURATION >= 1 && DURATION <= 30 && REPEATS >= 1 && REPEATS <= 10 )) || die "refusing: 1<=DURATION<=30, 1<=REPEATS<=10"
need wrk nginx openssl taskset setsid ss curl python3
BIN=$(sidecar_bin) || exit 2
BIN_B=${BATON_SIDECAR_BIN_B:-}
B_RUNTIME=${SIDECAR_B_RUNTIME:-}
[[ -z $B_RUNTIME || -n $BIN_B ]] || BIN_B=$BIN
[[ -z $BIN_B || -x $BIN_B ]] || die "BATON_SIDECAR_BIN_B=$BIN_B is not executable"
bench_init cpu-split "$OUT"
W=$WORK
UP=$(free_port) NGX=$(free_port) NGXS=$(free_port) SC=$(free_port) SCS=$(free_port)
SCB=$(free_port) SCBS=$(free_port)

make_cert ecdsa "$W"

ngx_conf() { # name body (the nginx proxy peer; the upstream is lib.sh's nginx_upstream)
  cat >"$W/$1.conf" <<EOF
worker_processes 1;
daemon off;
pid $W/$1.pid;
error_log $W/$1.err;
events { worker_connections 4096; }
http { access_log off; $2 }
EOF
}
ngx_conf proxy "upstream up { server 127.0.0.1:$UP; keepalive 64; }
  server { listen 127.0.0.1:$NGX; location / { proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }
  server { listen 127.0.0.1:$NGXS ssl; ssl_certificate $W/cert.pem; ssl_certificate_key $W/key.pem;
    ssl_protocols TLSv1.3; ssl_session_tickets off; ssl_session_cache off;
    location / { proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }"
cat >"$W/sidecar.yaml" <<EOF
version: 1
admin: {address: "127.0.0.1:0"}
runtime: {worker_threads: 1}
listeners:
- {name: plain, address: "127.0.0.1:$SC"}
- {name: tls, address: "127.0.0.1:$SCS", direction: inbound}
clusters:
- {name: up, endpoints: ["127.0.0.1:$UP"], pool_max_idle_per_endpoint: 256}
routes:
- {name: r, backends: [{cluster: up}]}
tls:
  mode: Permissive
  min_version: "1.3"
  alpn: ["http/1.1"]
  session_resumption: false
  require_client_cert: false
  source: {files: {cert_chain: $W/cert.pem, key: $W/key.pem, trust_bundle: $W/cert.pem}}
  offload: {mode: Preferred, workers: 1}
EOF
sed -e "s/127.0.0.1:$SC\"/127.0.0.1:$SCB\"/" -e "s/127.0.0.1:$SCS\"/127.0.0.1:$SCBS\"/" \
  -e "s/^runtime: {worker_threads: 1}/runtime: {worker_threads: 1${B_RUNTIME:+, $B_RUNTIME}}/" \
  "$W/sidecar.yaml" >"$W/sidecar-b.yaml"

nginx_upstream 0 "$UP" || exit 2
start_bg nginx 0 nginx -p "$W" -c "$W/proxy.conf"; NGX_MASTER=$LAST_PID
BATON_HANDOFF_SOCKET=$W/handoff.sock BATON_HANDOFF_STATUS_FILE=$W/handoff.json \
  start_bg sidecar 0 "$BIN" run --config "$W/sidecar.yaml"; SC_PID=$LAST_PID
wait_port "$SC" "$SC_PID" || die "the sidecar did not start; see $W/sidecar.log"
if [[ -n $BIN_B ]]; then
  BATON_HANDOFF_SOCKET=$W/handoff-b.sock BATON_HANDOFF_STATUS_FILE=$W/handoff-b.json \
    start_bg sidecar-b 0 "$BIN_B" run --config "$W/sidecar-b.yaml"; SCB_PID=$LAST_PID
  wait_port "$SCBS" "$SCB_PID" || die "sidecar B did not start; see $W/sidecar-b.log"
fi
# Listening is not serving: wait until every target answers through to the upstream.
for _ in $(seq 1 50); do
  curl -sf "http://127.0.0.1:$SC/" >/dev/null && curl -sfk "https://127.0.0.1:$SCS/" >/dev/null \
    && curl -sf "http://127.0.0.1:$NGX/" >/dev/null \
    && { [[ -z $BIN_B ]] || curl -sfk "https://127.0.0.1:$SCBS/" >/dev/null; } && break
  sleep 0.1
done
NGX_WORKER=$(pgrep -P "$NGX_MASTER" | head -1)

cpu() { awk '{print $14, $15}' "/proc/$1/stat"; }
run() { # target-name pid url
  local u0 s0 u1 s1 rps
  read -r u0 s0 < <(cpu "$2")
  rps=$(taskset -c 1 wrk -t1 -c16 -d"${DURATION}s" "$3" | awk '/Requests\/sec/{print $2}')
  read -r u1 s1 < <(cpu "$2")
  echo "$1 $rps $((u1 - u0)) $((s1 - s0))" >>"$OUT/raw.txt"
}
bench_header | tee "$OUT/summary.txt"
for _ in $(seq 1 "$REPEATS"); do
  run sidecar-http "$SC_PID" "http://127.0.0.1:$SC/"
  run nginx-http "$NGX_WORKER" "http://127.0.0.1:$NGX/"
  run nginx-https "$NGX_WORKER" "https://127.0.0.1:$NGXS/"
  run sidecar-https "$SC_PID" "https://127.0.0.1:$SCS/"
  if [[ -n $BIN_B ]]; then
    run sidecarB-http "$SCB_PID" "http://127.0.0.1:$SCB/"
    run sidecarB-https "$SCB_PID" "https://127.0.0.1:$SCBS/"
  fi
done
python3 - "$OUT/raw.txt" "$DURATION" "$(getconf CLK_TCK)" <<'EOF' | tee -a "$OUT/summary.txt"
import sys, statistics as st
raw, dur, hz = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
rows = {}
for line in open(raw):
    name, rps, u, s = line.split()
    n = float(rps) * dur
    rows.setdefault(name, []).append((float(rps), int(u) * 1e6 / hz / n, int(s) * 1e6 / hz / n))
med = {k: tuple(st.median(x[i] for x in v) for i in range(3)) for k, v in rows.items()}
print(f"{'target':14} {'req/s':>8} {'user us/req':>12} {'kernel us/req':>14} {'total':>7}")
for k in ("sidecar-http", "sidecarB-http", "nginx-http", "sidecar-https", "sidecarB-https", "nginx-https"):
    if k not in med:
        continue
    r, u, s = med[k]
    print(f"{k:14} {r:8.0f} {u:12.2f} {s:14.2f} {u + s:7.2f}")
for proto in ("http", "https"):
    for sc in ("sidecar", "sidecarB"):
        if f"{sc}-{proto}" not in med:
            continue
        a, b = med[f"{sc}-{proto}"], med[f"nginx-{proto}"]
        print(f"{proto}: {sc}/nginx throughput x{a[0] / b[0]:.2f}, user x{a[1] / b[1]:.2f}, "
              f"kernel x{a[2] / b[2]:.2f}, cpu/req x{(a[1] + a[2]) / (b[1] + b[2]):.2f}")
EOF
echo "raw: $OUT"
