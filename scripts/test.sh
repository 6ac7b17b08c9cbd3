#!/usr/bin/env bash
# Every test: installs what is missing, builds with warnings as errors into $BUILD_DIR
# (default build-test/, separate from the demo's build/), runs the whole CTest suite (unit,
# property and simulator-bar tests), then checks the demo command end to end.
set -euo pipefail
cd "$(dirname "$0")/.."

export BUILD_DIR=${BUILD_DIR:-build-test}
bash scripts/build.sh -DSB_WERROR=ON
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)"

# The installed package works for a project that uses it the way a trainer would.
rm -rf "$BUILD_DIR/install" "$BUILD_DIR/consumer"
cmake --install "$BUILD_DIR" --prefix "$BUILD_DIR/install" >/dev/null
cmake -S tests/consumer -B "$BUILD_DIR/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$(cd "$BUILD_DIR/install" && pwd)" >/dev/null
cmake --build "$BUILD_DIR/consumer" >/dev/null
"$BUILD_DIR/consumer/consumer"

# The planner benchmark must run (its figures are reported, never asserted).
"$BUILD_DIR/bench/sb-planner-bench" --benchmark_filter='/512/64' --benchmark_min_time=0.05

# The main job's simulator, short: it must run and print every policy.
out=$("$BUILD_DIR/sim/sb-sim" --steps=3 --ranks=8)
for p in sequential tokens flops sab dst sparsebalance; do
  grep -q "^$p " <<<"$out" || { echo "sb-sim output lacks policy $p" >&2; exit 1; }
done
echo "test.sh: all tests passed"
