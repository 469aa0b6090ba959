"""`torchrun --nproc-per-node N ns-train splat-metal` vs N on one machine (CPU, gloo): the scaling table.

    python benchmarks/bench_distributed_train.py                    # demo scene, 300 steps, N = 1 2 3
    python benchmarks/bench_distributed_train.py --worlds 1 2 4 --steps 600 --device cuda

Each N trains the same scene with the demo preset (configs/demo.args: full resolution, white
background) for the same number of steps, side by side in one run of this script; every rank trains on
one camera per step, so N ranks see N times the images (learning rates scaled as gsplat's distributed
trainer does, README "Several GPUs / machines"). Reported per N, from the run's own tensorboard
scalars (rank 0) and its final checkpoint:
  - gaussians per rank (max over ranks) and their parameter + Adam bytes per rank, at the end;
  - the all-to-all volume per step (rank 0's forward, median over the run; backward moves about as much);
  - the median wall time of a training step (nerfstudio's "Train Iter (time)", a 20-step running
    mean, from step 30 on);
  - the held-out PSNR of the final model (nerfstudio's eval split).
Every process gets one thread (OMP_NUM_THREADS=1), so N processes use N cores: images per second vs N
is the speed-up. On a 2-core machine N > 2 processes share cores: there it says only that it runs; the
bytes per rank are what scale-out buys. Writes benchmarks/results/distributed_<device>.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from cli_helpers import cli_env, demo_args, executable, tensorboard_scalars  # noqa: E402

ADAM_COPIES = 3  # a parameter and its two Adam moments


def train(scene: Path, out: Path, world: int, steps: int, device: str) -> Path:
    args = [executable("torchrun"), "--standalone", "--nproc-per-node", str(world), executable("ns-train"),
            "splat-metal", *demo_args(max_num_iterations=steps, machine__device_type=device, logging__steps_per_log=1,
                                      steps_per_save=10**6, steps_per_eval_all_images=10**6,
                                      steps_per_eval_image=10**6),
            "--data", str(scene), "--output-dir", str(out), "--timestamp", f"n{world}"]  # fmt: skip
    env = cli_env(out / "torch_home", extra={"OMP_NUM_THREADS": "1"})  # one core per process, whatever N
    log = out / f"n{world}.log"
    with open(log, "w") as f:
        code = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        raise SystemExit(f"N={world} failed (exit {code}); see {log}")
    return out / scene.name / "splat-metal" / f"n{world}"


def measure(run: Path, world: int, steps: int) -> dict:
    import torch
    from mcmc_runs import held_out_psnr
    from nerfstudio.utils.eval_utils import eval_setup

    state = torch.load(sorted((run / "nerfstudio_models").glob("*.ckpt"))[-1], map_location="cpu")
    params = {k: v for k, v in state["pipeline"].items() if ".gauss_params." in k}
    n = next(iter(params.values())).shape[0]
    row_bytes = sum(v[:1].numel() * v.element_size() for v in params.values())
    per_rank = n if world == 1 else max(state["splat_metal_resume"]["distributed"]["counts"])
    times = tensorboard_scalars(run, "Train Iter (time)")
    a2a = tensorboard_scalars(run, "Distributed/all_to_all MB (rank 0, forward)")
    _, pipeline, _, _ = eval_setup(run / "config.yml", test_mode="val")
    row = {
        "world_size": world,
        "steps": steps,
        "images_seen": world * steps,
        "gaussians": n,
        "gaussians_per_rank_max": per_rank,
        "gaussian_MB_per_rank": round(per_rank * row_bytes * ADAM_COPIES / 2**20, 3),
        "all_to_all_MB_per_step": round(statistics.median(a2a.values()), 3) if a2a else 0.0,
        # nerfstudio logs a 20-step running mean (seconds); from step 30 on the start-up steps are out of it
        "step_ms_median": round(1000 * statistics.median(v for s, v in times.items() if s >= 30), 2)
        if times
        else float("nan"),
        "held_out_psnr": round(held_out_psnr(pipeline), 2),
    }
    row["images_per_s"] = round(world / (row["step_ms_median"] / 1000), 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, nargs=3, default=[96, 64, 32], metavar=("W", "H", "VIEWS"))
    args = parser.parse_args()
    from splat_metal_method.data import demo_scene

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        scene = out / "scene"
        demo_scene.generate(scene, width=args.size[0], height=args.size[1], views=args.size[2], seed=0)
        rows = [measure(train(scene, out, w, args.steps, args.device), w, args.steps) for w in args.worlds]
    base = rows[0]
    print(f"scene {args.size[0]}x{args.size[1]}, {args.size[2]} views, {args.steps} steps, device {args.device}, "
          f"{os.cpu_count()} cores")  # fmt: skip
    header = list(rows[0]) + ["gaussian_MB_per_rank_vs_first", "images_per_s_vs_first"]
    for r in rows:
        r["gaussian_MB_per_rank_vs_first"] = round(r["gaussian_MB_per_rank"] / base["gaussian_MB_per_rank"], 3)
        r["images_per_s_vs_first"] = round(r["images_per_s"] / base["images_per_s"], 3)
    print(" | ".join(header))
    for r in rows:
        print(" | ".join(str(r[h]) for h in header))
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    with open(results / f"distributed_{args.device}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {results / f'distributed_{args.device}.csv'}")


if __name__ == "__main__":
    main()
