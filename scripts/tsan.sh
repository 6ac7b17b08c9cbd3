#!/usr/bin/env bash
# ThreadSanitizer over the code that runs on several threads: the planning threads, the
# service's reactors and long polls, restore on threads, the client's report streams and
# sessions, the worker's runner and shard exchange, and sb-load's clients against a real
# sb-planner (TSAN_LOAD=0 leaves those out).
# On 2 cores about 6 minutes without the worker's tests, the build included (their kernels'
# build under TSan adds several); run it after changing anything threaded.
# scripts/test.sh runs the part without gRPC (the planner's and the registry's tests, whose
# runs make no report at all) in about 3.
#   bash scripts/tsan.sh
#   TSAN_TESTS="tests/server/job_registry_test tests/planner/plan_threads_test" TSAN_LOAD=0 \
#     bash scripts/tsan.sh
#   TSAN_BUILD_ONLY=1 bash scripts/tsan.sh    # build what it would run, run nothing
# It builds into $TSAN_BUILD_DIR (default build-tsan/) with GCC's -fsanitize=thread, and runs
# each test with tests/tsan/absl_sync_tsan.cc preloaded: Debian's libabsl is built without
# TSan, so without it absl::Mutex would look like no synchronization at all. gRPC and protobuf
# are built without TSan too, and their own synchronization is invisible to it: a test makes
# hundreds of reports inside them. A report fails the script when one of its racing accesses
# starts in this project's code (its first frame outside the sanitizer's runtime); the others
# are only counted. Outputs and reports go to $TSAN_BUILD_DIR/tsan-logs/.
# Tests that wait on wall-clock deadlines may fail under TSan's 5-15x slowdown (a report's
# answer past its deadline, a local fallback): failed tests are listed, and fail the script
# only with TSAN_STRICT=1.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
TSAN_BUILD_DIR=${TSAN_BUILD_DIR:-build-tsan}
mkdir -p "$TSAN_BUILD_DIR"
TSAN_BUILD_DIR=$(cd "$TSAN_BUILD_DIR" && pwd)
TSAN_TESTS=${TSAN_TESTS:-"bench/sb-plan-digest tests/planner/plan_threads_test
  tests/planner/planner_test tests/planner/sample_table_test tests/planner/sample_assigner_test
  tests/planner/sparsity_tuner_test
  tests/server/job_registry_test tests/server/plan_store_test tests/server/registry_faults_test
  tests/server/planner_metrics_test tests/server/planner_service_test
  tests/server/sb_planner_test tests/server/sb_health_test tests/client/balancer_test
  tests/client/trainer_session_test tests/worker/micro_batch_runner_test
  tests/worker/shard_exchange_test tests/worker/step_sync_test"}
cmake -S . -B "$TSAN_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" -DSB_WITH_CUDA=OFF -DSB_BUILD_PYTHON=OFF \
  >/dev/null
TSAN_LOAD=${TSAN_LOAD:-1}
targets=()
if [ "$TSAN_LOAD" = "1" ]; then targets=(sb-load sb-planner); fi
for t in $TSAN_TESTS; do targets+=("$(basename "$t")"); done
cmake --build "$TSAN_BUILD_DIR" -j "$(nproc)" --target "${targets[@]}"
preload="$TSAN_BUILD_DIR/libabsl_sync_tsan.so"
c++ -std=c++17 -O1 -g -fPIC -shared -fsanitize=thread tests/tsan/absl_sync_tsan.cc -o "$preload" -ldl
# TSAN_BUILD_ONLY=1: build, run nothing (scripts/test.sh builds in the background, runs later).
if [ "${TSAN_BUILD_ONLY:-0}" = "1" ]; then
  echo "tsan.sh: built ${#targets[@]} targets in $TSAN_BUILD_DIR"
  exit 0
fi

logs="$TSAN_BUILD_DIR/tsan-logs"
rm -rf "$logs"
mkdir -p "$logs"
# The reports of a log whose racing accesses start in this project's sources: each pair of
# first frames once, with its count. Prints nothing when there is none. Left out: a reactor's
# OnDone (which deletes it) against one of its reactions (OnCancel, OnReadDone, ...) or its
# Finish, which gRPC orders before OnDone ("OnDone is called after all others",
# grpcpp/support/server_callback.h) through counters in libgrpc++ that TSan cannot see. An
# access after Finish has returned is not left out.
ours() {
  python3 - "$1" "$PWD/" <<'EOF'
import collections, re, sys
text = open(sys.argv[1], errors="replace").read()
root = sys.argv[2]
pairs = collections.Counter()
reaction = re.compile(r"#\d+ ((OnCancel|OnReadDone|OnWriteDone|OnWritesDoneDone) "
                      + re.escape(root) + r"|\S*Reactor\S*::Finish\(grpc::Status\))")
done = re.compile(r"#\d+ OnDone " + re.escape(root))
for report in text.split("WARNING: ThreadSanitizer")[1:]:
    firsts = []
    stacks = []
    for block in re.split(r"\n  (?=\S)", report)[1:]:
        if not re.match(r"(Write|Read|Previous|Atomic)", block):
            continue
        stacks.append(block)
        frames = [f for f in re.findall(r"#\d+ (.*)", block) if "libsanitizer" not in f]
        if frames:
            firsts.append(frames[0][:240])
    if len(stacks) == 2 and any(done.search(a) and reaction.search(b)
                                for a, b in (stacks, stacks[::-1])):
        continue
    if any(root in f for f in firsts):
        pairs[tuple(firsts)] += 1
for pair, count in pairs.items():
    print(f"  {count} report(s):")
    for frame in pair:
        print(f"    {frame}")
EOF
}

races=0
failed=()
# Each run's output goes to $logs/NAME.txt, and every process's reports (the test's and those of
# the sb-planner it starts) to $logs/NAME/report.PID. exitcode=0: a process keeps its own exit
# status, so that a failure is the test's and not TSan's (which exits 66 after any report).
run() {  # name, command...
  local name=$1 log="$logs/$1.txt" status=0
  shift
  mkdir -p "$logs/$name"
  LD_PRELOAD="$preload" \
    TSAN_OPTIONS="halt_on_error=0 history_size=4 exitcode=0 log_path=$logs/$name/report ${TSAN_OPTIONS:-}" \
    "$@" >"$log" 2>&1 || status=$?
  cat "$logs/$name"/report.* >"$logs/$name.reports" 2>/dev/null || true
  local all found
  all=$(grep -c "WARNING: ThreadSanitizer" "$logs/$name.reports" || true)
  found=$(ours "$logs/$name.reports")
  echo "tsan.sh: $name: exit $status, $all reports, $(if [ -n "$found" ]; then echo "RACES IN OURS:"; else echo "none in this project's code"; fi)"
  if [ -n "$found" ]; then
    echo "$found"
    races=1
  fi
  if [ "$status" -ne 0 ]; then failed+=("$name"); fi
}
for t in $TSAN_TESTS; do
  run "$(basename "$t")" timeout 1800 "$TSAN_BUILD_DIR/$t"
done
# sb-load's small runs against a real sb-planner (as ctest's sb_load_small and
# sb_load_batch_small): 8 clients' reports, steps, and nodes reporting by batch.
if [ "$TSAN_LOAD" = "1" ]; then
  run sb_load_small timeout 1800 "$TSAN_BUILD_DIR/bench/sb-load" \
    --sb_planner="$TSAN_BUILD_DIR/server/sb-planner" --clients=8 --reports=800 --ranks=64 \
    --samples=1024 --connections=8 --steps=2 --soak_steps=20 --soak_ranks=4
  run sb_load_batch_small timeout 1800 "$TSAN_BUILD_DIR/bench/sb-load" \
    --sb_planner="$TSAN_BUILD_DIR/server/sb-planner" --clients=8 --reports=800 --ranks=64 \
    --samples=1024 --connections=8 --steps=2 --step_seconds=0.2 --soak_steps=10 --soak_ranks=4 \
    --batch=8 --node_plans
fi
if [ "${#failed[@]}" -gt 0 ]; then
  echo "tsan.sh: failed under TSan (deadlines, see the logs in $logs): ${failed[*]}"
fi
if [ "$races" -ne 0 ]; then
  echo "tsan.sh: races in this project's code (logs: $logs)" >&2
  exit 1
fi
if [ "${TSAN_STRICT:-0}" = "1" ] && [ "${#failed[@]}" -gt 0 ]; then exit 1; fi
echo "tsan.sh: no race in this project's code"
