#!/usr/bin/env bash
# The main job: installs what is missing, builds SparseBalance, then runs sb-run: sb-planner
# with its embedded defaults (127.0.0.1:50151, state in ./sb-planner-state), 4 CPU sb-worker
# ranks running real block-sparse attention, the same short run twice (sequential, then
# sparsebalance) and a side-by-side summary of what the workers measured. Writes
# out/main-job/ (summary, per-step lines, timeline.svg). Then the simulator's S1 table.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
bash scripts/build.sh >/dev/null
mkdir -p out
echo "== the main job: sb-planner + 4 CPU workers, sequential vs sparsebalance (sb-run --help) =="
"$BUILD_DIR/worker/sb-run" --out=out/main-job
echo
echo "== sb-sim, scenario S1 at cluster scale (sb-sim --help explains the flags and models) =="
"$BUILD_DIR/sim/sb-sim" --trace=pretrain --ranks=32 --micro_batches=4 --capacity=131072 \
  --fill=0.85 --steps=30 --json=out/sim_s1.json --svg=out/sim_s1.svg
