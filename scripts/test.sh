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
build_dir="${SHARD_BUILD_DIR:-build}"

# A CI log keeps only its head and tail, so after a failure the last lines name what failed:
# pytest's and gtest's failure lines from each failed test's output, or its last lines.
print_failure_digest() {
  local log="$build_dir/Testing/Temporary/LastTest.log"
  echo "== what failed (from $log) =="
  while IFS=: read -r _ name; do
    awk -v name="$name" '
      /^[0-9]+\/[0-9]+ Testing: / && substr($0, index($0, "Testing: ") + 9) == name {
        inside = 1; next
      }
      inside && /^<end of output>$/ { exit }
      inside { print }' "$log" >"$build_dir/failed-output.txt"
    echo "-- $name"
    local failure_lines
    failure_lines=$(grep -E '^(FAILED|ERROR) |\[  FAILED  \]|^E  +' "$build_dir/failed-output.txt" || true)
    if [ -n "$failure_lines" ]; then
      tail -n 12 <<<"$failure_lines"
    else
      tail -n 8 "$build_dir/failed-output.txt"
    fi
  done <"$build_dir/Testing/Temporary/LastTestsFailed.log"
}

# Serially: the integration tests assert liveness deadlines and share a 2-core machine.
if ! ctest --test-dir "$build_dir" --output-on-failure --timeout 300 "$@"; then
  print_failure_digest
  exit 8
fi
if [ $# -eq 0 ] && [ "${SHARD_FUZZ_SECONDS:-15}" != 0 ]; then
  scripts/fuzz.sh --seconds "${SHARD_FUZZ_SECONDS:-15}"
fi
