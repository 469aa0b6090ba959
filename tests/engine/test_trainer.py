"""In-process tests of splat_metal_method/engine/trainer.py and resume_state.py: checkpoints written
atomically under a failure mid-write, the resume state through torch's weights_only load, the resume
command, the signal handler, the train lock. tests/engine/test_resume_cli.py drives exact resumes through
the real command lines; test_reliability_cli.py drives Ctrl-C with the viewer."""

from __future__ import annotations

import random
import signal
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from splat_metal_method.engine import resume_state
from splat_metal_method.engine.trainer import SplatMetalTrainer, TurnTakingLock, resume_command


def _listing(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------
def _fake_trainer(tmp_path: Path):
    from torch.cuda.amp import GradScaler

    pipeline = torch.nn.Linear(3, 2)
    return types.SimpleNamespace(
        checkpoint_dir=tmp_path / "run" / "nerfstudio_models",
        pipeline=pipeline,
        optimizers=types.SimpleNamespace(optimizers={"a": torch.optim.Adam(pipeline.parameters())}, schedulers={}),
        grad_scaler=GradScaler(enabled=False),
        config=types.SimpleNamespace(save_only_latest_checkpoint=True),
        _saved_steps=set(),
        _resume_state=lambda: {"format": resume_state.FORMAT},
        sharded=None,  # not a distributed run
    )


def test_checkpoint_interrupted_mid_write_leaves_the_previous_one(tmp_path, monkeypatch):
    trainer = _fake_trainer(tmp_path)
    save = SplatMetalTrainer.save_checkpoint
    save(trainer, 10)
    first = trainer.checkpoint_dir / "step-000000010.ckpt"
    good = first.read_bytes()
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):  # writes part of a checkpoint, then Ctrl-C arrives
        real_save(obj, f, *args, **kwargs)
        f.truncate(100)  # a file object: the checkpoint is written through one (reliability.save_checkpoint_file)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save(trainer, 20)
    assert _listing(trainer.checkpoint_dir) == {first.name: good}
    assert sorted(p.name for p in trainer.checkpoint_dir.parent.iterdir()) == ["nerfstudio_models"]  # no temp
    monkeypatch.setattr(torch, "save", real_save)
    save(trainer, 20)
    assert [p.name for p in trainer.checkpoint_dir.iterdir()] == ["step-000000020.ckpt"]  # older one removed after
    assert torch.load(trainer.checkpoint_dir / "step-000000020.ckpt")["step"] == 20  # weights_only default


# --------------------------------------------------------------------------------------------------
# Resume command and signals
# --------------------------------------------------------------------------------------------------
def test_resume_command_replaces_load_and_length_options():
    argv = ["/venv/bin/ns-train", "splat-metal", "--data", "my scene", "--max-num-iterations", "3000",
            "--load-dir=old", "--timestamp", "t1", "--vis", "viewer"]  # fmt: skip
    cmd = resume_command(argv, Path("outputs/x/nerfstudio_models"), 1234)
    assert cmd == (
        "ns-train splat-metal --data 'my scene' --vis viewer "
        "--load-dir outputs/x/nerfstudio_models --max-num-iterations 1234"
    )


@pytest.mark.parametrize(
    "tail, expected_tail",
    [
        (["nerfstudio-data", "--load-3D-points", "False"], "R nerfstudio-data --load-3D-points False"),
        (["colmap", "--downscale-factor", "2"], "R colmap --downscale-factor 2"),
        (["--vis=viewer", "colmap"], "--vis=viewer R colmap"),  # after a --flag=value: the subcommand
    ],
)
def test_resume_command_puts_its_options_before_the_dataparser_subcommand(tail, expected_tail):
    """tyro takes the method's options only before a dataparser subcommand: the resume's two options go
    there, and a scene folder named like a dataparser (--data colmap) stays the option's value."""
    argv = ["ns-train", "splat-metal", "--data", "colmap", "--max-num-iterations", "3000", *tail]
    cmd = resume_command(argv, Path("m"), 7)
    assert cmd == "ns-train splat-metal --data colmap " + expected_tail.replace(
        "R", "--load-dir m --max-num-iterations 7"
    )


def test_first_signal_asks_to_stop_second_stops_at_once():
    trainer = types.SimpleNamespace(stop_training=False, _stop_signal=None, sharded=None, _collective_failed=False)
    handler = SplatMetalTrainer._on_signal.__get__(trainer)
    handler(signal.SIGINT, None)
    assert trainer.stop_training and trainer._stop_signal == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, None)


def test_distributed_signal_is_agreed_on_and_a_repeat_is_the_same_request():
    """Under torchrun the ranks stop after the step they agree on (ShardedRun.step_end), not each on its
    own; a terminal's Ctrl-C reaches every rank and then again through torchrun: not a second press."""
    sharded = types.SimpleNamespace(stop_requested=False)
    trainer = types.SimpleNamespace(stop_training=False, _stop_signal=None, sharded=sharded, _collective_failed=False)
    handler = SplatMetalTrainer._on_signal.__get__(trainer)
    handler(signal.SIGINT, None)
    assert sharded.stop_requested and not trainer.stop_training and trainer._stop_signal == signal.SIGINT
    handler(signal.SIGINT, None)  # no KeyboardInterrupt
    assert sharded.stop_requested and not trainer.stop_training


def test_after_a_failed_collective_torchruns_sigterm_is_ignored():
    """A rank that saw a collective fail is writing why; torchrun's SIGTERM for the same failure neither asks
    for a step nor interrupts it (tests/engine/test_distributed_cli.py runs the real race)."""
    sharded = types.SimpleNamespace(stop_requested=False)
    trainer = types.SimpleNamespace(stop_training=False, _stop_signal=None, sharded=sharded, _collective_failed=True)
    handler = SplatMetalTrainer._on_signal.__get__(trainer)
    for _ in range(2):
        handler(signal.SIGTERM, None)
    assert not sharded.stop_requested and not trainer.stop_training and trainer._stop_signal is None


def _turn_order(lock) -> list:
    """The training thread (here: this one) releases the lock and takes it straight back while a
    render thread waits for it: who gets it first?"""
    import threading
    import time

    order = []

    def render():
        with lock:
            order.append("render")

    lock.acquire()
    thread = threading.Thread(target=render)
    thread.start()
    time.sleep(0.2)  # the render thread is now blocked on the lock
    lock.release()
    with lock:  # nerfstudio's next training step
        order.append("train")
    thread.join()
    return order


def test_train_lock_gives_a_waiting_render_its_turn():
    """nerfstudio's training loop re-takes train_lock right after releasing it; with a plain Lock the
    releasing thread usually wins again, and with fast steps a browser waited minutes for a frame."""
    import threading

    assert [_turn_order(TurnTakingLock()) for _ in range(5)] == [["render", "train"]] * 5
    plain = [_turn_order(threading.Lock()) for _ in range(5)]
    print("plain Lock turn orders:", plain)  # shows the problem the TurnTakingLock fixes


def test_config_yml_of_runs_before_the_trainer_moved_still_loads():
    """config.yml files name the Trainer class; older ones name it in reliability.py."""
    old = yaml.load("!!python/name:splat_metal_method.reliability.SplatMetalTrainer ''", Loader=yaml.Loader)
    assert old is SplatMetalTrainer


# --------------------------------------------------------------------------------------------------
# Resume state
# --------------------------------------------------------------------------------------------------
def _pipeline(n: int = 6, strategy=None):
    """The parts of a VanillaPipeline that resume_state reads: a FullImageDatamanager's camera queues
    and generator, a splatfacto model's gaussians and gsplat strategy with its running state."""
    from gsplat.strategy import DefaultStrategy

    strategy = strategy or DefaultStrategy(refine_scale2d_stop_iter=100)
    state = strategy.initialize_state(**({"scene_scale": 1.0} if isinstance(strategy, DefaultStrategy) else {}))
    g = torch.Generator().manual_seed(0)
    state.update(grad2d=torch.rand(n, generator=g), count=torch.rand(n, generator=g), radii=torch.rand(n, generator=g))
    generator = random.Random(3)
    cameras = list(range(5))
    generator.shuffle(cameras)
    datamanager = types.SimpleNamespace(
        train_unseen_cameras=cameras[2:], eval_unseen_cameras=[1], random_generator=generator,
        train_dataset=[None] * 5, eval_dataset=[None] * 2,
    )  # fmt: skip
    model = types.SimpleNamespace(gauss_params={"means": torch.zeros(n, 3)}, strategy=strategy, strategy_state=state)
    return types.SimpleNamespace(datamanager=datamanager, model=model)


def _draws(pipeline) -> tuple:
    """What the next training steps would draw from every generator and queue."""
    dm = pipeline.datamanager
    queue = list(dm.train_unseen_cameras)
    dm.random_generator.shuffle(queue)
    return (torch.rand(4).tolist(), np.random.rand(3).tolist(), random.random(), queue, list(dm.eval_unseen_cameras))


def test_resume_state_loads_weights_only_and_restores_every_part(tmp_path):
    pipeline = _pipeline()
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    path = tmp_path / "step-000000009.ckpt"
    torch.save({"step": 9, resume_state.KEY: resume_state.capture(pipeline)}, path)
    expected_state = {k: v.clone() if torch.is_tensor(v) else v for k, v in pipeline.model.strategy_state.items()}
    expected = _draws(pipeline)

    fresh = _pipeline()  # another process: everything drawn afresh, statistics of its own
    fresh.datamanager.train_unseen_cameras.pop(0)
    fresh.datamanager.random_generator.random()
    fresh.model.strategy_state["grad2d"].zero_()
    state_dict = fresh.model.strategy_state
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    loaded = torch.load(path, map_location="cpu", weights_only=True)[resume_state.KEY]
    assert resume_state.restore(fresh, loaded) == []
    resume_state.restore_rng(loaded)
    assert fresh.model.strategy_state is state_dict  # restored in place: the strategy and its helpers share it
    assert fresh.model.strategy_state.keys() == expected_state.keys()
    for k, v in expected_state.items():
        got = fresh.model.strategy_state[k]
        assert torch.equal(got, v) if torch.is_tensor(v) else got == v, k
    assert _draws(fresh) == expected


def test_resume_state_that_does_not_fit_is_left_out_with_a_note():
    from gsplat.strategy import MCMCStrategy

    source = _pipeline(n=6)
    state = resume_state.capture(source)
    other = _pipeline(n=7)  # another gaussian count
    before = other.model.strategy_state["grad2d"].clone()
    (note,) = resume_state.restore(other, state)
    assert note == "the checkpoint's densification state does not match its 7 gaussians; it starts afresh"
    assert torch.equal(other.model.strategy_state["grad2d"], before)
    mcmc = _pipeline(strategy=MCMCStrategy())  # another strategy
    (note,) = resume_state.restore(mcmc, state)
    assert note == (
        "the checkpoint's densification state is DefaultStrategy's, this run uses MCMCStrategy: it starts afresh"
    )
    smaller = _pipeline()
    smaller.datamanager.train_dataset = [None] * 2  # another dataset
    (note,) = resume_state.restore(smaller, state)
    assert "camera order does not fit this dataset" in note


def test_fused_adam_steps_are_seen_by_version_counters():
    """torch's fused Adam does not bump a parameter's in-place version counter (its single-tensor path
    does); splat-metal's optimizer config bumps it after each step, because the viewer's device copy of
    the gaussians (render_device.py) is refreshed only when a parameter's version changes."""
    from splat_metal_method.method.configs import FusedAdamOptimizerConfig

    p = torch.nn.Parameter(torch.randn(8))
    optimizer = FusedAdamOptimizerConfig(lr=0.1, eps=1e-15).setup([p])
    assert all(g["fused"] for g in optimizer.param_groups)
    for step in range(1, 3):
        p.grad = torch.randn(8)
        before, version = p.detach().clone(), p._version
        optimizer.step()
        assert not torch.equal(p.detach(), before) and p._version > version, step
