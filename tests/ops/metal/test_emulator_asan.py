"""The AddressSanitizer build of the emulator: an index past a buffer fails instead of reading neighbours.

SPLAT_METAL_EMU_ASAN=1 builds every kernel library with -fsanitize=address (and the UBSan checks of
test_emulator_ubsan.py, which catch an index past a fixed-size array first). A Python process can load
such a library only if the compiler's ASan runtime was preloaded (LD_PRELOAD, library.asan_preload()),
so everything here runs in Python subprocesses: part of the kernel suite (the emulator's own kernels,
with fibers, simdgroups, atomics and threadgroup memory, the whole Metal pipeline forward and
backward against the reference, and the fused training loss), and two planted out-of-bounds kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splat_metal_method.ops.metal import runtime
from splat_metal_method.ops.metal.emulator import EmulatorError, compile_library, library

ROOT = Path(__file__).resolve().parents[3]
KERNELS = Path(__file__).parent / "kernels"
SUITE = [  # the part of the kernel tests that also runs under ASan (the emulator tests that run kernels)
    "tests/ops/metal/test_emulator.py",
    "-k",
    "not cache_hit and not runtime_seam and not compile_error and not swizzle",
    "tests/ops/metal/test_forward_kernels.py::test_gradients_and_absgrad_flow_like_the_reference",
    "tests/ops/metal/test_loss_kernel.py::test_metal_loss_equals_reference",
    "tests/ops/metal/test_bin_histograms.py",  # the padded lists' bins: threadgroup histograms, windows, cut
    "tests/ops/metal/test_padded_isect.py::test_lists_past_the_budget_are_cut_into_windows_without_a_read",  # imports torch's triton
    # the pixel order: 8x4 blocks in strips of 4 rows, and in 32x32 tiles
    "tests/ops/metal/test_backward_kernels.py::test_rasterize_tile_geometries_match_reference[16-3-1-None-100]",
    "tests/ops/metal/test_backward_kernels.py::test_rasterize_tile_geometries_match_reference[32-3-1-None-None]",
]


def asan_env() -> dict:
    env = dict(
        os.environ, SPLAT_METAL_EMU_ASAN="1", LD_PRELOAD=library.asan_preload(), ASAN_OPTIONS="detect_leaks=0"
    )  # Python itself never frees some of its memory
    env.pop("PYTEST_ADDOPTS", None)
    return env


def run_python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)


PLANTED = """
import torch
from splat_metal_method.ops.metal import runtime
from splat_metal_method.ops.metal.emulator import compile_library
lib = compile_library(runtime.load_source({path!r}), "emulator_tests")
{call}
print("finished")
"""
READ_PAST_END = "lib.read_past_end(torch.zeros(100), torch.randn(100), threads=100, group_size=32)"
SHARED_PAST_END = "lib.shared_past_end(torch.zeros(256), threads=256, group_size=256)"


def test_kernel_suite_passes_under_asan():
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SUITE],
        cwd=ROOT,
        env=asan_env(),
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "AddressSanitizer" not in res.stderr and "runtime error:" not in res.stderr, res.stderr[-4000:]


@pytest.mark.parametrize("call, reports", [
    (READ_PAST_END, ["AddressSanitizer: heap-buffer-overflow", "READ of size 4"]),
    # An index past a fixed-size threadgroup array: the build's UBSan bounds check (on with ASan) stops it
    # before the write reaches memory.
    (SHARED_PAST_END, ["runtime error: index 256 out of bounds for type 'float [256]'"]),
], ids=["device_read", "threadgroup_write"])  # fmt: skip
def test_out_of_bounds_access_fails_under_asan(call, reports):
    res = run_python(PLANTED.format(path=str(KERNELS / "emulator_tests.metal"), call=call), asan_env())
    assert res.returncode != 0 and "finished" not in res.stdout, res.stdout + res.stderr[-3000:]
    assert all(r in res.stderr for r in reports), res.stderr[-3000:]


def test_out_of_bounds_access_goes_unnoticed_without_asan():
    # The reason for the ASan build: the normal build reads whatever lies past the tensor.
    lib = compile_library(runtime.load_source(KERNELS / "emulator_tests.metal"), "emulator_tests")
    x, out = torch.randn(100), torch.zeros(100)
    lib.read_past_end(out, x, threads=100, group_size=32)
    assert torch.equal(out[:-1], x[1:])
    lib.shared_past_end(torch.zeros(256), threads=256, group_size=256)


def test_asan_build_refuses_a_process_without_the_runtime():
    env = dict(os.environ, SPLAT_METAL_EMU_ASAN="1")
    env.pop("LD_PRELOAD", None)
    res = run_python(
        "from splat_metal_method.ops.metal.emulator import compile_library\n"
        "compile_library('kernel void k(device float* o [[buffer(0)]]) {}')",
        env,
    )
    assert res.returncode != 0 and "LD_PRELOAD=" in res.stderr and EmulatorError.__name__ in res.stderr, res.stderr
