"""Whole nerfstudio training steps on the bundled demo scene, per backend, side by side.

    python benchmarks/bench_train_step.py                      # reference vs cpu, 96x64 demo scene
    python benchmarks/bench_train_step.py --backends cpu metal --steps 20 --width 192 --height 128

One step is exactly what `ns-train splat-metal` runs per iteration (Trainer.train_iteration):
splatfacto's forward through our op layer, L1 + SSIM loss, backward, Adam steps for the gaussians and
the SO3xR3 camera optimizer, schedulers and callbacks. Each backend gets its own pipeline built with
the same seed; steps alternate between backends so machine noise hits them alike. By default
densification is off (warm-up longer than the run) so every backend times the same gaussians;
--densify runs splatfacto's densification (warm-up a quarter of the run, refine every eighth) so
the count grows as in real training (each backend densifies from its own gradients). Prints the
median time per step split into forward / backward / optimizer and the ratio to the first
backend, and writes benchmarks/results/train_step.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the shared in-process pipeline helpers
sys.path.insert(0, str(ROOT))

from bench_step import machine_info  # noqa: E402
from pipelines import make_pipeline, seed_all  # noqa: E402


def timed_step(pipeline, optimizers, callbacks, step: int) -> dict:
    """Trainer.train_iteration, timed in three parts (seconds)."""
    import functools

    from nerfstudio.engine.callbacks import TrainingCallbackLocation

    t0 = time.perf_counter()
    for cb in callbacks:
        cb.run_callback_at_location(step, location=TrainingCallbackLocation.BEFORE_TRAIN_ITERATION)
    optimizers.zero_grad_all()
    _, loss_dict, _ = pipeline.get_train_loss_dict(step=step)
    loss = functools.reduce(torch.add, loss_dict.values())
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizers.optimizer_step_all()
    optimizers.scheduler_step_all(step)
    for cb in callbacks:
        cb.run_callback_at_location(step, location=TrainingCallbackLocation.AFTER_TRAIN_ITERATION)
    t3 = time.perf_counter()
    assert torch.isfinite(loss), f"step {step}: loss {loss.item()}"
    return {"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2, "step_s": t3 - t0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["reference", "cpu"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per backend")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (builds, caches)")
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--data", type=Path, default=None, help="a nerfstudio dataset instead of the demo scene")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--densify", action="store_true", help="densify during the run (see above)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.pop("SPLAT_METAL_BACKEND", None)

    from rich.progress import track

    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            data = Path(tmp) / "demo"
            cmd = [sys.executable, "-m", "splat_metal_method.data.demo_scene", "--out", str(data),
                   "--width", str(args.width), "--height", str(args.height)]  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True)
        runs = {}
        for b in args.backends:
            seed_all(0)
            total = args.warmup + args.steps
            warmup, refine = (total // 4, max(total // 8, 2)) if args.densify else (10**9, 10**9)
            runs[b] = make_pipeline(data, seed=0, warmup=warmup, refine_every=refine, sh_degree_interval=1, backend=b)
        start_points = {b: runs[b][0].model.num_points for b in args.backends}
        samples = {b: [] for b in args.backends}
        for step in track(range(args.warmup + args.steps), description="training steps"):
            for b in args.backends:
                r = timed_step(*runs[b], step)
                if step >= args.warmup:
                    samples[b].append(r)
        n_points = {b: runs[b][0].model.num_points for b in args.backends}

    info = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(f"scene: {'demo ' + str(args.width) + 'x' + str(args.height) if args.data is None else args.data}, "
          f"gaussians {start_points} at the start, {n_points} at the end, SH degree 3 from step 3, "
          f"median of {args.steps} steps after {args.warmup}")  # fmt: skip
    base = None
    rows = []
    header = f"{'backend':>10} {'forward s':>10} {'backward s':>10} {'optimizer s':>11} {'step s':>8}"
    print(f"{header}  vs {args.backends[0]}")
    for b in args.backends:
        med = {k: statistics.median(r[k] for r in samples[b]) for k in samples[b][0]}
        base = base or med["step_s"]
        ratio = base / med["step_s"]
        print(f"{b:>10} {med['forward_s']:10.4f} {med['backward_s']:10.4f} {med['optimizer_s']:11.4f} "
              f"{med['step_s']:8.4f}  {ratio:.1f}x faster")  # fmt: skip
        rows.append({"backend": b, "gaussians": n_points[b], "width": args.width, "height": args.height,
                     **{k: round(v, 5) for k, v in med.items()}, "speedup": round(ratio, 2), **info})  # fmt: skip
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train_step.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out / 'train_step.csv'}")


if __name__ == "__main__":
    main()
