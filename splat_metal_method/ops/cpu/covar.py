"""Dispatch of covar.cpp: covariances and precisions of gaussians (gsplat's quat_scale_to_covar_preci)."""

from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from . import _ptr, _threads, build

# Single-thread cost of one gaussian (covariance only, as MCMC asks): measured 36 ns here (2-core EPYC).
NS_PER_GAUSSIAN = 40


def quat_scale_to_covar_preci_fwd(
    quats: Tensor,  # [N, 4] wxyz (normalised in covar.cpp), float32 CPU
    scales: Tensor,  # [N, 3] float32 CPU
    compute_covar: bool = True,
    compute_preci: bool = True,
    triu: bool = False,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """covar.cpp forward (no autograd): covariances and precisions [N, 3, 3], or [N, 6] upper
    triangles with ``triu``; None for the one not asked for."""
    N = quats.shape[0]
    shape = (N, 6) if triu else (N, 3, 3)
    covars = quats.new_empty(shape) if compute_covar else None
    precis = quats.new_empty(shape) if compute_preci else None
    inputs = [quats.detach().contiguous(), scales.detach().contiguous()]  # alive for the call
    outputs = int(bool(compute_covar)) + int(bool(compute_preci))
    if N > 0 and outputs > 0:
        build.load().splat_quat_scale_to_covar_preci_fwd(
            N, int(bool(triu)), *map(_ptr, inputs + [covars, precis]), _threads(N * NS_PER_GAUSSIAN * outputs)
        )
    return covars, precis
