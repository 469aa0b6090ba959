"""Dispatch of rasterize.metal: per-tile front-to-back compositing."""

from __future__ import annotations

import functools
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
# The chunk of a plan whose single pass composites every tile's whole list (padded lists that fit one dispatch:
# plan_padded; its plans of windows give each dispatch its own chunk).
WHOLE_TILE = 2**31 - 1


class Dispatch(NamedTuple):
    """One kernel dispatch of a pass: every camera and tile at once (camera None), or one camera's
    band of tile rows [rows[0], rows[1])."""

    pass_index: int
    camera: Optional[int]
    rows: Tuple[int, int]
    work: int  # forward gaussian-pixel evaluations, at most (tile pixels x gaussians composited)
    chunk: int = 0  # entries of a tile's list it composites, [pass_index chunk, (pass_index + 1) chunk); 0: the plan's


class PassPlan(NamedTuple):
    """How a render is cut into kernel dispatches; forward and backward share it."""

    chunk: int  # gaussians of a tile per pass
    dispatches: Tuple[Dispatch, ...]  # in pass order

    def chunk_of(self, d: Dispatch) -> int:
        return d.chunk or self.chunk

    @property
    def n_passes(self) -> int:  # windows [pass_index chunk, (pass_index + 1) chunk) of the lists
        return len({(d.pass_index, self.chunk_of(d)) for d in self.dispatches})


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


def _window(p: int, chunk: int, capacity: int, grid: Tuple[int, int, int], tile_pixels: int,
            per_dispatch: int) -> list:  # fmt: skip
    """The dispatches of window (p, chunk) of padded lists: entries [p chunk, (p + 1) chunk) of every tile's list
    (from the back in the backward pass). Each dispatch's work is a bound that holds at ANY list lengths: a band
    of tiles composites at most chunk entries a tile, and at most capacity / (p + 1) in all (a tile composites
    min(chunk, len - p chunk) <= len / (p + 1) of its window, and the lists hold at most `capacity` entries):
    one dispatch over everything when that fits, else bands of rows that do."""
    C, tile_height, tile_width = grid
    most = capacity // (p + 1)  # entries, at most, in this window over every tile
    if min(C * tile_height * tile_width * chunk, most) <= per_dispatch:
        return [Dispatch(p, None, (0, tile_height), tile_pixels * min(C * tile_height * tile_width * chunk, most), chunk)]  # fmt: skip
    rows = max(1, per_dispatch // (tile_width * chunk))  # the caller keeps tile_width x chunk <= per_dispatch
    return [Dispatch(p, c, (r, min(r + rows, tile_height)),
                     tile_pixels * min((min(r + rows, tile_height) - r) * tile_width * chunk, most), chunk)
            for c in range(C) for r in range(0, tile_height, rows)]  # fmt: skip


def _windows(first: int, repeat: int, longest: int) -> list:
    """(pass_index, chunk) of windows that cover [0, longest) of a list, front to back: 2 x `repeat` windows of
    `first` entries, then `repeat` windows of twice that, and so on (window p of a chunk starts where the
    last one ended: p chunk). Past the first `repeat`, window p holds at most 1 / (p + 1) of the entries."""
    out, chunk, p = [], first, 0
    while p * chunk < longest:
        out.append((p, chunk))
        p += 1
        if p == 2 * repeat:
            chunk, p = 2 * chunk, repeat
    return out


@functools.lru_cache(maxsize=64)
def plan_padded(capacity: int, n_gaussians: int, grid: Tuple[int, int, int], tile_pixels: int,
                budget: int) -> PassPlan:  # fmt: skip
    """The dispatches for padded lists (isect.py), whose lengths only the device knows, such that no dispatch
    passes `budget` backward at ANY list lengths the lists can hold: at most `capacity` entries in all
    (isect.py: the bins take none past it), at most min(n_gaussians, capacity) in one tile (a tile lists a
    gaussian once). Lists that fit one dispatch whole (capacity x tile_pixels x BWD_WORK_FACTOR <= budget): one
    pass of whole tiles, as before. Otherwise windows of the lists (_windows), each a pass of the kernels'
    multi-pass compositing (pass p composites [p chunk, (p + 1) chunk) of each tile, pixel state saved between
    passes), each cut by _window into dispatches whose bound fits: windows deep in the lists are one dispatch
    over everything (few tiles can hold that many entries), and a window past a tile's list returns at once
    for it. The plan depends on (capacity, gaussians, grid) only, never on the device: no host sync; of the
    candidate window sizes, the one with the fewest dispatches."""
    C, tile_height, tile_width = grid
    per_dispatch = budget // (runtime.BWD_WORK_FACTOR * tile_pixels)  # entries one dispatch may composite
    if capacity <= per_dispatch:
        return PassPlan(WHOLE_TILE, (Dispatch(0, None, (0, tile_height), tile_pixels * capacity),))
    longest = max(1, min(n_gaussians, capacity))
    repeat = max(1, -(-capacity // per_dispatch) - 1)  # windows p >= repeat hold <= capacity / (p + 1) <= per_dispatch

    def dispatches(first: int) -> int:  # of the plan whose first windows are `first` entries long
        whole = C * tile_height * tile_width * first <= per_dispatch
        bands = C * -(-tile_height // max(1, per_dispatch // (tile_width * first)))
        return sum(1 if p >= repeat or whole else bands for p, _ in _windows(first, repeat, longest))

    # the first windows' chunk: a power of two at which one tile row fits a dispatch (a band is one row at least)
    firsts = [2**k for k in range(max(1, per_dispatch // tile_width).bit_length())]
    first = min(firsts, key=dispatches)
    return PassPlan(WHOLE_TILE, tuple(d for p, chunk in _windows(first, repeat, longest)
                                      for d in _window(p, chunk, capacity, grid, tile_pixels, per_dispatch)))  # fmt: skip


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
    capacity, `grid` = (C, tile_height, tile_width)) are never read: plan_padded, from the capacity and N.

    No dispatch passes the budget at any load: exact lists at a chunk of at most row_chunk (one pass over
    one tile row then fits at any list lengths), padded lists by plan_padded's bounds."""
    chunk = int(chunk or RASTER_CHUNK)
    tile_pixels = int(tile_size) ** 2
    longest_bound = min(n_isects, n_isects if n_gaussians is None else n_gaussians)
    if isect_offsets.dim() == 1:
        if grid is None:
            raise ValueError("[plan_passes] padded lists (1-D isect_offsets with the end slot) need grid=(C, th, tw)")
        return plan_padded(int(n_isects), int(longest_bound), tuple(int(g) for g in grid), tile_pixels,
                           runtime.COMMAND_BUFFER_BUDGET)  # fmt: skip
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
                           has_background=int(backgrounds is not None), pass_index=d.pass_index, chunk=plan.chunk_of(d),
                           has_resume=int(resume), row0=b.row0, has_composite=has_composite)  # fmt: skip
        lib.rasterize_fwd(*inputs, offsets, flatten_ids, *per_pixel, args, *resume_bufs, *composite, **b.grid)
    return render_colors, render_alphas, transmittance, last_ids
