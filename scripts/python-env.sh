#!/usr/bin/env bash
# Creates (or updates) the project's Python virtual environment with the pinned PyPI packages of
# scripts/python-requirements.txt: current torch, numpy, pytest, build, scikit-build-core, grpcio.
# Idempotent: a stamp holding the requirements' checksum skips pip when nothing changed.
#
#   bash scripts/python-env.sh          # -> .venv (SB_VENV overrides), prints its interpreter
#
# Built on Debian's /usr/bin/python3 (python3-venv, python3-dev: scripts/install-deps.sh), so the
# extension compiles against the headers of the interpreter that runs it. A first install
# downloads about 3 GB (torch with its CUDA libraries): 3-4 min on the project's machines.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${SB_VENV:-.venv}
requirements=scripts/python-requirements.txt
stamp="$venv/.sb-requirements.sha256"
want=$(sha256sum "$requirements" | cut -d' ' -f1)

if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "python-env: $venv up to date" >&2
else
  start=$(date +%s)
  [ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
  echo "$want" >"$stamp"
  echo "python-env: $venv installed in $(( $(date +%s) - start )) s" >&2
fi
echo "$(cd "$venv" && pwd)/bin/python"
