"""Fast CPU backend: every stage in native, multi-threaded C++ (project.cpp, sh.cpp, isect.cpp,
rasterize.cpp; built on first use by build.py and cached), forward and backward.

Why native: the reference spends ~97% of a large step rasterizing every (tile pixel, listed
gaussian) pair in PyTorch; the native rasterizer visits only the pixels a gaussian can reach, in
vector registers, and stops saturated tiles. On small scenes the reference's many small PyTorch ops
(projection and SH autograd, the global sort) dominate instead, so those are native too. The
projection and SH arithmetic is the Metal kernels' (itself the reference's order); tile lists are
bit-identical to the reference's. Every stage is deterministic for any thread count (no atomics;
fixed-order sums), and runs on up to torch.get_num_threads() threads (see _threads).

The stages implement the backend contract (ops/contract.py). Tensors that
are not float32 CPU tensors go to the reference (the native code is float32 only).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor

from .. import reference
from ..autograd_stages import SphericalHarmonicsFn, camera_grads, project_with, resumed_transmittance_grad
from ..constants import ALPHA_MAX, ALPHA_MIN, SH_MAX_DEGREE, TRANSMITTANCE_MIN
from ..contract import absgrad_buffer, stage, with_background
from . import build

__all__ = ["project", "spherical_harmonics", "isect_tiles", "isect_offset_encode", "rasterize_to_pixels",
           "rasterize_depth_chunk", "available"]  # fmt: skip

isect_offset_encode = reference.isect_offset_encode  # one bincount + cumsum: nothing to gain
CAMERA_GRAD_BLOCK = 1024  # gaussians per partial sum of the camera gradients (fixed: deterministic)


def available() -> bool:
    """True when the native library is built (or can be built) here."""
    return build.load() is not None


def _ptr(t: Optional[Tensor]) -> int:
    return t.data_ptr() if t is not None else 0


# Below about a millisecond of work a call stays on the calling thread: waking threads costs more,
# and right after a PyTorch op its OpenMP workers keep spinning for a while, so extra threads would
# compete with them for the cores (measured: the demo's 96x64 step took 16 ms with 2 threads per
# native call and 11 ms with 1).
PARALLEL_MIN_NS = 1_000_000
# Rough single-thread cost of one work item, in nanoseconds (a pixel slot: one of the tile_size^2
# pixels of an intersection's tile, most of which a gaussian does not reach).
NS_PER_PIXEL_SLOT = 0.5
NS_PER_PROJECTION, NS_PER_SH_ROW, NS_PER_GAUSSIAN_TO_TILES = 150, 60, 30


def _threads(work_ns: float) -> int:
    return torch.get_num_threads() if work_ns >= PARALLEL_MIN_NS else 1


def _native(*tensors: Tensor) -> bool:
    """Whether the native code can take these tensors (float32 on CPU) and is built."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and build.load() is not None


def _project_fwd(means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane, radius_clip,
                 calc_compensations):  # fmt: skip
    """project.cpp forward: radii [C,N] int32, means2d [C,N,2], depths [C,N], conics [C,N,3], comp [C,N]|None."""
    N, C = means.shape[0], viewmats.shape[0]
    inputs = [t.detach().contiguous() for t in (means, quats, scales, viewmats, Ks)]  # alive for the call
    radii = torch.empty(C, N, dtype=torch.int32)  # [C, N]
    means2d, depths, conics = means.new_empty(C, N, 2), means.new_empty(C, N), means.new_empty(C, N, 3)
    comp = means.new_empty(C, N) if calc_compensations else None  # [C, N]
    build.load().splat_project_fwd(
        C, N, width, height, eps2d, near_plane, far_plane, radius_clip, int(calc_compensations),
        *map(_ptr, inputs + [radii, means2d, depths, conics, comp]), _threads(C * N * NS_PER_PROJECTION),
    )  # fmt: skip
    return radii, means2d, depths, conics, comp


def _project_bwd(means, quats, scales, viewmats, Ks, width, height, eps2d, radii, v_means2d, v_depths, v_conics,
                 v_compensations=None, viewmats_grad=True, Ks_grad=False):  # fmt: skip
    """project.cpp backward: v_means [N,3], v_quats [N,4], v_scales [N,3], v_viewmats [C,4,4] | None,
    v_Ks [C,3,3] | None (as ops/metal/project_bwd.py)."""
    N, C = means.shape[0], viewmats.shape[0]
    v_means, v_quats, v_scales = means.new_empty(C, N, 3), means.new_empty(C, N, 4), means.new_empty(C, N, 3)
    camera_grad = bool(viewmats_grad or Ks_grad)
    n_blocks = -(-N // CAMERA_GRAD_BLOCK)
    part = means.new_zeros(C, n_blocks, 16) if camera_grad else None  # [C, n_blocks, 16]
    # Keep every buffer referenced until the call returns (a temporary's pointer would dangle).
    buffers = [t.detach().contiguous() for t in (means, quats, scales, viewmats, Ks)] + [radii.int().contiguous()]
    buffers += [t.contiguous() for t in (v_means2d, v_depths, v_conics)]
    buffers += [None if v_compensations is None else v_compensations.contiguous(), v_means, v_quats, v_scales, part]
    build.load().splat_project_bwd(
        C, N, width, height, eps2d, int(v_compensations is not None), int(camera_grad), CAMERA_GRAD_BLOCK,
        *map(_ptr, buffers), _threads(2 * C * N * NS_PER_PROJECTION),
    )  # fmt: skip
    v_viewmats, v_Ks = camera_grads(part.sum(dim=1), viewmats_grad, Ks_grad) if camera_grad else (None, None)
    return v_means.sum(0), v_quats.sum(0), v_scales.sum(0), v_viewmats, v_Ks


def _masks_u8(masks: Optional[Tensor]) -> Optional[Tensor]:
    return None if masks is None else masks.to(torch.uint8).contiguous()


def _sh_fwd(degree, dirs, coeffs, masks=None):
    """sh.cpp forward: colours [..., 3] (no +0.5 offset)."""
    colors = dirs.new_empty(dirs.shape)  # [..., 3]
    total, K = dirs.numel() // 3, coeffs.shape[-2]
    buffers = [dirs.detach().contiguous(), coeffs.detach().contiguous(), _masks_u8(masks), colors]  # alive for the call
    build.load().splat_sh_fwd(total, K, degree, *map(_ptr, buffers), _threads(total * NS_PER_SH_ROW))
    return colors


def _sh_bwd(degree, dirs, coeffs, masks, v_colors, dirs_grad=True):
    """sh.cpp backward: v_dirs [..., 3] (None unless ``dirs_grad``), v_coeffs [..., K, 3]."""
    v_coeffs = coeffs.new_empty(coeffs.shape)  # [..., K, 3]
    v_dirs = dirs.new_empty(dirs.shape) if dirs_grad else None  # [..., 3]
    total, K = dirs.numel() // 3, coeffs.shape[-2]
    buffers = [dirs.detach().contiguous(), coeffs.detach().contiguous(), _masks_u8(masks), v_colors.contiguous(),
               v_coeffs, v_dirs]  # alive for the call  # fmt: skip
    build.load().splat_sh_bwd(total, K, degree, *map(_ptr, buffers), _threads(2 * total * NS_PER_SH_ROW))
    return v_dirs, v_coeffs


# What ProjectFn and SphericalHarmonicsFn run for this backend.
KERNELS = SimpleNamespace(project_fwd=_project_fwd, project_bwd=_project_bwd, spherical_harmonics_fwd=_sh_fwd,
                          spherical_harmonics_bwd=_sh_bwd)  # fmt: skip


@stage
def project(means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane, radius_clip,
            calc_compensations):  # fmt: skip
    args = (width, height, eps2d, near_plane, far_plane, radius_clip, calc_compensations)
    if not _native(means, quats, scales, viewmats, Ks):
        return reference.project(means, quats, scales, viewmats, Ks, *args)
    return project_with(KERNELS, means, quats, scales, viewmats, Ks, *args)


@stage
def spherical_harmonics(degree, dirs, coeffs, masks, activate):
    """The activation in torch, after the kernel."""
    if not 0 <= int(degree) <= SH_MAX_DEGREE:
        raise ValueError(f"[spherical_harmonics] degree must be 0..{SH_MAX_DEGREE}, got {degree}")
    if not _native(dirs, coeffs):
        return reference.spherical_harmonics(degree, dirs, coeffs, masks, activate)
    colors = SphericalHarmonicsFn.apply(KERNELS, int(degree), dirs, coeffs, masks)
    return reference.activate_sh_colors(colors) if activate else colors


@torch.no_grad()
@stage
def isect_tiles(means2d, radii, depths, tile_size, tile_width, tile_height):
    """The reference's lists in the reference's order (isect.cpp: counting sort by tile, stable depth sort per
    tile)."""
    if not _native(means2d, depths):
        return reference.isect_tiles(means2d, radii, depths, tile_size, tile_width, tile_height)
    lib = build.load()
    C, N = radii.shape
    means2d, radii = means2d.detach().contiguous(), radii.int().contiguous()
    depths = depths.detach().float().contiguous()
    tiles_per_gauss = torch.empty(C, N, dtype=torch.int32)  # [C, N]
    threads = _threads(C * N * NS_PER_GAUSSIAN_TO_TILES)
    M = lib.splat_isect_count(C * N, tile_size, tile_width, tile_height, _ptr(means2d), _ptr(radii),
                              _ptr(tiles_per_gauss), threads)  # fmt: skip
    isect_ids = torch.empty(M, dtype=torch.int64)  # [M]
    flatten_ids = torch.empty(M, dtype=torch.int32)  # [M]
    lib.splat_isect_fill(C, N, tile_size, tile_width, tile_height, _ptr(means2d), _ptr(radii), _ptr(depths),
                         _ptr(tiles_per_gauss), M, _ptr(isect_ids), _ptr(flatten_ids), threads)  # fmt: skip
    return tiles_per_gauss, isect_ids, flatten_ids


class _RasterizeToPixelsFn(torch.autograd.Function):
    """Native forward (also records final transmittance and last contributor per pixel) and
    native backward. Returns colours [C,H,W,D] without background, transmittance [C,H,W] and the
    stopped mask [C,H,W] (not differentiable). ``trans_in`` / ``stopped_in`` ([C,H,W], or None for a
    whole render) resume from an earlier depth chunk; trans_in then gets a gradient too."""

    @staticmethod
    def forward(ctx, means2d, conics, colors, opacities, trans_in, stopped_in, width, height, tile_size,
                isect_offsets, flatten_ids, absgrad_buf):  # fmt: skip
        lib = build.load()
        C, N, D = colors.shape
        means2d, conics, colors, opacities = (t.contiguous() for t in (means2d, conics, colors, opacities))
        isect_offsets, flatten_ids = isect_offsets.int().contiguous(), flatten_ids.int().contiguous()
        tile_h, tile_w = isect_offsets.shape[1:]
        out_colors = colors.new_empty(C, height, width, D)  # [C, H, W, D]
        out_trans = colors.new_empty(C, height, width)  # [C, H, W]
        out_last = torch.empty(C, height, width, dtype=torch.int32)  # [C, H, W]
        out_stopped = torch.empty(C, height, width, dtype=torch.uint8)  # [C, H, W]
        resume = [None, None] if trans_in is None else [trans_in.contiguous(), stopped_in.to(torch.uint8).contiguous()]
        lib.splat_rasterize_fwd(
            C, D, width, height, tile_size, tile_w, tile_h, flatten_ids.numel(), ALPHA_MAX, ALPHA_MIN,
            TRANSMITTANCE_MIN, *map(_ptr, [means2d, conics, colors, opacities, isect_offsets, flatten_ids, *resume,
                                           out_colors, out_trans, out_last, out_stopped]),
            _threads(flatten_ids.numel() * tile_size**2 * NS_PER_PIXEL_SLOT),
        )  # fmt: skip
        ctx.save_for_backward(means2d, conics, colors, opacities, isect_offsets, flatten_ids, out_trans, out_last,
                              trans_in, stopped_in, out_colors if trans_in is not None else None)  # fmt: skip
        ctx.args = (width, height, tile_size)
        ctx.absgrad_buf = absgrad_buf
        out_stopped = out_stopped.bool()
        ctx.mark_non_differentiable(out_stopped)
        return out_colors, out_trans, out_stopped

    @staticmethod
    def backward(ctx, v_colors, v_trans, _v_stopped):
        (means2d, conics, colors, opacities, isect_offsets, flatten_ids, trans, last, trans_in, stopped_in,
         out_colors) = ctx.saved_tensors  # fmt: skip
        width, height, tile_size = ctx.args
        C, N, D = colors.shape
        tile_h, tile_w = isect_offsets.shape[1:]
        M = flatten_ids.numel()
        v_colors = colors.new_zeros(C, height, width, D) if v_colors is None else v_colors.contiguous()
        # render_alphas = 1 - transmittance: the kernel takes the gradient w.r.t. the alpha.
        v_alphas = colors.new_zeros(C, height, width) if v_trans is None else (-v_trans).contiguous()
        isect_grads = colors.new_empty(max(M, 1), 2 + 3 + 1 + D + 2)  # [M, K] scratch
        v_means2d, v_conics = torch.zeros_like(means2d), torch.zeros_like(conics)  # [C, N, 2], [C, N, 3]
        v_opacities, v_colors_in = torch.zeros_like(opacities), torch.zeros_like(colors)  # [C, N], [C, N, D]
        absgrad = torch.zeros_like(means2d)  # [C, N, 2]
        build.load().splat_rasterize_bwd(
            C, D, width, height, tile_size, tile_w, tile_h, M, ALPHA_MAX, ALPHA_MIN, TRANSMITTANCE_MIN,
            *map(_ptr, (means2d, conics, colors, opacities, isect_offsets, flatten_ids, trans, last, v_colors,
                        v_alphas, isect_grads, v_means2d, v_conics, v_opacities, v_colors_in, absgrad)),
            _threads(2 * M * tile_size**2 * NS_PER_PIXEL_SLOT),
        )  # fmt: skip
        if ctx.absgrad_buf is not None:
            ctx.absgrad_buf.add_(absgrad)
        v_trans_in = None
        if trans_in is not None and ctx.needs_input_grad[4]:
            v_trans_in = resumed_transmittance_grad(out_colors, v_colors, trans, v_trans, trans_in, stopped_in,
                                                    TRANSMITTANCE_MIN)  # fmt: skip
        return (v_means2d, v_conics, v_colors_in, v_opacities, v_trans_in,
                None, None, None, None, None, None, None)  # fmt: skip


@stage
def rasterize_to_pixels(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids,
                        backgrounds, absgrad):  # fmt: skip
    if not _native(means2d, conics, colors, opacities):
        return reference.rasterize_to_pixels(means2d, conics, colors, opacities, width, height, tile_size,
                                             isect_offsets, flatten_ids, backgrounds, absgrad)  # fmt: skip
    render_colors, trans, _ = _RasterizeToPixelsFn.apply(
        means2d, conics, colors, opacities, None, None, int(width), int(height), int(tile_size), isect_offsets,
        flatten_ids, absgrad_buffer(means2d, absgrad),
    )  # fmt: skip
    render_alphas = 1.0 - trans[..., None]  # [C, H, W, 1]
    return with_background(render_colors, render_alphas, backgrounds), render_alphas


@stage
def rasterize_depth_chunk(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids,
                          transmittance, stopped, absgrad_out):  # fmt: skip
    if not _native(means2d, conics, colors, opacities, transmittance):
        return reference.rasterize_depth_chunk(means2d, conics, colors, opacities, width, height, tile_size,
                                               isect_offsets, flatten_ids, transmittance, stopped, absgrad_out)  # fmt: skip
    return _RasterizeToPixelsFn.apply(
        means2d, conics, colors, opacities, transmittance, stopped, int(width), int(height), int(tile_size),
        isect_offsets, flatten_ids, absgrad_out,
    )  # fmt: skip
