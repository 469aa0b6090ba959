"""Runs part of the kernel suite in a subprocess under another build of the emulator (fp contraction, the
threadgroup switch): the build is chosen by environment when a library is compiled, and this process's
libraries are the default build, so the suite runs in a fresh pytest (one process, a fixed schedule seed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]


def run_suite_under_build(build_env: Dict[str, str], suite: List[str]) -> subprocess.CompletedProcess:
    """``pytest -q -x`` on ``suite`` (paths, node ids, -k/--deselect options) with ``build_env`` set and the
    schedule seed fixed (SPLAT_METAL_EMU_SEED=0); the libraries are cached by their build flags."""
    env = dict(os.environ, SPLAT_METAL_EMU_SEED="0", **build_env)
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-p", "no:randomly",
         *suite],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
