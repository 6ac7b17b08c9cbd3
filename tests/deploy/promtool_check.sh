#!/usr/bin/env bash
# promtool on deploy/prometheus: the configuration and the rules parse, and the rules' unit tests
# (rules_test.yml: each alert firing and quiet) pass. Skipped (77) without promtool.
set -euo pipefail
deploy=${1:?usage: promtool_check.sh DEPLOY_DIR}
if ! command -v promtool >/dev/null 2>&1; then
  echo "SKIPPED: promtool not found (Debian package prometheus; scripts/install-deps.sh installs it)"
  exit 77
fi
cd "$deploy/prometheus"
promtool check config prometheus.yml
promtool check rules rules.yml
promtool test rules rules_test.yml
