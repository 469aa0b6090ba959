"""Autograd wrappers shared by the backends whose projection and spherical harmonics are kernels
with an explicit backward (metal: .metal files; cpu: native C++).

``kernels`` is passed as the first argument of ``apply``: any object with ``project_fwd``,
``project_bwd``, ``spherical_harmonics_fwd`` and ``spherical_harmonics_bwd`` of the signatures in
ops/metal/project.py, project_bwd.py, sh.py and sh_bwd.py. Gradients flow to means, quats, scales,
viewmats (camera pose), Ks, SH coefficients and view directions.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def camera_grads(
    total: Tensor,  # [C, 16]: d/d viewmat[0:3, 0:4] (12, row-major), then d/d (fx, fy, cx, cy)
    viewmats_grad: bool,
    Ks_grad: bool,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The projection backward's camera sums as v_viewmats [C,4,4] (row 3 zero) and v_Ks [C,3,3]."""
    C = total.shape[0]
    v_viewmats = v_Ks = None
    if viewmats_grad:
        v_viewmats = torch.cat([total[:, :12].view(C, 3, 4), total.new_zeros(C, 1, 4)], dim=1)
    if Ks_grad:
        zero = total.new_zeros(C)
        fx, fy, cx, cy = total[:, 12:].unbind(-1)
        v_Ks = torch.stack([fx, zero, cx, zero, fy, cy, zero, zero, zero], dim=-1).view(C, 3, 3)
    return v_viewmats, v_Ks


def project_with(kernels, means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane, radius_clip,
                 calc_compensations):  # fmt: skip
    """The contract's project (ops/contract.py) run by ``kernels`` through ProjectFn."""
    radii, means2d, depths, conics, comp = ProjectFn.apply(
        kernels, means, quats, scales, viewmats, Ks, int(width), int(height), float(eps2d), float(near_plane),
        float(far_plane), float(radius_clip), bool(calc_compensations),
    )  # fmt: skip
    return radii, means2d, depths, conics, (comp if calc_compensations else None)


class ProjectFn(torch.autograd.Function):
    """project: ``kernels.project_fwd`` forward, ``kernels.project_bwd`` backward."""

    @staticmethod
    def forward(ctx, kernels, means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane,
                radius_clip, calc_compensations):  # fmt: skip
        ctx.kernels = kernels
        radii, means2d, depths, conics, comp = kernels.project_fwd(
            means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane, radius_clip,
            calc_compensations,
        )  # fmt: skip
        ctx.save_for_backward(means, quats, scales, viewmats, Ks, radii)
        ctx.args = (width, height, eps2d, calc_compensations)
        ctx.mark_non_differentiable(radii)
        # outputs that fed nothing (radii, often depths) arrive in backward as None instead of zeros
        # autograd would allocate: grad_or_zeros makes only those needed. comp is None (no gradient)
        # without compensations.
        ctx.set_materialize_grads(False)
        return radii, means2d, depths, conics, comp

    @staticmethod
    def backward(ctx, _v_radii, v_means2d, v_depths, v_conics, v_comp):
        means, quats, scales, viewmats, Ks, radii = ctx.saved_tensors
        width, height, eps2d, calc_compensations = ctx.args
        need = ctx.needs_input_grad[1:]  # [0] is `kernels`
        if not any(need[:5]):
            return (None,) * 13

        def grad_or_zeros(g, *tail):  # outputs that fed nothing may arrive as None
            return g.contiguous() if g is not None else means.new_zeros(radii.shape + tail)

        v_means, v_quats, v_scales, v_viewmats, v_Ks = ctx.kernels.project_bwd(
            means, quats, scales, viewmats, Ks, width, height, eps2d, radii,
            grad_or_zeros(v_means2d, 2), grad_or_zeros(v_depths), grad_or_zeros(v_conics, 3),
            grad_or_zeros(v_comp) if calc_compensations else None,
            viewmats_grad=need[3], Ks_grad=need[4],
        )  # fmt: skip
        return (
            None,  # kernels
            v_means if need[0] else None,
            v_quats if need[1] else None,
            v_scales if need[2] else None,
            v_viewmats if need[3] else None,
            v_Ks if need[4] else None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,  # width, height, eps2d, near, far, radius_clip, calc_comp
        )


class SphericalHarmonicsFn(torch.autograd.Function):
    """spherical_harmonics: ``kernels.spherical_harmonics_fwd`` forward, ``kernels.spherical_harmonics_bwd``
    backward.

    With ``activate`` (kernels that support it: metal) the kernels also apply the public API's colour
    activation clamp_min(c + 0.5, 0), forward and backward (the backward gets the forward's output)."""

    @staticmethod
    def forward(ctx, kernels, degree, dirs, coeffs, masks, activate=False):
        ctx.kernels = kernels
        if activate:
            colors = kernels.spherical_harmonics_fwd(degree, dirs, coeffs, masks, activate=True)
            ctx.save_for_backward(dirs, coeffs, masks, colors)
        else:
            colors = kernels.spherical_harmonics_fwd(degree, dirs, coeffs, masks)
            ctx.save_for_backward(dirs, coeffs, masks)
        ctx.degree = degree
        return colors

    @staticmethod
    def backward(ctx, v_colors):
        dirs, coeffs, masks, *activated = ctx.saved_tensors
        need = ctx.needs_input_grad[1:]  # [0] is `kernels`
        if not (need[1] or need[2]):
            return None, None, None, None, None, None
        extra = {"colors": activated[0]} if activated else {}
        v_dirs, v_coeffs = ctx.kernels.spherical_harmonics_bwd(
            ctx.degree, dirs, coeffs, masks, v_colors.contiguous(), dirs_grad=need[1], **extra
        )
        # kernels, degree, masks, activate: not differentiable
        return None, None, v_dirs, (v_coeffs if need[2] else None), None, None


def resumed_transmittance_grad(
    chunk_colors: Tensor,  # [C, H, W, D] a depth chunk's colours (weighted by the incoming T)
    v_chunk_colors: Tensor,  # [C, H, W, D]
    trans_out: Tensor,  # [C, H, W] transmittance after the chunk
    v_trans_out: Optional[Tensor],  # [C, H, W]
    trans_in: Tensor,  # [C, H, W] transmittance before the chunk
    stopped_in: Tensor,  # [C, H, W] bool
    t_min: float,  # TRANSMITTANCE_MIN: a pixel still running has trans_in above it
) -> Tensor:  # [C, H, W] d loss / d trans_in
    """A resumed pixel's colour and transmittance are both proportional to its incoming
    transmittance (C = T_in S, T_out = T_in P), so their gradients carry back as (C v_C + T_out v_T) / T_in;
    a pixel that had already stopped passes T_in through unchanged (T_out = T_in, C = 0)."""
    v_trans_out = torch.zeros_like(trans_out) if v_trans_out is None else v_trans_out
    through = ((chunk_colors * v_chunk_colors).sum(-1) + trans_out * v_trans_out) / trans_in.clamp(min=t_min)
    return torch.where(stopped_in, v_trans_out, through)
