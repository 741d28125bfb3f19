#!/usr/bin/env bash
# Builds shard-bench-collectives and reports all-reduce / reduce-scatter / all-gather bus
# bandwidth through our shared-memory communicator (shm) and our TCP rings (tcp) beside raw Gloo,
# one thread's memcpy and loopback TCP, for 2 and 4 ranks (nccl-tests columns; the header names
# the CPU). Extra arguments go to every run, e.g.:
#   scripts/bench-collectives.sh --iters 10 --segment-bytes 4MiB --collectives all_reduce
#   scripts/bench-collectives.sh --impls shm,tcp --shm-slot-bytes 4MiB
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
scripts/build.sh --target shard-bench-collectives

status=0
for ranks in 2 4; do
  "${SHARD_BUILD_DIR:-build}/bin/shard-bench-collectives" --ranks "${ranks}" "$@" || status=1
  echo
done
exit "${status}"
