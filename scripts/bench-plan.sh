#!/usr/bin/env bash
# Builds shard-bench-plan and times planning of a 70B-parameter transformer manifest at 8, 64
# and 1024 ranks in both shard modes. Extra arguments go to the binary (see its --help).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
scripts/build.sh --target shard-bench-plan
"${SHARD_BUILD_DIR:-build}/bin/shard-bench-plan" "$@"
