"""Every gaussian parameter's Adam step inside the projection's backward (project_bwd.metal PROJECT_SH_ADAM with
PROJECT_ADAM_MEANS / _QUATS / _SCALES / _OPACITIES, armed by engine/optimizers.py GaussianOptimizers.zero_grad_some
for the groups the model's render_only_groups names) against its unfused twin and torch's Adam.

test_sh_adam's training loop (nerfstudio's trainer's order over splatfacto's raw parameters on a non-square image,
gsplat's densification and an opacity reset between steps), with means, quats, scales and opacities stepped in the
backward too:
  * the fused run equals, bit for bit, the same run with nothing stepped in the backward (project_bwd writes every
    gradient, adam_step steps them) and the run with the SH coefficients alone stepped there, at SH degrees 0-3;
  * a model that keeps one group out (scale regularisation) has it stepped after the backward, the rest in it;
  * it stays within float tolerance of nerfstudio's Optimizers with torch's Adam;
  * a planted bug (the quats with the means' learning rate) fails the twin comparison;
  * a non-finite mean trips the NaN guard's flag, and the guard drops the gaussians the twin's drops;
  * a backward that does not take the step (two cameras) leaves every group to the step after it;
  * a checkpoint resume across fused steps continues bit for bit.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from nerfstudio.engine.optimizers import Optimizers
from test_adam import LRS, config, gaussians, resumed
from test_sh_adam import (
    STEPS,
    assert_same,
    check_untaken_step_is_left_to_the_optimizer,
    plant_in_project_bwd,
    run,
    train_step,
)

from splat_metal_method.engine.optimizers import GaussianOptimizers
from splat_metal_method.ops.metal import runtime

ALL = tuple(LRS)


@pytest.fixture(autouse=True)
def one_os_thread(monkeypatch):
    """The rasterizer's backward sums gradients with float atomics: one emulator OS thread makes their order,
    and so two runs, the same (the Adam steps themselves have no atomics)."""
    monkeypatch.setenv("SPLAT_METAL_EMU_THREADS", "1")


def make(kind: str, render_only=ALL):
    """``kind``: "torch" (nerfstudio's Optimizers), "twin" (nothing stepped in the backward), "sh" (the SH
    coefficients there, the rest after it) or "fused" (every group ``render_only`` names there)."""
    params = gaussians()
    model = types.SimpleNamespace(gauss_params=params, config=types.SimpleNamespace(backend="metal"),
                                  render_only_groups=lambda: render_only)  # fmt: skip
    groups = {k: [p] for k, p in params.items()}
    if kind == "torch":
        return params, Optimizers(config(), groups)
    opts = GaussianOptimizers(config(), groups, model)
    opts.fuse_sh = kind in ("sh", "fused")
    opts.fuse_params = kind == "fused"
    return params, opts


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
def test_the_fused_step_equals_its_unfused_twins_through_densification(degree):
    twin, sh, fused = make("twin"), make("sh"), make("fused")
    runtime.reset_launch_counts()
    run([twin, sh, fused], degree)
    assert len(fused[0]["means"]) != 120  # densification changed the count
    assert fused[1].params_taken == fused[1].sh_taken == STEPS - 1  # armed from the second step on
    assert sh[1].params_taken == 0 and sh[1].sh_taken == STEPS - 1 and twin[1].sh_taken == 0
    assert float(fused[1].last_fused.flag) == 0.0
    assert all(fused[0][k].grad is None for k in ALL)  # no gradient tensor for any of them
    assert twin[0]["means"].grad is not None and sh[0]["means"].grad is not None
    # twin: prepare + step each step; sh: one more prepare from the second step; fused: the first step's prepare
    # and step, then only the backward's prepare (adam_step has nothing left to step)
    launches = runtime.launch_counts()
    assert launches["adam_prepare"] == STEPS + (2 * STEPS - 1) + STEPS, launches
    assert launches["adam_step"] == STEPS + STEPS + 1, launches


def test_a_group_the_model_keeps_out_is_stepped_after_the_backward():
    """render_only_groups without the scales (splatfacto's scale regularisation): the scales keep their gradient and
    adam_step, means, quats and opacities take adam_coef slots 2, 3 and 4 in the backward; same bits as the twin."""
    twin, fused = make("twin"), make("fused", tuple(k for k in ALL if k != "scales"))
    run([twin, fused], 3, range(14))
    assert fused[1].params_taken == 13
    assert fused[0]["scales"].grad is not None and fused[0]["quats"].grad is None


def test_the_fused_step_matches_torch_adam():
    run([make("torch"), make("fused")], 3)


def test_a_planted_bug_fails_the_twin_comparison(monkeypatch):
    """project_bwd.metal's step of the quats (a visible gaussian's) with the means' adam_coef slot."""
    old = "v_quat, v_quats, avg_sq_quats, 4, g, adam_coef, slot_quats"
    plant_in_project_bwd(monkeypatch, old, old.replace("slot_quats", "slot_means"))
    with pytest.raises(AssertionError, match="quats param differs from the twin"):
        run([make("twin"), make("fused")], 3, range(4))


def test_a_backward_that_does_not_take_the_step_leaves_it_to_the_optimizer():
    """Armed, but a two-camera render: the backward writes every gradient and the optimizer step steps every
    group, once; the next one-camera step takes them all in the backward again."""
    check_untaken_step_is_left_to_the_optimizer(make("twin"), make("fused"), "params_taken", "means")


def test_resume_through_a_checkpoint_with_the_fused_step_is_bit_identical(tmp_path):
    """Optimizer and scheduler state written with torch.save after steps taken in the backward and loaded into new
    optimizers continue exactly as the uninterrupted run (the resumed one's first step steps after the backward,
    then it takes the step in the backward again)."""
    a, a_opts = make("fused")
    for at in range(8):
        train_step(a, a_opts, at, 3)
    assert a_opts.params_taken == 7
    b, b_opts = resumed(tmp_path / "ckpt.pt", a, a_opts, make("fused"))
    for at in range(8, 14):
        for params, opts in ((a, a_opts), (b, b_opts)):
            train_step(params, opts, at, 3)
        assert_same(*(a, a_opts), *(b, b_opts), at, exact=True)
    assert a_opts.params_taken == 13 and b_opts.params_taken == 5


def test_a_non_finite_mean_trips_the_flag_and_the_guard_drops_what_the_twins_does():
    """A mean set to Inf (its gaussian is culled: gradient 0, but the stepped mean stays Inf) sets the fused step's
    flag, with no gradient left to read; the NaN guard (engine/reliability.py, recover mode) drops the same
    gaussians as the twin's and both runs go on alike."""
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
            params["means"][7, 1] = float("inf")
        train_step(params, opts, 2, 3)
        assert math.isnan(float(opts.last_fused.flag))
        guard.check(2)
    (twin, twin_opts), (fused, fused_opts) = runs
    assert fused_opts.params_taken == 2 and fused["means"].grad is None
    assert guards[0].dropped == guards[1].dropped >= 1 and len(fused["means"]) == len(twin["means"])
    assert "means" in guards[1].reports[0].describe(), guards[1].reports[0].describe()
    for k in LRS:
        assert torch.equal(twin[k], fused[k]) and torch.isfinite(fused[k]).all(), k
    run(runs, 3, range(3, 6))
    assert fused_opts.params_taken == 5 and len(guards[1].reports) == 1
