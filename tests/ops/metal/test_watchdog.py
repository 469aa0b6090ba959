"""No rasterizer dispatch over the command-buffer budget (runtime.COMMAND_BUFFER_BUDGET, backward-weighted) at
adversarial tile-row loads, counted from the real tile list lengths each dispatch composites.

- Exact lists (plan_passes reads this render's lengths): a 4K view with one tile of 100,000 entries, an 8K
  view with every tile holding 10,000 (one tile row at RASTER_CHUNK was over the budget: plan_passes now
  caps the chunk at rasterize.row_chunk), and one row with 10x the entries of the others. Every entry is
  composited once; the worst dispatch before (plan_from_lengths at RASTER_CHUNK) and after is printed.
- A real render and backward under the emulator with the budget set so low that one tile row is over it at
  the default chunk: the dispatches actually run stay within it, and the results equal the one-pass render.
- Padded lists (plan_padded: the lengths stay on the device): no dispatch passes the budget at ANY load the
  lists can hold, forward (windows from the front) and backward (from the back): a 10x jump in one row past
  the step-old estimate the planner used before, one tile of 100,000 entries, at 1080p and 1297x840; each
  dispatch's planned work bounds what it does, also against the worst lengths for that dispatch; the worst
  dispatch before (one pass of whole tiles, bands from the estimate) and after is printed.
- A real padded render and backward under the emulator with the budget set low, one row 10x the step
  before: the dispatches stay within it, launches past the longest list do nothing (the emulator's barrier
  counter), no host read, and the results equal the one-dispatch render.
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
BUDGET = runtime.COMMAND_BUFFER_BUDGET


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:  # [C, th, tw] lengths -> [C, th, tw] int32 starts
    return (lengths.reshape(-1).cumsum(0) - lengths.reshape(-1)).view(lengths.shape).int()


def dispatch_work(plan: rasterize.PassPlan, lengths: torch.Tensor) -> list:
    """The forward gaussian-pixel evaluations each dispatch of `plan` does on tiles of these lengths."""
    out = []
    for d in plan.dispatches:
        cams = slice(None) if d.camera is None else slice(d.camera, d.camera + 1)
        band = lengths[cams, d.rows[0] : d.rows[1]].long()
        out.append(TILE_PIXELS * int((band - d.pass_index * plan.chunk).clamp(0, plan.chunk).sum()))
    return out


def four_k(background: int, dense: int) -> torch.Tensor:
    lengths = torch.full((1, math.ceil(2160 / TS), 3840 // TS), background, dtype=torch.int64)
    lengths[0, 70, 120] = dense
    return lengths


def eight_k_full(per_tile: int) -> torch.Tensor:
    return torch.full((1, 4320 // TS, 7680 // TS), per_tile, dtype=torch.int64)


def row_jump(base: int, factor: int) -> torch.Tensor:  # a 1080p view, one tile row with `factor` x the entries
    lengths = torch.full((1, math.ceil(1080 / TS), 1920 // TS), base, dtype=torch.int64)
    lengths[0, 30] *= factor
    return lengths


CASES = {
    "4K, one tile of 100,000": four_k(300, 100_000),
    "8K, 10,000 in every tile": eight_k_full(10_000),
    "1080p, one row 10x": row_jump(2_000, 10),
}


@pytest.mark.parametrize("name", list(CASES))
def test_no_exact_list_dispatch_passes_the_budget(name):
    lengths = CASES[name]
    M = int(lengths.sum())
    plan = rasterize.plan_passes(offsets_of(lengths), M, TS, None, M)
    work = dispatch_work(plan, lengths)
    assert sum(work) == TILE_PIXELS * M, "every entry is composited exactly once"
    assert [d.work for d in plan.dispatches] == work, "the plan counts what each dispatch does"
    worst = max(work) * runtime.BWD_WORK_FACTOR
    before = rasterize.plan_from_lengths(lengths, TILE_PIXELS, rasterize.RASTER_CHUNK, BUDGET)
    worst_before = max(dispatch_work(before, lengths)) * runtime.BWD_WORK_FACTOR
    print(f"{name}: worst dispatch (backward) {worst_before:.3g} at chunk {before.chunk} before, {worst:.3g} at "
          f"chunk {plan.chunk} ({len(plan.dispatches)} dispatches) now, budget {BUDGET:.3g}")  # fmt: skip
    assert worst <= BUDGET


def test_the_8k_row_was_over_the_budget_at_the_default_chunk():
    """What row_chunk changes: at RASTER_CHUNK one full 8K tile row (480 tiles) is 4.03e9 backward, over 4e9."""
    lengths = CASES["8K, 10,000 in every tile"]
    before = rasterize.plan_from_lengths(lengths, TILE_PIXELS, rasterize.RASTER_CHUNK, BUDGET)
    assert max(dispatch_work(before, lengths)) * runtime.BWD_WORK_FACTOR > BUDGET
    assert (
        rasterize.row_chunk(TILE_PIXELS, 480, BUDGET)
        < rasterize.RASTER_CHUNK
        <= rasterize.row_chunk(TILE_PIXELS, 3840 // TS, BUDGET)
    )


def _render(scene):
    ts = {k: v.clone().requires_grad_(True) for k, v in scene.tensors().items() if k != "Ks"}
    colors, alphas, meta = rasterization(**scene.kwargs(**ts), absgrad=True, tile_size=8, backend="metal")
    ((colors * torch.linspace(0.3, 1.0, colors.shape[-1])).sum() + 0.5 * alphas.sum()).backward()
    return colors.detach(), alphas.detach(), {k: t.grad for k, t in ts.items()}, meta


def test_a_row_over_the_budget_is_split_across_passes_on_the_emulator(monkeypatch):
    scene = random_scene(n=300, C=1, width=45, height=37, seed=4, sh_degree=0, scale_range=(0.3, 0.9),
                         opacity_range=(0.05, 0.2))  # fmt: skip
    colors, alphas, grads, meta = _render(scene)  # one pass at the default budget
    offsets = meta["isect_offsets"]
    M = meta["flatten_ids"].numel()
    ends = torch.cat([offsets.reshape(-1)[1:].long(), torch.tensor([M])])
    lengths = (ends - offsets.reshape(-1).long()).view(offsets.shape)
    tile_width, tile_pixels = offsets.shape[2], 8 * 8
    budget = runtime.BWD_WORK_FACTOR * tile_pixels * tile_width * 3  # one row fits 3 gaussians a tile per pass
    assert int(lengths.max()) > 3 and budget < runtime.BWD_WORK_FACTOR * tile_pixels * int(lengths[0].sum(1).max())
    monkeypatch.setattr(runtime, "COMMAND_BUFFER_BUDGET", budget)
    plan = rasterize.plan_passes(offsets, M, 8, None, scene.N)  # what the render plans
    assert plan.chunk == 3 and plan.n_passes == math.ceil(int(lengths.max()) / 3)
    runtime.reset_command_buffers()
    runtime.reset_launch_counts()
    got_colors, got_alphas, got_grads, _ = _render(scene)
    launches = runtime.launch_counts()
    assert launches["rasterize_fwd"] == launches["rasterize_bwd"] == len(plan.dispatches) > plan.n_passes
    work = [w * tile_pixels // TILE_PIXELS for w in dispatch_work(plan, lengths)]  # at 8x8 tiles
    assert max(work) * runtime.BWD_WORK_FACTOR <= budget and sum(work) == tile_pixels * M
    assert max(b.work for b in runtime.command_buffers()) <= budget
    assert torch.equal(got_colors, colors) and torch.equal(got_alphas, alphas)
    for k, g in grads.items():  # float atomics: the summation order follows the schedule and the passes
        torch.testing.assert_close(got_grads[k], g, rtol=1e-5, atol=1e-6 + 1e-5 * float(g.abs().max()), msg=k)


def window_work(d: rasterize.Dispatch, chunk: int, lengths: torch.Tensor, from_back: bool = False) -> int:
    """The forward gaussian-pixel evaluations dispatch `d` (window [p chunk, (p + 1) chunk) of each list, counted
    from the front; the backward's counts it from the back: the same number) does on tiles of these lengths."""
    cams = slice(None) if d.camera is None else slice(d.camera, d.camera + 1)
    band = lengths[cams, d.rows[0] : d.rows[1]].long()
    return TILE_PIXELS * int((band - d.pass_index * chunk).clamp(0, chunk).sum())


def one_pass_bands(row_entries: list, tile_height: int, budget: int) -> list:
    """The row bands of the padded-list planner before (one pass of whole tiles, cut greedily from a step-old
    estimate of the entries per tile row, one camera): [(first row, end row)]."""
    bands, start, band = [], 0, 0
    for r, e in enumerate(row_entries):
        w = TILE_PIXELS * e * runtime.BWD_WORK_FACTOR
        if r > start and band + w > budget:
            bands.append((start, r))
            start, band = r, 0
        band += w
    return bands + [(start, tile_height)]


def padded_plan(lengths: torch.Tensor, capacity: int, n_gaussians: int) -> rasterize.PassPlan:
    C, th, tw = lengths.shape
    offsets = torch.zeros(C * th * tw + 1, dtype=torch.int32)  # padded lists: never read by the planner
    return rasterize.plan_passes(offsets, capacity, TS, None, n_gaussians, (C, th, tw))


def assert_bounded(plan: rasterize.PassPlan, lengths: torch.Tensor, capacity: int) -> int:
    """Every entry composited once, each dispatch within its planned work and that within the budget (also at the
    worst lengths the lists can hold for that dispatch); returns the worst dispatch's backward-weighted work."""
    C, th, tw = lengths.shape
    work = [window_work(d, plan.chunk_of(d), lengths) for d in plan.dispatches]
    assert sum(work) == TILE_PIXELS * int(lengths.sum()), "every entry is composited exactly once"
    for d, w in zip(plan.dispatches, work):
        assert w <= d.work and d.work * runtime.BWD_WORK_FACTOR <= BUDGET, d
        # the adversary for this dispatch: as many of its tiles as the capacity allows hold its whole window
        chunk, n_tiles = plan.chunk_of(d), (C if d.camera is None else 1) * (d.rows[1] - d.rows[0]) * tw
        end = (d.pass_index + 1) * chunk
        worst = torch.zeros_like(lengths)
        cams = slice(None) if d.camera is None else slice(d.camera, d.camera + 1)
        flat = worst[cams, d.rows[0] : d.rows[1]].reshape(-1)
        full = min(n_tiles, capacity // end)
        flat[:full] = end
        if full < n_tiles:
            flat[full] = capacity - full * end
        worst[cams, d.rows[0] : d.rows[1]] = flat.view(worst[cams, d.rows[0] : d.rows[1]].shape)
        assert window_work(d, chunk, worst) <= d.work, d
    return max(work) * runtime.BWD_WORK_FACTOR


def view(width: int, height: int, base: int) -> torch.Tensor:
    return torch.full((1, math.ceil(height / TS), math.ceil(width / TS)), base, dtype=torch.int64)


def row_10x(width, height):  # the step before had `base` in every tile; now one row holds 10x
    before = view(width, height, 2_000)
    now = before.clone()
    now[0, before.shape[1] // 2] *= 10
    return before, now


def one_tile_100k(width, height):
    before = view(width, height, 600)
    now = before.clone()
    now[0, before.shape[1] // 2, before.shape[2] // 3] = 100_000
    return before, now


PADDED = {f"{w}x{h}, {name}": (w, h, make) for w, h in ((1920, 1080), (1297, 840))
          for name, make in (("one row 10x", row_10x), ("one tile of 100,000", one_tile_100k))}  # fmt: skip


@pytest.mark.parametrize("name", list(PADDED))
def test_no_padded_list_dispatch_passes_the_budget_at_any_load(name):
    """plan_padded bounds each dispatch by what the lists can hold (the capacity in all, min(N, capacity) a
    tile), never by the step-old estimate the planner used before: the jump is inside the bound."""
    width, height, make = PADDED[name]
    before, now = make(width, height)
    capacity, n_gaussians = int(now.sum()), 1_000_000  # a capacity the jump fills exactly: the tightest
    plan = padded_plan(now, capacity, n_gaussians)
    worst = assert_bounded(plan, now, capacity)
    assert assert_bounded(padded_plan(now, 2 * capacity, n_gaussians), now, 2 * capacity) <= BUDGET
    # before: one pass of whole tiles, bands from the estimate (the step before's entries per row)
    estimate = [int(e) for e in before[0].sum(1)]
    bands = one_pass_bands(estimate, now.shape[1], BUDGET)
    worst_before = max(TILE_PIXELS * int(now[0, a:b].sum()) for a, b in bands) * runtime.BWD_WORK_FACTOR
    longest = int(now.max())
    busy = sum(1 for d in plan.dispatches if d.pass_index * plan.chunk_of(d) < longest)
    print(f"padded, {name}: worst dispatch (backward) {worst_before:.3g} before ({len(bands)} dispatches), "
          f"{worst:.3g} now ({len(plan.dispatches)} dispatches, {busy} with entries to composite), "
          f"budget {BUDGET:.3g}")  # fmt: skip
    assert worst <= BUDGET
    if "10x" in name and width == 1920:
        assert worst_before > BUDGET  # what the old plan did: the open limit this plan closes


def test_padded_lists_that_fit_one_dispatch_keep_one_pass_of_whole_tiles():
    """The common case: a capacity whose whole backward fits the budget is one dispatch of whole tiles, as before
    (no extra launch); one entry more and the lists are cut into windows, each within the budget."""
    C, th, tw = 2, 34, 60
    fits = BUDGET // (runtime.BWD_WORK_FACTOR * TILE_PIXELS)
    plan = padded_plan(torch.zeros(C, th, tw), fits, 5_000_000)
    assert plan.chunk == rasterize.WHOLE_TILE and plan.dispatches == (
        rasterize.Dispatch(0, None, (0, th), TILE_PIXELS * fits),
    )
    cut = padded_plan(torch.zeros(C, th, tw), fits + 1, 5_000_000)
    assert len(cut.dispatches) > 1 and max(d.work for d in cut.dispatches) * runtime.BWD_WORK_FACTOR <= BUDGET
    lengths = torch.zeros(C, th, tw, dtype=torch.int64)
    lengths[1, 5, 7] = fits + 1  # every entry in one tile
    assert assert_bounded(cut, lengths, fits + 1) <= BUDGET


def _jump_scenes(n: int, width: int, height: int):
    """(before, now): n small gaussians spread over the view, then the same ones with 97% moved into the middle
    tile row: that row holds ~10x the intersections it held the step before."""
    gen = torch.Generator().manual_seed(7)
    f, z = 0.9 * width, 4.0 + torch.rand(n, generator=gen)
    u, v = width * torch.rand(n, generator=gen), height * torch.rand(n, generator=gen)
    row_y = TS * (math.ceil(height / TS) // 2)
    v_now = torch.where(torch.rand(n, generator=gen) < 0.97, row_y + 4.0 + (TS - 8.0) * torch.rand(n, generator=gen), v)
    quats = torch.randn(n, 4, generator=gen)
    scales = (0.3 * z / f)[:, None] * (0.3 * torch.randn(n, 3, generator=gen)).exp()
    opacities = torch.rand(n, generator=gen) * 0.1 + 0.02
    colors = torch.rand(n, 3, generator=gen)

    def params(v):
        means = torch.stack([(u - width / 2) / f * z, (v - height / 2) / f * z, z], -1)
        return means, quats, scales, opacities, colors

    return params(v), params(v_now)


def _padded_step(params, width, height, caps):
    from splat_metal_method.ops.metal.fused import rasterization_metal

    leaves = [p.clone().requires_grad_(True) for p in params]
    f = 0.9 * width
    Ks = torch.tensor([[[f, 0, width / 2], [0, f, height / 2], [0, 0, 1]]])
    colors, alphas, meta = rasterization_metal(*leaves, torch.eye(4)[None], Ks, width, height, absgrad=True,
                                               isect_capacity=caps)  # fmt: skip
    ((colors * torch.linspace(0.5, 1.5, colors.numel()).view(colors.shape)).sum() + alphas.sum()).backward()
    return colors.detach(), alphas.detach(), meta, [p.grad for p in leaves]


def tile_lengths(meta) -> torch.Tensor:  # [1, th, tw] entries of each tile of a padded render
    starts = meta["isect_offsets"].reshape(-1).long()
    return (torch.cat([starts[1:], meta["n_intersections"].reshape(1).long()]) - starts).view(
        meta["isect_offsets"].shape
    )


def test_a_padded_row_jump_stays_within_the_budget_on_the_emulator(monkeypatch):
    """Real kernels and dispatch code: a training render (padded lists) whose middle tile row holds ~10x the step
    before's intersections, with the budget set so low that the capacity takes several dispatches. Each launch's
    work (counted from the device's tile lists) is within the budget forward and backward, every entry is
    composited once each way, launches whose window is past every list of their tiles do nothing (the emulator's
    barrier counter), nothing is read on the host, and the results equal the one-dispatch render."""
    from splat_metal_method.ops import IntersectionCapacities

    width, height = 70, 240
    tw, th = math.ceil(width / TS), math.ceil(height / TS)
    before, now = _jump_scenes(900, width, height)
    caps = IntersectionCapacities()
    caps.force(tw, th, 1, 2048)  # room for both steps (no overflow): the planner sees only this and N
    rows_before = tile_lengths(_padded_step(before, width, height, caps)[2])[0].sum(1)  # the step before
    baseline_caps = IntersectionCapacities()
    baseline_caps.seed_like(caps)
    runtime.reset_launch_counts()
    want = _padded_step(now, width, height, baseline_caps)  # one dispatch each way at the default budget
    assert runtime.launch_counts()["rasterize_fwd"] == runtime.launch_counts()["rasterize_bwd"] == 1

    capacity, M, lengths = want[2]["flatten_ids"].numel(), int(want[2]["n_intersections"]), tile_lengths(want[2])
    assert capacity == 2048 and lengths[0, th // 2].sum() >= 10 * rows_before[th // 2]  # the jump
    budget = runtime.BWD_WORK_FACTOR * TILE_PIXELS * (capacity // 3)  # the capacity is 3 dispatches' worth
    monkeypatch.setattr(runtime, "COMMAND_BUFFER_BUDGET", budget)
    plan = rasterize.plan_padded(capacity, min(900, capacity), (1, th, tw), TILE_PIXELS, budget)
    assert plan.n_passes > 2
    bands = one_pass_bands([int(r) for r in rows_before], th, budget)  # the plan before: from the step before
    worst_before = max(TILE_PIXELS * int(lengths[0, a:b].sum()) for a, b in bands) * runtime.BWD_WORK_FACTOR
    assert worst_before > budget

    seen = []

    def observer(name, kernel, args, launch):
        lib = kernel._lib  # the emulator library: its work counters (as bench/step_ledger.py reads them)
        barriers = lib.work_counters()["barriers"]
        out = kernel(*args, **launch)
        seen.append((name, tuple(launch["threads"]), lib.work_counters()["barriers"] - barriers))
        return out

    reads = []
    monkeypatch.setattr(runtime, "host_read", lambda t: reads.append(t) or t.cpu())
    previous = runtime.set_launch_observer(observer)
    runtime.reset_command_buffers()
    try:
        got = _padded_step(now, width, height, caps)
    finally:
        runtime.set_launch_observer(previous)
    assert reads == [], "a padded render read the device"
    for kernel in ("rasterize_fwd", "rasterize_bwd"):
        launches = [(threads, barriers) for name, threads, barriers in seen if name == kernel]
        assert len(launches) == len(plan.dispatches)
        work = [window_work(d, plan.chunk_of(d), lengths) for d in plan.dispatches]
        assert sum(work) == TILE_PIXELS * M
        for d, w, (threads, barriers) in zip(plan.dispatches, work, launches):
            assert threads == tuple(rasterize.band(d, 1, TS, tw, th).grid["threads"])
            assert w <= d.work and d.work * runtime.BWD_WORK_FACTOR <= budget
            assert (barriers > 0) == (w > 0), (kernel, d, w, barriers)  # nothing to do: the groups return at once
        idle = sum(1 for w in work if w == 0)
        print(f"{kernel}: {len(launches)} launches ({idle} with nothing to composite) for 1 at the default budget; "
              f"worst {max(work) * runtime.BWD_WORK_FACTOR:.3g} (before: {worst_before:.3g}), budget {budget:.3g}")  # fmt: skip
    assert max(b.work for b in runtime.command_buffers()) <= budget
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for g, w in zip(got[3], want[3]):  # float atomics: the summation order follows the passes
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 + 1e-5 * float(w.abs().max()))
