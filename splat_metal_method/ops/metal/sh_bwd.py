"""Dispatch of sh_bwd.metal: gradients of spherical-harmonics colours."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..constants import SH_MAX_DEGREE
from .kernels import grid_1d, library


def spherical_harmonics_bwd(
    degree: int,
    dirs: Tensor,  # [..., 3] unnormalised
    coeffs: Tensor,  # [..., K, 3]
    masks: Optional[Tensor],  # [...] bool
    v_colors: Tensor,  # [..., 3]
    dirs_grad: bool = True,
    colors: Optional[Tensor] = None,  # [..., 3] the forward's activated output, when it was activated
) -> Tuple[Optional[Tensor], Tensor]:
    """Runs sh_bwd. Returns v_dirs [..., 3] (None unless ``dirs_grad``) and v_coeffs [..., K, 3]
    (rows beyond (degree+1)^2 are zero). With ``colors`` (the output of an ``activate`` forward),
    the activation's gradient is applied first. No host sync."""
    op = "spherical_harmonics_bwd"
    lead = tuple(dirs.shape[:-1])
    K = coeffs.shape[-2]
    if not 0 <= int(degree) <= SH_MAX_DEGREE or K < (degree + 1) ** 2:  # sh.h's basis arrays hold degree 4 at most
        raise ValueError(f"[{op}] degree must be 0..{SH_MAX_DEGREE} with K >= (degree+1)^2, got {degree}, K={K}")
    if tuple(v_colors.shape) != lead + (3,) or v_colors.dtype != torch.float32:
        raise ValueError(
            f"[{op}] v_colors must be {list(lead) + [3]} float32, got {list(v_colors.shape)} {v_colors.dtype}"
        )
    device = dirs.device
    total = dirs.numel() // 3
    v_coeffs = torch.empty(coeffs.shape, dtype=torch.float32, device=device)
    v_dirs = torch.empty(dirs.shape, dtype=torch.float32, device=device) if dirs_grad else None
    if total == 0:
        return v_dirs, v_coeffs
    v_colors = v_colors.contiguous()
    placeholder = v_colors  # bound where the kernel reads or writes nothing (v_dirs, colors unused)
    if masks is not None:
        mask_buf = masks.to(device=device, dtype=torch.bool).contiguous()
    else:
        mask_buf = torch.ones((1,), dtype=torch.bool, device=device)
    library(device, "sh_bwd.metal").sh_bwd(
        dirs.contiguous(), coeffs.contiguous(), mask_buf, v_colors, v_coeffs,
        v_dirs if v_dirs is not None else placeholder,
        total, K, int(degree), int(masks is not None), int(dirs_grad),
        colors.contiguous() if colors is not None else placeholder, int(colors is not None),
        **grid_1d(total),
    )  # fmt: skip
    return v_dirs, v_coeffs
