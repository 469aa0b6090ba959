"""The two ops gsplat 1.4's MCMCStrategy needs, device-aware: ``compute_relocation`` (opacity and
scale of the gaussians a relocated or added one is split into) and ``quat_scale_to_covar_preci``
(the covariance its position noise is shaped by).

gsplat only has CUDA kernels for them. Backends are rasterization's (resolved the same way, so
SPLAT_METAL_BACKEND applies): "auto" is gsplat on cuda, metal on mps, cpu on cpu (the reference where
the native library cannot be built).

- ``quat_scale_to_covar_preci`` runs every step (in cpu-backend MCMC training 3-8% of the time as
  PyTorch, 1-2% native: benchmarks/bench_covar.py, README "MCMC"), so it has native versions: "cpu"
  (ops/cpu/covar.cpp) and "metal" (ops/metal/covar.metal; CPU tensors under the MSL emulator), one
  source for their math (ops/metal/covar.h), float32 only (other dtypes run the reference). Their forward is the kernel; a gradient, if asked for, comes from
  the reference's autograd on a recompute (MCMC's noise needs none: it runs under no_grad).
- ``compute_relocation`` runs once per refine on the dead gaussians only (about 1 ms per 10k
  gaussians on CPU: negligible), so every backend but "gsplat" runs the reference.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from . import reference, stage_fallback
from .rasterization import BACKENDS, resolve_backend, zero_quats_to_identity

MCMC_OP_BACKENDS = BACKENDS


def _resolve(backend: str, device: torch.device, op: str) -> str:
    """The backend that runs ``op`` on tensors on ``device``: "gsplat", "metal", "cpu" or "reference"."""
    if backend not in MCMC_OP_BACKENDS:
        raise ValueError(f"[{op}] backend must be one of {MCMC_OP_BACKENDS}, got {backend!r}")
    if backend == "gsplat" and device.type != "cuda":
        raise ValueError(f"[{op}] backend 'gsplat' needs CUDA tensors, got tensors on {device}")
    return resolve_backend(backend, device)


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
    if _resolve(backend, opacities.device, "compute_relocation") == "gsplat":
        from gsplat.relocation import compute_relocation as gsplat_compute_relocation

        return gsplat_compute_relocation(opacities, scales, ratios.clone(), binoms)
    new_opacities, new_scales = reference.compute_relocation(opacities.reshape(N), scales, ratios, binoms)
    return new_opacities.reshape(opacities.shape), new_scales


def _native_covar_fwd(name: str) -> Callable:
    """A native backend's forward: (quats, scales, compute_covar, compute_preci, triu) -> (covars, precis)."""
    if name == "cpu":
        from .cpu.covar import quat_scale_to_covar_preci_fwd
    else:
        from .metal.covar import quat_scale_to_covar_preci_fwd
    return quat_scale_to_covar_preci_fwd


class _QuatScaleToCovarPreciFn(torch.autograd.Function):
    """Native forward; backward by the reference's autograd on a recompute (the op is a few dozen
    flops per gaussian: recomputing costs less than saving anything)."""

    @staticmethod
    def forward(ctx, fwd, quats, scales, compute_covar, compute_preci, triu):
        covars, precis = fwd(quats.detach(), scales.detach(), compute_covar, compute_preci, triu)
        ctx.save_for_backward(quats, scales)
        ctx.flags = (compute_covar, compute_preci, triu)
        return covars, precis

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, v_covars, v_precis):
        quats, scales = ctx.saved_tensors
        with torch.enable_grad():
            q, s = quats.detach().requires_grad_(), scales.detach().requires_grad_()
            outs = reference.quat_scale_to_covar_preci(q, s, *ctx.flags)
            pairs = [(o, v) for o, v in zip(outs, (v_covars, v_precis)) if o is not None and v is not None]
            v_quats, v_scales = torch.autograd.grad(
                [o for o, _ in pairs], [q, s], [v for _, v in pairs], allow_unused=True
            )
        return None, v_quats, v_scales, None, None, None  # fwd, quats, scales, compute_covar, compute_preci, triu


def quat_scale_to_covar_preci(
    quats: Tensor,  # [N, 4] wxyz, not necessarily normalised (zero: the identity rotation)
    scales: Tensor,  # [N, 3]
    compute_covar: bool = True,
    compute_preci: bool = True,
    triu: bool = False,
    backend: str = "auto",
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """gsplat.quat_scale_to_covar_preci on any device: covariances and precisions [N, 3, 3] (or
    [N, 6] upper triangles [xx, xy, xz, yy, yz, zz] with ``triu``), None where not asked for.
    Differentiable on every backend."""
    if quats.dim() != 2 or quats.shape[1] != 4 or tuple(scales.shape) != (quats.shape[0], 3):
        raise ValueError(
            f"[quat_scale_to_covar_preci] needs quats [N,4] and scales [N,3], got {list(quats.shape)}, "
            f"{list(scales.shape)}"
        )
    if scales.device != quats.device:
        raise ValueError(f"[quat_scale_to_covar_preci] scales are on {scales.device}, quats on {quats.device}")
    name = _resolve(backend, quats.device, "quat_scale_to_covar_preci")
    flags = (bool(compute_covar), bool(compute_preci), bool(triu))
    if name == "gsplat":
        from gsplat import quat_scale_to_covar_preci as gsplat_quat_scale_to_covar_preci

        return gsplat_quat_scale_to_covar_preci(zero_quats_to_identity(quats), scales, *flags)
    if name == "metal" and "covariance" in stage_fallback.failed():  # failed the self-check on this GPU
        name = "reference"
    if name == "reference" or quats.dtype != torch.float32 or scales.dtype != torch.float32:
        return reference.quat_scale_to_covar_preci(quats, scales, *flags)
    return _QuatScaleToCovarPreciFn.apply(_native_covar_fwd(name), quats, scales, *flags)
