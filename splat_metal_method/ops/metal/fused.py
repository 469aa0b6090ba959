"""The Metal backend's op: ``rasterization`` with the fused preparation, padded lists and fused composite.

ops/rasterization.py's ``rasterization`` hands every "metal" call here; a caller that keeps its parameters
as splatfacto stores them (the model's training steps) calls ``rasterization_metal`` directly with the
options below. Where a fused piece does not apply (no SH colours, a viewmat that needs a gradient through
its inverse, a stage that failed the self-check: ops/stage_fallback.py, depth chunks, gsplat backgrounds),
the unfused stages run instead, the oracle of each fused piece:
  * the fused preparation (prepare.py ``project_and_shade``): projection, culling and SH colours in one
    kernel each way, the activations (exp, sigmoid, the SH bands' concatenation) inside;
  * padded lists (isect.py, "Padded lists"): intersection lists in buffers of the caller's capacities, no
    host read of their count;
  * the fused composite (``rasterize_to_pixels_composite``): splatfacto's background composite written by
    the rasterizer's kernels, differentiated in its backward.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import stage_fallback
from ..contract import RasterizeCall, call_signature, check_dense, check_inputs
from ..stages import (
    _project_and_cull,
    expected_depth,
    plan_depth_chunks,
    rasterize_projected,
    render_meta,
    with_depth_channel,
)


class _Shaped:
    """What check_inputs reads of a tensor (shape, dim(), device), for a tensor not materialised."""

    def __init__(self, shape, device):
        self.shape, self.device = torch.Size(shape), device

    def dim(self) -> int:
        return len(self.shape)


def _check_stored(call: RasterizeCall, colors_rest, opacities_are_logits, composite_background) -> None:
    """check_inputs of the activated shapes (no view op: each is an encode on MPS), and the stored options."""
    if composite_background is not None and call.render_mode not in ("RGB", "RGB+D", "RGB+ED"):
        raise ValueError(
            f"[rasterization] composite_background composites colours: render_mode {call.render_mode!r} has none"
        )
    if colors_rest is not None and call.sh_degree is None:
        raise ValueError("[rasterization] colors_rest needs sh_degree (SH coefficients)")
    means, opacities, colors = call.means, call.opacities, call.colors
    N = means.shape[0] if means.dim() == 2 else -1
    if opacities_are_logits and tuple(opacities.shape) in ((N,), (N, 1)):
        opacities = _Shaped((N,), opacities.device)
    if colors_rest is not None:
        if tuple(colors.shape) not in ((N, 3), (N, 1, 3)) or colors_rest.dim() != 3 or colors_rest.shape[0] != N:
            raise ValueError(f"[rasterization] with colors_rest, colors must be [N,3] or [N,1,3] and colors_rest "
                             f"[N,K-1,3], got {list(colors.shape)} and {list(colors_rest.shape)} (N={N})")  # fmt: skip
        colors = _Shaped((N, 1 + colors_rest.shape[1], colors_rest.shape[2]), colors.device)
    check_inputs(dataclasses.replace(call, opacities=opacities, colors=colors))


def _fuses_preparation(call: RasterizeCall, colors_rest) -> bool:
    """Whether prepare.py's kernels take this call: SH colours, contiguous float32, no viewmat gradient."""
    c = call
    tensors = (c.means, c.quats, c.scales, c.opacities, c.colors) + ((colors_rest,) if colors_rest is not None else ())
    return (c.sh_degree is not None and not (torch.is_grad_enabled() and c.viewmats.requires_grad)
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors))  # fmt: skip


def _fuses_composite(background: Tensor, backgrounds: Optional[Tensor], colors: Tensor) -> bool:
    """Whether the rasterizer composites over ``background`` itself: a [3] float32 tensor without gradient on
    the render's device, no gsplat backgrounds, at least 3 channels."""
    return (backgrounds is None and colors.shape[-1] >= 3 and tuple(background.shape) == (3,)
            and background.dtype == torch.float32 and background.device == colors.device
            and not background.requires_grad and background.is_contiguous())  # fmt: skip


def rasterization_metal(
    *args,
    isect_capacity=None,
    scales_are_log: bool = False,
    opacities_are_logits: bool = False,
    colors_rest: Optional[Tensor] = None,  # [N, K-1, 3]
    composite_background: Optional[Tensor] = None,  # [3]
    composite_squeeze: bool = False,
    tile_merge: bool = False,
    **kwargs,
) -> Tuple[Tensor, Tensor, Dict]:
    """ops.rasterization with backend "metal" (the same arguments, ``contract.RasterizeCall``, and results; the
    parameters below are keyword-only). With ``scales_are_log``, ``scales`` are log-scales; with
    ``opacities_are_logits``, ``opacities`` are logits [N] or [N, 1]; with ``colors_rest``, ``colors`` is the SH
    band 0 [N, 3]. And:

    ``isect_capacity`` (an ``ops.IntersectionCapacities`` the caller keeps, e.g. a model for its training
    steps): the intersection lists are padded to capacities kept there, so the render reads nothing on the
    host (isect.py, "Padded lists"); meta then has ``n_intersections`` (the real count, on the device) and
    ``isect_ids`` None (nothing in a step reads the ids; ``isect_tiles_padded(..., with_isect_ids=True)``
    gives them).

    Parameters as splatfacto stores them: ``scales_are_log`` (exp is applied), ``opacities_are_logits``
    ([N] or [N, 1] logits: sigmoid), ``colors_rest`` (with sh_degree: colors is the SH band 0 [N, 3] and
    colors_rest the others [N, K-1, 3]); applied inside the kernels, or first (as splatfacto does, with the
    same result) where the fused preparation does not apply.

    ``composite_background`` ([3], no gradient): where the rasterizer composites (``_fuses_composite``),
    meta["rgb"] is splatfacto's composite of the render over it, ``clamp(render_colors[..., :3] + (1 -
    render_alphas) * background, 0, 1)`` ([C,H,W,3], or [H,W,3] with ``composite_squeeze`` and one camera),
    differentiable in the render. Where it does not (backgrounds given, depth chunks), meta has no "rgb": the
    caller composites (ops/composite.py's composite_background, the unfused twin).

    ``tile_merge``: the rasterizer's backward sums a gaussian's gradients over its tile before its device
    atomics (rasterize_bwd.py; not in depth chunks): the same gradients up to float32 summation order."""
    from .. import metal

    call = RasterizeCall(*args, **kwargs)
    check_dense(call, "metal")
    _check_stored(call, colors_rest, opacities_are_logits, composite_background)
    failed = stage_fallback.failed()
    ops = stage_fallback.routed(metal)
    if not failed and _fuses_preparation(call, colors_rest):
        c = call
        projected = metal.project_and_shade(
            c.means, c.quats, c.scales, c.opacities, c.colors, colors_rest, c.viewmats, c.Ks, c.width, c.height,
            c.eps2d, c.near_plane, c.far_plane, c.radius_clip, c.rasterize_mode == "antialiased", c.sh_degree,
            scales_are_log, opacities_are_logits,
        )  # fmt: skip
    else:  # as splatfacto's get_outputs, before calling gsplat
        c = _activated(call, scales_are_log, opacities_are_logits, colors_rest)
        projected = _project_and_cull(ops, c.means, c.quats, c.scales, c.opacities, c.colors, c.viewmats, c.Ks,
                                      c.width, c.height, c.eps2d, c.near_plane, c.far_plane, c.radius_clip,
                                      c.rasterize_mode, c.sh_degree)  # fmt: skip
    radii, means2d, depths = projected[:3]
    planned = plan_depth_chunks(means2d, radii, depths, c.tile_size, c.width, c.height, c.max_intersections)
    if planned[2] is not None or failed & {"isect+sort", "rasterize"}:  # the stages, as every backend's
        return rasterize_projected(ops, "metal", projected, c.width, c.height, c.tile_size, c.backgrounds,
                                   c.render_mode, c.absgrad, c.max_intersections, planned)  # fmt: skip
    composite = None if failed else composite_background  # (the fused composite is the rasterize stage's)
    return _rasterize_fused(metal, ops, call, projected, planned[:2], isect_capacity, composite, composite_squeeze,
                            tile_merge)  # fmt: skip


def _activated(call: RasterizeCall, scales_are_log, opacities_are_logits, colors_rest) -> RasterizeCall:
    """The call with the parameters activated as splatfacto's get_outputs does before calling gsplat."""
    colors, scales, opacities = call.colors, call.scales, call.opacities
    if colors_rest is not None:
        colors = torch.cat((colors.reshape(colors.shape[0], 1, 3), colors_rest), dim=1)  # [N, K, 3]
    scales = torch.exp(scales) if scales_are_log else scales
    opacities = torch.sigmoid(opacities).reshape(-1) if opacities_are_logits else opacities
    return dataclasses.replace(call, colors=colors, scales=scales, opacities=opacities)


def _rasterize_fused(metal, ops, call, projected, tiles, isect_capacity, composite_background, composite_squeeze,
                     tile_merge):  # fmt: skip
    """The rasterization half with the padded lists and the fused composite where they apply: render_colors,
    render_alphas, meta (with "rgb", splatfacto's composite, where the rasterizer wrote it)."""
    c, (tile_width, tile_height) = call, tiles
    radii, means2d, depths, conics, opacities, colors = projected
    C = means2d.shape[0]
    colors, backgrounds = with_depth_channel(colors, depths, c.backgrounds, c.render_mode)
    # no isect_ids (with_isect_ids=False): no [capacity] int64 buffer written in every training step
    lists = None
    if isect_capacity is not None:
        lists = ops.isect_tiles_padded(means2d, radii, depths, c.tile_size, tile_width, tile_height, isect_capacity,
                                       with_isect_ids=False)  # fmt: skip
    if lists is None:  # exact lists (the keys would not fit the padded ones)
        tiles_per_gauss, isect_ids, flatten_ids = ops.isect_tiles(means2d, radii, depths, c.tile_size, tile_width,
                                                                  tile_height)  # fmt: skip
        isect_offsets = ops.isect_offset_encode(isect_ids, C, tile_width, tile_height)
        lists, n_intersections = (tiles_per_gauss, isect_ids, flatten_ids, isect_offsets), None
    else:
        n_intersections = lists[3][-1:]  # offsets: [C*th*tw + 1], the end slot the real count, on the device
    rgb = None
    rasterize_args = (means2d, conics, colors.contiguous(), opacities.contiguous(), c.width, c.height, c.tile_size,
                      lists[3], lists[2])  # fmt: skip
    if composite_background is not None and _fuses_composite(composite_background, backgrounds, colors):
        render_colors, render_alphas, rgb = metal.rasterize_to_pixels_composite(
            *rasterize_args, composite_background, c.absgrad, composite_squeeze, tile_merge
        )
    else:
        render_colors, render_alphas = metal.rasterize_to_pixels(
            *rasterize_args, backgrounds, c.absgrad, tile_merge=tile_merge
        )
    if n_intersections is not None:  # meta: the [C, th, tw] offsets (one view: one aten dispatch on MPS)
        th, tw = int(tile_height), int(tile_width)
        lists = lists[:3] + (lists[3].as_strided((C, th, tw), (th * tw, tw, 1)),)
    seen = isect_capacity.last_count if n_intersections is not None else None
    meta = render_meta("metal", projected, lists, c.width, c.height, c.tile_size, tile_width, tile_height, 1,
                       n_intersections, seen)  # fmt: skip
    if rgb is not None:
        meta["rgb"] = rgb  # splatfacto's composite (composite_background)
    return expected_depth(render_colors, render_alphas, c.render_mode), render_alphas, meta


_METAL_OPTIONS = list(inspect.signature(rasterization_metal).parameters.values())[1:-1]  # isect_capacity .. tile_merge
rasterization_metal.__signature__ = call_signature(tuple(_METAL_OPTIONS))
