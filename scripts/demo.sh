#!/usr/bin/env bash
# The main job: builds SparseBalance, then runs sb-sim on scenario S1 (the pretrain trace on
# 32 ranks x 4 micro-batches of 128K tokens, 85% full) with every policy side by side, and
# writes the report to out/ (JSON and an SVG timeline).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
bash scripts/build.sh >/dev/null
mkdir -p out
echo "== sb-sim, scenario S1 (sb-sim --help explains the flags and models) =="
"$BUILD_DIR/sim/sb-sim" --trace=pretrain --ranks=32 --micro-batches=4 --capacity=131072 \
  --fill=0.85 --steps=30 --json=out/sim_s1.json --svg=out/sim_s1.svg
echo
echo "== the same with one rank 1.5x slower (no policy is told which) =="
"$BUILD_DIR/sim/sb-sim" --trace=pretrain --ranks=32 --steps=30 --slow-ranks=1 \
  --policies=sequential,flops,sab,sparsebalance --svg=out/sim_s1_slow.svg
