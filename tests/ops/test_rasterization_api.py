"""The public op: backend resolution, input validation, and the meta dict as gsplat 1.4's
DefaultStrategy consumes it (unchanged, on CPU through the reference backend)."""

from __future__ import annotations

import math

import pytest
import torch
from gsplat.strategy import DefaultStrategy
from scenes import random_scene

from splat_metal_method.ops import BACKENDS, BackendUnavailable, rasterization, resolve_backend

CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------------------
# Backend resolution.
# --------------------------------------------------------------------------------------------------
def cpu_backends():
    """Concrete backends that accept CPU tensors."""
    out = []
    for name in BACKENDS:
        if name == "auto":
            continue
        try:
            out.append(resolve_backend(name, CPU))
        except BackendUnavailable:
            pass
    return out


def test_auto_on_cpu_picks_an_available_cpu_backend(monkeypatch):
    monkeypatch.delenv("SPLAT_METAL_BACKEND", raising=False)
    available = cpu_backends()
    assert "reference" in available and "gsplat" not in available
    name = resolve_backend("auto", CPU)
    assert name in available
    scene = random_scene(n=10, C=1, width=20, height=13)
    _, _, meta = rasterization(**scene.kwargs())
    assert meta["backend"] == name


def test_env_var_overrides_auto_but_not_explicit(monkeypatch):
    monkeypatch.setenv("SPLAT_METAL_BACKEND", "reference")
    assert resolve_backend("auto", CPU) == "reference"
    monkeypatch.setenv("SPLAT_METAL_BACKEND", "gsplat")
    with pytest.raises(BackendUnavailable, match="CUDA"):
        resolve_backend("auto", CPU)  # the env var forced gsplat, which cannot run on CPU tensors
    assert resolve_backend("reference", CPU) == "reference"  # an explicit argument wins
    scene = random_scene(n=10, C=1, width=20, height=13)
    _, _, meta = rasterization(**scene.kwargs(backend="reference"))
    assert meta["backend"] == "reference"
    with pytest.raises(BackendUnavailable):
        rasterization(**scene.kwargs())  # auto + env var gsplat on CPU
    monkeypatch.setenv("SPLAT_METAL_BACKEND", "")  # empty means unset
    assert resolve_backend("auto", CPU) in cpu_backends()


def test_unknown_backend_names(monkeypatch):
    monkeypatch.delenv("SPLAT_METAL_BACKEND", raising=False)
    with pytest.raises(BackendUnavailable, match="'vulkan'"):
        resolve_backend("vulkan", CPU)
    scene = random_scene(n=10, C=1, width=20, height=13)
    with pytest.raises(BackendUnavailable, match=r"\[rasterization\].*'vulkan'"):
        rasterization(**scene.kwargs(backend="vulkan"))
    monkeypatch.setenv("SPLAT_METAL_BACKEND", "vulkan")
    with pytest.raises(BackendUnavailable, match="SPLAT_METAL_BACKEND"):
        resolve_backend("auto", CPU)


def test_gsplat_backend_needs_cuda_tensors():
    scene = random_scene(n=10, C=1, width=20, height=13)
    with pytest.raises(BackendUnavailable, match=r"gsplat.*CUDA.*cpu"):
        rasterization(**scene.kwargs(backend="gsplat"))


# --------------------------------------------------------------------------------------------------
# Input validation: errors name the op and the argument.
# --------------------------------------------------------------------------------------------------
def _bad_inputs():
    s = random_scene(n=8, C=2, width=20, height=13, backgrounds=True)
    sh = random_scene(n=8, C=2, width=20, height=13, sh_degree=1)
    N = s.N
    return [
        ("means", s.kwargs(means=s.means[:, :2])),
        ("quats", s.kwargs(quats=s.quats[:, :3])),
        ("scales", s.kwargs(scales=s.scales[:-1])),
        ("opacities", s.kwargs(opacities=s.opacities[:, None])),
        ("colors", s.kwargs(colors=s.colors[:-1])),
        ("colors", s.kwargs(sh_degree=1)),  # RGB colors given with sh_degree
        ("colors", sh.kwargs(sh_degree=None, colors=sh.colors[:, :, :2])),
        ("sh_degree", sh.kwargs(sh_degree=2)),  # K=4 coefficients only cover degree 1
        ("sh_degree", sh.kwargs(sh_degree=4)),  # K=4 again
        ("sh_degree", sh.kwargs(sh_degree=5, colors=torch.zeros(N, 36, 3))),  # gsplat's and our highest is 4
        ("viewmats", s.kwargs(viewmats=s.viewmats[:, :3])),
        ("Ks", s.kwargs(Ks=s.Ks[:1])),
        ("backgrounds", s.kwargs(backgrounds=s.backgrounds[:1])),
        ("backgrounds", s.kwargs(backgrounds=torch.zeros(2, 4))),
        ("render_mode", s.kwargs(render_mode="RGBD")),
        ("rasterize_mode", s.kwargs(rasterize_mode="fancy")),
        ("packed", s.kwargs(packed=True)),
        ("colors", s.kwargs(colors=torch.rand(N + 1, 3))),
        ("tile_size", s.kwargs(tile_size=0)),
        ("tile_size", s.kwargs(tile_size=33)),
        ("tile_size", s.kwargs(tile_size=16.0)),
    ]


@pytest.mark.parametrize("arg,kwargs", _bad_inputs(), ids=lambda v: v if isinstance(v, str) else "")
def test_validation_errors_name_op_and_argument(arg, kwargs):
    with pytest.raises(ValueError, match=r"^\[rasterization\] .*" + arg):
        rasterization(**kwargs, backend="reference")


def test_valid_shapes_pass_and_outputs_have_gsplat_shapes():
    scene = random_scene(n=30, C=2, width=37, height=23, backgrounds=True)
    for mode, D in (("RGB", 3), ("D", 1), ("ED", 1), ("RGB+D", 4), ("RGB+ED", 4)):
        colors, alphas, meta = rasterization(**scene.kwargs(backend="reference", render_mode=mode))
        assert colors.shape == (2, 23, 37, D) and alphas.shape == (2, 23, 37, 1), mode
    assert meta["radii"].shape == (2, 30) and meta["means2d"].shape == (2, 30, 2)
    assert meta["width"] == 37 and meta["height"] == 23 and meta["n_cameras"] == 2
    assert meta["tile_width"] == 3 and meta["tile_height"] == 2 and meta["isect_offsets"].shape == (2, 2, 3)


# --------------------------------------------------------------------------------------------------
# gsplat 1.4's DefaultStrategy on our meta dict.
# --------------------------------------------------------------------------------------------------
def make_params(seed=0):
    """Three groups of gaussians, all with opacity sigmoid(0) = 0.5 unless noted:
    - 'small' (scale 0.005 <= grow_scale3d): visible -> duplicated;
    - 'large' (scale 0.05 > grow_scale3d): visible -> split into two;
    - 'dead' (opacity 1e-4 < prune_opa), placed behind the camera (never visible, zero gradient
      so never grown) -> pruned."""
    g = torch.Generator().manual_seed(seed)
    n_small, n_large, n_dead = 12, 8, 5
    n = n_small + n_large + n_dead
    means = 0.6 * (torch.rand(n, 3, generator=g) - 0.5)
    means[-n_dead:] = torch.tensor([0.0, 0.0, 10.0])  # behind the camera of camera() (centre z=3, looking -z)
    scales = torch.full((n, 3), math.log(0.05))
    scales[:n_small] = math.log(0.005)
    opacities = torch.zeros(n)
    opacities[-n_dead:] = torch.logit(torch.tensor(1e-4))
    params = torch.nn.ParameterDict(
        {
            "means": means,
            "scales": scales,
            "quats": torch.randn(n, 4, generator=g),
            "opacities": opacities,
            "colors": torch.rand(n, 3, generator=g),
        }
    )
    optimizers = {k: torch.optim.Adam([{"params": p, "lr": 1e-4, "name": k}]) for k, p in params.items()}
    return params, optimizers, (n_small, n_large, n_dead)


def camera(width=48, height=30):
    """One camera at (0, 0, 3) looking down -z at the origin (camera z = 3 - world z), non-square."""
    viewmat = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, -1.0, 0.0, 0.0], [0.0, 0.0, -1.0, 3.0], [0.0, 0.0, 0.0, 1.0]])
    K = torch.tensor([[40.0, 0.0, width / 2], [0.0, 40.0, height / 2], [0.0, 0.0, 1.0]])
    return viewmat[None], K[None], width, height


def render_params(params, absgrad, backgrounds=None):
    viewmats, Ks, W, H = camera()
    return rasterization(
        params["means"], params["quats"], torch.exp(params["scales"]), torch.sigmoid(params["opacities"]),
        params["colors"], viewmats, Ks, W, H, absgrad=absgrad, backend="reference",
    )  # fmt: skip


@pytest.mark.parametrize("absgrad", [False, True], ids=["grad", "absgrad"])
def test_default_strategy_consumes_meta(absgrad):
    params, optimizers, (n_small, n_large, n_dead) = make_params()
    strategy = DefaultStrategy(
        prune_opa=0.005, grow_grad2d=1e-12, grow_scale3d=0.01, refine_start_iter=1, refine_every=2,
        reset_every=1000, absgrad=absgrad,
    )  # fmt: skip
    strategy.check_sanity(params, optimizers)
    state = strategy.initialize_state(scene_scale=1.0)
    target = torch.rand(1, 30, 48, 3, generator=torch.Generator().manual_seed(1))
    for step in (1, 2):  # step 1 accumulates, step 2 (> refine_start_iter, % refine_every == 0) refines
        colors, alphas, meta = render_params(params, absgrad)
        strategy.step_pre_backward(params, optimizers, state, step, meta)
        loss = (colors - target).abs().mean()
        loss.backward()
        radii = meta["radii"]
        if step == 1:
            visible = radii[0] > 0
            assert visible[: n_small + n_large].all() and not visible[-n_dead:].any()
            grads = (meta["means2d"].absgrad if absgrad else meta["means2d"].grad).clone()
            other = meta["means2d"].grad if absgrad else getattr(meta["means2d"], "absgrad", None)
            if absgrad:
                assert not torch.allclose(grads, other.abs()), "absgrad should differ from |grad|"
            else:
                assert other is None, "absgrad=False must not compute absgrad"
            # DefaultStrategy's accumulation, recomputed from what it must have read.
            grads[..., 0] *= meta["width"] / 2.0 * meta["n_cameras"]
            grads[..., 1] *= meta["height"] / 2.0 * meta["n_cameras"]
            expected = torch.where(visible, grads[0].norm(dim=-1), 0.0)
        strategy.step_post_backward(params, optimizers, state, step, meta)
        if step == 1:
            torch.testing.assert_close(state["grad2d"], expected)
            torch.testing.assert_close(state["count"], visible.float())
            assert (state["grad2d"][: n_small + n_large] > 0).all()
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
    # 12 small duplicated (24), 8 large split (16), 5 dead pruned (0).
    n_after = len(params["means"])
    assert n_after == 2 * n_small + 2 * n_large, n_after
    for k, p in params.items():
        assert p.shape[0] == n_after, k
        assert optimizers[k].param_groups[0]["params"][0] is p
        assert optimizers[k].state[p]["exp_avg"].shape == p.shape
    assert (torch.sigmoid(params["opacities"]) >= 0.005).all()
    # The grown model still renders and trains.
    colors, _, meta = render_params(params, absgrad)
    assert meta["radii"].shape == (1, n_after)
    colors.mean().backward()
    assert torch.isfinite(params["means"].grad).all()
