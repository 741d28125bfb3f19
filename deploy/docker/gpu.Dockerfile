# syntax=docker/dockerfile:1
# Shard's GPU worker image: shard-worker with the CUDA/NCCL data path (and shardctl) on an
# NVIDIA CUDA runtime base. Build from the repository root (context filter:
# gpu.Dockerfile.dockerignore):
#
#   docker build -f deploy/docker/gpu.Dockerfile -t shard:gpu .
#   docker build -f deploy/docker/gpu.Dockerfile --build-arg CUDA_ARCHITECTURES=90-real -t shard:gpu .
#
# The host needs the NVIDIA driver and the NVIDIA Container Toolkit (which injects libcuda).
# The coordinator runs from the CPU image (cpu.Dockerfile); it needs no GPU.
ARG CUDA_VERSION=13.0.1
ARG UBUNTU=ubuntu24.04

# --- build stage: CUDA devel image + the same packages scripts/setup.sh installs on Debian -----
# Ubuntu 24.04 carries every package of scripts/setup.sh under the same Debian name (gRPC,
# Abseil, Gloo, CLI11, ...), so the project's own set-up script installs them here too.
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
ARG CUDA_ARCHITECTURES="90-real;80-virtual"
WORKDIR /src
COPY scripts/setup.sh scripts/setup.sh
RUN apt-get update && scripts/setup.sh \
 && (dpkg -s libnccl-dev >/dev/null 2>&1 \
     || DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnccl-dev) \
 && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHARD_WITH_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES}" -DBUILD_TESTING=OFF \
 && cmake --build /build -j "$(nproc)" --target shard-worker shardctl \
 && mkdir -p /out/bin \
 && cp /build/bin/shard-worker /build/bin/shardctl /out/bin/ \
 && strip --strip-debug /out/bin/* \
 && deploy/docker/runtime-packages.sh /out/bin/* > /out/runtime-packages.txt \
 && echo "runtime packages: $(tr '\n' ' ' < /out/runtime-packages.txt)"

# --- runtime stage: CUDA runtime (cuBLAS, NCCL) + the host libraries the binaries load --------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS runtime
COPY --from=build /out/runtime-packages.txt /tmp/runtime-packages.txt
# Packages the base already has are left alone (the CUDA image holds its cuBLAS and NCCL).
RUN apt-get update \
 && missing=$(for p in $(cat /tmp/runtime-packages.txt); do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done) \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      $missing ca-certificates \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt \
 && groupadd --system --gid 10001 shard \
 && useradd --system --uid 10001 --gid shard --home-dir /var/lib/shard --shell /usr/sbin/nologin shard \
 && mkdir -p /var/lib/shard /etc/shard \
 && chown shard:shard /var/lib/shard
COPY --from=build /out/bin/ /usr/local/bin/
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
VOLUME ["/var/lib/shard"]
WORKDIR /var/lib/shard
USER 10001:10001
# One worker per GPU: the container sees its GPU as cuda:0.
ENTRYPOINT ["shard-worker"]
CMD ["--device", "cuda:0"]
