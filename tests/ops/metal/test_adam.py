"""The fused Adam step (ops/metal/adam.metal through engine/optimizers.py) against torch.optim.Adam.

Two copies of the same gaussians, one stepped by nerfstudio's Optimizers with torch's Adam (the config
splat-metal trains with: fused, eps 1e-15, an exponential-decay scheduler on the means), the other by
GaussianOptimizers (the kernels under the emulator), take the same gradients: those of a render of the
first copy with the metal backend on a non-square image (gaussians off screen get zero gradients) for
STEPS steps, with gsplat's densification (duplicate, split, remove: they slice the optimizer state)
and an opacity reset between. Parameters and optimizer state agree within float tolerance at every
step; a resume through torch.save/torch.load of the optimizers continues bit for bit; a planted bug in
the kernel's bias correction fails the comparison.
"""

from __future__ import annotations

import math
import types
from typing import Optional

import pytest
import torch
from gsplat.strategy import ops as gs_ops
from nerfstudio.engine.optimizers import Optimizers
from nerfstudio.engine.schedulers import ExponentialDecaySchedulerConfig

from splat_metal_method.engine.optimizers import GaussianOptimizers
from splat_metal_method.method.configs import FusedAdamOptimizerConfig
from splat_metal_method.method.mcmc import routed_ops
from splat_metal_method.ops import rasterization
from splat_metal_method.ops.metal import adam, kernels, runtime

N, W, H = 120, 40, 26  # non-square, partial tiles
STEPS, DENSIFY_AT, RESET_AT = 32, 12, 20
LRS = {"means": 1.6e-4, "scales": 0.005, "quats": 0.001, "opacities": 0.05, "features_dc": 0.0025,
       "features_rest": 0.0025 / 20}  # fmt: skip
TOL = dict(rtol=1e-5, atol=2e-6)
SCALER = torch.amp.GradScaler("cpu", enabled=False)  # as nerfstudio's without mixed precision


def gaussians(seed: int = 0) -> torch.nn.ParameterDict:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(N, 3, generator=g) * torch.tensor([3.0, 2.0, 2.0]) - torch.tensor([1.5, 1.0, -3.0])
    x[: N // 10, 0] += 20.0  # off screen: zero gradients (Adam's 0 / (0 + eps) rows)
    return torch.nn.ParameterDict({
        "means": x,  # [N, 3]
        "scales": torch.log(0.05 + 0.1 * torch.rand(N, 3, generator=g)),  # [N, 3]
        "quats": torch.randn(N, 4, generator=g),  # [N, 4]
        "opacities": torch.randn(N, 1, generator=g),  # [N, 1]
        "features_dc": torch.randn(N, 3, generator=g),  # [N, 3]
        "features_rest": 0.1 * torch.randn(N, 15, 3, generator=g),  # [N, 15, 3]
    })  # fmt: skip


def config() -> dict:
    out = {k: {"optimizer": FusedAdamOptimizerConfig(lr=lr, eps=1e-15), "scheduler": None} for k, lr in LRS.items()}
    out["means"]["scheduler"] = ExponentialDecaySchedulerConfig(lr_final=1.6e-6, max_steps=STEPS)
    return out


def make(fused: bool):
    params = gaussians()
    model = types.SimpleNamespace(gauss_params=params, config=types.SimpleNamespace(backend="metal"))
    groups = {k: [p] for k, p in params.items()}
    opts = GaussianOptimizers(config(), groups, model) if fused else Optimizers(config(), groups)
    return params, opts


def render_grads(params) -> dict:
    """Gradients of a photometric loss of one metal render (non-square) of ``params``."""
    viewmat = torch.eye(4)[None]  # [1, 4, 4]
    K = torch.tensor([[[30.0, 0.0, W / 2], [0.0, 30.0, H / 2], [0.0, 0.0, 1.0]]])  # [1, 3, 3]
    leaves = {k: p.detach().clone().requires_grad_(True) for k, p in params.items()}
    colors = torch.cat([leaves["features_dc"][:, None], leaves["features_rest"]], 1)  # [N, 16, 3]
    render, _, _ = rasterization(
        leaves["means"], leaves["quats"], torch.exp(leaves["scales"]), torch.sigmoid(leaves["opacities"][:, 0]),
        colors, viewmat, K, W, H, sh_degree=3, backend="metal",
    )  # fmt: skip
    target = torch.linspace(0, 1, H * W * 3).view(1, H, W, 3)
    ((render - target) ** 2).mean().backward()
    return {k: t.grad for k, t in leaves.items()}


def step(params, opts, grads, at: int) -> None:
    for k, p in params.items():
        p.grad = grads[k].clone()
    opts.optimizer_scaler_step_all(SCALER)
    opts.scheduler_step_all(at)


def densify(params, opts, at: int) -> None:
    """gsplat's DefaultStrategy operations, as its refine step calls them (same random draws on both copies)."""
    optimizers, state = opts.optimizers, {}
    if at == DENSIFY_AT:
        mask = torch.arange(len(params["means"])) % 7 == 0
        gs_ops.duplicate(params, optimizers, state, mask)
        torch.manual_seed(at)
        mask = torch.arange(len(params["means"])) % 5 == 1
        gs_ops.split(params, optimizers, state, mask)
        mask = torch.arange(len(params["means"])) % 9 == 4
        gs_ops.remove(params, optimizers, state, mask)
    if at == RESET_AT:
        gs_ops.reset_opa(params, optimizers, state, value=0.02)


def resumed(path, params, opts, fresh):
    """``fresh`` (params, optimizers) with the state of ``params``/``opts`` after a save to ``path`` and a load,
    as a checkpoint resume does."""
    torch.save({"params": {k: p.detach() for k, p in params.items()},
                "optimizers": {k: o.state_dict() for k, o in opts.optimizers.items()},
                "schedulers": {k: s.state_dict() for k, s in opts.schedulers.items()}}, path)  # fmt: skip
    loaded = torch.load(path, weights_only=False)
    new, new_opts = fresh
    with torch.no_grad():
        for k, p in new.items():
            p.data = loaded["params"][k].clone()
    new_opts.load_optimizers(loaded["optimizers"])
    new_opts.load_schedulers(loaded["schedulers"])
    return new, new_opts


def assert_same(ref, ref_opts, ours, ours_opts, at, exact=False) -> None:
    for k in LRS:
        p, q = ref[k], ours[k]
        s, t = ref_opts.optimizers[k].state[p], ours_opts.optimizers[k].state[q]
        assert ours_opts.optimizers[k].param_groups[0]["params"][0] is q
        for what, a, b in (("param", p, q), ("exp_avg", s["exp_avg"], t["exp_avg"]),
                           ("exp_avg_sq", s["exp_avg_sq"], t["exp_avg_sq"]), ("step", s["step"], t["step"])):  # fmt: skip
            if exact:
                assert torch.equal(a, b), (at, k, what)
            else:  # moments: within 1e-5 of the tensor's largest (they are ~grad and ~grad^2 in size)
                tol = TOL if what == "param" else dict(rtol=1e-5, atol=1e-5 * float(a.abs().max()))
                torch.testing.assert_close(b, a, **tol, msg=lambda m: f"step {at}, {k} {what}: {m}")


def run(ref, ref_opts, ours, ours_opts, steps) -> None:
    for at in steps:
        grads = render_grads(ref)
        step(ref, ref_opts, grads, at)
        step(ours, ours_opts, grads, at)
        assert ours_opts.why_not_fused == "" and ours_opts.last_fused is not None
        assert float(ours_opts.last_fused.flag) == 0.0
        assert_same(ref, ref_opts, ours, ours_opts, at)
        densify(ref, ref_opts, at)
        densify(ours, ours_opts, at)


def test_fused_adam_matches_torch_adam_through_densification():
    ref, ref_opts = make(fused=False)
    ours, ours_opts = make(fused=True)
    runtime.reset_launch_counts()
    run(ref, ref_opts, ours, ours_opts, range(STEPS))
    assert len(ours["means"]) != N  # densification changed the count
    launches = runtime.launch_counts()
    assert launches["adam_prepare"] == launches["adam_step"] == STEPS, launches
    # the schedulers drove the learning rate the kernel read
    assert ours_opts.optimizers["means"].param_groups[0]["lr"] == ref_opts.optimizers["means"].param_groups[0]["lr"]
    assert ours_opts.optimizers["means"].param_groups[0]["lr"] < LRS["means"] / 10


def test_resume_through_a_checkpoint_is_bit_identical(tmp_path):
    """Optimizer and scheduler state written with torch.save and loaded into new optimizers (as a resume
    does) continue exactly as the uninterrupted run."""
    a, a_opts = make(fused=True)
    for at in range(8):
        step(a, a_opts, render_grads(a), at)
    path = tmp_path / "ckpt.pt"
    b, b_opts = resumed(path, a, a_opts, make(fused=True))
    for at in range(8, 14):
        grads = render_grads(a)
        step(a, a_opts, grads, at)
        step(b, b_opts, grads, at)
        assert b_opts.why_not_fused == ""
        assert_same(a, a_opts, b, b_opts, at, exact=True)


def test_nan_gradient_sets_the_flag_and_propagates_as_torch_adam():
    ref, ref_opts = make(fused=False)
    ours, ours_opts = make(fused=True)
    grads = render_grads(ref)
    grads["scales"][[3, 50]] = float("nan")
    grads["features_rest"][7, 4, 1] = float("inf")
    step(ref, ref_opts, grads, 0)
    step(ours, ours_opts, grads, 0)
    assert math.isnan(float(ours_opts.last_fused.flag))
    for k in LRS:
        assert torch.equal(torch.isfinite(ref[k]), torch.isfinite(ours[k])), k
    # a finite step after it clears the flag (the other of the two buffers)
    ours2, ours2_opts = make(fused=True)
    step(ours2, ours2_opts, render_grads(ours2), 0)
    assert float(ours2_opts.last_fused.flag) == 0.0


def test_planted_bias_correction_bug_fails_the_comparison(monkeypatch):
    """The comparison can fail: adam.metal with sqrt(1 - b2^t) replaced by 1 - b2^t."""
    source = kernels.stage_source("adam.metal")
    planted = source.replace("precise::sqrt(bias_correction2)", "bias_correction2")
    assert planted != source
    lib = runtime.library_for(torch.device("cpu"), planted, name="adam_planted.metal")
    monkeypatch.setattr(adam, "_lib", lambda device: lib)
    ref, ref_opts = make(fused=False)
    ours, ours_opts = make(fused=True)
    with pytest.raises(AssertionError, match="step 0"):
        run(ref, ref_opts, ours, ours_opts, range(3))


@pytest.mark.parametrize("change", ["max_norm", "amsgrad", "betas", "grad_none", "backend"])
def test_what_the_kernel_does_not_do_steps_with_torch(change):
    """Each case falls back to torch's Adam for every gaussian group, with the reason, and still steps."""
    params, opts = make(fused=True)
    grads = render_grads(params)
    if change == "max_norm":
        opts.config["quats"]["optimizer"].max_norm = 1.0
    elif change == "amsgrad":
        opts.optimizers["scales"].param_groups[0]["amsgrad"] = True
    elif change == "betas":
        opts.optimizers["opacities"].param_groups[0]["betas"] = (0.8, 0.999)
    elif change == "backend":
        opts.model.config.backend = "reference"
    before = {k: p.detach().clone() for k, p in params.items()}
    for k, p in params.items():
        p.grad = None if (change == "grad_none" and k == "features_rest") else grads[k].clone()
    runtime.reset_launch_counts()
    opts.optimizer_scaler_step_all(SCALER)
    assert opts.why_not_fused and opts.last_fused is None, change
    assert "adam_step" not in runtime.launch_counts()
    moved = [k for k in LRS if not torch.equal(params[k], before[k])]
    assert moved == [k for k in LRS if not (change == "grad_none" and k == "features_rest")], (change, moved)


def test_the_self_check_verifies_adam_and_a_failed_check_falls_back(monkeypatch):
    """kernel_checks.adam_checks (run by the doctor and the self-check) passes, catches the planted bug, and
    once the stage "adam" failed (the self-check's verdict on a GPU) the gaussians step with torch's Adam."""
    from splat_metal_method.ops import stage_fallback
    from splat_metal_method.verify import kernel_checks

    (check,) = kernel_checks.adam_checks(torch.device("cpu"))
    assert check.ok and stage_fallback.stage_of(check.stage) == "adam", check
    planted = kernels.stage_source("adam.metal").replace("precise::sqrt(bias_correction2)", "bias_correction2")
    lib = runtime.library_for(torch.device("cpu"), planted, name="adam_planted.metal")
    monkeypatch.setattr(adam, "_lib", lambda device: lib)
    (check,) = kernel_checks.adam_checks(torch.device("cpu"))
    assert not check.ok, check
    monkeypatch.undo()
    params, opts = make(fused=True)
    grads = render_grads(params)
    with stage_fallback.also_failed(["adam"]):
        step(params, opts, grads, 0)
        assert "self-check" in opts.why_not_fused and opts.last_fused is None
    step(params, opts, grads, 1)
    assert opts.why_not_fused == ""


def arenas(params, opts, keep: Optional[list] = None) -> tuple:
    """(the exp_avg arena's address, the exp_avg_sq arena's): every gaussian group's moment a view of each. ``keep``
    holds on to the arenas, so that a later one cannot be allocated at a freed one's address (which would look
    like no re-pack)."""
    out = []
    for key in ("exp_avg", "exp_avg_sq"):
        moments = [opts.optimizers[k].state[p][key] for k, p in params.items()]
        found = adam.arena(moments)
        assert found is not None and adam.overlapping(moments) is None, key
        out.append(found[0].data_ptr())
        if keep is not None:
            keep.append(found[0])
    return tuple(out)


def test_the_moments_are_re_packed_only_where_a_refine_or_a_load_replaced_them(tmp_path):
    """The moments live in two arenas (adam_step binds 2 buffers, not 12) from the first fused step on. A steady step
    keeps them where they are; a prune, a densification (gsplat's remove/duplicate/split: new tensors) or a moment
    replaced by hand is re-packed once at the next step; MCMC's relocation (in place) and a checkpoint's load (views
    of its loaded storage) need none. Through all of it the run matches torch's Adam; after the load exactly the
    uninterrupted run."""
    ref, ref_opts = make(fused=False)
    ours, ours_opts = make(fused=True)
    seen, kept = [], []
    for at in range(10):
        grads = render_grads(ref)
        step(ref, ref_opts, grads, at)
        step(ours, ours_opts, grads, at)
        assert ours_opts.why_not_fused == "" and ours_opts.last_fused is not None, ours_opts.why_not_fused
        assert_same(ref, ref_opts, ours, ours_opts, at)
        seen.append(arenas(ours, ours_opts, kept))
        for params, opts in ((ref, ref_opts), (ours, ours_opts)):
            if at == 2:
                gs_ops.remove(params, opts.optimizers, {}, torch.arange(len(params["means"])) % 9 == 4)
            if at == 4:
                torch.manual_seed(at)
                gs_ops.duplicate(params, opts.optimizers, {}, torch.arange(len(params["means"])) % 7 == 0)
                gs_ops.split(params, opts.optimizers, {}, torch.arange(len(params["means"])) % 5 == 1)
            if at == 6:
                binoms = torch.tensor([[math.comb(n, k) for k in range(10)] for n in range(10)], dtype=torch.float32)
                torch.manual_seed(at)
                with routed_ops("reference"):  # gsplat's relocation with its CUDA-only op routed to ours
                    gs_ops.relocate(params, opts.optimizers, {}, torch.arange(len(params["means"])) % 11 == 3, binoms)
        if at == 7:
            state = ours_opts.optimizers["quats"].state[ours["quats"]]
            state["exp_avg"] = state["exp_avg"].clone()  # a moment apart from its arena: re-packed, same values
    moved = [at for at in range(1, 10) if seen[at] != seen[at - 1]]
    assert moved == [3, 5, 8], (moved, seen)
    b, b_opts = resumed(tmp_path / "ckpt.pt", ours, ours_opts, make(fused=True))
    loaded = arenas(b, b_opts)
    for at in range(10, 12):
        grads = render_grads(ours)
        step(ours, ours_opts, grads, at)
        step(b, b_opts, grads, at)
        assert b_opts.why_not_fused == "" and arenas(b, b_opts) == loaded
        assert_same(ours, ours_opts, b, b_opts, at, exact=True)


def test_moments_that_share_memory_step_with_torch_as_torch_would():
    """A planted alias (two groups' exp_avg the same tensor, as no refine makes them) is not re-packed apart (that
    would change what the run computes): the gaussians step with torch's Adam, equal to torch's own run with the
    same alias bit for bit. fused_adam itself refuses moments apart from an arena, or sharing memory."""
    ref, ref_opts = make(fused=False)
    ours, ours_opts = make(fused=True)
    grads = render_grads(ref)
    step(ref, ref_opts, grads, 0)
    step(ours, ours_opts, grads, 0)
    with torch.no_grad():  # the same start for both (the kernel's first step is torch's within rounding)
        for k in LRS:
            ref[k].copy_(ours[k])
            for key, t in ours_opts.optimizers[k].state[ours[k]].items():
                ref_opts.optimizers[k].state[ref[k]][key].copy_(t)
    for params, opts in ((ref, ref_opts), (ours, ours_opts)):
        opts.optimizers["scales"].state[params["scales"]]["exp_avg"] = opts.optimizers["means"].state[
            params["means"]]["exp_avg"]  # fmt: skip
    runtime.reset_launch_counts()
    step(ref, ref_opts, grads, 1)
    step(ours, ours_opts, grads, 1)
    assert "share memory" in ours_opts.why_not_fused and ours_opts.last_fused is None
    assert "adam_step" not in runtime.launch_counts()
    for k in LRS:
        s, t = ref_opts.optimizers[k].state[ref[k]], ours_opts.optimizers[k].state[ours[k]]
        assert torch.equal(ref[k], ours[k]) and torch.equal(s["exp_avg"], t["exp_avg"]), k
    params = [torch.zeros(4, 3), torch.ones(4, 3)]
    grads = [torch.ones(4, 3), torch.ones(4, 3)]
    steps = [torch.zeros(()), torch.zeros(())]
    avgs, avg_sqs = adam.zero_moments(params)
    for bad, match in (([avgs[0], torch.zeros(4, 3)], "not views of the two moment arenas"),
                       ([avgs[0], avgs[0]], "exp_avg 0 and exp_avg 1 share memory"),
                       ([avgs[0], params[1]], "parameter 1 and exp_avg 1 share memory")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            adam.fused_adam(params, grads, bad, avg_sqs, steps, [1e-3] * 2, [1e-15] * 2, 0.9, 0.999)
    assert torch.equal(params[0], torch.zeros(4, 3)) and not avgs[0].any()  # nothing stepped
