#!/usr/bin/env bash
# ZeRO stage 3 against stage 2 on a local cluster of real processes, one compute thread per
# process, all in one run:
#  memory  per-rank peak resident memory of shard-worker at stages 2 and 3 at 2 and 4 workers on
#          a large MLP (default 1024,2048x25,1024: P = 105 M parameters, every layer under the
#          25 MiB bucket cap; "AxN" is N layers of width A) for --steps steps (global batch 32,
#          Adam): the whole process's peak (VmHWM before the peak is reset after step 1, and
#          /usr/bin/time's max RSS at exit: init and rank 0's final export included), the steady
#          peak (VmHWM over steps 2..N-1: /proc/PID/clear_refs 5 after step 1, read after step
#          N-1) and the engine's own accounting (held bytes, from the worker's log when it says),
#          each with its stage3/stage2 ratio (goal: peak <= 0.5x at 4 workers);
#  speed   steps/s over steps 2..N of the medium MLP (widths 512,1024,1024,1024,64, global batch
#          256, Adam) at 2 workers: stages 1 and 2 with overlapParamGather true and false, and
#          stage 3, against stage 2 and against torch DDP + ZeroRedundancyOptimizer on the same
#          MLP, data and steps (bench/torch_bench.py's worker --mode ddp, Debian's torch).
# Checkpoints and in-memory snapshots are off in every run. Takes about 2 minutes on 2 cores.
#
#   scripts/bench-zero3.sh [--steps N] [--widths LIST] [--batch B] [--workers "2 4"]
#                          [--speed-steps N] [--repeats R] [--bucket-cap-mb X] [--prefetch K]
#                          [--skip-memory] [--skip-speed] [--keep]
#
# --steps: the memory runs' steps (default 6, at least 3); --speed-steps: the speed runs' (60);
# --repeats: speed runs per configuration, interleaved (default 3): the ratios are of the best
# run of each (the one least slowed by anything else running), the median and range beside.
# SHARD_BUILD_LOCK=FILE builds under flock FILE (another build may be running).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

STEPS=6
WIDTHS="1024,2048x25,1024"
BATCH=32
WORKER_COUNTS="2 4"
SPEED_STEPS=60
REPEATS=3
BUCKET_CAP_MB=25
PREFETCH=1
MEMORY=true
SPEED=true
KEEP=false
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS="$2"; shift 2 ;;
    --widths) WIDTHS="$2"; shift 2 ;;
    --batch) BATCH="$2"; shift 2 ;;
    --workers) WORKER_COUNTS="$2"; shift 2 ;;
    --speed-steps) SPEED_STEPS="$2"; shift 2 ;;
    --repeats) REPEATS="$2"; shift 2 ;;
    --bucket-cap-mb) BUCKET_CAP_MB="$2"; shift 2 ;;
    --prefetch) PREFETCH="$2"; shift 2 ;;
    --skip-memory) MEMORY=false; shift ;;
    --skip-speed) SPEED=false; shift ;;
    --keep) KEEP=true; shift ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-zero3: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
if [ "$STEPS" -lt 3 ] || [ "$SPEED_STEPS" -lt 2 ] || [ "$REPEATS" -lt 1 ]; then
  echo "bench-zero3: --steps must be at least 3, --speed-steps 2, --repeats 1" >&2
  exit 2
fi

# "1024,2048x3,1024" -> "1024,2048,2048,2048,1024"
expand_widths() {
  local out="" part width count
  IFS=, read -ra parts <<<"$1"
  for part in "${parts[@]}"; do
    width=${part%%x*}
    count=1
    [ "$part" != "$width" ] && count=${part#*x}
    for _ in $(seq "$count"); do out="${out:+$out,}$width"; done
  done
  echo "$out"
}
BIG_WIDTHS=$(expand_widths "$WIDTHS")
MEDIUM_WIDTHS="512,1024,1024,1024,64"

scripts/setup.sh >/dev/null
build() {
  if [ -n "${SHARD_BUILD_LOCK:-}" ]; then flock "$SHARD_BUILD_LOCK" scripts/build.sh "$@"
  else scripts/build.sh "$@"; fi
}
# shard_python: bench/torch_bench.py reads the data file through shard.safetensors.
build --target shard-coordinator shard-worker shardctl shard_python >/dev/null
BUILD="$PWD/${SHARD_BUILD_DIR:-build}"
BIN="$BUILD/bin"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
RUN_DIR="$(mktemp -d -t shard-bench-zero3.XXXXXX)"
# Everything this script starts is one of its running jobs, or a worker whose parent is one (the
# memory runs' /usr/bin/time): only those are stopped, by pid.
cleanup() {
  local running pid file
  running=" $(jobs -pr | tr '\n' ' ') "
  for file in "$RUN_DIR"/*/w*.pid; do
    [ -s "$file" ] || continue
    pid=$(cat "$file")
    [[ "$running" == *" $(ps -o ppid= -p "$pid" 2>/dev/null | tr -d ' ') "* ]] &&
      kill -KILL "$pid" 2>/dev/null || true
  done
  for pid in $running; do kill -KILL "$pid" 2>/dev/null || true; done
  if [ "$KEEP" = true ]; then echo "bench-zero3: logs kept in $RUN_DIR" >&2; else rm -rf "$RUN_DIR"; fi
}
trap cleanup EXIT

# start_job DIR WORKERS WIDTHS DATA BATCH STEPS STAGE OVERLAP_PARAM_GATHER: writes the job and
# starts its coordinator (pid in COORDINATOR).
start_job() {
  local dir=$1 workers=$2 widths=$3 data=$4 batch=$5 steps=$6 stage=$7 gather=$8
  mkdir -p "$dir"
  cat >"$dir/job.json" <<JSON
{"name": "bench-zero3", "worldSize": $workers, "model": {"mlp": {"widths": [$widths]}},
 "data": {"path": "$data"}, "optimizer": {"name": "adam", "lr": 0.001},
 "globalBatch": $batch, "steps": $steps, "zeroStage": $stage, "overlapParamGather": $gather,
 "bucketCapMb": $BUCKET_CAP_MB, "prefetch": $PREFETCH,
 "checkpoint": {"everySteps": 0}, "snapshot": {"everySteps": 0}, "outputDir": "$dir/out"}
JSON
  "$BIN/shard-coordinator" --listen 127.0.0.1:0 --port-file "$dir/port" --job "$dir/job.json" \
    --state-dir "$dir/state" >"$dir/coordinator.log" 2>&1 &
  COORDINATOR=$!
  for _ in $(seq 200); do [ -s "$dir/port" ] && break; sleep 0.05; done
}

failed() {
  echo "bench-zero3: $1 failed; see below" >&2
  tail -n 5 "$2"/*.log >&2
  exit 1
}

# The rank-0 worker's line of "training finished" (it alone writes the parameters).
finished_line() { grep -h "training finished.*parameters written to" "$1"/w*.log; }

# --- memory ---------------------------------------------------------------------------------

vm_hwm() { awk '/^VmHWM:/ { print $2 }' "/proc/$1/status" 2>/dev/null || true; }

# wait_step DIR STEP STEPS COORDINATOR: until rank 0 has logged step STEP (status 1: the
# coordinator exited first).
wait_step() {
  until grep -qs " step $2/$3 loss " "$1"/w*.log; do
    kill -0 "$4" 2>/dev/null || return 1
    sleep 0.05
  done
}

# monitor DIR WORKERS STEPS COORDINATOR: once rank 0 has logged step 1, reads every worker's
# VmHWM (the peak of start-up, init and step 1) and resets it to the current RSS; once it has
# logged step STEPS-1, reads it again (the peak of steps 2..STEPS-1).
monitor() {
  local dir=$1 workers=$2 steps=$3 coordinator=$4 i pid
  wait_step "$dir" 1 "$steps" "$coordinator" || return 0
  for i in $(seq 0 $((workers - 1))); do
    pid=$(cat "$dir/w$i.pid")
    vm_hwm "$pid" >"$dir/w$i.hwm-setup"
    echo 5 2>/dev/null >"/proc/$pid/clear_refs" || rm -f "$dir/w$i.hwm-setup"
  done
  wait_step "$dir" $((steps - 1)) "$steps" "$coordinator" || return 0
  for i in $(seq 0 $((workers - 1))); do vm_hwm "$(cat "$dir/w$i.pid")" >"$dir/w$i.hwm-steady"; done
}

# memory_run WORKERS STAGE: writes DIR/ranks, one line per rank in rank order, KiB but held:
#   "rank peak setup steady end held_bytes" (- where not known): peak is the whole process's,
# setup start-up to step 1's end, steady steps 2..N-1, end steps 2..N and exit (rank 0's export).
# Not in a subshell: wait needs the processes to be this shell's children.
memory_run() {
  local workers=$1 stage=$2 dir="$RUN_DIR/memory-$1-$2" i
  start_job "$dir" "$workers" "$BIG_WIDTHS" "$RUN_DIR/big.safetensors" "$BATCH" "$STEPS" \
    "$stage" true
  local coordinator=$COORDINATOR timers=()
  for i in $(seq 0 $((workers - 1))); do
    /usr/bin/time -f %M -o "$dir/w$i.maxrss" \
      bash -c 'echo $$ >"$0"; exec "$@"' "$dir/w$i.pid" \
      "$BIN/shard-worker" --coordinator "127.0.0.1:$(cat "$dir/port")" --id "w$i" \
      --compute-threads 1 >"$dir/w$i.log" 2>&1 &
    timers+=("$!")
  done
  for _ in $(seq 200); do
    local ready=true
    for i in $(seq 0 $((workers - 1))); do [ -s "$dir/w$i.pid" ] || ready=false; done
    [ "$ready" = true ] && break
    sleep 0.05
  done
  monitor "$dir" "$workers" "$STEPS" "$coordinator" &
  local watcher=$!
  wait "$coordinator" || failed "memory run: $workers workers, stage $stage" "$dir"
  for pid in "${timers[@]}"; do wait "$pid" || failed "memory run: $workers workers, stage $stage" "$dir"; done
  wait "$watcher" || true
  for i in $(seq 0 $((workers - 1))); do
    local rank end setup steady held
    rank=$(sed -nE "s/.*joined job '[^']*' as rank ([0-9]+).*/\1/p" "$dir/w$i.log" | tail -1)
    # time's max RSS at exit: the peak since the reset (the whole process's without one).
    end=$(tail -1 "$dir/w$i.maxrss")
    setup=$(cat "$dir/w$i.hwm-setup" 2>/dev/null || true)
    steady=$(cat "$dir/w$i.hwm-steady" 2>/dev/null || true)
    held=$(sed -nE 's/.*model state held ([0-9]+) bytes.*/\1/p' "$dir/w$i.log" | tail -1)
    local peak=$end
    [ -n "$setup" ] && [ "$setup" -gt "$peak" ] && peak=$setup
    echo "$rank $peak ${setup:--} ${steady:--} $([ -n "$setup" ] && echo "$end" || echo -) ${held:--}"
  done | sort -n >"$dir/ranks"
}

# --- speed ----------------------------------------------------------------------------------

# speed_run STAGE GATHER REPEAT: writes rank 0's steps/s over steps 2..N to DIR/rate.
speed_run() {
  local stage=$1 gather=$2 dir="$RUN_DIR/speed-$1-$2-$3" i
  start_job "$dir" 2 "$MEDIUM_WIDTHS" "$RUN_DIR/medium.safetensors" 256 "$SPEED_STEPS" \
    "$stage" "$gather"
  local coordinator=$COORDINATOR workers=()
  for i in 0 1; do
    "$BIN/shard-worker" --coordinator "127.0.0.1:$(cat "$dir/port")" --id "w$i" \
      --compute-threads 1 >"$dir/w$i.log" 2>&1 &
    workers+=("$!")
  done
  wait "$coordinator" || failed "speed run: stage $stage, overlapParamGather $gather" "$dir"
  for i in "${workers[@]}"; do
    wait "$i" || failed "speed run: stage $stage, overlapParamGather $gather" "$dir"
  done
  finished_line "$dir" | sed -E 's/.* ([0-9.]+) steps\/s over steps.*/\1/' >"$dir/rate"
  RATE_FILE="$dir/rate"
}

# ddp_run REPEAT: torch DDP (gloo) + ZeroRedundancyOptimizer's steps/s over steps 2..N to DIR/rate
# (bench/torch_bench.py worker --mode ddp: warm-up 1 step, then N-1 timed, as Shard's window).
ddp_run() {
  local dir="$RUN_DIR/speed-ddp-$1" r pids=()
  mkdir -p "$dir"
  for r in 0 1; do
    PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}" GLOO_SOCKET_IFNAME=lo \
      MASTER_ADDR=127.0.0.1 timeout 600 /usr/bin/python3 bench/torch_bench.py worker \
      --mode ddp --model mlp --steps $((SPEED_STEPS - 1)) --warmup 1 \
      --data "$RUN_DIR/medium.safetensors" --result "$dir/result" --rank "$r" --world 2 \
      --store "$dir/store" >"$dir/ddp$r.log" 2>&1 &
    pids+=("$!")
  done
  for r in "${pids[@]}"; do wait "$r" || failed "DDP + ZeroRedundancyOptimizer run" "$dir"; done
  /usr/bin/python3 -c 'import json, sys; print("%.2f" % json.load(open(sys.argv[1]))["steps_per_second"])' \
    "$dir/result.rank0.json" >"$dir/rate"
  RATE_FILE="$dir/rate"
}

# CPU ticks (USER_HZ): "all busy" of the machine, and this script's own with its reaped children.
cpu_ticks() {
  awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9 }' /proc/stat
  sed 's/.*) //' "/proc/$$/stat" | awk '{ print $12 + $13 + $14 + $15 }'
}

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ v[NR] = $1 } END {
  if (NR % 2) printf "%.2f", v[(NR + 1) / 2]; else printf "%.2f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
best() { tr ' ' '\n' | grep -v '^$' | sort -g | tail -1; }
range() { tr ' ' '\n' | grep -v '^$' | sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END {
  printf "%.2f-%.2f", lo, hi }'; }

# --- the run --------------------------------------------------------------------------------

CPU=$(sed -nE 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
PARAMS=$(echo "$BIG_WIDTHS" | tr ',' '\n' |
  awk 'NR > 1 { p += prev * $1 + $1 } { prev = $1 } END { printf "%d", p }')
SHORT_WIDTHS="$WIDTHS"
printf "# bench-zero3 on %s (%s cores), %s; load average before: %s\n" "$CPU" "$(grep -c '^processor' /proc/cpuinfo)" \
  "$(date -Iseconds)" "$(cut -d' ' -f1-3 /proc/loadavg)"

if [ "$MEMORY" = true ]; then
  "$BIN/shardctl" data generate --widths "${BIG_WIDTHS%%,*},${BIG_WIDTHS##*,}" --samples 1024 \
    --seed 1 --out "$RUN_DIR/big.safetensors" >/dev/null
  echo
  awk -v w="$SHORT_WIDTHS" -v p="$PARAMS" -v b="$BATCH" -v s="$STEPS" -v c="$BUCKET_CAP_MB" \
    -v f="$PREFETCH" 'BEGIN { printf "# memory: MLP %s, P = %d parameters (%.1f MiB fp32), " \
      "global batch %d, Adam, %d steps, bucket cap %s MiB, prefetch %d; MiB per rank\n", \
      w, p, p * 4 / 1048576, b, s, c, f }'
  echo "#   peak: the whole process, per rank and the largest (VmHWM and /usr/bin/time's max RSS)"
  echo "#   setup: start-up, init and step 1 (VmHWM read then reset); steady: steps 2..$((STEPS - 1))" \
    "(VmHWM then); end: steps 2..$STEPS, rank 0's export, exit (max RSS);"
  echo "#   held: the engine's model state (the worker's log); each column the largest over ranks"
  printf "%7s %5s  %-24s %6s %6s %6s %6s %6s %6s %6s %6s\n" workers stage \
    "peak per rank (r0/r1/..)" peak vs_s2 setup steady vs_s2 end held vs_s2
  for workers in $WORKER_COUNTS; do
    s2=""
    for stage in 2 3; do
      memory_run "$workers" "$stage"
      # The maxima over ranks: peak setup steady end held (0 where not known).
      row=$(awk '{ for (c = 2; c <= 6; ++c) if ($c != "-" && $c > m[c]) m[c] = $c
                   list = list (NR > 1 ? "/" : "") sprintf("%.0f", $2 / 1024) }
                 END { print list, m[2] + 0, m[3] + 0, m[4] + 0, m[5] + 0, m[6] + 0 }' \
              "$RUN_DIR/memory-$workers-$stage/ranks")
      [ "$stage" = 2 ] && s2=$row
      awk -v w="$workers" -v s="$stage" -v row="$row" -v s2="$s2" '
        function mib(v, unit) { return v > 0 ? sprintf("%.0f", v / unit) : "-" }
        function ratio(a, b) { return (a > 0 && b > 0) ? sprintf("%.2fx", a / b) : "-" }
        BEGIN { split(row, r, " "); split(s2, b, " ")
          printf "%7s %5s  %-24s %6s %6s %6s %6s %6s %6s %6s %6s\n", w, s, r[1], mib(r[2], 1024),
            ratio(r[2], b[2]), mib(r[3], 1024), mib(r[4], 1024), ratio(r[4], b[4]),
            mib(r[5], 1024), mib(r[6], 1048576), ratio(r[6], b[6]) }'
      if [ "$stage" = 3 ] && [ "$workers" = 4 ]; then
        GOAL=$(awk -v row="$row" -v s2="$s2" '
          function ratio(a, b) { return (a > 0 && b > 0) ? sprintf("%.2fx", a / b) : "-" }
          BEGIN { split(row, r, " "); split(s2, b, " ")
            printf "stage 3 / stage 2 peak RSS at 4 workers: %s (goal <= 0.50x: %s); " \
              "steady %s, held %s", ratio(r[2], b[2]), r[2] <= 0.5 * b[2] ? "PASS" : "MISS",
              ratio(r[4], b[4]), ratio(r[6], b[6]) }')
      fi
    done
  done
  [ -n "${GOAL:-}" ] && echo "# $GOAL"
fi

if [ "$SPEED" = true ]; then
  "$BIN/shardctl" data generate --widths "$MEDIUM_WIDTHS" --samples 16384 --seed 1 \
    --out "$RUN_DIR/medium.safetensors" >/dev/null
  CONFIGS=("1 false" "1 true" "2 false" "2 true" "3 true" "ddp")
  declare -A RATES
  read -r -d '' busy_before own_before < <(cpu_ticks) || true
  started=$(date +%s.%N)
  for repeat in $(seq "$REPEATS"); do
    for config in "${CONFIGS[@]}"; do
      if [ "$config" = ddp ]; then ddp_run "$repeat"
      else speed_run "${config% *}" "${config#* }" "$repeat"; fi
      rate=$(cat "$RATE_FILE")
      RATES[$config]="${RATES[$config]:-} $rate"
    done
  done
  echo
  printf "# speed: medium MLP %s, global batch 256, Adam, 2 workers, steps/s over steps 2..%d, " \
    "$MEDIUM_WIDTHS" "$SPEED_STEPS"
  printf "best of %d runs; bucket cap %s MiB, prefetch %d\n" "$REPEATS" "$BUCKET_CAP_MB" \
    "$PREFETCH"
  printf "%-44s %7s %7s %13s %7s %13s %7s\n" configuration steps/s median range vs_s2 \
    vs_gather_off vs_ddp
  s2=$(best <<<"${RATES[2 true]}")
  ddp=$(best <<<"${RATES[ddp]}")
  for config in "${CONFIGS[@]}"; do
    rate=$(best <<<"${RATES[$config]}")
    middle=$(median <<<"${RATES[$config]}")
    spread=$(range <<<"${RATES[$config]}")
    off=""
    case "$config" in
      ddp) label="torch DDP + ZeroRedundancyOptimizer (gloo)" ;;
      "3 true") label="Shard ZeRO-3 (prefetch $PREFETCH)" ;;
      *) label="Shard ZeRO-${config% *}, overlapParamGather ${config#* }"
         [ "${config#* }" = true ] && off=$(best <<<"${RATES[${config% *} false]}") ;;
    esac
    awk -v l="$label" -v r="$rate" -v m="$middle" -v g="$spread" -v s="$s2" -v o="$off" \
      -v d="$ddp" 'BEGIN {
      printf "%-44s %7.2f %7.2f %13s %6.2fx %13s %6.2fx\n", l, r, m, g, r / s,
        o == "" ? "-" : sprintf("%.2fx", r / o), r / d }'
  done
  read -r -d '' busy_after own_after < <(cpu_ticks) || true
  awk -v b="$((busy_after - busy_before))" -v o="$((own_after - own_before))" \
    -v t="$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')" \
    -v hz="$(getconf CLK_TCK)" -v n="$(grep -c '^processor' /proc/cpuinfo)" 'BEGIN {
    printf "# other processes used %.0f%% of the %d cores during the speed runs (above a few %%, " \
      "the timings are noisy)\n", (b > o ? 100 * (b - o) / hz / t / n : 0), n }'
  awk -v a="$(best <<<"${RATES[3 true]}")" -v s="$s2" -v d="$ddp" 'BEGIN {
    printf "# stage 3 / stage 2: %.2fx; stage 3 / DDP+ZeroRedundancyOptimizer: %.2fx; " \
      "stage 2 / DDP+ZeroRedundancyOptimizer: %.2fx\n", a / s, a / d, s / d }'
fi
printf "# load average after: %s\n" "$(cut -d' ' -f1-3 /proc/loadavg)"
