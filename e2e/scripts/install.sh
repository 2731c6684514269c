#!/usr/bin/env bash
# Install Baton into the running e2e cluster the way a user would:
#   1. kubectl apply --validate=false -f manifests/crds/
#   2. kubectl apply --server-side --validate=false -k e2e/overlay (dry run first)
#   3. wait until the operator and webhook Deployments (2 Pods each, from the
#      locally imported images) are rolled out and the webhook Pods filled
#      caBundle of both webhook configurations.
# A component whose image did not build is SKIPPED with a loud message (its
# Deployment scaled to 0) and listed in $STATE/install-skipped; never silently.
# Exit 3 when something was skipped, 0 when everything is installed.
set -euo pipefail
E2E_DIR="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=e2e/scripts/common.sh
. "$E2E_DIR/scripts/common.sh"
cd "$REPO"

[ -f "$KUBECONFIG_ADMIN" ] || die "cluster is not up (run e2e/cluster.sh up)"
cluster_lock
skipped=()
# usable NAME: e2e/images.sh imported the component's image this run.
usable() {
  ! grep -qs "^$1 " "$CACHE/images/skipped" &&
    ctr_k8s images check "name==$IMAGE_REPO/$1:$IMAGE_TAG" 2>/dev/null | grep -q complete
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

# dump NAME: what a failed rollout looked like (pods, events, logs).
dump() {
  local name=$1
  kc -n "$SYSTEM_NAMESPACE" get pods -o wide >&2 || true
  kc -n "$SYSTEM_NAMESPACE" describe pods -l "app.kubernetes.io/name=$name" 2>&1 | tail -40 >&2 || true
  kc -n "$SYSTEM_NAMESPACE" logs -l "app.kubernetes.io/name=$name" --tail 30 --prefix 2>&1 >&2 || true
}

# rolled_out NAME: the Deployment's Pods are all updated and Ready.
rolled_out() {
  local name=$1
  if ! kc -n "$SYSTEM_NAMESPACE" rollout status "deployment/$name" --timeout=180s >/dev/null; then
    dump "$name"
    die "deployment $name did not become ready"
  fi
  log "$name: $(kc -n "$SYSTEM_NAMESPACE" get deployment "$name" -o 'jsonpath={.status.readyReplicas}/{.spec.replicas}') Pods ready"
}

for c in webhook operator; do
  if ! wanted "$c"; then
    kc -n "$SYSTEM_NAMESPACE" scale "deployment/baton-$c" --replicas 0 >/dev/null
  elif ! usable "$c"; then
    skipped+=("$c: no image $IMAGE_REPO/$c:$IMAGE_TAG (see e2e/images.sh output)")
    kc -n "$SYSTEM_NAMESPACE" scale "deployment/baton-$c" --replicas 0 >/dev/null
  fi
done

if ! printf '%s\n' "${skipped[@]:-}" | grep -q '^webhook'; then
  rolled_out baton-webhook
  # The webhook Pods fill caBundle from their shared CA; until then the API
  # server cannot verify them.
  deadline=$(($(date +%s) + 60))
  for cfg in mutatingwebhookconfiguration/baton-sidecar-injector validatingwebhookconfiguration/baton-validator; do
    until [ -n "$(kc get "$cfg" -o 'jsonpath={.webhooks[0].clientConfig.caBundle}')" ]; do
      if [ "$(date +%s)" -ge "$deadline" ]; then
        dump baton-webhook
        die "the webhook did not fill caBundle of $cfg"
      fi
      sleep 0.3
    done
  done
  log "webhook caBundle in place"
fi
if ! printf '%s\n' "${skipped[@]:-}" | grep -q '^operator'; then
  rolled_out baton-operator
fi

if [ ${#skipped[@]} -gt 0 ]; then
  printf '%s\n' "${skipped[@]}" >"$STATE/install-skipped"
  for s in "${skipped[@]}"; do log "SKIPPED: $s"; done
  exit 3
fi
rm -f "$STATE/install-skipped"
log "Baton installed"
