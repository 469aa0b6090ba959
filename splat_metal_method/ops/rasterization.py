"""The one public op: ``rasterization``, with gsplat 1.4.0's semantics for what splatfacto passes.

Backends (chosen once, at the top of ``rasterization``):
  - "gsplat":    gsplat's CUDA kernels (the whole call is passed through unchanged: no device work here,
                 tests/ops/test_gsplat_passthrough.py counts it).
  - "metal":     our Metal kernels (MPS tensors; CPU tensors run them under the MSL emulator):
                 ops/metal/fused.py's ``rasterization_metal``, with its fused pieces.
  - "cpu":       native multi-threaded rasterization on CPU tensors (ops/cpu; needs a C++ compiler,
                 built on first use and cached), the reference's PyTorch for the other stages.
  - "reference": pure PyTorch on any device; the oracle for the others.
  - "auto":      by tensor device: cuda -> gsplat, mps -> metal, cpu -> "cpu" (or "reference", with
                 one warning, where no C++ compiler can build it).
The environment variable SPLAT_METAL_BACKEND overrides "auto" for the whole process.

Non-finite inputs: one meaning on reference, cpu and metal (tests/ops/test_nonfinite.py), by explicit
isfinite checks in each backend's kernels (covar.h splat_params_finite / splat_projection_finite,
the alpha test) and, for what projection cannot see, here:
  * a gaussian with a non-finite mean, quaternion, scale, opacity or colour (an SH coefficient of the
    bands sh_degree uses, or an SH colour past float32), or whose quaternion's squared norm or projected
    values (means2d, conic, radius) overflow float32, or whose radius does not fit int32, is culled: radius 0, opacity 0 in
    meta, no contribution, zero gradients (so is one projection culls: radius 0, opacity 0);
  * a camera whose view matrix (the 12 entries projection reads; all 16 with SH colours, whose camera
    position inv(viewmat) must be finite too) is not finite is culled whole: background only;
  * a (gaussian, pixel) pair is composited only if sigma and opacity * exp(-sigma) are finite, sigma
    >= 0 and alpha >= ALPHA_MIN, identically in forward and backward;
  * backgrounds are composited as given (non-finite ones give non-finite pixels and gradients);
  * finite values render as the math says (1e30 opacity is alpha 0.999; zero scales are the eps2d blur).
gsplat 1.4's CUDA kernels (backend "gsplat", passed through unchanged) have no such checks (nor do they
turn a zero quaternion into the identity rotation, as the other backends do: rsqrt(0) makes it NaN): its
projection culls by `z < near`, `det <= 0`, `radius <= clip` comparisons, which NaN passes, so NaN
reaches `(int32_t)radius`, which CUDA converts to 0 (culled by accident, also in backward); an
overflowing quaternion normalises (rsqrt) to the identity rotation; its rasterizer's
`min(0.999f, opac * __expf(-sigma))` turns a NaN or +inf opacity into 0.999 (painted nearly opaque,
as our Metal kernels did before these checks); NaN colours reach every pixel the gaussian touches.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Dict, Tuple

import torch
from torch import Tensor

from .contract import RasterizeCall, call_signature, check_dense, check_inputs
from .stages import _project_and_cull, rasterize_projected

BACKENDS = ("auto", "reference", "gsplat", "metal", "cpu")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why."""


def _check_gsplat(device: torch.device) -> None:
    if device.type != "cuda":
        raise BackendUnavailable(
            f"backend 'gsplat' runs gsplat's CUDA kernels and needs CUDA tensors, got tensors on {device}"
            + ("" if torch.cuda.is_available() else " (no CUDA device on this machine)")
        )


def _check_metal(device: torch.device) -> None:
    if device.type not in ("mps", "cpu"):
        raise BackendUnavailable(
            f"backend 'metal' runs on MPS tensors (or CPU tensors under the MSL emulator), got {device}"
        )


_warned_no_native = False


def _cpu_backend_available(explicit: bool) -> bool:
    """Whether the native CPU backend can run; warns once (auto) or raises (explicit) if not."""
    global _warned_no_native
    from .cpu import build

    if build.load() is not None:
        return True
    reason = build.unavailable_reason()
    hint = ("install a C++17 compiler (Debian/Ubuntu: apt-get install g++; macOS: xcode-select --install) "
            "or point $CXX at one")  # fmt: skip
    if explicit:
        raise BackendUnavailable(f"backend 'cpu' needs its native library, which cannot be built: {reason}; {hint}")
    if not _warned_no_native:
        _warned_no_native = True
        warnings.warn(
            f"splat-metal: the fast CPU backend cannot be built ({reason}); using the 'reference' backend, "
            f"which is 10-40x slower per step. To fix: {hint}.",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def _check_cpu(device: torch.device) -> None:
    if device.type != "cpu":
        raise BackendUnavailable(f"backend 'cpu' runs on CPU tensors, got tensors on {device}")


def best_device() -> torch.device:
    """mps > cuda > cpu: the device ``ns-train splat-metal`` trains on and the viewer renders on."""
    if torch.backends.mps.is_available():
        return torch.device("mps")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turns "auto" (or SPLAT_METAL_BACKEND) into a concrete backend for tensors on ``device``."""
    if backend == "auto":
        backend = os.environ.get("SPLAT_METAL_BACKEND", "auto") or "auto"
        if backend not in BACKENDS:
            raise BackendUnavailable(f"SPLAT_METAL_BACKEND={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        backend = {"cuda": "gsplat", "mps": "metal"}.get(device.type, "reference")
        if device.type == "cpu" and _cpu_backend_available(explicit=False):
            backend = "cpu"
    elif backend == "cpu":
        _check_cpu(device)
        _cpu_backend_available(explicit=True)
    if backend == "gsplat":
        _check_gsplat(device)
    elif backend == "metal":
        _check_metal(device)
    elif backend not in ("reference", "cpu"):
        raise BackendUnavailable(f"[rasterization] backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def zero_quats_to_identity(quats: Tensor) -> Tensor:  # [N, 4] -> [N, 4]
    """For gsplat's kernels, which normalise with rsqrt(|q|^2) (a zero quaternion becomes NaN): zero
    rows replaced by the identity, as the other backends (like F.normalize) treat them, with a zero
    gradient. The identity is made on the device: new_tensor([1, 0, 0, 0]) would be a host-to-device
    copy, which PyTorch follows with a stream synchronize, stalling every training step."""
    zero_quat = (quats.detach() * quats.detach()).sum(dim=-1, keepdim=True) == 0  # [N, 1]
    identity = torch.zeros_like(quats[:1])  # [1, 4]
    identity[:, 0] = 1.0
    return torch.where(zero_quat, identity, quats)


def backend_module(name: str) -> ModuleType:
    """The module implementing the five stages for a (non-gsplat) backend. For "metal", stages that
    failed the self-check on this GPU run on the reference (ops/stage_fallback.py)."""
    if name == "reference":
        from . import reference

        return reference
    if name == "metal":
        from . import metal, stage_fallback

        return stage_fallback.routed(metal)
    if name == "cpu":
        from . import cpu

        return cpu
    raise BackendUnavailable(f"no stage module for backend {name!r}")


def rasterization(*args, **kwargs) -> Tuple[Tensor, Tensor, Dict]:
    """gsplat 1.4's ``rasterization``: its arguments (``contract.RasterizeCall``, this function's signature) up to
    ``rasterize_mode``, then ``backend`` and ``max_intersections``. Renders C cameras: render_colors [C,H,W,D'],
    render_alphas [C,H,W,1] and the meta dict gsplat 1.4's DefaultStrategy reads (means2d with grad and, if asked,
    absgrad; radii [C,N]; width; height; n_cameras; ...).

    ``backend`` (module docstring) is chosen once, here: "gsplat" hands gsplat the call as given (no work of
    this layer on the device), "metal" is ops/metal/fused.py's ``rasterization_metal`` (which also takes the
    model's parameters as stored and splatfacto's composite), the others run the backend's stages
    (ops/contract.py) through ops/stages.py.

    ``max_intersections`` (not a gsplat argument): when the render's tile intersections exceed it,
    it is rasterized in depth chunks with the same result (ops/chunked.py); meta then has
    ``depth_chunks`` > 1 and no isect_ids/flatten_ids/isect_offsets. Ignored by backend "gsplat"."""
    call = RasterizeCall(*args, **kwargs)
    name = resolve_backend(call.backend, call.means.device)
    check_inputs(call)
    if name == "gsplat":
        from gsplat.rendering import rasterization as gsplat_rasterization

        args, kwargs = call.gsplat_arguments()
        return gsplat_rasterization(*args, **kwargs)
    check_dense(call, name)
    if name == "metal":
        from .metal.fused import rasterization_metal

        return rasterization_metal(**call.arguments())
    c, ops = call, backend_module(name)
    projected = _project_and_cull(ops, c.means, c.quats, c.scales, c.opacities, c.colors, c.viewmats, c.Ks, c.width,
                                  c.height, c.eps2d, c.near_plane, c.far_plane, c.radius_clip, c.rasterize_mode,
                                  c.sh_degree)  # fmt: skip
    return rasterize_projected(ops, name, projected, c.width, c.height, c.tile_size, c.backgrounds, c.render_mode,
                               c.absgrad, c.max_intersections)  # fmt: skip


rasterization.__signature__ = call_signature()
