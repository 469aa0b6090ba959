"""3D Gaussian Splatting as Markov Chain Monte Carlo (Kheradmand et al. 2024) on every device:
`ns-train splat-metal-mcmc` (config.py) trains SplatMetalMCMCModel.

gsplat 1.4's ``MCMCStrategy`` does the work, unchanged: every ``refine_every`` steps between
``refine_start_iter`` and ``refine_stop_iter`` it teleports the gaussians whose opacity fell to
``min_opacity`` onto live ones (sampled by opacity), adds 5% more the same way up to ``cap_max``, and
after every step it moves each gaussian by noise shaped by its covariance and scaled by the means'
learning rate (so the noise follows the learning-rate schedule) times ``noise_lr``. Its two CUDA-only
ops are routed to our op layer (ops/mcmc.py, on the model's backend: gsplat on CUDA, the native or
Metal covariance on cpu and mps, relocation in PyTorch) for the duration of its step. The gaussian
count never exceeds ``cap_max``: growth stops there, relocation keeps the count, and initial
gaussians beyond the cap are subsampled.

What differs from splatfacto besides the strategy: gsplat's MCMC recipe (examples/simple_trainer.py
"mcmc"): initial opacity 0.5, the opacity and scale regularisers (0.01 each), and min_opacity 0.005
(splatfacto's cull_alpha_thresh); initial scales are splatfacto's (x1, not the recipe's x0.1: see
init_scale).

gsplat's schedule is made for 30K steps (refine from 500 every 100 until 25K, the means' learning rate
and so the noise decaying over 30K). A shorter run gets it scaled to its length (schedule-scale auto,
apply_schedule_scale: called by the trainer config before anything is written, so config.yml holds the
scaled values), as gsplat's --steps-scaler does, with refine-every kept at 10 or more.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Deque, List, Literal, Optional, Tuple, Type

import torch
from gsplat.strategy import MCMCStrategy

from .. import ops
from ..engine import memory
from .model import SplatMetalModel, SplatMetalModelConfig

# gsplat's default cap, used where the device's memory is unknown.
GSPLAT_CAP_MAX = 1_000_000
# The run length gsplat's MCMC schedule (refine 500..25000 every 100, means' lr decay over 30K) is made for.
DESIGN_STEPS = 30_000
# Fewest steps between two refines of a scaled schedule: a relocated or added gaussian gets this many steps
# to take its place before the next refine judges it (gsplat's 100 at 30K would be 2 steps at 600).
MIN_REFINE_EVERY = 10


@contextlib.contextmanager
def routed_ops(backend: str = "auto"):
    """While active, gsplat's strategy ops (gsplat.strategy.ops: relocate, sample_add,
    inject_noise_to_position) call our device-aware compute_relocation and quat_scale_to_covar_preci
    instead of the CUDA-only ones they import."""
    import gsplat.strategy.ops as gsplat_ops

    saved = gsplat_ops.compute_relocation, gsplat_ops.quat_scale_to_covar_preci
    gsplat_ops.compute_relocation = functools.partial(ops.compute_relocation, backend=backend)
    gsplat_ops.quat_scale_to_covar_preci = functools.partial(ops.quat_scale_to_covar_preci, backend=backend)
    try:
        yield
    finally:
        gsplat_ops.compute_relocation, gsplat_ops.quat_scale_to_covar_preci = saved


@dataclass
class SplatMetalMCMCStrategy(MCMCStrategy):
    """gsplat's MCMCStrategy with its ops routed to ours (any device), and a record of its refine
    steps for the memory hooks (``events``, read through ``pop_events`` as BudgetedStrategy's)."""

    absgrad: bool = False  # read by SplatMetalModel.get_outputs; MCMC needs no image-plane gradients
    backend: str = "auto"  # ops/mcmc.py backend: the model's (auto, reference, gsplat, metal, cpu)
    events: Deque[Tuple[int, str]] = field(
        default_factory=lambda: collections.deque(maxlen=64), repr=False, compare=False
    )
    on_message: Optional[Callable[[str], None]] = field(default=None, repr=False, compare=False)

    def step_post_backward(self, params, optimizers, state, step, info, lr):
        with routed_ops(self.backend):
            super().step_post_backward(params, optimizers, state, step, info, lr)
        if self.refine_start_iter < step < self.refine_stop_iter and step % self.refine_every == 0:
            self.events.append((step, "refine"))

    def pop_events(self) -> List[Tuple[int, str]]:
        events = list(self.events)
        self.events.clear()
        return events

    @torch.no_grad()
    def _relocate_gs(self, params, optimizers, binoms) -> int:
        # gsplat samples the targets among the live gaussians; with none left it would crash.
        if not bool((torch.sigmoid(params["opacities"].flatten()) > self.min_opacity).any()):
            if self.on_message is not None:
                self.on_message(f"every gaussian is at or below min opacity {self.min_opacity}: nothing to relocate to")
            return 0
        return super()._relocate_gs(params, optimizers, binoms)


@dataclass
class SplatMetalMCMCModelConfig(SplatMetalModelConfig):
    """splat-metal with gsplat's MCMC strategy instead of splatfacto's densification (see mcmc.py).

    Of splatfacto's densification options MCMC uses warmup_length (refine start), stop_split_at
    (refine stop), refine_every and cull_alpha_thresh (min opacity: below it a gaussian is relocated);
    max_gaussians is not used (cap_max is the cap)."""

    _target: Type = field(default_factory=lambda: SplatMetalMCMCModel)
    cap_max: int = -1
    """Most gaussians MCMC keeps (growth stops there; it never exceeds it). -1: derived from the device's
    memory like max-gaussians (printed when training starts); a positive number: exactly that."""
    noise_lr: float = 5e5
    """Position noise: scaled by this times the means' current learning rate (gsplat's default)."""
    mcmc_opacity_reg: float = 0.01
    """Weight of the mean opacity in the loss (pushes unneeded gaussians to relocation)."""
    mcmc_scale_reg: float = 0.01
    """Weight of the mean scale in the loss."""
    init_opacity: float = 0.5
    """Opacity of every initial gaussian (gsplat's MCMC recipe; splatfacto uses 0.1)."""
    init_scale: float = 1.0
    """Initial scales: this times the mean distance to the 3 nearest neighbours. 1 (splatfacto's, the 3DGS
    paper's): the seed points cover the surfaces from the first step. gsplat's MCMC recipe has 0.1, which
    needs a long run: growing a gaussian 10x at the scales' learning rate 0.005 (log space) takes 460+
    steps, so in a 600-step run the gaussians stayed specks (README "Real captures": 18.3 vs 25.6 dB)."""
    cull_alpha_thresh: float = 0.005
    """MCMC's min_opacity: gaussians at or below it are relocated onto live ones."""
    stop_split_at: int = 25000
    """MCMC's refine_stop_iter: relocation and growth stop after this step (noise continues)."""
    schedule_scale: Literal["auto", "off"] = "auto"
    """auto: a run shorter than 30K steps (--max-num-iterations, counted from step 0 when resuming) gets the
    30K schedule scaled to its length, as gsplat's --steps-scaler does: warmup-length, refine-every
    (at least 10), stop-split-at and the means' learning-rate decay (which MCMC's noise follows), each
    only if still at its 30K default (a value you set is kept); printed when training starts.
    off: the values as given."""


def scaled_schedule(steps: int) -> dict:
    """The 30K-step MCMC schedule scaled to a run of ``steps`` (unchanged from 30K steps on):
    {warmup_length, refine_every, stop_split_at, means_max_steps}."""
    defaults = SplatMetalMCMCModelConfig()
    scale = min(1.0, max(1, steps) / DESIGN_STEPS)
    every = max(MIN_REFINE_EVERY, round(defaults.refine_every * scale))
    return {
        "warmup_length": max(every, round(defaults.warmup_length * scale)),
        "refine_every": every,
        "stop_split_at": max(1, round(defaults.stop_split_at * scale)),
        "means_max_steps": max(1, round(DESIGN_STEPS * scale)),
    }


def run_length(trainer_config) -> int:
    """Steps of the whole run: --max-num-iterations, plus the loaded checkpoint's steps when resuming
    (nerfstudio counts --max-num-iterations from the loaded step)."""
    steps = trainer_config.max_num_iterations
    path = trainer_config.load_checkpoint
    if trainer_config.load_dir is not None:
        load_dir = Path(trainer_config.load_dir)
        step = trainer_config.load_step
        if step is None:  # nerfstudio loads the latest
            found = [
                int(m.group(1)) for f in load_dir.glob("step-*.ckpt") if (m := re.match(r"step-(\d+)\.ckpt", f.name))
            ]
            step = max(found) if found else None
        return steps + (step + 1 if step is not None else 0)
    if path is not None and (m := re.match(r"step-(\d+)\.ckpt", Path(path).name)):
        return steps + int(m.group(1)) + 1
    return steps


def apply_schedule_scale(trainer_config) -> Optional[str]:
    """schedule-scale auto on a splat-metal-mcmc TrainerConfig: the 30K schedule's step counts still at their
    defaults are set to scaled_schedule(run length) in place. Returns the line to print, None if nothing changed."""
    model = trainer_config.pipeline.model
    if not isinstance(model, SplatMetalMCMCModelConfig) or model.schedule_scale != "auto":
        return None
    steps = run_length(trainer_config)
    if steps >= DESIGN_STEPS:
        return None
    scaled, defaults = scaled_schedule(steps), SplatMetalMCMCModelConfig()
    changed = []
    for name in ("warmup_length", "refine_every", "stop_split_at"):
        if getattr(model, name) == getattr(defaults, name):
            setattr(model, name, scaled[name])
            changed.append(f"{name.replace('_', '-')} {scaled[name]}")
    scheduler = (trainer_config.optimizers.get("means") or {}).get("scheduler")
    if scheduler is not None and getattr(scheduler, "max_steps", None) == DESIGN_STEPS:
        scheduler.max_steps = scaled["means_max_steps"]
        changed.append(f"means' lr (and noise) decay over {scaled['means_max_steps']} steps")
    if not changed:
        return None
    return (f"MCMC schedule scaled to {steps:,} steps (x{steps / DESIGN_STEPS:.3g} of 30K; schedule-scale auto): "
            + ", ".join(changed))  # fmt: skip


def resolve_cap_max(value: int, device, sh_degree: int = 3) -> Tuple[int, str]:
    """cap_max config value -> (cap, how it was chosen). -1: from the device's memory (gsplat's
    1,000,000 where that is unknown); positive: as given."""
    if value is None or value == -1:
        cap, source = memory.default_max_gaussians(device, sh_degree)
        if cap is None:
            return GSPLAT_CAP_MAX, f"gsplat's default ({source})"
        return cap, source
    if value <= 0:
        raise ValueError(
            f"cap-max must be a positive number of gaussians, or -1 to derive it from the device's memory; got {value}"
        )
    return int(value), "set in the config"


class SplatMetalMCMCModel(SplatMetalModel):
    config: SplatMetalMCMCModelConfig

    def populate_modules(self):
        cfg = self.config
        if not 0 < cfg.init_opacity < 1 or cfg.init_scale <= 0:
            raise ValueError(
                f"init-opacity must be in (0, 1) and init-scale > 0; got {cfg.init_opacity}, {cfg.init_scale}"
            )
        super().populate_modules()  # splatfacto's gaussians (seed points or random init), on our ops
        device = torch.device(self.kwargs.get("device") or "cpu")
        cap, source = resolve_cap_max(cfg.cap_max, device, cfg.sh_degree)
        n = self.num_points
        with torch.no_grad():
            if n > cap:  # MCMC never grows past the cap, so start within it
                keep = torch.randperm(n)[:cap].sort().values
                for name, p in self.gauss_params.items():
                    self.gauss_params[name] = torch.nn.Parameter(p.data[keep])
                source += f"; {n:,} initial gaussians, a random {cap:,} of them kept"
            self.gauss_params["opacities"].fill_(math.log(cfg.init_opacity / (1 - cfg.init_opacity)))
            self.gauss_params["scales"].add_(math.log(cfg.init_scale))
        self.strategy = SplatMetalMCMCStrategy(
            cap_max=cap,
            noise_lr=cfg.noise_lr,
            refine_start_iter=cfg.warmup_length,
            refine_stop_iter=cfg.stop_split_at,
            refine_every=cfg.refine_every,
            min_opacity=cfg.cull_alpha_thresh,
            backend=cfg.backend,  # as rasterization: "auto" picks by device, an explicit one is kept
        )
        self.strategy_state = self.strategy.initialize_state()
        self.memory = memory.setup_model_memory(self, max_gaussians=(cap, f"cap-max: {source}"))
        self.strategy.on_message = self.memory.say

    def step_post_backward(self, step):
        assert step == self.step
        self.strategy.step_post_backward(
            params=self.gauss_params,
            optimizers=self.optimizers,
            state=self.strategy_state,
            step=step,
            info=self.info,
            lr=self.optimizers["means"].param_groups[0]["lr"],  # as nerfstudio: after this step's scheduler update
        )

    def render_only_groups(self):
        """As the base model's, less the opacities and scales where MCMC's regularisers add loss terms on them."""
        reg = {"opacities": self.config.mcmc_opacity_reg > 0, "scales": self.config.mcmc_scale_reg > 0}
        return tuple(g for g in super().render_only_groups() if not reg.get(g, False))

    def get_loss_dict(self, outputs, batch, metrics_dict=None):
        loss_dict = super().get_loss_dict(outputs, batch, metrics_dict)
        if self.config.mcmc_opacity_reg > 0:
            loss_dict["mcmc_opacity_reg"] = self.config.mcmc_opacity_reg * torch.sigmoid(self.opacities).mean()
        if self.config.mcmc_scale_reg > 0:
            loss_dict["mcmc_scale_reg"] = self.config.mcmc_scale_reg * torch.exp(self.scales).mean()
        return loss_dict
