"""Dispatch of adam.metal: Adam over the gaussians' parameter tensors in one per-gaussian pass (adam_step),
after a 6-thread launch that counts the steps and derives the bias corrections (adam_prepare), with the
NaN guard's flag folded in. Two launches and no aten op where torch's fused Adam issues two dispatches
per parameter group and the guard's nonfinite_flag reads every parameter and gradient again.

The state is torch's: ``exp_avg``, ``exp_avg_sq`` and a float32 ``step`` on the parameters' device per
parameter (what torch.optim.Adam(fused=True) keeps), updated in place; the oracle is torch.optim.Adam
(tests/ops/metal/test_adam.py). Who calls it and when torch's optimizer runs instead:
engine/optimizers.py."""

from __future__ import annotations

import math
from typing import Dict, Sequence

import torch
from torch import Tensor

from .kernels import grid_1d, library
from .variants import ADAM_SLOTS

SLOTS = ADAM_SLOTS  # parameter tensors one launch steps (adam.metal SPLAT_ADAM_SLOTS)
COEFS = 4  # floats per slot in the coefficient buffer (adam.metal SPLAT_ADAM_COEFS)
MAX_WIDTH = 255  # floats per row of one slot (a byte of adam_step's `widths`)

# Bound buffers adam_step reads and writes in place (parameter, exp_avg, exp_avg_sq of each slot): the step
# ledger counts them twice, so Adam's bytes are its accesses (7 per float: p, g, m, v read; p, m, v written).
READ_WRITE_ARGS = tuple(4 * k + j for k in range(SLOTS) for j in (0, 2, 3))

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
    if device not in _scratch:
        _scratch[device] = [torch.zeros(SLOTS * COEFS + 2, dtype=torch.float32, device=device),
                            tuple(torch.zeros(1, dtype=torch.float32, device=device) for _ in range(2)), 0]  # fmt: skip
    entry = _scratch[device]
    entry[2] += 1
    return entry[0], entry[1][entry[2] % 2]


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


@torch.no_grad()
def fused_adam(
    params: Sequence[Tensor],  # up to SLOTS tensors [N, ...] float32 contiguous, updated in place
    grads: Sequence[Tensor],  # each its parameter's shape
    exp_avgs: Sequence[Tensor],  # each its parameter's shape, updated in place
    exp_avg_sqs: Sequence[Tensor],  # each its parameter's shape, updated in place
    steps: Sequence[Tensor],  # [] or [1] float32 on the device each, incremented in place
    lrs: Sequence[float],
    eps: Sequence[float],
    beta1: float,
    beta2: float,
) -> Tensor:  # [1] float32: 0, or NaN where a gradient or an updated parameter is not finite
    """One Adam step (torch's, amsgrad/weight decay/maximize off) of every tensor. No host sync. The flag
    is a buffer reused by the next step on this device: read (or copy) it before then."""
    why = check(params, grads, exp_avgs, exp_avg_sqs, steps)
    if why:
        raise ValueError(f"[fused_adam] {why}")
    device = params[0].device
    coef, flag = scratch(device)
    k = len(params)
    pad = SLOTS - k
    lib = _lib(device)
    lib.adam_prepare(*steps, *[steps[0]] * pad, *[float(x) for x in lrs], *[0.0] * pad,
                     *[float(x) for x in eps], *[0.0] * pad, float(beta1), float(beta2), k, coef, flag,
                     threads=(SLOTS,), group_size=(SLOTS,))  # fmt: skip
    n = params[0].shape[0]
    widths = sum(math.prod(p.shape[1:]) << (8 * i) for i, p in enumerate(params))
    quads = [t for i in range(k) for t in (params[i], grads[i], exp_avgs[i], exp_avg_sqs[i])]
    quads += [params[0], grads[0], exp_avgs[0], exp_avg_sqs[0]] * pad  # unused slots: width 0, never read
    if n > 0:
        lib.adam_step(*quads, coef, flag, n, widths, **grid_1d(n))
    return flag
