#!/usr/bin/env bash
# On a GPU machine: runs the GPU tests, compute-sanitizer (memcheck, racecheck, initcheck) on
# the kernel tests, the GPU benchmark and, where PyTorch is installed, torch's fused Adam on the
# same sizes; ends with a summary table. Logs and the gtest XML go to $OUT (a temporary folder
# when unset). Needs the binaries of scripts/gpu-build.sh and, on that machine, only the NVIDIA
# driver, cuBLAS 13 and NCCL 2 (from the CUDA toolkit or PyTorch's nvidia-* wheels).
#   scripts/gpu-test.sh [BIN_DIR]      BIN_DIR defaults to build-gpu/device
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-build-gpu/device}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
# One machine: NCCL's bootstrap over loopback, whatever other interfaces exist.
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"

# cuBLAS and NCCL: the toolkit's, else the wheels next to PyTorch.
lib_path=""
for dir in /usr/local/cuda/lib64 /usr/local/cuda/lib \
    $(python3 -c 'import glob, nvidia, os
for p in nvidia.__path__:
    print(" ".join(glob.glob(os.path.join(p, "*", "lib"))))' 2>/dev/null); do
  [ -d "$dir" ] && lib_path="$lib_path:$dir"
done
export LD_LIBRARY_PATH="${lib_path#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

declare -a names results
record() { names+=("$1"); results+=("$2"); }

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$OUT/device.txt"
if ldd "$BIN/gpu_test" | grep "not found"; then
  echo "gpu-test: missing shared libraries (searched $LD_LIBRARY_PATH)" >&2
  exit 1
fi
ldd "$BIN/gpu_test" | grep -E "cublas|nccl"

echo "== gpu_test"
start=$SECONDS
timeout 150 "$BIN/gpu_test" --gtest_output="xml:$OUT/gpu_test.xml" 2>&1 | tee "$OUT/gpu_test.log"
status=${PIPESTATUS[0]}
passed=$(grep -oE '\[  PASSED  \] [0-9]+' "$OUT/gpu_test.log" | grep -oE '[0-9]+$' || echo 0)
failed=$(grep -oE '\[  FAILED  \] [0-9]+ test' "$OUT/gpu_test.log" | grep -oE '[0-9]+' || echo 0)
skipped=$(grep -oE '\[  SKIPPED \] [0-9]+ test' "$OUT/gpu_test.log" | grep -oE '[0-9]+' || echo 0)
record "gpu_test" "exit $status: $passed passed, ${failed:-0} failed, ${skipped:-0} skipped ($((SECONDS - start)) s)"

# Our kernels (and the small MLP, which runs the cross-entropy kernels); NCCL's own kernels
# are not ours to check. The medium MLPs add cuBLAS's kernels under memcheck only, and so does
# the engine on the GPU (bucket views, owned spans, 16-bit copies; staged, so no NCCL).
kernels='Rules/*:CastTest.*:ScaleGradientsTest.*:GradSquaredNormTest.*:FillTest.*:FusedOptimizerStateTest.*:Precisions/GpuMlpTest.*/Fp32Odd:GpuMlpErrorsTest.*'
for tool in memcheck racecheck initcheck; do
  echo "== compute-sanitizer --tool $tool"
  filter=$kernels
  [ "$tool" = memcheck ] && filter="$kernels:Precisions/*:GpuEngineTest.TwoStaged*:GpuEngineTest.Sixteen*"
  start=$SECONDS
  timeout 180 compute-sanitizer --tool "$tool" --error-exitcode 99 \
    "$BIN/gpu_test" --gtest_filter="$filter" >"$OUT/$tool.log" 2>&1
  status=$?
  tail -n 3 "$OUT/$tool.log"
  record "sanitizer $tool" "exit $status: $(grep -oE '(ERROR SUMMARY|RACECHECK SUMMARY): .*' "$OUT/$tool.log" | tail -n 1) ($((SECONDS - start)) s)"
done

echo "== shard-bench-gpu"
timeout 90 "$BIN/shard-bench-gpu" 2>&1 | tee "$OUT/bench.txt"
record "shard-bench-gpu" "exit ${PIPESTATUS[0]}"

torch_script="$BIN/gpu_torch_adam.py"
[ -f "$torch_script" ] || torch_script=bench/gpu_torch_adam.py
if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "== torch fused Adam"
  timeout 120 python3 "$torch_script" 2>&1 | tee "$OUT/torch.txt"
  record "torch fused adam" "exit ${PIPESTATUS[0]}"
else
  record "torch fused adam" "skipped: no PyTorch with CUDA"
fi

echo
echo "== summary (logs in $OUT)"
for i in "${!names[@]}"; do printf '%-22s %s\n' "${names[$i]}" "${results[$i]}"; done
grep -h '^|' "$OUT/bench.txt" "$OUT/torch.txt" 2>/dev/null | grep -v -- '---' | grep -E 'adam|mlp'
