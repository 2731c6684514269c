#!/usr/bin/env bash
# Scan the sidecar's TLS listener with Debian's testssl.sh (127.0.0.1 only).
#
# Starts one sidecar with a Strict TLS listener (ECDSA P-256 or RSA-2048
# self-signed certificate, the default policy: TLS 1.2-1.3, rustls's AEAD
# suites, resumption on) and runs testssl against it. testssl cannot present a
# mesh client certificate, so the listener runs with require_client_cert:
# false — everything else (protocols, suites, curves, vulnerabilities) is what
# a mesh listener negotiates. Findings of severity MEDIUM or worse make the
# script exit 1.
#
# Usage: bench/tls-testssl.sh [-o OUTDIR]   Env: BATON_SIDECAR_BIN, KEY_KIND (ecdsa|rsa)
set -euo pipefail
OUT=""
while getopts "o:h" o; do case $o in o) OUT=$OPTARG ;; *) sed -n '2,12p' "$0"; exit 0 ;; esac; done
BIN=${BATON_SIDECAR_BIN:-target/release/baton-sidecar}
KEY_KIND=${KEY_KIND:-ecdsa}
[[ -x $BIN ]] || { echo "no sidecar binary at $BIN" >&2; exit 2; }
command -v testssl >/dev/null || { echo "testssl missing: apt-get install testssl.sh" >&2; exit 2; }
OUT=${OUT:-${TMPDIR:-/tmp}/tls-testssl/$(date +%Y%m%d-%H%M%S)}
WORK=$OUT/work; mkdir -p "$WORK"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done; sleep 0.3; for p in "${PIDS[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
free_port() { local p; while :; do p=$(( 20000 + RANDOM % 12000 )); ss -ltn "sport = :$p" | grep -q ":$p" || { echo "$p"; return; }; done; }

if [[ $KEY_KIND == rsa ]]; then
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$WORK/key.pem" -out "$WORK/cert.pem" -days 2 \
    -subj /CN=localhost -addext subjectAltName=IP:127.0.0.1 2>/dev/null
else
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$WORK/key.pem" \
    -out "$WORK/cert.pem" -days 2 -subj /CN=localhost -addext subjectAltName=IP:127.0.0.1 2>/dev/null
fi
UP=$(free_port); PORT=$(free_port)
# Upstream: a trivial HTTP responder (python3, loopback).
setsid python3 -c "
import http.server, socketserver
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header('content-length','2'); self.end_headers(); self.wfile.write(b'ok')
    def log_message(self, *a): pass
socketserver.TCPServer(('127.0.0.1', $UP), H).serve_forever()" &
PIDS+=($!)
cat > "$WORK/sc.yaml" <<YAML
version: 1
admin: {address: "127.0.0.1:0"}
listeners:
- {name: in, address: "127.0.0.1:$PORT", direction: inbound}
clusters:
- {name: up, endpoints: ["127.0.0.1:$UP"]}
routes:
- {name: r, backends: [{cluster: up}]}
tls:
  mode: Strict
  require_client_cert: false
  source: {files: {cert_chain: "$WORK/cert.pem", key: "$WORK/key.pem", trust_bundle: "$WORK/cert.pem"}}
YAML
BATON_HANDOFF_SOCKET=$WORK/handoff.sock BATON_HANDOFF_STATUS_FILE=$WORK/handoff.json \
  setsid "$BIN" run --config "$WORK/sc.yaml" >"$WORK/sidecar.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do ss -ltn "sport = :$PORT" | grep -q ":$PORT" && break; sleep 0.05; done
timeout 900 testssl --quiet --color 0 --warnings off --fast --ip 127.0.0.1 \
  --jsonfile "$OUT/testssl.json" --logfile "$OUT/testssl.log" "127.0.0.1:$PORT" >"$OUT/testssl.txt" 2>&1 || true
cat "$OUT/testssl.txt"
# Findings that are properties of a mesh certificate, not of the TLS layer:
# the test certificate is self-signed and lives 2 days; mesh certificates come
# from the mesh CA (not a public one), live hours and are revoked by expiry
# (renewal at 2/3 of the lifetime), so no CRL/OCSP URI. HTTP security headers
# (HSTS, ...) belong to the application behind the sidecar.
EXPECTED='cert_chain_of_trust cert_expirationStatus cert_notAfter cert_revocation cert_trust security_headers HSTS DNS_CAArecord'
python3 - "$OUT/testssl.json" "$EXPECTED" > "$OUT/findings.txt" <<'PY'
import json, sys
expected = set(sys.argv[2].split())
bad = [f for f in json.load(open(sys.argv[1]))
       if f.get("severity") in ("MEDIUM", "HIGH", "CRITICAL") and f["id"] not in expected]
for f in bad:
    print(f"{f['severity']}: {f['id']}: {f['finding']}")
PY
echo "findings (MEDIUM or worse, excluding the expected certificate/HTTP-header ones):"
cat "$OUT/findings.txt"
echo "raw: $OUT"
[[ ! -s $OUT/findings.txt ]]
