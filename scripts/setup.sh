#!/usr/bin/env bash
# Installs every Debian package Shard's build and tests need. Idempotent and non-interactive:
# does nothing when all are present. Needs root (or sudo) only when something is missing.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config clang
  protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev
  libabsl-dev libspdlog-dev libgtest-dev libgmock-dev libgloo-dev
  libcli11-dev nlohmann-json3-dev libxxhash-dev libopenblas-dev libcpp-httplib-dev
  prometheus-cpp-dev libdlpack-dev
  docker-compose
  # The shard Python package's tests and examples: Debian's torch (CPU) for /usr/bin/python3.
  python3-torch python3-numpy python3-pytest
  # The fault tests' hosts (scripts/fault-hosts.sh, docs/faults.md): network namespaces, iptables
  # partitions, tc, ping, and libnetfilter-queue for shard-net-impair (netem's stand-in).
  iproute2 iptables iputils-ping util-linux libnetfilter-queue-dev
)

missing=()
for package in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "setup: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root or sudo to install packages" >&2; exit 1; }
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup: done"
