"""Threadgroup limits (runtime.check_group_size / fitted_group). A pipeline reports how many threads
per group it allows (torch: `max_threads_per_threadgroup`, register-dependent, can be < 1024; torch
raises a bare ValueError above it). The emulator reports the kernel's declared
[[max_total_threads_per_threadgroup(N)]], which is the seam here: a kernel declared smaller than what
we dispatch behaves like a GPU whose pipeline allows fewer threads."""

from __future__ import annotations

import pytest
import torch

from splat_metal_method.ops.metal import kernels, runtime
from splat_metal_method.ops.metal.runtime import ThreadgroupLimitError

SMALL_PIPELINE = """#include <metal_stdlib>
using namespace metal;
[[max_total_threads_per_threadgroup(48)]]
kernel void group_size_of(
    device float* out [[buffer(0)]],
    constant long& n [[buffer(1)]],
    uint i [[thread_position_in_grid]],
    uint g [[dispatch_threads_per_threadgroup]]) {
  if ((long)i < n) {
    out[i] = float(g);
  }
}
"""


def test_one_thread_per_item_launch_shrinks_to_the_pipeline_limit():
    lib = runtime.get_library(SMALL_PIPELINE, "small_pipeline", runtime="emulator")
    assert lib.limits("group_size_of")["max_threads_per_threadgroup"] == 48
    out = torch.zeros(1000)
    lib.group_size_of(out, 1000, **kernels.grid_1d(1000))  # asks for GROUP_1D = 256
    width = lib.limits("group_size_of")["thread_execution_width"] or 1  # whole SIMD widths where reported
    assert kernels.GROUP_1D > 48 and out.eq(48 - 48 % width).all(), out.unique()


def test_fixed_geometry_launch_over_the_limit_stops_with_what_to_do():
    lib = runtime.get_library(SMALL_PIPELINE, "small_pipeline", runtime="emulator")
    out = torch.zeros(100)
    runtime.reset_launch_counts()
    with pytest.raises(ThreadgroupLimitError, match=r"\[group_size_of\] .*at most 48 threads per threadgroup.*"
                       r"dispatches 64 \(group_size \(8, 8\)\).*--pipeline.model.backend reference.*splat-metal-doctor"):
        lib.group_size_of(out, 100, threads=(10, 10), group_size=(8, 8))
    assert runtime.launch_counts() == {} and out.eq(0).all()  # refused before the launch


def test_every_kernel_declares_the_group_size_we_dispatch():
    """[[max_total_threads_per_threadgroup(N)]] on every standard kernel, N = kernels.group_threads."""
    seen = 0
    for name, (stage_file, extra) in kernels.standard_variants().items():
        lib = kernels.library(torch.device("cpu"), stage_file, extra=extra)
        for kernel in dir(lib):
            assert lib.limits(kernel)["max_threads_per_threadgroup"] == kernels.group_threads(kernel), (name, kernel)
            seen += 1
    assert seen == 19  # with scan.metal's scan_block_sums and scan_blocks
