"""Small images under splatfacto's default resolution schedule (num_downscales 2: a quarter of the
size for the first 3,000 steps): gsplat's radii are at least 2 px and its screen-size rule
(DefaultStrategy ``grow_scale2d`` = split_screen_size 0.05, until stop_screen_size_at) splits every
gaussian whose radius exceeds 5% of the image's longer side, so at 16x12 every visible gaussian was
split at every refine. ``--pipeline.model.min-train-size`` (default 128 px) keeps training images
from being downscaled below that. In-process training (tests/pipelines.py) on the shared 64x48 demo
scene, four refines (steps 25, 30, 35, 40)."""

from __future__ import annotations

import demo_runs
from pipelines import setup_pipeline, train_step

from splat_metal_method.method.model import max_downscale

REFINES = (25, 30, 35, 40)  # refine_every 5, after the opacity reset's pause of 18 views + 5 steps


def test_max_downscale_keeps_the_longer_side_above_the_minimum():
    assert max_downscale(96, 64, 128) == 1  # smaller than the minimum already: full size
    assert max_downscale(64, 256, 128) == 2
    assert max_downscale(648, 420, 128) == 4  # 162x105; 81x52 would be below
    assert max_downscale(4000, 3000, 128) == 16  # large photos: splatfacto's own factor 4 applies
    assert max_downscale(96, 64, 0) > 2**20  # 0: no minimum


def _train(tmp_path_factory, steps: int, **model_options):
    """(H, W) of the first training render, and at each refine step the share of the gaussians seen
    since the last refine that gsplat's screen-size rule splits (radius over grow_scale2d of the
    longer side), measured before that step."""
    from splat_metal_method.method.configs import splat_metal_trainer_config

    cfg = splat_metal_trainer_config()
    cfg.machine.device_type = "cpu"
    cfg.pipeline.datamanager.data = demo_runs.demo_scene(tmp_path_factory)
    model = cfg.pipeline.model
    model.background_color = "white"
    model.warmup_length, model.refine_every = 5, 5
    for name, value in model_options.items():
        setattr(model, name, value)
    pipeline, optimizers, callbacks = setup_pipeline(cfg, "cpu")
    model, split_share = pipeline.model, []
    for step in range(steps):
        if step in REFINES:
            state = model.strategy_state
            seen = state["count"] > 0
            split_share.append(float((state["radii"][seen] > model.strategy.grow_scale2d).float().mean()))
        train_step(pipeline, optimizers, callbacks, step)
        if step == 0:
            size = model.last_size
    return size, split_share


def test_small_images_train_at_full_size_and_say_so_once(tmp_path_factory, capsys):
    size, _ = _train(tmp_path_factory, steps=2)
    out = " ".join(capsys.readouterr().out.split())
    assert size == (demo_runs.HEIGHT, demo_runs.WIDTH)
    message = (
        "splat-metal: training starts at 64x48, not 16x12 (num_downscales 2 of 64x48): "
        "images are not downscaled below 128 px (--pipeline.model.min-train-size; 0 allows it)."
    )
    assert out.count(message) == 1, out[-3000:]


def test_splitting_by_screen_size_dies_out_on_small_images(tmp_path_factory):
    """Measured: at 64x48 the share fell 0.97, 0.59, 0.27, 0.09; at 16x12 it stayed 1.0 (its radii
    never went below 2 px, 0.125 of the image) and the count doubled at every refine, less pruning."""
    size, share = _train(tmp_path_factory, steps=REFINES[-1] + 1)
    assert size == (demo_runs.HEIGHT, demo_runs.WIDTH)
    assert share[-1] < 0.25 and share == sorted(share, reverse=True), share
    small_size, small_share = _train(tmp_path_factory, steps=REFINES[-1] + 1, min_train_size=0)  # before the fix
    assert small_size == (demo_runs.HEIGHT // 4, demo_runs.WIDTH // 4)
    assert small_share == [1.0] * len(REFINES), small_share
