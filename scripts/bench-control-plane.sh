#!/usr/bin/env bash
# Builds shard-bench-control-plane and shard-coordinator and measures the coordinator's control
# plane at scale: 1000 simulated workers (one client process, gRPC callback API) join one real
# coordinator (started on 127.0.0.1 on a free port, stopped by pid at the end) and heartbeat
# against it: join-to-world-formed time, heartbeats/s, latencies, coordinator CPU. A default run
# takes about a minute; SHARD_BENCH_TIMEOUT (seconds, default 300) bounds it, after which the
# benchmark is sent SIGTERM and kills its coordinator. Extra arguments go to the binary (e.g.
# --workers 2000 --lease 2s --seconds 20 --dir /var/tmp --json); see docs/control-plane.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh >/dev/null
scripts/build.sh --target shard-bench-control-plane shard-coordinator >/dev/null
exec timeout --kill-after=20s "${SHARD_BENCH_TIMEOUT:-300}" \
  "${SHARD_BUILD_DIR:-build}/bin/shard-bench-control-plane" "$@"
