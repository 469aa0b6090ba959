#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh clang  # clang: the native CPU backend is also built and checked with it (macOS's compiler)
. "${SPLAT_METAL_VENV:-.venv}/bin/activate"
# Training and tests never touch the network (LPIPS weights, wandb, ...).
export WANDB_MODE=disabled HF_HUB_OFFLINE=1
python -m pytest "$@"
