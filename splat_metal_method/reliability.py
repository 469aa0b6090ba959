"""Training that survives imperfect numbers and impatient users.

Three mechanisms, each small:

* ``NonFiniteGuard`` (a TrainingCallback the model registers): after every training step, after the
  optimizer step and the densification strategy, it checks every parameter and gradient for NaN/Inf.
  The common case costs one reduction per tensor and one device sync. When something is not finite it
  says at which step, in which parameter (value or gradient) and in how many gaussians, then
  (``--pipeline.model.nonfinite``):
    - ``recover`` (default): drops the offending gaussians with gsplat's ``ops.remove``, which also
      slices the optimizer state and the strategy's running statistics, and training continues;
    - ``stop``: raises ``NonFiniteError`` before the step's checkpoint is written, so the last
      checkpoint on disk is the last good one; ns-train prints the message (no traceback), exit 1.
  Non-finite values outside the gaussians (camera pose corrections, bilateral grid) cannot be dropped,
  and neither can every gaussian: those stop training in both modes.
  Why after the step: NaN/Inf gradients always make the Adam update of their rows non-finite, and
  gaussians densified from a poisoned one inherit the poison, so one scan of the values after
  everything else catches all of them without re-indexing across densification.

* ``SplatMetalTrainer`` (``_target`` of ``SplatMetalTrainerConfig``): nerfstudio's Trainer with
    - atomic checkpoints: written to a hidden temporary file next to ``nerfstudio_models/`` and
      renamed into place, so a checkpoint file is always complete (older ones are deleted only after);
    - Ctrl-C (SIGINT) and SIGTERM: the first finishes the current step, saves a checkpoint of it,
      prints the command that resumes (``--load-dir``) and exits with status 130; a second one exits
      at once without saving (the last checkpoint stays intact). The viewer's "completed" wait loop
      keeps nerfstudio's plain Ctrl-C behaviour.

* ``install_atomic_ply_export``: nerfstudio's ``ns-export gaussian-splat`` opens the target .ply with
  ``open(filename, "wb")`` and writes it value by value, so an interrupted export leaves a truncated
  file where the user's previous export was. When a SplatMetalModel is built in a process that has
  loaded nerfstudio's exporter (that is, in ``ns-export``), ``ExportGaussianSplat.write_ply`` is
  wrapped to write the same bytes to a hidden temporary file in the same folder and rename it over
  the target. Nothing else of the exporter changes; the patch is idempotent and only active in that
  process. (Our package is imported by ns-export before the exporter's classes exist, hence the
  model-construction hook instead of an import-time patch.) A SIGKILL can leave a hidden
  ``.NAME.partial-PID`` file behind, never a partial ``NAME``.

Testing aid: ``SPLAT_METAL_INJECT_NAN_AT_STEP=STEP[:PARAM[:ROWS]]`` sets the gradient of PARAM
(default ``scales``; any optimizer group, e.g. ``camera_opt``) to NaN at STEP, in its first ROWS
gaussians (default 3; all of it for non-gaussian groups), right before the optimizer step, as a real
numerical blow-up would. It is meant for tests and for trying the two modes; never set it otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, Type

import torch
from nerfstudio.engine.callbacks import TrainingCallback, TrainingCallbackLocation
from nerfstudio.engine.trainer import Trainer
from nerfstudio.utils import writer
from nerfstudio.utils.decorators import check_main_thread
from nerfstudio.utils.rich_utils import CONSOLE

NONFINITE_MODES = ("recover", "stop")
INJECT_NAN_ENV = "SPLAT_METAL_INJECT_NAN_AT_STEP"
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what shells report for a Ctrl-C'd command


class NonFiniteError(SystemExit):
    """NaN/Inf in training that is not (or may not be) recovered. ``str(e)`` is the whole message.

    A SystemExit, like dataparser.DatasetError, so that ns-train prints only the message (exit 1)."""

    def __init__(self, message: str):
        super().__init__(message if message.startswith("splat-metal: ") else f"splat-metal: {message}")

    @property
    def message(self) -> str:
        return str(self.code)


# --------------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_path(target: Path, staging_dir: Optional[Path] = None) -> Iterator[Path]:
    """Yields a temporary path; when the block succeeds, the file written there replaces ``target``
    in one rename (``os.replace``). On any exception (KeyboardInterrupt included) the temporary file
    is removed and ``target`` is untouched. ``staging_dir`` (default: target's folder) must be on the
    same filesystem; the temporary name is hidden: ``.NAME.partial-PID``."""
    target = Path(target)
    tmp = Path(staging_dir or target.parent) / f".{target.name}.partial-{os.getpid()}"
    try:
        yield tmp
        with open(tmp, "rb+") as f:  # on disk before the rename: a crash cannot leave an empty target
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


# --------------------------------------------------------------------------------------------------
# Non-finite values
# --------------------------------------------------------------------------------------------------
def _kind(t: torch.Tensor) -> str:
    nan, inf = bool(torch.isnan(t).any()), bool(torch.isinf(t).any())
    return "NaN and Inf" if nan and inf else ("NaN" if nan else "Inf")


def _bad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """[n] bool: rows of ``t`` (first dim n) holding a non-finite value."""
    return ~torch.isfinite(t.detach().reshape(n, -1)).all(dim=1)


@dataclass
class NonFiniteReport:
    step: int
    n_gaussians: int
    bad_rows: torch.Tensor  # [N] bool
    findings: List[Tuple[str, str, int]] = field(default_factory=list)  # (where, NaN/Inf, gaussians)
    outside: List[Tuple[str, str]] = field(default_factory=list)  # (group, NaN/Inf): not per gaussian

    @property
    def n_bad(self) -> int:
        return int(self.bad_rows.sum())

    def describe(self) -> str:
        parts = [f"{kind} in {where} ({count:,} gaussian{'s' * (count != 1)})" for where, kind, count in self.findings]
        parts += [f"{kind} in {where}" for where, kind in self.outside]
        return f"step {self.step}: non-finite values: " + "; ".join(parts)


def _parse_injection(value: str) -> Tuple[int, str, int]:
    bits = value.split(":")
    try:
        step = int(bits[0])
        name = bits[1] if len(bits) > 1 and bits[1] else "scales"
        rows = int(bits[2]) if len(bits) > 2 else 3
    except ValueError:
        raise NonFiniteError(f"{INJECT_NAN_ENV}={value!r}: expected STEP[:PARAM[:ROWS]], e.g. 100:scales:3") from None
    return step, name, rows


class NonFiniteGuard:
    """Checks a SplatfactoModel's parameters and gradients after every step (see the module doc)."""

    def __init__(self, model, optimizers: Dict[str, torch.optim.Optimizer], mode: str = "recover"):
        if mode not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {mode!r}")
        self.model = model
        self.optimizers = optimizers  # group name -> torch optimizer (nerfstudio's Optimizers.optimizers)
        self.mode = mode
        self.dropped = 0  # gaussians dropped so far (recover)
        self.reports: List[NonFiniteReport] = []
        injection = os.environ.get(INJECT_NAN_ENV)
        if injection:
            self._install_injection(*_parse_injection(injection))

    def training_callbacks(self) -> List[TrainingCallback]:
        """Register after splatfacto's own (the strategy's step_post_backward) and the memory hooks."""
        return [TrainingCallback([TrainingCallbackLocation.AFTER_TRAIN_ITERATION], self.check)]

    # ---- checking
    def _other_params(self) -> List[Tuple[str, torch.Tensor]]:
        params = self.model.gauss_params
        return [
            (group, p)
            for group, opt in self.optimizers.items()
            if group not in params
            for g in opt.param_groups
            for p in g["params"]
        ]

    def _all_finite(self) -> bool:
        """One reduction per tensor and one sync. A finite tensor whose sum overflows is a false alarm
        that scan() sorts out."""
        tensors = list(self.model.gauss_params.values()) + [p for _, p in self._other_params()]
        sums = [t.detach().sum() for t in tensors] + [t.grad.sum() for t in tensors if t.grad is not None]
        if not sums:
            return True
        device = sums[0].device
        return bool(torch.isfinite(torch.stack([s.to(device).float() for s in sums])).all())

    def scan(self, step: int) -> Optional[NonFiniteReport]:
        """None when everything is finite, else what is not (and which gaussians)."""
        if self._all_finite():
            return None
        params = self.model.gauss_params
        n = params["means"].shape[0]
        report = NonFiniteReport(step, n, torch.zeros(n, dtype=torch.bool, device=params["means"].device))
        if n > 0:
            for name, p in params.items():
                for where, t in ((f"the gradient of {name}", p.grad), (name, p)):
                    if t is None or t.shape != p.shape:
                        continue
                    rows = _bad_rows(t, n)
                    if rows.any():
                        report.findings.append((where, _kind(t), int(rows.sum())))
                        report.bad_rows |= rows
            for key, t in getattr(self.model, "strategy_state", {}).items():
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 and t.shape[0] == n:
                    rows = _bad_rows(t, n)
                    if rows.any():
                        report.findings.append((f"the densification statistics ({key})", _kind(t), int(rows.sum())))
                        report.bad_rows |= rows
        for group, p in self._other_params():
            for where, t in ((f"the gradient of {group}", p.grad), (group, p)):
                if t is not None and not bool(torch.isfinite(t).all()):
                    report.outside.append((where, _kind(t)))
        if not report.findings and not report.outside:
            return None  # a sum overflowed; every value is finite
        return report

    def check(self, step: int) -> None:
        report = self.scan(step)
        if report is None:
            return
        self.reports.append(report)
        what = report.describe()
        if report.outside:
            raise NonFiniteError(
                f"{what}. These are not per-gaussian values, so dropping gaussians cannot repair them; training "
                "stopped before saving this step. Try lower learning rates for those parameters."
            )
        if self.mode == "stop":
            raise NonFiniteError(
                f"{what}. Training stopped before saving this step (--pipeline.model.nonfinite stop). "
                "--pipeline.model.nonfinite recover drops such gaussians and continues; lower learning rates "
                "(e.g. --optimizers.scales.optimizer.lr) avoid the blow-up."
            )
        if report.n_bad >= report.n_gaussians:
            raise NonFiniteError(
                f"{what}: all {report.n_gaussians:,} gaussians are affected, nothing would be left to train; "
                "training stopped before saving this step."
            )
        from gsplat.strategy import ops

        with torch.no_grad():
            ops.remove(self.model.gauss_params, self.optimizers, self.model.strategy_state, report.bad_rows)
        self.dropped += report.n_bad
        CONSOLE.print(
            f"splat-metal: {what}. Dropped those {report.n_bad:,} of {report.n_gaussians:,} gaussians and "
            "continuing (--pipeline.model.nonfinite recover).",
            highlight=False,
            soft_wrap=True,
        )

    # ---- testing aid
    def _install_injection(self, at_step: int, name: str, rows: int) -> None:
        if name not in self.optimizers:
            raise NonFiniteError(f"{INJECT_NAN_ENV}: no optimizer group {name!r}; groups: {sorted(self.optimizers)}")
        gaussian = name in self.model.gauss_params

        def hook(optimizer, args, kwargs):
            if getattr(self.model, "step", None) != at_step:
                return
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        if gaussian:
                            p.grad[:rows] = float("nan")
                        else:
                            p.grad.fill_(float("nan"))
            CONSOLE.print(f"splat-metal: {INJECT_NAN_ENV}: NaN injected into the gradient of {name} at step {at_step}")

        self.optimizers[name].register_step_pre_hook(hook)


# --------------------------------------------------------------------------------------------------
# Trainer: atomic checkpoints, clean stop on Ctrl-C / SIGTERM, clean stop on non-finite values
# --------------------------------------------------------------------------------------------------
_RESUME_DROP = ("--load-dir", "--load-checkpoint", "--load-step", "--max-num-iterations", "--timestamp")


def resume_command(argv: Sequence[str], load_dir: Path, steps: int) -> str:
    """``argv`` (the command that was run) with --load-dir and --max-num-iterations set so that it
    continues from ``load_dir`` for ``steps`` more steps (nerfstudio counts them from the loaded step).
    --timestamp is dropped: the resumed run gets a folder of its own and overwrites nothing."""
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
    prog = Path(argv[0]).name if argv else "ns-train"
    return shlex.join([prog, *args, "--load-dir", str(load_dir), "--max-num-iterations", str(steps)])


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
    """nerfstudio's Trainer with atomic checkpoints, a clean stop on Ctrl-C, SIGTERM and NaN/Inf, and a
    train_lock the viewer gets its turn at (TurnTakingLock)."""

    _stop_signal: Optional[int] = None  # the signal that asked training to stop, once one has
    _last_done_step: Optional[int] = None  # last step whose callbacks (densification included) ran
    _cut_short: bool = False  # the loop ended early on a signal (then the exit status is 130)
    _saved_steps: set

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.train_lock = TurnTakingLock()  # before setup() hands it to the viewer

    def setup(self, test_mode: Literal["test", "val", "inference"] = "val") -> None:
        try:
            super().setup(test_mode)
        except KeyboardInterrupt:
            CONSOLE.print("splat-metal: interrupted before training started; no checkpoint was written.")
            raise SystemExit(INTERRUPTED_EXIT_CODE) from None
        self._saved_steps = set()
        self._last_done_step = self._start_step - 1 if self._start_step > 0 else None
        self.callbacks.append(TrainingCallback([TrainingCallbackLocation.AFTER_TRAIN_ITERATION], self._step_done))

    def _step_done(self, step: int) -> None:
        self._last_done_step = step

    # ---- checkpoints
    @check_main_thread
    def save_checkpoint(self, step: int) -> None:
        """nerfstudio's checkpoint (same contents, same name), written atomically."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        ckpt_path: Path = self.checkpoint_dir / f"step-{step:09d}.ckpt"
        state = {
            "step": step,
            "pipeline": self.pipeline.module.state_dict()  # type: ignore
            if hasattr(self.pipeline, "module")
            else self.pipeline.state_dict(),
            "optimizers": {k: v.state_dict() for (k, v) in self.optimizers.optimizers.items()},
            "schedulers": {k: v.state_dict() for (k, v) in self.optimizers.schedulers.items()},
            "scalers": self.grad_scaler.state_dict(),
        }
        # Staged next to nerfstudio_models/, not in it: nerfstudio parses every name in that folder
        # as step-N.ckpt when it resumes or exports.
        with atomic_path(ckpt_path, staging_dir=self.checkpoint_dir.parent) as tmp:
            torch.save(state, tmp)
        self._saved_steps.add(step)
        if self.config.save_only_latest_checkpoint:
            for f in self.checkpoint_dir.glob("*.ckpt"):
                if f != ckpt_path:
                    f.unlink()

    def _latest_checkpoint(self) -> Optional[Path]:
        ckpts = sorted(self.checkpoint_dir.glob("step-*.ckpt")) if self.checkpoint_dir.is_dir() else []
        return ckpts[-1] if ckpts else None

    def _resume_hint(self, step: int) -> str:
        remaining = self._start_step + self.config.max_num_iterations - (step + 1)
        if remaining <= 0:
            return ""
        return f"\nResume with:\n  {resume_command(sys.argv, self.checkpoint_dir, remaining)}"

    # ---- signals
    def _on_signal(self, signum, frame) -> None:
        if self._stop_signal is not None:  # the second one: stop now
            raise KeyboardInterrupt
        self._stop_signal = signum
        self.stop_training = True
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        CONSOLE.print(
            f"\nsplat-metal: {name}: finishing the current step, then saving a checkpoint and stopping "
            f"({name} again stops at once without saving).",
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
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _restore_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    # ---- the loop
    def train(self) -> None:
        try:
            with self._stop_on_signals():
                super().train()
        except NonFiniteError as e:
            self._stop(f"{e.message}{self._last_good()}", NonFiniteError)
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
        return super()._train_complete_viewer()

    def _after_train(self) -> None:
        if self._stop_signal is None:
            return super()._after_train()
        self._cut_short = True
        step = self._last_done_step
        if step is None:
            CONSOLE.print("splat-metal: stopped before the first step finished; no checkpoint was written.")
        else:
            if step not in self._saved_steps:
                self.save_checkpoint(step)
            ckpt = self.checkpoint_dir / f"step-{step:09d}.ckpt"
            CONSOLE.print(
                f"splat-metal: training stopped after step {step}; checkpoint saved: {ckpt}{self._resume_hint(step)}",
                highlight=False,
                soft_wrap=True,
            )
        writer.write_out_storage()
        self._shutdown()


# --------------------------------------------------------------------------------------------------
# ns-export gaussian-splat: write then rename
# --------------------------------------------------------------------------------------------------
_ATOMIC_MARK = "_splat_metal_atomic"


def atomic_ply_writer(write_ply: Callable) -> Callable:
    """``write_ply(filename, count, map_to_tensors)`` that writes to a temporary file and renames it."""

    def write(filename, count, map_to_tensors):
        target = Path(filename)
        try:
            with atomic_path(target) as tmp:
                write_ply(str(tmp), count, map_to_tensors)
        except KeyboardInterrupt:
            raise SystemExit(
                f"splat-metal: export interrupted; {target} was not written"
                + (" (the file already there is untouched)." if target.exists() else ".")
            ) from None

    setattr(write, _ATOMIC_MARK, True)
    write.__wrapped__ = write_ply  # type: ignore[attr-defined]
    write.__doc__ = (write_ply.__doc__ or "") + "\n(splat-metal: written to a temporary file, then renamed.)"
    return write


def install_atomic_ply_export() -> bool:
    """Wraps nerfstudio's ExportGaussianSplat.write_ply if the exporter is loaded in this process.
    Returns whether it is (now) wrapped."""
    exporter = sys.modules.get("nerfstudio.scripts.exporter")
    cls = getattr(exporter, "ExportGaussianSplat", None)
    if cls is None:
        return False
    current = cls.__dict__.get("write_ply")
    func = current.__func__ if isinstance(current, staticmethod) else current
    if func is None:
        return False
    if not getattr(func, _ATOMIC_MARK, False):
        cls.write_ply = staticmethod(atomic_ply_writer(func))
    return True
