"""Dispatch of scan.metal: int64 prefix sums of int32/int64 values on the device (see scan.metal).

Used instead of torch.cumsum on integers, which has had correctness bugs on MPS. No host sync.
Dispatches: one for n <= SCAN_BLOCK, two up to SCAN_CARRY_BLOCKS blocks, more beyond (recursive).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import SCAN_BLOCK, SCAN_THREADS, library

# Up to this many blocks (n <= 4096 * 4096 values), each group of scan_blocks sums the totals of the
# earlier blocks itself: at most 16 loads per thread, as many as its own values. Beyond, the block
# totals are scanned first (one more level), so the work stays linear in n.
SCAN_CARRY_BLOCKS = 4096


def prefix_sum(values: Tensor, inclusive: bool = False) -> Tensor:
    """[n] int64 prefix sums of `values` ([n] int32 or int64): exclusive (out[i] = sum of values[:i])
    or inclusive (out[i] = sum of values[:i + 1]), accumulated in 64 bits."""
    if values.dim() != 1 or values.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"[prefix_sum] values must be [n] int32 or int64, got {list(values.shape)} {values.dtype}")
    device = values.device
    n = values.numel()
    out = torch.empty((n,), dtype=torch.int64, device=device)
    if n == 0:
        return out
    values = values.contiguous()
    wide = values.dtype == torch.int64
    # the kernels bind both an int32 and an int64 input; the one that `wide` does not select is never read
    unused = torch.empty((1,), dtype=torch.int32 if wide else torch.int64, device=device)
    inputs = (unused, values) if wide else (values, unused)
    lib = library(device, "scan.metal")
    n_blocks = (n + SCAN_BLOCK - 1) // SCAN_BLOCK
    grid = {"threads": (n_blocks * SCAN_THREADS,), "group_size": (SCAN_THREADS,)}
    if n_blocks == 1:
        lib.scan_blocks(*inputs, out, out, n, int(wide), int(inclusive), 0, **grid)  # carries unread
        return out
    block_sums = torch.empty((n_blocks,), dtype=torch.int64, device=device)
    lib.scan_block_sums(*inputs, block_sums, n, int(wide), **grid)
    if n_blocks <= SCAN_CARRY_BLOCKS:
        lib.scan_blocks(*inputs, out, block_sums, n, int(wide), int(inclusive), 1, **grid)
    else:
        carries = prefix_sum(block_sums, inclusive=False)
        lib.scan_blocks(*inputs, out, carries, n, int(wide), int(inclusive), 2, **grid)
    return out
