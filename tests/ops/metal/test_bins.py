"""Per-tile bins of the padded lists (ops/metal/isect.metal bin_count / bin_fill / bin_sort): exact at any
tile length.

- A tile of 10,000+ gaussians, longer than a bin (BIN_CAPACITY entries, sorted in threadgroup memory), with
  thousands of exact depth ties: the padded lists are the exact lists (the radix path) entry for entry, and
  the render and its gradients are the reference's, whether the merge steps were planned from the longest
  tile seen a step late (one bin_sort dispatch per step), not planned yet (one dispatch runs them all) or
  planned too short (the last dispatch finishes the tile), at several grid sizes and tile sizes.
- No global depth sort: each bin is sorted by the 64-bit key (depth bits << 32 | flat id). Fed any depth
  bits (negative, -0.0 and 0.0, infinities, denormals, exact ties), the padded lists equal the exact lists
  (isect_tiles_fwd: a stable radix sort by the unsigned depth bits) and the reference's entry for entry,
  short bins and a bin merged past BIN_CAPACITY alike.
- bin_count stores each entry's rank in its tile (threadgroup tile histograms, one device atomic per group and
  tile: tests/ops/metal/test_bin_histograms.py), bin_fill places it by that rank without atomics. Run directly on
  two cameras with entries past their rectangle (bin_count's tail: one atomic for all of them) and a capacity that holds all or cuts such a tail, every kept entry is in its bin once;
  planted off-by-ones in the slots are caught.
- The tests can fail: planted variants of the kernels (msplat's bins, which keep the first BIN_CAPACITY
  entries of a tile in the order the atomics handed out the slots; a sort key that does not break depth
  ties by gaussian id; a key of signed depth bits) are caught by the same comparisons.
"""

from __future__ import annotations

import math

import pytest
import torch
from planted import planted_library

from splat_metal_method.ops import IntersectionCapacities, rasterization
from splat_metal_method.ops.metal import isect, runtime
from splat_metal_method.ops.metal.fused import rasterization_metal
from splat_metal_method.ops.metal.kernels import BIN_CAPACITY


def long_tile_scene(n: int, width: int, height: int, tile: tuple, tile_size: int, seed: int = 0):
    """`n` small faint gaussians over the pixels of tile `tile` = (x, y) (each pixel sees hundreds, none
    reaches the transmittance floor, so every entry shows in the image), on 6 depths only: thousands of
    exact depth ties, ordered by gaussian id. Plus a few larger ones over the rest of the image."""
    gen = torch.Generator().manual_seed(seed)
    f = 0.9 * width
    z = 5.0 + 0.5 * torch.randint(0, 6, (n,), generator=gen).float()  # [n] exact ties
    x0, y0 = tile[0] * tile_size, tile[1] * tile_size
    u = x0 + 1.0 + (tile_size - 2.0) * torch.rand(n, generator=gen)
    v = y0 + 1.0 + (tile_size - 2.0) * torch.rand(n, generator=gen)
    scales = (0.4 * z / f)[:, None] * (0.2 * torch.randn(n, 3, generator=gen)).exp()
    k = 40  # the rest of the image: larger gaussians anywhere
    zk = 4.0 + 3.0 * torch.rand(k, generator=gen)
    uk, vk = width * torch.rand(k, generator=gen), height * torch.rand(k, generator=gen)
    z, u, v = torch.cat([z, zk]), torch.cat([u, uk]), torch.cat([v, vk])
    scales = torch.cat([scales, (3.0 * zk / f)[:, None].expand(k, 3)])
    means = torch.stack([(u - width / 2) / f * z, (v - height / 2) / f * z, z], -1)
    quats = torch.randn(n + k, 4, generator=gen)
    opacities = torch.rand(n + k, generator=gen) * 0.03 + 0.01
    colors = torch.rand(n + k, 3, generator=gen)
    return (means, quats, scales, opacities, colors), torch.eye(4)[None]


def render(params, viewmats, width, height, tile_size, caps=None, backend="metal"):
    leaves = [p.clone().requires_grad_(True) for p in params]
    f = 0.9 * width
    Ks = torch.tensor([[f, 0, width / 2], [0, f, height / 2], [0, 0, 1]]).repeat(viewmats.shape[0], 1, 1)
    if backend == "metal":
        colors, alphas, meta = rasterization_metal(*leaves, viewmats, Ks, width, height, tile_size=tile_size,
                                                   absgrad=True, isect_capacity=caps)  # fmt: skip
    else:
        colors, alphas, meta = rasterization(*leaves, viewmats, Ks, width, height, tile_size=tile_size,
                                             backend=backend, absgrad=True)  # fmt: skip
    weights = torch.linspace(0.5, 1.5, colors.numel()).view(colors.shape)
    ((colors * weights).sum() + alphas.sum()).backward()
    return colors.detach(), alphas.detach(), meta, [p.grad for p in leaves] + [meta["means2d"].absgrad]


def differences(got, exact) -> list:
    """What differs between a render with padded lists (bins) and one with exact lists: [] when none."""
    out = []
    meta, want = got[2], exact[2]
    M = want["flatten_ids"].numel()
    if meta["n_intersections"].tolist() != [M]:
        out.append(f"count {meta['n_intersections'].tolist()} != {M}")
    for name in ("isect_offsets", "tiles_per_gauss"):
        if not torch.equal(meta[name], want[name]):
            out.append(name)
    if meta["isect_ids"] is not None:  # a training render builds none (bin_sort skips them)
        out.append("isect_ids built")
    if M <= meta["flatten_ids"].numel():
        if not torch.equal(meta["flatten_ids"][:M], want["flatten_ids"]):
            out.append("flatten_ids")
        # asked for on the same projection (fresh capacities: one bin_sort dispatch runs every merge step)
        ids = isect.isect_tiles_padded_fwd(meta["means2d"].detach(), meta["radii"], meta["depths"].detach(),
                                           meta["tile_size"], meta["tile_width"], meta["tile_height"],
                                           IntersectionCapacities(), with_isect_ids=True)[1]  # fmt: skip
        if not torch.equal(ids[:M], want["isect_ids"]):
            out.append("isect_ids")
    if not (torch.equal(got[0], exact[0]) and torch.equal(got[1], exact[1])):
        out.append("pixels")
    for g, w in zip(got[3], exact[3]):  # two exact renders differ by ~1e-5 here (the order of float atomics)
        scale = w.abs().max().item() or 1.0
        if (g - w).abs().max().item() > 1e-4 * scale:
            out.append("gradients")
            break
    return out


def longest_tile(meta) -> int:
    starts = meta["isect_offsets"].reshape(-1).long()
    ends = torch.cat([starts[1:], meta["n_intersections"].long()])
    return int((ends - starts).max())


# (width, height, tile_size, the long tile): non-square, 6 / 24 / 45 tiles
GRIDS = [(40, 24, 16, (1, 0)), (52, 90, 16, (2, 3)), (72, 40, 8, (4, 2))]


@pytest.mark.parametrize("width, height, tile_size, tile", GRIDS, ids=lambda v: str(v))
def test_a_tile_of_ten_thousand_is_sorted_exactly(width, height, tile_size, tile):
    params, viewmats = long_tile_scene(10_300, width, height, tile, tile_size, seed=width)
    exact = render(params, viewmats, width, height, tile_size)
    caps = IntersectionCapacities()
    key = isect._grid_key(
        torch.device("cpu"), 1, tile_size, math.ceil(width / tile_size), math.ceil(height / tile_size)
    )
    plans = {}
    for call in ("not planned", "planned", "planned short"):
        if call == "planned short":  # an estimate below this step's longest tile: the last dispatch finishes it
            state = caps._grids[key]
            state.pending.clear()  # (what the device said of the last call: its longest tile)
            state.longest = BIN_CAPACITY + 1
        runtime.reset_launch_counts()
        got = render(params, viewmats, width, height, tile_size, caps=caps)
        plans[call] = runtime.launch_counts()["bin_sort"]
        assert differences(got, exact) == [], call
    assert longest_tile(got[2]) >= 10_000 > BIN_CAPACITY
    need = isect.merge_steps(longest_tile(got[2]))  # 3: 2,048 -> 16,384
    assert plans == {"not planned": 1, "planned": 1 + isect.merge_steps(math.ceil(longest_tile(got[2]) * isect.HEADROOM)),
                     "planned short": 2} and need >= 3, plans  # fmt: skip

    # the same pixels and gradients as the reference backend (ops/reference.py)
    ref = render(params, viewmats, width, height, tile_size, backend="reference")
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-5)
    for g, w in zip(got[3], ref[3]):
        scale = w.abs().max().item() or 1.0
        assert (g - w).abs().max().item() <= 1e-3 * scale, (g - w).abs().max().item() / scale


def test_two_cameras_share_one_bin_sort():
    params, viewmats = long_tile_scene(4_000, 40, 24, (1, 0), 16, seed=2)
    viewmats = viewmats.repeat(2, 1, 1)
    viewmats[1, 0, 3] = 0.05
    caps = IntersectionCapacities()
    exact = render(params, viewmats, 40, 24, 16)
    for _ in range(2):
        assert differences(render(params, viewmats, 40, 24, 16, caps=caps), exact) == []


# Planted variants of isect.metal (textual edits of its source): each must be caught by differences().
PLANTS = {
    # msplat's bins: a tile keeps the first BIN_CAPACITY entries the atomics hand out, the rest are dropped
    "drop past the bin": [
        ("                slots[out] += atomic_load_explicit(&hist[t - r0], memory_order_relaxed);",
         "                slots[out] += atomic_load_explicit(&hist[t - r0], memory_order_relaxed);"
         " if (slots[out] >= SPLAT_BIN_CAPACITY) { atomic_fetch_sub_explicit(&bins[t], 1, memory_order_relaxed); }"),
        ("      ranks[(t > 0 ? ends[t - 1] : 0) + slots[out]] = g;",
         "      if (slots[out] < SPLAT_BIN_CAPACITY) { ranks[(t > 0 ? ends[t - 1] : 0) + slots[out]] = g; }"),
    ],
    # a key that does not break depth ties by id (the block sort compares the depth bits only: ties in the
    # bitonic network's order)
    "ties in scatter order": [("if (((i & k) == 0) == (a > b)) {",
                               "if (((i & k) == 0) == ((a >> 32) > (b >> 32))) {")],
}  # fmt: skip
PLANT_SCENES = {"drop past the bin": 4_000, "ties in scatter order": 1_500}  # the second within one bin


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_bins_are_caught(plant, monkeypatch):
    planted = planted_library("isect.metal", PLANTS[plant], f"isect planted: {plant}")
    real = isect.library
    monkeypatch.setattr(
        isect, "library", lambda device, stage, *a: planted if stage == "isect.metal" else real(device, stage, *a)
    )
    params, viewmats = long_tile_scene(PLANT_SCENES[plant], 40, 24, (1, 0), 16, seed=1)
    exact = render(params, viewmats, 40, 24, 16)
    assert differences(render(params, viewmats, 40, 24, 16, caps=IntersectionCapacities()), exact) != []


@pytest.mark.parametrize("width, height", [(70, 45), (33, 64)])
def test_a_render_with_no_intersections_gets_empty_bins(width, height):
    """Every gaussian behind the camera: the bins are empty, every tile's range is [0, 0) (the offsets are
    written, not left as whatever the buffer held), the image is the background and the gradients are 0,
    on a fresh renderer and on its later steps."""
    n = 300
    gen = torch.Generator().manual_seed(4)
    means = torch.randn(n, 3, generator=gen)
    means[:, 2] = -5.0  # [N, 3] all behind the camera
    quats = torch.randn(n, 4, generator=gen)
    scales = torch.full((n, 3), 0.1)
    opacities = torch.full((n,), 0.8)
    colors = torch.rand(n, 3, generator=gen)
    viewmats = torch.eye(4)[None]  # [1, 4, 4]
    caps = IntersectionCapacities()
    for _ in range(3):
        rgb, alpha, meta, grads = render((means, quats, scales, opacities, colors), viewmats, width, height, 16, caps)
        assert rgb.abs().max() == 0 and alpha.abs().max() == 0
        assert int(meta["isect_offsets"].min()) == 0 and int(meta["isect_offsets"].max()) == 0
        assert all(g is None or (torch.isfinite(g).all() and g.abs().max() == 0) for g in grads)


def any_depth_lists(C: int = 2, n: int = 3_000, seed: int = 7):
    """means2d [C, n, 2], radii [C, n] and depths [C, n] of a 5 x 3 grid of 16 px tiles (80 x 48 px): most
    gaussians small and in tile (2, 1) of camera 0, so that its bin (~2,500 entries) is merged past
    BIN_CAPACITY; depths drawn from values whose bits order otherwise than the floats (negatives, -0.0, the
    infinities, denormals) and with exact ties; some radii 0 or negative (no tiles)."""
    gen = torch.Generator().manual_seed(seed)
    means2d = torch.stack([80 * torch.rand(C, n, generator=gen), 48 * torch.rand(C, n, generator=gen)], -1)
    crowd = torch.rand(n, generator=gen) < 0.85
    means2d[0, crowd] = torch.tensor([34.0, 18.0]) + 12 * torch.rand(int(crowd.sum()), 2, generator=gen)
    radii = torch.randint(-2, 20, (C, n), generator=gen, dtype=torch.int32)
    radii[0, crowd] = torch.randint(1, 3, (int(crowd.sum()),), generator=gen, dtype=torch.int32)
    pool = torch.tensor([-3.5, -0.0, 0.0, 1e-42, -1e-40, 2.5, 7.0, float("inf"), float("-inf"), 1e30, -2.5])
    depths = pool[torch.randint(0, len(pool), (C, n), generator=gen)]
    mixed = torch.rand(C, n, generator=gen) < 0.3
    depths[mixed] = 20 * torch.randn(int(mixed.sum()), generator=gen)  # and distinct values, of both signs
    return means2d.contiguous(), radii, depths.contiguous()


def list_differences(means2d, radii, depths, calls: int = 2) -> list:
    """What differs between the padded lists (bins) and the exact lists (isect_tiles_fwd, whose order is
    the stable radix sort by the unsigned depth bits) and the reference's, over `calls` padded calls of one
    renderer (the first unplanned, then planned from what the device said): [] when none."""
    from splat_metal_method.ops import reference

    C, n = radii.shape
    tw, th, ts = 5, 3, 16
    tpg, ids, fids = isect.isect_tiles_fwd(means2d, radii, depths, ts, tw, th)
    offsets = isect.isect_offset_encode_fwd(ids, C, tw, th).reshape(-1)
    ref_tpg, ref_ids, ref_fids = reference.isect_tiles(means2d, radii, depths, ts, tw, th)
    assert torch.equal(ref_ids, ids) and torch.equal(ref_fids, fids) and torch.equal(ref_tpg, tpg)
    M = ids.numel()
    starts = torch.cat([offsets, torch.tensor([M], dtype=torch.int32)]).long()
    assert int((starts[1:] - starts[:-1]).max()) > BIN_CAPACITY  # one bin is merged
    caps, out = IntersectionCapacities(), []
    for call in range(calls):
        p_tpg, p_ids, p_fids, p_offsets = isect.isect_tiles_padded_fwd(means2d, radii, depths, ts, tw, th, caps)
        for name, got, want in (("tiles_per_gauss", p_tpg, tpg), ("isect_ids", p_ids[:M], ids),
                                ("flatten_ids", p_fids[:M], fids), ("offsets", p_offsets[:-1], offsets)):  # fmt: skip
            if not torch.equal(got, want):
                out.append(f"call {call}: {name}")
        if int(p_offsets[-1]) != M:
            out.append(f"call {call}: count")
    return out


def test_bins_order_any_depth_bits_as_the_exact_lists():
    means2d, radii, depths = any_depth_lists()
    bits = depths.view(torch.int32)
    assert (bits < 0).any() and (depths == 0).any() and depths.isinf().any()  # the scene has what it says
    assert list_differences(means2d, radii, depths) == []


def test_a_key_of_signed_depth_bits_is_caught(monkeypatch):
    """The comparison above can fail: bins sorted by the depth bits as a signed integer (negative depths
    first, as the floats order them, unlike the exact lists' unsigned bits; the written bits unchanged)."""
    signed_keys = (("return ((ulong)as_type<uint>(depths[g]) << 32) | (ulong)g;",
                    "return ((ulong)(as_type<uint>(depths[g]) ^ 0x80000000u) << 32) | (ulong)g;"),
                   ("isect_ids[i] = (long)((key << 32) | (k >> 32));",
                    "isect_ids[i] = (long)((key << 32) | ((k >> 32) ^ 0x80000000ul));"))  # fmt: skip
    planted = planted_library("isect.metal", signed_keys, "isect planted: signed keys")
    real = isect.library
    monkeypatch.setattr(
        isect, "library", lambda device, stage, *a: planted if stage == "isect.metal" else real(device, stage, *a)
    )
    means2d, radii, depths = any_depth_lists()
    assert list_differences(means2d, radii, depths, calls=1) != []


def bin_kernel_differences(lib, C: int = 2, n: int = 400, cut_in_tail: bool = False, seed: int = 3,
                           per_thread: int = 1, group: int = 64) -> list:  # fmt: skip
    """bin_count + bin_fill run directly (isect.metal) against the bins a model of the flat-order emission
    gives: every entry of the first `capacity` (camera-major, gaussian-major, tile y-major, x-minor) in its
    (camera, tile) bin, once. Some gaussians are given more tiles than their rectangle holds (tiles_per_gauss
    planted larger, as isect_emit's guard allows): the rest of their entries go to tile 0 of their camera,
    bin_count's tail (one atomic for all of them). Two cameras; the capacity either holds every entry or cuts
    one such tail in the last camera. Returns what differs: [] when nothing does."""
    from splat_metal_method.ops import reference
    from splat_metal_method.ops.metal.kernels import grid_1d

    tw, th, ts = 5, 3, 16
    n_tiles = tw * th
    means2d, radii, depths = any_depth_lists(C, n, seed)
    lo, span = reference.tile_bounds(means2d, radii, ts, tw, th)
    true_counts = (span[..., 0] * span[..., 1] * (radii > 0)).reshape(-1)
    gen = torch.Generator().manual_seed(seed)
    extra = torch.randint(1, 4, (C * n,), generator=gen) * (torch.rand(C * n, generator=gen) < 0.2)
    extra = extra * (radii.reshape(-1) > 0)  # a gaussian behind the camera keeps no entries
    counts = (true_counts + extra).int()
    cum = torch.cumsum(counts.long(), 0)
    # the emission model: (dense bin, gaussian) per entry, in emission order
    emission = []
    lo, span = lo.reshape(-1, 2).tolist(), span.reshape(-1, 2).tolist()
    for g in range(C * n):
        base = (g // n) * n_tiles
        if true_counts[g] > 0:
            (x0, y0), (sx, sy) = lo[g], span[g]
            emission += [(base + y * tw + x, g) for y in range(y0, y0 + sy) for x in range(x0, x0 + sx)]
        emission += [(base, g)] * int(extra[g])
    assert len(emission) == int(cum[-1])
    capacity = len(emission)
    if cut_in_tail:  # inside the tail of the last camera's last gaussian whose tail is 2 entries or more
        g = max(i for i in range(n, C * n) if extra[i] >= 2)
        capacity = int(cum[g]) - 1
    kept = emission[:capacity]
    want = [[] for _ in range(C * n_tiles)]
    for t, g in kept:
        want[t].append(g)

    bins = torch.zeros(C * n_tiles + 2, dtype=torch.int32)
    slots = torch.full((capacity,), -1, dtype=torch.int32)
    ranks = torch.full((capacity + 5,), -1, dtype=torch.int32)  # 5 past the capacity: never written
    geometry = (C * n, n, ts, tw, th, capacity)
    lib.bin_count(means2d, radii, counts, cum, bins, slots, *geometry, per_thread,
                  **isect.bin_count_grid(C * n, per_thread, group))  # fmt: skip
    ends = torch.cumsum(bins.long(), 0)
    lib.bin_fill(means2d, radii, counts, cum, slots, ends, ranks, *geometry, **grid_1d(C * n))

    out = []
    if bins[: C * n_tiles].tolist() != [len(w) for w in want]:
        out.append("bin lengths")
    starts = [0] + ends[: C * n_tiles].tolist()
    for t in range(C * n_tiles):
        if sorted(ranks[starts[t] : starts[t + 1]].tolist()) != sorted(want[t]):
            out.append(f"bin {t}")
    if ranks[capacity:].tolist() != [-1] * 5:
        out.append("past the capacity")
    return out


@pytest.mark.parametrize("cut_in_tail", [False, True])
def test_bin_count_and_fill_place_every_entry_once(cut_in_tail):
    assert bin_kernel_differences(isect.library(torch.device("cpu"), "isect.metal"), cut_in_tail=cut_in_tail) == []


# Off-by-ones in the slots (a rank past the tail's first; a bin's start one late): caught by the comparison.
SLOT_PLANTS = {
    "tail rank": ("slots[out] = pass == 0 ? first + i : slots[out] + first;",
                  "slots[out] = pass == 0 ? first + i + 1 : slots[out] + first;"),
    "bin start": ("ranks[(t > 0 ? ends[t - 1] : 0) + slots[out]] = g;", "ranks[(t > 0 ? ends[t - 1] + 1 : 0) + slots[out]] = g;"),
}  # fmt: skip


@pytest.mark.parametrize("plant", sorted(SLOT_PLANTS))
def test_planted_slots_are_caught(plant):
    planted = planted_library("isect.metal", [SLOT_PLANTS[plant]], f"isect planted: {plant}")
    assert bin_kernel_differences(planted) != []
