"""The .sog's SH palette (export/quantize.py ``kmeans``): exact k-means (``lloyd``, 10 iterations), the
palette the export builds at that size (``kmeans`` as it is: ``lloyd`` below 2^29 N x k, the bounded
exact k-means ``lloyd_bounded`` below 2^33, ``two_level`` beyond) and the two-level palette, on the
same SH vectors: relative RMS error and CPU seconds (of the process: the load of a shared machine
does not change them much; wall seconds are printed too).

    python benchmarks/bench_palette.py 40000:32768 70000:65536 1500000:65536 [--no-exact-above 140000]
    python benchmarks/bench_palette.py --checkpoint outputs/.../nerfstudio_models/step-000000999.ckpt

The SH vectors: bands 1-3 (45 values, channel-major) as bench_export_scale.py makes them (4,096
shared "materials", Laplace, per band 0.12 / 0.06 / 0.03, the channels alike, times a per-gaussian
gain, plus a per-gaussian Laplace part at 0.3 of that scale), --seed 0 (docs/export.md's 30,000-point
row: --seed 3), or with --checkpoint the SH of a trained run's checkpoint (the gaussians the export
keeps: opacity >= 1/255) into the export's palette size. Exact k-means at 1.5M is ~10^14 operations:
skipped above --no-exact-above points.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

SH_SCALE = np.array([0.12] * 3 + [0.06] * 5 + [0.03] * 7)  # per coefficient of bands 1-3


def sh_vectors(n: int, seed: int) -> np.ndarray:  # [N, 45] channel-major
    rng = np.random.default_rng(seed)
    rng.normal(size=(max(1, n // 2000), 3))  # (the positions the generator draws first)
    rng.integers(0, max(1, n // 2000), n)
    rng.normal(size=(n, 3))
    materials = rng.laplace(size=(4096, 15, 1)) * SH_SCALE[:, None]
    rest = materials[rng.integers(0, 4096, n)] * (1 + 0.2 * rng.normal(size=(n, 1, 3)))
    rest = rest + rng.laplace(size=(n, 15, 3)) * 0.3 * SH_SCALE[:, None]  # [N, 15, 3]
    return rest.transpose(0, 2, 1).reshape(n, -1).astype(np.float32)


def checkpoint_sh(path: str) -> np.ndarray:  # [N, 45] channel-major, the gaussians the export keeps
    import torch

    state = torch.load(path, map_location="cpu", mmap=True)["pipeline"]
    rest = state["_model.gauss_params.features_rest"].numpy()  # [N, 15, 3]
    keep = state["_model.gauss_params.opacities"].numpy()[:, 0] >= -5.5373  # opacity >= 1/255
    return np.ascontiguousarray(rest[keep].transpose(0, 2, 1).reshape(int(keep.sum()), -1), np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="*", help="points:palette, e.g. 40000:32768")
    parser.add_argument("--checkpoint", help="a trained run's step-*.ckpt: its SH instead of generated ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-exact-above", type=int, default=140_000)
    args = parser.parse_args()
    from splat_metal_method.export import quantize

    print("| points → palette | exact k-means | the export's palette | two-level palette |\n|---|---:|---:|---:|")
    rows = [(None, None)] if args.checkpoint else [tuple(map(int, size.split(":"))) for size in args.sizes]
    for n, k in rows:
        x = sh_vectors(n, args.seed) if n else checkpoint_sh(args.checkpoint)
        if k is None:
            n, k = len(x), quantize.palette_size(len(x))
        cells = []
        limits = quantize.EXACT_LIMIT, quantize.BOUNDED_LIMIT
        for mode, exact, bounded in (("exact", 1 << 62, 1 << 62), ("export", *limits), ("two-level", 0, 0)):
            if mode == "exact" and n > args.no_exact_above:
                cells.append("not run")
                continue
            quantize.EXACT_LIMIT, quantize.BOUNDED_LIMIT = exact, bounded
            wall, cpu = time.perf_counter(), time.process_time()
            centroids, labels = quantize.kmeans(x, k, 10)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            rel = float(np.sqrt(((centroids[labels] - x) ** 2).sum() / (x**2).sum()))
            tier = 0 if n <= k else 1 if n * k <= exact else 2 if n * k < bounded else 3
            path = f"{('copy', 'exact', 'bounded', 'two-level')[tier]}, " if mode == "export" else ""
            cells.append(f"{rel:.4f} ({path}{cpu:.1f} s CPU, {wall:.1f} s wall)")
        quantize.EXACT_LIMIT, quantize.BOUNDED_LIMIT = limits
        print(f"| {n:,} → {k:,} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
