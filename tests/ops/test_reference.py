"""The reference backend (the oracle) checked against things that do not share its code:

- a brute-force compositor written here (every pixel against every depth-sorted gaussian, no tile
  lists), fed with the reference's own projection so only compositing is compared;
- gsplat 1.4's pure-PyTorch twins in gsplat/cuda/_torch_impl.py for projection, SH and tile
  intersection;
- finite differences (gradcheck in float64) for every differentiable input of ``rasterization``;
- per-pixel autograd through the brute-force compositor for absgrad;
- the real garden cameras.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from gsplat.cuda._torch_impl import (
    _fully_fused_projection,
    _isect_offset_encode,
    _isect_tiles,
    _quat_scale_to_covar_preci,
    _spherical_harmonics,
)
from scenes import Scene, garden_scene, look_at, random_scene

from splat_metal_method.ops import rasterization
from splat_metal_method.ops import reference as ref

TOL = 1e-4  # float32 image parity (images are in [0, 1])


# --------------------------------------------------------------------------------------------------
# Independent brute-force compositor.
# --------------------------------------------------------------------------------------------------
def brute_force(
    means2d,  # [C, N, 2]
    conics,  # [C, N, 3]
    colors,  # [C, N, D]
    opacities,  # [C, N]
    radii,  # [C, N]
    depths,  # [C, N]
    width,
    height,
    backgrounds=None,  # [C, D]
    tile_size=16,
    tile_rule=True,
    window=None,  # (x0, y0, w, h): render only this crop
    return_stats=False,
):
    """gsplat's per-pixel rules with no tile lists: every pixel (centre +0.5) walks all visible
    gaussians in depth order (stable: ties keep index order), skips sigma < 0 or alpha < 1/255,
    clamps alpha at 0.999, stops (exclusive) when the next T <= 1e-4, and adds T * background.

    ``tile_rule``: a gaussian is only evaluated at pixels whose tile lies in its tile box
    [floor((m - r)/ts), ceil((m + r)/ts)) -- the one place tiling changes the result (a gaussian
    can exceed alpha 1/255 just outside its 3-sigma radius). It is written here per pixel.
    Differentiable w.r.t. means2d/conics/colors/opacities/backgrounds. Returns colors [C,h,w,D],
    alphas [C,h,w,1] and, if asked, counts showing which rules fired: pixels stopped on the T floor,
    evaluations clamped at 0.999, evaluations >= 1/255 that the tile rule dropped."""
    C, N, D = colors.shape
    x0, y0, w, h = window if window is not None else (0, 0, width, height)
    ys, xs = torch.meshgrid(torch.arange(y0, y0 + h), torch.arange(x0, x0 + w), indexing="ij")
    xs, ys = xs.flatten(), ys.flatten()
    px, py = xs.to(means2d.dtype) + 0.5, ys.to(means2d.dtype) + 0.5
    out_colors, out_alphas = [], []
    stats = {"stopped": 0, "clamped": 0, "beyond_box": 0}
    for c in range(C):
        ids = torch.nonzero(radii[c] > 0).flatten()
        ids = ids[torch.sort(depths[c, ids], stable=True).indices]
        T = torch.ones(w * h, dtype=means2d.dtype)
        acc = torch.zeros(w * h, D, dtype=colors.dtype)
        done = torch.zeros(w * h, dtype=torch.bool)
        for g in ids.tolist():
            dx, dy = means2d[c, g, 0] - px, means2d[c, g, 1] - py
            ca, cb, cc = conics[c, g, 0], conics[c, g, 1], conics[c, g, 2]
            sigma = 0.5 * (ca * dx * dx + cc * dy * dy) + cb * dx * dy
            alpha = torch.clamp(opacities[c, g] * torch.exp(-sigma), max=0.999)
            use = (sigma >= 0) & (alpha >= 1.0 / 255.0) & ~done
            if tile_rule:
                mx, my, r = means2d[c, g, 0].item(), means2d[c, g, 1].item(), float(radii[c, g])
                tx, ty = xs // tile_size, ys // tile_size
                in_box = (tx >= math.floor((mx - r) / tile_size)) & (tx < math.ceil((mx + r) / tile_size))
                in_box &= (ty >= math.floor((my - r) / tile_size)) & (ty < math.ceil((my + r) / tile_size))
                stats["beyond_box"] += int((use & ~in_box).sum())
                use &= in_box
            stats["clamped"] += int((use & (opacities[c, g] * torch.exp(-sigma) > 0.999)).sum())
            next_T = T * (1 - alpha)
            stop = use & (next_T <= 1e-4)
            done = done | stop
            use = use & ~stop
            acc = acc + torch.where(use, alpha * T, 0.0)[:, None] * colors[c, g]
            T = torch.where(use, next_T, T)
        stats["stopped"] += int(done.sum())
        col = acc if backgrounds is None else acc + T[:, None] * backgrounds[c]
        out_colors.append(col.reshape(h, w, D))
        out_alphas.append((1 - T).reshape(h, w, 1))
    result = torch.stack(out_colors), torch.stack(out_alphas)
    return result + (stats,) if return_stats else result


def project_scene(scene: Scene, rasterize_mode="classic", **kw):
    return ref.project(
        scene.means, scene.quats, scene.scales, scene.viewmats, scene.Ks, scene.width, scene.height,
        calc_compensations=rasterize_mode == "antialiased", **kw,
    )  # fmt: skip


def brute_force_render(scene: Scene, render_mode="RGB", rasterize_mode="classic", tile_size=16, **kw):
    """``rasterization`` rebuilt from the reference's projection + the brute-force compositor
    (RGB colors only; SH is checked separately against gsplat)."""
    radii, means2d, depths, conics, comp = project_scene(scene, rasterize_mode)
    C, N = radii.shape
    opac = scene.opacities.expand(C, N)
    if comp is not None:
        opac = opac * comp
    colors, bg = scene.colors.expand(C, -1, -1), scene.backgrounds
    if render_mode == "RGB+ED":
        colors = torch.cat([colors, depths[..., None]], dim=-1)
        bg = None if bg is None else torch.cat([bg, bg.new_zeros(C, 1)], dim=-1)
    out = brute_force(means2d, conics, colors, opac, radii, depths, scene.width, scene.height, bg, tile_size, **kw)
    if render_mode == "RGB+ED":
        col, alpha = out[0], out[1]
        col = torch.cat([col[..., :-1], col[..., -1:] / alpha.clamp(min=1e-10)], dim=-1)
        out = (col,) + tuple(out[1:])
    return out


def render(scene: Scene, **kw):
    return rasterization(**scene.kwargs(backend="reference", **kw))


# --------------------------------------------------------------------------------------------------
# 1. Compositing vs brute force.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backgrounds", [False, True], ids=["nobg", "bg"])
@pytest.mark.parametrize("render_mode", ["RGB", "RGB+ED"])
@pytest.mark.parametrize("size", [(16, 16), (37, 23), (64, 40)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("C", [1, 2])
def test_render_matches_brute_force(C, size, render_mode, backgrounds):
    scene = random_scene(n=120, C=C, width=size[0], height=size[1], seed=C * 1000 + size[0], backgrounds=backgrounds)
    colors, alphas, meta = render(scene, render_mode=render_mode)
    expected_colors, expected_alphas = brute_force_render(scene, render_mode)
    D = 4 if render_mode == "RGB+ED" else 3
    assert colors.shape == (C, size[1], size[0], D) and alphas.shape == (C, size[1], size[0], 1)
    assert (meta["radii"] > 0).sum() > 20, "scene should put many gaussians on screen"
    assert alphas.max() > 0.5
    torch.testing.assert_close(alphas, expected_alphas, rtol=0, atol=TOL)
    torch.testing.assert_close(colors[..., :3], expected_colors[..., :3], rtol=0, atol=TOL)
    if render_mode == "RGB+ED":  # expected depth ~4: relative tolerance
        torch.testing.assert_close(colors[..., 3], expected_colors[..., 3], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("rasterize_mode", ["classic", "antialiased"])
def test_dense_scene_exercises_every_rule(rasterize_mode):
    """Many opaque gaussians: pixels hit the T floor (early stop) and alpha hits the 0.999 clamp."""
    scene = random_scene(n=300, C=2, width=40, height=28, seed=7, opacity_range=(0.6, 1.0), backgrounds=True)
    scene.opacities[::3] = 1.0
    ts = 4  # small tiles: more tile-box edges for the tile rule to act on
    colors, alphas, _ = render(scene, rasterize_mode=rasterize_mode, tile_size=ts)
    exp_colors, exp_alphas, stats = brute_force_render(scene, rasterize_mode=rasterize_mode, tile_size=ts,
                                                       return_stats=True)  # fmt: skip
    torch.testing.assert_close(colors, exp_colors, rtol=0, atol=TOL)
    torch.testing.assert_close(alphas, exp_alphas, rtol=0, atol=TOL)
    assert stats["stopped"] > 10, f"scene too thin to test the T floor: {stats}"
    if rasterize_mode == "classic":  # antialiasing scales opacities down
        assert stats["clamped"] > 0, f"the 0.999 clamp never fired: {stats}"


def test_tile_box_rule_is_gsplats():
    """gsplat evaluates a gaussian only in the tiles of its box [floor((m-r)/ts), ceil((m+r)/ts)), and
    a gaussian can still have alpha >= 1/255 just beyond its radius r = ceil(3 sqrt(lambda_max)).
    Built by hand at the stage level: an isotropic sigma=5 px gaussian, opacity 1 (r = 16), whose
    box starts at x=16 while the pixel centre 15.5 is 16.6 px away: alpha = exp(-5.51) > 1/255."""
    W, H, ts = 64, 40, 16
    means2d = torch.tensor([[[32.1, 20.5]]])
    conics = torch.tensor([[[1 / 25, 0.0, 1 / 25]]])
    radii = torch.tensor([[16]], dtype=torch.int32)  # ceil(3 * sqrt(25 + 0.1)), as projection computes
    depths, colors, opac = torch.tensor([[2.0]]), torch.ones(1, 1, 3), torch.ones(1, 1)
    _, ids, fids = ref.isect_tiles(means2d, radii, depths, ts, W // ts, math.ceil(H / ts))
    offsets = ref.isect_offset_encode(ids, 1, W // ts, math.ceil(H / ts))
    out, _ = ref.rasterize_to_pixels(means2d, conics, colors, opac, W, H, ts, offsets, fids)
    expected, _, stats = brute_force(means2d, conics, colors, opac, radii, depths, W, H, return_stats=True)
    no_rule, _ = brute_force(means2d, conics, colors, opac, radii, depths, W, H, tile_rule=False)
    assert stats["beyond_box"] > 0 and no_rule[0, 20, 15, 0] > 1 / 255
    assert out[0, 20, 15, 0] == 0 and out[0, 20, 16, 0] > 0
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_negative_sigma_is_skipped():
    """A conic that is not positive definite (only reachable by calling the stage directly, e.g.
    from another backend's projection) gives sigma < 0 at some pixels; gsplat skips them there
    instead of letting exp(-sigma) > 1 saturate alpha."""
    W, H, ts = 37, 23, 16
    means2d = torch.tensor([[[18.3, 11.6], [9.1, 7.7]]])
    conics = torch.tensor([[[0.05, 0.08, 0.05], [0.2, 0.0, 0.1]]])  # the first has det < 0
    radii = torch.tensor([[12, 6]], dtype=torch.int32)
    depths, opac = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 0.5]])
    colors = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    tw, th = math.ceil(W / ts), math.ceil(H / ts)
    _, ids, fids = ref.isect_tiles(means2d, radii, depths, ts, tw, th)
    offsets = ref.isect_offset_encode(ids, 1, tw, th)
    out, alpha = ref.rasterize_to_pixels(means2d, conics, colors, opac, W, H, ts, offsets, fids)
    expected, expected_alpha = brute_force(means2d, conics, colors, opac, radii, depths, W, H)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(alpha, expected_alpha, rtol=0, atol=1e-6)
    # Along the diagonal dx = -dy the first conic gives sigma < 0: those pixels stay untouched by it.
    assert out[0, 14, 15, 0] == 0 and out[0, 14, 21, 0] > 0.1  # (dx, dy) = (2.8, -2.9) vs (-3.2, -2.9)


def test_isect_tile_bounds_on_tile_edges():
    """Gaussians whose box ends exactly on a tile edge: ceil/floor must give gsplat's ranges."""
    ts, tw, th = 16, 4, 3
    r = torch.tensor([[4, 8, 16, 5, 12, 3]], dtype=torch.int32)
    x = torch.tensor([[12.0, 24.0, 16.0, 43.0, 36.0, 61.0]])  # x + r on an edge for the first four
    y = torch.tensor([[12.0, 8.0, 32.0, 21.0, 4.0, 45.0]])
    means2d = torch.stack([x, y], dim=-1)
    depths = torch.arange(1.0, 7.0)[None]
    tpg, ids, fids = ref.isect_tiles(means2d, r, depths, ts, tw, th)
    g_tpg, g_ids, g_fids = _isect_tiles(means2d, r, depths, ts, tw, th)
    assert torch.equal(tpg, g_tpg) and torch.equal(ids, g_ids) and torch.equal(fids, g_fids)
    assert tpg[0, 0].item() == 1  # [12-4, 12+4] = [8, 16]: only tile (0, 0)


def test_low_opacity_tiling_is_lossless():
    """Below opacity 0.35 a gaussian is under 1/255 outside its 3-sigma radius, so the renderer must
    equal the plain per-pixel compositor with no tile rule at all (tile size 16 and 4)."""
    scene = random_scene(n=150, C=1, width=37, height=23, seed=3, opacity_range=(0.05, 0.34), backgrounds=True)
    for tile_size in (16, 4):
        colors, alphas, _ = render(scene, tile_size=tile_size)
        exp_colors, exp_alphas = brute_force_render(scene, tile_rule=False)
        torch.testing.assert_close(colors, exp_colors, rtol=0, atol=TOL)
        torch.testing.assert_close(alphas, exp_alphas, rtol=0, atol=TOL)


def test_stage_rasterize_to_pixels_many_channels():
    """The compositing stage alone with D=5 feature channels and a small tile size."""
    scene = random_scene(n=80, C=2, width=29, height=19, seed=11, channels=5, backgrounds=True)
    radii, means2d, depths, conics, _ = project_scene(scene)
    C, N = radii.shape
    tile_size = 8
    tw, th = math.ceil(scene.width / tile_size), math.ceil(scene.height / tile_size)
    _, isect_ids, flatten_ids = ref.isect_tiles(means2d, radii, depths, tile_size, tw, th)
    offsets = ref.isect_offset_encode(isect_ids, C, tw, th)
    colors = scene.colors.expand(C, -1, -1).contiguous()
    opac = scene.opacities.expand(C, N).contiguous()
    out_c, out_a = ref.rasterize_to_pixels(
        means2d, conics, colors, opac, scene.width, scene.height, tile_size, offsets, flatten_ids, scene.backgrounds
    )
    exp_c, exp_a = brute_force(means2d, conics, colors, opac, radii, depths, scene.width, scene.height,
                               scene.backgrounds, tile_size)  # fmt: skip
    torch.testing.assert_close(out_c, exp_c, rtol=0, atol=TOL)
    torch.testing.assert_close(out_a, exp_a, rtol=0, atol=TOL)


# --------------------------------------------------------------------------------------------------
# 2. Stage parity with gsplat's pure-PyTorch implementation.
# --------------------------------------------------------------------------------------------------
def gsplat_projection(scene: Scene, **kw):
    covars, _ = _quat_scale_to_covar_preci(scene.quats, scene.scales, compute_preci=False)
    return _fully_fused_projection(
        scene.means, covars, scene.viewmats, scene.Ks, scene.width, scene.height, calc_compensations=True, **kw
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_projection_matches_gsplat(dtype):
    # extent > distance: some gaussians are behind the camera, some off-screen, some straddle the edge.
    scene = random_scene(n=400, C=2, width=37, height=23, seed=5, extent=5.0, distance=4.0,
                         scale_range=(0.01, 1.0), dtype=dtype)  # fmt: skip
    radii, means2d, depths, conics, comp = project_scene(scene, "antialiased")
    g_radii, g_means2d, g_depths, g_conics, g_comp = gsplat_projection(scene)
    ok = radii > 0
    assert ok.sum() > 50 and (~ok).sum() > 50
    assert ((g_depths < 0.01) & ~ok).any(), "scene should have gaussians behind the camera"
    assert ((g_depths > 0.01) & ~ok).any(), "scene should have off-screen gaussians"
    assert torch.equal(radii, g_radii.to(radii.dtype))
    rtol = 1e-9 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(means2d[ok], g_means2d[ok], rtol=rtol, atol=rtol)
    torch.testing.assert_close(depths[ok], g_depths[ok], rtol=rtol, atol=0)
    torch.testing.assert_close(conics[ok], g_conics[ok], rtol=rtol, atol=rtol * conics[ok].abs().max().item())
    torch.testing.assert_close(comp[ok], g_comp[ok], rtol=rtol, atol=rtol)
    # Culled entries are zero (gsplat's CUDA kernel leaves them unwritten zeros).
    for t in (means2d, depths, conics, comp):
        assert (t[~ok] == 0).all()


def test_projection_clip_and_planes():
    scene = random_scene(n=300, C=2, width=64, height=40, seed=9, scale_range=(0.01, 0.3), dtype=torch.float64)
    radii = project_scene(scene)[0]
    # radius_clip: gsplat's torch impl has no radius_clip; the kernel culls radius <= clip.
    clip = float(radii[radii > 0].float().median())
    clipped = project_scene(scene, radius_clip=clip)[0]
    assert torch.equal(clipped, torch.where(radii > clip, radii, 0))
    assert (clipped > 0).sum() < (radii > 0).sum()
    # Near/far planes vs gsplat (planes between two depths: gsplat's torch impl culls z == near,
    # its CUDA kernel keeps near <= z <= far, checked next).
    depths = project_scene(scene)[2][radii > 0].sort().values
    mid = len(depths) // 2
    plane = float(depths[mid] + depths[mid + 1]) / 2
    for near, far in ((plane, 1e10), (0.01, plane)):
        ours = project_scene(scene, near_plane=near, far_plane=far)[0]
        theirs = gsplat_projection(scene, near_plane=near, far_plane=far)[0]
        assert torch.equal(ours, theirs)
        assert 0 < (ours > 0).sum() < (radii > 0).sum()
    on_plane = (radii > 0) & (project_scene(scene)[2] == depths[mid])
    for near, far in ((float(depths[mid]), 1e10), (0.01, float(depths[mid]))):
        assert (project_scene(scene, near_plane=near, far_plane=far)[0][on_plane] > 0).all()


@pytest.mark.parametrize("degree", [0, 1, 2, 3, 4])
def test_spherical_harmonics_matches_gsplat(degree):
    g = torch.Generator().manual_seed(degree)
    dirs = (3 * torch.randn(2, 50, 3, generator=g, dtype=torch.float64)).requires_grad_()  # not unit length
    coeffs = torch.randn(2, 50, 25, 3, generator=g, dtype=torch.float64).requires_grad_()
    ours = ref.spherical_harmonics(degree, dirs, coeffs)
    theirs = _spherical_harmonics(degree, dirs, coeffs)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    w = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    ours_grads = torch.autograd.grad((ours * w).sum(), [dirs, coeffs], allow_unused=True)
    theirs_grads = torch.autograd.grad((theirs * w).sum(), [dirs, coeffs], allow_unused=True)
    for a, b, x in zip(ours_grads, theirs_grads, [dirs, coeffs]):  # None: unused (dirs at degree 0)
        a = torch.zeros_like(x) if a is None else a
        b = torch.zeros_like(x) if b is None else b
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    if degree > 0:
        assert ours_grads[0].abs().max() > 0
    masks = torch.rand(2, 50, generator=g) > 0.5
    masked = ref.spherical_harmonics(degree, dirs, coeffs, masks)
    assert (masked[~masks] == 0).all()
    torch.testing.assert_close(masked[masks], theirs[masks])


@pytest.mark.parametrize("degree", [0, 3, 4])
def test_rasterization_sh_path_matches_gsplat(degree):
    """End to end: SH colors through the API equal RGB colors computed with gsplat's SH from the
    camera centres (inverse viewmats), +0.5, clamped at 0 -- gsplat 1.4's rendering.py."""
    scene = random_scene(n=100, C=2, width=37, height=23, seed=13, sh_degree=4, dtype=torch.float64)
    colors, alphas, meta = render(scene, sh_degree=degree)
    campos = torch.linalg.inv(scene.viewmats)[:, :3, 3]
    dirs = scene.means[None] - campos[:, None]
    rgb = torch.clamp_min(_spherical_harmonics(degree, dirs, scene.colors.expand(2, -1, -1, -1)) + 0.5, 0.0)
    radii, means2d, depths, conics, _ = project_scene(scene)
    exp_colors, exp_alphas = brute_force(means2d, conics, rgb, scene.opacities.expand(2, -1), radii, depths,
                                         scene.width, scene.height)  # fmt: skip
    torch.testing.assert_close(colors, exp_colors, rtol=0, atol=1e-9)
    torch.testing.assert_close(alphas, exp_alphas, rtol=0, atol=1e-9)


@pytest.mark.parametrize("tile_size", [16, 8])
def test_isect_matches_gsplat(tile_size):
    scene = random_scene(n=40, C=2, width=37, height=23, seed=17, scale_range=(0.02, 0.4))
    # Exact duplicates (same depth) test the tie order.
    dup = torch.arange(0, 40, 5)
    for name in ("means", "quats", "scales"):
        t = getattr(scene, name)
        t[dup + 1] = t[dup]
    radii, means2d, depths, _, _ = project_scene(scene)
    C = scene.C
    tw, th = math.ceil(scene.width / tile_size), math.ceil(scene.height / tile_size)
    tpg, ids, fids = ref.isect_tiles(means2d, radii, depths, tile_size, tw, th)
    g_tpg, g_ids, g_fids = _isect_tiles(means2d, radii, depths, tile_size, tw, th)
    assert ids.dtype == torch.int64 and fids.dtype == torch.int32 and tpg.dtype == torch.int32
    assert torch.equal(tpg, g_tpg)
    assert ids.numel() == g_ids.numel() > 50
    assert torch.equal(ids, g_ids)  # both sorted; equal multisets of ids
    # Same set of (isect_id, flatten_id) pairs (gsplat's sort is unstable: compare sorted pairs).
    assert sorted(zip(ids.tolist(), fids.tolist())) == sorted(zip(g_ids.tolist(), g_fids.tolist()))
    # Ours is sorted by id and stable: equal ids keep ascending flatten ids (emission order).
    assert (ids[1:] >= ids[:-1]).all()
    same = ids[1:] == ids[:-1]
    assert same.sum() > 0, "duplicates should produce equal ids"
    assert (fids[1:][same] > fids[:-1][same]).all()
    offsets = ref.isect_offset_encode(ids, C, tw, th)
    assert offsets.shape == (C, th, tw) and offsets.dtype == torch.int32
    assert torch.equal(offsets, _isect_offset_encode(g_ids, C, tw, th))


def test_isect_offset_encode_empty():
    offsets = ref.isect_offset_encode(torch.zeros(0, dtype=torch.int64), 2, 3, 2)
    assert offsets.shape == (2, 2, 3) and (offsets == 0).all()


# --------------------------------------------------------------------------------------------------
# 3. gradcheck (float64) for every differentiable input.
# --------------------------------------------------------------------------------------------------
# Tolerances: in float64 central differences with eps=1e-6 have truncation error ~eps^2 * f''' (well
# under 1e-9 here: gaussians span a few pixels, so third derivatives are O(10-100)) and round-off
# ~1e-16/eps = 1e-10. atol=1e-6 therefore has three orders of margin and would still catch any
# wrong term (a missing factor changes entries by >1e-3). Discontinuities (alpha crossing 1/255,
# radius ceil, T floor) would break this; the scene keeps opacities moderate and gaussians inside
# the image, and a fixed seed makes the outcome deterministic.
GRAD_EPS, GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-6, 1e-4

GRAD_CASES = [
    ("means", "rgb", "RGB+ED", "classic"),
    ("quats", "rgb", "RGB+ED", "classic"),
    ("scales", "rgb", "RGB+ED", "classic"),
    ("scales", "rgb", "RGB", "antialiased"),
    ("opacities", "rgb", "RGB+ED", "classic"),
    ("opacities", "rgb", "RGB", "antialiased"),
    ("colors", "rgb", "RGB", "classic"),
    ("colors", "sh", "RGB", "classic"),
    ("means", "sh", "RGB", "classic"),
    ("viewmats", "rgb", "RGB+ED", "classic"),
    ("viewmats", "sh", "RGB", "classic"),
    ("backgrounds", "rgb", "RGB+ED", "classic"),
]


def tiny_scene(colors="rgb", C=2):
    """5 gaussians on a 12x9 image (non-square, 3x3 tiles of 4 px) with two different cameras."""
    return random_scene(
        n=5, C=C, width=12, height=9, seed=21, dtype=torch.float64, extent=0.5, distance=3.0,
        scale_range=(0.15, 0.35), opacity_range=(0.25, 0.7), backgrounds=True,
        sh_degree=3 if colors == "sh" else None,
    )  # fmt: skip


@pytest.mark.parametrize("name,colors,render_mode,rasterize_mode", GRAD_CASES, ids=lambda v: str(v))
def test_gradcheck(name, colors, render_mode, rasterize_mode):
    scene = tiny_scene(colors)
    kw = scene.kwargs(backend="reference", render_mode=render_mode, rasterize_mode=rasterize_mode, tile_size=4)
    radii = project_scene(scene)[0]
    assert (radii > 0).sum() >= 6, "gaussians should be visible in both cameras"
    x = kw.pop(name).clone().requires_grad_()

    def f(x):
        out_colors, out_alphas, _ = rasterization(**kw, **{name: x})
        return out_colors, out_alphas

    out_colors, out_alphas = f(x)
    assert out_colors.dtype == torch.float64 and out_alphas.dtype == torch.float64
    assert 0.2 < out_alphas.max() < 0.99
    assert torch.autograd.gradcheck(f, (x,), eps=GRAD_EPS, atol=GRAD_ATOL, rtol=GRAD_RTOL)
    # The check is not vacuous: the input really moves the image.
    assert x.grad is None
    (out_colors.sum() + out_alphas.sum()).backward()
    assert x.grad.abs().max() > 1e-3


# --------------------------------------------------------------------------------------------------
# 4. Edge cases.
# --------------------------------------------------------------------------------------------------
def leaf_inputs(scene: Scene):
    return {k: v.clone().requires_grad_() for k, v in scene.tensors().items() if k != "Ks"}


def test_no_gaussians_renders_background():
    scene = random_scene(n=0, C=2, width=37, height=23, backgrounds=True)
    inputs = leaf_inputs(scene)
    colors, alphas, meta = rasterization(**scene.kwargs(backend="reference", absgrad=True, **inputs))
    assert colors.shape == (2, 23, 37, 3)
    assert torch.equal(colors, inputs["backgrounds"][:, None, None, :].expand_as(colors).detach())
    assert (alphas == 0).all()
    meta["means2d"].retain_grad()
    (colors * torch.rand_like(colors)).sum().backward()
    assert inputs["means"].grad.shape == (0, 3)
    assert meta["means2d"].grad.shape == (2, 0, 2)
    assert torch.isfinite(inputs["backgrounds"].grad).all() and inputs["backgrounds"].grad.abs().sum() > 0
    assert torch.isfinite(inputs["viewmats"].grad).all()


def test_all_gaussians_behind_camera():
    scene = random_scene(n=30, C=2, width=37, height=23, backgrounds=True, seed=4)
    # Same camera centres, looking away from the cloud.
    campos = torch.linalg.inv(scene.viewmats.double())[:, :3, 3]
    scene.viewmats = torch.stack([look_at(p, 2 * p) for p in campos]).float()
    inputs = leaf_inputs(scene)
    colors, alphas, meta = rasterization(**scene.kwargs(backend="reference", absgrad=True, **inputs))
    assert (meta["radii"] == 0).all() and meta["isect_ids"].numel() == 0
    torch.testing.assert_close(colors, inputs["backgrounds"][:, None, None, :].expand_as(colors).detach())
    assert (alphas == 0).all()
    meta["means2d"].retain_grad()
    colors.mean().backward()
    # DefaultStrategy reads means2d.grad even when nothing is visible.
    assert meta["means2d"].grad is not None and (meta["means2d"].grad == 0).all()
    assert (meta["means2d"].absgrad == 0).all()
    for k in ("means", "quats", "scales", "opacities", "colors", "viewmats"):
        assert inputs[k].grad is not None and torch.isfinite(inputs[k].grad).all(), k


def test_one_gaussian_covering_every_tile():
    W, H = 70, 45  # 5x3 tiles, partial in both directions
    scene = random_scene(n=1, C=1, width=W, height=H, seed=0, backgrounds=True)
    scene.means[:] = 0.0
    scene.scales[:] = 3.0
    scene.opacities[:] = 0.8
    scene.viewmats = look_at((0.0, -6.0, 1.0))[None].float()
    colors, alphas, meta = render(scene)
    tw, th = math.ceil(W / 16), math.ceil(H / 16)
    assert meta["tiles_per_gauss"].item() == tw * th == 15
    assert torch.equal(meta["isect_offsets"].flatten(), torch.arange(tw * th, dtype=torch.int32))
    assert (alphas > 0.1).all()
    exp_colors, exp_alphas = brute_force_render(scene)
    torch.testing.assert_close(colors, exp_colors, rtol=0, atol=TOL)
    torch.testing.assert_close(alphas, exp_alphas, rtol=0, atol=TOL)


def test_cameras_are_independent_with_different_intrinsics():
    scene = random_scene(n=150, C=2, width=64, height=40, seed=23, backgrounds=True)
    assert not torch.equal(scene.Ks[0], scene.Ks[1])
    colors, alphas, meta = render(scene)
    assert not torch.allclose(colors[0], colors[1], atol=0.05)
    for c in range(2):
        one = replace(scene, viewmats=scene.viewmats[c : c + 1], Ks=scene.Ks[c : c + 1],
                      backgrounds=scene.backgrounds[c : c + 1])  # fmt: skip
        c_colors, c_alphas, c_meta = render(one)
        torch.testing.assert_close(colors[c : c + 1], c_colors, rtol=0, atol=1e-6)
        torch.testing.assert_close(alphas[c : c + 1], c_alphas, rtol=0, atol=1e-6)
        assert torch.equal(meta["radii"][c : c + 1], c_meta["radii"])
    exp_colors, exp_alphas = brute_force_render(scene)
    torch.testing.assert_close(colors, exp_colors, rtol=0, atol=TOL)


def test_absgrad_is_sum_of_per_pixel_abs_grads():
    scene = tiny_scene("rgb", C=2)
    colors, alphas, meta = rasterization(**scene.kwargs(backend="reference", absgrad=True, tile_size=4,
                                                        **leaf_inputs(scene)))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    w_colors = torch.randn(colors.shape, generator=g, dtype=colors.dtype)  # mixed signs: |sum| != sum|.|
    w_alphas = torch.randn(alphas.shape, generator=g, dtype=alphas.dtype)
    meta["means2d"].retain_grad()
    ((colors * w_colors).sum() + (alphas * w_alphas).sum()).backward()
    absgrad, grad = meta["means2d"].absgrad, meta["means2d"].grad
    assert absgrad.shape == grad.shape == (2, scene.N, 2)

    # Independent: per-pixel gradients through the brute-force compositor.
    radii = meta["radii"]
    means2d = meta["means2d"].detach().clone().requires_grad_()
    cols = scene.colors.expand(2, -1, -1)
    bf_colors, bf_alphas = brute_force(
        means2d, meta["conics"].detach(), cols, meta["opacities"].detach(), radii, meta["depths"].detach(),
        scene.width, scene.height, scene.backgrounds, 4,
    )  # fmt: skip
    per_pixel = ((bf_colors * w_colors).sum(-1) + (bf_alphas * w_alphas).sum(-1)).flatten()  # [C*H*W]
    expected_abs = torch.zeros_like(means2d)
    expected_sum = torch.zeros_like(means2d)
    for p in range(per_pixel.numel()):
        (gp,) = torch.autograd.grad(per_pixel[p], means2d, retain_graph=True)
        expected_abs += gp.abs()
        expected_sum += gp
    torch.testing.assert_close(grad, expected_sum, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(absgrad, expected_abs, rtol=1e-7, atol=1e-10)
    assert (absgrad >= grad.abs() - 1e-12).all()
    assert (absgrad - grad.abs()).max() > 1e-2 * absgrad.max(), "absgrad should differ from |grad|"


def test_absgrad_with_checkpointed_chunks(monkeypatch):
    """Big-work path (chunks recomputed in backward) gives the same image, grads and absgrad."""
    scene = random_scene(n=200, C=1, width=64, height=40, seed=31)
    outs = []
    for small in (False, True):
        if small:
            monkeypatch.setattr(ref, "CHUNK_ELEMENTS", 1 << 12)
            monkeypatch.setattr(ref, "CHECKPOINT_ELEMENTS", 0)
        inputs = leaf_inputs(scene)
        colors, alphas, meta = rasterization(**scene.kwargs(backend="reference", absgrad=True, **inputs))
        meta["means2d"].retain_grad()
        colors.sum().backward()
        outs.append((colors.detach(), meta["means2d"].grad, meta["means2d"].absgrad, inputs["means"].grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_float64_end_to_end_dtypes():
    scene = random_scene(n=50, C=2, width=37, height=23, seed=2, dtype=torch.float64, backgrounds=True)
    colors, alphas, meta = render(scene, render_mode="RGB+ED", absgrad=True)
    for t in (colors, alphas, meta["means2d"], meta["depths"], meta["conics"], meta["opacities"]):
        assert t.dtype == torch.float64
    assert meta["radii"].dtype == torch.int32 and meta["radii"].shape == (2, 50)


# --------------------------------------------------------------------------------------------------
# 5. Garden: real cameras, 648x420.
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def garden_render(garden):
    scene = garden_scene(garden, n=20_000, seed=0)
    with torch.no_grad():
        colors, alphas, meta = render(scene)
    return scene, colors, alphas, meta


def test_garden_images_are_sane(garden_render):
    scene, colors, alphas, meta = garden_render
    assert colors.shape == (3, 420, 648, 3) and alphas.shape == (3, 420, 648, 1)
    assert torch.isfinite(colors).all() and torch.isfinite(alphas).all()
    for c in range(3):
        visible = (meta["radii"][c] > 0).sum().item()
        assert visible > 2000, f"camera {c} sees only {visible} gaussians"
        assert alphas[c].mean() > 0.3, f"camera {c} is mostly empty"
        assert colors[c].std() > 0.05, f"camera {c} is flat"
        assert colors[c].max() <= 1.0 + 1e-5 and colors[c].min() >= 0.0


@pytest.mark.parametrize("window", [(304, 192, 32, 24), (101, 333, 32, 24), (600, 37, 32, 24)],
                         ids=["tile-aligned", "unaligned", "near-corner"])  # fmt: skip
def test_garden_crop_matches_brute_force(garden_render, window):
    scene, colors, alphas, meta = garden_render
    x0, y0, w, h = window
    radii, means2d, depths, conics = meta["radii"], meta["means2d"], meta["depths"], meta["conics"]
    ts = 16
    for c in range(3):
        # Only gaussians whose tile box (which contains the 3-sigma box) touches the crop's tiles
        # (widened by a tile: excluding extra ones is exact, the brute force applies the tile rule).
        r = radii[c].float()
        lo = torch.floor((means2d[c] - r[:, None]) / ts) - 1
        hi = torch.ceil((means2d[c] + r[:, None]) / ts) + 1
        touches = (radii[c] > 0) & (lo[:, 0] <= (x0 + w - 1) // ts) & (hi[:, 0] > x0 // ts)
        touches &= (lo[:, 1] <= (y0 + h - 1) // ts) & (hi[:, 1] > y0 // ts)
        ids = torch.nonzero(touches).flatten()
        assert ids.numel() > 20
        sub = lambda t: t[c : c + 1, ids]  # noqa: E731
        exp_colors, exp_alphas = brute_force(
            sub(means2d), sub(conics), scene.colors[ids][None], sub(meta["opacities"]), sub(radii), sub(depths),
            scene.width, scene.height, window=window,
        )  # fmt: skip
        crop = (slice(c, c + 1), slice(y0, y0 + h), slice(x0, x0 + w))
        assert alphas[crop].mean() > 0.1
        torch.testing.assert_close(colors[crop], exp_colors, rtol=0, atol=TOL)
        torch.testing.assert_close(alphas[crop], exp_alphas, rtol=0, atol=TOL)
