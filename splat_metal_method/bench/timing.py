"""Per-stage timing of one nerfstudio training iteration (splat-metal-bench and --vs msplat): MPS events
on mps (GPU time, read after one sync at the end of the step), wall time on cpu."""

from __future__ import annotations

import functools
import time
from typing import List

import torch

STAGES = ("forward", "backward", "optimizer")


class _StageClock:
    """Marks stage boundaries: MPS events on mps (GPU time, read after one sync at the end of the
    step), perf_counter on cpu."""

    def __init__(self, device: str):
        self.mps = device == "mps"
        self.marks: list = []

    def mark(self) -> None:
        if self.mps:
            e = torch.mps.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> List[float]:
        if self.mps:
            torch.mps.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def timed_step(trainer, step: int, device: str) -> List[float]:
    """Trainer.train_iteration (with the callbacks around it), split into the three stages: ms each."""
    from nerfstudio.engine.callbacks import TrainingCallbackLocation

    clock = _StageClock(device)
    with trainer.train_lock:
        trainer.pipeline.train()
        clock.mark()
        for cb in trainer.callbacks:
            cb.run_callback_at_location(step, TrainingCallbackLocation.BEFORE_TRAIN_ITERATION)
        trainer.optimizers.zero_grad_all()
        _, loss_dict, _ = trainer.pipeline.get_train_loss_dict(step=step)
        loss = functools.reduce(torch.add, loss_dict.values())
        clock.mark()
        loss.backward()
        clock.mark()
        trainer.optimizers.optimizer_step_all()
        trainer.optimizers.scheduler_step_all(step)
        for cb in trainer.callbacks:
            cb.run_callback_at_location(step, TrainingCallbackLocation.AFTER_TRAIN_ITERATION)
        clock.mark()
    return clock.intervals_ms()
