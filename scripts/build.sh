#!/usr/bin/env bash
# Configures (once) and builds Shard into build/ (binaries in build/bin). Extra arguments go to
# `cmake --build`, e.g. `scripts/build.sh --target shard-worker`.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${SHARD_BUILD_DIR:-build}"
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHARD_WARNINGS_AS_ERRORS=ON
fi
cmake --build "$BUILD_DIR" -j "$(nproc)" "$@"
