#!/usr/bin/env bash
# The format and lint checks of the test command (scripts/test.sh runs this after the build):
#  1. clang-format (Google style, 100 columns: .clang-format) on every tracked C++/CUDA file;
#     `bash scripts/lint.sh --fix` rewrites them instead of failing.
#  2. clang-tidy (.clang-tidy: bug-prone patterns, needless copies, missing override, ...) on
#     the project's own sources (not tests), with $BUILD_DIR/compile_commands.json, and clang's
#     thread-safety analysis with it (-Wthread-safety: the ABSL_GUARDED_BY and
#     ABSL_*_LOCKS_REQUIRED annotations checked). About five minutes on 2 cores; LINT_TIDY=0
#     skips it (the format check still runs).
# Both use Debian's clang 14 tools (scripts/install-deps.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build-test}
mapfile -t cxx_files < <(git ls-files '*.h' '*.cc' '*.cu' '*.inc')

if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${cxx_files[@]}"
  echo "lint.sh: formatted ${#cxx_files[@]} files"
  exit 0
fi

if ! clang-format --dry-run --Werror "${cxx_files[@]}" 2>"$BUILD_DIR/format.log"; then
  grep "error:" "$BUILD_DIR/format.log" | cut -d: -f1 | sort -u | sed 's/^/  not formatted: /'
  echo "lint.sh: run 'bash scripts/lint.sh --fix' to format them" >&2
  exit 1
fi
echo "lint.sh: clang-format clean (${#cxx_files[@]} files)"

if [ "${LINT_TIDY:-1}" = "0" ]; then exit 0; fi
if [ ! -f "$BUILD_DIR/compile_commands.json" ]; then
  echo "lint.sh: $BUILD_DIR/compile_commands.json is missing: build first (scripts/build.sh)" >&2
  exit 1
fi
# C++ sources the build compiles, tests, fuzzers and CUDA excepted (clang-tidy 14 does not
# know CUDA 13's headers).
mapfile -t tidy_files < <(git ls-files '*.cc' | grep -v -E '^(tests|examples)/')
run-clang-tidy -quiet -p "$BUILD_DIR" -j "$(nproc)" -extra-arg=-Wthread-safety \
  "${tidy_files[@]/#/$PWD/}" \
  >"$BUILD_DIR/tidy.log" 2>&1 || {
  grep -E "(warning|error):" "$BUILD_DIR/tidy.log" | sort -u | head -n 40
  echo "lint.sh: clang-tidy found the problems above (full log: $BUILD_DIR/tidy.log)" >&2
  exit 1
}
echo "lint.sh: clang-tidy clean (${#tidy_files[@]} files)"
