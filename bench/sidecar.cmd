exec ${BATON_SIDECAR_BIN:-target/release/baton-sidecar} run --listen 127.0.0.1:{PORT} --upstream {UPSTREAM} --workers 1
