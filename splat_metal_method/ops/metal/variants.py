"""The kernel variants and their launch geometry: which libraries the Metal backend compiles, with which
defines, and how many threads a group of each kernel has.

Both sides read it: kernels.py (which assembles and compiles the libraries) and the dispatch modules
(which launch them). It imports neither, so neither imports the other for a constant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, NamedTuple, Optional

from .. import constants

# Radix sort geometry (sort.metal): digits of RADIX_BITS per pass, RADIX_THREADS threads per group,
# each owning a contiguous run of RADIX_KEYS_PER_THREAD keys -> RADIX_BLOCK keys per group.
RADIX_BITS = 4
RADIX_THREADS = 256
RADIX_KEYS_PER_THREAD = 16
RADIX_BLOCK = RADIX_THREADS * RADIX_KEYS_PER_THREAD
RADIX_BINS = 1 << RADIX_BITS

# Prefix-sum geometry (scan.metal): SCAN_THREADS threads per group, each owning a contiguous run of
# SCAN_ITEMS values -> SCAN_BLOCK values per group.
SCAN_THREADS = 256
SCAN_ITEMS = 16
SCAN_BLOCK = SCAN_THREADS * SCAN_ITEMS

# Threads per group of the one-thread-per-item kernels (project, sh, isect, covar).
GROUP_1D = 256
ADAM_SLOTS = 6  # parameter tensors one fused Adam launch steps; adam_prepare's group (adam.metal SPLAT_ADAM_SLOTS)

# Per-tile bins of the padded lists (isect.metal bin_sort): a tile of up to BIN_CAPACITY entries is sorted
# whole in threadgroup memory (BIN_CAPACITY 64-bit keys x 8 B = 16 KiB of Apple's 32 KiB) by BIN_THREADS threads;
# a longer one is sorted in blocks of BIN_CAPACITY, then merged in device memory.
BIN_CAPACITY = 2048
BIN_THREADS = 256
# bin_count (isect.metal): a threadgroup of GROUP_1D threads counts the entries of GROUP_1D x BIN_COUNT_ITEMS
# consecutive gaussians per tile in threadgroup counters for a window of BIN_WINDOW tiles (every tile of a 1297x840
# image, 4,346 tiles of 16x16, fits), BIN_ROUND tiles at a time (15 KiB of ints of Apple's 32 KiB; two rounds over
# the group's entries), then reserves each touched tile's ranks with one device atomic. 4,096 gaussians a group: at
# ~5 tiles a gaussian ~20K entries, so most of the ~4K tiles are shared.
BIN_COUNT_ITEMS = 16
BIN_WINDOW = 7680
BIN_ROUND = 3840


# The fused L1 + SSIM loss (loss.metal).
LOSS_TILE = 16  # SPLAT_LOSS_TILE: pixels per side of a threadgroup's block (TILE^2 threads)
LOSS_WIN = 11  # SPLAT_LOSS_WIN: taps of the gaussian window (sigma 1.5, as pytorch_msssim / FusedSSIM)
LOSS_VARIANT = ("loss.metal", (("SPLAT_LOSS_TILE", LOSS_TILE), ("SPLAT_LOSS_WIN", LOSS_WIN)))

# project_bwd.metal: threads per group (injected as SPLAT_PROJECT_BWD_GROUP; fewer where the pipeline
# allows fewer); a group lies in one camera.
PROJECT_BWD_GROUP = 256

# Threadgroup memory the rasterizer backward's shared-memory batch may use (Metal allows 32 KiB per group).
BWD_BATCH_BYTES = 28 * 1024


def bwd_batch(tile_size: int, channels: int, rows: Optional[int] = None, merge: bool = False) -> int:
    """Gaussians per shared-memory batch of rasterize_bwd.metal: one per thread of a group (tile_size x
    rows pixels, the whole tile by default), fewer when D is large.

    A gaussian takes 4 (id) + 8 (mean) + 16 (conic, opacity) + 4 D (colour) bytes, and with the tile merge
    (SPLAT_BWD_MERGE) 4 (8 + D) more per simdgroup of 32 of the group; the batch is rounded down to whole
    simdgroups (32) when it has to shrink."""
    threads = tile_size * (rows or tile_size)
    per_gaussian = 4 + 8 + 16 + 4 * channels + (4 * (8 + channels) * -(-threads // 32) if merge else 0)
    batch = min(threads, BWD_BATCH_BYTES // per_gaussian)
    if batch < threads and batch >= 32:
        batch -= batch % 32
    return max(1, batch)


def group_threads(kernel: str, tile_size: int = constants.TILE_SIZE) -> int:
    """Threads per threadgroup the host dispatches `kernel` with: the N of its
    [[max_total_threads_per_threadgroup(N)]] (the same injected define)."""
    if kernel.startswith("l1_ssim_"):
        return LOSS_TILE * LOSS_TILE
    if kernel in ("rasterize_fwd", "rasterize_bwd"):
        return tile_size * tile_size
    if kernel.startswith("radix_"):
        return RADIX_THREADS
    if kernel.startswith("scan_"):
        return SCAN_THREADS
    if kernel == "bin_sort":
        return BIN_THREADS
    if kernel == "adam_prepare":
        return ADAM_SLOTS
    return PROJECT_BWD_GROUP if kernel == "project_bwd" else GROUP_1D


# ------------------------------------------------------------------------------------------------
# Every library the host can request (library_variants), and the define builders the dispatch code calls
# ------------------------------------------------------------------------------------------------
# A library is a stage file, a tile size (SPLAT_TILE_SIZE: the rasterizers' tile; the other stages are built at
# constants.TILE_SIZE) and variant defines; torch compiles each at the MSL version of its macOS (torch 2.8+: 3.0
# on macOS 13, 3.1 on 14, 3.2 on 15, 4.0 on 26). The version changes only what common.h's
# `#if __METAL_VERSION__ >= 320` block declares (the math-mode pragmas), not the source. The SH degree (0..4) is
# a kernel argument of sh.metal / sh_bwd.metal / project_bwd.metal, not a define: one library serves all five.
MSL_VERSIONS = (300, 310, 320, 400)
MSL_STD = {300: "metal3.0", 310: "metal3.1", 320: "metal3.2", 400: "metal4.0"}  # Apple's compiler's -std of each
MAX_TILE_SIZE = 32  # ops/contract.py's: one thread per pixel of a tile, at most 1024 a group
MAX_CHANNELS = 64  # per-pixel accumulators live in registers; one rasterizer library per channel count

# The stages built once, without variant defines, at constants.TILE_SIZE.
FIXED_STAGES = ("project.metal", "sh.metal", "isect.metal", "sort.metal", "scan.metal", "covar.metal",
                "train.metal", "adam.metal", "sh_bwd.metal")  # fmt: skip


class Variant(NamedTuple):
    """One library: kernels.stage_source(stage_file, tile_size, defines) is its source."""

    stage_file: str
    tile_size: int = constants.TILE_SIZE
    defines: tuple = ()  # (name, value) pairs


def strip_rows(tile_size: int) -> tuple:
    """Rows of a tile one rasterizer group may cover (kernels.tile_library picks the largest that this GPU's
    pipeline allows): the divisors of tile_size, largest first."""
    return tuple(r for r in range(tile_size, 0, -1) if tile_size % r == 0)


def strip_defines(tile_size: int, rows: int) -> tuple:
    """The define of a rasterizer library whose groups cover `rows` rows of a tile (none for the whole tile)."""
    return (("SPLAT_GROUP_ROWS", rows),) if rows != tile_size else ()


def raster_defines(channels: int) -> tuple:
    """The variant defines of rasterize.metal for `channels` channels."""
    return (("SPLAT_CHANNELS", channels),)


def bwd_defines(tile_size: int, channels: int, rows: Optional[int] = None, merge: bool = False) -> tuple:
    """The variant defines of rasterize_bwd.metal: channels, batch and the tile merge (SPLAT_BWD_MERGE)."""
    batch = bwd_batch(tile_size, channels, rows, merge)
    return (("SPLAT_CHANNELS", channels), ("SPLAT_BWD_BATCH", batch)) + ((("SPLAT_BWD_MERGE", 1),) if merge else ())


def bwd_merge_defines(tile_size: int, channels: int, rows: Optional[int] = None) -> tuple:
    """The variant defines of rasterize_bwd.metal with the tile merge (SPLAT_BWD_MERGE)."""
    return bwd_defines(tile_size, channels, rows, merge=True)


def group_sizes(group: int, multiple: int = 32) -> tuple:
    """Group sizes kernels.group_library may build a 1-D kernel with: `group`, or a smaller multiple of
    `multiple` where this GPU's pipeline allows fewer threads."""
    return (group,) + tuple(range(group - group % multiple - (multiple if group % multiple == 0 else 0), 0, -multiple))


def project_bwd_defines(group: int) -> tuple:
    return (("SPLAT_PROJECT_BWD_GROUP", group),)


def raster_variants(tile_size: int, rows: int, channels: int) -> Iterator[Variant]:
    """The rasterizer libraries of one geometry and channel count: the forward, the backward, its tile merge."""
    strip = strip_defines(tile_size, rows)
    yield Variant("rasterize.metal", tile_size, raster_defines(channels) + strip)
    for merge in (False, True):
        yield Variant("rasterize_bwd.metal", tile_size, bwd_defines(tile_size, channels, rows, merge) + strip)


def library_variants() -> Iterator[Variant]:
    """Every library the host can request: the fixed stages, project_bwd at each group size, the loss, and the
    rasterizers at every tile size (1..MAX_TILE_SIZE) x strip rows x channel count (1..MAX_CHANNELS) x tile
    merge. Each is compiled at one of MSL_VERSIONS on a Mac."""
    for stage_file in FIXED_STAGES:
        yield Variant(stage_file)
    for group in group_sizes(PROJECT_BWD_GROUP):
        yield Variant("project_bwd.metal", constants.TILE_SIZE, project_bwd_defines(group))
    yield Variant(LOSS_VARIANT[0], constants.TILE_SIZE, LOSS_VARIANT[1])
    for tile_size in range(1, MAX_TILE_SIZE + 1):
        for rows in strip_rows(tile_size):
            for channels in range(1, MAX_CHANNELS + 1):
                yield from raster_variants(tile_size, rows, channels)


def is_enumerated(variant: Variant) -> bool:
    """Whether library_variants yields `variant`."""
    return tuple(variant) in _enumerated()


def unlisted(requested) -> list:
    """The variants of `requested` that library_variants does not yield, sorted."""
    return sorted(v for v in requested if not is_enumerated(v))


_enumerated_set: Optional[frozenset] = None


def _enumerated() -> frozenset:
    global _enumerated_set
    if _enumerated_set is None:
        _enumerated_set = frozenset(tuple(v) for v in library_variants())
    return _enumerated_set


def checked_variants() -> Iterator[Variant]:
    """The libraries the compile checks build (the emulator's address-space and MSL-subset checks on Linux, Apple's
    compiler at every MSL version in the macOS workflow and the doctor): all of library_variants but the
    rasterizers, which are checked on a cover of their axes, since their product (tens of thousands of
    libraries) is too many to compile each time: every tile size at the whole tile and in 1-row strips, every
    strip of the default tile, and every channel count at the default tile; each forward, backward and tile merge."""
    for v in library_variants():
        if not v.stage_file.startswith("rasterize"):
            yield v
    geometries = [(ts, rows) for ts in range(1, MAX_TILE_SIZE + 1) for rows in sorted({ts, 1})]
    geometries += [(constants.TILE_SIZE, rows) for rows in strip_rows(constants.TILE_SIZE)[1:-1]]
    for tile_size, rows in geometries:
        for channels in (3,) if tile_size != constants.TILE_SIZE or rows != tile_size else range(1, MAX_CHANNELS + 1):
            yield from raster_variants(tile_size, rows, channels)


def variant_name(variant: Variant) -> str:
    """A file name for a library: stage, tile size and defines, e.g. rasterize_bwd_t16_SPLAT_CHANNELS3_..."""
    parts = [Path(variant.stage_file).stem, f"t{variant.tile_size}"]
    parts += [f"{name.removeprefix('SPLAT_').lower()}{value}" for name, value in variant.defines]
    return "_".join(parts)


def standard_variants() -> dict:
    """name -> (stage file, variant defines) of every library the backend compiles in normal use (the doctor
    compiles them on a user's Mac): RGB (3 channels), RGB+depth (4) and depth (1) at the default tile."""
    variants = {Path(f).stem: (f, ()) for f in FIXED_STAGES}
    variants["project_bwd"] = ("project_bwd.metal", project_bwd_defines(PROJECT_BWD_GROUP))
    variants["loss"] = LOSS_VARIANT
    for name, channels in (("rgb", 3), ("rgbd", 4), ("d", 1)):
        variants[f"rasterize_{name}"] = ("rasterize.metal", raster_defines(channels))
        variants[f"rasterize_bwd_{name}"] = ("rasterize_bwd.metal", bwd_defines(constants.TILE_SIZE, channels))
    # the backward's tile merge (rasterization_metal tile_merge, off by default), for the RGB training step
    variants["rasterize_bwd_rgb_merge"] = ("rasterize_bwd.metal", bwd_merge_defines(constants.TILE_SIZE, 3))
    return variants
