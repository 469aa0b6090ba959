"""Dispatch of sort.metal: stable LSD radix sort of (uint32 key, int32 value) pairs on the device.

Used instead of torch.sort because MPS sort has had int64 and large-size bugs and documents no
stability; the intersection lists need a stable sort for every backend to agree on per-tile order.
No host synchronisation: the number of passes follows from `bits`, which the caller knows.
A pass is radix_hist, our prefix sum of the block histograms into a second buffer (scan.py: one
dispatch up to 33M keys) and radix_scatter: 3 dispatches and no aten op: the
histogram and the ping-pong buffers are allocated once per sort (or, with ``scratch``, reused from
the workspace across sorts), and the first pass of an argsort (values None) writes the indices itself.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..workspace import workspace
from .kernels import RADIX_BINS, RADIX_BITS, RADIX_BLOCK, RADIX_THREADS, library
from .scan import prefix_sum


def radix_sort_pairs(
    keys: Tensor, values: Optional[Tensor] = None, bits: int = 32, scratch: Optional[str] = None
) -> Tuple[Tensor, Tensor]:
    """Stable sort of `keys` (int32 holding uint32 bit patterns, compared UNSIGNED; any shape, read
    flat) by their low `bits` bits, carrying `values` (int32, as many; None: the flat index of each
    key, an argsort). Returns (sorted_keys, sorted_values) [n]; the inputs are not modified. Keys must
    be 0 above bit `bits` for the result to be sorted by the full key.

    Without ``scratch`` the results are new tensors. With it, every buffer of the sort comes from the
    calling thread's workspace under names starting with ``scratch``: the results are then valid only
    until the next sort with the same ``scratch`` (ops/workspace.py: never return them from a stage)."""
    if values is not None and values.shape != keys.shape:
        raise ValueError(
            f"[radix_sort] keys and values must have one shape, got {list(keys.shape)}, {list(values.shape)}"
        )
    if keys.dtype != torch.int32 or (values is not None and values.dtype != torch.int32):
        raise ValueError(f"[radix_sort] keys and values must be int32, got {keys.dtype}, "
                         f"{None if values is None else values.dtype}")  # fmt: skip
    if not 0 <= bits <= 32:
        raise ValueError(f"[radix_sort] bits must be 0..32, got {bits}")
    n = keys.numel()
    if n >= 2**31:
        raise ValueError(f"[radix_sort] {n} keys exceed the 32-bit offsets of the sort")
    device = keys.device
    k_in = keys.contiguous()  # the kernels read them flat: no view needed
    v_in = None if values is None else values.contiguous()
    n_passes = (bits + RADIX_BITS - 1) // RADIX_BITS
    if n <= 1 or n_passes == 0:
        v = torch.arange(n, dtype=torch.int32, device=device) if v_in is None else v_in.reshape(n).clone()
        return k_in.reshape(n).clone(), v
    ws = workspace() if scratch is not None else None

    def buffer(name, size, dtype, exact=True):  # exact=False: a workspace buffer may be longer (kernels get n)
        if ws is None:
            return torch.empty((size,), dtype=dtype, device=device)
        return (
            ws.get(f"{scratch}.{name}", size, dtype, device)
            if exact
            else ws.at_least(f"{scratch}.{name}", size, dtype, device)
        )

    lib = library(device, "sort.metal")
    n_blocks = (n + RADIX_BLOCK - 1) // RADIX_BLOCK
    grid = {"threads": (n_blocks * RADIX_THREADS,), "group_size": (RADIX_THREADS,)}
    hist = buffer("hist", RADIX_BINS * n_blocks, torch.int64)  # [BINS, n_blocks] digit-major counts
    offsets = buffer("offsets", RADIX_BINS * n_blocks, torch.int64)  # their exclusive scan (out-of-place: one
    # dispatch up to scan.SCAN_SINGLE_BLOCKS blocks, 33M keys)
    # ping-pong: pass p reads one pair and writes the other (pass 0 reads the caller's tensors)
    pairs = [(buffer("keys0", n, torch.int32, False), buffer("values0", n, torch.int32, False))]
    if n_passes > 1:
        pairs.append((buffer("keys1", n, torch.int32, False), buffer("values1", n, torch.int32, False)))
    for p in range(n_passes):
        shift = p * RADIX_BITS
        k_out, v_out = pairs[p % 2]
        lib.radix_hist(k_in, hist, n, shift, n_blocks, **grid)
        prefix_sum(hist, inclusive=False, out=offsets)  # histograms -> where each block's digits go
        iota = v_in is None  # only on pass 0: later passes read the values written before
        lib.radix_scatter(k_in, k_in if iota else v_in, k_out, v_out, offsets, n, shift, n_blocks, int(iota), **grid)
        k_in, v_in = k_out, v_out
    return (k_in, v_in) if k_in.numel() == n else (k_in[:n], v_in[:n])  # the sorted n of a longer buffer
