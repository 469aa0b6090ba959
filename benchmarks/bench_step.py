"""Time per training-like step (forward + backward through the public op), per backend, side by side.

One step = what splatfacto asks of the op layer per iteration: render ONE camera with SH colors (degree 3),
render_mode="RGB+ED", absgrad=True and a background, loss = mean of the RGB image, backward to
every input (means, quats, scales, opacities, SH coefficients, viewmats, background).

Scenes:
  demo       synthetic, ~2k gaussians, 96x72 (a small demo-like scene)
  garden10k  the real garden points, 10k subsampled, kNN scales, the 3 real cameras at 648x420
  garden100k the same with 100k points

Usage:  python benchmarks/bench_step.py [--backends reference cpu] [--scenes demo garden10k garden100k] [--steps 3]
Backends alternate step by step so machine noise hits them alike; the table shows each backend's
median and its speed-up over the first backend. Writes a CSV to benchmarks/results/ (git-ignored).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the shared scene generators
sys.path.insert(0, str(ROOT))

from scenes import GARDEN_PATH, Scene, garden_scene, load_garden, random_scene  # noqa: E402

from splat_metal_method.ops import rasterization  # noqa: E402

SH_DEGREE = 3


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "loadavg_1m": round(os.getloadavg()[0], 2),  # other work on the machine skews the numbers
    }


def with_sh(scene: Scene, seed: int = 0) -> Scene:
    """Colors -> SH coefficients [N,16,3] (DC from the color, small random higher bands)."""
    g = torch.Generator().manual_seed(seed)
    rgb = scene.colors[:, :3]
    coeffs = 0.05 * torch.randn(scene.N, (SH_DEGREE + 1) ** 2, 3, generator=g, dtype=rgb.dtype)
    coeffs[:, 0] = (rgb - 0.5) / 0.28209479177387814
    scene.colors, scene.sh_degree = coeffs, SH_DEGREE
    return scene


def make_scenes(names):
    out = {}
    if "demo" in names:
        out["demo"] = with_sh(random_scene(n=2000, C=1, width=96, height=72, seed=0, scale_range=(0.01, 0.08)))
    garden_names = [n for n in names if n.startswith("garden")]
    if garden_names:
        garden = load_garden()
        if garden is None:
            print(f"garden data not found at {GARDEN_PATH}: skipping {garden_names}")
        else:
            for name in garden_names:
                n = int(name[len("garden") :].replace("k", "000"))
                out[name] = with_sh(garden_scene(garden, n=n, seed=0))
    return out


def step(scene: Scene, cam: int, backend: str) -> dict:
    """One training-like step on camera ``cam``; returns timings (s) and sizes."""
    leaves = {
        k: v.detach().clone().requires_grad_()
        for k, v in dict(means=scene.means, quats=scene.quats, scales=scene.scales, opacities=scene.opacities,
                         colors=scene.colors).items()
    }  # fmt: skip
    viewmats = scene.viewmats[cam : cam + 1].clone().requires_grad_()
    backgrounds = torch.ones(1, 3, requires_grad=True)
    t0 = time.perf_counter()
    colors, alphas, meta = rasterization(
        **leaves, viewmats=viewmats, Ks=scene.Ks[cam : cam + 1], width=scene.width, height=scene.height,
        sh_degree=scene.sh_degree, backgrounds=backgrounds, render_mode="RGB+ED", absgrad=True,
        backend=backend,
    )  # fmt: skip
    meta["means2d"].retain_grad()
    loss = colors[..., :3].mean()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    assert torch.isfinite(leaves["means"].grad).all()
    return {
        "forward_s": t1 - t0,
        "backward_s": t2 - t1,
        "step_s": t2 - t0,
        "visible": int((meta["radii"] > 0).sum()),
        "intersections": int(meta["isect_ids"].numel()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["reference", "cpu"])
    parser.add_argument("--scenes", nargs="+", default=["demo", "garden10k", "garden100k"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per scene (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    info = machine_info()
    print("splat-metal training-step benchmark: " + " vs ".join(args.backends))
    for k, v in info.items():
        print(f"  {k:14s} {v}")
    print("  step           1 camera, SH degree 3, RGB+ED, absgrad, background; loss = RGB mean; backward\n")

    rows = []
    header = f"{'scene':11s} {'gaussians':>9s} {'size':>8s} {'isects':>9s} {'backend':>10s} " \
             f"{'forward s':>10s} {'backward s':>10s} {'step s':>8s}  vs {args.backends[0]}"  # fmt: skip
    print(header)
    print("-" * len(header))
    for name, scene in make_scenes(args.scenes).items():
        samples = {b: [] for b in args.backends}
        for b in args.backends:
            step(scene, 0, b)  # warm-up (builds the native library, caches)
        for i in range(args.steps):
            for b in args.backends:  # alternate: noise hits every backend alike
                samples[b].append(step(scene, i % scene.C, b))  # cycles through the cameras
        base = None
        for b, runs in samples.items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            base = base or med["step_s"]
            row = {
                "scene": name, "backend": b, "gaussians": scene.N, "width": scene.width, "height": scene.height,
                "visible": int(med["visible"]), "intersections": int(med["intersections"]),
                "forward_s": round(med["forward_s"], 4), "backward_s": round(med["backward_s"], 4),
                "step_s": round(med["step_s"], 4), "speedup": round(base / med["step_s"], 2), "steps": args.steps,
                "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                **info,
            }  # fmt: skip
            rows.append(row)
            print(
                f"{name:11s} {scene.N:9d} {f'{scene.width}x{scene.height}':>8s} {row['intersections']:9d} {b:>10s} "
                f"{row['forward_s']:10.3f} {row['backward_s']:10.3f} {row['step_s']:8.3f}  {row['speedup']:.1f}x",
                flush=True,
            )
    print(f"\n(median of {args.steps} steps after a warm-up; max RSS {rows[-1]['max_rss_mb'] if rows else 0} MB)")

    if rows:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"bench_step_{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
