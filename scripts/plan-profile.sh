#!/usr/bin/env bash
# Where planning spends its time, function by function: perf samples the CPU clock (the
# project's VM has no hardware counters, but software clock sampling works) while sb-plan-count
# plans the benchmarks' step (bench/pretrain_step.h) PLANS times on THREADS threads, and the
# functions are listed by the share of samples that landed in them (their own code, callees
# excluded). Unlike scripts/plan-instructions.sh's counts, this sees memory stalls: a change
# that cuts instructions may not cut time, and one that adds a few (a prefetch) may. Shares
# only: weigh a change's time with interleaved benchmark runs. About 10 s.
#   bash scripts/plan-profile.sh                       # 65,536 over 4,096 ranks, one thread
#   THREADS=2 TOP=40 bash scripts/plan-profile.sh
#   BUILD_DIR=build-lint bash scripts/plan-profile.sh
# PERF_DATA=file keeps the samples for `perf annotate -i file --stdio -s SYMBOL` (per
# instruction; without precise events a stall's samples land a few instructions after it).
# PLAN_COUNT=path/to/sb-plan-count skips the build. Installs perf (linux-perf) when it is
# missing; exits 77 when perf cannot sample here (perf_event_paranoid, a container).
set -euo pipefail
cd "$(dirname "$0")/.."

PLANS=${PLANS:-40}
THREADS=${THREADS:-1}
TOP=${TOP:-25}
PLAN_TOOLS="perf"
source scripts/plan-count-setup.sh

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
data=${PERF_DATA:-$out/perf.data}
if ! perf record -q -e cpu-clock -F 4000 -o "$data" "$PLAN_COUNT" --samples="$SAMPLES" \
  --ranks="$RANKS" --plans="$PLANS" --threads="$THREADS" >"$out/plan.txt" 2>"$out/perf.log"; then
  echo "perf cannot sample here:" >&2
  cat "$out/perf.log" >&2
  exit 77
fi
echo "share of CPU time by function, $SAMPLES samples over $RANKS ranks, $PLANS plans on" \
  "$THREADS thread(s) (the batch's set-up included):"
# Function signatures shortened: parameter lists dropped, lambdas kept by number.
perf report -i "$data" --no-children --sort symbol -g none 2>/dev/null | grep '%' |
  sed -E 's/\((std::vector|sparsebalance::|unsigned|int|long|double|absl|const)[^()]*(\([^()]*\)[^()]*)*\)//g; s/ +- +- *$//; s/  +/ /g' |
  cut -c1-150 | awk -v top="$TOP" 'NR <= top'
