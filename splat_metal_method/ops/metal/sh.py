"""Dispatch of sh.metal: spherical-harmonics colours, degree 0..4."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..constants import SH_MAX_DEGREE
from .kernels import grid_1d, library


def spherical_harmonics_fwd(
    degree: int,
    dirs: Tensor,  # [C, N, 3] unnormalised
    coeffs: Tensor,  # [C, N, K, 3], K >= (degree+1)^2
    masks: Optional[Tensor] = None,  # [C, N] bool
    activate: bool = False,
) -> Tensor:  # [C, N, 3]; with ``activate`` clamp_min(colour + 0.5, 0) (sh.metal)
    op = "spherical_harmonics"
    if not 0 <= int(degree) <= SH_MAX_DEGREE:  # sh.h's basis arrays hold degree 4 at most
        raise ValueError(f"[{op}] degree must be 0..{SH_MAX_DEGREE}, got {degree}")
    if dirs.dim() < 1 or dirs.shape[-1] != 3:
        raise ValueError(f"[{op}] dirs must be [..., 3], got {list(dirs.shape)}")
    lead = tuple(dirs.shape[:-1])
    if coeffs.dim() != dirs.dim() + 1 or tuple(coeffs.shape[:-2]) != lead or coeffs.shape[-1] != 3:
        raise ValueError(f"[{op}] coeffs must be {list(lead) + ['K', 3]}, got {list(coeffs.shape)}")
    K = coeffs.shape[-2]
    if K < (degree + 1) ** 2:
        raise ValueError(f"[{op}] degree {degree} needs K >= {(degree + 1) ** 2} coefficients, got K={K}")
    if masks is not None and tuple(masks.shape) != lead:
        raise ValueError(f"[{op}] masks must be {list(lead)}, got {list(masks.shape)}")
    for name, t in (("dirs", dirs), ("coeffs", coeffs)):
        if t.dtype != torch.float32:
            raise ValueError(f"[{op}] {name} must be float32, got {t.dtype}")
        if t.device != dirs.device:
            raise ValueError(f"[{op}] {name} is on {t.device}, expected {dirs.device}")
    device = dirs.device
    total = dirs.numel() // 3
    colors = torch.empty(lead + (3,), dtype=torch.float32, device=device)
    if total == 0:
        return colors
    if masks is not None:
        mask_buf = masks.to(device=device, dtype=torch.bool).contiguous()
    else:
        mask_buf = torch.ones((1,), dtype=torch.bool, device=device)
    library(device, "sh.metal").sh_fwd(
        dirs.contiguous(), coeffs.contiguous(), mask_buf, colors,
        total, K, int(degree), int(masks is not None), int(activate),
        **grid_1d(total),
    )  # fmt: skip
    return colors
