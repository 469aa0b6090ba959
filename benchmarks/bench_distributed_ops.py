"""ops.distributed_rasterization vs world size on CPU (gloo): what each rank holds, what crosses ranks
per step, and each rank's CPU time per step.

    python benchmarks/bench_distributed_ops.py                     # garden, 20k gaussians, worlds 1 2 3 4
    python benchmarks/bench_distributed_ops.py --n 100000 --worlds 1 2 --scale 0.5

The garden points (../shared/data, docs/design.md section 5; a random scene when absent) are split into equal
contiguous shards; rank r renders garden camera r mod 3 (so the batch grows with the world, as in
distributed training: one camera per rank per step), SH degree 3, absgrad on (splatfacto's defaults),
cpu backend, one thread per process. Per world size it prints the gaussian parameter bytes per rank,
the forward all-to-all bytes per rank (meta["all_to_all_bytes"], measured: pairs sent to and received
from other ranks), the backward bytes (the same pairs' gradients: 9 + D floats a pair with absgrad,
computed from the forward count) and the median CPU time of one forward + backward per rank
(time.process_time: robust to other load; wall time on a 2-core machine shared by up to 4 processes
says nothing about scaling).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from scenes import garden_scene, load_garden, random_scene  # noqa: E402

from splat_metal_method.ops import distributed_rasterization  # noqa: E402

SH_DEGREE = 3
D = 3  # colour channels sent per pair (SH evaluated on the owner)


def scene(n: int, scale: float):
    garden = load_garden()
    s = garden_scene(garden, n=n) if garden is not None else random_scene(n=n, C=3, width=648, height=420, extent=2.0)
    g = torch.Generator().manual_seed(0)
    sh = 0.1 * torch.randn(s.N, (SH_DEGREE + 1) ** 2, 3, generator=g)
    sh[:, 0] = (s.colors - 0.5) / 0.28209479177387814  # the DC term gives the points' colours
    Ks = s.Ks.clone()
    Ks[:, :2] *= scale
    return s, sh, Ks, round(s.width * scale), round(s.height * scale), garden is not None


def worker(rank: int, world: int, init_file: str, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    s, sh, Ks, width, height, _ = scene(args.n, args.scale)
    lo, hi = rank * s.N // world, (rank + 1) * s.N // world
    params = {k: v[lo:hi].clone().requires_grad_(True) for k, v in
              (("means", s.means), ("quats", s.quats), ("scales", s.scales), ("opacities", s.opacities),
               ("colors", sh))}  # fmt: skip
    cam = rank % s.C
    viewmats, K = s.viewmats[cam : cam + 1].clone().requires_grad_(True), Ks[cam : cam + 1]
    times, moved = [], []
    for step in range(args.steps + 1):
        t = time.process_time()
        colors, alphas, meta = distributed_rasterization(
            **params, viewmats=viewmats, Ks=K, width=width, height=height, sh_degree=SH_DEGREE, absgrad=True,
            backend="cpu",
        )  # fmt: skip
        (colors.square().mean() + alphas.mean()).backward()
        if step:  # the first step is a warm-up
            times.append(time.process_time() - t)
            moved.append(meta["all_to_all_bytes"])
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    row = (param_bytes, statistics.median(moved), statistics.median(times))
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20_000, help="gaussians in the whole scene")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--scale", type=float, default=0.5, help="image scale of the garden's 648x420 cameras")
    args = parser.parse_args()
    _, _, _, width, height, real = scene(args.n, args.scale)
    print(f"{'garden' if real else 'random scene'}: {args.n:,} gaussians, SH {SH_DEGREE}, one {width}x{height} "
          f"camera per rank, cpu backend, 1 thread per process, median of {args.steps} steps")  # fmt: skip
    print(f"{'world':>5} {'gaussian MB/rank':>17} {'a2a fwd MB/rank':>16} {'a2a bwd MB/rank':>16} "
          f"{'fwd+bwd CPU s/rank':>19}")  # fmt: skip
    ctx = mp.get_context("spawn")
    for world in args.worlds:
        out = ctx.SimpleQueue()
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(world, f"{tmp}/init", args, out), nprocs=world)
        rows = out.get()
        params = statistics.mean(r[0] for r in rows) / 1e6
        fwd = statistics.mean(r[1] for r in rows) / 1e6
        bwd = fwd * (7 + D + 2) / (8 + D)  # the pairs' gradients (+ absgrad) return: computed, not measured
        cpu = statistics.mean(r[2] for r in rows)
        print(f"{world:>5} {params:>17.2f} {fwd:>16.2f} {bwd:>16.2f} {cpu:>19.3f}")


if __name__ == "__main__":
    main()
