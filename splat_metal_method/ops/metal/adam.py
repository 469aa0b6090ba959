"""Dispatch of adam.metal: Adam over the gaussians' parameter tensors in one per-gaussian pass (adam_step),
after a 6-thread launch that counts the steps and derives the bias corrections (adam_prepare), with the
NaN guard's flag folded in. Two launches and no aten op where torch's fused Adam issues two dispatches
per parameter group and the guard's nonfinite_flag reads every parameter and gradient again.

The state is torch's: ``exp_avg``, ``exp_avg_sq`` and a float32 ``step`` on the parameters' device per
parameter (what torch.optim.Adam(fused=True) keeps), updated in place; the oracle is torch.optim.Adam
(tests/ops/metal/test_adam.py). The moments are views of two allocations, the moment arenas (every exp_avg
one, every exp_avg_sq the other: ``pack_moments``), so that adam_step binds 2 buffers and offsets where it bound
12 tensors (docs/metal.md, "Argument slots"). Who calls it and when torch's optimizer runs instead:
engine/optimizers.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .kernels import grid_1d, library
from .params import ADAM_STEP, pack
from .variants import ADAM_SLOTS

SLOTS = ADAM_SLOTS  # parameter tensors one launch steps (adam.metal SPLAT_ADAM_SLOTS)
COEFS = 4  # floats per slot in the coefficient buffer (adam.metal SPLAT_ADAM_COEFS)
MAX_WIDTH = 255  # floats per row of one slot (a byte of adam_step's `widths`)

# Bound buffers adam_step reads and writes in place (each slot's parameter, the two moment arenas): the step
# ledger counts them twice, so Adam's bytes are its accesses (7 per float: p, g, m, v read; p, m, v written).
READ_WRITE_ARGS = tuple(2 * k for k in range(SLOTS)) + (2 * SLOTS, 2 * SLOTS + 1)

_spans: Dict[tuple, Tensor] = {}  # (device, storage address, offset, length) -> a kernel's flat view of an arena
_no_radii: Dict[torch.device, Tensor] = {}  # adam_step's radii placeholder where every gaussian steps
_scratch: Dict[torch.device, list] = {}  # device -> [coef, flags, steps so far]: reused (stream-ordered)


def _lib(device: torch.device):
    return library(device, "adam.metal")


def scratch(device: torch.device) -> tuple:
    """(coef, flag) for the next step on ``device``: allocated once, so a step allocates nothing. Every use is
    ordered on the device's queue (adam_prepare writes both, adam_step reads coef, the NaN guard's
    non-blocking copy of the flag is queued before a later step clears it). Two flags, alternating: where
    that copy is the tensor itself (CPU tensors under the emulator) the guard reads a step's flag at the
    next step's check, after that step cleared the other one."""
    device = torch.device(device)
    entry = _scratch_entry(device)
    entry[2] += 1
    return entry[0], entry[1][entry[2] % 2]


def _scratch_entry(device: torch.device) -> list:
    device = torch.device(device)
    if device not in _scratch:  # [coef, (flag, flag), steps so far, sink: a flag nobody reads]
        _scratch[device] = [torch.zeros(SLOTS * COEFS + 2, dtype=torch.float32, device=device),
                            tuple(torch.zeros(1, dtype=torch.float32, device=device) for _ in range(2)), 0,
                            torch.zeros(1, dtype=torch.float32, device=device)]  # fmt: skip
    return _scratch[device]


def check(params: Sequence[Tensor], grads, exp_avgs, exp_avg_sqs, steps) -> str:
    """'' when fused_adam can step these tensors, else why not (one line)."""
    if not 0 < len(params) <= SLOTS:
        return f"{len(params)} tensors (1..{SLOTS})"
    n, device = params[0].shape[0] if params[0].dim() else -1, params[0].device
    for i, (p, g, m, v, s) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        for what, t in (("parameter", p), ("gradient", g), ("exp_avg", m), ("exp_avg_sq", v)):
            if t is None or t.dtype != torch.float32 or not t.is_contiguous() or t.is_sparse:
                return f"{what} {i} is not a contiguous float32 tensor"
            if t.shape != p.shape or t.device != device:
                return f"{what} {i} is not of its parameter's shape and device"
        if p.dim() == 0 or p.shape[0] != n:
            return f"parameter {i} has {list(p.shape)}, not [{n}, ...] rows"
        if not 0 < math.prod(p.shape[1:]) <= MAX_WIDTH:
            return f"parameter {i} has {math.prod(p.shape[1:])} floats per row (1..{MAX_WIDTH})"
        if not isinstance(s, Tensor) or s.dtype != torch.float32 or s.numel() != 1 or s.device != device:
            return f"step {i} is not a float32 scalar on {device}"
    return ""


def _extent(t: Tensor) -> Tuple[int, int, int]:
    """(its storage's address, first byte, end byte) of a contiguous tensor in its storage."""
    start = t.storage_offset() * t.element_size()
    return t.untyped_storage().data_ptr(), start, start + t.numel() * t.element_size()


def overlapping(tensors: Sequence[Tensor]) -> Optional[Tuple[int, int]]:
    """The indices of two of ``tensors`` (contiguous) that share an element, or None (from their metadata: no
    device read). Moments that overlap each other or a parameter are not the kernel's to step (torch's Adam
    steps them one after the other, so they mean something else there)."""
    seen = sorted((_extent(t), i) for i, t in enumerate(tensors) if t.numel())
    end, last = (None, 0), None  # (storage, end byte) of the extent reaching furthest so far, and its index
    for (ptr, start, stop), i in seen:
        if ptr == end[0] and start < end[1]:
            return min(i, last), max(i, last)
        if ptr != end[0] or stop > end[1]:
            end, last = (ptr, stop), i
    return None


def arena(tensors: Sequence[Tensor]) -> Optional[Tuple[Tensor, List[int]]]:
    """(the one of ``tensors`` lowest in their allocation, each one's element offset from it) where all are views of
    one allocation (float32, contiguous), else None. The kernel binds that tensor (a view binds at its offset) and
    reaches the others at their offsets. Metadata only: no device read, no aten op."""
    ptr = tensors[0].untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != ptr for t in tensors):
        return None
    low = min(tensors, key=lambda t: t.storage_offset())
    return low, [t.storage_offset() - low.storage_offset() for t in tensors]


def arena_span(tensors: Sequence[Tensor]) -> Tuple[Tensor, List[int]]:
    """(one flat view of the allocation ``tensors`` are views of (arena() not None), from the lowest of them to the end
    of the furthest; each one's element offset in it): what a kernel binds for them. The view is made once per
    arena and span and kept (_spans, emptied by pack_moments), so a steady step makes no view op."""
    low, offsets = arena(tensors)
    end = max(o + t.numel() for o, t in zip(offsets, tensors))
    key = (low.device, low.untyped_storage().data_ptr(), low.storage_offset(), end)
    span = _spans.get(key)
    if span is None:  # (a kept view keeps its storage alive: no other allocation can take its address)
        span = _spans[key] = low.as_strided((end,), (1,), low.storage_offset())
    return span, offsets


def pack_moments(states: Sequence[dict]) -> None:
    """Makes the ``exp_avg`` of every state (torch Adam's, one per parameter) a view of one new allocation and every
    ``exp_avg_sq`` one of another, the moment arenas adam_step binds (each parameter's moment a contiguous view
    of its shape, values copied: one torch.cat each). Where a densification, a checkpoint load or a first step
    left the moments apart; torch's Adam, state_dict and the densification's slicing work on the views."""
    _spans.clear()  # the old arenas' views: their memory goes with the old moments
    for key in ("exp_avg", "exp_avg_sq"):
        moments = [s[key] for s in states]
        flat = torch.cat([m.reshape(-1) for m in moments])
        start = 0
        for s, m in zip(states, moments):
            s[key] = flat[start : start + m.numel()].view(m.shape)
            start += m.numel()


def zero_moments(params: Sequence[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
    """(exp_avgs, exp_avg_sqs): zero moments of ``params`` as adam_step binds them, views of two new allocations."""
    states = [{"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)} for p in params]
    pack_moments(states)
    return [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]


def moments_why(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs, exp_avg_sqs) -> str:
    """'' when adam_step can bind these moments (checked tensors: adam.check): every exp_avg a view of one
    allocation, every exp_avg_sq of one, no two of the tensors sharing memory; else why not (one line)."""
    shared = overlapping([*params, *grads, *exp_avgs, *exp_avg_sqs])
    if shared is not None:
        kinds = zip(("parameter", "gradient", "exp_avg", "exp_avg_sq"), (params, grads, exp_avgs, exp_avg_sqs))
        what = [f"{w} {i}" for w, ts in kinds for i in range(len(ts))]
        return f"{what[shared[0]]} and {what[shared[1]]} share memory"
    if arena(exp_avgs) is None or arena(exp_avg_sqs) is None:
        return "the moments are not views of the two moment arenas (adam.pack_moments)"
    return ""


@torch.no_grad()
def fused_adam(
    params: Sequence[Tensor],  # up to SLOTS tensors [N, ...] float32 contiguous, updated in place
    grads: Sequence[Tensor],  # each its parameter's shape
    exp_avgs: Sequence[Tensor],  # each its parameter's shape, views of one allocation (pack_moments), in place
    exp_avg_sqs: Sequence[Tensor],  # each its parameter's shape, views of another, updated in place
    steps: Sequence[Tensor],  # [] or [1] float32 on the device each, incremented in place
    lrs: Sequence[float],
    eps: Sequence[float],
    beta1: float,
    beta2: float,
    flag: Optional[Tensor] = None,  # this step's flag where the SH step in the backward (ShStep) set it up
    radii: Optional[Tensor] = None,  # [C, N] int32, the render's: a gaussian with radius 0 in each takes no step
) -> Tensor:  # [1] float32: 0, or NaN where a gradient or an updated parameter is not finite
    """One Adam step (torch's, amsgrad/weight decay/maximize off) of every tensor. No host sync. The flag
    is a buffer reused by the next step on this device: read (or copy) it before then. Given ``flag`` (what
    the backward's SH step already folded its verdict into), this step folds its own into it. Given ``radii``
    (the model's visible_adam), a gaussian not visible in that render keeps its parameters and moments."""
    why = check(params, grads, exp_avgs, exp_avg_sqs, steps) or moments_why(params, grads, exp_avgs, exp_avg_sqs)
    if why:
        raise ValueError(f"[fused_adam] {why}")
    device = params[0].device
    n = params[0].shape[0]
    if radii is not None and (radii.dim() != 2 or radii.shape[1] != n or radii.dtype != torch.int32
                              or radii.device != device or not radii.is_contiguous()):  # fmt: skip
        raise ValueError(f"[fused_adam] radii must be [C, {n}] contiguous int32 on {device}, got "
                         f"{list(radii.shape)} {radii.dtype} on {radii.device}")  # fmt: skip
    cams = 0 if radii is None else radii.shape[0]
    if radii is None:
        radii = _no_radii.setdefault(device, torch.zeros(1, dtype=torch.int32, device=device))  # never read
    if flag is None:
        coef, flag = scratch(device)
        cleared = flag
    else:  # adam_prepare clears the flag it is given: give it the sink, keep the SH step's verdict
        coef, cleared = _scratch_entry(device)[0], _scratch_entry(device)[3]
    k = len(params)
    pad = SLOTS - k
    lib = _lib(device)
    _prepare(lib, steps, lrs, eps, beta1, beta2, coef, cleared)
    widths = sum(math.prod(p.shape[1:]) << (8 * i) for i, p in enumerate(params))
    pairs = [t for i in range(k) for t in (params[i], grads[i])] + [params[0], grads[0]] * pad  # unused: width 0
    if n > 0:
        (avg_arena, avg_at), (avg_sq_arena, avg_sq_at) = arena_span(exp_avgs), arena_span(exp_avg_sqs)
        at = dict(zip(ADAM_STEP[3:], avg_at + avg_at[:1] * pad + avg_sq_at + avg_sq_at[:1] * pad))  # element offsets
        args = pack(ADAM_STEP, N=n, widths=widths, cams=cams, **at)
        lib.adam_step(*pairs, avg_arena, avg_sq_arena, coef, flag, args, radii, **grid_1d(n))
    return flag


def _prepare(lib, steps, lrs, eps, beta1, beta2, coef, flag) -> None:
    """adam_prepare: steps += 1, the coefficients of every slot, the flag cleared."""
    k, pad = len(steps), SLOTS - len(steps)
    lib.adam_prepare(*steps, *[steps[0]] * pad, *[float(x) for x in lrs], *[0.0] * pad,
                     *[float(x) for x in eps], *[0.0] * pad, float(beta1), float(beta2), k, coef, flag,
                     threads=(SLOTS,), group_size=(SLOTS,))  # fmt: skip


@dataclass
class ShStep:
    """The SH coefficients' Adam step, armed by engine/optimizers.py for the next backward: the projection's
    backward (prepare.py, project_bwd.metal PROJECT_SH_ADAM) takes it in the kernel that computes their
    gradients, so no SH gradient is written and read back. ``optimizers``: torch Adams of features_dc and
    features_rest (one tensor each, checked by GaussianOptimizers); their state, step counters, learning
    rates and eps are read when the backward takes the step. ``others``: the Adams of those of means, quats,
    scales and opacities (PARAMS_IN_BACKWARD) armed with them (project_bwd.metal PROJECT_ADAM_*), stepped
    in the same kernel where the backward differentiates exactly those tensors. ``flag``: that step's NaN
    flag once taken; ``taken``: the groups it stepped (the SH groups first). ``visible_only`` (the model's
    visible_adam): the kernel leaves a gaussian culled in that render (radius 0) and its moments untouched
    (project_bwd.metal PROJECT_ADAM_VISIBLE)."""

    optimizers: tuple  # (features_dc's, features_rest's) torch.optim.Adam
    others: Dict[str, torch.optim.Optimizer] = field(default_factory=dict)  # name -> its Adam
    flag: Optional[Tensor] = None  # [1] set when taken
    taken: Tuple[str, ...] = ()  # set when taken
    visible_only: bool = False  # the model's visible_adam: a gaussian culled in the render takes no step at all

    def params(self) -> tuple:
        return tuple(opt.param_groups[0]["params"][0] for opt in self.optimizers)


# the parameters besides the SH coefficients that can take their step inside project_bwd, in the order of its
# PROJECT_ADAM_* flags and slot bytes
PARAMS_IN_BACKWARD = ("means", "quats", "scales", "opacities")

_armed: Optional[ShStep] = None  # the step the next backward may take (one: a step is taken once)


def arm_sh_step(step: Optional[ShStep]) -> None:
    """Arms ``step`` for the next backward (None: disarms)."""
    global _armed
    _armed = step


def _same(t: Tensor, p: Tensor) -> bool:
    return t is p or (t.data_ptr() == p.data_ptr() and t.shape == p.shape)


def take_sh_step(sh_dc: Tensor, sh_rest: Tensor, others: Optional[Dict[str, Optional[Tensor]]] = None):
    """Where the armed step is for exactly these SH parameters: counts their step (and that of every armed
    parameter of ``others`` (name -> the tensor the backward differentiates there, None where it takes no
    gradient) that is the armed tensor), derives the coefficients (adam_prepare: slot 0 features_dc, slot 1
    features_rest, then the others in PARAMS_IN_BACKWARD's order), clears a flag, disarms and returns the buffers
    project_bwd binds: (coef, flag, exp_avg dc, exp_avg_sq dc, exp_avg rest, exp_avg_sq rest, {name: (exp_avg,
    exp_avg_sq, slot)}, visible_only). Else None."""
    global _armed
    step = _armed
    if step is None:
        return None
    params = step.params()
    if any(not _same(t, p) for t, p in zip((sh_dc, sh_rest), params)):
        return None  # another render's tensors (or a densification replaced them): the gradient path
    others = others or {}
    opts, names = list(step.optimizers), []
    for name in PARAMS_IN_BACKWARD:
        opt, t = step.others.get(name), others.get(name)
        if opt is not None and t is not None and _same(t, opt.param_groups[0]["params"][0]):
            opts.append(opt)
            names.append(name)
    params = [opt.param_groups[0]["params"][0] for opt in opts]
    states = [opt.state[p] for opt, p in zip(opts, params)]
    groups = [opt.param_groups[0] for opt in opts]
    tensors = [(s["exp_avg"], s["exp_avg_sq"]) for s in states]
    if check(list(params), list(params), *zip(*tensors), [s["step"] for s in states]) or moments_why(
        params, [], *zip(*tensors)
    ):  # (moments apart from the arenas, or sharing memory: the gradient path, then torch's Adam or adam_step)
        return None
    _armed = None
    device = sh_dc.device
    coef, flag = scratch(device)
    beta1, beta2 = groups[0]["betas"]
    _prepare(_lib(device), [s["step"] for s in states], [g["lr"] for g in groups], [g["eps"] for g in groups],
             beta1, beta2, coef, flag)  # fmt: skip
    step.flag = flag
    step.taken = ("features_dc", "features_rest") + tuple(names)
    more = {name: (*tensors[2 + i], 2 + i) for i, name in enumerate(names)}
    return coef, flag, tensors[0][0], tensors[0][1], tensors[1][0], tensors[1][1], more, step.visible_only
