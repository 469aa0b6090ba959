"""Dispatch of isect.metal: tile intersections, sorted, and per-tile offsets (see isect.metal)."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..workspace import workspace
from . import runtime
from .kernels import grid_1d, library
from .scan import prefix_sum
from .sort import radix_sort_pairs


def _tile_bits(tile_width: int, tile_height: int) -> int:
    return (int(tile_width) * int(tile_height)).bit_length()


def _no_intersections(device) -> Tuple[Tensor, Tensor]:
    return torch.empty((0,), dtype=torch.int64, device=device), torch.empty((0,), dtype=torch.int32, device=device)


@torch.no_grad()
def isect_tiles_fwd(
    means2d: Tensor,  # [C, N, 2]
    radii: Tensor,  # [C, N] int32
    depths: Tensor,  # [C, N]
    tile_size: int,
    tile_width: int,
    tile_height: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Returns tiles_per_gauss [C,N] int32, isect_ids [M] int64, flatten_ids [M] int32, sorted by
    (camera, tile, depth) with ties in emission order. One host sync: reading M."""
    op = "isect_tiles"
    if radii.dim() != 2:
        raise ValueError(f"[{op}] radii must be [C,N], got {list(radii.shape)}")
    C, N = radii.shape
    if tuple(means2d.shape) != (C, N, 2) or tuple(depths.shape) != (C, N):
        raise ValueError(f"[{op}] means2d must be [C,N,2] and depths [C,N] with C,N={C},{N}, got "
                         f"{list(means2d.shape)}, {list(depths.shape)}")  # fmt: skip
    if means2d.dtype != torch.float32 or depths.dtype != torch.float32 or radii.dtype != torch.int32:
        raise ValueError(f"[{op}] expected float32 means2d/depths and int32 radii, got "
                         f"{means2d.dtype}, {depths.dtype}, {radii.dtype}")  # fmt: skip
    device = means2d.device
    tile_bits = _tile_bits(tile_width, tile_height)
    cam_bits = max(C - 1, 0).bit_length()
    if tile_bits + cam_bits > 32:
        raise ValueError(f"[{op}] {C} cameras x {tile_width * tile_height} tiles do not fit a 32-bit key")
    total = C * N
    tiles_per_gauss = torch.empty((C, N), dtype=torch.int32, device=device)
    if total == 0:
        return tiles_per_gauss, *_no_intersections(device)
    means2d, radii, depths = means2d.contiguous(), radii.contiguous(), depths.contiguous()
    lib = library(device, "isect.metal")
    # Scratch whose size is C*N (fixed between refines) or M (new every step): reused from the
    # workspace (ops/workspace.py) instead of fresh allocations, and read only inside this stage.
    ws = workspace()

    # Depth order of every (camera, gaussian): stable by flat index for equal depth bits (an argsort:
    # the sort writes the indices itself). Then the tile counts, per gaussian and in depth order.
    _, order = radix_sort_pairs(depths.view(torch.int32), None, bits=32, scratch="isect.depth_sort")
    counts = ws.get("isect.counts", total, torch.int32, device)
    lib.isect_count(means2d, radii, order, tiles_per_gauss, counts, total, int(tile_size), int(tile_width),
                    int(tile_height), **grid_1d(total))  # fmt: skip
    cum = prefix_sum(counts, inclusive=True, out=ws.get("isect.cum", total, torch.int64, device))  # [C*N]
    M = int(runtime.host_read(cum[-1]))  # the only host sync: sizes the intersection buffers
    if M == 0:
        return tiles_per_gauss, *_no_intersections(device)
    if M >= 2**31:
        raise ValueError(f"[{op}] {M} intersections exceed the 32-bit offsets")

    tile_keys = ws.get("isect.tile_keys", M, torch.int32, device)
    flat_ids = ws.get("isect.flat_ids", M, torch.int32, device)
    lib.isect_emit(means2d, radii, tiles_per_gauss, order, cum, tile_keys, flat_ids,
                   total, N, int(tile_size), int(tile_width), int(tile_height), tile_bits,
                   **grid_1d(total))  # fmt: skip
    tile_keys, flat_ids = radix_sort_pairs(tile_keys, flat_ids, bits=tile_bits + cam_bits, scratch="isect.tile_sort")

    isect_ids = torch.empty((M,), dtype=torch.int64, device=device)
    flatten_ids = torch.empty((M,), dtype=torch.int32, device=device)
    lib.isect_finalize(tile_keys, flat_ids, depths, isect_ids, flatten_ids, M, **grid_1d(M))
    return tiles_per_gauss, isect_ids, flatten_ids


@torch.no_grad()
def isect_offset_encode_fwd(isect_ids: Tensor, C: int, tile_width: int, tile_height: int) -> Tensor:
    """Start of each tile's range in the sorted list: [C, tile_height, tile_width] int32."""
    if isect_ids.dim() != 1 or isect_ids.dtype != torch.int64:
        raise ValueError(
            f"[isect_offset_encode] isect_ids must be [M] int64, got {list(isect_ids.shape)} {isect_ids.dtype}"
        )
    device = isect_ids.device
    n_tiles = int(tile_width) * int(tile_height)
    M = isect_ids.numel()
    if M == 0:
        return torch.zeros((C, tile_height, tile_width), dtype=torch.int32, device=device)
    offsets = torch.empty((C, tile_height, tile_width), dtype=torch.int32, device=device)
    library(device, "isect.metal").isect_offsets(
        isect_ids.contiguous(), offsets, M, n_tiles, C * n_tiles, _tile_bits(tile_width, tile_height),
        **grid_1d(M),
    )  # fmt: skip
    return offsets
