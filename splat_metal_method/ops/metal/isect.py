"""Dispatch of isect.metal: tile intersections, sorted, and per-tile offsets (see isect.metal)."""

from __future__ import annotations

import math
import warnings
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..workspace import workspace
from . import runtime
from .kernels import BIN_CAPACITY, BIN_COUNT_ITEMS, BIN_THREADS, BIN_WINDOW, GROUP_1D, grid_1d, library
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
                    int(tile_height), counts, 0, 1, **grid_1d(total))  # fmt: skip
    cum = prefix_sum(counts, inclusive=True, out=ws.get("isect.cum", total, torch.int64, device))  # [C*N]
    M = int(runtime.host_read(cum[-1]))  # the only host sync: sizes the intersection buffers
    if M == 0:
        return tiles_per_gauss, *_no_intersections(device)
    if M >= 2**31:
        raise ValueError(f"[{op}] {M} intersections exceed the 32-bit offsets")

    tile_keys = ws.get("isect.tile_keys", M, torch.int32, device)
    flat_ids = ws.get("isect.flat_ids", M, torch.int32, device)
    lib.isect_emit(means2d, radii, tiles_per_gauss, order, cum, tile_keys, flat_ids,
                   total, N, int(tile_size), int(tile_width), int(tile_height), tile_bits, M,
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
        isect_ids.contiguous(), offsets, M, n_tiles, C * n_tiles, _tile_bits(tile_width, tile_height), 0,
        **grid_1d(M),
    )  # fmt: skip
    return offsets


# ------------------------------------------------------------------------------------------------
# Padded lists: training steps without a host read.
#
# isect_tiles_fwd reads M (the intersection count) to size its buffers: a host sync, which on a Mac
# drains the GPU's queue every step. Training steps instead use buffers of a capacity kept on the
# host from earlier steps: the kernels run over the capacity, the true count stays on the device
# (the end slot of the offsets, which the rasterizer reads as the end of the last tile), and a copy of
# it comes back to the host without waiting, read a step later (as the NaN guard's flag is).
# - Sizing: the most intersections per (camera, gaussian) seen for this tile grid, times this call's
#   C*N (the host knows N: densification cannot outrun the capacity unseen), with HEADROOM; grown by at
#   least GROWTH when it has to grow, never shrunk. The first call for a tile grid reads M once.
# - No global sort (isect.metal, "Padded lists"): neither the depth sort of the C*N gaussians nor the radix
#   sort by tile. The gaussians are counted in flat order; their entries are counted per tile (bin_count's
#   threadgroup tile histograms: one threadgroup atomic an entry, one device atomic per group and tile it touched;
#   each entry keeps its rank in its tile) and placed in their tile's bin at that rank, each
#   storing its gaussian's flat id, then each bin is sorted by the 64-bit key (depth bits << 32 | flat id),
#   the depths gathered by the sort (bitonic in threadgroup memory; past BIN_CAPACITY entries in blocks, then
#   merged): the same lists as isect_tiles_fwd's entry for entry
#   (its stable depth sort orders by the same depth bits, then by flat id), whatever order the atomics took.
#   The merge steps get a dispatch each, planned from the longest bin the device reported a step earlier
#   (read without waiting, with the count); the last dispatch runs whatever steps are left, so a tile longer
#   than planned is still sorted whole.
# - Overflow (more intersections than the capacity): the bins take none past it (the first `capacity`
#   entries of the flat-order emission: camera-major, gaussian-major, tile y-major, x-minor), so the
#   intersections of the highest flat ids (the last camera's last gaussians; the one gaussian straddling
#   the capacity keeps its first tiles) are left out of that step's render, and their gradients from it
#   are zero; every other gradient is that of the image that was rendered. It is found a step later, said
#   once in the log and counted (IntersectionCapacities.overflows), and the capacity grows.
# The capacities belong to the caller (IntersectionCapacities: a model keeps its own).
HEADROOM = 1.15
GROWTH = 1.25
GRANULE = 1024  # capacities are multiples of this (fewer reallocations of the workspace)
MAX_PADDED_KEY_BITS = 31  # the padding's key (all ones) << 32 must stay a positive int64 isect_id


class _Capacity:
    """Capacity of one tile grid's padded lists and what the device has said about its need."""

    def __init__(self, owner: "IntersectionCapacities", entries: int, per_item: float):
        self.owner = owner
        self.entries = entries  # length of the buffers
        self.per_item = per_item  # most intersections per (camera, gaussian) seen
        # (C*N, capacity, [count, longest bin], event or None), oldest first; a host tensor or a Python list
        self.pending: list = []
        self.longest: Optional[int] = None  # entries of the longest tile (bin), latest seen
        self.longest_total = 0  # the C*N of the render it was counted in

    def observe(self, total: int, capacity: int, count: int) -> None:
        self.per_item = max(self.per_item, count / max(total, 1))
        self.owner.last_count = count
        if count > capacity:
            self.owner._note_overflow(count, capacity)

    def resolve(self) -> None:
        """Reads the counts the device has finished, without waiting for the others."""
        while self.pending:
            total, capacity, host, event = self.pending[0]
            if event is not None and not event.query():
                break
            self.pending.pop(0)
            count, longest = host if isinstance(host, list) else host.tolist()  # a host tensor: no device read
            self.observe(total, capacity, count)
            self.longest, self.longest_total = longest, total

    def merge_estimate(self, total: int) -> int:
        """Merge steps bin_sort is expected to need at this call's C*N: from the longest bin the device
        reported (with HEADROOM, scaled by the gaussians since); 0 before any (the one dispatch then runs
        them all)."""
        if self.longest is None:
            return 0
        return merge_steps(math.ceil(self.longest * HEADROOM * total / max(self.longest_total, 1)))

    def size_for(self, total: int) -> int:
        need = math.ceil(self.per_item * total * HEADROOM)
        if need > self.entries:
            self.entries = _round_up(max(need, math.ceil(self.entries * GROWTH)))
        return self.entries


def _round_up(n: int) -> int:
    return max(GRANULE, -(-int(n) // GRANULE) * GRANULE)


class IntersectionCapacities:
    """The capacities of one renderer's padded lists (one per tile grid), owned by its caller: a model
    passes its own to ``rasterization_metal(..., isect_capacity=...)`` in training steps, so that what one
    scene needs never sizes another's lists.

    ``overflows`` counts the steps found to have overflowed (a step late), ``last_count`` is the latest
    intersection count the host has heard of (a step or two old; None before the first), and
    ``pending_host_counts()`` the counts still on their way to the host (host tensors on a Mac)."""

    def __init__(self):
        self._grids: Dict[tuple, _Capacity] = {}
        self.overflows = 0
        self.last_count: Optional[int] = None
        self._said = False

    def _note_overflow(self, count: int, capacity: int) -> None:
        self.overflows += 1
        if not self._said:
            self._said = True
            warnings.warn(
                f"splat-metal: a training step had {count:,} tile intersections, more than the {capacity:,} its "
                "buffers held; those of the last gaussians (highest indices) were left out of that step's render and "
                "gradients. The capacity "
                "grows from now on (said once; IntersectionCapacities.overflows counts them).",
                stacklevel=3,
            )

    def pending_host_counts(self) -> list:
        return [host for state in self._grids.values() for _, _, host, _ in state.pending if isinstance(host, Tensor)]

    def entries(self, tile_width: int, tile_height: int, C: int, device="cpu", tile_size: int = 16) -> Optional[int]:
        """The capacity of one tile grid (None before its first render)."""
        state = self._grids.get(_grid_key(torch.device(device), C, tile_size, tile_width, tile_height))
        return None if state is None else state.entries

    def expect(self, tile_width: int, tile_height: int, C: int, n_gaussians: int, count: int,
               device="cpu", tile_size: int = 16, longest: Optional[int] = None) -> None:  # fmt: skip
        """Sets one tile grid's state to what renders of `count` intersections of C x `n_gaussians` would have
        taught it (`longest`: the entries of the longest tile), as if the device had said so (the benchmarks' count-only mode, benchmarks/step_model/scale_ledger.py)."""
        key = _grid_key(torch.device(device), C, tile_size, tile_width, tile_height)
        total = int(C) * int(n_gaussians)
        state = self._grids[key] = _Capacity(self, 0, count / max(total, 1))
        state.size_for(total)
        if longest is not None:
            state.longest, state.longest_total = int(longest), total
        self.last_count = int(count)

    def seed_like(self, other: "IntersectionCapacities") -> None:
        """This renderer's state becomes a copy of `other`'s (nothing pending): what its renders taught it."""
        self._grids = {}
        for key, state in other._grids.items():
            copy = self._grids[key] = _Capacity(self, state.entries, state.per_item)
            copy.longest, copy.longest_total = state.longest, state.longest_total
        self.last_count = other.last_count

    def force(self, tile_width: int, tile_height: int, C: int, entries: int, device="cpu", tile_size: int = 16):
        """Sets the capacity of one tile grid and forgets what was seen of it (tests: a small capacity makes
        the lists overflow)."""
        key = _grid_key(torch.device(device), C, tile_size, tile_width, tile_height)
        self._grids[key] = _Capacity(self, int(entries), 0.0)


def _grid_key(device: torch.device, C: int, tile_size: int, tile_width: int, tile_height: int) -> tuple:
    return (device.type, device.index, int(C), int(tile_size), int(tile_width), int(tile_height))


def padded_supported(C: int, tile_width: int, tile_height: int) -> bool:
    return _tile_bits(tile_width, tile_height) + max(C - 1, 0).bit_length() <= MAX_PADDED_KEY_BITS


@torch.no_grad()
def isect_tiles_padded_fwd(
    means2d: Tensor,  # [C, N, 2]
    radii: Tensor,  # [C, N] int32
    depths: Tensor,  # [C, N]
    tile_size: int,
    tile_width: int,
    tile_height: int,
    capacities: IntersectionCapacities,
    with_isect_ids: bool = True,
) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor]:
    """isect_tiles + isect_offset_encode without a host read (see above), sized by `capacities`. Returns tiles_per_gauss
    [C,N] int32, isect_ids [cap] int64 and flatten_ids [cap] int32 (the real entries first, in the
    order isect_tiles_fwd gives them; then padding), and isect_offsets [C*th*tw + 1] int32 whose last
    entry is the real entries' count (the end of the last tile). No host sync, but on the first call
    for a tile grid (one read of M sizes the capacity).
    ``with_isect_ids=False`` (training renders: the rasterizer reads flatten_ids and the offsets only): isect_ids
    is None, neither allocated nor written (bin_sort binds `ends` in its place and skips those writes);
    flatten_ids and the offsets are the same."""
    C, N = radii.shape
    device = means2d.device
    tile_bits = _tile_bits(tile_width, tile_height)
    bits = tile_bits + max(C - 1, 0).bit_length()
    if bits > MAX_PADDED_KEY_BITS:
        raise ValueError(f"[isect_tiles_padded] {C} cameras x {tile_width * tile_height} tiles need {bits}-bit keys")
    total = C * N
    n_tiles = int(tile_width) * int(tile_height)
    key = _grid_key(device, C, tile_size, tile_width, tile_height)
    tiles_per_gauss = torch.empty((C, N), dtype=torch.int32, device=device)
    means2d, radii, depths = means2d.contiguous(), radii.contiguous(), depths.contiguous()
    lib = library(device, "isect.metal")
    ws = workspace()
    if total == 0:
        offsets = torch.zeros((C * n_tiles + 1,), dtype=torch.int32, device=device)
        if with_isect_ids:
            return tiles_per_gauss, *_no_intersections(device), offsets
        return tiles_per_gauss, None, torch.empty((0,), dtype=torch.int32, device=device), offsets

    n_bins = C * n_tiles
    bins = ws.get("isect.bins", n_bins + 2, torch.int32, device)  # counters, then M and the longest bin
    # Tile counts in flat order (ordered = 0: no depth order; `order` and `counts` are not read or written, the
    # buffers bound there are radii and tiles_per_gauss themselves), and their prefix sum in flat order.
    flat_counts = tiles_per_gauss.view(-1)
    lib.isect_count(means2d, radii, radii, tiles_per_gauss, flat_counts, total, int(tile_size), int(tile_width),
                    int(tile_height), bins, n_bins + 2, 0, **grid_1d(total))  # fmt: skip
    cum = prefix_sum(flat_counts, inclusive=True, out=ws.get("isect.cum", total, torch.int64, device))  # [C*N]
    state = capacities._grids.get(key)
    if state is None:  # a tile grid not seen yet: one read of M sizes its capacity
        M = int(runtime.host_read(cum[-1]))
        state = capacities._grids[key] = _Capacity(capacities, 0, M / total)
    else:
        state.resolve()
    cap = state.size_for(total)

    # Per-tile bins (isect.metal): count, place, sort each tile by (depth bits, flat id).
    geometry = (int(tile_size), int(tile_width), int(tile_height), cap)
    # whole scratch buffers (the kernels index them below cap): no slice when an earlier, larger capacity grew them
    ranks = ws.at_least("isect.ranks", cap, torch.int32, device)
    ranks2 = ws.at_least("isect.ranks2", cap, torch.int32, device)
    # bin_count stores each entry's rank in its tile by its emission position, in ranks2 (bin_sort's merge buffer,
    # free until then), and bin_fill places the entries by those ranks. Threadgroup tile histograms: one device
    # atomic per (group of BIN_COUNT_ITEMS x GROUP_1D gaussians, tile it touches), not one per entry.
    slots = ranks2
    lib.bin_count(means2d, radii, tiles_per_gauss, cum, bins, slots, total, N, *geometry, BIN_COUNT_ITEMS,
                  **bin_count_grid(total, BIN_COUNT_ITEMS))  # fmt: skip
    ends = prefix_sum(bins, inclusive=True, out=ws.get("isect.bin_ends", n_bins + 2, torch.int64, device))
    lib.bin_fill(means2d, radii, tiles_per_gauss, cum, slots, ends, ranks, total, N, *geometry, **grid_1d(total))
    flatten_ids = torch.empty((cap,), dtype=torch.int32, device=device)
    offsets = torch.empty((n_bins + 1,), dtype=torch.int32, device=device)
    # Without isect_ids: no [cap] int64 buffer; ends (int64, bound anyway) is bound in its place, never written.
    isect_ids = torch.empty((cap,), dtype=torch.int64, device=device) if with_isect_ids else None
    grid = {"threads": (n_bins * BIN_THREADS,), "group_size": (BIN_THREADS,)}
    for lo, hi in bin_sort_steps(state.merge_estimate(total)):
        lib.bin_sort(ranks, ranks2, ends, depths, cum, bins, isect_ids if with_isect_ids else ends, flatten_ids,
                     offsets, n_bins, n_tiles, tile_bits, total, cap, (1 << bits) - 1, lo, hi, int(with_isect_ids),
                     **grid)  # fmt: skip
    # The count and the longest bin (bins[n_bins:]) on their way to the host without waiting: read at a later
    # call, once the event is done (the capacity and bin_sort's merge steps are planned from them).
    count = bins[n_bins:].to("cpu", non_blocking=True)  # [2]: M, the longest bin
    event = None
    if device.type == "mps":
        event = torch.mps.Event()
        event.record()
    elif device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
    else:  # CPU tensors: the "copies" are the buffers themselves, which later calls overwrite
        count = count.tolist()
    state.pending.append((total, cap, count, event))
    return tiles_per_gauss, isect_ids, flatten_ids, offsets


def bin_count_grid(total: int, per_thread: int = BIN_COUNT_ITEMS, group: int = GROUP_1D) -> dict:
    """Launch of bin_count (isect.metal): one group of `group` threads per run of group x per_thread gaussians
    (barriers and threadgroup memory: the group size is fixed, never fitted down)."""
    groups = max(-(-int(total) // (group * per_thread)), 1)
    return {"threads": (groups * group,), "group_size": (group,)}


@torch.no_grad()
def bin_count_atomics(means2d: Tensor, radii: Tensor, tile_size: int, tile_width: int, tile_height: int,
                      capacity: Optional[int] = None, per_thread: int = BIN_COUNT_ITEMS, group: int = GROUP_1D,
                      window: int = BIN_WINDOW) -> Tuple[int, int]:  # fmt: skip
    """The atomics bin_count (isect.metal) issues on these gaussians, computed on the host: (device, threadgroup).
    Each entry of the flat-order emission within `capacity` (each gaussian's rectangle, ops/reference.py
    tile_bounds: the kernels' rectangle math; no tail: the counts are the rectangles', as isect_count gives them)
    of a tile in its group's window is one threadgroup atomic; each distinct (group, tile in the window) one device
    atomic (the reservation); each entry of a tile past the window one device atomic. What the step ledger counts
    from the emulator's execution (tests/ops/metal/test_bin_histograms.py: equal), and what the scale ledger's
    count-only mode, where no kernel runs, records for bin_count (benchmarks/step_model/scale_ledger.py)."""
    from .. import reference

    C, N = radii.shape
    n_tiles = int(tile_width) * int(tile_height)
    lo, span = reference.tile_bounds(means2d, radii, tile_size, tile_width, tile_height)  # [C, N, 2]
    span = torch.where((radii > 0)[..., None], span, torch.zeros_like(span)).reshape(-1, 2)
    lo = lo.reshape(-1, 2)
    counts = span[:, 0] * span[:, 1]  # [C*N]
    M = int(counts.sum())
    kept = M if capacity is None else min(M, int(capacity))
    if kept == 0:
        return 0, 0
    g = torch.repeat_interleave(torch.arange(C * N, device=counts.device), counts)[:kept]  # each entry's gaussian
    k = torch.arange(kept, device=counts.device) - (torch.cumsum(counts, 0) - counts)[g]  # its place in the rectangle
    x = lo[g, 0] + k % span[g, 0]
    y = lo[g, 1] + torch.div(k, span[g, 0], rounding_mode="floor")
    t = torch.div(g, N, rounding_mode="floor") * n_tiles + y * int(tile_width) + x  # dense (camera, tile)
    run = group * per_thread
    grp = torch.div(g, run, rounding_mode="floor")
    w0 = torch.div(grp * run, N, rounding_mode="floor") * n_tiles  # the group's window starts at its first camera
    inside = t < w0 + window
    pairs = torch.unique(grp[inside] * (C * n_tiles) + t[inside]).numel()
    return int(pairs + (~inside).sum()), int(inside.sum())


def bin_sort_steps(merges: int) -> list:
    """The (step_lo, step_hi) of each bin_sort dispatch (isect.metal): the block sort, then one dispatch per
    merge step expected (`merges`, planned from the longest bin seen a step late); the last dispatch runs
    every step left (1 << 30: to the end of each tile), so a tile longer than planned is still sorted whole."""
    return [(s, s + 1) for s in range(merges)] + [(merges, 1 << 30)]


def merge_steps(longest: int) -> int:
    """Merge steps bin_sort needs for a bin of `longest` entries: runs of BIN_CAPACITY doubled until one holds it."""
    steps, width = 0, BIN_CAPACITY
    while width < longest:
        steps, width = steps + 1, width * 2
    return steps


# ------------------------------------------------------------------------------------------------
# What a bin_sort launch reads and writes (the ledgers' count of its bytes: benchmarks/step_model/ledger.py MOVED_BYTES).
#
# bin_sort binds every buffer whole at each launch, but a launch of steps [step_lo, step_hi) touches only the
# entries of the tiles those steps work on. Read off isect.metal bin_sort, by role (argument index, element bytes):
#   ranks (0, 4)        the bins (flat ids): step 0 reads every tile's bin and writes it back sorted by blocks (tiles
#                       past one block); merge step s reads it (s odd) or writes it (s even, not the tile's last)
#   ranks2 (1, 4)       the merge ping-pong: written at odd merge steps, read at even ones
#   ends (2, 8)         [n + 2] ends of the bins: each group reads its start and end, every launch ([0, n))
#   depths (3, 4)       [C*N] one gather per entry an active step reads (its key): counted as 4 bytes a gather;
#                       the binary searches' probes of the partner run (src and depths) are not counted (that run
#                       is read by the same step's own loop: cache hits)
#   cum (4, 8)          [C*N] its last entry (the count M), read by tile 0 at step 0
#   bins (5, 4)         [n + 2] bins[n] (M) and bins[n + 1] (the longest bin) written at step 0
#   isect_ids (6, 8)    [capacity] written with the final entries (with_ids only) and the padding, as flatten_ids
#   flatten_ids (7, 4)  [capacity] the final entries: a tile's at its last step (step 0 for a tile of one block, its
#                       last merge otherwise); the padding [end of the list, capacity) at step 0
#   offsets (8, 4)      [n + 1] every tile's start and the list's end, at step 0
# A tile of `len` entries runs steps 0 .. merge_steps(len); merge step s works on the tiles with merge_steps(len) >= s,
# i.e. len > BIN_CAPACITY << (s - 1). tests/ops/test_bin_sort_traffic.py holds this to the kernel: run under the
# emulator with sentinel-filled buffers, every entry a launch writes lies in the ranges written here.
BIN_SORT_ROLES = {"ranks": (0, 4), "ranks2": (1, 4), "ends": (2, 8), "depths": (3, 4), "cum": (4, 8),
                  "bins": (5, 4), "isect_ids": (6, 8), "flatten_ids": (7, 4), "offsets": (8, 4)}  # fmt: skip
PER_ENTRY_ROLES = ("ranks", "ranks2", "depths", "isect_ids", "flatten_ids")  # the rest: per tile (and cum's one entry)


def bin_sort_access(lengths, capacity: int, total: int, step_lo: int, step_hi: int, with_ids: bool) -> dict:
    """The entries one bin_sort launch of steps [step_lo, step_hi) reads and writes, from its bins' lengths
    (`lengths`: [C * n_tiles], in tile order): {"read": {role: [(a, b), ...]}, "write": {...}}, half-open
    ranges of each buffer's indices (depths: the ranges of the list whose entries' depths are gathered)."""
    read: Dict[str, list] = {r: [] for r in BIN_SORT_ROLES}
    write: Dict[str, list] = {r: [] for r in BIN_SORT_ROLES}
    n = len(lengths)
    finals = ("flatten_ids", "isect_ids") if with_ids else ("flatten_ids",)
    read["ends"].append((0, n))
    start = 0
    for length in lengths:
        length = int(length)
        rng = (start, start + length)
        merges = merge_steps(length)
        for s in range(step_lo, min(step_hi, merges + 1)):
            if length == 0:
                break
            src, dst = ("ranks", "ranks2") if s % 2 == 1 else ("ranks2", "ranks")
            read["ranks" if s == 0 else src].append(rng)
            read["depths"].append(rng)
            for role in finals if s == merges else ("ranks",) if s == 0 else (dst,):
                write[role].append(rng)
        start += length
    if step_lo <= 0 < step_hi and n > 0:
        write["offsets"].append((0, n + 1))
        write["bins"].append((n, n + 2))
        read["cum"].append((total - 1, total))
        if start < capacity:  # the padding
            for role in finals:
                write[role].append((start, capacity))
    return {"read": read, "write": write}


def access_bytes(access: dict) -> Dict[str, int]:
    """Bytes of bin_sort_access's ranges by role (reads and writes added up)."""
    return {role: sum(b - a for mode in access.values() for a, b in mode[role]) * BIN_SORT_ROLES[role][1]
            for role in BIN_SORT_ROLES}  # fmt: skip


def bin_lengths(ends: Tensor, n_bins: int) -> list:
    """The bins' lengths from bin_sort's `ends` (the inclusive prefix sum of their counts), a host list."""
    e = ends[:n_bins].tolist()
    return [e[0]] + [b - a for a, b in zip(e[:-1], e[1:])] if e else []


def bin_sort_moved_bytes(args, lengths=None) -> Tuple[Dict[str, int], list]:
    """Bytes one bin_sort launch (its arguments `args`, as isect_tiles_padded_fwd binds them) reads and writes,
    keyed by the shape of the buffer whose size they grow with ("x"-joined, as benchmarks/step_model/ledger.py ModelWork.buffer_shapes:
    the per-entry traffic, depth gathers included, under the capacity's shape, the per-tile under that of `ends`),
    and the bins' lengths it was counted from: `lengths` (count-only: a host model of the bins), else read from
    the bound `ends` (executed: the kernels ran, ends holds the real bins)."""
    ends, n_bins, total, capacity = args[2], int(args[9]), int(args[12]), int(args[13])
    step_lo, step_hi, with_ids = int(args[15]), int(args[16]), bool(int(args[17]))
    if lengths is None:
        lengths = bin_lengths(ends, n_bins)
    by_role = access_bytes(bin_sort_access(lengths, capacity, total, step_lo, step_hi, with_ids))
    entry_shape, tile_shape = str(capacity), "x".join(str(d) for d in ends.shape)
    out: Dict[str, int] = {}
    for role, b in by_role.items():
        key = entry_shape if role in PER_ENTRY_ROLES else tile_shape
        out[key] = out.get(key, 0) + b
    return out, list(lengths)
