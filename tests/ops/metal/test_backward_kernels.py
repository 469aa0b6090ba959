"""Metal backward kernels vs reference autograd (the gradient oracle), stage by stage and end to end.

On Linux the kernels run under the MSL emulator (cpu tensors); on a Mac the same tests also run them
on the GPU (mps tensors).

Error measure, per gradient tensor: rel = ||metal - ref|| / max(||ref||, 1e-12) <= 1e-3, and
max |metal - ref| <= 1e-3 * max |ref| + 1e-6 (no single element may hide behind a good norm).
The reference differentiates the same float32 maths through autograd, so most tensors agree to
~1e-6; the 1e-3 bound leaves room for reordered float sums (atomics on the GPU, per-simdgroup sums,
float32 x float32 products of gradients of size 1e2-1e3) without letting a wrong term through: every
missing or wrong term of the derivations moves some tensor by far more than 1e-3 of its norm. Checked
by mutation: each of 17 single-term edits of the three kernels (background term, abs() of absgrad,
buf / (1 - alpha), the 0.999 clamp, the last-contributor skip, the carried pass state, the clamped-J
terms in z, fx and cx, the 2 fx tx / z^3 term, the compensation term, the viewmat covariance term,
the quaternion normalisation, the cross-simdgroup viewmat sum, an SH basis derivative, the
direction normalisation) makes at least one test here fail.

Stage tests feed each backend the REFERENCE's upstream outputs, so a test sees only that stage's
backward. The end-to-end tests go through ops.rasterization with each backend's own forward.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from scenes import garden_scene, random_scene

from splat_metal_method.ops import constants, rasterization
from splat_metal_method.ops import metal as mtl
from splat_metal_method.ops import reference as ref
from splat_metal_method.ops.metal import runtime
from splat_metal_method.ops.metal.project_bwd import project_bwd
from splat_metal_method.ops.metal.rasterize import rasterize_to_pixels_fwd
from splat_metal_method.ops.metal.rasterize_bwd import bwd_batch, rasterize_to_pixels_bwd
from splat_metal_method.ops.metal.sh_bwd import spherical_harmonics_bwd

DEVICES = ["cpu"] + (["mps"] if runtime.metal_available() else [])
TS = constants.TILE_SIZE
RTOL = 1e-3
# (C, width, height, N): empty, single gaussian, square/non-square, garden-sized image with few gaussians
CASES = [(1, 16, 16, 0), (2, 16, 16, 1), (1, 37, 23, 1000), (2, 37, 23, 1000), (2, 648, 420, 150)]
CASE_IDS = [f"C{c}-{w}x{h}-N{n}" for c, w, h, n in CASES]


def check_grad(name, actual, expected, rtol=RTOL, atol=1e-6):
    """rel = ||a - b|| / max(||b||, 1e-12) <= rtol and max|a - b| <= rtol * max|b| + atol."""
    assert actual is not None, f"{name}: no gradient"
    actual = actual.detach().cpu().double()
    expected = torch.zeros_like(actual) if expected is None else expected.detach().cpu().double()
    assert actual.shape == expected.shape, f"{name}: shape {list(actual.shape)} != {list(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite gradient"
    if actual.numel() == 0:
        return 0.0
    diff = actual - expected
    rel = (diff.norm() / expected.norm().clamp(min=1e-12)).item()
    scale = expected.abs().max().item()
    max_abs = diff.abs().max().item()
    print(f"{name}: rel {rel:.2e}, max|err| {max_abs:.2e} (max|ref| {scale:.2e})")
    assert rel <= rtol, f"{name}: relative error {rel:.3g} > {rtol} (max|err| {max_abs:.3g}, max|ref| {scale:.3g})"
    worst = diff.abs().argmax()
    assert max_abs <= rtol * scale + atol, (
        f"{name}: max|err| {max_abs:.3g} > {rtol} * max|ref| {scale:.3g} at flat index {worst.item()}: "
        f"{actual.flatten()[worst].item()} vs {expected.flatten()[worst].item()}"
    )
    return rel


def to(device, *ts):
    return [t.to(device) if torch.is_tensor(t) else t for t in ts]


def tiles(W, H, ts=TS):
    return math.ceil(W / ts), math.ceil(H / ts)


def lists(means2d, radii, depths, C, W, H, ts=TS):
    tw, th = tiles(W, H, ts)
    _, isect_ids, flatten_ids = ref.isect_tiles(means2d, radii, depths, ts, tw, th)
    return ref.isect_offset_encode(isect_ids, C, tw, th), flatten_ids


def leaf(t):
    return t.detach().clone().requires_grad_(True)


# --------------------------------------------------------------------------------------------------
# rasterize_to_pixels backward
# --------------------------------------------------------------------------------------------------
def check_rasterize_bwd(name, device, means2d, conics, colors, opacities, W, H, offsets, flatten_ids, bg,
                        ts=TS, chunk=None, seed=0):  # fmt: skip
    """Random upstream gradients on colours and alphas; every input gradient and absgrad compared."""
    C = colors.shape[0]
    g = torch.Generator().manual_seed(seed)
    v_colors = torch.randn(C, H, W, colors.shape[-1], generator=g)
    v_alphas = torch.randn(C, H, W, 1, generator=g)
    leaves = [leaf(t) for t in (means2d, conics, colors, opacities)] + [leaf(bg) if bg is not None else None]
    rc, ra = ref.rasterize_to_pixels(*leaves[:4], W, H, ts, offsets, flatten_ids, leaves[4], absgrad=True)
    ((rc * v_colors).sum() + (ra * v_alphas).sum()).backward()
    ref_absgrad = leaves[0].absgrad

    dev = to(device, means2d, conics, colors, opacities, bg, offsets, flatten_ids, v_colors, v_alphas)
    m2, co, cl, op, b, off, fl, vc, va = dev
    _, _, T, last = rasterize_to_pixels_fwd(m2, co, cl, op, W, H, ts, off, fl, b)
    absgrad = torch.zeros(m2.shape, device=device)
    t0 = time.perf_counter()
    grads = rasterize_to_pixels_bwd(m2, co, cl, op, b, W, H, ts, off, fl, T, last, vc, va, absgrad, chunk=chunk)
    elapsed = time.perf_counter() - t0
    for part, got, lf in zip(["means2d", "conics", "colors", "opacities", "backgrounds"], grads, leaves):
        if lf is None:
            assert got is None
            continue
        check_grad(f"{name}.v_{part}", got, lf.grad)
    check_grad(f"{name}.absgrad", absgrad, ref_absgrad)
    return grads, absgrad, elapsed


def reference_inputs(C, W, H, N, seed, channels, with_bg, ts=TS, **scene_kw):
    scene = random_scene(n=N, C=C, width=W, height=H, seed=seed, **scene_kw)
    radii, means2d, depths, conics, _ = ref.project(scene.means, scene.quats, scene.scales, scene.viewmats,
                                                    scene.Ks, W, H)  # fmt: skip
    offsets, flatten_ids = lists(means2d, radii, depths, C, W, H, ts)
    g = torch.Generator().manual_seed(seed + 100)
    colors = torch.rand(C, N, channels, generator=g)
    if channels == 4:
        colors[..., 3] = depths  # RGB+ED packs depth as a 4th channel
    opacities = scene.opacities.expand(C, N).contiguous()
    bg = torch.rand(C, channels, generator=g) if with_bg else None
    return means2d, conics, colors, opacities, offsets, flatten_ids, bg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("channels, with_bg", [(3, False), (4, True)], ids=["RGB", "RGB+D-bg"])
def test_rasterize_bwd_matches_reference(device, case, channels, with_bg):
    C, W, H, N = case
    means2d, conics, colors, opacities, offsets, flatten_ids, bg = reference_inputs(C, W, H, N, 7, channels, with_bg)
    grads, absgrad, _ = check_rasterize_bwd(f"rast_bwd[{C},{W}x{H},{N},D{channels}]", device, means2d, conics, colors,
                                            opacities, W, H, offsets, flatten_ids, bg)  # fmt: skip
    if flatten_ids.numel() > 0:
        assert grads[0].abs().sum() > 0 and absgrad.abs().sum() > 0, "a visible scene should give gradients"
        assert (absgrad >= grads[0].abs() - 1e-6).all(), "absgrad sums |per-pixel grads| >= |sum|"


@pytest.mark.parametrize("device", DEVICES)
def test_rasterize_bwd_large_channel_count_small_batch_tile_8(device):
    """D = 33 (depth-like extra channels) shrinks the shared-memory batch below a tile's pixel count;
    tile size 8 changes the group shape (64 threads, 2 simdgroups)."""
    C, W, H, N = 1, 37, 23, 400
    assert bwd_batch(16, 33) < 256 and bwd_batch(16, 33) % 32 == 0
    means2d, conics, colors, opacities, offsets, flatten_ids, bg = reference_inputs(C, W, H, N, 5, 33, True, ts=16)
    check_rasterize_bwd("rast_bwd[D33]", device, means2d, conics, colors, opacities, W, H, offsets, flatten_ids, bg)
    means2d, conics, colors, opacities, offsets, flatten_ids, bg = reference_inputs(C, W, H, N, 6, 1, False, ts=8)
    check_rasterize_bwd("rast_bwd[D1,ts8]", device, means2d, conics, colors, opacities, W, H, offsets,
                        flatten_ids, bg, ts=8)  # fmt: skip


def dense_tile_inputs(opacity, N=700, seed=11):
    """N gaussians stacked on the optical axis (pixel (8,8) of a 37x23 image): one tile holds more
    than two 256-gaussian shared-memory batches."""
    C, W, H = 1, 37, 23
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(N, 3, generator=g) * torch.tensor([0.05, 0.05, 0.5]) + torch.tensor([0.0, 0.0, 5.0])
    quats = torch.randn(N, 4, generator=g)
    scales = torch.rand(N, 3, generator=g) * 0.04 + (0.02 if opacity < 0.5 else 0.3)
    viewmats = torch.eye(4)[None]
    Ks = torch.tensor([[[100.0, 0.0, 8.0], [0.0, 100.0, 8.0], [0.0, 0.0, 1.0]]])
    radii, means2d, depths, conics, _ = ref.project(means, quats, scales, viewmats, Ks, W, H)
    offsets, flatten_ids = lists(means2d, radii, depths, C, W, H)
    counts = torch.diff(torch.cat([offsets.flatten(), torch.tensor([flatten_ids.numel()])]))
    assert counts.max() > 2 * TS * TS, f"need > 2 batches in a tile, got {counts.max().item()}"
    colors = torch.rand(C, N, 3, generator=g)
    opacities = torch.full((C, N), opacity)
    bg = torch.tensor([[0.2, 0.5, 0.7]])
    return means2d, conics, colors, opacities, W, H, offsets, flatten_ids, bg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opacity", [0.05, 0.9], ids=["faint-all-batches", "opaque-early-stop"])
def test_rasterize_bwd_dense_tile_batches_and_passes(device, opacity):
    """More gaussians in a tile than one shared-memory batch. Faint ones: every pixel differentiates
    all three batches; opaque ones: pixels stopped inside the first batch, so whole simdgroups skip
    later batches (simd_max of last_ids). Then the same backward in passes of 100 gaussians (state
    carried between passes) must give the same gradients."""
    inputs = dense_tile_inputs(opacity)
    one, abs_one, _ = check_rasterize_bwd(f"rast_bwd[dense{opacity}]", device, *inputs)
    many, abs_many, _ = check_rasterize_bwd(f"rast_bwd[dense{opacity},chunk100]", device, *inputs, chunk=100)
    for part, a, b in zip(["means2d", "conics", "colors", "opacities", "backgrounds"], many, one):
        check_grad(f"rast_bwd[dense{opacity}].passes_vs_one.{part}", a, b, rtol=1e-5)
    check_grad(f"rast_bwd[dense{opacity}].passes_vs_one.absgrad", abs_many, abs_one, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_rasterize_bwd_absgrad_is_accumulated_and_optional(device):
    """absgrad_out is added into (gsplat semantics: a second backward adds again); without it the
    other gradients do not change."""
    means2d, conics, colors, opacities, offsets, flatten_ids, bg = reference_inputs(1, 37, 23, 300, 3, 3, True)
    args = to(device, means2d, conics, colors, opacities, bg)
    m2, co, cl, op, b = args
    off, fl = to(device, offsets, flatten_ids)
    _, _, T, last = rasterize_to_pixels_fwd(m2, co, cl, op, 37, 23, TS, off, fl, b)
    vc, va = torch.randn(1, 23, 37, 3).to(device), torch.randn(1, 23, 37, 1).to(device)
    buf = torch.zeros(m2.shape, device=device)
    g1 = rasterize_to_pixels_bwd(m2, co, cl, op, b, 37, 23, TS, off, fl, T, last, vc, va, buf)
    once = buf.clone()
    rasterize_to_pixels_bwd(m2, co, cl, op, b, 37, 23, TS, off, fl, T, last, vc, va, buf)
    check_grad("absgrad.twice", buf, 2 * once, rtol=1e-6)
    g0 = rasterize_to_pixels_bwd(m2, co, cl, op, b, 37, 23, TS, off, fl, T, last, vc, va, None)
    for part, a, c in zip(["means2d", "conics", "colors", "opacities", "backgrounds"], g0, g1):
        check_grad(f"absgrad.off.{part}", a, c, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_rasterize_bwd_saturated_alpha(device):
    """Opacities of 0.998-1 on broad gaussians: near their centres opacity * exp(-sigma) exceeds the 0.999 clamp, where
    alpha is constant (no gradient to sigma or opacity), and pixels stop after one or two gaussians."""
    means2d, conics, colors, opacities, offsets, flatten_ids, bg = reference_inputs(
        1, 37, 23, 300, 9, 3, True, opacity_range=(0.998, 1.0), scale_range=(1.0, 2.0)
    )
    ys, xs = torch.meshgrid(torch.arange(23) + 0.5, torch.arange(37) + 0.5, indexing="ij")
    d = means2d[0, :, None, None, :] - torch.stack([xs, ys], -1)
    co = conics[0, :, None, None, :]
    sigma = 0.5 * (co[..., 0] * d[..., 0] ** 2 + co[..., 2] * d[..., 1] ** 2) + co[..., 1] * d.prod(-1)
    visible = (conics[0].abs().sum(-1) > 0)[:, None, None]
    clamped = (opacities[0, :, None, None] * torch.exp(-sigma) > constants.ALPHA_MAX) & visible
    assert clamped.sum() >= 20, f"only {clamped.sum().item()} clamped (gaussian, pixel) pairs"
    check_rasterize_bwd("rast_bwd[saturated]", device, means2d, conics, colors, opacities, 37, 23, offsets,
                        flatten_ids, bg)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# projection backward
# --------------------------------------------------------------------------------------------------
def check_project_bwd(name, device, scene, calc_comp, near_plane=0.01, seed=0, only_conics=False):
    """Random upstream gradients on every output (only on conics with ``only_conics``: then the
    cov2d / J path, small next to the means2d path for broad gaussians, is all that is checked)."""
    C, N = scene.C, scene.N
    leaves = [leaf(t) for t in (scene.means, scene.quats, scene.scales, scene.viewmats, scene.Ks)]
    radii, means2d, depths, conics, comp = ref.project(*leaves, scene.width, scene.height,
                                                       near_plane=near_plane, calc_compensations=calc_comp)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    v_means2d, v_depths, v_conics = (torch.randn(t.shape, generator=g) for t in (means2d, depths, conics))
    v_comp = torch.randn(C, N, generator=g) if calc_comp else None
    if only_conics:
        v_means2d, v_depths, v_comp = v_means2d * 0, v_depths * 0, (v_comp * 0 if calc_comp else None)
    loss = (means2d * v_means2d).sum() + (depths * v_depths).sum() + (conics * v_conics).sum()
    if calc_comp:
        loss = loss + (comp * v_comp).sum()
    if loss.requires_grad:
        loss.backward()
    args = to(device, scene.means, scene.quats, scene.scales, scene.viewmats, scene.Ks)
    got = project_bwd(*args, scene.width, scene.height, constants.EPS2D, radii.to(device),
                      *to(device, v_means2d, v_depths, v_conics, v_comp), Ks_grad=True)  # fmt: skip
    for part, a, lf in zip(["means", "quats", "scales", "viewmats", "Ks"], got, leaves):
        check_grad(f"{name}.v_{part}", a, lf.grad)
    return radii, got, [lf.grad for lf in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("antialiased", [False, True], ids=["classic", "antialiased"])
def test_project_bwd_matches_reference(device, case, antialiased):
    C, W, H, N = case
    scene = random_scene(n=N, C=C, width=W, height=H, seed=21)
    radii, got, _ = check_project_bwd(f"proj_bwd[{C},{W}x{H},{N},{antialiased}]", device, scene, antialiased)
    if (radii > 0).any():
        assert got[3][:, :3].abs().sum() > 0, "visible gaussians must move the camera pose"
        assert (got[3][:, 3] == 0).all(), "row 3 of a viewmat is constant"


@pytest.mark.parametrize("device", DEVICES)
def test_project_bwd_fov_clamp_near_plane_and_many_groups(device):
    """Narrow field of view with a wide scene: many visible gaussians have centres outside
    1.3 x tan(fov), so the clamped branch of the J derivative is exercised; one camera, so that the
    rows of those gaussians can be checked on their own (they are a minority of the norm). N = 1000
    spans 4 threadgroups, so the per-group viewmat partials are summed."""
    scene = random_scene(n=1000, C=1, width=64, height=40, seed=4, fov_x_deg=25.0, extent=2.0, scale_range=(0.1, 0.6))
    radii, got, expected = check_project_bwd("proj_bwd[clamp]", device, scene, True)
    R, t = scene.viewmats[:, :3, :3], scene.viewmats[:, :3, 3]
    mc = torch.einsum("cij,nj->cni", R, scene.means) + t[:, None]
    clamped = torch.zeros_like(radii, dtype=torch.bool)
    for axis, size in ((0, scene.width), (1, scene.height)):
        f, c = scene.Ks[:, axis, axis, None], scene.Ks[:, axis, 2, None]
        lim_pos, lim_neg = (size - c) / f + 0.3 * 0.5 * size / f, c / f + 0.3 * 0.5 * size / f
        u = mc[..., axis] / mc[..., 2]
        clamped |= (radii > 0) & ((u > lim_pos) | (u < -lim_neg))
    rows = clamped[0]
    assert rows.sum() >= 10, f"only {rows.sum().item()} visible gaussians in the clamped branch"
    _, got, expected = check_project_bwd("proj_bwd[clamp,conics]", device, scene, True, only_conics=True)
    for part, a, b in zip(["means", "quats", "scales"], got, expected):
        check_grad(f"proj_bwd[clamp,conics].clamped_rows.v_{part}", a[rows], b[rows])
    # a near plane that culls part of the scene, two cameras
    scene2 = random_scene(n=1000, C=2, width=64, height=40, seed=4, fov_x_deg=25.0, extent=2.0, scale_range=(0.1, 0.6))
    radii, _, _ = check_project_bwd("proj_bwd[near]", device, scene2, False, near_plane=3.8)
    assert (radii == 0).any() and (radii > 0).any()


@pytest.mark.parametrize("device", DEVICES)
def test_project_bwd_everything_behind_the_camera(device):
    scene = random_scene(n=200, C=2, width=37, height=23, seed=12)
    scene.viewmats = torch.diag(torch.tensor([-1.0, 1.0, -1.0, 1.0])) @ scene.viewmats
    radii, got, _ = check_project_bwd("proj_bwd[behind]", device, scene, True)
    assert (radii == 0).all()
    for t in got:
        assert (t == 0).all()


# --------------------------------------------------------------------------------------------------
# spherical harmonics backward
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("degree", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("C, N", [(1, 0), (1, 1), (2, 1000)])
def test_sh_bwd_matches_reference(device, degree, C, N):
    g = torch.Generator().manual_seed(degree + 10 * N)
    K = 25  # more rows than degree < 4 uses: those must get exactly zero
    dirs = torch.randn(C, N, 3, generator=g) * 3.0
    coeffs = torch.randn(C, N, K, 3, generator=g)
    masks = torch.rand(C, N, generator=g) > 0.2
    v_colors = torch.randn(C, N, 3, generator=g)
    d, c = leaf(dirs), leaf(coeffs)
    (ref.spherical_harmonics(degree, d, c, masks) * v_colors).sum().backward()
    v_dirs, v_coeffs = spherical_harmonics_bwd(degree, *to(device, dirs, coeffs, masks, v_colors))
    check_grad(f"sh_bwd[{degree},{C},{N}].v_dirs", v_dirs, d.grad)
    check_grad(f"sh_bwd[{degree},{C},{N}].v_coeffs", v_coeffs, c.grad)
    assert (v_coeffs[..., (degree + 1) ** 2 :, :] == 0).all()
    assert (v_coeffs[~masks.to(device)] == 0).all() and (v_dirs[~masks.to(device)] == 0).all()
    v_dirs2, v_coeffs2 = spherical_harmonics_bwd(degree, *to(device, dirs, coeffs, None, v_colors), dirs_grad=False)
    assert v_dirs2 is None
    d, c = leaf(dirs), leaf(coeffs)
    (ref.spherical_harmonics(degree, d, c) * v_colors).sum().backward()
    check_grad(f"sh_bwd[{degree},{C},{N}].nomask.v_coeffs", v_coeffs2, c.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("degree", [1, 3, 4])
def test_sh_activate_bwd_matches_reference(device, degree):
    """activate: clamp_min(c + 0.5, 0)'s gradient (passes where c + 0.5 > 0) inside sh_bwd.metal,
    through the metal backend's autograd Function, against the reference's torch ops."""
    g = torch.Generator().manual_seed(30 + degree)
    C, N, K = 2, 600, 25
    dirs = torch.randn(C, N, 3, generator=g) * 3.0
    coeffs = torch.randn(C, N, K, 3, generator=g) * 2.0
    masks = torch.rand(C, N, generator=g) > 0.2
    v_colors = torch.randn(C, N, 3, generator=g)
    d, c = leaf(dirs), leaf(coeffs)
    r = ref.spherical_harmonics(degree, d, c, masks, activate=True)
    assert (r == 0).any() and (r > 0).any()  # both sides of the clamp
    (r * v_colors).sum().backward()
    dm, cm = (leaf(t.to(device)) for t in (dirs, coeffs))
    (mtl.spherical_harmonics(degree, dm, cm, masks.to(device), activate=True) * v_colors.to(device)).sum().backward()
    check_grad(f"sh_activate_bwd[{degree}].v_dirs", dm.grad, d.grad)
    check_grad(f"sh_activate_bwd[{degree}].v_coeffs", cm.grad, c.grad)


# --------------------------------------------------------------------------------------------------
# end to end through the public op (each backend runs its own forward)
# --------------------------------------------------------------------------------------------------
def public_grads(backend, device, kw, seed=0, absgrad=True):
    """Leaf gradients of a random linear loss on colours and alphas, plus means2d.grad / absgrad."""
    leaves = {k: leaf(v).to(device) if backend == "metal" else leaf(v) for k, v in kw.items() if torch.is_tensor(v)}
    for v in leaves.values():
        v.retain_grad()
    call = dict(kw, **leaves)
    colors, alphas, meta = rasterization(**call, absgrad=absgrad, backend=backend)
    meta["means2d"].retain_grad()
    g = torch.Generator().manual_seed(seed)
    w_c = torch.randn(colors.shape, generator=g).to(colors.device)
    w_a = torch.randn(alphas.shape, generator=g).to(colors.device)
    if kw.get("render_mode", "RGB") in ("ED", "RGB+ED"):  # expected depth is large where alpha is tiny
        w_c[..., -1] *= (alphas[..., 0] > 0.5).float() * 0.1
    ((colors * w_c).sum() + (alphas * w_a).sum()).backward()
    out = {k: v.grad for k, v in leaves.items()}
    out["means2d"] = meta["means2d"].grad
    if absgrad:
        out["absgrad"] = meta["means2d"].absgrad
    return out, meta


def check_public(name, device, kw, absgrad=True):
    r, rmeta = public_grads("reference", "cpu", kw, absgrad=absgrad)
    m, mmeta = public_grads("metal", device, kw, absgrad=absgrad)
    assert torch.equal(mmeta["radii"].cpu(), rmeta["radii"]), f"{name}: radii differ"
    for k in r:
        check_grad(f"{name}.grad.{k}", m[k], r[k])
    return m, r


E2E = [  # (C, W, H, N, sh_degree, rasterize_mode, render_mode, backgrounds)
    (2, 37, 23, 1000, 3, "antialiased", "RGB+ED", True),
    (2, 45, 29, 400, 4, "classic", "RGB+ED", True),
    (1, 37, 23, 1000, 2, "classic", "RGB", False),
    (2, 16, 16, 1, 0, "classic", "RGB+ED", True),
    (1, 16, 16, 0, 1, "antialiased", "RGB", True),
    (2, 648, 420, 150, 1, "antialiased", "RGB+ED", False),
    (2, 37, 23, 300, None, "classic", "RGB", True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case", E2E, ids=lambda c: f"C{c[0]}-{c[1]}x{c[2]}-N{c[3]}-sh{c[4]}-{c[5]}-{c[6]}-bg{int(c[7])}"
)
def test_public_api_gradients_match_reference(device, case):
    C, W, H, N, sh_degree, mode, render_mode, bg = case
    scene = random_scene(n=N, C=C, width=W, height=H, seed=31, sh_degree=sh_degree, backgrounds=bg)
    kw = scene.kwargs(rasterize_mode=mode, render_mode=render_mode, near_plane=0.2)
    m, _ = check_public(f"api[{C},{W}x{H},{N},sh{sh_degree},{mode},{render_mode}]", device, kw)
    if N > 1:
        for k in ("means", "quats", "scales", "opacities", "colors", "viewmats", "Ks"):
            assert m[k].abs().sum() > 0, f"no gradient reached {k}"


@pytest.mark.parametrize("device", DEVICES)
def test_public_api_everything_behind_the_camera(device):
    scene = random_scene(n=200, C=2, width=37, height=23, seed=12, sh_degree=2, backgrounds=True)
    scene.viewmats = torch.diag(torch.tensor([-1.0, 1.0, -1.0, 1.0])) @ scene.viewmats
    m, _ = check_public("api[behind]", device, scene.kwargs(rasterize_mode="antialiased"))
    for k in ("means", "quats", "scales", "opacities", "colors", "Ks", "means2d", "absgrad"):
        assert (m[k] == 0).all(), k
    assert m["backgrounds"].abs().sum() > 0, "the background alone is seen: it gets the whole gradient"


@pytest.mark.parametrize("device", DEVICES)
def test_public_api_one_gaussian_covering_every_tile(device):
    kw = dict(
        means=torch.tensor([[0.0, 0.0, 2.0]]), quats=torch.tensor([[0.9, 0.1, -0.2, 0.3]]),
        scales=torch.tensor([[1.2, 0.9, 0.5]]), opacities=torch.tensor([0.8]),
        colors=torch.tensor([[0.9, 0.4, 0.1]]), viewmats=torch.eye(4)[None],
        Ks=torch.tensor([[[500.0, 0.0, 300.0], [0.0, 520.0, 230.0], [0.0, 0.0, 1.0]]]),
        width=648, height=420, backgrounds=torch.tensor([[0.0, 0.0, 1.0]]),
    )  # fmt: skip
    m, _ = check_public("api[cover]", device, kw)
    _, _, meta = rasterization(**to_device(kw, device), backend="metal")
    assert meta["tiles_per_gauss"].item() == tiles(648, 420)[0] * tiles(648, 420)[1]


def to_device(kw, device):
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in kw.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_public_api_dense_tile(device):
    """700 faint gaussians in one tile through the whole chain (SH degree 3, antialiased)."""
    N = 700
    g = torch.Generator().manual_seed(11)
    means = torch.randn(N, 3, generator=g) * torch.tensor([0.05, 0.05, 0.5]) + torch.tensor([0.0, 0.0, 5.0])
    kw = dict(
        means=means, quats=torch.randn(N, 4, generator=g), scales=torch.rand(N, 3, generator=g) * 0.04 + 0.02,
        opacities=torch.full((N,), 0.05), colors=0.3 * torch.randn(N, 16, 3, generator=g), sh_degree=3,
        viewmats=torch.eye(4)[None], Ks=torch.tensor([[[100.0, 0.0, 8.0], [0.0, 100.0, 8.0], [0.0, 0.0, 1.0]]]),
        width=37, height=23, rasterize_mode="antialiased",
    )  # fmt: skip
    check_public("api[dense]", device, kw)


GARDEN_N = 1000
GARDEN_SCALE = 0.03


@pytest.mark.parametrize("device", DEVICES)
def test_garden_cameras_gradients(device, garden):
    """The 3 real garden cameras (648x420) on a subsample of the real points, SH degree 1, RGB+ED,
    antialiased, absgrad: every gradient, including the camera poses', against the reference."""
    scene = garden_scene(garden, n=GARDEN_N, seed=1, scale=GARDEN_SCALE)
    C, N = scene.C, scene.N
    g = torch.Generator().manual_seed(3)
    scene.scales = scene.scales * torch.exp(0.4 * torch.randn(N, 3, generator=g))  # anisotropic: quats matter
    sh = torch.zeros(N, 4, 3)
    sh[:, 0] = (scene.colors - 0.5) / 0.2820947917738781
    sh[:, 1:] = 0.1 * torch.randn(N, 3, 3, generator=g)
    kw = scene.kwargs(colors=sh, sh_degree=1, backgrounds=torch.rand(C, 3, generator=g), render_mode="RGB+ED",
                      rasterize_mode="antialiased", near_plane=0.2)  # fmt: skip
    m, _ = check_public("garden", device, kw)
    assert m["viewmats"][:, :3].abs().sum(dim=(1, 2)).min() > 0, "every garden camera gets a pose gradient"


# --------------------------------------------------------------------------------------------------
# gradcheck-style: against the float64 reference, and finite differences of the Metal forward
# --------------------------------------------------------------------------------------------------
def tiny_scene():
    """12 broad, half-transparent gaussians in front of 2 cameras at 24x17: smooth enough for finite
    differences (few pixels sit on an alpha or tile threshold)."""
    return random_scene(n=12, C=2, width=24, height=17, seed=5, sh_degree=2, backgrounds=True,
                        scale_range=(0.2, 0.5), opacity_range=(0.2, 0.6), distance=3.0)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_match_the_float64_reference(device):
    """The float32 kernels against the float64 oracle: agreement to ~1e-5 shows the kernels'
    float32 error is rounding (a float32 oracle could share a float32 bias with the kernels)."""
    kw = tiny_scene().kwargs(rasterize_mode="antialiased", render_mode="RGB+ED")
    r64, _ = public_grads("reference", "cpu", {k: v.double() if torch.is_tensor(v) else v for k, v in kw.items()})
    m, _ = public_grads("metal", device, kw)
    for k in r64:
        check_grad(f"f64.grad.{k}", m[k], r64[k], rtol=1e-4)


def smooth_scene():
    """6 broad gaussians (scales 2-3) seen by 2 cameras at 24x17, chosen so the loss is smooth where
    the finite differences probe it: every gaussian's alpha at every pixel is far above the 1/255
    cut and below the 0.999 clamp, every gaussian covers every tile, and depths differ enough that no
    step reorders them (all asserted below). Elsewhere 3DGS' loss has jumps that finite differences
    would measure instead of the gradient."""
    return random_scene(n=6, C=2, width=24, height=17, seed=7, sh_degree=2, backgrounds=True, extent=0.8,
                        scale_range=(2.0, 3.0), opacity_range=(0.1, 0.4), distance=3.0)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_finite_differences_of_the_metal_forward(device):
    """Directional derivatives of the Metal forward itself (no reference involved): for each input X
    and a random unit direction d, (L(X + h d) - L(X - h d)) / 2h against <grad X, d>, h = 2e-3.
    The loss is summed in float64 over float32 renders; rounding and truncation give ~1e-3 relative
    (measured); a missing or wrong term in any backward kernel is off by far more. Tolerance 1e-2,
    relative to max(|<grad, d>|, 1e-2 ||grad||) so a direction nearly orthogonal to the gradient
    does not turn rounding into a failure."""
    kw = smooth_scene().kwargs(rasterize_mode="antialiased", render_mode="RGB")
    W, H = kw["width"], kw["height"]
    _, _, meta = rasterization(**kw, backend="reference")
    ys, xs = torch.meshgrid(torch.arange(H) + 0.5, torch.arange(W) + 0.5, indexing="ij")
    delta = meta["means2d"][:, :, None, None, :] - torch.stack([xs, ys], -1)
    co = meta["conics"][:, :, None, None, :]
    sigma = 0.5 * (co[..., 0] * delta[..., 0] ** 2 + co[..., 2] * delta[..., 1] ** 2) + co[..., 1] * delta.prod(-1)
    alpha = meta["opacities"][:, :, None, None] * torch.exp(-sigma)
    depths = meta["depths"]
    gaps = (depths[:, :, None] - depths[:, None, :]).abs() + 1e9 * torch.eye(depths.shape[1])
    assert alpha.min() > 5 * constants.ALPHA_MIN and alpha.max() < constants.ALPHA_MAX, "scene not smooth"
    assert (meta["tiles_per_gauss"] == math.prod(tiles(W, H))).all() and gaps.min() > 0.02, "scene not smooth"

    kw = to_device(kw, device)
    w = torch.randn(2, H, W, 3, generator=torch.Generator().manual_seed(2)).double().to(device)

    def loss(**over):
        colors, alphas, _ = rasterization(**dict(kw, **over), backend="metal")
        return (colors.double() * w).sum() + 0.5 * alphas.double().sum()

    names = ["means", "quats", "scales", "opacities", "colors", "viewmats", "Ks", "backgrounds"]
    leaves = {k: leaf(kw[k]) for k in names}
    loss(**leaves).backward()
    g = torch.Generator().manual_seed(3)
    h = 2e-3
    for k in names:
        x = kw[k].detach()
        d = torch.randn(x.shape, generator=g).to(device)
        if k == "viewmats":
            d[:, 3] = 0.0
        d = d / d.norm()
        with torch.no_grad():
            fd = (loss(**{k: x + h * d}) - loss(**{k: x - h * d})).item() / (2 * h)
        an = (leaves[k].grad.double() * d).sum().item()
        err = abs(fd - an) / max(abs(an), 1e-2 * leaves[k].grad.norm().item(), 1e-9)
        print(f"fd.{k}: analytic {an:.6g}, finite difference {fd:.6g}, rel {err:.2e}")
        assert err <= 1e-2, f"{k}: analytic {an} vs finite difference {fd}"


def test_standard_variants_include_the_backward_libraries():
    """kernels.compile_all (the doctor; all_sources feeds the macOS CI's `xcrun metal` check) builds
    exactly the backward libraries a training step uses: after it, a step compiles nothing new."""
    from splat_metal_method.ops.metal import kernels

    names = list(kernels.compile_all(torch.device("cpu")))
    assert {"project_bwd", "sh_bwd", "rasterize_bwd_rgb", "rasterize_bwd_rgbd", "rasterize_bwd_d"} <= set(names)
    before = set(runtime._libraries)
    scene = random_scene(n=50, C=1, width=37, height=23, seed=2, sh_degree=1, backgrounds=True)
    for mode in ("RGB", "RGB+ED", "D"):
        public_grads("metal", "cpu", scene.kwargs(render_mode=mode, rasterize_mode="antialiased"))
    assert set(runtime._libraries) == before, "a training step compiled a library compile_all does not know"


# --------------------------------------------------------------------------------------------------
# the rasterizers' pixel order at every tile geometry (common.h raster_pixel_in_group)
# --------------------------------------------------------------------------------------------------
# (tile size, channels, cameras, chunk (None: one pass), threads the pipeline allows a group (None: a whole tile)).
# A simdgroup takes an 8x4 block of pixels where the tile width is a multiple of 8 and the group's rows of 4 (16,
# 24, 32 and the strips of 4 and 8 rows), a row-major run of 32 otherwise (8 wide: the same thing; 12, 5).
TILE_GEOMETRIES = [
    (16, 3, 1, None, None),  # 8 simdgroups: 2 x 4 blocks
    (16, 4, 2, 7, None),
    (16, 3, 1, None, 100),  # groups of 4 rows of a tile: 2 blocks of 8x4
    (16, 3, 2, 7, 128),  # groups of 8 rows
    (24, 3, 1, None, None),  # 3 x 6 blocks
    (32, 3, 1, None, None),  # 4 x 8 blocks
    (8, 3, 1, None, None),  # 8 wide: a block of 8x4 is 4 rows of 8
    (12, 3, 1, 7, None),  # not a multiple of 8: row order (4.5 simdgroups)
    (5, 4, 1, None, None),  # one partial simdgroup: row order
]


def limit_rasterizer_groups(monkeypatch, limit):
    """This GPU's rasterizer pipelines allow `limit` threads a group (kernels.tile_library builds strips)."""
    from splat_metal_method.ops.metal import kernels

    real = runtime.pipeline_limits

    def limits(kernel):
        out = real(kernel)
        if repr(kernel).startswith(("<emulated Metal kernel rasterize_fwd(", "<emulated Metal kernel rasterize_bwd(")):
            out["max_threads_per_threadgroup"] = min(out["max_threads_per_threadgroup"] or limit, limit)
        return out

    monkeypatch.setattr(runtime, "pipeline_limits", limits)
    monkeypatch.setattr(kernels, "_fitted_groups", {})


def geometry_inputs(ts, D, C):
    W, H = 3 * ts + 7, 2 * ts + 5  # non-square, partial tiles
    return W, H, reference_inputs(C, W, H, 120, ts * 10 + D, D, False, ts=ts, scale_range=(0.05, 0.3))


@pytest.mark.parametrize("ts,D,C,chunk,limit", TILE_GEOMETRIES)
def test_rasterize_tile_geometries_match_reference(ts, D, C, chunk, limit, monkeypatch):
    """Forward and every gradient (absgrad included) against the reference at each geometry of the pixel order."""
    if limit:
        limit_rasterizer_groups(monkeypatch, limit)
    W, H, (means2d, conics, colors, opacities, offsets, flatten_ids, _) = geometry_inputs(ts, D, C)
    want_c, want_a = ref.rasterize_to_pixels(means2d, conics, colors, opacities, W, H, ts, offsets, flatten_ids)
    got_c, got_a, _, _ = rasterize_to_pixels_fwd(means2d, conics, colors, opacities, W, H, ts, offsets, flatten_ids,
                                                 chunk=chunk)  # fmt: skip
    assert want_a.max() > 0.5
    torch.testing.assert_close(got_c, want_c, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_a, want_a, rtol=1e-4, atol=1e-5)
    grads, absgrad, _ = check_rasterize_bwd(f"ts{ts}", "cpu", means2d, conics, colors, opacities, W, H, offsets,
                                            flatten_ids, None, ts=ts, chunk=chunk)  # fmt: skip
    assert grads[0].abs().sum() > 0 and absgrad.abs().sum() > 0


def test_planted_pixel_order_bug_fails_the_reference_comparison(monkeypatch):
    """An order that gives two threads of a block the same pixel (lane / 16 for lane / 8: rows 0-1 of each block
    twice, rows 2-3 never) is caught by the forward's comparison with the reference."""
    from splat_metal_method.ops.metal import kernels

    right = kernels.stage_source

    def planted(stage_file, tile_size=TS, extra=()):
        src = right(stage_file, tile_size, extra)
        if stage_file == "rasterize.metal":
            old = "* 4 + lane / 8);"
            assert src.count(old) == 1
            src = src.replace(old, "* 4 + lane / 16);")
        return src

    monkeypatch.setattr(kernels, "stage_source", planted)
    W, H, (means2d, conics, colors, opacities, offsets, flatten_ids, _) = geometry_inputs(16, 3, 1)
    want_c, _ = ref.rasterize_to_pixels(means2d, conics, colors, opacities, W, H, 16, offsets, flatten_ids)
    got_c, _, _, _ = rasterize_to_pixels_fwd(means2d, conics, colors, opacities, W, H, 16, offsets, flatten_ids)
    with pytest.raises(AssertionError):  # what test_rasterize_tile_geometries_match_reference asserts
        torch.testing.assert_close(got_c, want_c, rtol=1e-4, atol=1e-5)
