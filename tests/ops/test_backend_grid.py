"""The whole space the public op accepts, on the metal (emulated on Linux) and cpu backends, against the
reference: tile sizes 1-32, channel counts 1-64, absgrad on/off, backgrounds on/off, depth-chunk resume
(max_intersections), passes within a kernel (the watchdog bound), one to three cameras, non-square
images whose tile grid is partial in both directions. Forward (colours, alphas) and backward (means,
quats, scales, opacities, colours, backgrounds, viewmats, means2d.absgrad).

Every tile size and channel count compiles its own Metal rasterizer library (a few seconds each under
the emulator), so a run covers a fixed set of corner cases plus a seeded random sample of the rest of
the grid. The seed is in the test id; SPLAT_METAL_GRID_SEED=<seed> replays a run and
SPLAT_METAL_GRID_SAMPLES=<n> widens the sample (0 = corners only).

Why the corners: the Metal backward once scattered its 8 + D reduced quantities with a fixed stride of
32 lanes, so a simdgroup with r < 32 live lanes lost every quantity q with q mod 32 >= r. That is every
tile whose pixel count is not a multiple of 32 (all sizes but 8, 16, 24, 32) once 8 + D > r for its last
simdgroup: sizes 1, 2, 6, 10, 14, 15, 17, 18, 22, 26, 30, 31 for any D; 3, 13, 19, 29 for D >= 2;
4, 12, 20, 28 for D >= 9; 7, 9, 23, 25 for D >= 10; 5, 11, 21, 27 for D >= 18 -- while the forward
was right and the suite only used tile sizes 16 and 8. The corners include each of those shapes.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch
from scenes import random_scene

from splat_metal_method.ops import rasterization
from splat_metal_method.ops.cpu import build as cpu_build
from splat_metal_method.ops.metal import rasterize as metal_rasterize

TILE_SIZES = range(1, 33)
CHANNELS = (1, 2, 3, 4, 5, 9, 16, 33, 64)
RTOL = 1e-3


@dataclass(frozen=True)
class Case:
    tile_size: int
    channels: int
    cameras: int = 2
    absgrad: bool = True
    background: bool = True
    depth_chunks: bool = False  # max_intersections below the render's count: composited in chunks
    passes: bool = False  # kernel passes of a few gaussians per tile (RASTER_CHUNK), state carried

    def __str__(self):
        flags = [f"ts{self.tile_size}", f"D{self.channels}", f"C{self.cameras}"]
        flags += [name for name, on in (("abs", self.absgrad), ("bg", self.background),
                                        ("chunks", self.depth_chunks), ("passes", self.passes)) if on]  # fmt: skip
        return "-".join(flags)


# Each tile size of 1-5 (a simdgroup of 1-25 live lanes), a partial last simdgroup (12: 144 = 4.5 x 32,
# 17: 289, 31: 961), full simdgroups (8, 16, 32), each required channel count, every option.
CORNERS = [
    Case(1, 1, cameras=1),
    Case(1, 64, absgrad=False),
    Case(2, 3, depth_chunks=True),
    Case(2, 33, cameras=3),
    Case(3, 9, background=False),
    Case(4, 9, passes=True),
    Case(4, 5),
    Case(5, 16, cameras=1),
    Case(7, 2, depth_chunks=True),
    Case(8, 64),
    Case(12, 9, passes=True),
    Case(12, 33, absgrad=False),
    Case(16, 1),
    Case(16, 3, depth_chunks=True, passes=True),
    Case(16, 4, cameras=3),
    Case(17, 5),
    Case(31, 4, background=False),
    Case(32, 3, cameras=1),
    Case(32, 64, depth_chunks=True),
]


def _sample() -> tuple[int, list[Case]]:
    seed = int(os.environ.get("SPLAT_METAL_GRID_SEED") or random.SystemRandom().randrange(10**6))
    n = int(os.environ.get("SPLAT_METAL_GRID_SAMPLES", "6"))
    rng = random.Random(seed)
    corners = set(CORNERS)
    out: list[Case] = []
    while len(out) < n:
        c = Case(rng.choice(TILE_SIZES), rng.choice(CHANNELS), cameras=rng.randint(1, 3),
                 absgrad=rng.random() < 0.5, background=rng.random() < 0.5,
                 depth_chunks=rng.random() < 0.3, passes=rng.random() < 0.3)  # fmt: skip
        if c not in corners and c not in out:
            out.append(c)
    return seed, out


SEED, SAMPLE = _sample()
CASES = [pytest.param(c, id=f"corner-{c}") for c in CORNERS] + [pytest.param(c, id=f"seed{SEED}-{c}") for c in SAMPLE]
BACKENDS = ["metal"] + (["cpu"] if cpu_build.load() is not None else [])


def _inputs(case: Case):
    """A non-square image with a partial last tile row and column, ~3 tiles per side at any tile
    size; gaussians a few tiles wide so tiles hold several of them and pixels overlap."""
    ts = case.tile_size
    W, H = 3 * ts + max(1, ts // 2) + 2, 2 * ts + max(1, ts // 3) + 1
    scene = random_scene(n=60, C=case.cameras, width=W, height=H, seed=1000 * ts + case.channels,
                         scale_range=(0.05, 0.25))  # fmt: skip
    g = torch.Generator().manual_seed(ts * 7 + case.channels)
    colors = torch.rand(scene.N, case.channels, generator=g)
    bg = torch.rand(case.cameras, case.channels, generator=g) if case.background else None
    v_colors = torch.randn(case.cameras, H, W, case.channels, generator=g)
    v_alphas = torch.randn(case.cameras, H, W, 1, generator=g)
    return scene, colors, bg, v_colors, v_alphas


def _render(backend: str, case: Case, max_intersections=None):
    scene, colors, bg, v_colors, v_alphas = _inputs(case)
    leaves = {
        "means": scene.means, "quats": scene.quats, "scales": scene.scales, "opacities": scene.opacities,
        "colors": colors, "viewmats": scene.viewmats, **({"backgrounds": bg} if bg is not None else {}),
    }  # fmt: skip
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
    rc, ra, meta = rasterization(
        leaves["means"], leaves["quats"], leaves["scales"], leaves["opacities"], leaves["colors"],
        leaves["viewmats"], scene.Ks, scene.width, scene.height, tile_size=case.tile_size,
        backgrounds=leaves.get("backgrounds"), absgrad=case.absgrad, backend=backend,
        max_intersections=max_intersections,
    )  # fmt: skip
    meta["means2d"].retain_grad()
    ((rc * v_colors).sum() + (ra * v_alphas).sum()).backward()
    grads = {k: v.grad for k, v in leaves.items()}
    grads["means2d"] = meta["means2d"].grad
    if case.absgrad:
        grads["absgrad"] = meta["means2d"].absgrad
    return rc.detach(), ra.detach(), grads, meta


def _close(name, actual, expected, rtol=RTOL, atol=1e-6):
    assert actual is not None, f"{name}: no gradient"
    a, b = actual.detach().double(), expected.detach().double()
    assert a.shape == b.shape, f"{name}: shape {list(a.shape)} != {list(b.shape)}"
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    if b.numel() == 0:
        return
    diff = (a - b).abs()
    rel = ((a - b).norm() / b.norm().clamp(min=1e-12)).item()
    assert rel <= rtol, f"{name}: relative error {rel:.3g} > {rtol}"
    assert diff.max() <= rtol * b.abs().max() + atol, (
        f"{name}: max|err| {diff.max().item():.3g} at flat index {diff.argmax().item()} "
        f"(max|ref| {b.abs().max().item():.3g})"
    )


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference_over_the_grid(backend, case, monkeypatch):
    ref_rc, ref_ra, ref_grads, ref_meta = _render("reference", case)
    n_isects = ref_meta["flatten_ids"].numel()
    assert n_isects > 3 * case.cameras, f"scene too sparse to test anything ({n_isects} intersections)"
    max_isect = None
    if case.depth_chunks:  # about three depth chunks; the reference gives the unchunked render
        max_isect = max(1, n_isects // 3)
    if case.passes:  # a handful of gaussians per kernel pass: several passes for most tiles
        monkeypatch.setattr(metal_rasterize, "RASTER_CHUNK", 3)
        import splat_metal_method.ops.metal.rasterize_bwd as metal_rasterize_bwd

        monkeypatch.setattr(metal_rasterize_bwd, "RASTER_CHUNK", 3)
    from splat_metal_method.ops.metal import runtime

    runtime.reset_launch_counts()
    rc, ra, grads, meta = _render(backend, case, max_intersections=max_isect)
    if case.passes and backend == "metal":  # the lowered chunk really split the render into passes
        assert runtime.launch_counts().get("rasterize_fwd", 0) > (meta.get("depth_chunks") or 1)
    if case.depth_chunks:
        assert meta["depth_chunks"] > 1, "max_intersections should have split the render"
    _close(f"{backend}[{case}].colors", rc, ref_rc)
    _close(f"{backend}[{case}].alphas", ra, ref_ra)
    assert set(grads) == set(ref_grads)
    for name, expected in ref_grads.items():
        _close(f"{backend}[{case}].v_{name}", grads[name], expected)
    assert ref_grads["means2d"].abs().sum() > 0, "a visible scene should move its means"
