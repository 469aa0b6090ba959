"""Helpers shared by the PlayCanvas formats (sog_file.py, compressed_ply_file.py): Morton order,
a 256-entry 1-D codebook and the k-means palette SOG stores spherical harmonics in.

Same input, same output, byte for byte: no random state outside a seeded generator, centroid sums
in float64 on the host (a GPU's atomic float adds would change the last bits from run to run), and
ties broken by index.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
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


def kmeans(
    points: np.ndarray, k: int, iterations: int = 10, device: Optional[torch.device] = None, seed: int = SEED
) -> Tuple[np.ndarray, np.ndarray]:
    """k-means of [N, D] points into k centroids: assignment (the N x k distances, the costly part)
    on ``device``, centroid means in float64 on the host. Seeds: k distinct points drawn by a
    generator seeded with ``seed``; an empty cluster is re-seeded with a drawn point. Returns
    (centroids [k, D] float32, labels [N] int64). With N <= k every point is its own centroid."""
    x = np.ascontiguousarray(points, np.float32)
    n, d = x.shape
    if n <= k:
        return x.copy(), np.arange(n, dtype=np.int64)
    device = torch.device("cpu") if device is None else torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    centroids = x[torch.randperm(n, generator=gen)[:k].numpy()].astype(np.float64)
    xd = torch.from_numpy(x).to(device)
    x64 = x.astype(np.float64)
    labels = np.zeros(n, np.int64)
    for it in range(iterations + 1):
        labels = _assign(xd, torch.from_numpy(centroids.astype(np.float32)).to(device))
        if it == iterations:
            break
        counts = np.bincount(labels, minlength=k)
        sums = np.zeros((k, d))
        for j in range(d):
            sums[:, j] = np.bincount(labels, weights=x64[:, j], minlength=k)
        empty = np.flatnonzero(counts == 0)
        centroids = sums / np.maximum(counts, 1)[:, None]
        if len(empty):
            centroids[empty] = x64[torch.randint(n, (len(empty),), generator=gen).numpy()]
    return centroids.astype(np.float32), labels


def _assign(x: torch.Tensor, c: torch.Tensor) -> np.ndarray:
    """Nearest centroid per point, in chunks of at most 2^24 distances."""
    c_sq = (c * c).sum(1)
    step = max(1, (1 << 24) // c.shape[0])
    out = []
    for s in range(0, x.shape[0], step):
        xs = x[s : s + step]
        dist = c_sq[None, :] - 2 * (xs @ c.T)  # |x|^2 is the same for every centroid
        out.append(torch.argmin(dist, dim=1).cpu())
    return torch.cat(out).numpy().astype(np.int64)
