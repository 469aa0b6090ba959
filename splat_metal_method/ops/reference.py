"""Reference backend: pure PyTorch, differentiable, runs on cpu, mps and cuda.

It is the oracle every other backend is tested against, so it favours plain, vectorised math
over speed. Semantics follow gsplat 1.4 (non-packed, pinhole). Cost grows with tile
intersections (each tile composites only the gaussians listed for it), and memory stays bounded
by compositing tiles in chunks (recomputed in backward when the work is large).

It implements every stage of the backend contract (ops/contract.py: ``project``, ``spherical_harmonics``,
``isect_tiles``, ``isect_offset_encode``, ``rasterize_to_pixels``, ``rasterize_depth_chunk``). At the end: the two ops of gsplat's MCMC strategy (``compute_relocation``,
``quat_scale_to_covar_preci``), which every non-CUDA device runs from here (ops/mcmc.py).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..sh_basis import SH_C0, sh_basis_terms
from .constants import ALPHA_MAX, ALPHA_MIN, SH_MAX_DEGREE, TRANSMITTANCE_MIN
from .contract import absgrad_buffer, stage, with_background

# Elements of one [tiles, gaussians, pixels] block composited at once. Bounds peak memory.
CHUNK_ELEMENTS = 1 << 22
# Above this much total compositing work, chunks are recomputed in backward instead of stored.
CHECKPOINT_ELEMENTS = 1 << 24


def quat_to_rotmat(quats: Tensor) -> Tensor:  # [..., 4] wxyz -> [..., 3, 3]
    w, x, y, z = F.normalize(quats, p=2, dim=-1).unbind(-1)
    rows = [
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ]  # fmt: skip
    return torch.stack(rows, dim=-1).reshape(quats.shape[:-1] + (3, 3))


RADIUS_LIMIT = 2.0**31  # radii are int32: a radius must be below this (covar.h SPLAT_RADIUS_LIMIT)


def _rows_finite(x: Tensor, dims: int = 1) -> Tensor:  # [..., *row] -> [...] bool
    return torch.isfinite(x).flatten(-dims).all(dim=-1)


@stage
def project(means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane, radius_clip,
            calc_compensations):  # fmt: skip
    """Non-finite inputs (README "Known limits"), by explicit checks as in covar.h: a gaussian whose
    mean, quaternion, scale or quaternion squared norm is not finite, or a camera whose view matrix
    is not, is culled; so is a pair whose projected values (means2d, conic, radius, depth, and the
    compensation ratio when asked) are not finite or whose radius does not fit int32. Culled pairs get
    exactly zero gradients: the values are computed once to find them, then again with every culled
    pair's inputs replaced by a harmless constant, so no NaN or inf meets a zero gradient (0 * inf)."""
    quat_sq = (quats * quats).sum(dim=-1)  # [N]
    gauss_ok = _rows_finite(means) & _rows_finite(quats) & torch.isfinite(quat_sq) & _rows_finite(scales)  # [N]
    cam_ok = _rows_finite(viewmats[:, :3, :], 2)  # [C] (the 12 entries projection reads)
    with torch.no_grad():
        pair_ok = cam_ok[:, None] & gauss_ok[None, :]
        keep = _project_pairs(
            means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane, radius_clip,
            calc_compensations, pair_ok,
        )[0]  # fmt: skip
    return _project_pairs(
        means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane, radius_clip,
        calc_compensations, keep,
    )[1]  # fmt: skip


def _project_pairs(means, quats, scales, viewmats, Ks, width, height, eps2d, near_plane, far_plane, radius_clip,
                   calc_compensations, pair_ok):  # fmt: skip
    """project's math for the (camera, gaussian) pairs where pair_ok [C,N]; the others use a unit
    gaussian 1 in front of an identity camera instead of their inputs. Returns (keep [C,N], outputs)."""
    C, N = pair_ok.shape
    gauss_any = pair_ok.any(dim=0)  # [N]
    cam_any = pair_ok.any(dim=1)  # [C]
    eye = torch.eye(4, device=viewmats.device, dtype=viewmats.dtype)
    viewmats = torch.where(cam_any[:, None, None], viewmats, eye)
    means = torch.where(gauss_any[:, None], means, 0.0)
    quats = torch.where(gauss_any[:, None], quats, torch.tensor([1.0, 0.0, 0.0, 0.0], device=quats.device))
    scales = torch.where(gauss_any[:, None], scales, 1.0)
    M = quat_to_rotmat(quats) * scales[:, None, :]  # [N, 3, 3]
    covars = M @ M.transpose(-1, -2)  # [N, 3, 3]
    R = viewmats[:, :3, :3]  # [C, 3, 3]
    t = viewmats[:, :3, 3]  # [C, 3]
    means_c = torch.einsum("cij,nj->cni", R, means) + t[:, None, :]  # [C, N, 3]
    covars_c = torch.einsum("cij,njk,clk->cnil", R, covars, R)  # [C, N, 3, 3]
    # Per pair: a pair that is not ok (or whose camera-space values overflowed) gets the constant.
    ok = pair_ok & _rows_finite(means_c) & _rows_finite(covars_c, 2)
    means_c = torch.where(ok[..., None], means_c, torch.tensor([0.0, 0.0, 1.0], device=means.device))
    covars_c = torch.where(ok[..., None, None], covars_c, eye[:3, :3])

    tx, ty, tz = means_c.unbind(-1)  # [C, N]
    in_depth = (tz >= near_plane) & (tz <= far_plane)  # gsplat's kernel culls z < near or z > far
    # Culled gaussians still flow through the math below; a safe depth keeps their values (and
    # therefore every gradient) finite before they are zeroed.
    tz = torch.where(in_depth, tz, torch.ones_like(tz))
    fx, fy = Ks[:, 0, 0, None], Ks[:, 1, 1, None]  # [C, 1]
    cx, cy = Ks[:, 0, 2, None], Ks[:, 1, 2, None]  # [C, 1]
    tan_fovx, tan_fovy = 0.5 * width / fx, 0.5 * height / fy
    lim_x_pos, lim_x_neg = (width - cx) / fx + 0.3 * tan_fovx, cx / fx + 0.3 * tan_fovx
    lim_y_pos, lim_y_neg = (height - cy) / fy + 0.3 * tan_fovy, cy / fy + 0.3 * tan_fovy
    tx_c = tz * torch.minimum(torch.maximum(tx / tz, -lim_x_neg), lim_x_pos)
    ty_c = tz * torch.minimum(torch.maximum(ty / tz, -lim_y_neg), lim_y_pos)
    zero = torch.zeros_like(tz)
    J = torch.stack([fx / tz, zero, -fx * tx_c / (tz * tz), zero, fy / tz, -fy * ty_c / (tz * tz)], dim=-1).reshape(
        tz.shape + (2, 3)
    )  # [C, N, 2, 3]
    cov2d = J @ covars_c @ J.transpose(-1, -2)  # [C, N, 2, 2]
    means2d = torch.stack([fx * tx / tz + cx, fy * ty / tz + cy], dim=-1)  # [C, N, 2]

    a, b, c = cov2d[..., 0, 0], 0.5 * (cov2d[..., 0, 1] + cov2d[..., 1, 0]), cov2d[..., 1, 1]
    det_orig = a * c - b * b
    a, c = a + eps2d, c + eps2d
    det = a * c - b * b
    valid = ok & in_depth & (det > 0)
    det = torch.where(valid, det, torch.ones_like(det))
    conics = torch.stack([c / det, -b / det, a / det], dim=-1)  # [C, N, 3]
    ratio = det_orig / det

    with torch.no_grad():
        half_trace = 0.5 * (a + c)
        v1 = half_trace + torch.sqrt(torch.clamp(half_trace * half_trace - det, min=0.01))
        radius = torch.ceil(3.0 * torch.sqrt(v1))
        x, y = means2d[..., 0], means2d[..., 1]
        inside = (x + radius > 0) & (x - radius < width) & (y + radius > 0) & (y - radius < height)
        finite = _rows_finite(means2d) & _rows_finite(conics) & torch.isfinite(radius) & (radius < RADIUS_LIMIT)
        if calc_compensations:
            finite &= torch.isfinite(ratio)
        keep = valid & (radius > radius_clip) & inside & finite
        radii = torch.where(keep, radius, torch.zeros_like(radius)).int()  # keep: finite and < 2^31

    compensations = None
    if calc_compensations:
        positive = keep & (ratio > 0)
        compensations = torch.where(positive, torch.sqrt(torch.where(positive, ratio, 1.0)), 0.0)
    k = keep[..., None]
    return keep, (
        radii,
        torch.where(k, means2d, 0.0),
        torch.where(keep, means_c[..., 2], 0.0),
        torch.where(k, conics, 0.0),
        compensations,
    )


def sh_bases(degree: int, dirs: Tensor) -> Tensor:  # dirs [..., 3] unit -> [..., (degree+1)^2]
    """gsplat 1.4's _eval_sh_bases_fast((degree+1)^2, dirs) for degree 0..4, in its operation order (the
    polynomials: sh_basis.py, shared with the torch-free export)."""
    if not 0 <= degree <= SH_MAX_DEGREE:
        raise ValueError(f"[spherical_harmonics] degree must be 0..{SH_MAX_DEGREE}, got {degree}")
    x, y, z = dirs.unbind(-1)
    return torch.stack([torch.full_like(x, SH_C0), *sh_basis_terms(degree, x, y, z)], dim=-1)


@stage
def spherical_harmonics(degree, dirs, coeffs, masks, activate):
    n_bases = (degree + 1) ** 2
    coeffs = coeffs[..., :n_bases, :]
    if masks is not None:  # masked entries compute with zeros, so their gradients are exactly 0 (no 0 * NaN)
        dirs = torch.where(masks[..., None], dirs, 1.0)
        coeffs = torch.where(masks[..., None, None], coeffs, 0.0)
    bases = sh_bases(degree, F.normalize(dirs, p=2, dim=-1))  # [C, N, n_bases]
    colors = (bases[..., None] * coeffs).sum(dim=-2)
    if masks is not None:
        colors = torch.where(masks[..., None], colors, 0.0)
    return activate_sh_colors(colors) if activate else colors


def activate_sh_colors(colors: Tensor) -> Tensor:
    """The public API's colour from SH: clamp_min(c + 0.5, 0) (gsplat's; the oracle for sh.metal's
    ``activate``)."""
    return torch.clamp_min(colors + 0.5, 0.0)


@torch.no_grad()
def tile_bounds(
    means2d: Tensor,  # [C, N, 2]
    radii: Tensor,  # [C, N] int32
    tile_size: int,
    tile_width: int,
    tile_height: int,
) -> Tuple[Tensor, Tensor]:
    """First tile (x, y) and tile span (w, h) of each gaussian's screen bounding box, clipped to the
    grid: lo [C,N,2] int64, span [C,N,2] int64. Its tile count is span_x * span_y where radii > 0."""
    tile_xy = means2d.float() / tile_size  # [C, N, 2]
    tile_r = radii.float() / tile_size  # [C, N]
    lo = torch.floor(tile_xy - tile_r[..., None]).long()  # [C, N, 2]
    hi = torch.ceil(tile_xy + tile_r[..., None]).long()
    limit = torch.tensor([tile_width, tile_height], device=means2d.device)
    lo = torch.minimum(torch.clamp(lo, min=0), limit)
    hi = torch.minimum(torch.clamp(hi, min=0), limit)
    return lo, hi - lo


@torch.no_grad()
@stage
def isect_tiles(means2d, radii, depths, tile_size, tile_width, tile_height):
    C, N = radii.shape
    device = means2d.device
    lo, span = tile_bounds(means2d, radii, tile_size, tile_width, tile_height)
    tiles_per_gauss = span[..., 0] * span[..., 1] * (radii > 0)  # [C, N]

    counts = tiles_per_gauss.flatten()
    owner = torch.repeat_interleave(torch.arange(C * N, device=device), counts)  # [M]
    first = torch.cumsum(counts, 0) - counts
    local = torch.arange(owner.numel(), device=device) - first[owner]
    span_x = span.reshape(-1, 2)[owner, 0]
    lo_flat = lo.reshape(-1, 2)[owner]
    tile_x = lo_flat[:, 0] + local % span_x.clamp(min=1)
    tile_y = lo_flat[:, 1] + local // span_x.clamp(min=1)
    tile_id = tile_y * tile_width + tile_x
    cam_id = owner // max(N, 1)
    tile_bits = (tile_width * tile_height).bit_length()
    depth_bits = depths.float().contiguous().view(torch.int32).long().flatten()[owner] & 0xFFFFFFFF
    isect_ids = (cam_id << (32 + tile_bits)) | (tile_id << 32) | depth_bits
    isect_ids, order = torch.sort(isect_ids, stable=True)
    flatten_ids = owner[order].int()
    return tiles_per_gauss.int(), isect_ids, flatten_ids


@torch.no_grad()
@stage
def isect_offset_encode(isect_ids, C, tile_width, tile_height):
    tile_bits = (tile_width * tile_height).bit_length()
    n_tiles = tile_width * tile_height
    key = isect_ids >> 32
    dense = (key >> tile_bits) * n_tiles + (key & ((1 << tile_bits) - 1))  # camera-major tile index
    counts = torch.bincount(dense, minlength=C * n_tiles)
    offsets = torch.cumsum(counts, 0) - counts
    return offsets.reshape(C, tile_height, tile_width).int()


class _PixelDeltas(torch.autograd.Function):
    """deltas[t, l, p] = means2d of gaussian l of tile t minus pixel p's centre.

    Its backward is where per-pixel gradients w.r.t. means2d exist separately, so it also
    accumulates their absolute values (gsplat's absgrad, read by DefaultStrategy)."""

    @staticmethod
    def forward(ctx, means, pixels, gaussian_ids, absgrad_out):  # [T,L,2], [T,P,2], [T,L], [C*N,2]|None
        ctx.save_for_backward(gaussian_ids)
        ctx.absgrad_out = absgrad_out
        return means[:, :, None, :] - pixels[:, None, :, :]  # [T, L, P, 2]

    @staticmethod
    def backward(ctx, grad):  # grad [T, L, P, 2]
        (gaussian_ids,) = ctx.saved_tensors
        if ctx.absgrad_out is not None:
            ctx.absgrad_out.index_add_(0, gaussian_ids.flatten(), grad.abs().sum(2).flatten(0, 1))
        return grad.sum(2), None, None, None  # means, pixels (constant), ids, absgrad buffer


def _running_transmittance(alpha: Tensor, trans_in: Optional[Tensor]) -> Tensor:
    """Transmittance after each gaussian, [T,L,P], starting from 1 or from ``trans_in`` [T,P].

    ``trans_in`` enters as the first factor of the running product, so a list composited in two
    depth chunks multiplies the same factors in the same order as the list composited at once."""
    if trans_in is None:
        return torch.cumprod(1 - alpha, dim=1)
    return torch.cumprod(torch.cat([trans_in[:, None, :], 1 - alpha], dim=1), dim=1)[:, 1:]


def _composite_tiles(
    means2d, conics, colors, opacities, pixels, pixel_ok, gaussian_ids, valid, absgrad_out, trans_in=None
):
    """Front-to-back compositing of a block of tiles, exactly as gsplat's kernel does per pixel.

    means2d [T,L,2], conics [T,L,3], colors [T,L,D], opacities [T,L], pixels [T,P,2],
    pixel_ok [T,P], gaussian_ids [T,L], valid [T,L], trans_in [T,P] or None (start at 1; 0 marks a
    pixel that has already stopped) -> colors [T,P,D], transmittance [T,P], stopped [T,P] bool."""
    delta = _PixelDeltas.apply(means2d, pixels, gaussian_ids, absgrad_out)  # [T, L, P, 2]
    dx, dy = delta[..., 0], delta[..., 1]
    a, b, c = (conics[..., i, None] for i in range(3))
    sigma = 0.5 * (a * dx * dx + c * dy * dy) + b * dx * dy  # [T, L, P]
    # The alpha test, explicit about non-finite values and identical in every backend's forward and
    # backward: sigma finite and >= 0, opacity * exp(-sigma) finite, alpha >= ALPHA_MIN. A failing sigma
    # is replaced by +inf before exp (alpha 0, gradient exactly 0).
    sigma_ok = torch.isfinite(sigma) & (sigma >= 0)
    raw_alpha = opacities[..., None] * torch.exp(-torch.where(sigma_ok, sigma, torch.inf))
    alpha = torch.clamp_max(raw_alpha, ALPHA_MAX)
    used = sigma_ok & torch.isfinite(raw_alpha) & (alpha >= ALPHA_MIN) & valid[..., None] & pixel_ok[:, None, :]
    alpha = torch.where(used, alpha, 0.0)
    with torch.no_grad():  # a pixel stops before the gaussian that would drop T to the floor
        reach = _running_transmittance(alpha, trans_in)
        used = used & (reach > TRANSMITTANCE_MIN)
        stopped = reach[:, -1] <= TRANSMITTANCE_MIN  # T only falls, so the last entry tells
    alpha = torch.where(used, alpha, 0.0)
    trans = _running_transmittance(alpha, trans_in)  # [T, L, P] transmittance after each gaussian
    first = torch.ones_like(trans[:, :1]) if trans_in is None else trans_in[:, None, :]
    trans_before = torch.cat([first, trans[:, :-1]], dim=1)
    weights = alpha * trans_before
    return torch.einsum("tlp,tld->tpd", weights, colors), trans[:, -1], stopped


@stage
def rasterize_to_pixels(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids,
                        backgrounds, absgrad):  # fmt: skip
    render_colors, trans, _ = _rasterize(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets,
                                         flatten_ids, absgrad_buffer(means2d, absgrad))  # fmt: skip
    render_alphas = 1.0 - trans[..., None]
    return with_background(render_colors, render_alphas, backgrounds), render_alphas


@stage
def rasterize_depth_chunk(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids,
                          transmittance, stopped, absgrad_out):  # fmt: skip
    trans_in = torch.where(stopped, torch.zeros_like(transmittance), transmittance)
    out_colors, trans, stopped_out = _rasterize(
        means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids, absgrad_out,
        trans_in,
    )  # fmt: skip
    return out_colors, torch.where(stopped, transmittance, trans), stopped | stopped_out


def _rasterize(means2d, conics, colors, opacities, width, height, tile_size, isect_offsets, flatten_ids,
               absgrad_out=None, trans_in=None) -> Tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Compositing of every tile (rasterize_to_pixels's arguments, absgrad_out [C, N, 2] or None, trans_in
    [C, H, W] or None: start at 1; 0 marks a pixel that has stopped): colors [C,H,W,D] (no background),
    transmittance [C,H,W], stopped [C,H,W] bool."""
    C, N, D = colors.shape
    tile_height, tile_width = isect_offsets.shape[1:]
    n_tiles = C * tile_height * tile_width
    P = tile_size * tile_size
    device = means2d.device
    M = flatten_ids.numel()

    starts = isect_offsets.flatten().long()
    ends = torch.cat([starts[1:], torch.tensor([M], device=device)])
    counts = ends - starts  # [n_tiles]
    absgrad_flat = absgrad_out.view(C * N, 2) if absgrad_out is not None else None

    means_flat = means2d.reshape(C * N, 2)
    conics_flat = conics.reshape(C * N, 3)
    colors_flat = colors.reshape(C * N, D)
    opac_flat = opacities.reshape(C * N)
    # A gaussian whose mean, conic or opacity is not finite fails the alpha test at every pixel (as in
    # the kernels); here it is given zeros (alpha 0) so that no NaN meets a zero gradient.
    finite = _rows_finite(means_flat) & _rows_finite(conics_flat) & torch.isfinite(opac_flat)  # [C*N]
    means_flat = torch.where(finite[:, None], means_flat, 0.0)
    conics_flat = torch.where(finite[:, None], conics_flat, 0.0)
    opac_flat = torch.where(finite, opac_flat, 0.0)

    # Pixel centres of every tile: [n_tiles, P, 2] built lazily per chunk from the tile index.
    local = torch.arange(P, device=device)
    local_xy = torch.stack([local % tile_size, local // tile_size], dim=-1)  # [P, 2]

    def tile_pixels(tile_idx):  # [T] -> pixels [T,P,2] float, inside-image mask [T,P]
        ty = (tile_idx // tile_width) % tile_height
        tx = tile_idx % tile_width
        xy = torch.stack([tx, ty], dim=-1)[:, None, :] * tile_size + local_xy[None]  # [T, P, 2]
        ok = (xy[..., 0] < width) & (xy[..., 1] < height)
        return xy.to(means2d.dtype) + 0.5, ok

    def to_tiles(x):  # [C, H, W, K] -> [n_tiles, P, K] (pixels past the image edge padded with 1)
        pad_h, pad_w = tile_height * tile_size - height, tile_width * tile_size - width
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h), value=1.0)
        x = x.reshape(C, tile_height, tile_size, tile_width, tile_size, -1).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(n_tiles, P, -1)

    trans_tiles = None if trans_in is None else to_tiles(trans_in[..., None])[..., 0]  # [n_tiles, P]

    def composite(tile_idx, length, means_f, conics_f, colors_f, opac_f, trans_t):
        pos = starts[tile_idx, None] + torch.arange(length, device=device)  # [T, L]
        valid = torch.arange(length, device=device) < counts[tile_idx, None]
        gids = flatten_ids[torch.where(valid, pos, 0).clamp(max=max(M - 1, 0))].long()  # [T, L]
        gids = torch.where(valid, gids, 0)
        pixels, pixel_ok = tile_pixels(tile_idx)
        return _composite_tiles(
            means_f[gids], conics_f[gids], colors_f[gids], opac_f[gids],
            pixels, pixel_ok, gids, valid, absgrad_flat, None if trans_t is None else trans_t[tile_idx],
        )  # fmt: skip

    # Group non-empty tiles by gaussian count so padding stays small, then cut into chunks.
    busy = torch.nonzero(counts > 0).flatten()
    busy = busy[torch.argsort(counts[busy], stable=True)]
    busy_counts = counts[busy].tolist()
    total_work = sum(busy_counts) * P
    use_checkpoint = torch.is_grad_enabled() and total_work > CHECKPOINT_ELEMENTS
    tile_ids, tile_colors, tile_trans, tile_stopped = [], [], [], []
    i = 0
    while i < len(busy_counts):
        j = i + 1
        # Tiles are sorted by count, so the last in the chunk sets the padded length.
        while j < len(busy_counts) and (j + 1 - i) * busy_counts[j] * P <= CHUNK_ELEMENTS:
            j += 1
        idx, length = busy[i:j], busy_counts[j - 1]
        args = (idx, length, means_flat, conics_flat, colors_flat, opac_flat, trans_tiles)
        if use_checkpoint:
            col, trans, stop = checkpoint(composite, *args, use_reentrant=False)
        else:
            col, trans, stop = composite(*args)
        tile_ids.append(idx)
        tile_colors.append(col)
        tile_trans.append(trans)
        tile_stopped.append(stop)
        i = j

    image = torch.zeros(n_tiles, P, D, device=device, dtype=colors.dtype)
    if trans_tiles is None:
        trans_all = torch.ones(n_tiles, P, device=device, dtype=colors.dtype)
    else:
        trans_all = trans_tiles
    stopped_all = trans_all <= TRANSMITTANCE_MIN
    if tile_ids:
        idx = torch.cat(tile_ids)
        image = image.index_copy(0, idx, torch.cat(tile_colors))
        trans_all = trans_all.index_copy(0, idx, torch.cat(tile_trans))
        stopped_all = stopped_all.index_copy(0, idx, torch.cat(tile_stopped))
    else:
        # Nothing visible: keep the outputs attached to the inputs (an empty slice sums to exactly 0)
        # so backward still runs and gives zero gradients, as gsplat's kernels do; DefaultStrategy
        # reads means2d.grad even for views that see no gaussian.
        anchor = sum(t[:0].sum() for t in (means_flat, conics_flat, colors_flat, opac_flat))
        image, trans_all = image + anchor, trans_all + anchor

    def to_image(x):  # [n_tiles, P, K] -> [C, H, W, K]
        x = x.reshape(C, tile_height, tile_width, tile_size, tile_size, -1).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(C, tile_height * tile_size, tile_width * tile_size, -1)[:, :height, :width]

    return to_image(image), to_image(trans_all[..., None])[..., 0], to_image(stopped_all[..., None])[..., 0]


# ------------------------------------------------------------------------------------------------
# The ops of the MCMC strategy (gsplat.relocation.compute_relocation, gsplat.quat_scale_to_covar_preci)
# ------------------------------------------------------------------------------------------------
def compute_relocation(
    opacities: Tensor,  # [N] opacities of the sampled gaussians
    scales: Tensor,  # [N, 3]
    ratios: Tensor,  # [N] int: how many gaussians each one becomes (itself included)
    binoms: Tensor,  # [n_max, n_max] binomial coefficients, binoms[n, k] = C(n, k)
) -> Tuple[Tensor, Tensor]:
    """Opacity and scale of each of the ``ratios`` gaussians one gaussian is split into, so that they
    render like the original (3DGS as MCMC, Kheradmand et al. 2024, eq. 9):

        o' = 1 - (1 - o)^(1/n)
        s' = s * o / sum_{i=1..n} sum_{k=0..i-1} C(i-1, k) (-1)^k o'^(k+1) / sqrt(k+1)

    As gsplat: n is ``ratios`` clamped to [1, n_max]. The alternating sum loses digits in float32
    (gsplat's kernel: up to 3e-4 relative at o ~ 1, n ~ 50), so it is summed in float64 where the
    device has it (not mps); then only the rounding of the table remains (gsplat's float32
    table, 8e-5). Returns [N], [N, 3] in the dtype of the inputs."""
    n_max = binoms.shape[0]
    n = ratios.clamp(1, n_max).long()  # [N]
    work = torch.float32 if opacities.device.type == "mps" else torch.float64
    o = opacities.to(work)
    new_opacities = -torch.expm1(torch.log1p(-o) / n)  # 1 - (1-o)^(1/n), accurate for small o
    # Swap the sums: sum_k (sum_{i=k+1..n} C(i-1, k)) (-1)^k o'^(k+1) / sqrt(k+1); the inner sum is a
    # column sum of rows 0..n-1 of the table (C(i-1, k) = 0 for i-1 < k).
    k = torch.arange(n_max, device=o.device, dtype=work)  # [n_max]
    coeffs = binoms.to(work).cumsum(dim=0)[n - 1]  # [N, n_max]
    signs = 1.0 - 2.0 * (k % 2)  # (-1)^k
    terms = coeffs * (signs / torch.sqrt(k + 1)) * new_opacities[:, None] ** (k + 1)  # [N, n_max]
    new_scales = scales * (o / terms.sum(dim=-1)).to(scales.dtype)[:, None]  # [N, 3]
    return new_opacities.to(opacities.dtype), new_scales


def quat_scale_to_covar_preci(
    quats: Tensor,  # [N, 4] wxyz, not necessarily normalised
    scales: Tensor,  # [N, 3]
    compute_covar: bool = True,
    compute_preci: bool = True,
    triu: bool = False,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Covariance R S S^T R^T and precision R S^-1 S^-1 R^T of each gaussian, R from the normalised
    quaternion, S = diag(scales): [N, 3, 3] each, or their upper triangles [N, 6] (xx, xy, xz, yy,
    yz, zz) with ``triu``; None for the one not asked for (gsplat 1.4 semantics)."""
    R = quat_to_rotmat(quats)  # [N, 3, 3]

    def outer(M: Tensor) -> Tensor:  # M M^T: [N, 3, 3], or its upper triangle [N, 6]
        out = M @ M.transpose(-1, -2)
        return out.flatten(-2)[..., [0, 1, 2, 4, 5, 8]] if triu else out

    covars = outer(R * scales[:, None, :]) if compute_covar else None
    precis = outer(R / scales[:, None, :]) if compute_preci else None
    return covars, precis
