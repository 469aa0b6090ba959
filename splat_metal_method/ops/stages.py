"""The stages every backend but gsplat runs through, written once (over the backend contract, ops/contract.py):
projection with the non-finite culling, the tile lists and rasterizer (or depth chunks), and the meta dict gsplat's strategies
read. ``ops.rasterization`` and the Metal fused path (ops/metal/fused.py) both call these; neither imports
the other."""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch
from torch import Tensor

from .reference import activate_sh_colors


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
