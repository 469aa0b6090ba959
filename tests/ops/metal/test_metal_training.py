"""nerfstudio training steps through the Metal backend (the MSL emulator on Linux) vs the reference.

The pipeline is built in-process from splat-metal's TrainerConfig on a tiny demo scene (48x32,
10 views), with the camera optimizer on (so viewmats carry gradients), SH degree 3 reached at step
21, and a short densification schedule. SPLAT_METAL_BACKEND selects the backend, as a user would.

- one step: loss and every parameter gradient (means, scales, quats, features_dc, features_rest,
  opacities, camera_opt) of "metal" against "reference", plus means2d.grad/absgrad as
  DefaultStrategy reads them;
- 30 steps: the Metal path lowers the loss like the reference does, and densification fires;
- host syncs and kernel launches per step on the emulated runtime are counted and printed.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import pipelines
import pytest
import torch
from pipelines import seed_all, train_step

from splat_metal_method.ops.metal import runtime
from splat_metal_method.ops.metal.rasterize import RASTER_CHUNK

WIDTH, HEIGHT, VIEWS = 48, 32, 10
# The opacity reset at step 0 pauses refinement for 9 training views + REFINE_EVERY steps, so the
# first densification is at step 20; ten steps after it show the loss still falling.
REFINE_EVERY, WARMUP = 10, 10
STEPS = 30
SH_INTERVAL = 7  # SH degree 3 from step 21: the last steps of the run train every band


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from splat_metal_method.data import demo_scene

    out = tmp_path_factory.mktemp("demo") / "scene"
    demo_scene.generate(out, width=WIDTH, height=HEIGHT, views=VIEWS)  # in process: no second Python start-up
    return out


def make_pipeline(data: Path, seed: int = 0):
    return pipelines.make_pipeline(data, seed, warmup=WARMUP, refine_every=REFINE_EVERY, sh_degree_interval=SH_INTERVAL)


class SyncCounter:
    """Counts Tensor.item/.tolist/.cpu/.numpy calls (host syncs on a GPU) by the calling file."""

    METHODS = ("item", "tolist", "cpu", "numpy")

    def __init__(self):
        self.counts: Counter = Counter()
        self._orig = {}

    def __enter__(self):
        for name in self.METHODS:
            orig = getattr(torch.Tensor, name)
            self._orig[name] = orig

            def wrapper(t, *a, _orig=orig, _name=name, **k):
                frame = traceback.extract_stack(limit=2)[0]  # the caller of the tensor method
                where = frame.filename.split("site-packages/")[-1].split("/work/main/")[-1]
                self.counts[f"{_name} {where}:{frame.lineno}"] += 1
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(torch.Tensor, name, orig)
        return False


def grads_of(pipeline):
    return {k: [p.grad.detach().clone() if p.grad is not None else None for p in ps]
            for k, ps in pipeline.get_param_groups().items()}  # fmt: skip


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def test_one_training_step_matches_reference(demo_dir, monkeypatch):
    """Loss and every parameter gradient of one nerfstudio training step, metal vs reference."""
    from nerfstudio.engine.callbacks import TrainingCallbackLocation

    pipeline, optimizers, callbacks = make_pipeline(demo_dir)
    model = pipeline.model
    with torch.no_grad():  # move off splatfacto's init (isotropic scales, zero SH rest, identity poses)
        g = torch.Generator().manual_seed(1)
        gp = model.gauss_params
        gp["scales"] += 0.3 * torch.randn(gp["scales"].shape, generator=g)
        gp["features_rest"] += 0.05 * torch.randn(gp["features_rest"].shape, generator=g)
        model.camera_optimizer.pose_adjustment += 0.01 * torch.randn(
            model.camera_optimizer.pose_adjustment.shape, generator=g
        )
    step = 30  # SH degree 3 (from step 3 * SH_INTERVAL)
    for cb in callbacks:
        cb.run_callback_at_location(step, location=TrainingCallbackLocation.BEFORE_TRAIN_ITERATION)
    camera, batch = pipeline.datamanager.next_train(step)
    results = {}
    for backend in ("reference", "metal"):
        monkeypatch.setenv("SPLAT_METAL_BACKEND", backend)
        optimizers.zero_grad_all()
        t0 = time.perf_counter()
        outputs = model.get_outputs(camera)
        model.info["means2d"].retain_grad()  # compared below (training reads only its absgrad)
        metrics = model.get_metrics_dict(outputs, batch)
        loss = functools.reduce(torch.add, model.get_loss_dict(outputs, batch, metrics).values())
        loss.backward()
        elapsed = time.perf_counter() - t0
        assert model.info["backend"] == backend
        if backend == "metal":  # a training step's padded lists, built without isect_ids (nothing reads them)
            assert model.info["n_intersections"] is not None and model.info["isect_ids"] is None
        means2d = model.info["means2d"]
        results[backend] = (loss.item(), grads_of(pipeline), means2d.grad.clone(), means2d.absgrad.clone())
        print(f"{backend}: loss {loss.item():.8f}, forward+backward {elapsed:.2f} s")
    (lr, gr, m2r, absr), (lm, gm, m2m, absm) = results["reference"], results["metal"]
    assert abs(lm - lr) <= 1e-5 * abs(lr), f"loss {lm} vs {lr}"
    for name in ("means", "scales", "quats", "features_dc", "features_rest", "opacities", "camera_opt"):
        for a, b in zip(gm[name], gr[name]):
            assert a is not None and b is not None, f"{name}: missing gradient"
            assert b.norm() > 0, f"{name}: the reference gradient vanished; the comparison would be empty"
            r = rel(a, b)
            print(f"grad {name:14s} {list(b.shape)}: rel {r:.2e} (|ref| {b.norm().item():.3e})")
            assert r <= 1e-3, f"{name}: relative error {r:.3g}"
    for name, a, b in (("means2d.grad", m2m, m2r), ("means2d.absgrad", absm, absr)):
        r = rel(a, b)
        print(f"{name}: rel {r:.2e}")
        assert r <= 1e-3, f"{name}: relative error {r:.3g}"


def run_training(demo_dir, backend, monkeypatch, count=False):
    monkeypatch.setenv("SPLAT_METAL_BACKEND", backend)
    pipeline, optimizers, callbacks = make_pipeline(demo_dir, seed=0)
    seed_all(1)
    losses, sizes, times, syncs, launches = [], [], [], [], []
    for step in range(STEPS):
        sizes.append(pipeline.model.num_points)  # during the step (densification runs after it)
        runtime.reset_launch_counts()
        t0 = time.perf_counter()
        if count:
            with SyncCounter() as sc:
                loss = train_step(pipeline, optimizers, callbacks, step)
            syncs.append(sc.counts)
        else:
            loss = train_step(pipeline, optimizers, callbacks, step)
        times.append(time.perf_counter() - t0)
        launches.append(runtime.launch_counts())
        losses.append(loss.item())
    sizes.append(pipeline.model.num_points)
    return losses, sizes, times, syncs, launches


def test_thirty_training_steps_metal_vs_reference(demo_dir, monkeypatch):
    """STEPS (30) steps on each backend from the same start and camera order: the Metal path lowers the loss
    as the reference does and DefaultStrategy densifies from its means2d gradients. Also counts host
    syncs and kernel launches per Metal step and compares step times."""
    ref_losses, ref_sizes, ref_times, _, _ = run_training(demo_dir, "reference", monkeypatch)
    losses, sizes, times, syncs, launches = run_training(demo_dir, "metal", monkeypatch, count=True)

    def avg(x, lo, hi):
        return float(np.mean(x[lo:hi]))

    print("step  loss(ref)  loss(metal)  gaussians(ref/metal)  s/step(ref/metal)")
    for s in range(0, STEPS, 5):
        print(f"{s:4d}  {ref_losses[s]:.5f}   {losses[s]:.5f}      {ref_sizes[s]:6d}/{sizes[s]:6d}"
              f"          {ref_times[s]:.2f}/{times[s]:.2f}")  # fmt: skip
    steady = slice(2, STEPS)  # the first steps compile kernels / warm caches
    print(f"median s/step at {WIDTH}x{HEIGHT}: reference {np.median(ref_times[steady]):.3f}, "
          f"metal (emulated) {np.median(times[steady]):.3f}")  # fmt: skip

    # Host syncs and kernel launches per Metal step (a step without densification, and all steps).
    per_step = [sum(c.values()) for c in syncs]

    # isect.py's .tolist() of the intersection count reads a host copy: on a Mac a non_blocking copy read a
    # step late, on CPU the tensor itself (the step ledger counts it as a host-local read, not a sync)
    def op_sync(site: str) -> bool:
        return "splat_metal_method/ops" in site and not (site.startswith("tolist ") and "isect.py" in site)

    ours = [sum(v for k, v in c.items() if op_sync(k)) for c in syncs]
    quiet = STEPS - 1  # not a refine step
    print(f"host syncs (item/tolist/cpu/numpy) per metal step: min {min(per_step)}, max {max(per_step)}; "
          f"from splat_metal_method.ops: max {max(ours)}")  # fmt: skip
    for k, v in sorted(syncs[quiet].items()):
        print(f"  step {quiet}: {v} x {k}")
    print(f"kernel launches at step {quiet}: {sum(launches[quiet].values())} {launches[quiet]}")
    # The op layer's syncs: isect reads M (the size of the intersection buffers) once per render, and
    # rasterization reads the longest tile list once (shared by forward and backward) only when a tile
    # could exceed RASTER_CHUNK gaussians, i.e. when N > RASTER_CHUNK.
    for s in range(STEPS):
        allowed = 1 + (sizes[s] > RASTER_CHUNK)
        assert ours[s] <= allowed, f"step {s}: the op layer synced {ours[s]} times (allowed {allowed}): {syncs[s]}"
    for name in ("project_bwd", "sh_bwd", "rasterize_bwd"):
        assert launches[quiet].get(name, 0) >= 1, f"{name} did not run: the backward is not the Metal one"
    # the gaussians' Adam is one fused pass (engine/optimizers.py; the camera optimizer's is torch's)
    assert all(c.get("adam_step") == 1 for c in launches), [c.get("adam_step") for c in launches]
    # the camera optimizer's viewmat gradient keeps the unfused projection (not prepare.py): the SH coefficients
    # take their step there too, not inside the backward (test_fused_sh_step_training_run_matches_its_twin)
    assert all(c.get("adam_prepare") == 1 for c in launches), [c.get("adam_prepare") for c in launches]

    # Learning: the Metal run lowers the loss like the reference run.
    first_ref, last_ref = avg(ref_losses, 0, 5), avg(ref_losses, STEPS - 10, STEPS)
    first, last = avg(losses, 0, 5), avg(losses, STEPS - 10, STEPS)
    print(f"mean loss steps 0-4 -> {STEPS - 10}-{STEPS - 1}: reference {first_ref:.4f} -> {last_ref:.4f}, "
          f"metal {first:.4f} -> {last:.4f}")  # fmt: skip
    assert abs(first - first_ref) <= 1e-4 * first_ref, "same start, same cameras: same first losses"
    assert last_ref < 0.8 * first_ref, f"the reference itself should learn in {STEPS} steps"
    assert last < 0.8 * first, f"metal did not lower the loss: {first:.4f} -> {last:.4f}"
    assert abs(last - last_ref) <= 0.05 * last_ref, f"metal {last:.4f} vs reference {last_ref:.4f} after {STEPS} steps"

    # Densification fired on both (gaussian count changed at a refine step).
    assert len(set(ref_sizes)) > 1, "the reference run never densified/pruned"
    assert len(set(sizes)) > 1, "the metal run never densified/pruned"
    grew = [s for s in range(STEPS) if sizes[s + 1] > sizes[s]]
    assert grew, f"the metal run never grew: {sizes}"
    print(
        f"metal run grew at steps {grew}: {sizes[0]} -> {sizes[-1]} gaussians (reference {ref_sizes[0]} -> {ref_sizes[-1]})"
    )


def test_sh_degree_4_trains_past_step_4_intervals(demo_dir, monkeypatch, tmp_path):
    """`--pipeline.model.sh-degree 4` on the Metal backend: the self-check passes at degree 4 (it failed
    before the kernels had band 4, and training then crashed at step 4 x sh_degree_interval); the steps
    from 4 x interval render with degree 4 and train band 4 (zero until then: Adam moves nothing without a
    gradient); the loss stays finite."""
    from splat_metal_method.method import model as model_module
    from splat_metal_method.ops import stage_fallback
    from splat_metal_method.verify import self_check

    interval, steps = 2, 10  # degree 4 from step 8
    monkeypatch.setenv("SPLAT_METAL_BACKEND", "metal")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached verdict: the check runs
    monkeypatch.setattr(self_check, "_verified", set())
    stage_fallback.reset()
    degrees = []
    render = model_module.rasterization_metal  # the op the model calls on the metal backend

    def recording(*args, **kwargs):  # the real op; only the degree each step renders with is noted
        degrees.append(kwargs["sh_degree"])
        return render(*args, **kwargs)

    monkeypatch.setattr(model_module, "rasterization_metal", recording)
    pipeline, optimizers, callbacks = pipelines.make_pipeline(
        demo_dir, warmup=WARMUP, refine_every=REFINE_EVERY, sh_degree_interval=interval, sh_degree=4
    )
    model = pipeline.model
    band4 = slice(15, 24)  # features_rest rows of band 4 (coefficients 16..24)
    for step in range(steps):
        if step == 4 * interval:
            assert model.features_rest[:, band4].abs().max() == 0, "band 4 trained before degree 4"
        loss = train_step(pipeline, optimizers, callbacks, step)
        assert torch.isfinite(loss), f"step {step}: loss {loss}"
        assert model.info["backend"] == "metal"
    assert degrees == [min(s // interval, 4) for s in range(steps)]
    assert model.features_rest.shape[1] == 24 and model.features_rest[:, band4].abs().max() > 0
    assert stage_fallback.failed() == frozenset(), "a stage failed the self-check at degree 4"
    assert [run.sh_degree for _, run in self_check._verified] == [4]


def test_fused_sh_step_training_run_matches_its_twin(demo_dir, monkeypatch):
    """splatfacto's default (no camera optimizer): the fused preparation renders, and from the second step on
    every gaussian parameter takes its Adam step inside project_bwd (its adam_prepare there, no adam_step left).
    Through a densification, the run equals bit for bit the same run with those steps after the backward
    (fuse_sh off), and the run with the SH coefficients' alone inside it (fuse_params off: one more
    adam_prepare a step)."""
    monkeypatch.setenv("SPLAT_METAL_BACKEND", "metal")
    monkeypatch.setenv("SPLAT_METAL_EMU_THREADS", "1")  # the rasterizer's float atomics in one order
    steps, runs = STEPS, []
    for fuse_sh, fuse_params in ((False, False), (True, False), (True, True)):
        pipeline, optimizers, callbacks = pipelines.make_pipeline(
            demo_dir, 0, warmup=WARMUP, refine_every=REFINE_EVERY, sh_degree_interval=SH_INTERVAL, camera_mode="off"
        )  # fmt: skip
        optimizers.fuse_sh, optimizers.fuse_params = fuse_sh, fuse_params
        seed_all(1)
        prepares, adam_steps, sizes = [], [], []
        for step in range(steps):
            runtime.reset_launch_counts()
            train_step(pipeline, optimizers, callbacks, step)
            prepares.append(runtime.launch_counts().get("adam_prepare"))
            adam_steps.append(runtime.launch_counts().get("adam_step", 0))
            sizes.append(pipeline.model.num_points)
        runs.append((pipeline.model.gauss_params, optimizers, prepares, sizes, adam_steps))
    (twin, twin_opts, twin_prepares, sizes, _), (sh, sh_opts, sh_prepares, sh_sizes, _) = runs[:2]
    ours, opts, prepares, our_sizes, adam_steps = runs[2]
    assert twin_prepares == [1] * steps and sh_prepares == [1] + [2] * (steps - 1), (twin_prepares, sh_prepares)
    assert prepares == [1] * steps and adam_steps == [1] + [0] * (steps - 1), (prepares, adam_steps)
    assert opts.sh_taken == opts.params_taken == sh_opts.sh_taken == steps - 1 and sh_opts.params_taken == 0
    assert len(set(sizes)) > 1 and sizes == our_sizes == sh_sizes, sizes
    for name in twin:
        assert torch.equal(twin[name], sh[name]), name
        a, b = twin_opts.optimizers[name].state[twin[name]], sh_opts.optimizers[name].state[sh[name]]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a[key], b[key]), (name, key)
    for name in twin:
        assert torch.equal(twin[name], ours[name]), name
        a, b = twin_opts.optimizers[name].state[twin[name]], opts.optimizers[name].state[ours[name]]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a[key], b[key]), (name, key)
