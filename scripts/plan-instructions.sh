#!/usr/bin/env bash
# Instructions per plan, phase by phase, counted by callgrind: the planning benchmarks' step
# (bench/pretrain_step.h: the pretrain trace, sparsebalance, 4 micro-batches of 131,072 tokens)
# planned PLANS times on one thread by sb-plan-count. Unlike wall time on this project's VM
# (which drifts by 10-30% within an hour), the counts are the same on every run, so a change to
# planning can be weighed exactly. Instructions are not all of a plan's time (it also waits on
# memory): scripts/plan-profile.sh shows where the time goes. About 20 s at the default size.
#   bash scripts/plan-instructions.sh                                  # 65,536 over 4,096 ranks
#   SAMPLES=16384 RANKS=1024 bash scripts/plan-instructions.sh
#   BUILD_DIR=build-lint bash scripts/plan-instructions.sh
# PLAN_COUNT=path/to/sb-plan-count skips the build. Installs valgrind when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PLANS=${PLANS:-3}
PLAN_TOOLS="valgrind callgrind_annotate"
source scripts/plan-count-setup.sh

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
valgrind --tool=callgrind --callgrind-out-file="$out/callgrind.out" "$PLAN_COUNT" \
  --samples="$SAMPLES" --ranks="$RANKS" --plans="$PLANS" --threads=1 2>"$out/valgrind.log"
callgrind_annotate --inclusive=yes --threshold=100 "$out/callgrind.out" >"$out/inclusive.txt" 2>/dev/null

echo "instructions per plan (millions), $SAMPLES samples over $RANKS ranks, mean of $PLANS:"
# Each phase's function (PlanPhaseSeconds' phases; the guards' sums are WarmRecalls and
# BucketBlockSums, which PlanStep runs beside the placement's sort and deal, so that the place
# phase's wall time holds them on two threads): its largest inclusive count, lambdas and the
# FunctionRef thunks left out. Every function is listed (--threshold=100): in a small step the
# guards' sums fall below callgrind_annotate's default cut.
for phase in "plan:sparsebalance::PlanStep(" "validate:sparsebalance::ValidateBatch(" \
  "table:sparsebalance::SampleTable::SampleTable(" "allocate:sparsebalance::AllocateDensities(" \
  "place:sparsebalance::AssignSamples(" "guards (recalls):sparsebalance::SampleTable::WarmRecalls(" \
  "guards (buckets):BucketBlockSums(" "tune:sparsebalance::TuneDensities(" \
  "build:sparsebalance::BuildPlan("; do
  name=${phase%%:*}
  function=${phase#*:}
  # The first match, read by awk alone: `grep | head -1` ends grep with SIGPIPE on a long
  # listing, which pipefail turns into the script's failure.
  count=$(awk -v f="$function" 'index($0, f) && !/lambda/ && !/InvokeObject/ {
    gsub(",", "", $1); print $1; exit }' "$out/inclusive.txt")
  awk -v name="$name" -v count="${count:-0}" -v plans="$PLANS" \
    'BEGIN { printf "  %-17s %8.2f\n", name, count / plans / 1e6 }'
done
