"""Dispatch of scan.metal: int64 prefix sums of int32/int64 values on the device (see scan.metal).

Used instead of torch.cumsum on integers, which has had correctness bugs on MPS. No host sync.
Dispatches: one for n <= SCAN_BLOCK (out-of-place: up to SCAN_SINGLE_BLOCKS blocks), two up to
SCAN_CARRY_BLOCKS blocks, more beyond (recursive).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .kernels import SCAN_BLOCK, SCAN_THREADS, grid_1d, library

# Up to this many blocks (n <= 4096 * 4096 values), each group of scan_blocks sums the totals of the
# earlier blocks itself: at most 16 loads per thread, as many as its own values. Beyond, the block
# totals are scanned first (one more level), so the work stays linear in n.
SCAN_CARRY_BLOCKS = 4096
# Up to this many blocks (n <= 131,072 values) an out-of-place scan is one dispatch: each group sums the
# values before its block itself (at most 31 blocks' worth, 496 loads per thread). The radix sort's
# digit offsets take this path up to 33M keys, so its launches do not grow with the scene.
SCAN_SINGLE_BLOCKS = 32


_unused: dict = {}  # (device, dtype) -> [1] tensor bound where the kernels' other input goes (never read)


def _unused_input(device: torch.device, dtype: torch.dtype) -> Tensor:
    key = (device, dtype)
    t = _unused.get(key)
    if t is None:
        t = _unused[key] = torch.zeros((1,), dtype=dtype, device=device)
    return t


def prefix_sum(values: Tensor, inclusive: bool = False, out: Optional[Tensor] = None) -> Tensor:
    """[n] int64 prefix sums of `values` ([n] int32 or int64): exclusive (out[i] = sum of values[:i])
    or inclusive (out[i] = sum of values[:i + 1]), accumulated in 64 bits. ``out`` ([n] int64,
    contiguous) receives them instead of a new tensor; it may be ``values`` itself (an in-place scan:
    every thread reads its own values before it writes them, block totals go to a separate buffer)."""
    if values.dim() != 1 or values.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"[prefix_sum] values must be [n] int32 or int64, got {list(values.shape)} {values.dtype}")
    device = values.device
    n = values.numel()
    if out is None:
        out = torch.empty((n,), dtype=torch.int64, device=device)
    elif out.shape != (n,) or out.dtype != torch.int64 or not out.is_contiguous() or out.device != device:
        raise ValueError(
            f"[prefix_sum] out must be [{n}] contiguous int64 on {device}, got {list(out.shape)} {out.dtype}"
        )
    if n == 0:
        return out
    values = values.contiguous()
    wide = values.dtype == torch.int64
    # the kernels bind both an int32 and an int64 input; the one that `wide` does not select is never
    # read: `out` stands in for an unused int64 one, a cached [1] tensor for an unused int32 one
    inputs = (_unused_input(device, torch.int32), values) if wide else (values, out)
    lib = library(device, "scan.metal")
    n_blocks = (n + SCAN_BLOCK - 1) // SCAN_BLOCK
    grid = {"threads": (n_blocks * SCAN_THREADS,), "group_size": (SCAN_THREADS,)}
    if n_blocks == 1:
        lib.scan_blocks(*inputs, out, out, n, int(wide), int(inclusive), 0, **grid)  # carries unread
        return out
    if n_blocks <= SCAN_SINGLE_BLOCKS and out.data_ptr() != values.data_ptr():
        lib.scan_blocks(*inputs, out, out, n, int(wide), int(inclusive), 3, **grid)  # carries unread
        return out
    block_sums = torch.empty((n_blocks,), dtype=torch.int64, device=device)
    lib.scan_block_sums(*inputs, block_sums, n, int(wide), **grid)
    if n_blocks <= SCAN_CARRY_BLOCKS:
        lib.scan_blocks(*inputs, out, block_sums, n, int(wide), int(inclusive), 1, **grid)
    else:
        carries = prefix_sum(block_sums, inclusive=False)
        lib.scan_blocks(*inputs, out, carries, n, int(wide), int(inclusive), 2, **grid)
    return out


def block_sums_moved_bytes(args, lengths=None):
    """Bytes one scan_block_sums launch (its arguments as prefix_sum binds them) reads and writes, keyed by the
    bound buffer's shape (as benchmarks/step_model/ledger.py ModelWork.buffer_shapes): the `n` values of its one input (in32, or in64
    when wide) read, the block totals written. The other input is bound but never read: prefix_sum binds `out`
    there (8 bytes a value for an int32 scan), which the bound-buffer count charged. (benchmarks/step_model/ledger.py MOVED_BYTES)"""
    in32, in64, block_sums, n, wide = args[:5]
    values = in64 if int(wide) else in32
    out: dict = {}
    for t, b in ((values, int(n) * values.element_size()), (block_sums, block_sums.numel() * 8)):
        key = "x".join(str(d) for d in t.shape)
        out[key] = out.get(key, 0) + b
    return out, None


def select_rows(mask: Tensor, n_selected: int, with_rest: bool = False):  # [n] bool -> [n_selected] int64 (, rest)
    """torch.where(mask)[0] (and torch.where(~mask)[0] with ``with_rest``) without a host read: the
    caller knows how many rows are selected (one read it already made), the device finds which
    (prefix_sum + scan_compact). On MPS torch.where(mask) is nonzero, which drains the GPU's queue."""
    if mask.dim() != 1 or mask.dtype != torch.bool:
        raise ValueError(f"[select_rows] mask must be [n] bool, got {list(mask.shape)} {mask.dtype}")
    n, device = mask.numel(), mask.device
    if not 0 <= n_selected <= n:
        raise ValueError(f"[select_rows] {n_selected} selected rows of {n}")
    sel = torch.empty((n_selected,), dtype=torch.int64, device=device)
    rest = torch.empty((n - n_selected,), dtype=torch.int64, device=device) if with_rest else None
    if n == 0:
        return (sel, rest) if with_rest else sel
    flags = mask.to(torch.int32)
    cum = prefix_sum(flags, inclusive=True)
    placeholder = rest if rest is not None and rest.numel() else _unused_input(device, torch.int64)
    library(device, "scan.metal").scan_compact(
        flags, cum, sel if n_selected else _unused_input(device, torch.int64), placeholder, n, int(with_rest),
        **grid_1d(n),
    )  # fmt: skip
    return (sel, rest) if with_rest else sel
