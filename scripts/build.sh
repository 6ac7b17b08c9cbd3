#!/usr/bin/env bash
# Installs what is missing, configures and builds SparseBalance into $BUILD_DIR (default
# build/). Extra arguments go to cmake's configure step, e.g. -DSB_WERROR=ON.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
cmake --build "$BUILD_DIR" -j "$JOBS"
