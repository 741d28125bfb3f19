#!/usr/bin/env bash
# Fuzzes the parsers of untrusted input with libFuzzer (docs/fuzzing.md).
#
#   scripts/fuzz.sh [--seconds N] [target...]
#
# Targets: job_spec, manifest, checkpoint_manifest, safetensors, snapshot_shard (default: all). Builds them with
# clang, ASan and UBSan in build-fuzz/ (SHARD_FUZZ_BUILD_DIR overrides), runs each for N seconds
# (default 60) on a fresh copy of its seed corpus tests/fuzz/corpus/<target>/, and exits
# non-zero if any target crashed, naming the reproducer and the command that replays it.
set -euo pipefail
cd "$(dirname "$0")/.."

ALL_TARGETS=(job_spec manifest checkpoint_manifest safetensors snapshot_shard)
seconds=60
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="${2:?--seconds needs a number}"; shift 2 ;;
    --seconds=*) seconds="${1#*=}"; shift ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz: unknown option $1" >&2; exit 2 ;;
    *)
      [[ " ${ALL_TARGETS[*]} " == *" $1 "* ]] \
        || { echo "fuzz: unknown target '$1' (${ALL_TARGETS[*]})" >&2; exit 2; }
      targets+=("$1"); shift ;;
  esac
done
[[ "$seconds" =~ ^[0-9]+$ ]] || { echo "fuzz: --seconds needs a whole number" >&2; exit 2; }
[ ${#targets[@]} -gt 0 ] || targets=("${ALL_TARGETS[@]}")

scripts/setup.sh
# libFuzzer's runtime comes with clang's compiler-rt, which clang only recommends.
if ! clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a | grep -q /; then
  echo "fuzz: installing clang's runtime libraries (libFuzzer, sanitizers)"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends libclang-rt-dev
fi

build="${SHARD_FUZZ_BUILD_DIR:-build-fuzz}"
if [ ! -f "$build/CMakeCache.txt" ]; then
  CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DSHARD_FUZZ=ON -DSHARD_WITH_CUDA=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
# Only the fuzz targets and what they link (shard_common, shard_proto), not the whole product.
cmake --build "$build" --target fuzz_targets

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
work="$build/fuzz-work"
failed=()
for target in "${targets[@]}"; do
  dir="$work/$target"
  rm -rf "$dir"
  mkdir -p "$dir/corpus" "$dir/artifacts"
  cp tests/fuzz/corpus/"$target"/* "$dir/corpus/"
  binary="$build/bin/fuzz_$target"
  echo "fuzz: $target for ${seconds}s (log: $dir/fuzz.log)"
  # Inputs up to 64 KiB; any single allocation over 256 MiB or a process over 2 GiB is a
  # finding (a size field trusted), as is an input that takes more than 10 s.
  set +e
  "$binary" -max_total_time="$seconds" -max_len=65536 -timeout=10 \
    -rss_limit_mb=2048 -malloc_limit_mb=256 \
    -dict="tests/fuzz/$target.dict" -artifact_prefix="$dir/artifacts/" \
    -print_final_stats=1 "$dir/corpus" >"$dir/fuzz.log" 2>&1
  rc=$?
  set -e
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/fuzz.log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$dir/fuzz.log" | tail -1)
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$dir/fuzz.log" | tail -1 || true)
  echo "fuzz: $target: ${runs:-?} runs, ${rate:-?} exec/s, ${cov:-no coverage line}," \
       "corpus $(find "$dir/corpus" -type f | wc -l) inputs"
  reproducer=$(find "$dir/artifacts" -type f | head -1)
  if [ $rc -ne 0 ] || [ -n "$reproducer" ]; then
    failed+=("$target")
    echo "fuzz: $target FAILED (exit $rc); the end of its log:" >&2
    grep -E 'ERROR|runtime error|FUZZ_CHECK|SUMMARY|Test unit written' "$dir/fuzz.log" | tail -8 >&2 || true
    if [ -n "$reproducer" ]; then
      echo "fuzz: reproducer: $reproducer" >&2
      echo "fuzz: replay it:  $binary $reproducer" >&2
      echo "fuzz: once fixed, add it to tests/fuzz/corpus/$target/ as a regression input" >&2
    fi
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: crashes in: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: no crashes in ${targets[*]} (${seconds}s each)"
