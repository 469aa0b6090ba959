"""splatfacto's training loss, ``(1 - ssim_lambda) * L1 + ssim_lambda * (1 - SSIM)``, as one op.

    loss, l1, ssim = l1_ssim_loss(pred, gt, ssim_lambda, backend)

pred, gt: [H, W, C] or [B, H, W, C] float images in [0, 1] (channel last, as the model renders them);
returns three 0-dim tensors: the loss (differentiable in pred; gt is a target and gets no gradient from the
metal backend), the mean |gt - pred| and the mean SSIM (pytorch_msssim's, as splatfacto computes it: 11-tap
gaussian window, sigma 1.5, valid padding, data range 1), both detached when the metal kernels ran.

backend: as rasterization's ("auto" resolves by device). "metal" runs ops/metal/loss.metal (three launches);
every other backend, what those kernels do not cover (float32 images at least 11 x 11 pixels), and a GPU on
which they failed the self-check (stage "loss", ops/stage_fallback.py) run the reference: ssim.FusedSSIM + L1
with torch ops, splatfacto's own formula.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .ssim import FusedSSIM

_ssim_modules: dict = {}  # (channels, device) -> FusedSSIM


def l1_ssim_loss_reference(pred: Tensor, gt: Tensor, ssim_lambda: float) -> Tuple[Tensor, Tensor, Tensor]:
    """splatfacto's get_loss_dict main_loss, with its SSIM as ssim.FusedSSIM: the oracle and the fallback."""
    X = gt if gt.dim() == 4 else gt[None]  # [B, H, W, C]
    Y = pred if pred.dim() == 4 else pred[None]
    key = (X.shape[-1], X.device)
    ssim_module = _ssim_modules.get(key)
    if ssim_module is None:
        ssim_module = _ssim_modules[key] = FusedSSIM(data_range=1.0, channel=X.shape[-1]).to(X.device)
    l1 = torch.abs(gt - pred).mean()
    ssim = ssim_module(X.permute(0, 3, 1, 2), Y.permute(0, 3, 1, 2))
    loss = (1 - ssim_lambda) * l1 + ssim_lambda * (1 - ssim)
    return loss, l1, ssim


def l1_ssim_loss(pred: Tensor, gt: Tensor, ssim_lambda: float, backend: str = "auto",
                 stats: bool = True) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:  # fmt: skip
    """(loss, l1, ssim), 0-dim each, of pred and gt [H, W, C] or [B, H, W, C] (module docstring). Without
    ``stats`` l1 and ssim are None (a training step needs the loss only: the metal kernels then allocate
    two tensors fewer)."""
    if pred.shape != gt.shape or pred.dim() not in (3, 4):
        raise ValueError(f"[l1_ssim_loss] pred and gt must both be [H, W, C] or [B, H, W, C], got "
                         f"{list(pred.shape)} and {list(gt.shape)}")  # fmt: skip
    from .rasterization import resolve_backend
    from .stage_fallback import failed

    if resolve_backend(backend, pred.device) == "metal" and _metal_covers(pred, gt) and "loss" not in failed():
        from .metal.loss import l1_ssim_loss as metal_loss

        return metal_loss(pred.contiguous(), gt.contiguous(), ssim_lambda, stats)
    loss, l1, ssim = l1_ssim_loss_reference(pred, gt, ssim_lambda)
    return (loss, l1, ssim) if stats else (loss, None, None)


def _metal_covers(pred: Tensor, gt: Tensor) -> bool:
    from .metal.loss import WIN

    return (pred.dtype == gt.dtype == torch.float32 and pred.device == gt.device and min(pred.shape[-3:-1]) >= WIN
            and pred.numel() > 0 and not gt.requires_grad)  # fmt: skip
