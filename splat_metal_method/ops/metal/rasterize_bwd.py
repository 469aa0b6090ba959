"""Dispatch of rasterize_bwd.metal: gradients of per-tile alpha compositing."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import params, runtime
from .kernels import tile_library
from .rasterize import MAX_CHANNELS, RASTER_CHUNK, PassPlan, band, check_offsets, flat_offsets, plan_passes
from .variants import bwd_batch, bwd_defines  # noqa: F401 (bwd_batch: part of this module's API)

# Bits of rasterize_bwd.metal's `flags` (SPLAT_BWD_*): what one launch reads.
BWD_BACKGROUND, BWD_ABSGRAD, BWD_COMPOSITE, BWD_V_COLORS, BWD_V_ALPHAS = 1, 2, 4, 8, 16

# The backward's tile merge (rasterize_bwd.metal SPLAT_BWD_MERGE): a gaussian's reduced gradients summed over
# the simdgroups of its tile in threadgroup memory, then one device atomic per quantity and tile instead of one
# per simdgroup (up to 8x fewer atomics at 16x16 tiles; the step ledger counts them), at the price of smaller
# batches and a barrier more per batch. Off by default until a Mac measures it (a prototype in a msplat fork
# regressed at small tiles): rasterize_to_pixels_bwd's ``tile_merge``, chosen per call (the model config's
# bwd_tile_merge; splat-metal-bench --vs tile-merge runs both).

# Positions of v_colors and of the packed scalars (params.RASTER_BWD) in lib.rasterize_bwd's arguments (the launch in
# rasterize_to_pixels_bwd)
_ARG_V_COLORS, _ARG_PARAMS = 15, 18
# simd reductions every simdgroup that has gaussians to walk performs first: simd_max of its last bin, its lanes'
# rank (simd_prefix_exclusive_sum) and count (simd_sum), one component each
SETUP_REDUCTIONS = 3


def reduced_components(flags: int, channels: int) -> Tuple[int, int]:
    """(scalar components, simd_sum calls) an active (gaussian, simdgroup) pair reduces (rasterize_bwd.metal):
    conic and opacity 4 in one float4, means2d 2 (+ |means2d| 2 with absgrad) in one call, the colour's channels
    in float4s, the last over its used channels: (11, 3) for splatfacto's RGB with absgrad, (9, 3) without
    (msplat's 9 components)."""
    return 4 + (4 if flags & BWD_ABSGRAD else 2) + channels, 2 + (channels + 3) // 4


def active_groups(args, components: int, calls: int) -> int:
    """The active (gaussian, simdgroup) pairs of one rasterize_bwd launch with these arguments, from its counted
    simd reductions as components and as calls (the step ledger's; benchmarks/step_model/peers.py OursFromLedger scales the backward's
    reductions and atomics by them): SETUP_REDUCTIONS of one component each per simdgroup that walks (how many
    depends on the tiles) and reduced_components per group solve for both. Raises if they do not: the kernel's
    reductions are not what reduced_components says."""
    per_group, calls_per_group = reduced_components(
        int(args[_ARG_PARAMS][params.RASTER_BWD.index("flags")]), int(args[_ARG_V_COLORS].shape[-1])
    )
    groups, rest = divmod(components - calls, per_group - calls_per_group)
    simdgroups, rest2 = divmod(calls - calls_per_group * groups, SETUP_REDUCTIONS)
    if rest or rest2 or groups < 0 or simdgroups < 0:
        raise ValueError(f"rasterize_bwd: {components} reduced components in {calls} calls are not "
                         f"{SETUP_REDUCTIONS} a simdgroup plus {per_group} in {calls_per_group} an active group")  # fmt: skip
    return groups


def rasterize_to_pixels_bwd(
    means2d: Tensor,  # [C, N, 2]
    conics: Tensor,  # [C, N, 3]
    colors: Tensor,  # [C, N, D]
    opacities: Tensor,  # [C, N]
    backgrounds: Optional[Tensor],  # [C, D]
    width: int,
    height: int,
    tile_size: int,
    isect_offsets: Tensor,  # [C, tile_height, tile_width] int32, or [C * th * tw + 1] (padded lists)
    flatten_ids: Tensor,  # [M] int32
    transmittance: Tensor,  # [C, H, W] final T (from rasterize_to_pixels_fwd)
    last_ids: Tensor,  # [C, H, W] int32 (from rasterize_to_pixels_fwd)
    v_render_colors: Optional[Tensor],  # [C, H, W, D], or None (zero)
    v_render_alphas: Optional[Tensor],  # [C, H, W, 1], or None (zero)
    absgrad_out: Optional[Tensor] = None,  # [C, N, 2] float32 contiguous: |per-pixel grad| ADDED here
    chunk: Optional[int] = None,
    plan: Optional[PassPlan] = None,
    composite: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]] = None,  # (composite_bg [3], render_colors, v_rgb)
    tile_merge: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Runs rasterize_bwd. Returns v_means2d [C,N,2], v_conics [C,N,3], v_colors [C,N,D],
    v_opacities [C,N] and v_backgrounds [C,D] (None without backgrounds). With ``absgrad_out``,
    sum over pixels of |per-pixel d loss / d means2d| is accumulated into it (gsplat's absgrad).
    A gradient given as None is zero: nothing is allocated for it. ``composite``: the forward's fused
    composite (rasterize_to_pixels_fwd's composite_bg), its background, the forward's render_colors and
    the gradient v_rgb of its rgb ([C, H, W, 3] or [H, W, 3]; None: zero); not with backgrounds.
    ``tile_merge``: a gaussian's gradients summed over its tile's simdgroups before the device atomics
    (SPLAT_BWD_MERGE, above); the same gradients up to float32 summation order.

    Host sync: none when the caller passes ``plan`` (the autograd Function passes the forward's
    rasterize.plan_passes) or when plan_passes needs none; otherwise one. Each pass reserves its work
    x runtime.BWD_WORK_FACTOR with runtime.reserve_work (a commit between passes when a command
    buffer would pass the budget)."""
    op = "rasterize_to_pixels_bwd"
    C, N, D = colors.shape
    device = colors.device
    if not 1 <= D <= MAX_CHANNELS:
        raise ValueError(f"[{op}] colors must have 1..{MAX_CHANNELS} channels, got {D}")
    for name, t, shape in (
        ("means2d", means2d, (C, N, 2)), ("conics", conics, (C, N, 3)), ("opacities", opacities, (C, N)),
        ("transmittance", transmittance, (C, height, width)), ("v_render_colors", v_render_colors, (C, height, width, D)),
        ("v_render_alphas", v_render_alphas, (C, height, width, 1)),
    ):  # fmt: skip
        if t is None and name.startswith("v_"):
            continue
        if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"[{op}] {name} must be {list(shape)} float32 on {device}, "
                             f"got {list(t.shape)} {t.dtype} on {t.device}")  # fmt: skip
    if tuple(last_ids.shape) != (C, height, width) or last_ids.dtype != torch.int32:
        raise ValueError(
            f"[{op}] last_ids must be {[C, height, width]} int32, got {list(last_ids.shape)} {last_ids.dtype}"
        )
    if absgrad_out is not None and (tuple(absgrad_out.shape) != (C, N, 2) or not absgrad_out.is_contiguous()
                                    or absgrad_out.dtype != torch.float32):  # fmt: skip
        raise ValueError(f"[{op}] absgrad_out must be a contiguous [C,N,2] float32 buffer")
    tile_height, tile_width = math.ceil(height / tile_size), math.ceil(width / tile_size)
    padded = check_offsets(op, isect_offsets, C, tile_height, tile_width)
    M = flatten_ids.numel()

    v_means2d = torch.zeros((C, N, 2), dtype=torch.float32, device=device)
    v_conics = torch.zeros((C, N, 3), dtype=torch.float32, device=device)
    v_colors = torch.zeros((C, N, D), dtype=torch.float32, device=device)
    v_opacities = torch.zeros((C, N), dtype=torch.float32, device=device)
    composite_bg, render_out, v_rgb = composite if composite is not None else (None, None, None)
    if composite is not None and (backgrounds is not None or D < 3 or render_out.shape != (C, height, width, D)
                                  or (v_rgb is not None and v_rgb.numel() != C * height * width * 3)):  # fmt: skip
        raise ValueError(f"[{op}] the fused composite's backward needs no backgrounds, D >= 3, the forward's "
                         f"render_colors {[C, height, width, D]} and v_rgb of {C * height * width * 3} elements")  # fmt: skip
    v_backgrounds = None
    if backgrounds is not None:  # d colour / d bg = T_final per pixel
        v_backgrounds = torch.zeros((C, D), dtype=torch.float32, device=device)
        if v_render_colors is not None:
            v_backgrounds = (v_render_colors * transmittance[..., None]).sum(dim=(1, 2))
    if M == 0 or C * height * width == 0:
        return v_means2d, v_conics, v_colors, v_opacities, v_backgrounds

    if plan is None:
        plan = plan_passes(isect_offsets, M, tile_size, chunk or RASTER_CHUNK, N, (C, tile_height, tile_width))
    n_passes = plan.n_passes
    multi = n_passes > 1
    # Buffers the kernel neither reads nor writes here are bound to a float32 tensor at hand: no
    # placeholder allocation (each one an aten op). pix_T / pix_buf are
    # touched only between passes, the background table only with backgrounds, absgrad only when asked.
    placeholder = v_opacities  # [C, N]
    pix_T = torch.empty((C, height, width), dtype=torch.float32, device=device) if multi else placeholder
    pix_buf = torch.empty((C, height, width, D), dtype=torch.float32, device=device) if multi else placeholder
    bg = backgrounds.contiguous() if backgrounds is not None else placeholder
    abs_buf = absgrad_out if absgrad_out is not None else placeholder
    flags = ((BWD_BACKGROUND if backgrounds is not None else 0) | (BWD_ABSGRAD if absgrad_out is not None else 0)
             | (BWD_COMPOSITE if v_rgb is not None else 0) | (BWD_V_COLORS if v_render_colors is not None else 0)
             | (BWD_V_ALPHAS if v_render_alphas is not None else 0))  # fmt: skip
    if not flags & (BWD_COMPOSITE | BWD_V_COLORS | BWD_V_ALPHAS):  # every incoming gradient is zero
        return v_means2d, v_conics, v_colors, v_opacities, v_backgrounds
    composite_bufs = (composite_bg.contiguous(), render_out.contiguous(), v_rgb.contiguous()) if v_rgb is not None \
        else (placeholder,) * 3  # fmt: skip

    lib, rows = tile_library(device, "rasterize_bwd.metal", "rasterize_bwd", tile_size,
                             lambda rows: bwd_defines(tile_size, D, rows, tile_merge))  # fmt: skip
    inputs = (means2d.contiguous(), conics.contiguous(), colors.contiguous(), opacities.contiguous(), bg)
    offsets, flatten_ids = flat_offsets(isect_offsets), flatten_ids.contiguous()
    per_pixel = (transmittance.contiguous(), last_ids.contiguous(),
                 v_render_colors.contiguous() if v_render_colors is not None else placeholder,
                 v_render_alphas.contiguous() if v_render_alphas is not None else placeholder, pix_T, pix_buf)  # fmt: skip
    total_tiles = C * tile_width * tile_height + int(padded)  # padded: the last tile ends at the end slot
    for d in plan.dispatches:  # a band is its first tile row, a kernel argument (rasterize.band)
        b = band(d, C, tile_size, tile_width, tile_height, rows)
        runtime.reserve_work(device, d.work * runtime.BWD_WORK_FACTOR)
        args = params.pack(params.RASTER_BWD, width=int(width), height=int(height), tile_width=tile_width,
                           tile_height=tile_height, total_tiles=total_tiles, n_isects=M, flags=flags,
                           pass_index=d.pass_index, chunk=plan.chunk_of(d), row0=b.row0)  # fmt: skip
        lib.rasterize_bwd(
            *inputs, offsets, flatten_ids, *per_pixel, v_means2d, v_conics, v_colors, v_opacities, abs_buf, args,
            *composite_bufs, **b.grid,
        )  # fmt: skip
    return v_means2d, v_conics, v_colors, v_opacities, v_backgrounds
