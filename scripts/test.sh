#!/usr/bin/env bash
# Runs every test: installs what is missing, configures, builds, and runs the whole suite
# through ctest (unit, in-process multi-rank, and multi-process integration tests). Exits
# non-zero on any failure. Extra arguments go to ctest, e.g. `scripts/test.sh -L unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
# Serially: the integration tests assert liveness deadlines and share a 2-core machine.
ctest --test-dir "${SHARD_BUILD_DIR:-build}" --output-on-failure --timeout 300 "$@"
