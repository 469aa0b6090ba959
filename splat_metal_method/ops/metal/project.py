"""Dispatch of project.metal: EWA projection of gaussians into every camera."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import params
from .kernels import grid_1d, library


def _check(op: str, name: str, t: Tensor, shape: tuple, device: torch.device) -> Tensor:
    if tuple(t.shape) != shape:
        raise ValueError(f"[{op}] {name} must be {list(shape)}, got {list(t.shape)}")
    if t.dtype != torch.float32:
        raise ValueError(f"[{op}] {name} must be float32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"[{op}] {name} is on {t.device}, expected {device} like means")
    return t.contiguous()


def project_fwd(
    means: Tensor,  # [N, 3]
    quats: Tensor,  # [N, 4] wxyz (normalised in the kernel)
    scales: Tensor,  # [N, 3]
    viewmats: Tensor,  # [C, 4, 4]
    Ks: Tensor,  # [C, 3, 3]
    width: int,
    height: int,
    eps2d: float = 0.3,
    near_plane: float = 0.01,
    far_plane: float = 1e10,
    radius_clip: float = 0.0,
    calc_compensations: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Runs project_fwd. Returns radii [C,N] int32, means2d [C,N,2], depths [C,N], conics [C,N,3],
    compensations [C,N] or None; culled entries are 0 everywhere."""
    op = "project"
    device = means.device
    N = means.shape[0]
    C = viewmats.shape[0]
    means = _check(op, "means", means, (N, 3), device)
    quats = _check(op, "quats", quats, (N, 4), device)
    scales = _check(op, "scales", scales, (N, 3), device)
    viewmats = _check(op, "viewmats", viewmats, (C, 4, 4), device)
    Ks = _check(op, "Ks", Ks, (C, 3, 3), device)
    if C * N >= 2**31:
        raise ValueError(f"[{op}] C*N = {C * N} exceeds the kernels' 32-bit thread index")

    radii = torch.empty((C, N), dtype=torch.int32, device=device)
    means2d = torch.empty((C, N, 2), dtype=torch.float32, device=device)
    depths = torch.empty((C, N), dtype=torch.float32, device=device)
    conics = torch.empty((C, N, 3), dtype=torch.float32, device=device)
    comp = torch.empty((C, N) if calc_compensations else (1,), dtype=torch.float32, device=device)
    if C * N > 0:
        ints = params.pack(params.PROJECT_FWD_INTS, C=C, N=N, width=int(width), height=int(height),
                           calc_comp=int(bool(calc_compensations)), flags=0, degree=0, dc_stride=0, rest_stride=0,
                           rest_offset=0)  # flags 0: the plain stage, no fused preparation (prepare.py)  # fmt: skip
        floats = params.pack(params.PROJECT_FWD_FLOATS, eps2d=float(eps2d), near_plane=float(near_plane),
                             far_plane=float(far_plane), radius_clip=float(radius_clip))  # fmt: skip
        library(device, "project.metal").project_fwd(
            means, quats, scales, viewmats, Ks, radii, means2d, depths, conics, comp, ints, floats,
            means, means, means, means, depths, **grid_1d(C * N),
        )  # fmt: skip
    elif calc_compensations:
        comp = torch.empty((C, N), dtype=torch.float32, device=device)
    return radii, means2d, depths, conics, (comp if calc_compensations else None)
