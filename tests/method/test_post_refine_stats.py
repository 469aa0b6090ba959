"""From refine stop on, a training step computes no densification statistics (model.py strategy_reads_stats).

gsplat 1.4's DefaultStrategy reads means2d.absgrad (or its retained gradient) and the radii only while
step < refine_stop_iter (its step_post_backward returns at once from then on), so from that step the model asks
the rasterizer for no absgrad (2 of its backward's 11 atomics per gaussian and simdgroup) and gsplat's
statistics (our densify_stats kernel on the metal backend) do not run. Checked here on short runs whose
refine stops at STOP, against the same run with ``stats_after_refine_stop`` (today's behaviour, every step):

- every parameter and the strategy's statistics are the same bits at every step, before and after STOP (the
  emulator on one OS thread: with several, its float atomics land in a varying order, as on a GPU);
- the statistics exist up to and including step STOP - 1 (the last one the strategy reads, a refine step here)
  and not from STOP on;
- the metal backend's backward issues 11 atomics per active group at STOP - 1 and 9 at STOP (counted by the
  step ledger under the emulator);
- a run resumed from a checkpoint after STOP computes none either and continues the same bits;
- MCMC (absgrad off, no statistics) is unchanged: the option makes no difference to it.
"""

from __future__ import annotations

import pipelines
import pytest
import torch

from splat_metal_method.bench import step_ledger

WIDTH, HEIGHT, VIEWS = 48, 32, 10
# Opacity reset at step 0 pauses refinement for 9 training views + REFINE_EVERY steps: refines at 20 and 30.
# Refine stops at STOP = 31: step 30 (a refine) is the last the strategy reads.
WARMUP, REFINE_EVERY, STOP = 10, 10, 31
STEPS = STOP + 5
GROUPS = ("means", "scales", "quats", "features_dc", "features_rest", "opacities")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from splat_metal_method.data import demo_scene

    out = tmp_path_factory.mktemp("demo") / "scene"
    demo_scene.generate(out, width=WIDTH, height=HEIGHT, views=VIEWS)
    return out


def _has_stats(model) -> bool:
    """Whether this step's render carries what DefaultStrategy reads: means2d.absgrad (splatfacto's default)."""
    return getattr(model.info["means2d"], "absgrad", None) is not None


def _run(data, backend: str, keep: bool, method: str = "splat-metal", count_at=()):
    """Trains STEPS steps; per step (parameters, strategy statistics, statistics present), and the step ledgers
    of the steps in ``count_at``."""
    if method == "splat-metal":
        pipeline, optimizers, callbacks = pipelines.make_pipeline(
            data, 0, warmup=WARMUP, refine_every=REFINE_EVERY, sh_degree_interval=7, backend=backend,
            stop_split_at=STOP, stats_after_refine_stop=keep,
        )  # fmt: skip
    else:
        from splat_metal_method.method.configs import splat_metal_mcmc_trainer_config

        cfg = splat_metal_mcmc_trainer_config()
        cfg.machine.device_type = "cpu"
        cfg.pipeline.datamanager.data = data
        m = cfg.pipeline.model
        m.background_color, m.num_downscales, m.backend, m.schedule_scale = "white", 0, backend, "off"
        m.warmup_length, m.refine_every, m.stop_split_at, m.stats_after_refine_stop = WARMUP, REFINE_EVERY, STOP, keep
        pipeline, optimizers, callbacks = pipelines.setup_pipeline(cfg, "cpu", 0)
    model = pipeline.model
    out, ledgers = [], {}
    for step in range(STEPS):
        if step in count_at:
            with step_ledger.count(f"step {step}") as ledgers[step]:
                pipelines.train_step(pipeline, optimizers, callbacks, step)
        else:
            pipelines.train_step(pipeline, optimizers, callbacks, step)
        params = {k: model.gauss_params[k].detach().clone() for k in GROUPS}
        stats = {k: v.clone() for k, v in model.strategy_state.items() if isinstance(v, torch.Tensor)}
        out.append((params, stats, _has_stats(model)))
    return out, ledgers


def _assert_same_bits(a, b, what: str):
    assert len(a) == len(b)
    for step, ((pa, sa, _), (pb, sb, _)) in enumerate(zip(a, b)):
        for k in pa:
            assert torch.equal(pa[k], pb[k]), f"{what}: {k} differs after step {step}"
        assert sa.keys() == sb.keys(), (step, sa.keys(), sb.keys())
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"{what}: strategy state {k} differs after step {step}"


@pytest.mark.parametrize("backend", ["metal", "cpu"])
def test_parameters_are_the_same_bits_and_statistics_stop_at_refine_stop(demo_dir, backend, monkeypatch):
    # the emulator's OS threads add float atomics in a varying order (as a GPU does): one thread, one order
    monkeypatch.setenv("SPLAT_METAL_EMU_THREADS", "1")
    count_at = (STOP - 1, STOP) if backend == "metal" else ()
    skip, ledgers = _run(demo_dir, backend, keep=False, count_at=count_at)
    keep, _ = _run(demo_dir, backend, keep=True)
    n = [p["means"].shape[0] for p, _, _ in skip]
    assert n[STOP - 1] != n[STOP - 2], "the refine at STOP - 1 changed nothing: its statistics would not matter"
    _assert_same_bits(skip, keep, backend)
    present = [has for _, _, has in skip]
    assert present == [step < STOP for step in range(STEPS)], present
    assert all(has for _, _, has in keep)
    for step, led in ledgers.items():  # the metal backend, under the emulator
        bwd = led.kernels["rasterize_bwd"]
        # every active (gaussian, simdgroup) group issues one atomic per quantity and reduces as many components:
        # 11 with absgrad, else 9 (the ledger counts the groups from the reductions, 3 a simdgroup aside)
        expected = 11 if step < STOP else 9
        assert bwd.active_groups > 0 and bwd.device_atomics == expected * bwd.active_groups, (step, bwd)
        assert ("densify_stats" in led.kernels) == (step < STOP), (step, sorted(led.kernels))


def test_mcmc_is_unchanged(demo_dir):
    skip, _ = _run(demo_dir, "cpu", keep=False, method="splat-metal-mcmc")
    keep, _ = _run(demo_dir, "cpu", keep=True, method="splat-metal-mcmc")
    _assert_same_bits(skip, keep, "mcmc")
    assert not any(has for _, _, has in skip + keep)  # MCMC asks for no absgrad at any step


def test_a_run_resumed_after_refine_stop_computes_none_and_continues_the_same_bits(demo_dir, tmp_path):
    def configure(load_dir=None):
        def f(cfg):
            m = cfg.pipeline.model
            m.background_color, m.stop_split_at, m.warmup_length, m.refine_every = "white", STOP, WARMUP, REFINE_EVERY
            m.densify_grad_thresh = 0.0002  # splatfacto's default (the ledger's build_trainer lowers it)
            cfg.load_dir = load_dir

        return f

    saved, last = STOP + 1, STOP + 4
    pipelines.seed_all(0)
    a = step_ledger.build_trainer(demo_dir, "splat-metal", "cpu", tmp_path / "a", configure=configure())
    for step in range(saved + 1):
        step_ledger.train_step(a, step)
    a.save_checkpoint(saved)
    for step in range(saved + 1, last + 1):
        step_ledger.train_step(a, step)
    b = step_ledger.build_trainer(demo_dir, "splat-metal", "cpu", tmp_path / "b",
                                  configure=configure(a.checkpoint_dir))  # fmt: skip
    assert b._start_step == saved + 1
    before = {k: v.clone() for k, v in b.pipeline.model.strategy_state.items() if isinstance(v, torch.Tensor)}
    for step in range(saved + 1, last + 1):
        step_ledger.train_step(b, step)
        assert not _has_stats(b.pipeline.model), step
    for k, v in before.items():
        assert torch.equal(b.pipeline.model.strategy_state[k], v), k  # the statistics stay as saved
    for k in GROUPS:
        assert torch.equal(a.pipeline.model.gauss_params[k], b.pipeline.model.gauss_params[k]), k
