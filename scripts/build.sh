#!/usr/bin/env bash
# Installs what is missing, configures and builds SparseBalance into $BUILD_DIR (default
# build/). Extra arguments go to cmake's configure step, e.g. -DSB_WERROR=ON. SB_PYTHON names the
# interpreter the Python package is built for (scripts/test.sh passes the venv's; default:
# Debian's /usr/bin/python3, the same version and headers).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
python_args=()
if [ -n "${SB_PYTHON:-}" ]; then python_args=("-DPython3_EXECUTABLE=$SB_PYTHON"); fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${python_args[@]}" "$@"
cmake --build "$BUILD_DIR" -j "$JOBS"
