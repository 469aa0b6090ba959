"""The scale ledger (benchmarks/step_model/scale_ledger.py): one steady training render of the Metal
backend counted at the sizes people train, held to budgets at every size.

- Count-only (kernels counted, not run) equals executed (the kernels under the emulator) at small sizes:
  the same launches, aten dispatches, host syncs, command buffers and bytes (bound, and moved: bin_sort's
  counted from the bins' lengths, ledger.MOVED_BYTES) when seeded with what the executed renders taught
  and the bins they filled; the host model of the intersections (reference projection + tile bounds)
  gives the count the kernels produce and bins within a few entries of theirs.
- Budgets (issue 36): dispatches do not grow with the scene. Launches + aten dispatches at 3M gaussians
  at most 11 more than at 20k (what 1.15x allowed over the 77 at 20k before issue 38 removed the padded
  lists' depth sort), no host sync at any size, no work per band but the launch itself.
"""

from __future__ import annotations

import math

import pytest
from step_model import scale_ledger

# non-square, wider and taller; the last with a tile of ~2,100 entries, past a bin (isect.metal bin_sort:
# one merge dispatch, planned from the longest tile: the executed render's, or the host model's)
SMALL = [(600, 120, 78, 1), (1500, 72, 130, 1), (16_000, 64, 40, 2)]


@pytest.mark.parametrize("n, width, height, bin_sorts", SMALL)
def test_count_only_equals_executed(n, width, height, bin_sorts):
    executed = scale_ledger.measure(n, width, height, execute=True)
    assert executed.ledger.kernels["bin_sort"].launches == bin_sorts
    seeded = scale_ledger.measure(n, width, height, seed_from=executed.capacities, bins=executed.bin_lengths)
    modelled = scale_ledger.measure(n, width, height)  # capacities and bins from the host model of the scene
    assert executed.ledger.kernel_total().simd_reductions > 0  # the kernels ran
    assert seeded.ledger.kernel_total().simd_reductions == 0  # ... and here they did not
    assert seeded.summary() == executed.summary()
    for k in ("bin_sort", "scan_block_sums"):  # what each launch moved, counted alike from the same bins
        if k in executed.ledger.kernels:
            got, want = seeded.ledger.kernels[k], executed.ledger.kernels[k]
            assert (got.moved_bytes, got.moved_shapes, got.buffer_shapes) == (
                want.moved_bytes,
                want.moved_shapes,
                want.buffer_shapes,
            ), k
    sort = executed.ledger.kernels["bin_sort"]
    assert 0 < sort.moved_bytes < sort.buffer_bytes  # the merge launch moves the long tile's entries only
    # the host model's bins: the kernels' within a few entries each (float rounding moves a rectangle edge)
    assert len(modelled.bin_lengths) == len(executed.bin_lengths)
    assert (
        max(abs(a - b) for a, b in zip(modelled.bin_lengths, executed.bin_lengths))
        <= 0.01 * max(executed.bin_lengths) + 2
    )
    assert dict(seeded.ledger.aten_ops) == dict(executed.ledger.aten_ops)
    assert {k: w.launches for k, w in seeded.ledger.kernels.items()} == {
        k: w.launches for k, w in executed.ledger.kernels.items()
    }
    # the host model counts the intersections the kernels emit (the reference's math: float rounding at
    # most moves a rectangle edge)
    assert abs(modelled.intersections - executed.intersections) <= 0.01 * executed.intersections
    want, got = executed.summary(), modelled.summary()
    for k in ("kernel_launches", "aten_dispatches", "host_syncs", "command_buffers"):
        assert got[k] == want[k], (k, got, want)
    assert got["kernel_bytes"] == pytest.approx(want["kernel_bytes"], rel=0.05)
    assert got["kernel_moved_bytes"] == pytest.approx(want["kernel_moved_bytes"], rel=0.05)
    got_sort, want_sort = modelled.ledger.kernels["bin_sort"], executed.ledger.kernels["bin_sort"]
    assert got_sort.moved_bytes == pytest.approx(want_sort.moved_bytes, rel=0.02)
    # bin_count's atomics: count-only records the host model's (isect.bin_count_atomics on the reference projection:
    # exact on the same rectangles, tests/ops/metal/test_bin_histograms.py), the executed render the emulator's
    ew, mw = executed.ledger.kernels["bin_count"], modelled.ledger.kernels["bin_count"]
    assert 0 < ew.device_atomics < ew.threadgroup_atomics  # one threadgroup atomic an entry of the counted render
    assert ew.threadgroup_atomics == pytest.approx(executed.intersections, rel=0.01)  # (M heard of: a render earlier)
    assert mw.device_atomics == pytest.approx(ew.device_atomics, rel=0.03, abs=3)
    assert mw.threadgroup_atomics == pytest.approx(ew.threadgroup_atomics, rel=0.01)


# What one steady render step (render, composite, fused loss, backward) may issue at any scene size at
# 1024x664 (measured, issue 36: 50 / 51 / 53 / 57 launches and 55 / 56 / 56 / 56 aten dispatches at 20k /
# 500k / 1.5M / 3M; before: 55 / 176 / 2,268 launches at 20k / 500k / 1.5M; with the per-tile bins of part 3:
# 41 / 42 / 45 / 50 launches and 54 / 55 / 55 / 55 aten dispatches). The launches that grow are the
# command-buffer bands of the rasterizer (one each way per ~4e9 backward-weighted evaluations: the
# watchdog budget, from the work), one more prefix-sum dispatch past 131,072 gaussians and one bin_sort
# dispatch per merge step of the longest tile (2,048 entries doubled: 0 / 0 / 1 / 2). Issue 38: projection +
# SH colour in one kernel each way, no host-side camera inverse: 2 launches and 4 aten dispatches fewer.
# The SH coefficients' Adam inside project_bwd (the render takes it as a steady step arms it): its adam_prepare
# is a launch of the render now (+1), no SH gradient is allocated or accumulated (-4 aten dispatches).
# No global depth sort in the padded lists (each tile's bin sorted by depth bits and flat id): 24 launches and
# one aten dispatch fewer at every size, measured 14 / 15 / 23 launches and 38 / 39 / 39 aten dispatches at
# 20k / 500k / 3M (were 38 / 39 / 47 and 39 / 40 / 40). No isect_ids in the padded lists (isect.py with_isect_ids):
# one aten dispatch fewer at every size, measured 29 / 30 / 30 at 20k / 500k / 3M (were 30 / 31 / 31).
# No rasterizer dispatch over the budget at any load (rasterize.plan_padded: windows of the lists bounded by the
# capacity, not by the rows seen a step late): one dispatch each way while the capacity fits the budget (20k,
# 500k), else the windows the worst case needs, most of them exiting at once: measured 14 / 15 / 81 launches and
# 29 / 30 / 33 aten dispatches at 20k / 500k / 3M (were 14 / 15 / 23 and 29 / 30 / 30).
BUDGETS = {"kernel_launches": 84, "aten_dispatches": 40, "host_syncs": 0}
GROWTH = 72  # dispatches at 3M beyond 20k (measured 71: 32 windows more each way, +1 scan, +2 merges, +3 aten)
SIZES = (20_000, 500_000, 3_000_000)
IMAGE = (1024, 664)


@pytest.fixture(scope="module")
def rows():
    return {n: scale_ledger.measure(n, *IMAGE) for n in SIZES}


def test_budgets_at_every_size(rows):
    over = [f"{n}: {k} = {r.summary()[k]} > {v}" for n, r in rows.items() for k, v in BUDGETS.items()
            if r.summary()[k] > v]  # fmt: skip
    assert not over, "over budget:\n  " + "\n  ".join(over) + "\n" + scale_ledger.table(list(rows.values()))


def test_dispatches_do_not_grow_with_the_scene(rows):
    small, large = rows[SIZES[0]].summary(), rows[SIZES[-1]].summary()
    assert large["dispatches"] - small["dispatches"] <= GROWTH, scale_ledger.table(list(rows.values()))
    # the rasterizer: the dispatches of rasterize.plan_padded each way, from the capacity (no host read)
    row = rows[SIZES[-1]]
    bands = row.ledger.kernels["rasterize_fwd"].launches
    assert row.ledger.kernels["rasterize_bwd"].launches == bands
    from splat_metal_method.ops.metal import rasterize, runtime

    th, tw = math.ceil(IMAGE[1] / 16), math.ceil(IMAGE[0] / 16)
    capacity = row.capacities.entries(tw, th, 1)
    plan = rasterize.plan_padded(capacity, min(row.n_gaussians, capacity), (1, th, tw), 16 * 16,
                                 runtime.COMMAND_BUFFER_BUDGET)  # fmt: skip
    assert bands == len(plan.dispatches), bands
    assert max(d.work for d in plan.dispatches) * runtime.BWD_WORK_FACTOR <= runtime.COMMAND_BUFFER_BUDGET
    assert row.command_buffers <= 2 * bands + 1
    # the intersections grow with the scene (the ledger measured a real load, not an empty image)
    assert rows[SIZES[-1]].intersections > 100 * rows[SIZES[0]].intersections


def test_step_model_takes_the_render_counts_from_the_scale_ledger():
    """bench/step_model.at_scale: the render's launches from the scale ledger, aten kernels grown by the
    scale ledger's growth over its 20k render, the rasterizer's bytes one launch's, Adam's as accesses."""
    from step_model import model as step_model

    step = {"aten_kernels": 28, "n_gaussians": 20_000, "intersections": 1_000, "pixels": 100,
            "part_bytes": {"optimizer": 400, "model, loss, camera opt": 10},
            "kernels": {"rasterize_fwd": {"launches": 3, "buffer_bytes": 300}, "densify_stats": {"launches": 1},
                        "isect_pad": {"launches": 1, "buffer_bytes": 50}}}  # fmt: skip
    scale = {"aten_kernels": 50, "n_gaussians": 1_000_000, "intersections": 5_000_000, "pixels": 10_000,
             "kernels": {"rasterize_fwd": {"launches": 4, "buffer_bytes": 4e9, "threads": 8e6}}}  # fmt: skip
    base = {"aten_kernels": 7, "kernels": {"isect_pad": {"launches": 1}}}  # a render kernel the scale tree dropped
    out = step_model.at_scale(step, scale, base)
    assert out["aten_kernels"] == 28 + 50 - 7
    assert out["kernels"]["rasterize_fwd"]["launches"] == 4 and out["kernels"]["densify_stats"]["launches"] == 1
    assert "isect_pad" not in out["kernels"]
    # one launch's bytes, rescaled so that peers' scaling by intersections lands on the scale ledger's
    assert out["kernels"]["rasterize_fwd"]["buffer_bytes"] == pytest.approx(4e9 / 4 * 1_000 / 5_000_000)
    assert out["part_bytes"] == {"optimizer": 700, "model, loss, camera opt": 10}
    assert step["kernels"]["rasterize_fwd"]["launches"] == 3  # the step ledger is left as it was


def test_rasterize_bytes_are_split_by_what_the_buffers_hold():
    """Issue 36 part 4: the scale ledger tells a kernel's per-gaussian, per-pixel and per-intersection
    buffers apart (scale_ledger.bytes_by_kind), and the model scales each part by its own count."""
    from step_model import model as step_model
    from step_model import peers

    row = scale_ledger.measure(600, 120, 78)  # non-square, count-only
    d = scale_ledger.as_dict(row)
    fwd = d["kernels"]["rasterize_fwd"]
    kinds = fwd["bytes_by_kind"]
    assert sum(kinds.values()) == fwd["buffer_bytes"] and "buffer_shapes" not in fwd
    # the rasterizer holds all three: gaussians' 2-D data, the image it writes, the tile lists it walks
    assert kinds["G"] > 0 and kinds["P"] >= 120 * 78 * 3 * 4 and kinds["M"] > 0
    assert d["kernels"]["project_fwd"]["bytes_by_kind"]["P"] == 0  # projection holds no pixel buffer
    # the classifier: a dimension of n -> per gaussian; both image (or tile-grid) dimensions -> per pixel
    shapes = {"1x600x2": 8, "1x78x120x3": 16, "1x5x8": 4, "4096": 2, "600": 1}
    assert scale_ledger.bytes_by_kind(shapes, 600, 120, 78) == {"G": 9, "P": 20, "M": 2}
    # at_scale then peers: each part lands on the model's own count of what it holds
    step = {"aten_kernels": 28, "n_gaussians": 20_000, "intersections": 1_000, "pixels": 100, "part_bytes": {},
            "kernels": {}}  # fmt: skip
    scale = {"aten_kernels": 50, "n_gaussians": 1_000, "intersections": 5_000, "pixels": 10_000,
             "kernels": {"rasterize_fwd": {"launches": 2, "buffer_bytes": 700,
                                           "bytes_by_kind": {"G": 100, "P": 400, "M": 200}}}}  # fmt: skip
    out = step_model.at_scale(step, scale, {"aten_kernels": 7, "kernels": {}})["kernels"]["rasterize_fwd"]
    assert out["bytes_by_kind"] == pytest.approx({"G": 50 * 20, "P": 200 / 100, "M": 100 / 5})
    assert out["buffer_bytes"] == pytest.approx(sum(out["bytes_by_kind"].values()))
    assert peers.kernel_grows("rasterize_fwd") != "P"  # one ratio for all would misprice the image part


def test_the_model_prices_moved_bytes_where_counted_and_bound_bytes_elsewhere():
    """ledger.MOVED_BYTES (bin_sort, scan_block_sums): a row with what a kernel's launches moved is priced by
    that (at_scale carries it, scaled by what each part holds; peers prefers it); a row without (ledger files
    written before it) is priced by its bound bytes as before."""
    from step_model import model as step_model
    from step_model import peers

    step = {"aten_kernels": 28, "n_gaussians": 20_000, "intersections": 1_000, "pixels": 100, "part_bytes": {},
            "host_syncs": 0, "kernels": {"bin_sort": {"launches": 1, "buffer_bytes": 10, "moved_bytes": 5}}}  # fmt: skip
    bound = {"launches": 3, "buffer_bytes": 8e9, "threads": 1e6, "bytes_by_kind": {"G": 1e9, "P": 0, "M": 7e9}}
    moved = {**bound, "moved_bytes": 3e9, "moved_by_kind": {"G": 0, "P": 0, "M": 3e9}}
    scene = peers.COMPARE_SCENES[-1]
    terms, per_g = {}, {}
    for label, w in (("bound", bound), ("moved", moved)):
        scale = {"aten_kernels": 30, "n_gaussians": int(scene.gaussians), "intersections": 15_000_000,
                 "pixels": scene.width * scene.height, "kernels": {"bin_sort": w}}  # fmt: skip
        out = step_model.at_scale(step, scale, {"aten_kernels": 28, "kernels": {}})
        sort = out["kernels"]["bin_sort"]
        assert ("moved_bytes" in sort) == (label == "moved")  # the step ledger's own figure is not carried over
        b = peers.OursFromLedger(out).step(scene, "M4 Max", peers.CALIBRATED)
        terms[label] = b.terms["sort (radix + scan)"]
        per_g[label] = step_model.bytes_per_gaussian(step, scale).get("render: bin_sort", 0.0)
    g = peers._Gpu("M4 Max", peers.CALIBRATED)
    assert terms["moved"] == pytest.approx(g.bytes_ms(3e9 * scene.M / 15_000_000))
    assert terms["bound"] == pytest.approx(g.bytes_ms(1e9 * scene.gaussians / scene.gaussians + 7e9 * scene.M / 15e6))
    assert per_g == {
        "bound": pytest.approx(1e9 / scene.gaussians),
        "moved": 0.0,
    }  # the moved depths: gathers, per entry
