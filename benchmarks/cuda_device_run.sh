#!/usr/bin/env bash
# The CUDA measurements (benchmarks/cuda_device_run.py) on a GPU machine that has no network.
#
#   bash benchmarks/cuda_device_run.sh --prepare   # here, once: wheels (benchmarks/cuda_carry.txt, cp312,
#                                                  # and this checkout's own, for its commands and entry
#                                                  # points) and the garden data into .cuda-carry/ (~26 MiB)
#   bash benchmarks/cuda_device_run.sh [ARGS]      # there, with .cuda-carry/ carried along: installs the
#                                                  # wheels into /tmp/splat-metal-site, runs the script,
#                                                  # results and run.log in $OUT (default benchmarks/results/cuda)
# ARGS go to cuda_device_run.py (e.g. --stages parity,overhead for a rerun).
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=.cuda-carry
PY=${PYTHON:-python3}

if [ "${1:-}" = --prepare ]; then
  set -e
  mkdir -p "$CARRY/wheels"
  platforms=""
  for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms="$platforms --platform ${p}_x86_64"
  done
  # shellcheck disable=SC2086
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
    -d "$CARRY/wheels" -r benchmarks/cuda_carry.txt
  # splat-metal itself: its console scripts (splat-metal-export) and nerfstudio entry points (ns-train
  # splat-metal); its code is imported from the checkout (PYTHONPATH below), so rebuild only when those change.
  rm -f "$CARRY"/wheels/splat_metal_method-*.whl
  $PY -m pip wheel -q --no-deps -w "$CARRY/wheels" .
  cp -f ../shared/data/garden_points.npz "$CARRY/"
  du -sh "$CARRY"
  exit 0
fi

OUT=${OUT:-$PWD/benchmarks/results/cuda}
mkdir -p "$OUT"
if compgen -G "$CARRY/wheels/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/splat-metal-site "$CARRY"/wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/splat-metal-site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/splat-metal-site/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # splat_metal_method from this checkout
export MAX_JOBS=${MAX_JOBS:-$(nproc)} WANDB_MODE=disabled HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# 590 s: inside the device tool's 600 s per command; the script's own --budget-s (540) ends it first.
timeout 590 "$PY" benchmarks/cuda_device_run.py --out "$OUT" "$@" 2>&1 | tee "$OUT/run.log"
