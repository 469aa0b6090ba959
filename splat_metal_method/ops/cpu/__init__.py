"""Fast CPU backend: native, multi-threaded tile intersection and rasterization (isect.cpp,
rasterize.cpp; built on first use by build.py and cached) plus the reference's vectorised PyTorch
projection and spherical harmonics.

Why this split (measured on garden cameras at 648x420, 100k gaussians, one thread): the reference
spends about 11.7 s per forward+backward, of which projection (15 ms), spherical harmonics and tile
intersection + sort (46 ms) are a small part; the rest is rasterization, which PyTorch can only do by
evaluating every (tile pixel, listed gaussian) pair. The native rasterizer visits only the pixels a
gaussian can reach, stops a tile when its pixels are saturated, runs tiles on torch's intra-op
thread count, and is deterministic for any thread count (see rasterize.cpp).

The stages keep the backend contract (same names and signatures as ops/reference.py). Tensors that
are not float32 are rasterized by the reference (the native code is float32 only).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import reference
from ..constants import ALPHA_MAX, ALPHA_MIN, TRANSMITTANCE_MIN
from . import build

__all__ = ["project", "spherical_harmonics", "isect_tiles", "isect_offset_encode", "rasterize_to_pixels", "available"]

# The reference's stages are already cheap next to rasterization (see the module docstring).
project = reference.project
spherical_harmonics = reference.spherical_harmonics
isect_offset_encode = reference.isect_offset_encode


def available() -> bool:
    """True when the native library is built (or can be built) here."""
    return build.load() is not None


def _ptr(t: Optional[Tensor]) -> int:
    return t.data_ptr() if t is not None else 0


@torch.no_grad()
def isect_tiles(
    means2d: Tensor,  # [C, N, 2]
    radii: Tensor,  # [C, N] int32
    depths: Tensor,  # [C, N]
    tile_size: int,
    tile_width: int,
    tile_height: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """tiles_per_gauss [C,N] int32, isect_ids [M] int64, flatten_ids [M] int32: the reference's
    lists in the reference's order (isect.cpp: counting sort by tile, stable depth sort per tile)."""
    lib = build.load()
    if lib is None or means2d.dtype != torch.float32 or means2d.device.type != "cpu":
        return reference.isect_tiles(means2d, radii, depths, tile_size, tile_width, tile_height)
    C, N = radii.shape
    means2d, radii = means2d.detach().contiguous(), radii.int().contiguous()
    depths = depths.detach().float().contiguous()
    tiles_per_gauss = torch.empty(C, N, dtype=torch.int32)  # [C, N]
    threads = torch.get_num_threads()
    M = lib.splat_isect_count(C * N, tile_size, tile_width, tile_height, _ptr(means2d), _ptr(radii),
                              _ptr(tiles_per_gauss), threads)  # fmt: skip
    isect_ids = torch.empty(M, dtype=torch.int64)  # [M]
    flatten_ids = torch.empty(M, dtype=torch.int32)  # [M]
    lib.splat_isect_fill(C, N, tile_size, tile_width, tile_height, _ptr(means2d), _ptr(radii), _ptr(depths),
                         _ptr(tiles_per_gauss), M, _ptr(isect_ids), _ptr(flatten_ids), threads)  # fmt: skip
    return tiles_per_gauss, isect_ids, flatten_ids


class _RasterizeToPixelsFn(torch.autograd.Function):
    """Native forward (also records final transmittance and last contributor per pixel) and
    native backward. Returns colours [C,H,W,D] without background and transmittance [C,H,W]."""

    @staticmethod
    def forward(ctx, means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids,
                absgrad_buf):  # fmt: skip
        lib = build.load()
        C, N, D = colors.shape
        means2d, conics, colors, opacities = (t.contiguous() for t in (means2d, conics, colors, opacities))
        isect_offsets, flatten_ids = isect_offsets.int().contiguous(), flatten_ids.int().contiguous()
        tile_h, tile_w = isect_offsets.shape[1:]
        out_colors = colors.new_empty(C, height, width, D)  # [C, H, W, D]
        out_trans = colors.new_empty(C, height, width)  # [C, H, W]
        out_last = torch.empty(C, height, width, dtype=torch.int32)  # [C, H, W]
        out_stopped = torch.empty(C, height, width, dtype=torch.uint8)  # [C, H, W]
        lib.splat_rasterize_fwd(
            C, D, width, height, tile_size, tile_w, tile_h, flatten_ids.numel(), ALPHA_MAX, ALPHA_MIN,
            TRANSMITTANCE_MIN, *map(_ptr, (means2d, conics, colors, opacities, isect_offsets, flatten_ids,
                                           out_colors, out_trans, out_last, out_stopped)),
            torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(means2d, conics, colors, opacities, isect_offsets, flatten_ids, out_trans, out_last)
        ctx.args = (width, height, tile_size)
        ctx.absgrad_buf = absgrad_buf
        return out_colors, out_trans

    @staticmethod
    def backward(ctx, v_colors, v_trans):
        means2d, conics, colors, opacities, isect_offsets, flatten_ids, trans, last = ctx.saved_tensors
        width, height, tile_size = ctx.args
        C, N, D = colors.shape
        tile_h, tile_w = isect_offsets.shape[1:]
        M = flatten_ids.numel()
        v_colors = colors.new_zeros(C, height, width, D) if v_colors is None else v_colors.contiguous()
        # render_alphas = 1 - transmittance: the kernel takes the gradient w.r.t. the alpha.
        v_alphas = colors.new_zeros(C, height, width) if v_trans is None else (-v_trans).contiguous()
        isect_grads = colors.new_empty(max(M, 1), 2 + 3 + 1 + D + 2)  # [M, K] scratch
        v_means2d, v_conics = torch.zeros_like(means2d), torch.zeros_like(conics)  # [C, N, 2], [C, N, 3]
        v_opacities, v_colors_in = torch.zeros_like(opacities), torch.zeros_like(colors)  # [C, N], [C, N, D]
        absgrad = torch.zeros_like(means2d)  # [C, N, 2]
        build.load().splat_rasterize_bwd(
            C, D, width, height, tile_size, tile_w, tile_h, M, ALPHA_MAX, ALPHA_MIN, TRANSMITTANCE_MIN,
            *map(_ptr, (means2d, conics, colors, opacities, isect_offsets, flatten_ids, trans, last, v_colors,
                        v_alphas, isect_grads, v_means2d, v_conics, v_opacities, v_colors_in, absgrad)),
            torch.get_num_threads(),
        )  # fmt: skip
        if ctx.absgrad_buf is not None:
            ctx.absgrad_buf.add_(absgrad)
        return v_means2d, v_conics, v_colors_in, v_opacities, None, None, None, None, None, None


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
    tensors = (means2d, conics, colors, opacities)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors) or build.load() is None:
        return reference.rasterize_to_pixels(
            means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids, backgrounds,
            absgrad,
        )  # fmt: skip
    absgrad_buf = None
    if absgrad:
        absgrad_buf = torch.zeros_like(means2d)
        means2d.absgrad = absgrad_buf
    render_colors, trans = _RasterizeToPixelsFn.apply(
        means2d, conics, colors, opacities, int(width), int(height), int(tile_size), isect_offsets, flatten_ids,
        absgrad_buf,
    )  # fmt: skip
    render_alphas = 1.0 - trans[..., None]  # [C, H, W, 1]
    if backgrounds is not None:
        render_colors = render_colors + backgrounds[:, None, None, :] * (1.0 - render_alphas)
    return render_colors, render_alphas
