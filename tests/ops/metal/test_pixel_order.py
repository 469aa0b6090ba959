"""The rasterizer's pixel order (common.h raster_pixel_in_group, variants.PIXEL_ORDER): a simdgroup takes an 8x4
block of its tile's pixels where the tile allows ("blocks", the default) instead of 32 consecutive pixels of a row
("rows", msplat's and gsplat's order). Under the emulator, on non-square images with partial tiles: the forward's
outputs are bitwise those of the row order (a pixel computes the same whichever thread takes it), the backward's
gradients equal within float rounding (its atomics add in another order) and match the reference, and the backward
has fewer active (gaussian, simdgroup) groups where the order differs (tile sizes that are multiples of 8, strips of
4 and 8 rows), the same ones where it cannot (8, 12, 5). The step ledger's count of a launch's groups in the block
order, msplat's (rasterize_bwd.block_order_groups: a row-order launch run once more in it), equals the groups the
block-order build counts when it is the one that runs. A planted order that maps two threads to one pixel fails the
comparison."""

from __future__ import annotations

import pytest
import torch
from scenes import random_scene

from splat_metal_method.bench import step_ledger
from splat_metal_method.ops import rasterization
from splat_metal_method.ops.metal import kernels, runtime, variants
from splat_metal_method.ops.metal import rasterize as metal_rasterize
from splat_metal_method.ops.metal import rasterize_bwd as metal_rasterize_bwd

CASES = [  # (tile size, channels, cameras, kernel passes, threads the pipeline allows a group: None = a tile)
    (16, 3, 1, False, None),  # 8 simdgroups: 2 x 4 blocks instead of 8 strips of 16x2
    (16, 4, 2, True, None),
    (16, 3, 1, False, 100),  # groups of 4 rows of a tile: 2 blocks of 8x4
    (16, 3, 2, True, 128),  # groups of 8 rows
    (24, 3, 1, False, None),  # 3 x 6 blocks
    (32, 3, 1, False, None),  # 4 x 8 blocks instead of 32 rows
    (8, 3, 1, False, None),  # 8 wide: a block of 8x4 IS 4 rows of 8, the same order
    (12, 3, 1, True, None),  # not a multiple of 8: row order (4.5 simdgroups)
    (5, 4, 1, False, None),  # one partial simdgroup: row order
]
DIFFERS = {16, 24, 32}  # tile sizes where the two orders differ


def _render(ts, D, C, order, monkeypatch, backend="metal"):
    monkeypatch.setattr(variants, "PIXEL_ORDER", order)
    monkeypatch.setattr(kernels, "_fitted_groups", {})
    W, H = 3 * ts + 7, 2 * ts + 5  # non-square, partial tiles
    scene = random_scene(n=120, C=C, width=W, height=H, seed=ts * 10 + D, scale_range=(0.05, 0.3))
    g = torch.Generator().manual_seed(ts)
    leaves = {"means": scene.means, "quats": scene.quats, "scales": scene.scales, "opacities": scene.opacities,
              "colors": torch.rand(scene.N, D, generator=g)}  # fmt: skip
    leaves = {k: t.detach().clone().requires_grad_(True) for k, t in leaves.items()}
    with step_ledger.count("order") as led:
        render, alpha, meta = rasterization(
            leaves["means"], leaves["quats"], leaves["scales"], leaves["opacities"], leaves["colors"],
            scene.viewmats, scene.Ks, W, H, tile_size=ts, absgrad=True, backend=backend,
        )  # fmt: skip
        ((render * torch.randn(render.shape, generator=g)).sum() + (alpha * torch.randn(alpha.shape, generator=g)).sum()
         ).backward()  # fmt: skip
    grads = {k: t.grad for k, t in leaves.items()}
    grads["absgrad"] = meta["means2d"].absgrad
    return (render.detach(), alpha.detach()), grads, led.kernels.get("rasterize_bwd"), scene


def _limited(monkeypatch, limit):
    """This GPU's rasterizer pipelines allow `limit` threads a group (kernels.tile_library builds strips)."""
    real = runtime.pipeline_limits

    def limits(kernel):
        out = real(kernel)
        if repr(kernel).startswith(("<emulated Metal kernel rasterize_fwd(", "<emulated Metal kernel rasterize_bwd(")):
            out["max_threads_per_threadgroup"] = min(out["max_threads_per_threadgroup"] or limit, limit)
        return out

    monkeypatch.setattr(runtime, "pipeline_limits", limits)


def _compare(got, want, rtol=1e-5):
    for k, w in want.items():
        err = (got[k] - w).abs().max().item()
        assert err <= rtol * w.abs().max().item() + 1e-7, f"v_{k}: max|err| {err:.3g} (max|ref| {w.abs().max():.3g})"


@pytest.mark.parametrize("ts,D,C,passes,limit", CASES)
def test_block_order_computes_what_the_row_order_does_with_fewer_groups(ts, D, C, passes, limit, monkeypatch):
    if passes:
        monkeypatch.setattr(metal_rasterize, "RASTER_CHUNK", 7)
        monkeypatch.setattr(metal_rasterize_bwd, "RASTER_CHUNK", 7)
    if limit:
        _limited(monkeypatch, limit)
    rows_out, rows_grads, rows_work, scene = _render(ts, D, C, "rows", monkeypatch)
    blocks_out, blocks_grads, blocks_work, _ = _render(ts, D, C, "blocks", monkeypatch)
    for a, b in zip(blocks_out, rows_out):
        assert torch.equal(a, b)
    assert rows_out[1].max() > 0.5 and rows_grads["means"].abs().sum() > 0 and rows_grads["absgrad"].abs().sum() > 0
    _compare(blocks_grads, rows_grads)
    if passes:
        assert blocks_work.launches > 1
    # msplat's order (8x4 blocks): the ledger runs a row-order launch once more in it, and counts what the
    # block-order build counts when it is the one that runs
    assert rows_work.block_order_groups == blocks_work.active_groups == blocks_work.block_order_groups > 0
    if ts in DIFFERS:
        assert blocks_work.active_groups < rows_work.active_groups, (blocks_work, rows_work)
        assert blocks_work.device_atomics < rows_work.device_atomics
    else:
        assert blocks_work.active_groups == rows_work.active_groups
        assert blocks_work.device_atomics == rows_work.device_atomics


def test_blocks_match_the_reference(monkeypatch):
    """The default order against the PyTorch reference: forward and every gradient."""
    out, grads, _, _ = _render(16, 3, 2, "blocks", monkeypatch)
    want_out, want_grads, _, _ = _render(16, 3, 2, "blocks", monkeypatch, backend="reference")
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)
    _compare(grads, want_grads, rtol=1e-4)


def test_planted_order_bug_fails_the_comparison(monkeypatch):
    """An order that gives two threads of a block the same pixel (lane / 16 for lane / 8: rows 0-1 of each block
    twice, rows 2-3 never) is caught by the forward's comparison."""
    rows_out, _, _, _ = _render(16, 3, 1, "rows", monkeypatch)
    right = kernels.stage_source

    def planted(stage_file, tile_size=16, extra=()):
        src = right(stage_file, tile_size, extra)
        if stage_file == "rasterize.metal" and ("SPLAT_PIXEL_ROWS", 1) not in extra:
            old = "* 4 + lane / 8);"
            assert src.count(old) == 1
            src = src.replace(old, "* 4 + lane / 16);")
        return src

    monkeypatch.setattr(kernels, "stage_source", planted)
    blocks_out, _, _, _ = _render(16, 3, 1, "blocks", monkeypatch)
    assert not torch.equal(blocks_out[0], rows_out[0])


def test_pixel_order_rejects_an_unknown_name():
    with pytest.raises(ValueError, match="SPLAT_METAL_PIXEL_ORDER"):
        variants.pixel_order_defines("columns")
