"""The step ledger: what one training step (or render) of splat-metal asks of a Mac, counted on Linux.

A real nerfstudio Trainer runs on CPU tensors with the Metal backend (its kernels under the MSL
emulator) and, for one phase at a time (a steady training step, a refine step, an eval render, a steady step
after refine stop),
`count(...)` records:

- host syncs, counted as a Mac runs the step: on MPS every read of a device tensor on the host drains
  the command queue. Device-to-host reads are aten ``_local_scalar_dense`` (``.item()``, ``int()``,
  ``bool()``, ``float()``), ops whose output size depends on the data (``nonzero``/``torch.where(c)``,
  ``masked_select``, ``unique``, boolean-mask indexing, ...) and ``.tolist()``/``.cpu()``/``.numpy()``,
  but not ``.to("cpu", non_blocking=True)``: that copy is queued behind the device's work and the
  host reads it later, once an event says it is done (reliability.NonFiniteGuard);
  Python-to-device writes are ``torch.tensor(data, device=d)`` and ``host_tensor.to(d)``. Tensors that
  stay on the host on a Mac are not syncs: those made without a device (or with the string ``"cpu"``)
  and torch's Adam step counters (CPU scalars unless the optimizer is fused or capturable). On CPU a
  ``device=`` given as a torch.device is taken as the model's device (mps on a Mac).
- aten dispatches, each one encode on MPS (views included; ``aten_kernels`` leaves out views and
  allocations), split by the part of the step that issued them. A ``_foreach_*`` op counts once per
  tensor in its list: MPS has no foreach kernels (torch's native_functions.yaml gives MPS only
  ``_fused_adam(w)_``), so on a Mac torch's slow path runs the op tensor by tensor;
- our kernel launches (runtime.launch_counts' seam) and, inside each kernel, the emulator's work
  counters (msl_shim.h): simdgroup reductions (scalar components), shuffles/votes, device and
  threadgroup atomics, threadgroup barriers; threadgroup memory per group as declared; and bytes
  moved, estimated as the sizes of the buffers bound to each launch (each read or written once; twice
  for those a kernel updates in place, READ_WRITE_ARGS), and, for the kernels whose launches touch a part
  of what they bind (MOVED_BYTES: bin_sort's merge steps, scan_block_sums' unread input), the bytes each
  launch reads and writes, from the kernel's code and the data it runs on (``moved_bytes``; the model
  prefers it where present).

Used by benchmarks/bench_ledger.py (the table), tests/bench/test_step_ledger.py (budgets) and
`splat-metal-bench` (host syncs per step).
"""

from __future__ import annotations

import collections
import math
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..ops.metal import adam, isect, prepare, rasterize_bwd, scan

# aten ops whose output size depends on tensor values: the host must read the device to allocate.
DATA_DEPENDENT_OPS = {
    "_local_scalar_dense", "nonzero", "masked_select", "unique_dim", "_unique", "_unique2",
    "unique_consecutive", "bincount", "argwhere",
}  # fmt: skip
BOOL_INDEX_OPS = {"index.Tensor", "index_put", "index_put_", "_index_put_impl_"}  # sync with a bool mask
# Kernels that read and write some bound buffers in place (argument indices): those count twice, so their
# bytes are accesses (adam_step: parameter, gradient and both moments read, three written).
READ_WRITE_ARGS: Dict[str, object] = {  # kernel -> argument indices, or a function of the arguments giving them
    "adam_step": adam.READ_WRITE_ARGS,
    "project_bwd": prepare.sh_adam_read_write_args,  # the parameters it steps and their moments (PROJECT_SH_ADAM, _ADAM_*)
}
# Kernels whose launches touch a part of the buffers they bind: kernel -> (function(args, extent) giving the bytes one
# launch reads and writes ({bound buffer's shape: bytes}, as KernelWork.buffer_shapes) and the extent it counted from,
# whether it needs an extent). The extent is the data the launch's work depends on: None when the kernels run (read
# from the bound buffers), else a host model of it (count-only mode: count(..., extents={kernel: model})); without
# one the launch's moved bytes are not counted (the model then takes its bound bytes).
MOVED_BYTES = {
    "bin_sort": (isect.bin_sort_moved_bytes, True),  # extent: the bins' lengths
    "scan_block_sums": (scan.block_sums_moved_bytes, False),  # the launch's arguments say it all
}
# kernel -> function (arguments, counted simd reductions: components, calls) giving the launch's active groups
ACTIVE_GROUPS = {"rasterize_bwd": rasterize_bwd.active_groups}
ALLOCATIONS = {"empty.memory_format", "empty_strided", "empty_like", "lift_fresh", "_local_scalar_dense"}

# Parts of a step, by the innermost file of the Python stack that issued an aten op (first match).
PARTS: Tuple[Tuple[str, str], ...] = (
    ("/splat_metal_method/ops/", "rasterization op"),
    ("/torch/optim/", "optimizer"),
    ("/splat_metal_method/engine/optimizers.py", "optimizer"),
    ("/gsplat/strategy/", "strategy"),
    ("/splat_metal_method/engine/memory.py", "strategy"),
    ("/splat_metal_method/method/mcmc.py", "strategy"),
    ("/torch/autograd/", "autograd backward"),
    ("/splat_metal_method/", "model, loss, camera opt"),
    ("/nerfstudio/", "model, loss, camera opt"),
    ("/pytorch_msssim/", "model, loss, camera opt"),
    ("/torchmetrics/", "model, loss, camera opt"),
)
_WHERE_FILES = ("splat_metal_method", "nerfstudio", "gsplat", "pytorch_msssim", "torchmetrics", "torch/optim")


def aten_key(func) -> Optional[str]:
    """'name.overload' of an aten OpOverload ('name' without overload); None for other namespaces."""
    schema = func._schema
    ns, _, name = schema.name.partition("::")
    if ns != "aten":
        return None
    return name + (f".{schema.overload_name}" if schema.overload_name else "")


def foreach_width(key: str, args) -> int:
    """Dispatches one aten call costs on MPS: the number of tensors a ``_foreach_*`` op (torch's slow
    per-tensor path on MPS) works on, else 1."""
    if key.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)):
        return max(1, len(args[0]))
    return 1


def where(depth: int = 3) -> str:
    """The innermost frames of our code / nerfstudio / gsplat / torch.optim on the current stack."""
    frames, f = [], sys._getframe(1)
    while f is not None and len(frames) < depth:
        name = f.f_code.co_filename.replace("\\", "/")
        if any(s in name for s in _WHERE_FILES) and not name.endswith("step_ledger.py"):
            frames.append(f"{Path(name).name}:{f.f_lineno} {f.f_code.co_name}")
        f = f.f_back
    return " <- ".join(frames)


def step_part(skip_ops: bool = False) -> str:
    """The part of the step the innermost matching frame belongs to (PARTS); with ``skip_ops``, of the
    innermost frame outside the op layer (who called into our kernels)."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if not name.endswith("step_ledger.py") and not (skip_ops and "/splat_metal_method/ops/" in name):
            for pattern, part in PARTS:
                if pattern in name:
                    return part
        f = f.f_back
    return "other"


@dataclass
class KernelWork:
    """What one kernel did over a phase (all its launches)."""

    launches: int = 0
    threads: int = 0
    threadgroups: int = 0
    simd_reductions: int = 0  # scalar components (a float4 simd_sum counts 4), once per simdgroup
    simd_reduction_ops: int = 0  # the same reductions as calls (a float4 simd_sum counts 1)
    simd_shuffles: int = 0  # shuffles, broadcasts and votes, once per simdgroup
    device_atomics: int = 0  # per calling thread
    threadgroup_atomics: int = 0
    barriers: int = 0  # threadgroup barriers, once per threadgroup
    active_groups: int = 0  # rasterize_bwd: active (gaussian, simdgroup) pairs, from its reductions (ACTIVE_GROUPS)
    block_order_groups: int = (
        0  # rasterize_bwd: the same launches' active groups in 8x4 blocks (its own: it runs in them)
    )
    threadgroup_bytes: int = 0  # threadgroup memory one group declares
    buffer_bytes: int = 0  # sizes of the buffers bound to its launches (estimate of bytes moved)
    # buffer_bytes by the bound buffer's shape ("3x1500x2" -> bytes), so a reader that knows the scene can
    # tell per-gaussian, per-pixel and per-intersection buffers apart (scale_ledger.bytes_by_kind)
    buffer_shapes: Dict[str, int] = field(default_factory=dict)
    # bytes its launches read and wrote, counted from the kernel's code and data (MOVED_BYTES; 0 for the other
    # kernels, whose bound bytes stand for it), and by buffer shape as buffer_shapes
    moved_bytes: int = 0
    moved_shapes: Dict[str, int] = field(default_factory=dict)

    def add(self, other: "KernelWork") -> None:
        for k in self.__dataclass_fields__:
            if k == "threadgroup_bytes":
                self.threadgroup_bytes = max(self.threadgroup_bytes, other.threadgroup_bytes)
            elif k in ("buffer_shapes", "moved_shapes"):
                mine = getattr(self, k)
                for shape, b in getattr(other, k).items():
                    mine[shape] = mine.get(shape, 0) + b
            else:
                setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class Ledger:
    """Counts of one phase (a training step or a render)."""

    name: str
    host_reads: List[Tuple[str, str]] = field(default_factory=list)  # device -> host syncs: (what, where)
    host_writes: List[Tuple[str, str]] = field(default_factory=list)  # Python -> device transfers
    host_local: List[Tuple[str, str]] = field(default_factory=list)  # reads of host tensors (no sync)
    aten_ops: collections.Counter = field(default_factory=collections.Counter)  # op key -> calls
    aten_views: int = 0
    aten_allocations: int = 0
    parts: collections.Counter = field(default_factory=collections.Counter)  # part of the step -> aten ops
    # part of the step -> bytes the aten kernels (not views/allocations) read and wrote: each tensor
    # argument and output once
    part_bytes: collections.Counter = field(default_factory=collections.Counter)
    kernels: Dict[str, KernelWork] = field(default_factory=dict)
    # part of the step that called the op layer (step_part(skip_ops=True)) -> our kernel launches
    launch_parts: collections.Counter = field(default_factory=collections.Counter)
    n_gaussians: int = 0
    pixels: int = 0  # rendered pixels (all cameras)
    intersections: int = 0  # tile intersections of the render(s)
    # kernel -> the extent its moved bytes were counted from at its last launch (MOVED_BYTES: bin_sort's bin lengths)
    extents: Dict[str, object] = field(default_factory=dict)

    @property
    def host_syncs(self) -> int:
        return len(self.host_reads) + len(self.host_writes)

    @property
    def aten_dispatches(self) -> int:
        return sum(self.aten_ops.values())

    @property
    def aten_kernels(self) -> int:
        return self.aten_dispatches - self.aten_views - self.aten_allocations

    @property
    def kernel_launches(self) -> int:
        return sum(k.launches for k in self.kernels.values())

    def kernel_total(self) -> KernelWork:
        total = KernelWork()
        for k in self.kernels.values():
            total.add(k)
        return total

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


class _Counting:
    """The shared state of the two torch modes and the launch observer of one `count`."""

    def __init__(self, ledger: Ledger, host_tensors, extents=None):
        self.ledger = ledger
        self.extents = dict(extents or {})  # count-only mode: host models of what MOVED_BYTES reads (kernel -> extent)
        self.paused = False  # the ledger's own reads (MOVED_BYTES in executed mode): not the step's
        # tensors that stay on the host on a Mac, by identity (id -> weak reference: a tensor's memory
        # can be reused by the next tensor, its Python object cannot while it lives)
        self.host = {id(t): weakref.ref(t) for t in host_tensors}

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self.host.get(id(t))
        return ref is not None and ref() is t

    def mark_host(self, t) -> None:
        if isinstance(t, torch.Tensor):
            self.host[id(t)] = weakref.ref(t)

    # -- kernels
    def launch(self, name, kernel, args, launch):
        from ..ops.metal import runtime

        lib = getattr(kernel, "_lib", None)
        counters = getattr(lib, "work_counters", None)
        before = counters() if counters else {}
        moved_bytes, needs_extent = MOVED_BYTES.get(name, (None, False))
        extent = None if runtime.executing() else self.extents.get(name)
        moved = None  # {shape: bytes} this launch reads and writes, where counted
        if moved_bytes is not None and (runtime.executing() or extent is not None or not needs_extent):
            self.paused = True
            try:
                moved, extent = moved_bytes(args, extent)  # before the launch: the data the launch works on
            finally:
                self.paused = False
            self.ledger.extents[name] = extent
        out = kernel(*args, **launch) if runtime.executing() else None  # count-only: counted, not run
        after = counters() if counters else {}
        work = KernelWork(launches=1, threadgroup_bytes=int(getattr(kernel, "threadgroup_memory", 0) or 0))
        for k, v in after.items():
            setattr(work, k, v - before[k])
        threads = launch.get("threads")
        group = launch.get("group_size")
        threads = (threads,) if isinstance(threads, int) else tuple(threads)
        group = (group,) if isinstance(group, int) else tuple(group)
        work.threads = math.prod(int(t) for t in threads)
        work.threadgroups = math.prod(-(-int(t) // int(g)) for t, g in zip(threads, group))
        if name in ACTIVE_GROUPS and runtime.executing():
            work.active_groups = ACTIVE_GROUPS[name](args, work.simd_reductions, work.simd_reduction_ops)
            work.block_order_groups = work.active_groups  # the launch runs in msplat's order (8x4 blocks) itself
        seen, read_write = set(), READ_WRITE_ARGS.get(name, ())
        read_write = read_write(args) if callable(read_write) else read_write
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.data_ptr() not in seen:
                seen.add(a.data_ptr())
                nbytes = a.numel() * a.element_size() * (2 if i in read_write else 1)
                work.buffer_bytes += nbytes
                shape = "x".join(str(d) for d in a.shape)
                work.buffer_shapes[shape] = work.buffer_shapes.get(shape, 0) + nbytes
        if moved is not None:
            work.moved_shapes, work.moved_bytes = dict(moved), sum(moved.values())
        self.ledger.kernels.setdefault(name, KernelWork()).add(work)
        self.ledger.launch_parts[step_part(skip_ops=True)] += 1
        return out


class _AtenCounter(TorchDispatchMode):
    def __init__(self, state: _Counting):
        super().__init__()
        self.s = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.s.paused:
            return out
        key = aten_key(func)
        if key is None:  # profiler markers and other non-aten ops: no device work
            return out
        led = self.s.ledger
        n = foreach_width(key, args)
        led.aten_ops[key] += n
        part = step_part()
        led.parts[part] += n
        if func.is_view:
            led.aten_views += 1
        elif key in ALLOCATIONS:
            led.aten_allocations += 1
        else:
            seen = {}
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
            led.part_bytes[part] += sum(seen.values())
        base = key.split(".", 1)[0]
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_host = bool(inputs) and all(self.s.is_host(t) for t in inputs)
        if on_host:  # computed from host tensors only (e.g. a host_read's copy): the result is on the host too
            for t in tree_leaves(out):
                self.s.mark_host(t)
        if base in DATA_DEPENDENT_OPS or (key == "repeat_interleave.Tensor" and kwargs.get("output_size") is None):
            if on_host:
                led.host_local.append((key, where()))
            else:
                led.host_reads.append((key, where()))
        elif key in BOOL_INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_leaves(indices)):
                led.host_reads.append((key + " (boolean mask)", where()))
        return out


_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}
_READS = {"tolist", "numpy", "cpu"}


def _non_blocking_to_host(args, kwargs) -> bool:
    """``Tensor.to("cpu", non_blocking=True)``. (A blocking ``.to("cpu")`` is not told apart from a
    no-op: nerfstudio's datamanager moves to its device, the string "cpu" when the ledger runs.)"""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    non_blocking = bool(kwargs.get("non_blocking")) or any(a is True for a in args[2:])
    return non_blocking and isinstance(target, str) and target.split(":")[0] == "cpu"


class _TransferCounter(TorchFunctionMode):
    def __init__(self, state: _Counting):
        super().__init__()
        self.s = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.s.paused:
            return out
        s, led = self.s, self.s.ledger
        name = getattr(func, "__name__", "")
        if func in _FACTORIES:
            data = args[0] if args else kwargs.get("data")
            device = kwargs.get("device")
            if device is not None and not isinstance(device, str) and not isinstance(data, torch.Tensor):
                led.host_writes.append((f"torch.{name}(data, device=...)", where()))
            else:
                s.mark_host(out)
        elif name in _READS and args and isinstance(args[0], torch.Tensor) and not s.is_host(args[0]):
            led.host_reads.append((f"Tensor.{name}", where()))
            s.mark_host(out)  # what came back is on the host: reading it (.item()) is no second sync
        elif name == "to" and args and isinstance(args[0], torch.Tensor) and _non_blocking_to_host(args, kwargs):
            s.mark_host(out)  # queued behind the device's work, no wait: no sync (read it once it is done)
        elif name == "to" and args and isinstance(args[0], torch.Tensor) and s.is_host(args[0]):
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, (torch.device, torch.Tensor)):
                led.host_writes.append(("host_tensor.to(device)", where()))
        return out


class count:
    """Context manager: ``with count("steady", host_tensors) as ledger: <one step>``. ``extents``: in count-only
    mode, host models of what MOVED_BYTES reads from the device when the kernels run (kernel -> extent)."""

    def __init__(self, name: str, host_tensors=(), extents=None):
        self.ledger = Ledger(name)
        self.state = _Counting(self.ledger, host_tensors, extents)

    def __enter__(self) -> Ledger:
        from ..ops.metal import runtime

        self._previous = runtime.set_launch_observer(self.state.launch)
        self._modes = [_TransferCounter(self.state), _AtenCounter(self.state)]
        for m in self._modes:
            m.__enter__()
        return self.ledger

    def __exit__(self, *exc):
        from ..ops.metal import runtime

        for m in reversed(self._modes):
            m.__exit__(*exc)
        runtime.set_launch_observer(self._previous)
        return False


# ------------------------------------------------------------------------------------------------
# Driving a real Trainer
# ------------------------------------------------------------------------------------------------
METHODS = ("splat-metal", "splat-metal-mcmc")
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


def build_trainer(data: Path, method: str = "splat-metal", backend: str = "metal", output_dir: Path = Path("/tmp"),
                  device: str = "cpu", configure=None):  # fmt: skip
    """nerfstudio's Trainer for ``method`` on ``data``, set up on ``device`` (no viewer, no writers);
    ``configure(cfg)`` may change the TrainerConfig before setup."""
    from ..method.configs import splat_metal_mcmc_trainer_config, splat_metal_trainer_config

    if method not in METHODS:
        raise ValueError(f"[step_ledger] method must be one of {METHODS}, got {method!r}")
    cfg = splat_metal_trainer_config() if method == "splat-metal" else splat_metal_mcmc_trainer_config()
    cfg.machine.device_type = device
    cfg.pipeline.datamanager.data = Path(data)
    cfg.output_dir = Path(output_dir)
    cfg.vis = "tensorboard"
    cfg.logging.local_writer.enable = False
    model_cfg = cfg.pipeline.model
    model_cfg.backend = backend
    model_cfg.num_downscales = 0
    if method == "splat-metal":
        model_cfg.densify_grad_thresh = 1e-12  # the refine step duplicates and splits: every refine path runs
    if configure is not None:
        configure(cfg)
    cfg.set_timestamp()
    trainer = cfg.setup(local_rank=0, world_size=1)
    trainer.setup()
    trainer.pipeline.model.nonfinite_guard.deferred = True  # as on MPS: its flag is read a step late
    return trainer


def train_step(trainer, step: int) -> None:
    """What Trainer.train runs per iteration: callbacks around Trainer.train_iteration."""
    from nerfstudio.engine.callbacks import TrainingCallbackLocation

    with trainer.train_lock:
        trainer.pipeline.train()
        for cb in trainer.callbacks:
            cb.run_callback_at_location(step, TrainingCallbackLocation.BEFORE_TRAIN_ITERATION)
        trainer.train_iteration(step)
        for cb in trainer.callbacks:
            cb.run_callback_at_location(step, TrainingCallbackLocation.AFTER_TRAIN_ITERATION)


def host_resident(trainer) -> list:
    """Tensors that live on the host on a Mac: torch Adam's step counters unless the optimizer is
    fused or capturable (torch then keeps them on the parameters' device), and the NaN guard's flags
    already copied to the host (non_blocking; read once their event completed), likewise the
    intersection counts of the Metal backend's padded lists (ops/metal/isect.py), and the dataset's
    cameras, which nerfstudio keeps on the host (their sizes, read once per camera by the model)."""
    model = trainer.pipeline.model
    guard = getattr(model, "nonfinite_guard", None)
    out = [host for _, host, _ in guard.pending] if guard is not None else []
    capacities = getattr(model, "isect_capacities", None)
    if capacities is not None:  # intersection counts of padded lists, on their way to the host
        out += capacities.pending_host_counts()
    cameras = model.__dict__.get("_host_train_cameras")
    if cameras is not None:  # the dataset's cameras, read once per training camera for its size (model.py)
        out += [cameras.width, cameras.height]
    for opt in trainer.optimizers.optimizers.values():
        on_device = any(g.get("fused") or g.get("capturable") for g in opt.param_groups)
        for state in opt.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and not on_device:
                out.append(step)
    return out


def _intersections(model) -> int:
    """Tile intersections of the model's last render (rasterization's meta)."""
    tiles = (getattr(model, "info", None) or {}).get("tiles_per_gauss")
    return int(tiles.sum()) if isinstance(tiles, torch.Tensor) else 0


def measure(data: Path, method: str = "splat-metal", backend: str = "metal", output_dir: Path = Path("/tmp"),
            phases=("steady", "logged", "refine", "eval", "post_refine")) -> Dict[str, Ledger]:  # fmt: skip
    """Ledgers of a steady training step, a logged one, a refine step, an eval render and a steady step after
    refine stop (post_refine_step) of ``method``, in the order given (steps only move forward: post_refine last)."""
    from nerfstudio.engine.callbacks import TrainingCallbackLocation  # noqa: F401 (before writer: import order)
    from nerfstudio.utils import writer

    from ..ops.metal.runtime import reset_launch_counts
    from ..ops.workspace import workspace

    writers = list(writer.EVENT_WRITERS)
    trainer = build_trainer(data, method, backend, output_dir)
    # as in a new process: scratch buffers grown by earlier renders in this one would hand out slices
    # (a view each) where a fresh workspace hands out whole buffers
    workspace().clear()
    try:
        model = trainer.pipeline.model
        # one pass over the training cameras first: a steady step never reads a camera's size again
        # (model.py caches it per camera), and one warm-up step would leave that read in the count
        n_cameras = len(trainer.pipeline.datamanager.train_dataset.cameras)
        for step in range(max(3001, WARM_STEP - n_cameras), WARM_STEP + 1):  # 3000 refines
            train_step(trainer, step)
        reset_launch_counts()
        out: Dict[str, Ledger] = {}
        for phase in phases:
            n = len(model.means)
            if phase == "eval":
                camera, _ = trainer.pipeline.datamanager.next_eval_image(REFINE_STEP)
                with count(phase, host_resident(trainer)) as ledger, torch.no_grad():
                    model.eval()
                    model.get_outputs_for_camera(camera)
                ledger.pixels = int(camera.width.sum()) * int(camera.height.sum())
            else:
                step = {"steady": STEADY_STEP, "logged": LOGGED_STEP, "refine": REFINE_STEP}.get(phase)
                if phase == "post_refine":
                    step = post_refine_step(model)
                    train_step(trainer, step - 2)  # uncounted, as WARM_STEP: the first step in a while
                elif step is None:
                    raise ValueError(f"[step_ledger] unknown phase {phase!r}")
                camera_px = _train_pixels(trainer)
                with count(phase, host_resident(trainer)) as ledger:
                    train_step(trainer, step)
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
