#!/usr/bin/env bash
# The main job on the embedded default: a coordinator and N CPU workers on 127.0.0.1 (free
# ports) train the demo MLP (widths 512,1024,1024,64) on generated data with sharded Adam
# (ZeRO stage 2): they form a world, self-check their data path, agree on a plan, and train
# while rank 0 shows the loss per step and the overlap; the coordinator finishes the job when
# every rank is done and rank 0 has written the consolidated parameters. Everything it starts
# is stopped on exit, Ctrl-C included. Exits 0 only if the job succeeded and every process
# exited cleanly.
#
#   scripts/local-cluster.sh [--workers N] [--steps N] [--lease DURATION] [--keep-logs]
set -euo pipefail
cd "$(dirname "$0")/.."

WORKERS=4
STEPS=100
LEASE=5s
KEEP_LOGS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) WORKERS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --lease) LEASE="$2"; shift 2 ;;
    --keep-logs) KEEP_LOGS=1; shift ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "local-cluster: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$WORKERS" =~ ^[1-9][0-9]*$ ]] || { echo "local-cluster: --workers must be a positive integer" >&2; exit 2; }
[[ "$STEPS" =~ ^[1-9][0-9]*$ ]] || { echo "local-cluster: --steps must be a positive integer" >&2; exit 2; }

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

say "generating training data from a random teacher MLP"
"$BIN/shardctl" data generate --widths 512,1024,1024,64 --samples 16384 --seed 1 \
  --out "$RUN_DIR/data.safetensors"
cat >"$RUN_DIR/job.json" <<JSON
{
  "name": "demo",
  "worldSize": $WORKERS,
  "model": {"mlp": {"widths": [512, 1024, 1024, 64]}},
  "data": {"path": "data.safetensors"},
  "seed": 42,
  "optimizer": {"name": "adam", "lr": 0.001},
  "globalBatch": $((WORKERS * 64)),
  "steps": $STEPS,
  "zeroStage": 2,
  "shardMode": "range",
  "bucketCapMb": 4,
  "outputDir": "out"
}
JSON
echo "job spec ($RUN_DIR/job.json):"
sed 's/^/  /' "$RUN_DIR/job.json"

say "starting shard-coordinator (world of $WORKERS workers, lease $LEASE) in $RUN_DIR"
"$BIN/shard-coordinator" --listen 127.0.0.1:0 --port-file "$RUN_DIR/port" \
  --job "$RUN_DIR/job.json" --lease "$LEASE" --state-dir "$RUN_DIR/state" \
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

say "starting $WORKERS shard-worker processes"
WORKER_PIDS=()
for i in $(seq 0 $((WORKERS - 1))); do
  "$BIN/shard-worker" --coordinator "$ADDRESS" --id "worker-$i" --compute-threads 1 \
    >"$RUN_DIR/worker-$i.log" 2>&1 &
  WORKER_PIDS+=("$!")
  PIDS+=("$!")
done
# Rank 0 logs the loss per step; show it as it trains.
for i in $(seq 0 $((WORKERS - 1))); do
  tail -n +1 -f --pid="$COORDINATOR_PID" "$RUN_DIR/worker-$i.log" \
    | grep --line-buffered -E " step [0-9]+/|training job|training finished:| E " \
    | sed -u "s/^/  [worker-$i] /" &
  PIDS+=("$!")
done

if ! "${SHARDCTL[@]}" wait --wait-timeout 60s >/dev/null; then
  say "the world did not form with every self-check passed"
  "${SHARDCTL[@]}" status || true
  for i in $(seq 0 $((WORKERS - 1))); do echo "--- worker-$i"; tail -5 "$RUN_DIR/worker-$i.log"; done
  exit 1
fi
say "world formed: every worker passed its data-path self-check and is training"
"${SHARDCTL[@]}" status || true

say "training (the coordinator finishes the job when every rank is done)"
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
grep -h "overlap status INITIALIZED" "$RUN_DIR/coordinator.log" | sed 's/^.* coordinator /plan: /' || true
grep -h "training finished" "$RUN_DIR"/worker-*.log | grep "parameters written" \
  | sed 's/^.* training finished: /training: /' || { echo "no training summary"; FAILED=1; }
grep -H "optimizer state" "$RUN_DIR"/worker-*.log \
  | sed -E 's|^.*/(worker-[0-9]+)\.log:.* optimizer state ([0-9]+) bytes.*|  \1 optimizer state: \2 bytes|' | sort -V
if [ -f "$RUN_DIR/out/final.safetensors" ]; then
  echo "consolidated parameters: $(stat -c %s "$RUN_DIR/out/final.safetensors") bytes of safetensors" \
    "(kept with --keep-logs)"
else
  echo "no consolidated parameters were written"; FAILED=1
fi
if [ $FAILED -ne 0 ]; then
  say "FAILED: a process did not exit cleanly"
  exit 1
fi
echo "result: success (coordinator and $WORKERS workers exited cleanly)"
