#!/usr/bin/env bash
# Measures recovery from memory against recovery from disk, and what snapshots cost:
#  1. shard-bench-recovery: one of 4 CPU workers lost while training the medium MLP (about
#     20 MB of job state), the new world restoring from peers' snapshots and, in the same run,
#     from the latest disk checkpoint: detect, abort, re-form, training again, the restore and
#     the steps lost, beside the lease and a cold start. Extra arguments go to it (e.g.
#     --signal stop --trials 5, or --widths 4096,8192,8192,64 --samples 2048 for about 1.2 GB).
#  2. unless SHARD_BENCH_OVERHEAD=0: the per-step cost of snapshots (scripts/bench-train.sh on
#     4 workers, ZeRO-2): off, every 10 and every step, without and with one replica.
# See docs/recovery.md ("Benchmark").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh >/dev/null
scripts/build.sh --target shard-bench-recovery >/dev/null
"${SHARD_BUILD_DIR:-build}/bin/shard-bench-recovery" "$@"
if [ "${SHARD_BENCH_OVERHEAD:-1}" != 0 ]; then
  echo
  echo "# the cost of in-memory snapshots (snapshot = every:replicas, 0 = off)"
  scripts/bench-train.sh --workers 4 --stages 2 --overlap true --steps 200 \
    --snapshot-every "0 10:0 10:1 1:0 1:1"
fi
