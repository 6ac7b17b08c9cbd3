#!/usr/bin/env bash
# Builds the whole project for 64-bit Arm Linux (aarch64: NVIDIA Grace in GH200/GB200 nodes,
# AWS Graviton) with Debian's cross compiler and arm64 libraries, warnings as errors, and runs
# on it, through qemu-user:
#  - sb-plan-digest: the 88 plans of bench/plan_digest.cc, compared line by line with the host's.
#    Plans must be the same bytes on every machine (CMakeLists.txt: no contraction into fused
#    multiply-adds; det_math.h: exp and log computed, not the C library's), so a trainer's local
#    fallback on a Grace host plans what an x86-64 planner would;
#  - the test suites: every test matching CROSS_TESTS (a ctest regular expression; empty: all)
#    and not CROSS_EXCLUDE. Left out by default:
#      - the kernels' and the worker's longest runs (1-4 minutes each under qemu, which runs
#        vectorised float loops 50-100x slower), the simulator's and the end-to-end tests
#        (CROSS_EXCLUDE=... to run them);
#      - what qemu-user cannot run: the callgrind and perf scripts (host tools on the host's
#        binaries), and ChildProcessTest's program that cannot start (qemu emulates
#        posix_spawn's vfork as a fork, so the child's exec error never reaches the parent).
# No GPU code (-DSB_WITH_CUDA=OFF) and no Python module. Not part of scripts/test.sh; run it after
# changing anything with an #if on the architecture, intrinsics or floating-point flags.
# 2026-12-07 on 2 cores: the packages under a minute, the build about 6 minutes, the digest 6 s
# (0.6 s on the host), the default tests (493 of 563) about 5 minutes, all passing.
#   bash scripts/cross-aarch64.sh
#   CROSS_DIGEST=0 CROSS_TESTS='DetExp|ActiveBlocks' bash scripts/cross-aarch64.sh
#   CROSS_RUN_TESTS=0 bash scripts/cross-aarch64.sh    # the build and the digest alone
set -euo pipefail
cd "$(dirname "$0")/.."

CROSS_BUILD_DIR=${CROSS_BUILD_DIR:-build-aarch64}
CROSS_DIGEST=${CROSS_DIGEST:-1}
CROSS_TESTS=${CROSS_TESTS:-}
CROSS_EXCLUDE=${CROSS_EXCLUDE-'ShardAttention|MicroBatchRunner|LayerRunner|CudaKernelsTest|Simulator|S1Bars|EndToEnd|e2e|deploy_live|plan_instructions_script|plan_profile_script|AProgramThatCannotStartIsAnErrorNamingIt'}
CROSS_RUN_TESTS=${CROSS_RUN_TESTS:-1}
HOST_BUILD_DIR=${HOST_BUILD_DIR:-build}

if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  dpkg --add-architecture arm64
  apt-get update -qq
fi
bash scripts/install-deps.sh  # the host's code generators (protoc, grpc_cpp_plugin), cmake
bash scripts/install-deps.sh g++-aarch64-linux-gnu qemu-user qemu-user-binfmt \
  libabsl-dev:arm64 libgrpc++-dev:arm64 libprotobuf-dev:arm64 libssl-dev:arm64 \
  libprometheus-cpp-core1.0:arm64 libprometheus-cpp-pull1.0:arm64 \
  libgtest-dev:arm64 libgmock-dev:arm64 libbenchmark-dev:arm64
# prometheus-cpp-dev is not co-installable across architectures: installing the arm64 one
# removes the host's (and the host's build then fails to configure). Its files are unpacked
# into the build directory instead, and found there (apt warns that the download runs unsandboxed
# as root, since its user cannot write there: harmless).
prometheus_root="$PWD/$CROSS_BUILD_DIR/prometheus-cpp-dev"
if [ ! -f "$prometheus_root/usr/lib/aarch64-linux-gnu/cmake/prometheus-cpp/prometheus-cpp-config.cmake" ]; then
  mkdir -p "$prometheus_root"
  (cd "$prometheus_root" && apt-get download -q prometheus-cpp-dev:arm64 \
    libprometheus-cpp-core1.0:arm64 libprometheus-cpp-pull1.0:arm64 \
    libprometheus-cpp-push1.0:arm64 &&
    for deb in ./*.deb; do dpkg -x "$deb" .; done && rm -f ./*.deb)
fi

# Tests that start the project's programs (sb-planner, sb-profile, ...) start arm64 binaries: the
# kernel hands them to qemu once qemu-user-binfmt's entry is registered (it is not by itself in a
# container or a VM without systemd-binfmt).
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  [ -e /proc/sys/fs/binfmt_misc/register ] ||
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null || true
  cat /usr/lib/binfmt.d/qemu-aarch64.conf >/proc/sys/fs/binfmt_misc/register 2>/dev/null ||
    echo "cross-aarch64: cannot register qemu with binfmt_misc: tests that start programs fail" >&2
fi

cmake -S . -B "$CROSS_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DSB_WERROR=ON -DSB_WITH_CUDA=OFF \
  -DSB_BUILD_PYTHON=OFF \
  -Dprometheus-cpp_DIR="$prometheus_root/usr/lib/aarch64-linux-gnu/cmake/prometheus-cpp" \
  >/dev/null
cmake --build "$CROSS_BUILD_DIR" -j "$(nproc)"

status=0
if [ "$CROSS_RUN_TESTS" = "1" ]; then
  filters=()
  if [ -n "$CROSS_TESTS" ]; then filters+=(-R "$CROSS_TESTS"); fi
  if [ -n "$CROSS_EXCLUDE" ]; then filters+=(-E "$CROSS_EXCLUDE"); fi
  (cd "$CROSS_BUILD_DIR" && ctest --output-on-failure -j "$(nproc)" --timeout 900 "${filters[@]}") ||
    status=1
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
