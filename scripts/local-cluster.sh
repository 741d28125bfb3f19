#!/usr/bin/env bash
# The main job on the embedded default: a coordinator and N CPU workers on 127.0.0.1 (free
# ports), shown as they form a world, self-check their data path and agree on a plan for the
# demo MLP's parameters (widths 512,1024,1024,64), then stopped with shardctl. Everything it starts is stopped on exit, Ctrl-C included. Exits 0 only if the job
# succeeded: the world formed, every worker passed its self-check, and all exited cleanly.
#
#   scripts/local-cluster.sh [--workers N] [--lease DURATION] [--keep-logs]
set -euo pipefail
cd "$(dirname "$0")/.."

WORKERS=4
LEASE=5s
KEEP_LOGS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) WORKERS="$2"; shift 2 ;;
    --lease) LEASE="$2"; shift 2 ;;
    --keep-logs) KEEP_LOGS=1; shift ;;
    -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "local-cluster: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$WORKERS" =~ ^[1-9][0-9]*$ ]] || { echo "local-cluster: --workers must be a positive integer" >&2; exit 2; }

scripts/setup.sh
scripts/build.sh --target shard-coordinator shard-worker shardctl
BIN="$PWD/${SHARD_BUILD_DIR:-build}/bin"

RUN_DIR="$(mktemp -d -t shard-local-cluster.XXXXXX)"
PIDS=()
cleanup() {
  local status=$?
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  sleep 0.5
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  if [ "$KEEP_LOGS" = 1 ] || [ $status -ne 0 ]; then
    echo "logs kept in $RUN_DIR"
  else
    rm -rf "$RUN_DIR"
  fi
  exit $status
}
trap cleanup EXIT
trap 'echo; echo "interrupted: stopping everything"; exit 130' INT TERM

say() { printf '\n== %s\n' "$*"; }

say "starting shard-coordinator (world of $WORKERS workers, lease $LEASE) in $RUN_DIR"
"$BIN/shard-coordinator" --listen 127.0.0.1:0 --port-file "$RUN_DIR/port" \
  --world-size "$WORKERS" --lease "$LEASE" --state-dir "$RUN_DIR/state" \
  >"$RUN_DIR/coordinator.log" 2>&1 &
COORDINATOR_PID=$!
PIDS+=("$COORDINATOR_PID")
for _ in $(seq 100); do [ -s "$RUN_DIR/port" ] && break; sleep 0.1; done
[ -s "$RUN_DIR/port" ] || { echo "coordinator did not start:"; cat "$RUN_DIR/coordinator.log"; exit 1; }
ADDRESS="127.0.0.1:$(cat "$RUN_DIR/port")"
# Show the coordinator's events as they happen.
tail -n +1 -f --pid="$COORDINATOR_PID" "$RUN_DIR/coordinator.log" | sed -u 's/^/  [coordinator] /' &
PIDS+=("$!")
SHARDCTL=("$BIN/shardctl" --coordinator "$ADDRESS")

# The demo model's parameter manifest: the brief's MLP with widths 512,1024,1024,64.
cat >"$RUN_DIR/manifest.json" <<'JSON'
{"params": [
  {"name": "layers.0.weight", "shape": [1024, 512]}, {"name": "layers.0.bias", "shape": [1024]},
  {"name": "layers.1.weight", "shape": [1024, 1024]}, {"name": "layers.1.bias", "shape": [1024]},
  {"name": "layers.2.weight", "shape": [64, 1024]}, {"name": "layers.2.bias", "shape": [64]}]}
JSON

say "starting $WORKERS shard-worker processes"
WORKER_PIDS=()
for i in $(seq 0 $((WORKERS - 1))); do
  "$BIN/shard-worker" --coordinator "$ADDRESS" --id "worker-$i" \
    --manifest "$RUN_DIR/manifest.json" >"$RUN_DIR/worker-$i.log" 2>&1 &
  WORKER_PIDS+=("$!")
  PIDS+=("$!")
done

if ! "${SHARDCTL[@]}" wait --initialized --wait-timeout 60s; then
  say "the world did not form with every self-check passed and the plan applied"
  "${SHARDCTL[@]}" status || true
  for i in $(seq 0 $((WORKERS - 1))); do echo "--- worker-$i"; tail -5 "$RUN_DIR/worker-$i.log"; done
  exit 1
fi

say "world formed: every worker passed its data-path self-check"
"${SHARDCTL[@]}" status

say "the plan every worker computed and acknowledged (buckets rebuilt from rank 0's gradient order)"
"${SHARDCTL[@]}" plan
echo
"${SHARDCTL[@]}" stats

say "stopping the job with shardctl stop"
"${SHARDCTL[@]}" stop

FAILED=0
for i in "${!WORKER_PIDS[@]}"; do
  if wait "${WORKER_PIDS[$i]}"; then :; else
    echo "worker-$i exited with status $?"; FAILED=1
  fi
done
if wait "$COORDINATOR_PID"; then :; else
  echo "coordinator exited with status $?"; FAILED=1
fi
sleep 0.2

say "summary"
echo "workers: $WORKERS formed a world over Gloo TCP on 127.0.0.1 and passed the self-check"
grep -H "self-check passed" "$RUN_DIR"/worker-*.log \
  | sed 's|^.*/\(worker-[0-9]*\)\.log:.* self-check passed: |  \1: |' | sort -V
if [ $FAILED -ne 0 ]; then
  say "FAILED: a process did not exit cleanly"
  exit 1
fi
echo "result: success (coordinator and $WORKERS workers exited cleanly)"
