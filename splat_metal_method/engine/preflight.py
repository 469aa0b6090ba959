"""The options and environment of ``ns-train splat-metal``, checked before nerfstudio writes anything.

ns-train saves config.yml (creating the run folder) before it builds the trainer, the model or the
data; a bad option met there ends in a traceback after a run folder holding only config.yml exists.
``check_options`` (called by SplatMetalTrainerConfig.save_config, before the dataset check) turns each
user-caused mistake found so far into one line (what, which option or file, how to fix), raised as
``OptionError`` (a SystemExit: exit status 1, no traceback): the device, the rendering backend and
``SPLAT_METAL_BACKEND``, the SH degree, MCMC's cap, the output folder (writable, and the run's folder
inside it), and ``--load-dir`` / ``--load-checkpoint`` (patches/checkpoints.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from ..ops.constants import SH_MAX_DEGREE as MAX_SH_DEGREE  # 0..4, as gsplat
from ..ops.rasterization import BACKENDS, BackendUnavailable, resolve_backend
from ..patches.checkpoints import checkpoint_file, find_checkpoint


class OptionError(SystemExit):
    """An option or environment variable that cannot work; ``str(e)`` is the whole message."""

    def __init__(self, message: str):
        super().__init__(message if message.startswith("splat-metal: ") else f"splat-metal: {message}")


def check_options(config) -> None:
    """Raises OptionError for the first unusable option of a TrainerConfig (see the module doc)."""
    machine = config.machine
    _check_device(machine.device_type)
    model = config.pipeline.model
    _check_backend(getattr(model, "backend", None), machine.device_type)
    sh_degree = getattr(model, "sh_degree", None)
    if sh_degree is not None and not 0 <= sh_degree <= MAX_SH_DEGREE:
        raise OptionError(
            f"--pipeline.model.sh-degree {sh_degree} is out of range; use 0 to {MAX_SH_DEGREE} (3 is the usual choice)."
        )
    cap_max = getattr(model, "cap_max", None)
    if cap_max is not None and cap_max != -1 and cap_max <= 0:
        raise OptionError(
            f"--pipeline.model.cap-max {cap_max} must be a positive number of gaussians, or -1 to derive it from "
            "the device's memory."
        )
    if config.max_num_iterations <= 0:
        raise OptionError(f"--max-num-iterations {config.max_num_iterations} must be at least 1.")
    if config.steps_per_save <= 0:
        raise OptionError(f"--steps-per-save {config.steps_per_save} must be at least 1.")
    _check_output(config)
    if config.load_dir is not None:
        find_checkpoint(config.load_dir, config.load_step, resume=True)
    elif config.load_checkpoint is not None:
        checkpoint_file(config.load_checkpoint)


def _check_device(device_type: str) -> None:
    if device_type == "mps" and not torch.backends.mps.is_available():
        raise OptionError(
            "--machine.device-type mps: this machine has no usable MPS device (an Apple GPU, macOS 14 or later); "
            "leave the option out to train on the best device here, or use --machine.device-type cpu."
        )
    if device_type == "cuda" and not torch.cuda.is_available():
        raise OptionError(
            "--machine.device-type cuda: torch sees no CUDA device here; leave the option out to train on the best "
            "device here, or use --machine.device-type cpu."
        )


def _check_backend(backend: Optional[str], device_type: str) -> None:
    env = os.environ.get("SPLAT_METAL_BACKEND")
    if env and env not in BACKENDS:
        raise OptionError(
            f"SPLAT_METAL_BACKEND={env!r} is not a backend; use one of {', '.join(BACKENDS)} (or unset it)."
        )
    if backend is None or (backend == "auto" and env in (None, "", "auto")):
        return  # "auto" always finds one: resolving it may build the native CPU backend, left to the run
    try:
        resolve_backend(backend, torch.device(device_type))
    except BackendUnavailable as e:
        where = f"SPLAT_METAL_BACKEND={env}" if backend == "auto" else f"--pipeline.model.backend {backend}"
        raise OptionError(
            f"{where}: {str(e).splitlines()[0]}; use auto (the best backend for the device) or another backend."
        ) from None


def _check_output(config) -> None:
    """The run's folder stays inside --output-dir, and a file can be created where it will be."""
    output_dir = Path(config.output_dir)
    inside = os.path.join(os.path.abspath(output_dir), "")
    if not os.path.abspath(config.get_base_dir()).startswith(inside):
        outside_by_name = not os.path.abspath(output_dir / config.experiment_name).startswith(inside)
        option = f"--experiment-name {config.experiment_name}" if outside_by_name else f"--timestamp {config.timestamp}"
        raise OptionError(
            f"{option} would put the run's folder outside --output-dir {output_dir}; use a name without '..' or '/'."
        )
    existing = Path(os.path.abspath(config.get_base_dir()))
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == Path(os.path.abspath(output_dir)) else f": {existing} in it"
        raise OptionError(f"--output-dir {output_dir}{where} is a file, not a folder; choose a folder.")
    probe = existing / f".splat-metal-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OptionError(
            f"--output-dir {output_dir}: cannot write in {existing} ({e.strerror or e}); choose a writable folder."
        ) from None
