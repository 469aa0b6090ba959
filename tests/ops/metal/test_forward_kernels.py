"""Metal forward kernels vs the reference backend (the oracle), stage by stage.

On Linux the kernels run under the MSL emulator (cpu tensors); on a Mac the same tests also run them
on the GPU (mps tensors). Each stage is fed the REFERENCE's upstream outputs, so a test sees only
that stage's differences:

- floats: |metal - ref| <= 1e-4 + 4 ulp(|ref|). The ulp term only matters for values far above 1
  (means2d in pixels of a 648-wide image are exact to 6e-5 = 1 ulp; conics of sub-pixel gaussians
  reach ~10); images in [0, 1] are held to 1e-4.
- integers (radii, tiles_per_gauss, isect_ids, flatten_ids, offsets): identical, i.e. the same tile
  ranges and the same per-tile order.
The end-to-end garden test through the public API also compares the whole chain; its one looser
bound is justified there.
"""

from __future__ import annotations

import math

import pytest
import torch
from scenes import garden_scene, random_scene

from splat_metal_method.ops import constants, rasterization
from splat_metal_method.ops import metal as mtl
from splat_metal_method.ops import reference as ref
from splat_metal_method.ops.metal import runtime
from splat_metal_method.ops.metal.rasterize import rasterize_to_pixels_fwd
from splat_metal_method.ops.metal.sort import radix_sort_pairs

DEVICES = ["cpu"] + (["mps"] if runtime.metal_available() else [])
TS = constants.TILE_SIZE
ATOL = 1e-4
ULPS = 4
# (C, width, height, N): empty, single gaussian, square/non-square, and the garden-sized image with few
# gaussians (the emulator runs one CPU fiber per GPU thread, so big images stay sparse).
CASES = [(1, 16, 16, 0), (2, 16, 16, 1), (1, 37, 23, 1000), (2, 37, 23, 1000), (2, 648, 420, 150)]
CASE_IDS = [f"C{c}-{w}x{h}-N{n}" for c, w, h, n in CASES]

MAX_ERRORS: dict = {}  # test name -> largest error seen (printed with -s, quoted in reports)


def assert_close(name, actual, expected, atol=ATOL, ulps=ULPS):
    actual = actual.detach().cpu().double()
    expected = expected.detach().cpu().double()
    assert actual.shape == expected.shape, f"{name}: shape {list(actual.shape)} != {list(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err = (actual - expected).abs()
    tol = atol + ulps * torch.finfo(torch.float32).eps * expected.abs()
    worst = (err - tol).argmax() if err.numel() else None
    assert torch.all(err <= tol), (
        f"{name}: max |err| {err.max().item():.3g}; worst at flat index {worst.item()}: "
        f"{actual.flatten()[worst].item()} vs {expected.flatten()[worst].item()}"
    )
    e = err.max().item() if err.numel() else 0.0
    MAX_ERRORS[name] = max(MAX_ERRORS.get(name, 0.0), e)
    print(f"{name}: max |err| = {e:.3g}")
    return e


def assert_equal(name, actual, expected):
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {list(actual.shape)} != {list(expected.shape)}"
    if not torch.equal(actual, expected):
        bad = (actual != expected).nonzero()
        raise AssertionError(f"{name}: {len(bad)} entries differ, first at {bad[0].tolist()}: "
                             f"{actual[tuple(bad[0])].item()} vs {expected[tuple(bad[0])].item()}")  # fmt: skip


def scene_for(C, W, H, N, seed=0, **kw):
    return random_scene(n=N, C=C, width=W, height=H, seed=seed, **kw)


def project_both(scene, device, **kw):
    args = (scene.means, scene.quats, scene.scales, scene.viewmats, scene.Ks, scene.width, scene.height)
    r = ref.project(*args, **kw)
    m = mtl.project(*(a.to(device) if torch.is_tensor(a) else a for a in args), **kw)
    return m, r


def check_projection(name, m, scene, **kw):
    """Projection outputs against the float32 reference: radii identical, floats within 1e-4 + 4 ulp.

    Also measured (printed, not asserted) against a float64 run of the reference, to show the error
    is rounding. Callers keep near_plane >= 0.2 (scene units, cameras ~2-4 units away): for a
    gaussian much closer to the camera plane than that, camera-space depth is a cancelling sum, and
    ANY float32 implementation (kernel or reference, which sum in different orders) is off the exact
    means2d/conics by more than 1e-4, so a parity test there would measure conditioning, not code."""
    args = (scene.means, scene.quats, scene.scales, scene.viewmats, scene.Ks, scene.width, scene.height)
    r32 = ref.project(*args, **kw)
    r64 = ref.project(*(a.double() if torch.is_tensor(a) else a for a in args), **kw)
    assert_equal(f"{name}.radii", m[0], r32[0])
    for i, part in enumerate(["means2d", "depths", "conics", "compensations"], start=1):
        if r32[i] is None:
            assert m[i] is None, f"{name}.{part} should be None"
            continue
        assert_close(f"{name}.{part}", m[i], r32[i])
        kept = r32[0] > 0
        vs64 = (m[i].detach().cpu().double() - r64[i]).abs()[kept & (r64[0] > 0)]
        print(f"{name}.{part}: max |metal - ref64| = {vs64.max().item() if vs64.numel() else 0:.3g}")
    return r32


def tiles(W, H, ts=TS):
    return math.ceil(W / ts), math.ceil(H / ts)


def reference_lists(scene, ts=TS):
    """Reference projection + tile lists for a scene (the inputs of the rasterizer tests)."""
    radii, means2d, depths, conics, _ = ref.project(
        scene.means, scene.quats, scene.scales, scene.viewmats, scene.Ks, scene.width, scene.height
    )
    tw, th = tiles(scene.width, scene.height, ts)
    _, isect_ids, flatten_ids = ref.isect_tiles(means2d, radii, depths, ts, tw, th)
    offsets = ref.isect_offset_encode(isect_ids, scene.C, tw, th)
    return radii, means2d, depths, conics, offsets, flatten_ids


def to(device, *ts):
    return [t.to(device) if torch.is_tensor(t) else t for t in ts]


# --------------------------------------------------------------------------------------------------
# projection
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_project_matches_reference(device, case):
    C, W, H, N = case
    scene = scene_for(C, W, H, N, seed=1, distance=1.8, extent=1.5)  # camera inside the cloud: some culled
    kw = dict(near_plane=0.2, calc_compensations=True)
    m, _ = project_both(scene, device, **kw)
    r = check_projection("project", m, scene, **kw)
    if N >= 1000:
        assert 0 < (r[0] > 0).sum() < C * N, "the scene should have both kept and culled gaussians"


@pytest.mark.parametrize("device", DEVICES)
def test_project_options_and_culling(device):
    """radius_clip, eps2d, near/far planes and no compensations, on a scene that straddles the camera
    (some gaussians behind it, some beyond the far plane, some off-image)."""
    scene = scene_for(2, 37, 23, 1000, seed=2, distance=1.5, extent=2.0)
    kw = dict(eps2d=0.1, near_plane=0.2, far_plane=3.0, radius_clip=3.0)
    m, _ = project_both(scene, device, **kw)
    check_projection("project(opts)", m, scene, **kw)
    depth_c = (scene.means @ scene.viewmats[:, :3, :3].transpose(1, 2) + scene.viewmats[:, None, :3, 3])[..., 2]
    assert (depth_c < 0).any() and (depth_c > 3.0).any(), "scene should cross both planes"
    culled = m[0].cpu() == 0
    assert culled.any() and (~culled).any()
    for t in m[1:4]:  # culled entries are zero
        assert (t.cpu()[culled] == 0).all()


# --------------------------------------------------------------------------------------------------
# spherical harmonics
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("degree", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("with_masks", [False, True])
def test_spherical_harmonics_matches_reference(device, degree, with_masks):
    g = torch.Generator().manual_seed(10 + degree)
    C, N, K = 2, 1000, 25  # K = 25 > (degree+1)^2 for degree < 4: only the leading rows may be read
    dirs = torch.randn(C, N, 3, generator=g) * 3.0
    dirs[0, :5] = 0.0  # zero directions normalise to zero, as F.normalize does
    coeffs = torch.randn(C, N, K, 3, generator=g)
    masks = torch.rand(C, N, generator=g) > 0.3 if with_masks else None
    r = ref.spherical_harmonics(degree, dirs, coeffs, masks)
    m = mtl.spherical_harmonics(degree, *to(device, dirs, coeffs, masks))
    assert_close(f"sh.deg{degree}", m, r)
    if with_masks:
        assert (m.cpu()[~masks] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("degree", [0, 3, 4])
def test_spherical_harmonics_activate_matches_reference(device, degree):
    """activate: the public API's clamp_min(c + 0.5, 0) inside sh.metal, bitwise as torch computes it
    after the plain kernel: clamped and unclamped entries, masked ones (0.5), a NaN that stays NaN."""
    g = torch.Generator().manual_seed(20 + degree)
    C, N, K = 2, 500, 25
    dirs = torch.randn(C, N, 3, generator=g) * 3.0
    coeffs = torch.randn(C, N, K, 3, generator=g) * 2.0
    coeffs[1, 7, 0, 0] = float("nan")
    masks = torch.rand(C, N, generator=g) > 0.3
    masks[1, 7] = True
    r = ref.spherical_harmonics(degree, dirs, coeffs, masks, activate=True)
    m = mtl.spherical_harmonics(degree, *to(device, dirs, coeffs, masks), activate=True).cpu()
    plain = mtl.spherical_harmonics(degree, *to(device, dirs, coeffs, masks)).cpu()
    both = ~torch.isnan(m)
    assert torch.equal(m[both], torch.clamp_min(plain + 0.5, 0.0)[both]) and torch.isnan(m[1, 7, 0])
    assert_close(f"sh.activate.deg{degree}", torch.nan_to_num(m), torch.nan_to_num(r))
    assert (m[~masks] == 0.5).all() and (m[masks & both.all(-1)] == 0).any() and (m > 0.5).any()


def test_spherical_harmonics_empty_and_bad_degree():
    assert mtl.spherical_harmonics(2, torch.zeros(1, 0, 3), torch.zeros(1, 0, 9, 3)).shape == (1, 0, 3)
    with pytest.raises(ValueError, match="spherical_harmonics"):
        mtl.spherical_harmonics(3, torch.zeros(1, 4, 3), torch.zeros(1, 4, 9, 3))  # K too small
    with pytest.raises(ValueError, match=r"degree must be 0\.\.4, got 5"):  # sh.h's basis arrays end at degree 4
        mtl.spherical_harmonics(5, torch.zeros(1, 4, 3), torch.zeros(1, 4, 36, 3))


# --------------------------------------------------------------------------------------------------
# tile intersection
# --------------------------------------------------------------------------------------------------
def check_isect(name, device, means2d, radii, depths, C, W, H, ts=TS):
    tw, th = tiles(W, H, ts)
    r = ref.isect_tiles(means2d, radii, depths, ts, tw, th)
    m = mtl.isect_tiles(*to(device, means2d, radii, depths), ts, tw, th)
    for part, a, b in zip(["tiles_per_gauss", "isect_ids", "flatten_ids"], m, r):
        assert_equal(f"{name}.{part}", a, b)
    r_off = ref.isect_offset_encode(r[1], C, tw, th)
    m_off = mtl.isect_offset_encode(m[1], C, tw, th)
    assert_equal(f"{name}.offsets", m_off, r_off)
    return r


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_isect_matches_reference(device, case):
    C, W, H, N = case
    scene = scene_for(C, W, H, N, seed=3)
    radii, means2d, depths, *_ = reference_lists(scene)
    r = check_isect("isect", device, means2d, radii, depths, C, W, H)
    if N >= 1000:
        assert r[1].numel() > N, "expected gaussians spanning several tiles"


@pytest.mark.parametrize("device", DEVICES)
def test_isect_equal_depths_keep_emission_order(device):
    """Ties in depth (same bits) must keep camera-major, gaussian-major order in every tile."""
    C, W, H, N = 2, 37, 23, 400
    g = torch.Generator().manual_seed(4)
    means2d = torch.rand(C, N, 2, generator=g) * torch.tensor([W, H])
    radii = torch.randint(0, 12, (C, N), generator=g, dtype=torch.int32)
    depths = torch.randint(1, 4, (C, N), generator=g).float()  # only 3 distinct depths
    r = check_isect("isect(ties)", device, means2d, radii, depths, C, W, H)
    assert r[1].numel() > 1000


@pytest.mark.parametrize("device", DEVICES)
def test_isect_over_a_million_intersections(device):
    """> 1,000,000 keys through the full intersection pipeline (two radix sorts, emit, offsets)."""
    C, W, H, N = 2, 648, 420, 6000
    g = torch.Generator().manual_seed(5)
    means2d = torch.rand(C, N, 2, generator=g) * torch.tensor([W, H])
    radii = torch.randint(20, 120, (C, N), generator=g, dtype=torch.int32)
    depths = torch.rand(C, N, generator=g) * 10 + 0.5
    r = check_isect("isect(1M)", device, means2d, radii, depths, C, W, H)
    assert r[1].numel() > 1_000_000


@pytest.mark.parametrize("device", DEVICES)
def test_radix_sort_is_a_stable_unsigned_sort(device):
    g = torch.Generator().manual_seed(6)
    n = 1_100_000
    keys = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32)
    keys[::3] = keys[1::3][: keys[::3].numel()]  # many duplicates: stability is observable
    vals = torch.arange(n, dtype=torch.int32)
    k, v = radix_sort_pairs(*to(device, keys, vals), bits=32)
    expected_keys, order = torch.sort(keys.long() & 0xFFFFFFFF, stable=True)
    assert_equal("radix_sort.keys", k.long() & 0xFFFFFFFF, expected_keys)
    assert_equal("radix_sort.values", v, order.int())
    # fewer bits (the tile-key sort): only the low `bits` bits are sorted, ties stay in input order
    small = torch.randint(0, 1 << 11, (5000,), generator=g, dtype=torch.int32)
    k, v = radix_sort_pairs(*to(device, small, torch.arange(5000, dtype=torch.int32)), bits=11)
    expected_keys, order = torch.sort(small, stable=True)
    assert_equal("radix_sort(11 bits).keys", k, expected_keys)
    assert_equal("radix_sort(11 bits).values", v, order.int())


# --------------------------------------------------------------------------------------------------
# rasterization
# --------------------------------------------------------------------------------------------------
def rasterize_both(device, means2d, conics, colors, opacities, W, H, offsets, flatten_ids, bg, ts=TS):
    r = ref.rasterize_to_pixels(means2d, conics, colors, opacities, W, H, ts, offsets, flatten_ids, bg)
    m = mtl.rasterize_to_pixels(*to(device, means2d, conics, colors, opacities), W, H, ts,
                                *to(device, offsets, flatten_ids, bg))  # fmt: skip
    return m, r


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("channels, with_bg", [(3, False), (4, True)], ids=["RGB", "RGB+D-bg"])
def test_rasterize_matches_reference(device, case, channels, with_bg):
    C, W, H, N = case
    scene = scene_for(C, W, H, N, seed=7)
    radii, means2d, depths, conics, offsets, flatten_ids = reference_lists(scene)
    g = torch.Generator().manual_seed(8)
    colors = torch.rand(C, N, channels, generator=g)
    if channels == 4:
        colors[..., 3] = depths  # "RGB+ED" packs depth as a 4th channel
    opacities = scene.opacities.expand(C, N).contiguous()
    bg = torch.rand(C, channels, generator=g) if with_bg else None
    m, r = rasterize_both(device, means2d, conics, colors, opacities, W, H, offsets, flatten_ids, bg)
    # the depth channel holds values up to ~5: hold it to the same relative accuracy as colours in [0, 1]
    scale = 1 + (colors.max().item() if colors.numel() else 0.0)
    assert_close(f"rasterize.colors(D={channels})", m[0], r[0], atol=ATOL * scale)
    assert_close("rasterize.alphas", m[1], r[1])


@pytest.mark.parametrize("device", DEVICES)
def test_rasterize_single_channel_and_tile_size_8(device):
    C, W, H, N = 1, 37, 23, 300
    scene = scene_for(C, W, H, N, seed=9)
    radii, means2d, depths, conics, offsets, flatten_ids = reference_lists(scene, ts=8)
    colors = torch.rand(C, N, 1, generator=torch.Generator().manual_seed(1))
    opacities = scene.opacities.expand(C, N).contiguous()
    m, r = rasterize_both(device, means2d, conics, colors, opacities, W, H, offsets, flatten_ids, None, ts=8)
    assert_close("rasterize(D=1,ts=8).colors", m[0], r[0])
    assert_close("rasterize(D=1,ts=8).alphas", m[1], r[1])


def composite_tile_by_hand(means2d, conics, colors, opacities, offsets, flatten_ids, W, H, ts=TS):
    """Per tile, per gaussian in list order, all pixels at once: the kernel's loop written out in
    torch. Returns transmittance [C,H,W] and last_ids [C,H,W] (index into flatten_ids, -1: none)."""
    C = colors.shape[0]
    tw, th = tiles(W, H, ts)
    M = flatten_ids.numel()
    T_all = torch.ones(C, H, W)
    last_all = torch.full((C, H, W), -1, dtype=torch.int32)
    starts = offsets.flatten().tolist()
    ends = starts[1:] + [M]
    for t, (s, e) in enumerate(zip(starts, ends)):
        if s == e:
            continue
        cam, ty, tx = t // (tw * th), (t // tw) % th, t % tw
        ys = torch.arange(ty * ts, min((ty + 1) * ts, H))
        xs = torch.arange(tx * ts, min((tx + 1) * ts, W))
        py, px = torch.meshgrid(ys.float() + 0.5, xs.float() + 0.5, indexing="ij")
        T = torch.ones_like(px)
        last = torch.full(px.shape, -1, dtype=torch.int32)
        done = torch.zeros(px.shape, dtype=torch.bool)
        for i in range(s, e):
            gid = flatten_ids[i].item()
            c_, n_ = divmod(gid, means2d.shape[1])
            a, b, c = conics[c_, n_]
            dx, dy = means2d[c_, n_, 0] - px, means2d[c_, n_, 1] - py
            sigma = 0.5 * (a * dx * dx + c * dy * dy) + b * dx * dy
            alpha = torch.clamp_max(opacities[c_, n_] * torch.exp(-sigma), constants.ALPHA_MAX)
            use = ~done & (sigma >= 0) & (alpha >= constants.ALPHA_MIN)
            next_T = T * (1 - alpha)
            stop = use & (next_T <= constants.TRANSMITTANCE_MIN)
            done |= stop
            use &= ~stop
            T = torch.where(use, next_T, T)
            last = torch.where(use, torch.tensor(i, dtype=torch.int32), last)
        T_all[cam, ys[0] : ys[-1] + 1, xs[0] : xs[-1] + 1] = T
        last_all[cam, ys[0] : ys[-1] + 1, xs[0] : xs[-1] + 1] = last
    return T_all, last_all


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opacity", [0.01, 0.9], ids=["faint-all-batches", "opaque-early-stop"])
def test_rasterize_dense_tile_batches_passes_and_backward_records(device, opacity):
    """700 gaussians in one tile (> one 256-gaussian shared-memory batch). Faint ones make every pixel
    walk all batches; opaque ones stop every pixel inside the first batch, so the group-wide stop
    decision is exercised. Also: several passes (chunk=100, not a multiple of the batch) give
    bit-identical results, and transmittance / last_ids match a hand-written walk of the same lists."""
    C, W, H, N = 1, 37, 23, 700
    g = torch.Generator().manual_seed(11)
    # camera = world frame; gaussians at depth ~5 around the optical axis, which hits pixel (8, 8)
    means = torch.randn(N, 3, generator=g) * torch.tensor([0.05, 0.05, 0.5]) + torch.tensor([0.0, 0.0, 5.0])
    quats = torch.randn(N, 4, generator=g)
    # faint: ~2 px blobs, every pixel near the centre walks all batches; opaque: ~6 px blobs that
    # saturate the whole first tile within the first batch, so its group stops early as a whole
    scales = torch.rand(N, 3, generator=g) * 0.04 + (0.02 if opacity < 0.5 else 0.3)
    viewmats = torch.eye(4)[None]
    Ks = torch.tensor([[[100.0, 0.0, 8.0], [0.0, 100.0, 8.0], [0.0, 0.0, 1.0]]])
    radii, means2d, depths, conics, _ = ref.project(means, quats, scales, viewmats, Ks, W, H)
    tw, th = tiles(W, H)
    tpg, isect_ids, flatten_ids = ref.isect_tiles(means2d, radii, depths, TS, tw, th)
    offsets = ref.isect_offset_encode(isect_ids, C, tw, th)
    counts = torch.diff(torch.cat([offsets.flatten(), torch.tensor([flatten_ids.numel()])]))
    assert counts.max() > 2 * TS * TS, f"need > 2 batches in a tile, got {counts.max().item()}"
    colors = torch.rand(C, N, 3, generator=g)
    opacities = torch.full((C, N), opacity)
    bg = torch.tensor([[0.2, 0.5, 0.7]])

    m, r = rasterize_both(device, means2d, conics, colors, opacities, W, H, offsets, flatten_ids, bg)
    assert_close(f"rasterize(dense,{opacity}).colors", m[0], r[0])
    assert_close(f"rasterize(dense,{opacity}).alphas", m[1], r[1])

    args = to(device, means2d, conics, colors, opacities) + [W, H, TS] + to(device, offsets, flatten_ids, bg)
    one = rasterize_to_pixels_fwd(*args)
    many = rasterize_to_pixels_fwd(*args, chunk=100)
    for name, a, b in zip(["colors", "alphas", "transmittance", "last_ids"], one, many):
        assert_equal(f"rasterize(chunked).{name}", b, a)

    T, last = composite_tile_by_hand(means2d, conics, colors, opacities, offsets, flatten_ids, W, H)
    assert_close(f"rasterize(dense,{opacity}).transmittance", one[2], T)
    assert_equal(f"rasterize(dense,{opacity}).last_ids", one[3], last)
    assert_close("rasterize.alpha_is_1-T", one[1][..., 0], 1 - one[2], atol=1e-7, ulps=0)
    if opacity > 0.5:
        first_tile_T, first_tile_last = T[0, :TS, :TS], last[0, :TS, :TS]
        assert (first_tile_T < 0.01).all(), "opaque case should saturate the whole first tile"
        assert (first_tile_last < TS * TS).all(), "... inside its first batch"
    else:
        assert (last.cpu() >= 2 * TS * TS).any(), "faint case should reach the third batch"


@pytest.mark.parametrize("device", DEVICES)
def test_everything_behind_the_camera(device):
    C, W, H, N = 2, 37, 23, 200
    scene = scene_for(C, W, H, N, seed=12)
    # mirror every camera through its own centre: the scene now lies behind it
    flip = torch.diag(torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    scene.viewmats = flip @ scene.viewmats
    m, r = project_both(scene, device)
    assert_equal("behind.radii", m[0], r[0])
    assert (m[0] == 0).all()
    tw, th = tiles(W, H)
    tpg, isect_ids, flatten_ids = mtl.isect_tiles(m[1], m[0], m[2], TS, tw, th)
    assert (tpg == 0).all() and isect_ids.numel() == 0 and flatten_ids.numel() == 0
    offsets = mtl.isect_offset_encode(isect_ids, C, tw, th)
    assert_equal("behind.offsets", offsets, torch.zeros(C, th, tw, dtype=torch.int32))
    bg = torch.rand(C, 3).to(device)
    colors, alphas = mtl.rasterize_to_pixels(m[1], m[3], torch.rand(C, N, 3).to(device), torch.rand(C, N).to(device),
                                             W, H, TS, offsets, flatten_ids, bg)  # fmt: skip
    assert_close("behind.colors", colors, bg[:, None, None, :].expand(C, H, W, 3))
    assert (alphas == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_one_gaussian_covering_every_tile(device):
    W, H = 648, 420
    viewmats = torch.eye(4)[None]
    Ks = torch.tensor([[[500.0, 0.0, 300.0], [0.0, 520.0, 230.0], [0.0, 0.0, 1.0]]])
    means = torch.tensor([[0.0, 0.0, 2.0]])
    quats = torch.tensor([[0.9, 0.1, -0.2, 0.3]])
    scales = torch.tensor([[1.2, 0.9, 0.5]])
    args = (means, quats, scales, viewmats, Ks, W, H)
    r = ref.project(*args)
    m = mtl.project(*to(device, *args))
    assert_equal("cover.radii", m[0], r[0])
    tw, th = tiles(W, H)
    tpg, isect_ids, flatten_ids = check_isect("cover", device, r[1], r[0], r[2], 1, W, H)
    assert tpg.item() == tw * th
    offsets = ref.isect_offset_encode(isect_ids, 1, tw, th)
    mr, rr = rasterize_both(device, r[1], r[3], torch.tensor([[[0.9, 0.4, 0.1]]]), torch.tensor([[0.8]]), W, H,
                            offsets, flatten_ids, torch.tensor([[0.0, 0.0, 1.0]]))  # fmt: skip
    assert_close("cover.colors", mr[0], rr[0])
    assert_close("cover.alphas", mr[1], rr[1])
    assert (rr[1] > constants.ALPHA_MIN).float().mean() > 0.5, "the gaussian should cover most pixels"


# --------------------------------------------------------------------------------------------------
# garden: real cameras and points
# --------------------------------------------------------------------------------------------------
GARDEN_N = 2000  # a subsample with made-up 3 cm gaussians keeps the reference side of the test fast
GARDEN_SCALE = 0.03


@pytest.mark.parametrize("device", DEVICES)
def test_garden_stage_by_stage(device, garden):
    scene = garden_scene(garden, n=GARDEN_N, seed=0, scale=GARDEN_SCALE)
    C, W, H, N = scene.C, scene.width, scene.height, scene.N
    m, _ = project_both(scene, device, near_plane=0.2)
    r = check_projection("garden", m, scene, near_plane=0.2)
    radii, means2d, depths, conics = r[:4]
    tpg, isect_ids, flatten_ids = check_isect("garden.isect", device, means2d, radii, depths, C, W, H)
    offsets = ref.isect_offset_encode(isect_ids, C, *tiles(W, H))
    colors = scene.colors.expand(C, N, 3).contiguous()
    opacities = scene.opacities.expand(C, N).contiguous()
    mr, rr = rasterize_both(device, means2d, conics, colors, opacities, W, H, offsets, flatten_ids, None)
    assert_close("garden.colors", mr[0], rr[0])
    assert_close("garden.alphas", mr[1], rr[1])
    assert rr[1].mean() > 0.3, "the garden render should cover a good part of the images"


@pytest.mark.parametrize("device", DEVICES)
def test_garden_public_api_end_to_end(device, garden):
    """The whole chain through ops.rasterization (SH degree 1 colours, RGB+ED, backgrounds).

    Looser bound, justified: here each backend feeds its OWN projection to the later stages, and
    the reference's einsum/bmm rounds differently (by 1 ulp) from the kernel's ordered sums. A 1-ulp
    shift of a mean can flip the alpha >= 1/255 cut or the T <= 1e-4 stop for a pixel/gaussian pair
    that sits on the threshold; each flip changes that pixel by at most about alpha*T*|colour| <=
    1/255 (plus the same relative change of what lies behind). So: all but 0.01% of pixels within
    1e-4 and every pixel within 2/255 (colours) -- the expected depth channel (divided by alpha) is
    compared where alpha > 0.5."""
    scene = garden_scene(garden, n=GARDEN_N, seed=1, scale=GARDEN_SCALE)
    C, N = scene.C, scene.N
    g = torch.Generator().manual_seed(3)
    sh = torch.zeros(N, 4, 3)
    sh[:, 0] = (scene.colors - 0.5) / 0.2820947917738781
    sh[:, 1:] = 0.1 * torch.randn(N, 3, 3, generator=g)
    bg = torch.rand(C, 3, generator=g)
    kw = scene.kwargs(colors=sh, sh_degree=1, backgrounds=bg, render_mode="RGB+ED")
    rc, ra, rmeta = rasterization(**kw, backend="reference")
    mc, ma, mmeta = rasterization(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in kw.items()},
                                  backend="metal")  # fmt: skip
    assert_equal("garden-api.radii", mmeta["radii"], rmeta["radii"])
    for part, a, b, limit in (("colors", mc[..., :3], rc[..., :3], 2 / 255), ("alphas", ma, ra, 2 / 255)):
        err = (a.cpu() - b).abs()
        frac = (err > ATOL).float().mean().item()
        MAX_ERRORS[f"garden-api.{part}"] = err.max().item()
        print(f"garden-api.{part}: max |err| = {err.max().item():.3g}, pixels over 1e-4: {frac:.2e}")
        assert frac <= 1e-4 and err.max() <= limit, f"{part}: max {err.max().item():.3g}, {frac:.2e} over 1e-4"
    solid = ra[..., 0] > 0.5
    d_err = (mc[..., 3].cpu() - rc[..., 3])[solid].abs()
    assert (d_err <= 1e-3 * rc[..., 3][solid].abs().clamp(min=1)).float().mean() > 0.9999


# --------------------------------------------------------------------------------------------------
# autograd wrappers (backward: Metal kernels, see test_backward_kernels.py for the per-kernel checks)
# --------------------------------------------------------------------------------------------------
def test_gradients_and_absgrad_flow_like_the_reference():
    scene = random_scene(n=60, C=2, width=37, height=23, seed=13, sh_degree=2, backgrounds=True)
    leaves = {}
    results = {}
    for backend in ("reference", "metal"):
        ts = {k: v.clone().requires_grad_(True) for k, v in scene.tensors().items() if k != "Ks"}
        kw = scene.kwargs(**ts)
        with _nullctx():  # (part 2: the Metal backward kernels replaced the warned-about reference recomputation)
            colors, alphas, meta = rasterization(**kw, absgrad=True, backend=backend)
            meta["means2d"].retain_grad()
            loss = (colors * torch.linspace(0, 1, colors.shape[-1])).sum() + 0.3 * alphas.sum()
            loss.backward()
        leaves[backend] = ts
        results[backend] = (colors.detach(), meta["means2d"].grad, meta["means2d"].absgrad)
    for k in leaves["reference"]:
        gr, gm = leaves["reference"][k].grad, leaves["metal"][k].grad
        assert gm is not None, f"no gradient for {k}"
        assert_close(f"grad.{k}", gm, gr, atol=1e-4, ulps=64)
    assert_close("forward(sh).colors", results["metal"][0], results["reference"][0])
    assert_close("grad.means2d", results["metal"][1], results["reference"][1], ulps=64)
    assert results["metal"][2].abs().sum() > 0
    assert_close("absgrad.means2d", results["metal"][2], results["reference"][2], ulps=64)


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_bad_inputs_name_the_op():
    cam = (torch.eye(4)[None], torch.eye(3)[None])
    with pytest.raises(ValueError, match=r"\[project\] quats"):
        mtl.project(torch.zeros(3, 3), torch.zeros(2, 4), torch.ones(3, 3), *cam, 8, 8)
    gauss = (torch.zeros(1, 2, 2), torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), torch.zeros(1, 2))
    bad_offsets = torch.zeros(1, 2, 2, dtype=torch.int32)  # a 16x16 image has 1x1 tiles
    with pytest.raises(ValueError, match=r"\[rasterize_to_pixels\] isect_offsets"):
        mtl.rasterize_to_pixels(*gauss, 16, 16, 16, bad_offsets, torch.zeros(0, dtype=torch.int32))
