"""Dispatch of loss.metal: splatfacto's training loss (1 - lambda) * L1 + lambda * (1 - SSIM), fused.

Three launches per step (l1_ssim_fwd, l1_ssim_reduce, l1_ssim_bwd), msplat's count for its loss (its
ssim_h_fwd, ssim_fused_v_fwd_h_bwd, ssim_v_bwd: one blur direction per launch, where l1_ssim_fwd stages a
patch and blurs both), with 3 floats per SSIM-map pixel and channel kept between forward and backward (msplat
keeps 15 per pixel and direction). Three allocations in a training step (the partials, the loss, the
gradient; the per-group sums live in a workspace buffer, and L1 / SSIM are written only when asked), where
the torch path (ssim.FusedSSIM + L1) issues about 25 aten ops forward and as many backward. The reference
and fallback is ops/loss.py::l1_ssim_loss_reference.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from pytorch_msssim.ssim import _fspecial_gauss_1d
from torch import Tensor

from ..workspace import workspace
from .kernels import library
from .variants import LOSS_TILE, LOSS_VARIANT, LOSS_WIN

TILE, WIN, VARIANT = LOSS_TILE, LOSS_WIN, LOSS_VARIANT  # block side, window taps, (file, defines)
_windows: Dict[torch.device, Tensor] = {}


def _window(device: torch.device) -> Tensor:  # [WIN]
    """The reference's window on `device`, copied there once per process (not per step)."""
    win = _windows.get(device)
    if win is None:
        win = _windows[device] = _fspecial_gauss_1d(WIN, 1.5).reshape(WIN).to(device).contiguous()
    return win


def _grid(B: int, H: int, W: int) -> dict:
    return {"threads": (-(-W // TILE) * TILE, -(-H // TILE) * TILE, B), "group_size": (TILE, TILE, 1)}


def _dims(pred: Tensor) -> Tuple[int, int, int, int]:
    """(B, H, W, C) of [H, W, C] (B = 1) or [B, H, W, C]: read from the shape, no view op."""
    return (pred.shape[0] if pred.dim() == 4 else 1,) + tuple(pred.shape[-3:])


def l1_ssim_fwd(
    pred: Tensor,  # [B, H, W, C] or [H, W, C], float32 contiguous, H, W >= WIN
    gt: Tensor,  # same shape
    ssim_lambda: float,
    with_partials: bool,
    stats: bool = True,
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor], Tensor]:
    """loss [], l1 [] and ssim [] (None without ``stats``), partials [B, H-10, W-10, C, 3] (or [1])."""
    B, H, W, C = _dims(pred)
    device = pred.device
    groups_x, groups_y = -(-W // TILE), -(-H // TILE)
    groups = B * groups_x * groups_y
    shape = (B, H - WIN + 1, W - WIN + 1, C, 3) if with_partials else (1,)
    partials = torch.empty(shape, dtype=torch.float32, device=device)
    # [groups, 2], read by l1_ssim_reduce right below: scratch (the whole buffer, no slice op)
    sums = workspace().at_least("loss.sums", 2 * groups, torch.float32, device)
    lib = library(device, VARIANT[0], extra=VARIANT[1])
    lib.l1_ssim_fwd(pred, gt, _window(device), partials, sums, H, W, C, groups_x, groups_y, int(with_partials),
                    **_grid(B, H, W))  # fmt: skip
    loss = torch.empty((), dtype=torch.float32, device=device)
    l1, ssim = (torch.empty((), dtype=torch.float32, device=device) for _ in range(2)) if stats else (None, None)
    lib.l1_ssim_reduce(sums, loss, l1 if stats else loss, ssim if stats else loss, groups, float(B * H * W * C),
                       float(B * (H - WIN + 1) * (W - WIN + 1) * C), float(1.0 - ssim_lambda), float(ssim_lambda),
                       int(stats), threads=(TILE * TILE,), group_size=(TILE * TILE,))  # fmt: skip
    return loss, l1, ssim, partials


def l1_ssim_bwd(
    pred: Tensor,  # [B, H, W, C] or [H, W, C]
    gt: Tensor,  # same shape
    partials: Tensor,  # [B, H-10, W-10, C, 3] from l1_ssim_fwd
    grad_loss: Tensor,  # [] on pred's device
    ssim_lambda: float,
) -> Tensor:  # pred's shape: d loss / d pred
    B, H, W, C = _dims(pred)
    grad_pred = torch.empty_like(pred)
    library(pred.device, VARIANT[0], extra=VARIANT[1]).l1_ssim_bwd(
        pred, gt, _window(pred.device), partials, grad_loss, grad_pred, H, W, C,
        float((1.0 - ssim_lambda) / (B * H * W * C)), float(ssim_lambda / (B * (H - WIN + 1) * (W - WIN + 1) * C)),
        **_grid(B, H, W),
    )  # fmt: skip
    return grad_pred


class L1SSIMLossFn(torch.autograd.Function):
    """(loss, l1, ssim) of [B, H, W, C] or [H, W, C] images; gradient to pred only (gt is a target)."""

    @staticmethod
    def forward(ctx, pred, gt, ssim_lambda, stats=True):
        loss, l1, ssim, partials = l1_ssim_fwd(pred, gt, ssim_lambda, with_partials=ctx.needs_input_grad[0],
                                               stats=stats)  # fmt: skip
        ctx.save_for_backward(pred, gt, partials)
        ctx.ssim_lambda = ssim_lambda
        ctx.set_materialize_grads(False)
        if not stats:
            return loss
        ctx.mark_non_differentiable(l1, ssim)
        return loss, l1, ssim

    @staticmethod
    def backward(ctx, grad_loss, grad_l1=None, grad_ssim=None):
        if grad_loss is None:
            return None, None, None, None
        pred, gt, partials = ctx.saved_tensors
        grad_pred = l1_ssim_bwd(pred, gt, partials, grad_loss.contiguous(), ctx.ssim_lambda)
        return grad_pred, None, None, None  # gt: no gradient (a target); ssim_lambda: a float; stats: a bool


def l1_ssim_loss(pred: Tensor, gt: Tensor, ssim_lambda: float, stats: bool = True):
    """[B, H, W, C] or [H, W, C] float32 contiguous images, H, W >= 11 (ops/loss.py checks) -> loss, l1, ssim []
    (l1 and ssim None without ``stats``: not computed into tensors, two allocations fewer)."""
    if not stats:
        return L1SSIMLossFn.apply(pred, gt, float(ssim_lambda), False), None, None
    return L1SSIMLossFn.apply(pred, gt, float(ssim_lambda), True)
