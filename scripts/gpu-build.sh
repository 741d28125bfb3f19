#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries into build-gpu/ (CUDA required, -DSHARD_WITH_CUDA=ON)
# and puts stripped copies in build-gpu/device/ for a GPU machine that has none of our Debian
# packages: they need only the NVIDIA driver, cuBLAS and NCCL there (checked below with ldd).
# It also packs the three programs, shard-bench-checkpoint, shard-bench-collectives and the shard
# Python package (libshard.so with it) with every shared library they need beyond the C/C++
# runtime, CUDA and NCCL into build-gpu/device/cluster.tar.xz (bin/, python/ and lib/), for
# scripts/gpu-cluster-test.sh, the GPU runs of scripts/bench-torch.sh, and the CPU benchmarks
# that need a core per rank (docs/checkpoints.md, gpu-cluster-test.sh --cores). Then, on the
# GPU machine, from the repository root:
#   scripts/gpu-test.sh build-gpu/device
#   scripts/gpu-cluster-test.sh build-gpu/device/cluster.tar.xz --bench --cores
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${SHARD_GPU_BUILD_DIR:-build-gpu}"
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DSHARD_WARNINGS_AS_ERRORS=ON -DSHARD_WITH_CUDA=ON
fi
cmake --build "$BUILD_DIR" -j "$(nproc)" --target gpu_test shard-bench-gpu \
  shard-coordinator shard-worker shardctl shard-bench-checkpoint shard-bench-collectives shard_python
mkdir -p "$BUILD_DIR/device"
for binary in gpu_test shard-bench-gpu; do
  objcopy --strip-debug "$BUILD_DIR/bin/$binary" "$BUILD_DIR/device/$binary"
  # Anything shared beyond the C/C++ runtime, cuBLAS and NCCL would be missing on that machine.
  extra=$(ldd "$BUILD_DIR/device/$binary" | awk '{print $1}' |
    grep -vE '^(linux-vdso|/lib64/ld-linux|lib(c|m|dl|rt|pthread|gcc_s|stdc\+\+)\.so|libcublas(Lt)?\.so|libnccl\.so)' || true)
  if [ -n "$extra" ]; then
    echo "gpu-build: $binary needs shared libraries a bare GPU machine lacks:" $extra >&2
    exit 1
  fi
done
cp bench/gpu_torch_adam.py "$BUILD_DIR/device/"

# The cluster bundle: the programs and the Debian libraries they load (Gloo, gRPC, protobuf,
# Abseil, spdlog, OpenBLAS, ...), found by ldd here. The GPU machine's C library must be at
# least as new as this machine's (Debian 12: glibc 2.36).
bundle="$BUILD_DIR/device/cluster"
rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib" "$bundle/python/shard"
for program in shard-coordinator shard-worker shardctl shard-bench-checkpoint shard-bench-collectives; do
  objcopy --strip-debug "$BUILD_DIR/bin/$program" "$bundle/bin/$program"
done
cp "$BUILD_DIR"/python/shard/*.py "$bundle/python/shard/"
objcopy --strip-debug "$BUILD_DIR/python/shard/libshard.so" "$bundle/python/shard/libshard.so"
ldd "$bundle"/bin/* "$bundle/python/shard/libshard.so" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -vE '/(libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+)\.so|/ld-linux|libcuda\.so|libcublas|libnccl' |
  while read -r library; do cp -L "$library" "$bundle/lib/"; done
tar -C "$BUILD_DIR/device" -cJf "$BUILD_DIR/device/cluster.tar.xz" cluster
rm -rf "$bundle"
du -sh "$BUILD_DIR/device"
