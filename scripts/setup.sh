#!/usr/bin/env bash
# Sets up everything splat-metal needs on a fresh Linux or macOS machine: system libraries
# (Debian/Ubuntu: g++ for the native CPU backend, libusb for ns-export's open3d import, chromium for
# the viewer tests, ffmpeg, which ns-render requires even for image output, tmux for the terminal-screen
# test; extra Debian packages
# may be named as arguments, e.g. `bash scripts/setup.sh clang`), a virtual
# environment in .venv (override with SPLAT_METAL_VENV) and this package with its test extras.
# Safe to re-run: it skips what is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPLAT_METAL_VENV:-.venv}
PYTHON=${PYTHON:-python3}

# Supported Pythons (= pyproject.toml's requires-python; 3.13: nerfstudio 1.1.5 needs numpy<2, which
# has no cp313 wheels). Checked first, so nothing is half-installed; `--check-python` stops after it.
SUPPORTED_PYTHONS="3.10 3.11 3.12"
py=$PYTHON; [ -x "$VENV/bin/python" ] && py=$VENV/bin/python
version=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || version=""
case " $SUPPORTED_PYTHONS " in
  *" ${version:-none} "*) ;;
  *) echo "[setup] $py is ${version:+Python }${version:-not a working Python}; splat-metal supports Python ${SUPPORTED_PYTHONS// /, }." >&2
     echo "[setup] Run again with one of them, e.g. PYTHON=python3.12 bash scripts/setup.sh${version:+ (after removing $VENV if it was made with $py)}" >&2
     exit 1 ;;
esac
[ "${1:-}" = --check-python ] && { echo "[setup] Python $version ($py): supported"; exit 0; }

if [ "$(uname -s)" = Darwin ]; then
  [ "$(uname -m)" = arm64 ] || { echo "[setup] splat-metal needs an Apple Silicon Mac: PyTorch has no Intel-Mac wheels of torch >= 2.7" >&2; exit 1; }
  macos=$(sw_vers -productVersion)
  [ "${macos%%.*}" -ge 13 ] || { echo "[setup] splat-metal needs macOS 13 or later (this is $macos)" >&2; exit 1; }
fi

if [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  wanted=(g++ libusb-1.0-0 chromium chromium-driver ffmpeg tmux colmap)
  # Node and npm for PlayCanvas's tools below, only when there is no npm (a NodeSource nodejs carries
  # its own npm and conflicts with Debian's npm package).
  command -v npm >/dev/null 2>&1 || wanted+=(nodejs npm)
  for pkg in "${wanted[@]}" "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    echo "[setup] apt-get install ${missing[*]}"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"

# torch builds known to work with nerfstudio 1.1.5 and torchvision on each platform (docs/design.md section 3.3).
pinfile=constraints.txt
case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) torch_pkgs="torch==2.14.1 torchvision==0.29.1"; pins="-c constraints.txt" ;;
  Linux-aarch64) torch_pkgs="torch==2.9.1 torchvision==0.24.1"; pins="-c constraints.txt" ;;
  # Apple Silicon: wheels only (no compiler, no source builds); torch and everything else pinned in
  # constraints-macos-arm64.txt, which scripts/resolve_macos.py generates.
  Darwin-arm64) torch_pkgs=""; pinfile=constraints-macos-arm64.txt; pins="--only-binary=:all: -c $pinfile" ;;
  *) torch_pkgs="torch>=2.7 torchvision"; pins="" ;;
esac

# Re-install only when the dependency description changed.
stamp="$VENV/.splat-metal-installed"
want=$(cat pyproject.toml "$pinfile" scripts/setup.sh | cksum)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q --upgrade pip
  echo "[setup] pip install ${torch_pkgs:-torch (versions in $pinfile)}, nerfstudio and splat-metal (a few minutes the first time)"
  # shellcheck disable=SC2086
  [ -z "$torch_pkgs" ] || python -m pip install -q $torch_pkgs
  # shellcheck disable=SC2086
  python -m pip install -q -e ".[test]" $pins
  echo "$want" > "$stamp"
fi

# PlayCanvas's own tools for the export tests (tests/test_export_playcanvas.py): splat-transform decodes
# our .sog / .compressed.ply and writes them from our .ply; SuperSplat's viewer renders them in
# Chromium. Pinned: splat-transform 3.x needs Node >= 22. Into .npm-tools (gitignored), once.
# The .glb's (tests/export/test_export_glb.py): Khronos' glTF-Validator, and the PlayCanvas engine and
# Babylon.js, whose glTF loaders draw KHR_gaussian_splatting in Chromium.
NPM_TOOLS="@playcanvas/splat-transform@2.7.1 @playcanvas/supersplat-viewer@1.36.2 gltf-validator@2.0.0-dev.3.10 \
playcanvas@2.23.3 babylonjs@9.28.0 babylonjs-loaders@9.28.0"
if command -v npm >/dev/null 2>&1 && [ "$(cat .npm-tools/.installed 2>/dev/null)" != "$NPM_TOOLS" ]; then
  echo "[setup] npm install $NPM_TOOLS (into .npm-tools)"
  mkdir -p .npm-tools
  [ -f .npm-tools/package.json ] || echo '{"private": true}' > .npm-tools/package.json
  # shellcheck disable=SC2086
  (cd .npm-tools && npm install --no-audit --no-fund --loglevel=error $NPM_TOOLS >/dev/null) \
    && echo "$NPM_TOOLS" > .npm-tools/.installed
fi

# Newer viewers (tests/export/test_export_viewers_*.py, tests/web_viewers.py), into .npm-tools-node22
# (gitignored) beside the tools above: splat-transform 3.x, which needs Node >= 22 (npm's `node`
# package puts a Node 22 binary in .npm-tools-node22/node_modules/.bin, used for it alone) and has
# the same package name as 2.7.1; Spark with the three.js it runs on; CesiumJS (3D Tiles).
# Pinned; about 20 s and 640 MB (CesiumJS is most of it) the first time, nothing when in place.
NODE22_TOOLS="node@22.23.3 @playcanvas/splat-transform@3.10.2 @sparkjsdev/spark@2.2.0 three@0.187.0 cesium@1.145.0"
if command -v npm >/dev/null 2>&1 && [ "$(cat .npm-tools-node22/.installed 2>/dev/null)" != "$NODE22_TOOLS" ]; then
  echo "[setup] npm install $NODE22_TOOLS (into .npm-tools-node22)"
  mkdir -p .npm-tools-node22
  [ -f .npm-tools-node22/package.json ] || echo '{"private": true}' > .npm-tools-node22/package.json
  # shellcheck disable=SC2086
  (cd .npm-tools-node22 && npm install --no-audit --no-fund --loglevel=error $NODE22_TOOLS >/dev/null) \
    && echo "$NODE22_TOOLS" > .npm-tools-node22/.installed
fi
