"""isect.metal's guards (issue 22, section 5 and its float-to-int conversions, section 2):

- isect_emit writes exactly the count isect_count sized its range with, even when its own recomputed
  tile rectangle disagrees: a planted disagreement (emit's rectangle one tile wider) stays inside the
  gaussian's range, whereas the same disagreement without the guard writes into the neighbour's range
  and past the buffer (shown too, so the check below can fail);
- non-finite or huge means give an empty rectangle, never a converted NaN/inf.
"""

from __future__ import annotations

import pytest
import torch

from splat_metal_method.ops.metal import kernels, runtime
from splat_metal_method.ops.metal.scan import prefix_sum
from splat_metal_method.ops.metal.sort import radix_sort_pairs

TS, W, H = 16, 256, 160  # 16 x 10 tiles
TILE_W, TILE_H = W // TS, H // TS
TILE_BITS = (TILE_W * TILE_H).bit_length()
SENTINEL = -7
EMIT_RECT = (
    "tile_rect(means2d[2 * g], means2d[2 * g + 1], radii[g], tile_size, tile_width, tile_height, x0, y0, x1, y1);"
)
GUARD = " && out < end"


def isect_library(grow_emit: bool = False, unguarded: bool = False):
    """isect.metal, optionally with emit's rectangle one tile wider than isect_count's (planted) and/or
    without emit's stop at the sized count."""
    src = kernels.stage_source("isect.metal")
    assert src.count(EMIT_RECT) == 1 and src.count(GUARD) == 2, "isect_emit changed: update this test"
    if grow_emit:
        src = src.replace(EMIT_RECT, EMIT_RECT + " x1 += 1; /* planted */")
    if unguarded:
        src = src.replace(GUARD, "")
    return runtime.library_for("cpu", src, name="isect.metal")


def emit(lib, means2d, radii, depths, spare: int = 64):
    """Runs the depth sort, isect_count (always the real one), our scan and the given library's
    isect_emit into buffers with `spare` sentinel entries past M. Returns (tiles_per_gauss, order, cum,
    tile_keys, flat_ids, M)."""
    n = radii.numel()
    real = isect_library()
    tiles_per_gauss = torch.empty(n, dtype=torch.int32)
    counts = torch.empty(n, dtype=torch.int32)
    _, order = radix_sort_pairs(depths.view(torch.int32), torch.arange(n, dtype=torch.int32), bits=32)
    real.isect_count(
        means2d, radii, order, tiles_per_gauss, counts, n, TS, TILE_W, TILE_H, counts, 0, 1, **kernels.grid_1d(n)
    )
    assert torch.equal(counts, tiles_per_gauss[order.long()])
    cum = prefix_sum(counts, inclusive=True)
    M = int(cum[-1])
    tile_keys = torch.full((M + spare,), SENTINEL, dtype=torch.int32)
    flat_ids = torch.full((M + spare,), SENTINEL, dtype=torch.int32)
    lib.isect_emit(means2d, radii, tiles_per_gauss, order, cum, tile_keys, flat_ids, n, n, TS, TILE_W, TILE_H,
                   TILE_BITS, M, **kernels.grid_1d(n))  # fmt: skip
    return tiles_per_gauss, order, cum, tile_keys, flat_ids, M


def ranges_hold_only_their_gaussian(order, cum, tiles_per_gauss, flat_ids, M) -> bool:
    starts = cum - tiles_per_gauss[order.long()]
    owner = torch.repeat_interleave(order.long(), tiles_per_gauss[order.long()].long())  # [M] who owns entry i
    assert owner.numel() == M and int(starts[0]) == 0
    return bool(torch.equal(flat_ids[:M].long(), owner)) and bool((flat_ids[M:] == SENTINEL).all())


def scene(n=60, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # away from the right edge, so that the planted wider rectangle really is one tile wider
    means2d = torch.stack(
        [torch.empty(n).uniform_(40, 180, generator=gen), torch.empty(n).uniform_(20, 140, generator=gen)], dim=-1
    ).contiguous()
    radii = torch.randint(3, 40, (n,), generator=gen, dtype=torch.int32)
    depths = torch.empty(n).uniform_(1, 5, generator=gen)
    return means2d, radii, depths


def test_emit_matches_the_count_that_sized_its_range():
    means2d, radii, depths = scene()
    tpg, order, cum, keys, ids, M = emit(isect_library(), means2d, radii, depths)
    assert M > 100
    assert ranges_hold_only_their_gaussian(order, cum, tpg, ids, M)
    assert (keys[M:] == SENTINEL).all()


def test_a_planted_emit_count_disagreement_stays_in_bounds():
    means2d, radii, depths = scene()
    tpg, order, cum, keys, ids, M = emit(isect_library(grow_emit=True), means2d, radii, depths)
    assert ranges_hold_only_their_gaussian(order, cum, tpg, ids, M), "emit wrote outside a gaussian's range"
    assert (keys[M:] == SENTINEL).all()
    # the disagreement is real: its wider rectangle gave some gaussian a tile isect_count did not count
    _, _, _, good_keys, _, _ = emit(isect_library(), means2d, radii, depths)
    assert not torch.equal(keys[:M], good_keys[:M])
    assert (keys[:M] < TILE_W * TILE_H).all() and (keys[:M] >= 0).all()


def test_without_the_guard_the_planted_disagreement_overwrites_neighbours():
    """What the guard prevents (and that the check above can fail): the wider rectangle unguarded."""
    means2d, radii, depths = scene()
    tpg, order, cum, keys, ids, M = emit(
        isect_library(grow_emit=True, unguarded=True), means2d, radii, depths, spare=4096
    )  # room for what the last gaussian writes past M
    assert not ranges_hold_only_their_gaussian(order, cum, tpg, ids, M)
    assert (ids[M:] != SENTINEL).any(), "the last gaussian in depth order should have written past M"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 1e38, -1e38])
def test_non_finite_or_huge_means_give_an_empty_rectangle(bad):
    means2d, radii, depths = scene(n=8, seed=1)
    means2d[3, 0] = bad
    means2d[5, 1] = bad
    tpg, order, cum, keys, ids, M = emit(isect_library(), means2d, radii, depths)
    assert tpg[3] == 0 and tpg[5] == 0, tpg
    assert (tpg[[0, 1, 2, 4, 6, 7]] > 0).all()
    assert ranges_hold_only_their_gaussian(order, cum, tpg, ids, M)
