"""Distributed rasterization: gaussians sharded over the ranks of a torch.distributed group, each rank
rendering its own cameras from every shard (the design of gsplat 1.4's ``distributed=True``, after
Grendel-GS), on any collective backend (gloo on CPU, NCCL on CUDA).

One call, made collectively by every rank of the group:
  1. every rank's options and sizes are gathered and checked (one small all_gather): a mismatch, or bad
     input on any rank, raises the same clear error on every rank instead of a hang;
  2. every rank's cameras are gathered (differentiable: the gradient of every rank's use of a camera is
     summed back to the rank that owns it);
  3. the rank projects its shard for all C_total cameras with the backend's ``project`` stage (per
     destination rank, at that rank's width/height) and evaluates SH colours for them;
  4. ONE ``all_to_all_single`` with uneven splits (gloo and NCCL both have it) sends each destination the
     (camera, gaussian) pairs visible in its cameras (radii > 0): means2d, conics, colours, opacity (with
     the antialiasing compensation), depth, radius -- 8 + D floats a pair;
  5. the receiver lays them out as [C_r, M, ...] (M: the most pairs one of its cameras got), in the order
     of the concatenation of all shards, and rasterizes them with the backend's ``isect_tiles``,
     ``isect_offset_encode`` and ``rasterize_to_pixels`` (or the depth chunks of ops/chunked.py).
In backward the same all-to-all runs in reverse: the gradients of the received pairs (and, with
``absgrad``, their per-pixel absolute gradients) return to the owners, so each rank's parameters and its
``meta["means2d"]`` get exactly the rows a single process rendering every camera from every gaussian would
give them, for a loss that is the sum of every rank's loss.

Every rank runs the same collectives in the same order, whatever its shard holds (N_r == 0 and nothing
visible included), and each collective uses the group's own timeout. Backward runs two collectives (the
reverse all-to-all, then an all_reduce of the camera gradients), so every rank must call backward on a
loss that depends on its renders (``loss.backward()``, as with DDP).
"""

from __future__ import annotations

import inspect
import math
import struct
import warnings
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .contract import RASTERIZE_MODES, RENDER_MODES, RasterizeCall, call_signature, check_inputs
from .rasterization import BACKENDS, BackendUnavailable, backend_module, rasterization, resolve_backend
from .stages import rasterize_projected, render_meta

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _decode(label: str, value: int):
    """An option's value as gathered (an int) -> readable, for error messages."""
    named = {"backend": BACKENDS, "render_mode": RENDER_MODES, "rasterize_mode": RASTERIZE_MODES, "dtype": _DTYPES}
    if label in named:
        return named[label][value] if 0 <= value < len(named[label]) else "invalid"
    if label in ("near_plane", "far_plane", "radius_clip", "eps2d"):
        return struct.unpack("<d", struct.pack("<q", value))[0]
    return None if label == "sh_degree" and value == -1 else value


def _gather_ints(values: List[int], group, device: torch.device) -> List[List[int]]:
    """all_gather of one int64 vector per rank -> a list (rank) of lists."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.tolist() for o in out]


class _GatherCameras(torch.autograd.Function):
    """[C_r, 25] per rank (viewmat, then K, flattened) -> [C_total, 25] of every rank in rank order.
    Backward: all_reduce of the gradient (each rank's use of every camera), then this rank's rows."""

    @staticmethod
    def forward(ctx, cams, counts, rank, group):  # [C_r, 25], C per rank, this rank, group
        padded = cams.new_zeros(max(counts), cams.shape[1])  # all_gather needs equal sizes
        padded[: cams.shape[0]] = cams
        out = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(out, padded.contiguous(), group=group)
        ctx.rows = (sum(counts[:rank]), counts[rank])
        ctx.group = group
        return torch.cat([o[:c] for o, c in zip(out, counts)])

    @staticmethod
    def backward(ctx, grad):  # [C_total, 25]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start, count = ctx.rows
        return grad[start : start + count], None, None, None  # counts, rank, group: not differentiable


class _ExchangeProjected(torch.autograd.Function):
    """The all-to-all of the visible projected gaussians, [S, F] sent -> [R, F] received; backward sends
    the gradients of the first ``plan.n_grad`` columns (plus the receiver's absgrad rows) back."""

    @staticmethod
    def forward(ctx, send, plan):  # send [S, F]
        recv = send.new_empty(sum(plan.recv_splits), send.shape[1])  # [R, F]
        dist.all_to_all_single(recv, send.detach().contiguous(), plan.recv_splits, plan.send_splits, group=plan.group)
        ctx.plan = plan
        ctx.shape = send.shape
        return recv

    @staticmethod
    def backward(ctx, grad_recv):  # [R, F]
        plan = ctx.plan
        grad = grad_recv[:, : plan.n_grad]
        if plan.recv_absgrad is not None:  # [C_r, M, 2], filled by the rasterizer's backward, which ran first
            grad = torch.cat([grad, plan.recv_absgrad.reshape(-1, 2)[plan.recv_index]], dim=1)
        grad_send = grad.new_empty(ctx.shape[0], grad.shape[1])  # [S, n_grad (+2)]
        dist.all_to_all_single(grad_send, grad.contiguous(), plan.send_splits, plan.recv_splits, group=plan.group)
        if plan.send_absgrad is not None:  # meta["means2d"].absgrad [C_total, N_r, 2]
            plan.send_absgrad[plan.send_visible] = grad_send[:, plan.n_grad :]
        tail = grad_send.new_zeros(ctx.shape[0], ctx.shape[1] - plan.n_grad)  # radius: not differentiable
        return torch.cat([grad_send[:, : plan.n_grad], tail], dim=1), None  # plan: not differentiable


_warned_gsplat_fallback = False


def gsplat_distributed_misfit(cameras: List[int], sizes: List[Tuple[int, int]], absgrad: bool, default_group: bool,
                              packed: bool) -> Optional[str]:  # fmt: skip
    """Why gsplat 1.4's ``rasterization(distributed=True)`` cannot give this call's semantics (None: it can).

    Read in gsplat/rendering.py: it assumes every rank passes the same number of cameras and projects
    every camera at the calling rank's width/height, asserts absgrad off, and uses the default group."""
    if absgrad:
        return "it does not support absgrad (an assert in gsplat 1.4)"
    if len(set(cameras)) > 1:
        return f"it needs the same camera count on every rank, got {cameras}"
    if len(set(sizes)) > 1:
        return f"it projects every camera at the caller's image size, and the ranks' sizes differ: {sizes}"
    if not default_group:
        return "it runs on the default process group only"
    if packed:
        return "packed mode's meta differs from the dense one DefaultStrategy reads here"
    return None


def distributed_rasterization(
    *args, group: Optional[dist.ProcessGroup] = None, absgrad_in_run: Optional[bool] = None, **kwargs
) -> Tuple[Tensor, Tensor, Dict]:
    """Renders this rank's C_r cameras from the gaussians of every rank of ``group`` (default: the default
    process group; a process without an initialised process group is a world of one). Called collectively.
    The arguments are ``ops.rasterization``'s (``contract.RasterizeCall``): this rank's shard (means [N_r, 3],
    ...), its cameras (viewmats [C_r, 4, 4], Ks [C_r, 3, 3], backgrounds [C_r, D]) and image size; ``group``
    and ``absgrad_in_run`` are keyword-only.

    Same semantics as one process calling ``ops.rasterization`` on the concatenation of every rank's
    gaussians (rank order) and cameras, with the loss the sum of every rank's loss: renders are its
    renders of this rank's cameras, and backward gives each rank the gradients of its shard, its viewmats
    (and Ks) and its backgrounds. A world of one is ``ops.rasterization`` itself (bit for bit).
    ``packed``/``sparse_grad`` are refused in a world of more than one.

    Returns render_colors [C_r,H_r,W_r,D'], render_alphas [C_r,H_r,W_r,1] and meta, for the LOCAL shard:
    "means2d" [C_total, N_r, 2] (its .grad after backward -- and with absgrad its ``.absgrad`` -- are the
    single process's rows of this shard), "radii" [C_total, N_r], "depths", "conics", "opacities"
    [C_total, N_r, ...]; "width"/"height" (this rank's), "n_cameras" C_r (THIS rank's camera count, not
    C_total: DefaultStrategy multiplies means2d gradients by it because a process's loss is the mean over its
    own C cameras; here every rank's loss is the mean over its own C_r and the ranks' gradients are summed,
    so each row is scaled by 1/C_r of the rank that rendered it, never by 1/C_total), "n_cameras_total"
    C_total, "camera_offset" (index of this
    rank's first camera in the concatenation), "world_size", "backend", "depth_chunks" (of this rank's
    render) and "all_to_all_bytes": bytes of projected gaussians this rank sent to and received from OTHER
    ranks in this call's forward (its own pairs are a local copy; the camera and size gathers, a few
    hundred bytes, are not counted). Backward moves the gradients of the same pairs back: (7 + D [+2 with
    absgrad]) floats a pair against 8 + D forward, so a training step moves a little under twice it.

    backend "gsplat" (CUDA, NCCL) passes the call to gsplat's ``rasterization(distributed=True)`` where
    that gives these semantics (same camera count and image size on every rank, no absgrad, the default
    group; meta["n_cameras"] is then C_r as above), and otherwise runs this module's implementation with
    the reference stages on CUDA, warning once why. ``absgrad_in_run`` (None: ``absgrad``) is whether the run
    asks for absgrad at any step: that choice of path follows it, so a run whose strategy reads absgrad until
    its refine stop and computes none after it (model.py strategy_reads_stats) keeps one path, and the same
    numbers, throughout."""
    call = RasterizeCall(*args, **kwargs)
    initialised = dist.is_available() and dist.is_initialized()
    if not initialised and group is not None:
        raise RuntimeError("[distributed_rasterization] a group was given but torch.distributed is not initialised")
    world = dist.get_world_size(group) if initialised else 1
    if world == 1:
        render_colors, render_alphas, meta = rasterization(**call.arguments())
        meta.update(camera_offset=0, all_to_all_bytes=0, world_size=1)
        return render_colors, render_alphas, meta
    rank = dist.get_rank(group)
    name, table = _agree(call, group, world)  # 1.
    n_per_rank, cams_per_rank, sizes = [t[1] for t in table], [t[2] for t in table], [(t[3], t[4]) for t in table]
    offsets = [sum(cams_per_rank[:r]) for r in range(world)]
    if name == "gsplat":
        path_absgrad = call.absgrad if absgrad_in_run is None else bool(absgrad_in_run) or call.absgrad
        misfit = gsplat_distributed_misfit(cams_per_rank, sizes, path_absgrad, group in (None, dist.group.WORLD),
                                           call.packed)  # fmt: skip
        if misfit is None:
            return _gsplat_distributed(call, n_per_rank, cams_per_rank, rank)
        global _warned_gsplat_fallback
        if not _warned_gsplat_fallback:
            _warned_gsplat_fallback = True
            warnings.warn(f"splat-metal: gsplat's distributed mode cannot render this call ({misfit}); using "
                          "splat-metal's distributed rasterization with the reference stages on CUDA (slower)",
                          RuntimeWarning, stacklevel=2)  # fmt: skip
        name = "reference"
    ops = backend_module(name)
    viewmats_all, Ks_all = _gather_cameras(call, cams_per_rank, rank, group)  # 2.
    projected, send, visible, n_grad = _project_shard(ops, call, viewmats_all, Ks_all, offsets, cams_per_rank, sizes)
    plan, recv, moved = _exchange(call, send, visible, n_grad, projected[1], offsets, cams_per_rank, rank, group)

    # 5. Rasterize this rank's cameras from the received pairs, laid out [C_r, M, F] in concatenation order.
    C, M = cams_per_rank[rank], plan.M
    dense = recv.new_zeros(C * M, recv.shape[1]).index_copy(0, plan.recv_index, recv).view(C, M, recv.shape[1])
    render_colors, render_alphas, recv_means2d, chunks = _rasterize_received(ops, dense, call)
    if call.absgrad:
        plan.recv_absgrad = recv_means2d.absgrad  # [C_r, M, 2]
    tile_width, tile_height = math.ceil(call.width / call.tile_size), math.ceil(call.height / call.tile_size)
    meta = render_meta(name, projected, (None,) * 4, call.width, call.height, call.tile_size, tile_width,
                       tile_height, chunks)  # fmt: skip
    meta.update(n_cameras=C, n_cameras_total=sum(cams_per_rank), camera_offset=offsets[rank], all_to_all_bytes=moved,
                world_size=world)  # n_cameras: this rank's C_r, not C_total (the docstring)  # fmt: skip
    return render_colors, render_alphas, meta


def _agree(call: RasterizeCall, group, world: int) -> Tuple[str, List[List[int]]]:
    """1. Local checks, then one gather of every rank's sizes and options: errors are raised on every rank.
    Returns the backend and, per rank, [ok, N_r, C_r, width, height, options...]."""
    c = call
    error, name = None, "reference"
    try:
        check_inputs(call)
        if c.viewmats.shape[0] < 1:
            raise ValueError("[distributed_rasterization] every rank must render at least one camera, got C=0")
        if c.means.dtype not in _DTYPES:
            raise ValueError(f"[distributed_rasterization] means must be floating point, got {c.means.dtype}")
        name = resolve_backend(c.backend, c.means.device)
    except (ValueError, BackendUnavailable) as e:
        error = e
    options = {  # must be alike on every rank (max_intersections need not: it only bounds this rank's render)
        "backend": BACKENDS.index(name),
        "render_mode": RENDER_MODES.index(c.render_mode) if c.render_mode in RENDER_MODES else -1,
        "sh_degree": -1 if c.sh_degree is None else int(c.sh_degree),
        "colors.shape[1]": c.colors.shape[1] if c.colors.dim() > 1 else -1,
        "colors.shape[2]": c.colors.shape[2] if c.colors.dim() > 2 else -1,
        "rasterize_mode": RASTERIZE_MODES.index(c.rasterize_mode) if c.rasterize_mode in RASTERIZE_MODES else -1,
        "absgrad": bool(c.absgrad),
        "tile_size": int(c.tile_size) if isinstance(c.tile_size, int) else -1,
        "backgrounds (given or None)": c.backgrounds is not None,
        "grad mode (torch.is_grad_enabled())": torch.is_grad_enabled(),
        "dtype": _DTYPES.index(c.means.dtype) if c.means.dtype in _DTYPES else -1,
        "near_plane": _float_bits(c.near_plane),
        "far_plane": _float_bits(c.far_plane),
        "radius_clip": _float_bits(c.radius_clip),
        "eps2d": _float_bits(c.eps2d),
        "packed": bool(c.packed),
        "sparse_grad": bool(c.sparse_grad),
    }
    local = [error is None, c.means.shape[0], c.viewmats.shape[0], int(c.width), int(c.height)]
    table = _gather_ints(local + [int(v) for v in options.values()], group, c.means.device)  # [world][5 + options]
    bad = [r for r in range(world) if not table[r][0]]
    if error is not None:
        raise error
    if bad:
        raise ValueError(f"[distributed_rasterization] rank(s) {bad} rejected their inputs (their error says why)")
    for i, label in enumerate(options):
        values = [table[r][5 + i] for r in range(world)]
        if len(set(values)) > 1:
            shown = [_decode(label, v) for v in values]
            raise ValueError(f"[distributed_rasterization] every rank must pass the same {label}; per rank: {shown}")
    if c.packed or c.sparse_grad:
        raise ValueError("[distributed_rasterization] packed/sparse_grad are not supported with more than one rank")
    return name, table


def _gather_cameras(call: RasterizeCall, cams_per_rank: List[int], rank: int, group) -> Tuple[Tensor, Tensor]:
    """2. Every rank's cameras, differentiable: viewmats [C_total, 4, 4], Ks [C_total, 3, 3]. With gradients on,
    the gather is always part of the graph (a local stand-in if this rank's cameras need no gradient), so every
    rank runs its backward all_reduce."""
    viewmats, Ks, C_total = call.viewmats, call.Ks, sum(cams_per_rank)
    cams = torch.cat([viewmats.reshape(-1, 16), Ks.reshape(-1, 9).to(viewmats.dtype)], dim=1)  # [C_r, 25]
    if torch.is_grad_enabled() and not cams.requires_grad:
        cams = cams.detach().requires_grad_(True)
    cams_all = _GatherCameras.apply(cams, cams_per_rank, rank, group)  # [C_total, 25]
    return cams_all[:, :16].reshape(C_total, 4, 4), cams_all[:, 16:].reshape(C_total, 3, 3).to(Ks.dtype)


def _project_shard(ops, call: RasterizeCall, viewmats_all, Ks_all, offsets, cams_per_rank, sizes):
    """3. The local shard projected for every camera, at its owner's image size; opacities and colours. Returns
    (radii, means2d, depths, conics, opacities, None) [C_total, N_r, ...], the rows to send [S, F] (the visible
    pairs by camera, so by destination, then gaussian), visible [C_total, N_r] and the differentiable columns."""
    c, C_total = call, sum(cams_per_rank)
    N = c.means.shape[0]
    projected = [
        ops.project(c.means, c.quats, c.scales, viewmats_all[o : o + n], Ks_all[o : o + n], w, h, c.eps2d,
                    c.near_plane, c.far_plane, c.radius_clip, c.rasterize_mode == "antialiased")
        for o, n, (w, h) in zip(offsets, cams_per_rank, sizes)
    ]  # fmt: skip
    radii, means2d, depths, conics = (torch.cat([p[i] for p in projected]) for i in range(4))  # [C_total, N, ...]
    opacities_all = c.opacities.expand(C_total, N)  # [C_total, N]
    if projected[0][4] is not None:
        opacities_all = opacities_all * torch.cat([p[4] for p in projected])
    visible = radii > 0  # [C_total, N]
    columns = [means2d, conics]
    if c.render_mode in ("RGB", "RGB+D", "RGB+ED"):
        if c.sh_degree is None:
            columns.append(c.colors.expand(C_total, -1, -1))  # [C_total, N, D]
        else:
            campos = torch.linalg.inv(viewmats_all)[:, :3, 3]  # [C_total, 3]
            dirs = c.means[None, :, :] - campos[:, None, :]  # [C_total, N, 3]
            sh = ops.spherical_harmonics(c.sh_degree, dirs, c.colors.expand(C_total, -1, -1, -1), visible)
            columns.append(torch.clamp_min(sh + 0.5, 0.0))  # [C_total, N, 3]
    columns += [opacities_all[..., None], depths[..., None]]
    n_grad = sum(col.shape[-1] for col in columns)  # the differentiable columns; the radius follows
    columns.append(radii.detach().to(c.means.dtype)[..., None])  # an integer, exact in float below 2^24
    send = torch.cat(columns, dim=-1)[visible]  # [S, F]
    return (radii, means2d, depths, conics, opacities_all, None), send, visible, n_grad


def _exchange(call: RasterizeCall, send, visible, n_grad, means2d, offsets, cams_per_rank, rank, group):
    """4. Visible pairs per (rank, camera), then the all-to-all. Returns the plan (its M: the pairs of this rank's
    busiest camera), the received rows [R, F] and the bytes moved to and from other ranks."""
    world, device = len(cams_per_rank), call.means.device
    counts = _gather_ints(visible.sum(dim=1).tolist(), group, device)  # [world][C_total]
    mine = slice(offsets[rank], offsets[rank] + cams_per_rank[rank])
    send_splits = [sum(counts[rank][o : o + c]) for o, c in zip(offsets, cams_per_rank)]
    recv_splits = [sum(counts[s][mine]) for s in range(world)]
    per_camera = torch.tensor([counts[s][mine] for s in range(world)], device=device)  # [world, C_r]
    M = int(per_camera.sum(dim=0).max())  # pairs of this rank's busiest camera
    plan = SimpleNamespace(group=group, send_splits=send_splits, recv_splits=recv_splits, n_grad=n_grad, M=M,
                           recv_index=_receive_index(per_camera, M), recv_absgrad=None, send_absgrad=None,
                           send_visible=visible)  # fmt: skip
    if call.absgrad:
        means2d.absgrad = plan.send_absgrad = torch.zeros_like(means2d)  # [C_total, N, 2], filled in backward
    recv = _ExchangeProjected.apply(send, plan)  # [R, F]
    row_bytes = send.shape[1] * send.element_size()
    moved = sum(send_splits[r] + recv_splits[r] for r in range(world) if r != rank) * row_bytes
    return plan, recv, moved


def _receive_index(per_camera: Tensor, M: int) -> Tensor:
    """Row of each received pair in the receiver's [C_r * M] layout. Pairs arrive by sender, then camera,
    then gaussian; in the layout each camera lists its pairs by sender, then gaussian: the order of the
    concatenation of all shards, so depth ties sort as in one process."""
    world, C = per_camera.shape
    blocks = per_camera.flatten()  # [world * C] pairs per (sender, camera), sender-major
    block_of_row = torch.repeat_interleave(torch.arange(world * C, device=blocks.device), blocks)  # [R]
    block_start = torch.cumsum(blocks, 0) - blocks
    earlier_senders = (torch.cumsum(per_camera, 0) - per_camera).flatten()  # pairs of this camera before
    slot = earlier_senders[block_of_row] + torch.arange(block_of_row.numel(), device=blocks.device)
    slot = slot - block_start[block_of_row]
    return (block_of_row % C) * M + slot


def _rasterize_received(ops, dense, call: RasterizeCall):
    """The rasterization half of ops.rasterization on received pairs ``dense`` [C, M, F] (means2d 2, conics 3,
    colours D or none, opacity, depth, radius; padding rows have radius 0). Returns render_colors,
    render_alphas, the means2d tensor rasterized (its .absgrad is the absgrad buffer) and the chunk count."""
    means2d, conics = dense[..., 0:2].contiguous(), dense[..., 2:5].contiguous()  # [C, M, 2], [C, M, 3]
    colors = dense[..., 5:-3]  # [C, M, D]
    opacities, depths = dense[..., -3].contiguous(), dense[..., -2].contiguous()  # [C, M]
    radii = dense[..., -1].detach().round().int()  # [C, M]
    projected = (radii, means2d, depths, conics, opacities, colors)
    c = call
    render_colors, render_alphas, meta = rasterize_projected(ops, "received", projected, c.width, c.height,
                                                             c.tile_size, c.backgrounds, c.render_mode, c.absgrad,
                                                             c.max_intersections)  # fmt: skip
    return render_colors, render_alphas, means2d, meta["depth_chunks"]


def _gsplat_distributed(call: RasterizeCall, n_per_rank, cams_per_rank, rank):
    """gsplat 1.4's own distributed mode (CUDA, NCCL), with meta completed to this module's contract."""
    from gsplat.rendering import rasterization as gsplat_rasterization

    # As ops.rasterization: the call as given (gsplat's semantics, a zero quaternion included).
    args, kwargs = call.gsplat_arguments()
    del kwargs["packed"], kwargs["sparse_grad"], kwargs["absgrad"]  # gsplat's defaults (the misfit test)
    render_colors, render_alphas, meta = gsplat_rasterization(*args, distributed=True, **kwargs)
    # gsplat sends every (camera, gaussian) pair: means2d 2, depth 1, conics 3, opacity 1, colours D, radius.
    means = call.means
    D = 3 if call.sh_degree is not None else call.colors.shape[-1]
    row_bytes = (7 + D) * means.element_size() + 4
    others = [r for r in range(len(n_per_rank)) if r != rank]
    moved = sum(cams_per_rank[r] * means.shape[0] + cams_per_rank[rank] * n_per_rank[r] for r in others) * row_bytes
    meta.update(n_cameras=cams_per_rank[rank], n_cameras_total=sum(cams_per_rank),
                camera_offset=sum(cams_per_rank[:rank]), all_to_all_bytes=moved,
                backend="gsplat", world_size=len(n_per_rank), depth_chunks=1)  # fmt: skip
    return render_colors, render_alphas, meta


distributed_rasterization.__signature__ = call_signature(
    tuple(inspect.signature(distributed_rasterization).parameters.values())[1:-1]  # group, absgrad_in_run
)
