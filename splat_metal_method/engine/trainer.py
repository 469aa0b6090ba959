"""SplatMetalTrainer (``_target`` of ``SplatMetalTrainerConfig``): nerfstudio's Trainer with

* atomic checkpoints: written to a hidden temporary file next to ``nerfstudio_models/`` and renamed
  into place, so a checkpoint file is always complete (older ones are deleted only after);
* exact resumes: each checkpoint also carries what nerfstudio's leaves out and training depends on
  (resume_state.py: the densification strategy's running state, the random generators, the
  datamanager's camera order), so that on CPU a run resumed with ``--load-dir`` ends bit-identical
  to the uninterrupted run with the same seed. A checkpoint without it (an older splat-metal's)
  still resumes, with a one-line note that it cannot be exact;
* Ctrl-C (SIGINT) and SIGTERM: the first finishes the current step, saves a checkpoint of it,
  prints the command that resumes (``--load-dir``) and exits with status 130; a second one exits at
  once without saving (the last checkpoint stays intact). The viewer's "completed" wait loop keeps
  nerfstudio's plain Ctrl-C behaviour;
* a clean stop on NaN/Inf (reliability.NonFiniteError), keeping the last good checkpoint, and on a
  checkpoint that cannot be written (full disk, read-only folder: reliability.CheckpointWriteError),
  naming the file, the previous checkpoint (intact) and the resume command;
* every line a person must read at the end (stopped, failed, finished) printed after the last redraw
  of nerfstudio's progress table, which moves the cursor up over whatever was printed since the one
  before (tests/engine/test_terminal_screen.py reads a terminal's screen);
* a train_lock the viewer gets its turn at (TurnTakingLock);
* under torchrun, one scene sharded across the processes (distributed.py's ShardedRun: rank 0 writes
  the whole scene's checkpoints, serves the viewer and evaluates; a stop on any rank stops all of them
  after the same step).
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Literal, Optional, Sequence, Type

import torch
from nerfstudio.engine.callbacks import TrainingCallback, TrainingCallbackLocation
from nerfstudio.engine.trainer import Trainer
from nerfstudio.utils import comms, writer
from nerfstudio.utils.decorators import check_eval_enabled
from nerfstudio.utils.misc import step_check
from nerfstudio.utils.rich_utils import CONSOLE

from ..patches.checkpoints import find_checkpoint
from . import distributed, resume_state
from .optimizers import GaussianOptimizers
from .reliability import CheckpointWriteError, NonFiniteError, save_checkpoint_file

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what shells report for a Ctrl-C'd command


_RESUME_DROP = ("--load-dir", "--load-checkpoint", "--load-step", "--max-num-iterations", "--timestamp")


def resume_command(argv: Sequence[str], load_dir: Path, steps: int, launcher: str = "") -> str:
    """``argv`` (the command that was run) with --load-dir and --max-num-iterations set so that it
    continues from ``load_dir`` for ``steps`` more steps (nerfstudio counts them from the loaded step).
    --timestamp is dropped: the resumed run gets a folder of its own and overwrites nothing. The two
    options go before a dataparser subcommand (``... nerfstudio-data --load-3D-points False``): tyro
    takes the method's own options only before it.
    ``launcher`` (a distributed run: its torchrun command) goes in front of ``$(command -v ns-train)``."""
    args, skip = [], False
    for a in list(argv)[1:]:
        if skip:
            skip = False
            continue
        if a in _RESUME_DROP:
            skip = True
            continue
        if a.split("=", 1)[0] in _RESUME_DROP:
            continue
        args.append(a)
    at = _dataparser_subcommand(args)
    options = ["--load-dir", str(load_dir), "--max-num-iterations", str(steps)]
    prog = Path(argv[0]).name if argv else "ns-train"
    command = shlex.join([*args[:at], *options, *args[at:]])
    if launcher:
        return f"{launcher} $(command -v {shlex.quote(prog)}) {command}"
    return f"{shlex.quote(prog)} {command}"


def _dataparser_subcommand(args: Sequence[str]) -> int:
    """Where the dataparser subcommand starts in ns-train's arguments (``args[0]`` the method), or
    len(args): the first dataparser name (nerfstudio's, plugins' included) that is no option's value."""
    from nerfstudio.configs.dataparser_configs import all_dataparsers

    for i in range(1, len(args)):
        before = args[i - 1]
        if args[i] in all_dataparsers and not (before.startswith("--") and "=" not in before):
            return i
    return len(args)


class TurnTakingLock:
    """A lock that one thread cannot monopolise. nerfstudio's training loop releases train_lock and
    takes it again at once, every step, while the viewer's render thread waits for the same lock; a
    plain Lock lets the releasing thread win again and again, and with a fast step (the native CPU
    backend) a browser waited minutes for its first frame. Here a thread that wants the lock back
    while another thread waits for it first gives the waiter up to 50 ms to take its turn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._waiting = 0
        self._last_owner: Optional[int] = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        if blocking and self._last_owner == me:
            for _ in range(50):
                if not self._waiting:
                    break
                time.sleep(0.001)
        with self._count:
            self._waiting += 1
        try:
            got = self._lock.acquire(blocking, timeout)
        finally:
            with self._count:
                self._waiting -= 1
        if got:
            self._last_owner = me
        return got

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class SplatMetalTrainer(Trainer):
    """nerfstudio's Trainer with atomic checkpoints that resume exactly, a clean stop on Ctrl-C, SIGTERM
    and NaN/Inf, and a train_lock the viewer gets its turn at (TurnTakingLock)."""

    _stop_signal: Optional[int] = None  # the signal that asked training to stop, once one has
    _last_done_step: Optional[int] = None  # last step whose callbacks (densification included) ran
    _cut_short: bool = False  # the loop ended early on a signal (then the exit status is 130)
    _saved_steps: set
    _rng_to_restore: Optional[Dict[str, Any]] = None  # the loaded checkpoint's generators, until step one

    sharded: Optional[distributed.ShardedRun] = None  # a distributed run (torchrun, more than one process)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.train_lock = TurnTakingLock()  # before setup() hands it to the viewer
        self._collective_failed = False
        try:  # set up already by the config's set_timestamp under ns-train; here for other callers
            ctx = distributed.setup(self.config.machine.device_type, self.config.machine.num_devices)
        except distributed.DistributedError as e:
            raise SystemExit(f"splat-metal distributed: {e}") from None
        if ctx is not None and ctx.world_size > 1:
            self.sharded = distributed.ShardedRun(self, ctx)
            if self.device.startswith("cuda"):
                self.device = f"cuda:{ctx.local_rank}"
            if not ctx.is_main:  # rank 0 serves the viewer (the other ranks' writers are nerfstudio no-ops)
                self.config.vis = "tensorboard"

    def setup(self, test_mode: Literal["test", "val", "inference"] = "val") -> None:
        try:
            super().setup(test_mode)
        except KeyboardInterrupt:
            CONSOLE.print("splat-metal: interrupted before training started; no checkpoint was written.")
            raise SystemExit(INTERRUPTED_EXIT_CODE) from None
        self._saved_steps = set()
        self._held_out = None  # (step, nerfstudio's average metrics over the eval images), for the summary
        average_metrics = self.pipeline.get_average_eval_image_metrics

        def remember_held_out(step=None, **kwargs):
            metrics = average_metrics(step=step, **kwargs)
            self._held_out = (step, metrics)
            return metrics

        self.pipeline.get_average_eval_image_metrics = remember_held_out
        self._last_done_step = self._start_step - 1 if self._start_step > 0 else None
        self._load_resume_state()
        if self.sharded is not None:
            try:
                self.sharded.check_model()
            except distributed.DistributedError as e:
                raise SystemExit(f"splat-metal distributed: {e}") from None
            self._rng_to_restore = self.sharded.start(self._rng_to_restore)
            self.callbacks.append(
                TrainingCallback([TrainingCallbackLocation.AFTER_TRAIN_ITERATION], self.sharded.step_end)
            )
        # First of all callbacks: the generators are put back after everything set-up draws.
        self.callbacks.insert(0, TrainingCallback([TrainingCallbackLocation.BEFORE_TRAIN_ITERATION], self._restore_rng))
        self.callbacks.append(TrainingCallback([TrainingCallbackLocation.AFTER_TRAIN_ITERATION], self._step_done))

    def _step_done(self, step: int) -> None:
        self._last_done_step = step

    def setup_optimizers(self):
        # nerfstudio's Optimizers (Trainer.setup_optimizers), with the gaussians' Adam as one kernel pass on
        # the metal backend (optimizers.py)
        model = self.pipeline.model
        optimizers = GaussianOptimizers(self.config.optimizers.copy(), self.pipeline.get_param_groups(), model)
        if self.sharded is not None:  # the gaussians' learning rates follow the batch of world-size images
            self.sharded.scale_optimizers(optimizers)
        return optimizers

    @check_eval_enabled
    def eval_iteration(self, step: int) -> None:
        if self.sharded is None:
            return super().eval_iteration(step)
        c = self.config
        if not any(step_check(step, every) for every in (c.steps_per_eval_batch, c.steps_per_eval_image,
                                                          c.steps_per_eval_all_images)):  # fmt: skip
            return
        self.sharded.refresh_view()  # collective: rank 0 evaluates the whole scene, alone
        if self.sharded.ctx.is_main:
            super().eval_iteration(step)

    # ---- checkpoints
    def save_checkpoint(self, step: int) -> None:
        """nerfstudio's checkpoint (same contents, same name) plus the resume state, written atomically.
        Distributed: every rank calls it (the shards are gathered), rank 0 writes the whole scene.
        First the NaN guard's pending flags (MPS reads them late) are waited for and acted on: in stop
        mode a non-finite step raises here, before anything is written."""
        guard = getattr(getattr(self.pipeline, "model", None), "nonfinite_guard", None)
        if guard is not None:
            guard.flush(step)
        if self.sharded is not None:
            state = self.sharded.checkpoint_state(step, self._resume_state)
            if state is None:
                self._saved_steps.add(step)
                return
        elif not comms.is_main_process():
            return
        else:
            state = {
                "step": step,
                "pipeline": self.pipeline.module.state_dict()  # type: ignore
                if hasattr(self.pipeline, "module")
                else self.pipeline.state_dict(),
                "optimizers": {k: v.state_dict() for (k, v) in self.optimizers.optimizers.items()},
                "schedulers": {k: v.state_dict() for (k, v) in self.optimizers.schedulers.items()},
                "scalers": self.grad_scaler.state_dict(),
                resume_state.KEY: self._resume_state(),
            }
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        ckpt_path: Path = self.checkpoint_dir / f"step-{step:09d}.ckpt"
        # Staged next to nerfstudio_models/, not in it: nerfstudio parses every name in that folder
        # as step-N.ckpt when it resumes or exports.
        try:
            save_checkpoint_file(state, ckpt_path, step, staging_dir=self.checkpoint_dir.parent)
        except CheckpointWriteError as e:
            last = self._latest_checkpoint()
            intact = f"; the previous checkpoint, {last}, is intact" if last else "; no earlier checkpoint exists"
            raise CheckpointWriteError(
                f"{e.code}{intact}. Free space (or make the folder writable), then resume."
                + (self._resume_hint(int(last.stem.split("-")[1])) if last else "")
            ) from None
        self._saved_steps.add(step)
        if self.config.save_only_latest_checkpoint:
            for f in self.checkpoint_dir.glob("*.ckpt"):
                if f != ckpt_path:
                    f.unlink()

    def _resume_state(self) -> Dict[str, Any]:
        return resume_state.capture(self.pipeline)

    def _loaded_checkpoint(self) -> Optional[Path]:
        """The file nerfstudio's _load_checkpoint loaded (--load-dir [--load-step] or --load-checkpoint)."""
        if self.config.load_dir is not None:  # as patches/checkpoints.py made nerfstudio choose it
            return find_checkpoint(self.config.load_dir, self.config.load_step, resume=True)[0]
        return self.config.load_checkpoint

    def _load_resume_state(self) -> None:
        """After nerfstudio loaded the checkpoint: the rest of what the run was (resume_state.py)."""
        path = self._loaded_checkpoint()
        if path is None:
            return
        state = torch.load(path, map_location="cpu", mmap=True).get(resume_state.KEY)  # weights_only
        if state is None:
            CONSOLE.print(
                f"splat-metal: {path} has no resume state (an older splat-metal wrote it): training continues from "
                "it, but not exactly as it would have gone on (densification statistics, random generators and "
                "camera order start afresh).",
                highlight=False,
                soft_wrap=True,
            )
            return
        for note in resume_state.restore(self.pipeline, state):
            CONSOLE.print(f"splat-metal: resuming from {path}: {note}.", highlight=False, soft_wrap=True)
        self._rng_to_restore = state

    def _restore_rng(self, step: int) -> None:
        if self._rng_to_restore is not None:
            resume_state.restore_rng(self._rng_to_restore)
            self._rng_to_restore = None

    def _latest_checkpoint(self) -> Optional[Path]:
        ckpts = sorted(self.checkpoint_dir.glob("step-*.ckpt")) if self.checkpoint_dir.is_dir() else []
        return ckpts[-1] if ckpts else None

    def _resume_hint(self, step: int) -> str:
        remaining = self._start_step + self.config.max_num_iterations - (step + 1)
        if remaining <= 0:
            return ""
        launcher = self.sharded.resume_prefix() if self.sharded is not None else ""
        return f"\nResume with:\n  {resume_command(sys.argv, self.checkpoint_dir, remaining, launcher)}"

    # ---- signals
    def _on_signal(self, signum, frame) -> None:
        if self._collective_failed:  # torchrun's SIGTERM after the failure this rank is already reporting
            return
        if self._stop_signal is not None:  # the second one: stop now
            if self.sharded is not None:  # torchrun passes a terminal's Ctrl-C on once more: the same request
                return
            raise KeyboardInterrupt
        self._stop_signal = signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.sharded is not None:  # every rank stops after the same step (ShardedRun.step_end)
            self.sharded.stop_requested = True
            CONSOLE.print(
                f"\nsplat-metal: {name}: every rank finishes the current step, then the whole scene is saved "
                "and training stops (torchrun ends the processes 30 s after a signal of its own).",
                highlight=False,
                soft_wrap=True,
            )
            return
        self.stop_training = True
        CONSOLE.print(
            f"\nsplat-metal: {name}: finishing the current step, then saving a checkpoint and stopping "
            f"({name} again stops at once without saving).",
            highlight=False,
            soft_wrap=True,
        )

    def agree_to_stop(self, ranks: Sequence[int]) -> None:
        """A distributed run: some rank got a stop signal; every rank stops after this step."""
        self.stop_training = True
        if self._stop_signal is None:
            self._stop_signal = signal.SIGINT
            CONSOLE.print(
                f"splat-metal distributed: rank {', '.join(map(str, ranks))} asked to stop: saving after this step.",
                highlight=False,
                soft_wrap=True,
            )

    @contextlib.contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():  # after a failed collective torchrun's SIGTERM stays ignored
                signal.signal(s, signal.SIG_IGN if self._collective_failed and s == signal.SIGTERM else handler)

    def _restore_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    # ---- the loop
    def train(self) -> None:
        try:
            with self._stop_on_signals():
                try:
                    super().train()
                except RuntimeError as e:
                    if self.sharded is None or not distributed.is_collective_failure(e):
                        raise
                    self._stop_after_collective_failure(e)
        except NonFiniteError as e:
            self._stop(f"{e.message}{self._last_good()}", NonFiniteError)
        except CheckpointWriteError as e:
            self._stop(str(e.code), CheckpointWriteError)
        except KeyboardInterrupt:
            if self.training_state == "completed":  # Ctrl-C in the viewer's wait after training: quit
                self._shutdown()
                return
            last = self._latest_checkpoint()
            self._stop(
                "stopped at once without saving; "
                + (f"the last checkpoint, {last}, is intact." if last else "no checkpoint was written.")
                + (self._resume_hint(int(last.stem.split("-")[1])) if last else ""),
                None,
            )
        if self._cut_short:  # _after_train saved the checkpoint and shut the viewer down
            raise SystemExit(INTERRUPTED_EXIT_CODE)
        self._shutdown()  # finished: no viewer render may still be running when the process exits

    def _stop_after_collective_failure(self, error: RuntimeError) -> None:
        """Another rank died, hung or was stopped. torchrun sees the same failure and sends this rank SIGTERM
        a moment later: from here on that signal is ignored (``_on_signal``), and the message is written
        and flushed before anything else, inside the signal handlers, so it cannot be lost to the race."""
        self._collective_failed = True
        message = (
            f"splat-metal distributed: rank {self.sharded.ctx.rank} stopped at step {self.step}: a collective with "
            f"the other ranks failed ({str(error).splitlines()[0][:300]}). Another rank died, hung or was stopped: "
            f"torchrun's summary names it.{self._last_good()}"
        )
        print(message, file=sys.stderr, flush=True)
        writer.write_out_storage()
        self._shutdown()
        raise distributed.CollectiveFailed(1)

    def _last_good(self) -> str:
        last = self._latest_checkpoint()
        if last is None:
            return "\nNo checkpoint had been written yet."
        return f"\nThe last good checkpoint is kept: {last}{self._resume_hint(int(last.stem.split('-')[1]))}"

    def _shutdown(self, timeout: float = 60.0) -> None:
        """Waits for the viewer's render threads to finish the render they are in, then nerfstudio's
        shutdown (stops the viewer's server). The render threads are daemons: one still inside torch
        when the interpreter exits is killed mid-C++ and aborts the process ("terminate called without
        an active exception", exit status -6), as happened when Ctrl-C came during a viewer render."""
        machines = list((getattr(self.viewer_state, "render_statemachines", None) or {}).values())
        for m in machines:
            m.running = False  # its loop ends after the current render
        for m in machines:
            if isinstance(m, threading.Thread) and m.is_alive() and m is not threading.current_thread():
                m.join(timeout)
        self.shutdown()

    def _stop(self, message: str, error: Optional[Type[SystemExit]]) -> None:
        writer.write_out_storage()
        self._shutdown()
        if error is not None:
            raise error(message) from None
        CONSOLE.print(f"splat-metal: {message}", highlight=False, soft_wrap=True)
        raise SystemExit(INTERRUPTED_EXIT_CODE)

    def _train_complete_viewer(self) -> None:
        self._restore_signals()  # nerfstudio's wait loop after training ("Use ctrl+c to quit")
        self._print_finished()
        return super()._train_complete_viewer()

    def _print_finished(self) -> None:
        """Where the finished run's checkpoint is and the command that trains it further: after
        nerfstudio's panel, when nothing redraws the progress table any more."""
        if getattr(self, "_finished_printed", False) or not comms.is_main_process():
            return
        self._finished_printed = True
        last = self._latest_checkpoint()
        if last is None:
            return
        steps = self.config.max_num_iterations
        command = resume_command(sys.argv, self.checkpoint_dir, steps,
                                 self.sharded.resume_prefix() if self.sharded is not None else "")  # fmt: skip
        config = self.base_dir / "config.yml"
        export = f"splat-metal-export --load-config {config} --output-dir {self.base_dir / 'exports'} --format ply"
        CONSOLE.print(
            f"splat-metal: training finished; checkpoint: {last}{self._held_out_line()}\n"
            f"To export the splat:\n  {export}\nTo train {steps:,} steps more:\n  {command}",
            highlight=False,
            soft_wrap=True,
        )

    def _held_out_line(self) -> str:
        """The held-out images' average PSNR/SSIM/LPIPS of the run's last all-images eval ('' if none ran)."""
        if self._held_out is None:
            return ""
        step, metrics = self._held_out
        shown = [f"PSNR {metrics['psnr']:.2f} dB" if "psnr" in metrics else None,
                 f"SSIM {metrics['ssim']:.3f}" if "ssim" in metrics else None,
                 f"LPIPS {metrics['lpips']:.3f}" if "lpips" in metrics else None]  # fmt: skip
        images = len(self.pipeline.datamanager.eval_dataset)
        return f"\nheld-out images ({images}, step {step}): " + ", ".join(x for x in shown if x)

    def _after_train(self) -> None:
        if self._stop_signal is None:
            if self.sharded is not None:  # the viewer, if it stays up, shows the finished scene
                self.sharded.refresh_view()
            super()._after_train()
            self._print_finished()
            return
        self._cut_short = True
        step = self._last_done_step
        if step is not None and step not in self._saved_steps:
            self.save_checkpoint(step)
        # The progress table (nerfstudio's LocalWriter) moves the cursor up over everything printed since
        # its last redraw: flush it first, so that nothing redraws over the message.
        writer.write_out_storage()
        self._shutdown()
        if step is None:
            CONSOLE.print("splat-metal: stopped before the first step finished; no checkpoint was written.")
        else:
            ckpt = self.checkpoint_dir / f"step-{step:09d}.ckpt"
            CONSOLE.print(
                f"splat-metal: training stopped after step {step}; checkpoint saved: {ckpt}{self._resume_hint(step)}",
                highlight=False,
                soft_wrap=True,
            )
