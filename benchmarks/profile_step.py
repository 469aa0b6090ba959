"""Where a training step's time goes on trained runs (benchmarks/bench_real_capture.py --keep DIR): render
(forward), backward, the strategy's per-step work, and for MCMC its parts (position noise: the covariance and
the rest; one relocation of the gaussians at or below min opacity, as a refine does), with the tile
intersections per gaussian from the render's meta. One process, one thread unless --threads.

    python benchmarks/profile_step.py DIR/outputs/snowmiku/splat-metal/default/config.yml \\
        DIR/outputs/snowmiku/splat-metal-mcmc/mcmc/config.yml
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def profile(config: Path, views: int) -> dict:
    from nerfstudio.utils.eval_utils import eval_setup

    from splat_metal_method.method.mcmc import SplatMetalMCMCModel, routed_ops

    _, pipeline, _, step = eval_setup(config, test_mode="val")
    model = pipeline.model
    model.train()
    params = model.gauss_params
    optimizers = {k: torch.optim.Adam([p], lr=1e-4, eps=1e-15) for k, p in params.items()}
    model.optimizers = optimizers
    is_mcmc = isinstance(model, SplatMetalMCMCModel)
    # The last step that is no refine step (what most steps run).
    while step % model.config.refine_every == 0:
        step -= 1
    t = {"forward": [], "backward": [], "strategy": [], "isect_per_gaussian": []}
    for i in range(views + 1):  # the first is a warm-up
        model.step = step
        camera, batch = pipeline.datamanager.next_train(i)
        outputs, t_fwd = timed(lambda: model.get_outputs(camera))
        loss = sum(v for v in model.get_loss_dict(outputs, batch).values())
        for opt in optimizers.values():
            opt.zero_grad()
        _, t_bwd = timed(loss.backward)
        for opt in optimizers.values():
            opt.step()
        _, t_strat = timed(lambda: model.step_post_backward(step))
        if i:
            t["forward"].append(t_fwd)
            t["backward"].append(t_bwd)
            t["strategy"].append(t_strat)
            t["isect_per_gaussian"].append(float(model.info["tiles_per_gauss"].sum()) / len(params["means"]))
    row = {"run": str(config.parent.name), "gaussians": len(params["means"])}
    row.update({k: statistics.median(v) for k, v in t.items()})
    if is_mcmc:
        import gsplat.strategy.ops as gsplat_ops

        from splat_metal_method import ops

        strategy = model.strategy
        with torch.no_grad():
            scales, quats = torch.exp(params["scales"]), params["quats"]
            covar = [timed(lambda: ops.quat_scale_to_covar_preci(quats, scales, True, False, False, backend=strategy.backend))[1] for _ in range(5)]  # fmt: skip
            noise = []
            for _ in range(5):
                with routed_ops(strategy.backend):
                    noise.append(timed(lambda: gsplat_ops.inject_noise_to_position(params, optimizers, {}, 1e-6))[1])
            dead = int((torch.sigmoid(params["opacities"].flatten()) <= strategy.min_opacity).sum())
            with routed_ops(strategy.backend):
                _, t_reloc = timed(lambda: strategy._relocate_gs(params, optimizers, model.strategy_state["binoms"]))
        row.update(noise=statistics.median(noise), covariance=statistics.median(covar), dead=dead, relocation=t_reloc)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+", type=Path, help="config.yml of trained runs")
    p.add_argument("--views", type=int, default=8, help="training views timed per run (median)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [profile(c, args.views) for c in args.configs]
    ms = lambda r, k: f"{1000 * r[k]:.1f} ms" if k in r else ""  # noqa: E731
    print("\n| run | gaussians | intersections / gaussian | render | backward | strategy step | "
          "noise (covariance) | relocation (dead) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        noise = f"{ms(r, 'noise')} ({ms(r, 'covariance')})" if "noise" in r else ""
        reloc = f"{ms(r, 'relocation')} ({r['dead']:,})" if "relocation" in r else ""
        print(f"| {r['run']} | {r['gaussians']:,} | {r['isect_per_gaussian']:.2f} | {ms(r, 'forward')} | "
              f"{ms(r, 'backward')} | {ms(r, 'strategy')} | {noise} | {reloc} |")  # fmt: skip


if __name__ == "__main__":
    main()
