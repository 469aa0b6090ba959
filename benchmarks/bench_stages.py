"""Per-stage and full-step timings of every backend, side by side in one process.

    python benchmarks/bench_stages.py                       # all CPU-capable backends, default sweep
    python benchmarks/bench_stages.py --device mps --backends metal reference
    python benchmarks/bench_stages.py --quick               # a short sweep (smoke run)

For each scene (garden cameras at several gaussian counts and resolutions, plus a synthetic
scene) it times, per backend: project, SH, intersect + sort, rasterize forward, rasterize
backward, and one full training-like step (forward + backward through the public op). Backends
alternate within each repetition so machine noise hits them alike; the median is reported.
Writes benchmarks/results/stages.csv and stages.png (time vs N, per stage and backend), and
prints ratios against the reference.
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).parent / "results"
GARDEN = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "garden_points.npz"


def sync(device):
    if device.type == "mps":
        torch.mps.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize()


def garden_scene(n: int, scale_px: float, device, downscale: int = 1, seed: int = 0):
    """n points of the real garden scene (repeated with jitter beyond its 138k points), small
    isotropic scales, random opacities; the 3 real cameras, optionally downscaled."""
    data = np.load(GARDEN)
    g = torch.Generator().manual_seed(seed)
    pts = torch.from_numpy(data["means3d"]).float()
    idx = torch.randint(0, pts.shape[0], (n,), generator=g)
    means = pts[idx] + torch.randn(n, 3, generator=g) * 0.01  # jitter separates repeated points
    scales = torch.full((n, 3), scale_px)
    Ks = torch.from_numpy(data["Ks"]).float().clone()
    Ks[:, :2] /= downscale
    W, H = int(data["width"]) // downscale, int(data["height"]) // downscale
    scene = dict(
        means=means,
        quats=torch.randn(n, 4, generator=g),
        scales=scales,
        opacities=torch.rand(n, generator=g) * 0.7 + 0.2,
        coeffs=torch.randn(n, 16, 3, generator=g) * 0.2,
        viewmats=torch.from_numpy(data["viewmats"]).float(),
        Ks=Ks,
    )
    return {k: v.to(device) for k, v in scene.items()}, W, H


def time_backend(backend: str, scene, W, H, device):
    """Seconds per stage for one backend on one scene (one camera at a time, like training)."""
    from splat_metal_method.ops import backend_module, rasterization

    out = {}
    viewmats, Ks = scene["viewmats"][:1], scene["Ks"][:1]
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in scene.items() if k not in ("Ks",)}

    def clock(fn):
        sync(device)
        t = time.perf_counter()
        r = fn()
        sync(device)
        return r, time.perf_counter() - t

    if backend != "gsplat":
        ops = backend_module(backend)
        proj, out["project"] = clock(lambda: ops.project(leaves["means"], leaves["quats"], leaves["scales"],
                                                         leaves["viewmats"][:1], Ks, W, H))  # fmt: skip
        radii, means2d, depths, conics, _ = proj
        campos = torch.linalg.inv(viewmats)[:, :3, 3]
        dirs = leaves["means"][None] - campos[:, None]
        colors, out["sh"] = clock(lambda: ops.spherical_harmonics(3, dirs, leaves["coeffs"][None], radii > 0))
        tw, th = -(-W // 16), -(-H // 16)
        (tiles, ids, flat), out["isect+sort"] = clock(lambda: ops.isect_tiles(means2d, radii, depths, 16, tw, th))
        offsets = ops.isect_offset_encode(ids, 1, tw, th)
        opac = leaves["opacities"][None]
        (img, alpha), out["raster fwd"] = clock(
            lambda: ops.rasterize_to_pixels(means2d, conics, colors, opac, W, H, 16, offsets, flat)
        )
        _, out["raster bwd"] = clock(lambda: (img.sum() + alpha.sum()).backward())
        out["intersections"] = ids.numel()

    def step():
        c, a, _ = rasterization(leaves["means"], leaves["quats"], leaves["scales"], leaves["opacities"],
                                leaves["coeffs"], leaves["viewmats"][:1], Ks, W, H, sh_degree=3,
                                absgrad=True, backend=backend)  # fmt: skip
        (c.mean() + a.mean()).backward()

    _, out["train step"] = clock(step)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backends", nargs="+", default=None)
    parser.add_argument("--counts", nargs="+", type=int, default=[10_000, 30_000, 100_000])
    parser.add_argument("--downscales", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one small scene, one repeat")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.quick:
        args.counts, args.downscales, args.repeats = [5_000], [4], 1
    if args.backends is None:
        args.backends = {"cpu": ["metal", "reference"], "mps": ["metal", "reference"], "cuda": ["gsplat", "reference"]}[
            device.type
        ]

    from rich.progress import track

    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, device {device}")  # fmt: skip
    rows = []
    jobs = [(n, d) for n in args.counts for d in args.downscales]
    for n, d in track(jobs, description="benchmarking"):
        scene, W, H = garden_scene(n, 0.02, device, downscale=d)
        samples = {b: [] for b in args.backends}
        for b in args.backends:  # warm-up: compile kernels, allocate
            time_backend(b, scene, W, H, device)
        for _ in range(args.repeats):
            for b in args.backends:
                samples[b].append(time_backend(b, scene, W, H, device))
        for b, runs in samples.items():
            row = {"backend": b, "gaussians": n, "width": W, "height": H}
            for key in runs[0]:
                row[key] = statistics.median(r[key] for r in runs)
            rows.append(row)

    RESULTS.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with open(RESULTS / "stages.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)

    print(f"{'scene':>22} {'backend':>10} " + " ".join(f"{k:>12}" for k in keys[4:]) + "  step vs reference")
    for r in rows:
        ref = next(x for x in rows if x["backend"] == "reference" and x["gaussians"] == r["gaussians"]
                   and x["width"] == r["width"]) if "reference" in args.backends else None  # fmt: skip
        ratio = f"{ref['train step'] / r['train step']:.1f}x faster" if ref else ""
        cells = " ".join(f"{r.get(k, float('nan')):>12.4f}" if k != "intersections" else f"{int(r.get(k, 0)):>12d}"
                         for k in keys[4:])  # fmt: skip
        print(f"{r['gaussians']:>8} @ {r['width']}x{r['height']:<8} {r['backend']:>10} {cells}  {ratio}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [k for k in ("project", "sh", "isect+sort", "raster fwd", "raster bwd", "train step") if k in keys]
    fig, axes = plt.subplots(1, len(stages), figsize=(4 * len(stages), 3.5))
    for ax, stage in zip(np.atleast_1d(axes), stages):
        for b in args.backends:
            for size in sorted({(r["width"], r["height"]) for r in rows}):
                pts = [(r["gaussians"], r[stage]) for r in rows if r["backend"] == b and (r["width"], r["height"]) == size]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{b} {size[0]}x{size[1]}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(stage)
        ax.set_xlabel("gaussians")
    np.atleast_1d(axes)[0].set_ylabel("seconds")
    np.atleast_1d(axes)[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "stages.png", dpi=100)
    print(f"wrote {RESULTS / 'stages.csv'} and {RESULTS / 'stages.png'}")


if __name__ == "__main__":
    main()
