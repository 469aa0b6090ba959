#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite. Extra arguments go to pytest:
# `bash scripts/test.sh -m "not slow"` is the fast tier (the slow list is in tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh clang  # clang: the native CPU backend is also built and checked with it (macOS's compiler)
. "${SPLAT_METAL_VENV:-.venv}/bin/activate"
# Training and tests never touch the network (LPIPS weights, wandb, ...).
export WANDB_MODE=disabled HF_HUB_OFFLINE=1
# Lint and format first (a few seconds; pyproject.toml [tool.ruff]): a violation fails the run.
ruff check . && ruff format --check --quiet . || { echo "[test] ruff found violations: run 'ruff check --fix . && ruff format .'" >&2; exit 1; }
# Two workers (pytest-xdist), one test file at a time each: most end-to-end tests wait on subprocesses,
# browsers and single-threaded start-up, and a module's fixtures stay in one worker. The finished demo
# runs are shared by both (tests/demo_runs.py). SPLAT_METAL_TEST_WORKERS=0: one process, as before.
# pytest's exit code 5 means no test ran (a -m or -k that matches nothing, a wrong path): a failure too.
rc=0
python -m pytest -n "${SPLAT_METAL_TEST_WORKERS:-2}" --dist loadfile "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "[test] no tests ran: check the arguments given to pytest ($*)" >&2
  exit 1
fi
exit "$rc"
