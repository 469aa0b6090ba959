"""rasterize_bwd.metal's tile merge (rasterization_metal's tile_merge, the model's bwd_tile_merge; off by default): a gaussian's gradients summed
over the simdgroups of its tile before one device atomic per quantity, against the direct path (an atomic per
simdgroup, its twin) and the reference, under the emulator: non-square images, tile sizes whose groups hold
1, 2, 4.5 and 8 simdgroups, 3 and 4 channels, absgrad, two cameras, kernel passes, the fused composite. The
step ledger's work counters show the atomics it saves. A planted kernel bug (the flush keeps one simdgroup's
sum) fails the comparison."""

from __future__ import annotations

import pytest
import torch
from scenes import random_scene

from splat_metal_method.bench import step_ledger
from splat_metal_method.ops import rasterization
from splat_metal_method.ops.metal import kernels
from splat_metal_method.ops.metal import rasterize as metal_rasterize
from splat_metal_method.ops.metal import rasterize_bwd as metal_rasterize_bwd
from splat_metal_method.ops.metal.fused import rasterization_metal

CASES = [  # (tile size, channels, cameras, kernel passes)
    (16, 3, 1, False),
    (8, 4, 2, False),
    (12, 3, 1, True),  # 144 threads: 4.5 simdgroups, the last one partial
    (5, 4, 1, False),  # 25 threads: one partial simdgroup (nothing to merge across)
]


def _render(ts, D, C, merge, monkeypatch, absgrad=True):
    W, H = 4 * ts + 3, 2 * ts + 5  # non-square, partial tiles
    scene = random_scene(n=80, C=C, width=W, height=H, seed=ts * 10 + D, scale_range=(0.05, 0.3))
    g = torch.Generator().manual_seed(ts)
    leaves = {"means": scene.means, "quats": scene.quats, "scales": scene.scales, "opacities": scene.opacities,
              "colors": torch.rand(scene.N, D, generator=g)}  # fmt: skip
    leaves = {k: t.detach().clone().requires_grad_(True) for k, t in leaves.items()}
    with step_ledger.count("bwd") as led:
        render, alpha, meta = rasterization_metal(
            leaves["means"], leaves["quats"], leaves["scales"], leaves["opacities"], leaves["colors"],
            scene.viewmats, scene.Ks, W, H, tile_size=ts, absgrad=absgrad, tile_merge=merge,
            **({"composite_background": torch.tensor([0.2, 0.4, 0.9])} if D == 3 else {}),
        )  # fmt: skip
        out = meta["rgb"] if D == 3 else render
        (
            (out * torch.randn(out.shape, generator=g)).sum() + (alpha * torch.randn(alpha.shape, generator=g)).sum()
        ).backward()
    grads = {k: t.grad for k, t in leaves.items()}
    if absgrad:
        grads["absgrad"] = meta["means2d"].absgrad
    return grads, led.kernels["rasterize_bwd"]


def _compare(got, want, rtol=1e-5):
    for k, w in want.items():
        err = (got[k] - w).abs().max().item()
        assert err <= rtol * w.abs().max().item() + 1e-7, f"v_{k}: max|err| {err:.3g} (max|ref| {w.abs().max():.3g})"


@pytest.mark.parametrize("ts,D,C,passes", CASES)
def test_tile_merge_matches_the_direct_atomics_with_fewer_of_them(ts, D, C, passes, monkeypatch):
    if passes:
        monkeypatch.setattr(metal_rasterize, "RASTER_CHUNK", 7)
        monkeypatch.setattr(metal_rasterize_bwd, "RASTER_CHUNK", 7)
    direct, direct_work = _render(ts, D, C, False, monkeypatch)
    merged, merged_work = _render(ts, D, C, True, monkeypatch)
    _compare(merged, direct)
    assert direct["means"].abs().sum() > 0 and direct["absgrad"].abs().sum() > 0
    if passes:
        assert merged_work.launches > 1
    if ts * ts > 32:  # several simdgroups per tile: fewer atomics
        assert merged_work.device_atomics < direct_work.device_atomics, (merged_work, direct_work)
    else:  # one simdgroup: the same atomics at most (the merge skips zero sums)
        assert merged_work.device_atomics <= direct_work.device_atomics
    assert merged_work.barriers > direct_work.barriers  # the price: a barrier per batch more


@pytest.mark.parametrize("ts,D,C,passes", CASES)
def test_each_active_group_reduces_and_issues_only_its_quantities(ts, D, C, passes, monkeypatch):
    """The ledger counts the backward's active (gaussian, simdgroup) groups from its reductions (rasterize_bwd.py
    active_groups: 3 a simdgroup, then 4 + 2 + D a group, + 2 with absgrad; it raises when they do not divide): the
    same groups with and without absgrad and the tile merge, and without the merge one device atomic per reduced
    component (11 a group for splatfacto's RGB with absgrad, 9 without: msplat's). Reducing a component more (a
    float4 for three channels, |means2d| without absgrad) breaks the division or the equality."""
    if passes:
        monkeypatch.setattr(metal_rasterize, "RASTER_CHUNK", 7)
        monkeypatch.setattr(metal_rasterize_bwd, "RASTER_CHUNK", 7)
    groups = set()
    for absgrad in (True, False):
        for merge in (False, True):
            _, work = _render(ts, D, C, merge, monkeypatch, absgrad=absgrad)
            assert work.active_groups > 0, work
            groups.add(work.active_groups)
            if not merge:
                assert work.device_atomics == (4 + 2 + D + (2 if absgrad else 0)) * work.active_groups, (absgrad, work)
    assert len(groups) == 1, groups


def test_tile_merge_matches_the_reference(monkeypatch):
    merged, _ = _render(16, 4, 2, True, monkeypatch)
    W, H = 67, 37
    scene = random_scene(n=80, C=2, width=W, height=H, seed=164, scale_range=(0.05, 0.3))
    g = torch.Generator().manual_seed(16)
    leaves = {"means": scene.means, "quats": scene.quats, "scales": scene.scales, "opacities": scene.opacities,
              "colors": torch.rand(scene.N, 4, generator=g)}  # fmt: skip
    leaves = {k: t.detach().clone().requires_grad_(True) for k, t in leaves.items()}
    render, alpha, meta = rasterization(*leaves.values(), scene.viewmats, scene.Ks, W, H, tile_size=16, absgrad=True,
                                        backend="reference")  # fmt: skip
    (
        (render * torch.randn(render.shape, generator=g)).sum() + (alpha * torch.randn(alpha.shape, generator=g)).sum()
    ).backward()
    ref = {k: t.grad for k, t in leaves.items()}
    ref["absgrad"] = meta["means2d"].absgrad
    _compare(merged, ref, rtol=2e-3)


def test_planted_merge_bug_fails_the_comparison(monkeypatch):
    """The flush keeping only the last simdgroup's sum (= instead of +=) is caught."""
    direct, _ = _render(16, 3, 1, False, monkeypatch)
    right = kernels.stage_source

    def planted(stage_file, tile_size=16, extra=()):
        src = right(stage_file, tile_size, extra)
        if ("SPLAT_BWD_MERGE", 1) in extra:
            assert "value += s_part[" in src
            src = src.replace("value += s_part[", "value = s_part[")
        return src

    monkeypatch.setattr(kernels, "stage_source", planted)
    merged, _ = _render(16, 3, 1, True, monkeypatch)
    with pytest.raises(AssertionError, match="v_"):
        _compare(merged, direct)
