#!/usr/bin/env bash
# Builds shard-bench-checkpoint and measures checkpoint save/restore throughput at 1, 2 and 4
# ranks against the same disk's raw write (fsync) and read bandwidth, and the training pause
# per save against a memory copy. Extra arguments go to the binary (e.g. --gib 2 --dir /data).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh >/dev/null
scripts/build.sh --target shard-bench-checkpoint >/dev/null
"${SHARD_BUILD_DIR:-build}/bin/shard-bench-checkpoint" "$@"
