"""The gaussians of a run, read from its checkpoint without building its pipeline.

nerfstudio's ``eval_setup`` (what ``ns-export`` runs) builds the whole pipeline, datamanager
included, and only then loads the checkpoint into it: 10 s on an idle 2-core machine, 30-50 s on a
loaded one, for an export that needs six tensors. ``load_run`` reads the same checkpoint (the one
``eval_setup`` would load: patches/checkpoints.eval_checkpoint, the newest readable step-*.ckpt, or
config.yml's load_step where this run has it) with ``torch.load(mmap=True)`` on the CPU (the
tensors are mapped from the file, not copied), and gives ``export_gaussians`` an object with the
attributes of a splatfacto model it reads (means, shs_0, shs_rest, opacities, scales, quats,
config): the same values ``ns-export gaussian-splat`` exports (splatfacto's ``shs_0``: DC as stored,
or RGB2SH(sigmoid(features_dc)) at SH degree 0). ``ns-export`` itself keeps nerfstudio's path.

The tensors are read by ``torch_zip.load`` (numpy views of the mapped file, without importing torch: the
import alone takes 2-3 s, most of a 100k-gaussian export); a checkpoint it cannot read (the legacy format, a
compressed member) is loaded with ``torch.load(mmap=True)`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np

PARAMS = ("means", "scales", "quats", "features_dc", "features_rest", "opacities")
SH_C0 = 0.28209479177387814


@dataclass
class CheckpointModel:
    """What export_gaussians reads of a splatfacto model, from a checkpoint's state dict."""

    params: Dict[str, Any]  # PARAMS, [N, ...]: numpy float32 arrays (torch CPU tensors where torch read them)
    config: (
        object  # the run's model config (SplatfactoModelConfig, or run_config.ModelSettings): sh_degree, rasterize_mode
    )

    @property
    def device(self):  # where eval_setup would have put the model (the .sog's k-means runs there)
        from .playcanvas import gpu_possible

        if not gpu_possible():  # the CPU, as torch would say, without importing it (kmeans_device's default)
            return None
        import torch

        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    means = property(lambda self: self.params["means"])
    scales = property(lambda self: self.params["scales"])
    quats = property(lambda self: self.params["quats"])
    opacities = property(lambda self: self.params["opacities"])
    shs_rest = property(lambda self: self.params["features_rest"])

    @property
    def shs_0(self):  # splatfacto's shs_0
        dc = self.params["features_dc"]
        if self.config.sh_degree > 0:
            return dc
        import torch  # torch's sigmoid, for ns-export's bits (an SH degree 0 run only)

        return (torch.sigmoid(torch.as_tensor(dc)) - 0.5) / SH_C0


class CheckpointProblem(Exception):
    """The checkpoint holds no usable gaussians; the message is the reason."""


def load_run(run) -> Tuple[CheckpointModel, Path, int]:
    """(model view, checkpoint path, step) of a run (run_config.RunSettings: its checkpoint folder,
    config.yml's load_step and model settings). Raises patches.checkpoints.CheckpointError (one line) when no checkpoint
    can be used, CheckpointProblem when the chosen one holds no gaussians."""
    from ..patches.checkpoints import CHECKPOINT_NAME, eval_checkpoint

    path = eval_checkpoint(run.checkpoint_dir, run.load_step)
    step = int(CHECKPOINT_NAME.fullmatch(path.name).group(1))  # type: ignore[union-attr]
    from . import torch_zip

    try:
        state = torch_zip.load(path)["pipeline"]
    except (torch_zip.Unsupported, KeyError, TypeError):  # torch reads it, or says why it cannot
        try:
            import torch

            loaded = torch.load(path, map_location="cpu", mmap=True)
            state = loaded["pipeline"]
        except Exception as e:  # noqa: BLE001 - a checkpoint of another program or torch version
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise CheckpointProblem(f"{path} cannot be loaded ({type(e).__name__}: {first})") from None
    state = {(k[len("module.") :] if k.startswith("module.") else k): v for k, v in state.items()}
    params = {}
    for name in PARAMS:  # gauss_params.* (nerfstudio >= 1.1), or the older bare names splatfacto accepts
        value = state.get(f"_model.gauss_params.{name}", state.get(f"_model.{name}"))
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):  # a numpy array or a torch tensor
            raise CheckpointProblem(f"{path} holds no gaussians (no _model.gauss_params.{name} in its state)")
        params[name] = value
    model_config = run.model
    n = params["means"].shape[0]
    rest = (model_config.sh_degree + 1) ** 2 - 1
    shapes = {"means": (n, 3), "scales": (n, 3), "quats": (n, 4), "features_dc": (n, 3),
              "features_rest": (n, rest, 3), "opacities": (n, 1)}  # fmt: skip
    for name, shape in shapes.items():
        if tuple(params[name].shape) != shape:
            raise CheckpointProblem(
                f"{path}: {name} is {tuple(params[name].shape)}, not {shape} as a run of SH degree "
                f"{model_config.sh_degree} with {n:,} gaussians has it"
            )
    params = {k: torch_zip.as_float32(v) if isinstance(v, np.ndarray) else v for k, v in params.items()}
    return CheckpointModel(params, model_config), path, step
