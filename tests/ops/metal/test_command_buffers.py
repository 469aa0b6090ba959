"""The command-buffer bound of the Metal rasterizer (issue 22, section 3).

torch's MPS stream puts consecutive dispatches into one command buffer, so the GPU-watchdog bound has
to hold per command buffer. The runtime keeps a ledger of command buffers (runtime.command_buffers():
launches and estimated work, closed by a commit or a host read); these tests check that no command
buffer is given more than runtime.COMMAND_BUFFER_BUDGET:
- by planning alone, on the sizes the issue names (a 4K view, one tile with 100k gaussians, dense
  everywhere), without running the kernels;
- by one real small render + backward under the emulator with the budget set low: commits happen
  between dispatches, every command buffer stays within the budget, and the results do not change.
"""

from __future__ import annotations

import math

import pytest
import torch
from scenes import random_scene

from splat_metal_method.ops import rasterization
from splat_metal_method.ops.metal import rasterize, runtime

TS = 16
TILE_PIXELS = TS * TS


def ledger_of(plan: rasterize.PassPlan, budget: int) -> list:
    """The command buffers a forward + backward of `plan` fills: the same reserve_work calls, in the
    same order, as rasterize_to_pixels_fwd / _bwd make (the forward's last buffer stays open into the
    backward, as on a Mac where nothing syncs between them)."""
    runtime.reset_command_buffers()
    for d in plan.dispatches:
        runtime.reserve_work("cpu", d.work)
    for d in plan.dispatches:
        runtime.reserve_work("cpu", d.work * runtime.BWD_WORK_FACTOR)
    return runtime.command_buffers()


def four_k_lengths(background: int, dense: int = 100_000) -> torch.Tensor:
    """[1, 135, 240] tile list lengths of a 3840x2160 view: `background` gaussians in every tile and
    `dense` in one tile near the middle."""
    lengths = torch.full((1, math.ceil(2160 / TS), 3840 // TS), background, dtype=torch.int64)
    lengths[0, 70, 120] = dense
    return lengths


@pytest.mark.parametrize("background", [0, 30, 300, 3000, 9000], ids=lambda b: f"{b}-per-tile")
def test_a_dense_4k_view_never_puts_more_than_the_budget_in_one_command_buffer(background, monkeypatch):
    monkeypatch.setattr(runtime, "COMMAND_BUFFER_BUDGET", runtime.COMMAND_BUFFER_BUDGET)
    budget = runtime.COMMAND_BUFFER_BUDGET
    lengths = four_k_lengths(background)
    plan = rasterize.plan_from_lengths(lengths, TILE_PIXELS, rasterize.RASTER_CHUNK, budget)
    # the plan counts every gaussian-pixel evaluation exactly once, and covers every tile in pass 0
    assert sum(d.work for d in plan.dispatches) == TILE_PIXELS * int(lengths.sum())
    assert plan.n_passes == math.ceil(100_000 / rasterize.RASTER_CHUNK)
    covered = torch.zeros(lengths.shape, dtype=torch.int64)
    for d in plan.dispatches:
        if d.pass_index == 0:
            cams = range(lengths.shape[0]) if d.camera is None else [d.camera]
            for c in cams:
                covered[c, d.rows[0] : d.rows[1]] += 1
        assert d.work * runtime.BWD_WORK_FACTOR <= budget, d  # one 4K tile row always fits at chunk 8192
    assert (covered == 1).all(), "pass 0 must visit every tile exactly once (it finalises them)"

    buffers = ledger_of(plan, budget)
    assert max(b.work for b in buffers) <= budget
    assert sum(b.work for b in buffers) == TILE_PIXELS * int(lengths.sum()) * (1 + runtime.BWD_WORK_FACTOR)
    total = TILE_PIXELS * int(lengths.sum()) * (1 + runtime.BWD_WORK_FACTOR)
    if total > budget:  # the render does not fit one command buffer: it was cut, and tightly enough
        assert len(buffers) >= math.ceil(total / budget)
    print(
        f"4K, {background}/tile + one tile of 100k: {plan.n_passes} passes, {len(plan.dispatches)} dispatches, "
        f"{len(buffers)} command buffers, max {max(b.work for b in buffers):.3g} <= {budget:.3g}"
    )


def test_without_planning_the_same_view_would_pass_the_budget():
    """What the plan prevents: one dispatch per pass over the whole image (the old loop) puts the dense
    4K view's backward pass 0 above the budget in a single dispatch."""
    lengths = four_k_lengths(3000)
    budget = runtime.COMMAND_BUFFER_BUDGET
    chunk = rasterize.RASTER_CHUNK
    pass0 = TILE_PIXELS * int(lengths.clamp(max=chunk).sum())
    assert pass0 * runtime.BWD_WORK_FACTOR > budget
    plan = rasterize.plan_from_lengths(lengths, TILE_PIXELS, chunk, budget)
    assert sum(1 for d in plan.dispatches if d.pass_index == 0) > 1  # so pass 0 was cut into bands


def test_plan_passes_without_host_read_when_one_small_dispatch_fits():
    offsets = torch.zeros((2, 3, 4), dtype=torch.int32)
    runtime.reset_command_buffers()
    plan = rasterize.plan_passes(offsets, 500, TS, None, 400)
    assert plan.dispatches == (rasterize.Dispatch(0, None, (0, 3), TILE_PIXELS * 500),)
    assert [b.closed_by for b in runtime.command_buffers()] == [""]  # nothing read from the device


# --------------------------------------------------------------------------------------------------
# a real render under the emulator
# --------------------------------------------------------------------------------------------------
def render(max_intersections=None):
    scene = random_scene(
        n=300,
        C=2,
        width=45,
        height=37,
        seed=4,
        sh_degree=0,
        backgrounds=True,
        scale_range=(0.3, 0.9),
        opacity_range=(0.05, 0.2),
    )
    ts = {k: v.clone().requires_grad_(True) for k, v in scene.tensors().items() if k != "Ks"}
    colors, alphas, meta = rasterization(**scene.kwargs(**ts), absgrad=True, tile_size=8, backend="metal",
                                         max_intersections=max_intersections)  # fmt: skip
    assert meta.get("depth_chunks", 1) > 1 if max_intersections else True
    ((colors * torch.linspace(0.3, 1.0, colors.shape[-1])).sum() + 0.5 * alphas.sum()).backward()
    return {
        "colors": colors.detach(),
        "alphas": alphas.detach(),
        "absgrad": meta["means2d"].absgrad,
        **{f"grad.{k}": t.grad for k, t in ts.items()},
    }


@pytest.mark.parametrize("max_intersections", [None, 1500], ids=["whole", "depth-chunks"])
def test_a_low_budget_commits_between_dispatches_and_keeps_the_results(monkeypatch, max_intersections):
    """Bands of tile rows (per camera, means shifted to the band) and commits between them: same colours,
    alphas and gradients as one dispatch per pass; with depth chunks the bands also resume T and the
    stop state."""
    want = render(max_intersections)
    monkeypatch.setattr(rasterize, "RASTER_CHUNK", 24)  # several passes per tile
    per_pass_tile = 8 * 8 * 24
    budget = 6 * per_pass_tile * runtime.BWD_WORK_FACTOR  # a few tiles' worth of backward per command buffer
    monkeypatch.setattr(runtime, "COMMAND_BUFFER_BUDGET", budget)
    runtime.reset_command_buffers()
    runtime.reset_launch_counts()
    got = render(max_intersections)
    buffers = runtime.command_buffers()
    launches = runtime.launch_counts()
    raster = [b for b in buffers if b.launches.get("rasterize_fwd") or b.launches.get("rasterize_bwd")]
    print(
        f"{len(buffers)} command buffers, {launches.get('rasterize_fwd')} rasterize_fwd and "
        f"{launches.get('rasterize_bwd')} rasterize_bwd dispatches; work per buffer: {[b.work for b in raster]}"
    )
    assert launches["rasterize_fwd"] > 2 and launches["rasterize_bwd"] > 2  # passes were cut into bands
    assert max(b.work for b in buffers) <= budget
    commits = [b for b in raster if b.closed_by == "commit"]
    assert len(commits) >= 2, [(b.closed_by, dict(b.launches), b.work) for b in buffers]
    assert any(b.launches.get("rasterize_fwd") for b in commits) and any(
        b.launches.get("rasterize_bwd") for b in commits
    )
    for k, v in want.items():  # float atomics: the summation order follows the schedule and the bands
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6 + 1e-5 * float(v.abs().max()), msg=k)


def test_a_host_read_closes_the_command_buffer():
    runtime.reset_command_buffers()
    runtime.reserve_work("cpu", 10)
    assert int(runtime.host_read(torch.tensor(3))) == 3
    runtime.reserve_work("cpu", 5)
    runtime.commit("cpu")
    assert [(b.work, b.closed_by) for b in runtime.command_buffers()] == [(10, "host sync"), (5, "commit"), (0, "")]
