"""Padded intersection lists (ops/metal/isect.py, "Padded lists"): training steps on Metal without a host
read of the intersection count.

- Without overflow, a render with padded lists is the render with exact lists: the same pixels bit for
  bit, the same gradients (up to the order of float atomics), the same real entries and tile offsets,
  at every grid size, with one and two cameras, at several tile sizes.
- Only the first padded call for a tile grid reads the count; later ones read nothing on the host.
- Overflow (forced with a small capacity): the intersections of the last gaussians in flat order (the
  highest indices; the lists sort nothing globally, so not the deepest) are left out of that step,
  exactly: its render and gradients are those of the scene without them; it is said once in the log a
  step later, counted, and the capacity grows so that the next step is exact again.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from splat_metal_method.ops import IntersectionCapacities, rasterization
from splat_metal_method.ops.metal import isect, runtime
from splat_metal_method.ops.metal.fused import rasterization_metal

SIZES = [(64, 48), (48, 64), (70, 45), (33, 17), (96, 96)]


@pytest.fixture
def caps():
    """A renderer's own capacities, as a model keeps them (ops.IntersectionCapacities)."""
    return IntersectionCapacities()


def scene(n=240, C=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    means = torch.randn(n, 3, generator=gen) * 0.7
    means[:, 2] += 4.0
    quats = torch.randn(n, 4, generator=gen)
    scales = (torch.rand(n, 3, generator=gen) * 0.8 - 3.0).exp()
    opacities = torch.rand(n, generator=gen) * 0.9 + 0.05
    colors = torch.rand(n, 3, generator=gen)
    viewmats = torch.eye(4).repeat(C, 1, 1)
    viewmats[:, 0, 3] = torch.linspace(-0.2, 0.2, C)
    return means, quats, scales, opacities, colors, viewmats


def intrinsics(C, width, height):
    f = 0.9 * max(width, height)
    return torch.tensor([[f, 0, width / 2], [0, f, height / 2], [0, 0, 1]]).repeat(C, 1, 1)


def render(params, viewmats, width, height, caps=None, tile_size=16):
    """(colors, alphas, meta, gradients of means..colors, absgrad) of a training render: padded lists with
    the capacities `caps`, exact lists without."""
    leaves = [p.clone().requires_grad_(True) for p in params]
    Ks = intrinsics(viewmats.shape[0], width, height)
    colors, alphas, meta = rasterization_metal(*leaves, viewmats, Ks, width, height, tile_size=tile_size,
                                               absgrad=True, isect_capacity=caps)  # fmt: skip
    weights = torch.linspace(0.5, 1.5, colors.numel()).view(colors.shape)
    ((colors * weights).sum() + alphas.sum()).backward()
    return colors.detach(), alphas.detach(), meta, [p.grad for p in leaves], meta["means2d"].absgrad


def isect_ids_of(meta, caps, tile_size):
    """The isect_ids of a training render's padded lists (which it does not build), asked for: the same call
    (its projection, its capacities) with with_isect_ids=True."""
    got = isect.isect_tiles_padded_fwd(meta["means2d"].detach(), meta["radii"], meta["depths"].detach(), tile_size,
                                       meta["tile_width"], meta["tile_height"], caps, with_isect_ids=True)  # fmt: skip
    assert torch.equal(got[2], meta["flatten_ids"]) and torch.equal(got[3][:-1], meta["isect_offsets"].reshape(-1))
    return got[1]


def assert_gradients_close(got, want):
    for g, w in zip(got, want):
        scale = w.abs().max().item() or 1.0
        assert (g - w).abs().max().item() <= 1e-5 * scale, (g - w).abs().max().item() / scale


@pytest.mark.parametrize("C", [1, 2])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_padded_lists_render_as_the_exact_ones(size, C, monkeypatch, caps):
    width, height = size
    *params, viewmats = scene(C=C, seed=width)
    exact = render(params, viewmats, width, height)
    for call in range(2):  # the first sizes the capacity (one host read), the second reads nothing
        got = render(params, viewmats, width, height, caps=caps)
        assert torch.equal(got[0], exact[0]) and torch.equal(got[1], exact[1]), f"call {call}: pixels differ"
        assert_gradients_close(got[3], exact[3])
        assert_gradients_close([got[4]], [exact[4]])
        meta, want = got[2], exact[2]
        M = want["flatten_ids"].numel()
        assert meta["n_intersections"].tolist() == [M] and meta["flatten_ids"].numel() >= M * isect.HEADROOM
        assert meta["isect_ids"] is None  # a training render builds no isect_ids; asked for, they are exact
        ids = isect_ids_of(meta, caps, tile_size=16)
        assert torch.equal(ids[:M], want["isect_ids"])
        assert torch.equal(meta["flatten_ids"][:M], want["flatten_ids"])
        assert torch.equal(meta["isect_offsets"], want["isect_offsets"])
        assert torch.equal(meta["tiles_per_gauss"], want["tiles_per_gauss"])


@pytest.mark.parametrize("C", [1, 2])
def test_training_renders_build_no_isect_ids(C, monkeypatch):
    """A training render (rasterization with capacities) builds its padded lists without isect_ids: meta has
    None there, and the lists it renders from (flatten_ids with its padding, the offsets, the count) and the
    render and its gradients are those of the same renders with isect_ids built (ops.isect_tiles_padded
    forced to with_isect_ids=True), call after call of one renderer each."""
    from splat_metal_method.ops import metal

    *params, viewmats = scene(C=C, seed=5)
    width, height = 70, 45
    without, forced = IntersectionCapacities(), IntersectionCapacities()
    exact = render(params, viewmats, width, height)
    M = exact[2]["flatten_ids"].numel()
    real = metal.isect_tiles_padded
    for call in range(2):  # unplanned, then planned from what the device said
        got = render(params, viewmats, width, height, caps=without)
        with monkeypatch.context() as m:
            m.setattr(metal, "isect_tiles_padded", lambda *a, with_isect_ids, **k: real(*a, with_isect_ids=True, **k))
            want = render(params, viewmats, width, height, caps=forced)
        assert got[2]["isect_ids"] is None, f"call {call}"
        assert want[2]["isect_ids"] is not None and torch.equal(want[2]["isect_ids"][:M], exact[2]["isect_ids"])
        for name in ("flatten_ids", "isect_offsets", "tiles_per_gauss", "n_intersections"):
            assert torch.equal(got[2][name], want[2][name]), f"call {call}: {name}"
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"call {call}: pixels differ"
        assert_gradients_close(got[3], want[3])
        assert_gradients_close([got[4]], [want[4]])
    assert without.entries(math.ceil(width / 16), math.ceil(height / 16), C) == forced.entries(
        math.ceil(width / 16), math.ceil(height / 16), C
    )


@pytest.mark.parametrize("tile_size", [8, 16, 32])
def test_padded_lists_at_other_tile_sizes(tile_size, monkeypatch, caps):
    *params, viewmats = scene(C=2, seed=tile_size)
    exact = render(params, viewmats, 70, 45, tile_size=tile_size)
    got = render(params, viewmats, 70, 45, caps=caps, tile_size=tile_size)
    assert torch.equal(got[0], exact[0]) and torch.equal(got[1], exact[1])
    assert_gradients_close(got[3], exact[3])


@pytest.mark.parametrize("C", [1, 2])
def test_lists_past_the_budget_are_cut_into_windows_without_a_read(monkeypatch, caps, C):
    """A render whose capacity passes the command-buffer budget is cut into windows of the lists and bands of tile
    rows (rasterize.plan_padded, from the capacity and N only): no read of the device, each band's first row a
    kernel argument (no copy of means2d, no slice per band), the buffers that carry pixel state between passes the
    only aten ops added, exact."""
    from splat_metal_method.bench import step_ledger
    from splat_metal_method.ops.metal import rasterize

    *params, viewmats = scene(n=400, C=C, seed=3)
    exact = render(params, viewmats, 70, 45)
    render(params, viewmats, 70, 45, caps=caps)  # sizes the capacity
    with step_ledger.count("one dispatch") as whole:
        render(params, viewmats, 70, 45, caps=caps)
    capacity = caps.entries(5, 3, C)
    budget = 16 * 16 * capacity * runtime.BWD_WORK_FACTOR // 3
    monkeypatch.setattr(runtime, "COMMAND_BUFFER_BUDGET", budget)
    plan = rasterize.plan_padded(capacity, min(400, capacity), (C, 3, 5), 16 * 16, budget)
    reads = []
    monkeypatch.setattr(runtime, "host_read", lambda t: reads.append(t) or t.cpu())
    runtime.reset_launch_counts()
    runtime.reset_command_buffers()
    with step_ledger.count("windows") as led:
        got = render(params, viewmats, 70, 45, caps=caps)
    assert reads == [] and led.host_syncs == 0, "a padded render read the device"
    launches = runtime.launch_counts()
    assert plan.n_passes > 1 and launches["rasterize_fwd"] == launches["rasterize_bwd"] == len(plan.dispatches)
    added = dict(led.aten_ops - whole.aten_ops)
    assert led.aten_dispatches - whole.aten_dispatches == 3, added  # pixel_done, pix_T, pix_buf: none per dispatch
    assert len([b for b in runtime.command_buffers() if b.closed_by == "commit"]) >= 2
    assert max(b.work for b in runtime.command_buffers()) <= budget
    assert torch.equal(got[0], exact[0]) and torch.equal(got[1], exact[1])
    assert_gradients_close(got[3], exact[3])


def test_only_the_first_call_of_a_grid_reads_the_count(monkeypatch, caps):
    *params, viewmats = scene()
    reads = []
    real = runtime.host_read
    monkeypatch.setattr(runtime, "host_read", lambda t: reads.append(t.numel()) or real(t))
    for _ in range(3):
        render(params, viewmats, 64, 48, caps=caps)
    assert reads == [1], reads
    render(params, viewmats, 48, 64, caps=caps)  # another tile grid: its own capacity
    assert reads == [1, 1], reads


def test_capacity_follows_the_gaussian_count(caps):
    """Densification grows N between steps: the capacity is sized from intersections per gaussian times
    this call's N, so a doubled scene does not overflow unseen."""
    *params, viewmats = scene(n=200)
    render(params, viewmats, 64, 48, caps=caps)
    render(params, viewmats, 64, 48, caps=caps)  # the first step's count is now read
    doubled = [torch.cat([p, p]) for p in params]
    colors, _, meta, _, _ = render(doubled, viewmats, 64, 48, caps=caps)
    assert caps.overflows == 0
    M = int(meta["n_intersections"])
    assert meta["flatten_ids"].numel() >= M


def _flat_cumsum(params, viewmats, width, height):
    """The inclusive cumsum of the gaussians' tile counts in flat order, the order the padded lists emit
    in (C = 1), from the reference backend."""
    from splat_metal_method.ops import reference

    means, quats, scales, *_ = params
    radii, means2d, depths, _, _ = reference.project(means, quats, scales, viewmats, intrinsics(1, width, height),
                                                     width, height)  # fmt: skip
    tw, th = math.ceil(width / 16), math.ceil(height / 16)
    tiles, _, _ = reference.isect_tiles(means2d, radii, depths, 16, tw, th)
    return tiles[0].long().cumsum(0)


def test_overflow_leaves_out_the_last_gaussians_said_once_then_grows(monkeypatch, caps):
    width, height = 64, 48
    *params, viewmats = scene(n=240, seed=5)
    cum = _flat_cumsum(params, viewmats, width, height)
    k = int((cum <= cum[-1] // 2).sum())  # the first k gaussians in flat order fit
    capacity = int(cum[k - 1])
    caps.force(math.ceil(width / 16), math.ceil(height / 16), 1, capacity)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        over = render(params, viewmats, width, height, caps=caps)
    assert not [w for w in said if "tile intersections" in str(w.message)], "said before it was known"
    assert caps.overflows == 0 and over[2]["n_intersections"].tolist() == [capacity]

    # The overflowed step is the render of the scene without the gaussians of index k and up, exactly.
    kept = torch.arange(k)
    subset = [p[kept] for p in params]
    want = render(subset, viewmats, width, height)
    assert torch.equal(over[0], want[0]) and torch.equal(over[1], want[1])
    dropped = torch.arange(k, len(cum))
    for g, w in zip(over[3], want[3]):
        assert (g[dropped] == 0).all(), "a gaussian left out of the render got a gradient"
        assert_gradients_close([g[kept]], [w])

    # A step later: said once, counted, and the capacity grown past the need: exact again.
    exact = render(params, viewmats, width, height)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        again = render(params, viewmats, width, height, caps=caps)
        render(params, viewmats, width, height, caps=caps)
    messages = [str(w.message) for w in said if "tile intersections" in str(w.message)]
    assert len(messages) == 1 and "left out" in messages[0] and f"{int(cum[-1]):,}" in messages[0], messages
    assert caps.overflows == 1
    assert torch.equal(again[0], exact[0]) and torch.equal(again[1], exact[1])
    assert again[2]["flatten_ids"].numel() >= int(cum[-1]) * isect.HEADROOM

    # A second overflow is counted but not said again.
    caps.force(math.ceil(width / 16), math.ceil(height / 16), 1, capacity)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        render(params, viewmats, width, height, caps=caps)
        render(params, viewmats, width, height, caps=caps)
    assert not [w for w in said if "tile intersections" in str(w.message)]
    assert caps.overflows == 2


def test_without_capacities_the_lists_are_exact():
    """Renders whose caller keeps no capacities (eval, the viewer, any other caller of the op) use exact
    lists; one renderer's capacities never size another's."""
    *params, viewmats = scene()
    with torch.no_grad():
        _, _, meta = rasterization(*params, viewmats, intrinsics(1, 64, 48), 64, 48, backend="metal")
    assert meta["n_intersections"] is None and meta["isect_offsets"].shape == (1, 3, 4)
    first, second = IntersectionCapacities(), IntersectionCapacities()
    render(params, viewmats, 64, 48, caps=first)
    assert first.entries(4, 3, 1) is not None and second.entries(4, 3, 1) is None


def test_a_tile_of_ten_thousand_gaussians_is_composited_whole():
    """One pass of whole tiles (rasterize.plan_padded: the capacity fits one dispatch): a tile listing 10,500 gaussians, more than a
    RASTER_CHUNK, is composited to its end by one threadgroup each way, nothing left out: the same pixels
    and gradients as the reference backend (ops/reference.py), non-square image."""
    from splat_metal_method.ops.metal import rasterize

    n, width, height = 10_500, 40, 24
    gen = torch.Generator().manual_seed(11)
    # small gaussians (~0.5 px) spread over the pixels of tile (1, 0): each pixel sees a few hundred, faint,
    # so its pixels do not reach the transmittance floor and the whole list, deepest included, shows in the image
    f, z = 0.9 * width, 5.0 + 2.0 * torch.rand(n, generator=gen)
    u, v = 17.0 + 14.0 * torch.rand(n, generator=gen), 1.0 + 14.0 * torch.rand(n, generator=gen)
    means = torch.stack([(u - width / 2) / f * z, (v - height / 2) / f * z, z], -1)
    quats = torch.randn(n, 4, generator=gen)
    scales = (0.5 * z / f)[:, None] * (0.2 * torch.randn(n, 3, generator=gen)).exp()
    opacities = torch.rand(n, generator=gen) * 0.03 + 0.01
    colors = torch.rand(n, 3, generator=gen)
    params, viewmats = (means, quats, scales, opacities, colors), torch.eye(4)[None]
    caps = IntersectionCapacities()
    for _ in range(2):  # the capacity, then the rows, as a training run learns them
        render(params, viewmats, width, height, caps=caps)
    runtime.reset_launch_counts()
    got = render(params, viewmats, width, height, caps=caps)
    offsets = got[2]["isect_offsets"].reshape(-1).long()
    ends = torch.cat([offsets[1:], got[2]["n_intersections"].long()])
    assert int((ends - offsets).max()) >= 10_000 > rasterize.RASTER_CHUNK
    assert runtime.launch_counts()["rasterize_fwd"] == runtime.launch_counts()["rasterize_bwd"] == 1
    assert float((got[1][0, :16, 16:32] < 0.999).float().mean()) > 0.9  # the tile's pixels did not stop early
    leaves = [p.clone().requires_grad_(True) for p in params]
    Ks = intrinsics(1, width, height)
    colors_ref, alphas_ref, meta = rasterization(*leaves, viewmats, Ks, width, height, backend="reference",
                                                 absgrad=True)  # fmt: skip
    weights = torch.linspace(0.5, 1.5, colors_ref.numel()).view(colors_ref.shape)
    ((colors_ref * weights).sum() + alphas_ref.sum()).backward()
    torch.testing.assert_close(got[0], colors_ref.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], alphas_ref.detach(), rtol=1e-4, atol=1e-5)
    for g, w in zip(got[3] + [got[4]], [p.grad for p in leaves] + [meta["means2d"].absgrad]):
        scale = w.abs().max().item() or 1.0
        assert (g - w).abs().max().item() <= 1e-3 * scale, (g - w).abs().max().item() / scale
