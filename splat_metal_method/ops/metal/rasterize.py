"""Dispatch of rasterize.metal: per-tile front-to-back compositing."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .kernels import tile_library

# Gaussians of one tile composited per dispatch ("pass"). Bounds the work of one command so a dense
# tile cannot run into the GPU watchdog: a pass costs at most tiles x TILE_PIXELS x RASTER_CHUNK
# gaussian evaluations. More passes only happen when some tile holds more than this many gaussians.
RASTER_CHUNK = 8192
MAX_CHANNELS = 64  # per-pixel accumulators live in registers; one library per channel count


def rasterize_to_pixels_fwd(
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
    chunk: Optional[int] = None,
    n_passes: Optional[int] = None,
    trans_in: Optional[Tensor] = None,  # [C, H, W]: resume a depth chunk from this transmittance ...
    stopped_in: Optional[Tensor] = None,  # [C, H, W] bool ... and stop state
    stopped_out: Optional[Tensor] = None,  # [C, H, W] int32, written when resuming: the stop state after
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Runs rasterize_fwd. Returns render_colors [C,H,W,D], render_alphas [C,H,W,1] and, for the
    backward pass, transmittance [C,H,W] (final T) and last_ids [C,H,W] int32 (index into
    flatten_ids of the last contributing gaussian, -1 if none).

    Host sync: none when min(M, N) <= chunk or when the caller passes ``n_passes`` (see count_passes,
    whose result the backward pass reuses); otherwise one, to read the longest tile list and size the
    number of passes."""
    op = "rasterize_to_pixels"
    if colors.dim() != 3:
        raise ValueError(f"[{op}] colors must be [C,N,D], got {list(colors.shape)}")
    C, N, D = colors.shape
    device = colors.device
    for name, t, shape in (("means2d", means2d, (C, N, 2)), ("conics", conics, (C, N, 3)),
                           ("opacities", opacities, (C, N))):  # fmt: skip
        if tuple(t.shape) != shape:
            raise ValueError(f"[{op}] {name} must be {list(shape)}, got {list(t.shape)}")
        if t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"[{op}] {name} must be float32 on {device}, got {t.dtype} on {t.device}")
    if colors.dtype != torch.float32:
        raise ValueError(f"[{op}] colors must be float32, got {colors.dtype}")
    if not 1 <= D <= MAX_CHANNELS:
        raise ValueError(f"[{op}] colors must have 1..{MAX_CHANNELS} channels, got {D}")
    if not 1 <= tile_size <= 32:
        raise ValueError(f"[{op}] tile_size must be 1..32 (one thread per pixel of a tile), got {tile_size}")
    tile_height, tile_width = math.ceil(height / tile_size), math.ceil(width / tile_size)
    if tuple(isect_offsets.shape) != (C, tile_height, tile_width) or isect_offsets.dtype != torch.int32:
        raise ValueError(f"[{op}] isect_offsets must be [C, tile_height, tile_width] = "
                         f"{[C, tile_height, tile_width]} int32, got {list(isect_offsets.shape)} {isect_offsets.dtype}")
    if flatten_ids.dim() != 1 or flatten_ids.dtype != torch.int32:
        raise ValueError(f"[{op}] flatten_ids must be [M] int32, got {list(flatten_ids.shape)} {flatten_ids.dtype}")
    if backgrounds is not None:
        if tuple(backgrounds.shape) != (C, D) or backgrounds.dtype != torch.float32:
            raise ValueError(f"[{op}] backgrounds must be [C,D] = {[C, D]} float32, got "
                             f"{list(backgrounds.shape)} {backgrounds.dtype}")  # fmt: skip
    chunk = int(chunk or RASTER_CHUNK)
    M = flatten_ids.numel()

    render_colors = torch.empty((C, height, width, D), dtype=torch.float32, device=device)
    render_alphas = torch.empty((C, height, width, 1), dtype=torch.float32, device=device)
    transmittance = torch.empty((C, height, width), dtype=torch.float32, device=device)
    last_ids = torch.empty((C, height, width), dtype=torch.int32, device=device)
    if C * height * width == 0:
        return render_colors, render_alphas, transmittance, last_ids

    if n_passes is None:
        n_passes = count_passes(isect_offsets, M, chunk, N)
    resume = trans_in is not None
    if resume:
        if stopped_in is None or stopped_out is None or tuple(trans_in.shape) != (C, height, width):
            raise ValueError(f"[{op}] resuming needs trans_in, stopped_in and stopped_out of {[C, height, width]}")
        pixel_done = stopped_out
        resume_bufs = (trans_in.float().contiguous(), stopped_in.to(torch.int32).contiguous())
    else:
        pixel_done = torch.empty((C, height, width) if n_passes > 1 else (1,), dtype=torch.int32, device=device)
        placeholder = torch.zeros((1,), dtype=torch.int32, device=device)
        resume_bufs = (placeholder.float(), placeholder)
    bg = backgrounds.contiguous() if backgrounds is not None else torch.zeros((1,), dtype=torch.float32, device=device)
    if M == 0:  # kernels bind every buffer; give flatten_ids one (never read) element
        flatten_ids = torch.zeros((1,), dtype=torch.int32, device=device)

    lib, rows = tile_library(device, "rasterize.metal", "rasterize_fwd", tile_size,
                             lambda _rows: (("SPLAT_CHANNELS", D),))  # rows: of a tile per group (kernels.py)
    grid = {"threads": (tile_width * tile_size, tile_height * tile_size, C), "group_size": (tile_size, rows, 1)}
    args = (
        means2d.contiguous(), conics.contiguous(), colors.contiguous(), opacities.contiguous(), bg,
        isect_offsets.contiguous(), flatten_ids.contiguous(),
        render_colors, render_alphas, transmittance, last_ids, pixel_done,
        int(width), int(height), tile_width, tile_height, C * tile_width * tile_height, M,
        int(backgrounds is not None),
    )  # fmt: skip
    for p in range(n_passes):
        lib.rasterize_fwd(*args, p, chunk, *resume_bufs, int(resume), **grid)
    return render_colors, render_alphas, transmittance, last_ids


def count_passes(isect_offsets: Tensor, n_isects: int, chunk: Optional[int] = None,
                 n_gaussians: Optional[int] = None) -> int:  # fmt: skip
    """Dispatches ("passes") of at most `chunk` gaussians per tile that the longest tile list needs.
    A tile lists a gaussian at most once, so its list is at most min(M, N) long: no host sync when
    that bound is <= chunk, else one (to read the longest list)."""
    chunk = int(chunk or RASTER_CHUNK)
    if min(n_isects, n_isects if n_gaussians is None else n_gaussians) <= chunk:
        return 1
    starts = isect_offsets.view(-1).long()
    ends = torch.cat([starts[1:], starts.new_full((1,), n_isects)])
    return max(1, math.ceil(int((ends - starts).max().item()) / chunk))
