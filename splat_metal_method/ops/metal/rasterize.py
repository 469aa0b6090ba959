"""Dispatch of rasterize.metal: per-tile front-to-back compositing."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import runtime
from .kernels import tile_library

# Gaussians of one tile composited per pass, at most. Pass p composites entries [p chunk, (p+1) chunk)
# of every tile's list; a pass costs at most TILE_PIXELS x chunk gaussian-pixel evaluations per tile.
# Consecutive dispatches still land in one command buffer, so the bound that matters is per command
# buffer (runtime.py, "Command buffers and the GPU watchdog"): plan_passes counts each pass's work,
# cuts a pass whose backward would pass runtime.COMMAND_BUFFER_BUDGET into bands of tile rows (one
# dispatch each), and the dispatch loops reserve each dispatch's work with runtime.reserve_work,
# which commits between dispatches when the current command buffer would pass the budget.
RASTER_CHUNK = 8192
MAX_CHANNELS = 64  # per-pixel accumulators live in registers; one library per channel count


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


def plan_from_bound(n_isects: int, longest: int, C: int, tile_height: int, tile_width: int, tile_pixels: int,
                    chunk: int, budget: int) -> PassPlan:  # fmt: skip
    """The dispatches for lists whose lengths only the device knows: at most `n_isects` entries in all
    and at most `longest` in one tile. ceil(longest / chunk) passes over every tile (a tile whose list
    ended in an earlier pass returns at once). Pass p composites at most min(n_isects, tiles x chunk)
    entries; where that bound's backward does not fit `budget`, each camera's tile rows go in bands of
    r rows, each bounded by min(n_isects, r x tile_width x chunk) entries (a single row goes alone)."""
    dispatches = []
    for p in range(max(1, math.ceil(longest / chunk))):
        entries = min(n_isects, C * tile_height * tile_width * chunk)
        if tile_pixels * entries * runtime.BWD_WORK_FACTOR <= budget:
            dispatches.append(Dispatch(p, None, (0, tile_height), tile_pixels * entries))
            continue
        row_entries = tile_width * chunk
        rows = max(1, budget // (runtime.BWD_WORK_FACTOR * tile_pixels * row_entries))
        for c in range(C):
            for r0 in range(0, tile_height, rows):
                r1 = min(tile_height, r0 + rows)
                dispatches.append(Dispatch(p, c, (r0, r1), tile_pixels * min(n_isects, (r1 - r0) * row_entries)))
    return PassPlan(chunk, tuple(dispatches))


def plan_passes(isect_offsets: Tensor, n_isects: int, tile_size: int, chunk: Optional[int] = None,
                n_gaussians: Optional[int] = None, grid: Optional[Tuple[int, int, int]] = None) -> PassPlan:  # fmt: skip
    """The dispatches of a render. A tile lists a gaussian at most once, so its list is at most
    min(M, N) long: one dispatch of at most tile_pixels x M evaluations, and no host sync, when that
    bound is <= chunk and the dispatch's backward fits runtime.COMMAND_BUFFER_BUDGET; otherwise one
    host read of the tile list lengths ([C, tile_height, tile_width] int32) and plan_from_lengths.
    Padded lists (isect_offsets [C * tile_height * tile_width + 1] with the end slot, `n_isects` their
    capacity, `grid` = (C, tile_height, tile_width)) are never read: plan_from_bound."""
    chunk = int(chunk or RASTER_CHUNK)
    tile_pixels = int(tile_size) ** 2
    longest_bound = min(n_isects, n_isects if n_gaussians is None else n_gaussians)
    if isect_offsets.dim() == 1:
        if grid is None:
            raise ValueError("[plan_passes] padded lists (1-D isect_offsets with the end slot) need grid=(C, th, tw)")
        C, tile_height, tile_width = grid
        return plan_from_bound(n_isects, longest_bound, C, tile_height, tile_width, tile_pixels, chunk,
                               runtime.COMMAND_BUFFER_BUDGET)  # fmt: skip
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
    """What the kernels see of one dispatch: an image of `height` pixel rows and `tile_rows` tile rows
    starting at pixel row `y0` of camera `camera` (all cameras when None), its first tile at flat index
    `first_tile` of [C, tile_height, tile_width], and the launch grid."""

    camera: Optional[int]
    y0: int
    height: int
    tile_rows: int
    first_tile: int
    grid: dict

    def rows(self, t: Tensor) -> Tensor:
        """The band's part of a per-pixel [C, H, ...] tensor, a contiguous view (Metal binds a tensor at
        its storage offset); anything else (a [1] placeholder, a [C, D] table) unchanged."""
        if self.camera is None or t.dim() < 3:
            return t
        return t[self.camera, self.y0 : self.y0 + self.height]

    def means(self, means2d: Tensor) -> Tensor:
        """means2d [C, N, 2] in the band's pixel rows (y - y0): the kernels place a pixel by its row in
        the band. Bit-exact: y0 is an integer, so my - y0 is exact, and (my - y0) - (row + 0.5) rounds
        the same real number as my - (y0 + row + 0.5)."""
        if self.y0 == 0:
            return means2d
        shifted = means2d.clone()
        shifted[..., 1] -= float(self.y0)
        return shifted

    def table(self, t: Tensor) -> Tensor:
        """A per-camera [C, ...] table (backgrounds) from the band's camera on."""
        return t if self.camera is None or t.dim() < 2 else t[self.camera :]


def band(
    d: Dispatch, C: int, height: int, tile_size: int, tile_width: int, tile_height: int, rows: Optional[int] = None
) -> Band:
    """The Band of dispatch `d`. Gaussian and intersection indices stay global."""
    group = (tile_size, rows or tile_size, 1)  # rows of a tile per group (kernels.tile_library)
    if d.camera is None:
        grid = (tile_width * tile_size, tile_height * tile_size, C)
        return Band(None, 0, height, tile_height, 0, {"threads": grid, "group_size": group})
    r0, r1 = d.rows
    y0 = r0 * tile_size
    grid = (tile_width * tile_size, (r1 - r0) * tile_size, 1)
    return Band(d.camera, y0, min(height, r1 * tile_size) - y0, r1 - r0, (d.camera * tile_height + r0) * tile_width,
                {"threads": grid, "group_size": group})  # fmt: skip


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
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Runs rasterize_fwd. Returns render_colors [C,H,W,D], render_alphas [C,H,W,1] and, for the
    backward pass, transmittance [C,H,W] (final T) and last_ids [C,H,W] int32 (index into
    flatten_ids of the last contributing gaussian, -1 if none).

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
    # at most 2 dims (band.rows leaves them whole): no placeholder allocation (each one an aten op). With
    # one pass and no resume, pixel_done is never touched; trans_in / stopped_in only when resuming; the
    # background table only with backgrounds.
    if not resume:
        pixel_done = (torch.empty((C, height, width), dtype=torch.int32, device=device) if n_passes > 1
                      else flatten_ids)  # fmt: skip
        resume_bufs = (opacities, flatten_ids)
    bg = backgrounds.contiguous() if backgrounds is not None else opacities

    lib, rows = tile_library(
        device, "rasterize.metal", "rasterize_fwd", tile_size, lambda _rows: (("SPLAT_CHANNELS", D),)
    )  # rows: of a tile per group (kernels.py)
    means2d, others = means2d.contiguous(), (conics.contiguous(), colors.contiguous(), opacities.contiguous())
    offsets, flatten_ids = isect_offsets.contiguous().view(-1), flatten_ids.contiguous()
    per_pixel = (render_colors, render_alphas, transmittance, last_ids, pixel_done)
    total_tiles = C * tile_width * tile_height + int(padded)  # padded: the last tile ends at the end slot
    for d in plan.dispatches:
        b = band(d, C, height, tile_size, tile_width, tile_height, rows)
        runtime.reserve_work(device, d.work)
        lib.rasterize_fwd(
            b.means(means2d), *others, b.table(bg), offsets[b.first_tile:], flatten_ids, *map(b.rows, per_pixel),
            int(width), b.height, tile_width, b.tile_rows, total_tiles - b.first_tile, M, int(backgrounds is not None),
            d.pass_index, plan.chunk, *map(b.rows, resume_bufs), int(resume), **b.grid,
        )  # fmt: skip
    return render_colors, render_alphas, transmittance, last_ids
