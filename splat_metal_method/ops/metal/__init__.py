"""Metal backend: the five stages of the backend contract, run by hand-written Metal kernels.

On mps tensors the kernels run through torch.mps.compile_shader; on cpu tensors the same .metal
sources run under the MSL emulator (see runtime.py). Each differentiable stage is one
torch.autograd.Function whose forward runs the Metal kernels.

BACKWARD, FOR NOW: the backward of every stage recomputes that stage with the reference backend
(ops/reference.py) under enable_grad and returns torch.autograd.grad of it. Gradients are therefore
exactly the reference's (including means2d.absgrad), but slow and memory-hungry; Metal backward
kernels replace this in part 2. A one-time warning says so.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor

from .isect import isect_offset_encode_fwd, isect_tiles_fwd
from .project import project_fwd
from .rasterize import rasterize_to_pixels_fwd
from .sh import spherical_harmonics_fwd

__all__ = [
    "project",
    "spherical_harmonics",
    "isect_tiles",
    "isect_offset_encode",
    "rasterize_to_pixels",
    "rasterize_to_pixels_fwd",
]

_warned = False


def _warn_reference_backward() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "splat-metal: the Metal backend has no backward kernels yet; gradients are recomputed with "
            "the pure-PyTorch reference backend (correct, but slow and memory-hungry)",
            stacklevel=3,
        )


def _reference():
    from .. import reference

    return reference


def _leaf(t: Optional[Tensor], differentiable: bool) -> Optional[Tensor]:
    """A fresh leaf for recomputation: detached, requiring grad only where a gradient is wanted."""
    if t is None:
        return None
    return t.detach().requires_grad_(differentiable)


def _grads(outputs, grad_outputs, inputs):
    """torch.autograd.grad over the (output, grad) pairs that can carry a gradient; None per input
    that needs none."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o is not None and g is not None and o.requires_grad]
    wanted = [i for i in inputs if i is not None and i.requires_grad]
    result = {}
    if pairs and wanted:
        got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        result = {id(i): g for i, g in zip(wanted, got)}
    return [result.get(id(i)) if i is not None else None for i in inputs]


class _ProjectFn(torch.autograd.Function):
    """project: Metal forward; backward = reference recomputation (part 2: Metal backward kernel)."""

    @staticmethod
    def forward(ctx, means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane,
                radius_clip, calc_compensations):  # fmt: skip
        radii, means2d, depths, conics, comp = project_fwd(
            means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane, radius_clip,
            calc_compensations,
        )  # fmt: skip
        ctx.save_for_backward(means, quats, scales, viewmats, Ks)
        ctx.args = (width, height, eps2d, near_plane, far_plane, radius_clip, calc_compensations)
        ctx.mark_non_differentiable(radii)
        if comp is None:
            comp = torch.zeros((0,), dtype=means.dtype, device=means.device)  # placeholder, no gradient
        return radii, means2d, depths, conics, comp

    @staticmethod
    def backward(ctx, _v_radii, v_means2d, v_depths, v_conics, v_comp):
        _warn_reference_backward()
        inputs = [_leaf(t, need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[:5])]
        with torch.enable_grad():
            _, means2d, depths, conics, comp = _reference().project(*inputs, *ctx.args)
        grads = _grads([means2d, depths, conics, comp], [v_means2d, v_depths, v_conics, v_comp], inputs)
        # width, height, eps2d, near_plane, far_plane, radius_clip, calc_compensations: not differentiable
        return (*grads, None, None, None, None, None, None, None)


class _SphericalHarmonicsFn(torch.autograd.Function):
    """spherical_harmonics: Metal forward; backward = reference recomputation."""

    @staticmethod
    def forward(ctx, degree, dirs, coeffs, masks):
        colors = spherical_harmonics_fwd(degree, dirs, coeffs, masks)
        ctx.degree = degree
        ctx.save_for_backward(dirs, coeffs, masks)
        return colors

    @staticmethod
    def backward(ctx, v_colors):
        _warn_reference_backward()
        dirs, coeffs, masks = ctx.saved_tensors
        inputs = [_leaf(dirs, ctx.needs_input_grad[1]), _leaf(coeffs, ctx.needs_input_grad[2])]
        with torch.enable_grad():
            colors = _reference().spherical_harmonics(ctx.degree, inputs[0], inputs[1], masks)
        v_dirs, v_coeffs = _grads([colors], [v_colors], inputs)
        return None, v_dirs, v_coeffs, None  # degree, masks: not differentiable


class _RasterizeToPixelsFn(torch.autograd.Function):
    """rasterize_to_pixels: Metal forward (which also records final transmittance and last
    contributor per pixel for the future Metal backward); backward = reference recomputation.
    With absgrad, the reference's per-pixel |d loss / d means2d| sums are added into the buffer the
    wrapper attached as means2d.absgrad at forward time (the reference does the same)."""

    @staticmethod
    def forward(ctx, means2d, conics, colors, opacities, backgrounds, width, height, tile_size,
                isect_offsets, flatten_ids, absgrad_buf):  # fmt: skip
        render_colors, render_alphas, transmittance, last_ids = rasterize_to_pixels_fwd(
            means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids, backgrounds
        )
        ctx.save_for_backward(means2d, conics, colors, opacities, backgrounds, isect_offsets, flatten_ids,
                              transmittance, last_ids)  # fmt: skip
        ctx.args = (width, height, tile_size)
        ctx.absgrad_buf = absgrad_buf
        return render_colors, render_alphas

    @staticmethod
    def backward(ctx, v_render_colors, v_render_alphas):
        _warn_reference_backward()
        means2d, conics, colors, opacities, backgrounds, isect_offsets, flatten_ids, _, _ = ctx.saved_tensors
        width, height, tile_size = ctx.args
        absgrad = ctx.absgrad_buf is not None
        # means2d needs a graph for absgrad even when only the absgrad (not the gradient) is wanted
        inputs = [
            _leaf(means2d, ctx.needs_input_grad[0] or absgrad),
            _leaf(conics, ctx.needs_input_grad[1]),
            _leaf(colors, ctx.needs_input_grad[2]),
            _leaf(opacities, ctx.needs_input_grad[3]),
            _leaf(backgrounds, ctx.needs_input_grad[4]),
        ]
        with torch.enable_grad():
            out_colors, out_alphas = _reference().rasterize_to_pixels(
                inputs[0], inputs[1], inputs[2], inputs[3], width, height, tile_size, isect_offsets,
                flatten_ids, inputs[4], absgrad,
            )  # fmt: skip
        grads = _grads([out_colors, out_alphas], [v_render_colors, v_render_alphas], inputs)
        if absgrad and getattr(inputs[0], "absgrad", None) is not None:
            ctx.absgrad_buf.add_(inputs[0].absgrad)
        if not ctx.needs_input_grad[0]:
            grads[0] = None
        # width, height, tile_size, isect_offsets, flatten_ids, absgrad buffer: not differentiable
        return (*grads, None, None, None, None, None, None)


# ------------------------------------------------------------------------------------------------
# The backend contract (same names and signatures as ops/reference.py)
# ------------------------------------------------------------------------------------------------
def project(
    means: Tensor,  # [N, 3]
    quats: Tensor,  # [N, 4] wxyz (normalised inside)
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
    """radii [C,N] int32, means2d [C,N,2], depths [C,N], conics [C,N,3], compensations [C,N] or None."""
    radii, means2d, depths, conics, comp = _ProjectFn.apply(
        means, quats, scales, viewmats, Ks, int(width), int(height), float(eps2d), float(near_plane),
        float(far_plane), float(radius_clip), bool(calc_compensations),
    )  # fmt: skip
    return radii, means2d, depths, conics, (comp if calc_compensations else None)


def spherical_harmonics(
    degree: int,
    dirs: Tensor,  # [C, N, 3]
    coeffs: Tensor,  # [C, N, K, 3]
    masks: Optional[Tensor] = None,  # [C, N] bool
) -> Tensor:  # [C, N, 3]
    return _SphericalHarmonicsFn.apply(int(degree), dirs, coeffs, masks)


def isect_tiles(
    means2d: Tensor,  # [C, N, 2]
    radii: Tensor,  # [C, N] int32
    depths: Tensor,  # [C, N]
    tile_size: int,
    tile_width: int,
    tile_height: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """tiles_per_gauss [C,N] int32, isect_ids [M] int64, flatten_ids [M] int32 (not differentiable)."""
    return isect_tiles_fwd(means2d.detach(), radii, depths.detach(), int(tile_size), int(tile_width), int(tile_height))


def isect_offset_encode(isect_ids: Tensor, C: int, tile_width: int, tile_height: int) -> Tensor:
    """[C, tile_height, tile_width] int32 start of each tile's range in the sorted list."""
    return isect_offset_encode_fwd(isect_ids, int(C), int(tile_width), int(tile_height))


def rasterize_to_pixels(
    means2d: Tensor,  # [C, N, 2]
    conics: Tensor,  # [C, N, 3]
    colors: Tensor,  # [C, N, D]
    opacities: Tensor,  # [C, N]
    width: int,
    height: int,
    tile_size: int,
    isect_offsets: Tensor,  # [C, tile_height, tile_width] int32
    flatten_ids: Tensor,  # [M] int32
    backgrounds: Optional[Tensor] = None,  # [C, D]
    absgrad: bool = False,
) -> Tuple[Tensor, Tensor]:
    """render_colors [C,H,W,D], render_alphas [C,H,W,1]. With absgrad, sets means2d.absgrad [C,N,2]
    (zeros now, filled by the backward pass), as the reference does."""
    absgrad_buf = None
    if absgrad:
        absgrad_buf = torch.zeros(means2d.shape, dtype=means2d.dtype, device=means2d.device)
        means2d.absgrad = absgrad_buf
    return _RasterizeToPixelsFn.apply(
        means2d, conics, colors, opacities, backgrounds, int(width), int(height), int(tile_size),
        isect_offsets, flatten_ids, absgrad_buf,
    )  # fmt: skip
