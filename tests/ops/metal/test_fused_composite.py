"""splatfacto's background composite fused into the Metal rasterizer (rasterization's composite_background:
rasterize.metal writes rgb = clamp(render + (1 - alpha) background, 0, 1), rasterize_bwd.metal takes its
gradient) against its unfused twin (the same rasterizer, then ops/composite.py's train.metal kernels: the same
bits forward) and the reference (reference rasterization + splatfacto's expression), forward and backward,
under the emulator: non-square images, several tile grids, one and two cameras, RGB and RGB+ED, a fixed, a
black and a fresh random background each step, gradients through rgb only or through rgb, alpha and depth,
kernel passes. Planted bugs show each comparison can fail."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from scenes import random_scene

import splat_metal_method.ops.metal as metal_ops
from splat_metal_method.bench import step_ledger
from splat_metal_method.ops import rasterization
from splat_metal_method.ops.composite import composite_background, composite_background_reference
from splat_metal_method.ops.metal import fused as fused_module
from splat_metal_method.ops.metal import rasterize as metal_rasterize
from splat_metal_method.ops.metal import rasterize_bwd as metal_rasterize_bwd
from splat_metal_method.ops.metal.fused import rasterization_metal


@dataclass(frozen=True)
class Case:
    tile_size: int = 16
    cameras: int = 1
    mode: str = "RGB"
    squeeze: bool = True
    background: str = "fixed"  # "fixed", "black" (uncovered pixels land on the clamp's 0), "random"
    all_outputs: bool = False  # the loss also reads alpha (and depth): every incoming gradient at once
    passes: bool = False  # kernel passes of 3 gaussians per tile

    def __str__(self):
        flags = [f"ts{self.tile_size}", f"C{self.cameras}", self.mode, self.background]
        flags += [n for n, on in (("squeeze", self.squeeze), ("all", self.all_outputs), ("passes", self.passes)) if on]
        return "-".join(flags)


CASES = [
    Case(),
    Case(tile_size=8, cameras=2, mode="RGB+ED", squeeze=False, background="black", all_outputs=True),
    Case(tile_size=5, background="random", all_outputs=True),
    Case(background="random", passes=True),
]


def _scene(case: Case):
    ts = case.tile_size
    W, H = 3 * ts + 7, 2 * ts + 3  # non-square, partial last tile row and column
    scene = random_scene(n=60, C=case.cameras, width=W, height=H, seed=11 * ts + case.cameras,
                         scale_range=(0.05, 0.3))  # fmt: skip
    g = torch.Generator().manual_seed(ts)
    colors = torch.rand(scene.N, 3, generator=g) * 1.6 - 0.3  # some pixels clamp below 0 and above 1
    return scene, colors, g


def _background(case: Case, g: torch.Generator) -> torch.Tensor:
    if case.background == "black":
        return torch.zeros(3)
    if case.background == "random":  # splatfacto's "random" background: drawn anew every step
        return torch.rand(3, generator=g)
    return torch.tensor([0.25, 0.5, 1.0])


def _step(kind: str, case: Case, scene, colors, background, v):
    """One render + loss + backward: kind "fused" (composite_background), "twin" (rasterize then
    composite_background's metal kernels) or "reference"."""
    leaves = {"means": scene.means, "quats": scene.quats, "scales": scene.scales, "opacities": scene.opacities,
              "colors": colors}  # fmt: skip
    leaves = {k: t.detach().clone().requires_grad_(True) for k, t in leaves.items()}
    backend = "reference" if kind == "reference" else "metal"
    fused = {"composite_background": background, "composite_squeeze": case.squeeze} if kind == "fused" else {}
    render, alpha, meta = (rasterization_metal if kind == "fused" else rasterization)(
        leaves["means"], leaves["quats"], leaves["scales"], leaves["opacities"], leaves["colors"], scene.viewmats,
        scene.Ks, scene.width, scene.height, tile_size=case.tile_size, render_mode=case.mode, absgrad=True,
        **({} if kind == "fused" else {"backend": backend}), **fused,
    )  # fmt: skip
    meta["means2d"].retain_grad()
    if kind == "fused":
        rgb = meta["rgb"]
    elif kind == "twin":
        rgb = composite_background(render, alpha, background, "metal", squeeze=case.squeeze)
    else:
        rgb = composite_background_reference(render, alpha, background)
        rgb = rgb.squeeze(0) if case.squeeze else rgb
    v_rgb, v_alpha, v_depth = v
    loss = (rgb * (v_rgb[0] if case.squeeze else v_rgb)).sum()
    if case.all_outputs:
        loss = loss + (alpha * v_alpha).sum()
        if case.mode == "RGB+ED":
            loss = loss + (render[..., 3:] * v_depth).sum()
    loss.backward()
    grads = {k: t.grad for k, t in leaves.items()}
    grads["means2d"], grads["absgrad"] = meta["means2d"].grad, meta["means2d"].absgrad
    return rgb.detach(), render.detach(), alpha.detach(), grads


def _close(name, actual, expected, rtol, atol):
    a, b = actual.double(), expected.double()
    assert a.shape == b.shape, f"{name}: shape {list(a.shape)} != {list(b.shape)}"
    err = (a - b).abs().max().item()
    assert err <= rtol * b.abs().max().item() + atol, f"{name}: max|err| {err:.3g} (max|ref| {b.abs().max():.3g})"


def _compare(got, want, rtol, atol, rgb_atol):
    rgb, render, alpha, grads = got
    _close("rgb", rgb, want[0], 0, rgb_atol)
    _close("render", render, want[1], rgb_atol, rgb_atol)  # depth (RGB+ED) is metres: relative
    _close("alpha", alpha, want[2], 0, rgb_atol)
    assert set(grads) == set(want[3])
    for k in grads:
        _close(f"v_{k}", grads[k], want[3][k], rtol, atol)


@pytest.fixture
def passes(monkeypatch):
    def lower():
        monkeypatch.setattr(metal_rasterize, "RASTER_CHUNK", 3)
        monkeypatch.setattr(metal_rasterize_bwd, "RASTER_CHUNK", 3)

    return lower


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fused_composite_matches_its_twin_and_the_reference(case, passes):
    if case.passes:
        passes()
    scene, colors, g = _scene(case)
    H, W, C = scene.height, scene.width, case.cameras
    for step in range(2 if case.background == "random" else 1):  # a random background changes every step
        background = _background(case, g)
        D = 4 if case.mode == "RGB+ED" else 3
        v = (torch.randn(C, H, W, 3, generator=g), torch.randn(C, H, W, 1, generator=g),
             torch.randn(C, H, W, 1, generator=g))  # fmt: skip
        out = {k: _step(k, case, scene, colors, background, v) for k in ("fused", "twin", "reference")}
        rgb = out["fused"][0]
        assert rgb.shape == ((H, W, 3) if case.squeeze else (C, H, W, 3)) and out["fused"][1].shape[-1] == D
        clamped = (rgb == 0) | (rgb == 1)
        assert clamped.any() and not clamped.all(), "the scene should exercise the clamp's both sides"
        # the twin: the same kernels' bits forward; backward the same arithmetic, summed by float atomics
        _compare(out["fused"], out["twin"], rtol=1e-5, atol=1e-7, rgb_atol=0)
        _compare(out["fused"], out["reference"], rtol=2e-3, atol=1e-5, rgb_atol=1e-5)
        assert out["reference"][3]["means2d"].abs().sum() > 0


def test_fused_composite_cuts_launches_and_aten_ops():
    case = Case()
    scene, colors, g = _scene(case)
    v = (torch.randn(1, scene.height, scene.width, 3, generator=g),) * 3
    counted = {}
    for kind in ("fused", "twin"):
        _step(kind, case, scene, colors, _background(case, g), v)  # first calls: workspace buffers, caches
        with step_ledger.count(kind) as led:
            _step(kind, case, scene, colors, _background(case, g), v)
        counted[kind] = led
    fused, twin = counted["fused"], counted["twin"]
    assert "composite_fwd" not in fused.kernels and "composite_bwd" not in fused.kernels
    assert twin.kernels["composite_fwd"].launches == 1 and twin.kernels["composite_bwd"].launches == 1
    assert fused.kernel_launches == twin.kernel_launches - 2
    assert fused.aten_dispatches < twin.aten_dispatches, (fused.aten_ops, twin.aten_ops)


def test_planted_errors_fail_the_comparison(monkeypatch):
    """A background off by 1e-3 (forward), an incoming rgb gradient 1% off, and a backward that lets the
    gradient through the clamp everywhere: each fails the comparison with the twin."""
    case = Case(tile_size=8)
    scene, colors, g = _scene(case)
    background = _background(case, g)
    v = (torch.randn(1, scene.height, scene.width, 3, generator=g),) * 3
    twin = _step("twin", case, scene, colors, background, v)
    _compare(_step("fused", case, scene, colors, background, v), twin, rtol=1e-5, atol=1e-7, rgb_atol=0)
    with pytest.raises(AssertionError, match="rgb"):
        _compare(_step("fused", case, scene, colors, background + 1e-3, v), twin, 1e-5, 1e-7, 0)
    right = metal_ops.rasterize_to_pixels_bwd
    for plant in (
        lambda comp: (comp[0], comp[1], comp[2] * 1.01),  # v_rgb 1% off
        lambda comp: (comp[0], torch.full_like(comp[1], 0.5), comp[2]),  # every x inside [0, 1]: no clamp mask
    ):

        def wrong(*args, composite=None, plant=plant, **kwargs):
            return right(*args, composite=plant(composite) if composite is not None else None, **kwargs)

        monkeypatch.setattr(metal_ops, "rasterize_to_pixels_bwd", wrong)
        with pytest.raises(AssertionError, match="v_"):
            _compare(_step("fused", case, scene, colors, background, v), twin, 1e-5, 1e-7, 0)
        monkeypatch.undo()


def test_composite_is_left_to_the_caller_where_the_rasterizer_does_not_fuse():
    """gsplat backgrounds given with composite_background, depth chunks: meta has no "rgb" (the caller
    composites, as the model does: the unfused twin); a render without colours has nothing to composite."""
    scene, colors, g = _scene(Case())
    bg3 = torch.tensor([0.25, 0.5, 1.0])
    for kwargs in ({"backgrounds": torch.rand(1, 3, generator=g)}, {"max_intersections": 5}):
        _, _, meta = rasterization_metal(
            scene.means, scene.quats, scene.scales, scene.opacities, colors, scene.viewmats, scene.Ks, scene.width,
            scene.height, composite_background=bg3, **kwargs,
        )  # fmt: skip
        assert "rgb" not in meta, kwargs
        assert "max_intersections" not in kwargs or meta["depth_chunks"] > 1
    with pytest.raises(ValueError, match="composite_background"):
        rasterization_metal(scene.means, scene.quats, scene.scales, scene.opacities, colors, scene.viewmats,
                            scene.Ks, scene.width, scene.height, render_mode="D", composite_background=bg3)  # fmt: skip


def test_the_self_check_covers_the_fused_composite(monkeypatch):
    """kernel_checks.stage_checks (the self-check's and the doctor's) compares the fused composite with the
    reference's rasterizer + composite, as stage "rasterize" (a failure routes the render to the unfused
    twin), and a planted rgb 1% off fails it."""
    from splat_metal_method.ops import reference
    from splat_metal_method.ops.stage_fallback import stage_of
    from splat_metal_method.verify import kernel_checks

    def composite_checks():
        checks = kernel_checks.stage_checks(torch.device("cpu"), metal_ops, reference, 40, 27, channels=(3,),
                                            sh_degrees=(), modes=("classic",), backgrounds=False, n=120, cameras=1)  # fmt: skip
        return [c for c in checks if "fused composite" in c.stage]

    checks = composite_checks()
    assert [c.direction for c in checks] == ["forward", "backward"] and all(c.ok for c in checks), checks
    assert stage_of(checks[0].stage) == "rasterize"
    right = metal_ops.rasterize_to_pixels_composite
    monkeypatch.setattr(metal_ops, "rasterize_to_pixels_composite",
                        lambda *a, **k: tuple(t * f for t, f in zip(right(*a, **k), (1.0, 1.0, 1.01))))  # fmt: skip
    assert [c.ok for c in composite_checks()] == [False, False]


def test_the_model_renders_the_same_rgb_and_gradients_with_the_composite_fused(monkeypatch):
    """SplatMetalModel.get_outputs (training, random background, SH colours): its rgb from the rasterizer's fused
    composite and the gradients of a loss on it equal those of the unfused twin (the metal backend not fusing
    the composite: the model composites with ops/composite.py)."""
    from nerfstudio.cameras.cameras import Cameras
    from nerfstudio.data.scene_box import SceneBox

    from splat_metal_method.method.model import SplatMetalModelConfig

    gen = torch.Generator().manual_seed(1)
    means = torch.rand(80, 3, generator=gen) - 0.5
    colors = (torch.rand(80, 3, generator=gen) * 255).to(torch.uint8)
    model = SplatMetalModelConfig(backend="metal", background_color="random").setup(
        scene_box=SceneBox(aabb=torch.tensor([[-1.0, -1, -1], [1, 1, 1]])), num_train_data=1, metadata={},
        seed_points=(means, colors),
    )  # fmt: skip
    model.config.num_downscales = 0
    model.step = 2000  # SH degree 2
    model.optimizers = {}  # the strategy's step_pre_backward takes them (the trainer sets them)
    model.train()
    c2w = torch.tensor([[1.0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 2.5]])[None]  # OpenGL: looking at the origin
    camera = Cameras(camera_to_worlds=c2w, fx=40.0, fy=40.0, cx=20.5, cy=14.0, width=41, height=29)
    v = torch.randn(29, 41, 3, generator=gen)

    def run():
        torch.manual_seed(3)  # the same random background both times
        for p in model.gauss_params.values():
            p.grad = None
        rgb = model.get_outputs(camera)["rgb"]
        (rgb * v).sum().backward()
        return rgb.detach(), {k: p.grad.clone() for k, p in model.gauss_params.items()}

    runtime_counts = {}
    from splat_metal_method.ops.metal import runtime

    runtime.reset_launch_counts()
    fused = run()
    runtime_counts["fused"] = runtime.launch_counts()
    assert int(model.info["n_intersections"]) > 100  # the camera sees the gaussians
    monkeypatch.setattr(fused_module, "_fuses_composite", lambda *args: False)
    runtime.reset_launch_counts()
    twin = run()
    runtime_counts["twin"] = runtime.launch_counts()
    assert "composite_fwd" not in runtime_counts["fused"] and runtime_counts["twin"]["composite_fwd"] == 1
    assert fused[0].shape == (29, 41, 3) and 0 < fused[0].mean() < 1
    torch.testing.assert_close(fused[0], twin[0], rtol=0, atol=0)
    # the same arithmetic, summed by float atomics in another order (isotropic seed gaussians: the quaternions'
    # gradients are rounding noise, ~1e-7)
    for k, g in twin[1].items():
        _close(f"v_{k}", fused[1][k], g, rtol=1e-5, atol=1e-6)
    assert twin[1]["means"].abs().max() > 1e-2 and twin[1]["features_dc"].abs().max() > 1e-2
