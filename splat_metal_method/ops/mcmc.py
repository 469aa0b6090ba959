"""The two ops gsplat 1.4's MCMCStrategy needs, device-aware: ``compute_relocation`` (opacity and
scale of the gaussians a relocated or added one is split into) and ``quat_scale_to_covar_preci``
(the covariance its position noise is shaped by).

gsplat only has CUDA kernels for them. Here "auto" runs gsplat's kernels on CUDA tensors and the
PyTorch reference (ops/reference.py) on every other device: cpu (backends "cpu", "reference" and
"metal" under the emulator) and mps. Relocation runs once per refine on the dead gaussians only
(about 1 ms per 10k gaussians on CPU: negligible). The covariance runs every step and measured about
20-25% of a cpu-backend step (README "MCMC"): the candidate for a native/Metal version, not done yet.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import reference

MCMC_OP_BACKENDS = ("auto", "gsplat", "reference")


def _use_gsplat(backend: str, device: torch.device, op: str) -> bool:
    if backend not in MCMC_OP_BACKENDS:
        raise ValueError(f"[{op}] backend must be one of {MCMC_OP_BACKENDS}, got {backend!r}")
    if backend == "gsplat" and device.type != "cuda":
        raise ValueError(f"[{op}] backend 'gsplat' needs CUDA tensors, got tensors on {device}")
    return device.type == "cuda" and backend != "reference"


def compute_relocation(
    opacities: Tensor,  # [N] or [N, 1] (gsplat's strategy ops pass splatfacto's [N, 1])
    scales: Tensor,  # [N, 3]
    ratios: Tensor,  # [N] int
    binoms: Tensor,  # [n_max, n_max]
    backend: str = "auto",
) -> Tuple[Tensor, Tensor]:
    """gsplat.relocation.compute_relocation on any device: (new opacities shaped like ``opacities``,
    new scales [N, 3]). Formula and clamping: reference.compute_relocation. Unlike gsplat's,
    ``ratios`` is not modified."""
    N = opacities.shape[0]
    if tuple(opacities.shape) not in ((N,), (N, 1)) or tuple(scales.shape) != (N, 3) or tuple(ratios.shape) != (N,):
        raise ValueError(
            "[compute_relocation] needs opacities [N] or [N,1], scales [N,3], ratios [N]; got "
            f"{list(opacities.shape)}, {list(scales.shape)}, {list(ratios.shape)}"
        )
    if binoms.dim() != 2 or binoms.shape[0] != binoms.shape[1]:
        raise ValueError(f"[compute_relocation] binoms must be [n_max, n_max], got {list(binoms.shape)}")
    if _use_gsplat(backend, opacities.device, "compute_relocation"):
        from gsplat.relocation import compute_relocation as gsplat_compute_relocation

        return gsplat_compute_relocation(opacities, scales, ratios.clone(), binoms)
    new_opacities, new_scales = reference.compute_relocation(opacities.reshape(N), scales, ratios, binoms)
    return new_opacities.reshape(opacities.shape), new_scales


def quat_scale_to_covar_preci(
    quats: Tensor,  # [N, 4]
    scales: Tensor,  # [N, 3]
    compute_covar: bool = True,
    compute_preci: bool = True,
    triu: bool = False,
    backend: str = "auto",
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """gsplat.quat_scale_to_covar_preci on any device: covariances and precisions [N, 3, 3] (or
    [N, 6] with ``triu``), None where not asked for. Differentiable on every backend."""
    if quats.dim() != 2 or quats.shape[1] != 4 or tuple(scales.shape) != (quats.shape[0], 3):
        raise ValueError(
            f"[quat_scale_to_covar_preci] needs quats [N,4] and scales [N,3], got {list(quats.shape)}, "
            f"{list(scales.shape)}"
        )
    if _use_gsplat(backend, quats.device, "quat_scale_to_covar_preci"):
        from gsplat import quat_scale_to_covar_preci as gsplat_quat_scale_to_covar_preci

        return gsplat_quat_scale_to_covar_preci(quats, scales, compute_covar, compute_preci, triu)
    return reference.quat_scale_to_covar_preci(quats, scales, compute_covar, compute_preci, triu)
