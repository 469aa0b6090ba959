"""Per-stage and full-step timings of every backend, side by side in one process.

    python benchmarks/bench_stages.py                       # cpu, emulated metal, reference; 10k..1M
    python benchmarks/bench_stages.py --device mps --backends metal reference
    python benchmarks/bench_stages.py --quick               # a short sweep (smoke run)

For each scene (the real garden points and cameras at several gaussian counts and resolutions) it
times, per backend: project, SH, intersect + sort, rasterize forward, rasterize backward, one full
training-like step (forward + backward through the public op) and that step's peak memory above
what was in use before it (CPU: C-heap bytes in use, sampled every millisecond; CUDA:
max_memory_allocated; MPS: driver memory after the step).
Backends alternate within each repetition so machine noise hits them alike; the median is
reported. Backends listed in --slow (default: reference, metal, whose step at 1M gaussians takes
minutes on a laptop CPU) only run up to --slow-max gaussians. Writes benchmarks/results/stages.csv
and stages.png (time vs N per stage and backend, plus peak memory), and prints ratios against the
reference.
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import threading
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


def _cpu_bytes_in_use() -> int:
    """Bytes of the C heap in use (glibc mallinfo2: where CPU tensors live); the resident set size
    where that is unavailable (macOS), which misses memory the allocator reuses."""
    from splat_metal_method.engine.memory import malloc_stats, process_rss

    heap = malloc_stats()
    return heap[0] if heap is not None else (process_rss() or 0)


def peak_memory(fn, device):
    """Runs fn(); returns (result, peak bytes above the memory in use when it started)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        r = fn()
        torch.cuda.synchronize()
        return r, torch.cuda.max_memory_allocated() - base
    if device.type == "mps":
        base = torch.mps.driver_allocated_memory()
        r = fn()
        torch.mps.synchronize()
        return r, torch.mps.driver_allocated_memory() - base
    base, peak, done = _cpu_bytes_in_use(), [0], threading.Event()

    def sample():  # every millisecond; a peak between two samples is missed
        while not done.is_set():
            peak[0] = max(peak[0], _cpu_bytes_in_use())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        r = fn()
    finally:
        done.set()
        sampler.join()
    return r, max(peak[0], _cpu_bytes_in_use()) - base


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
    _, peak = peak_memory(step, device)
    out["peak MB"] = peak / 2**20
    return out


def backends_for(args, n: int):
    return [b for b in args.backends if b not in args.slow or n <= args.slow_max]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backends", nargs="+", default=None)
    parser.add_argument("--counts", nargs="+", type=int, default=[10_000, 30_000, 100_000, 300_000, 1_000_000])
    parser.add_argument("--slow", nargs="+", default=["reference", "metal"], help="backends capped at --slow-max")
    parser.add_argument("--slow-max", type=int, default=100_000)
    parser.add_argument("--downscales", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one small scene, one repeat")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.quick:
        args.counts, args.downscales, args.repeats = [5_000], [4], 1
    if args.backends is None:
        args.backends = {"cpu": ["cpu", "metal", "reference"], "mps": ["metal", "reference"],
                         "cuda": ["gsplat", "reference"]}[device.type]  # fmt: skip

    from rich.progress import Progress, TextColumn

    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, device {device}")  # fmt: skip
    rows = []
    jobs = [(n, d) for n in args.counts for d in args.downscales]
    total = sum(len(backends_for(args, n)) * (args.repeats + 1) for n, _ in jobs)
    with Progress(*Progress.get_default_columns(), TextColumn("{task.fields[what]}")) as progress:
        task = progress.add_task("benchmarking", total=total, what="")
        for n, d in jobs:
            scene, W, H = garden_scene(n, 0.02, device, downscale=d)
            backends = backends_for(args, n)
            samples = {b: [] for b in backends}
            for rep in range(args.repeats + 1):  # repetition 0 is the warm-up: builds kernels, allocates
                for b in backends:
                    progress.update(task, what=f"{b} {n:,} @ {W}x{H}")
                    r = time_backend(b, scene, W, H, device)
                    if rep:
                        samples[b].append(r)
                    progress.advance(task)
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
        ref = next((x for x in rows if x["backend"] == "reference" and x["gaussians"] == r["gaussians"]
                    and x["width"] == r["width"]), None)  # fmt: skip
        ratio = f"{ref['train step'] / r['train step']:.1f}x faster" if ref else ""
        cells = " ".join(f"{r.get(k, float('nan')):>12.4f}" if k != "intersections" else f"{int(r.get(k, 0)):>12d}"
                         for k in keys[4:])  # fmt: skip
        print(f"{r['gaussians']:>8} @ {r['width']}x{r['height']:<8} {r['backend']:>10} {cells}  {ratio}")

    print("\nscaling (train step time per intersection, per backend; flat = linear in intersections):")
    for b in args.backends:
        pts = [r for r in rows if r["backend"] == b and r.get("intersections")]
        if pts:
            print(
                f"  {b:>10}: "
                + ", ".join(
                    f"{r['gaussians']:,}@{r['width']}x{r['height']}: "
                    f"{1e9 * r['train step'] / r['intersections']:.0f} ns"
                    for r in pts
                )
            )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_stages = ("project", "sh", "isect+sort", "raster fwd", "raster bwd", "train step", "peak MB")
    stages = [k for k in all_stages if k in keys]
    fig, axes = plt.subplots(1, len(stages), figsize=(4 * len(stages), 3.5))
    for ax, stage in zip(np.atleast_1d(axes), stages):
        for b in args.backends:
            for size in sorted({(r["width"], r["height"]) for r in rows}):
                pts = [
                    (r["gaussians"], r[stage]) for r in rows if r["backend"] == b and (r["width"], r["height"]) == size
                ]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{b} {size[0]}x{size[1]}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(stage)
        ax.set_xlabel("gaussians")
    np.atleast_1d(axes)[0].set_ylabel("seconds (peak MB: megabytes)")
    np.atleast_1d(axes)[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "stages.png", dpi=100)
    print(f"wrote {RESULTS / 'stages.csv'} and {RESULTS / 'stages.png'}")


if __name__ == "__main__":
    main()
