"""The state a checkpoint must carry so that a resumed run continues exactly as the uninterrupted one.

nerfstudio's checkpoint holds the pipeline's parameters, the optimizers, the schedulers and the
grad scaler. Training also depends on state it leaves out, each of which changes the run after a
resume:

* the densification strategy's running state (``model.strategy_state``: for gsplat's
  DefaultStrategy the accumulated image-plane gradients ``grad2d``, the visibility ``count`` and
  the screen-size ``radii`` since the last refine; for another strategy, whatever its
  ``initialize_state`` dict holds) -- without it the first refine after a resume decides on a few
  steps of statistics instead of a full window;
* the random generators: torch's (random backgrounds, the positions of split gaussians, MCMC's
  sampling), numpy's and Python's ``random`` (nerfstudio's eval-image choice; gsplat falls back to
  numpy for very large multinomial draws), and the accelerator's;
* the datamanager's camera order: FullImageDatamanager's queue of training cameras not yet seen
  this epoch (``train_unseen_cameras``), the private ``random.Random`` that shuffles the next
  epoch, the eval queue, and the fps sampler's epoch counts.

``capture(pipeline)`` returns all of it as plain data (tensors, numbers, lists, tuples, strings),
so that the checkpoint still loads with torch's ``weights_only`` unpickler (checkpoints.py).
``restore(pipeline, state)`` puts back the strategy and datamanager parts and returns the notes to
print about what could not be restored; ``restore_rng(state)`` puts back the generators (the
Trainer does this right before the first resumed step, after everything set-up draws). The state of
any strategy goes through the same path: it is the strategy's own state dict, restored in place.
"""

from __future__ import annotations

import random
from typing import Any, Dict, List

import numpy as np
import torch

KEY = "splat_metal_resume"  # top-level key in the checkpoint; nerfstudio's loaders ignore it
FORMAT = 1

_QUEUES = ("train_unseen_cameras", "eval_unseen_cameras")  # FullImageDatamanager's camera queues
_FPS_COUNTS = "train_unsampled_epoch_count"  # FullImageDatamanager, train_cameras_sampling_strategy "fps"


# ---- random generators
def rng_state() -> Dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "mps" in rng and torch.backends.mps.is_available():
        torch.mps.set_rng_state(rng["mps"])


# ---- datamanager
def datamanager_state(datamanager) -> Dict[str, Any]:
    state: Dict[str, Any] = {name: list(getattr(datamanager, name)) for name in _QUEUES if hasattr(datamanager, name)}
    generator = getattr(datamanager, "random_generator", None)
    if isinstance(generator, random.Random):
        state["random_generator"] = generator.getstate()
    counts = getattr(datamanager, _FPS_COUNTS, None)
    if counts is not None:
        state[_FPS_COUNTS] = torch.from_numpy(np.array(counts, dtype=np.float64))
    return state


def _dataset_sizes(datamanager) -> Dict[str, int]:
    return {
        "train_unseen_cameras": len(datamanager.train_dataset),
        "eval_unseen_cameras": len(datamanager.eval_dataset) if datamanager.eval_dataset is not None else 0,
    }


def restore_datamanager(datamanager, state: Dict[str, Any]) -> List[str]:
    sizes = _dataset_sizes(datamanager)
    for name in _QUEUES:
        if name not in state or not hasattr(datamanager, name):
            continue
        queue = [int(i) for i in state[name]]
        if not queue or max(queue) >= sizes[name]:  # another dataset than the checkpoint's
            return [f"the checkpoint's camera order does not fit this dataset ({name}); cameras are drawn afresh"]
        setattr(datamanager, name, queue)
    if "random_generator" in state:
        if not isinstance(getattr(datamanager, "random_generator", None), random.Random):
            datamanager.random_generator = random.Random()
        datamanager.random_generator.setstate(state["random_generator"])
    if _FPS_COUNTS in state:
        setattr(datamanager, _FPS_COUNTS, state[_FPS_COUNTS].numpy().copy())
    return []


# ---- densification strategy
def strategy_state(model) -> Dict[str, Any]:
    return {"class": type(model.strategy).__name__, "state": dict(model.strategy_state)}


def restore_strategy(model, state: Dict[str, Any]) -> List[str]:
    this = type(model.strategy).__name__
    if state["class"] != this:
        return [f"the checkpoint's densification state is {state['class']}'s, this run uses {this}: it starts afresh"]
    n = model.gauss_params["means"].shape[0]
    device = model.gauss_params["means"].device
    loaded = {k: v.to(device, copy=True) if isinstance(v, torch.Tensor) else v for k, v in state["state"].items()}
    rows = [k for k, v in loaded.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] != n]
    if any(k in ("grad2d", "count", "radii") for k in rows):  # per-gaussian statistics of another model
        return [f"the checkpoint's densification state does not match its {n:,} gaussians; it starts afresh"]
    model.strategy_state.clear()  # in place: the strategy, the NaN guard and gsplat's ops share this dict
    model.strategy_state.update(loaded)
    return []


# ---- all of it
def capture(pipeline) -> Dict[str, Any]:
    state: Dict[str, Any] = {"format": FORMAT, "rng": rng_state()}
    state["datamanager"] = datamanager_state(pipeline.datamanager)
    if hasattr(pipeline.model, "strategy_state") and hasattr(pipeline.model, "strategy"):
        state["strategy"] = strategy_state(pipeline.model)
    return state


def restore(pipeline, state: Dict[str, Any]) -> List[str]:
    """Restores the datamanager and strategy parts (not the generators: restore_rng). Returns notes."""
    if state.get("format") != FORMAT:
        return [f"its resume state has format {state.get('format')!r}, this splat-metal reads {FORMAT}"]
    notes = restore_datamanager(pipeline.datamanager, state["datamanager"])
    if "strategy" in state and hasattr(pipeline.model, "strategy_state"):
        notes += restore_strategy(pipeline.model, state["strategy"])
    return notes
