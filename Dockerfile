# syntax=docker/dockerfile:1
# Baton's images, one target each: operator, webhook, sidecar, empty (the
# standby slot's idle image), debug-symbols, and the demo-* workloads.
#
#   docker build --target sidecar -t baton/sidecar:0.1.0 .
#
# compiles every binary in the build (a `rust` image). With the binaries
# already built (`scripts/build-binaries.sh`, into target/release/ and
# target/control/ of the build context), the same command takes them instead:
#
#   docker build --build-arg BINARIES=prebuilt --target sidecar -t baton/sidecar:0.1.0 .
#
# The e2e cluster and scripts/demo.sh run exactly that (e2e/images.sh, with
# buildah, which builds this file without a Docker engine; README "Build the
# images"). scripts/check-dockerfile.sh checks this file against the
# workspace and e2e/images.sh.
#
# Every runtime image is FROM scratch: the root its binary needs (binary,
# the shared libraries it links, /etc/passwd, /tmp, CA certificates; the
# sidecar adds iptables), assembled by docker/rootfs.sh. Every image runs as
# the non-root user 2137, and works with a read-only root filesystem.

ARG RUST_VERSION=1.95
# build: compile in the image build; prebuilt: copy target/{release,control}/ of the context
# (scripts/build-binaries.sh lays them out so).
ARG BINARIES=build

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
RUN apt-get update && apt-get install -y --no-install-recommends libssl-dev pkg-config \
    && rm -rf /var/lib/apt/lists/*
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    scripts/build-binaries.sh all \
    && mkdir -p /out \
    && cp target/control/baton-operator target/control/baton-webhook \
          target/release/baton-sidecar target/release/baton-empty \
          target/control/demo-http-echo target/control/demo-tcp-echo \
          target/control/demo-load target/control/demo-fetch /out/

# What every image's root is assembled from: a stage of its own, so a layer
# cache (and e2e/images.sh's tag of it) keeps it across builds, and a rebuild
# only assembles fresh binaries.
FROM debian:bookworm-slim AS rootfs-packages
RUN apt-get update \
    && apt-get install -y --no-install-recommends binutils ca-certificates iptables libssl3 \
    && rm -rf /var/lib/apt/lists/*

# Binaries built outside (BINARIES=prebuilt). On the packages stage rather
# than scratch: buildah's layer cache then skips the copy when they are
# unchanged.
FROM rootfs-packages AS prebuilt
COPY target/control/baton-operator target/control/baton-webhook \
     target/release/baton-sidecar target/release/baton-empty \
     target/control/demo-http-echo target/control/demo-tcp-echo \
     target/control/demo-load target/control/demo-fetch /out/

FROM ${BINARIES} AS binaries

# Every image's root (docker/rootfs.sh), under /roots/<image>/. The binaries
# are copied in, not bind-mounted: buildah's layer cache does not see a
# mounted stage's content change, a COPY's it does.
FROM rootfs-packages AS rootfs
COPY docker/rootfs.sh /usr/local/sbin/baton-rootfs
COPY --from=binaries /out/ /in/
RUN baton-rootfs /in /roots

FROM scratch AS operator
COPY --from=rootfs /roots/operator/ /
ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin
USER 2137:2137
ENTRYPOINT ["/usr/local/bin/baton-operator"]

FROM scratch AS webhook
COPY --from=rootfs /roots/webhook/ /
ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin
USER 2137:2137
ENTRYPOINT ["/usr/local/bin/baton-webhook"]

# `baton-sidecar init` (the injected init container) programs iptables, so
# this image alone carries it; the capability to use it (NET_ADMIN) is granted
# to the init container only, which runs as root (the injected spec says so).
FROM scratch AS sidecar
COPY --from=rootfs /roots/sidecar/ /
ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin
USER 2137:2137
ENTRYPOINT ["/usr/local/bin/baton-sidecar"]
CMD ["run"]

# The standby slot's idle image: waits until a hot upgrade swaps it for the
# release image, using almost no memory or CPU meanwhile. Every node pulls it
# for every injected Pod, so it holds only the binary and the C runtime it
# links (no shell, no trust store). The sidecar's postStart hook
# (`baton-sidecar wait-ready`) stays on a slot the rollout swaps back to this
# image; baton-empty answers it at once.
FROM scratch AS empty
COPY --from=rootfs /roots/empty/ /
ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin
USER 2137:2137
ENTRYPOINT ["/usr/local/bin/baton-empty"]

# Debug info of every binary above (linked by .gnu_debuglink), for
# symbolizing cores and profiles: `docker build --target debug-symbols -o dbg .`
FROM rootfs AS debug-info
RUN baton-rootfs --debug /in /debug
FROM scratch AS debug-symbols
COPY --from=debug-info /debug/ /

# Demo and test workloads.
FROM scratch AS demo-http-echo
COPY --from=rootfs /roots/demo-http-echo/ /
ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin
USER 2137:2137
ENTRYPOINT ["/usr/local/bin/demo-http-echo"]

FROM scratch AS demo-tcp-echo
COPY --from=rootfs /roots/demo-tcp-echo/ /
ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin
USER 2137:2137
ENTRYPOINT ["/usr/local/bin/demo-tcp-echo"]

FROM scratch AS demo-load
COPY --from=rootfs /roots/demo-load/ /
ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin
USER 2137:2137
ENTRYPOINT ["/usr/local/bin/demo-load"]

FROM scratch AS demo-fetch
COPY --from=rootfs /roots/demo-fetch/ /
ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin
USER 2137:2137
ENTRYPOINT ["/usr/local/bin/demo-fetch"]
