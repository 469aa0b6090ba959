"""Train splat-metal (splatfacto's densification) or splat-metal-mcmc in process on a scene and measure
what benchmarks/bench_mcmc.py and tests/method/test_mcmc_quality.py compare: held-out PSNR (nerfstudio's
eval split, the model's own metric), gaussian count, step time, peak memory."""

from __future__ import annotations

import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipelines import setup_pipeline, train_step  # noqa: E402

METHODS = ("default", "mcmc")


def schedule(method: str, steps: int) -> dict:
    """Refinement for a run of ``steps``: default densifies from steps/3 every steps/6 (the demo
    preset's 200/100 at 600 steps); MCMC refines from steps/12 every steps/60 (gsplat's
    --steps-scaler applied to its 500/100 of 30k steps gives the same ratios)."""
    if method == "mcmc":
        return {"warmup": max(steps // 12, 1), "refine_every": max(steps // 60, 1)}
    return {"warmup": max(steps // 3, 1), "refine_every": max(steps // 6, 1)}


def method_config(method: str, data: Path, steps: int, warmup: int, refine_every: int, cap_max: int = -1,
                  device: str = "cpu", backend: str = "auto", sh_degree_interval: Optional[int] = None):  # fmt: skip
    """The TrainerConfig of ``ns-train splat-metal`` or ``splat-metal-mcmc`` with the demo preset's
    choices (configs/demo.args: full resolution, white background, densification/refinement from
    ``warmup`` every ``refine_every`` steps, SH degree up every steps/2) for a run of ``steps``, the
    learning-rate schedules (and so MCMC's noise) decaying over the run."""
    from splat_metal_method.method.configs import splat_metal_mcmc_trainer_config, splat_metal_trainer_config

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    cfg = splat_metal_mcmc_trainer_config() if method == "mcmc" else splat_metal_trainer_config()
    cfg.machine.device_type = device
    cfg.max_num_iterations = steps
    cfg.pipeline.datamanager.data = data
    model = cfg.pipeline.model
    model.background_color = "white"
    model.num_downscales = 0
    model.warmup_length = warmup
    model.refine_every = refine_every
    model.sh_degree_interval = sh_degree_interval or max(steps // 2, 1)
    model.backend = backend
    for name in ("means", "camera_opt", "bilateral_grid"):  # the schedules end with the run
        scheduler = cfg.optimizers[name]["scheduler"]
        scheduler.max_steps = steps
        if scheduler.warmup_steps:
            scheduler.warmup_steps = min(scheduler.warmup_steps, steps // 10)
    if method == "mcmc":
        model.cap_max = cap_max
        model.stop_split_at = steps  # MCMC keeps refining to the end of the run
    else:
        model.reset_alpha_every = 10
        model.stop_split_at = steps
    return cfg


@dataclass
class RunResult:
    method: str
    steps: int
    gaussians: int
    psnr: float  # mean over the held-out views
    step_s: float  # median seconds per training step
    peak_rss_mb: float  # of this process
    peak_device_mb: Optional[float]  # cuda: max allocated; cpu/mps: None


def held_out_psnr(pipeline) -> float:
    model = pipeline.model
    model.eval()
    values = []
    with torch.no_grad():
        for camera, batch in pipeline.datamanager.fixed_indices_eval_dataloader:
            outputs = model.get_outputs_for_camera(camera)
            values.append(float(model.get_image_metrics_and_images(outputs, batch)[0]["psnr"]))
    model.train()
    return sum(values) / len(values)


def train_and_evaluate(method: str, cfg, steps: int, device: str = "cpu", seed: int = 0) -> RunResult:
    pipeline, optimizers, callbacks = setup_pipeline(cfg, device, seed)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        loss = train_step(pipeline, optimizers, callbacks, step)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if not torch.isfinite(loss):
            raise RuntimeError(f"{method}: loss {float(loss)} at step {step}")
    peak_device = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    rss_mb = maxrss / 2**20 if sys.platform == "darwin" else maxrss / 2**10
    return RunResult(
        method=method,
        steps=steps,
        gaussians=pipeline.model.num_points,
        psnr=held_out_psnr(pipeline),
        step_s=statistics.median(times[min(10, steps // 2) :]),
        peak_rss_mb=rss_mb,
        peak_device_mb=peak_device,
    )


def as_row(result: RunResult) -> dict:
    return asdict(result)
