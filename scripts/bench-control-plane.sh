#!/usr/bin/env bash
# Builds shard-bench-control-plane and shard-coordinator and measures the coordinator's control
# plane at scale against the product's targets: N simulated workers (default 1000; one client
# process, gRPC callback API) join one real coordinator (started on 127.0.0.1 on a free port,
# its state on a real disk under /var/tmp, stopped by pid at the end), long-poll their heartbeats
# as shard-worker does, and one of them dies: join-to-world-formed, the coordinator's CPU while
# forming, the generation formed at, the journal's size, heartbeat CPU at a 10 s lease, and the
# re-formation after the death. Exits non-zero if a check fails (errors, generations, world
# sizes). A run takes about 40 s; SHARD_BENCH_TIMEOUT (seconds, default 300) bounds it, after
# which the benchmark is sent SIGTERM and kills its coordinator. Extra arguments go to the binary
# (e.g. --workers 10000 --seconds 10 --dir /var/tmp --modes paced,saturate --json); the results
# at 1,000 and 10,000 workers are in docs/control-plane.md ("Control plane at scale").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh >/dev/null
scripts/build.sh --target shard-bench-control-plane shard-coordinator >/dev/null
# Each channel is one connection, but --channels may ask for thousands: take the hard limit.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
exec timeout --kill-after=20s "${SHARD_BENCH_TIMEOUT:-300}" \
  "${SHARD_BUILD_DIR:-build}/bin/shard-bench-control-plane" "$@"
