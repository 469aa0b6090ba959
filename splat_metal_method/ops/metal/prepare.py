"""The fused preparation of a render: projection, culling and SH colours in one kernel each way.

rasterization.py's glue between the projection and SH stages (its non-finite culling, the opacity
mask and compensation product, the view directions, the SH mask) and the model's activations
(exp of the log-scales, sigmoid of the opacity logits, the concatenation of the SH bands) were about
45 aten ops per training step forward and backward, each one encode on MPS. Here project.metal's
project_fwd does them in the same float32 operations, the SH colour included (PROJECT_SHADE: each SH
coefficient read once a step forward, the colour tested for finiteness where it is computed), and
project_bwd.metal's project_bwd the backward, the SH colour's included (PROJECT_SHADE: the directions'
gradient never leaves the thread), so one PrepareFn replaces ProjectFn + SphericalHarmonicsFn + the glue,
and the camera positions are computed in the kernels (no inverse on the host). The oracle is the unfused path (rasterization.py with any other backend, and the metal
backend where this does not apply: no SH colours, or a viewmat that needs a gradient through its
inverse); the twins of the two kernels are project_fwd without PROJECT_SHADE followed by sh.metal's
sh_fused_fwd, and sh_bwd.metal's sh_fused_bwd followed by project_bwd without it
(``shade_in_projection=False``), which tests/ops/metal/test_prepare.py runs beside them.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..autograd_stages import camera_grads
from ..constants import SH_MAX_DEGREE
from . import params
from .adam import arena_span
from .kernels import grid_1d, group_library, library
from .project_bwd import CALC_CAMERA, CALC_COMP, gradient_buffers, launch_params
from .variants import PROJECT_BWD_GROUP

# project.metal / project_bwd.metal flags
FUSED, EXP_SCALES, SIGMOID_OPACITIES, CAMPOS, MEANS_SH, NO_V_DEPTHS, SH_APART, SHADE = 1, 2, 4, 8, 16, 32, 64, 256
SH_ADAM = 128  # project_bwd.metal: the SH coefficients' Adam step inside the backward (engine/optimizers.py)
SH_DEGREE_SHIFT, SH_K_SHIFT = 16, 20  # project_bwd.metal: the SH degree and K ride in the flags' high bits
# project_bwd.metal PROJECT_ADAM_*: means, quats, scales, opacities (adam.PARAMS_IN_BACKWARD's order) take their Adam
# step in the backward too; their adam_coef slots ride in bytes of the flags from ADAM_SLOT_SHIFT
ADAM_PARAM_FLAGS = (2048, 4096, 8192, 16384)
ADAM_SLOT_SHIFT = 32
ADAM_VISIBLE = 32768  # project_bwd.metal PROJECT_ADAM_VISIBLE: a culled gaussian takes no step (visible_adam)
# per parameter of PARAMS_IN_BACKWARD: its argument of project_bwd (updated in place with its flag)
ADAM_PARAM_ARGS = (0, 1, 2, 17)
PARAMS_ARG = 14  # project_bwd's packed list (params.PROJECT_BWD), its flags at FLAGS_AT
FLAGS_AT = params.PROJECT_BWD.index("flags")


def sh_adam_read_write_args(args) -> Tuple[int, ...]:
    """project_bwd's arguments it updates in place (the step ledger counts them twice): with SH_ADAM the SH
    coefficients (21, 22) and the moment arenas (exp_avgs 11, exp_avg_sqs 12), with ADAM_PARAM_FLAGS those
    parameters (ADAM_PARAM_ARGS), else none."""
    flags = args[PARAMS_ARG][FLAGS_AT] if len(args) > PARAMS_ARG and isinstance(args[PARAMS_ARG], list) else 0
    if not flags & SH_ADAM:
        return ()
    out = [11, 12, 21, 22] + [arg for bit, arg in zip(ADAM_PARAM_FLAGS, ADAM_PARAM_ARGS) if flags & bit]
    return tuple(sorted(out))


def _layout(sh_dc: Tensor, sh_rest: Optional[Tensor]) -> Tuple[Tensor, Tensor, int, int, int, int]:
    """(dc buffer, rest buffer, K, dc_stride, rest_stride, rest_offset) as the kernels read coefficients:
    one [N, K, 3] tensor, or splatfacto's bands apart (dc [N, 3] or [N, 1, 3], rest [N, K-1, 3])."""
    if sh_rest is None:
        K = sh_dc.shape[1]
        return sh_dc, sh_dc, K, 3 * K, 3 * K, 3
    K = sh_rest.shape[1] + 1
    return sh_dc, (sh_rest if K > 1 else sh_dc), K, 3, 3 * (K - 1), 0


def project_library(device: torch.device):
    """project.metal's library, whose project_fwd the forward runs (a test plants a broken one here)."""
    return library(device, "project.metal")


def project_bwd_library(device: torch.device):
    """(library, group size) of project_bwd.metal, whose project_bwd the backward runs (a test plants one here)."""
    return group_library(device, "project_bwd.metal", "project_bwd", "SPLAT_PROJECT_BWD_GROUP", PROJECT_BWD_GROUP)


class PrepareFn(torch.autograd.Function):
    """radii, means2d, depths, conics, opacities [C, N] (masked, x compensation) and activated SH colours
    [C, N, 3] of the gaussians in every camera, as rasterization.py's unfused path computes them."""

    @staticmethod
    def forward(ctx, means, quats, scales, opacities, sh_dc, sh_rest, viewmats, Ks, width, height, eps2d, near_plane,
                far_plane, radius_clip, calc_comp, degree, exp_scales, sigmoid_opacities, shade_in_projection):  # fmt: skip
        device = means.device
        N, C = means.shape[0], viewmats.shape[0]
        dc, rest, K, dc_stride, rest_stride, rest_offset = _layout(sh_dc, sh_rest)
        radii = torch.empty((C, N), dtype=torch.int32, device=device)
        means2d = torch.empty((C, N, 2), dtype=torch.float32, device=device)
        depths = torch.empty((C, N), dtype=torch.float32, device=device)
        conics = torch.empty((C, N, 3), dtype=torch.float32, device=device)
        comp = torch.empty((C, N), dtype=torch.float32, device=device) if calc_comp else depths
        opacities_out = torch.empty((C, N), dtype=torch.float32, device=device)
        colors = torch.empty((C, N, 3), dtype=torch.float32, device=device)
        flags = FUSED | CAMPOS | (EXP_SCALES if exp_scales else 0) | (SIGMOID_OPACITIES if sigmoid_opacities else 0)
        if C * N > 0:
            ints = params.pack(params.PROJECT_FWD_INTS, C=C, N=N, width=int(width), height=int(height),
                               calc_comp=int(bool(calc_comp)), flags=flags | (SHADE if shade_in_projection else 0),
                               degree=int(degree), dc_stride=dc_stride, rest_stride=rest_stride,
                               rest_offset=rest_offset)  # fmt: skip
            floats = params.pack(params.PROJECT_FWD_FLOATS, eps2d=float(eps2d), near_plane=float(near_plane),
                                 far_plane=float(far_plane), radius_clip=float(radius_clip))  # fmt: skip
            project_library(device).project_fwd(
                means, quats, scales, viewmats, Ks, radii, means2d, depths, conics, comp, ints, floats,
                opacities, dc, rest, colors, opacities_out, **grid_1d(C * N),
            )  # fmt: skip
            if not shade_in_projection:  # the unfused twin: the colours (and their culling) in a second kernel
                library(device, "sh.metal").sh_fused_fwd(
                    means, viewmats, dc, rest, radii, colors, C, N, int(degree), dc_stride, rest_stride, rest_offset,
                    means2d, depths, conics, opacities_out, **grid_1d(C * N),
                )  # fmt: skip
        # not the colours: sh_fused_bwd recomputes them (saving an output costs a detach each way)
        ctx.save_for_backward(means, quats, scales, opacities, sh_dc, sh_rest, viewmats, Ks, radii)
        ctx.args = (width, height, eps2d, calc_comp, degree, flags, shade_in_projection)
        ctx.mark_non_differentiable(radii)
        ctx.set_materialize_grads(False)  # outputs that fed nothing (depths in RGB renders) arrive as None
        return radii, means2d, depths, conics, opacities_out, colors

    @staticmethod
    def backward(ctx, _v_radii, v_means2d, v_depths, v_conics, v_opacities_out, v_colors):
        means, quats, scales, opacities, sh_dc, sh_rest, viewmats, Ks, radii = ctx.saved_tensors
        width, height, eps2d, calc_comp, degree, flags, shade_in_projection = ctx.args
        need = ctx.needs_input_grad
        device = means.device
        N, C = means.shape[0], viewmats.shape[0]
        dc, rest, K, dc_stride, rest_stride, rest_offset = _layout(sh_dc, sh_rest)

        def grad_or_zeros(g, *tail):
            return g.contiguous() if g is not None else means.new_zeros((C, N) + tail)

        v_means2d, v_conics = grad_or_zeros(v_means2d, 2), grad_or_zeros(v_conics, 3)
        v_opacities_out, v_colors = grad_or_zeros(v_opacities_out), grad_or_zeros(v_colors, 3)
        # the SH coefficients' Adam step, where the optimizer armed it for these parameters (engine/optimizers.py):
        # one camera (a thread holds its gaussian's whole gradient), splatfacto's bands apart, both need a gradient
        sh_step, more, visible_only = None, {}, False
        if shade_in_projection and C == 1 and sh_rest is not None and K > 1 and need[4] and need[5]:
            from .adam import take_sh_step

            # means, quats, scales, opacities too where armed (their Adam in the same thread: PROJECT_ADAM_*)
            others = dict(zip(("means", "quats", "scales", "opacities"), (means, quats, scales, opacities)))
            others = {k: t if need[i] else None for i, (k, t) in enumerate(others.items())}
            sh_step = take_sh_step(sh_dc, sh_rest, others)
            if sh_step is not None:
                sh_step, more, visible_only = sh_step[:6], sh_step[6], sh_step[7]
        lead = () if C == 1 else (C,)  # [C, N, .] written flat; for one camera the inputs' own shapes
        # the gradients written, in one allocation (none of a parameter stepped here, nor of the SH coefficients)
        shapes = {name: lead + shape for name, shape in (("means", (N, 3)), ("quats", (N, 4)), ("scales", (N, 3)),
                                                         ("opacities", tuple(opacities.shape))) if name not in more}  # fmt: skip
        if sh_step is None:
            shapes["sh_dc"] = lead + tuple(dc.shape)
            if sh_rest is not None and K > 1:
                shapes["sh_rest"] = lead + tuple(rest.shape)
        grads, views, at = gradient_buffers(device, shapes)
        placeholder = v_means2d  # bound where the kernel neither reads nor writes
        v_means, v_quats, v_scales, v_opacities = (views.get(k) for k in ("means", "quats", "scales", "opacities"))
        v_dc = views.get("sh_dc", placeholder)
        v_rest = views.get("sh_rest", v_dc)  # one [N, K, 3] tensor (or K = 1): the same buffer
        at.setdefault("sh_rest", at.get("sh_dc", 0))
        offsets = {f"v_{k}": at[k] for k in ("means", "quats", "scales", "opacities", "sh_dc", "sh_rest") if k in at}
        # the twin's SH directions' gradient is written into v_means, to which project_bwd adds its own (in place)
        v_dirs = v_means if v_means is not None else placeholder
        lib, group = project_bwd_library(device)
        n_groups = (N + group - 1) // group
        camera_grad = bool(need[6] or need[7])
        part = torch.empty((C, n_groups, 16), dtype=torch.float32, device=device) if camera_grad else placeholder
        flags |= NO_V_DEPTHS if v_depths is None else 0
        if shade_in_projection:  # the SH colour's backward inside project_bwd (its layout and sizes in the flags)
            flags |= SHADE | (SH_APART if sh_rest is not None else 0)
            flags |= (int(degree) << SH_DEGREE_SHIFT) | (K << SH_K_SHIFT)
        else:  # the unfused twin: sh_fused_bwd writes the directions' gradient, project_bwd adds it
            flags |= MEANS_SH
        flags |= (CALC_COMP if calc_comp else 0) | (CALC_CAMERA if camera_grad else 0)
        adam_coef, adam_flag = placeholder, placeholder
        exp_avgs = exp_avg_sqs = grads if grads is not None else placeholder  # no Adam step: unused
        if sh_step is not None:  # the moments, views of the arenas, at their offsets (no coefficient gradient)
            flags |= SH_ADAM | (ADAM_VISIBLE if visible_only else 0)
            adam_coef, adam_flag, m_dc, s_dc, m_rest, s_rest = sh_step
            names = ["sh_dc", "sh_rest"] + [name for name in ("means", "quats", "scales", "opacities") if name in more]
            moments = [(m_dc, s_dc), (m_rest, s_rest)] + [more[name][:2] for name in names[2:]]
            exp_avgs, avg_at = arena_span([m for m, _ in moments])
            exp_avg_sqs, avg_sq_at = arena_span([v for _, v in moments])
            short = {"sh_dc": "dc", "sh_rest": "rest"}
            offsets.update({f"v_{name}": o for name, o in zip(names, avg_at)})
            offsets.update({f"avg_sq_{short.get(name, name)}": o for name, o in zip(names, avg_sq_at)})
            for i, name in enumerate(("means", "quats", "scales", "opacities")):
                if name in more:
                    flags |= ADAM_PARAM_FLAGS[i] | (more[name][2] << (ADAM_SLOT_SHIFT + 8 * i))
            if grads is None:
                grads = exp_avgs  # nothing written but moments
        if C * N > 0:
            if not shade_in_projection:
                library(device, "sh_bwd.metal").sh_fused_bwd(
                    means, viewmats, dc, rest, radii, v_colors, v_dc, v_rest, v_dirs,
                    C, N, K, int(degree), dc_stride, rest_stride, rest_offset, **grid_1d(C * N),
                )  # fmt: skip
            lib.project_bwd(
                means, quats, scales, viewmats, Ks, radii, v_means2d,
                v_depths.contiguous() if v_depths is not None else v_means2d, v_conics, v_means2d,
                grads, exp_avgs, exp_avg_sqs, part,
                launch_params(N, width, height, n_groups, eps2d, flags, **offsets), adam_coef, adam_flag,
                opacities, v_opacities_out, v_dirs, v_colors, dc, rest,
                threads=(n_groups * group, C), group_size=(group, 1),
            )  # fmt: skip
        v_viewmats = v_Ks = None
        if camera_grad:  # projection's (the SH directions' gradient to the camera position is not taken here)
            total = part.sum(dim=1) if C * N > 0 else torch.zeros((C, 16), dtype=torch.float32, device=device)
            v_viewmats, v_Ks = camera_grads(total, bool(need[6]), bool(need[7]))
        if C > 1:  # (sh_step needs one camera: every gradient was written)
            v_means, v_quats, v_scales, v_opacities = (
                v_means.sum(0),
                v_quats.sum(0),
                v_scales.sum(0),
                v_opacities.sum(0),
            )
            v_dc = v_dc.sum(0)
            v_rest = v_dc if sh_rest is None or K == 1 else v_rest.sum(0)
        v_sh_rest = None
        if sh_step is not None:  # stepped in place above: no gradient reaches .grad (the optimizer skips them)
            v_dc = None  # (v_means .. v_opacities: None where stepped, no view made)
        elif sh_rest is not None:
            v_sh_rest = v_rest if K > 1 else torch.zeros_like(sh_rest)
        return (
            v_means if need[0] else None,
            v_quats if need[1] else None,
            v_scales if need[2] else None,
            v_opacities if need[3] else None,
            v_dc if need[4] else None,
            v_sh_rest if need[5] else None,
            v_viewmats if need[6] else None,
            v_Ks if need[7] else None,
            None, None, None, None, None, None, None, None, None, None, None,  # width .. shade_in_projection
        )  # fmt: skip


def project_and_shade(
    means: Tensor,  # [N, 3]
    quats: Tensor,  # [N, 4]
    scales: Tensor,  # [N, 3] (logs with exp_scales)
    opacities: Tensor,  # [N] or [N, 1] (logits with sigmoid_opacities)
    sh_dc: Tensor,  # [N, K, 3] all the SH coefficients, or with sh_rest band 0: [N, 3] / [N, 1, 3]
    sh_rest: Optional[Tensor],  # [N, K-1, 3] or None
    viewmats: Tensor,  # [C, 4, 4], no gradient through its inverse
    Ks: Tensor,  # [C, 3, 3]
    width: int,
    height: int,
    eps2d: float,
    near_plane: float,
    far_plane: float,
    radius_clip: float,
    calc_compensations: bool,
    sh_degree: int,
    exp_scales: bool = False,
    sigmoid_opacities: bool = False,
    shade_in_projection: bool = True,  # False: the unfused twin (project_fwd, then sh_fused_fwd), for tests
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """radii [C,N] int32, means2d [C,N,2], depths [C,N], conics [C,N,3], opacities [C,N], colours [C,N,3]."""
    N = means.shape[0]
    if means.shape[0] * viewmats.shape[0] >= 2**31:
        raise ValueError(f"[project_and_shade] C*N = {N * viewmats.shape[0]} exceeds the kernels' 32-bit index")
    K = sh_dc.shape[1] if sh_rest is None else sh_rest.shape[1] + 1
    if not 0 <= int(sh_degree) <= SH_MAX_DEGREE or K < (sh_degree + 1) ** 2:  # sh.h's arrays: degree 4 at most
        raise ValueError(f"[project_and_shade] sh_degree must be 0..{SH_MAX_DEGREE} with K >= (sh_degree+1)^2, "
                         f"got {sh_degree}, K={K}")  # fmt: skip
    tensors = (means, quats, scales, opacities, sh_dc, viewmats, Ks) + ((sh_rest,) if sh_rest is not None else ())
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("[project_and_shade] every tensor must be contiguous float32")
    return PrepareFn.apply(
        means, quats, scales, opacities, sh_dc, sh_rest, viewmats, Ks, int(width), int(height), float(eps2d),
        float(near_plane), float(far_plane), float(radius_clip), bool(calc_compensations), int(sh_degree),
        bool(exp_scales), bool(sigmoid_opacities), bool(shade_in_projection),
    )  # fmt: skip
