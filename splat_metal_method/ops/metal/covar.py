"""Dispatch of covar.metal: covariances and precisions of gaussians (gsplat's quat_scale_to_covar_preci)."""

from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from .kernels import grid_1d, library


def quat_scale_to_covar_preci_fwd(
    quats: Tensor,  # [N, 4] wxyz (normalised in the kernel), float32
    scales: Tensor,  # [N, 3] float32
    compute_covar: bool = True,
    compute_preci: bool = True,
    triu: bool = False,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Runs quat_scale_to_covar_preci_fwd (no autograd): covariances and precisions [N, 3, 3], or
    [N, 6] upper triangles with ``triu``; None for the one not asked for."""
    N = quats.shape[0]
    if N >= 2**31:
        raise ValueError(f"[quat_scale_to_covar_preci] N = {N} exceeds the kernel's 32-bit thread index")
    shape = (N, 6) if triu else (N, 3, 3)
    covars = quats.new_empty(shape if compute_covar else (1,))
    precis = quats.new_empty(shape if compute_preci else (1,))
    if N > 0 and (compute_covar or compute_preci):
        library(quats.device, "covar.metal").quat_scale_to_covar_preci_fwd(
            quats.contiguous(), scales.contiguous(), covars, precis, N, int(bool(compute_covar)),
            int(bool(compute_preci)), int(bool(triu)), **grid_1d(N),
        )  # fmt: skip
    return (covars if compute_covar else None), (precis if compute_preci else None)
