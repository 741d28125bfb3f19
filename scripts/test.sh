#!/usr/bin/env bash
# Runs every test: installs what is missing, configures, builds, and runs the whole suite
# through ctest (unit, in-process multi-rank, and multi-process integration tests), then fuzzes
# the parsers of untrusted input for a bounded time (SHARD_FUZZ_SECONDS per target, default 15;
# 0 skips it). Exits non-zero on any failure. Extra arguments go to ctest and skip the fuzzing,
# e.g. `scripts/test.sh -L unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
# Serially: the integration tests assert liveness deadlines and share a 2-core machine.
ctest --test-dir "${SHARD_BUILD_DIR:-build}" --output-on-failure --timeout 300 "$@"
if [ $# -eq 0 ] && [ "${SHARD_FUZZ_SECONDS:-15}" != 0 ]; then
  scripts/fuzz.sh --seconds "${SHARD_FUZZ_SECONDS:-15}"
fi
