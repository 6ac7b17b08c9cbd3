#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (AddressSanitizer on) into $FUZZ_BUILD_DIR
# (default build-fuzz/) and runs each for FUZZ_SECONDS (default 30; CI uses the default).
#   FUZZ_SECONDS=600 bash scripts/fuzz.sh      # a longer run
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
FUZZ_BUILD_DIR=${FUZZ_BUILD_DIR:-build-fuzz}
FUZZ_SECONDS=${FUZZ_SECONDS:-30}
cmake -S . -B "$FUZZ_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address" \
  -DSB_BUILD_FUZZERS=ON -DSB_BUILD_TESTS=OFF -DSB_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$FUZZ_BUILD_DIR" --target wire_fuzzer -j "$(nproc)"
corpus="$FUZZ_BUILD_DIR/corpus/wire"
mkdir -p "$corpus"
"$FUZZ_BUILD_DIR/tests/fuzz/wire_fuzzer" -max_total_time="$FUZZ_SECONDS" -max_len=4096 \
  -print_final_stats=1 "$corpus"
