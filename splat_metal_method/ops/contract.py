"""The backend contract, written once: what every backend but gsplat implements, and the op's one argument check.

* ``Backend``: the stages (projection, spherical harmonics, tile intersection with its offsets, the rasterizer
  forward and backward, and one depth chunk of it), with their arguments, defaults, shapes and results. A backend
  is a module of these functions (ops/reference.py, ops/cpu, ops/metal; ops/stage_fallback.py mixes two);
  ops/stages.py, ops/chunked.py and ops/distributed.py call them. Each differentiable stage's backward is its
  autograd backward (a torch.autograd.Function where the backend has kernels for it).
* ``stage``: a backend's implementation names the contract's parameters and takes its defaults and docstring
  from ``Backend``; ``mismatches`` says how a backend differs (tests/ops/test_contract.py runs it on each).
* ``RasterizeCall``: one call of the op (gsplat 1.4's ``rasterization`` arguments, then this layer's two), the one
  definition of its signature: ``rasterization``, ``rasterization_metal`` and ``distributed_rasterization`` take
  theirs through it, and ``check_inputs`` checks it.
* ``with_background`` and ``absgrad_buffer``: the tail and the absgrad buffer every rasterizer shares.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import List, Optional, Protocol, Tuple

import torch
from torch import Tensor

from .constants import EPS2D, SH_MAX_DEGREE, TILE_SIZE

RENDER_MODES = ("RGB", "D", "ED", "RGB+D", "RGB+ED")
RASTERIZE_MODES = ("classic", "antialiased")
MAX_TILE_SIZE = 32  # one thread per pixel of a tile: at most 1024 per threadgroup/block (Metal, gsplat)


class Backend(Protocol):
    """The stages of a backend, each a module-level function of the backend's module."""

    def project(
        self,
        means: Tensor,  # [N, 3]
        quats: Tensor,  # [N, 4] wxyz, normalised inside (a zero quaternion is the identity rotation)
        scales: Tensor,  # [N, 3]
        viewmats: Tensor,  # [C, 4, 4] world -> camera
        Ks: Tensor,  # [C, 3, 3]
        width: int,
        height: int,
        eps2d: float = EPS2D,
        near_plane: float = 0.01,
        far_plane: float = 1e10,
        radius_clip: float = 0.0,
        calc_compensations: bool = False,
    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
        """EWA projection: radii [C,N] int32, means2d [C,N,2], depths [C,N], conics [C,N,3], compensations [C,N]
        (None without ``calc_compensations``). Culled pairs have radius 0, zero outputs and zero gradients."""

    def spherical_harmonics(
        self,
        degree: int,  # 0..SH_MAX_DEGREE
        dirs: Tensor,  # [C, N, 3] unnormalised view directions (mean - camera centre)
        coeffs: Tensor,  # [C, N, K, 3], K >= (degree+1)^2
        masks: Optional[Tensor] = None,  # [C, N] bool; False -> colour 0, gradients 0
        activate: bool = False,
    ) -> Tensor:
        """Colours [C,N,3] of the SH bands up to ``degree``; with ``activate`` the public op's colour,
        clamp_min(colour + 0.5, 0) (reference.activate_sh_colors)."""

    def isect_tiles(self, means2d: Tensor, radii: Tensor, depths: Tensor,  # [C, N, 2], [C, N] int32, [C, N]
                    tile_size: int, tile_width: int, tile_height: int) -> Tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Every (gaussian, tile) overlap sorted by camera, tile, then depth (stable: ties keep emission order):
        tiles_per_gauss [C,N] int32, isect_ids [M] int64, flatten_ids [M] int32. Not differentiable."""

    def isect_offset_encode(self, isect_ids: Tensor, C: int, tile_width: int, tile_height: int) -> Tensor:
        """Start of each tile's range in the sorted list: [C, tile_height, tile_width] int32."""

    def rasterize_to_pixels(
        self,
        means2d: Tensor, conics: Tensor, colors: Tensor, opacities: Tensor,  # [C, N, 2], [C, N, 3], [C, N, D], [C, N]
        width: int, height: int, tile_size: int,
        isect_offsets: Tensor, flatten_ids: Tensor,  # [C, tile_height, tile_width] int32, [M] int32
        backgrounds: Optional[Tensor] = None,  # [C, D]
        absgrad: bool = False,
    ) -> Tuple[Tensor, Tensor]:  # fmt: skip
        """Front-to-back alpha compositing of each tile's depth-sorted gaussians, forward and backward:
        render_colors [C,H,W,D] (over ``backgrounds``: with_background), render_alphas [C,H,W,1]. With absgrad,
        sets means2d.absgrad [C,N,2] (absgrad_buffer: zeros now, filled by the backward pass)."""

    def rasterize_depth_chunk(
        self,
        means2d: Tensor, conics: Tensor, colors: Tensor, opacities: Tensor, width: int, height: int, tile_size: int,
        isect_offsets: Tensor, flatten_ids: Tensor,  # as rasterize_to_pixels's, of this chunk's intersections [M_k]
        transmittance: Tensor,  # [C, H, W] running transmittance before this chunk
        stopped: Tensor,  # [C, H, W] bool: the pixel has already hit the transmittance floor
        absgrad_out: Optional[Tensor] = None,  # [C, N, 2] buffer backward adds |per-pixel d loss/d means2d| to
    ) -> Tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """One depth chunk (ops/chunked.py), all behind the previous ones, resumed from the running state: this
        chunk's colours [C,H,W,D] (weighted by the incoming transmittance, no background), the transmittance
        after it [C,H,W] and the stopped mask [C,H,W]. Chained front to back (colours summed, state passed on)
        they give the render of the whole list: the stop rule sees the absolute transmittance."""


STAGES = tuple(name for name in vars(Backend) if not name.startswith("_"))


def _contract_parameters(name: str) -> List[inspect.Parameter]:
    return list(inspect.signature(getattr(Backend, name)).parameters.values())[1:]  # without self


def _differences(name: str, fn) -> List[str]:
    """How ``fn``'s parameters differ from the contract's stage ``name``: the same names in the same order with
    the same defaults, then only keyword-only extras with defaults (a backend's own options)."""
    want = _contract_parameters(name)
    have = list(inspect.signature(fn).parameters.values())
    shared, extra = have[: len(want)], have[len(want) :]
    found = []
    if [(p.name, p.kind) for p in shared] != [(p.name, p.kind) for p in want]:
        found.append(f"{name}({', '.join(p.name for p in have)}) is not the contract's "
                     f"{name}({', '.join(p.name for p in want)})")  # fmt: skip
    elif [p.default for p in shared] != [p.default for p in want]:
        found.append(f"{name}'s defaults {[p.default for p in shared]} are not the contract's "
                     f"{[p.default for p in want]}")  # fmt: skip
    for p in extra:
        if p.kind is not p.KEYWORD_ONLY or p.default is p.empty:
            found.append(f"{name}'s extra parameter {p.name} must be keyword-only with a default")
    return found


def stage(fn):
    """A backend's implementation of the contract's stage of the same name: it names the stage's parameters (and
    may add keyword-only options with defaults); their defaults and the docstring come from ``Backend``. A
    function that differs from the contract fails here, at import."""
    want = _contract_parameters(fn.__name__)
    have = list(inspect.signature(fn).parameters.values())[: len(want)]
    if [(p.name, p.kind) for p in have] == [(p.name, p.kind) for p in want]:
        fn.__defaults__ = tuple(p.default for p in want if p.default is not p.empty) or None
    problems = _differences(fn.__name__, fn)
    if problems:
        raise TypeError(f"{fn.__module__}: " + "; ".join(problems))
    contract_doc = inspect.getdoc(getattr(Backend, fn.__name__))
    fn.__doc__ = contract_doc if fn.__doc__ is None else f"{contract_doc}\n\n{inspect.cleandoc(fn.__doc__)}"
    return fn


def mismatches(backend) -> List[str]:
    """How ``backend`` (a module or namespace of stage functions) differs from the contract; [] where it keeps it."""
    found = []
    for name in STAGES:
        fn = getattr(backend, name, None)
        found += [f"no {name}"] if fn is None else _differences(name, fn)
    return found


def with_background(render_colors: Tensor, render_alphas: Tensor, backgrounds: Optional[Tensor]) -> Tensor:
    """The rasterizer's tail: render_colors [C,H,W,D] composited over backgrounds [C,D] (None: as they are)."""
    if backgrounds is None:
        return render_colors
    return render_colors + backgrounds[:, None, None, :] * (1.0 - render_alphas)


def absgrad_buffer(means2d: Tensor, absgrad: bool) -> Optional[Tensor]:
    """With absgrad: means2d.absgrad [C,N,2], zeros now, which the rasterizer's backward fills; else None."""
    if not absgrad:
        return None
    means2d.absgrad = torch.zeros(means2d.shape, dtype=means2d.dtype, device=means2d.device)
    return means2d.absgrad


@dataclasses.dataclass
class RasterizeCall:
    """One call of the op: gsplat 1.4's ``rasterization`` arguments in its order (to ``rasterize_mode``; ``packed``
    defaults to False, the dense meta DefaultStrategy reads), then this layer's ``backend`` and
    ``max_intersections`` (ops/rasterization.py says what they mean)."""

    means: Tensor  # [N, 3]
    quats: Tensor  # [N, 4] wxyz (normalised internally)
    scales: Tensor  # [N, 3]
    opacities: Tensor  # [N]
    colors: Tensor  # [N, D] post-activation, or [N, K, 3] SH coefficients with sh_degree
    viewmats: Tensor  # [C, 4, 4] world -> camera
    Ks: Tensor  # [C, 3, 3]
    width: int
    height: int
    near_plane: float = 0.01
    far_plane: float = 1e10
    radius_clip: float = 0.0
    eps2d: float = EPS2D
    sh_degree: Optional[int] = None
    packed: bool = False
    tile_size: int = TILE_SIZE
    backgrounds: Optional[Tensor] = None  # [C, D]
    render_mode: str = "RGB"
    sparse_grad: bool = False
    absgrad: bool = False
    rasterize_mode: str = "classic"
    backend: str = "auto"
    max_intersections: Optional[int] = None

    def arguments(self) -> dict:
        """The call's arguments by name (the tensors themselves, not copies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def gsplat_arguments(self) -> Tuple[tuple, dict]:
        """(args, kwargs) of gsplat's ``rasterization`` for this call: the nine positional ones, then its options."""
        options = self.arguments()
        args = tuple(options.pop(name) for name in list(options)[:9])  # means .. height
        del options["backend"], options["max_intersections"]
        return args, options


def call_signature(extra: Tuple[inspect.Parameter, ...] = ()) -> inspect.Signature:
    """RasterizeCall's parameters (the op's signature), then ``extra`` (keyword-only)."""
    parameters = list(inspect.signature(RasterizeCall).parameters.values())
    return inspect.Signature(parameters + list(extra))


def check_dense(call: RasterizeCall, name: str) -> None:
    """packed and sparse_grad are gsplat's alone: any other backend ``name`` refuses them."""
    if call.packed or call.sparse_grad:
        raise ValueError(f"[rasterization] packed/sparse_grad are only supported by backend 'gsplat' (using {name!r})")


def check_inputs(call: RasterizeCall) -> None:
    """The op's one argument check (every backend, distributed_rasterization too): shapes, devices and options,
    read on the host only (no tensor op: the gsplat passthrough costs no device work)."""
    means, quats, scales, opacities, colors = call.means, call.quats, call.scales, call.opacities, call.colors
    viewmats, Ks, sh_degree, tile_size, backgrounds = call.viewmats, call.Ks, call.sh_degree, call.tile_size, call.backgrounds  # fmt: skip

    def fail(msg):
        raise ValueError(f"[rasterization] {msg}")

    if call.rasterize_mode not in RASTERIZE_MODES:
        fail(f"rasterize_mode must be one of {RASTERIZE_MODES}, got {call.rasterize_mode!r}")

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
    if call.render_mode not in RENDER_MODES:
        fail(f"render_mode must be one of {RENDER_MODES}, got {call.render_mode!r}")
    tensors = [means, quats, scales, opacities, colors, viewmats, Ks]
    if any(t.device != means.device for t in tensors):
        fail("all inputs must be on the same device: " + ", ".join(str(t.device) for t in tensors))
    if backgrounds is not None and tuple(backgrounds.shape) != (C, colors.shape[-1]):
        fail(f"backgrounds must be [C,D] with C={C}, D={colors.shape[-1]} like colors, got {list(backgrounds.shape)}")
