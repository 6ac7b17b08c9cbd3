#!/usr/bin/env bash
# The GPU check, for a machine with an sm_90 GPU (H100/H200): one command that builds the CUDA
# kernels, runs every GPU test, the kernel benchmarks, a 2-rank NCCL sb-run when there are two
# devices, and measures a profile table. Meant for the few minutes a GPU is lent: it goes on
# after a failed step, so one run reports everything, and exits non-zero if any step failed.
#
#   bash scripts/gpu-check.sh                     # about 8 minutes on one H200 with 16 cores
#   GPU_CHECK_QUICK=1 bash scripts/gpu-check.sh   # tests and the 8K benchmarks only (~4 min)
#
# Without nvcc or without a visible device it says so and exits 0 (skipped), so it is safe on any
# machine. Results go to $GPU_CHECK_OUT (default $OUT when set, else $BUILD_DIR/gpu-check):
#   summary.md        what ran, pass/fail per step, the benchmark table (ms, TFLOP/s)
#   gpu.txt           nvidia-smi's view of the devices
#   *.log             each step's output
#   kernels_bench.json, device.profile (the planner's profile format), nccl-run/ (sb-run's out)
# The kernels run with SB_CUDA_LAUNCH_CHECKS=1: every launch waits for its stream, so a fault
# is reported by the kernel that made it. Needs the project's build dependencies
# (scripts/install-deps.sh); it does not install anything itself.
set -uo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build-gpu}
OUT_DIR=${GPU_CHECK_OUT:-${OUT:-$BUILD_DIR/gpu-check}}
QUICK=${GPU_CHECK_QUICK:-0}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
summary="$OUT_DIR/summary.md"
: >"$summary"
note() { echo "gpu-check: $*"; echo "$*" >>"$summary"; }
failed=()

if ! command -v nvcc >/dev/null 2>&1; then
  note "skipped: nvcc is not on PATH (the CUDA toolkit is needed to build the kernels)"
  exit 0
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >"$OUT_DIR/gpu.txt" 2>&1; then
  note "skipped: no CUDA device (nvidia-smi is missing or sees none)"
  exit 0
fi
devices=$(grep -c '^GPU' "$OUT_DIR/gpu.txt" || true)
if [ "${devices:-0}" -eq 0 ]; then
  note "skipped: no CUDA device (nvidia-smi -L lists none)"
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
  >>"$OUT_DIR/gpu.txt" 2>&1 || true
note "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
note ""
note "devices: $devices ($(sed -n 1p "$OUT_DIR/gpu.txt"))"

# Runs a step with a time limit; its output goes to $OUT_DIR/<name>.log.
step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  if timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1; then
    note "- $name: passed ($((SECONDS - start)) s)"
  else
    note "- $name: FAILED (exit $?, $((SECONDS - start)) s; see $name.log)"
    failed+=("$name")
  fi
}

targets=(cuda_kernels_test layer_runner_test sb-kernels-bench sb-profile)
if [ "$devices" -ge 2 ] && [ "$QUICK" != 1 ]; then targets+=(sb-run sb-worker sb-planner); fi
step configure 300 cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSB_WITH_CUDA=ON
step build 900 cmake --build "$BUILD_DIR" -j "$(nproc)" --target "${targets[@]}"
if [[ " ${failed[*]} " == *" build "* || " ${failed[*]} " == *" configure "* ]]; then
  tail -n 30 "$OUT_DIR/build.log" "$OUT_DIR/configure.log" 2>/dev/null
  exit 1
fi

export SB_CUDA_LAUNCH_CHECKS=1
# Every test of the device executor (the emulated twins already run in the test command).
step cuda_kernels_test 300 "$BUILD_DIR/tests/kernels/cuda_kernels_test" \
  --gtest_filter='*/Device.*:CudaBuildTest.*'
step layer_runner_test 300 "$BUILD_DIR/tests/kernels/layer_runner_test"

# Kernel benchmarks: selection alone, forward and backward on both paths (the scalar one up to
# 32K tokens), 32 heads x 128, densities 1.0 / 0.3 / 0.1.
filter='Cuda'
if [ "$QUICK" = 1 ]; then filter='Cuda.*/length:8192/'; fi
unset SB_CUDA_LAUNCH_CHECKS  # timing: no wait after each launch
step kernels_bench 420 "$BUILD_DIR/bench/sb-kernels-bench" --benchmark_filter="$filter" \
  --benchmark_min_time=0.2 --benchmark_out="$OUT_DIR/kernels_bench.json" \
  --benchmark_out_format=json
export SB_CUDA_LAUNCH_CHECKS=1

if [ "$QUICK" != 1 ]; then
  step profile 300 "$BUILD_DIR/kernels/sb-profile" --device=cuda --heads=32 --head_dim=128 \
    --lengths=8192,32768,131072 --densities=1,0.3,0.1 --repeats=3 --out="$OUT_DIR/device.profile"
  if [ "$devices" -ge 2 ]; then
    step nccl_run 300 "$BUILD_DIR/worker/sb-run" --device=cuda --workers=2 --steps=4 \
      --heads=8 --head_dim=128 --capacity=16384 --out="$OUT_DIR/nccl-run"
  else
    note "- nccl_run: not run (one device; the 2-rank NCCL run needs two)"
  fi
fi

# The benchmark table.
if [ -s "$OUT_DIR/kernels_bench.json" ]; then
  note ""
  note "| benchmark | ms | TFLOP/s (kept blocks) | TFLOP/s (dense equivalent) | active blocks |"
  note "|---|---|---|---|---|"
  python3 - "$OUT_DIR/kernels_bench.json" >>"$summary" <<'EOF'
import json, sys
for b in json.load(open(sys.argv[1])).get("benchmarks", []):
    if b.get("error_occurred"):
        print(f"| {b['name']} | error: {b.get('error_message', '')} | | | |")
        continue
    ms = b["real_time"] if b.get("time_unit") == "ms" else b["real_time"] / 1e6
    kept = b.get("TFLOPs_active_blocks", 0.0)
    dense = b.get("TFLOPs_dense_equivalent", 0.0)
    blocks = b.get("active_blocks", 0.0)
    print(f"| {b['name']} | {ms:.3f} | {kept:.1f} | {dense:.1f} | {blocks:.0f} |")
EOF
fi

note ""
if [ ${#failed[@]} -gt 0 ]; then
  note "FAILED: ${failed[*]}"
  exit 1
fi
note "all steps passed"
