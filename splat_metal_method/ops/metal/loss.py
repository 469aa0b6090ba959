"""Dispatch of loss.metal: splatfacto's training loss (1 - lambda) * L1 + lambda * (1 - SSIM), fused.

Three launches per step (l1_ssim_fwd, l1_ssim_reduce, l1_ssim_bwd) and six allocations, where the torch
path (ssim.FusedSSIM + L1) issues about 25 aten ops forward and as many backward. The reference and
fallback is ops/loss.py::l1_ssim_loss_reference.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from pytorch_msssim.ssim import _fspecial_gauss_1d
from torch import Tensor

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
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:  # loss [], l1 [], ssim [], partials [B, H-10, W-10, C, 3] (or [1])
    B, H, W, C = _dims(pred)
    device = pred.device
    groups_x, groups_y = -(-W // TILE), -(-H // TILE)
    groups = B * groups_x * groups_y
    shape = (B, H - WIN + 1, W - WIN + 1, C, 3) if with_partials else (1,)
    partials = torch.empty(shape, dtype=torch.float32, device=device)
    sums = torch.empty((groups, 2), dtype=torch.float32, device=device)
    lib = library(device, VARIANT[0], extra=VARIANT[1])
    lib.l1_ssim_fwd(pred, gt, _window(device), partials, sums, H, W, C, groups_x, groups_y, int(with_partials),
                    **_grid(B, H, W))  # fmt: skip
    loss, l1, ssim = (torch.empty((), dtype=torch.float32, device=device) for _ in range(3))
    lib.l1_ssim_reduce(sums, loss, l1, ssim, groups, float(B * H * W * C), float(B * (H - WIN + 1) * (W - WIN + 1) * C),
                       float(1.0 - ssim_lambda), float(ssim_lambda), threads=(TILE * TILE,), group_size=(TILE * TILE,))  # fmt: skip
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
    def forward(ctx, pred, gt, ssim_lambda):
        loss, l1, ssim, partials = l1_ssim_fwd(pred, gt, ssim_lambda, with_partials=ctx.needs_input_grad[0])
        ctx.save_for_backward(pred, gt, partials)
        ctx.ssim_lambda = ssim_lambda
        ctx.mark_non_differentiable(l1, ssim)
        ctx.set_materialize_grads(False)
        return loss, l1, ssim

    @staticmethod
    def backward(ctx, grad_loss, grad_l1, grad_ssim):
        if grad_loss is None:
            return None, None, None
        pred, gt, partials = ctx.saved_tensors
        grad_pred = l1_ssim_bwd(pred, gt, partials, grad_loss.contiguous(), ctx.ssim_lambda)
        return grad_pred, None, None  # gt: no gradient (a target); ssim_lambda: a float


def l1_ssim_loss(pred: Tensor, gt: Tensor, ssim_lambda: float) -> Tuple[Tensor, Tensor, Tensor]:
    """[B, H, W, C] or [H, W, C] float32 contiguous images, H, W >= 11 (ops/loss.py checks) -> loss, l1, ssim []."""
    return L1SSIMLossFn.apply(pred, gt, float(ssim_lambda))
