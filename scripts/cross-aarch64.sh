#!/usr/bin/env bash
# Builds the whole project for 64-bit Arm Linux (aarch64: NVIDIA Grace in GH200/GB200 nodes,
# AWS Graviton) with Debian's cross compiler and arm64 libraries, warnings as errors, and runs
# on it, through qemu-user:
#  - sb-plan-digest: the 88 plans of bench/plan_digest.cc, compared line by line with the host's.
#    Plans must be the same bytes on every machine (planner/CMakeLists.txt: no contraction into
#    fused multiply-adds; det_math.h: exp and log computed, not the C library's), so a trainer's
#    local fallback on a Grace host plans what an x86-64 planner would;
#  - the test suites named in CROSS_TESTS (ctest regular expression; default: the planner's, the
#    contract's and the kernels' CPU reference, whose vector paths are x86-64 only).
# No GPU code (-DSB_WITH_CUDA=OFF) and no Python module. qemu runs the code 50-200x slower than
# the host: the digest takes about 30 minutes of one core here, so this is not part of
# scripts/test.sh; run it after changing anything with an #if on the architecture, intrinsics
# or floating-point flags. The first run installs about 400 MB of packages (2-3 minutes),
# adding arm64 to dpkg's architectures; the build takes about 12 minutes on 2 cores.
#   bash scripts/cross-aarch64.sh
#   CROSS_DIGEST=0 CROSS_TESTS='det_math|block_geometry' bash scripts/cross-aarch64.sh
set -euo pipefail
cd "$(dirname "$0")/.."

CROSS_BUILD_DIR=${CROSS_BUILD_DIR:-build-aarch64}
CROSS_DIGEST=${CROSS_DIGEST:-1}
CROSS_TESTS=${CROSS_TESTS:-'det_math|block_geometry|planner|sample_|sparsity_tuner|latency_model|recall_model|context_parallel|plan_threads|attention_cpu'}
HOST_BUILD_DIR=${HOST_BUILD_DIR:-build}

if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  dpkg --add-architecture arm64
  apt-get update -qq
fi
bash scripts/install-deps.sh  # the host's code generators (protoc, grpc_cpp_plugin), cmake
bash scripts/install-deps.sh g++-aarch64-linux-gnu qemu-user \
  libabsl-dev:arm64 libgrpc++-dev:arm64 libprotobuf-dev:arm64 libssl-dev:arm64 \
  libprometheus-cpp-core1.0:arm64 libprometheus-cpp-pull1.0:arm64 \
  libgtest-dev:arm64 libgmock-dev:arm64 libbenchmark-dev:arm64
# prometheus-cpp-dev is not co-installable across architectures: installing the arm64 one
# removes the host's (and the host's build then fails to configure). Its files are unpacked
# into the build directory instead, and found there.
prometheus_root="$PWD/$CROSS_BUILD_DIR/prometheus-cpp-dev"
if [ ! -f "$prometheus_root/usr/lib/aarch64-linux-gnu/cmake/prometheus-cpp/prometheus-cpp-config.cmake" ]; then
  mkdir -p "$prometheus_root"
  (cd "$prometheus_root" && apt-get download -q prometheus-cpp-dev:arm64 \
    libprometheus-cpp-core1.0:arm64 libprometheus-cpp-pull1.0:arm64 \
    libprometheus-cpp-push1.0:arm64 2>/dev/null &&
    for deb in ./*.deb; do dpkg -x "$deb" .; done && rm -f ./*.deb)
fi

cmake -S . -B "$CROSS_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DSB_WERROR=ON -DSB_WITH_CUDA=OFF \
  -DSB_BUILD_PYTHON=OFF \
  -Dprometheus-cpp_DIR="$prometheus_root/usr/lib/aarch64-linux-gnu/cmake/prometheus-cpp" \
  >/dev/null
cmake --build "$CROSS_BUILD_DIR" -j "$(nproc)"

status=0
if [ -n "$CROSS_TESTS" ]; then
  (cd "$CROSS_BUILD_DIR" && ctest --output-on-failure -j "$(nproc)" -R "$CROSS_TESTS") || status=1
fi
if [ "$CROSS_DIGEST" = "1" ]; then
  cmake -S . -B "$HOST_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$HOST_BUILD_DIR" --target sb-plan-digest
  "$HOST_BUILD_DIR/bench/sb-plan-digest" >"$CROSS_BUILD_DIR/digest-host.txt"
  qemu-aarch64 -L / "$CROSS_BUILD_DIR/bench/sb-plan-digest" \
    >"$CROSS_BUILD_DIR/digest-aarch64.txt"
  if diff "$CROSS_BUILD_DIR/digest-host.txt" "$CROSS_BUILD_DIR/digest-aarch64.txt"; then
    echo "cross-aarch64: the 88 plans are the same bytes on aarch64 as on this host"
  else
    echo "cross-aarch64: plans differ between aarch64 and this host (lines above)" >&2
    status=1
  fi
fi
exit $status
