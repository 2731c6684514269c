# shellcheck shell=bash
# Helpers every bench script shares: source it, then call bench_init.
#
#   . "$(dirname "$0")/lib.sh"
#   bench_init my-bench "$OUT"      # OUT/WORK dirs, cleanup trap
#   BIN=$(sidecar_bin)              # BATON_SIDECAR_BIN, or a fresh release build
#   port=$(free_port)
#   start_bg proxy 0 nginx -c …     # own process group, pinned, logged; LAST_PID
#   wait_port "$port" "$LAST_PID"
#   nginx_upstream 0 "$port"        # the shared 10-byte nginx upstream
#
# Why one file: each script used to carry its own free_port (three different
# ones), cleanup trap and certificate commands, and they drifted apart (one
# stopped only the process it started, not its process group). The rules live here
# once: everything binds 127.0.0.1; every process a script starts runs in its
# own process group (setsid) and is stopped by that group's id, SIGTERM then
# SIGKILL, on exit, error or Ctrl-C; nothing is ever killed by name.

BENCH_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BENCH_PIDS=()

log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*"; }
die() { echo "$*" >&2; exit 2; }

need() {   # need TOOL... : fail early, naming what is missing
  local t
  for t in "$@"; do command -v "$t" >/dev/null || die "missing $t${NEED_HINT:+ ($NEED_HINT)}"; done
}

bench_init() {   # bench_init NAME [OUTDIR] : sets OUT (absolute) and WORK=$OUT/work, traps cleanup
  OUT=${2:-${TMPDIR:-/tmp}/$1/$(date +%Y%m%d-%H%M%S)}
  mkdir -p "$OUT/work"
  OUT=$(cd "$OUT" && pwd)
  WORK=$OUT/work
  BENCH_PORTS_FILE=$WORK/.ports
  : >"$BENCH_PORTS_FILE"
  trap bench_cleanup EXIT
  trap 'exit 130' INT TERM
}

free_port() {   # a random port in 20000-31999 with no socket on it, never the same twice per run
  # Called as $(free_port), i.e. in a subshell: the ports handed out so far
  # live in a file (bench_init), or a second call could return a port the
  # first caller has not bound yet.
  local p
  for _ in $(seq 200); do
    p=$(( 20000 + RANDOM % 12000 ))
    [[ -n ${BENCH_PORTS_FILE:-} ]] && grep -qx "$p" "$BENCH_PORTS_FILE" && continue
    if [[ -z $(ss -Htan "( sport = :$p or dport = :$p )") ]]; then
      [[ -n ${BENCH_PORTS_FILE:-} ]] && echo "$p" >>"$BENCH_PORTS_FILE"
      echo "$p"
      return 0
    fi
  done
  echo "no free port in 20000-31999" >&2
  return 1
}

wait_port() {   # wait_port PORT [PID] : until something listens on 127.0.0.1:PORT (5 s); fails early if PID exited
  for _ in $(seq 100); do
    [[ -n ${2:-} ]] && ! kill -0 "$2" 2>/dev/null && return 1
    [[ -n $(ss -Hltn "sport = :$1") ]] && return 0
    sleep 0.05
  done
  return 1
}

start_bg() {   # start_bg NAME CPUS CMD... : own process group, pinned to CPUS (taskset list, empty: anywhere),
               # output in $WORK/NAME.log; sets LAST_PID (== its process group id)
  local name=$1 cpus=$2
  shift 2
  [[ -n $cpus ]] && set -- taskset -c "$cpus" "$@"
  setsid "$@" >"$WORK/$name.log" 2>&1 </dev/null &
  LAST_PID=$!
  BENCH_PIDS+=("$LAST_PID")
}

stop_pid() {   # stop_pid PID : SIGTERM its process group, up to 2 s, then SIGKILL
  local pid=$1
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 40); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  kill -KILL -- "-$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  # Forget it, so the exit trap never signals a process group id reused since.
  local keep=() p
  for p in "${BENCH_PIDS[@]}"; do [[ $p == "$pid" ]] || keep+=("$p"); done
  BENCH_PIDS=("${keep[@]}")
}

bench_cleanup() {   # every process group start_bg created, whatever state the script is in
  local p
  for p in "${BENCH_PIDS[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  sleep 0.3
  for p in "${BENCH_PIDS[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
}

pg_cpu() {   # pg_cpu PGID : CPU seconds (user + system) used so far by every process of that group
  { cat /proc/[0-9]*/stat 2>/dev/null || true; } | awk -v pg="$1" -v hz="$(getconf CLK_TCK)" '
    { line=$0; sub(/^.*\) /, "", line); split(line, f, " "); if (f[3] == pg) s += f[12] + f[13] }
    END { printf "%.2f", s / hz }'
}

sidecar_bin() {   # the baton-sidecar binary to measure: BATON_SIDECAR_BIN, else a release build (absolute path)
  local bin=${BATON_SIDECAR_BIN:-}
  if [[ -z $bin ]]; then
    build_release baton-sidecar >&2 || return 1
    bin=${CARGO_TARGET_DIR:-$BENCH_ROOT/target}/release/baton-sidecar
  fi
  [[ -x $bin ]] || { echo "no sidecar binary at $bin" >&2; return 1; }
  echo "$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")"
}

build_release() {   # build_release PACKAGE... : cargo build --release, niced (the machine is shared)
  local args=() p
  for p in "$@"; do args+=(-p "$p"); done
  (cd "$BENCH_ROOT" && nice -n 5 cargo build --release --locked "${args[@]}")
}

nginx_upstream() {   # nginx_upstream CPUS PORT : the upstream every proxy under test forwards to (nginx,
                     # 1 worker, `return 200` with a 10-byte body) on 127.0.0.1:PORT, files in $WORK/upstream,
                     # log $WORK/upstream.log, pinned to CPUS; waits until it listens; sets LAST_PID
  local cpus=$1 port=$2 dir=$WORK/upstream
  mkdir -p "$dir/logs"
  cat >"$dir/nginx.conf" <<NGX
worker_processes 1;
daemon off;
pid $dir/nginx.pid;
error_log $dir/error.log;
events { worker_connections 4096; }
http { access_log off; server { listen 127.0.0.1:$port; location / { return 200 "0123456789"; } } }
NGX
  start_bg upstream "$cpus" nginx -p "$dir" -c "$dir/nginx.conf"
  wait_port "$port" "$LAST_PID" || { echo "the nginx upstream did not start; see $WORK/upstream.log" >&2; return 1; }
}

make_cert() {   # make_cert rsa|ecdsa DIR : self-signed DIR/cert.pem + DIR/key.pem for 127.0.0.1, 2 days
  local kind=$1 dir=$2 key
  case $kind in
    rsa) key=(-newkey rsa:2048) ;;
    ecdsa) key=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1) ;;
    *) die "make_cert: key kind must be rsa or ecdsa, not $kind" ;;
  esac
  openssl req -x509 "${key[@]}" -nodes -keyout "$dir/key.pem" -out "$dir/cert.pem" -days 2 \
    -subj /CN=localhost -addext subjectAltName=IP:127.0.0.1 2>/dev/null
}

render() {   # render TEMPLATE KEY=VALUE... : the template with every {{KEY}} replaced; an unfilled one is an error
  local tmpl=$1 s kv rest
  s=$(<"$tmpl") || return 1
  shift
  for kv in "$@"; do s=${s//"{{${kv%%=*}}}"/${kv#*=}}; done
  rest=$(grep -o '{{[A-Z_]*}}' <<<"$s" | sort -u | tr '\n' ' ')
  [[ -z $rest ]] || { echo "render: $rest left unfilled in $tmpl" >&2; return 1; }
  printf '%s\n' "$s"
}

bench_header() {   # what a result was measured on: date, kernel, CPUs, load
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "host: $(uname -r), $(nproc) cpus, load: $(cut -d' ' -f1-3 /proc/loadavg)"
}

show_results() {   # show_results FILE... : print the summaries, then where the raw data is
  cat "$@"
  echo "raw: $OUT"
}
