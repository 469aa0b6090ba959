"""Assembles and caches the Metal kernel libraries: generated #defines + common.h + covar.h + sh.h + one stage file.

The constants shared by Python and the kernels come from ``ops/constants.py`` (and the radix sort
geometry below) and are injected as ``#define``s, so they are defined exactly once. Each
(stage, variant) source is built once per process; ``runtime.library_for`` then compiles it once per
process and device kind (torch.mps.compile_shader on mps tensors, the MSL emulator on cpu tensors).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .. import constants
from . import variants
from .runtime import library_for, load_source
from .variants import (  # noqa: F401 (group_threads and the geometry are part of this module's API)
    BIN_CAPACITY,
    BIN_COUNT_ITEMS,
    BIN_ROUND,
    BIN_THREADS,
    BIN_WINDOW,
    GROUP_1D,
    RADIX_BINS,
    RADIX_BITS,
    RADIX_BLOCK,
    RADIX_KEYS_PER_THREAD,
    RADIX_THREADS,
    SCAN_BLOCK,
    SCAN_ITEMS,
    SCAN_THREADS,
    group_threads,
)


def _base_defines(tile_size: int) -> dict:
    return {
        "SPLAT_TILE_SIZE": int(tile_size),
        "SPLAT_ALPHA_MAX": float(constants.ALPHA_MAX),
        "SPLAT_ALPHA_MIN": float(constants.ALPHA_MIN),
        "SPLAT_TRANSMITTANCE_MIN": float(constants.TRANSMITTANCE_MIN),
        "SPLAT_RADIX_BITS": RADIX_BITS,
        "SPLAT_RADIX_THREADS": RADIX_THREADS,
        "SPLAT_RADIX_KEYS_PER_THREAD": RADIX_KEYS_PER_THREAD,
        "SPLAT_GROUP_1D": GROUP_1D,
        "SPLAT_BIN_CAPACITY": BIN_CAPACITY,
        "SPLAT_BIN_THREADS": BIN_THREADS,
        "SPLAT_BIN_WINDOW": BIN_WINDOW,
        "SPLAT_BIN_ROUND": BIN_ROUND,
        "SPLAT_SCAN_THREADS": SCAN_THREADS,
        "SPLAT_SCAN_ITEMS": SCAN_ITEMS,
    }


_requested: set = set()  # every variants.Variant stage_source has built in this process


def requested_variants() -> set:
    """The libraries (variants.Variant) this process has assembled: each should be one variants.library_variants
    yields (tests/ops/metal/conftest.py checks it after every kernel test)."""
    return set(_requested)


@lru_cache(maxsize=None)
def stage_source(stage_file: str, tile_size: int = constants.TILE_SIZE, extra: tuple = ()) -> str:
    """Full source of one library: defines, common.h, covar.h and sh.h (the quaternion/covariance math and the
    spherical-harmonics basis, shared with the native CPU backend), then the stage file. `extra` holds
    (name, value) pairs of per-variant defines (e.g. the channel count of the rasterizer)."""
    _requested.add(variants.Variant(stage_file, int(tile_size), tuple(extra)))
    defines = _base_defines(tile_size)
    defines.update(dict(extra))
    return load_source("common.h", "covar.h", "sh.h", stage_file, defines=defines)


def library(device: torch.device, stage_file: str, tile_size: int = constants.TILE_SIZE, extra: tuple = ()):
    """The compiled library of `stage_file` for tensors on `device` (cached per process)."""
    return library_for(device, stage_source(stage_file, tile_size, extra), name=stage_file)


# The first MSL version whose source can declare its math mode (common.h's `#pragma METAL fp math_mode(safe)`);
# below it, PYTORCH_MPS_FAST_MATH compiles our kernels with fast math.
SAFE_MATH_MSL = 320
_MSL_VERSION_PROBE = """#include <metal_stdlib>
using namespace metal;
kernel void msl_version(device int* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  if (i == 0) {
    out[0] = __METAL_VERSION__;
  }
}
"""


@lru_cache(maxsize=None)
def msl_version(device_type: str) -> int:
    """__METAL_VERSION__ of the libraries built for `device_type` ("mps": the version torch compiles at on
    this macOS, e.g. 310 for MSL 3.1; "cpu": the emulator's 320). One tiny probe kernel, once per process."""
    device = torch.device(device_type)
    out = torch.zeros(1, dtype=torch.int32, device=device)
    library_for(device, _MSL_VERSION_PROBE, name="msl_version_probe").msl_version(out, threads=(1,), group_size=(1,))
    return int(out.item())


def safe_math_declared(device_type: str) -> bool:
    """Whether our kernels declare safe math at the MSL version they are built at for `device_type` (then
    PYTORCH_MPS_FAST_MATH cannot change them)."""
    return msl_version(device_type) >= SAFE_MATH_MSL


_fitted_groups: dict = {}  # (device type, stage file, kernel, variant) -> the group geometry its pipeline allows


def strip_library(device: torch.device, stage_file: str, tile_size: int, extra: tuple, rows: int):
    """The library of a tile kernel whose groups cover `rows` rows of a tile (SPLAT_GROUP_ROWS where fewer than
    tile_size), with the variant defines `extra`."""
    return library(device, stage_file, tile_size, extra + variants.strip_defines(tile_size, rows))


def tile_library(device: torch.device, stage_file: str, kernel: str, tile_size: int, extra_for) -> tuple:
    """(library, rows) of a tile kernel (rasterize_fwd / rasterize_bwd: one thread per pixel of a tile), built
    for the group this GPU's pipeline allows, chosen at library build time from the limit it reports: the
    whole tile (rows = tile_size, tile_size^2 threads), or, where a register-heavy pipeline allows fewer
    threads per group, strips of `rows` rows (the largest divisor of tile_size that fits; SPLAT_GROUP_ROWS).
    Dispatch with group_size (tile_size, rows, 1). `extra_for(rows)`: the library's other variant defines.
    Where not even one row fits, the full-tile library is returned and its launch stops with
    ThreadgroupLimitError."""

    def build(rows):
        return strip_library(device, stage_file, tile_size, extra_for(rows), rows)

    key = (torch.device(device).type, stage_file, kernel, tile_size, extra_for(tile_size))
    rows = _fitted_groups.get(key)
    if rows is None:
        rows = tile_size
        while True:
            limit = build(rows).limits(kernel)["max_threads_per_threadgroup"]
            if limit is None or tile_size * rows <= limit:
                break
            fits = [r for r in variants.strip_rows(tile_size) if r < rows and tile_size * r <= limit]
            if not fits:
                rows = tile_size
                break
            rows = max(fits)
        _fitted_groups[key] = rows
    return build(rows), rows


def group_library(device: torch.device, stage_file: str, kernel: str, define: str, group: int, multiple: int = 32):
    """(library, group) of a 1-D kernel whose group size is the define `define` (project_bwd's
    SPLAT_PROJECT_BWD_GROUP): `group` threads, or, where this GPU's pipeline allows fewer, the largest
    multiple of `multiple` within its reported limit, chosen at library build time. Where not even
    `multiple` fits, the `group` library is returned and its launch stops with ThreadgroupLimitError."""

    def build(size):
        return library(device, stage_file, extra=((define, size),))

    key = (torch.device(device).type, stage_file, kernel, define, group)
    size = _fitted_groups.get(key)
    if size is None:
        size = group
        while True:
            limit = build(size).limits(kernel)["max_threads_per_threadgroup"]
            if limit is None or size <= limit:
                break
            if limit < multiple:
                size = group
                break
            size = limit - limit % multiple
        _fitted_groups[key] = size
    return build(size), size


def grid_1d(n: int) -> dict:
    """Launch arguments for one thread per item (partial last group; kernels bound-check). These kernels
    never synchronise, so the runtime may shrink the group to what a pipeline allows (fit_group)."""
    return {"threads": (int(n),), "group_size": (GROUP_1D,), "fit_group": True}


def standard_variants() -> dict:
    """name -> (stage file, variant defines) of every library the backend compiles in normal use."""
    return variants.standard_variants()


def all_sources() -> dict:
    """name -> full assembled source of every library the compile checks build (variants.checked_variants: what
    `splat-metal-doctor --emit-metal` writes and the macOS workflow compiles with `xcrun metal`)."""
    return {variants.variant_name(v): stage_source(*v) for v in variants.checked_variants()}


def compile_all(device: torch.device):
    """Compiles every standard library for `device` (cached); yields their names as it goes."""
    for name, (f, extra) in variants.standard_variants().items():
        library(torch.device(device), f, constants.TILE_SIZE, extra)
        yield name
