"""Dispatch of train.metal: the training step's small per-element work outside the render, one launch
each where PyTorch issued 5-15 aten ops (each an encode on MPS): gsplat's densification statistics
(densify_stats), the NaN guard's flag (nonfinite_flag) and the background composite (composite). Their
references are the PyTorch expressions they replace (engine/memory.py, engine/reliability.py,
ops/composite.py), which run for every other backend."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .kernels import grid_1d, library

FLAG_SLOTS = 12  # tensors one nonfinite_flag launch reads (train.metal SPLAT_FLAG_SLOTS)
FLAG_RUN = 16  # consecutive elements one thread of nonfinite_flag reads (train.metal FLAG_RUN)


def _lib(device: torch.device):
    return library(device, "train.metal")


def densify_stats(
    grads: Tensor,  # [C, N, 2] means2d.grad or .absgrad, float32
    radii: Tensor,  # [C, N] int32
    grad2d: Tensor,  # [N] float32, updated in place
    count: Tensor,  # [N] float32, updated in place
    radii_max: Optional[Tensor],  # [N] float32, updated in place, or None (not tracked)
    scale_x: float,  # W / 2 * C
    scale_y: float,  # H / 2 * C
    size: float,  # max(W, H)
) -> None:
    """gsplat 1.4 DefaultStrategy's running statistics of one render (memory.BudgetedStrategy._update_state),
    in place, in one launch. No host sync."""
    C, N = radii.shape
    for name, t in (("grad2d", grad2d), ("count", count)) + ((("radii", radii_max),) if radii_max is not None else ()):
        if tuple(t.shape) != (N,) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"[densify_stats] {name} must be a contiguous [{N}] float32 tensor, got "
                             f"{list(t.shape)} {t.dtype}")  # fmt: skip
    if N == 0:
        return
    _lib(grads.device).densify_stats(
        grads.contiguous(), radii.contiguous(), grad2d, count, radii_max if radii_max is not None else grad2d,
        C, N, float(scale_x), float(scale_y), float(size), int(radii_max is not None), **grid_1d(N),
    )  # fmt: skip


def nonfinite_flag(tensors: Sequence[Tensor], flag: Optional[Tensor] = None) -> Tensor:
    """A [1] float32 device tensor: 0 when every element of every tensor is finite, NaN otherwise. One
    allocation and one launch per FLAG_SLOTS tensors (float32, contiguous). No host sync. ``flag``: a
    [1] float32 tensor to set to NaN instead (left as it is where every element is finite; no allocation)."""
    device = tensors[0].device
    if flag is None:
        flag = torch.zeros((1,), dtype=torch.float32, device=device)
    for start in range(0, len(tensors), FLAG_SLOTS):
        batch = [t for t in tensors[start : start + FLAG_SLOTS]]
        lengths = [t.numel() for t in batch] + [0] * (FLAG_SLOTS - len(batch))
        buffers = [t.contiguous() for t in batch] + [flag] * (FLAG_SLOTS - len(batch))
        runs = -(-max(lengths) // FLAG_RUN)
        if runs > 0:
            _lib(device).nonfinite_flag(*buffers, lengths, flag, **grid_1d(runs))  # lengths: one int64 list
    return flag


class CompositeFn(torch.autograd.Function):
    """rgb = clamp(color[..., :3] + (1 - alpha) * background, 0, 1): composite_fwd / composite_bwd."""

    @staticmethod
    def forward(ctx, color, alpha, background, squeeze=False):
        P, D = alpha.numel(), color.shape[-1]
        shape = color.shape[1 if squeeze else 0 : -1] + (3,)  # squeeze: [1, H, W, D] -> [H, W, 3]
        rgb = torch.empty(shape, dtype=torch.float32, device=color.device)
        if P > 0:
            _lib(color.device).composite_fwd(color, alpha, background, rgb, P, D, **grid_1d(P))
        ctx.save_for_backward(color, alpha, background)
        return rgb

    @staticmethod
    def backward(ctx, v_rgb):
        color, alpha, background = ctx.saved_tensors
        P, D = alpha.numel(), color.shape[-1]
        v_color = torch.empty(color.shape, dtype=torch.float32, device=color.device)
        v_alpha = torch.empty(alpha.shape, dtype=torch.float32, device=color.device)
        if P > 0:
            _lib(color.device).composite_bwd(color, alpha, background, v_rgb.contiguous(), v_color, v_alpha, P, D,
                                             **grid_1d(P))  # fmt: skip
        return v_color, v_alpha, None, None


def composite(
    color: Tensor,  # [..., D] float32 contiguous, D >= 3 (channels past 3 are not composited)
    alpha: Tensor,  # [..., 1] float32 contiguous
    background: Tensor,  # [3] float32 contiguous, no gradient
    squeeze: bool = False,  # color is [1, H, W, D]: the result is [H, W, 3]
) -> Tensor:  # [..., 3]
    if squeeze and color.shape[0] != 1:
        raise ValueError(f"[composite] squeeze needs one camera, got color {list(color.shape)}")
    return CompositeFn.apply(color, alpha, background, squeeze)
