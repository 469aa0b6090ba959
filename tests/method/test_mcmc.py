"""splat-metal-mcmc (splat_metal_method/method/mcmc.py): gsplat's own MCMCStrategy running on CPU tensors
through our ops, its cap, its noise, and the model built around it in a real nerfstudio pipeline."""

from __future__ import annotations

import pytest
import torch
from gsplat.strategy import MCMCStrategy

from splat_metal_method.engine import memory
from splat_metal_method.method.mcmc import SplatMetalMCMCStrategy, resolve_cap_max, routed_ops
from splat_metal_method.verify import self_check

SH_REST = 15


def gaussians(n: int, seed: int = 0):
    """splatfacto-shaped parameters ([N,1] opacities) with one Adam per parameter, as nerfstudio's."""
    g = torch.Generator().manual_seed(seed)
    params = torch.nn.ParameterDict({
        "means": torch.randn(n, 3, generator=g),
        "scales": torch.log(torch.rand(n, 3, generator=g) * 0.1 + 0.01),
        "quats": torch.randn(n, 4, generator=g),
        "features_dc": torch.rand(n, 3, generator=g),
        "features_rest": torch.zeros(n, SH_REST, 3),
        "opacities": torch.logit(torch.rand(n, 1, generator=g) * 0.8 + 0.1),
    })  # fmt: skip
    optimizers = {k: torch.optim.Adam([p], lr=1e-3, eps=1e-15) for k, p in params.items()}
    return params, optimizers


def adam_step(params, optimizers):
    """A real optimizer step (Adam state for every row) that fades the opacities."""
    for opt in optimizers.values():
        opt.zero_grad()
    loss = sum((p**2).mean() for p in params.values()) + torch.sigmoid(params["opacities"]).sum()
    loss.backward()
    for opt in optimizers.values():
        opt.step()


def kill(params, rows):
    with torch.no_grad():
        params["opacities"][rows] = torch.logit(torch.tensor(0.001))


def test_gsplat_ops_are_cuda_only_and_routed_only_inside_the_context():
    import gsplat.strategy.ops as gsplat_ops

    original = gsplat_ops.compute_relocation, gsplat_ops.quat_scale_to_covar_preci
    with routed_ops():
        assert gsplat_ops.compute_relocation.func.__module__ == "splat_metal_method.ops.mcmc"
        assert gsplat_ops.quat_scale_to_covar_preci.func.__module__ == "splat_metal_method.ops.mcmc"
    assert (gsplat_ops.compute_relocation, gsplat_ops.quat_scale_to_covar_preci) == original
    params, optimizers = gaussians(20)
    # Stock gsplat cannot run this on CPU tensors: the reason this method exists.
    with pytest.raises(Exception):
        MCMCStrategy().step_post_backward(params, optimizers, MCMCStrategy().initialize_state(), 1, {}, lr=1e-4)


def test_cap_is_never_exceeded_across_relocation_and_growth():
    cap, n0 = 130, 100
    params, optimizers = gaussians(n0)
    strategy = SplatMetalMCMCStrategy(cap_max=cap, refine_start_iter=0, refine_every=2, refine_stop_iter=40)
    state = strategy.initialize_state()
    counts, relocated = [], 0
    for step in range(1, 40):
        adam_step(params, optimizers)
        if step % 4 == 0:
            kill(params, torch.arange(step % 7, len(params["means"]), 9))  # a few dead ones each time
        dead_before = int((torch.sigmoid(params["opacities"]) <= strategy.min_opacity).sum())
        strategy.step_post_backward(params, optimizers, state, step, {}, lr=1e-4)
        n = len(params["means"])
        counts.append(n)
        assert n <= cap, f"step {step}: {n} gaussians > cap {cap}"
        assert all(len(p) == n for p in params.values())
        for name, opt in optimizers.items():
            assert opt.param_groups[0]["params"][0] is params[name]  # the optimizer steps the new tensors
            assert opt.state[params[name]]["exp_avg"].shape == params[name].shape
        if step % 2 == 0 and dead_before:
            relocated += dead_before
            assert not bool((torch.sigmoid(params["opacities"]) < strategy.min_opacity * 0.999).any())
    assert counts[0] == n0 and max(counts) == cap, counts  # grew 5% per refine step, up to the cap
    assert counts == sorted(counts)  # relocation keeps the count; nothing is lost
    assert relocated > 10
    assert [kind for _, kind in strategy.pop_events()] == ["refine"] * 19  # steps 2, 4, ..., 38


def test_relocation_zeroes_the_adam_state_of_the_moved_and_sampled_gaussians():
    params, optimizers = gaussians(50)
    adam_step(params, optimizers)
    dead = torch.tensor([3, 17, 40])
    kill(params, dead)
    strategy = SplatMetalMCMCStrategy(cap_max=50, refine_start_iter=0, refine_every=1)
    before = params["means"].detach().clone()
    adam_before = optimizers["scales"].state[params["scales"]]["exp_avg"].clone()
    strategy.step_post_backward(params, optimizers, strategy.initialize_state(), 1, {}, lr=0.0)  # lr 0: no noise
    moved = (params["means"] != before).any(dim=-1)
    assert moved[dead].all() and int(moved.sum()) == 3  # the dead ones were teleported onto live ones
    targets = set()
    for d in dead.tolist():
        target = int(((params["means"][d] == before).all(dim=-1)).nonzero()[0])  # the live one it copies
        targets.add(target)
        assert float(torch.sigmoid(params["opacities"][d])) > strategy.min_opacity
        torch.testing.assert_close(params["opacities"][d], params["opacities"][target])
        torch.testing.assert_close(params["scales"][d], params["scales"][target])
        for name, opt in optimizers.items():
            assert not opt.state[params[name]]["exp_avg"][target].any()
    others = [i for i in range(50) if i not in targets and i not in dead.tolist()]
    torch.testing.assert_close(optimizers["scales"].state[params["scales"]]["exp_avg"][others], adam_before[others])


def test_noise_is_the_covariance_times_gaussian_noise_scaled_by_lr_and_opacity():
    """inject_noise_to_position through our covariance, checked against its formula (gsplat 1.4):
    means += Sigma @ z * sigmoid(100 (1 - o - 0.995)) * lr * noise_lr."""
    params, optimizers = gaussians(40)
    with torch.no_grad():
        params["opacities"][:20] = torch.logit(torch.tensor(0.002))  # faint: full noise
    strategy = SplatMetalMCMCStrategy(refine_start_iter=100, noise_lr=5e5)  # no refine at step 1
    before = params["means"].detach().clone()
    torch.manual_seed(7)
    strategy.step_post_backward(params, optimizers, strategy.initialize_state(), 1, {}, lr=1.6e-4)
    torch.manual_seed(7)
    z = torch.randn(40, 3)
    o = torch.sigmoid(params["opacities"].flatten())
    q = torch.nn.functional.normalize(params["quats"].detach(), dim=-1)
    w, x, y, zq = q.unbind(-1)
    R = torch.stack([
        1 - 2 * (y * y + zq * zq), 2 * (x * y - w * zq), 2 * (x * zq + w * y),
        2 * (x * y + w * zq), 1 - 2 * (x * x + zq * zq), 2 * (y * zq - w * x),
        2 * (x * zq - w * y), 2 * (y * zq + w * x), 1 - 2 * (x * x + y * y),
    ], dim=-1).reshape(40, 3, 3)  # fmt: skip
    cov = R @ torch.diag_embed(torch.exp(params["scales"].detach()) ** 2) @ R.transpose(1, 2)
    gate = 1 / (1 + torch.exp(-100 * ((1 - o) - 0.995)))
    want = before + torch.einsum("nij,nj->ni", cov, z * gate[:, None] * 1.6e-4 * 5e5)
    torch.testing.assert_close(params["means"].detach(), want, rtol=1e-5, atol=1e-7)
    step = (params["means"] - before).norm(dim=-1)
    assert step[:20].min() > 100 * step[20:].max()  # opaque gaussians barely move


def test_all_dead_is_reported_not_a_crash():
    params, optimizers = gaussians(10)
    kill(params, torch.arange(10))
    said = []
    strategy = SplatMetalMCMCStrategy(cap_max=10, refine_start_iter=0, refine_every=1, on_message=said.append)
    strategy.step_post_backward(params, optimizers, strategy.initialize_state(), 1, {}, lr=1e-4)
    assert len(params["means"]) == 10 and "nothing to relocate to" in said[0]


def test_cap_max_resolution(monkeypatch):
    monkeypatch.setattr(memory, "device_memory", lambda device: 8 * memory.GiB)
    cap, source = resolve_cap_max(-1, "cpu")
    assert cap == int(8 * memory.GiB * memory.GAUSSIAN_MEMORY_FRACTION) // memory.BYTES_PER_GAUSSIAN
    assert "8.0 GiB" in source
    assert resolve_cap_max(5000, "cpu") == (5000, "set in the config")
    monkeypatch.setattr(memory, "device_memory", lambda device: None)
    assert resolve_cap_max(-1, "cpu")[0] == 1_000_000
    for bad in (0, -2):
        with pytest.raises(ValueError, match="cap-max must be a positive number"):
            resolve_cap_max(bad, "cpu")


# ------------------------------------------------------------------------------------------------
# The model in a real nerfstudio pipeline (in process, CPU tensors)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_scene(tmp_path_factory):
    from splat_metal_method.data import demo_scene

    out = tmp_path_factory.mktemp("mcmc") / "scene"
    demo_scene.generate(out, width=40, height=24, views=10, seed=0)  # non-square, 1,500 seed points
    return out


def mcmc_pipeline(scene, steps, cap_max, backend="auto", **model_options):
    from mcmc_runs import method_config
    from pipelines import setup_pipeline

    cfg = method_config("mcmc", scene, steps=steps, warmup=2, refine_every=3, cap_max=cap_max, backend=backend)
    for name, value in model_options.items():
        setattr(cfg.pipeline.model, name, value)
    return setup_pipeline(cfg, "cpu", seed=0)


@pytest.mark.parametrize("backend", ["reference", "cpu", "metal"])
def test_trains_on_every_backend_relocating_and_growing_within_the_cap(tiny_scene, backend):
    """metal: the Metal kernels under the MSL emulator. (gsplat: CUDA only, see the skipped test below.)"""
    from pipelines import train_step

    from splat_metal_method.ops.metal import runtime

    cap = 1560
    pipeline, optimizers, callbacks = mcmc_pipeline(tiny_scene, 7, cap, backend=backend)
    model = pipeline.model
    assert isinstance(model.strategy, SplatMetalMCMCStrategy) and model.memory.strategy is model.strategy
    assert model.strategy.backend == backend  # its covariance (position noise) runs on the model's backend
    assert self_check.RunKernels.of(model).covariance  # so a Mac's self-check covers covar.metal
    runtime.reset_launch_counts()
    assert model.memory.max_gaussians == cap and model.num_points == 1500
    assert float(torch.sigmoid(model.opacities).mean()) == pytest.approx(0.5)  # gsplat's MCMC init
    counts = []
    for step in range(7):
        if step == 5:  # some gaussians die before the refine at step 6: relocation has work
            kill(model.gauss_params, torch.arange(0, 1560, 40))
            dead_means = model.means[::40].detach().clone()
        loss = train_step(pipeline, optimizers, callbacks, step)
        assert torch.isfinite(loss)
        counts.append(model.num_points)
        assert model.num_points <= cap
    assert counts[2] == 1500 and counts[3] == cap, counts  # growth at step 3 stopped by the cap
    assert not torch.isclose(model.means[::40].detach(), dead_means).all(dim=-1).any()  # teleported
    assert float(torch.sigmoid(model.opacities).min()) > model.strategy.min_opacity
    assert [r for _, r in model.memory.releases] == ["refine"] * 2  # steps 3 and 6: the memory hooks
    assert runtime.launch_counts().get("quat_scale_to_covar_preci_fwd", 0) == (7 if backend == "metal" else 0)


def test_nan_guard_drops_gaussians_and_keeps_the_binomial_table(tiny_scene, monkeypatch):
    from inject import plant_nan
    from pipelines import train_step

    plant_nan(monkeypatch.setattr, 4, "means", 51)  # 51 rows: the table's size
    pipeline, optimizers, callbacks = mcmc_pipeline(tiny_scene, 7, 1700)
    for step in range(7):
        train_step(pipeline, optimizers, callbacks, step)
        if step == 4:
            after_drop = pipeline.model.num_points
    assert pipeline.model.nonfinite_guard.dropped == 51
    assert after_drop == 1575 - 51  # grown at step 3, then 51 dropped at step 4
    assert pipeline.model.strategy_state["binoms"].shape == (51, 51)
    assert pipeline.model.num_points == min(1700, int(1.05 * after_drop))  # the refine at 6 still works


def test_random_init_starts_within_the_cap(tiny_scene):
    pipeline, _, _ = mcmc_pipeline(tiny_scene, 4, 700, random_init=True, num_random=900, random_scale=2.0)
    model = pipeline.model
    assert model.num_points == 700
    assert "900 initial gaussians, a random 700 of them kept" in model.memory.max_gaussians_source
    assert float(model.means.abs().max()) <= 1.0  # splatfacto's cube of side random_scale
    assert float(torch.sigmoid(model.opacities).mean()) == pytest.approx(0.5)


def test_regularisers_are_in_the_loss(tiny_scene):
    from nerfstudio.engine.callbacks import TrainingCallbackLocation

    pipeline, _, callbacks = mcmc_pipeline(tiny_scene, 4, 2000, mcmc_opacity_reg=0.02, mcmc_scale_reg=0.0)
    for cb in callbacks:
        cb.run_callback_at_location(0, location=TrainingCallbackLocation.BEFORE_TRAIN_ITERATION)
    _, loss_dict, _ = pipeline.get_train_loss_dict(step=0)
    model = pipeline.model
    assert "mcmc_scale_reg" not in loss_dict
    torch.testing.assert_close(loss_dict["mcmc_opacity_reg"], 0.02 * torch.sigmoid(model.opacities).mean())
    loss_dict["mcmc_opacity_reg"].backward()
    assert model.opacities.grad is not None and (model.opacities.grad > 0).all()


@pytest.mark.parametrize(
    "steps, expected",
    [  # 600: x0.02 (refine-every floored at 10); 7000: x0.2333; 30000 and beyond: gsplat's schedule unchanged
        (600, {"warmup_length": 10, "refine_every": 10, "stop_split_at": 500, "means_max_steps": 600}),
        (7000, {"warmup_length": 117, "refine_every": 23, "stop_split_at": 5833, "means_max_steps": 7000}),
        (30000, {"warmup_length": 500, "refine_every": 100, "stop_split_at": 25000, "means_max_steps": 30000}),
        (60000, {"warmup_length": 500, "refine_every": 100, "stop_split_at": 25000, "means_max_steps": 30000}),
    ],
)
def test_scaled_schedule(steps, expected):
    from splat_metal_method.method.mcmc import scaled_schedule

    assert scaled_schedule(steps) == expected


def test_schedule_scale_applies_to_defaults_only_and_can_be_switched_off(tmp_path):
    from splat_metal_method.method.configs import splat_metal_mcmc_trainer_config, splat_metal_trainer_config
    from splat_metal_method.method.mcmc import apply_schedule_scale

    cfg = splat_metal_mcmc_trainer_config()
    cfg.max_num_iterations = 600
    cfg.pipeline.model.warmup_length = 50  # set by the user: kept
    line = apply_schedule_scale(cfg)
    m = cfg.pipeline.model
    assert (m.warmup_length, m.refine_every, m.stop_split_at) == (50, 10, 500)
    assert cfg.optimizers["means"]["scheduler"].max_steps == 600
    assert "600 steps" in line and "warmup-length" not in line, line
    assert apply_schedule_scale(cfg) is None  # applied once: nothing left at the 30K defaults

    off = splat_metal_mcmc_trainer_config()
    off.max_num_iterations = 600
    off.pipeline.model.schedule_scale = "off"
    assert apply_schedule_scale(off) is None
    assert (off.pipeline.model.refine_every, off.optimizers["means"]["scheduler"].max_steps) == (100, 30000)

    default = splat_metal_trainer_config()  # splat-metal (splatfacto's densification) is not touched
    default.max_num_iterations = 600
    assert apply_schedule_scale(default) is None and default.pipeline.model.refine_every == 100

    # A resume (--load-dir, --max-num-iterations = the steps left) scales to the whole run's length.
    (tmp_path / "step-000000399.ckpt").touch()
    resumed = splat_metal_mcmc_trainer_config()
    resumed.max_num_iterations, resumed.load_dir = 200, tmp_path
    apply_schedule_scale(resumed)
    assert resumed.pipeline.model.stop_split_at == 500 and resumed.optimizers["means"]["scheduler"].max_steps == 600
