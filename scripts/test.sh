#!/usr/bin/env bash
# Every test: installs what is missing, builds with warnings as errors into $BUILD_DIR
# (default build-test/, separate from the demo's build/), checks format and lint
# (scripts/lint.sh), runs the whole CTest suite (unit, property, simulator-bar, service, client
# and command-line tests), builds a project against the installed package, runs both fuzzers
# briefly, runs the planner's and the registry's threaded tests under ThreadSanitizer
# (scripts/tsan.sh), and runs the planning benchmark and the service load generator once,
# briefly. Each phase's time is printed as it ends, and all of them at the end.
#
# Work whose result is needed only later runs in the background at the lowest priority (nice
# 19), taking only the CPU the foreground leaves: the ThreadSanitizer and fuzzer builds beside the
# venv's download and the main build, the lint beside CTest. Each is waited for, and its log
# printed if it failed, where its result is needed. Measured on a fresh clone (2 cores), this
# saves about 100 s: the venv's download leaves the CPU idle, but CTest keeps both cores busy
# and most of the lint still runs after it.
set -euo pipefail
cd "$(dirname "$0")/.."

export BUILD_DIR=${BUILD_DIR:-build-test}
mkdir -p "$BUILD_DIR"
# Each phase's wall time, printed as it ends ("test.sh: build took 512 s") and summed at the end:
# where the 40-minute budget goes.
phase_start=$SECONDS
phases=""
phase_done() {
  local took=$((SECONDS - phase_start))
  echo "test.sh: $1 took $took s"
  phases="$phases $1=${took}s"
  phase_start=$SECONDS
}
# Background jobs run in sessions of their own (setsid), so that one still running when this
# script ends (a failure, or a signal) is stopped with everything it started. A new session is a
# new scheduler autogroup (Linux's default), which shares the CPU equally with this one whatever
# its processes' nice: measured, two nice-19 loops in their own sessions took 68% of a core each
# against 33% for two plain ones. So the autogroup is niced too (2-3% each then).
background=()
background_low() {  # log, command...: runs the command in the background at the lowest priority
  local log=$1
  shift
  setsid -w bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null || true; exec nice -n 19 "$@"' \
    low "$@" >"$log" 2>&1 &
  background+=("$!")
}
stop_background() {
  for pid in "${background[@]}"; do kill -- "-$pid" 2>/dev/null || true; done
}
trap stop_background EXIT
trap 'exit 130' INT TERM
# Waits for background job $1; on failure prints the last lines of log $2 and fails.
wait_for() {
  local pid=$1 log=$2
  if ! wait "$pid"; then
    tail -n 60 "$log"
    echo "test.sh: failed, see $log" >&2
    exit 1
  fi
}

# The planner's and the registry's threaded tests, which make no report at all under TSan.
tsan_tests="bench/sb-plan-digest tests/planner/plan_threads_test tests/planner/planner_test
  tests/planner/sample_table_test tests/planner/sample_assigner_test
  tests/planner/sparsity_tuner_test tests/server/job_registry_test tests/server/plan_store_test
  tests/server/registry_faults_test"

bash scripts/install-deps.sh
side_log="$BUILD_DIR/side-builds.log"
background_low "$side_log" env TSAN_BUILD_ONLY=1 TSAN_LOAD=0 TSAN_TESTS="$tsan_tests" \
  FUZZ_BUILD_ONLY=1 bash -c 'bash scripts/tsan.sh && bash scripts/fuzz.sh'
side_builds=${background[-1]}
# The Python tests run on current torch from PyPI, in .venv (a first install: about 2 min).
SB_PYTHON=$(bash scripts/python-env.sh)
export SB_PYTHON
phase_done "install"
# Line tables only (-g1, not -g): backtraces and sanitizer reports keep file and line, and the
# build takes about a quarter less (pybind11's and gRPC's templates spend that on debug info).
bash scripts/build.sh -DSB_WERROR=ON "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
phase_done "build"
# Format (clang-format) and lint (clang-tidy) checks, beside CTest; scripts/lint.sh says how to
# fix what they find.
lint_log="$BUILD_DIR/lint.log"
background_low "$lint_log" bash scripts/lint.sh
lint=${background[-1]}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)"
phase_done "ctest"
wait_for "$lint" "$lint_log"
cat "$lint_log"
phase_done "lint-rest"

# The installed package works for a project that uses it the way a trainer would.
rm -rf "$BUILD_DIR/install" "$BUILD_DIR/consumer"
cmake --install "$BUILD_DIR" --prefix "$BUILD_DIR/install" >/dev/null
cmake -S tests/consumer -B "$BUILD_DIR/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$(cd "$BUILD_DIR/install" && pwd)" >/dev/null
cmake --build "$BUILD_DIR/consumer" >/dev/null
# ... against the installed sb-planner, on a free port (the consumer's Balancer flow).
consumer_state=$(mktemp -d)
"$BUILD_DIR/install/bin/sb-planner" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
  --state_dir="$consumer_state/state" >"$consumer_state/log" 2>&1 &
consumer_planner=$!
planner_address=""
for _ in $(seq 100); do
  planner_address=$(grep -o 'listening on [0-9.]*:[0-9]*' "$consumer_state/log" | head -n 1 |
                    cut -d' ' -f3 || true)
  [ -n "$planner_address" ] && break
  sleep 0.1
done
consumer_rc=0
"$BUILD_DIR/consumer/consumer" "$planner_address" || consumer_rc=$?
kill "$consumer_planner"; wait "$consumer_planner" || true
rm -rf "$consumer_state"
[ "$consumer_rc" -eq 0 ] || { echo "test.sh: the consumer failed"; exit 1; }
phase_done "consumer"

# Request validation and whole call sequences through the registry and the store under
# libFuzzer (clang, AddressSanitizer and UndefinedBehaviorSanitizer), briefly: 20 s per target in
# CI, 30 s otherwise; FUZZ_SECONDS overrides, scripts/fuzz.sh alone runs them longer.
if [ "${CI:-}" = "true" ]; then export FUZZ_SECONDS=${FUZZ_SECONDS:-20}; fi
wait_for "$side_builds" "$side_log"
grep -E "^(tsan|fuzz).sh: built" "$side_log"
phase_done "side-builds-rest"
fuzz_log="$BUILD_DIR/fuzz.log"
bash scripts/fuzz.sh >"$fuzz_log" 2>&1 || { tail -n 60 "$fuzz_log"; exit 1; }
grep -E "^fuzz.sh|stat::number_of_executed_units" "$fuzz_log"
phase_done "fuzz"

# ThreadSanitizer over the planning threads (sb-plan-digest plans its 88 cases on 2 threads)
# and the registry (restore on threads): the tests that run no gRPC, whose TSan runs report
# nothing at all. About 3 minutes; scripts/tsan.sh alone also runs the service's and the
# client's tests and sb-load against a real sb-planner.
tsan_log="$BUILD_DIR/tsan.log"
TSAN_LOAD=0 TSAN_TESTS="$tsan_tests" bash scripts/tsan.sh >"$tsan_log" 2>&1 ||
  { tail -n 60 "$tsan_log"; exit 1; }
grep "^tsan.sh" "$tsan_log"
phase_done "tsan"

# The planner benchmark must run (its figures are reported, never asserted).
"$BUILD_DIR/bench/sb-planner-bench" --benchmark_filter='/512/64' --benchmark_min_time=0.05
# The service load generator, briefly (README "Service load" has the full-size figures).
"$BUILD_DIR/bench/sb-load" --reports=8000 --steps=3 --soak_steps=300

phase_done "bench"
echo "test.sh: all tests passed in $SECONDS s:$phases"
