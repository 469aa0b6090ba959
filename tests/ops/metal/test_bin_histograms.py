"""bin_count's threadgroup tile histograms (ops/metal/isect.metal bin_count): a group counts its run of gaussians'
entries per tile in threadgroup memory and reserves each touched tile's ranks with one device atomic.

- Run directly (the emulator) on three cameras of a non-square tile grid, with groups that straddle cameras, a
  window of the default size and a small forced one (SPLAT_BIN_WINDOW: tiles past it take the per-entry device
  atomic), with and without a capacity cut: every kept entry is in its (camera, tile) bin once, the bins as the
  flat-order emission gives them (the per-entry kernel's result: ranks may differ, the sorted bins may not).
- The atomics it issues (counted by the emulator) are exactly the host's count (isect.bin_count_atomics, what
  the scale ledger records in count-only mode): device atomics = distinct (group, tile in window) + entries past
  the window; threadgroup atomics = entries in the window.
- The padded lists stay the exact lists entry for entry (flatten_ids, isect_ids, offsets) with the small window
  and with one gaussian a thread (groups straddling the camera boundary).
- The tests can fail: a wrong reservation base, a skipped second pass, are caught.
"""

from __future__ import annotations

import pytest
import torch
from planted import planted_library

from splat_metal_method.bench import step_ledger
from splat_metal_method.ops import reference
from splat_metal_method.ops.metal import isect
from splat_metal_method.ops.metal.kernels import BIN_WINDOW, library

TW, TH, TS = 7, 4, 16  # a non-square grid of 16 px tiles: 112 x 64 px


def scene(C: int = 3, n: int = 500, seed: int = 5):
    """means2d [C, n, 2] and radii [C, n] over the grid (a crowd in a few tiles, some large, some radii <= 0)."""
    gen = torch.Generator().manual_seed(seed)
    means2d = torch.stack([112 * torch.rand(C, n, generator=gen), 64 * torch.rand(C, n, generator=gen)], -1)
    crowd = torch.rand(C, n, generator=gen) < 0.5
    means2d[crowd] = torch.tensor([40.0, 20.0]) + 20 * torch.rand(int(crowd.sum()), 2, generator=gen)
    radii = torch.randint(-2, 24, (C, n), generator=gen, dtype=torch.int32)
    return means2d.contiguous(), radii


def bins_by_emission(means2d, radii, capacity):
    """Flat ids per dense (camera, tile) bin of the first `capacity` entries of the flat-order emission."""
    C, n = radii.shape
    lo, span = reference.tile_bounds(means2d, radii, TS, TW, TH)
    lo, span = lo.reshape(-1, 2).tolist(), span.reshape(-1, 2).tolist()
    emission = []
    for g in range(C * n):
        if int(radii.reshape(-1)[g]) > 0:
            (x0, y0), (sx, sy) = lo[g], span[g]
            emission += [((g // n) * TW * TH + y * TW + x, g) for y in range(y0, y0 + sy) for x in range(x0, x0 + sx)]
    want = [[] for _ in range(C * TW * TH)]
    for t, g in emission[:capacity]:
        want[t].append(g)
    return want, len(emission)


def run_bins(lib, means2d, radii, cut: bool, per_thread: int, group: int):
    """bin_count + bin_fill on the scene; returns (what differs from the emission model, the ledger's bin_count)."""
    C, n = radii.shape
    lo, span = reference.tile_bounds(means2d, radii, TS, TW, TH)
    counts = (span[..., 0] * span[..., 1] * (radii > 0)).reshape(-1).int()
    cum = torch.cumsum(counts.long(), 0)
    M = int(cum[-1])
    capacity = M * 2 // 3 if cut else M
    want, total = bins_by_emission(means2d, radii, capacity)
    assert total == M
    bins = torch.zeros(C * TW * TH + 2, dtype=torch.int32)
    slots = torch.full((capacity,), -1, dtype=torch.int32)
    ranks = torch.full((capacity + 5,), -1, dtype=torch.int32)
    geometry = (C * n, n, TS, TW, TH, capacity)
    with step_ledger.count("bin_count") as led:
        lib.bin_count(means2d, radii, counts, cum, bins, slots, *geometry, per_thread,
                      **isect.bin_count_grid(C * n, per_thread, group))  # fmt: skip
    ends = torch.cumsum(bins.long(), 0)
    from splat_metal_method.ops.metal.kernels import grid_1d

    lib.bin_fill(means2d, radii, counts, cum, slots, ends, ranks, *geometry, **grid_1d(C * n))
    out = []
    if bins[: C * TW * TH].tolist() != [len(w) for w in want]:
        out.append("bin lengths")
    starts = [0] + ends[: C * TW * TH].tolist()
    for t in range(C * TW * TH):
        if sorted(ranks[starts[t] : starts[t + 1]].tolist()) != sorted(want[t]):
            out.append(f"bin {t}")
    if ranks[capacity:].tolist() != [-1] * 5:
        out.append("past the capacity")
    return out, led.kernels["bin_count"], capacity


def windowed(window: int):
    return library(torch.device("cpu"), "isect.metal", extra=(("SPLAT_BIN_WINDOW", window),))


# (window, per_thread, group): the default window (every tile of the three cameras in it: no fallback), windows
# of 9 and 40 tiles (the rest of a camera's 28 tiles, or the later cameras', past it: per-entry device atomics),
# groups of 32 threads x 3 or 5 gaussians (groups straddle the camera boundaries at 500 and 1000) and of 64 x 1.
CONFIGS = [(BIN_WINDOW, 3, 32), (9, 3, 32), (9, 1, 64), (40, 5, 32)]


@pytest.mark.planted_variants  # windows of 9 and 40 tiles
@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("window, per_thread, group", CONFIGS)
def test_bins_and_atomics(window, per_thread, group, cut):
    means2d, radii = scene()
    lib = windowed(window) if window != BIN_WINDOW else isect.library(torch.device("cpu"), "isect.metal")
    diffs, work, capacity = run_bins(lib, means2d, radii, cut, per_thread, group)
    assert diffs == []
    device, tg = isect.bin_count_atomics(means2d, radii, TS, TW, TH, capacity if cut else None, per_thread, group,
                                         window)  # fmt: skip
    assert (work.device_atomics, work.threadgroup_atomics) == (device, tg)
    if window < 3 * TW * TH:  # the fallback ran: entries past a window took a device atomic each
        assert 0 < tg < capacity
    else:  # every entry counted in threadgroup memory; far fewer device atomics than entries
        assert tg == capacity and device < capacity / 2


@pytest.mark.planted_variants  # a window of 40 tiles held 9 at a time
@pytest.mark.parametrize("cut", [False, True])
def test_bins_counted_in_rounds_are_those_of_one_round(cut):
    """A window of 40 tiles whose counters are held 9 at a time (SPLAT_BIN_ROUND: 5 rounds, the last of 4 tiles;
    the default holds its 7,680 tiles in 2 rounds of 3,840): the same bins, ranks and atomics as one round."""
    means2d, radii = scene()
    lib = library(torch.device("cpu"), "isect.metal", extra=(("SPLAT_BIN_WINDOW", 40), ("SPLAT_BIN_ROUND", 9)))
    diffs, work, capacity = run_bins(lib, means2d, radii, cut, 5, 32)
    assert diffs == []
    device, tg = isect.bin_count_atomics(means2d, radii, TS, TW, TH, capacity if cut else None, 5, 32, 40)
    assert (work.device_atomics, work.threadgroup_atomics) == (device, tg) and 0 < tg < capacity
    assert work.threadgroup_bytes == 9 * 4


@pytest.mark.planted_variants
def test_a_planted_single_round_is_caught():
    """bin_count running its first round only (the tiles past the first 9 of the window never counted)."""
    old = "for (long r0 = w0; r0 < w1; r0 += SPLAT_BIN_ROUND) {"
    planted = planted_library("isect.metal", [(old, old.replace("r0 < w1", "r0 < w1 && r0 == w0"))],
                              "isect planted: one round", (("SPLAT_BIN_WINDOW", 40), ("SPLAT_BIN_ROUND", 9)))  # fmt: skip
    means2d, radii = scene()
    diffs, _, _ = run_bins(planted, means2d, radii, False, 5, 32)
    assert "bin lengths" in diffs


PLANTS = {
    "reservation base": ("atomic_fetch_add_explicit(&bins[r0 + i], c,", "atomic_fetch_add_explicit(&bins[r0 + i], 1,"),
    "second pass skipped": ("slots[out] += atomic_load_explicit(&hist[t - r0], memory_order_relaxed);",
                            "slots[out] += 0;"),
    "reserved tile": ("atomic_fetch_add_explicit(&bins[r0 + i], c,", "atomic_fetch_add_explicit(&bins[r0 + i + 1], c,"),
}  # fmt: skip


@pytest.mark.planted_variants
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_histogram_bugs_are_caught(plant):
    planted = planted_library("isect.metal", [PLANTS[plant]], f"isect planted: {plant}", (("SPLAT_BIN_WINDOW", 40),))
    means2d, radii = scene()
    diffs, _, _ = run_bins(planted, means2d, radii, False, 3, 32)
    assert diffs != []


@pytest.mark.planted_variants  # a window of 9 tiles
@pytest.mark.parametrize("window, per_thread", [(9, 16), (9, 1), (BIN_WINDOW, 1)])
def test_padded_lists_stay_the_exact_lists(monkeypatch, window, per_thread):
    """isect_tiles_padded_fwd with a small window / one gaussian a thread: the exact lists entry for entry."""
    from test_bins import any_depth_lists, list_differences

    if window != BIN_WINDOW:
        lib = windowed(window)
        real = isect.library
        monkeypatch.setattr(
            isect, "library", lambda device, stage, *a: lib if stage == "isect.metal" else real(device, stage, *a)
        )
    monkeypatch.setattr(isect, "BIN_COUNT_ITEMS", per_thread)
    means2d, radii, depths = any_depth_lists()  # two cameras of 3,000: a group straddles them
    assert list_differences(means2d, radii, depths) == []
