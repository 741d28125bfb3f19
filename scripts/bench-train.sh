#!/usr/bin/env bash
# Training throughput of the medium MLP (widths 512,1024,1024,1024,64, global batch 256, Adam)
# on a local cluster of real processes: steps per second over steps 2..N (--steps, default 200:
# enough that the first steps, which rebuild the buckets and map buffers, weigh little; at 60 two
# runs of 2 workers against 1 differed by 1.21x-1.43x) at 1, 2 and 4 workers,
# ZeRO stages 0/1/2, overlap on and off, with the fraction of gradient-reduction time hidden
# behind backward, and each run's ratio to the 1-worker run measured in the same invocation.
# --snapshot-every runs each configuration with each in-memory snapshot setting (EVERY or
# EVERY:REPLICAS; 0 is off; the job's default is 10:1) and gives its steps/s against the first,
# with the snapshots rank 0 took (a periodic one waits while the one before is still replicated)
# and max_pause, the longest step boundary rank 0 spent on one (copying its state, unless a
# periodic snapshot in host memory copied it in the background).
# --overlap-update "true false" runs each overlapped configuration with each bucket's update
# during backward (the job's default) and after it, and gives its steps/s against the first.
# --transport "shm tcp" runs each multi-worker configuration over each transport (shared memory,
# the default on one host, and loopback TCP) and gives its steps/s against the first. Every row
# shows rank 0's step efficiency: its mean step time over its forward+backward time (target
# <= 1.1: reductions, update and step boundary hidden or negligible).
#
#   scripts/bench-train.sh [--steps N] [--bucket-cap-mb X] [--workers "1 2 4"] [--stages "0 1 2"]
#                          [--overlap "true false"] [--snapshot-every "0 10:1 1:1"]
#                          [--overlap-update "true false"] [--transport "shm tcp"] [--threads N]
#                          [--repeat N] [--raw FILE] [--bin DIR]
#
# Each worker gets max(1, cores / workers) OpenBLAS threads, so every run uses the same cores;
# --threads N gives every worker N instead (--threads 1: one thread per process, so vs_1_worker
# is what a second process on a core of its own adds).
# --repeat N runs every configuration N times, in N interleaved rounds, and gives medians: of
# each column, and of each ratio taken between runs of the same round (on a shared VM two runs of
# one configuration can differ by 10-15%; a ratio of neighbours in time differs less). --raw FILE
# also writes every run's figures there, one line each: its row (from 0, in table order), round,
# steps/s, hidden %, step/fwd+bwd, snapshots, max_pause ms.
# --bin DIR runs the programs in DIR (the bin/ of scripts/gpu-build.sh's bundle, on a machine with
# a core per rank) and builds nothing; by default they are built here first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

STEPS=200
BUCKET_CAP_MB=4
WORKER_COUNTS="1 2 4"
STAGES="0 1 2"
OVERLAPS="true false"
SNAPSHOTS="10:1"
UPDATES="true"
TRANSPORTS="shm"
THREADS=""
REPEAT=1
RAW=""
BIN=""
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS="$2"; shift 2 ;;
    --bucket-cap-mb) BUCKET_CAP_MB="$2"; shift 2 ;;
    --workers) WORKER_COUNTS="$2"; shift 2 ;;
    --stages) STAGES="$2"; shift 2 ;;
    --overlap) OVERLAPS="$2"; shift 2 ;;
    --snapshot-every) SNAPSHOTS="$2"; shift 2 ;;
    --overlap-update) UPDATES="$2"; shift 2 ;;
    --transport) TRANSPORTS="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --repeat) REPEAT="$2"; shift 2 ;;
    --raw) RAW="$2"; shift 2 ;;
    --bin) BIN="$(cd "$2" && pwd)"; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "bench-train: unknown argument '$1'" >&2; exit 2 ;;
  esac
done

if [ -z "$BIN" ]; then
  scripts/setup.sh >/dev/null
  scripts/build.sh --target shard-coordinator shard-worker shardctl >/dev/null
  BIN="$PWD/${SHARD_BUILD_DIR:-build}/bin"
fi
CORES=$(nproc)
RUN_DIR="$(mktemp -d -t shard-bench-train.XXXXXX)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  rm -rf "$RUN_DIR"
}
trap cleanup EXIT

"$BIN/shardctl" data generate --widths 512,1024,1024,1024,64 --samples 16384 --seed 1 \
  --out "$RUN_DIR/data.safetensors" >/dev/null

# run WORKERS STAGE OVERLAP SNAPSHOT_EVERY REPLICAS UPDATE TRANSPORT (in round $round) -> prints
# "steps_per_second hidden_percent step_over_forward_backward snapshots_taken max_pause_ms"
run() {
  local workers=$1 stage=$2 overlap=$3 snapshot_every=$4 replicas=$5 update=$6 transport=$7
  local dir="$RUN_DIR/run-$workers-$stage-$overlap-$snapshot_every-$replicas-$update-$transport-$round"
  mkdir -p "$dir"
  cat >"$dir/job.json" <<JSON
{"name": "bench", "worldSize": $workers,
 "model": {"mlp": {"widths": [512, 1024, 1024, 1024, 64]}},
 "data": {"path": "$RUN_DIR/data.safetensors"}, "optimizer": {"name": "adam", "lr": 0.001},
 "globalBatch": 256, "steps": $STEPS, "zeroStage": $stage, "overlap": $overlap,
 "overlapUpdate": $update, "bucketCapMb": $BUCKET_CAP_MB,
 "snapshot": {"everySteps": $snapshot_every, "replicas": $replicas}, "outputDir": "$dir/out"}
JSON
  "$BIN/shard-coordinator" --listen 127.0.0.1:0 --port-file "$dir/port" --job "$dir/job.json" \
    --state-dir "$dir/state" >"$dir/coordinator.log" 2>&1 &
  local coordinator=$!
  PIDS+=("$coordinator")
  for _ in $(seq 100); do [ -s "$dir/port" ] && break; sleep 0.05; done
  local threads=${THREADS:-$(( CORES / workers > 0 ? CORES / workers : 1 ))}
  for i in $(seq 0 $((workers - 1))); do
    "$BIN/shard-worker" --coordinator "127.0.0.1:$(cat "$dir/port")" --id "w$i" \
      --compute-threads "$threads" --transport "$transport" >"$dir/w$i.log" 2>&1 &
    PIDS+=("$!")
  done
  if ! wait "$coordinator"; then
    echo "bench-train: run $workers workers stage $stage overlap $overlap failed; see below" >&2
    tail -5 "$dir"/*.log >&2
    exit 1
  fi
  # Rank 0's summary: "... N steps/s over steps 2-M, P% of gradient reduction hidden behind
  # backward, a step E.EEx its forward and backward, S memory snapshots taken, training paused
  # at most X ms for a snapshot or checkpoint, ..."
  grep -h "parameters written to" "$dir"/w*.log |
    sed -E 's/.* ([0-9.]+) steps\/s over steps.* ([0-9]+)% of gradient reduction.*a step ([0-9.]+)x its.*and backward, ([0-9]+) memory snapshots taken, training paused at most ([0-9.]+) ms.*/\1 \2 \3 \4 \5/'
}

printf "# medium MLP 512,1024,1024,1024,64, global batch 256, Adam, %s steps, bucket cap %s MiB, %s cores, %s OpenBLAS threads per worker, medians of %s interleaved rounds\n" \
  "$STEPS" "$BUCKET_CAP_MB" "$CORES" "${THREADS:-cores/workers}" "$REPEAT"
printf "# %s\n" "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"

# The configurations, in table order, each with the rows its ratios are to (by index): the first
# row, the first snapshot setting, update and transport of its kind.
CONFIGS=()
baseline=""
for workers in $WORKER_COUNTS; do
  for stage in $STAGES; do
    for overlap in $OVERLAPS; do
      # One worker has nothing to overlap or shard: measure it once.
      if [ "$workers" = 1 ] && { [ "$stage" != 0 ] || [ "$overlap" = false ]; }; then continue; fi
      first=""
      # The update can only overlap an overlapped backward: measure the others once.
      updates=$UPDATES
      [ "$overlap" = false ] && updates=${UPDATES%% *}
      for snapshot in $SNAPSHOTS; do
        every=${snapshot%%:*}
        replicas=1
        [ "$snapshot" != "$every" ] && replicas=${snapshot#*:}
        first_update=""
        for update in $updates; do
          # One worker has no peer to reach: measure it over the first transport only.
          transports=$TRANSPORTS
          [ "$workers" = 1 ] && transports=${TRANSPORTS%% *}
          first_transport=""
          for transport in $transports; do
            index=${#CONFIGS[@]}
            [ -z "$baseline" ] && baseline=$index
            [ -z "$first" ] && first=$index
            [ -z "$first_update" ] && first_update=$index
            [ -z "$first_transport" ] && first_transport=$index
            CONFIGS+=("$workers $stage $overlap $every $replicas $update $transport $baseline $first $first_update $first_transport")
          done
        done
      done
    done
  done
done

# Rounds interleaved, so that a slow spell of the machine weighs on every configuration alike;
# each round's ratios are between runs of that round.
RESULTS="$RUN_DIR/results"
: >"$RESULTS"
for round in $(seq "$REPEAT"); do
  for index in "${!CONFIGS[@]}"; do
    read -r workers stage overlap every replicas update transport _ <<<"${CONFIGS[$index]}"
    read -r rate hidden efficiency taken pause < <(
      run "$workers" "$stage" "$overlap" "$every" "$replicas" "$update" "$transport")
    echo "$index $round $rate $hidden $efficiency $taken $pause" >>"$RESULTS"
  done
done
[ -n "$RAW" ] && cp "$RESULTS" "$RAW"

printf "%8s %6s %8s %7s %9s %9s %10s %10s %14s %10s %10s %12s %12s %10s %13s\n" workers stage \
  overlap update snapshot transport steps/s hidden step/fwd+bwd snapshots max_pause vs_1_worker \
  vs_snapshot vs_update vs_transport
printf "%s\n" "${CONFIGS[@]}" | awk -v results="$RESULTS" '
  function median(list,    values, n, i, j, t) {
    n = split(list, values, " ")
    for (i = 2; i <= n; i++)
      for (j = i; j > 1 && values[j - 1] + 0 > values[j] + 0; j--) {
        t = values[j]; values[j] = values[j - 1]; values[j - 1] = t
      }
    return n % 2 ? values[(n + 1) / 2] : (values[n / 2] + values[n / 2 + 1]) / 2
  }
  function ratios(row, to,    round, list) {
    list = ""
    for (round = 1; round <= rounds; round++)
      list = list " " rate[row, round] / rate[to, round]
    return median(list)
  }
  BEGIN {
    while ((getline line < results) > 0) {
      split(line, f, " ")
      i = f[1]; r = f[2]
      rate[i, r] = f[3]; hidden[i] = hidden[i] " " f[4]; efficiency[i] = efficiency[i] " " f[5]
      taken[i] = taken[i] " " f[6]; pause[i] = pause[i] " " f[7]; rates[i] = rates[i] " " f[3]
      if (r > rounds) rounds = r
    }
  }
  {
    i = NR - 1
    printf "%8s %6s %8s %7s %9s %9s %10.2f %9s%% %13.2fx %10s %8.1fms %11.2fx %11.3fx %9.3fx %12.3fx\n",
      $1, $2, $3, $6, $4 ":" $5, $7, median(rates[i]), median(hidden[i]), median(efficiency[i]),
      median(taken[i]), median(pause[i]), ratios(i, $8), ratios(i, $9), ratios(i, $10),
      ratios(i, $11)
  }'
