"""quat_scale_to_covar_preci (MCMC's position noise, every step): PyTorch reference vs the native CPU
kernel, side by side, and its share of an MCMC cpu-backend training step before and after.

    python benchmarks/bench_covar.py                  # one thread (CPU time: robust on a shared machine)
    python benchmarks/bench_covar.py --threads 2      # the native kernel's threads (wall time)

1. The op as MCMCStrategy calls it (covariance only, full 3x3) and with both outputs, at 10k, 100k and
   1M gaussians: median of --repeats calls each.
2. splat-metal-mcmc trained in process on the demo scene (96x64, cpu backend, random init of N
   gaussians with cap-max N, refining every 5 steps) for --steps steps, once with the strategy's ops on
   the reference ("before") and once on the native kernel ("after"): median and mean step time (the
   mean includes the refine steps), the covariance's median time per step and its share of the
   training time (sum over steps; the first two steps, which build caches, left out).
With one thread both are process CPU time (time.process_time), which other processes' load does not
inflate; with more threads, wall time. The Metal kernel's speed needs a Mac: not measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from splat_metal_method import ops  # noqa: E402


def op_times(n: int, repeats: int, clock) -> dict:
    g = torch.Generator().manual_seed(0)
    quats, scales = torch.randn(n, 4, generator=g), torch.rand(n, 3, generator=g) + 0.05
    out = {}
    for label, flags in (("covar", (True, False)), ("covar+preci", (True, True))):
        for backend in ("reference", "cpu"):
            ops.quat_scale_to_covar_preci(quats, scales, *flags, backend=backend)  # warm up
            samples = []
            for _ in range(repeats):
                t = clock()
                ops.quat_scale_to_covar_preci(quats, scales, *flags, backend=backend)
                samples.append(clock() - t)
            out[(label, backend)] = statistics.median(samples)
    return out


def mcmc_run(data: Path, n: int, steps: int, strategy_backend: str, clock) -> dict:
    """Median step time and total covariance time of a short splat-metal-mcmc run (cpu backend)."""
    from mcmc_runs import method_config
    from pipelines import setup_pipeline, train_step

    cfg = method_config("mcmc", data, steps, warmup=5, refine_every=5, cap_max=n, backend="cpu")
    model_cfg = cfg.pipeline.model
    model_cfg.random_init, model_cfg.num_random = True, n
    pipeline, optimizers, callbacks = setup_pipeline(cfg, "cpu", seed=0)
    pipeline.model.strategy.backend = strategy_backend  # only the MCMC ops change; rasterization stays "cpu"
    covariance = [0.0]
    original = ops.quat_scale_to_covar_preci

    def timed(*a, **k):
        t = clock()
        try:
            return original(*a, **k)
        finally:
            covariance[0] += clock() - t

    ops.quat_scale_to_covar_preci = timed  # what routed_ops hands gsplat's strategy
    try:
        times, covar_times = [], []
        for step in range(steps):
            covariance[0], t = 0.0, clock()
            train_step(pipeline, optimizers, callbacks, step)
            times.append(clock() - t)
            covar_times.append(covariance[0])
    finally:
        ops.quat_scale_to_covar_preci = original
    times, covar_times = times[2:], covar_times[2:]  # the first steps build caches
    return {
        "step_s": statistics.median(times),
        "mean_step_s": statistics.mean(times),
        "covar_step_s": statistics.median(covar_times),
        "share": sum(covar_times) / sum(times),
        "gaussians": pipeline.model.num_points,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--train-sizes", type=int, nargs="*", default=[10_000, 100_000])
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock, what = (time.process_time, "process CPU time") if args.threads == 1 else (time.perf_counter, "wall time")
    from splat_metal_method.ops.cpu import build

    print(f"native library: {build.describe()}")

    lines = [f"torch {torch.__version__}, {args.threads} thread(s), {what}", "",
             "| gaussians | outputs | reference | native cpu | speed-up |", "|---:|---|---:|---:|---:|"]  # fmt: skip
    for n in args.sizes:
        t = op_times(n, args.repeats, clock)
        for label in ("covar", "covar+preci"):
            ref, cpu = t[(label, "reference")], t[(label, "cpu")]
            lines.append(f"| {n:,} | {label} | {1e3 * ref:.2f} ms | {1e3 * cpu:.2f} ms | {ref / cpu:.1f}x |")
            print(lines[-1], flush=True)
    if args.train_sizes:
        lines += ["", f"splat-metal-mcmc, demo scene 96x64, cpu backend, {args.steps} steps",
                  "| gaussians | MCMC ops on | median step | mean step | covariance per step | its share of training |",
                  "|---:|---|---:|---:|---:|---:|"]  # fmt: skip
        lines += mcmc_rows(args, clock)
    print("\n" + "\n".join(lines))


def mcmc_rows(args, clock) -> list:
    from splat_metal_method.data import demo_scene

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "demo"
        demo_scene.generate(data, width=96, height=64, views=32, seed=0)
        for n in args.train_sizes:
            for backend, label in (("reference", "reference (before)"), ("cpu", "native cpu (after)")):
                r = mcmc_run(data, n, args.steps, backend, clock)
                ms = {k: f"{1e3 * r[k]:.1f} ms" for k in ("step_s", "mean_step_s")}
                rows.append(
                    f"| {r['gaussians']:,} | {label} | {ms['step_s']} | {ms['mean_step_s']} | "
                    f"{1e3 * r['covar_step_s']:.2f} ms | {100 * r['share']:.1f}% |"
                )
                print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
