#!/usr/bin/env bash
# Builds shard-bench-collectives and reports all-reduce / reduce-scatter / all-gather bus
# bandwidth through our shared-memory communicator (shm: on buffers the peers read in place, as
# the engine's buckets; shm-copy: on private ones, through its slots) and our TCP rings (tcp)
# beside raw Gloo, one thread's memcpy, every rank's memcpy at once and loopback TCP, for 2 and 4
# ranks (nccl-tests columns; the Machine line names the CPU). Extra arguments go to every run,
# e.g.:
#   scripts/bench-collectives.sh --iters 10 --segment-bytes 4MiB --collectives all_reduce
#   scripts/bench-collectives.sh --impls shm,tcp --shm-slot-bytes 4MiB
#   scripts/bench-collectives.sh --in-place --min-bytes 64MiB   # as the engine runs them
# `--json-dir DIR` (first) writes each run's records to DIR/collectives-<ranks>-ranks.json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
json_dir=
if [ "${1:-}" = --json-dir ]; then
  json_dir=${2:?--json-dir needs a directory}
  shift 2
  mkdir -p "$json_dir"
fi
scripts/setup.sh
scripts/build.sh --target shard-bench-collectives

status=0
for ranks in 2 4; do
  json=()
  [ -z "$json_dir" ] || json=(--json "$json_dir/collectives-${ranks}-ranks.json")
  "${SHARD_BUILD_DIR:-build}/bin/shard-bench-collectives" --ranks "${ranks}" "${json[@]}" "$@" \
    || status=1
  echo
done
exit "${status}"
