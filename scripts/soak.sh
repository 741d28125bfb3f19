#!/usr/bin/env bash
# A process-level soak of the real binaries: builds shard-coordinator, shard-worker and shardctl,
# then runs scripts/soak.py, which trains a small job on 4 CPU workers while it SIGKILLs and
# SIGSTOPs workers (replaced at once or late, same id or new), SIGKILLs and restarts the
# coordinator, resizes and drains, and (--partitions N, as root, on test hosts made of network
# namespaces: docs/faults.md) partitions the network, (--disk-faults N, as root) fills the
# checkpoint disk, at random moments chosen from --seed. It
# passes only with no hang, the job finished, every kept checkpoint verified and the final
# parameters bitwise equal to a reference run; it prints a table of faults survived and time
# lost per fault.
#
#   scripts/soak.sh [--seed S] [--kills 20] [--coordinator-kills 3] [--stops N] [--resizes 2]
#                   [--drains 2] [--partitions N] [--disk-faults N] [--workers 4] [--steps N]
#                   [--duration SECONDS] [--lease 1s] [--grace 1s] [--every 5] [--keep]
#                   [--build-dir DIR] [--no-build]
#
# `scripts/soak.sh --help` lists every flag; docs/elasticity.md ("Soak") explains the report.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=1
ARGS=()
BUILD_DIR="${SHARD_BUILD_DIR:-build}"
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) BUILD=0; shift ;;
    --build-dir) BUILD_DIR="$2"; ARGS+=("$1" "$2"); shift 2 ;;
    --build-dir=*) BUILD_DIR="${1#*=}"; ARGS+=("$1"); shift ;;
    -h|--help) exec /usr/bin/python3 scripts/soak.py --help ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if [ "$BUILD" = 1 ]; then
  scripts/setup.sh >/dev/null
  SHARD_BUILD_DIR="$BUILD_DIR" scripts/build.sh --target shard-coordinator shard-worker shardctl >/dev/null
fi
exec /usr/bin/python3 scripts/soak.py --build-dir "$BUILD_DIR" "${ARGS[@]}"
