#!/usr/bin/env bash
# Pod-create latency through the real API server, with and without Baton's
# injector in the path: server-side dry-run creates (admission runs in full,
# nothing is stored or scheduled) of the same pod into an opted-in namespace
# and into a plain one, interleaved over one keep-alive TLS connection so
# both see the same machine noise. Bounded: N creates each (default 200, at
# most 2000), paced at RATE per second (default 50).
#
# Needs the e2e cluster with Baton installed (the injector reachable at the
# URL in baton-sidecar-injector), e.g.:
#   BATON_E2E_KEEP=1 e2e/run.sh webhook   # leaves the cluster up
#   BATON_E2E_KUBECONFIG=/tmp/baton-e2e/admin.kubeconfig bench/webhook-podcreate.sh
set -euo pipefail
KC="${BATON_E2E_KUBECONFIG:?set BATON_E2E_KUBECONFIG to the e2e cluster kubeconfig}"
N="${N:-200}"; [ "$N" -le 2000 ] || N=2000
RATE="${RATE:-50}"
k() { kubectl --kubeconfig "$KC" "$@"; }
tmp=$(mktemp -d)
suffix=$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')
plain="baton-bench-plain-$suffix"; meshed="baton-bench-meshed-$suffix"; release="baton-bench-$suffix"
cleanup() {
  k delete ns "$plain" "$meshed" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  k delete sidecarreleases.baton.dev "$release" --ignore-not-found >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT

k get mutatingwebhookconfiguration baton-sidecar-injector >/dev/null
k create ns "$plain" >/dev/null
k create ns "$meshed" >/dev/null
k label ns "$meshed" baton.dev/inject=enabled baton.dev/bench="$suffix" >/dev/null
k apply -f - >/dev/null <<YAML
apiVersion: baton.dev/v1alpha1
kind: SidecarRelease
metadata: {name: $release}
spec:
  version: 0.1.0-bench
  image: docker.io/baton/sidecar:e2e
  emptyImage: docker.io/baton/empty:e2e
  priority: 1000
  namespaceSelector: {matchLabels: {baton.dev/bench: "$suffix"}}
YAML
for ns in "$plain" "$meshed"; do
  until k get sa default -n "$ns" >/dev/null 2>&1; do sleep 0.2; done
done
server=$(k config view --raw --minify -o jsonpath='{.clusters[0].cluster.server}')
# Credentials inline (*-data) or as file paths, whichever the kubeconfig has.
cred() {
  local data file
  data=$(k config view --raw --minify -o "jsonpath={$1-data}")
  if [ -n "$data" ]; then
    printf '%s' "$data" | base64 -d >"$2"
  else
    file=$(k config view --raw --minify -o "jsonpath={$1}")
    cp "$file" "$2"
  fi
}
cred .clusters[0].cluster.certificate-authority "$tmp/ca.crt"
cred .users[0].user.client-certificate "$tmp/client.crt"
cred .users[0].user.client-key "$tmp/client.key"

python3 - "$server" "$tmp" "$plain" "$meshed" "$N" "$RATE" <<'PY'
import http.client, json, ssl, sys, time, urllib.parse
server, tmp, plain, meshed, n, rate = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6])
u = urllib.parse.urlparse(server)
ctx = ssl.create_default_context(cafile=f"{tmp}/ca.crt")
ctx.load_cert_chain(f"{tmp}/client.crt", f"{tmp}/client.key")
conn = http.client.HTTPSConnection(u.hostname, u.port, context=ctx, timeout=10)
pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "bench-", "labels": {"app": "bench"}},
       "spec": {"containers": [{"name": "app", "image": "docker.io/baton/demo-http-echo:e2e", "imagePullPolicy": "Never"}]}}
body = json.dumps(pod).encode()
def create(ns):
    t = time.perf_counter()
    conn.request("POST", f"/api/v1/namespaces/{ns}/pods?dryRun=All", body, {"Content-Type": "application/json"})
    r = conn.getresponse(); data = r.read()
    dt = time.perf_counter() - t
    if r.status != 201:
        sys.exit(f"create in {ns}: HTTP {r.status}: {data[:300]!r}")
    return dt, json.loads(data)
# Warm-up and a check that injection really happens in the meshed namespace.
for _ in range(10):
    create(plain)
_, obj = create(meshed)
names = [c["name"] for c in obj["spec"]["containers"]]
assert names[0] == "baton-sidecar-a", f"not injected: {names}"
lat = {plain: [], meshed: []}
interval, start = 1.0 / rate, time.perf_counter()
for i in range(2 * n):
    due = start + i * interval
    now = time.perf_counter()
    if due > now:
        time.sleep(due - now)
    ns = plain if i % 2 == 0 else meshed
    lat[ns].append(create(ns)[0])
def pct(v, p):
    v = sorted(v); return v[min(len(v) - 1, round((len(v) - 1) * p))] * 1000
print(f"pod create (server-side dry run) through the API server, {n} each, interleaved at {rate:g}/s, one keep-alive TLS connection")
print(f"{'':28} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
for label, ns in (("without webhook (plain ns)", plain), ("with injection (opted-in)", meshed)):
    print(f"{label:28} {pct(lat[ns], .5):8.2f} {pct(lat[ns], .9):8.2f} {pct(lat[ns], .99):8.2f}")
print(f"added by injection: p50 {pct(lat[meshed], .5) - pct(lat[plain], .5):+.2f} ms, p99 {pct(lat[meshed], .99) - pct(lat[plain], .99):+.2f} ms")
PY
