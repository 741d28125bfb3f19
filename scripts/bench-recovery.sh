#!/usr/bin/env bash
# Builds shard-bench-recovery and the binaries it runs, and measures how long losing one of 4 CPU
# workers stops the medium-MLP job: detect, abort, re-form and resume (restore included), beside
# the lease and a cold start of the same job. Extra arguments go to the binary (e.g. --signal
# stop --trials 5 --lease 2s); see docs/elasticity.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh >/dev/null
scripts/build.sh --target shard-bench-recovery >/dev/null
exec "${SHARD_BUILD_DIR:-build}/bin/shard-bench-recovery" "$@"
