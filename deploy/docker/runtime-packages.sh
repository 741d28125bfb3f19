#!/usr/bin/env bash
# Prints, one per line, the Debian/Ubuntu packages that hold the shared libraries the given
# binaries load (ldd -> dpkg -S). The image builds run it in their build stage and install the
# list in the runtime stage, so the runtime image carries exactly the libraries the binaries
# need, whatever the distribution names them (libgrpc++1.51 on bookworm, the CUDA image's
# libnccl2 and libcublas on Ubuntu), and no compiler, header or -dev package.
# Libraries not found here (libcuda.so.1, injected by the NVIDIA container runtime) are skipped.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }
for binary in "$@"; do
  ldd "$binary"
done | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u | while read -r lib; do
  # usrmerge: a package may register /lib/... or /usr/lib/...; try the path as ldd prints it,
  # then the resolved one (alternatives such as libopenblas.so.0 resolve to their provider).
  owner=$(dpkg -S "$lib" 2>/dev/null || dpkg -S "$(realpath "$lib")" 2>/dev/null || true)
  [ -n "$owner" ] || { echo "runtime-packages: no package owns $lib" >&2; exit 1; }
  echo "${owner%%: *}" | tr ',' '\n' | sed 's/^ *//; s/:.*$//'
done | grep -v '^$' | sort -u
