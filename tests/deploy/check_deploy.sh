#!/usr/bin/env bash
# Validates the deployment files in deploy/ offline (no Docker engine, no cluster) against the
# binaries built in BIN_DIR: YAML/JSON parse, kustomize render (when kubectl exists), flags and
# SHARD_* environment variables that the binaries really have, probes on the health port, worker
# counts and shared volumes. See check_deploy.py for the full list.
#
#   tests/deploy/check_deploy.sh BIN_DIR      (ctest passes build/bin)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
[ $# -ge 1 ] || { echo "usage: $0 BIN_DIR" >&2; exit 2; }
command -v python3 >/dev/null || { echo "check_deploy: python3 is required" >&2; exit 1; }
exec python3 "$here/check_deploy.py" "$1" "$here/../.."
