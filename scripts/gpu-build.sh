#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries into build-gpu/ (CUDA required, -DSHARD_WITH_CUDA=ON)
# and puts stripped copies in build-gpu/device/ for a GPU machine that has none of our Debian
# packages: they need only the NVIDIA driver, cuBLAS and NCCL there (checked below with ldd).
# Then, on the GPU machine, from the repository root: scripts/gpu-test.sh build-gpu/device
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${SHARD_GPU_BUILD_DIR:-build-gpu}"
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DSHARD_WARNINGS_AS_ERRORS=ON -DSHARD_WITH_CUDA=ON
fi
cmake --build "$BUILD_DIR" -j "$(nproc)" --target gpu_test shard-bench-gpu
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
du -sh "$BUILD_DIR/device"
