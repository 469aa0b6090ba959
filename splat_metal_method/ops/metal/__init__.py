"""Metal backend: the five stages of the backend contract, run by hand-written Metal kernels.

On mps tensors the kernels run through torch.mps.compile_shader; on cpu tensors the same .metal
sources run under the MSL emulator (see runtime.py). Each differentiable stage is one
torch.autograd.Function whose forward runs the Metal kernels.

Forward and backward are both Metal kernels (`<stage>.metal` / `<stage>_bwd.metal`, dispatched by
`<stage>.py` / `<stage>_bwd.py`); there is no reference fallback. Gradients flow to means, quats,
scales, viewmats (camera pose), SH coefficients / colours, opacities and backgrounds, and
rasterize_to_pixels accumulates gsplat's absgrad into means2d.absgrad. Ks get the reference's
gradient too (gsplat's kernels give none).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..autograd_stages import SphericalHarmonicsFn, project_with, resumed_transmittance_grad
from ..constants import TRANSMITTANCE_MIN
from ..contract import absgrad_buffer, stage
from . import rasterize as _rasterize  # _rasterize.RASTER_CHUNK read at each call (tests lower it)
from .isect import (
    IntersectionCapacities,
    isect_offset_encode_fwd,
    isect_tiles_fwd,
    isect_tiles_padded_fwd,
    padded_supported,
)
from .prepare import project_and_shade
from .project import project_fwd
from .project_bwd import project_bwd
from .rasterize import plan_passes, rasterize_to_pixels_fwd
from .rasterize_bwd import rasterize_to_pixels_bwd
from .sh import spherical_harmonics_fwd
from .sh_bwd import spherical_harmonics_bwd

__all__ = [
    "project",
    "spherical_harmonics",
    "isect_tiles",
    "isect_offset_encode",
    "rasterize_to_pixels",
    "rasterize_to_pixels_fwd",
    "rasterize_depth_chunk",
    "project_and_shade",  # not a contract stage: rasterization.py's fused preparation (prepare.py)
    "rasterize_to_pixels_composite",  # not a contract stage: rasterization.py's fused composite
]


class _RasterizeToPixelsFn(torch.autograd.Function):
    """rasterize_to_pixels: rasterize.metal forward (which also records final transmittance and last
    contributor per pixel), rasterize_bwd.metal backward. With absgrad, the per-pixel
    |d loss / d means2d| sums are added into the buffer the wrapper attached as means2d.absgrad at
    forward time (the reference does the same). With ``composite_bg`` ([3]) a third output, rgb, is
    splatfacto's background composite fused into both kernels (rasterize_to_pixels_composite); its
    unfused twin is rasterize_to_pixels + ops/composite.py. Gradients of unused outputs are not
    materialised (no zeros allocated): the kernel reads what it is given."""

    @staticmethod
    def forward(ctx, means2d, conics, colors, opacities, backgrounds, width, height, tile_size,
                isect_offsets, flatten_ids, absgrad_buf, composite_bg=None, squeeze=False, tile_merge=False):  # fmt: skip
        # One pass plan for forward and backward: at most one host sync (rasterize.plan_passes).
        C = colors.shape[0]
        grid = (C, -(-height // tile_size), -(-width // tile_size))  # (C, tile_height, tile_width)
        plan = plan_passes(
            isect_offsets, flatten_ids.numel(), tile_size, _rasterize.RASTER_CHUNK, colors.shape[1], grid
        )
        rgb = None
        if composite_bg is not None:  # squeeze: one camera's rgb as [H, W, 3] (no view op)
            shape = (height, width, 3) if squeeze and C == 1 else (C, height, width, 3)
            rgb = torch.empty(shape, dtype=torch.float32, device=colors.device)
        render_colors, render_alphas, transmittance, last_ids = rasterize_to_pixels_fwd(
            means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids, backgrounds,
            chunk=_rasterize.RASTER_CHUNK, plan=plan, composite_bg=composite_bg, rgb_out=rgb,
        )  # fmt: skip
        # render_colors is an output: saved as itself, autograd would detach it twice (at save and unpack)
        render_saved = render_colors.detach() if rgb is not None else None
        ctx.save_for_backward(means2d, conics, colors, opacities, backgrounds, isect_offsets, flatten_ids,
                              transmittance, last_ids, composite_bg, render_saved)  # fmt: skip
        ctx.args = (width, height, tile_size, plan, tile_merge)
        ctx.absgrad_buf = absgrad_buf
        ctx.set_materialize_grads(False)
        return (render_colors, render_alphas) if rgb is None else (render_colors, render_alphas, rgb)

    @staticmethod
    def backward(ctx, v_render_colors, v_render_alphas, v_rgb=None):
        (means2d, conics, colors, opacities, backgrounds, isect_offsets, flatten_ids, transmittance,
         last_ids, composite_bg, render_colors) = ctx.saved_tensors  # fmt: skip
        width, height, tile_size, plan, tile_merge = ctx.args
        need = ctx.needs_input_grad
        if not (any(need[:5]) or ctx.absgrad_buf is not None):
            return (None,) * 14
        v_means2d, v_conics, v_colors, v_opacities, v_backgrounds = rasterize_to_pixels_bwd(
            means2d, conics, colors, opacities, backgrounds, width, height, tile_size, isect_offsets,
            flatten_ids, transmittance, last_ids, v_render_colors, v_render_alphas,
            absgrad_out=ctx.absgrad_buf, chunk=_rasterize.RASTER_CHUNK, plan=plan,
            composite=(composite_bg, render_colors, v_rgb) if composite_bg is not None else None, tile_merge=tile_merge,
        )  # fmt: skip
        grads = (v_means2d, v_conics, v_colors, v_opacities, v_backgrounds)
        # width, height, tile_size, offsets, flatten_ids, absgrad buffer, composite_bg (no gradient:
        # rasterize_to_pixels_composite's condition), squeeze, tile_merge: none
        return tuple(g if n else None for g, n in zip(grads, need)) + (None,) * 9


class _RasterizeDepthChunkFn(torch.autograd.Function):
    """One depth chunk (ops/chunked.py) resumed from the running transmittance and stop state:
    rasterize.metal forward in resume mode, rasterize_bwd.metal backward (T is recovered from the
    chunk's final T, so it is absolute), plus the closed-form gradient to the incoming transmittance."""

    @staticmethod
    def forward(ctx, means2d, conics, colors, opacities, trans_in, stopped_in, width, height, tile_size,
                isect_offsets, flatten_ids, absgrad_buf):  # fmt: skip
        plan = plan_passes(isect_offsets, flatten_ids.numel(), tile_size, _rasterize.RASTER_CHUNK, colors.shape[1])
        stopped_out = torch.zeros(trans_in.shape, dtype=torch.int32, device=trans_in.device)  # [C, H, W]
        chunk_colors, _, trans_out, last_ids = rasterize_to_pixels_fwd(
            means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids, None,
            chunk=_rasterize.RASTER_CHUNK, plan=plan, trans_in=trans_in, stopped_in=stopped_in, stopped_out=stopped_out,
        )  # fmt: skip
        ctx.save_for_backward(means2d, conics, colors, opacities, isect_offsets, flatten_ids, trans_out, last_ids,
                              trans_in, stopped_in, chunk_colors)  # fmt: skip
        ctx.args = (width, height, tile_size, plan)
        ctx.absgrad_buf = absgrad_buf
        stopped_out = stopped_out != 0
        ctx.mark_non_differentiable(stopped_out)
        return chunk_colors, trans_out, stopped_out

    @staticmethod
    def backward(ctx, v_chunk_colors, v_trans_out, _v_stopped):
        (means2d, conics, colors, opacities, isect_offsets, flatten_ids, trans_out, last_ids, trans_in, stopped_in,
         chunk_colors) = ctx.saved_tensors  # fmt: skip
        width, height, tile_size, plan = ctx.args
        if v_chunk_colors is None:
            v_chunk_colors = torch.zeros_like(chunk_colors)
        v_alphas = (torch.zeros_like(trans_out) if v_trans_out is None else -v_trans_out)[..., None]  # alpha = 1 - T
        v_means2d, v_conics, v_colors, v_opacities, _ = rasterize_to_pixels_bwd(
            means2d, conics, colors, opacities, None, width, height, tile_size, isect_offsets, flatten_ids,
            trans_out, last_ids, v_chunk_colors.contiguous(), v_alphas.contiguous(), absgrad_out=ctx.absgrad_buf,
            chunk=_rasterize.RASTER_CHUNK, plan=plan,
        )  # fmt: skip
        v_trans_in = resumed_transmittance_grad(chunk_colors, v_chunk_colors, trans_out, v_trans_out, trans_in,
                                                stopped_in, TRANSMITTANCE_MIN)  # fmt: skip
        return (v_means2d, v_conics, v_colors, v_opacities, v_trans_in,
                None, None, None, None, None, None, None)  # fmt: skip


# The Metal implementations ProjectFn and SphericalHarmonicsFn run.
KERNELS = SimpleNamespace(
    project_fwd=project_fwd,
    project_bwd=project_bwd,
    spherical_harmonics_fwd=spherical_harmonics_fwd,
    spherical_harmonics_bwd=spherical_harmonics_bwd,
)


# ------------------------------------------------------------------------------------------------
# The backend contract (ops/contract.py)
# ------------------------------------------------------------------------------------------------
@stage
def project(means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane, radius_clip,
            calc_compensations):  # fmt: skip
    return project_with(KERNELS, means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane,
                        radius_clip, calc_compensations)  # fmt: skip


@stage
def spherical_harmonics(degree, dirs, coeffs, masks, activate):
    """The activation inside sh.metal / sh_bwd.metal."""
    return SphericalHarmonicsFn.apply(KERNELS, int(degree), dirs, coeffs, masks, bool(activate))


@stage
def isect_tiles(means2d, radii, depths, tile_size, tile_width, tile_height):
    # no .detach(): isect_tiles_fwd runs under no_grad and its kernels read the memory (2 aten ops fewer)
    return isect_tiles_fwd(means2d, radii, depths, int(tile_size), int(tile_width), int(tile_height))


def isect_tiles_padded(means2d, radii, depths, tile_size, tile_width, tile_height, capacities: IntersectionCapacities,
                       with_isect_ids: bool = True) -> Optional[Tuple[Tensor, Optional[Tensor], Tensor, Tensor]]:  # fmt: skip
    """Metal only (training steps): the contract's isect_tiles (same arguments) + isect_offset_encode into buffers of a capacity kept
    from earlier steps (`capacities`, the caller's), without reading the intersection count on the host
    (isect.py, "Padded lists").
    tiles_per_gauss [C,N] int32, isect_ids [cap] int64, flatten_ids [cap] int32, isect_offsets
    [C*th*tw + 1] int32 (the end slot: the real entries' count), which rasterize_to_pixels takes as is.
    ``with_isect_ids=False``: isect_ids is None, neither allocated nor written (rasterization's training
    renders: nothing in a step reads them); the other three are the same.
    None where the keys would not fit (then the exact stages run)."""
    if not padded_supported(radii.shape[0], int(tile_width), int(tile_height)):
        return None
    return isect_tiles_padded_fwd(
        means2d, radii, depths, int(tile_size), int(tile_width), int(tile_height), capacities, bool(with_isect_ids)
    )


@stage
def isect_offset_encode(isect_ids, C, tile_width, tile_height):
    return isect_offset_encode_fwd(isect_ids, int(C), int(tile_width), int(tile_height))


@stage
def rasterize_to_pixels(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids,
                        backgrounds, absgrad, *, tile_merge: bool = False):  # fmt: skip
    """The background inside the kernels. ``tile_merge`` (Metal only): the backward's tile merge
    (rasterize_bwd.py)."""
    return _RasterizeToPixelsFn.apply(
        means2d, conics, colors, opacities, backgrounds, int(width), int(height), int(tile_size),
        isect_offsets, flatten_ids, absgrad_buffer(means2d, absgrad), None, False, bool(tile_merge),
    )  # fmt: skip


def rasterize_to_pixels_composite(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets,
                                  flatten_ids, composite_bg: Tensor, absgrad: bool = False, squeeze: bool = False,
                                  tile_merge: bool = False) -> Tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """rasterize_to_pixels's arguments (colors D >= 3; isect_offsets also [C * th * tw + 1], padded lists) with
    composite_bg [3] float32 (no gradient) in place of backgrounds. Not a contract stage (rasterization.py's fused composite, Metal only): rasterize_to_pixels without
    backgrounds, plus splatfacto's background composite rgb = clamp(render_colors[..., :3] + (1 - render_alphas)
    * composite_bg, 0, 1) written by the same kernel and differentiated inside rasterize_bwd (no composite
    launches, no gradient buffers for it). rgb is [C,H,W,3], or [H,W,3] with ``squeeze`` and one camera.
    The unfused twin is rasterize_to_pixels + ops/composite.py's composite_background, the same bits."""
    return _RasterizeToPixelsFn.apply(
        means2d, conics, colors, opacities, None, int(width), int(height), int(tile_size),
        isect_offsets, flatten_ids, absgrad_buffer(means2d, absgrad), composite_bg, bool(squeeze), bool(tile_merge),
    )  # fmt: skip


@stage
def rasterize_depth_chunk(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids,
                          transmittance, stopped, absgrad_out):  # fmt: skip
    return _RasterizeDepthChunkFn.apply(
        means2d, conics, colors.contiguous(), opacities.contiguous(), transmittance.contiguous(), stopped,
        int(width), int(height), int(tile_size), isect_offsets, flatten_ids, absgrad_out,
    )  # fmt: skip
