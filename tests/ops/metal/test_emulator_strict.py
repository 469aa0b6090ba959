"""The emulator is stricter than Metal where Metal leaves things undefined or refuses them late: each rule
proven by a planted bug (a small kernel compiled here) that it catches, and the product's kernels passing it.

- An empty dispatch (a zero in threads= or group_size=) is refused, as Metal's validation does; the product
  skips the launch where its work can be empty (no gaussians, no intersections: every training-step stage).
- ``#pragma once`` in a kernel source is refused (torch.mps.compile_shader's header inliner refuses it in
  some releases).
- A barrier or simdgroup op is a rendezvous of one call site: threads of a group (lanes of a simdgroup)
  reaching two different calls, e.g. a barrier on both branches of an if/else, is an error naming both.
"""

from __future__ import annotations

import pytest
import torch
from scenes import random_scene

from splat_metal_method.ops.metal import runtime
from splat_metal_method.ops.metal.adam import fused_adam, zero_moments
from splat_metal_method.ops.metal.emulator import EmulatorError, MetalCompileError, compile_library
from splat_metal_method.ops.metal.fused import rasterization_metal
from splat_metal_method.ops.metal.isect import IntersectionCapacities
from splat_metal_method.ops.metal.train import densify_stats, nonfinite_flag

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"
PLANTED = """#include <metal_stdlib>
using namespace metal;
kernel void fill(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  out[gid] = 1.0f;
}

// BUG on purpose: the same barrier written on both branches; every thread reaches one barrier, but not the same.
kernel void barrier_both_branches(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float sh[64];
  sh[tid] = float(tid);
  if (tid % 2 == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tid] = sh[(tid + 1) % 64];
}

// The fix: one barrier after the branch.
kernel void barrier_after_branch(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float sh[64];
  sh[tid] = (tid % 2 == 0) ? float(tid) : -float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = sh[(tid + 1) % 64];
}

// BUG on purpose: lanes of one simdgroup reduce at two different simd_sum calls.
kernel void simd_sum_both_branches(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]],
                                   uint gid [[thread_position_in_grid]]) {
  float s;
  if (lane < 16) {
    s = simd_sum(1.0f);
  } else {
    s = simd_sum(2.0f);
  }
  out[gid] = s;
}

// BUG on purpose: a shuffle written directly on one branch and in a helper on the other: two calls.
inline float from_next(float v, uint lane) { return simd_shuffle(v, (lane + 1) % 32); }
kernel void helper_shuffle_both_branches(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]],
                                         uint gid [[thread_position_in_grid]]) {
  float v = float(lane);
  if (lane % 2 == 0) {
    v = simd_shuffle(v, (lane + 1) % 32);
  } else {
    v = from_next(v, lane);
  }
  out[gid] = v;
}

// Per-simdgroup uniform branches are fine: each simdgroup's lanes all take the same one.
kernel void simd_uniform_per_simdgroup(device float* out [[buffer(0)]], uint sg [[simdgroup_index_in_threadgroup]],
                                       uint gid [[thread_position_in_grid]]) {
  float s;
  if (sg == 0) {
    s = simd_sum(1.0f);
  } else {
    s = simd_sum(2.0f);
  }
  out[gid] = s;
}
"""


@pytest.fixture(scope="module")
def lib():
    return compile_library(PLANTED, "strict_planted.metal")


# ---------------------------------------------------------------------------------------------------
# empty dispatches
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threads, group", [(0, 32), ((0, 4), (8, 1)), ((16, 0, 1), (16, 1, 1)), (32, 0)])
def test_an_empty_dispatch_is_refused_as_metal_validation_does(lib, threads, group):
    with pytest.raises(EmulatorError, match=r"\[fill\] threads .* must be positive.*skip the launch"):
        lib.fill(torch.zeros(32), threads=threads, group_size=group)
    out = torch.zeros(32)
    lib.fill(out, threads=32, group_size=32)  # one thread more of each: runs
    assert out.eq(1).all()


def _training_step(scene, sh: bool, tile_merge: bool, steps: int = 2):
    """The model's training render (fused preparation, padded lists, fused composite), its backward, the
    Adam step and the step's small kernels, on the emulator: what runs when a step has no work."""
    N = scene.N
    leaves = {k: getattr(scene, k).detach().clone().requires_grad_(True)
              for k in ("means", "quats", "scales", "opacities", "colors")}  # fmt: skip
    caps = IntersectionCapacities()
    for _ in range(steps):
        colors = leaves["colors"][:, :1].contiguous() if sh else leaves["colors"][:, 0].contiguous()
        rest = leaves["colors"][:, 1:].contiguous() if sh else None
        render, alpha, meta = rasterization_metal(
            leaves["means"], leaves["quats"], leaves["scales"], leaves["opacities"].reshape(N), colors,
            scene.viewmats, scene.Ks, scene.width, scene.height, sh_degree=scene.sh_degree if sh else None,
            colors_rest=rest, scales_are_log=True, opacities_are_logits=True, isect_capacity=caps, absgrad=True,
            composite_background=torch.tensor([0.1, 0.2, 0.3]), render_mode="RGB+ED", tile_merge=tile_merge,
        )  # fmt: skip
        (render.sum() + alpha.sum() + meta["rgb"].sum()).backward()
        params = [leaves["means"], leaves["opacities"]]
        flag = fused_adam(params, [p.grad for p in params], *zero_moments(params), [torch.zeros(1), torch.zeros(1)], [1e-3, 1e-3],
                          [1e-15, 1e-15], 0.9, 0.999, radii=meta["radii"].int().contiguous())  # fmt: skip
        densify_stats(meta["means2d"].absgrad if meta["means2d"].absgrad is not None else torch.zeros(1, N, 2),
                      meta["radii"].int().contiguous(), torch.zeros(N), torch.zeros(N), torch.zeros(N), 1.0, 1.0,
                      1.0)  # fmt: skip
        nonfinite_flag([leaves["means"].grad, leaves["scales"].grad], flag)
    return render, meta


def _scene(n):
    return random_scene(n=n, C=1, width=45, height=29, seed=3, sh_degree=1)


@pytest.mark.parametrize("sh", [False, True], ids=["rgb", "sh"])
@pytest.mark.parametrize("tile_merge", [False, True], ids=["direct", "tile-merge"])
def test_a_training_step_without_gaussians_or_intersections_launches_nothing_empty(sh, tile_merge):
    from dataclasses import replace

    base = _scene(24)
    empty = replace(base, **{k: getattr(base, k)[:0] for k in ("means", "quats", "scales", "opacities", "colors")})
    far_behind = replace(base, means=base.means + 1000.0)  # in front of no camera: 0 intersections
    for scene, n_gaussians in ((empty, 0), (far_behind, 24)):
        runtime.reset_launch_counts()
        render, meta = _training_step(scene, sh, tile_merge)
        assert int(meta["n_intersections"].sum() if torch.is_tensor(meta["n_intersections"]) else 0) == 0
        assert meta["radii"].shape[-1] == n_gaussians
        assert torch.isfinite(render).all()
        assert sum(runtime.launch_counts().values()) > 0  # the kernels that had work ran (and none was empty)


# ---------------------------------------------------------------------------------------------------
# #pragma once
# ---------------------------------------------------------------------------------------------------
def test_pragma_once_in_a_kernel_source_is_refused():
    source = "#pragma once\n" + HEADER + "kernel void k(device float* o [[buffer(0)]]) { o[0] = 1.0f; }\n"
    with pytest.raises(MetalCompileError, match=r"once\.metal:1: `#pragma once`: .*header inliner"):
        compile_library(source, "once.metal")
    compile_library(source.replace("#pragma once\n", ""), "once.metal")  # without it: compiles


# ---------------------------------------------------------------------------------------------------
# rendezvous by call site
# ---------------------------------------------------------------------------------------------------
def test_a_barrier_on_both_branches_is_an_error_naming_both_calls(lib):
    with pytest.raises(EmulatorError, match=r"different threadgroup_barrier calls: .*strict_planted\.metal:(\d+).* "
                                            r"at strict_planted\.metal:(?!\1)\d+.*divergent control flow"):  # fmt: skip
        lib.barrier_both_branches(torch.zeros(64), threads=64, group_size=64)
    out = torch.zeros(64)
    lib.barrier_after_branch(out, threads=64, group_size=64)
    expected = torch.arange(64.0).roll(-1)
    assert torch.equal(out, torch.where(expected % 2 == 0, expected, -expected))


@pytest.mark.parametrize("kernel", ["simd_sum_both_branches", "helper_shuffle_both_branches"])
def test_lanes_at_two_calls_of_one_simd_op_are_an_error(lib, kernel):
    with pytest.raises(EmulatorError, match=rf"\[{kernel}\] lanes of simdgroup 0 .* different simdgroup operations: "
                                            r"lane \d+ at strict_planted\.metal:\d+.*uniform control flow"):  # fmt: skip
        getattr(lib, kernel)(torch.zeros(64), threads=64, group_size=64)


def test_simd_ops_uniform_per_simdgroup_pass(lib):
    out = torch.zeros(96)
    lib.simd_uniform_per_simdgroup(out, threads=96, group_size=96)
    assert torch.equal(out, torch.tensor([32.0] * 32 + [64.0] * 64))
