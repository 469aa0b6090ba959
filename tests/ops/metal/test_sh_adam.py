"""The SH coefficients' Adam step inside the projection's backward (project_bwd.metal PROJECT_SH_ADAM, armed by
engine/optimizers.py GaussianOptimizers.zero_grad_some) against its unfused twin and torch's Adam.

A training loop in nerfstudio's trainer's order (zero_grad, render, backward, optimizer step, scheduler
step) over splatfacto's raw parameters (log-scales, opacity logits, features_dc and features_rest apart) on
a non-square image, with gsplat's densification (state slicing) and an opacity reset between steps:
  * the fused run (SH stepped in the backward from the second step on) equals, bit for bit, the same run
    with arming off (project_bwd writes the SH gradients, adam_step steps them): same float operations;
  * it stays within float tolerance of nerfstudio's Optimizers with torch's Adam;
  * a planted bug (the rest's coefficients with band 0's learning rate) fails the twin comparison;
  * a non-finite coefficient trips the NaN guard's flag, and the guard drops the gaussians the twin's drops;
  * a backward that does not take the step (two cameras) leaves the groups to the step after it, which still
    steps them once;
  * a checkpoint resume across fused steps continues bit for bit.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from nerfstudio.engine.optimizers import Optimizers
from test_adam import LRS, SCALER, TOL, config, densify, gaussians, resumed

from splat_metal_method.engine.optimizers import GaussianOptimizers
from splat_metal_method.ops.metal import kernels, prepare, runtime
from splat_metal_method.ops.metal.fused import rasterization_metal

W, H = 40, 26  # non-square, partial tiles
STEPS = 24  # test_adam's DENSIFY_AT 12, RESET_AT 20 fall inside


@pytest.fixture(autouse=True)
def one_os_thread(monkeypatch):
    """The rasterizer's backward sums gradients with float atomics: one emulator OS thread makes their order,
    and so two runs, the same (the SH step itself has no atomics)."""
    monkeypatch.setenv("SPLAT_METAL_EMU_THREADS", "1")


def make(kind: str):
    params = gaussians()
    model = types.SimpleNamespace(gauss_params=params, config=types.SimpleNamespace(backend="metal"))
    groups = {k: [p] for k, p in params.items()}
    if kind == "torch":
        return params, Optimizers(config(), groups)
    opts = GaussianOptimizers(config(), groups, model)
    opts.fuse_sh = kind == "fused"
    return params, opts


def train_step(params, opts, at: int, degree: int, cameras: int = 1, after_zero_grad=None) -> None:
    """One iteration in nerfstudio's trainer's order, the loss of a metal render of the parameters themselves
    (``after_zero_grad``: called between zero_grad, which arms the step, and the render)."""
    opts.zero_grad_all()
    if after_zero_grad is not None:
        after_zero_grad(params, opts)
    viewmats = torch.eye(4)[None].repeat(cameras, 1, 1)  # [C, 4, 4]
    viewmats[1:, 0, 3] = 0.1
    Ks = torch.tensor([[[30.0, 0.0, W / 2], [0.0, 30.0, H / 2], [0.0, 0.0, 1.0]]]).repeat(cameras, 1, 1)  # [C, 3, 3]
    render, _, _ = rasterization_metal(
        params["means"], params["quats"], params["scales"], params["opacities"], params["features_dc"], viewmats,
        Ks, W, H, sh_degree=degree, scales_are_log=True, opacities_are_logits=True,
        colors_rest=params["features_rest"],
    )  # fmt: skip
    target = torch.linspace(0, 1, H * W * 3).view(1, H, W, 3)
    ((render - target) ** 2).mean().backward()
    opts.optimizer_scaler_step_all(SCALER)
    opts.scheduler_step_all(at)


def assert_same(ref, ref_opts, ours, ours_opts, at, exact: bool) -> None:
    for k in LRS:
        p, q = ref[k], ours[k]
        s, t = ref_opts.optimizers[k].state[p], ours_opts.optimizers[k].state[q]
        for what, a, b in (("param", p, q), ("exp_avg", s["exp_avg"], t["exp_avg"]),
                           ("exp_avg_sq", s["exp_avg_sq"], t["exp_avg_sq"]), ("step", s["step"], t["step"])):  # fmt: skip
            if exact:
                assert torch.equal(a, b), f"step {at}, {k} {what} differs from the twin"
            else:
                tol = TOL if what == "param" else dict(rtol=1e-4, atol=1e-4 * float(a.abs().max()))
                torch.testing.assert_close(b, a, **tol, msg=lambda m: f"step {at}, {k} {what}: {m}")


def run(runs, degree: int, steps=range(STEPS)) -> None:
    """Steps every (params, opts) of ``runs`` alike and compares each with the first (exact where it is a
    GaussianOptimizers twin, within tolerance against torch's Adam)."""
    (ref, ref_opts), rest = runs[0], runs[1:]
    for at in steps:
        for params, opts in runs:
            train_step(params, opts, at, degree)
        for params, opts in rest:
            assert_same(ref, ref_opts, params, opts, at, exact=isinstance(ref_opts, GaussianOptimizers))
        for params, opts in runs:
            densify(params, opts, at)


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
def test_the_fused_sh_step_equals_its_unfused_twin_through_densification(degree):
    twin, fused = make("twin"), make("fused")
    runtime.reset_launch_counts()
    run([twin, fused], degree)
    assert len(fused[0]["means"]) != 120  # densification changed the count
    assert fused[1].sh_taken == STEPS - 1 and twin[1].sh_taken == 0  # armed from the second step on
    assert fused[1].why_not_fused == "" and float(fused[1].last_fused.flag) == 0.0
    assert fused[0]["features_dc"].grad is None and twin[0]["features_dc"].grad is not None
    launches = runtime.launch_counts()  # twin: one prepare per step; fused: one more from the second step
    assert launches["adam_prepare"] == 2 * STEPS + STEPS - 1 and launches["adam_step"] == 2 * STEPS, launches


def test_the_fused_sh_step_matches_torch_adam():
    run([make("torch"), make("fused")], 3)


def plant_in_project_bwd(monkeypatch, old: str, new: str) -> None:
    """The backward compiled with ``old`` (found once in project_bwd.metal) replaced by ``new``, for this test."""
    group = prepare.project_bwd_library(torch.device("cpu"))[1]
    src = kernels.stage_source("project_bwd.metal", extra=(("SPLAT_PROJECT_BWD_GROUP", group),))
    assert src.count(old) == 1, "project_bwd.metal changed: update the planted bug"
    planted = runtime.library_for("cpu", src.replace(old, new), name="project_bwd.metal")
    monkeypatch.setattr(prepare, "project_bwd_library", lambda device: (planted, group))


def test_a_planted_bug_fails_the_twin_comparison(monkeypatch):
    """project_bwd.metal's SH step with the rest's coefficients on band 0's coefficients (learning rate)."""
    plant_in_project_bwd(monkeypatch, "adam_coef, k == 0 ? 0 : 1, b1, b2", "adam_coef, 0, b1, b2")
    with pytest.raises(AssertionError, match="features_rest param differs from the twin"):
        run([make("twin"), make("fused")], 3, range(4))


def test_a_non_finite_coefficient_trips_the_flag():
    twin, fused = make("twin"), make("fused")
    run([twin, fused], 3, range(2))
    for params, _ in (twin, fused):
        with torch.no_grad():
            params["features_rest"][5, 2, 0] = float("inf")
    for params, opts in (twin, fused):
        train_step(params, opts, 2, 3)
    assert fused[1].sh_taken == 2
    assert math.isnan(float(twin[1].last_fused.flag)) and math.isnan(float(fused[1].last_fused.flag))
    assert torch.equal(torch.isfinite(twin[0]["features_rest"]), torch.isfinite(fused[0]["features_rest"]))


def check_untaken_step_is_left_to_the_optimizer(twin, fused, taken: str, param: str) -> None:
    """Steps 0-1 one camera (the backward takes the step: ``fused[1].<taken>`` counts them), step 2 two cameras
    (it does not: ``param`` has a gradient and the optimizer steps it, bit for bit as the twin), steps 3-4 one
    camera again (the backward takes them again)."""
    run([twin, fused], 3, range(2))
    for params, opts in (twin, fused):
        train_step(params, opts, 2, 3, cameras=2)
    assert getattr(fused[1], taken) == 1 and fused[0][param].grad is not None
    assert_same(*twin, *fused, 2, exact=True)
    run([twin, fused], 3, range(3, 5))
    assert getattr(fused[1], taken) == 3


def test_a_backward_that_does_not_take_the_step_leaves_it_to_the_optimizer():
    """Armed, but a two-camera render (a thread no longer holds a gaussian's whole gradient): the backward
    writes the SH gradients and the optimizer step steps them, once; the next one-camera step takes it again."""
    check_untaken_step_is_left_to_the_optimizer(make("twin"), make("fused"), "sh_taken", "features_dc")


def test_resume_through_a_checkpoint_with_the_fused_sh_step_is_bit_identical(tmp_path):
    """test_adam's resume, with the SH coefficients stepped inside the backward: optimizer and scheduler state
    written with torch.save (after steps that took the fused SH step) and loaded into new optimizers continue
    exactly as the uninterrupted run (the resumed one's first step steps them after the backward, then it takes
    the fused step again)."""
    a, a_opts = make("fused")
    for at in range(8):
        train_step(a, a_opts, at, 3)
    assert a_opts.sh_taken == 7
    path = tmp_path / "ckpt.pt"
    b, b_opts = resumed(path, a, a_opts, make("fused"))
    for at in range(8, 14):
        for params, opts in ((a, a_opts), (b, b_opts)):
            train_step(params, opts, at, 3)
        assert_same(*(a, a_opts), *(b, b_opts), at, exact=True)
    assert a_opts.sh_taken == 13 and b_opts.sh_taken == 5


def test_the_nan_guard_drops_the_same_gaussians_as_with_the_twin():
    """The NaN guard (engine/reliability.py, recover mode) reading the fused steps' flag: a non-finite SH
    coefficient stepped inside the backward (no SH gradient left to read) drops the same gaussians as the twin
    (whose guard also sees the gradients), and both runs continue alike with the survivors. The guard trusts the
    flag for what the fused steps stepped: an SH step that never sets it fails this test (checked by hand)."""
    from splat_metal_method.engine.reliability import NonFiniteGuard

    runs = [make("twin"), make("fused")]
    guards = []
    for params, opts in runs:
        n = len(params["means"])
        model = types.SimpleNamespace(gauss_params=params, config=types.SimpleNamespace(backend="metal"), step=0,
                                      strategy_state={"grad2d": torch.zeros(n), "count": torch.ones(n), "radii": None})  # fmt: skip
        guards.append(NonFiniteGuard(model, opts.optimizers, "recover", deferred=False, fused_from=opts))
    run(runs, 3, range(2))
    for (params, opts), guard in zip(runs, guards):
        with torch.no_grad():
            params["features_rest"][5, 2, 0] = float("inf")
        train_step(params, opts, 2, 3)
        guard.check(2)
    (twin, twin_opts), (fused, fused_opts) = runs
    assert fused_opts.sh_taken == 2 and fused["features_dc"].grad is None
    assert guards[0].dropped == guards[1].dropped >= 1 and len(fused["means"]) == len(twin["means"])
    assert "features_rest" in guards[1].reports[0].describe(), guards[1].reports[0].describe()
    for k in LRS:
        assert torch.equal(twin[k], fused[k]) and torch.isfinite(fused[k]).all(), k
    run(runs, 3, range(3, 6))  # both go on alike (exact), the fused one taking the SH step again
    assert fused_opts.sh_taken == 5 and len(guards[1].reports) == 1


def test_moments_apart_from_the_arenas_or_sharing_memory_leave_the_step_to_the_optimizer():
    """project_bwd reaches the moments it steps through the two moment arenas. A moment replaced by a copy between
    the arming and the backward is not the arena's: that backward does not take the step, the step after it
    re-packs (adam.pack_moments) and steps the groups, and the run stays bit for bit its twin's. Two groups'
    exp_avg made one tensor (an alias no refine makes) in both runs after a step: nothing is armed, neither
    kernel steps them, torch's Adam does, in both runs alike."""

    def apart(params, opts):
        state = opts.optimizers["features_rest"].state[params["features_rest"]]
        state["exp_avg"] = state["exp_avg"].clone()

    def shared(params, opts):
        opts.optimizers["scales"].state[params["scales"]]["exp_avg"] = opts.optimizers["means"].state[
            params["means"]]["exp_avg"]  # fmt: skip

    twin, fused = make("twin"), make("fused")
    for at in range(6):
        for params, opts in (twin, fused):
            train_step(params, opts, at, 3, after_zero_grad=apart if at == 2 else None)
            if at == 3:  # before the next arming
                shared(params, opts)
        assert_same(*twin, *fused, at, exact=True)
        if at == 2:
            assert fused[1].sh_taken == 1 and fused[1].why_not_fused == "" and fused[1].last_fused is not None
        if at >= 4:
            assert "share memory" in fused[1].why_not_fused and "share memory" in twin[1].why_not_fused
            assert fused[1].last_fused is None
    assert fused[1].sh_taken == 2  # steps 1 and 3: not 2 (apart), nor 4 and 5 (shared)
