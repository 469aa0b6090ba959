"""CUDA path on a real GPU: splat-metal (gsplat passthrough) vs stock splatfacto, side by side.

    python benchmarks/cuda_vs_splatfacto.py --data data/demo --steps 300

Builds both nerfstudio pipelines on the same scene with the same seed, alternates blocks of
training steps between them (so machine noise hits both alike), and prints step-time ratio
(target <= 1.02) and peak CUDA memory of each; then checks reference-vs-gsplat parity on CUDA
with the doctor's full-op check. Needs a CUDA GPU; exits with a clear message otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def build(method: str, data: Path, seed: int):
    import torch
    from nerfstudio.configs.method_configs import all_methods

    config = all_methods[method]
    config.data = data
    config.machine.device_type = "cuda"
    config.machine.seed = seed
    config.pipeline.datamanager.data = data
    config.pipeline.model.num_downscales = 0
    config.vis = "tensorboard"
    torch.manual_seed(seed)
    pipeline = config.pipeline.setup(device="cuda", test_mode="val")
    optimizers = config.optimizers
    from nerfstudio.engine.optimizers import Optimizers

    opt = Optimizers(optimizers, pipeline.get_param_groups())
    pipeline.train()
    model = pipeline.model
    model.step_cb(opt, 0)
    return pipeline, opt


def train_block(pipeline, opt, start: int, n: int) -> float:
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    for step in range(start, start + n):
        pipeline.model.step_cb(opt, step)
        opt.zero_grad_all()
        _, loss_dict, _ = pipeline.get_train_loss_dict(step=step)
        sum(loss_dict.values()).backward()
        opt.optimizer_step_all()
        pipeline.model.step_post_backward(step)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a nerfstudio scene (e.g. the demo scene)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block", type=int, default=25)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_vs_splatfacto: needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    runs = {m: build(m, args.data, seed=0) for m in ("splatfacto", "splat-metal")}
    times = {m: [] for m in runs}
    for start in range(0, args.steps, args.block):
        for method, (pipeline, opt) in runs.items():
            times[method].append(train_block(pipeline, opt, start, args.block))
    for method, (pipeline, _) in runs.items():
        n = pipeline.model.num_points
        print(f"{method:>12}: median step {statistics.median(times[method]) * 1000:.2f} ms, {n} gaussians")
    ratio = statistics.median(times["splat-metal"]) / statistics.median(times["splatfacto"])
    print(f"step-time ratio splat-metal / splatfacto: {ratio:.3f} (target <= 1.02)")
    print(f"peak CUDA memory (both pipelines in one process): {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")

    from splat_metal_method.doctor import full_op_checks

    checks = full_op_checks(torch.device("cuda"), "gsplat", 61, 37)
    for c in checks:
        print(f"parity {c.stage} {c.direction}: max abs {c.max_abs:.2e}, rel {c.rel:.2e}, {'ok' if c.ok else 'MISMATCH'}")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
