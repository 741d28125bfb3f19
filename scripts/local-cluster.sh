#!/usr/bin/env bash
# The main job on the embedded default: a coordinator and N CPU workers on 127.0.0.1 (free
# ports) train the demo MLP (widths 512,1024,1024,64) on generated data with sharded Adam
# (ZeRO stage 2), saving a sharded checkpoint every few steps. Halfway through, the operator
# saves a checkpoint with `shardctl checkpoint save` and stops the job; a new coordinator on
# the same state directory restores that checkpoint on a different number of workers
# (--restore latest, --world-size M) and training finishes exactly where it left off. The last
# checkpoint is verified and exported to one safetensors file. Everything it starts is stopped
# on exit, Ctrl-C included. Exits 0 only if every stage succeeded and every process exited
# cleanly.
#
#   scripts/local-cluster.sh [--workers N] [--restore-workers M] [--steps N] [--lease DURATION]
#                            [--keep-logs]
#
# --restore-workers defaults to N/2 (2 when N is 1).
set -euo pipefail
cd "$(dirname "$0")/.."

WORKERS=4
RESTORE_WORKERS=
STEPS=100
LEASE=5s
KEEP_LOGS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) WORKERS="$2"; shift 2 ;;
    --restore-workers) RESTORE_WORKERS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --lease) LEASE="$2"; shift 2 ;;
    --keep-logs) KEEP_LOGS=1; shift ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "local-cluster: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
positive() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || { echo "local-cluster: $1 must be a positive integer" >&2; exit 2; }; }
positive --workers "$WORKERS"
positive --steps "$STEPS"
[ -n "$RESTORE_WORKERS" ] || RESTORE_WORKERS=$(( WORKERS > 1 ? WORKERS / 2 : 2 ))
positive --restore-workers "$RESTORE_WORKERS"
[ "$STEPS" -ge 10 ] || { echo "local-cluster: --steps must be at least 10 (it stops and restores halfway)" >&2; exit 2; }

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
gcd() { local a=$1 b=$2; while [ "$b" -ne 0 ]; do set -- "$b" $((a % b)); a=$1; b=$2; done; echo "$a"; }

say "generating training data from a random teacher MLP"
"$BIN/shardctl" data generate --widths 512,1024,1024,64 --samples 16384 --seed 1 \
  --out "$RUN_DIR/data.safetensors"
# The global batch divides both world sizes, so the restored job reads the same samples per
# step as the first one would have.
GLOBAL_BATCH=$(( 64 * WORKERS * RESTORE_WORKERS / $(gcd "$WORKERS" "$RESTORE_WORKERS") ))
EVERY=$(( STEPS / 5 ))
cat >"$RUN_DIR/job-first.json" <<JSON
{
  "name": "demo",
  "worldSize": $WORKERS,
  "model": {"mlp": {"widths": [512, 1024, 1024, 64]}},
  "data": {"path": "data.safetensors"},
  "seed": 42,
  "optimizer": {"name": "adam", "lr": 0.001},
  "globalBatch": $GLOBAL_BATCH,
  "steps": $STEPS,
  "zeroStage": 2,
  "shardMode": "range",
  "bucketCapMb": 4,
  "checkpoint": {"everySteps": $EVERY, "keepLast": 3},
  "outputDir": "out"
}
JSON
echo "job spec ($RUN_DIR/job-first.json):"
sed 's/^/  /' "$RUN_DIR/job-first.json"

COORDINATOR_PID=
WORKER_PIDS=()
SHARDCTL=()
# start_job STAGE WORKERS [coordinator flags...]: a coordinator on a free port and WORKERS
# workers, their logs streamed with a prefix; returns once the world formed and self-checked.
start_job() {
  local stage=$1 workers=$2; shift 2
  rm -f "$RUN_DIR/port"
  : >"$RUN_DIR/coordinator-$stage.log"
  say "$stage: starting shard-coordinator $* (lease $LEASE)"
  "$BIN/shard-coordinator" --listen 127.0.0.1:0 --port-file "$RUN_DIR/port" \
    --job "$RUN_DIR/job-$stage.json" --lease "$LEASE" --state-dir "$RUN_DIR/state" "$@" \
    >"$RUN_DIR/coordinator-$stage.log" 2>&1 &
  COORDINATOR_PID=$!
  PIDS+=("$COORDINATOR_PID")
  for _ in $(seq 100); do [ -s "$RUN_DIR/port" ] && break; sleep 0.1; done
  [ -s "$RUN_DIR/port" ] || { echo "coordinator did not start:"; cat "$RUN_DIR/coordinator-$stage.log"; exit 1; }
  SHARDCTL=("$BIN/shardctl" --coordinator "127.0.0.1:$(cat "$RUN_DIR/port")")
  tail -n +1 -f --pid="$COORDINATOR_PID" "$RUN_DIR/coordinator-$stage.log" \
    | sed -u 's/^/  [coordinator] /' &
  PIDS+=("$!")

  say "$stage: starting $workers shard-worker processes"
  WORKER_PIDS=()
  for i in $(seq 0 $((workers - 1))); do
    : >"$RUN_DIR/worker-$i-$stage.log"
    "$BIN/shard-worker" --coordinator "127.0.0.1:$(cat "$RUN_DIR/port")" --id "worker-$i" \
      --compute-threads 1 >"$RUN_DIR/worker-$i-$stage.log" 2>&1 &
    WORKER_PIDS+=("$!")
    PIDS+=("$!")
    # Rank 0 logs the loss per step; show it, and every worker's checkpoint and restore lines.
    tail -n +1 -f --pid="$COORDINATOR_PID" "$RUN_DIR/worker-$i-$stage.log" \
      | grep --line-buffered -E " step [0-9]+/|training job|training finished:|restor|checkpoint| E " \
      | sed -u "s/^/  [worker-$i] /" &
    PIDS+=("$!")
  done
  if ! "${SHARDCTL[@]}" wait --wait-timeout 60s >/dev/null; then
    say "$stage: the world did not form with every self-check passed"
    "${SHARDCTL[@]}" status || true
    for i in $(seq 0 $((workers - 1))); do echo "--- worker-$i"; tail -5 "$RUN_DIR/worker-$i-$stage.log"; done
    exit 1
  fi
  say "$stage: world of $workers formed, every worker passed its data-path self-check"
  "${SHARDCTL[@]}" status || true
}

# wait_job STAGE: waits for every process of the stage; exits 1 unless all exited 0.
wait_job() {
  local failed=0
  for i in "${!WORKER_PIDS[@]}"; do
    if wait "${WORKER_PIDS[$i]}"; then :; else echo "worker-$i exited with status $?"; failed=1; fi
  done
  if wait "$COORDINATOR_PID"; then :; else echo "coordinator exited with status $?"; failed=1; fi
  sleep 0.2
  [ $failed -eq 0 ] || { say "$1 FAILED: a process did not exit cleanly"; exit 1; }
}

checkpoint_ids() { "${SHARDCTL[@]}" checkpoint list --json | grep -o '"id": "[^"]*"' | cut -d'"' -f4 || true; }
checkpoints_committed() { checkpoint_ids | grep -c . || true; }

start_job first "$WORKERS"
say "first: training with a checkpoint every $EVERY steps; waiting for two of them"
for _ in $(seq 600); do [ "$(checkpoints_committed)" -ge 2 ] && break; sleep 0.1; done
[ "$(checkpoints_committed)" -ge 2 ] || { echo "no two checkpoints committed within 60s"; exit 1; }
say "first: the operator saves a checkpoint now and stops the job"
"${SHARDCTL[@]}" checkpoint save --wait-timeout 60s
"${SHARDCTL[@]}" checkpoint list
RESUME_ID=$(checkpoint_ids | tail -1)
"${SHARDCTL[@]}" stop --reason "local-cluster: stop after a checkpoint, restore on $RESTORE_WORKERS workers"
wait_job first
echo "stopped; the latest committed checkpoint is $RESUME_ID"

say "the job spec of the restored run differs only in its world size: $RESTORE_WORKERS workers"
sed "s/\"worldSize\": $WORKERS,/\"worldSize\": $RESTORE_WORKERS,/" "$RUN_DIR/job-first.json" \
  >"$RUN_DIR/job-restored.json"
diff "$RUN_DIR/job-first.json" "$RUN_DIR/job-restored.json" | sed 's/^/  /' || true
start_job restored "$RESTORE_WORKERS" --restore latest
say "restored: training on $RESTORE_WORKERS workers from $RESUME_ID to step $STEPS"
wait_job restored
# A checkpoint is committed once its manifest exists; ids sort by step.
LAST_ID=$(ls -d "$RUN_DIR"/out/checkpoints/demo/step-*/manifest.json 2>/dev/null | sort | tail -1 \
  | xargs -r dirname | xargs -r basename)
[ -n "$LAST_ID" ] || { echo "no committed checkpoint in $RUN_DIR/out/checkpoints/demo"; exit 1; }

say "verifying and exporting the last checkpoint (no coordinator needed)"
"$BIN/shardctl" checkpoint verify --path "$RUN_DIR/out/checkpoints/demo/$LAST_ID"
"$BIN/shardctl" checkpoint export --path "$RUN_DIR/out/checkpoints/demo/$LAST_ID" \
  --out "$RUN_DIR/out/exported.safetensors"

say "summary"
echo "first run on $WORKERS workers, last step logged before the stop:" \
  "$(grep -h " step [0-9]*/$STEPS loss" "$RUN_DIR"/worker-*-first.log | tail -1 | sed -E 's/^.* (step [0-9]+\/[0-9]+ loss [0-9.]+).*$/\1/')"
grep -h "training finished" "$RUN_DIR"/worker-*-restored.log | grep "parameters written" \
  | sed 's/^.* training finished: /restored run: /' || { echo "no training summary"; exit 1; }
echo "checkpoint saved on $WORKERS workers and restored on $RESTORE_WORKERS: $RESUME_ID"
echo "last checkpoint $LAST_ID verified and exported:" \
  "$(stat -c %s "$RUN_DIR/out/exported.safetensors") bytes of safetensors"
[ -f "$RUN_DIR/out/final.safetensors" ] || { echo "no consolidated parameters were written"; exit 1; }
echo "consolidated parameters: $(stat -c %s "$RUN_DIR/out/final.safetensors") bytes (kept with --keep-logs)"
echo "result: success (every stage finished and every process exited cleanly)"
