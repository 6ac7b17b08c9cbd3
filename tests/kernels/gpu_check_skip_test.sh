#!/usr/bin/env bash
# scripts/gpu-check.sh on a machine without a GPU: it must say why it skips, write that to its
# summary and exit 0, with nvcc on PATH and without. Skipped (77) where a GPU is visible: there
# the check itself is what to run.
set -euo pipefail
root=$1
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "a GPU is visible: run scripts/gpu-check.sh itself"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
GPU_CHECK_OUT="$out/with" bash "$root/scripts/gpu-check.sh" >"$out/with.log"
grep -q "^gpu-check: skipped: " "$out/with.log"
grep -q "^skipped: " "$out/with/summary.md"
# Without nvcc (a PATH without the CUDA toolkit).
PATH=/usr/bin:/bin GPU_CHECK_OUT="$out/without" bash "$root/scripts/gpu-check.sh" >"$out/without.log"
grep -q "^gpu-check: skipped: nvcc is not on PATH" "$out/without.log"
echo "gpu-check.sh skips cleanly without a device"
