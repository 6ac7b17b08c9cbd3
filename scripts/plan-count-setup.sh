# Sourced by plan-instructions.sh and plan-profile.sh (from the project root): the step's size
# and the sb-plan-count binary they run. Installs the project's packages when any of the tools
# named in $PLAN_TOOLS is missing, and builds sb-plan-count in $BUILD_DIR unless $PLAN_COUNT
# names one.
BUILD_DIR=${BUILD_DIR:-build}
SAMPLES=${SAMPLES:-65536}
RANKS=${RANKS:-4096}
for tool in $PLAN_TOOLS; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    bash scripts/install-deps.sh
    break
  fi
done
if [ -z "${PLAN_COUNT:-}" ]; then
  cmake --build "$BUILD_DIR" --target sb-plan-count >/dev/null
  PLAN_COUNT="$BUILD_DIR/bench/sb-plan-count"
fi
