#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (AddressSanitizer and UndefinedBehaviorSanitizer,
# undefined behaviour fatal) into $FUZZ_BUILD_DIR (default build-fuzz/) and runs each for
# FUZZ_SECONDS (default 30; scripts/test.sh sets 20 under CI):
#   wire_fuzzer      request validation (SubmitBatchRequest, JobConfig)
#   registry_fuzzer  whole RPC sequences on a JobRegistry over a PlanStore, with restarts;
#                    starts from the seeds in tests/fuzz/corpus/registry/
#   FUZZ_SECONDS=600 bash scripts/fuzz.sh                 # a longer run
#   FUZZ_TARGETS=registry_fuzzer bash scripts/fuzz.sh     # one target
#   FUZZ_BUILD_ONLY=1 bash scripts/fuzz.sh                # build them, run nothing
# The targets run side by side, one per core (FUZZ_JOBS, default nproc; 1 runs them in turn),
# each into $FUZZ_BUILD_DIR/<name>.log, printed when all have finished.
# A crash leaves its input in $FUZZ_BUILD_DIR/artifacts/; replay it with
#   REGISTRY_FUZZER_TRACE=1 $FUZZ_BUILD_DIR/tests/fuzz/registry_fuzzer FILE
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
FUZZ_BUILD_DIR=${FUZZ_BUILD_DIR:-build-fuzz}
FUZZ_SECONDS=${FUZZ_SECONDS:-30}
FUZZ_TARGETS=${FUZZ_TARGETS:-wire_fuzzer registry_fuzzer}
cmake -S . -B "$FUZZ_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined" \
  -DSB_BUILD_FUZZERS=ON -DSB_BUILD_TESTS=OFF -DSB_BUILD_BENCHMARKS=OFF >/dev/null
# shellcheck disable=SC2086  # FUZZ_TARGETS is a list
cmake --build "$FUZZ_BUILD_DIR" --target $FUZZ_TARGETS -j "$(nproc)"
mkdir -p "$FUZZ_BUILD_DIR/artifacts"
# FUZZ_BUILD_ONLY=1: build, run nothing (scripts/test.sh builds in the background, runs later).
if [ "${FUZZ_BUILD_ONLY:-0}" = "1" ]; then
  echo "fuzz.sh: built $FUZZ_TARGETS in $FUZZ_BUILD_DIR"
  exit 0
fi
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
FUZZ_JOBS=${FUZZ_JOBS:-$(nproc)}
fuzz_one() {  # target: runs it, its output into $FUZZ_BUILD_DIR/<name>.log
  local target=$1 name=${1%_fuzzer}
  local corpus="$FUZZ_BUILD_DIR/corpus/$name"  # new inputs go here, not into the repository
  mkdir -p "$corpus"
  local seeds=()
  if [ -d "tests/fuzz/corpus/$name" ]; then seeds=("tests/fuzz/corpus/$name"); fi
  "$FUZZ_BUILD_DIR/tests/fuzz/$target" -max_total_time="$FUZZ_SECONDS" -max_len=4096 \
    -timeout=10 -print_final_stats=1 -artifact_prefix="$FUZZ_BUILD_DIR/artifacts/$name-" \
    "$corpus" "${seeds[@]}" >"$FUZZ_BUILD_DIR/$name.log" 2>&1
}
pids=()
names=()
status=0
for target in $FUZZ_TARGETS; do
  echo "fuzz.sh: $target for ${FUZZ_SECONDS}s"
  fuzz_one "$target" &
  pids+=($!)
  names+=("${target%_fuzzer}")
  if [ "${#pids[@]}" -ge "$FUZZ_JOBS" ]; then
    wait "${pids[0]}" || status=1
    pids=("${pids[@]:1}")
  fi
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for name in "${names[@]}"; do cat "$FUZZ_BUILD_DIR/$name.log"; done
if [ "$status" -ne 0 ]; then
  echo "fuzz.sh: a target failed; its input is in $FUZZ_BUILD_DIR/artifacts/" >&2
  exit 1
fi
