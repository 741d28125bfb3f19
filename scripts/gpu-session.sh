#!/usr/bin/env bash
# A whole GPU session in one command within a time budget. A lent GPU machine comes with minutes
# of device time, so the stages run most important first, each under `timeout` of what is left
# of the budget, and a stage that cannot get its minimum is skipped (the summary says so):
#   gpu-test   scripts/gpu-test.sh DEVICE_DIR: the GPU tests, compute-sanitizer and the kernel
#              benchmark (about 30 s; at least 60 s given)
#   torch      scripts/gpu-cluster-test.sh BUNDLE --torch-only --bench: shard.torch on the GPU
#              against plain torch (its tests, then bench-torch's GPU table in fp32 and under
#              bf16 autocast; about 190 s, at least 150 s given)
#   cluster    scripts/gpu-cluster-test.sh BUNDLE: the GPU worker end to end against CPU workers
#              (NCCL, staged, bf16/fp16, a kill; about 60 s, at least 60 s given)
#   cores      scripts/gpu-cluster-test.sh BUNDLE --cores-only --cores-repeats 1: the CPU targets
#              that need a core per rank, on the machine's cores (at least 120 s given)
# Each stage's logs and tables, and its output as <stage>.log, are packed after every stage into
# $OUT/session.tar.xz, and the summary table, which ends the output, goes to $OUT/summary.txt:
# two files, as a device machine hands back only a few (OUT: a temporary folder when unset).
# Exits 1 if a stage failed, else 0 (skipped stages included).
#
#   scripts/gpu-session.sh [DEVICE_DIR] [--bundle PATH] [--budget SECONDS]
#
# DEVICE_DIR: scripts/gpu-build.sh's build-gpu/device (gpu_test, shard-bench-gpu and
# cluster.tar.xz). --bundle: the cluster bundle (default DEVICE_DIR/cluster.tar.xz; a build
# folder such as build/ works too). --budget: seconds for all stages (default 540, which leaves
# a 600-second command room to pack $OUT).
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE_DIR=build-gpu/device
BUNDLE=""
BUDGET=540
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) BUNDLE="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    -*) echo "gpu-session: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) DEVICE_DIR="$1"; shift ;;
  esac
done
BUNDLE="${BUNDLE:-$DEVICE_DIR/cluster.tar.xz}"
[ -x "$DEVICE_DIR/gpu_test" ] || { echo "gpu-session: no gpu_test in $DEVICE_DIR" >&2; exit 2; }
[ -e "$BUNDLE" ] || { echo "gpu-session: no bundle at $BUNDLE" >&2; exit 2; }
RESULTS="${OUT:-$(mktemp -d)}"
mkdir -p "$RESULTS"
WORK="$(mktemp -d -t shard-gpu-session.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1  # the logs keep up with a stage that the budget cuts
pack() { tar -C "$WORK" -cJf "$RESULTS/session.tar.xz" .; }

declare -a names results
FAILED=0
# stage NAME MINIMUM_SECONDS COMMAND...: runs COMMAND with OUT=$WORK/NAME under what is left of
# the budget, or skips it when less than MINIMUM is left.
stage() {
  local name=$1 minimum=$2; shift 2
  local left=$(( BUDGET - SECONDS ))
  if [ "$left" -lt "$minimum" ]; then
    names+=("$name"); results+=("skipped: ${left} s of the budget left, it needs ${minimum}")
    return
  fi
  echo "== $name (up to ${left} s)"
  local start=$SECONDS status
  mkdir -p "$WORK/$name"
  OUT="$WORK/$name" timeout --kill-after 10 "$left" "$@" 2>&1 | tee "$WORK/$name.log"
  status=${PIPESTATUS[0]}
  local result="exit $status ($(( SECONDS - start )) s)"
  case $status in
    0) ;;
    124|137) result="FAIL: cut at the budget, $result"; FAILED=1 ;;
    *) result="FAIL: $result"; FAILED=1 ;;
  esac
  names+=("$name"); results+=("$result")
  pack
}

stage gpu-test 60 scripts/gpu-test.sh "$DEVICE_DIR"
stage torch 150 scripts/gpu-cluster-test.sh "$BUNDLE" --torch-only --bench
stage cluster 60 scripts/gpu-cluster-test.sh "$BUNDLE"
stage cores 120 scripts/gpu-cluster-test.sh "$BUNDLE" --cores-only --cores-repeats 1

{
  echo
  echo "== session summary (budget $BUDGET s, used $SECONDS s; logs in $RESULTS/session.tar.xz)"
  for i in "${!names[@]}"; do printf '%-10s %s\n' "${names[$i]}" "${results[$i]}"; done
} | tee "$RESULTS/summary.txt" "$WORK/summary.txt"
pack
exit $FAILED
