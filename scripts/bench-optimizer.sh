#!/usr/bin/env bash
# Builds shard-bench-optimizer and measures the CPU optimizer step (Adam, AdamW, SGD momentum;
# one thread) against the memory-copy bandwidth measured in the same run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh >/dev/null
scripts/build.sh --target shard-bench-optimizer >/dev/null
"${SHARD_BUILD_DIR:-build}/bin/shard-bench-optimizer" "$@"
