"""Non-finite and out-of-range inputs mean one thing on every backend (README "Known limits").

One tiny scene (24 gaussians, 40x30, SH degree 1, a background), one entry of one input replaced by
NaN, +inf, -inf, 1e30 or 0, rendered by the reference, the native cpu backend and the Metal kernels
(under the MSL emulator). The semantics checked:
  * a gaussian with a non-finite mean, quaternion, scale, opacity or colour (SH coefficient) is
    culled: radius 0, the render of the scene without it, zero gradient for every one of its
    parameters, the other gaussians' gradients unchanged;
  * so is one whose values are finite but out of range: its quaternion's squared norm or its
    projected covariance overflows float32 (1e30 in a quaternion or a scale);
  * a camera with a non-finite view matrix is culled whole: the background, zero gradients;
  * a background is composited as given (a NaN background gives NaN pixels where T > 0);
  * every other value (1e30 opacity or colour, zeros) renders as the finite math says, the same on
    every backend.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch
from scenes import random_scene

from splat_metal_method.ops import rasterization, reference
from splat_metal_method.ops.rasterization import backend_module

WIDTH, HEIGHT = 40, 30  # non-square, partial tiles on both axes
BAD = 8  # the gaussian given the bad value (visible in the base scene, asserted below)
VALUES = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf, "1e30": 1e30, "zero": 0.0}
BACKENDS = ["reference", "cpu", "metal"]  # all on CPU tensors; "metal" runs the kernels under the emulator
PARAMS = ("means", "quats", "scales", "opacities", "colors", "viewmats", "backgrounds")
ENTRY = {  # which entry of each input gets the value
    "means": (BAD, 0), "quats": (BAD, 1), "scales": (BAD, 2), "opacities": (BAD,), "colors": (BAD, 1, 2),
    "viewmats": (0, 1, 1), "backgrounds": (0, 1),
}  # fmt: skip


@functools.lru_cache(maxsize=None)
def _base():
    return random_scene(n=24, C=1, width=WIDTH, height=HEIGHT, seed=7, sh_degree=1, backgrounds=True)


def _with_value(param: str, value: float):
    scene = _base()
    t = getattr(scene, param).clone()
    t[ENTRY[param]] = value
    return replace(scene, **{param: t})


def _culled(param: str, value: str) -> bool:
    """Whether the semantics cull gaussian BAD (the others render as before)."""
    if param in ("means", "quats", "scales", "opacities", "colors"):
        return value in ("nan", "+inf", "-inf") or (value == "1e30" and param in ("quats", "scales"))
    return False


def _without_bad(scene):
    keep = torch.arange(scene.N) != BAD
    return replace(scene, **{k: getattr(scene, k)[keep] for k in ("means", "quats", "scales", "opacities", "colors")})


@functools.lru_cache(maxsize=None)
def _render(scene_key, backend: str):
    """(colors, alphas, radii, grads by name) of a scene; scene_key = (param, value), or ("base", "with")
    / ("base", "without") for the base scene with / without gaussian BAD."""
    param, value = scene_key
    if param == "base":
        scene = _base() if value == "with" else _without_bad(_base())
    else:
        scene = _with_value(param, VALUES[value])
    inputs = {k: getattr(scene, k).clone().requires_grad_(True) for k in PARAMS}
    colors, alphas, meta = rasterization(
        **inputs, Ks=scene.Ks, width=WIDTH, height=HEIGHT, sh_degree=scene.sh_degree, backend=backend,
        render_mode="RGB+ED", absgrad=True,
    )  # fmt: skip
    meta["means2d"].retain_grad()
    weights = torch.rand(colors.shape, generator=torch.Generator().manual_seed(1))  # every pixel matters
    loss = (torch.nan_to_num(colors, 0.0, 0.0, 0.0) * weights).sum() + alphas.sum()
    loss.backward()
    grads = {k: v.grad for k, v in inputs.items()}
    grads["means2d"], grads["absgrad"] = meta["means2d"].grad, meta["means2d"].absgrad
    return colors.detach(), alphas.detach(), meta["radii"], grads


def _close(actual, expected, what, atol=1e-4, rtol=1e-4):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _grad_close(actual, expected, what):
    scale = float(expected[torch.isfinite(expected)].abs().max()) if torch.isfinite(expected).any() else 1.0
    _close(actual, expected, what, atol=1e-3 * max(scale, 1.0), rtol=1e-3)


def test_bad_gaussian_is_visible_in_the_base_scene():
    _, alphas, radii, _ = _render(("base", "with"), "reference")
    _, alphas_without, _, _ = _render(("base", "without"), "reference")
    assert radii[0, BAD] > 0 and (radii > 0).sum() > 12 and alphas.max() > 0.5
    assert ((alphas - alphas_without).abs() > 1e-3).sum() > 20, "culling gaussian BAD must change the picture"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("param", PARAMS)
def test_nonfinite_input_has_one_meaning(param, value, backend):
    colors, alphas, radii, grads = _render((param, value), backend)
    ref_colors, ref_alphas, ref_radii, ref_grads = _render((param, value), "reference")
    # The same picture and gradients as the oracle on every backend.
    _close(alphas, ref_alphas, f"{param}={value} {backend} alphas")
    # With a background the kernels add T bg, the reference (1 - alpha) bg: 1e-4 relative where T is small.
    _close(colors, ref_colors, f"{param}={value} {backend} colors", rtol=1e-3 if param == "backgrounds" else 1e-4)
    assert torch.equal(radii, ref_radii), f"{param}={value} {backend}: radii differ from the reference"
    for name, g in grads.items():
        _grad_close(g, ref_grads[name], f"{param}={value} {backend} grad of {name}")

    if _culled(param, value):  # the semantics: as if gaussian BAD were not there
        exp_colors, exp_alphas, exp_radii, exp_grads = _render(("base", "without"), backend)
        assert radii[0, BAD] == 0
        _close(colors, exp_colors, f"{param}={value} {backend}: not the render without the gaussian", 1e-6, 1e-6)
        _close(alphas, exp_alphas, f"{param}={value} {backend}: not the alphas without the gaussian", 1e-6, 1e-6)
        keep = torch.arange(24) != BAD
        for name in ("means", "quats", "scales", "opacities", "colors"):
            assert not grads[name][BAD].any(), f"{param}={value} {backend}: gradient of the culled {name}"
            _close(grads[name][keep], exp_grads[name], f"{param}={value} {backend} grad of {name}", 1e-5, 1e-5)
        _close(grads["viewmats"], exp_grads["viewmats"], f"{param}={value} {backend} grad of viewmats", 1e-5, 1e-5)
    elif param == "viewmats" and value in ("nan", "+inf", "-inf"):  # the camera is culled whole
        assert (radii == 0).all() and (alphas == 0).all()
        assert torch.equal(colors[..., :3], _base().backgrounds[:, None, None, :].expand(1, HEIGHT, WIDTH, 3))
        for name in ("means", "quats", "scales", "opacities", "colors", "viewmats"):
            assert not grads[name].any(), f"viewmats={value} {backend}: gradient of {name} not zero"
    elif param == "backgrounds":  # composited as given: channel 1 is the finite render + bg (1 - alpha)
        base_colors, base_alphas, _, _ = _render(("base", "with"), backend)
        assert torch.equal(alphas, base_alphas) and (alphas < 1).all()
        assert torch.equal(colors[..., [0, 2, 3]], base_colors[..., [0, 2, 3]]), "other channels must not change"
        expected = base_colors[..., 1] + (VALUES[value] - _base().backgrounds[0, 1]) * (1 - alphas[..., 0])
        _close(colors[..., 1], expected, f"backgrounds={value} {backend}", rtol=1e-3)
    else:  # finite inputs: finite outputs and gradients
        assert torch.isfinite(colors).all() and torch.isfinite(alphas).all()
        for name, g in grads.items():
            assert torch.isfinite(g).all(), f"{param}={value} {backend}: non-finite gradient of {name}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", ["nan", "+inf", "-inf"])
def test_rasterizer_skips_a_nonfinite_opacity(backend, value):
    """The stage alone (not only the public API's cull): an alpha that is not finite fails the alpha
    test, in forward and backward, on every backend."""
    scene = _base()
    ops = backend_module(backend)
    radii, means2d, depths, conics, _ = reference.project(
        scene.means, scene.quats, scene.scales, scene.viewmats, scene.Ks, WIDTH, HEIGHT
    )
    tw, th = math.ceil(WIDTH / 16), math.ceil(HEIGHT / 16)
    _, isect_ids, flatten_ids = reference.isect_tiles(means2d, radii, depths, 16, tw, th)
    offsets = reference.isect_offset_encode(isect_ids, 1, tw, th)
    colors = torch.rand(1, 24, 3, generator=torch.Generator().manual_seed(2))

    def render(opacities):
        leaves = [t.clone().requires_grad_(True) for t in (means2d, conics, colors, opacities)]
        out_c, out_a = ops.rasterize_to_pixels(*leaves, WIDTH, HEIGHT, 16, offsets, flatten_ids)
        (out_c.sum() + out_a.sum()).backward()
        return out_c.detach(), out_a.detach(), [t.grad for t in leaves]

    bad = scene.opacities[None].clone()
    bad[0, BAD] = VALUES[value]
    gone = scene.opacities[None].clone()
    gone[0, BAD] = 0.0  # alpha 0 < ALPHA_MIN everywhere: skipped
    got, expected = render(bad), render(gone)
    _close(got[0], expected[0], f"{backend} opacity={value} colors", 1e-6, 1e-6)
    _close(got[1], expected[1], f"{backend} opacity={value} alphas", 1e-6, 1e-6)
    for g, e, name in zip(got[2], expected[2], ("means2d", "conics", "colors", "opacities")):
        assert torch.isfinite(g).all(), f"{backend} opacity={value}: non-finite gradient of {name}"
        _close(g, e, f"{backend} opacity={value} grad of {name}", 1e-6, 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_projection_culls_a_camera_with_a_nonfinite_viewmat(backend):
    """RGB colours (no SH, so the public API computes no camera position): the projection stage's own
    check culls the whole camera, with zero gradients."""
    scene = random_scene(n=24, C=2, width=WIDTH, height=HEIGHT, seed=7)
    viewmats = scene.viewmats.clone()
    viewmats[1, 0, 3] = math.nan  # a translation entry of camera 1
    inputs = {k: getattr(scene, k).clone().requires_grad_(True) for k in ("means", "quats", "scales", "opacities",
                                                                         "colors")}  # fmt: skip
    viewmats.requires_grad_(True)
    colors, alphas, meta = rasterization(**inputs, viewmats=viewmats, Ks=scene.Ks, width=WIDTH, height=HEIGHT,
                                         backend=backend)  # fmt: skip
    (colors.sum() + alphas.sum()).backward()
    assert (meta["radii"][1] == 0).all() and (meta["radii"][0] > 0).sum() > 12
    assert not colors[1].any() and not alphas[1].any() and alphas[0].max() > 0.5
    assert not viewmats.grad[1].any() and torch.isfinite(viewmats.grad).all() and viewmats.grad[0].any()
    for name, t in inputs.items():
        assert torch.isfinite(t.grad).all(), f"{backend}: non-finite gradient of {name}"
