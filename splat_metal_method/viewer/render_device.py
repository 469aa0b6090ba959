"""Where renders for people run: the viewer, ns-render, ns-eval and evaluation during training.

nerfstudio's loaders (``eval_setup``: ns-viewer, ns-render, ns-eval, ns-export) put a finished run's
pipeline on "cuda if available else cpu"; they do not know mps. On a Mac the model therefore lives
on the CPU, and would render with the slow CPU path although the Metal kernels are right there.

The fix keeps every tensor nerfstudio can see where nerfstudio put it, and moves only the render:
``SplatMetalModel.get_outputs_for_camera`` asks :func:`render_target` which device and backend to use.
When that is not the model's own device and backend, the render runs on a copy of the gaussian
parameters on the target device (:func:`mirrored_params`: made once, refreshed only when a parameter
is updated in place or replaced, e.g. by densification) and the outputs come back on the model's
device. So ns-viewer on a Mac renders with Metal, while its cameras, batches, metrics and the
exporter keep the CPU tensors they expect. Training (``get_outputs`` in train mode) is never
redirected; under the viewer, renders run between training steps (nerfstudio's train_lock) and touch
no training state (tests/viewer/test_viewer.py checks training stays bit-identical).

Considered and not done: moving the model to mps after loading. nerfstudio's eval code keeps data on
the datamanager's device and some of it compares devices; a hook inside load_state_dict would move
the model under nerfstudio's feet. The copy costs one parameter-sized buffer on the GPU.

Choice (environment variable ``SPLAT_METAL_RENDER_DEVICE``, read at every render):
  - unset / "auto": a model on the CPU renders on the best device this machine has (mps > cuda),
    if the model's configured backend can run there; otherwise, and for models already on a GPU,
    on the model's device.
  - "model": always render on the model's device, with the model's backend.
  - "DEVICE" or "DEVICE:BACKEND" (e.g. "mps", "cuda:reference", "cpu:metal"): exactly that; an
    unavailable device or a backend that cannot run there is an error that names this variable.
    "cpu:metal" runs the Metal kernels under the MSL emulator: how tests on Linux take the path a
    Mac takes without a Mac.

Diagnostics: ``SPLAT_METAL_RENDER_LOG=FILE`` appends one JSON line per render (device, backend, step,
camera and size) so a user can see what the viewer rendered with, and tests can re-render the view.
"""

from __future__ import annotations

import contextvars
import json
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..ops.rasterization import BACKENDS, BackendUnavailable, best_device, resolve_backend

if TYPE_CHECKING:
    from nerfstudio.cameras.cameras import Cameras
    from nerfstudio.data.scene_box import OrientedBox
    from nerfstudio.models.splatfacto import SplatfactoModel  # a SplatMetalModel (method/model.py imports this module)

RENDER_DEVICE_ENV = "SPLAT_METAL_RENDER_DEVICE"
RENDER_LOG_ENV = "SPLAT_METAL_RENDER_LOG"


@dataclass(frozen=True)
class RenderTarget:
    device: torch.device
    backend: str  # what ops.rasterization gets ("auto" = by device)
    why: str  # one line for logs


def _device_available(device: torch.device) -> bool:
    if device.type == "mps":
        return torch.backends.mps.is_available()
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu"


def _runs_on(backend: str, device: torch.device) -> bool:
    try:
        resolve_backend(backend, device)
    except BackendUnavailable:
        return False
    return True


def render_target(model_device: torch.device, model_backend: str, setting: Optional[str] = None) -> RenderTarget:
    """The device and backend a non-training render of a model on ``model_device`` runs on.
    ``setting`` defaults to $SPLAT_METAL_RENDER_DEVICE (see the module docstring)."""
    model_device = torch.device(model_device)
    if setting is None:
        setting = os.environ.get(RENDER_DEVICE_ENV, "")
    setting = setting.strip().lower() or "auto"

    if setting == "model":
        return RenderTarget(model_device, model_backend, f"{RENDER_DEVICE_ENV}=model")
    if setting == "auto":
        best = best_device()
        if model_device.type == "cpu" and best.type != "cpu" and _runs_on(model_backend, best):
            return RenderTarget(best, model_backend, f"model on cpu, {best.type} available")
        return RenderTarget(model_device, model_backend, "render where the model is")

    name, _, backend = setting.partition(":")
    backend = backend or model_backend
    if backend not in BACKENDS:
        raise ValueError(f"{RENDER_DEVICE_ENV}={setting!r}: backend must be one of {BACKENDS}, got {backend!r}")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"{RENDER_DEVICE_ENV}={setting!r}: {name!r} is not a torch device") from e
    if not _device_available(device):
        raise ValueError(f"{RENDER_DEVICE_ENV}={setting!r}: device {device.type} is not available on this machine")
    try:
        resolve_backend(backend, device)
    except BackendUnavailable as e:
        raise ValueError(f"{RENDER_DEVICE_ENV}={setting!r}: {e}") from e
    return RenderTarget(device, backend, f"{RENDER_DEVICE_ENV}={setting}")


# ---------------------------------------------------------------------------------------------
# Device copies of the gaussian parameters.


class _Mirror:
    """A copy of one model's gaussian parameters on one device. ``stamp`` identifies the source
    state: each source tensor (held weakly, so a replaced parameter can never be mistaken for the
    old one), its storage and shape (``param.data = new`` keeps the object), and its in-place
    version counter, which optimizer steps and load_state_dict bump. Writes through ``param.data``
    in place bump nothing and are not seen; nothing in splatfacto or gsplat's strategies does that."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stamp: List[Tuple[str, weakref.ref, int, int, tuple]] = []
        self.params: Dict[str, Tensor] = {}
        self.refreshes = 0

    @staticmethod
    def stamp_of(source: Dict[str, Tensor]) -> List[Tuple[str, weakref.ref, int, int, tuple]]:
        return [(k, weakref.ref(v), v._version, v.data_ptr(), tuple(v.shape)) for k, v in source.items()]

    def current(self, source: Dict[str, Tensor]) -> bool:
        if len(self.stamp) != len(source):
            return False
        return all(
            name in source and ref() is source[name] and source[name]._version == version
            and source[name].data_ptr() == ptr and tuple(source[name].shape) == shape
            for name, ref, version, ptr, shape in self.stamp
        )  # fmt: skip


_mirrors: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[str, _Mirror]]" = weakref.WeakKeyDictionary()
_mirrors_lock = threading.Lock()


def shown_params(model: torch.nn.Module) -> Dict[str, Tensor]:
    """The gaussians a render of ``model`` shows: its parameters or, on rank 0 of a distributed run outside
    a training step, the copy of every rank's shard gathered there (``model.gathered_params``,
    distributed.py): the viewer and eval see the whole scene, not rank 0's shard."""
    gathered = getattr(model, "gathered_params", None)
    if gathered is not None and not model.training:
        return dict(gathered)
    return {k: v for k, v in model.gauss_params.items()}


def mirrored_params(model: torch.nn.Module, device: torch.device) -> Dict[str, Tensor]:
    """``shown_params(model)`` as detached tensors on ``device``, copied only when they changed."""
    device = torch.device(device)
    with _mirrors_lock:
        mirror = _mirrors.setdefault(model, {}).setdefault(str(device), _Mirror())
    source = shown_params(model)
    with mirror.lock:
        if not mirror.current(source):
            with torch.no_grad():
                mirror.params = {k: v.detach().to(device, copy=True) for k, v in source.items()}
            mirror.stamp = _Mirror.stamp_of(source)
            mirror.refreshes += 1
        return dict(mirror.params)


def mirror_refreshes(model: torch.nn.Module, device: torch.device) -> int:
    """How many times the copy on ``device`` was (re)made; 0 if there is none."""
    mirror = _mirrors.get(model, {}).get(str(torch.device(device)))
    return 0 if mirror is None else mirror.refreshes


# ---------------------------------------------------------------------------------------------
# The redirect seam read by SplatMetalModel.get_outputs.


@dataclass(frozen=True)
class _Redirect:
    model_ref: weakref.ref
    params: Dict[str, Tensor]
    backend: str


# A context variable, not a model attribute: every viewer client renders from its own thread, and a
# redirected render must never leak into a concurrent training step.
_redirect: contextvars.ContextVar[Optional[_Redirect]] = contextvars.ContextVar("splat_metal_redirect", default=None)


def render_source(model: "SplatfactoModel") -> Tuple[Dict[str, Tensor], str]:
    """The gaussian parameters and backend ``model.get_outputs`` renders with: the model's own,
    unless :func:`render_for_camera` redirected this render to another device."""
    redirect = _redirect.get()
    if redirect is not None and redirect.model_ref() is model:
        return dict(redirect.params), redirect.backend
    return shown_params(model), model.config.backend


_announced: "weakref.WeakKeyDictionary[torch.nn.Module, set]" = weakref.WeakKeyDictionary()


def _announce(model: torch.nn.Module, target: RenderTarget) -> None:
    seen = _announced.setdefault(model, set())
    key = (str(target.device), target.backend)
    if key not in seen:
        seen.add(key)
        from nerfstudio.utils.rich_utils import CONSOLE

        CONSOLE.print(
            f"[splat-metal] rendering on {target.device.type} (backend {target.backend}) while the model stays on "
            f"{model.device.type}: {target.why}. Set {RENDER_DEVICE_ENV}=model to render on {model.device.type}."
        )


def render_for_camera(
    model: "SplatfactoModel",
    camera: "Cameras",
    obb_box: "Optional[OrientedBox]",
    render_here: Callable[["Cameras", "Optional[OrientedBox]"], Dict],
) -> Dict:
    """``get_outputs_for_camera`` for SplatMetalModel: renders on :func:`render_target`'s device and
    returns the outputs on the model's device. ``render_here`` is splatfacto's own implementation,
    used when the target is the model's device and backend."""
    started = time.perf_counter()
    target = render_target(model.device, model.config.backend)
    if target.device == model.device and target.backend == model.config.backend:
        outputs = render_here(camera, obb_box)
    else:
        # Every redirected render takes this one path, also when only the backend differs (a copy on the
        # same device is cheap next to a render): "cpu:metal" on Linux runs exactly what a Mac runs.
        if target.device != model.device:
            _announce(model, target)
        params = mirrored_params(model, target.device)
        token = _redirect.set(_Redirect(weakref.ref(model), params, target.backend))
        try:
            with torch.no_grad():
                model.set_crop(obb_box)
                outputs = model.get_outputs(camera.to(target.device))
        finally:
            _redirect.reset(token)
        outputs = {k: v.to(model.device) if isinstance(v, Tensor) else v for k, v in outputs.items()}
    log_path = os.environ.get(RENDER_LOG_ENV)
    if log_path:
        _log_render(log_path, model, camera, target, time.perf_counter() - started)
    return outputs


def _log_render(path: str, model: "SplatfactoModel", camera: "Cameras", target: RenderTarget, seconds: float) -> None:
    info = getattr(model, "info", None) or {}
    record = {
        "time": time.time(),
        "step": int(getattr(model, "step", -1)),
        "device": target.device.type,
        "backend": info.get("backend", target.backend),
        "num_points": int(shown_params(model)["means"].shape[0]),  # what was rendered (distributed: every shard)
        "width": int(camera.width.reshape(-1)[0]),
        "height": int(camera.height.reshape(-1)[0]),
        "fx": float(camera.fx.reshape(-1)[0]),
        "fy": float(camera.fy.reshape(-1)[0]),
        "cx": float(camera.cx.reshape(-1)[0]),
        "cy": float(camera.cy.reshape(-1)[0]),
        "camera_to_world": camera.camera_to_worlds.reshape(-1, 3, 4)[0].tolist(),
        "seconds": round(seconds, 4),
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
