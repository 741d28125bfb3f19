#!/usr/bin/env bash
# The installed CMake package, end to end: installs a built tree into a temporary prefix,
# checks what landed there, builds tests/package/example against it with find_package(Shard)
# in a separate CMake project, runs the example, and checks that its loss fell.
#
#   tests/package/check_package.sh <build-dir> <source-dir>
#
# The build directory must be fully built (scripts/build.sh). Temporary files are removed on
# exit; set SHARD_KEEP_PACKAGE_TMP=1 to keep them for a look.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 <build-dir> <source-dir>" >&2
  exit 2
fi
build_dir=$(cd "$1" && pwd)
source_dir=$(cd "$2" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/shard-package.XXXXXX")
cleanup() {
  if [ "${SHARD_KEEP_PACKAGE_TMP:-0}" = 1 ]; then
    echo "kept $work"
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT
prefix="$work/prefix"

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

echo "== cmake --install $build_dir --prefix $prefix"
cmake --install "$build_dir" --prefix "$prefix" > "$work/install.log" \
  || { cat "$work/install.log" >&2; fail "cmake --install"; }

echo "== installed files"
libdir=lib
[ -d "$prefix/lib" ] || libdir=$(cd "$prefix" && ls -d lib* | head -n 1)
expected=(
  bin/shard-coordinator bin/shard-worker bin/shardctl
  "$libdir/libshard_common.a" "$libdir/libshard_proto.a" "$libdir/libshard_dataplane.a"
  "$libdir/libshard_worker.a"
  "$libdir/cmake/Shard/ShardConfig.cmake" "$libdir/cmake/Shard/ShardConfigVersion.cmake"
  "$libdir/cmake/Shard/ShardTargets.cmake"
  include/shard/shard/config.h
  include/shard/shard/v1/job.pb.h include/shard/shard/v1/coordinator.grpc.pb.h
  include/shard/common/manifest.h include/shard/common/plan.h
  include/shard/proto/job_convert.h
  include/shard/worker/dataplane/engine.h include/shard/worker/dataplane/gloo_communicator.h
  include/shard/worker/coordinator_client.h
)
for file in "${expected[@]}"; do
  [ -f "$prefix/$file" ] || fail "not installed: $file"
done
for program in shard-coordinator shard-worker shardctl; do
  [ -x "$prefix/bin/$program" ] || fail "not executable: bin/$program"
done
# What stays in the build tree: the test and benchmark programs, the GPU library, the
# coordinator's and shardctl's own libraries, and no header of the GPU path or the tests.
for absent in include/shard/worker/gpu include/shard/tests "$libdir/libshard_server.a" \
              "$libdir/libshard_client.a" "$libdir/libshard_gpu.a" bin/shard-bench-plan; do
  [ ! -e "$prefix/$absent" ] || fail "installed but should not be: $absent"
done
# The installed programs run from their new place (their shared libraries resolve).
"$prefix/bin/shardctl" --help > /dev/null || fail "installed shardctl --help"
"$prefix/bin/shard-coordinator" --help > /dev/null || fail "installed shard-coordinator --help"
"$prefix/bin/shard-worker" --help > /dev/null || fail "installed shard-worker --help"
# No path into the source or build tree may leak into the package.
if grep -rl -e "$source_dir" -e "$build_dir" "$prefix/$libdir/cmake/Shard"; then
  fail "the CMake package refers to the source or build tree (files above)"
fi
echo "$(find "$prefix" -type f | wc -l) files installed"

echo "== configure and build the example against the package"
generator=()
if command -v ninja > /dev/null; then generator=(-G Ninja); fi
cmake -S "$source_dir/tests/package/example" -B "$work/example" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON > "$work/configure.log" 2>&1 \
  || { cat "$work/configure.log" >&2; fail "configuring the example"; }
grep -q "Shard_DIR:PATH=$prefix/" "$work/example/CMakeCache.txt" \
  || fail "the example found Shard somewhere other than $prefix: $(grep Shard_DIR "$work/example/CMakeCache.txt")"
cmake --build "$work/example" > "$work/build.log" 2>&1 \
  || { cat "$work/build.log" >&2; fail "building the example"; }
# A warning from a Shard header in a user's build is a bug of the package.
if grep -n "warning:" "$work/build.log"; then fail "warnings building the example"; fi

echo "== run the example"
"$work/example/linear_regression" 2 60 | tee "$work/run.log" \
  || fail "the example exited with an error"
read -r first last < <(awk '/^first_loss/ { print $2, $4 }' "$work/run.log") || true
[ -n "${first:-}" ] && [ -n "${last:-}" ] || fail "no loss line in the example's output"
awk -v f="$first" -v l="$last" 'BEGIN { exit !(f > 0 && l < 0.1 * f) }' \
  || fail "the loss did not fall: first $first, last $last"
echo "PASS: installed package builds the example; loss $first -> $last"
