# syntax=docker/dockerfile:1
# Shard's CPU image: shard-coordinator, shard-worker (Gloo data path) and shardctl on Debian
# bookworm. Build from the repository root (the context filter is cpu.Dockerfile.dockerignore):
#
#   docker build -f deploy/docker/cpu.Dockerfile -t shard:cpu .
#
# See deploy/README.md for running it with docker-compose and Kubernetes.

# --- build stage: the project's own set-up script installs the Debian build dependencies ------
FROM debian:bookworm AS build
WORKDIR /src
COPY scripts/setup.sh scripts/setup.sh
RUN apt-get update && scripts/setup.sh && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHARD_WITH_CUDA=OFF \
      -DBUILD_TESTING=OFF \
 && cmake --build /build -j "$(nproc)" --target shard-coordinator shard-worker shardctl \
 && mkdir -p /out/bin \
 && cp /build/bin/shard-coordinator /build/bin/shard-worker /build/bin/shardctl /out/bin/ \
 && strip --strip-debug /out/bin/* \
 && deploy/docker/runtime-packages.sh /out/bin/* > /out/runtime-packages.txt \
 && cp deploy/docker/shard-healthcheck /out/bin/ \
 && echo "runtime packages: $(tr '\n' ' ' < /out/runtime-packages.txt)"

# --- runtime stage: the shared libraries the binaries load, nothing else ----------------------
FROM debian:bookworm-slim AS runtime
COPY --from=build /out/runtime-packages.txt /tmp/runtime-packages.txt
# curl: the gRPC health check (shard-healthcheck); ca-certificates: TLS to other services.
# Packages the base already has are left alone (the CUDA image holds its cuBLAS and NCCL).
RUN apt-get update \
 && missing=$(for p in $(cat /tmp/runtime-packages.txt); do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done) \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      $missing curl ca-certificates \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt \
 && groupadd --system --gid 10001 shard \
 && useradd --system --uid 10001 --gid shard --home-dir /var/lib/shard --shell /usr/sbin/nologin shard \
 && mkdir -p /var/lib/shard /etc/shard \
 && chown shard:shard /var/lib/shard
COPY --from=build /out/bin/ /usr/local/bin/
# State, checkpoints, data and outputs live under /var/lib/shard (one volume shared by the
# coordinator and every worker: workers write checkpoint shards the coordinator commits).
VOLUME ["/var/lib/shard"]
WORKDIR /var/lib/shard
USER 10001:10001
# 7460 gRPC (coordinator), 7461 gRPC health (plaintext, health service only), 9464 /metrics.
EXPOSE 7460 7461 9464
# Pick the program with the command: `shard-coordinator ...`, `shard-worker ...`, `shardctl ...`.
CMD ["shard-coordinator", "--help"]
