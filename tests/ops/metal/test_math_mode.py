"""Fast math (issue 22 §4): the kernels declare safe math where the MSL version allows it (common.h,
MSL >= 3.2), the emulator compiles as MSL 3.2 and runs only that math, and the doctor says whether
PYTORCH_MPS_FAST_MATH can change the kernels at this MSL version."""

from __future__ import annotations

import re

import pytest
import torch

from splat_metal_method.ops.metal import kernels
from splat_metal_method.ops.metal.emulator import MetalCompileError, compile_library
from splat_metal_method.verify import doctor

KERNEL = """#include <metal_stdlib>
{pragmas}
using namespace metal;
kernel void fma_probe(device float* out [[buffer(0)]], const device float* x [[buffer(1)]],
                      uint i [[thread_position_in_grid]]) {{
  out[i] = x[3 * i] * x[3 * i + 1] + x[3 * i + 2];
}}
"""
SAFE = "#if __METAL_VERSION__ >= 320\n#pragma METAL fp math_mode(safe)\n#pragma METAL fp contract(off)\n#endif"


def test_every_library_declares_safe_math_from_msl_3_2():
    for name, source in kernels.all_sources().items():
        assert re.search(r"#if __METAL_VERSION__ >= 320\n#pragma METAL fp math_mode\(safe\)\n"
                         r"#pragma METAL fp contract\(off\)\n#endif", source), name  # fmt: skip
    assert kernels.msl_version("cpu") == 320 and kernels.safe_math_declared("cpu")
    assert doctor.safe_math_fact(torch.device("cpu")).startswith("declared (MSL 3.2")
    assert doctor.facts(torch.device("cpu"))["safe math in the kernels"].startswith("declared")
    assert "fma_probe" in dir(compile_library(KERNEL.format(pragmas=SAFE), "safe_math"))  # the subset check accepts it


@pytest.mark.parametrize(
    "pragma",
    [
        "#pragma METAL fp math_mode(fast)",
        "#pragma METAL fp contract(fast)",
        "#pragma METAL fp math_mode(relaxed)",
        "#pragma unroll",
    ],
)
def test_the_subset_check_refuses_math_the_emulator_does_not_run(pragma):
    with pytest.raises(MetalCompileError, match=re.escape(f"`{pragma}`: the MSL emulator runs safe math only")):
        compile_library(KERNEL.format(pragmas=pragma), "fast_math")
