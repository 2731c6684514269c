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
# Usage: bench/tls-testssl.sh [-o OUTDIR]   Env: BATON_SIDECAR_BIN (default: the release
# build, built if stale), KEY_KIND (ecdsa|rsa)
set -euo pipefail
. "$(dirname "$0")/lib.sh"
OUT=""
while getopts "o:h" o; do case $o in o) OUT=$OPTARG ;; *) sed -n '2,13p' "$0"; exit 0 ;; esac; done
KEY_KIND=${KEY_KIND:-ecdsa}
NEED_HINT="testssl: apt-get install testssl.sh" need testssl openssl setsid ss python3
BIN=$(sidecar_bin) || exit 2
bench_init tls-testssl "$OUT"
make_cert "$KEY_KIND" "$WORK"
UP=$(free_port); PORT=$(free_port)
# Upstream: a trivial HTTP responder (python3, loopback).
start_bg upstream "" python3 -c "
import http.server, socketserver
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header('content-length','2'); self.end_headers(); self.wfile.write(b'ok')
    def log_message(self, *a): pass
socketserver.TCPServer(('127.0.0.1', $UP), H).serve_forever()"
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
  start_bg sidecar "" "$BIN" run --config "$WORK/sc.yaml"
wait_port "$PORT" "$LAST_PID" || die "the sidecar did not start; see $WORK/sidecar.log"
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
