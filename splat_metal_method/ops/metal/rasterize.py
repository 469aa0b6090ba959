"""Dispatch of rasterize.metal: per-tile front-to-back compositing."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import params, runtime, variants
from .kernels import tile_library
from .variants import MAX_CHANNELS

# Gaussians of one tile composited per pass, at most. Pass p composites entries [p chunk, (p+1) chunk)
# of every tile's list; a pass costs at most TILE_PIXELS x chunk gaussian-pixel evaluations per tile.
# Consecutive dispatches still land in one command buffer, so the bound that matters is per command
# buffer (runtime.py, "Command buffers and the GPU watchdog"): plan_passes counts each pass's work,
# cuts a pass whose backward would pass runtime.COMMAND_BUFFER_BUDGET into bands of tile rows (one
# dispatch each), and the dispatch loops reserve each dispatch's work with runtime.reserve_work,
# which commits between dispatches when the current command buffer would pass the budget.
RASTER_CHUNK = 8192
# The chunk of a plan whose single pass composites every tile's whole list (padded lists: plan_from_rows).
WHOLE_TILE = 2**31 - 1


class Dispatch(NamedTuple):
    """One kernel dispatch of a pass: every camera and tile at once (camera None), or one camera's
    band of tile rows [rows[0], rows[1])."""

    pass_index: int
    camera: Optional[int]
    rows: Tuple[int, int]
    work: int  # forward gaussian-pixel evaluations, at most (tile pixels x gaussians composited)


class PassPlan(NamedTuple):
    """How a render is cut into kernel dispatches; forward and backward share it."""

    chunk: int  # gaussians of a tile per pass
    dispatches: Tuple[Dispatch, ...]  # in pass order

    @property
    def n_passes(self) -> int:
        return 1 + max(d.pass_index for d in self.dispatches)


def plan_from_lengths(tile_lengths: Tensor, tile_pixels: int, chunk: int, budget: int) -> PassPlan:
    """The dispatches for tiles of these list lengths ([C, tile_height, tile_width], on the host).
    Pass p costs tile_pixels x sum_t clamp(len_t - p chunk, 0, chunk). A pass whose backward (work x
    runtime.BWD_WORK_FACTOR) fits `budget` is one dispatch over everything; otherwise each camera's tile
    rows are cut greedily into bands that fit (a single row that does not fit goes alone: it holds
    tile_width x tile_pixels x chunk evaluations at most, 2e9 backward-weighted at 4K width), and bands
    with nothing left to composite after pass 0 are skipped (their tiles were finalised)."""
    lengths = tile_lengths.long()
    C, tile_height, _ = lengths.shape
    longest = int(lengths.max()) if lengths.numel() else 0
    dispatches = []
    for p in range(max(1, math.ceil(longest / chunk))):
        row_work = tile_pixels * (lengths - p * chunk).clamp(0, chunk).sum(dim=2)  # [C, tile_height]
        total = int(row_work.sum())
        if total * runtime.BWD_WORK_FACTOR <= budget:
            dispatches.append(Dispatch(p, None, (0, tile_height), total))
            continue
        for c in range(C):
            start, band = 0, 0
            for r, w in enumerate(int(w) for w in row_work[c]):  # already on the host
                if r > start and (band + w) * runtime.BWD_WORK_FACTOR > budget:
                    if p == 0 or band > 0:
                        dispatches.append(Dispatch(p, c, (start, r), band))
                    start, band = r, 0
                band += w
            if p == 0 or band > 0:
                dispatches.append(Dispatch(p, c, (start, tile_height), band))
    return PassPlan(chunk, tuple(dispatches))


def plan_from_rows(row_entries, C: int, tile_height: int, tile_pixels: int, budget: int) -> PassPlan:
    """The dispatches for padded lists (isect.py), whose lengths only the device knows, from an estimate of
    the intersections in each tile row (`row_entries`: C * tile_height numbers, camera-major; what the
    device counted at an earlier step, read without waiting, scaled to this step's gaussians). One pass
    composites every tile's whole list (chunk WHOLE_TILE: a threadgroup loops over its tile however long
    it is, so nothing is left out whatever the estimate); the watchdog bound is per command buffer, so a
    render whose backward work passes `budget` is cut into bands of tile rows by the same greedy rule as
    plan_from_lengths. The number of dispatches follows the work, not the gaussian count or the capacity."""
    work = [tile_pixels * int(e) for e in row_entries]
    total = sum(work)
    if total * runtime.BWD_WORK_FACTOR <= budget:
        return PassPlan(WHOLE_TILE, (Dispatch(0, None, (0, tile_height), total),))
    dispatches = []
    for c in range(C):
        start, band_work = 0, 0
        for r in range(tile_height):
            w = work[c * tile_height + r]
            if r > start and (band_work + w) * runtime.BWD_WORK_FACTOR > budget:
                dispatches.append(Dispatch(0, c, (start, r), band_work))
                start, band_work = r, 0
            band_work += w
        dispatches.append(Dispatch(0, c, (start, tile_height), band_work))
    return PassPlan(WHOLE_TILE, tuple(dispatches))


def row_chunk(tile_pixels: int, tile_width: int, budget: int) -> int:
    """The largest chunk at which one pass over one full tile row (tile_width tiles, each compositing `chunk`
    gaussians over tile_pixels pixels) fits `budget` backward: above RASTER_CHUNK up to 7,600 pixels wide at
    tile 16 (476 tiles), below beyond. plan_from_lengths cuts no band below one row, so with a chunk no larger
    every dispatch fits."""
    return max(1, budget // (runtime.BWD_WORK_FACTOR * tile_pixels * max(1, int(tile_width))))


def plan_passes(isect_offsets: Tensor, n_isects: int, tile_size: int, chunk: Optional[int] = None,
                n_gaussians: Optional[int] = None, grid: Optional[Tuple[int, int, int]] = None) -> PassPlan:  # fmt: skip
    """The dispatches of a render. A tile lists a gaussian at most once, so its list is at most
    min(M, N) long: one dispatch of at most tile_pixels x M evaluations, and no host sync, when that
    bound is <= chunk and the dispatch's backward fits runtime.COMMAND_BUFFER_BUDGET; otherwise one
    host read of the tile list lengths ([C, tile_height, tile_width] int32) and plan_from_lengths.
    Padded lists (isect_offsets [C * tile_height * tile_width + 1] with the end slot, `n_isects` their
    capacity, `grid` = (C, tile_height, tile_width)) are never read: plan_from_rows, from the estimate of
    intersections per tile row isect.py attaches to them (``isect_offsets.row_entries``; without one, the
    capacity spread evenly over the rows).

    Exact lists: the chunk is at most row_chunk (one pass over one tile row then fits the budget at any
    list lengths), so that no dispatch passes the budget at any load."""
    chunk = int(chunk or RASTER_CHUNK)
    tile_pixels = int(tile_size) ** 2
    longest_bound = min(n_isects, n_isects if n_gaussians is None else n_gaussians)
    if isect_offsets.dim() == 1:
        if grid is None:
            raise ValueError("[plan_passes] padded lists (1-D isect_offsets with the end slot) need grid=(C, th, tw)")
        C, tile_height, _ = grid
        rows = getattr(isect_offsets, "row_entries", None)
        if rows is None or len(rows) != C * tile_height:
            rows = [-(-n_isects // (C * tile_height))] * (C * tile_height)
        return plan_from_rows(rows, C, tile_height, tile_pixels, runtime.COMMAND_BUFFER_BUDGET)
    chunk = min(chunk, row_chunk(tile_pixels, isect_offsets.shape[2], runtime.COMMAND_BUFFER_BUDGET))
    if longest_bound <= chunk and tile_pixels * n_isects * runtime.BWD_WORK_FACTOR <= runtime.COMMAND_BUFFER_BUDGET:
        return PassPlan(chunk, (Dispatch(0, None, (0, isect_offsets.shape[1]), tile_pixels * n_isects),))
    starts = isect_offsets.reshape(-1).long()
    ends = torch.cat([starts[1:], starts.new_full((1,), n_isects)])
    lengths = runtime.host_read(ends - starts).view(isect_offsets.shape)
    return plan_from_lengths(lengths, tile_pixels, chunk, runtime.COMMAND_BUFFER_BUDGET)


def check_offsets(op: str, isect_offsets: Tensor, C: int, tile_height: int, tile_width: int) -> bool:
    """isect_offsets is [C, tile_height, tile_width] int32 (exact lists: the last tile ends at M, the
    length of flatten_ids) or [C * tile_height * tile_width + 1] int32 (padded lists, isect.py: the end
    slot holds where the last tile ends, known only to the device). Returns True for padded lists."""
    n = C * tile_height * tile_width
    if isect_offsets.dtype == torch.int32 and tuple(isect_offsets.shape) in ((C, tile_height, tile_width), (n + 1,)):
        return isect_offsets.dim() == 1
    raise ValueError(
        f"[{op}] isect_offsets must be [C, tile_height, tile_width] = {[C, tile_height, tile_width]} int32 "
        f"(or [{n + 1}] with the end slot), got {list(isect_offsets.shape)} {isect_offsets.dtype}"
    )


class Band(NamedTuple):
    """What the kernels see of one dispatch: its first tile row `row0` (a flat row of [C * tile_height],
    a kernel argument: every buffer is bound whole, nothing is copied or sliced per band) and the launch
    grid (all cameras in z when the dispatch covers them all)."""

    row0: int
    grid: dict


def flat_offsets(isect_offsets: Tensor) -> Tensor:  # [C, th, tw] or flat [C*th*tw (+1)] -> flat
    """The tile offsets as the kernels bind them; a flat contiguous tensor as it is (a view would be one more
    dispatch a step: the training render passes the padded lists' flat offsets)."""
    if isect_offsets.dim() == 1 and isect_offsets.is_contiguous():
        return isect_offsets
    return isect_offsets.contiguous().view(-1)


def band(d: Dispatch, C: int, tile_size: int, tile_width: int, tile_height: int, rows: Optional[int] = None) -> Band:
    """The Band of dispatch `d`. Gaussian, intersection and pixel indices stay global."""
    group = (tile_size, rows or tile_size, 1)  # rows of a tile per group (kernels.tile_library)
    if d.camera is None:
        return Band(0, {"threads": (tile_width * tile_size, tile_height * tile_size, C), "group_size": group})
    r0, r1 = d.rows
    grid = (tile_width * tile_size, (r1 - r0) * tile_size, 1)
    return Band(d.camera * tile_height + r0, {"threads": grid, "group_size": group})


def rasterize_to_pixels_fwd(
    means2d: Tensor,  # [C, N, 2]
    conics: Tensor,  # [C, N, 3]
    colors: Tensor,  # [C, N, D]
    opacities: Tensor,  # [C, N]
    width: int,
    height: int,
    tile_size: int,
    isect_offsets: Tensor,  # [C, tile_height, tile_width] int32, or [C * th * tw + 1] (padded lists)
    flatten_ids: Tensor,  # [M] int32
    backgrounds: Optional[Tensor] = None,  # [C, D]
    chunk: Optional[int] = None,
    plan: Optional[PassPlan] = None,
    trans_in: Optional[Tensor] = None,  # [C, H, W]: resume a depth chunk from this transmittance ...
    stopped_in: Optional[Tensor] = None,  # [C, H, W] bool ... and stop state
    stopped_out: Optional[Tensor] = None,  # [C, H, W] int32, written when resuming: the stop state after
    composite_bg: Optional[Tensor] = None,  # [3] float32: also write splatfacto's composite into rgb_out ...
    rgb_out: Optional[Tensor] = None,  # ... [C, H, W, 3] (or [H, W, 3] for one camera) float32 contiguous
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Runs rasterize_fwd. Returns render_colors [C,H,W,D], render_alphas [C,H,W,1] and, for the
    backward pass, transmittance [C,H,W] (final T) and last_ids [C,H,W] int32 (index into
    flatten_ids of the last contributing gaussian, -1 if none).
    With ``composite_bg`` (D >= 3, not when resuming), the fused composite: rgb_out = clamp(render_colors[..., :3]
    + (1 - render_alphas) * composite_bg, 0, 1), the bits of train.metal's composite_fwd.

    Host sync: none when the caller passes ``plan`` (plan_passes, which the backward pass reuses) or
    when plan_passes needs none (see there); otherwise one, to read the tile list lengths. Passes are
    reserved with runtime.reserve_work: a commit between passes when a command buffer would pass
    the budget."""
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
    padded = check_offsets(op, isect_offsets, C, tile_height, tile_width)
    if flatten_ids.dim() != 1 or flatten_ids.dtype != torch.int32:
        raise ValueError(f"[{op}] flatten_ids must be [M] int32, got {list(flatten_ids.shape)} {flatten_ids.dtype}")
    if backgrounds is not None:
        if tuple(backgrounds.shape) != (C, D) or backgrounds.dtype != torch.float32:
            raise ValueError(f"[{op}] backgrounds must be [C,D] = {[C, D]} float32, got "
                             f"{list(backgrounds.shape)} {backgrounds.dtype}")  # fmt: skip
    if composite_bg is not None:
        if D < 3 or trans_in is not None or rgb_out is None or rgb_out.numel() != C * height * width * 3:
            raise ValueError(f"[{op}] the fused composite needs D >= 3 (got {D}), no resume and rgb_out of "
                             f"{C * height * width * 3} elements")  # fmt: skip
        if tuple(composite_bg.shape) != (3,) or composite_bg.dtype != torch.float32 or not composite_bg.is_contiguous():
            raise ValueError(f"[{op}] composite_bg must be a contiguous [3] float32 tensor, got "
                             f"{list(composite_bg.shape)} {composite_bg.dtype}")  # fmt: skip
    M = flatten_ids.numel()

    render_colors = torch.empty((C, height, width, D), dtype=torch.float32, device=device)
    render_alphas = torch.empty((C, height, width, 1), dtype=torch.float32, device=device)
    transmittance = torch.empty((C, height, width), dtype=torch.float32, device=device)
    last_ids = torch.empty((C, height, width), dtype=torch.int32, device=device)
    if C * height * width == 0:
        return render_colors, render_alphas, transmittance, last_ids

    if plan is None:
        plan = plan_passes(isect_offsets, M, tile_size, chunk, N, (C, tile_height, tile_width))
    n_passes = plan.n_passes
    resume = trans_in is not None
    if resume:
        if stopped_in is None or stopped_out is None or tuple(trans_in.shape) != (C, height, width):
            raise ValueError(f"[{op}] resuming needs trans_in, stopped_in and stopped_out of {[C, height, width]}")
        pixel_done = stopped_out
        resume_bufs = (trans_in.float().contiguous(), stopped_in.to(torch.int32).contiguous())
    if M == 0:  # kernels bind every buffer; give flatten_ids one (never read) element
        flatten_ids = torch.zeros((1,), dtype=torch.int32, device=device)
    # Buffers the kernel neither reads nor writes here are bound to tensors at hand of its dtype and of
    # any shape: no placeholder allocation (each one an aten op). With
    # one pass and no resume, pixel_done is never touched; trans_in / stopped_in only when resuming; the
    # background table only with backgrounds.
    if not resume:
        pixel_done = (torch.empty((C, height, width), dtype=torch.int32, device=device) if n_passes > 1
                      else flatten_ids)  # fmt: skip
        resume_bufs = (opacities, flatten_ids)
    bg = backgrounds.contiguous() if backgrounds is not None else opacities

    lib, rows = tile_library(
        device, "rasterize.metal", "rasterize_fwd", tile_size, lambda _rows: variants.raster_defines(D)
    )  # rows: of a tile per group (kernels.py)
    inputs = (means2d.contiguous(), conics.contiguous(), colors.contiguous(), opacities.contiguous(), bg)
    offsets, flatten_ids = flat_offsets(isect_offsets), flatten_ids.contiguous()
    per_pixel = (render_colors, render_alphas, transmittance, last_ids, pixel_done)
    composite = (composite_bg, rgb_out) if composite_bg is not None else (opacities, opacities)
    has_composite = int(composite_bg is not None)
    total_tiles = C * tile_width * tile_height + int(padded)  # padded: the last tile ends at the end slot
    for d in plan.dispatches:
        b = band(d, C, tile_size, tile_width, tile_height, rows)
        runtime.reserve_work(device, d.work)
        args = params.pack(params.RASTER_FWD, width=int(width), height=int(height), tile_width=tile_width,
                           tile_height=tile_height, total_tiles=total_tiles, n_isects=M,
                           has_background=int(backgrounds is not None), pass_index=d.pass_index, chunk=plan.chunk,
                           has_resume=int(resume), row0=b.row0, has_composite=has_composite)  # fmt: skip
        lib.rasterize_fwd(*inputs, offsets, flatten_ids, *per_pixel, args, *resume_bufs, *composite, **b.grid)
    return render_colors, render_alphas, transmittance, last_ids
