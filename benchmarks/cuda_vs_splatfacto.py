"""CUDA path on a real GPU: splat-metal (gsplat passthrough) vs stock splatfacto, side by side.

    python benchmarks/cuda_vs_splatfacto.py                      # the bundled demo scene
    python benchmarks/cuda_vs_splatfacto.py --data path/to/scene --steps 300
    python benchmarks/cuda_vs_splatfacto.py --no-seed-points --json result.json   # without open3d

Builds both nerfstudio pipelines (Trainer.setup's pipeline, optimizers and callbacks) on the same
scene with the same seed and runs exactly Trainer.train_iteration's step on each, alternating
blocks of steps so machine noise hits both alike. Prints the median step time of each and their
ratio (target <= 1.02), each method's peak CUDA memory above what was allocated when its block
began, and the gaussian counts; then checks reference-vs-gsplat parity on CUDA with the doctor's
full-op check. Needs a CUDA GPU; exits 2 with a clear message otherwise, 1 on a parity mismatch.
``--no-seed-points`` starts both from splatfacto's random initialisation (nerfstudio reads the seed
points with open3d); ``--json`` also writes the numbers to a file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the shared in-process pipeline helpers

from pipelines import setup_pipeline, train_step  # noqa: E402


def build(method: str, data: Path, seed: int, seed_points: bool = True):
    from nerfstudio.configs.method_configs import all_methods

    cfg = all_methods[method]
    cfg.machine.device_type = "cuda"
    cfg.machine.seed = seed
    cfg.pipeline.datamanager.data = data
    cfg.pipeline.datamanager.dataparser.load_3D_points = seed_points
    cfg.pipeline.model.num_downscales = 0
    cfg.pipeline.model.background_color = "white"  # "random" would make the two runs differ
    # A GPU machine without network cannot fetch LPIPS's AlexNet weights, which stock splatfacto downloads
    # while it builds; training never uses LPIPS, so both methods build without it there (as ours does).
    from splat_metal_method.method.model import _lpips_only_if_local

    with _lpips_only_if_local():
        return setup_pipeline(cfg, "cuda", seed)


def train_block(run, start: int, n: int):
    """Seconds per step over n steps, and the block's peak CUDA memory above its start."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for step in range(start, start + n):
        train_step(*run, step)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n, torch.cuda.max_memory_allocated() - base


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=None, help="a nerfstudio scene (default: the demo scene)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block", type=int, default=25)
    parser.add_argument("--no-seed-points", action="store_true", help="random initialisation (no open3d needed)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_vs_splatfacto: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            data = Path(tmp) / "demo"
            subprocess.run([sys.executable, "-m", "splat_metal_method.data.demo_scene", "--out", str(data)], check=True)
        runs = {m: build(m, data, seed=0, seed_points=not args.no_seed_points) for m in ("splatfacto", "splat-metal")}
        times = {m: [] for m in runs}
        peaks = {m: [] for m in runs}
        for start in range(0, args.steps, args.block):
            for method, run in runs.items():
                seconds, peak = train_block(run, start, args.block)
                times[method].append(seconds)
                peaks[method].append(peak)
    for method, (pipeline, _, _) in runs.items():
        backend = getattr(pipeline.model, "info", {}).get("backend", "gsplat")
        print(f"{method:>12}: median step {statistics.median(times[method]) * 1000:.2f} ms, "
              f"peak {max(peaks[method]) / 2**20:.0f} MiB above its block's start, "
              f"{pipeline.model.num_points} gaussians, backend {backend}")  # fmt: skip
    ratio = statistics.median(times["splat-metal"]) / statistics.median(times["splatfacto"])
    print(f"step-time ratio splat-metal / splatfacto: {ratio:.3f} (target <= 1.02)")

    from splat_metal_method.verify.kernel_checks import full_op_checks

    checks = full_op_checks(torch.device("cuda"), "gsplat", 61, 37)
    for c in checks:
        verdict = "ok" if c.ok else "MISMATCH"
        print(f"parity {c.stage} {c.direction}: max abs {c.max_abs:.2e}, rel {c.rel:.2e}, {verdict}"
              + (f" ({c.error})" if c.error else ""))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": args.steps, "block": args.block,
            "seed_points": not args.no_seed_points,
            "median_step_ms": {m: round(statistics.median(t) * 1000, 3) for m, t in times.items()},
            "peak_mib_above_block_start": {m: round(max(p) / 2**20, 1) for m, p in peaks.items()},
            "gaussians": {m: run[0].model.num_points for m, run in runs.items()},
            "step_time_ratio": round(ratio, 4),
            "parity": [{"check": f"{c.stage} {c.direction}", "max_abs": c.max_abs, "rel": c.rel, "ok": c.ok, "error": c.error}
                       for c in checks],
        }, indent=1))  # fmt: skip
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
