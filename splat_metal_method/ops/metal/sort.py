"""Dispatch of sort.metal: stable LSD radix sort of (uint32 key, int32 value) pairs on the device.

Used instead of torch.sort because MPS sort has had int64 and large-size bugs and documents no
stability; the intersection lists need a stable sort for every backend to agree on per-tile order.
No host synchronisation: the number of passes follows from `bits`, which the caller knows.
A pass is radix_hist, our prefix sum of the block histograms (scan.py: one dispatch up to 2^20 keys,
two beyond) and radix_scatter: 3 dispatches (4 beyond 2^20 keys), where torch's integer cumsum (which
has had MPS correctness bugs) and a subtraction made 4 at every size.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .kernels import RADIX_BINS, RADIX_BITS, RADIX_BLOCK, RADIX_THREADS, library
from .scan import prefix_sum


def radix_sort_pairs(keys: Tensor, values: Tensor, bits: int = 32) -> Tuple[Tensor, Tensor]:
    """Stable sort of `keys` ([n] int32 holding uint32 bit patterns, compared UNSIGNED) by their low
    `bits` bits, carrying `values` ([n] int32). Returns new (sorted_keys, sorted_values); the inputs
    are not modified. Keys must be 0 above bit `bits` for the result to be sorted by the full key."""
    if keys.dim() != 1 or values.shape != keys.shape:
        raise ValueError(f"[radix_sort] keys and values must be [n], got {list(keys.shape)}, {list(values.shape)}")
    if keys.dtype != torch.int32 or values.dtype != torch.int32:
        raise ValueError(f"[radix_sort] keys and values must be int32, got {keys.dtype}, {values.dtype}")
    if not 0 <= bits <= 32:
        raise ValueError(f"[radix_sort] bits must be 0..32, got {bits}")
    n = keys.numel()
    if n >= 2**31:
        raise ValueError(f"[radix_sort] {n} keys exceed the 32-bit offsets of the sort")
    device = keys.device
    k_in, v_in = keys.contiguous(), values.contiguous()
    n_passes = (bits + RADIX_BITS - 1) // RADIX_BITS
    if n <= 1 or n_passes == 0:
        return k_in.clone(), v_in.clone()
    lib = library(device, "sort.metal")
    n_blocks = (n + RADIX_BLOCK - 1) // RADIX_BLOCK
    grid = {"threads": (n_blocks * RADIX_THREADS,), "group_size": (RADIX_THREADS,)}
    block_hist = torch.empty((RADIX_BINS, n_blocks), dtype=torch.int32, device=device)
    k_out, v_out = torch.empty_like(k_in), torch.empty_like(v_in)
    for p in range(n_passes):
        shift = p * RADIX_BITS
        lib.radix_hist(k_in, block_hist, n, shift, n_blocks, **grid)
        bin_offsets = prefix_sum(block_hist.view(-1), inclusive=False)  # [BINS * n_blocks] int64, digit-major
        lib.radix_scatter(k_in, v_in, k_out, v_out, bin_offsets, n, shift, n_blocks, **grid)
        if p == 0:  # never write into the caller's tensors: the first pass reads them, later ones ping-pong
            k_in, v_in = k_out, v_out
            k_out, v_out = torch.empty_like(k_in), torch.empty_like(v_in)
        else:
            k_in, v_in, k_out, v_out = k_out, v_out, k_in, v_in
    return k_in, v_in
