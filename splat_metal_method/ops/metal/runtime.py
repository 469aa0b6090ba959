"""The runtime seam: where the Metal backend gets its kernel libraries.

Dispatch code is written once against torch.mps.compile_shader's call convention::

    lib = library_for(means.device, load_source(COMMON, "project.metal"))
    lib.project_fwd(means, out, n, threads=n, group_size=256)   # arg i <-> [[buffer(i)]]

and gets Apple's compiler on an mps tensor, or the MSL emulator (g++ on the CPU) on a cpu tensor.
Both kinds of library are cached per process by source hash and count their launches per kernel
name (`launch_counts()`), which the tests use to count kernel launches per training step.

It also keeps the per-process ledger of command buffers (`command_buffers()`, see "Command buffers and
the GPU watchdog" below): what each holds, so that no command buffer is given more estimated work
than COMMAND_BUFFER_BUDGET, on a Mac and, modelled, under the emulator.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

KERNEL_DIR = Path(__file__).resolve().parent

_libraries: dict[tuple[str, str], "_CountingLibrary"] = {}
_lock = threading.Lock()
_launches: Counter = Counter()


def launch_counts() -> dict[str, int]:
    """Kernel launches per kernel name since the last reset (both runtimes)."""
    return dict(_launches)


def reset_launch_counts() -> None:
    _launches.clear()


# ------------------------------------------------------------------------------------------------
# Command buffers and the GPU watchdog
# ------------------------------------------------------------------------------------------------
# torch's MPS stream encodes every dispatch (ours, through compile_shader, and aten's) into its current
# command buffer and commits it only at a host sync or under memory pressure, and macOS aborts a
# command buffer that runs for seconds (~2 s reported on M1/M2-class GPUs). So the work of a render is
# bounded per command buffer, not per dispatch: before a heavy dispatch, `reserve_work` commits the
# current command buffer when the dispatch would take it past COMMAND_BUFFER_BUDGET.
#
# How a commit happens on a Mac (torch >= 2.7; read in pytorch's sources):
#   torch.mps.Event().record()  ->  torch._C._mps_recordEvent (torch/mps/event.py, torch/csrc/mps/Module.cpp)
#   -> MPSHooks::recordEvent -> MPSEventPool::recordEvent(id, /*syncEvent*/ true) (aten/src/ATen/mps/MPSHooks.mm)
#   -> MPSEvent::recordLocked: encodeSignalEvent, then stream->synchronize(SyncType::COMMIT)
#      (aten/src/ATen/mps/MPSEvent.mm)
#   -> MPSStream::commit(): commitAndContinue on the MPSCommandBuffer (the Metal command buffer is
#      committed, encoding continues in a new one), or flush() = commit when commitAndContinue is off
#      (aten/src/ATen/mps/MPSStream.mm). Neither waits for the GPU.
# torch.mps.synchronize() (torch._C._mps_deviceSynchronize -> MPSHooks::deviceSynchronize) is
# SyncType::COMMIT_AND_WAIT: it commits too, but stalls the CPU until the GPU is idle, and so does
# every host read (.item(), .cpu()). MPSHooks::commitStream (SyncType::COMMIT) has no Python binding.
# So a commit here is one event record: no CPU stall, no wait on the GPU.
#
# The budget, in forward gaussian-pixel evaluations (one pixel compositing one gaussian, as the
# rasterizer's pass planner counts them: an upper bound that ignores early termination; a backward
# evaluation counts BWD_WORK_FACTOR). An M1-class GPU (8 cores, ~2.6 TFLOP/s fp32) does one forward
# evaluation in ~25-30 instructions: ~1e11/s at peak, ~2e10/s at a pessimistic 20% efficiency. 4e9
# evaluations are then ~0.2 s: a safety factor of 10 below a ~2 s watchdog, which also covers an
# estimate off by a few times, a slower or busy GPU, and the small kernels (projection, sort) that
# share the command buffer without being counted.
COMMAND_BUFFER_BUDGET = 4_000_000_000
BWD_WORK_FACTOR = 4  # a backward evaluation (gradients, atomics) costs up to ~4 forward ones


@dataclass
class CommandBuffer:
    """What one command buffer holds: kernel launches per name and the estimated work reserved."""

    launches: Counter = field(default_factory=Counter)
    work: int = 0
    closed_by: str = ""  # "commit" (reserve_work / commit), "host sync" (host_read); "" while open


_current = CommandBuffer()
_closed: deque = deque(maxlen=4096)  # the last closed command buffers, oldest first


def command_buffers() -> list[CommandBuffer]:
    """The command buffers since the last reset, the open one last (the modelled ledger: commits and
    host reads made through this module close one; other host syncs are not seen, which only
    overestimates what a command buffer holds)."""
    return [*_closed, _current]


def reset_command_buffers() -> None:
    global _current
    _closed.clear()
    _current = CommandBuffer()


def _close(reason: str) -> None:
    global _current
    if _current.launches or _current.work:
        _current.closed_by = reason
        _closed.append(_current)
        _current = CommandBuffer()


def commit(device: torch.device | str) -> None:
    """Ends the current command buffer: on mps, commits torch's without waiting (see above); under the
    emulator, whose kernels run at once, closes it in the ledger."""
    if torch.device(device).type == "mps":
        torch.mps.Event().record()
    _close("commit")


def reserve_work(device: torch.device | str, work: int) -> None:
    """Call before a dispatch of estimated `work`: commits the current command buffer first if it
    already holds work and this dispatch would take it past COMMAND_BUFFER_BUDGET. One dispatch
    above the budget alone cannot be split here (the rasterizer's pass planner sizes its passes)."""
    work = int(work)
    if _current.work > 0 and _current.work + work > COMMAND_BUFFER_BUDGET:
        commit(device)
    _current.work += work


def host_read(t: torch.Tensor) -> torch.Tensor:
    """`t` copied to the host. On mps this commits torch's command buffer and waits for the GPU
    (SyncType::COMMIT_AND_WAIT), so the ledger closes the current one."""
    out = t.cpu()
    _close("host sync")
    return out


# The one hook for counting: while set, observer(name, kernel, args, launch) is called instead of a plain launch
# and decides what happens to it (the step ledger counts around kernel(*args, **launch); the benchmarks' count-only
# mode counts and skips it). None: launch directly.
_launch_observer = None


def set_launch_observer(observer) -> object:
    """Installs `observer` (None removes it); returns the previous one."""
    global _launch_observer
    previous, _launch_observer = _launch_observer, observer
    return previous


def metal_available() -> bool:
    """True on a Mac where torch can compile and run Metal shaders."""
    return torch.backends.mps.is_available() and hasattr(torch.mps, "compile_shader")


def _line_name(path: Path) -> str:
    """The file name a `#line` directive gives `path`, as ASCII C string-literal content: files of this
    package by their path in it (splat_metal_method/ops/metal/x.metal, the same on every machine),
    others by their absolute path with `\\`, `"` and non-ASCII bytes written as octal escapes."""
    try:
        return "splat_metal_method/ops/metal/" + path.relative_to(KERNEL_DIR).as_posix()
    except ValueError:
        pass
    return "".join(chr(b) if 32 <= b < 127 and b not in b'"\\' else f"\\{b:03o}" for b in path.as_posix().encode())


def load_source(*metal_files: str | os.PathLike, defines: dict[str, object] | None = None) -> str:
    """Concatenate kernel files (shared header first, then stage files) into one source.

    Relative paths are taken from this directory. Each file is preceded by `#line 1 "<name>"`, so
    errors from Apple's compiler or the emulator's g++ name the original .metal file and line.
    `defines` (e.g. constants shared with Python such as TILE_SIZE) become `#define NAME value`
    lines at the top; floats are written with an `f` suffix so they stay float in MSL.

    The result is ASCII whatever the install path: torch.mps.compile_shader builds its source
    string as ASCII, so a path under /Users/José/ in a `#line` would fail the whole library.
    """
    parts = []
    if defines:
        parts.append('#line 1 "<splat_metal defines>"\n')
        for k, v in defines.items():
            val = f"{float(v)!r}f" if isinstance(v, float) else str(int(v)) if isinstance(v, bool) else str(v)
            parts.append(f"#define {k} {val}\n")
    for f in metal_files:
        p = Path(f)
        if not p.is_absolute():
            p = KERNEL_DIR / p
        text = p.read_text()
        parts.append(f'#line 1 "{_line_name(p)}"\n{text}')
        if not text.endswith("\n"):
            parts.append("\n")
    return "".join(parts)


class ThreadgroupLimitError(ValueError):
    """This GPU's pipeline for a kernel allows fewer threads per threadgroup than splat-metal dispatches."""


def pipeline_limits(kernel) -> dict[str, int | None]:
    """What a compiled kernel reports about its pipeline (None where its runtime reports nothing):
    torch.mps.compile_shader's kernels have max_threads_per_threadgroup (the pipeline's
    maxTotalThreadsPerThreadgroup: register-dependent, can be < 1024), thread_execution_width and
    static_thread_group_memory_length; the emulator reports what it enforces."""
    return {
        a: getattr(kernel, a, None)
        for a in ("max_threads_per_threadgroup", "thread_execution_width", "static_thread_group_memory_length")
    }


def fitted_group(group_size, limits: dict[str, int | None]) -> tuple[int]:
    """A 1-D group of a kernel whose threads never synchronise, shrunk to what the pipeline allows
    (whole execution widths where possible): such a kernel computes the same with any group size."""
    (group,) = (group_size,) if isinstance(group_size, int) else tuple(group_size)
    limit = limits.get("max_threads_per_threadgroup")
    if limit is None or group <= limit:
        return (group,)
    width = limits.get("thread_execution_width") or 1
    return (limit - limit % width if limit >= width else limit,)


def check_group_size(name: str, group_size, limits: dict[str, int | None]) -> None:
    """Raises ThreadgroupLimitError (before the launch) when `group_size` needs more threads than the
    pipeline allows. torch would raise a bare ValueError; this one says what to do."""
    limit = limits.get("max_threads_per_threadgroup")
    if limit is None or group_size is None:
        return
    dims = (group_size,) if isinstance(group_size, int) else tuple(group_size)
    threads = 1
    for d in dims:
        threads *= int(d)
    if threads > limit:
        raise ThreadgroupLimitError(
            f"[{name}] this GPU's pipeline for the kernel allows at most {limit} threads per threadgroup "
            f"(thread execution width {limits.get('thread_execution_width')}), but splat-metal dispatches "
            f"{threads} (group_size {dims}). The Metal backend cannot run here as built. Continue with "
            "--pipeline.model.backend reference (PyTorch on the same GPU), and please report this with the "
            "output of `splat-metal-doctor`."
        )


class _CountingLibrary:
    """Wraps a compiled library (MPS or emulator); `lib.kernel(...)` checks the group size against the
    pipeline's limit (shrinking it first when the launch says ``fit_group=True``), counts, then launches."""

    def __init__(self, lib, runtime: str):
        self._lib, self.runtime = lib, runtime
        self._kernels: dict[str, object] = {}

    @property
    def compiled(self):
        """The library this one wraps: its kernels run at once, neither counted nor seen by a launch observer
        (the step ledger's own launches beside the step's: rasterize_bwd.block_order_groups)."""
        return self._lib

    def limits(self, name: str) -> dict[str, int | None]:
        """pipeline_limits of kernel `name`."""
        return pipeline_limits(getattr(self._lib, name))

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        fn = self._kernels.get(name)
        if fn is None:
            kernel = getattr(self._lib, name)
            limits = pipeline_limits(kernel)  # read once: a pipeline's limits never change

            def fn(*args, _kernel=kernel, _name=name, **launch):  # launch: threads=, group_size= [, fit_group=]
                if launch.pop("fit_group", False):  # kernels.grid_1d: any group size will do
                    launch["group_size"] = fitted_group(launch["group_size"], limits)
                check_group_size(_name, launch.get("group_size"), limits)
                _launches[_name] += 1
                _current.launches[_name] += 1
                if _launch_observer is not None:  # it runs (or skips) the launch itself
                    return _launch_observer(_name, _kernel, args, launch)
                return _kernel(*args, **launch)

            self._kernels[name] = fn
        return fn

    def __dir__(self):
        return dir(self._lib)


def get_library(source: str, name: str = "splat_metal", runtime: str | None = None) -> _CountingLibrary:
    """Compile `source` once per process (cached by hash) for `runtime`.

    runtime: "mps" (torch.mps.compile_shader), "emulator" (g++ on the CPU), or None = mps when
    Metal is available, else the emulator. `name` labels emulator diagnostics.
    """
    if runtime is None:
        runtime = "mps" if metal_available() else "emulator"
    if runtime not in ("mps", "emulator"):
        raise ValueError(f"[get_library] runtime must be 'mps' or 'emulator', got {runtime!r}")
    key = (runtime, hashlib.sha256(source.encode()).hexdigest())
    with _lock:
        lib = _libraries.get(key)
        if lib is None:
            if runtime == "mps":
                if not metal_available():
                    raise RuntimeError("[get_library] runtime 'mps' needs macOS 14+ with torch MPS")
                raw = torch.mps.compile_shader(source)
            else:
                from .emulator import compile_library

                raw = compile_library(source, name)
            lib = _libraries[key] = _CountingLibrary(raw, runtime)
    return lib


def library_for(device: torch.device | str, source: str, name: str = "splat_metal") -> _CountingLibrary:
    """The library that runs kernels on tensors of `device`: Metal for mps, the emulator for cpu."""
    device = torch.device(device)
    if device.type == "mps":
        return get_library(source, name, "mps")
    if device.type == "cpu":
        return get_library(source, name, "emulator")
    raise ValueError(f"[library_for] Metal kernels run on mps (or cpu via the emulator), not on {device}")
