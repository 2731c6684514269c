# syntax=docker/dockerfile:1
# One builder compiles every binary once; each runtime stage copies only its own.
# Build a component with:  docker build --target sidecar -t baton/sidecar:0.1.0 .
# (targets: operator, webhook, sidecar, empty, and the demo-* workloads). The e2e harness builds the same
# images as OCI tarballs without Docker (e2e/images.sh); keep the two in step —
# scripts/check-dockerfile.sh verifies every binary copied here is one the
# workspace builds.

ARG RUST_VERSION=1.95
FROM rust:${RUST_VERSION}-bookworm AS builder
WORKDIR /src
RUN apt-get update && apt-get install -y --no-install-recommends libssl-dev pkg-config \
    && rm -rf /var/lib/apt/lists/*
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bins \
    && mkdir -p /out \
    && cp target/release/baton-operator target/release/baton-webhook \
          target/release/baton-sidecar target/release/baton-empty \
          target/release/demo-http-echo target/release/demo-tcp-echo target/release/demo-load \
          target/release/demo-fetch /out/ \
    && mkdir -p /out/debug \
    && for b in /out/baton-* /out/demo-*; do \
         objcopy --only-keep-debug "$b" "/out/debug/${b##*/}.debug" \
         && objcopy --strip-debug --add-gnu-debuglink="/out/debug/${b##*/}.debug" "$b"; \
       done \
    && mkdir -p /out/empty-root/usr/local/bin \
    && cp /out/baton-empty /out/empty-root/usr/local/bin/ \
    && ln -s baton-empty /out/empty-root/usr/local/bin/baton-sidecar \
    && for lib in $(ldd /out/baton-empty | awk '/=>/ { print $3 } !/=>/ && $1 ~ /^\// { print $1 }'); do \
         install -D "$(readlink -f "$lib")" "/out/empty-root$lib"; \
       done

# Minimal runtime: Debian slim with CA certificates and the OpenSSL 3 runtime
# (the sidecar's `openssl` offload engine loads providers such as Intel's QAT
# provider through OPENSSL_CONF). Every image runs as a non-root user.
FROM debian:bookworm-slim AS runtime
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libssl3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 2137 --no-create-home --shell /usr/sbin/nologin baton
USER 2137:2137

FROM runtime AS operator
COPY --from=builder /out/baton-operator /usr/local/bin/baton-operator
ENTRYPOINT ["/usr/local/bin/baton-operator"]

FROM runtime AS webhook
COPY --from=builder /out/baton-webhook /usr/local/bin/baton-webhook
ENTRYPOINT ["/usr/local/bin/baton-webhook"]

# `baton-sidecar init` (the injected init container) programs iptables, so
# this image alone carries it; the capability to use it (NET_ADMIN) is granted
# to the init container only.
FROM runtime AS sidecar
USER root
RUN apt-get update && apt-get install -y --no-install-recommends iptables \
    && rm -rf /var/lib/apt/lists/*
USER 2137:2137
COPY --from=builder /out/baton-sidecar /usr/local/bin/baton-sidecar
ENTRYPOINT ["/usr/local/bin/baton-sidecar"]
CMD ["run"]

# The standby slot's idle image: waits until a hot upgrade swaps it for the
# release image, using almost no memory or CPU meanwhile. Every node pulls it
# for every injected Pod, so it holds only the binary and the C runtime it
# links (no shell, no trust store): the same rootfs e2e/images.sh builds.
# The sidecar's postStart hook (`baton-sidecar wait-ready`) stays on a slot
# the rollout swaps back to this image; baton-empty answers it at once.
FROM scratch AS empty
COPY --from=builder /out/empty-root/ /
USER 2137:2137
ENTRYPOINT ["/usr/local/bin/baton-empty"]

# Debug info of every binary above (linked by .gnu_debuglink), for
# symbolizing cores and profiles: `docker build --target debug-symbols -o dbg .`
FROM scratch AS debug-symbols
COPY --from=builder /out/debug/ /

# Demo and test workloads (e2e/images.sh builds the same three).
FROM runtime AS demo-http-echo
COPY --from=builder /out/demo-http-echo /usr/local/bin/demo-http-echo
ENTRYPOINT ["/usr/local/bin/demo-http-echo"]

FROM runtime AS demo-tcp-echo
COPY --from=builder /out/demo-tcp-echo /usr/local/bin/demo-tcp-echo
ENTRYPOINT ["/usr/local/bin/demo-tcp-echo"]

FROM runtime AS demo-load
COPY --from=builder /out/demo-load /usr/local/bin/demo-load
ENTRYPOINT ["/usr/local/bin/demo-load"]

FROM runtime AS demo-fetch
COPY --from=builder /out/demo-fetch /usr/local/bin/demo-fetch
ENTRYPOINT ["/usr/local/bin/demo-fetch"]
