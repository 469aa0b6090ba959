"""In-process nerfstudio training (what Trainer.setup/train_iteration do, without the viewer),
shared by tests and benchmarks: build splat-metal's pipeline on a dataset and run steps."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import numpy as np
import torch


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_pipeline(data: Path, seed: int = 0, warmup: int = 10, refine_every: int = 20, sh_degree_interval: int = 10,
                  backend: str = "auto", sh_degree: int = 3, camera_mode: str = "SO3xR3", **model_options):  # fmt: skip
    """VanillaPipeline + Optimizers + training callbacks, as Trainer.setup builds them (no viewer), on
    CPU, with the SO3xR3 camera optimizer (viewmats get gradients; ``camera_mode``) and a white background;
    ``model_options`` set further SplatMetalModelConfig fields."""
    from nerfstudio.cameras.camera_optimizers import CameraOptimizerConfig

    from splat_metal_method.method.configs import splat_metal_trainer_config

    cfg = splat_metal_trainer_config()
    cfg.machine.device_type = "cpu"
    cfg.pipeline.datamanager.data = data
    model = cfg.pipeline.model
    model.camera_optimizer = CameraOptimizerConfig(mode=camera_mode)
    model.background_color = "white"  # splatfacto's default "random" would differ between two renders
    model.num_downscales = 0
    model.warmup_length = warmup
    model.refine_every = refine_every
    model.sh_degree_interval = sh_degree_interval
    model.sh_degree = sh_degree
    model.backend = backend  # "auto": SPLAT_METAL_BACKEND decides
    for name, value in model_options.items():
        assert hasattr(model, name), name
        setattr(model, name, value)
    return setup_pipeline(cfg, "cpu", seed)


def setup_pipeline(cfg, device: str, seed: int = 0):
    """Pipeline, Optimizers and training callbacks of a TrainerConfig (any method), on ``device``."""
    from nerfstudio.engine.callbacks import TrainingCallbackAttributes

    from splat_metal_method.engine.optimizers import GaussianOptimizers

    seed_all(seed)
    pipeline = cfg.pipeline.setup(device=device, test_mode="val", world_size=1, local_rank=0)
    # as SplatMetalTrainer.setup_optimizers: the gaussians' Adam one kernel pass on the metal backend
    optimizers = GaussianOptimizers(cfg.optimizers, pipeline.get_param_groups(), pipeline.model)
    callbacks = pipeline.get_training_callbacks(
        TrainingCallbackAttributes(optimizers=optimizers, grad_scaler=None, pipeline=pipeline, trainer=None)
    )
    return pipeline, optimizers, callbacks


def train_step(pipeline, optimizers, callbacks, step: int) -> torch.Tensor:
    """Trainer.train_iteration without the grad scaler (mixed precision is off): returns the loss."""
    from nerfstudio.engine.callbacks import TrainingCallbackLocation

    for cb in callbacks:
        cb.run_callback_at_location(step, location=TrainingCallbackLocation.BEFORE_TRAIN_ITERATION)
    optimizers.zero_grad_all()
    _, loss_dict, _ = pipeline.get_train_loss_dict(step=step)
    loss = functools.reduce(torch.add, loss_dict.values())
    loss.backward()
    optimizers.optimizer_step_all()
    optimizers.scheduler_step_all(step)
    for cb in callbacks:
        cb.run_callback_at_location(step, location=TrainingCallbackLocation.AFTER_TRAIN_ITERATION)
    return loss.detach()
