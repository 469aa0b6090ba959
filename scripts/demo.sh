#!/usr/bin/env bash
# Sets everything up, generates the bundled demo scene, trains splat-metal on it with the demo
# preset (configs/demo.args) and exports the result as .ply, .splat and .spz in exports/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${SPLAT_METAL_VENV:-.venv}/bin/activate"
export WANDB_MODE=disabled
python -m splat_metal_method.data.demo_scene --out data/demo
# shellcheck disable=SC2046
ns-train splat-metal $(grep -v '^\s*#' configs/demo.args) --data data/demo --output-dir outputs "$@"
config=$(ls -t outputs/demo/splat-metal/*/config.yml | head -n 1)
splat-metal-export --load-config "$config" --output-dir exports/demo  # the .ply is ns-export's, byte for byte
echo "[demo] trained: $config"
echo "[demo] exported: exports/demo/splat.ply, splat.splat, splat.spz"
