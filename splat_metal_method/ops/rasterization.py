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

import math
import os
import warnings
from types import ModuleType
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .constants import EPS2D, SH_MAX_DEGREE, TILE_SIZE
from .reference import activate_sh_colors

BACKENDS = ("auto", "reference", "gsplat", "metal", "cpu")
RENDER_MODES = ("RGB", "D", "ED", "RGB+D", "RGB+ED")


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


MAX_TILE_SIZE = 32  # one thread per pixel of a tile: at most 1024 per threadgroup/block (Metal, gsplat)


RASTERIZE_MODES = ("classic", "antialiased")


def check_inputs(means, quats, scales, opacities, colors, viewmats, Ks, sh_degree, render_mode, backgrounds,
                 tile_size, rasterize_mode="classic"):  # fmt: skip
    """The op's one argument check (every backend, distributed_rasterization too): shapes, devices and
    options, read on the host only (no tensor op: the gsplat passthrough costs no device work)."""

    def fail(msg):
        raise ValueError(f"[rasterization] {msg}")

    if rasterize_mode not in RASTERIZE_MODES:
        fail(f"rasterize_mode must be one of {RASTERIZE_MODES}, got {rasterize_mode!r}")

    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or not 1 <= tile_size <= MAX_TILE_SIZE:
        fail(f"tile_size must be an int in 1..{MAX_TILE_SIZE} (one thread per pixel of a tile), got {tile_size!r}")

    N = means.shape[0] if means.dim() == 2 else -1
    if means.dim() != 2 or means.shape[1] != 3:
        fail(f"means must be [N,3], got {list(means.shape)}")
    for name, t, shape in (("quats", quats, (N, 4)), ("scales", scales, (N, 3)), ("opacities", opacities, (N,))):
        if tuple(t.shape) != shape:
            fail(f"{name} must be {list(shape)}, got {list(t.shape)}")
    C = viewmats.shape[0] if viewmats.dim() == 3 else -1
    if tuple(viewmats.shape) != (C, 4, 4):
        fail(f"viewmats must be [C,4,4], got {list(viewmats.shape)}")
    if tuple(Ks.shape) != (C, 3, 3):
        fail(f"Ks must be [C,3,3] with C={C} like viewmats, got {list(Ks.shape)}")
    if sh_degree is None:
        if colors.dim() != 2 or colors.shape[0] != N:
            fail(f"colors must be [N,D] when sh_degree is None, got {list(colors.shape)} (N={N})")
    else:
        if colors.dim() != 3 or colors.shape[0] != N or colors.shape[2] != 3:
            fail(f"colors must be [N,K,3] SH coefficients when sh_degree is set, got {list(colors.shape)}")
        if not 0 <= sh_degree <= SH_MAX_DEGREE or (sh_degree + 1) ** 2 > colors.shape[1]:
            fail(f"sh_degree={sh_degree} needs 0..{SH_MAX_DEGREE} and K >= (sh_degree+1)^2, got K={colors.shape[1]}")
    if render_mode not in RENDER_MODES:
        fail(f"render_mode must be one of {RENDER_MODES}, got {render_mode!r}")
    tensors = [means, quats, scales, opacities, colors, viewmats, Ks]
    if any(t.device != means.device for t in tensors):
        fail("all inputs must be on the same device: " + ", ".join(str(t.device) for t in tensors))
    if backgrounds is not None and tuple(backgrounds.shape) != (C, colors.shape[-1]):
        fail(f"backgrounds must be [C,D] with C={C}, D={colors.shape[-1]} like colors, got {list(backgrounds.shape)}")


def _project_and_cull(ops, means, quats, scales, opacities, colors, viewmats, Ks, width, height, eps2d, near_plane,
                      far_plane, radius_clip, rasterize_mode, sh_degree):  # fmt: skip
    """The backend's project and spherical_harmonics stages and the culling between them (the oracle of
    the metal backend's fused preparation, ops/metal/prepare.py): radii, means2d, depths, conics,
    opacities [C, N] (culled 0, x compensations) and colours [C, N, D]."""
    C, N = viewmats.shape[0], means.shape[0]
    # Non-finite inputs (README "Known limits"). Projection culls a gaussian with a non-finite mean,
    # quaternion or scale and a camera with a non-finite view matrix itself (every backend, explicitly);
    # what it cannot see is culled here, the same way for every backend: a gaussian with a non-finite
    # opacity or colour (a coefficient of the SH bands in use: those beyond sh_degree colour nothing), and
    # (with SH colours) a camera whose position inv(viewmat) is not finite.
    # Culled: radius 0, so no tile lists it and every gradient it would get is exactly 0; the opacity of
    # every entry of radius 0 is replaced by 0 so that no NaN meets a zero gradient (compensations *
    # opacity), and so that it means what the fused preparation's does (prepare.py). No host sync.
    radii, means2d, depths, conics, compensations = ops.project(
        means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane, radius_clip,
        rasterize_mode == "antialiased",
    )  # fmt: skip
    # Finiteness is tested as "x * 0 == 0" (x * 0 is 0 for finite x, NaN for inf and NaN), summed
    # per gaussian / camera (a sum of zeros cannot overflow; one NaN makes it NaN): the same verdict
    # as isfinite(...).all() in fewer aten ops (each is an encode on MPS). No gradient flows through it.
    guard_inverse = sh_degree is not None and torch.is_grad_enabled() and viewmats.requires_grad
    with torch.no_grad():
        in_use = colors if sh_degree is None else colors[:, : (sh_degree + 1) ** 2]  # [N, D] or [N, (d+1)^2, 3]
        bad = (in_use.flatten(1) * 0).sum(dim=-1) + opacities * 0  # [N] 0, or NaN if any value is not finite
        if sh_degree is not None:
            bad_view = (viewmats * 0).sum(dim=(1, 2), keepdim=True)  # [C, 1, 1]
            finite_view = bad_view == 0 if guard_inverse else None
    campos = None
    if sh_degree is not None:
        invertible = viewmats
        if guard_inverse:
            # a non-finite camera is inverted as the identity: its inverse's backward would meet NaN
            # with the zero gradient of its culled campos (without a gradient, the NaN inverse is
            # simply masked below)
            eye = torch.eye(4, device=viewmats.device, dtype=viewmats.dtype)
            invertible = torch.where(finite_view, viewmats, eye)
        campos = torch.linalg.inv_ex(invertible)[0][:, :3, 3]  # [C, 3]
        with torch.no_grad():
            bad_cam = bad_view.view(C, 1) + (campos * 0).sum(dim=-1, keepdim=True)  # [C, 1]
            bad = bad + bad_cam  # [C, N]
        campos = campos.masked_fill(bad_cam != 0, 0.0)
    culled = bad != 0  # [C, N] (NaN != 0), or [N] without SH colours
    if culled.dim() == 1:
        culled = culled.expand(C, N)
    radii = radii.masked_fill(culled, 0)
    if sh_degree is None:
        colors = colors[None] if C == 1 else colors.expand(C, -1, -1)  # [C, N, D]
    else:
        dirs = means[None, :, :] - campos[:, None, :]  # [C, N, 3]
        coeffs = colors[None] if C == 1 else colors.expand(C, -1, -1, -1)  # [C, N, K, 3] (backward: 1 op for C == 1)
        colors = ops.spherical_harmonics(sh_degree, dirs, coeffs, radii > 0)  # [C, N, 3] before the activation
        # a colour past float32 from finite coefficients (|c| ~ 1e37) is culled too, as the fused preparation's
        # kernel culls every non-finite colour it computes (ops/metal/prepare.py); its gradient is 0 (finite)
        with torch.no_grad():
            overflow = (colors * 0).sum(dim=-1) != 0  # [C, N]
        culled = culled | overflow
        radii = radii.masked_fill(overflow, 0)
        colors = activate_sh_colors(colors.masked_fill(overflow[..., None], 0.0))  # clamp_min(c + 0.5, 0)
    culled_xy = culled[..., None]  # [C, N, 1]
    means2d, conics = means2d.masked_fill(culled_xy, 0.0), conics.masked_fill(culled_xy, 0.0)
    depths = depths.masked_fill(culled, 0.0)
    opacities = opacities.masked_fill(radii == 0, 0.0)  # [C, N] (the mask broadcasts the [N] opacities)
    if compensations is not None:
        opacities = opacities * compensations
    return radii, means2d, depths, conics, opacities, colors


def rasterization(
    means: Tensor,  # [N, 3]
    quats: Tensor,  # [N, 4] wxyz (normalised internally)
    scales: Tensor,  # [N, 3]
    opacities: Tensor,  # [N]
    colors: Tensor,  # [N, D] post-activation, or [N, K, 3] SH coefficients with sh_degree
    viewmats: Tensor,  # [C, 4, 4] world -> camera
    Ks: Tensor,  # [C, 3, 3]
    width: int,
    height: int,
    near_plane: float = 0.01,
    far_plane: float = 1e10,
    radius_clip: float = 0.0,
    eps2d: float = EPS2D,
    sh_degree: Optional[int] = None,
    packed: bool = False,
    tile_size: int = TILE_SIZE,
    backgrounds: Optional[Tensor] = None,  # [C, D]
    render_mode: str = "RGB",
    sparse_grad: bool = False,
    absgrad: bool = False,
    rasterize_mode: str = "classic",
    backend: str = "auto",
    max_intersections: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Dict]:
    """gsplat 1.4's ``rasterization`` (its arguments up to ``rasterize_mode``; ``packed`` defaults to False,
    the dense meta DefaultStrategy reads). Renders C cameras: render_colors [C,H,W,D'], render_alphas
    [C,H,W,1] and the meta dict gsplat 1.4's DefaultStrategy reads (means2d with grad and, if asked, absgrad;
    radii [C,N]; width; height; n_cameras; ...).

    ``backend`` (module docstring) is chosen once, here: "gsplat" hands gsplat the call as given (no work of
    this layer on the device), "metal" is ops/metal/fused.py's ``rasterization_metal`` (which also takes the
    model's parameters as stored and splatfacto's composite), the others run the five stages below.

    ``max_intersections`` (not a gsplat argument): when the render's tile intersections exceed it,
    it is rasterized in depth chunks with the same result (ops/chunked.py); meta then has
    ``depth_chunks`` > 1 and no isect_ids/flatten_ids/isect_offsets. Ignored by backend "gsplat"."""
    name = resolve_backend(backend, means.device)
    check_inputs(means, quats, scales, opacities, colors, viewmats, Ks, sh_degree, render_mode, backgrounds,
                 tile_size, rasterize_mode)  # fmt: skip
    if name == "gsplat":
        from gsplat.rendering import rasterization as gsplat_rasterization

        return gsplat_rasterization(
            means, quats, scales, opacities, colors, viewmats, Ks, width, height,
            near_plane=near_plane, far_plane=far_plane, radius_clip=radius_clip, eps2d=eps2d,
            sh_degree=sh_degree, packed=packed, tile_size=tile_size, backgrounds=backgrounds,
            render_mode=render_mode, sparse_grad=sparse_grad, absgrad=absgrad, rasterize_mode=rasterize_mode,
        )  # fmt: skip
    if packed or sparse_grad:
        raise ValueError(f"[rasterization] packed/sparse_grad are only supported by backend 'gsplat' (using {name!r})")
    if name == "metal":
        from .metal.fused import rasterization_metal

        return rasterization_metal(
            means, quats, scales, opacities, colors, viewmats, Ks, width, height, near_plane=near_plane,
            far_plane=far_plane, radius_clip=radius_clip, eps2d=eps2d, sh_degree=sh_degree, tile_size=tile_size,
            backgrounds=backgrounds, render_mode=render_mode, absgrad=absgrad, rasterize_mode=rasterize_mode,
            max_intersections=max_intersections,
        )  # fmt: skip
    ops = backend_module(name)
    projected = _project_and_cull(ops, means, quats, scales, opacities, colors, viewmats, Ks, width, height, eps2d,
                                  near_plane, far_plane, radius_clip, rasterize_mode, sh_degree)  # fmt: skip
    return rasterize_projected(ops, name, projected, width, height, tile_size, backgrounds, render_mode, absgrad,
                               max_intersections)  # fmt: skip


def with_depth_channel(colors: Tensor, depths: Tensor, backgrounds: Optional[Tensor], render_mode: str):
    """The colours [C, N, D'] and backgrounds [C, D'] the rasterizer composites for ``render_mode``: depth
    appended ("RGB+D", "RGB+ED") or alone ("D", "ED"), with a zero background for it."""
    C = colors.shape[0]
    if render_mode in ("RGB+D", "RGB+ED"):
        colors = torch.cat([colors, depths[..., None]], dim=-1)
        if backgrounds is not None:
            backgrounds = torch.cat([backgrounds, backgrounds.new_zeros(C, 1)], dim=-1)
    elif render_mode in ("D", "ED"):
        colors = depths[..., None]
        if backgrounds is not None:
            backgrounds = backgrounds.new_zeros(C, 1)
    return colors, backgrounds


def expected_depth(render_colors: Tensor, render_alphas: Tensor, render_mode: str) -> Tensor:
    """Depth modes "ED" / "RGB+ED": the depth channel (last) divided by the alpha, as gsplat 1.4."""
    if render_mode not in ("ED", "RGB+ED"):
        return render_colors
    return torch.cat([render_colors[..., :-1], render_colors[..., -1:] / render_alphas.clamp(min=1e-10)], dim=-1)


def plan_depth_chunks(means2d, radii, depths, tile_size, width, height, max_intersections):
    """(tile_width, tile_height, the render's depth chunks or None: ops/chunked.py)."""
    tile_width, tile_height = math.ceil(width / tile_size), math.ceil(height / tile_size)
    if not max_intersections:
        return tile_width, tile_height, None
    from . import chunked

    plan = chunked.plan(means2d, radii, depths, tile_size, tile_width, tile_height, int(max_intersections))
    return tile_width, tile_height, plan


def rasterize_projected(ops, name, projected, width, height, tile_size, backgrounds, render_mode, absgrad,
                        max_intersections, planned=None):  # fmt: skip
    """The rasterization half of the op from the projected gaussians (radii, means2d, depths, conics,
    opacities [C, N], colours [C, N, D]): the backend's isect_tiles, isect_offset_encode and
    rasterize_to_pixels, or the depth chunks (``planned``: plan_depth_chunks's result, if the caller has
    it). Returns render_colors, render_alphas, meta."""
    radii, means2d, depths, conics, opacities, colors = projected
    C = means2d.shape[0]
    colors, backgrounds = with_depth_channel(colors, depths, backgrounds, render_mode)
    if planned is None:
        planned = plan_depth_chunks(means2d, radii, depths, tile_size, width, height, max_intersections)
    tile_width, tile_height, chunks = planned
    if chunks is None:
        tiles_per_gauss, isect_ids, flatten_ids = ops.isect_tiles(
            means2d, radii, depths, tile_size, tile_width, tile_height
        )
        isect_offsets = ops.isect_offset_encode(isect_ids, C, tile_width, tile_height)
        render_colors, render_alphas = ops.rasterize_to_pixels(
            means2d, conics, colors.contiguous(), opacities.contiguous(), width, height, tile_size,
            isect_offsets, flatten_ids, backgrounds, absgrad,
        )  # fmt: skip
        lists = (tiles_per_gauss, isect_ids, flatten_ids, isect_offsets)
    else:
        from . import chunked

        render_colors, render_alphas = chunked.rasterize_in_depth_chunks(
            ops, chunks, means2d, conics, colors.contiguous(), opacities.contiguous(), radii, depths,
            width, height, tile_size, tile_width, tile_height, backgrounds, absgrad,
        )  # fmt: skip
        lists = (chunks.tiles_per_gauss, None, None, None)
    meta = render_meta(name, projected, lists, width, height, tile_size, tile_width, tile_height,
                       1 if chunks is None else chunks.n_chunks)  # fmt: skip
    return expected_depth(render_colors, render_alphas, render_mode), render_alphas, meta


def render_meta(name, projected, lists, width, height, tile_size, tile_width, tile_height, depth_chunks,
                n_intersections=None, n_intersections_seen=None) -> Dict:  # fmt: skip
    """The meta dict of gsplat 1.4's dense mode, and this layer's entries (backend, depth_chunks, the padded
    lists' counts)."""
    radii, means2d, depths, conics, opacities, _ = projected
    tiles_per_gauss, isect_ids, flatten_ids, isect_offsets = lists
    return {
        "camera_ids": None,
        "gaussian_ids": None,
        "radii": radii,
        "means2d": means2d,
        "depths": depths,
        "conics": conics,
        "opacities": opacities,
        "tile_width": tile_width,
        "tile_height": tile_height,
        "tiles_per_gauss": tiles_per_gauss,
        "isect_ids": isect_ids,
        "flatten_ids": flatten_ids,
        "isect_offsets": isect_offsets,
        # padded lists (Metal training steps): flatten_ids holds n_intersections ([1] int32, on the device)
        # real entries, then padding, and isect_ids is None (not built: nothing in a step reads it; the
        # chunked path has None there too); None where the lists are exact (their length).
        "n_intersections": n_intersections,
        # the latest count the host has heard of (a step or two old), for logs that must not read the device
        "n_intersections_seen": n_intersections_seen,
        "width": width,
        "height": height,
        "tile_size": tile_size,
        "n_cameras": means2d.shape[0],
        "backend": name,
        "depth_chunks": depth_chunks,
    }
