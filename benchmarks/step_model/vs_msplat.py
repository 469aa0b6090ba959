"""benchmarks/bench_vs_msplat.py (was `splat-metal-bench --vs msplat`): train splat-metal and msplat (rayanht/msplat, pure Metal) on the same
nerfstudio-format scene with matched settings and print one line to paste into an issue: ms per step
(median of the steady steps), gaussians, held-out PSNR (every 8th image) and the ratio.

    python benchmarks/bench_vs_msplat.py                          # the demo scene
    python benchmarks/bench_vs_msplat.py --data my_scene --steps 7000

msplat runs only where ``import msplat`` works (its wheels: macOS 14+ on Apple Silicon, Python 3.12+;
``pip install msplat``); elsewhere the command says so and exits with status 2. Our side is nerfstudio's
real Trainer (the splat-metal method, the metal backend on mps), timed per step as splat-metal-bench does.

Matched settings (one function, ``matched_settings``; msplat's names from its TrainingConfig, ours from
splatfacto's config): steps, SH degree and its interval, image downscale and the coarse-to-fine
schedule (num_downscales, resolution_schedule), the held-out split (every 8th image of the sorted
frames: msplat's ``test_every=8``, nerfstudio's ``eval_mode="interval"``, ``eval_interval=8``; both take
index % 8 == 0), SSIM weight, and the densification schedule: warm-up, refine interval, opacity reset
interval (in refine intervals in both), end of splitting (msplat fixes it at iterations / 2, so ours is
set to the same), end of screen-size culling, size threshold and split screen size. The gradient
thresholds stay each project's own: msplat thresholds the mean 2D gradient (0.0002), splatfacto the
absolute gradient gsplat calls absgrad (0.0008); they are not the same quantity.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

MSPLAT_REQUIREMENT = (
    "benchmarks/bench_vs_msplat.py needs msplat, which is not installed here (`import msplat` failed: {error}). "
    "msplat's wheels are for macOS 14+ on Apple Silicon with Python 3.12+: `pip install msplat` there."
)
FULL_SCHEDULE_STEPS = 7000  # from here on both projects' default densification schedule is used unchanged


@dataclass(frozen=True)
class Matched:
    """One training setup, in both projects' terms."""

    steps: int
    sh_degree: int = 3
    sh_degree_interval: int = 1000
    downscale: int = 1  # image downscale factor of the dataset
    num_downscales: int = 0  # coarse-to-fine levels (msplat's README benchmarks use 0)
    resolution_schedule: int = 3000
    eval_every: int = 8
    ssim_weight: float = 0.2
    warmup_length: int = 500
    refine_every: int = 100
    reset_alpha_every: int = 30  # in refine intervals
    stop_split_at: int = 3500
    stop_screen_size_at: int = 4000
    densify_size_thresh: float = 0.01
    split_screen_size: float = 0.05


def matched_settings(steps: int, sh_degree: int = 3, downscale: int = 1, num_downscales: int = 0) -> Matched:
    """The settings both trainers get. From FULL_SCHEDULE_STEPS steps on, the two projects' shared defaults
    (warm-up 500, refine every 100, opacity reset every 30 refines, SH degree up every 1000, split until
    steps / 2); shorter runs scale the schedule to the run, as splat-metal-bench does (warm-up and refine
    interval an eighth of the run, SH degree up every quarter, no opacity reset inside the run)."""
    if steps < 3:
        raise ValueError(f"[matched_settings] steps must be at least 3, got {steps}")
    if steps >= FULL_SCHEDULE_STEPS:
        m = Matched(steps=steps, sh_degree=sh_degree, downscale=downscale, num_downscales=num_downscales)
    else:
        refine = max(steps // 8, 2)
        m = Matched(
            steps=steps, sh_degree=sh_degree, downscale=downscale, num_downscales=num_downscales,
            sh_degree_interval=max(steps // 4, 1), resolution_schedule=max(steps // 4, 1),
            warmup_length=max(steps // 8, 1), refine_every=refine, reset_alpha_every=steps // refine + 2,
            stop_screen_size_at=steps,
        )  # fmt: skip
    return _replace(m, stop_split_at=steps // 2)


def _replace(m: Matched, **kw) -> Matched:
    return Matched(**{**asdict(m), **kw})


def msplat_config_kwargs(m: Matched) -> Dict[str, object]:
    """msplat.TrainingConfig(**kwargs) (its _core.pyi field names). msplat has no stop_split_at: its
    Model sets stopSplitAt = iterations / 2, which matched_settings gives ours too."""
    return {
        "iterations": m.steps, "sh_degree": m.sh_degree, "sh_degree_interval": m.sh_degree_interval,
        "ssim_weight": m.ssim_weight, "num_downscales": m.num_downscales,
        "resolution_schedule": m.resolution_schedule, "refine_every": m.refine_every,
        "warmup_length": m.warmup_length, "reset_alpha_every": m.reset_alpha_every,
        "densify_size_thresh": m.densify_size_thresh, "stop_screen_size_at": m.stop_screen_size_at,
        "split_screen_size": m.split_screen_size, "downscale_factor": 1.0, "save_every": -1,
    }  # fmt: skip


def msplat_dataset_kwargs(m: Matched) -> Dict[str, object]:
    """msplat.load_dataset(path, **kwargs): the image downscale and the every-8th held-out split."""
    return {"downscale_factor": float(m.downscale), "eval_mode": True, "test_every": m.eval_every}


def ours_configure(m: Matched) -> Callable:
    """A ``configure(cfg)`` for step_ledger.build_trainer: the same settings on nerfstudio's TrainerConfig."""

    def configure(cfg) -> None:
        cfg.max_num_iterations = m.steps
        parser = cfg.pipeline.datamanager.dataparser
        parser.eval_mode = "interval"
        parser.eval_interval = m.eval_every
        parser.downscale_factor = m.downscale
        model = cfg.pipeline.model
        for name in ("sh_degree", "sh_degree_interval", "num_downscales", "resolution_schedule", "warmup_length",
                     "refine_every", "reset_alpha_every", "stop_split_at", "stop_screen_size_at",
                     "densify_size_thresh", "split_screen_size"):  # fmt: skip
            setattr(model, name, getattr(m, name))
        model.ssim_lambda = m.ssim_weight
        model.memory_log_every = 0

    return configure


def steady_median(ms: List[float], m: Matched) -> float:
    """Median ms of the steady steps: not the first step (lazy state, compiles) nor a refine step."""

    def refines(step: int) -> bool:
        return step > m.warmup_length and step % m.refine_every == 0

    steady = [t for step, t in enumerate(ms) if step >= 1 and not refines(step)]
    return statistics.median(steady or ms)


@dataclass
class Result:
    name: str
    ms_per_step: float  # median of the steady steps
    gaussians: int
    psnr: float
    seconds: float
    wall_ms_per_step: float = 0.0  # the whole step loop's wall time / steps, the GPU drained at its end


def import_msplat():
    """msplat, or SystemExit(2) with the requirement named."""
    try:
        import msplat  # noqa: F401
    except Exception as e:  # ImportError, or a wheel built for another OS failing to load
        print(MSPLAT_REQUIREMENT.format(error=f"{type(e).__name__}: {e}"), file=sys.stderr)
        raise SystemExit(2) from None
    return msplat


def run_msplat(data: Path, m: Matched) -> Result:
    import contextlib

    msplat = import_msplat()
    t0 = time.perf_counter()
    # msplat's nerfstudio loader resolves a file_path starting with "." against the working directory
    # (core/src/loaders/load_nerfstudio.cpp), nerfstudio against the scene's folder: load from there
    with contextlib.chdir(data) if hasattr(contextlib, "chdir") and Path(data).is_dir() else contextlib.nullcontext():
        dataset = msplat.load_dataset(str(Path(data).resolve()), **msplat_dataset_kwargs(m))
    trainer = msplat.GaussianTrainer(dataset, msplat.TrainingConfig(**msplat_config_kwargs(m)))
    # msplat's ms_per_step is the host's time for step() (python/bindings.cpp), which ends in
    # commitAndContinue without waiting: it equals the GPU's time per step only once the command queue is
    # full. The loop's wall time with the GPU drained at the end (msplat.sync) is printed beside it.
    ms, count = [], 0
    t_loop = time.perf_counter()
    for _ in range(m.steps):
        stats = trainer.step()
        ms.append(float(stats.ms_per_step))
        count = int(stats.splat_count)
    getattr(msplat, "sync", lambda: None)()
    wall = (time.perf_counter() - t_loop) * 1e3 / m.steps
    metrics = trainer.evaluate()
    return Result("msplat", steady_median(ms, m), count, float(metrics["psnr"]), time.perf_counter() - t0, wall)


def run_ours(data: Path, m: Matched, device: str, backend: str, work: Path) -> Result:
    """nerfstudio's Trainer with the matched settings; per-step times as splat-metal-bench takes them."""
    from nerfstudio.engine.callbacks import TrainingCallbackLocation  # noqa: F401 (before writer: import order)
    from nerfstudio.utils import writer

    from splat_metal_method.bench import step_ledger
    from splat_metal_method.bench.timing import timed_step

    writers = list(writer.EVENT_WRITERS)
    t0 = time.perf_counter()
    trainer = step_ledger.build_trainer(data, "splat-metal", backend, work / "outputs", device, ours_configure(m))
    try:
        model = trainer.pipeline.model
        t_loop = time.perf_counter()
        ms = [sum(timed_step(trainer, step, device)) for step in range(m.steps)]  # each drains the GPU at its end
        wall = (time.perf_counter() - t_loop) * 1e3 / m.steps
        trainer.pipeline.eval()
        metrics = trainer.pipeline.get_average_eval_image_metrics(step=m.steps)
        return Result("ours", steady_median(ms, m), len(model.means), float(metrics["psnr"]),
                      time.perf_counter() - t0, wall)  # fmt: skip
    finally:
        writer.EVENT_WRITERS[:] = writers


def summary_line(scene: str, m: Matched, ours: Result, theirs: Optional[Result], device: str) -> str:
    parts = [
        f"bench_vs_msplat | {scene} | {device} | {m.steps} steps, SH {m.sh_degree}, downscale "
        f"{m.downscale} (+{m.num_downscales} coarse levels), eval every {m.eval_every}th image, refine every "
        f"{m.refine_every} from {m.warmup_length} to {m.stop_split_at}"
    ]
    for r in (ours, theirs):
        if r is not None:
            parts.append(f"{r.name}: {r.ms_per_step:.2f} ms/step (wall {r.wall_ms_per_step:.2f}), {r.gaussians} "
                         f"gaussians, PSNR {r.psnr:.2f} dB")  # fmt: skip
    if theirs is not None:
        ratio = ours.ms_per_step / theirs.ms_per_step
        wall = ours.wall_ms_per_step / theirs.wall_ms_per_step if theirs.wall_ms_per_step > 0 else float("nan")
        parts.append(f"ours / msplat: {ratio:.2f}x ms/step (wall {wall:.2f}x)")
    return " | ".join(parts)


def main(data: Optional[Path], steps: int, sh_degree: int, downscale: int, num_downscales: int, device: str,
         out: Path) -> int:  # fmt: skip
    import tempfile

    import_msplat()  # before any training: say what is missing at once
    work = Path(tempfile.mkdtemp(prefix="splat_metal_vs_msplat_"))
    if data is None:
        from splat_metal_method.bench import scenes as bench_scenes

        data, scene = bench_scenes.demo(work / "demo192", 192, 128, views=24), "demo 192x128"
    else:
        scene = Path(data).name
    m = matched_settings(steps, sh_degree, downscale, num_downscales)
    ours = run_ours(Path(data), m, device, "metal", work)
    print(f"ours: {ours}", flush=True)
    theirs = run_msplat(Path(data), m)
    print(f"msplat: {theirs}", flush=True)
    line = summary_line(scene, m, ours, theirs, device)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_msplat.txt").write_text(line + "\n")
    print(f"\nPaste into an issue:\n{line}")
    return 0


def cli(argv=None) -> int:
    """benchmarks/bench_vs_msplat.py: the options `splat-metal-bench --vs msplat` had."""
    import argparse
    import datetime as dt

    import torch

    ap = argparse.ArgumentParser(prog="bench_vs_msplat.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=None, help="a nerfstudio-format scene (default: the demo)")
    ap.add_argument("--steps", type=int, default=2000, help="training steps of both")
    ap.add_argument("--sh-degree", type=int, default=3, help="SH degree of both")
    ap.add_argument("--downscale", type=int, default=1, help="image downscale factor of both")
    ap.add_argument("--num-downscales", type=int, default=0, help="coarse-to-fine levels of both")
    ap.add_argument("--device", choices=("auto", "mps", "cpu"), default="auto")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default ./splat-metal-vs-msplat-<time>)")
    args = ap.parse_args(argv)
    device = args.device if args.device != "auto" else ("mps" if torch.backends.mps.is_available() else "cpu")
    out = args.out or Path(f"splat-metal-vs-msplat-{dt.datetime.now():%Y%m%d-%H%M%S}")
    try:
        return main(args.data, args.steps, args.sh_degree, args.downscale, args.num_downscales, device, out)
    except SystemExit as e:  # msplat missing: the message is printed; a non-zero status
        return int(e.code) if isinstance(e.code, int) else 2
