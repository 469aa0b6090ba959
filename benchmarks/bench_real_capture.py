"""A real phone capture (../shared/data/snowmiku: 97 photos 785x589, COLMAP poses, 25,784 SfM points)
trained as users train theirs, through the command lines:

    ns-train splat-metal      --data <capture> ... nerfstudio-data --eval-mode interval   # every 8th held out
    ns-train splat-metal-mcmc --data <capture> --pipeline.model.cap-max N ... (same split)
    ns-eval --load-config <run>/config.yml

Methods: default (splatfacto's densification), MCMC capped at default's final count, and MCMC capped at
a third of it (default runs first: its count is the caps). Each run is one ns-train process (one at a
time, --threads torch threads), then ns-eval.

    python benchmarks/bench_real_capture.py                         # the full benchmark: 7K steps, full size
    python benchmarks/bench_real_capture.py --steps 600 --width 392 --schedule scaled   # what fits a busy CPU

--schedule default: ns-train's own schedule (splatfacto's, made for 30K steps), only the step count
changed (MCMC scales its own strategy schedule to the run: schedule-scale auto, mcmc.py). --schedule
scaled: every step count of splatfacto's schedule times steps/7000 (as gsplat's --steps-scaler does),
so a short run goes through what a 7K run does, compressed: densification from 500 every 100 until 15K,
resolution schedule 3K, SH degree every 1K, means' learning-rate decay over 30K; MCMC gets the same
resolution and SH counts, and its refinement and means' learning-rate decay from schedule-scale auto
(its 30K schedule times steps/30000, refine-every at least 10). --schedule scaled7k: MCMC too gets every
count times steps/7000 (refinement until 25K: what this benchmark ran before schedule-scale existed). --width/--frames-every/--points make a smaller cut of the capture
(tests/real_capture.py) in a temporary folder.

Measured per run: held-out PSNR and SSIM (ns-eval; LPIPS when torchvision's AlexNet weights are on
disk), final gaussian count, median step time (nerfstudio's "Train Iter (time)"), peak RSS of the
ns-train process, wall time of the ns-train process; over steps (tensorboard): held-out PSNR at every
--eval-every steps and the gaussian count. Writes benchmarks/results/real_capture_<label>.csv and .png
(PSNR over steps, count over steps, one held-out view of each method beside its photo).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import real_capture  # noqa: E402
from cli_helpers import cli_env, executable  # noqa: E402

FULL_STEPS = 7000  # the field's short benchmark
# ns-train options that are step counts in splatfacto's schedule (and MCMC's stop), at their defaults.
SCHEDULE = {"warmup-length": 500, "refine-every": 100, "resolution-schedule": 3000, "sh-degree-interval": 1000}
STOP_SPLIT = {"default": 15000, "mcmc": 25000}
MEANS_LR_STEPS = 30000


SHARED = ("resolution-schedule", "sh-degree-interval")  # splatfacto's counts that MCMC's auto scaling leaves alone


def schedule_args(method: str, steps: int, schedule: str) -> list:
    if schedule == "default":
        return []
    scale = steps / FULL_STEPS
    args = []
    for name, value in SCHEDULE.items():
        args += [f"--pipeline.model.{name}", max(1, round(value * scale))]
    if method.startswith("mcmc") and schedule == "scaled":  # the rest: schedule-scale auto
        return [a for i in range(0, len(args), 2) if args[i].split(".")[-1] in SHARED for a in args[i : i + 2]]
    stop = STOP_SPLIT["mcmc" if method.startswith("mcmc") else "default"]
    args += ["--pipeline.model.stop-split-at", max(1, round(stop * scale))]
    args += ["--optimizers.means.scheduler.max-steps", max(1, round(MEANS_LR_STEPS * scale))]
    return args


def train(method: str, data: Path, out: Path, args, cap_max: int = -1) -> dict:
    """One ns-train run (its own process) and ns-eval on it -> the row of the table."""
    name = "splat-metal-mcmc" if method.startswith("mcmc") else "splat-metal"
    eval_every = max(1, args.steps // args.eval_points)
    cmd = [executable("ns-train"), name, "--data", data, "--output-dir", out, "--timestamp", method,
           "--vis", "tensorboard", "--max-num-iterations", args.steps, "--steps-per-save", args.steps,
           "--steps-per-eval-image", 10**9, "--steps-per-eval-batch", 0, "--steps-per-eval-all-images", eval_every,
           "--machine.device-type", args.device, *schedule_args(method, args.steps, args.schedule)]  # fmt: skip
    if cap_max > 0:
        cmd += ["--pipeline.model.cap-max", cap_max]
    cmd += ["nerfstudio-data", "--eval-mode", "interval"]
    env = cli_env(extra={"OMP_NUM_THREADS": str(args.threads)} if args.threads else None)
    run_dir = out / data.name / name / method
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(run_dir / "ns-train.log", "w") as log:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: its peak RSS
    wall = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"{method}: ns-train failed; see {run_dir / 'ns-train.log'}:\n"
                           + (run_dir / "ns-train.log").read_text()[-3000:])  # fmt: skip
    metrics_path = run_dir / "eval.json"
    ev = subprocess.run([executable("ns-eval"), "--load-config", str(run_dir / "config.yml"), "--output-path",
                         str(metrics_path)], capture_output=True, text=True, env=env)  # fmt: skip
    if ev.returncode != 0:
        raise RuntimeError(f"{method}: ns-eval failed:\n{ev.stdout[-2000:]}{ev.stderr[-2000:]}")
    results = json.loads(metrics_path.read_text())["results"]
    step_s = scalars(run_dir, "Train Iter (time)")
    counts = scalars(run_dir, "Train Metrics Dict/gaussian_count")
    psnr_over_steps = scalars(run_dir, "Eval Images Metrics Dict (all images)/psnr")
    return {
        "method": method, "steps": args.steps, "schedule": args.schedule, "cap_max": cap_max if cap_max > 0 else "",
        "psnr": round(results["psnr"], 3), "ssim": round(results["ssim"], 4),
        "lpips": round(results["lpips"], 4) if "lpips" in results else "",
        "gaussians": int(counts[max(counts)]) if counts else "",
        "median_step_ms": round(1000 * statistics.median(step_s.values()), 1) if step_s else "",
        "peak_rss_mib": round(usage.ru_maxrss / 1024), "wall_s": round(wall, 1),
        "run_dir": str(run_dir), "psnr_over_steps": json.dumps(psnr_over_steps), "count_over_steps": json.dumps(counts),
    }  # fmt: skip


def scalars(run_dir: Path, tag: str) -> dict:
    """{step: value} of a scalar ns-train logged to tensorboard in ``run_dir``; {} if none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def held_out_views(rows) -> list:
    """[(method, render [H, W, 3], photo [H, W, 3])] of the first held-out view, each run loaded as ns-eval loads it."""
    import torch
    from nerfstudio.utils.eval_utils import eval_setup

    views = []
    for r in rows:
        _, pipeline, _, _ = eval_setup(Path(r["run_dir"]) / "config.yml", test_mode="test")
        pipeline.eval()
        camera, batch = pipeline.datamanager.fixed_indices_eval_dataloader[0]  # the first held-out view
        with torch.no_grad():
            rgb = pipeline.model.get_outputs_for_camera(camera)["rgb"].cpu().numpy()  # [H, W, 3]
        photo = batch["image"].cpu().numpy()  # [H, W, 3] uint8 (cache_images_type) or float
        views.append((r["method"], rgb, photo / 255.0 if photo.dtype.kind == "u" else photo))
    return views


def plot(rows, views, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig = plt.figure(figsize=(4 * max(3, len(views) + 1), 7))
    grid = fig.add_gridspec(2, max(3, len(views) + 1))
    for col, (key, label) in enumerate((("psnr_over_steps", "held-out PSNR (dB)"), ("count_over_steps", "gaussians"))):
        ax = fig.add_subplot(grid[0, col])
        for r in rows:
            series = {int(k): v for k, v in json.loads(r[key]).items()}
            steps = sorted(series)
            ax.plot(
                steps, [series[k] for k in steps], label=r["method"], marker="." if key == "psnr_over_steps" else None
            )
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8)
    for col, (method, rgb, photo) in enumerate([(None, None, views[0][2])] + views):
        ax = fig.add_subplot(grid[1, col])
        ax.imshow(np.clip(photo if method is None else rgb, 0, 1))
        row = next((r for r in rows if r["method"] == method), None)
        ax.set_title("photo (held out)" if method is None else f"{method}: {row['psnr']:.2f} dB", fontsize=9)
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=FULL_STEPS)
    p.add_argument("--schedule", choices=("default", "scaled", "scaled7k"), default="default")
    p.add_argument("--width", type=int, default=None, help="photo width (default 785, as captured)")
    p.add_argument("--points", type=int, default=None, help="random seed points kept (default: all 25,784)")
    p.add_argument("--methods", nargs="+", default=["default", "mcmc", "mcmc-third"],
                   choices=("default", "mcmc", "mcmc-third"))  # fmt: skip
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each ns-train")
    p.add_argument("--eval-points", type=int, default=6, help="held-out PSNR this many times over the run")
    p.add_argument("--label", default=None, help="results file name: real_capture_<label>.csv (default from the scale)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--keep", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = p.parse_args(argv)
    if "default" not in args.methods and any(m.startswith("mcmc") for m in args.methods):
        p.error("the MCMC caps come from the default run: include 'default' in --methods")

    label = args.label or f"{args.device}_{args.steps}steps_{args.schedule}_w{args.width or 785}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        data = real_capture.make_cut(root / "snowmiku", width=args.width, points=args.points)
        for method in args.methods:
            cap = -1
            if method == "mcmc":
                cap = rows[0]["gaussians"]
            elif method == "mcmc-third":
                cap = max(1, rows[0]["gaussians"] // 3)
            row = train(method, data, root / "outputs", args, cap_max=cap)
            print(f"{method}: {row['psnr']:.2f} dB, ssim {row['ssim']:.3f}, {row['gaussians']:,} gaussians, "
                  f"median step {row['median_step_ms']} ms, peak RSS {row['peak_rss_mib']} MiB, wall {row['wall_s']} s",
                  flush=True)  # fmt: skip
            rows.append(row)
        views = held_out_views(rows)
        args.out.mkdir(parents=True, exist_ok=True)
        csv_path, png_path = args.out / f"real_capture_{label}.csv", args.out / f"real_capture_{label}.png"
        scale = f"{args.width or 785} px wide, {args.points or 'all'} seed points"
        plot(rows, views, png_path, f"snowmiku ({scale}), {args.steps} steps, {args.schedule} schedule, {args.device}")
    for r in rows:
        r.pop("run_dir")
        r.update(
            width=args.width or 785, seed_points=args.points or 25784, device=args.device, threads=args.threads or ""
        )
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("\n| method | held-out PSNR | SSIM | gaussians | median step | peak RSS | wall |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cap = f" (cap {r['cap_max']:,})" if r["cap_max"] else ""
        print(
            f"| {r['method']}{cap} | {r['psnr']:.2f} dB | {r['ssim']:.3f} | {r['gaussians']:,} | "
            f"{r['median_step_ms']} ms | {r['peak_rss_mib']:,} MiB | {r['wall_s']:.0f} s |"
        )
    print(f"wrote {csv_path} and {png_path}")


if __name__ == "__main__":
    main()
