#!/usr/bin/env bash
# Bring the local cluster up: PKI, the bridge, etcd, kube-apiserver (on the
# bridge gateway), controller-manager, scheduler, containerd, bridge CNI,
# kubelet, kube-proxy (iptables mode), egress guards. Returns when the
# Node is Ready and prints KUBECONFIG=<path>. Idempotent: a running cluster is
# left as it is. On failure the partial cluster stays for inspection; `down`
# removes it (e2e/run.sh always calls down).
set -euo pipefail
E2E_DIR="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=e2e/scripts/common.sh
. "$E2E_DIR/scripts/common.sh"

[ "$(id -u)" = 0 ] || die "the cluster needs root (containerd, kubelet, iptables)"
cluster_lock
T0=$(date +%s.%N)
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

if pid_alive "$(recorded_pid kubelet)" && kc get --raw /readyz >/dev/null 2>&1; then
  log "already up"
  echo "KUBECONFIG=$KUBECONFIG_ADMIN"
  exit 0
fi
if [ -d "$RUN" ]; then
  log "stale run dir $RUN: tearing the old cluster down first"
  "$E2E_DIR/scripts/down.sh"
fi

BIN="$(k8s_bin)"
mkdir -p "$PKI" "$LOGS" "$PIDS" "$STATE" "$RUN/etcd" "$RUN/containerd" "$RUN/cni/net.d" "$RUN/kubelet"

# --- record what `down` must restore ------------------------------------------
: >"$STATE/sysctls"
for s in "${SYSCTLS[@]}"; do
  if [ -r "/proc/sys/$s" ]; then printf '%s %s\n' "$s" "$(cat "/proc/sys/$s")" >>"$STATE/sysctls"; fi
done
: >"$STATE/preexisting"
for p in "${HOST_PATHS[@]}"; do if [ -e "$p" ]; then echo "$p" >>"$STATE/preexisting"; fi; done

# --- PKI -------------------------------------------------------------------------
log "PKI"
(
  cd "$PKI"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.crt -days 30 \
    -subj "/CN=baton-e2e-ca" 2>/dev/null
  # name  subject  extra-extensions
  issue() {
    local name=$1 subj=$2 ext=$3
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$name.key" -out "$name.csr" -subj "$subj" 2>/dev/null
    printf '%s\n' "$ext" >"$name.ext"
    openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 \
      -extfile "$name.ext" -out "$name.crt" 2>/dev/null
    rm -f "$name.csr"
  }
  client="basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  issue apiserver "/CN=kube-apiserver" "basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:$APISERVER_HOST,IP:$SERVICE_API_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  issue admin "/O=system:masters/CN=baton-e2e-admin" "$client"
  issue kubelet "/O=system:nodes/CN=system:node:$NODE_NAME" "$client"
  issue apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$client"
  issue controller-manager "/CN=system:kube-controller-manager" "$client"
  issue scheduler "/CN=system:kube-scheduler" "$client"
  # Bound to the node-proxier role by the default ClusterRoleBinding.
  issue kube-proxy "/CN=system:kube-proxy" "$client"
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
)

kubeconfig() { # name cert
  cat >"$RUN/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: baton-e2e
  cluster:
    server: $APISERVER_URL
    certificate-authority: $PKI/ca.crt
users:
- name: $2
  user:
    client-certificate: $PKI/$2.crt
    client-key: $PKI/$2.key
contexts:
- name: baton-e2e
  context: {cluster: baton-e2e, user: $2}
current-context: baton-e2e
EOF
}
kubeconfig admin admin
kubeconfig kubelet kubelet
kubeconfig controller-manager controller-manager
kubeconfig scheduler scheduler
kubeconfig kube-proxy kube-proxy

# start name cmd...: run detached, log to $LOGS/name.log, record the PID.
start() {
  local name=$1
  shift
  # 9>&-: daemons must not inherit the cluster lock's descriptor.
  setsid "$@" >"$LOGS/$name.log" 2>&1 </dev/null 9>&- &
  echo $! >"$PIDS/$name.pid"
  ledger_add "$name" $!
}

wait_until() { # seconds description command...
  local limit=$1 what=$2
  shift 2
  local deadline=$(($(date +%s) + limit))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      log "timed out after ${limit}s waiting for $what"
      for f in "$LOGS"/*.log; do echo "--- $f" >&2; tail -15 "$f" >&2; done
      die "up failed (run: e2e/cluster.sh down)"
    fi
    sleep 0.3
  done
}

# The bridge exists from the start (the CNI plugin reuses it): the API server
# serves on its gateway address, which Pods reach over the bridge.
ip link add "$BRIDGE" type bridge
ip addr add "$POD_GATEWAY/${POD_SUBNET#*/}" dev "$BRIDGE"
ip link set "$BRIDGE" up

# --- etcd + apiserver ------------------------------------------------------
log "etcd"
start etcd etcd --name baton-e2e --data-dir "$RUN/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "baton-e2e=http://127.0.0.1:$ETCD_PEER_PORT" \
  --listen-metrics-urls "" --log-level warn

log "kube-apiserver"
start kube-apiserver "$BIN/kube-apiserver" \
  --etcd-servers "http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --bind-address "$APISERVER_HOST" --advertise-address "$APISERVER_HOST" --secure-port "$APISERVER_PORT" \
  --insecure-port 0 \
  --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
  --client-ca-file "$PKI/ca.crt" \
  --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --api-audiences https://kubernetes.default.svc.cluster.local \
  --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
  --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
  --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
  --kubelet-preferred-address-types Hostname,InternalIP \
  --endpoint-reconciler-type lease \
  --service-cluster-ip-range "$SERVICE_RANGE" \
  --allow-privileged=true --profiling=false

# --- containerd (in parallel with the apiserver's start) ---------------------
log "containerd"
mkdir -p "$RUN/containerd/certs.d/docker.io" "$RUN/containerd/root" "$RUN/containerd/state" "$RUN/containerd/opt"
cat >"$RUN/containerd/certs.d/docker.io/hosts.toml" <<EOF
# docker.io resolves to a dead loopback port: an accidental pull fails locally.
server = "https://$DEAD_REGISTRY"
[host."https://$DEAD_REGISTRY"]
  capabilities = ["pull", "resolve"]
EOF
cat >"$RUN/containerd/config.toml" <<EOF
version = 2
root = "$RUN/containerd/root"
state = "$RUN/containerd/state"
[grpc]
  address = "$CONTAINERD_SOCK"
[ttrpc]
  address = "$RUN/containerd/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$RUN/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # No CAP_SYS_RESOURCE on these machines: without this every sandbox fails.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "$RUN/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$RUN/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$RUN/containerd/certs.d"
EOF
cat >"$RUN/cni/net.d/10-baton.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "baton-e2e",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_SUBNET", "gateway": "$POD_GATEWAY"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "$RUN/cni/ipam"
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
start containerd containerd --config "$RUN/containerd/config.toml"


# --- egress guards -----------------------------------------------------------
# Pods are never routed off the bridge; nothing on the host reaches the
# link-local metadata range. Dedicated chains so tests can read the counters.
log "egress guards"
for ipt in iptables ip6tables; do
  $ipt -w -N "$GUARD_FWD" 2>/dev/null || $ipt -w -F "$GUARD_FWD"
  $ipt -w -A "$GUARD_FWD" -i "$BRIDGE" ! -o "$BRIDGE" -j DROP
  $ipt -w -I FORWARD 1 -j "$GUARD_FWD"
done
iptables -w -N "$GUARD_OUT" 2>/dev/null || iptables -w -F "$GUARD_OUT"
iptables -w -A "$GUARD_OUT" -d 169.254.0.0/16 -j DROP
# A ClusterIP still untranslated after kube-proxy's OUTPUT DNAT has no
# Service behind it; the default route would carry it off the machine.
iptables -w -A "$GUARD_OUT" -d "$SERVICE_RANGE" -j DROP
iptables -w -I OUTPUT 1 -j "$GUARD_OUT"
ip6tables -w -N "$GUARD_OUT" 2>/dev/null || ip6tables -w -F "$GUARD_OUT"
ip6tables -w -A "$GUARD_OUT" -d fe80::a9fe:a9fe/128 -j DROP
ip6tables -w -I OUTPUT 1 -j "$GUARD_OUT"

wait_until 60 "kube-apiserver /readyz" kc get --raw /readyz
log "apiserver ready after $(elapsed)s"

log "controller-manager, scheduler"
start kube-controller-manager "$BIN/kube-controller-manager" \
  --kubeconfig "$RUN/controller-manager.kubeconfig" \
  --authentication-kubeconfig "$RUN/controller-manager.kubeconfig" \
  --authorization-kubeconfig "$RUN/controller-manager.kubeconfig" \
  --bind-address 127.0.0.1 --port 0 --secure-port 10257 \
  --controllers '*,-cloud-node-lifecycle,-route,-service,-nodeipam' \
  --use-service-account-credentials=true \
  --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
  --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
  --leader-elect=false --node-monitor-period 2s
start kube-scheduler "$BIN/kube-scheduler" \
  --kubeconfig "$RUN/scheduler.kubeconfig" \
  --authentication-kubeconfig "$RUN/scheduler.kubeconfig" \
  --authorization-kubeconfig "$RUN/scheduler.kubeconfig" \
  --bind-address 127.0.0.1 --port 0 --secure-port 10259 --leader-elect=false

wait_until 30 "containerd" ctr --address "$CONTAINERD_SOCK" version
"$E2E_DIR/images.sh" pause

# --- kubelet ---------------------------------------------------------------------
log "kubelet"
printf 'nameserver 127.0.0.1\noptions ndots:1\n' >"$RUN/resolv.conf"
cat >"$RUN/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
failSwapOn: false
nodeStatusUpdateFrequency: 2s
nodeStatusReportFrequency: 10s
syncFrequency: 10s
fileCheckFrequency: 10s
resolvConf: $RUN/resolv.conf
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
kubeAPIQPS: 50
kubeAPIBurst: 100
EOF
# kubeAPIQPS/kubeAPIBurst: the defaults since Kubernetes 1.27 (1.20's are
# 5/10). In one CI run, right after the tests of phase 1 had deleted their
# namespaces, a replaced webhook Pod and two operator Pods stayed listed
# (terminating) for about a minute although containerd had stopped their
# containers within 5 s, and two exclusive tests that wait for them took
# 70 s and 60 s (16 s and 10 s alone): the kubelet's final delete queues
# behind its other API calls at 5 per second.
# The kubelet's built-in AWS credential provider probes 169.254.169.254 at
# start unless told not to.
start kubelet env AWS_EC2_METADATA_DISABLED=true "$BIN/kubelet" \
  --config "$RUN/kubelet/config.yaml" \
  --kubeconfig "$RUN/kubelet.kubeconfig" \
  --container-runtime remote \
  --container-runtime-endpoint "unix://$CONTAINERD_SOCK" \
  --image-service-endpoint "unix://$CONTAINERD_SOCK" \
  --root-dir "$KUBELET_ROOT" --cert-dir "$RUN/kubelet/pki" \
  --runtime-request-timeout 2m --v 1

node_ready() {
  [ "$(kc get node "$NODE_NAME" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" = True ] &&
    ! kc get node "$NODE_NAME" -o 'jsonpath={.spec.taints[*].key}' | grep -q not-ready
}
wait_until 90 "Node $NODE_NAME Ready" node_ready

# --- kube-proxy ------------------------------------------------------------------
# iptables mode. A Pod's packet to a ClusterIP is routed through the host and
# DNATed there; the backend's reply on the same bridge must pass iptables too
# (bridge-nf-call-iptables, restored on down) or conntrack cannot undo the
# DNAT. Without br_netfilter, --masquerade-all makes replies come back
# through the host instead. --conntrack-max-per-core 0 and the two timeouts
# 0 keep it from writing conntrack sysctls.
log "kube-proxy"
proxy_extra=()
if [ -w /proc/sys/net/bridge/bridge-nf-call-iptables ]; then
  echo 1 >/proc/sys/net/bridge/bridge-nf-call-iptables
else
  log "no br_netfilter: kube-proxy --masquerade-all"
  proxy_extra+=(--masquerade-all)
fi
start kube-proxy "$BIN/kube-proxy" \
  --kubeconfig "$RUN/kube-proxy.kubeconfig" \
  --proxy-mode iptables --cluster-cidr "$POD_SUBNET" \
  --hostname-override "$NODE_NAME" \
  --conntrack-max-per-core 0 \
  --conntrack-tcp-timeout-established 0 --conntrack-tcp-timeout-close-wait 0 \
  --metrics-bind-address "$KUBE_PROXY_METRICS" --healthz-bind-address "$KUBE_PROXY_HEALTHZ" \
  --oom-score-adj 0 "${proxy_extra[@]}"
# Synced once its rules for the `kubernetes` Service (published by the API
# server's endpoint reconciler) are in the nat table.
proxy_synced() {
  curl -fsS "http://$KUBE_PROXY_HEALTHZ/healthz" >/dev/null &&
    iptables -w -t nat -S KUBE-SERVICES 2>/dev/null | grep -q -- "-d $SERVICE_API_IP/32"
}
wait_until 60 "kube-proxy rules for the kubernetes Service" proxy_synced

# The kubelet and kube-proxy insert their jumps at the top of FORWARD/OUTPUT:
# move the guards back to first place (kube-proxy only re-inserts a jump
# that is missing, so this holds for the cluster's life).
for ipt in iptables ip6tables; do
  for pair in "FORWARD:$GUARD_FWD" "OUTPUT:$GUARD_OUT"; do
    chain=${pair%%:*} guard=${pair#*:}
    if [ "$($ipt -w -S "$chain" | sed -n 2p)" != "-A $chain -j $guard" ]; then
      $ipt -w -D "$chain" -j "$guard"
      $ipt -w -I "$chain" 1 -j "$guard"
    fi
  done
done

echo "$(elapsed)" >"$STATE/up-seconds"
log "Node $NODE_NAME Ready after $(elapsed)s (logs: $LOGS)"
echo "KUBECONFIG=$KUBECONFIG_ADMIN"
