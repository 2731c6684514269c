#!/usr/bin/env bash
# Install Baton into the running e2e cluster the way a user would:
#   1. kubectl apply --validate=false -f manifests/crds/
#   2. kubectl apply --server-side --validate=false -k e2e/overlay (dry run first)
#   3. start baton-webhook and baton-operator as host processes on 127.0.0.1
#      with their ServiceAccounts' tokens (see e2e/overlay/kustomization.yaml
#      for why), wait until they are ready and the webhook filled caBundle.
# A component whose release binary is missing (it did not build) is SKIPPED
# with a loud message and listed in $STATE/install-skipped; never silently.
# Exit 3 when something was skipped, 0 when everything is installed.
set -euo pipefail
E2E_DIR="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=e2e/scripts/common.sh
. "$E2E_DIR/scripts/common.sh"
cd "$REPO"

[ -f "$KUBECONFIG_ADMIN" ] || die "cluster is not up (run e2e/cluster.sh up)"
cluster_lock
RELEASE="${CARGO_TARGET_DIR:-$REPO/target}/release"
skipped=()
# usable NAME BINARY: the binary exists and e2e/images.sh did not skip its
# image (a failed release build can leave an old binary behind).
usable() {
  [ -x "$RELEASE/$2" ] && ! grep -qs "^$1 " "$CACHE/images/skipped"
}
# BATON_E2E_SKIP="operator webhook": leave components out on purpose
# (reported like any other skip).
wanted() {
  case " ${BATON_E2E_SKIP:-} " in
    *" $1 "*)
      skipped+=("$1: left out by BATON_E2E_SKIP")
      return 1
      ;;
  esac
}

# --validate=false: kubectl validates client-side against the server's
# OpenAPI, and 1.20's does not know `x-kubernetes-validations` (CEL, 1.25+),
# so a 1.20 user needs it; the 1.20 API server then drops those rules (the
# validating webhook enforces them there).
log "kubectl apply --validate=false -f manifests/crds/"
kc apply --validate=false -f manifests/crds/ >/dev/null
kc wait --for condition=established --timeout=30s -f manifests/crds/ >/dev/null

# A server dry run of namespaced objects needs their namespace to exist.
kc apply --server-side --field-manager "$INSTALL_FIELD_MANAGER" -f manifests/namespace.yaml >/dev/null
log "kubectl apply --server-side -k e2e/overlay (dry run, then for real)"
kc apply --server-side --validate=false --field-manager "$INSTALL_FIELD_MANAGER" --dry-run=server -k e2e/overlay >/dev/null
kc apply --server-side --validate=false --field-manager "$INSTALL_FIELD_MANAGER" -k e2e/overlay >/dev/null

# sa_kubeconfig NAME: a kubeconfig with the ServiceAccount's token (1.20
# still creates token Secrets for ServiceAccounts).
sa_kubeconfig() {
  local sa=$1 secret token deadline=$(($(date +%s) + 30))
  until secret="$(kc -n "$SYSTEM_NAMESPACE" get sa "$sa" -o 'jsonpath={.secrets[0].name}' 2>/dev/null)" && [ -n "$secret" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || die "no token Secret for ServiceAccount $sa"
    sleep 0.3
  done
  token="$(kc -n "$SYSTEM_NAMESPACE" get secret "$secret" -o 'jsonpath={.data.token}' | base64 -d)"
  cat >"$RUN/$sa.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: baton-e2e
  cluster: {server: "https://127.0.0.1:$APISERVER_PORT", certificate-authority: "$PKI/ca.crt"}
users:
- name: $sa
  user: {token: "$token"}
contexts:
- name: baton-e2e
  context: {cluster: baton-e2e, user: $sa, namespace: $SYSTEM_NAMESPACE}
current-context: baton-e2e
KC
  chmod 600 "$RUN/$sa.kubeconfig"
}

# host_process NAME ADMIN_READY_URL CMD...: start with the recorded-PID
# convention of up.sh, then wait for its readiness endpoint.
host_process() {
  local name=$1 ready=$2
  shift 2
  local pid
  pid="$(recorded_pid "host-$name")"
  if pid_alive "$pid"; then
    log "$name already running (pid $pid)"
    return 0
  fi
  setsid "$@" >"$LOGS/host-$name.log" 2>&1 </dev/null 9>&- &
  echo $! >"$PIDS/host-$name.pid"
  local deadline=$(($(date +%s) + 60))
  until curl -fs -o /dev/null "$ready"; do
    if ! pid_alive "$(recorded_pid "host-$name")"; then
      tail -20 "$LOGS/host-$name.log" >&2
      die "$name exited during start-up (log: $LOGS/host-$name.log)"
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      tail -20 "$LOGS/host-$name.log" >&2
      die "$name not ready after 60s (log: $LOGS/host-$name.log)"
    fi
    sleep 0.3
  done
  log "$name ready (pid $(recorded_pid "host-$name"))"
}

if ! wanted webhook; then
  :
elif usable webhook baton-webhook; then
  sa_kubeconfig baton-webhook
  host_process webhook "http://127.0.0.1:$WEBHOOK_ADMIN_PORT/ready" \
    env KUBECONFIG="$RUN/baton-webhook.kubeconfig" POD_NAMESPACE="$SYSTEM_NAMESPACE" \
    "$RELEASE/baton-webhook" \
    --listen "127.0.0.1:$WEBHOOK_PORT" --admin-listen "127.0.0.1:$WEBHOOK_ADMIN_PORT" \
    --namespace "$SYSTEM_NAMESPACE" --extra-san 127.0.0.1 --image-pull-policy Never
  # The webhook fills caBundle from its CA; until then the API server cannot
  # verify it.
  deadline=$(($(date +%s) + 30))
  for cfg in mutatingwebhookconfiguration/baton-sidecar-injector validatingwebhookconfiguration/baton-validator; do
    until [ -n "$(kc get "$cfg" -o 'jsonpath={.webhooks[0].clientConfig.caBundle}')" ]; do
      [ "$(date +%s)" -lt "$deadline" ] || die "the webhook did not fill caBundle of $cfg"
      sleep 0.3
    done
  done
  log "webhook caBundle in place"
else
  skipped+=("webhook: no usable release binary $RELEASE/baton-webhook (see e2e/images.sh output)")
fi

if ! wanted operator; then
  :
elif usable operator baton-operator; then
  sa_kubeconfig baton-operator
  host_process operator "http://127.0.0.1:$OPERATOR_ADMIN_PORT/live" \
    env KUBECONFIG="$RUN/baton-operator.kubeconfig" BATON_POD_NAME=host-operator \
    "$RELEASE/baton-operator" \
    --admin-addr "127.0.0.1:$OPERATOR_ADMIN_PORT" --namespace "$SYSTEM_NAMESPACE" --identity host-operator
else
  skipped+=("operator: no usable release binary $RELEASE/baton-operator (see e2e/images.sh output)")
fi

if [ ${#skipped[@]} -gt 0 ]; then
  printf '%s\n' "${skipped[@]}" >"$STATE/install-skipped"
  for s in "${skipped[@]}"; do log "SKIPPED: $s"; done
  exit 3
fi
rm -f "$STATE/install-skipped"
log "Baton installed"
