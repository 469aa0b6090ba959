"""`splat-metal-doctor` as users run it: every kernel compiled and checked against the reference (on
CPU: the Metal kernels under the emulator, plus the native cpu backend), exit status 0."""

from __future__ import annotations

import os
import shutil
import subprocess


def test_doctor_passes_on_cpu():
    exe = shutil.which("splat-metal-doctor")
    assert exe, "the splat-metal-doctor console script is not installed (pip install -e .)"
    env = {**os.environ, "COLUMNS": "200"}  # rich wraps table cells at the terminal width
    res = subprocess.run(
        [exe, "--device", "cpu", "--size", "45x29"], capture_output=True, text=True, timeout=600, env=env
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "auto backend here: cpu" in res.stdout
    assert "rasterization (cpu)" in res.stdout and "MISMATCH" not in res.stdout
    assert "rasterize (tile 16, 3 channels, absgrad)" in res.stdout  # what training uses
    assert "sh (degree 4) " in res.stdout  # every SH degree gsplat supports, 0..4
    assert "sh (fused preparation with projection, degree 4, antialiased)" in res.stdout  # training's SH path
    assert "covariance + precision (triu, metal)" in res.stdout and "covariance + precision (3x3, cpu)" in res.stdout
    assert "l1 + ssim loss (metal)" in res.stdout  # the fused training loss (ops/metal/loss.py)
    assert "Metal pipelines" in res.stdout and "radix_scatter" in res.stdout  # each kernel's threadgroup limit
    passed, total = res.stdout.rsplit(" checks passed", 1)[0].rsplit("\n", 1)[-1].split("/")
    assert passed == total and int(total) >= 18, res.stdout
