"""Training that survives imperfect numbers and interrupted exports (the Trainer's clean stop on
Ctrl-C/SIGTERM and its atomic checkpoints are in trainer.py).

Two mechanisms, each small:

* ``NonFiniteGuard`` (a TrainingCallback the model registers): after every training step, after the
  optimizer step and the densification strategy, it checks every parameter and gradient for NaN/Inf.
  The common case costs three aten ops (one ``_foreach_norm`` over every parameter and gradient,
  stacked and summed into one flag that is finite exactly when all of them are, but for an overflow
  that the scan below sorts out; MPS has no fused ``_foreach_norm``: torch encodes one
  ``linalg_vector_norm`` per tensor, each reading its tensor once). On CPU and CUDA the flag is read at once (one host read a step).
  On MPS, where every read drains the GPU's queue, it is copied to the host without waiting
  (``non_blocking``) and read at a later step once its ``torch.mps.Event`` has completed: no host
  sync a step, and a detection lag of at least one step (as many as the GPU runs behind the host; not
  measured on a Mac yet). Pending flags are waited for before a checkpoint is written and when
  training ends (SplatMetalTrainer.save_checkpoint calls ``flush``). ``deferred=True`` runs this path
  on CPU (tests, and the step ledger, which counts the step as a Mac runs it). When a flag is not finite, a scan of every
  tensor says at which step, in which parameter (value or gradient) and in how many gaussians (a late
  detection scans the current values: NaN/Inf gradients have made their gaussians' values
  non-finite by then, and the rasterizer culls non-finite gaussians, so they got zero gradients in
  between), then (``--pipeline.model.nonfinite``):
    - ``recover`` (default): drops the offending gaussians with gsplat's ``ops.remove``, which also
      slices the optimizer state and the strategy's running statistics, and training continues;
    - ``stop``: raises ``NonFiniteError`` before the step's checkpoint is written, so the last
      checkpoint on disk is the last good one (on MPS too: no checkpoint is written while a flag is
      pending); ns-train prints the message (no traceback), exit 1.
  Non-finite values outside the gaussians (camera pose corrections, bilateral grid) cannot be dropped,
  and neither can every gaussian: those stop training in both modes.
  Why after the step: NaN/Inf gradients always make the Adam update of their rows non-finite, and
  gaussians densified from a poisoned one inherit the poison, so one scan of the values after
  everything else catches all of them without re-indexing across densification.

* ``install_atomic_ply_export``: nerfstudio's ``ns-export gaussian-splat`` opens the target .ply with
  ``open(filename, "wb")`` and writes it value by value, so an interrupted export leaves a truncated
  file where the user's previous export was. When a SplatMetalModel is built in a process that has
  loaded nerfstudio's exporter (that is, in ``ns-export``), ``ExportGaussianSplat.write_ply`` is
  wrapped to write the same bytes to a hidden temporary file in the same folder and rename it over
  the target, through splat-metal's block writer (export/ply_file.py: the same bytes, tested against
  nerfstudio's; 1.5M gaussians in seconds instead of minutes). Nothing else of the exporter changes;
  the patch is idempotent and only active in that process. (Our package is imported by ns-export before the exporter's classes exist, hence the
  model-construction hook instead of an import-time patch.) A SIGKILL can leave a hidden
  ``.NAME.partial-PID`` file behind, never a partial ``NAME``.

* ``save_checkpoint_file``: a checkpoint written through a Python file object (torch then raises a
  RuntimeError whose context is the file's ``OSError(ENOSPC)``, where a path gives only a C++
  ``basic_ios``/``inline_container`` message), into a hidden temporary file that is renamed over the target only when complete.
  A failed write raises ``CheckpointWriteError`` after the temporary file is removed: the earlier
  checkpoints are untouched.

Faults are planted for the tests by patching plain functions (tests/inject.py): ``checkpoint_write`` (a write
that fails half-way, as a full disk does) and the guard's optimizers (NaN in a gradient); nothing here reads a
variable for them.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from nerfstudio.engine.callbacks import TrainingCallback, TrainingCallbackLocation
from nerfstudio.utils.rich_utils import CONSOLE

from .files import PARTIAL_NAME, STOP_SIGNALS, atomic_path, remove_stale_partials, signals_interrupt  # noqa: F401 (re-exported)

NONFINITE_MODES = ("recover", "stop")


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
class CheckpointWriteError(SystemExit):
    """A checkpoint could not be written (full disk, read-only folder); ``str(e)`` is the message."""

    def __init__(self, message: str):
        super().__init__(message if message.startswith("splat-metal: ") else f"splat-metal: {message}")


def checkpoint_write(state: dict, f, step: int) -> None:
    """The one write of a checkpoint, of step ``step``, into the open file ``f``: torch.save (tests/inject.py replaces
    it with one that fails half-way)."""
    torch.save(state, f)


def save_checkpoint_file(state: dict, target: Path, step: int, staging_dir: Optional[Path] = None) -> None:
    """torch.save(state) to ``target`` atomically (atomic_path). An OSError (full disk, read-only
    folder) raises CheckpointWriteError naming the file; nothing is left at ``target``'s temporary path."""
    try:
        with atomic_path(target, staging_dir) as tmp:
            with open(tmp, "wb") as f:
                checkpoint_write(state, f, step)
    except (OSError, RuntimeError) as e:
        cause = _os_error(e)  # torch's writer turns the file's OSError into a RuntimeError (its context)
        if cause is None:
            raise
        raise CheckpointWriteError(f"could not write the checkpoint {target} ({cause.strerror or cause})") from None


def _os_error(e: Optional[BaseException]) -> Optional[OSError]:
    while e is not None and not isinstance(e, OSError):
        e = e.__cause__ or e.__context__
    return e


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
    flagged_at: Optional[int] = None  # the step whose flag said so, when read late (MPS)

    @property
    def n_bad(self) -> int:
        return int(self.bad_rows.sum())

    def describe(self) -> str:
        parts = [f"{kind} in {where} ({count:,} gaussian{'s' * (count != 1)})" for where, kind, count in self.findings]
        parts += [f"{kind} in {where}" for where, kind in self.outside]
        late = f" (flagged after step {self.flagged_at})" if self.flagged_at not in (None, self.step) else ""
        return f"step {self.step}{late}: non-finite values: " + "; ".join(parts)


class NonFiniteGuard:
    """Checks a SplatfactoModel's parameters and gradients after every step (see the module doc).

    ``deferred``: read the flag a step late, without waiting (None: where the parameters are on MPS).
    Tests and the step ledger set it on CPU to run the Mac's path."""

    def __init__(self, model, optimizers: Dict[str, torch.optim.Optimizer], mode: str = "recover",
                 deferred: Optional[bool] = None, fused_from=None):  # fmt: skip
        if mode not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {mode!r}")
        self.model = model
        self.optimizers = optimizers  # group name -> torch optimizer (nerfstudio's Optimizers.optimizers)
        # optimizers.GaussianOptimizers (or None): its last_fused step's flag already judged what it stepped
        self.fused_from = fused_from
        self.mode = mode
        self.deferred = deferred
        self.dropped = 0  # gaussians dropped so far (recover)
        self.reports: List[NonFiniteReport] = []
        self.pending: List[Tuple[int, torch.Tensor, object]] = []  # (step, flag on the host, event or None)

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

    @torch.no_grad()
    def _flag(self) -> Optional[torch.Tensor]:
        """A device scalar, finite when every parameter and gradient is (None: nothing to check).
        Three ops: the 1-norm of each tensor in one ``_foreach_norm``, stacked and summed. A NaN or Inf
        anywhere makes it NaN or Inf; a finite sum that overflows is a false alarm that scan() sorts out."""
        params = list(self.model.gauss_params.values()) + [p for _, p in self._other_params()]
        tensors = params + [p.grad for p in params if p.grad is not None]
        if not tensors:
            return None
        if self._metal_flag(tensors):
            # with the metal backend one kernel (ops/metal/train.metal nonfinite_flag) per 12 tensors and one
            # allocation: 0, or NaN where anything is not finite (no overflowing sum, no false alarm)
            from ..ops.metal.train import nonfinite_flag

            fused = getattr(self.fused_from, "last_fused", None)
            if fused is not None:
                # the fused Adam pass (optimizers.py, ops/metal/adam.metal) judged the gradients and updated
                # parameters it stepped: read again only what it did not step or what changed since (a
                # densification's new tensors, MCMC's noise on the means), into the same flag
                rest = [t for t, judged in zip(tensors, fused.covers(tensors)) if not judged]
                return nonfinite_flag(rest, flag=fused.flag) if rest else fused.flag
            return nonfinite_flag(tensors)
        return torch.stack(torch._foreach_norm(tensors, 1)).sum()

    def _metal_flag(self, tensors) -> bool:
        """Whether the flag runs as a Metal kernel: the model renders with the metal backend (its kernels
        run where its tensors are) and every tensor is contiguous float32."""
        if self.__dict__.get("_metal") is None:
            from .optimizers import renders_with_metal

            self._metal = renders_with_metal(self.model, tensors[0].device)
        return self._metal and all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)

    def _all_finite(self) -> bool:
        """The flag, read at once (one host sync)."""
        flag = self._flag()
        return flag is None or math.isfinite(float(flag))

    def _is_deferred(self) -> bool:
        if self.deferred is not None:
            return self.deferred
        return self.model.gauss_params["means"].device.type == "mps"

    def scan(self, step: int, flagged_at: Optional[int] = None) -> Optional[NonFiniteReport]:
        """None when everything is finite, else what is not (and which gaussians). Reads every tensor:
        run it only when a flag said something is not finite."""
        params = self.model.gauss_params
        n = params["means"].shape[0]
        report = NonFiniteReport(step, n, torch.zeros(n, dtype=torch.bool, device=params["means"].device))
        report.flagged_at = flagged_at
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
            return None  # a sum overflowed (every value is finite), or what a late flag saw is gone
        return report

    def check(self, step: int) -> None:
        """After every training step. Deferred (MPS): acts on the flags of earlier steps that the
        GPU has finished, then sends this step's flag to the host without waiting."""
        if not self._is_deferred():
            if not self._all_finite():
                self._act(self.scan(step))
            return
        self._resolve(step, wait=False)
        flag = self._flag()
        if flag is not None:
            host = flag.to("cpu", non_blocking=True)
            event = None
            if flag.device.type == "mps":
                event = torch.mps.Event()
                event.record()
            elif flag.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
            self.pending.append((step, host, event))

    def flush(self, step: int) -> None:
        """Waits for every pending flag and acts on it (raises in stop mode): before a checkpoint is
        written and when training ends. Nothing to do where flags are read at once."""
        self._resolve(step, wait=True)

    def _resolve(self, step: int, wait: bool) -> None:
        flagged_at = None
        while self.pending:
            at, host, event = self.pending[0]
            if event is not None and not event.query():
                if not wait:
                    break
                event.synchronize()
            self.pending.pop(0)
            if not math.isfinite(float(host)):
                flagged_at = at
                break
        if flagged_at is not None:
            self.pending.clear()  # flags of earlier steps than the scan, which sees the state now
            self._act(self.scan(step, flagged_at))

    def _act(self, report: Optional[NonFiniteReport]) -> None:
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

        state = self.model.strategy_state
        per_gaussian = {k: v for k, v in state.items() if k != "binoms"}  # MCMC's binomial table is not
        with torch.no_grad():  # per gaussian, and gsplat's remove slices every tensor it is given
            ops.remove(self.model.gauss_params, self.optimizers, per_gaussian, report.bad_rows)
        state.update(per_gaussian)
        self.dropped += report.n_bad
        CONSOLE.print(
            f"splat-metal: {what}. Dropped those {report.n_bad:,} of {report.n_gaussians:,} gaussians and "
            "continuing (--pipeline.model.nonfinite recover).",
            highlight=False,
            soft_wrap=True,
        )


# --------------------------------------------------------------------------------------------------
# ns-export gaussian-splat: write then rename
# --------------------------------------------------------------------------------------------------
_ATOMIC_MARK = "_splat_metal_atomic"


def atomic_ply_writer(write_ply: Callable) -> Callable:
    """``write_ply(filename, count, map_to_tensors)`` that writes to a temporary file and renames it."""

    def write(filename, count, map_to_tensors):
        target = Path(filename)
        remove_stale_partials(target.parent)
        try:
            with signals_interrupt(), atomic_path(target) as tmp:
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


def install_atomic_ply_export(writer: Optional[Callable] = None) -> bool:
    """Wraps nerfstudio's ExportGaussianSplat.write_ply if the exporter is loaded in this process;
    ``writer``, a function with its signature that writes the same bytes, then writes instead
    (the method passes export.ply_file's, which writes a block of rows at a time; nerfstudio's own
    stays on the wrapper as ``nerfstudio_write_ply``). Returns whether it is (now) wrapped."""
    exporter = sys.modules.get("nerfstudio.scripts.exporter")
    cls = getattr(exporter, "ExportGaussianSplat", None)
    if cls is None:
        return False
    current = cls.__dict__.get("write_ply")
    func = current.__func__ if isinstance(current, staticmethod) else current
    if func is None:
        return False
    if not getattr(func, _ATOMIC_MARK, False):
        write = atomic_ply_writer(writer or func)
        write.nerfstudio_write_ply = func  # type: ignore[attr-defined]
        cls.write_ply = staticmethod(write)
    return True
