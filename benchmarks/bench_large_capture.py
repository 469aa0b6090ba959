"""A thousand photos in bounded memory: peak RSS, time to the first step and the steady step of a capture
of 100 and of 1,000 photos, with its images cached whole (nerfstudio's way) and streamed.

    python benchmarks/bench_large_capture.py                           # 100 and 1,000 photos of 1600x1200, cpu
    python benchmarks/bench_large_capture.py --photos 100 1000 --steps 30 --device mps
    python benchmarks/bench_large_capture.py --skip-cached-above 500    # when 6 GB of RAM is not free

The captures are made once (--data-dir, default a folder in the system's temp dir, reused when it is
there) as ns-process-data writes a COLMAP capture: images/frame_00001.jpg ..., a transforms.json with
the OPENCV lens model (k1 -0.05, k2 0.01: every image is undistorted, as a phone's), and
sparse_pc.ply. The content is cheap (a smooth random texture, shifted per photo); what is measured is
the data path, not quality.

Each (photos, mode) is trained in its own process (peak RSS is a per-process high-water mark): the
pipeline splat-metal's ns-train builds, with image_cache_gb -1 ("cached": every image decoded before
the first step, nerfstudio's way) or --stream-gb ("streamed": images decoded in the background as
training asks for them). The default budget, 2 GB, caches 100 of these photos and streams 1,000. Per
run: the peak RSS and the seconds from the start of the pipeline set-up to the end of the first step.
The cached run then builds a streamed pipeline beside its own and alternates steps between the two
(machine noise hits both alike) for the steady step of each (median after --warmup steps; also the
process's CPU time over a step, all threads, which shows the decoding's cost apart from load). Printed:
the ratios streamed / cached, and the peak-RSS growth from the smallest to the largest capture with
the default budget and streamed at both sizes. Goal: growth at most 300 MB, steady step streamed
within 10% of cached. Writes benchmarks/results/large_capture_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the shared in-process pipeline helpers
sys.path.insert(0, str(ROOT))

DEFAULT_BUDGET_GB = 2.0  # SplatMetalDatamanagerConfig.image_cache_gb
MARKER = "splat_metal_large_capture"
GROWTH_GOAL_MB, STEP_GOAL = 300.0, 1.10


# ---- the capture
def write_capture(out: Path, n: int, width: int, height: int, k1: float = -0.05, k2: float = 0.01) -> Path:
    """``n`` photos of ``width`` x ``height`` in nerfstudio's format (made once: reused when ``out`` holds
    the same capture)."""
    from PIL import Image

    from splat_metal_method.data.demo_scene import LOOK_AT, make_cameras, write_ply

    out = Path(out)
    spec = {"n": n, "width": width, "height": height, "k1": k1, "k2": k2, "version": 1}
    transforms_path = out / "transforms.json"
    if transforms_path.is_file() and json.loads(transforms_path.read_text()).get(MARKER) == spec:
        return out
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    coarse = Image.fromarray(rng.integers(0, 256, (max(2, height // 24), max(2, width // 24), 3), dtype=np.uint8))
    texture = np.asarray(coarse.resize((2 * width, height), Image.Resampling.BICUBIC))  # [H, 2W, 3] smooth
    frames = []
    c2w, intrinsics = make_cameras(n, width, height)
    for i in range(n):
        name = f"images/frame_{i + 1:05d}.jpg"
        shift = (i * 37) % width
        Image.fromarray(np.ascontiguousarray(texture[:, shift : shift + width])).save(out / name, quality=90)
        frames.append({"file_path": name, "transform_matrix": c2w[i].tolist(), "colmap_im_id": i + 1})
    xyz = (np.asarray(LOOK_AT) + rng.uniform(-1.0, 1.0, (2000, 3))).astype(np.float32)
    write_ply(out / "sparse_pc.ply", xyz, rng.integers(0, 256, (2000, 3), dtype=np.uint8))
    transforms = {
        "camera_model": "OPENCV", **intrinsics, "k1": k1, "k2": k2, "p1": 0.0, "p2": 0.0,
        "frames": frames, "applied_transform": np.eye(4)[:3].tolist(), "ply_file_path": "sparse_pc.ply", MARKER: spec,
    }  # fmt: skip
    transforms_path.write_text(json.dumps(transforms, indent=1))
    return out


# ---- one run (a child process)
def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if platform.system() == "Darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def _pipeline(data: Path, budget_gb: float, device: str):
    from pipelines import setup_pipeline

    from splat_metal_method.method.configs import splat_metal_trainer_config

    cfg = splat_metal_trainer_config()
    cfg.machine.device_type = device
    cfg.pipeline.datamanager.data = data
    cfg.pipeline.datamanager.image_cache_gb = budget_gb
    return setup_pipeline(cfg, device, seed=0)


def _step(run, step: int, cpu: list = None) -> float:
    """Wall seconds of one training step; appends the process's CPU seconds over it (all threads) to ``cpu``."""
    from pipelines import train_step

    t, c = time.perf_counter(), time.process_time()
    float(train_step(*run, step))  # the step's work is done (a sync on a GPU)
    if cpu is not None:
        cpu.append(time.process_time() - c)
    return time.perf_counter() - t


def run_child(data: Path, mode: str, budget_gb: float, steps: int, warmup: int, device: str) -> dict:
    """The run's peak RSS and time to its first step; "cached" then also builds a streamed pipeline beside it
    and alternates steps between the two (machine noise hits both alike) for the steady step of each."""
    import torch  # noqa: F401 (imported before the baseline, so that it does not count as the images' memory)

    baseline = peak_rss_mb()
    start = time.perf_counter()
    run = _pipeline(data, -1.0 if mode == "cached" else budget_gb, device)
    _step(run, 0)
    out = {"mode": mode, "streamed": run[0].datamanager.streaming, "baseline_rss_mb": baseline,
           "first_step_s": time.perf_counter() - start, "peak_rss_mb": peak_rss_mb()}  # fmt: skip
    if mode == "cached":
        streamed = _pipeline(data, budget_gb, device)
        _step(streamed, 0)
        times = {"cached": [], "streamed": []}
        cpu = {"cached": [], "streamed": []}
        for step in range(1, steps):
            times["cached"].append(_step(run, step, cpu["cached"]))
            times["streamed"].append(_step(streamed, step, cpu["streamed"]))
        for name, t in times.items():
            out[f"steady_step_ms_{name}"] = 1000 * statistics.median(t[warmup:])
            out[f"steady_cpu_ms_{name}"] = 1000 * statistics.median(cpu[name][warmup:])
    return out


def spawn(args, data: Path, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", str(data), "--mode", mode, "--budget-gb", str(args.stream_gb),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--photos", type=int, nargs="+", default=[100, 1000], help="capture sizes (default 100 1000)")
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--height", type=int, default=1200)
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the steady step (default 5)")
    p.add_argument("--device", default="cpu", help="cpu, mps or cuda (default cpu)")
    p.add_argument("--stream-gb", type=float, default=0.1, help="image_cache_gb of the streamed runs (default 0.1)")
    p.add_argument("--skip-cached-above", type=int, default=0, help="no cached run for captures larger than this")
    p.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "splat_metal_large_capture")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("cached", "streamed"), help=argparse.SUPPRESS)
    p.add_argument("--budget-gb", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args.child, args.mode, args.budget_gb, args.steps, args.warmup, args.device)))
        return 0

    photo_mb = args.width * args.height * 3 / 1e6  # decoded uint8
    results = {}
    for n in args.photos:
        t = time.perf_counter()
        data = write_capture(args.data_dir / f"{n}_{args.width}x{args.height}", n, args.width, args.height)
        print(f"{n} photos of {args.width}x{args.height} in {data} ({time.perf_counter() - t:.0f} s)", flush=True)
        for mode in ("cached", "streamed"):
            if mode == "cached" and args.skip_cached_above and n > args.skip_cached_above:
                continue
            r = results[(n, mode)] = spawn(args, data, mode)
            print(f"  {mode:8s} peak RSS {r['peak_rss_mb']:7.0f} MB (after imports {r['baseline_rss_mb']:5.0f}), "
                  f"first step after {r['first_step_s']:6.1f} s", flush=True)  # fmt: skip
        if (n, "cached") in results:
            r = results[(n, "cached")]
            print(f"  steady step, alternating in one process: cached {r['steady_step_ms_cached']:.1f} ms, "
                  f"streamed {r['steady_step_ms_streamed']:.1f} ms (CPU time of the process over a step, all "
                  f"threads: {r['steady_cpu_ms_cached']:.1f} vs {r['steady_cpu_ms_streamed']:.1f} ms)", flush=True)  # fmt: skip

    print(f"\nratios streamed / cached ({args.device}, {args.steps} steps, steady = median after {args.warmup}):")
    for n in args.photos:
        if (n, "cached") in results:
            c, s = results[(n, "cached")], results[(n, "streamed")]
            print(f"  {n:5d} photos: steady step {c['steady_step_ms_streamed'] / c['steady_step_ms_cached']:.3f} "
                  f"(its CPU time {c['steady_cpu_ms_streamed'] / c['steady_cpu_ms_cached']:.3f}), "
                  f"time to first step {s['first_step_s'] / c['first_step_s']:.3f}, "
                  f"peak RSS {s['peak_rss_mb'] / c['peak_rss_mb']:.3f}")  # fmt: skip
    small, large = min(args.photos), max(args.photos)

    def default(n):  # what image_cache_gb's default does with n photos
        return "cached" if n * photo_mb <= DEFAULT_BUDGET_GB * 1000 else "streamed"

    growth = {}
    if (small, default(small)) in results and (large, default(large)) in results:
        growth["default budget"] = results[(large, default(large))]["peak_rss_mb"] - results[(small, default(small))]["peak_rss_mb"]  # fmt: skip
    growth["streamed at both"] = (
        results[(large, "streamed")]["peak_rss_mb"] - results[(small, "streamed")]["peak_rss_mb"]
    )
    for label, mb in growth.items():
        verdict = "meets" if mb <= GROWTH_GOAL_MB else "MISSES"
        print(f"peak RSS growth {small} -> {large} photos, {label}: {mb:+.0f} MB ({verdict} the goal of +{GROWTH_GOAL_MB:.0f} MB)")  # fmt: skip
    out = ROOT / "benchmarks" / "results" / f"large_capture_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": platform.platform(),
              "runs": {f"{n}_{mode}": r for (n, mode), r in results.items()}, "growth_mb": growth}  # fmt: skip
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
