"""The fp-contraction build of the emulator (SPLAT_METAL_EMU_FP_CONTRACT=1: -ffp-contract=fast -mfma, compiled as
MSL 3.1, where common.h's `fp contract(off)` pragma does not exist): what Apple's compiler may do to the kernels
on macOS 14 and older, where multiply-adds may be fused. A threshold comparison (the 1/255 alpha cut, the
transmittance stop) could then flip between the forward and the backward kernels.

- Planted: ``a * a - 1`` at a = 1 + 2^-12 gives the fused (exactly rounded) result in this build and the
  unfused one in the default build, so the build does contract.
- The forward and backward kernel comparisons (every projection, SH, intersection, rasterizer and public-API
  test of test_forward_kernels.py and test_backward_kernels.py, the garden ones included: the real scene's
  pixels on the thresholds) pass under it at a fixed schedule seed, in a subprocess (the build is chosen when
  a library is compiled).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from splat_metal_method.ops.metal.emulator import compile_library

ROOT = Path(__file__).resolve().parents[3]
MAD = """#include <metal_stdlib>
using namespace metal;
kernel void mad(device float* out [[buffer(0)]], device const float* a [[buffer(1)]],
                uint i [[thread_position_in_grid]]) {
  out[i] = a[i] * a[i] - 1.0f;  // fused: one rounding; unfused: a*a rounds first and loses 2^-24
}
"""
SUITE = ["tests/ops/metal/test_forward_kernels.py", "tests/ops/metal/test_backward_kernels.py"]


def _mad(lib) -> float:
    a = torch.tensor([1.0 + 2.0**-12], dtype=torch.float32)
    out = torch.zeros(1)
    lib.mad(out, a, threads=1, group_size=1)
    return out.item()


def test_the_build_fuses_multiply_adds(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLAT_METAL_CACHE_DIR", str(tmp_path))
    exact = float(torch.tensor(1.0 + 2.0**-12, dtype=torch.float64) ** 2 - 1.0)  # 2^-11 + 2^-24
    monkeypatch.delenv("SPLAT_METAL_EMU_FP_CONTRACT", raising=False)
    unfused = _mad(compile_library(MAD, "mad.metal"))
    monkeypatch.setenv("SPLAT_METAL_EMU_FP_CONTRACT", "1")
    fused = _mad(compile_library(MAD, "mad.metal"))
    assert unfused == 2.0**-11, "the default build rounds a * a first (-ffp-contract=off)"
    assert fused == exact != unfused, "the fp-contraction build should fuse the multiply-add"


def test_kernel_comparisons_hold_under_fp_contraction(tmp_path):
    env = dict(os.environ, SPLAT_METAL_EMU_FP_CONTRACT="1", SPLAT_METAL_EMU_SEED="0",
               SPLAT_METAL_CACHE_DIR=str(tmp_path))  # fmt: skip
    env.pop("PYTEST_ADDOPTS", None)
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *SUITE],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert " passed" in res.stdout, res.stdout[-2000:]
