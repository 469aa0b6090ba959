"""What a bin_sort launch writes (ops/metal/isect.py bin_sort_access: the entries the ledgers count as moved,
benchmarks/step_model/ledger.py MOVED_BYTES) held to the kernel itself.

bin_sort runs under the emulator on the bins of a real intersection pass (a tile of 5,000+ entries: two merge
steps; one of ~3,000: one; short ones; a capacity past the list: padding), one launch per step and then all the
merge steps in one launch, with and without isect_ids. Before each launch every buffer the launch does not read is
filled with a sentinel: every entry the launch changed must lie in the ranges bin_access counts as written (every
buffer), and in those buffers the count is exact (each counted entry was written). The buffers the launch only
reads are left as they were. A planted wrong formula (no merge steps; no padding) is caught by the same check.
"""

from __future__ import annotations

import pytest
import torch

from splat_metal_method.ops.metal import isect, runtime
from splat_metal_method.ops.metal.kernels import BIN_CAPACITY

SENTINEL = -0x2152411  # 0xFDEADBEEF's low bits, as int32: no flat id, offset or count takes it
TILE, WIDTH, HEIGHT = 16, 80, 48  # 5 x 3 tiles


def projected(seed: int = 0):
    """means2d [1, N, 2], radii [1, N], depths [1, N]: 5,200 gaussians inside tile (1, 1), 3,000 inside tile (3, 2),
    300 anywhere (several tiles each), a few with radius 0; depths with exact ties."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for n, (tx, ty), spread, radius in ((5200, (1, 1), 0.0, 2), (3000, (3, 2), 0.0, 2), (300, (0, 0), 1.0, 9)):
        if spread:
            xy = torch.rand(n, 2, generator=g) * torch.tensor([WIDTH, HEIGHT])
        else:
            xy = torch.tensor([tx * TILE + 3.0, ty * TILE + 3.0]) + 10.0 * torch.rand(n, 2, generator=g)
        r = torch.full((n,), radius, dtype=torch.int32) + (spread * torch.randint(0, 6, (n,), generator=g)).int()
        parts.append((xy, r))
    means2d = torch.cat([p[0] for p in parts])[None].float()
    radii = torch.cat([p[1] for p in parts])[None]
    radii[0, ::97] = 0
    depths = (1.0 + torch.randint(0, 50, (means2d.shape[1],), generator=g).float() * 0.25)[None]
    return means2d.contiguous(), radii.contiguous(), depths.contiguous()


def mask_of(ranges, size: int) -> torch.Tensor:
    m = torch.zeros(size, dtype=torch.bool)
    for a, b in ranges:
        m[a:b] = True
    return m


ROLE_OF_ARG = {i: role for role, (i, _) in isect.BIN_SORT_ROLES.items()}


def check_launches(access=isect.bin_sort_access, with_ids: bool = True, plan=((0, 1), (1, 2), (2, 3), (3, 1 << 30)),
                   merged: bool = False) -> list:  # fmt: skip
    """Runs the first isect_tiles_padded_fwd pass's bin_sort as the launches `plan` (merged: step 0, then every merge
    step in one launch) and returns what the kernel wrote outside `access`'s written ranges, or where a counted
    entry of a sentinel-filled buffer was not written ([] when the formula holds)."""
    problems, plans = [], [(0, 1), (1, 1 << 30)] if merged else list(plan)

    def observer(name, kernel, args, launch):
        if name != "bin_sort":
            return kernel(*args, **launch)
        args = list(args)
        lengths = isect.bin_lengths(args[2], int(args[9]))
        assert max(lengths) > 2 * BIN_CAPACITY and sum(lengths) < int(args[13])  # two merges; padding
        for lo, hi in plans:
            args[15], args[16] = lo, hi
            # buffers the launch does not read: the outputs, and the merge buffer the launch's first step writes
            fill = {"flatten_ids", "offsets", "bins"} | ({"isect_ids"} if with_ids else set())
            fill |= {"ranks2"} if lo == 0 or lo % 2 == 1 else {"ranks"}
            before = {}
            for i, role in ROLE_OF_ARG.items():
                t = args[i]
                if role == "isect_ids" and not with_ids:
                    continue  # ends stands in for it
                if role in fill:
                    t.fill_(SENTINEL)
                before[role] = t.clone()
            kernel(*args, **launch)
            written = access(lengths, int(args[13]), int(args[12]), lo, hi, with_ids)["write"]
            for role, old in before.items():
                t = args[isect.BIN_SORT_ROLES[role][0]]
                changed = (t != old).reshape(-1)
                counted = mask_of(written[role], changed.numel())
                outside = int((changed & ~counted).sum())
                if outside:
                    problems.append(f"steps [{lo}, {hi}): {outside} entries of {role} written outside the count")
                if role in fill and int((counted & ~changed).sum()):
                    problems.append(
                        f"steps [{lo}, {hi}): {role} counted {int(counted.sum())}, wrote {int(changed.sum())}"
                    )
        return None

    means2d, radii, depths = projected()
    caps = isect.IntersectionCapacities()
    previous = runtime.set_launch_observer(observer)
    try:
        isect.isect_tiles_padded_fwd(means2d, radii, depths, TILE, WIDTH // TILE, HEIGHT // TILE, caps,
                                     with_isect_ids=with_ids)  # fmt: skip
    finally:
        runtime.set_launch_observer(previous)
    return problems


@pytest.mark.parametrize("with_ids", [True, False])
def test_every_entry_bin_sort_writes_is_counted(with_ids):
    assert check_launches(with_ids=with_ids) == []


def test_merge_steps_in_one_launch_are_counted():
    assert check_launches(merged=True) == []


def no_merges(lengths, capacity, total, lo, hi, with_ids):  # planted: every tile sorted in one block
    return isect.bin_sort_access([min(n, BIN_CAPACITY) for n in lengths], capacity, total, lo, hi, with_ids)


def no_padding(lengths, capacity, total, lo, hi, with_ids):  # planted: the list taken as full
    return isect.bin_sort_access(lengths, sum(lengths), total, lo, hi, with_ids)


@pytest.mark.parametrize("planted", [no_merges, no_padding])
def test_a_wrong_formula_is_caught(planted):
    assert check_launches(planted)


def test_moved_bytes_are_the_counted_ranges():
    """bin_sort_moved_bytes (what the ledger adds up) is access_bytes of bin_sort_access: per entry under the
    capacity's shape, per tile under that of ends; a launch of merge steps only moves the long tiles' entries."""
    lengths = [0, 5, BIN_CAPACITY + 1, 3 * BIN_CAPACITY]
    cap, n, total = 20_000, len(lengths), 100
    ends = torch.tensor(lengths + [0, 0]).cumsum(0)
    args = [None, None, ends, None, None, None, None, None, None, n, n, 4, total, cap, 0, 1, 2, 0]
    moved, seen = isect.bin_sort_moved_bytes(args)
    assert seen == lengths
    long_entries = BIN_CAPACITY + 1 + 3 * BIN_CAPACITY
    # step 1: the two long tiles, read from ranks, depths gathered, written to ranks2 (the 3-block tile) or final
    per_entry = long_entries * 4 * 2 + 3 * BIN_CAPACITY * 4 + (BIN_CAPACITY + 1) * 4
    assert moved == {str(cap): per_entry, str(n + 2): n * 8}
    args[15], args[16] = 0, 1
    moved0, _ = isect.bin_sort_moved_bytes(args, lengths)
    E = sum(lengths)
    assert moved0[str(cap)] == E * 4 * 3 + (cap - E) * 4  # read, gathered, written back or final; the padding
    assert moved0[str(n + 2)] == n * 8 + (n + 1) * 4 + 2 * 4 + 8  # ends, offsets, bins' two words, cum's last
