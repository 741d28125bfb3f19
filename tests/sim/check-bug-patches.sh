#!/usr/bin/env bash
# Each patch in tests/sim/bugs/ puts back a bug the control-plane simulation once found. This
# checks, for each, that the simulation still finds it:
#   1. the patch still applies (`git apply --check`) to a copy of the directories it touches,
#      made in a temporary directory; the source tree and the build directory are only read;
#   2. the simulation builds with it: the objects of shard-control-plane-sim whose source or
#      headers (ninja's dependency log) the patch touches are compiled again from the copy, with
#      the build's own command lines (`ninja -t commands`; the copy first on the include path),
#      the static libraries holding them are archived again, and the program is linked again;
#      every other object and library comes from the build as it is;
#   3. the patched program FAILS on the pinned seeds (tests/sim/pinned_seeds.txt). The seeds
#      decide everything and none is cut short by time, so the result does not depend on the
#      machine's speed. (That the unpatched program passes them is ctest
#      control_plane_simulation_pinned.)
#
#   tests/sim/check-bug-patches.sh <source-dir> <build-dir> [patch ...]
#
# Without patches it checks every tests/sim/bugs/*.patch. The build directory must be a Ninja
# build (scripts/build.sh) with shard-control-plane-sim built. NINJA names the ninja program
# (default: ninja), SHARD_BUG_JOBS the parallel compiles (default: nproc). Temporary files are
# removed on exit; SHARD_KEEP_BUG_TMP=1 keeps them for a look. Exit 0 when every patch is still
# found, 1 otherwise.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 <source-dir> <build-dir> [patch ...]" >&2
  exit 2
fi
source_dir=$(cd "$1" && pwd -P)
build_dir=$(cd "$2" && pwd -P)
shift 2
ninja=${NINJA:-ninja}
target=shard-control-plane-sim
pinned=$source_dir/tests/sim/pinned_seeds.txt

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# More than one patch: one run of this script each, so that one failure does not hide another.
if [ $# -ne 1 ]; then
  if [ $# -eq 0 ]; then
    shopt -s nullglob
    set -- "$source_dir"/tests/sim/bugs/*.patch
    [ $# -gt 0 ] || fail "no patches in $source_dir/tests/sim/bugs"
  fi
  failed=()
  for patch in "$@"; do
    "$0" "$source_dir" "$build_dir" "$patch" || failed+=("$(basename "$patch")")
    echo
  done
  [ ${#failed[@]} -eq 0 ] || fail "${#failed[@]} of $# patches: ${failed[*]}"
  echo "all $# patches still break the simulation"
  exit 0
fi

patch=$(cd "$(dirname "$1")" && pwd -P)/$(basename "$1")
name=$(basename "$patch" .patch)
[ -f "$patch" ] || fail "no patch $patch"
[ -f "$build_dir/build.ninja" ] || fail "$build_dir is not a Ninja build (scripts/build.sh)"
command -v git > /dev/null || fail "git is needed to apply the patch"

work=$(mktemp -d "${TMPDIR:-/tmp}/shard-bug-$name.XXXXXX")
cleanup() {
  if [ "${SHARD_KEEP_BUG_TMP:-0}" = 1 ]; then
    echo "kept $work"
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT
copy=$work/src  # the touched directories, patched
out=$work/out   # what is built again, and the generated ninja file that builds it
mkdir -p "$copy" "$out"

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }
started=$(now)
echo "== $name ($patch)"

# 1. The files the patch touches; a copy of their directories; the patch applied to the copy.
mapfile -t touched < <(sed -n 's|^diff --git a/\([^ ]*\) b/\([^ ]*\)$|\1\n\2|p' "$patch" | sort -u)
[ ${#touched[@]} -gt 0 ] || fail "$patch touches no file (not a git diff?)"
declare -A copied=()
for file in "${touched[@]}"; do
  dir=$(dirname "$file")
  if [ "$dir" = . ]; then  # a file at the top: not the whole tree
    [ ! -f "$source_dir/$file" ] || cp "$source_dir/$file" "$copy/$file"
  elif [ -d "$source_dir/$dir" ] && [ -z "${copied[$dir]:-}" ]; then
    mkdir -p "$copy/$dir"
    cp -R "$source_dir/$dir/." "$copy/$dir/"
    copied[$dir]=1
  fi
done
# The copy is no git repository, and git must not look above it for one.
if ! (cd "$copy" && GIT_CEILING_DIRECTORIES=$work git apply --check -v "$patch") \
    > "$work/apply.log" 2>&1; then
  cat "$work/apply.log" >&2
  fail "$name no longer applies to $source_dir; regenerate it (docs/control-plane.md)"
fi
(cd "$copy" && GIT_CEILING_DIRECTORIES=$work git apply "$patch")
echo "applies: ${touched[*]}"

# 2. The build's commands for the program, in the order ninja runs them: compiles (one line each,
# ending in `-o OBJECT -c SOURCE`), archives (`ar qc LIBRARY ...`) and, last, the link.
(cd "$build_dir" && "$ninja" -t commands "$target") > "$work/commands" \
  || fail "ninja -t commands $target in $build_dir"
compile='^.* -o ([^ ]+) -c ([^ ]+)$'
objects=()
src_prefix=
while IFS= read -r line; do
  if [[ $line =~ $compile ]]; then
    objects+=("${BASH_REMATCH[1]}")
    source=${BASH_REMATCH[2]}
    [[ $source != */tests/sim/main.cc ]] || src_prefix=${source%/tests/sim/main.cc}
  fi
done < "$work/commands"
[ -n "$src_prefix" ] || fail "no compile of tests/sim/main.cc among the commands of $target"
[ "$(cd "$src_prefix" && pwd -P)" = "$source_dir" ] \
  || fail "$build_dir was configured for the sources in $src_prefix, not $source_dir"

# The objects to compile again: those whose dependencies (the source and every header, as the
# compiler saw them) include a file the patch touches.
(cd "$build_dir" && "$ninja" -t deps "${objects[@]}") > "$work/deps" \
  || fail "ninja -t deps in $build_dir"
printf '%s\n' "${touched[@]/#/$src_prefix/}" > "$work/touched"
mapfile -t stale < <(awk 'NR == FNR { touched[$0] = 1; next }
                         /^[^ ]/ { object = $1; sub(/:$/, "", object); next }
                         ($1 in touched) && !(object in seen) { seen[object] = 1; print object }' \
                     "$work/touched" "$work/deps")
[ ${#stale[@]} -gt 0 ] || fail "$name touches nothing $target is built from"
declare -A again=()
for object in "${stale[@]}"; do again[$object]=1; done

# A ninja file that runs, in the build directory, the commands that make those objects, the
# libraries that hold them and the program, each writing into $out instead.
declare -A moved=()  # a path in the build directory -> its rebuilt copy in $out
{
  echo "rule run"
  echo "  command = cd $build_dir && \$cmd"
  echo "  description = \$desc"
} > "$out/build.ninja"
add_edge() {  # output, description, command, inputs...
  local output=$1 desc=$2 cmd=$3
  shift 3
  printf 'build %s: run %s\n  cmd = %s\n  desc = %s\n' "$output" "$*" "${cmd//\$/\$\$}" "$desc" \
    >> "$out/build.ninja"
}
program=
mapfile -t lines < "$work/commands"
for ((i = 0; i < ${#lines[@]}; i++)); do
  line=" ${lines[i]} "
  if [[ ${lines[i]} =~ $compile ]]; then
    object=${BASH_REMATCH[1]}
    source=${BASH_REMATCH[2]}
    [ -n "${again[$object]:-}" ] || continue
    relative=${source#"$src_prefix"/}
    [ -f "$copy/$relative" ] && source_now=$copy/$relative || source_now=$source
    line=${line/" -o $object "/" -o $out/$object "}
    line=${line/" -MF $object.d "/" -MF $out/$object.d "}
    # The patched copy is found first on the include path; the patch may bring back warnings.
    line=${line/" -c $source "/" -Wno-error -c $source_now "}
    line=${line/ -/ -I$copy -}
    mkdir -p "$(dirname "$out/$object")"
    add_edge "$out/$object" "CXX $relative (patched)" "$line" "$source_now"
    moved[$object]=$out/$object
    continue
  fi
  inputs=()
  for old in "${!moved[@]}"; do
    if [[ $line == *" $old "* ]]; then
      line=${line//" $old "/" ${moved[$old]} "}
      inputs+=("${moved[$old]}")
    fi
  done
  if [ $((i + 1)) -eq ${#lines[@]} ]; then  # the link
    [[ $line =~ \ -o\ ([^ ]*$target)\  ]] || fail "the last command does not link $target: $line"
    program=$out/$target
    line=${line/" -o ${BASH_REMATCH[1]} "/" -o $program "}
    add_edge "$program" "LINK $target (patched)" "$line" "${inputs[@]}"
  elif [ ${#inputs[@]} -gt 0 ]; then
    [[ $line =~ \ qc\ ([^ ]+)\  ]] \
      || fail "a command uses a rebuilt object but is no archive or link: $line"
    library=${BASH_REMATCH[1]}
    mkdir -p "$(dirname "$out/$library")"
    line=${line//" $library "/" $out/$library "}
    add_edge "$out/$library" "AR $library (patched)" "$line" "${inputs[@]}"
    moved[$library]=$out/$library
  fi
done
echo "compiles again: ${stale[*]}"
built=$(now)
(cd "$out" && "$ninja" -j "${SHARD_BUG_JOBS:-$(nproc)}") || fail "$target does not build with $name"
echo "built in $(since "$built")"

# 3. The pinned seeds, each to its end: the patched program must fail at least one.
ran=$(now)
rc=0
"$program" --pinned "$pinned" --seeds 0 --time-budget 30m > "$work/sim.log" 2>&1 || rc=$?
grep -E '^(FAIL|[0-9]+ seeds )' "$work/sim.log" || true
echo "ran in $(since "$ran")"
if [ $rc -eq 0 ]; then
  fail "$name no longer breaks the simulation: every pinned seed passes with it" \
    "(find a seed that fails with it and add it to $pinned)"
fi
if [ $rc -ne 1 ] || ! grep -q '^FAIL pinned seed ' "$work/sim.log"; then
  tail -n 20 "$work/sim.log" >&2
  fail "$target with $name exited $rc without failing a pinned seed"
fi
echo "== $name: still found, in $(since "$started")"
