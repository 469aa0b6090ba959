"""Degenerate scenes through the public ``rasterization`` on every backend: all gaussians pruned
(N = 0), all behind the camera, one gaussian covering every tile, extremely anisotropic scales,
quaternions of zero norm. Each must give well-defined output (the background where nothing is
drawn) and finite gradients for every input, including means2d's grad and absgrad (what
DefaultStrategy reads), in RGB+ED mode (depth divides by alpha). "metal" on CPU tensors runs the
Metal kernels under the MSL emulator; "gsplat" needs CUDA and is skipped without it. Images are
non-square and span several tiles (docs/design.md section 3.2)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from scenes import random_scene

from splat_metal_method.ops import rasterization

WIDTH, HEIGHT = 45, 29  # 3 x 2 tiles of 16, partial on both axes
BACKGROUND = (0.2, 0.5, 0.9)

BACKENDS = [
    pytest.param("reference", "cpu", id="reference"),
    pytest.param("metal", "cpu", id="metal-emulator"),
    pytest.param(
        "gsplat", "cuda", id="gsplat",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="backend gsplat needs CUDA (none here)"),
    ),
]  # fmt: skip


def _base(n: int = 24):
    return random_scene(n=n, C=1, width=WIDTH, height=HEIGHT, seed=3, sh_degree=1)


def _to_camera_frame(scene, points_cam: torch.Tensor) -> torch.Tensor:
    """World positions of points given in camera 0's frame (x right, y down, z forward)."""
    R, t = scene.viewmats[0, :3, :3], scene.viewmats[0, :3, 3]
    return (points_cam - t) @ R  # R^T (p - t)


def _empty(scene):
    return replace(scene, **{k: getattr(scene, k)[:0] for k in ("means", "quats", "scales", "opacities", "colors")})


def _behind(scene):
    g = torch.Generator().manual_seed(0)
    cam = torch.randn(scene.N, 3, generator=g) * 0.3 + torch.tensor([0.0, 0.0, -2.0])  # z < 0: behind
    return replace(scene, means=_to_camera_frame(scene, cam))


def _covering(scene):
    # One opaque gaussian 2 units in front of the camera, scale 50: larger than the whole view.
    means = scene.means.clone()
    means[0] = _to_camera_frame(scene, torch.tensor([[0.0, 0.0, 2.0]]))[0]
    scales, opacities = scene.scales.clone(), scene.opacities.clone()
    scales[0], opacities[0] = 50.0, 0.99
    return replace(scene, means=means, scales=scales, opacities=opacities)


def _anisotropic(scene):
    scales = scene.scales.clone()
    scales[:5] = torch.tensor(
        [[1e-8, 1e-8, 3.0], [10.0, 1e-9, 1e-9], [1e-12, 1e-12, 1e-12], [1e4, 1e-6, 1e-6], [1e-7, 2.0, 2.0]]
    )
    return replace(scene, scales=scales)


def _zero_quats(scene):
    quats = scene.quats.clone()
    quats[:6] = 0.0
    return replace(scene, quats=quats)


CASES = {
    "all-pruned": _empty,
    "all-behind-camera": _behind,
    "one-covers-every-tile": _covering,
    "extreme-anisotropy": _anisotropic,
    "zero-norm-quats": _zero_quats,
}


def _render(scene, backend: str, device: str):
    inputs = {
        k: getattr(scene, k).to(device).clone().requires_grad_(True)
        for k in ("means", "quats", "scales", "opacities", "colors", "viewmats")
    }
    background = torch.tensor([BACKGROUND], device=device)
    colors, alphas, meta = rasterization(
        **inputs, Ks=scene.Ks.to(device), width=scene.width, height=scene.height, sh_degree=scene.sh_degree,
        backgrounds=background, render_mode="RGB+ED", absgrad=True, backend=backend,
    )  # fmt: skip
    meta["means2d"].retain_grad()
    g = torch.Generator().manual_seed(1)
    weights = torch.rand(colors.shape, generator=g).to(device)  # every pixel and channel matters
    ((colors * weights).sum() + alphas.sum()).backward()
    return colors.detach().cpu(), alphas.detach().cpu(), inputs, meta


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_degenerate_scene_is_well_defined(backend, device, case):
    scene = CASES[case](_base())
    colors, alphas, inputs, meta = _render(scene, backend, device)

    assert colors.shape == (1, HEIGHT, WIDTH, 4) and alphas.shape == (1, HEIGHT, WIDTH, 1)
    assert torch.isfinite(colors).all(), f"{case}/{backend}: non-finite pixels"
    assert torch.isfinite(alphas).all() and (alphas >= 0).all() and (alphas <= 1).all()
    for name, t in inputs.items():
        assert t.grad is not None, f"{case}/{backend}: no gradient for {name}"
        assert t.grad.shape == t.shape
        assert torch.isfinite(t.grad).all(), f"{case}/{backend}: non-finite gradient of {name}"
    means2d = meta["means2d"]
    for what in ("grad", "absgrad"):
        t = getattr(means2d, what, None)
        assert t is not None and torch.isfinite(t).all(), f"{case}/{backend}: means2d.{what} missing or non-finite"
    assert meta["radii"].shape == (1, scene.N)

    if case in ("all-pruned", "all-behind-camera"):  # nothing drawn: exactly the background, zero gradients
        assert (alphas == 0).all()
        assert torch.equal(colors[..., :3], torch.tensor(BACKGROUND).expand(1, HEIGHT, WIDTH, 3))
        assert torch.equal(colors[..., 3], torch.zeros(1, HEIGHT, WIDTH)), "depth where nothing is drawn must be 0"
        assert (meta["radii"] == 0).all()
        for name in ("means", "quats", "scales", "opacities", "colors"):
            assert not inputs[name].grad.any(), f"{case}/{backend}: gradient of {name} should be zero"
    if case == "one-covers-every-tile":
        assert (alphas > 0.9).all(), "the covering gaussian must reach every pixel of every tile"
        assert inputs["means"].grad[0].abs().sum() > 0 and inputs["opacities"].grad[0] != 0


@pytest.mark.parametrize("case", [c for c in CASES if c not in ("all-pruned", "all-behind-camera")])
@pytest.mark.parametrize("backend,device", BACKENDS[1:])
def test_degenerate_scene_matches_reference(backend, device, case):
    """The other backends draw the same picture as the oracle in each degenerate case."""
    scene = CASES[case](_base())
    ref_colors, ref_alphas, ref_inputs, _ = _render(scene, "reference", "cpu")
    colors, alphas, inputs, _ = _render(scene, backend, device)
    torch.testing.assert_close(alphas, ref_alphas, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(colors, ref_colors, atol=1e-4, rtol=1e-4)
    for name in ("opacities", "colors"):  # well-conditioned gradients agree too
        torch.testing.assert_close(inputs[name].grad.cpu(), ref_inputs[name].grad, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("backend,device", BACKENDS[:2])
def test_zero_norm_quat_renders_as_identity_rotation(backend, device):
    """A zero quaternion is the identity rotation (q / max(|q|, 1e-12) as F.normalize) on our backends,
    with a zero gradient (no direction to move in), not NaN. Backend "gsplat" hands gsplat the call as given
    (tests/ops/test_gsplat_passthrough.py): there it is gsplat's (rsqrt of 0)."""
    scene = _base()
    zero = _zero_quats(scene)
    identity = replace(scene, quats=torch.where(zero.quats.norm(dim=-1, keepdim=True) == 0,
                                                torch.tensor([1.0, 0.0, 0.0, 0.0]), zero.quats))  # fmt: skip
    colors_zero, alphas_zero, inputs, _ = _render(zero, backend, device)
    colors_id, alphas_id, _, _ = _render(identity, backend, device)
    torch.testing.assert_close(colors_zero, colors_id, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alphas_zero, alphas_id, atol=1e-5, rtol=1e-5)
    assert not inputs["quats"].grad[:6].any()
