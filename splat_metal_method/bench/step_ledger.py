"""The step ledger: what one training step (or render) of splat-metal asks of a Mac, counted on Linux.

A real nerfstudio Trainer runs on CPU tensors with the Metal backend (its kernels under the MSL
emulator), and ``with count(...) as ledger: <one step>`` records:

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
- our kernel launches (seen through the runtime's launch observer, runtime.set_launch_observer) and, inside
  each kernel, the emulator's work counters (msl_shim.h): simdgroup reductions (scalar components),
  shuffles/votes, device and threadgroup atomics, threadgroup barriers; threadgroup memory per group as
  declared; and the sizes of the buffers bound to each launch (each read or written once; twice for those a
  kernel updates in place, READ_WRITE_ARGS).

Used by `splat-metal-bench` (host syncs per step, the --vs runs' atomics) and the tests that hold a step's
counts; benchmarks/step_model/ledger.py extends it (bytes moved, count-only mode, the phases of a run).
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

from ..ops.metal import adam, prepare, rasterize_bwd

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

    def add(self, other: "KernelWork") -> None:
        for k in self.__dataclass_fields__:
            if k == "threadgroup_bytes":
                self.threadgroup_bytes = max(self.threadgroup_bytes, other.threadgroup_bytes)
            elif isinstance(getattr(self, k), dict):  # by buffer shape (benchmarks/step_model/ledger.py)
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
    kernels: Dict[str, KernelWork] = field(default_factory=dict)
    # part of the step that called the op layer (step_part(skip_ops=True)) -> our kernel launches
    launch_parts: collections.Counter = field(default_factory=collections.Counter)

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


class Counting:
    """The shared state of the two torch modes and the runtime's launch observer of one `count`.
    benchmarks/step_model/ledger.py extends it: ``run`` (count-only mode: launches counted, not run; the bytes a
    launch moves) and ``record`` / ``aten_kernel`` (more per launch and per aten kernel)."""

    work_type = KernelWork

    def __init__(self, ledger: Ledger, host_tensors=()):
        self.ledger = ledger
        self.executes = True  # the kernels run (count-only mode, in benchmarks/step_model: they do not)
        self.paused = False  # the ledger's own work (paused_call): not the step's
        # tensors that stay on the host on a Mac, by identity (id -> weak reference: a tensor's memory
        # can be reused by the next tensor, its Python object cannot while it lives)
        self.host = {id(t): weakref.ref(t) for t in host_tensors}

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self.host.get(id(t))
        return ref is not None and ref() is t

    def mark_host(self, t) -> None:
        if isinstance(t, torch.Tensor):
            self.host[id(t)] = weakref.ref(t)

    def paused_call(self, fn, *args):
        """``fn(*args)``, not counted as the step's."""
        self.paused = True
        try:
            return fn(*args)
        finally:
            self.paused = False

    # -- kernels
    def run(self, name, kernel, args, launch):
        """Runs one launch of kernel ``name``; returns what it returns."""
        return kernel(*args, **launch)

    def record(self, name, kernel, args, launch, work: KernelWork) -> None:
        """More of one launch's work, before it is added to the ledger (nothing here)."""

    def aten_kernel(self, part: str, args, kwargs, out) -> None:
        """One aten kernel (not a view or an allocation) of the step's ``part`` (nothing here)."""

    def launch(self, name, kernel, args, launch):
        """The runtime's launch observer (runtime.set_launch_observer): counts the launch and runs it (``run``)."""
        lib = getattr(kernel, "_lib", None)
        counters = getattr(lib, "work_counters", None)
        before = counters() if counters else {}
        out = self.run(name, kernel, args, launch)
        after = counters() if counters else {}
        work = self.work_type(launches=1, threadgroup_bytes=int(getattr(kernel, "threadgroup_memory", 0) or 0))
        for k, v in after.items():
            setattr(work, k, v - before[k])
        threads = launch.get("threads")
        group = launch.get("group_size")
        threads = (threads,) if isinstance(threads, int) else tuple(threads)
        group = (group,) if isinstance(group, int) else tuple(group)
        work.threads = math.prod(int(t) for t in threads)
        work.threadgroups = math.prod(-(-int(t) // int(g)) for t, g in zip(threads, group))
        if name in ACTIVE_GROUPS and self.executes:
            work.active_groups = ACTIVE_GROUPS[name](args, work.simd_reductions, work.simd_reduction_ops)
            work.block_order_groups = work.active_groups  # the launch runs in msplat's order (8x4 blocks) itself
        work.buffer_bytes = sum(nbytes for _, nbytes in bound_buffers(name, args))
        self.record(name, kernel, args, launch, work)
        self.ledger.kernels.setdefault(name, self.work_type()).add(work)
        self.ledger.launch_parts[step_part(skip_ops=True)] += 1
        return out


def bound_buffers(name: str, args) -> List[Tuple[torch.Tensor, int]]:
    """The distinct buffers one launch of kernel ``name`` binds, with the bytes each counts (READ_WRITE_ARGS: twice,
    also where the same buffer is bound again at an index that is not: a placeholder slot)."""
    out, read_write = {}, READ_WRITE_ARGS.get(name, ())
    read_write = read_write(args) if callable(read_write) else read_write
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            counted = a.numel() * a.element_size() * (2 if i in read_write else 1)
            if counted > out.get(a.data_ptr(), (a, 0))[1]:
                out[a.data_ptr()] = (out.get(a.data_ptr(), (a, 0))[0], counted)
    return list(out.values())


class _AtenCounter(TorchDispatchMode):
    def __init__(self, state: Counting):
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
            self.s.aten_kernel(part, args, kwargs, out)
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
    def __init__(self, state: Counting):
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
    """Context manager: ``with count("steady", host_tensors) as ledger: <one step>``; ``host_tensors``: tensors that
    stay on the host on a Mac (host_resident)."""

    def __init__(self, name: str, host_tensors=()):
        self.ledger = Ledger(name)
        self.state = Counting(self.ledger, host_tensors)

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
