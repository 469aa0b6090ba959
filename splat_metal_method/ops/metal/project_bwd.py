"""Dispatch of project_bwd.metal: gradients of the EWA projection."""

from __future__ import annotations

import math
import struct
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..autograd_stages import camera_grads
from . import params
from .kernels import group_library
from .variants import PROJECT_BWD_GROUP

GROUP = PROJECT_BWD_GROUP  # threads per group (variants.py)
CALC_COMP, CALC_CAMERA = 512, 1024  # project_bwd.metal's PROJECT_CALC_COMP / PROJECT_CALC_CAMERA flags


def launch_params(N: int, width: int, height: int, n_groups: int, eps2d: float, flags: int, **offsets: int) -> list:
    """project_bwd's packed list (common.h PROJECT_BWD_*): its sizes, eps2d as its float32's bits, the flags and the
    element offsets of its outputs and moments (``offsets``: v_means=..; one not given is 0, its buffer unused).
    A setBytes slot: nothing allocated or copied per step."""
    bits = struct.unpack("<I", struct.pack("<f", float(eps2d)))[0]
    at = {name: 0 for name in params.PROJECT_BWD[6:]}
    at.update(offsets)
    return params.pack(params.PROJECT_BWD, N=int(N), width=int(width), height=int(height), n_groups=int(n_groups),
                       eps2d=bits, flags=int(flags), **at)  # fmt: skip


def gradient_buffers(device, shapes: Dict[str, tuple]) -> Tuple[Optional[Tensor], Dict[str, Tensor], Dict[str, int]]:
    """The gradients project_bwd writes in one allocation (its `grads` slot): (that flat buffer, None where
    ``shapes`` is empty; name -> its contiguous view of that shape; name -> the view's element offset)."""
    total = sum(math.prod(shape) for shape in shapes.values())
    flat = torch.empty(total, dtype=torch.float32, device=device) if shapes else None
    views, offsets, start = {}, {}, 0
    for name, shape in shapes.items():
        strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]  # contiguous
        views[name] = flat.as_strided(shape, strides, start)
        offsets[name] = start
        start += math.prod(shape)
    return flat, views, offsets


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

    # [C, N, k] written flat by the kernel, in one allocation; for one camera [N, k] is the same memory and the result
    lead = (N,) if C == 1 else (C, N)
    grads, views, at = gradient_buffers(device, {"v_means": lead + (3,), "v_quats": lead + (4,),
                                                 "v_scales": lead + (3,)})  # fmt: skip
    v_means, v_quats, v_scales = views["v_means"], views["v_quats"], views["v_scales"]
    lib, group = group_library(device, "project_bwd.metal", "project_bwd", "SPLAT_PROJECT_BWD_GROUP", GROUP)
    n_groups = (N + group - 1) // group
    camera_grad = bool(viewmats_grad or Ks_grad)
    # unused buffers are bound to tensors at hand (the kernel neither reads v_comp without
    # compensations nor writes part without camera gradients): no placeholder allocation
    part = torch.empty((C, n_groups, 16), dtype=torch.float32, device=device) if camera_grad else v_means
    flags = (CALC_COMP if v_compensations is not None else 0) | (CALC_CAMERA if camera_grad else 0)
    if C * N > 0:
        lib.project_bwd(
            means.contiguous(), quats.contiguous(), scales.contiguous(), viewmats.contiguous(), Ks.contiguous(),
            radii.contiguous(), v_means2d.contiguous(), v_depths.contiguous(), v_conics.contiguous(),
            v_compensations.contiguous() if v_compensations is not None else v_depths,
            grads, grads, grads, part,  # no Adam step (prepare.py): the moment arenas' slots unused
            launch_params(N, width, height, n_groups, eps2d, flags, **at),
            v_depths, v_depths,  # no Adam step
            v_depths, v_depths, v_depths, v_depths, v_depths, v_depths,  # plain: neither fused nor the SH colour's
            threads=(n_groups * group, C), group_size=(group, 1),
        )  # fmt: skip
    v_viewmats = v_Ks = None
    if camera_grad:
        total = part.sum(dim=1) if C * N > 0 else torch.zeros((C, 16), dtype=torch.float32, device=device)
        v_viewmats, v_Ks = camera_grads(total, viewmats_grad, Ks_grad)
    if C == 1:
        return v_means, v_quats, v_scales, v_viewmats, v_Ks
    return v_means.sum(0), v_quats.sum(0), v_scales.sum(0), v_viewmats, v_Ks
