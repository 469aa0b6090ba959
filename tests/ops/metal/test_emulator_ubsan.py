"""The UndefinedBehaviorSanitizer build of the emulator: a float-to-int conversion of NaN, inf or an
out-of-range value (undefined in C++ and MSL; x86 gives INT_MIN, an Apple GPU may saturate to INT_MAX)
ends the process instead of passing silently.

SPLAT_METAL_EMU_UBSAN=1 (and SPLAT_METAL_EMU_ASAN=1) builds every kernel library with
-fsanitize=float-cast-overflow,signed-integer-overflow,shift,bounds -fno-sanitize-recover=all. A report
exits the process, so everything runs in Python subprocesses: the non-finite input grid of
tests/ops/test_nonfinite.py through the Metal kernels, and a planted unguarded conversion.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splat_metal_method.ops.metal import runtime
from splat_metal_method.ops.metal.emulator import compile_library

ROOT = Path(__file__).resolve().parents[3]
KERNELS = Path(__file__).parent / "kernels" / "ubsan_tests.metal"
UB_REPORT = "runtime error:"


def ubsan_env() -> dict:
    env = dict(os.environ, SPLAT_METAL_EMU_UBSAN="1")
    env.pop("PYTEST_ADDOPTS", None)
    return env


PLANTED = """
import torch
from splat_metal_method.ops.metal import runtime
from splat_metal_method.ops.metal.emulator import compile_library
lib = compile_library(runtime.load_source({path!r}), "ubsan_tests")
x = torch.tensor([1.5, -2.5, {value}, 7.0])
out = torch.zeros(4, dtype=torch.int32)
lib.{kernel}(out, x, threads=4, group_size=4)
print("finished", out.tolist())
"""


def run_planted(kernel: str, value: str) -> subprocess.CompletedProcess:
    code = PLANTED.format(path=str(KERNELS), kernel=kernel, value=value)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ubsan_env(), capture_output=True, text=True)


@pytest.mark.parametrize("value", ["float('nan')", "float('inf')", "1e30", "-3e9"])
def test_unguarded_float_to_int_fails_under_ubsan(value):
    res = run_planted("float_to_int_unguarded", value)
    assert res.returncode != 0 and "finished" not in res.stdout, res.stdout + res.stderr[-3000:]
    assert UB_REPORT in res.stderr and "outside the range of representable values" in res.stderr, res.stderr[-3000:]


def test_guarded_float_to_int_passes_under_ubsan():
    res = run_planted("float_to_int_guarded", "float('nan')")
    assert res.returncode == 0 and "finished [1, -2, 0, 7]" in res.stdout, res.stdout + res.stderr[-3000:]


def test_unguarded_float_to_int_goes_unnoticed_without_ubsan():
    # The reason for the UBSan build: the normal build converts NaN to whatever the CPU gives.
    lib = compile_library(runtime.load_source(KERNELS), "ubsan_tests")
    out = torch.zeros(4, dtype=torch.int32)
    lib.float_to_int_unguarded(out, torch.tensor([1.5, -2.5, float("nan"), 7.0]), threads=4, group_size=4)
    assert out[[0, 1, 3]].tolist() == [1, -2, 7]  # out[2] is undefined (INT_MIN on x86)


def test_nonfinite_inputs_run_clean_under_ubsan():
    """Every non-finite and out-of-range input of the grid through the Metal kernels (projection, SH,
    tile intersection, sort, rasterization, forward and backward) without undefined behaviour."""
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly",
                          "tests/ops/test_nonfinite.py", "-k", "metal"],
                         cwd=ROOT, env=ubsan_env(), capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert UB_REPORT not in res.stdout + res.stderr, (res.stdout + res.stderr)[-4000:]
