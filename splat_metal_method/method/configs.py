"""`ns-train splat-metal`: splatfacto's training recipe with SplatMetalModel and a device chosen
by itself (mps > cuda > cpu) unless the user passes --machine.device-type. The dataset is checked
(dataparser.py) before ns-train writes anything."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Type

import torch
from nerfstudio.configs.base_config import MachineConfig, ViewerConfig
from nerfstudio.engine.optimizers import AdamOptimizerConfig
from nerfstudio.engine.schedulers import ExponentialDecaySchedulerConfig
from nerfstudio.engine.trainer import TrainerConfig
from nerfstudio.pipelines.base_pipeline import VanillaPipelineConfig
from nerfstudio.plugins.types import MethodSpecification
from nerfstudio.utils.rich_utils import CONSOLE

from ..data.datamanager import SplatMetalDatamanagerConfig
from ..data.dataparser import SplatMetalDataParserConfig, check_dataset
from ..engine import distributed, preflight
from ..engine.trainer import SplatMetalTrainer
from ..ops import best_device
from ..patches import checkpoints
from ..patches import startup as startup_fix
from ..patches import viewer as viewer_fixes
from .mcmc import SplatMetalMCMCModelConfig, apply_schedule_scale
from .model import SplatMetalModelConfig, check_bilateral_grid

viewer_fixes.apply()  # before any Viewer exists: Ctrl-C could hang after a browser left (viewer_fixes.py)
startup_fix.apply()  # before nerfstudio builds its external-method stand-ins: a third of start-up (startup_fix.py)
checkpoints.install()  # nerfstudio's loaders take the newest readable step-*.ckpt, nothing else (checkpoints.py)


def default_device_type() -> str:
    """mps > cuda > cpu: the best device this machine has."""
    return best_device().type


@dataclass
class SplatMetalTrainerConfig(TrainerConfig):
    """TrainerConfig that checks the dataset before ns-train saves config.yml (its first write), and
    trains with SplatMetalTrainer (trainer.py: atomic checkpoints that resume exactly, clean stop on
    Ctrl-C/SIGTERM/NaN)."""

    _target: Type = field(default_factory=lambda: SplatMetalTrainer)

    def set_timestamp(self) -> None:
        """ns-train's first call on the config. Under torchrun (distributed.py) it also starts the process
        group, so that every rank agrees on rank 0's timestamp (one output folder) and options before
        anything is written. splat-metal-mcmc's schedule is scaled to the run here (schedule-scale auto), so
        that config.yml, the printed config and every rank hold the scaled values."""
        super().set_timestamp()
        scaled = apply_schedule_scale(self)
        if scaled is not None:
            CONSOLE.print(scaled)
        try:
            ctx = distributed.setup(self.machine.device_type, self.machine.num_devices)
            if ctx is not None and ctx.world_size > 1:
                self.timestamp = distributed.broadcast_object(self.timestamp)
                import yaml

                distributed.check_same_options(yaml.dump(self))
        except distributed.DistributedError as e:
            raise SystemExit(f"splat-metal distributed: {e}") from None

    def print_to_terminal(self) -> None:
        if distributed.current() is None or distributed.current().is_main:  # type: ignore[union-attr]
            super().print_to_terminal()

    def save_config(self) -> None:
        preflight.check_options(self)  # options and environment, before the first write (preflight.py)
        if distributed.current() is not None and not distributed.current().is_main:  # type: ignore[union-attr]
            return  # rank 0 writes the run's config
        datamanager = self.pipeline.datamanager
        dataparser = getattr(datamanager, "dataparser", None)
        if isinstance(dataparser, SplatMetalDataParserConfig):  # not when the user picked another dataparser
            data = datamanager.data if datamanager.data is not None else dataparser.data
            check_dataset(data, config=dataparser)  # its downscale factor, split and seed-point options too
        if isinstance(self.pipeline.model, SplatMetalModelConfig):  # a one-line refusal before any write
            check_bilateral_grid(self.pipeline.model, self.machine.device_type)
        super().save_config()


@dataclass
class FusedAdamOptimizerConfig(AdamOptimizerConfig):
    """nerfstudio's Adam config with torch's fused Adam: one ``_fused_adam_`` kernel per parameter group
    and step, with the step counter on the device. torch's default on mps and cpu is the single-tensor
    path (about 12 aten ops per parameter and an ``.item()`` of a CPU step counter); fused Adam has
    kernels on mps (torch >= 2.4), cuda and cpu, so every device runs what a Mac runs. Resumes stay
    exact: the checkpoint carries the fused state (a step tensor), and an older checkpoint's CPU step
    counter is moved to the device by torch's load_state_dict."""

    fused: bool = True

    def setup(self, params) -> torch.optim.Optimizer:
        optimizer = super().setup(params)
        if self.fused:
            optimizer.register_step_post_hook(_bump_param_versions)
        return optimizer


def _bump_param_versions(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """torch's fused Adam updates the parameters without bumping their in-place version counters (the
    single-tensor path does): bump them, so what watches `_version` sees every step (the viewer's copy
    of the gaussians on its render device, render_device.py, stayed stale between densifications)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            torch.autograd.graph.increment_version(p)


def _adam(lr: float) -> AdamOptimizerConfig:
    return FusedAdamOptimizerConfig(lr=lr, eps=1e-15)


def splat_metal_trainer_config() -> TrainerConfig:
    """splatfacto's TrainerConfig from nerfstudio 1.1.5 (same schedule and learning rates)."""
    return SplatMetalTrainerConfig(
        method_name="splat-metal",
        steps_per_eval_image=100,
        steps_per_eval_batch=0,
        steps_per_save=2000,
        steps_per_eval_all_images=1000,
        max_num_iterations=30000,
        mixed_precision=False,
        machine=MachineConfig(device_type=default_device_type()),
        pipeline=VanillaPipelineConfig(
            datamanager=SplatMetalDatamanagerConfig(
                dataparser=SplatMetalDataParserConfig(load_3D_points=True),
                cache_images_type="uint8",
            ),
            model=SplatMetalModelConfig(),
        ),
        optimizers={
            "means": {
                "optimizer": _adam(1.6e-4),
                "scheduler": ExponentialDecaySchedulerConfig(lr_final=1.6e-6, max_steps=30000),
            },
            "features_dc": {"optimizer": _adam(0.0025), "scheduler": None},
            "features_rest": {"optimizer": _adam(0.0025 / 20), "scheduler": None},
            "opacities": {"optimizer": _adam(0.05), "scheduler": None},
            "scales": {"optimizer": _adam(0.005), "scheduler": None},
            "quats": {"optimizer": _adam(0.001), "scheduler": None},
            "camera_opt": {
                "optimizer": _adam(1e-4),
                "scheduler": ExponentialDecaySchedulerConfig(
                    lr_final=5e-7, max_steps=30000, warmup_steps=1000, lr_pre_warmup=0
                ),
            },
            "bilateral_grid": {
                "optimizer": _adam(2e-3),
                "scheduler": ExponentialDecaySchedulerConfig(
                    lr_final=1e-4, max_steps=30000, warmup_steps=1000, lr_pre_warmup=0
                ),
            },
        },
        viewer=ViewerConfig(num_rays_per_chunk=1 << 15),
        vis="viewer",
    )


splat_metal_method = MethodSpecification(
    config=splat_metal_trainer_config(),
    description="Gaussian splatting (splatfacto) with Metal kernels on Apple GPUs, gsplat on NVIDIA, PyTorch on CPU.",
)


def splat_metal_mcmc_trainer_config() -> TrainerConfig:
    """splat-metal's recipe (same schedule, learning rates, devices) with gsplat's MCMC strategy
    instead of splatfacto's densification (mcmc.py)."""
    config = splat_metal_trainer_config()
    config.method_name = "splat-metal-mcmc"
    config.pipeline.model = SplatMetalMCMCModelConfig()
    return config


splat_metal_mcmc_method = MethodSpecification(
    config=splat_metal_mcmc_trainer_config(),
    description="splat-metal with 3DGS-MCMC (gsplat's MCMCStrategy on every device): a fixed gaussian budget (cap-max).",
)
