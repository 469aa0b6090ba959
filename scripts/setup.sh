#!/usr/bin/env bash
# Sets up everything splat-metal needs on a fresh Linux or macOS machine: system libraries
# (Debian/Ubuntu: g++ for the native CPU backend, libusb for ns-export's open3d import, chromium for
# the viewer tests, ffmpeg, which ns-render requires even for image output; extra Debian packages
# may be named as arguments, e.g. `bash scripts/setup.sh clang`), a virtual
# environment in .venv (override with SPLAT_METAL_VENV) and this package with its test extras.
# Safe to re-run: it skips what is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPLAT_METAL_VENV:-.venv}
PYTHON=${PYTHON:-python3}

if [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  for pkg in g++ libusb-1.0-0 chromium chromium-driver ffmpeg "$@"; do
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

# Re-install only when the dependency description changed.
stamp="$VENV/.splat-metal-installed"
want=$(cat pyproject.toml constraints.txt scripts/setup.sh | cksum)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q --upgrade pip
  # torch builds known to work with nerfstudio 1.1.5 and torchvision on each platform (DESIGN.md).
  case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) torch_pkgs="torch==2.14.1 torchvision==0.29.1"; pins="-c constraints.txt" ;;
    Linux-aarch64) torch_pkgs="torch==2.9.1 torchvision==0.24.1"; pins="-c constraints.txt" ;;
    *) torch_pkgs="torch>=2.7 torchvision"; pins="" ;;  # macOS arm64: PyPI's MPS-enabled builds
  esac
  echo "[setup] pip install $torch_pkgs, nerfstudio and splat-metal (a few minutes the first time)"
  # shellcheck disable=SC2086
  python -m pip install -q $torch_pkgs
  # shellcheck disable=SC2086
  python -m pip install -q -e ".[test]" $pins
  echo "$want" > "$stamp"
fi
