"""Memory over a long training run: does memory track the scene, or keep climbing?

Trains splat-metal on the demo scene with nerfstudio's own Trainer (the loop ns-train runs:
densification, pruning, opacity resets, eval passes, the memory hooks) and samples, every few
steps, the gaussian count next to process RSS and the allocator's numbers (memory.memory_stats:
C heap in use / held on cpu; torch.cuda allocated / reserved / peak on cuda; current / driver on
mps). Densification stops at ``--refine-stop`` (and at ``--max-gaussians``), so the count
plateaus; the verdict compares memory at the start and at the end of the plateau (mean of the
first and last 10% of its samples) against a 5% limit, and also reports the least-squares trend
over the plateau. Training stops at ``--steps`` or after ``--max-minutes``, whichever comes first.

    python benchmarks/bench_memory.py                          # cpu, stops after 10 minutes
    python benchmarks/bench_memory.py --device cuda --hooks on  # on an NVIDIA GPU
    python benchmarks/bench_memory.py --device cuda --hooks off
    python benchmarks/bench_memory.py --device cuda --no-seed-points --json summary.json  # without open3d

Writes benchmarks/results/memory_<device>_hooks-<on|off>_<time>.csv and .png (git-ignored) and
prints a summary (machine, steps, seconds per step, count and memory at plateau start/end, growth).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from splat_metal_method.data import demo_scene
from splat_metal_method.engine import memory  # noqa: E402
from splat_metal_method.ops.workspace import workspace_stats  # noqa: E402

FIELDS = [
    "step", "seconds", "gaussians", "intersections", "rss_mb", "allocated_mb", "reserved_mb", "peak_mb",
    "workspace_mb", "releases",
]  # fmt: skip
GROWTH_LIMIT = 0.05


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda or mps (default cpu)")
    p.add_argument("--backend", default="auto", help="op-layer backend (default: by device)")
    p.add_argument("--steps", type=int, default=3000, help="training steps at most (default 3000)")
    p.add_argument("--max-minutes", type=float, default=10.0, help="stop training after this long (default 10)")
    p.add_argument("--refine-stop", type=int, default=400, help="densification stops here (default 400)")
    p.add_argument("--max-gaussians", type=int, default=6000, help="cap (default 6000; 0: none, -1: from device)")
    p.add_argument("--hooks", choices=("on", "off"), default="on", help="empty-cache hooks (default on)")
    p.add_argument("--sample-every", type=int, default=10, help="steps between samples (default 10)")
    p.add_argument("--width", type=int, default=48)
    p.add_argument("--height", type=int, default=32)
    p.add_argument("--views", type=int, default=16)
    p.add_argument("--data", type=Path, default=None, help="existing scene (default: generate the demo scene)")
    p.add_argument(
        "--no-seed-points",
        action="store_true",
        help="splatfacto's random initialisation (nerfstudio reads seed points with open3d)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the summary to this JSON file")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return p.parse_args(argv)


def build_trainer(args, data: Path, workdir: Path):
    from splat_metal_method.method.configs import splat_metal_trainer_config

    cfg = splat_metal_trainer_config()
    cfg.machine.device_type = args.device
    cfg.pipeline.datamanager.data = data
    cfg.pipeline.datamanager.dataparser.load_3D_points = not args.no_seed_points
    cfg.output_dir = workdir / "outputs"
    cfg.max_num_iterations = args.steps
    cfg.steps_per_save = 10**9  # the final checkpoint only
    cfg.steps_per_eval_image = 200
    cfg.steps_per_eval_all_images = 10**9
    cfg.vis = "tensorboard"  # nerfstudio runs eval passes only with an event writer
    cfg.logging.local_writer.enable = False
    cfg.viewer.quit_on_train_completion = True
    m = cfg.pipeline.model
    m.backend = args.backend
    m.num_downscales = 0
    m.warmup_length = 100
    m.refine_every = 25
    m.reset_alpha_every = 12  # opacity reset every 300 steps
    m.stop_split_at = args.refine_stop
    m.sh_degree_interval = 150
    m.max_gaussians = args.max_gaussians
    hooks = args.hooks == "on"
    m.empty_cache_after_refine = m.empty_cache_after_eval = hooks
    m.empty_cache_every = 0
    m.memory_log_every = 100
    cfg.set_timestamp()
    trainer = cfg.setup(local_rank=0, world_size=1)
    trainer.setup()
    return trainer


def trend(rows, key: str, start: int):
    """Least-squares slope of ``key`` over the plateau, as relative change over its length."""
    pts = [(r["step"], r[key]) for r in rows if r["step"] >= start and r[key] is not None]
    if len(pts) < 10:
        return None
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    return slope * (pts[-1][0] - pts[0][0]) / my


def growth(rows, key: str, start: int):
    """(mean at the start of the plateau, mean at its end, relative growth) of column ``key``."""
    vals = [r[key] for r in rows if r["step"] >= start and r[key] is not None]
    if len(vals) < 10:
        return None
    k = max(1, len(vals) // 10)
    first, last = sum(vals[:k]) / k, sum(vals[-k:]) / k
    return first, last, (last - first) / first


def plot(rows, path: Path, plateau: int, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for key, label in (("rss_mb", "process RSS"), ("reserved_mb", "allocator held / reserved"),
                       ("allocated_mb", "allocator in use / allocated"), ("peak_mb", "peak allocated")):  # fmt: skip
        ys = [r[key] for r in rows]
        if any(y is not None for y in ys):
            ax.plot(steps, ys, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    ax.axvline(plateau, color="grey", linestyle=":", label="count plateaus")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["gaussians"] for r in rows], color="black", linewidth=1, label="gaussians")
    ax2.set_ylabel("gaussians")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="center right", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    from nerfstudio.engine.callbacks import TrainingCallback, TrainingCallbackLocation

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = args.out / f"memory_{args.device}_hooks-{args.hooks}_{stamp}"
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        workdir = Path(tmp)
        data = args.data
        if data is None:
            data = workdir / "demo"
            demo_scene.generate(data, width=args.width, height=args.height, views=args.views, seed=0)
        trainer = build_trainer(args, data, workdir)
        model = trainer.pipeline.model
        device = torch.device(args.device)
        rows = []
        t0 = time.perf_counter()
        peak = [0]

        def sample(step: int):
            s = memory.memory_stats(device)
            if s.peak is None and s.allocated is not None:
                peak[0] = max(peak[0], s.allocated)
                s.peak = peak[0]
            mb = lambda v: None if v is None else v / memory.MiB  # noqa: E731
            info = getattr(model, "info", None) or {}
            tpg = info.get("tiles_per_gauss")
            rows.append({
                "step": step, "seconds": time.perf_counter() - t0, "gaussians": model.num_points,
                "intersections": int(tpg.sum()) if tpg is not None else None,
                "rss_mb": mb(s.rss), "allocated_mb": mb(s.allocated), "reserved_mb": mb(s.reserved),
                "peak_mb": mb(s.peak), "workspace_mb": workspace_stats()["bytes"] / memory.MiB,
                "releases": len(model.memory.releases),
            })  # fmt: skip
            writer.writerow(rows[-1])
            csv_file.flush()
            if time.perf_counter() - t0 > 60 * args.max_minutes:
                trainer.stop_training = True  # the loop ends before the next step and saves

        trainer.callbacks.append(
            TrainingCallback(
                [TrainingCallbackLocation.AFTER_TRAIN_ITERATION], sample, update_every_num_iters=args.sample_every
            )
        )
        with open(stem.with_suffix(".csv"), "w", newline="") as csv_file:  # written as it goes
            writer = csv.DictWriter(csv_file, fieldnames=FIELDS)
            writer.writeheader()
            trainer.train()
        seconds = time.perf_counter() - t0
        steps_done = rows[-1]["step"] + 1 if rows else 0
    plateau = args.refine_stop + args.sample_every  # the strategy refines at most up to refine_stop
    title = (
        f"splat-metal memory, demo {args.width}x{args.height}, {steps_done} steps on {args.device} "
        f"({args.backend}), hooks {args.hooks}, densify until {args.refine_stop}"
    )
    plotted = plot(rows, stem.with_suffix(".png"), plateau, title)

    print(f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"device {args.device}, backend {args.backend}, hooks {args.hooks}, {steps_done} steps in {seconds:.0f} s "
          f"({seconds / max(steps_done, 1):.3f} s/step), {len(model.memory.releases)} cache releases")  # fmt: skip
    counts = [r["gaussians"] for r in rows if r["step"] >= plateau]
    summary = {"device": args.device, "backend": args.backend, "hooks": args.hooks, "steps": steps_done,
               "seconds": round(seconds, 1), "s_per_step": round(seconds / max(steps_done, 1), 4),
               "cache_releases": len(model.memory.releases), "max_gaussians": max((r["gaussians"] for r in rows), default=0),
               "csv": str(stem.with_suffix(".csv")), "plateau_from_step": plateau, "growth": {}}  # fmt: skip
    if len(counts) < 10:
        print(f"the run ended before the plateau had 10 samples (plateau from step {plateau}); no verdict")
        if args.json:
            args.json.write_text(json.dumps({**summary, "verdict": None}, indent=1))
        return 2
    print(
        f"gaussians: max {max(r['gaussians'] for r in rows)}, on the plateau {min(counts)}..{max(counts)} "
        f"({len(counts)} samples, steps {plateau}..{rows[-1]['step']})"
    )
    verdict = True
    for key in ("rss_mb", "allocated_mb", "reserved_mb", "peak_mb"):
        g = growth(rows, key, plateau)
        if g is None:
            continue
        ok = g[2] <= GROWTH_LIMIT
        verdict &= ok if key in ("rss_mb", "allocated_mb") else True
        summary["growth"][key] = {"plateau_start_mb": round(g[0], 1), "plateau_end_mb": round(g[1], 1),
                                  "growth": round(g[2], 4), "trend": round(trend(rows, key, plateau), 4)}  # fmt: skip
        print(f"{key:>13}: plateau start {g[0]:8.1f} MiB, end {g[1]:8.1f} MiB, growth {100 * g[2]:+.2f}% "
              f"({'ok' if ok else 'OVER'} the {100 * GROWTH_LIMIT:.0f}% limit), "
              f"trend {100 * trend(rows, key, plateau):+.2f}% over the plateau")  # fmt: skip
    print(f"wrote {stem.with_suffix('.csv')}" + (f" and {stem.with_suffix('.png')}" if plotted else ""))
    if args.json:
        args.json.write_text(json.dumps({**summary, "verdict": bool(verdict)}, indent=1))
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
