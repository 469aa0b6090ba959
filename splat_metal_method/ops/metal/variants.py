"""The kernel variants and their launch geometry: which libraries the Metal backend compiles, with which
defines, and how many threads a group of each kernel has.

Both sides read it: kernels.py (which assembles and compiles the libraries) and the dispatch modules
(which launch them). It imports neither, so neither imports the other for a constant.
"""

from __future__ import annotations

import os
from typing import Optional

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
# consecutive gaussians per tile in a threadgroup histogram of BIN_WINDOW ints (30 KiB of Apple's 32 KiB: every
# tile of a 1297x840 image, 4,346 tiles of 16x16, fits), then reserves each touched tile's ranks with one device
# atomic. 4,096 gaussians a group: at ~5 tiles a gaussian ~20K entries, so most of the ~4K tiles are shared.
BIN_COUNT_ITEMS = 16
BIN_WINDOW = 7680


# The fused L1 + SSIM loss (loss.metal).
LOSS_TILE = 16  # SPLAT_LOSS_TILE: pixels per side of a threadgroup's block (TILE^2 threads)
LOSS_WIN = 11  # SPLAT_LOSS_WIN: taps of the gaussian window (sigma 1.5, as pytorch_msssim / FusedSSIM)
LOSS_VARIANT = ("loss.metal", (("SPLAT_LOSS_TILE", LOSS_TILE), ("SPLAT_LOSS_WIN", LOSS_WIN)))

# project_bwd.metal: threads per group (injected as SPLAT_PROJECT_BWD_GROUP; fewer where the pipeline
# allows fewer); a group lies in one camera.
PROJECT_BWD_GROUP = 256

# Which pixel of its tile each rasterizer thread takes (common.h raster_pixel_in_group): "blocks", a simdgroup an
# 8x4 block of pixels where the tile allows (the default: a gaussian's footprint meets fewer simdgroups, so the
# backward reduces and issues fewer atomics), or "rows", a simdgroup 32 consecutive pixels of a row (gsplat's
# order, and ours before). Both kernels read it at each call, from this attribute; SPLAT_METAL_PIXEL_ORDER=rows
# sets it for a process (an A/B run on a Mac: splat-metal-bench --vs pixel-order). msplat 1.1.3 rasterizes in 8x8
# threadgroups: its simdgroups are 8x4 blocks too, and the model prices a backward's groups by that order's (the
# step ledger runs a row-order launch once more in it: rasterize_bwd.block_order_groups).
PIXEL_ORDERS = ("blocks", "rows")
PIXEL_ORDER = os.environ.get("SPLAT_METAL_PIXEL_ORDER", "blocks") or "blocks"


def pixel_order_defines(order: Optional[str] = None) -> tuple:
    """The rasterizer kernels' variant defines of a pixel order (PIXEL_ORDER when None)."""
    order = PIXEL_ORDER if order is None else order
    if order not in PIXEL_ORDERS:
        raise ValueError(f"pixel order must be one of {PIXEL_ORDERS} (SPLAT_METAL_PIXEL_ORDER), got {order!r}")
    return (("SPLAT_PIXEL_ROWS", 1),) if order == "rows" else ()


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


# compiled per channel count: 3 (RGB), 4 (RGB+depth), 1 (depth only).
_FIXED_VARIANTS = {
    "project": ("project.metal", ()),
    "sh": ("sh.metal", ()),
    "isect": ("isect.metal", ()),
    "sort": ("sort.metal", ()),
    "scan": ("scan.metal", ()),
    "covar": ("covar.metal", ()),
    "train": ("train.metal", ()),
    "adam": ("adam.metal", ()),
    "rasterize_rgb": ("rasterize.metal", (("SPLAT_CHANNELS", 3),)),
    "rasterize_rgbd": ("rasterize.metal", (("SPLAT_CHANNELS", 4),)),
    "rasterize_d": ("rasterize.metal", (("SPLAT_CHANNELS", 1),)),
}


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


def standard_variants() -> dict:
    """name -> (stage file, variant defines) of every library the backend compiles in normal use."""
    variants = dict(_FIXED_VARIANTS)
    variants["project_bwd"] = ("project_bwd.metal", (("SPLAT_PROJECT_BWD_GROUP", PROJECT_BWD_GROUP),))
    variants["sh_bwd"] = ("sh_bwd.metal", ())
    variants["loss"] = LOSS_VARIANT
    for name, channels in (("rgb", 3), ("rgbd", 4), ("d", 1)):
        batch = bwd_batch(constants.TILE_SIZE, channels)
        variants[f"rasterize_bwd_{name}"] = (
            "rasterize_bwd.metal",
            (("SPLAT_CHANNELS", channels), ("SPLAT_BWD_BATCH", batch)),
        )
    # the backward's tile merge (rasterization_metal tile_merge, off by default), for the RGB training step
    variants["rasterize_bwd_rgb_merge"] = ("rasterize_bwd.metal", bwd_merge_defines(constants.TILE_SIZE, 3))
    # both kernels in the row order (PIXEL_ORDER = "rows": the A/B run and the step ledger's count of its groups)
    for name in ("rasterize_rgb", "rasterize_bwd_rgb"):
        stage_file, defines = variants[name]
        variants[f"{name}_rows"] = (stage_file, defines + pixel_order_defines("rows"))
    return variants


def bwd_merge_defines(tile_size: int, channels: int, rows: Optional[int] = None) -> tuple:
    """The variant defines of rasterize_bwd.metal with the tile merge (SPLAT_BWD_MERGE)."""
    batch = bwd_batch(tile_size, channels, rows, merge=True)
    return (("SPLAT_CHANNELS", channels), ("SPLAT_BWD_BATCH", batch), ("SPLAT_BWD_MERGE", 1))
