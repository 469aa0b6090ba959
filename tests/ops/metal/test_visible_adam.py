"""The model's visible_adam option (gsplat's SelectiveAdam): a gaussian culled in the step's render (radius 0 in every
camera) takes no Adam step at all, on each of its three paths (engine/optimizers.py GaussianOptimizers):
  * inside the projection's backward (project_bwd.metal PROJECT_ADAM_VISIBLE, every group armed there);
  * after it, adam.metal's adam_step reading the render's radii (nothing armed in the backward: the twin);
  * torch's Adam (a model that does not render with the metal backend) with the culled rows given back.

test_sh_adam's training loop (splatfacto's raw parameters, gsplat's densification and an opacity reset between
steps, a tenth of the gaussians off screen):
  * the fused run equals the twin bit for bit (same element update) and torch's masked step within float tolerance;
  * a culled gaussian's parameters and moments are exactly what they were before a step, a visible one's are torch's
    Adam step of them; off (the default) the culled ones move, as torch's Adam moves them;
  * planted bugs (the kernel's or adam_step's skip ignored) fail the twin comparison.
"""

from __future__ import annotations

import types

import pytest
import torch
from test_adam import LRS, SCALER, config, densify, gaussians
from test_sh_adam import STEPS, H, W, assert_same, plant_in_project_bwd

from splat_metal_method.engine.optimizers import GaussianOptimizers
from splat_metal_method.ops.metal import adam, kernels, runtime
from splat_metal_method.ops.metal.fused import rasterization_metal

ALL = tuple(LRS)


@pytest.fixture(autouse=True)
def one_os_thread(monkeypatch):
    """One emulator OS thread: the rasterizer backward's float atomics in one order, so two runs are the same."""
    monkeypatch.setenv("SPLAT_METAL_EMU_THREADS", "1")


def make(kind: str, visible: bool = True):
    """``kind``: "torch" (torch's Adam: the model does not render with metal), "twin" (metal, adam_step after the
    backward) or "fused" (metal, every group stepped inside the backward from the second step on)."""
    params = gaussians()
    backend = "reference" if kind == "torch" else "metal"
    model = types.SimpleNamespace(gauss_params=params, config=types.SimpleNamespace(backend=backend, visible_adam=visible),
                                  render_only_groups=lambda: ALL, info={})  # fmt: skip
    opts = GaussianOptimizers(config(), {k: [p] for k, p in params.items()}, model)
    opts.fuse_sh = opts.fuse_params = kind == "fused"
    return params, opts


def render_and_backward(params, opts, degree: int, cameras: int = 1) -> None:
    """zero_grad, a metal render of the parameters (its info on the model, as SplatMetalModel keeps it), backward."""
    opts.zero_grad_all()
    viewmats = torch.eye(4)[None].repeat(cameras, 1, 1)  # [C, 4, 4]
    viewmats[1:, 0, 3] = 0.1
    Ks = torch.tensor([[[30.0, 0.0, W / 2], [0.0, 30.0, H / 2], [0.0, 0.0, 1.0]]]).repeat(cameras, 1, 1)
    render, _, info = rasterization_metal(
        params["means"], params["quats"], params["scales"], params["opacities"], params["features_dc"], viewmats,
        Ks, W, H, sh_degree=degree, scales_are_log=True, opacities_are_logits=True,
        colors_rest=params["features_rest"],
    )  # fmt: skip
    opts.model.info = info
    target = torch.linspace(0, 1, H * W * 3).view(1, H, W, 3)
    ((render - target) ** 2).mean().backward()


def train_step(params, opts, at: int, degree: int, cameras: int = 1) -> None:
    render_and_backward(params, opts, degree, cameras)
    opts.optimizer_scaler_step_all(SCALER)
    opts.scheduler_step_all(at)


def run(runs, degree: int, steps=range(STEPS)) -> None:
    """Steps every run alike; each compared with the first (exact where both step with the metal kernels)."""
    (ref, ref_opts), rest = runs[0], runs[1:]
    for at in steps:
        for params, opts in runs:
            train_step(params, opts, at, degree)
        for params, opts in rest:
            exact = ref_opts.model.config.backend == opts.model.config.backend == "metal"
            assert_same(ref, ref_opts, params, opts, at, exact=exact)
        for params, opts in runs:
            densify(params, opts, at)
            if at in (2, 13):
                off_screen(params)


def off_screen(params) -> None:
    """Moves a few visible gaussians (moments not 0 by now) off screen: culled with a momentum torch's Adam follows."""
    with torch.no_grad():
        n = len(params["means"])
        params["means"][n // 10 : n // 10 + 8, 0] += 20.0


@pytest.mark.parametrize("degree", [0, 3])
def test_the_fused_step_equals_the_twin_through_densification(degree):
    twin, fused = make("twin"), make("fused")
    run([twin, fused], degree)
    assert len(fused[0]["means"]) != 120  # densification changed the count
    assert fused[1].params_taken == STEPS - 1 and twin[1].params_taken == 0
    assert float(fused[1].last_fused.flag) == 0.0


def test_the_metal_steps_match_torch_adam_with_the_culled_rows_kept():
    run([make("torch"), make("twin"), make("fused")], 3)


def test_two_cameras_mask_by_every_camera():
    """A two-camera render is not stepped in the backward; adam_step reads both cameras' radii."""
    runs = [make("torch"), make("fused")]
    for at in range(3):
        for params, opts in runs:
            train_step(params, opts, at, 3, cameras=2)
        assert_same(*runs[0], *runs[1], at, exact=False)
    assert runs[1][1].params_taken == 0


def _snapshot(params, opts):
    out = {}
    for k in ALL:
        p = params[k]
        state = opts.optimizers[k].state[p]
        out[k] = (p.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone(), state["step"].clone())
    return out


@pytest.mark.parametrize("kind", ["torch", "twin", "fused"])
@pytest.mark.parametrize("visible", [True, False])
def test_a_culled_gaussian_keeps_everything_and_a_visible_one_takes_torch_adams_step(kind, visible):
    """After a few steps (state present), one more: the culled rows' parameters and both moments unchanged (off: moved),
    the visible rows equal to torch.optim.Adam stepping the same tensors with the same gradient."""
    (params, opts), (grads_params, grads_opts) = make(kind, visible), make("twin", visible=False)
    for at in range(3):
        train_step(params, opts, at, 3)
    off_screen(params)
    before = _snapshot(params, opts)
    # the gradient of this step, from a copy of the parameters rendered the same way (the fused run writes none)
    with torch.no_grad():
        for k in ALL:
            grads_params[k].copy_(params[k])
    render_and_backward(grads_params, grads_opts, 3)
    grads = {k: grads_params[k].grad.clone() for k in ALL}
    lrs = {k: opts.optimizers[k].param_groups[0]["lr"] for k in ALL}  # this step's (the scheduler steps after it)
    train_step(params, opts, 3, 3)
    radii = opts.model.info["radii"]
    culled = (radii == 0).all(dim=0)
    assert 0 < int(culled.sum()) < len(culled)
    for k in ALL:
        p0, m0, v0, s0 = before[k]
        state = opts.optimizers[k].state[params[k]]
        ref = torch.nn.Parameter(p0.clone())
        ref_opt = torch.optim.Adam([ref], lr=lrs[k], eps=1e-15)
        ref_opt.state[ref] = {"step": s0.clone(), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
        ref.grad = grads[k]
        ref_opt.step()
        ref_state = ref_opt.state[ref]
        for what, got, old, want in (("param", params[k].detach(), p0, ref.detach()),
                                     ("exp_avg", state["exp_avg"], m0, ref_state["exp_avg"]),
                                     ("exp_avg_sq", state["exp_avg_sq"], v0, ref_state["exp_avg_sq"])):  # fmt: skip
            if visible:
                assert torch.equal(got[culled], old[culled]), f"{kind}: a culled gaussian's {k} {what} changed"
            else:
                torch.testing.assert_close(got[culled], want[culled], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got[~culled], want[~culled], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{kind}: a visible gaussian's {k} {what}: {m}")  # fmt: skip
        assert float(state["step"]) == float(s0) + 1  # the counter is per tensor, as torch's
        if not visible and k == "means":  # off: torch's Adam moves the culled ones by their momentum
            assert not torch.equal(params[k].detach()[culled], p0[culled])


def test_a_planted_bug_in_the_kernels_skip_fails_the_twin_comparison(monkeypatch):
    """project_bwd.metal stepping the culled gaussians although PROJECT_ADAM_VISIBLE is set."""
    plant_in_project_bwd(
        monkeypatch, "const bool step_culled = (flags & PROJECT_ADAM_VISIBLE) == 0;", "const bool step_culled = true;"
    )
    with pytest.raises(AssertionError, match="differs from the twin"):
        run([make("twin"), make("fused")], 3, range(4))


def test_a_planted_bug_in_adam_steps_mask_fails_the_torch_comparison(monkeypatch):
    """adam.metal's adam_step stepping every gaussian although given the radii."""
    src = kernels.stage_source("adam.metal")
    old = "bool visible = cams == 0;"
    assert src.count(old) == 1, "adam.metal changed: update the planted bug"
    planted = runtime.library_for("cpu", src.replace(old, "bool visible = true;"), name="adam.metal")
    monkeypatch.setattr(adam, "_lib", lambda device: planted)
    with pytest.raises(AssertionError, match=r"step \d+, \w+ (param|exp_avg)"):
        run([make("torch"), make("twin")], 3, range(4))
