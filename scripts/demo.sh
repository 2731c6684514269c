#!/usr/bin/env bash
# Baton's main job, locally, in two acts (README "Run Baton's main job locally").
#
#  1. Lossless handoff on this host: a baton-sidecar serves HTTP/1.1 load
#     (byte-checked by demo-load) while new sidecar processes take over from
#     the running one three times: listeners, live keep-alive connections and
#     counters move; the load client must see zero failures.
#  2. Injection on a real local Kubernetes (e2e/cluster.sh, with kube-proxy):
#     Baton installed from manifests/ as a user would (its operator and
#     webhook run as two Pods each; the API server calls the webhook through
#     its Service), a namespace labelled baton.dev/inject=enabled, a
#     Deployment whose pods come up with the sidecar slots, and the
#     SidecarRelease status the operator writes. The cluster is torn down at
#     the end (BATON_DEMO_KEEP=1 keeps it; BATON_DEMO_K8S=0 skips act 2).
#
# Everything listens on 127.0.0.1 or the cluster's private bridge; every load
# is bounded; every process started here is stopped by PID on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/baton/target-$(rustc --version | awk '{print $2}')}"
BIN="$CARGO_TARGET_DIR/release"

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
work=$(mktemp -d /tmp/baton-demo.XXXXXX)
pids=()
k8s_up=0
cleanup() {
  local rc=$?
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ "$k8s_up" = 1 ] && [ "${BATON_DEMO_KEEP:-0}" != 1 ]; then
    say "tearing the local cluster down"
    e2e/cluster.sh down || rc=1
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "installing packages and building (release)"
scripts/deps.sh
cargo build --release --locked -p baton-sidecar -p baton-e2e --bins 2>&1 | tail -1

# ---------------------------------------------------------------- act 1
say "act 1: three live handoffs under load"
"$BIN/demo-http-echo" --listen 127.0.0.1:8081 >"$work/echo1.log" 2>&1 & pids+=($!)
"$BIN/demo-http-echo" --listen 127.0.0.1:8082 >"$work/echo2.log" 2>&1 & pids+=($!)
export BATON_HANDOFF_SOCKET="$work/handoff.sock" BATON_HANDOFF_STATUS_FILE="$work/handoff-status.json"
export BATON_LOG=warn
# Sets $started (not echoed: a command substitution would run it in a
# subshell and the PID would never reach the cleanup list).
start_sidecar() {
  "$BIN/baton-sidecar" run --config examples/standalone.yaml >>"$work/sidecar.log" 2>&1 &
  started=$!
  pids+=("$started")
}
start_sidecar
first=$started
"$BIN/baton-sidecar" wait-ready --admin 127.0.0.1:15020 --timeout-secs 30
echo "sidecar pid $first serves 127.0.0.1:15001 (examples/standalone.yaml)"

"$BIN/demo-load" --target 127.0.0.1:15001 --protocol http1 --exchanges 40000 \
  --concurrency 8 --payload-bytes 2048 --deadline-secs 90 >"$work/load.txt" 2>&1 &
load=$!
pids+=("$load")
for i in 1 2 3; do
  sleep 2
  before=$(date +%s%N)
  start_sidecar
  new=$started
  for _ in $(seq 1 200); do
    grep -qs "\"pid\": *$new\b" "$BATON_HANDOFF_STATUS_FILE" && break
    sleep 0.05
  done
  grep -qs "\"pid\": *$new\b" "$BATON_HANDOFF_STATUS_FILE" || { echo "handoff $i did not complete"; cat "$work/sidecar.log"; exit 1; }
  echo "handoff $i: pid $new took over in $(( ($(date +%s%N) - before) / 1000000 )) ms (including process start)"
done
wait "$load" || { echo "load client reported failures:"; cat "$work/load.txt"; exit 1; }
cat "$work/load.txt"
echo "handoff status file:"; cat "$BATON_HANDOFF_STATUS_FILE"; echo
curl -fsS http://127.0.0.1:15020/metrics | grep -E '^baton_sidecar_(requests_total|handoff_complete|lifecycle_phase\{.*\} 1)' | head -8 || true

for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
pids=()

# ---------------------------------------------------------------- act 2
[ "${BATON_DEMO_K8S:-1}" = 1 ] || { say "act 2 skipped (BATON_DEMO_K8S=0)"; exit 0; }
say "act 2: injection on a local Kubernetes cluster"
e2e/cluster.sh provision
k8s_up=1
kubeconfig=$(e2e/cluster.sh up | sed -n 's/^KUBECONFIG=//p' | tail -1)
export KUBECONFIG="$kubeconfig"
e2e/cluster.sh images
e2e/cluster.sh install
say "Baton's control plane: Pods behind Services"
kubectl -n baton-system get deployments,pods,services -o wide
echo "operator leader: $(kubectl -n baton-system get lease baton-operator -o jsonpath='{.spec.holderIdentity}')"
tag=e2e
kubectl apply -f - <<YAML
apiVersion: baton.dev/v1alpha1
kind: SidecarRelease
metadata: {name: demo}
spec:
  version: "0.1.0"
  image: docker.io/baton/sidecar:$tag
  emptyImage: docker.io/baton/empty:$tag
---
apiVersion: v1
kind: Namespace
metadata:
  name: baton-demo
  labels: {baton.dev/inject: enabled}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: echo, namespace: baton-demo}
spec:
  replicas: 2
  selector: {matchLabels: {app: echo}}
  template:
    metadata: {labels: {app: echo}}
    spec:
      terminationGracePeriodSeconds: 5
      containers:
        - name: echo
          image: docker.io/baton/demo-http-echo:$tag
          imagePullPolicy: Never
          args: ["--listen", "0.0.0.0:8080"]
          ports: [{containerPort: 8080}]
YAML
kubectl -n baton-demo rollout status deployment/echo --timeout=120s
say "the injected pods"
kubectl -n baton-demo get pods -o wide
pod=$(kubectl -n baton-demo get pods -o jsonpath='{.items[0].metadata.name}')
echo "containers of $pod:"
kubectl -n baton-demo get pod "$pod" -o jsonpath='{range .spec.initContainers[*]}  init: {.name} ({.image}){"\n"}{end}{range .spec.containers[*]}  container: {.name} ({.image}){"\n"}{end}'
echo "annotations:"
kubectl -n baton-demo get pod "$pod" -o jsonpath='{.metadata.annotations}' | tr ',' '\n' | grep baton.dev || true
ip=$(kubectl -n baton-demo get pod "$pod" -o jsonpath='{.status.podIP}')
say "HTTP to the pod IP $ip:8080 (inbound capture through the sidecar)"
curl -fsS --max-time 5 -d 'hello through baton' "http://$ip:8080/" && echo
say "SidecarRelease status written by the operator"
for _ in $(seq 1 30); do
  [ "$(kubectl get sr demo -o jsonpath='{.status.total}' 2>/dev/null)" = 2 ] && break
  sleep 1
done
kubectl get sidecarreleases
kubectl get sr demo -o jsonpath='{range .status.conditions[*]}{.type}={.status} ({.reason}): {.message}{"\n"}{end}'
say "done"
