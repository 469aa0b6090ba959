"""scan.metal (our int64 prefix sum, run under the MSL emulator) against torch.cumsum on the CPU, and
the dispatches of a radix-sort pass that uses it instead of torch's integer cumsum (issue 22, section 6)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from splat_metal_method.ops.metal import runtime, scan
from splat_metal_method.ops.metal.kernels import RADIX_BITS, RADIX_BLOCK, SCAN_BLOCK
from splat_metal_method.ops.metal.sort import radix_sort_pairs

# the edges of a thread's run (16), of a simdgroup-sized count (32), of a group's threads (256) and of
# a block (4096), one and several blocks, and a million values (245 blocks: the two-dispatch path)
SIZES = [
    0,
    1,
    15,
    16,
    17,
    31,
    32,
    33,
    255,
    256,
    257,
    SCAN_BLOCK - 1,
    SCAN_BLOCK,
    SCAN_BLOCK + 1,
    3 * SCAN_BLOCK + 7,
    1_000_000,
]


def torch_prefix_sum(x: torch.Tensor, inclusive: bool) -> torch.Tensor:
    cum = torch.cumsum(x.long(), 0)
    return cum if inclusive else cum - x.long()


@pytest.mark.parametrize("n", SIZES)
def test_prefix_sum_matches_torch_cumsum(n):
    gen = torch.Generator().manual_seed(n)
    for dtype in (torch.int32, torch.int64):
        x = torch.randint(-1000, 100_000, (n,), generator=gen, dtype=dtype)
        for inclusive in (False, True):
            got = scan.prefix_sum(x, inclusive=inclusive)
            assert got.dtype == torch.int64 and got.shape == (n,)
            assert torch.equal(got, torch_prefix_sum(x, inclusive)), (n, dtype, inclusive)


def test_prefix_sum_counts_past_int32():
    # 64-bit sums: the total of int32 values may pass 2^31 (the host then refuses that many intersections)
    x = torch.full((3 * SCAN_BLOCK,), 2**20, dtype=torch.int32)
    got = scan.prefix_sum(x, inclusive=True)
    assert int(got[-1]) == 3 * SCAN_BLOCK * 2**20 > 2**31
    assert torch.equal(got, torch_prefix_sum(x, True))


@pytest.mark.parametrize("n, blocks_then_carry", [(5 * SCAN_BLOCK + 3, 2), (40 * SCAN_BLOCK, 3)])
def test_prefix_sum_recursive_level(monkeypatch, n, blocks_then_carry):
    """Past SCAN_CARRY_BLOCKS blocks the block totals are scanned first (one more level, recursively);
    lowered here so that the path runs on small sizes."""
    monkeypatch.setattr(scan, "SCAN_CARRY_BLOCKS", blocks_then_carry)
    monkeypatch.setattr(scan, "SCAN_SINGLE_BLOCKS", 1)  # not the one-dispatch path
    x = torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    runtime.reset_launch_counts()
    for inclusive in (False, True):
        assert torch.equal(scan.prefix_sum(x, inclusive=inclusive), torch_prefix_sum(x, inclusive))
    assert runtime.launch_counts()["scan_blocks"] >= 2 * 2  # outer + at least one inner level, twice


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_prefix_sum_out_of_place_is_one_dispatch_up_to_single_blocks(dtype):
    """Out of place, up to SCAN_SINGLE_BLOCKS blocks each group sums the blocks before its own (one
    dispatch); one block more takes the two-dispatch path; in place always does (other groups would be
    overwriting the values a group sums)."""
    n = scan.SCAN_SINGLE_BLOCKS * SCAN_BLOCK
    x = torch.randint(-1000, 100_000, (n + 1,), generator=torch.Generator().manual_seed(3), dtype=dtype)
    for size, launches in ((n, 1), (n + 1, 2), (2 * SCAN_BLOCK + 1, 1)):
        for inclusive in (False, True):
            runtime.reset_launch_counts()
            got = scan.prefix_sum(x[:size], inclusive=inclusive)
            assert sum(runtime.launch_counts().values()) == launches, (size, runtime.launch_counts())
            assert torch.equal(got, torch_prefix_sum(x[:size], inclusive)), (size, inclusive)
    y = x[: 2 * SCAN_BLOCK + 1].long()
    runtime.reset_launch_counts()
    assert torch.equal(scan.prefix_sum(y.clone(), out=None), torch_prefix_sum(y, False))
    z = y.clone()
    scan.prefix_sum(z, out=z)
    assert torch.equal(z, torch_prefix_sum(y, False)) and runtime.launch_counts()["scan_block_sums"] == 1


def test_prefix_sum_refuses_bad_input():
    with pytest.raises(ValueError, match=r"\[prefix_sum\] values must be \[n\] int32 or int64"):
        scan.prefix_sum(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"\[prefix_sum\]"):
        scan.prefix_sum(torch.zeros(2, 2, dtype=torch.int32))


class _CountAtenOps(TorchDispatchMode):
    """aten ops that run a kernel (allocations are not dispatches of a command encoder)."""

    ALLOCATIONS = {"empty.memory_format", "empty_like.default", "empty_strided.default", "view.default"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"{func._schema.name.split('::')[-1]}.{func._schema.overload_name or 'default'}"
        if name not in self.ALLOCATIONS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("n, per_pass", [(3 * RADIX_BLOCK + 5, 3), ((1 << 20) + RADIX_BLOCK, 3)])
def test_radix_sort_pass_dispatches_no_more_than_with_torch_cumsum(n, per_pass):
    """Before (torch.cumsum + subtraction): radix_hist, cumsum, sub, radix_scatter = 4 dispatches per
    pass at every size. Now: radix_hist, scan_blocks, radix_scatter = 3 up to 33M keys (the block
    histograms are scanned out of place, one dispatch up to scan.SCAN_SINGLE_BLOCKS blocks; issue 36:
    the sort's launches do not grow with the scene); no aten kernel at all."""
    gen = torch.Generator().manual_seed(2)
    keys = torch.randint(0, 2**31 - 1, (n,), generator=gen, dtype=torch.int32)
    vals = torch.arange(n, dtype=torch.int32)
    bits = 3 * RADIX_BITS
    runtime.reset_launch_counts()
    with _CountAtenOps() as aten:
        k, v = radix_sort_pairs(keys, vals, bits=bits)
    launches = runtime.launch_counts()
    passes = bits // RADIX_BITS
    assert sum(launches.values()) == per_pass * passes, launches
    assert launches["radix_hist"] == launches["radix_scatter"] == passes
    assert aten.ops == [], f"aten kernels in the radix sort: {aten.ops}"
    expected, order = torch.sort(keys & (2**bits - 1), stable=True)
    assert torch.equal(k & (2**bits - 1), expected) and torch.equal(v, order.int())


@pytest.mark.parametrize("n", [1, 4095, 3 * SCAN_BLOCK + 7])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_prefix_sum_into_out_and_in_place(n, dtype):
    """``out`` receives the sums (no new tensor); an int64 scan may be in place (sort.py scans its
    histograms so), on one block and on several."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(-1000, 1000, (n,), generator=gen, dtype=dtype)
    for inclusive in (False, True):
        out = torch.full((n,), -5, dtype=torch.int64)
        assert scan.prefix_sum(x, inclusive=inclusive, out=out) is out
        assert torch.equal(out, torch_prefix_sum(x, inclusive))
        if dtype == torch.int64:
            y = x.clone()
            assert scan.prefix_sum(y, inclusive=inclusive, out=y) is y
            assert torch.equal(y, torch_prefix_sum(x, inclusive))
    with pytest.raises(ValueError, match=r"\[prefix_sum\] out must be"):
        scan.prefix_sum(x, out=torch.empty(n + 1, dtype=torch.int64))


@pytest.mark.parametrize("n", [2, 5000])
def test_radix_argsort_and_workspace_scratch(n):
    """values=None sorts the flat indices (the first pass writes them), keys of any shape are read
    flat, and with ``scratch`` the buffers come from the workspace: the same results, reused storage."""
    gen = torch.Generator().manual_seed(7)
    keys = torch.randint(0, 2**31 - 1, (2, n), generator=gen, dtype=torch.int32)
    expected, order = torch.sort(keys.view(-1), stable=True)
    k, v = radix_sort_pairs(keys, None, bits=32)
    assert torch.equal(k, expected) and torch.equal(v, order.int())
    k1, v1 = radix_sort_pairs(keys, None, bits=32, scratch="test.sort")
    ptr = v1.data_ptr()
    assert torch.equal(k1, expected) and torch.equal(v1, order.int())
    k2, v2 = radix_sort_pairs(keys, None, bits=32, scratch="test.sort")
    assert v2.data_ptr() == ptr and torch.equal(v2, order.int())
    # fewer keys into the same (now longer) scratch buffers, for 1 to 8 passes: the sorted n only
    fewer = keys.view(-1)[: max(1, n // 3)] & 0x0FFFFFFF
    for bits in (4, 12, 28):
        k3, v3 = radix_sort_pairs(fewer, None, bits=bits, scratch="test.sort")
        expected3, order3 = torch.sort(fewer & ((1 << bits) - 1) if bits < 28 else fewer, stable=True)
        if bits == 28:
            assert k3.shape == fewer.shape and torch.equal(k3, expected3) and torch.equal(v3, order3.int())
        else:  # sorted by the low `bits` only: compare the order of those digits
            assert k3.shape == fewer.shape and torch.equal(k3 & ((1 << bits) - 1), expected3)
