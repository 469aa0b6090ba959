"""Depth-chunked rasterization: a bounded number of tile intersections at a time, same render.

When one render's tile intersections would exceed a budget, the visible gaussians of each camera
are cut, in depth order, into chunks of at most about ``budget`` intersections. Each chunk is
intersected, sorted and composited on its own, front to back, resuming from the running state of
every pixel (transmittance T and whether it has stopped):

    C = C_1 + T_1 C_2 + T_1 T_2 C_3 + ...        T = T_1 T_2 T_3 ...

Every chunk is a contiguous depth range, so each tile's list is the unchunked list cut into
consecutive pieces (equal depths stay in emission order), and the stop rule (stop before the
gaussian that would take T to <= 1e-4) sees the absolute T because T is passed into the next chunk
rather than multiplied in afterwards. Forward values and gradients (means2d.absgrad included) are
those of the unchunked render up to float32 rounding of T at chunk boundaries. With gradients on,
each chunk is recomputed in backward (torch.utils.checkpoint), so only one chunk's intersection
lists exist at any time.

Backend-agnostic: intersections come from the backend's own ``isect_tiles`` /
``isect_offset_encode``, compositing from its ``rasterize_depth_chunk`` (the contract's stages, ops/contract.py). gsplat's fused CUDA path has no
transmittance input, so the "gsplat" backend is not chunked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from . import reference
from .contract import absgrad_buffer, with_background


@dataclass
class DepthChunks:
    """How one render is cut: chunk index per (camera, gaussian), -1 where it touches no tile."""

    tiles_per_gauss: Tensor  # [C, N] int32
    chunk_ids: Tensor  # [C, N] int64
    n_chunks: int
    n_intersections: int
    budget: int


@torch.no_grad()
def count_intersections(means2d: Tensor, radii: Tensor, tile_size: int, tile_width: int, tile_height: int) -> Tensor:
    """Tiles each gaussian touches [C,N] int32 (what isect_tiles would emit), without emitting them."""
    _, span = reference.tile_bounds(means2d, radii, tile_size, tile_width, tile_height)
    return (span[..., 0] * span[..., 1] * (radii > 0)).int()


@torch.no_grad()
def plan(means2d, radii, depths, tile_size, tile_width, tile_height, budget: int) -> Optional[DepthChunks]:
    """None when the render fits ``budget`` intersections; else its depth chunks (the lists of the contract's
    ``isect_tiles`` of the same arguments, cut). One host sync.

    A chunk holds at most ``budget`` + (largest tile count of one gaussian) - 1 intersections:
    a gaussian is never split, it goes to the chunk where its last intersection falls."""
    if budget <= 0:
        raise ValueError(f"[rasterization] max_intersections must be positive, got {budget}")
    tiles_per_gauss = count_intersections(means2d, radii, tile_size, tile_width, tile_height)
    counts = tiles_per_gauss.long()
    total = int(counts.sum())
    if total <= budget:
        return None
    # Depth order per camera; stable, so equal depths keep gaussian order as the intersection sort does.
    order = torch.argsort(depths.detach(), dim=1, stable=True)  # [C, N]
    cum = torch.cumsum(torch.gather(counts, 1, order), dim=1)  # inclusive intersection count
    chunk_sorted = torch.div(cum - 1, budget, rounding_mode="floor").clamp(min=0)
    chunk_ids = torch.empty_like(chunk_sorted).scatter_(1, order, chunk_sorted)
    chunk_ids = torch.where(counts > 0, chunk_ids, torch.full_like(chunk_ids, -1))
    n_chunks = int(chunk_ids.max()) + 1
    return DepthChunks(tiles_per_gauss, chunk_ids, n_chunks, total, int(budget))


def _chunk(ops: ModuleType, composite, chunk_radii, means2d, conics, colors, opacities, depths, transmittance, stopped,
           geometry, absgrad_out=None):  # fmt: skip
    """One chunk's lists and composite: chunk_radii [C, N] int32 (radii, zero outside this chunk), the running
    transmittance [C, H, W] and stopped [C, H, W], geometry (width, height, tile_size, tile_width, tile_height);
    absgrad_out is bound by partial (backward writes it, checkpoint must not save it)."""
    width, height, tile_size, tile_width, tile_height = geometry
    C = means2d.shape[0]
    _, isect_ids, flatten_ids = ops.isect_tiles(means2d, chunk_radii, depths, tile_size, tile_width, tile_height)
    isect_offsets = ops.isect_offset_encode(isect_ids, C, tile_width, tile_height)
    del isect_ids
    return composite(
        means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids,
        transmittance, stopped, absgrad_out,
    )  # fmt: skip


def rasterize_in_depth_chunks(ops: ModuleType, chunks: DepthChunks, means2d, conics, colors, opacities, radii, depths,
                              width, height, tile_size, tile_width, tile_height, backgrounds, absgrad):  # fmt: skip
    """``ops.rasterize_to_pixels`` of the whole list (the contract's arguments, with the projected radii [C,N]
    and depths [C,N] and the tile grid), in the depth chunks ``chunks``: render_colors [C,H,W,D], render_alphas
    [C,H,W,1]. With absgrad, sets ``means2d.absgrad`` [C,N,2] (filled by backward)."""
    C = colors.shape[0]
    composite = ops.rasterize_depth_chunk  # the contract's: every backend has one
    absgrad_out = absgrad_buffer(means2d, absgrad)
    transmittance = torch.ones(C, height, width, device=means2d.device, dtype=colors.dtype)
    stopped = torch.zeros(C, height, width, device=means2d.device, dtype=torch.bool)
    render_colors = None
    geometry = (int(width), int(height), int(tile_size), int(tile_width), int(tile_height))
    for k in range(chunks.n_chunks):
        chunk_radii = torch.where(chunks.chunk_ids == k, radii, torch.zeros_like(radii))
        run = functools.partial(_chunk, absgrad_out=absgrad_out)
        args = (ops, composite, chunk_radii, means2d, conics, colors, opacities, depths, transmittance, stopped,
                geometry)  # fmt: skip
        if torch.is_grad_enabled():
            # Keep only this chunk's inputs and outputs for backward; its lists are rebuilt then.
            chunk_colors, transmittance, stopped = checkpoint(run, *args, use_reentrant=False)
        else:
            chunk_colors, transmittance, stopped = run(*args)
        render_colors = chunk_colors if render_colors is None else render_colors + chunk_colors
        if k + 1 < chunks.n_chunks and bool(stopped.all()):
            break  # every pixel has stopped: the remaining chunks cannot contribute
    render_alphas = 1.0 - transmittance[..., None]
    return with_background(render_colors, render_alphas, backgrounds), render_alphas
