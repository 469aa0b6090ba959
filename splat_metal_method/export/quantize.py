"""Helpers shared by the PlayCanvas formats (sog_file.py, compressed_ply_file.py): Morton order,
a 256-entry 1-D codebook and the k-means palette SOG stores spherical harmonics in.

Same input, same output, byte for byte: no random state outside a seeded generator, centroid sums
in float64 on the host (a GPU's atomic float adds would change the last bits from run to run), and
ties broken by index.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Tuple

import numpy as np

if TYPE_CHECKING:
    import torch

SEED = 0


def morton_order(means: np.ndarray) -> np.ndarray:
    """[N] indices sorting the gaussians along a 3-D Z-order curve (10 bits per axis over the
    bounding box; buckets of more than 256 equal codes are ordered again within their own box), as
    splat-transform orders before writing SOG and compressed .ply: neighbours in the file are
    neighbours in space, so per-chunk ranges are tight and the images compress."""
    means = np.asarray(means, np.float64)
    order = np.arange(len(means), dtype=np.int64)
    _morton_sort(means, order)
    return order


def _part1by2(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32) & np.uint32(0x3FF)
    x = (x ^ (x << np.uint32(16))) & np.uint32(0xFF0000FF)
    x = (x ^ (x << np.uint32(8))) & np.uint32(0x0300F00F)
    x = (x ^ (x << np.uint32(4))) & np.uint32(0x030C30C3)
    x = (x ^ (x << np.uint32(2))) & np.uint32(0x09249249)
    return x


def _morton_sort(means: np.ndarray, order: np.ndarray) -> None:  # sorts ``order`` in place
    if len(order) == 0:
        return
    p = means[order]
    lo, hi = p.min(axis=0), p.max(axis=0)
    extent = hi - lo
    if not np.all(np.isfinite(extent)) or not np.any(extent > 0):
        return
    mul = np.where(extent > 0, 1024 / np.where(extent > 0, extent, 1), 0)
    cell = np.minimum(1023, (p - lo) * mul).astype(np.uint32)
    code = (_part1by2(cell[:, 2]) << np.uint32(2)) + (_part1by2(cell[:, 1]) << np.uint32(1)) + _part1by2(cell[:, 0])
    perm = np.argsort(code, kind="stable")
    order[:] = order[perm]
    code = code[perm]
    starts = np.flatnonzero(np.r_[True, code[1:] != code[:-1]])
    ends = np.r_[starts[1:], len(code)]
    for s, e in zip(starts, ends):
        if e - s > 256:
            sub = order[s:e].copy()
            _morton_sort(means, sub)
            order[s:e] = sub


def codebook_1d(values: np.ndarray, k: int = 256) -> Tuple[np.ndarray, np.ndarray]:
    """A k-entry float32 codebook (ascending) for the pooled values (any shape), and each value's
    nearest entry (uint8 for k <= 256). The optimal weighted 1-D k-means of a histogram (dynamic
    programming over the sorted bins; splat-transform builds its codebooks the same way): 1024 bins
    placed between uniform and quantile positions, each weighing count^0.5, so that sparse tails
    (the largest scales, the most saturated colours) get entries of their own instead of all going
    to the dense middle. In float64 on the host whatever the run's device (1-D, a second or so)."""
    flat = np.asarray(values, np.float64).reshape(-1)
    if flat.size == 0:
        return np.zeros(k, np.float32), np.zeros(np.shape(values), np.uint8)
    data = np.sort(flat)
    n = data.size
    lo, hi = data[0], data[-1]
    if hi - lo < 1e-20:
        return np.full(k, lo, np.float32), np.zeros(np.shape(values), np.uint8)
    bins = min(1024, n)
    iqr = data[int(n * 0.75)] - data[int(n * 0.25)]
    beta = max(0.5, min(0.999, 1 - iqr / (hi - lo)))
    pos = beta * (np.arange(n) / n) + (1 - beta) * (data - lo) / (hi - lo)
    b = np.minimum(bins - 1, np.floor(bins * pos).astype(np.int64))
    counts = np.bincount(b, minlength=bins).astype(np.float64)
    sums = np.bincount(b, weights=data, minlength=bins)
    full = counts > 0
    centers, weights = sums[full] / counts[full], np.sqrt(counts[full])  # ascending
    centroids = centers if len(centers) <= k else _optimal_1d(centers, weights, k)
    book = np.unique(centroids.astype(np.float32))  # what the file holds
    book = np.concatenate([book, np.full(k - book.size, book[-1], np.float32)])  # pad: repeat the last
    return book, nearest_1d(book, values)


def _optimal_1d(x: np.ndarray, w: np.ndarray, k: int) -> np.ndarray:
    """The k means of contiguous groups of the sorted points x (weights w) that minimise the
    weighted squared error: exact, by dynamic programming over group ends (Lloyd's iterations get
    stuck with the tails under-served)."""
    h = len(x)
    pw, pwx, pwxx = (np.r_[0.0, np.cumsum(v)] for v in (w, w * x, w * x * x))
    j, a = np.arange(h)[:, None], np.arange(h)[None, :]  # [j, a]: the group of bins a..j (rows contiguous)
    sw = pw[j + 1] - pw[a]
    swx = pwx[j + 1] - pwx[a]
    cost = np.where(a <= j, (pwxx[j + 1] - pwxx[a]) - swx * swx / np.where(sw > 0, sw, 1), np.inf)
    best = cost[:, 0].copy()  # one group ending at j
    splits = np.zeros((k, h), np.int64)  # first bin of the last group
    total = np.empty_like(cost)
    rows = np.arange(h)
    for m in range(1, k):
        prev = np.r_[np.inf, best[:-1]]  # groups 0..m-1 end at a-1
        np.add(cost, prev[None, :], out=total)
        splits[m] = np.argmin(total, axis=1)
        best = total[rows, splits[m]]
    out, end = [], h - 1
    for m in range(k - 1, -1, -1):
        start = splits[m][end] if m > 0 else 0
        out.append((pwx[end + 1] - pwx[start]) / (pw[end + 1] - pw[start]))
        end = start - 1
    return np.array(out[::-1])


def nearest_1d(book: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of an ascending codebook for each value (ties: the lower one)."""
    b = book.astype(np.float64)
    v = np.asarray(values, np.float64)
    idx = np.clip(np.searchsorted(b, v, side="left"), 1, len(b) - 1)
    left, right = b[idx - 1], b[idx]
    pick = np.where(np.abs(v - left) <= np.abs(right - v), idx - 1, idx)
    return pick.astype(np.uint8 if len(b) <= 256 else np.int64)


def palette_size(n: int) -> int:
    """splat-transform's SH palette size for n gaussians: min(64, 2^floor(log2(n / 1024))) * 1024
    (65,536 from 65,536 gaussians on; the largest power of two <= n below that)."""
    if n <= 0:
        return 0
    return int(min(64.0, 2.0 ** np.floor(np.log2(n / 1024))) * 1024)


EXACT_LIMIT = 1 << 29  # N x k distances per iteration up to which the palette is exact k-means (N < 32,768)
BOUNDED_LIMIT = 1 << 32  # beyond, below this: exact k-means with bounds, to convergence (32,768 <= N < 65,536)
BOUNDED_ITERATIONS = 50  # at most, with the bounds (the run stops once no label changes)
MOVED_SHARE = 2  # the centroids measured exactly in the bounds' update: up to k / 2 that moved most
CELL_FACTOR = 4  # coarse cells: 4 sqrt(k) (1,024 for 65,536 entries, 64 entries each)
COARSE_SAMPLE = 32  # points per coarse cell its k-means trains on
CELL_ITERATIONS = 5  # k-means iterations within a cell
PROBES = 8  # nearest cells whose entries a cell's points are compared with in the refinement, at least
REFINE_DISTANCES = 1 << 26  # more probes while N x probed entries per iteration stays under this
REFINE_ITERATIONS = 4  # global Lloyd iterations after the two-level palette


class _Cpu:
    """Stands for torch.device("cpu") where the k-means runs on the CPU: the work is numpy's, and
    only ``device.type`` is read."""

    type = "cpu"


CPU = _Cpu()


def kmeans(
    points: np.ndarray,
    k: int,
    iterations: int = 10,
    device: Optional[torch.device] = None,
    seed: int = SEED,
    progress: Optional[Callable[[str, int, int], None]] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """k-means of [N, D] points into k centroids. Returns (centroids [k, D] float32, labels [N] int64);
    with N <= k every point is its own centroid. ``progress(step, done, total)`` is called as the
    work advances.

    Up to N x k = EXACT_LIMIT (2^29: every N below 32,768 with splat-transform's palette size, at
    most ~16 s of CPU): exact Lloyd iterations (``lloyd``). Below BOUNDED_LIMIT (2^32: every N
    below 65,536, whose palette is 32,768 entries): the same k-means with bounds that skip most distances after the first
    assignment, run to convergence (``lloyd_bounded``: exact k-means' error or less, ~2 full
    assignments). Beyond, the N x k distances per iteration are what make it slow (1.5M x 65,536 x
    45 dimensions: ~10^13 operations per iteration), and the palette is built as faiss trains its
    large inverted-file codebooks (faiss.contrib.clustering.two_level_clustering; Nistér & Stewénius
    2006), ``two_level``. Same points, same seed: same result, whatever the number of cores."""
    x = np.ascontiguousarray(points, np.float32)
    n = x.shape[0]
    if n <= k:
        return x.copy(), np.arange(n, dtype=np.int64)
    if device is None or (isinstance(device, str) and device == "cpu"):
        device = CPU  # numpy only: torch is not imported
    else:
        import torch

        device = torch.device(device)
    with _cpu_threads(device) as pool:
        if n * k <= EXACT_LIMIT:
            return lloyd(x, k, iterations, device, np.random.default_rng(seed), progress, pool)
        if n * k < BOUNDED_LIMIT:
            return lloyd_bounded(x, k, iterations, device, np.random.default_rng(seed), progress, pool)
        return two_level(x, k, iterations, device, seed, progress, pool)


@contextlib.contextmanager
def _cpu_threads(device: torch.device) -> Iterator[Optional[ThreadPoolExecutor]]:
    """A pool of one thread per core for the work on the CPU (numpy releases the GIL in its products
    and reductions), with the BLAS library itself held to one thread meanwhile: its own threads
    spin-wait between the many small products (measured: a third of the palette's CPU time, most
    of it in the kernel). None on a GPU (one queue; MPS is not safe from several threads)."""
    if device.type != "cpu":
        yield None
        return
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1, user_api="blas"), ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        yield pool


def lloyd(x: np.ndarray, k: int, iterations: int, device: torch.device, rng: np.random.Generator, progress=None,
          pool: Optional[ThreadPoolExecutor] = None):  # fmt: skip
    """Exact k-means: k distinct points drawn by ``rng`` as seeds, then ``iterations`` rounds of
    nearest-centroid assignment (the N x k distances, on ``device``; over ``pool`` when given) and
    centroid means (float64, on the host); an empty cluster is re-seeded with a drawn point.
    x [N, D] float32, N > k."""
    n = x.shape[0]
    centroids = x[np.sort(rng.permutation(n)[:k])]
    labels = np.zeros(n, np.int64)
    for it in range(iterations + 1):
        labels = nearest(x, centroids, device, pool=pool)[0]
        if it == iterations:
            break
        centroids = _means(x, labels, k, rng)
        if progress is not None:
            progress("k-means", it + 1, iterations)
    return centroids, labels


def lloyd_bounded(x: np.ndarray, k: int, iterations: int, device: torch.device, rng: np.random.Generator,
                  progress=None, pool: Optional[ThreadPoolExecutor] = None):  # fmt: skip
    """``lloyd``'s k-means (the same seeds, the same means, the same re-seeding of empty clusters),
    with the assignments after the first one pruned by bounds, as Hamerly's (Hamerly 2010): per
    point an upper bound on the distance to its centroid and a lower bound on the distance to every
    other one, moved each iteration by how far the centroids moved. Hamerly moves the lower bound by
    the largest move of all, which here is most points' whole margin (a few centroids move far:
    re-seeded, or a cluster that gained a point); instead the centroids that moved most (all that
    moved, up to k / MOVED_SHARE) are measured exactly, and only the rest's largest move comes off
    the bound. Only the points whose bounds still cross are compared with all k centroids again.

    Run past ``iterations`` until no label changes (at most BOUNDED_ITERATIONS): Lloyd's error
    never grows from one iteration to the next, so the result is exact k-means' (same seeds) or
    better, for about two full assignments: with N up to a few times k most clusters are one or two
    points, and from the second iteration on only a few centroids move. Same bytes on any number of
    threads (the points to compare again, and their blocks, do not depend on them). x [N, D] float32,
    N > k."""
    n = x.shape[0]
    centroids = x[np.sort(rng.permutation(n)[:k])]
    x_sq = (x.astype(np.float64) ** 2).sum(1)
    labels, upper, _, lower = _bounds(x, centroids, x_sq, device, pool)
    where = np.full(k, -1, np.int64)  # a centroid's place among the measured ones, or -1
    for it in range(1, max(iterations, BOUNDED_ITERATIONS) + 1):
        moved = _means(x, labels, k, rng)
        drift = np.sqrt(((moved.astype(np.float64) - centroids) ** 2).sum(1)) * (1 + 1e-6) + 1e-12
        drift[np.all(moved == centroids, axis=1)] = 0.0
        centroids = moved
        by_drift = np.argsort(-drift, kind="stable")
        measured = by_drift[: min(int((drift > 0).sum()), k // MOVED_SHARE)]
        rest = drift[by_drift[len(measured)]] if len(measured) < k else 0.0  # the largest unmeasured move
        upper += drift[labels]
        open_ = np.flatnonzero(upper > lower - drift[by_drift[0]])  # Hamerly's test fails
        lower[open_] -= rest
        if len(measured) and len(open_):  # their distances to the centroids that moved most, exactly
            where[measured] = np.arange(len(measured))
            near = _bounds(x[open_], centroids[measured], x_sq[open_], device, pool, where[labels[open_]])[2]
            where[measured] = -1
            lower[open_] = np.minimum(lower[open_], near)
        untouched = np.ones(n, bool)
        untouched[open_] = False
        lower[untouched] -= drift[by_drift[0]]
        open_ = open_[upper[open_] > lower[open_]]
        if len(open_):  # tighten the upper bound to the exact distance
            diff = (x[open_] - centroids[labels[open_]]).astype(np.float64)
            upper[open_] = np.sqrt((diff * diff).sum(1)) * (1 + 1e-6)
            open_ = open_[upper[open_] > lower[open_]]
        changed = 0
        if len(open_):  # compare with all k
            a, u, _, lo = _bounds(x[open_], centroids, x_sq[open_], device, pool)
            changed = int((a != labels[open_]).sum())
            labels[open_], upper[open_], lower[open_] = a, u, lo
        if progress is not None:
            progress("k-means", min(it, iterations), iterations)
        if it >= iterations and not changed:
            break
    return centroids, labels


def _bounds(x: np.ndarray, c: np.ndarray, x_sq: np.ndarray, device: torch.device,
            pool: Optional[ThreadPoolExecutor] = None, skip: Optional[np.ndarray] = None):  # fmt: skip
    """For each row of x [N, D]: its nearest row of c [M, D] (int64 [N]), an upper and a lower bound
    on the distance to it, and a lower bound on the distance to the second nearest (float64 [N],
    Euclidean, widened by the float32 products' rounding; x_sq [N] is |x|^2 in float64). With ``skip`` [N]
    (a row of c per point, -1 for none) that row is left out for that point. As ``nearest``: in
    chunks of at most 2^20 distances, over ``pool`` when given, the same bytes on any number of
    threads."""
    c_sq = (c * c).sum(1)
    c2 = c * np.float32(-2)  # (a power of two: x @ c2.T is -2 x @ c.T to the bit)
    step = max(1, (1 << 20) // c.shape[0])
    if device.type != "cpu":
        import torch

        cd, c_sq_d = torch.from_numpy(c2).to(device), torch.from_numpy(c_sq).to(device)

    def chunk(s: int):
        rows = np.arange(min(step, x.shape[0] - s))
        e = None if skip is None else skip[s : s + step]
        if device.type != "cpu":
            d = torch.addmm(c_sq_d, torch.from_numpy(x[s : s + step]).to(device), cd.T)
            if e is not None:
                d[torch.from_numpy(rows[e >= 0]).to(device), torch.from_numpy(e[e >= 0]).to(device)] = torch.inf
            v, i = torch.topk(d, min(2, c.shape[0]), dim=1, largest=False)
            v, i = v.cpu().numpy(), i[:, 0].cpu().numpy()
            return i, v[:, 0], (v[:, 1] if c.shape[0] > 1 else np.full(len(rows), np.inf, np.float32))
        d = x[s : s + step] @ c2.T  # [n, M] squared distances less |x|^2
        d += c_sq
        if e is not None:
            d[rows[e >= 0], e[e >= 0]] = np.inf
        i = np.argmin(d, axis=1)
        first = d[rows, i].copy()
        if c.shape[0] == 1:
            return i, first, np.full(len(rows), np.inf, np.float32)
        d[rows, i] = np.inf
        return i, first, d.min(axis=1)

    parts = list((map if pool is None else pool.map)(chunk, range(0, x.shape[0], step)))
    idx = np.concatenate([i for i, _, _ in parts]).astype(np.int64)
    first = np.concatenate([f for _, f, _ in parts]).astype(np.float64) + x_sq
    second = np.concatenate([t for _, _, t in parts]).astype(np.float64) + x_sq
    slack = 1e-5 * (x_sq + float(c_sq.max()))  # the float32 distances' error, generously
    bound = [np.sqrt(np.maximum(v, 0)) for v in (first + slack, first - slack, second - slack)]
    return idx, bound[0], bound[1], bound[2]


def _means(x: np.ndarray, labels: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """[k, D] float32 means of the points of each label (sums in float64, in the points' order); an
    empty label gets a point drawn by ``rng``."""
    counts = np.bincount(labels, minlength=k)
    if len(labels) <= 1 << 16:  # a cell's points: sorted by label and summed per run, one call for all D
        used = np.flatnonzero(counts)
        sums = np.zeros((k, x.shape[1]))
        sums[used] = np.add.reduceat(x[np.argsort(labels, kind="stable")].astype(np.float64),
                                     np.r_[0, np.cumsum(counts[used])[:-1]], axis=0)  # fmt: skip
    else:
        sums = np.stack([np.bincount(labels, weights=x[:, j], minlength=k) for j in range(x.shape[1])], 1)
    centroids = sums / np.maximum(counts, 1)[:, None]
    empty = np.flatnonzero(counts == 0)
    if len(empty):
        centroids[empty] = x[rng.integers(0, x.shape[0], len(empty))]
    return centroids.astype(np.float32)


def two_level(x: np.ndarray, k: int, iterations: int, device: torch.device, seed: int, progress=None,
              pool: Optional[ThreadPoolExecutor] = None):  # fmt: skip
    """k-means of x [N, D] into k entries for large N x k, as faiss trains large codebooks:

    1. k-means (``iterations``) of COARSE_SAMPLE points per cell into C = 4 sqrt(k) coarse cells;
       every point goes to its nearest cell (N x C distances, once); the points are then sorted by
       cell, so each cell's points are one contiguous block;
    2. in each cell, CELL_ITERATIONS of k-means of its points into its share of k (proportional
       to its size, as faiss's rebalancing);
    3. REFINE_ITERATIONS global Lloyd iterations in which the points of a cell are compared with the
       entries of the P cells nearest to it (its own included; an inverted file probed per cell,
       Jégou et al. 2011; P = PROBES, or more while N x P x k/C stays under REFINE_DISTANCES, i.e.
       where N is small): one dense distance block per cell, its points x its neighbours' entries,
       which moves points that the cell boundaries put with the wrong entries; then the final
       assignment the same way.

    Per point that is C + (CELL_ITERATIONS + 1) k/C + (REFINE_ITERATIONS + 1) P k/C distances
    instead of (iterations + 1) k: ~4,000 instead of 720,000 for 65,536 entries. Cells are
    independent (each has its own seeded generator), so they run on all cores and give the same
    result on any number of them. docs/export.md has the measured cost and error against exact
    k-means."""
    n = x.shape[0]
    cells = min(k, int(round(CELL_FACTOR * np.sqrt(k))))
    rng = np.random.default_rng(seed)
    sample = x[np.sort(rng.permutation(n)[: COARSE_SAMPLE * cells])]
    coarse = lloyd(sample, cells, iterations, device, rng, pool=pool)[0]
    cell = nearest(x, coarse, device, pool=pool)[0]  # [N] each point's nearest cell
    sizes = np.bincount(cell, minlength=cells)
    share = np.diff(np.r_[0, np.cumsum(sizes) * k // n])  # entries per cell, summing to k, <= its points
    first = np.r_[0, np.cumsum(share)]  # cell c owns entries first[c]..first[c+1]
    order = np.argsort(cell, kind="stable")  # points by cell, ascending within a cell
    xs = x[order]  # [N, D] cell c's points are xs[start[c]:start[c+1]]
    start = np.r_[0, np.cumsum(sizes)]
    probed = min(cells, max(PROBES, REFINE_DISTANCES // (n * k // cells)))
    probes = nearest(coarse, coarse, device, probed)[0]  # [C, P] each cell's nearest cells, itself first
    candidates = [np.concatenate([np.arange(first[d], first[d + 1]) for d in probes[c]]) for c in range(cells)]
    candidates = [cand if len(cand) else np.arange(k) for cand in candidates]  # (neighbours without entries)
    centroids = np.zeros((k, x.shape[1]), np.float32)
    sorted_labels = np.zeros(n, np.int64)
    done = [0]

    def fine(c: int) -> None:
        pts = xs[start[c] : start[c + 1]]
        if share[c] and len(pts) > share[c]:
            pts = lloyd(pts, share[c], CELL_ITERATIONS, device, np.random.default_rng([seed, c]))[0]
        centroids[first[c] : first[c + 1]] = pts[: share[c]]
        done[0] += 1
        if progress is not None and done[0] % 64 == 0:
            progress("SH palette, per cell", done[0], cells)

    def assign(c: int) -> None:  # cell c's points against its probed cells' entries; cells write apart
        if sizes[c]:
            arg = nearest(xs[start[c] : start[c + 1]], centroids[candidates[c]], device)[0]
            sorted_labels[start[c] : start[c + 1]] = candidates[c][arg]  # equal distances: the nearer cell's

    labels = np.zeros(n, np.int64)
    each = map if pool is None else pool.map
    list(each(fine, range(cells)))
    for it in range(REFINE_ITERATIONS + 1):
        list(each(assign, range(cells)))
        labels[order] = sorted_labels
        if it == REFINE_ITERATIONS:
            break
        centroids[:] = _means(x, labels, k, rng)
        if progress is not None:
            progress("SH palette, refining", it + 1, REFINE_ITERATIONS)
    return centroids, labels


def nearest(x: np.ndarray, c: np.ndarray, device: torch.device, k: int = 1,
            pool: Optional[ThreadPoolExecutor] = None) -> Tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """For each row of x [N, D], its nearest row of c [M, D]: (index [N] int64, squared distance
    less |x|^2 [N] float32); with k > 1, the k nearest indices [N, k], nearest first (no distances).
    In chunks of at most 2^20 distances (4 MB: they stay in the cache, and no large temporary is
    made), over ``pool`` when given; on the CPU with numpy (whose argmin is several times faster
    than torch's; the same bytes whatever the load or the number of threads), elsewhere with torch
    on ``device``."""
    c_sq = (c * c).sum(1)  # [M]
    step = max(1, (1 << 20) // c.shape[0])
    if device.type != "cpu":  # torch only here: on the CPU the distances are numpy's
        import torch

        cd, c_sq_d = torch.from_numpy(c).to(device), torch.from_numpy(c_sq).to(device)

    def chunk(s: int):
        if device.type == "cpu":
            d = x[s : s + step] @ c.T  # [n, M]; |x|^2 is the same for every centroid
            d *= -2
            d += c_sq
            if k == 1:
                i = np.argmin(d, axis=1)
                return i, np.take_along_axis(d, i[:, None], axis=1)[:, 0]
            part = np.argpartition(d, k - 1, axis=1)[:, :k]
            by_distance = np.argsort(np.take_along_axis(d, part, axis=1), axis=1, kind="stable")
            return np.take_along_axis(part, by_distance, axis=1), None
        d = torch.addmm(c_sq_d, torch.from_numpy(x[s : s + step]).to(device), cd.T, alpha=-2)
        if k == 1:
            v, i = torch.min(d, dim=1)
            return i.cpu().numpy(), v.cpu().numpy()
        return torch.topk(d, k, dim=1, largest=False).indices.cpu().numpy(), None

    parts = list((map if pool is None else pool.map)(chunk, range(0, x.shape[0], step)))
    idx = np.concatenate([i for i, _ in parts]).astype(np.int64)
    return idx, (np.concatenate([d for _, d in parts]) if k == 1 else np.zeros(0, np.float32))
