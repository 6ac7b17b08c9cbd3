#!/usr/bin/env bash
# Installs the Debian (bookworm) packages SparseBalance builds and tests with, when missing.
# Idempotent and quick when everything is present: it asks dpkg first and only then apt-get.
# Run as root (or with sudo available). The Python side (torch, pytest, ...) comes from PyPI into
# a virtual environment: scripts/python-env.sh. Given package names, installs those instead
# (scripts/cross-aarch64.sh's cross compiler and arm64 libraries).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git python3
  libabsl-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  prometheus-cpp-dev nlohmann-json3-dev
  clang libclang-rt-14-dev clang-format clang-tidy openssl libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  prometheus python3-yaml valgrind linux-perf
  python3-dev python3-venv
)
if [ $# -gt 0 ]; then packages=("$@"); fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
