"""The backward's active (gaussian, simdgroup) groups in the row order (a simdgroup a 16x2 strip of pixels) and in
8x4 blocks (the default; msplat's order), counted under the emulator on garden's COLMAP points rendered as
gaussians (no training: knn scales, opacity 0.5), one camera at full size and at halves.

    SPLAT_METAL_GARDEN_POINTS=../shared/data/garden_points.npz python benchmarks/bench_pixel_order.py [--downscales 1 2 4]

One forward and backward (random output gradients, absgrad on) per size, in the row order, through the step
ledger, which counts each backward launch's groups in the block order too (rasterize_bwd.block_order_groups). The
share rows / blocks is what 8x4 blocks save: the backward's reductions and atomics are issued per group.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splat_metal_method.bench import scenes, step_ledger  # noqa: E402
from splat_metal_method.ops import rasterization  # noqa: E402
from splat_metal_method.ops.metal import variants  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--downscales", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args(argv)
    path = scenes.garden_points_path()
    if path is None:
        sys.exit("garden_points.npz not found: set SPLAT_METAL_GARDEN_POINTS")
    d = np.load(path)
    points = d["means3d"].astype(np.float32)  # [N, 3]
    n = len(points)
    means = torch.from_numpy(points)
    scales = torch.from_numpy(scenes._knn_scale(points).astype(np.float32))[:, None].repeat(1, 3)  # [N, 3]
    quats = torch.tensor([1.0, 0.0, 0.0, 0.0]).repeat(n, 1)  # [N, 4]
    opacities = torch.full((n,), 0.5)
    colors = torch.from_numpy(d["colors"].astype(np.float32))  # [N, 3]
    colors = colors / 255.0 if colors.max() > 1 else colors
    viewmats = torch.from_numpy(d["viewmats"][:1].astype(np.float32))  # [1, 4, 4]
    variants.PIXEL_ORDER = "rows"
    print("| garden points, one camera | intersections | groups, rows | groups, 8x4 blocks | rows / blocks |")
    print("|---|---:|---:|---:|---:|")
    for down in args.downscales:
        Ks = torch.from_numpy(d["Ks"][:1].astype(np.float32)).clone()  # [1, 3, 3]
        Ks[:, :2] /= down
        width, height = int(d["width"]) // down, int(d["height"]) // down
        leaves = [t.clone().requires_grad_(True) for t in (means, quats, scales, opacities, colors)]
        t0 = time.perf_counter()
        with step_ledger.count("pixel order") as led:
            render, alpha, meta = rasterization(*leaves, viewmats, Ks, width, height, absgrad=True, backend="metal")
            g = torch.Generator().manual_seed(0)
            ((render * torch.randn(render.shape, generator=g)).sum()
             + (alpha * torch.randn(alpha.shape, generator=g)).sum()).backward()  # fmt: skip
        bwd = led.kernels["rasterize_bwd"]
        print(f"| {n:,} at {width}x{height} | {meta['flatten_ids'].numel():,} | {bwd.active_groups:,} | "
              f"{bwd.block_order_groups:,} | {bwd.active_groups / bwd.block_order_groups:.3f} |  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
