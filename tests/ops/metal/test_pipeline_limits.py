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
    with pytest.raises(
        ThreadgroupLimitError,
        match=r"\[group_size_of\] .*at most 48 threads per threadgroup.*"
        r"dispatches 64 \(group_size \(8, 8\)\).*--pipeline.model.backend reference.*splat-metal-doctor",
    ):
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
    # scan.metal: scan_block_sums, scan_blocks, scan_compact; isect.metal: bin_count, bin_fill, bin_sort; loss.metal: 3;
    # train.metal: 4; sh(_bwd).metal: the 2 fused; adam.metal: adam_prepare (ADAM_SLOTS threads), adam_step;
    # rasterize_bwd.metal: its tile-merge variant (rasterization_metal tile_merge)
    assert seen == 35


@pytest.mark.parametrize("limit, rows", [(128, 8), (100, 4)])
def test_rasterizer_runs_in_tile_strips_where_the_pipeline_allows_fewer_threads(monkeypatch, limit, rows):
    """A register-heavy pipeline (the rasterizer at many channels) that allows fewer threads per group
    than a 16x16 tile: the emulator runtime reports `limit` for every rasterizer pipeline, so the library
    is rebuilt with groups of `rows` rows of a tile (kernels.tile_library), and the result equals the
    full-tile path, forward (bitwise: each pixel computes the same) and backward with absgrad (float
    atomics add in another order), on a non-square image with partial edge tiles, in one pass and in
    several (RASTER_CHUNK passes)."""
    from splat_metal_method.ops import metal, reference
    from splat_metal_method.ops.metal.rasterize import rasterize_to_pixels_fwd

    C, N, D, W, H, ts = 2, 300, 5, 45, 29, 16
    g = torch.Generator().manual_seed(0)
    means = torch.randn(N, 3, generator=g) * 0.6 + torch.tensor([0.0, 0.0, 3.0])
    quats = torch.randn(N, 4, generator=g)
    scales = torch.rand(N, 3, generator=g) * 0.15 + 0.02
    viewmats = torch.eye(4).expand(C, 4, 4).clone()
    viewmats[1, 0, 3] = 0.2
    Ks = torch.tensor([[40.0, 0, W / 2], [0, 40.0, H / 2], [0, 0, 1]]).expand(C, 3, 3).clone()
    radii, means2d, depths, conics, _ = reference.project(means, quats, scales, viewmats, Ks, W, H)
    tw, th = -(-W // ts), -(-H // ts)
    _, isect_ids, flatten_ids = reference.isect_tiles(means2d, radii, depths, ts, tw, th)
    offsets = reference.isect_offset_encode(isect_ids, C, tw, th)
    colors = torch.rand(C, N, D, generator=g)
    opacities = torch.rand(C, N, generator=g)
    backgrounds = torch.rand(C, D, generator=g)
    v_colors, v_alphas = torch.randn(C, H, W, D, generator=g), torch.randn(C, H, W, 1, generator=g)

    def render():
        leaves = [t.clone().requires_grad_() for t in (means2d, conics, colors, opacities, backgrounds)]
        out = metal.rasterize_to_pixels(*leaves[:4], W, H, ts, offsets, flatten_ids, leaves[4], absgrad=True)
        torch.autograd.backward(out, (v_colors, v_alphas))
        several = rasterize_to_pixels_fwd(*(t.detach() for t in leaves[:4]), W, H, ts, offsets, flatten_ids,
                                          backgrounds, chunk=7)[:2]  # fmt: skip
        return out, several, [t.grad for t in leaves] + [leaves[0].absgrad]

    monkeypatch.setattr(kernels, "_fitted_groups", {})
    full = render()
    assert kernels.tile_library(torch.device("cpu"), "rasterize.metal", "rasterize_fwd", ts,
                                lambda _r: (("SPLAT_CHANNELS", D),))[1] == ts  # fmt: skip

    real_limits = runtime.pipeline_limits

    def register_heavy(kernel):  # this GPU's rasterizer pipelines allow `limit` threads per group
        limits = real_limits(kernel)
        if repr(kernel).startswith(("<emulated Metal kernel rasterize_fwd(", "<emulated Metal kernel rasterize_bwd(")):
            limits["max_threads_per_threadgroup"] = min(limits["max_threads_per_threadgroup"] or limit, limit)
        return limits

    monkeypatch.setattr(runtime, "pipeline_limits", register_heavy)
    monkeypatch.setattr(kernels, "_fitted_groups", {})
    lib, got_rows = kernels.tile_library(torch.device("cpu"), "rasterize.metal", "rasterize_fwd", ts,
                                         lambda _r: (("SPLAT_CHANNELS", D),))  # fmt: skip
    assert got_rows == rows and lib.limits("rasterize_fwd")["max_threads_per_threadgroup"] == min(limit, ts * rows)
    runtime.reset_launch_counts()
    strips = render()
    assert runtime.launch_counts()["rasterize_fwd"] >= 2 and runtime.launch_counts()["rasterize_bwd"] == 1

    (full_c, full_a), (strip_c, strip_a) = full[0], strips[0]
    assert torch.equal(strip_c, full_c) and torch.equal(strip_a, full_a) and full_a.max() > 0.5
    for a, b in zip(strips[1], full[1]):  # several passes
        assert torch.equal(a, b)
    names = ("means2d", "conics", "colors", "opacities", "backgrounds", "absgrad")
    for name, a, b in zip(names, strips[2], full[2]):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_projection_backward_runs_in_smaller_groups_where_the_pipeline_allows_fewer(monkeypatch):
    """project_bwd's group (GROUP = 256, camera-gradient partial sums per group) shrinks to the largest
    multiple of 32 within the limit the pipeline reports (here 100 -> 96; N = 300 leaves the last group
    partial): gradients equal the 256-thread path's, viewmats included, non-square image."""
    from splat_metal_method.ops import metal
    from splat_metal_method.ops.metal.project_bwd import GROUP

    C, N, W, H = 2, 300, 45, 29
    g = torch.Generator().manual_seed(3)
    means = torch.randn(N, 3, generator=g) * 0.6 + torch.tensor([0.0, 0.0, 3.0])
    quats, scales = torch.randn(N, 4, generator=g), torch.rand(N, 3, generator=g) * 0.15 + 0.02
    viewmats = torch.eye(4).expand(C, 4, 4).clone()
    viewmats[1, 1, 3] = 0.3
    Ks = torch.tensor([[40.0, 0, W / 2], [0, 40.0, H / 2], [0, 0, 1]]).expand(C, 3, 3).clone()
    weights = [torch.randn(C, N, k, generator=g) for k in (2, 1, 3)]  # means2d, depths, conics

    def grads():
        leaves = [t.clone().requires_grad_() for t in (means, quats, scales, viewmats)]
        _, means2d, depths, conics, _ = metal.project(*leaves, Ks, W, H)
        loss = sum((o.reshape(C, N, -1) * w).sum() for o, w in zip((means2d, depths, conics), weights))
        loss.backward()
        return [t.grad for t in leaves]

    monkeypatch.setattr(kernels, "_fitted_groups", {})
    full = grads()
    real_limits = runtime.pipeline_limits

    def register_heavy(kernel):
        limits = real_limits(kernel)
        if repr(kernel).startswith("<emulated Metal kernel project_bwd("):
            limits["max_threads_per_threadgroup"] = 100
        return limits

    monkeypatch.setattr(runtime, "pipeline_limits", register_heavy)
    monkeypatch.setattr(kernels, "_fitted_groups", {})
    _, group = kernels.group_library(torch.device("cpu"), "project_bwd.metal", "project_bwd",
                                     "SPLAT_PROJECT_BWD_GROUP", GROUP)  # fmt: skip
    assert group == 96
    runtime.reset_launch_counts()
    smaller = grads()
    assert runtime.launch_counts()["project_bwd"] == 1
    for name, a, b in zip(("means", "quats", "scales", "viewmats"), smaller, full):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
