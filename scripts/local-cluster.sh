#!/usr/bin/env bash
# The main job on the embedded default: a coordinator and N CPU workers on 127.0.0.1 (free
# ports) train the demo MLP (widths 512,1024,1024,64) on generated data with sharded Adam
# (ZeRO stage 2), taking an in-memory snapshot every 10 steps (each rank's copied to a buddy
# rank) and saving a sharded checkpoint every few dozen. Then, while it trains:
#   1. one worker is killed (SIGKILL): the survivors abort their collectives at once, the
#      coordinator declares it dead after the lease, waits --grace for a replacement, re-forms
#      the world with N-1 workers and they restore the newest snapshot from memory (the dead
#      rank's ranges from its buddy's replica), not from disk, and go on;
#   2. a replacement worker joins as a standby and is folded in at the next pause (a snapshot at
#      a step boundary), reading all of its ranges from its peers (N);
#   3. the operator shrinks the live job with `shardctl resize --world-size N/2`: a snapshot at
#      the next step boundary, the rest restore it from memory (the workers resized out serve
#      their ranges until then, and leave);
#   4. the operator saves a checkpoint with `shardctl checkpoint save` and stops the job; a new
#      coordinator on the same state directory restores it on M workers (--restore latest).
# Training finishes exactly where it left off; the last checkpoint is verified and exported to
# one safetensors file. Everything it starts is stopped on exit, Ctrl-C included. Exits 0 only
# if every stage succeeded and every process it did not kill exited cleanly.
#
#   scripts/local-cluster.sh [--workers N] [--restore-workers M] [--steps N] [--lease DURATION]
#                            [--grace DURATION] [--torch SCRIPT] [--keep-logs]
#
# --workers is at least 3 (default 4); --restore-workers defaults to N-1. --torch runs the same
# story with PyTorch workers: the launcher, `python3 -m shard.run --coordinator ...
# --nproc-per-node N --max-restarts 1`, starts `python3 SCRIPT --data DATA` per rank (e.g.
# examples/torch/mlp.py, the same MLP in torch) with the shard package of the build, the job's
# model being external. There the killed worker's replacement is the launcher's restart of it,
# under a new id, at once: it waits as a standby while the dead worker's lease runs out (or,
# arriving later, takes the free rank or is folded in), so the world is whole again without the
# separate grow stage.
set -euo pipefail
cd "$(dirname "$0")/.."

WORKERS=4
RESTORE_WORKERS=
STEPS=600
LEASE=2s
GRACE=2s
KEEP_LOGS=0
TORCH_SCRIPT=
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) WORKERS="$2"; shift 2 ;;
    --restore-workers) RESTORE_WORKERS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --lease) LEASE="$2"; shift 2 ;;
    --grace) GRACE="$2"; shift 2 ;;
    --torch) TORCH_SCRIPT="$2"; shift 2 ;;
    --keep-logs) KEEP_LOGS=1; shift ;;
    -h|--help) sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "local-cluster: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
positive() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || { echo "local-cluster: $1 must be a positive integer" >&2; exit 2; }; }
positive --workers "$WORKERS"
positive --steps "$STEPS"
[ "$WORKERS" -ge 3 ] || { echo "local-cluster: --workers must be at least 3 (it kills one and halves the job)" >&2; exit 2; }
[ -n "$RESTORE_WORKERS" ] || RESTORE_WORKERS=$(( WORKERS - 1 ))
positive --restore-workers "$RESTORE_WORKERS"
[ "$STEPS" -ge 200 ] || { echo "local-cluster: --steps must be at least 200 (the stages run while it trains)" >&2; exit 2; }
RESIZED=$(( WORKERS / 2 ))

scripts/setup.sh
scripts/build.sh --target shard-coordinator shard-worker shardctl
BIN="$PWD/${SHARD_BUILD_DIR:-build}/bin"
MODEL='{"mlp": {"widths": [512, 1024, 1024, 64]}}'
if [ -n "$TORCH_SCRIPT" ]; then
  [ -f "$TORCH_SCRIPT" ] || { echo "local-cluster: --torch $TORCH_SCRIPT: no such file" >&2; exit 2; }
  TORCH_SCRIPT=$(realpath "$TORCH_SCRIPT")
  scripts/build.sh --target shard_python
  PYTHON_PATH="$PWD/${SHARD_BUILD_DIR:-build}/python"
  MODEL='{"external": {}}'
fi

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
lcm() { local l=1 n; for n in "$@"; do l=$(( l * n / $(gcd "$l" "$n") )); done; echo "$l"; }

say "generating training data from a random teacher MLP"
"$BIN/shardctl" data generate --widths 512,1024,1024,64 --samples 16384 --seed 1 \
  --out "$RUN_DIR/data.safetensors"
# The global batch divides every world size the job goes through, so each step reads the same
# samples whoever trains it.
GLOBAL_BATCH=$(( 32 * $(lcm "$WORKERS" $((WORKERS - 1)) "$RESIZED" "$RESTORE_WORKERS") ))
EVERY=$(( STEPS / 20 ))
MIN_WORKERS=$RESIZED
cat >"$RUN_DIR/job-first.json" <<JSON
{
  "name": "demo",
  "worldSize": $WORKERS,
  "minWorldSize": $MIN_WORKERS,
  "model": $MODEL,
  "data": {"path": "data.safetensors"},
  "seed": 42,
  "optimizer": {"name": "adam", "lr": 0.001},
  "globalBatch": $GLOBAL_BATCH,
  "steps": $STEPS,
  "zeroStage": 2,
  "shardMode": "range",
  "bucketCapMb": 4,
  "checkpoint": {"everySteps": $EVERY, "keepLast": 3},
  "snapshot": {"everySteps": 10, "replicas": 1},
  "outputDir": "out"
}
JSON
echo "job spec ($RUN_DIR/job-first.json):"
sed 's/^/  /' "$RUN_DIR/job-first.json"

COORDINATOR_PID=
# The lines of a worker's log that are shown: the loss per step, training, checkpoints, restores.
WORKER_LINES=" step [0-9]+/|training job|training finished:|training paused|restor|checkpoint|ended|told to| E "
WORKER_PIDS=()
WORKER_NAMES=()
SHARDCTL=()
# start_worker NAME STAGE: one shard-worker; its loss, checkpoint and restore lines are shown.
start_worker() {
  local name=$1 stage=$2
  : >"$RUN_DIR/$name-$stage.log"
  "$BIN/shard-worker" --coordinator "127.0.0.1:$(cat "$RUN_DIR/port")" --id "$name" \
    --compute-threads 1 >"$RUN_DIR/$name-$stage.log" 2>&1 &
  WORKER_PIDS+=("$!")
  WORKER_NAMES+=("$name")
  PIDS+=("$!")
  # Rank 0 logs the loss per step; show it, and every worker's checkpoint and restore lines.
  tail -n +1 -f --pid="$COORDINATOR_PID" "$RUN_DIR/$name-$stage.log" \
    | grep --line-buffered -E "$WORKER_LINES" \
    | sed -u "s/^/  [$name] /" &
  PIDS+=("$!")
}

# start_launcher STAGE WORKERS: the torch workers, through the launcher (python3 -m shard.run):
# WORKERS ranks with ids worker-<i>, restarted once under a new id if one dies; its log
# directory ($RUN_DIR/ranks-STAGE) has a log per rank process and processes.json (their pids).
# The launcher's own lines and the ranks' loss, checkpoint and restore lines are shown.
start_launcher() {
  local stage=$1 workers=$2
  LAUNCH_DIR="$RUN_DIR/ranks-$stage"
  say "$stage: starting $workers torch worker processes with python3 -m shard.run"
  OMP_NUM_THREADS=1 PYTHONPATH="$PYTHON_PATH${PYTHONPATH:+:$PYTHONPATH}" \
    /usr/bin/python3 -m shard.run --coordinator "127.0.0.1:$(cat "$RUN_DIR/port")" \
    --nproc-per-node "$workers" --max-restarts 1 --device cpu --id-prefix worker \
    --log-dir "$LAUNCH_DIR" "$TORCH_SCRIPT" --data "$RUN_DIR/data.safetensors" \
    > >(grep --line-buffered -E "^\[shard.run\]|$WORKER_LINES" | sed -u 's/^/  /') 2>&1 &
  WORKER_PIDS+=("$!")
  WORKER_NAMES+=("the launcher (shard.run)")
  PIDS+=("$!")
}

# rank_process LOCAL_RANK: "PID WORKER_ID" of the launcher's current process for that rank.
rank_process() {
  /usr/bin/python3 -c 'import json, sys
rank = json.load(open(sys.argv[1]))["ranks"][int(sys.argv[2])]
print(rank["pid"], rank["worker_id"])' "$LAUNCH_DIR/processes.json" "$1"
}

# worker_logs STAGE: the log files of the stage's worker processes.
worker_logs() {
  if [ -n "$TORCH_SCRIPT" ]; then
    ls "$RUN_DIR/ranks-$1"/*.log
  else
    ls "$RUN_DIR"/worker-*-"$1".log
  fi
}

# start_job STAGE WORKERS [coordinator flags...]: a coordinator on a free port and WORKERS
# workers, their logs streamed with a prefix; returns once the world formed and self-checked.
start_job() {
  local stage=$1 workers=$2; shift 2
  rm -f "$RUN_DIR/port"
  : >"$RUN_DIR/coordinator-$stage.log"
  say "$stage: starting shard-coordinator $* (lease $LEASE, reform grace $GRACE)"
  "$BIN/shard-coordinator" --listen 127.0.0.1:0 --port-file "$RUN_DIR/port" \
    --job "$RUN_DIR/job-$stage.json" --lease "$LEASE" --reform-grace "$GRACE" \
    --state-dir "$RUN_DIR/state" "$@" >"$RUN_DIR/coordinator-$stage.log" 2>&1 &
  COORDINATOR_PID=$!
  PIDS+=("$COORDINATOR_PID")
  for _ in $(seq 100); do [ -s "$RUN_DIR/port" ] && break; sleep 0.1; done
  [ -s "$RUN_DIR/port" ] || { echo "coordinator did not start:"; cat "$RUN_DIR/coordinator-$stage.log"; exit 1; }
  SHARDCTL=("$BIN/shardctl" --coordinator "127.0.0.1:$(cat "$RUN_DIR/port")")
  tail -n +1 -f --pid="$COORDINATOR_PID" "$RUN_DIR/coordinator-$stage.log" \
    | sed -u 's/^/  [coordinator] /' &
  PIDS+=("$!")

  WORKER_PIDS=()
  WORKER_NAMES=()
  if [ -n "$TORCH_SCRIPT" ]; then
    start_launcher "$stage" "$workers"
  else
    say "$stage: starting $workers worker processes"
    for i in $(seq 0 $((workers - 1))); do start_worker "worker-$i" "$stage"; done
  fi
  if ! "${SHARDCTL[@]}" wait --wait-timeout 60s >/dev/null; then
    say "$stage: the world did not form with every self-check passed"
    "${SHARDCTL[@]}" status || true
    if [ -n "$TORCH_SCRIPT" ]; then
      for log in $(worker_logs "$stage"); do echo "--- $log"; tail -5 "$log"; done
    else
      for name in "${WORKER_NAMES[@]}"; do echo "--- $name"; tail -5 "$RUN_DIR/$name-$stage.log"; done
    fi
    exit 1
  fi
  say "$stage: world of $workers formed, every worker passed its data-path self-check"
  "${SHARDCTL[@]}" status || true
}

# wait_job STAGE: waits for every worker still listed and the coordinator; exits 1 unless all
# exited 0.
wait_job() {
  local failed=0
  for i in "${!WORKER_PIDS[@]}"; do
    if wait "${WORKER_PIDS[$i]}"; then :; else echo "${WORKER_NAMES[$i]} exited with status $?"; failed=1; fi
  done
  if wait "$COORDINATOR_PID"; then :; else echo "coordinator exited with status $?"; failed=1; fi
  sleep 0.2
  [ $failed -eq 0 ] || { say "$1 FAILED: a process did not exit cleanly"; exit 1; }
}

checkpoint_ids() { "${SHARDCTL[@]}" checkpoint list --json | grep -o '"id": "[^"]*"' | cut -d'"' -f4 || true; }
checkpoints_committed() { checkpoint_ids | grep -c . || true; }
# status_field NAME: a top-level field of `shardctl status --json`.
status_field() {
  "${SHARDCTL[@]}" status --json 2>/dev/null | grep -o "\"$1\": *\"\{0,1\}[^,\"}]*" | head -1 \
    | sed 's/^.*: *"\{0,1\}//'
}
# wait_world RANKS: until the world runs with RANKS ranks (a transition towards the job's
# world size may still be pending).
wait_world() {
  for _ in $(seq 600); do
    if [ "$(status_field ranks)" = "$1" ] && [ "$(status_field world_size)" = "$1" ] \
       && [ "$(status_field state)" = running ]; then
      return 0
    fi
    sleep 0.1
  done
  echo "the world did not settle at $1 ranks within 60s"; "${SHARDCTL[@]}" status || true
  for i in "${!WORKER_PIDS[@]}"; do
    kill -0 "${WORKER_PIDS[$i]}" 2>/dev/null || { wait "${WORKER_PIDS[$i]}"; echo "${WORKER_NAMES[$i]} exited with status $?"; }
  done
  exit 1
}
# holds_rank WORKER: whether WORKER holds a rank (a replacement that took one).
holds_rank() {
  "${SHARDCTL[@]}" workers --json 2>/dev/null | /usr/bin/python3 -c 'import json, sys
workers = json.load(sys.stdin)
sys.exit(0 if any(w["id"] == sys.argv[1] and w["rank"] >= 0 for w in workers) else 1)' "$1" 2>/dev/null
}
# log_time TEXT FILE...: when the latest line containing TEXT in the FILEs was written (ms since
# the epoch; empty if none).
log_time() {
  local text=$1 stamp; shift
  stamp=$(grep -h -- "$text" "$@" | cut -c1-23 | sort | tail -1)
  [ -z "$stamp" ] || date -d "${stamp/T/ }" +%s%3N
}
now_ms() { date +%s%3N; }
# wait_resumed LOG...: sets RESUMED_AT, when training first ran a step again after KILLED_AT.
wait_resumed() {
  for _ in $(seq 300); do
    RESUMED_AT=$(log_time "first step of this run done" "$@")
    [ -n "$RESUMED_AT" ] && [ "$RESUMED_AT" -ge "$KILLED_AT" ] && return 0
    sleep 0.1
  done
  echo "training did not resume within 30s"
  exit 1
}
# train_a_while: until the job commits one more checkpoint (the current world trained).
train_a_while() {
  local before; before=$(checkpoint_ids | tail -1)
  for _ in $(seq 600); do [ "$(checkpoint_ids | tail -1)" != "$before" ] && return 0; sleep 0.1; done
  echo "no new checkpoint within 60s"; exit 1
}

start_job first "$WORKERS"
say "first: training with a snapshot in memory every 10 steps and a checkpoint every $EVERY; waiting for two checkpoints"
for _ in $(seq 600); do [ "$(checkpoints_committed)" -ge 2 ] && break; sleep 0.1; done
[ "$(checkpoints_committed)" -ge 2 ] || { echo "no two checkpoints committed within 60s"; exit 1; }

VICTIM=$(( WORKERS - 1 ))
if [ -n "$TORCH_SCRIPT" ]; then
  read -r VICTIM_PID VICTIM_NAME < <(rank_process "$VICTIM")
  REPLACEMENT="$VICTIM_NAME-r1"
  say "chaos: SIGKILL $VICTIM_NAME (pid $VICTIM_PID) in the middle of training (job minWorldSize" \
    "$MIN_WORKERS); shard.run restarts it at once as $REPLACEMENT, which joins as a standby"
  GENERATION_BEFORE=$(status_field generation)
  KILLED_AT=$(now_ms)
  kill -KILL "$VICTIM_PID"
  for _ in $(seq 600); do holds_rank "$REPLACEMENT" && break; sleep 0.1; done
  holds_rank "$REPLACEMENT" || { echo "$REPLACEMENT did not take a rank within 60s"; "${SHARDCTL[@]}" status || true; exit 1; }
  wait_world "$WORKERS"
  wait_resumed $(worker_logs first)
  DEAD_AT=$(log_time "declared dead" "$RUN_DIR/coordinator-first.log")
  JOINED_AT=$(log_time "worker $REPLACEMENT joined" "$RUN_DIR/coordinator-first.log")
  say "chaos: recovered from generation $GENERATION_BEFORE to $(status_field generation) on $WORKERS workers:" \
    "$REPLACEMENT joined after $(( JOINED_AT - KILLED_AT )) ms, $VICTIM_NAME declared dead after" \
    "$(( DEAD_AT - KILLED_AT )) ms (lease $LEASE), training again after $(( RESUMED_AT - KILLED_AT )) ms"
  # How the replacement got its rank: as a standby (joined before the lease ran out), the free
  # rank (joined within the grace) or folded in after a re-formation without it.
  grep -hE "worker $REPLACEMENT joined|standby $REPLACEMENT|re-forming with|folded in" \
    "$RUN_DIR/coordinator-first.log" | sed 's/^/  /' || true
else
  say "chaos: SIGKILL ${WORKER_NAMES[$VICTIM]} in the middle of training (job minWorldSize $MIN_WORKERS)"
  GENERATION_BEFORE=$(status_field generation)
  KILLED_AT=$(now_ms)
  kill -KILL "${WORKER_PIDS[$VICTIM]}"
  wait "${WORKER_PIDS[$VICTIM]}" 2>/dev/null || true
  unset "WORKER_PIDS[$VICTIM]" "WORKER_NAMES[$VICTIM]"
  wait_world $(( WORKERS - 1 ))
  wait_resumed "$RUN_DIR"/worker-*-first.log
  DEAD_AT=$(log_time "declared dead" "$RUN_DIR/coordinator-first.log")
  REFORMED_AT=$(log_time "re-forming with" "$RUN_DIR/coordinator-first.log")
  say "chaos: recovered from generation $GENERATION_BEFORE to $(status_field generation) on $(( WORKERS - 1 )) workers:" \
    "declared dead after $(( DEAD_AT - KILLED_AT )) ms (lease $LEASE), re-formed after" \
    "$(( REFORMED_AT - KILLED_AT )) ms (grace $GRACE), training again after $(( RESUMED_AT - KILLED_AT )) ms"
fi
"${SHARDCTL[@]}" status || true
# The coordinator's account of where the new world's state came from, and what it cost.
"${SHARDCTL[@]}" events | grep -E "restore_point|restored" | tail -2 || true

if [ -z "$TORCH_SCRIPT" ]; then
  say "grow: a replacement worker joins; it waits as a standby and is folded in at the next pause, from memory"
  start_worker "worker-$WORKERS" first
  wait_world "$WORKERS"
  "${SHARDCTL[@]}" status || true
fi
train_a_while

say "resize: the operator shrinks the live job to $RESIZED workers (no step is lost)"
"${SHARDCTL[@]}" resize --world-size "$RESIZED" --wait-timeout 60s
"${SHARDCTL[@]}" status || true
train_a_while

say "history: shardctl events"
"${SHARDCTL[@]}" events | tee "$RUN_DIR/events-first.txt"
FROM_MEMORY=$(grep -c "restored memory snapshot" "$RUN_DIR/events-first.txt" || true)
FROM_DISK=$(grep -E "restored checkpoint .* from disk" -c "$RUN_DIR/events-first.txt" || true)

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
if [ -n "$TORCH_SCRIPT" ]; then
  FIRST_SIZES="$WORKERS (one worker killed and replaced by shard.run's restart) and $RESIZED"
else
  FIRST_SIZES="$WORKERS, $(( WORKERS - 1 )), $WORKERS and $RESIZED"
fi
echo "first run on $FIRST_SIZES workers, last step logged before the stop:" \
  "$(grep -h " step [0-9]*/$STEPS loss" $(worker_logs first) | sort | tail -1 | sed -E 's/^.* (step [0-9]+\/[0-9]+ loss [0-9.]+).*$/\1/')"
echo "a killed worker cost $(( RESUMED_AT - KILLED_AT )) ms of training plus the steps since the last snapshot"
echo "restores in the first run: $FROM_MEMORY from memory, $FROM_DISK from disk"
grep -h "training finished" $(worker_logs restored) | grep "parameters written" \
  | sed 's/^.* training finished: /restored run: /' || { echo "no training summary"; exit 1; }
echo "checkpoint saved on $WORKERS workers and restored on $RESTORE_WORKERS: $RESUME_ID"
echo "last checkpoint $LAST_ID verified and exported:" \
  "$(stat -c %s "$RUN_DIR/out/exported.safetensors") bytes of safetensors"
[ -f "$RUN_DIR/out/final.safetensors" ] || { echo "no consolidated parameters were written"; exit 1; }
echo "consolidated parameters: $(stat -c %s "$RUN_DIR/out/final.safetensors") bytes (kept with --keep-logs)"
echo "result: success (every stage finished and every process exited cleanly)"
