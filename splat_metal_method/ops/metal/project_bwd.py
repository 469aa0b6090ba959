"""Dispatch of project_bwd.metal: gradients of the EWA projection."""

from __future__ import annotations

import struct
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..autograd_stages import camera_grads
from .kernels import group_library
from .variants import PROJECT_BWD_GROUP

GROUP = PROJECT_BWD_GROUP  # threads per group (variants.py)
CALC_COMP, CALC_CAMERA = 512, 1024  # project_bwd.metal's PROJECT_CALC_COMP / PROJECT_CALC_CAMERA flags

_ARGS: Dict[tuple, Tensor] = {}  # (device, N, width, height, n_groups, eps2d bits) -> its ProjectBwdArgs
_ARGS_KEPT = 8  # sizes kept per process (a densification changes N: the oldest goes)


def launch_args(device, N: int, width: int, height: int, n_groups: int, eps2d: float) -> Tensor:
    """project_bwd.metal's ProjectBwdArgs (N, width, height, n_groups as int64, then eps2d as the float32 in the low
    half of a fifth int64, little-endian as Apple GPUs and the emulator's hosts are): one buffer where the kernel
    had five scalar slots. Made once per sizes and kept (the kernel only reads it), so a steady step neither
    allocates nor copies it; made on the device by fills of Python scalars (no host-to-device copy, which torch's
    MPS backend makes a host sync), ten dispatches where a size is new (the step after a refine)."""
    bits = struct.unpack("<I", struct.pack("<f", float(eps2d)))[0]
    key = (torch.device(device), int(N), int(width), int(height), int(n_groups), bits)
    t = _ARGS.get(key)
    if t is None:
        if len(_ARGS) >= _ARGS_KEPT:
            _ARGS.pop(next(iter(_ARGS)))
        t = torch.empty(len(key) - 1, dtype=torch.int64, device=key[0])
        for i, value in enumerate(key[1:]):
            t[i].fill_(value)
        _ARGS[key] = t
    return t


def project_bwd(
    means: Tensor,  # [N, 3]
    quats: Tensor,  # [N, 4]
    scales: Tensor,  # [N, 3]
    viewmats: Tensor,  # [C, 4, 4]
    Ks: Tensor,  # [C, 3, 3]
    width: int,
    height: int,
    eps2d: float,
    radii: Tensor,  # [C, N] int32 (forward output)
    v_means2d: Tensor,  # [C, N, 2]
    v_depths: Tensor,  # [C, N]
    v_conics: Tensor,  # [C, N, 3]
    v_compensations: Optional[Tensor] = None,  # [C, N]; None when the forward had no compensations
    viewmats_grad: bool = True,
    Ks_grad: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """Runs project_bwd. Returns v_means [N,3], v_quats [N,4], v_scales [N,3] (summed over cameras),
    v_viewmats [C,4,4] (row 3 is zero; None unless ``viewmats_grad``) and v_Ks [C,3,3] (fx, fy, cx,
    cy entries; None unless ``Ks_grad``). No host sync."""
    op = "project_bwd"
    device = means.device
    N, C = means.shape[0], viewmats.shape[0]
    for name, t, shape in (
        ("v_means2d", v_means2d, (C, N, 2)), ("v_depths", v_depths, (C, N)), ("v_conics", v_conics, (C, N, 3)),
    ):  # fmt: skip
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(f"[{op}] {name} must be {list(shape)} float32, got {list(t.shape)} {t.dtype}")
    if v_compensations is not None and tuple(v_compensations.shape) != (C, N):
        raise ValueError(f"[{op}] v_compensations must be {[C, N]}, got {list(v_compensations.shape)}")
    if tuple(radii.shape) != (C, N) or radii.dtype != torch.int32:
        raise ValueError(f"[{op}] radii must be {[C, N]} int32, got {list(radii.shape)} {radii.dtype}")

    # [C, N, k] written flat by the kernel; for one camera [N, k] is the same memory and the result
    lead = (N,) if C == 1 else (C, N)
    v_means = torch.empty(lead + (3,), dtype=torch.float32, device=device)
    v_quats = torch.empty(lead + (4,), dtype=torch.float32, device=device)
    v_scales = torch.empty(lead + (3,), dtype=torch.float32, device=device)
    lib, group = group_library(device, "project_bwd.metal", "project_bwd", "SPLAT_PROJECT_BWD_GROUP", GROUP)
    n_groups = (N + group - 1) // group
    camera_grad = bool(viewmats_grad or Ks_grad)
    # unused buffers are bound to tensors at hand (the kernel neither reads v_comp without
    # compensations nor writes part without camera gradients): no placeholder allocation
    part = torch.empty((C, n_groups, 16), dtype=torch.float32, device=device) if camera_grad else v_means
    if C * N > 0:
        lib.project_bwd(
            means.contiguous(), quats.contiguous(), scales.contiguous(), viewmats.contiguous(), Ks.contiguous(),
            radii.contiguous(), v_means2d.contiguous(), v_depths.contiguous(), v_conics.contiguous(),
            v_compensations.contiguous() if v_compensations is not None else v_depths,
            v_means, v_quats, v_scales, part, launch_args(device, N, width, height, n_groups, eps2d),
            v_means, v_quats, v_scales, v_depths, v_means, v_depths,  # no Adam step (prepare.py)
            v_depths, v_depths, v_depths, v_means,  # plain: not fused (prepare.py)
            (CALC_COMP if v_compensations is not None else 0) | (CALC_CAMERA if camera_grad else 0),
            v_depths, v_depths, v_depths, v_means, v_means,  # nor the SH colour's backward
            threads=(n_groups * group, C), group_size=(group, 1),
        )  # fmt: skip
    v_viewmats = v_Ks = None
    if camera_grad:
        total = part.sum(dim=1) if C * N > 0 else torch.zeros((C, 16), dtype=torch.float32, device=device)
        v_viewmats, v_Ks = camera_grads(total, viewmats_grad, Ks_grad)
    if C == 1:
        return v_means, v_quats, v_scales, v_viewmats, v_Ks
    return v_means.sum(0), v_quats.sum(0), v_scales.sum(0), v_viewmats, v_Ks
