"""Memory management: cache release, memory stats, budgets, and the TrainingCallbacks that apply them.

Earlier Metal ports of 3DGS saw MPS memory climb far past what the scene needs. Here memory tracks
the scene and says what it is doing:

  * ``empty_cache(device)`` and ``memory_stats(device)`` work on mps, cuda and cpu alike.
  * ``MemoryManager.training_callbacks`` releases cached memory after every refine (densify +
    prune) and opacity-reset step of the strategy, after eval passes, optionally every N steps,
    and at the end of training; it writes the memory curve to nerfstudio's writer every K steps
    (tensorboard / wandb / comet scalars "Memory/...", next to the loss).
  * Budgets instead of crashes: ``BudgetedStrategy`` stops densification at ``max_gaussians``
    (pruning still runs); ``max_intersections`` makes the op layer rasterize a view in depth chunks
    (ops/chunked.py) instead of allocating more intersections than the budget.

Thread safety: every hook that runs inside the training loop runs under the trainer's
``train_lock`` (nerfstudio holds it around the iteration and its callbacks, and around eval),
which is also the lock the viewer holds while it renders, so a release never races a viewer
render. The end-of-training hook runs outside the loop and takes the lock itself.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import gc
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple, Union

import torch
from gsplat.strategy import DefaultStrategy

from ..ops import BackendUnavailable, resolve_backend

MiB = 1024**2
GiB = 1024**3

# Default budgets, derived from the device's memory (see default_max_gaussians / _intersections).
# Bytes one gaussian costs while training with SH degree 3: 59 floats of parameters, their
# gradients and two Adam moments (944 B) plus per-view projection / SH activations and strategy
# state (about 1 KB more).
BYTES_PER_GAUSSIAN = 2048
# Each SH coefficient above degree 3's 16: 3 floats of parameter, gradient and two Adam moments.
BYTES_PER_EXTRA_SH_COEFFICIENT = 3 * 4 * 4


def bytes_per_gaussian(sh_degree: int = 3) -> int:
    """Training bytes of one gaussian at ``sh_degree`` (degree 4's 25 coefficients: 2,480 B)."""
    return BYTES_PER_GAUSSIAN + ((sh_degree + 1) ** 2 - 16) * BYTES_PER_EXTRA_SH_COEFFICIENT


GAUSSIAN_MEMORY_FRACTION = 0.5  # the rest: images, per-pixel buffers, intersections, the framework
# Bytes one tile intersection costs: keys and ids, their sort buffers, and the per-intersection
# gathers of the compositing that is recomputed in backward.
BYTES_PER_INTERSECTION = 128
INTERSECTION_MEMORY_FRACTION = 0.25
# A training render skips the depth-chunk plan (a host read) while the previous render used at most
# this fraction of the intersection budget: views of one scene differ by less than this factor.
PLAN_HEADROOM = 4

DeviceLike = Union[str, torch.device]


# ------------------------------------------------------------------------------------------------
# Device memory: release and stats
# ------------------------------------------------------------------------------------------------
def empty_cache(device: DeviceLike) -> bool:
    """Returns cached, unused device memory to the system: torch.mps / torch.cuda empty_cache
    (after waiting for queued MPS work, whose buffers are only free once it has run). No-op on cpu.
    True when something was called."""
    kind = torch.device(device).type
    if kind == "mps":
        torch.mps.synchronize()
        torch.mps.empty_cache()
        return True
    if kind == "cuda" and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        return True
    return False


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _load_mallinfo2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        fn = libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_mallinfo2 = _load_mallinfo2()


def malloc_stats() -> Optional[Tuple[int, int]]:
    """(bytes in use, bytes held from the OS) of the C heap (glibc), where CPU tensors live; None
    where glibc's mallinfo2 is not available (e.g. macOS)."""
    if _mallinfo2 is None:
        return None
    m = _mallinfo2()
    return int(m.uordblks + m.hblkhd), int(m.arena + m.hblkhd)


def process_rss() -> Optional[int]:
    """Resident set size of this process in bytes (None if it cannot be read)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class MemoryStats:
    """One sample, in bytes. None where the device has no such number.

    allocated: cuda/mps: bytes in live tensors (torch.cuda.memory_allocated /
        torch.mps.current_allocated_memory); cpu: bytes the C heap has handed out (whole process).
    reserved: cuda: held by the caching allocator (memory_reserved); mps: allocated by the Metal
        driver for this process (driver_allocated_memory); cpu: C heap held from the OS.
    peak: cuda: torch.cuda.max_memory_allocated; mps/cpu: the largest `allocated` a MemoryManager
        has sampled (once per step, so a peak inside a step is not seen).
    rss: resident set size of the process.
    """

    device: str
    allocated: Optional[int]
    reserved: Optional[int]
    peak: Optional[int]
    rss: Optional[int]

    def as_mb(self) -> Dict[str, float]:
        return {k: v / MiB for k, v in dataclasses.asdict(self).items() if isinstance(v, int)}


def memory_stats(device: DeviceLike) -> MemoryStats:
    """Allocator and process memory for tensors on ``device``."""
    d = torch.device(device)
    allocated = reserved = peak = None
    if d.type == "cuda" and torch.cuda.is_initialized():
        allocated, reserved = torch.cuda.memory_allocated(d), torch.cuda.memory_reserved(d)
        peak = torch.cuda.max_memory_allocated(d)
    elif d.type == "mps":
        allocated, reserved = torch.mps.current_allocated_memory(), torch.mps.driver_allocated_memory()
    elif d.type == "cpu":
        heap = malloc_stats()
        if heap is not None:
            allocated, reserved = heap
    return MemoryStats(str(d), allocated, reserved, peak, process_rss())


def device_memory(device: DeviceLike) -> Optional[int]:
    """Bytes a process may use on ``device``: torch.mps.recommended_max_memory() on a Mac, the GPU's
    total memory on cuda, physical RAM on cpu; None if unknown."""
    d = torch.device(device)
    try:
        if d.type == "mps":
            return int(torch.mps.recommended_max_memory())
        if d.type == "cuda":
            return int(torch.cuda.get_device_properties(d.index or 0).total_memory)
        if d.type == "cpu":
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (RuntimeError, AssertionError, ValueError, OSError, AttributeError):
        return None
    return None


# ------------------------------------------------------------------------------------------------
# Budgets
# ------------------------------------------------------------------------------------------------
def default_max_gaussians(device: DeviceLike, sh_degree: int = 3) -> Tuple[Optional[int], str]:
    """(cap, how it was derived) for training on ``device``; (None, why) when memory is unknown."""
    total = device_memory(device)
    if total is None:
        return None, f"no cap: the memory of {device} is unknown"
    per_gaussian = bytes_per_gaussian(sh_degree)
    cap = int(total * GAUSSIAN_MEMORY_FRACTION) // per_gaussian
    return cap, (
        f"{GAUSSIAN_MEMORY_FRACTION:.0%} of {total / GiB:.1f} GiB ({_memory_source(device)}) "
        f"at ~{per_gaussian} B per gaussian"
    )


def default_max_intersections(device: DeviceLike) -> Tuple[Optional[int], str]:
    """(budget, how it was derived) of tile intersections per render on ``device``."""
    total = device_memory(device)
    if total is None:
        return None, f"no budget: the memory of {device} is unknown"
    budget = int(total * INTERSECTION_MEMORY_FRACTION) // BYTES_PER_INTERSECTION
    return budget, (
        f"{INTERSECTION_MEMORY_FRACTION:.0%} of {total / GiB:.1f} GiB at ~{BYTES_PER_INTERSECTION} B per intersection"
    )


def _memory_source(device: DeviceLike) -> str:
    return {
        "mps": "torch.mps.recommended_max_memory()",
        "cuda": "GPU total memory",
        "cpu": "physical RAM",
    }.get(torch.device(device).type, "device memory")


def resolve_budget(value: int, default: Callable[[DeviceLike], Tuple[Optional[int], str]], device: DeviceLike):
    """Config value -> (budget or None, how it was chosen): -1 derives it from the device, 0 means
    none, a positive value is taken as given."""
    if value is None or value < 0:
        return default(device)
    if value == 0:
        return None, "off (0)"
    return int(value), "set in the config"


@dataclass
class BudgetedStrategy(DefaultStrategy):
    """gsplat's DefaultStrategy with a cap on the number of gaussians, and a record of its events.

    At the cap, a refine step grows nothing (duplicate and split are skipped) while pruning runs as
    usual. Below the cap, when growth would overshoot it, only the candidates with the largest
    image-plane gradient are grown, so the count never exceeds the cap. The selection hides the
    other candidates from gsplat's own ``_grow_gs`` for that call (their accumulated gradient is
    zeroed, which gsplat does after every refine step anyway; their screen-size record is restored
    afterwards, as pruning reads it).

    ``events`` records (step, "refine" | "reset") for the memory hooks.
    """

    max_gaussians: int = 0  # 0: no cap
    events: Deque[Tuple[int, str]] = field(
        default_factory=lambda: collections.deque(maxlen=64), repr=False, compare=False
    )
    growth_skipped: int = field(default=0, repr=False, compare=False)  # growth candidates not grown (total)
    cap_hit_step: Optional[int] = field(default=None, repr=False, compare=False)  # first refine limited by the cap
    on_cap: Optional[Callable[[str], None]] = field(default=None, repr=False, compare=False)  # message sink
    # Metal backend: a refine finds the rows to duplicate, split and prune on the device (KnownRows), with
    # one host read per grow and one per prune (gsplat reads every count and mask: 7 host syncs).
    rows_on_device: bool = field(default=False, repr=False, compare=False)

    @classmethod
    def from_strategy(cls, strategy: DefaultStrategy, max_gaussians: Optional[int]) -> "BudgetedStrategy":
        """The same strategy (every DefaultStrategy setting copied) with the cap (None or 0: no cap)."""
        settings = {f.name: getattr(strategy, f.name) for f in dataclasses.fields(DefaultStrategy)}
        return cls(**settings, max_gaussians=int(max_gaussians or 0))

    def step_pre_backward(self, params, optimizers, state, step, info):
        """gsplat retains ``means2d.grad`` (a copy of the gradient every step); with absgrad its statistics read
        ``means2d.absgrad``, which every backend fills without it, so only the plain-gradient setting retains it."""
        if not self.absgrad:
            super().step_pre_backward(params, optimizers, state, step, info)

    def step_post_backward(self, params, optimizers, state, step, info, packed=False):
        super().step_post_backward(params, optimizers, state, step, info, packed=packed)
        # gsplat resets opacities at these steps (after its refine check, before refine_stop_iter)
        if step < self.refine_stop_iter and step % self.reset_every == 0:
            self.events.append((step, "reset"))

    def _update_state(self, params, state, info, packed: bool = False):
        """gsplat 1.4's running statistics (grad2d, count, radii) without its host read: gsplat
        gathers the visible gaussians with torch.where (nonzero, a sync on MPS); here the same sums
        are taken densely over [C, N], adding zero where a gaussian is not visible (bit-identical for
        one camera, whose ids do not repeat)."""
        if packed:
            return super()._update_state(params, state, info, packed=packed)
        grads = info[self.key_for_gradient].absgrad if self.absgrad else info[self.key_for_gradient].grad
        n = len(params["means"])
        for key in ("grad2d", "count") + (("radii",) if self.refine_scale2d_stop_iter > 0 else ()):
            if state[key] is None:
                state[key] = torch.zeros(n, device=grads.device)
        if info.get("backend") == "metal" and grads.dtype == torch.float32:
            # one kernel (ops/metal/train.metal densify_stats) for the 12 aten ops below, the same bits
            from ..ops.metal.train import densify_stats

            W, H, C = info["width"], info["height"], info["n_cameras"]
            densify_stats(grads, info["radii"], state["grad2d"], state["count"],
                          state["radii"] if self.refine_scale2d_stop_iter > 0 else None,
                          W / 2.0 * C, H / 2.0 * C, float(max(W, H)))  # fmt: skip
            return
        grads = grads * self._pixel_scale(info, grads)  # [C, N, 2]: gsplat's two in-place column products
        visible = info["radii"] > 0.0  # [C, N]
        norms = torch.where(visible, grads.norm(dim=-1), 0.0)  # [C, N]
        state["grad2d"] += norms.sum(dim=0)
        state["count"] += visible.sum(dim=0)
        if self.refine_scale2d_stop_iter > 0:  # radii normalised to [0, 1] screen space; 0 where not visible
            radii = info["radii"].amax(dim=0) / float(max(info["width"], info["height"]))  # [N]
            torch.maximum(state["radii"], radii, out=state["radii"])

    def _pixel_scale(self, info, grads) -> torch.Tensor:
        """[2] (width / 2 * C, height / 2 * C) on the gradients' device, made once per image size (a
        host-to-device copy) instead of gsplat's clone and per-column in-place products every step."""
        key = (info["width"], info["height"], info["n_cameras"], grads.device, grads.dtype)
        cache = self.__dict__.setdefault("_pixel_scales", {})
        if key not in cache:
            cache[key] = torch.tensor([info["width"] / 2.0 * info["n_cameras"], info["height"] / 2.0 * info["n_cameras"]],
                                      dtype=grads.dtype, device=grads.device)  # fmt: skip
        return cache[key]

    def pop_events(self) -> List[Tuple[int, str]]:
        events = list(self.events)
        self.events.clear()
        return events

    @torch.no_grad()
    def _grow_gs(self, params, optimizers, state, step) -> Tuple[int, int]:
        self.events.append((step, "refine"))
        if self.rows_on_device:
            grown = self._grow_with_known_rows(params, optimizers, state, step)
            if grown is not None:
                return grown
        if self.max_gaussians <= 0:
            return super()._grow_gs(params, optimizers, state, step)
        n = len(params["means"])
        room = self.max_gaussians - n
        growth, priority, by_screen_size = self._growth_per_gaussian(params, state, step)
        wanted = int(growth.sum())
        if wanted <= room:
            return super()._grow_gs(params, optimizers, state, step)
        candidates = growth > 0
        if self.cap_hit_step is None:
            self.cap_hit_step = step
            self._say(
                f"max-gaussians cap {self.max_gaussians:,} reached at step {step} ({n:,} gaussians, growth "
                f"would add {wanted:,}): densification adds no more than the cap allows from now on; pruning continues"
            )
        # Grow the candidates with the largest gradient whose growth still fits; hide the others.
        order = torch.argsort(torch.where(candidates, priority, -torch.inf), descending=True, stable=True)
        fits = torch.cumsum(growth[order], 0) <= max(room, 0)
        keep = torch.zeros_like(candidates)
        keep[order[fits]] = True
        hidden = candidates & ~keep
        self.growth_skipped += wanted - int(growth[keep].sum())
        if not bool(keep.any()):
            return 0, 0
        state["grad2d"][hidden] = 0.0
        if by_screen_size:  # duplicate/split carry every state tensor along, so the copy stays aligned
            state["_budget_radii"] = state["radii"].clone()
            state["radii"][hidden] = 0.0
        try:
            result = super()._grow_gs(params, optimizers, state, step)
        finally:
            if by_screen_size:
                state["radii"] = state.pop("_budget_radii")
        if len(params["means"]) > self.max_gaussians:  # only if gsplat's growth rule changed
            self._say(f"step {step}: growth went past the cap ({len(params['means']):,} > {self.max_gaussians:,})")
        return result

    def _grow_with_known_rows(self, params, optimizers, state, step) -> Optional[Tuple[int, int]]:
        """gsplat 1.4's _grow_gs with one host read (both counts at once) and the rows found on the
        device; None (nothing done) when the cap limits this growth (then the capped path runs)."""
        from gsplat.strategy.ops import duplicate, split

        is_dupli, is_split = self._grow_masks(params, state, step)
        n_dupli, n_split = (int(v) for v in torch.stack([is_dupli.sum(), is_split.sum()]).tolist())
        if self.max_gaussians > 0 and n_dupli + n_split > self.max_gaussians - len(params["means"]):
            return None
        if n_dupli > 0:
            duplicate(params=params, optimizers=optimizers, state=state, mask=KnownRows.of(is_dupli, n_dupli))
        if n_split > 0:  # new gaussians added by duplication are not split (gsplat)
            is_split = torch.cat([is_split, torch.zeros(n_dupli, dtype=torch.bool, device=is_split.device)])
            split(params=params, optimizers=optimizers, state=state, mask=KnownRows.of(is_split, n_split),
                  revised_opacity=self.revised_opacity)  # fmt: skip
        return n_dupli, n_split

    @torch.no_grad()
    def _prune_gs(self, params, optimizers, state, step) -> int:
        if not self.rows_on_device:
            return super()._prune_gs(params, optimizers, state, step)
        from gsplat.strategy.ops import remove

        is_prune = torch.sigmoid(params["opacities"].flatten()) < self.prune_opa  # gsplat 1.4's _prune_gs
        if step > self.reset_every:
            is_too_big = torch.exp(params["scales"]).max(dim=-1).values > self.prune_scale3d * state["scene_scale"]
            if step < self.refine_scale2d_stop_iter:
                is_too_big |= state["radii"] > self.prune_scale2d
            is_prune = is_prune | is_too_big
        n_prune = int(is_prune.sum())  # the prune's one host read
        if n_prune > 0:
            remove(params=params, optimizers=optimizers, state=state, mask=KnownRows.of(is_prune, n_prune))
        return n_prune

    def _grow_masks(self, params, state, step) -> Tuple[torch.Tensor, torch.Tensor]:
        """gsplat 1.4's _grow_gs masks: (duplicate, split) per gaussian."""
        grads = state["grad2d"] / state["count"].clamp_min(1)
        high = grads > self.grow_grad2d
        small = torch.exp(params["scales"]).max(dim=-1).values <= self.grow_scale3d * state["scene_scale"]
        split = high & ~small
        if step < self.refine_scale2d_stop_iter:
            split |= state["radii"] > self.grow_scale2d
        return high & small, split

    def _growth_per_gaussian(self, params, state, step) -> Tuple[torch.Tensor, torch.Tensor, bool]:
        """Gaussians each one would add in gsplat 1.4's ``_grow_gs`` (0, 1, or 2 when it is both
        duplicated and then split), its average image-plane gradient, and whether the screen-size
        split rule is active at ``step``."""
        grads = state["grad2d"] / state["count"].clamp_min(1)
        high = grads > self.grow_grad2d
        small = torch.exp(params["scales"]).max(dim=-1).values <= self.grow_scale3d * state["scene_scale"]
        split = high & ~small
        by_screen_size = step < self.refine_scale2d_stop_iter
        if by_screen_size:
            split |= state["radii"] > self.grow_scale2d
        return (high & small).long() + split.long(), grads, by_screen_size

    def _say(self, message: str) -> None:
        if self.on_cap is not None:
            self.on_cap(message)


class KnownRows(torch.Tensor):
    """A bool mask [N] that carries its own ``torch.where``: the rows it selects and those it does not,
    found on the device (ops.metal.scan.select_rows) from a count the host already read.

    gsplat 1.4's strategy ops (duplicate, split, remove) take a mask and call ``torch.where(mask)[0]``
    and ``torch.where(~mask)[0]``: nonzero, each a host sync on MPS (it needs the count to size its
    output). Given a KnownRows they get the same index tensors without one, and nothing else in them
    changes: every other use of the mask (its device, its values) is the plain tensor's."""

    @staticmethod
    def of(mask: torch.Tensor, n_selected: int) -> "KnownRows":
        from ..ops.metal.scan import select_rows

        selected, rest = select_rows(mask, n_selected, with_rest=True)
        known = mask.as_subclass(KnownRows)
        known._rows, known._complement_rows = selected, rest
        return known

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.where and len(args) == 1 and not kwargs:
            return (args[0]._rows,)
        if func in (torch.Tensor.__invert__, torch.logical_not, torch.Tensor.logical_not) and len(args) == 1:
            flipped = torch.logical_not(args[0].as_subclass(torch.Tensor)).as_subclass(KnownRows)
            flipped._rows, flipped._complement_rows = args[0]._complement_rows, args[0]._rows
            return flipped
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


# ------------------------------------------------------------------------------------------------
# The hooks
# ------------------------------------------------------------------------------------------------
def _console_print(message: str) -> None:
    from nerfstudio.utils.rich_utils import CONSOLE

    CONSOLE.print(f"[bold cyan]splat-metal memory:[/bold cyan] {message}")


class MemoryManager:
    """Applies the memory settings of one model during training (see the module docstring).

    ``releases`` records (step, reason) of every cache release, reasons being "refine", "reset",
    "eval", "every" and "end" (joined with "+" when several coincide)."""

    def __init__(
        self,
        device: DeviceLike,
        strategy: Optional[DefaultStrategy] = None,
        num_gaussians: Optional[Callable[[], int]] = None,
        render_meta: Optional[Callable[[], Optional[dict]]] = None,
        empty_cache_after_refine: bool = True,
        empty_cache_after_eval: bool = True,
        empty_cache_every: int = 0,
        log_every: int = 100,
        collect_garbage: bool = True,
        max_gaussians: Optional[int] = None,
        max_gaussians_source: str = "",
        max_intersections: Optional[int] = None,
        max_intersections_source: str = "",
        say: Callable[[str], None] = _console_print,
    ):
        self.device = torch.device(device)
        self.strategy = strategy
        self.num_gaussians = num_gaussians
        self.render_meta = render_meta
        self.empty_cache_after_refine = empty_cache_after_refine
        self.empty_cache_after_eval = empty_cache_after_eval
        self.empty_cache_every = int(empty_cache_every)
        self.log_every = int(log_every)
        self.collect_garbage = collect_garbage
        self.max_gaussians, self.max_gaussians_source = max_gaussians, max_gaussians_source
        self.max_intersections, self.max_intersections_source = max_intersections, max_intersections_source
        self.say = say
        self.releases: Deque[Tuple[int, str]] = collections.deque(maxlen=10_000)
        self.last_stats: Optional[MemoryStats] = None
        self._peak = 0
        self._eval_renders = 0
        self._last_intersections: Optional[int] = None  # of the last training render (render_budget)
        self._lock: Optional[threading.Lock] = None
        if isinstance(strategy, BudgetedStrategy) and strategy.on_cap is None:
            strategy.on_cap = say

    # -- wiring ----------------------------------------------------------------------------------
    def training_callbacks(self, attributes) -> list:
        """nerfstudio TrainingCallbacks: before each iteration (release after an eval pass), after
        each iteration (after refine/reset, every N, stats every K), and after training."""
        from nerfstudio.engine.callbacks import TrainingCallback, TrainingCallbackLocation

        trainer = getattr(attributes, "trainer", None)
        self._lock = getattr(trainer, "train_lock", None)
        self.say(self.describe())
        return [
            TrainingCallback([TrainingCallbackLocation.BEFORE_TRAIN_ITERATION], self.before_iteration),
            TrainingCallback([TrainingCallbackLocation.AFTER_TRAIN_ITERATION], self.after_iteration),
            TrainingCallback([TrainingCallbackLocation.AFTER_TRAIN], self.after_training),
        ]

    def describe(self) -> str:
        stats = memory_stats(self.device)
        total = device_memory(self.device)
        hooks = [
            name
            for name, on in (
                ("refine/prune/opacity reset", self.empty_cache_after_refine),
                ("eval", self.empty_cache_after_eval),
                (f"every {self.empty_cache_every} steps", self.empty_cache_every > 0),
            )
            if on
        ]
        parts = [
            f"device {self.device}" + (f" ({total / GiB:.1f} GiB usable)" if total else ""),
            "max gaussians "
            + (f"{self.max_gaussians:,}" if self.max_gaussians else "unlimited")
            + (f" ({self.max_gaussians_source})" if self.max_gaussians_source else ""),
            "max intersections per render "
            + (f"{self.max_intersections:,}" if self.max_intersections else "unlimited")
            + (f" ({self.max_intersections_source})" if self.max_intersections_source else ""),
            "empty cache after "
            + (", ".join(hooks) if hooks else "nothing")
            + ("" if self.device.type in ("mps", "cuda") else " (no-op on cpu)"),
            f"stats every {self.log_every} steps" if self.log_every > 0 else "stats off",
        ]
        if stats.rss is not None:
            parts.append(f"RSS now {stats.rss / MiB:.0f} MiB")
        return "; ".join(parts)

    def render_budget(self, training: bool) -> Optional[int]:
        """``max_intersections`` for the model's next render: None (no depth-chunk plan, whose total is
        a host read) for a training render when the previous one needed at most 1/PLAN_HEADROOM of the
        budget; the budget otherwise (first render, eval and viewer renders, after a refine, or when
        the previous render came near it or was chunked)."""
        last = self._last_intersections
        if training and self.max_intersections and last is not None and last * PLAN_HEADROOM <= self.max_intersections:
            return None
        return self.max_intersections

    def note_render(self, training: bool, meta: Optional[dict] = None) -> None:
        """Called by the model for every render with the render's meta. Eval-mode renders on the main
        thread are eval passes (the viewer renders on its own thread and does not count). A training
        render's intersection count (the size of flatten_ids, known on the host) sets render_budget."""
        if not training and threading.current_thread() is threading.main_thread():
            self._eval_renders += 1
        if training:
            ids = (meta or {}).get("flatten_ids")
            self._last_intersections = int(ids.numel()) if isinstance(ids, torch.Tensor) else None

    # -- callbacks -------------------------------------------------------------------------------
    def before_iteration(self, step: int) -> None:
        if self._eval_renders:
            self._eval_renders = 0
            if self.empty_cache_after_eval:
                self.release(step, "eval")

    def after_iteration(self, step: int) -> None:
        reasons = []
        pop_events = getattr(self.strategy, "pop_events", None)  # BudgetedStrategy, SplatMetalMCMCStrategy
        events = pop_events() if pop_events is not None else []
        if any(kind == "refine" for _, kind in events):
            self._last_intersections = None  # the gaussians changed: the next render plans again
        if self.empty_cache_after_refine:
            reasons += sorted({kind for _, kind in events})
        if self.empty_cache_every > 0 and step % self.empty_cache_every == 0:
            reasons.append("every")
        if reasons:
            self.release(step, "+".join(reasons))
        log_now = self.log_every > 0 and step % self.log_every == 0
        # GPU allocator counters are free to read, so their peak is tracked every step; on CPU the
        # heap statistics walk malloc's arenas (~0.5 ms, a tenth of a small step): only when logging.
        if log_now or self.device.type != "cpu":
            stats = self.sample()
            if log_now:
                self.log(step, stats)

    def after_training(self, step: int) -> None:
        with self._lock if self._lock is not None else contextlib.nullcontext():
            self.release(step, "end")

    # -- actions ---------------------------------------------------------------------------------
    def release(self, step: int, reason: str) -> None:
        """Frees what Python still holds in reference cycles (gc) and returns the allocator's cache to
        the system. On cpu there is no cache to return, so the full collection (0.17 s each on
        nerfstudio's heap: 9 s of a 600-step MCMC run refining every 10 steps) is left to Python's own gc."""
        if self.collect_garbage and self.device.type != "cpu":
            gc.collect()
        empty_cache(self.device)
        self.releases.append((step, reason))

    def sample(self) -> MemoryStats:
        stats = memory_stats(self.device)
        if stats.peak is None and stats.allocated is not None:
            self._peak = max(self._peak, stats.allocated)
            stats.peak = self._peak
        self.last_stats = stats
        return stats

    def log(self, step: int, stats: Optional[MemoryStats] = None) -> Dict[str, float]:
        """Writes the memory scalars for ``step`` to nerfstudio's writer and returns them."""
        from nerfstudio.utils import writer

        from ..ops.workspace import workspace_stats

        stats = stats or self.sample()
        names = {"allocated": "allocated", "reserved": "reserved", "peak": "peak", "rss": "RSS"}
        scalars = {f"Memory/{names[k]} (MB)": v for k, v in stats.as_mb().items()}
        scalars["Memory/workspace (MB)"] = workspace_stats()["bytes"] / MiB
        scalars["Memory/cache releases"] = float(len(self.releases))
        if self.num_gaussians is not None:
            scalars["Memory/gaussians"] = float(self.num_gaussians())
        meta = self.render_meta() if self.render_meta is not None else None
        if meta and meta.get("n_intersections") is not None:  # padded lists: the count the host has heard of
            if meta.get("n_intersections_seen") is not None:
                scalars["Memory/intersections"] = float(meta["n_intersections_seen"])
            scalars["Memory/depth chunks"] = float(meta.get("depth_chunks", 1))
        elif meta and meta.get("tiles_per_gauss") is not None:
            scalars["Memory/intersections"] = float(meta["tiles_per_gauss"].sum())
            scalars["Memory/depth chunks"] = float(meta.get("depth_chunks", 1))
        if isinstance(self.strategy, BudgetedStrategy):
            scalars["Memory/growth skipped by cap"] = float(self.strategy.growth_skipped)
        for name, value in scalars.items():
            writer.put_scalar(name=name, scalar=value, step=step)
        return scalars


def setup_model_memory(model, max_gaussians: Optional[Tuple[int, str]] = None) -> MemoryManager:
    """For a SplatMetalModel after splatfacto's populate_modules: caps its strategy and returns the
    MemoryManager built from its config (empty_cache_*, memory_log_every, max_gaussians,
    max_intersections). A strategy with a cap of its own (MCMC's cap_max) passes it as
    ``max_gaussians`` = (cap, how it was chosen) and is kept as it is."""
    config = model.config
    device = torch.device(model.kwargs.get("device") or "cpu")
    max_isects, i_source = resolve_budget(config.max_intersections, default_max_intersections, device)
    if max_gaussians is None:
        per_device = functools.partial(default_max_gaussians, sh_degree=config.sh_degree)
        max_gaussians, g_source = resolve_budget(config.max_gaussians, per_device, device)
        model.strategy = BudgetedStrategy.from_strategy(model.strategy, max_gaussians)
        try:
            model.strategy.rows_on_device = resolve_backend(config.backend, device) == "metal"
        except BackendUnavailable:  # reported where the model renders; the strategy keeps gsplat's ops
            model.strategy.rows_on_device = False
    else:
        max_gaussians, g_source = max_gaussians
    return MemoryManager(
        device,
        strategy=model.strategy,
        num_gaussians=lambda: model.num_points,
        render_meta=lambda: getattr(model, "info", None),
        empty_cache_after_refine=config.empty_cache_after_refine,
        empty_cache_after_eval=config.empty_cache_after_eval,
        empty_cache_every=config.empty_cache_every,
        log_every=config.memory_log_every,
        max_gaussians=max_gaussians,
        max_gaussians_source=g_source,
        max_intersections=max_isects,
        max_intersections_source=i_source,
    )
