#!/usr/bin/env bash
# What an authorization policy and the access log cost the HTTP/1.1 data
# plane (issue #36, docs/decisions/0053): one sidecar per variant, all
# forwarding to the shared nginx upstream (lib.sh), measured in ONE run,
# interleaved (the order rotates each repeat), and reported as ratios to
# the `off` variant of the same repeat.
#
#   off       no policy, no access log                     the baseline
#   policy    a 20-rule policy: 19 rules that do not match a `GET /` from
#             127.0.0.1 (each tests CIDRs, then methods, path prefixes or a
#             header) and a last one that allows it: every request walks
#             all 20 rules, and path normalization runs (path conditions)
#   log       access_log: true, the default rate limit (1000 lines/s; the
#             rest are dropped and counted); lines go to stdout, which is a
#             file ($WORK/log.log)
#   log-all   access_log: true with the rate limit out of the way
#             (10,000,000 lines/s): every request's line is written to a
#             file ($WORK/log-all.log)
#   policy-general  `policy` with runtime.h1_fast_path: false: the general
#             (hyper) path, what a policy cost before decision 0053
#
# Tests per variant and repeat: `sat` (wrk -t1 -c16, closed loop,
# saturating: req/s, p99) and `lat` (wrk -t1 -c1: one request at a time,
# p50/p99 of the unloaded round trip). Reported: per-repeat ratios to
# `off` (throughput, proxy CPU µs/request) and p99 deltas in µs, as the
# median and the range over repeats. Only numbers of one run mean anything
# on a shared machine.
#
# Usage: bench/authz-bench.sh [-d SECONDS] [-l SECONDS] [-r REPEATS] [-o OUTDIR]
#   -d: each sat run (default 5), -l: each lat run (3), -r: repeats (5).
# Env: BATON_SIDECAR_BIN (default: the release build, built if stale),
#      VARIANTS (default "off policy log log-all policy-general").
# Bounds: every wrk run has -d and an outer timeout; the plan is refused
# above 1200 s. Everything listens on 127.0.0.1 (random free ports); only
# the processes this script started are stopped, by process group.
# Pinning as the shared harness: 2 CPUs -> client on 1, upstream + sidecars on 0.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

DURATION=5 LAT_DURATION=3 REPEATS=5 OUT=""
while getopts "d:l:r:o:h" o; do
  case $o in
    d) DURATION=$OPTARG ;; l) LAT_DURATION=$OPTARG ;; r) REPEATS=$OPTARG ;; o) OUT=$OPTARG ;;
    *) sed -n '2,36p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  esac
done
[[ $DURATION =~ ^[0-9]+$ && $LAT_DURATION =~ ^[0-9]+$ && $REPEATS =~ ^[0-9]+$ ]] \
  || die "-d, -l and -r take integers"
(( DURATION >= 1 && DURATION <= 30 && LAT_DURATION >= 1 && LAT_DURATION <= 30 \
   && REPEATS >= 1 && REPEATS <= 10 )) || die "refusing: 1<=-d,-l<=30, 1<=-r<=10"
VARIANTS=${VARIANTS:-off policy log log-all policy-general}
nvar=$(wc -w <<<"$VARIANTS")
(( REPEATS * nvar * (DURATION + LAT_DURATION + 2) <= 1200 )) || die "refusing: the plan is longer than 1200 s"
NEED_HINT="apt-get install wrk nginx" need wrk nginx curl taskset setsid ss python3
BIN=$(sidecar_bin) || exit 2

bench_init authz-bench "$OUT"
RESULTS=$OUT/results.tsv
printf 'rep\tvariant\ttest\trps\tp50_us\tp99_us\tnon2xx\tproxy_cpu_s\trequests\n' >"$RESULTS"
exec > >(tee -a "$OUT/run.log") 2>&1

NCPU=$(nproc)
if (( NCPU >= 3 )); then UP_CPUS=0 PROXY_CPUS=1 CLI_CPUS=2-$((NCPU - 1))
elif (( NCPU == 2 )); then UP_CPUS=0 PROXY_CPUS=0 CLI_CPUS=1
else UP_CPUS=0 PROXY_CPUS=0 CLI_CPUS=0; fi

UP_PORT=$(free_port)
nginx_upstream "$UP_CPUS" "$UP_PORT"

# The 20-rule policy: rules 0..18 match the client's address (the CIDR test
# passes, so evaluation goes on to the request's conditions) and then fail on
# a method, a path prefix or a header; rule 19 allows.
policy_yaml() {
  echo "policies:"
  echo "  rbac:"
  echo "  - name: bench20"
  echo "    default_action: deny"
  echo "    rules:"
  local i action
  for i in $(seq 0 18); do
    action=$([[ $((i % 2)) == 0 ]] && echo deny || echo allow)
    case $((i % 3)) in
      0) echo "    - {name: r$i, action: $action, cidrs: ['10.0.0.0/8', '127.0.0.0/8'], methods: [POST, DELETE], path_prefixes: ['/'], headers: [{name: x-tenant-$i, exact: 't$i'}]}" ;;
      1) echo "    - {name: r$i, action: $action, cidrs: ['10.0.0.0/8', '127.0.0.0/8'], methods: [GET, POST], path_prefixes: ['/admin$i/', '/internal$i/']}" ;;
      2) echo "    - {name: r$i, action: $action, cidrs: ['10.0.0.0/8', '127.0.0.0/8'], methods: [GET], path_prefixes: ['/'], headers: [{name: x-tenant-$i, prefix: 't'}]}" ;;
    esac
  done
  echo "    - {name: last, action: allow, cidrs: ['127.0.0.0/8'], methods: [GET, HEAD], path_prefixes: ['/']}"
}

config() {   # config VARIANT PORT : the sidecar's YAML
  local v=$1 port=$2 rbac="" log="" rt="worker_threads: 1"
  case $v in
    off) ;;
    policy) rbac=", rbac: bench20" ;;
    log) log=", access_log: true" ;;
    log-all) log=", access_log: true"; rt="$rt, access_log_lines_per_second: 10000000" ;;
    policy-general) rbac=", rbac: bench20"; rt="$rt, h1_fast_path: false" ;;
    *) die "unknown variant $v" ;;
  esac
  cat <<YAML
version: 1
admin: {address: "127.0.0.1:0"}
runtime: {$rt}
listeners:
- {name: in, address: "127.0.0.1:$port", direction: inbound$rbac$log}
clusters:
- {name: up, endpoints: ["127.0.0.1:$UP_PORT"]}
routes:
- {name: r, backends: [{cluster: up}]}
YAML
  [[ -n $rbac ]] && policy_yaml
  return 0
}

declare -A PORT PGID
for v in $VARIANTS; do
  PORT[$v]=$(free_port)
  config "$v" "${PORT[$v]}" >"$WORK/$v.yaml"
  BATON_HANDOFF_SOCKET=$WORK/$v.sock BATON_HANDOFF_STATUS_FILE=$WORK/$v-handoff.json \
    start_bg "$v" "$PROXY_CPUS" "$BIN" run --config "$WORK/$v.yaml"
  PGID[$v]=$LAST_PID
  wait_port "${PORT[$v]}" "$LAST_PID" || { tail -n 20 "$WORK/$v.log"; die "sidecar $v did not start"; }
  body=$(curl -s --max-time 2 "http://127.0.0.1:${PORT[$v]}/")
  [[ $body == 0123456789 ]] || { tail -n 20 "$WORK/$v.log"; die "sidecar $v does not answer with the upstream's body (got: $body)"; }
done

{
  bench_header
  echo "sidecar: $BIN"
  echo "plan: $REPEATS repeats x variants ($VARIANTS) x (sat ${DURATION}s c16, lat ${LAT_DURATION}s c1); cpus: client $CLI_CPUS, upstream $UP_CPUS, sidecars $PROXY_CPUS"
} | tee "$OUT/header.txt"

run_wrk() {   # run_wrk REP VARIANT TEST CONNS SECS
  local rep=$1 v=$2 t=$3 c=$4 d=$5 raw=$WORK/wrk-$1-$2-$3.txt c0 c1
  c0=$(pg_cpu "${PGID[$v]}")
  taskset -c "$CLI_CPUS" timeout $((d + 15)) wrk -t1 -c"$c" -d"${d}s" --latency "http://127.0.0.1:${PORT[$v]}/" >"$raw" 2>&1 \
    || { cat "$raw"; die "wrk failed ($v $t)"; }
  c1=$(pg_cpu "${PGID[$v]}")
  python3 - "$raw" "$rep" "$v" "$t" "$c0" "$c1" >>"$RESULTS" <<'PY'
import re, sys
raw, rep, v, t, c0, c1 = sys.argv[1:]
text = open(raw).read()
def us(s):
    m = re.match(r"([0-9.]+)(us|ms|s)$", s)
    return float(m[1]) * {"us": 1, "ms": 1e3, "s": 1e6}[m[2]]
pct = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", text, re.M))
rps = float(re.search(r"Requests/sec:\s+([0-9.]+)", text)[1])
reqs = int(re.search(r"(\d+) requests in", text)[1])
non2xx = int((re.search(r"Non-2xx or 3xx responses: (\d+)", text) or [0, 0])[1])
print(f"{rep}\t{v}\t{t}\t{rps:.0f}\t{us(pct['50']):.0f}\t{us(pct['99']):.0f}\t{non2xx}\t{float(c1) - float(c0):.2f}\t{reqs}")
PY
  tail -n 1 "$RESULTS"
}

read -r -a order <<<"$VARIANTS"
for rep in $(seq "$REPEATS"); do
  # Warm each (connections, pools) once per repeat, unmeasured.
  for v in "${order[@]}"; do
    taskset -c "$CLI_CPUS" timeout 10 wrk -t1 -c16 -d1s "http://127.0.0.1:${PORT[$v]}/" >/dev/null 2>&1 || true
  done
  for t in sat lat; do
    for v in "${order[@]}"; do
      if [[ $t == sat ]]; then run_wrk "$rep" "$v" sat 16 "$DURATION"; else run_wrk "$rep" "$v" lat 1 "$LAT_DURATION"; fi
    done
  done
  order=("${order[@]:1}" "${order[0]}")   # rotate
done

python3 - "$RESULTS" "$VARIANTS" <<'PY' | tee "$OUT/summary.txt"
import statistics as st, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])][1:]
variants = sys.argv[2].split()
by = {}
for rep, v, t, rps, p50, p99, non2xx, cpu, reqs in rows:
    by[(rep, v, t)] = dict(rps=float(rps), p50=float(p50), p99=float(p99),
                           non2xx=int(non2xx), cpu_us=float(cpu) * 1e6 / max(int(reqs), 1))
reps = sorted({r[0] for r in rows}, key=int)
def fmt(xs, f="{:.3f}"):
    return f"{f.format(st.median(xs))} ({f.format(min(xs))}-{f.format(max(xs))})"
print("medians over repeats (range); ratios and deltas are per repeat, against `off` of the same repeat")
for t in ("sat", "lat"):
    print(f"\n{t}: {'variant':<15}{'req/s':>9}{'p50 us':>8}{'p99 us':>8}{'cpu us/req':>11}   throughput vs off   p99 delta us vs off   cpu/req vs off")
    for v in variants:
        cur = [by[(r, v, t)] for r in reps if (r, v, t) in by]
        if not cur:
            continue
        line = (f"     {v:<15}{st.median(c['rps'] for c in cur):>9.0f}{st.median(c['p50'] for c in cur):>8.0f}"
                f"{st.median(c['p99'] for c in cur):>8.0f}{st.median(c['cpu_us'] for c in cur):>11.2f}")
        if v != "off":
            pairs = [(by[(r, v, t)], by[(r, "off", t)]) for r in reps if (r, v, t) in by and (r, "off", t) in by]
            line += ("   x" + fmt([a["rps"] / b["rps"] for a, b in pairs])
                     + "   " + fmt([a["p99"] - b["p99"] for a, b in pairs], "{:+.0f}")
                     + "   x" + fmt([a["cpu_us"] / b["cpu_us"] for a, b in pairs]))
        print(line)
bad = [(k, c["non2xx"]) for k, c in by.items() if c["non2xx"]]
print("\nnon-2xx responses:", bad or "none")
PY
for v in $VARIANTS; do
  case $v in log|log-all) echo "$v: $(grep -c '"start_time"' "$WORK/$v.log") access-log lines written to $WORK/$v.log" | tee -a "$OUT/summary.txt" ;; esac
done
echo "raw: $OUT"
