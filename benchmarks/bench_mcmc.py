"""splat-metal (splatfacto's densification) vs splat-metal-mcmc at the same number of steps.

    python benchmarks/bench_mcmc.py                      # cpu: demo scene + a bigger scene, 600 steps
    python benchmarks/bench_mcmc.py --device cuda --steps 3000
    python benchmarks/bench_mcmc.py --op-share           # also: the MCMC ops' share of a step

Scenes (generated, splat_metal_method/data/demo_scene.py): the demo scene (96x64, 32 views) and a
bigger one (160x112, 40 views); both non-square with nerfstudio's held-out views (every tenth).
Each method trains with the demo preset's choices (configs/demo.args: full resolution, white
background) and its own refinement schedule for the run length: default densifies from step
steps/3 every steps/6 (the demo preset's 200/100 at 600 steps, opacity reset every 10 refines);
MCMC refines from steps/12 every steps/60 (gsplat's --steps-scaler, which scales the 500/100 of
30k steps the same way) with cap-max = the count the default run ended with, so MCMC never has
more gaussians than default. Both decay the means' learning rate (and MCMC's noise) over the run.

Each (scene, method) run is its own process (default first: its count is MCMC's cap) and reports:
held-out PSNR (the model's metric over nerfstudio's eval split), final gaussian count, median step
time, peak RSS of the process (CPU) or peak CUDA memory.
Writes benchmarks/results/mcmc_<device>.csv and .png (git-ignored) and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

SCENES = {"demo": (96, 64, 32), "bigger": (160, 112, 40)}  # width, height, views


def run_one(args) -> None:
    """Child process: one training run; prints its result as one JSON line."""
    import torch
    from mcmc_runs import as_row, method_config, schedule, train_and_evaluate

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = method_config(args.method, Path(args.data), args.steps, cap_max=args.cap_max, device=args.device,
                        backend=args.backend, **schedule(args.method, args.steps))  # fmt: skip
    timer = OpShare() if args.op_share and args.method == "mcmc" else None
    result = train_and_evaluate(args.method, cfg, args.steps, device=args.device, seed=args.seed)
    row = as_row(result)
    if timer is not None:
        row.update(timer.report(result.step_s * args.steps))
    print("RESULT " + json.dumps(row), flush=True)


class OpShare:
    """Times the routed MCMC ops and the whole strategy step (monkeypatched wrappers)."""

    def __init__(self):
        import time

        from splat_metal_method import ops
        from splat_metal_method.method import mcmc

        self.seconds = {"relocation_s": 0.0, "covariance_s": 0.0, "strategy_s": 0.0}

        def timed(fn, key):
            def wrapper(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.seconds[key] += time.perf_counter() - t

            return wrapper

        ops.compute_relocation = timed(ops.compute_relocation, "relocation_s")
        ops.quat_scale_to_covar_preci = timed(ops.quat_scale_to_covar_preci, "covariance_s")
        cls = mcmc.SplatMetalMCMCStrategy
        cls.step_post_backward = timed(cls.step_post_backward, "strategy_s")

    def report(self, train_s: float) -> dict:
        out = {k: round(v, 4) for k, v in self.seconds.items()}
        for k, v in self.seconds.items():
            out[k.replace("_s", "_share")] = round(v / train_s, 5)
        return out


def launch(method: str, data: Path, args, cap_max: int = -1) -> subprocess.Popen:
    cmd = [
        sys.executable,
        __file__,
        "--one",
        "--method",
        method,
        "--data",
        str(data),
        "--steps",
        str(args.steps),
        "--device",
        args.device,
        "--backend",
        args.backend,
        "--cap-max",
        str(cap_max),
        "--seed",
        str(args.seed),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.op_share:
        cmd.append("--op-share")
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def result_of(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"run failed (exit {proc.returncode}):\n{out[-4000:]}")


def plot(rows, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    scenes = list(dict.fromkeys(r["scene"] for r in rows))
    metrics = [("psnr", "held-out PSNR (dB)"), ("gaussians", "gaussians"), ("step_s", "median step (s)"),
               ("peak_mb", "peak memory (MiB)")]  # fmt: skip
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.4))
    width = 0.38
    for ax, (key, label) in zip(axes, metrics):
        for j, method in enumerate(("default", "mcmc")):
            values = [next(r[key] for r in rows if r["scene"] == s and r["method"] == method) for s in scenes]
            ax.bar([i + (j - 0.5) * width for i in range(len(scenes))], values, width, label=method)
        ax.set_xticks(range(len(scenes)))
        ax.set_xticklabels(scenes)
        ax.set_title(label, fontsize=10)
    axes[0].legend()
    fig.suptitle(f"splat-metal default vs MCMC, {rows[0]['steps']} steps, {rows[0]['device']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto")
    p.add_argument("--scenes", nargs="+", default=list(SCENES), choices=list(SCENES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each run")
    p.add_argument("--op-share", action="store_true", help="time the MCMC ops and strategy step (MCMC runs)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    # child-process mode
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default="default", help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cap-max", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        return run_one(args)

    from splat_metal_method.data import demo_scene

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for scene in args.scenes:
            width, height, views = SCENES[scene]
            data = Path(tmp) / scene
            demo_scene.generate(data, width=width, height=height, views=views, seed=args.seed)
            default = result_of(launch("default", data, args))
            mcmc = result_of(launch("mcmc", data, args, cap_max=default["gaussians"]))
            for r in (default, mcmc):
                held_out = len(demo_scene.eval_indices(views))
                r.update(scene=f"{scene} {width}x{height}", device=args.device, eval_views=held_out)
                r["peak_mb"] = r["peak_device_mb"] if r["peak_device_mb"] is not None else r["peak_rss_mb"]
                rows.append(r)
            print(f"{scene}: default {default['psnr']:.2f} dB / {default['gaussians']:,}; "
                  f"mcmc {mcmc['psnr']:.2f} dB / {mcmc['gaussians']:,}", flush=True)  # fmt: skip

    args.out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = args.out / f"mcmc_{args.device}.csv", args.out / f"mcmc_{args.device}.png"
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    memory = "peak CUDA MiB" if args.device == "cuda" else "peak RSS MiB"
    print(f"\n{args.steps} steps on {args.device}")
    print(f"| scene | method | held-out PSNR (dB) | gaussians | step (ms) | {memory} |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['scene']} | {r['method']} | {r['psnr']:.2f} | {r['gaussians']:,} | {1000 * r['step_s']:.1f} | "
              f"{r['peak_mb']:.0f} |")  # fmt: skip
    for scene in dict.fromkeys(r["scene"] for r in rows):
        d, m = (next(r for r in rows if r["scene"] == scene and r["method"] == k) for k in ("default", "mcmc"))
        print(f"{scene}: MCMC - default = {m['psnr'] - d['psnr']:+.2f} dB with {m['gaussians'] / d['gaussians']:.2f}x "
              f"the gaussians, {m['step_s'] / d['step_s']:.2f}x the step time")  # fmt: skip
        if "covariance_share" in m:
            print(
                f"  MCMC ops' share of training time: covariance {100 * m['covariance_share']:.2f}%, relocation "
                f"{100 * m['relocation_share']:.2f}%, whole strategy step {100 * m['strategy_share']:.2f}%"
            )
    print(f"wrote {csv_path}" + (f" and {png_path}" if plot(rows, png_path) else " (no matplotlib: no PNG)"))


if __name__ == "__main__":
    main()
