"""In-process tests of splat_metal_method/engine/reliability.py: the NaN/Inf guard on a small gaussian model
with real Adam optimizers and gsplat's strategy state, atomic writes (files and nerfstudio's PLY
writer) under failures mid-write. The same mechanisms are driven through the real command lines in
test_reliability_cli.py; the Trainer's parts (checkpoints, signals) are in test_trainer.py."""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from splat_metal_method.engine import reliability
from splat_metal_method.engine.reliability import NonFiniteError, NonFiniteGuard, atomic_path

N = 10
SHAPES = {
    "means": (3,),
    "scales": (3,),
    "quats": (4,),
    "features_dc": (3,),
    "features_rest": (15, 3),
    "opacities": (1,),
}


class FakeModel(torch.nn.Module):
    """What NonFiniteGuard reads of a SplatfactoModel: gauss_params, strategy_state, step."""

    def __init__(self, n: int = N):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gauss_params = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(torch.randn((n, *s), generator=g)) for k, s in SHAPES.items()}
        )
        self.camera_opt = torch.nn.Parameter(torch.zeros(4, 6))
        self.strategy_state = {"grad2d": torch.rand(n, generator=g), "count": torch.ones(n), "radii": None}
        self.step = 0
        # Row i of every parameter starts with the value i, so tests can tell which rows survived.
        with torch.no_grad():
            for p in self.gauss_params.values():
                p.flatten(1)[:, 0] = torch.arange(n, dtype=p.dtype)


def make(mode: str = "recover", n: int = N, deferred=None):
    model = FakeModel(n)
    optimizers = {k: torch.optim.Adam([p], lr=1e-3, eps=1e-15) for k, p in model.gauss_params.items()}
    optimizers["camera_opt"] = torch.optim.Adam([model.camera_opt], lr=1e-4)
    return model, optimizers, NonFiniteGuard(model, optimizers, mode, deferred=deferred)


def train_step(model, optimizers, poison=None):
    """One step of a real loss through every parameter; ``poison(model)`` edits grads before Adam."""
    for opt in optimizers.values():
        opt.zero_grad()
    loss = sum((p**2).sum() for p in model.gauss_params.values()) + (model.camera_opt**2).sum()
    loss.backward()
    if poison is not None:
        poison(model)
    for opt in optimizers.values():
        opt.step()


def ids(model) -> list:
    """The original row ids still present (first value of each row of means)."""
    return model.gauss_params["means"][:, 0].detach().round().long().tolist()


def test_clean_step_changes_nothing():
    model, optimizers, guard = make()
    train_step(model, optimizers)
    before = {k: p.detach().clone() for k, p in model.gauss_params.items()}
    guard.check(5)
    assert guard.reports == [] and guard.dropped == 0
    for k, p in model.gauss_params.items():
        assert torch.equal(p, before[k])


def test_nan_gradient_drops_only_its_gaussians_and_fixes_optimizer_and_strategy_state(capsys):
    model, optimizers, guard = make()
    train_step(model, optimizers)  # Adam state exists for every row

    def poison(m):
        m.gauss_params["scales"].grad[[2, 5]] = float("nan")

    model.step = 7
    train_step(model, optimizers, poison)
    guard.check(7)

    assert ids(model) == [0, 1, 3, 4, 6, 7, 8, 9]
    for name, p in model.gauss_params.items():
        assert p.shape[0] == N - 2 and torch.isfinite(p).all()
        state = optimizers[name].state[p]  # the new parameter carries the sliced Adam state
        assert state["exp_avg"].shape == p.shape and torch.isfinite(state["exp_avg_sq"]).all()
        assert optimizers[name].param_groups[0]["params"][0] is p
    assert model.strategy_state["grad2d"].shape == (N - 2,) and model.strategy_state["radii"] is None
    out = capsys.readouterr().out
    assert "step 7" in out and "NaN in the gradient of scales (2 gaussians)" in out and "NaN in scales" in out
    assert "Dropped those 2 of 10 gaussians" in out
    # Training goes on with the survivors.
    train_step(model, optimizers)
    guard.check(8)
    assert guard.dropped == 2 and len(guard.reports) == 1


def test_inf_value_and_bad_densification_statistics_are_found():
    model, optimizers, guard = make()
    with torch.no_grad():
        model.gauss_params["features_rest"][4, 7, 1] = float("inf")
    model.strategy_state["grad2d"][8] = float("nan")
    guard.check(3)
    assert ids(model) == [0, 1, 2, 3, 5, 6, 7, 9]
    (report,) = guard.reports
    assert "Inf in features_rest (1 gaussian)" in report.describe()
    assert "densification statistics (grad2d)" in report.describe()


def test_stop_mode_raises_with_step_and_parameter_and_keeps_the_model():
    model, optimizers, guard = make("stop")
    model.step = 11
    train_step(model, optimizers, lambda m: m.gauss_params["opacities"].grad[0].fill_(float("nan")))
    with pytest.raises(NonFiniteError) as e:
        guard.check(11)
    assert isinstance(e.value, SystemExit)  # ns-train prints the message only, exit status 1
    msg = e.value.message
    assert msg.startswith("splat-metal: step 11:") and "gradient of opacities" in msg and "nonfinite recover" in msg
    assert model.gauss_params["means"].shape[0] == N  # nothing dropped: the process stops


def test_non_gaussian_parameters_and_all_gaussians_stop_even_in_recover_mode():
    model, optimizers, guard = make("recover")
    train_step(model, optimizers, lambda m: m.camera_opt.grad.fill_(float("inf")))
    with pytest.raises(NonFiniteError, match="camera_opt.*cannot repair"):
        guard.check(2)

    model, optimizers, guard = make("recover")
    train_step(model, optimizers, lambda m: m.gauss_params["means"].grad.fill_(float("nan")))
    with pytest.raises(NonFiniteError, match="all 10 gaussians"):
        guard.check(2)


def test_overflowing_sum_is_not_a_false_alarm():
    model, optimizers, guard = make()
    with torch.no_grad():
        model.gauss_params["opacities"][:] = 3e38  # finite, but the sum overflows to inf
    guard.check(1)
    assert guard.reports == [] and model.gauss_params["means"].shape[0] == N


def test_empty_model_is_fine():
    model, optimizers, guard = make(n=0)
    train_step(model, optimizers)
    guard.check(0)
    assert guard.reports == []


def test_a_planted_nan_poisons_the_named_gradient_at_its_step(monkeypatch):
    """tests/inject.py's NaN, which the command-line tests plant: in the named gradient, at its step only."""
    from inject import plant_nan

    plant_nan(monkeypatch.setattr, 4, "quats", 2)
    model, optimizers, guard = make()
    model.step = 3
    train_step(model, optimizers)
    guard.check(3)
    assert guard.reports == []
    model.step = 4
    train_step(model, optimizers)
    guard.check(4)
    assert ids(model) == list(range(2, N))
    assert "gradient of quats (2 gaussians)" in guard.reports[0].describe()


def test_flag_is_one_foreach_norm_and_reads_the_host_once():
    from splat_metal_method.bench import step_ledger

    model, optimizers, guard = make()
    train_step(model, optimizers)
    with step_ledger.count("guard") as led:
        guard.check(1)
    # one _foreach_norm call over every parameter and gradient (MPS runs it tensor by tensor, and the ledger
    # counts it so), then stack + sum and the one read
    norms = led.aten_ops["_foreach_norm.Scalar"]
    assert norms >= 2 * len(model.gauss_params) and led.aten_dispatches == norms + 3, led.aten_ops
    assert [what for what, _ in led.host_reads] == ["_local_scalar_dense"]  # read at once off MPS


def test_flag_is_a_kernel_with_the_metal_backend():
    """With the metal backend the flag is train.metal's nonfinite_flag: one allocation and one launch per
    12 tensors (here 14: 7 parameters and their gradients), 0 when all is finite, NaN for a NaN or an Inf
    anywhere, the last element of any tensor included."""
    import types

    from splat_metal_method.bench import step_ledger
    from splat_metal_method.ops.metal import runtime

    model, optimizers, guard = make()
    model.config = types.SimpleNamespace(backend="metal")
    train_step(model, optimizers)
    runtime.reset_launch_counts()
    with step_ledger.count("guard") as led:
        flag = guard._flag()
    assert led.aten_dispatches == 1 and led.kernel_launches == 2, (dict(led.aten_ops), led.kernels)
    assert float(flag) == 0.0 and guard._all_finite()
    tensors = list(model.gauss_params.values()) + [model.camera_opt]
    tensors += [t.grad for t in tensors]
    for k, t in enumerate(tensors):
        for bad in (float("nan"), float("inf"), float("-inf")):
            flat = t.detach().view(-1)
            i = [0, flat.numel() - 1, flat.numel() // 2][k % 3]
            old = flat[i].item()
            flat[i] = bad
            assert math.isnan(float(guard._flag())), (k, i, bad)
            flat[i] = old
    assert float(guard._flag()) == 0.0


@pytest.mark.parametrize("where", ["value", "gradient"])
def test_deferred_flag_is_read_a_step_late_and_finds_nan(where, capsys):
    """MPS's path (forced here on CPU): the flag of step 5 is acted on at the check of step 6."""
    model, optimizers, guard = make(deferred=True)
    train_step(model, optimizers)
    if where == "value":  # a parameter, gradients finite
        with torch.no_grad():
            model.gauss_params["quats"][[1, 6], 2] = float("nan")
    else:  # only a gradient (after the optimizer step, so the values stay finite)
        model.gauss_params["scales"].grad[[1, 6]] = float("inf")
    guard.check(5)
    assert guard.reports == [] and len(guard.pending) == 1 and ids(model) == list(range(N))
    guard.check(6)
    assert ids(model) == [0, 2, 3, 4, 5, 7, 8, 9] and guard.dropped == 2
    assert [at for at, _, _ in guard.pending] == [6]  # step 6's flag, taken after the drop
    (report,) = guard.reports
    what = "NaN in quats" if where == "value" else "Inf in the gradient of scales"
    assert report.describe().startswith(f"step 6 (flagged after step 5): non-finite values: {what} (2 gaussians)")
    assert "Dropped those 2 of 10 gaussians" in capsys.readouterr().out
    train_step(model, optimizers)
    guard.check(7)
    guard.flush(7)
    assert len(guard.reports) == 1 and guard.pending == []


def test_deferred_stop_raises_at_flush_before_a_checkpoint():
    model, optimizers, guard = make("stop", deferred=True)
    model.step = 11
    train_step(model, optimizers, lambda m: m.gauss_params["opacities"].grad[0].fill_(float("nan")))
    guard.check(11)  # not read yet
    with pytest.raises(NonFiniteError, match="^splat-metal: step 11: .*gradient of opacities"):
        guard.flush(11)


def test_deferred_flag_that_comes_back_clean_is_no_report():
    """A late flag whose non-finite gaussians are gone by the time it is read (pruned in between)."""
    model, optimizers, guard = make(deferred=True)
    with torch.no_grad():
        model.gauss_params["means"][3] = float("nan")
    guard.check(1)
    with torch.no_grad():
        model.gauss_params["means"][3] = 3.0  # its id again (the first value)
    guard.flush(2)
    assert guard.reports == [] and ids(model) == list(range(N)) and guard.pending == []


@pytest.mark.parametrize("nan_at", [3, 4])  # 4: a save step, caught only by the flush before the save
def test_deferred_stop_never_leaves_a_bad_checkpoint(tmp_path, nan_at):
    """nerfstudio's loop (train, callbacks, save every 2 steps) with SplatMetalTrainer's save_checkpoint."""
    import types

    from torch.cuda.amp import GradScaler

    from splat_metal_method.engine import resume_state
    from splat_metal_method.engine.trainer import SplatMetalTrainer

    model, optimizers, guard = make("stop", deferred=True)
    model.nonfinite_guard = guard
    pipeline = torch.nn.Module()
    pipeline.model = model
    trainer = types.SimpleNamespace(
        checkpoint_dir=tmp_path / "nerfstudio_models", pipeline=pipeline, grad_scaler=GradScaler(enabled=False),
        optimizers=types.SimpleNamespace(optimizers=optimizers, schedulers={}),
        config=types.SimpleNamespace(save_only_latest_checkpoint=False), _saved_steps=set(),
        _resume_state=lambda: {"format": resume_state.FORMAT}, sharded=None,
    )  # fmt: skip
    with pytest.raises(NonFiniteError, match=f"step {nan_at}"):
        for step in range(8):
            model.step = step
            poison = (lambda m: m.gauss_params["scales"].grad[2].fill_(float("nan"))) if step == nan_at else None
            train_step(model, optimizers, poison)
            guard.check(step)
            if step % 2 == 0:
                SplatMetalTrainer.save_checkpoint(trainer, step)
    saved = sorted(trainer.checkpoint_dir.glob("*.ckpt"))
    assert [p.name for p in saved] == [f"step-{s:09d}.ckpt" for s in range(0, nan_at, 2)]
    for path in saved:
        state = torch.load(path, map_location="cpu")
        assert all(torch.isfinite(v).all() for v in state["pipeline"].values()), path


# --------------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------------
def _listing(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_atomic_path_keeps_the_old_file_when_writing_fails(tmp_path, error):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(error):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise error()
    assert _listing(tmp_path) == {"out.bin": b"old"}
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.bin.partial-")
        tmp.write_bytes(b"new")
    assert _listing(tmp_path) == {"out.bin": b"new"}


class _DyingColumn(np.ndarray):
    """A float column whose element reads fail after ``limit`` of them (the writer reads one per value)."""

    def __getitem__(self, i):
        if isinstance(i, (int, np.integer)) and i >= self.limit:
            raise self.error()
        return super().__getitem__(i)


def _ply_columns(n: int, dying_at=None, error=RuntimeError):
    cols = OrderedDict(
        (k, np.linspace(0, 1, n, dtype=np.float32) + j) for j, k in enumerate(["x", "y", "z", "opacity"])
    )
    if dying_at is not None:
        col = cols["z"].view(_DyingColumn)
        col.limit, col.error = dying_at, error
        cols["z"] = col
    return cols


def test_ply_writer_is_atomic_and_writes_the_same_bytes(tmp_path, monkeypatch):
    exporter = pytest.importorskip("nerfstudio.scripts.exporter")
    original = exporter.ExportGaussianSplat.__dict__["write_ply"].__func__
    # nerfstudio's own writer, also where an earlier test in this process installed the method's block writer
    original = getattr(original, "nerfstudio_write_ply", getattr(original, "__wrapped__", original))
    write = reliability.atomic_ply_writer(original)
    target = tmp_path / "splat.ply"

    original(str(tmp_path / "direct.ply"), 50, _ply_columns(50))
    write(str(target), 50, _ply_columns(50))
    assert target.read_bytes() == (tmp_path / "direct.ply").read_bytes()

    target.write_bytes(b"the user's previous export")
    with pytest.raises(RuntimeError):
        write(str(target), 50, _ply_columns(50, dying_at=20))
    with pytest.raises(SystemExit, match="export interrupted; .*splat.ply was not written .*untouched"):
        write(str(target), 50, _ply_columns(50, dying_at=20, error=KeyboardInterrupt))
    assert _listing(tmp_path) == {
        "splat.ply": b"the user's previous export",
        "direct.ply": _listing(tmp_path)["direct.ply"],
    }
    # Without the wrapper, nerfstudio's writer leaves a truncated file at the target: what this prevents.
    with pytest.raises(RuntimeError):
        original(str(target), 50, _ply_columns(50, dying_at=20))
    assert target.read_bytes() != b"the user's previous export"


def test_install_wraps_the_loaded_exporter_once(monkeypatch):
    exporter = pytest.importorskip("nerfstudio.scripts.exporter")
    cls = exporter.ExportGaussianSplat
    monkeypatch.setattr(cls, "write_ply", cls.__dict__["write_ply"])  # restored after the test
    assert reliability.install_atomic_ply_export()
    wrapped = cls.__dict__["write_ply"]
    assert isinstance(wrapped, staticmethod) and getattr(wrapped.__func__, "_splat_metal_atomic", False)
    assert reliability.install_atomic_ply_export() and cls.__dict__["write_ply"] is wrapped  # idempotent
    monkeypatch.delitem(__import__("sys").modules, "nerfstudio.scripts.exporter")
    assert not reliability.install_atomic_ply_export()  # not in ns-export: nothing to do


# --------------------------------------------------------------------------------------------------
# A checkpoint write that fails (full disk)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("disk", ["tmpfs", "injected"])
def test_full_disk_during_a_checkpoint_write_leaves_nothing(tmp_path, monkeypatch, disk):
    """A real 256 KiB tmpfs where one can be mounted (root), and the planted write error (tests/inject.py) that the
    command-line tests use: the same error, no file left."""
    import subprocess

    from inject import plant_save_error

    from splat_metal_method.engine.reliability import CheckpointWriteError, save_checkpoint_file

    folder = tmp_path / "disk"
    folder.mkdir()
    if disk == "tmpfs":
        if (
            os.geteuid() != 0
            or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)]).returncode
        ):
            pytest.skip("mounting a small tmpfs needs root; the injected case covers the same path")
    else:
        plant_save_error(monkeypatch.setattr, 20)
    try:
        (folder / "step-000000010.ckpt").write_bytes(b"the previous checkpoint")
        state = {"step": 20, "w": torch.zeros(200_000)}  # 800 KB: more than the tmpfs holds
        with pytest.raises(CheckpointWriteError) as info:
            save_checkpoint_file(state, folder / "step-000000020.ckpt", 20)
        assert str(info.value.code) == (
            f"splat-metal: could not write the checkpoint {folder / 'step-000000020.ckpt'} (No space left on device)"
        )
        assert sorted(p.name for p in folder.iterdir()) == ["step-000000010.ckpt"]
        assert (folder / "step-000000010.ckpt").read_bytes() == b"the previous checkpoint"
    finally:
        if disk == "tmpfs":
            subprocess.run(["umount", str(folder)], check=True)


# ---- with the gaussians' Adam as one kernel pass (engine/optimizers.py, ops/metal/adam.metal)
def make_fused(deferred=None):
    """make() with the metal backend, the gaussians stepped by GaussianOptimizers' fused pass (whose flag
    the guard takes over) and the camera optimizer by torch's Adam."""
    import types

    from splat_metal_method.engine.optimizers import GaussianOptimizers
    from splat_metal_method.method.configs import FusedAdamOptimizerConfig

    model = FakeModel()
    model.config = types.SimpleNamespace(backend="metal")
    groups = {k: [p] for k, p in model.gauss_params.items()}
    groups["camera_opt"] = [model.camera_opt]
    config = {k: {"optimizer": FusedAdamOptimizerConfig(lr=1e-3, eps=1e-15), "scheduler": None} for k in groups}
    opts = GaussianOptimizers(config, groups, model)
    return model, opts, NonFiniteGuard(model, opts.optimizers, "recover", deferred=deferred, fused_from=opts)


def fused_step(model, opts, poison=None):
    from torch.cuda.amp import GradScaler

    for opt in opts.optimizers.values():
        opt.zero_grad()
    (sum((p**2).sum() for p in model.gauss_params.values()) + (model.camera_opt**2).sum()).backward()
    if poison is not None:
        poison(model)
    opts.optimizer_scaler_step_all(GradScaler(enabled=False))
    assert opts.why_not_fused == "" and opts.last_fused is not None


def test_fused_adam_flag_leaves_the_guard_only_what_it_did_not_step():
    """A clean step: the guard reads again only the camera optimizer's parameter and gradient (one
    nonfinite_flag launch into the fused pass's flag, no aten op); a gaussian parameter changed in place
    after the step (MCMC's noise on the means) is read again, and a NaN there is found."""
    from splat_metal_method.bench import step_ledger
    from splat_metal_method.ops.metal import runtime

    model, opts, guard = make_fused()
    fused_step(model, opts)
    runtime.reset_launch_counts()
    with step_ledger.count("guard") as led:
        flag = guard._flag()
    assert led.aten_dispatches == 0 and led.kernels["nonfinite_flag"].launches == 1, (dict(led.aten_ops), led.kernels)
    assert led.kernels["nonfinite_flag"].buffer_bytes < 2 * model.camera_opt.numel() * 4 + 100  # 2 tensors only
    assert flag is opts.last_fused.flag and float(flag) == 0.0 and guard._all_finite()
    fused_step(model, opts)
    with torch.no_grad():
        model.gauss_params["means"][4, 1] = float("nan")  # in place, after the step: a new version
    guard.check(3)
    (report,) = guard.reports
    assert report.describe().startswith("step 3: non-finite values: NaN in means (1 gaussian)")
    assert ids(model) == [0, 1, 2, 3, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("deferred", [False, True])
def test_fused_adam_nan_gradient_drops_its_gaussians_as_torch_adam(deferred, capsys):
    """What the guard does with the fused pass's flag is what it does with torch's Adam
    (test_nan_gradient_drops_only_its_gaussians_and_fixes_optimizer_and_strategy_state): the same rows
    dropped, the same report; deferred (MPS): acted on at the next step's check, as before."""
    model, opts, guard = make_fused(deferred)
    fused_step(model, opts)
    guard.check(6)
    model.step = 7
    fused_step(model, opts, lambda m: m.gauss_params["scales"].grad.index_fill_(0, torch.tensor([2, 5]), math.nan))
    assert math.isnan(float(opts.last_fused.flag))
    guard.check(7)
    if deferred:
        assert guard.reports == [] and ids(model) == list(range(N))
        fused_step(model, opts)  # the next step's flag (the other buffer) is clean; step 7's is read now
        guard.check(8)
    assert ids(model) == [0, 1, 3, 4, 6, 7, 8, 9] and guard.dropped == 2
    (report,) = guard.reports
    what = "NaN in the gradient of scales (2 gaussians); NaN in scales (2 gaussians)"
    assert what in report.describe(), report.describe()
    for name, p in model.gauss_params.items():  # the new parameters carry the sliced Adam state
        state = opts.optimizers[name].state[p]
        assert p.shape[0] == N - 2 and torch.isfinite(p).all() and state["exp_avg"].shape == p.shape
    assert "Dropped those 2 of 10 gaussians" in capsys.readouterr().out
    fused_step(model, opts)  # training goes on, fused, with the survivors
    guard.check(9)
    guard.flush(9)
    assert guard.dropped == 2 and len(guard.reports) == 1
