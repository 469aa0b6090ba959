"""The one public op: ``rasterization``, with gsplat 1.4.0's semantics for what splatfacto passes.

Backends:
  - "gsplat":    gsplat's CUDA kernels (the whole call is passed through unchanged).
  - "metal":     our Metal kernels (MPS tensors; CPU tensors run them under the MSL emulator).
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
gsplat 1.4's CUDA kernels (backend "gsplat", passed through unchanged) have no such checks: its
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


def _check_inputs(means, quats, scales, opacities, colors, viewmats, Ks, sh_degree, render_mode, backgrounds,
                  tile_size):  # fmt: skip
    def fail(msg):
        raise ValueError(f"[rasterization] {msg}")

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


class _Shaped:
    """What _check_inputs reads of a tensor (shape, dim(), device), for a tensor not materialised."""

    def __init__(self, shape, device):
        self.shape, self.device = torch.Size(shape), device

    def dim(self) -> int:
        return len(self.shape)


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
    isect_capacity=None,
    scales_are_log: bool = False,
    opacities_are_logits: bool = False,
    colors_rest: Optional[Tensor] = None,  # [N, K-1, 3]
    composite_background: Optional[Tensor] = None,  # [3]
    composite_squeeze: bool = False,
) -> Tuple[Tensor, Tensor, Dict]:
    """Renders C cameras. Returns render_colors [C,H,W,D'], render_alphas [C,H,W,1] and the meta
    dict gsplat 1.4's DefaultStrategy reads (means2d with grad and, if asked, absgrad; radii [C,N];
    width; height; n_cameras; ...).

    ``max_intersections`` (not a gsplat argument): when the render's tile intersections exceed it,
    it is rasterized in depth chunks with the same result (ops/chunked.py); meta then has
    ``depth_chunks`` > 1 and no isect_ids/flatten_ids/isect_offsets. Ignored by backend "gsplat".

    ``isect_capacity`` (not a gsplat argument; an ``ops.IntersectionCapacities`` the caller keeps, e.g. a
    model for its training steps): on the Metal backend the intersection lists are padded to capacities
    kept there, so the render reads nothing on the host (ops/metal/isect.py, "Padded lists"); meta then
    has ``n_intersections`` (the real count, on the device) and ``isect_ids`` None (the padded lists are
    built without them: the rasterizer reads flatten_ids and the offsets, nothing in a step reads the ids;
    ``ops.isect_tiles_padded(..., with_isect_ids=True)`` gives them). Other backends ignore it.

    Parameters as splatfacto stores them (not gsplat arguments): ``scales_are_log`` (scales are
    log-scales: exp is applied), ``opacities_are_logits`` (opacities [N] or [N, 1] are logits: sigmoid),
    ``colors_rest`` (with sh_degree: colors is the SH band 0 [N, 3] and colors_rest the others
    [N, K-1, 3]). The metal backend applies them inside its kernels (ops/metal/prepare.py); the others
    apply them first, as splatfacto does, with the same result.

    ``composite_background`` (not a gsplat argument; [3], no gradient): where the backend's rasterizer
    composites (metal: its kernels, forward and backward, no composite launches), meta["rgb"] is splatfacto's
    composite of the render over it, ``clamp(render_colors[..., :3] + (1 - render_alphas) * background, 0, 1)``
    ([C,H,W,3], or [H,W,3] with ``composite_squeeze`` and one camera), differentiable in the render. Where it
    does not (other backends; backgrounds given, depth chunks), meta has no "rgb": the caller composites
    (ops/composite.py's composite_background, the unfused twin)."""
    if rasterize_mode not in ("classic", "antialiased"):
        raise ValueError(f"[rasterization] rasterize_mode must be 'classic' or 'antialiased', got {rasterize_mode!r}")
    if composite_background is not None and render_mode not in ("RGB", "RGB+D", "RGB+ED"):
        raise ValueError(
            f"[rasterization] composite_background composites colours: render_mode {render_mode!r} has none"
        )
    name = resolve_backend(backend, means.device)
    ops = backend_module(name) if name != "gsplat" else None
    fused = (
        getattr(ops, "project_and_shade", None) is not None and sh_degree is not None and not packed
        and not (torch.is_grad_enabled() and viewmats.requires_grad)
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in (means, quats, scales, opacities, colors))
        and (colors_rest is None or (colors_rest.dtype == torch.float32 and colors_rest.is_contiguous()))
    )  # fmt: skip
    raw = (scales_are_log, opacities_are_logits, colors_rest is not None)
    if fused:  # the same checks, of the activated shapes (no view op: each is an encode on MPS)
        N = means.shape[0] if means.dim() == 2 else -1
        if opacities_are_logits and tuple(opacities.shape) in ((N,), (N, 1)):
            opacities_as = _Shaped((N,), opacities.device)
        else:
            opacities_as = opacities
        colors_as = colors
        if colors_rest is not None:
            if tuple(colors.shape) not in ((N, 3), (N, 1, 3)) or colors_rest.dim() != 3 or colors_rest.shape[0] != N:
                raise ValueError(f"[rasterization] with colors_rest, colors must be [N,3] or [N,1,3] and colors_rest "
                                 f"[N,K-1,3], got {list(colors.shape)} and {list(colors_rest.shape)} (N={N})")  # fmt: skip
            colors_as = _Shaped((N, 1 + colors_rest.shape[1], colors_rest.shape[2]), colors.device)
        _check_inputs(means, quats, scales, opacities_as, colors_as, viewmats, Ks, sh_degree, render_mode, backgrounds,
                      tile_size)  # fmt: skip
    if not fused and any(raw):  # as splatfacto's get_outputs, before calling gsplat
        if colors_rest is not None:
            if sh_degree is None:
                raise ValueError("[rasterization] colors_rest needs sh_degree (SH coefficients)")
            colors = torch.cat((colors.reshape(colors.shape[0], 1, 3), colors_rest), dim=1)
        scales = torch.exp(scales) if scales_are_log else scales
        opacities = torch.sigmoid(opacities).reshape(-1) if opacities_are_logits else opacities
    if not fused:
        _check_inputs(means, quats, scales, opacities, colors, viewmats, Ks, sh_degree, render_mode, backgrounds,
                      tile_size)  # fmt: skip
    if name == "gsplat":
        from gsplat.rendering import rasterization as gsplat_rasterization

        quats = zero_quats_to_identity(quats)
        return gsplat_rasterization(
            means, quats, scales, opacities, colors, viewmats, Ks, width, height,
            near_plane=near_plane, far_plane=far_plane, radius_clip=radius_clip, eps2d=eps2d,
            sh_degree=sh_degree, packed=packed, tile_size=tile_size, backgrounds=backgrounds,
            render_mode=render_mode, sparse_grad=sparse_grad, absgrad=absgrad, rasterize_mode=rasterize_mode,
        )  # fmt: skip
    if packed or sparse_grad:
        raise ValueError(f"[rasterization] packed/sparse_grad are only supported by backend 'gsplat' (using {name!r})")
    C, N = viewmats.shape[0], means.shape[0]
    if fused:  # the metal backend: projection, the culling below and SH colours in its kernels (prepare.py)
        radii, means2d, depths, conics, opacities, colors = ops.project_and_shade(
            means, quats, scales, opacities, colors, colors_rest, viewmats, Ks, width, height, eps2d,
            near_plane, far_plane, radius_clip, rasterize_mode == "antialiased", sh_degree, scales_are_log,
            opacities_are_logits,
        )  # fmt: skip
    else:
        radii, means2d, depths, conics, opacities, colors = _project_and_cull(
            ops, means, quats, scales, opacities, colors, viewmats, Ks, width, height, eps2d, near_plane, far_plane,
            radius_clip, rasterize_mode, sh_degree,
        )  # fmt: skip

    if render_mode in ("RGB+D", "RGB+ED"):
        colors = torch.cat([colors, depths[..., None]], dim=-1)
        if backgrounds is not None:
            backgrounds = torch.cat([backgrounds, backgrounds.new_zeros(C, 1)], dim=-1)
    elif render_mode in ("D", "ED"):
        colors = depths[..., None]
        if backgrounds is not None:
            backgrounds = backgrounds.new_zeros(C, 1)

    tile_width, tile_height = math.ceil(width / tile_size), math.ceil(height / tile_size)
    chunks = None
    if max_intersections:  # bounded intersections: depth chunks when over budget (ops/chunked.py)
        from . import chunked

        chunks = chunked.plan(means2d, radii, depths, tile_size, tile_width, tile_height, int(max_intersections))
    n_intersections, rgb = None, None
    if chunks is None:
        # With the caller's capacities, on Metal: padded lists, no host read of the intersection count.
        padded = getattr(ops, "isect_tiles_padded", None) if isect_capacity is not None else None
        # no isect_ids (with_isect_ids=False): no [capacity] int64 buffer written in every training step
        padded = (
            padded(means2d, radii, depths, tile_size, tile_width, tile_height, isect_capacity, with_isect_ids=False)
            if padded
            else None
        )
        if padded is not None:
            tiles_per_gauss, isect_ids, flatten_ids, isect_offsets = padded  # offsets: [C*th*tw + 1]
        else:
            tiles_per_gauss, isect_ids, flatten_ids = ops.isect_tiles(
                means2d, radii, depths, tile_size, tile_width, tile_height
            )
            isect_offsets = ops.isect_offset_encode(isect_ids, C, tile_width, tile_height)
        fused_composite = getattr(ops, "rasterize_to_pixels_composite", None)
        if (
            composite_background is not None
            and fused_composite is not None
            and _fuses_composite(composite_background, backgrounds, colors)
        ):  # the metal backend: splatfacto's composite inside the rasterizer's kernels
            render_colors, render_alphas, rgb = fused_composite(
                means2d, conics, colors.contiguous(), opacities.contiguous(), width, height, tile_size,
                isect_offsets, flatten_ids, composite_background, absgrad, composite_squeeze,
            )  # fmt: skip
        else:
            render_colors, render_alphas = ops.rasterize_to_pixels(
                means2d, conics, colors.contiguous(), opacities.contiguous(), width, height, tile_size,
                isect_offsets, flatten_ids, backgrounds, absgrad,
            )  # fmt: skip
        if padded is not None:  # meta: the [C, th, tw] offsets; the count stays on the device
            n_intersections = isect_offsets[-1:]
            # one view, not a slice and a view (one aten dispatch each on MPS)
            th, tw = int(tile_height), int(tile_width)
            isect_offsets = isect_offsets.as_strided((C, th, tw), (th * tw, tw, 1))
    else:
        tiles_per_gauss, isect_ids, flatten_ids, isect_offsets = chunks.tiles_per_gauss, None, None, None
        render_colors, render_alphas = chunked.rasterize_in_depth_chunks(
            ops, chunks, means2d, conics, colors.contiguous(), opacities.contiguous(), radii, depths,
            width, height, tile_size, tile_width, tile_height, backgrounds, absgrad,
        )  # fmt: skip
    if render_mode in ("ED", "RGB+ED"):
        render_colors = torch.cat(
            [render_colors[..., :-1], render_colors[..., -1:] / render_alphas.clamp(min=1e-10)], dim=-1
        )
    meta = {
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
        "n_intersections_seen": isect_capacity.last_count if n_intersections is not None else None,
        "width": width,
        "height": height,
        "tile_size": tile_size,
        "n_cameras": C,
        "backend": name,
        "depth_chunks": 1 if chunks is None else chunks.n_chunks,
    }
    if rgb is not None:
        meta["rgb"] = rgb  # splatfacto's composite (composite_background)
    return render_colors, render_alphas, meta


def _fuses_composite(background: Tensor, backgrounds: Optional[Tensor], colors: Tensor) -> bool:
    """Whether the metal backend's rasterizer composites over ``background`` itself: a [3] float32 tensor
    without gradient on the render's device, no gsplat backgrounds, at least 3 channels."""
    return (backgrounds is None and colors.shape[-1] >= 3 and tuple(background.shape) == (3,)
            and background.dtype == torch.float32 and background.device == colors.device
            and not background.requires_grad and background.is_contiguous())  # fmt: skip
