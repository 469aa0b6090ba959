"""The step ledger as the step model reads it: splat_metal_method/bench/step_ledger.py's counts of a step, and more.

- the bytes each aten kernel reads and writes (each tensor argument and output once), by the part of the step;
- the bound buffers' bytes by buffer shape (``buffer_shapes``), so a reader that knows the scene can tell
  per-gaussian, per-pixel and per-intersection buffers apart (scale_ledger.bytes_by_kind);
- for the kernels whose launches touch a part of what they bind (MOVED_BYTES: bin_sort's merge steps,
  scan_block_sums' unread input), the bytes each launch reads and writes, from the kernel's code and the data it
  runs on (``moved_bytes``; the model prefers it where present);
- count-only mode (``count(..., execute=False)``, ``count_only()``): launches are counted (the runtime's launch
  counts and command buffers, this ledger) but not run, through the runtime's one launch observer, so a step at
  millions of gaussians counts on a small machine (scale_ledger.py);
- ``measure``: the phases of a run of a real nerfstudio Trainer (a steady training step, a logged one, a refine
  step, an eval render, a steady step after refine stop), and the tables benchmarks/bench_ledger.py prints.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict

import torch
from torch.utils._pytree import tree_leaves

from splat_metal_method.bench import step_ledger
from splat_metal_method.bench.step_ledger import METHODS, KernelWork, Ledger  # noqa: F401 (the model's names)
from splat_metal_method.ops.metal import isect, runtime, scan

# Kernels whose launches touch a part of the buffers they bind: kernel -> (function(args, extent) giving the bytes one
# launch reads and writes ({bound buffer's shape: bytes}, as ModelWork.buffer_shapes) and the extent it counted from,
# whether it needs an extent). The extent is the data the launch's work depends on: None when the kernels run (read
# from the bound buffers), else a host model of it (count-only mode: count(..., extents={kernel: model})); without
# one the launch's moved bytes are not counted (the model then takes its bound bytes).
MOVED_BYTES = {
    "bin_sort": (isect.bin_sort_moved_bytes, True),  # extent: the bins' lengths
    "scan_block_sums": (scan.block_sums_moved_bytes, False),  # the launch's arguments say it all
}


@dataclass
class ModelWork(KernelWork):
    """KernelWork with the bytes by buffer shape ("3x1500x2" -> bytes) and, where MOVED_BYTES counts them, the
    bytes its launches read and wrote (0 for the other kernels, whose bound bytes stand for it)."""

    buffer_shapes: Dict[str, int] = field(default_factory=dict)
    moved_bytes: int = 0
    moved_shapes: Dict[str, int] = field(default_factory=dict)


@dataclass
class ModelLedger(Ledger):
    """Ledger with the aten kernels' bytes by part, the scene's size and MOVED_BYTES' extents."""

    # part of the step -> bytes the aten kernels (not views/allocations) read and wrote: each tensor argument and
    # output once
    part_bytes: collections.Counter = field(default_factory=collections.Counter)
    n_gaussians: int = 0
    pixels: int = 0  # rendered pixels (all cameras)
    intersections: int = 0  # tile intersections of the render(s)
    # kernel -> the extent its moved bytes were counted from at its last launch (MOVED_BYTES: bin_sort's bin lengths)
    extents: Dict[str, object] = field(default_factory=dict)

    def summary(self) -> Dict[str, int]:
        t = self.kernel_total()
        return {
            "host_syncs": self.host_syncs, "host_reads": len(self.host_reads), "host_writes": len(self.host_writes),
            "aten_dispatches": self.aten_dispatches, "aten_kernels": self.aten_kernels,
            "kernel_launches": self.kernel_launches, "simd_reductions": t.simd_reductions,
            "simd_shuffles": t.simd_shuffles, "device_atomics": t.device_atomics,
            "threadgroup_atomics": t.threadgroup_atomics, "barriers": t.barriers,
            "buffer_bytes": t.buffer_bytes, "threadgroup_bytes_max": t.threadgroup_bytes,
            "aten_bytes": sum(self.part_bytes.values()),
        }  # fmt: skip


class ModelCounting(step_ledger.Counting):
    """step_ledger.Counting that also counts bytes (MOVED_BYTES, by shape, the aten kernels') and, with
    ``executes`` False, counts launches without running them."""

    work_type = ModelWork

    def __init__(self, ledger: ModelLedger, host_tensors=(), extents=None, execute: bool = True):
        super().__init__(ledger, host_tensors)
        self.executes = execute
        self.extents = dict(extents or {})  # count-only mode: host models of what MOVED_BYTES reads (kernel -> extent)
        self.moved = None  # {shape: bytes} the current launch reads and writes, where counted

    def run(self, name, kernel, args, launch):
        moved_bytes, needs_extent = MOVED_BYTES.get(name, (None, False))
        extent = None if self.executes else self.extents.get(name)
        self.moved = None
        if moved_bytes is not None and (self.executes or extent is not None or not needs_extent):
            self.moved, extent = self.paused_call(moved_bytes, args, extent)  # before the launch: the data it reads
            self.ledger.extents[name] = extent
        return super().run(name, kernel, args, launch) if self.executes else None  # count-only: counted, not run

    def record(self, name, kernel, args, launch, work: ModelWork) -> None:
        for a, nbytes in step_ledger.bound_buffers(name, args):
            shape = "x".join(str(d) for d in a.shape)
            work.buffer_shapes[shape] = work.buffer_shapes.get(shape, 0) + nbytes
        if self.moved is not None:
            work.moved_shapes, work.moved_bytes = dict(self.moved), sum(self.moved.values())

    def aten_kernel(self, part, args, kwargs, out) -> None:
        seen = {}
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
        self.ledger.part_bytes[part] += sum(seen.values())


class count(step_ledger.count):
    """step_ledger.count with ModelLedger's counts. ``execute=False`` (count-only mode): the launches are counted,
    not run; ``extents``: then host models of what MOVED_BYTES reads from the device when the kernels run
    (kernel -> extent)."""

    def __init__(self, name: str, host_tensors=(), extents=None, execute: bool = True):
        self.ledger = ModelLedger(name)
        self.state = ModelCounting(self.ledger, host_tensors, extents, execute)


def _skip(name, kernel, args, launch):
    return None


class count_only:
    """Context: kernel launches are counted by the runtime (launch_counts, command_buffers) but not run, and the
    host learns nothing from the device: kernel outputs are left unwritten. A ``count(..., execute=False)`` inside
    counts its launches the same way."""

    def __enter__(self):
        self._previous = runtime.set_launch_observer(_skip)
        return self

    def __exit__(self, *exc):
        runtime.set_launch_observer(self._previous)


# ------------------------------------------------------------------------------------------------
# The phases of a real Trainer's run
# ------------------------------------------------------------------------------------------------
# Steps the phases run at (splatfacto's schedule): SH degree 3 from 3000, the opacity reset at 3000,
# refine at 3200 (past warm-up, % 100 == 0, more than n_train + 100 past the reset); the steady step
# 3101 is none of these. WARM_STEP runs first, uncounted: lazily built state (Adam moments, strategy
# buffers, compiled kernels). LOGGED_STEP is a steady step nerfstudio writes out (step % steps_per_log == 0,
# default 10): the model computes the train PSNR and the loss dict's constant scale_reg only then.
WARM_STEP, STEADY_STEP, LOGGED_STEP, REFINE_STEP = 3099, 3101, 3110, 3200
# "post_refine": a steady step once the strategy has stopped refining (splatfacto's stop_split_at, 15,000 of 30,000
# steps; MCMC's 25,000): refine_stop_iter + POST_REFINE_OFFSET, after an uncounted one two steps before it. From
# refine_stop_iter on, gsplat's DefaultStrategy reads no statistics, and the model computes none (no absgrad in
# the rasterizer's backward, no densify_stats): half of a default run's steps are this one.
POST_REFINE_OFFSET = STEADY_STEP - 3000


def post_refine_step(model) -> int:
    """The step the "post_refine" phase counts: ``POST_REFINE_OFFSET`` steps past the strategy's refine_stop_iter."""
    return int(model.strategy.refine_stop_iter) + POST_REFINE_OFFSET


def _intersections(model) -> int:
    """Tile intersections of the model's last render (rasterization's meta)."""
    tiles = (getattr(model, "info", None) or {}).get("tiles_per_gauss")
    return int(tiles.sum()) if isinstance(tiles, torch.Tensor) else 0


def measure(data: Path, method: str = "splat-metal", backend: str = "metal", output_dir: Path = Path("/tmp"),
            phases=("steady", "logged", "refine", "eval", "post_refine")) -> Dict[str, ModelLedger]:  # fmt: skip
    """Ledgers of a steady training step, a logged one, a refine step, an eval render and a steady step after
    refine stop (post_refine_step) of ``method``, in the order given (steps only move forward: post_refine last)."""
    from nerfstudio.engine.callbacks import TrainingCallbackLocation  # noqa: F401 (before writer: import order)
    from nerfstudio.utils import writer

    from splat_metal_method.ops.metal.runtime import reset_launch_counts
    from splat_metal_method.ops.workspace import workspace

    writers = list(writer.EVENT_WRITERS)
    trainer = step_ledger.build_trainer(data, method, backend, output_dir)
    # as in a new process: scratch buffers grown by earlier renders in this one would hand out slices
    # (a view each) where a fresh workspace hands out whole buffers
    workspace().clear()
    try:
        model = trainer.pipeline.model
        # one pass over the training cameras first: a steady step never reads a camera's size again
        # (model.py caches it per camera), and one warm-up step would leave that read in the count
        n_cameras = len(trainer.pipeline.datamanager.train_dataset.cameras)
        for step in range(max(3001, WARM_STEP - n_cameras), WARM_STEP + 1):  # 3000 refines
            step_ledger.train_step(trainer, step)
        reset_launch_counts()
        out: Dict[str, ModelLedger] = {}
        for phase in phases:
            n = len(model.means)
            if phase == "eval":
                camera, _ = trainer.pipeline.datamanager.next_eval_image(REFINE_STEP)
                with count(phase, step_ledger.host_resident(trainer)) as ledger, torch.no_grad():
                    model.eval()
                    model.get_outputs_for_camera(camera)
                ledger.pixels = int(camera.width.sum()) * int(camera.height.sum())
            else:
                step = {"steady": STEADY_STEP, "logged": LOGGED_STEP, "refine": REFINE_STEP}.get(phase)
                if phase == "post_refine":
                    step = post_refine_step(model)
                    step_ledger.train_step(trainer, step - 2)  # uncounted, as WARM_STEP: the first step in a while
                elif step is None:
                    raise ValueError(f"[ledger] unknown phase {phase!r}")
                camera_px = _train_pixels(trainer)
                with count(phase, step_ledger.host_resident(trainer)) as ledger:
                    step_ledger.train_step(trainer, step)
                ledger.pixels = camera_px
            ledger.n_gaussians = n
            ledger.intersections = _intersections(model)
            out[phase] = ledger
        return out
    finally:
        writer.EVENT_WRITERS[:] = writers


def _train_pixels(trainer) -> int:
    cams = trainer.pipeline.datamanager.train_dataset.cameras
    return int(cams.width[0]) * int(cams.height[0])


# ------------------------------------------------------------------------------------------------
# Printing
# ------------------------------------------------------------------------------------------------
COLUMNS = (("host syncs", "host_syncs"), ("reads", "host_reads"), ("writes", "host_writes"),
           ("aten ops", "aten_dispatches"), ("aten kernels", "aten_kernels"),
           ("our launches", "kernel_launches"), ("simd red.", "simd_reductions"), ("simd shuf.", "simd_shuffles"),
           ("dev. atomics", "device_atomics"), ("barriers", "barriers"), ("buffer MB", "buffer_bytes"))  # fmt: skip


def table(rows: Dict[str, Ledger]) -> str:
    """A markdown table: one row per (label -> ledger)."""
    head = "| phase | gaussians | " + " | ".join(c for c, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (2 + len(COLUMNS))]
    for label, led in rows.items():
        s = led.summary()
        cells = [f"{s[k] / 1e6:.1f}" if k == "buffer_bytes" else str(s[k]) for _, k in COLUMNS]
        lines.append(f"| {label} | {led.n_gaussians} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernel_table(led: Ledger) -> str:
    """Per-kernel work of one phase."""
    keys = ("launches", "threadgroups", "simd_reductions", "simd_shuffles", "device_atomics", "threadgroup_atomics",
            "barriers", "threadgroup_bytes", "buffer_bytes")  # fmt: skip
    lines = ["| kernel | " + " | ".join(keys) + " |", "|" + "---|" * (1 + len(keys))]
    for name, w in sorted(led.kernels.items()):
        lines.append(f"| {name} | " + " | ".join(str(getattr(w, k)) for k in keys) + " |")
    return "\n".join(lines)


def sync_sites(led: Ledger) -> str:
    """Each host sync of a phase with where it came from (grouped)."""
    c = collections.Counter(f"{what} at {at}" for what, at in led.host_reads + led.host_writes)
    return "\n".join(f"  {n} x {site}" for site, n in c.most_common())
