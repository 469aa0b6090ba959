"""ops.distributed_rasterization on real torch.distributed process groups (gloo, CPU) of 2 and 3 processes,
against one process calling ops.rasterization on the concatenation of every shard and camera.

Each worker builds the same seeded scene, takes its shard and its cameras, renders distributed and
also renders the whole scene in one process (its own copy); the loss is a fixed random weighting of
every render, summed over the ranks. Compared: renders, alphas, radii and the gradients of the shard
(means, quats, scales, opacities, colours/SH), of the rank's viewmats, Ks and backgrounds, the
shard's rows of meta["means2d"].grad and .absgrad, and what gsplat's DefaultStrategy accumulates from
meta for densification (grad2d, count, radii). Many configurations run in one spawn (a spawn costs
seconds of imports per process); the configuration is named in any failure.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gsplat.strategy import DefaultStrategy
from scenes import look_at, random_scene

from splat_metal_method.engine.distributed import settle_collectives
from splat_metal_method.ops import distributed_rasterization, rasterization
from splat_metal_method.ops.cpu import available as cpu_available
from splat_metal_method.ops.distributed import gsplat_distributed_misfit

TOL = 2e-4  # float32: relative to the largest magnitude of the quantity compared
TIMEOUT = datetime.timedelta(seconds=60)  # a collective that waits longer fails the test instead of hanging


@dataclass(frozen=True)
class Config:
    name: str
    backend: str
    shards: Tuple[int, ...]  # gaussians per rank (0: an empty shard)
    cameras: Tuple[int, ...]  # cameras per rank
    sizes: Tuple[Tuple[int, int], ...] = ()  # (width, height) per rank; () = 37x23 everywhere
    sh_degree: Optional[int] = None
    render_mode: str = "RGB"
    absgrad: bool = True
    rasterize_mode: str = "classic"
    backgrounds: bool = True
    max_intersections: Optional[int] = None  # the single process's and rank 0's (its render must exceed it)
    blind_rank: Optional[int] = None  # this rank's first camera looks away from every gaussian
    seed: int = 0


TWO_RANKS = [
    Config("reference-rgb", "reference", shards=(70, 41), cameras=(2, 2)),  # C_r = 2: DefaultStrategy's scaling
    Config("cpu-sh3-ed-aa", "cpu", shards=(0, 90), cameras=(2, 1), sh_degree=3, render_mode="RGB+ED",
           rasterize_mode="antialiased", seed=1),
    Config("cpu-sizes-noabs", "cpu", shards=(50, 60), cameras=(1, 1), sizes=((37, 23), (23, 41)), absgrad=False,
           backgrounds=False, seed=2),
    Config("cpu-sh1-chunks", "cpu", shards=(40, 45), cameras=(2, 1), sh_degree=1, max_intersections=100, seed=3),
    Config("metal-emulator", "metal", shards=(30, 25), cameras=(1, 1), sh_degree=1, seed=4),
]  # fmt: skip
THREE_RANKS = [
    Config("cpu-sh3-ed-empty-blind", "cpu", shards=(60, 0, 45), cameras=(1, 2, 1), sizes=((37, 23),) * 3,
           sh_degree=3, render_mode="RGB+ED", blind_rank=2, seed=5),  # rank 2 receives nothing
    Config("reference-sh3-sizes-aa-empty", "reference", shards=(30, 0, 40), cameras=(2, 1, 1),
           sizes=((37, 23), (16, 16), (23, 41)), sh_degree=3, rasterize_mode="antialiased", seed=6),
    Config("cpu-noabs-sh0", "cpu", shards=(1, 70, 20), cameras=(1, 1, 3), sh_degree=0, absgrad=False, seed=7),
]  # fmt: skip


def _close(name, got, want):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item() if want.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    assert err <= TOL * scale + 1e-6, f"{name}: max error {err:.3g} against max magnitude {scale:.3g}"


def _scene(cfg: Config, world: int):
    """The whole scene (every shard's gaussians, every rank's cameras and weights) as float32 tensors."""
    sizes = cfg.sizes or ((37, 23),) * world
    gaussians = random_scene(n=sum(cfg.shards), C=1, seed=cfg.seed, sh_degree=cfg.sh_degree, extent=2.5)
    ranks = []
    for r in range(world):
        w, h = sizes[r]
        cams = random_scene(n=1, C=cfg.cameras[r], width=w, height=h, seed=100 * cfg.seed + r + 1, backgrounds=True)
        viewmats = cams.viewmats.clone()
        if cfg.blind_rank == r:  # at 4 units from the origin, looking outwards: every gaussian is behind it
            campos = torch.linalg.inv(viewmats[0].double())[:3, 3]
            viewmats[0] = look_at(campos, 2 * campos).float()
        g = torch.Generator().manual_seed(1000 + 10 * cfg.seed + r)
        channels = 3 + (cfg.render_mode == "RGB+ED")
        ranks.append(dict(viewmats=viewmats, Ks=cams.Ks, backgrounds=cams.backgrounds if cfg.backgrounds else None,
                          width=w, height=h, weights=torch.randn(cfg.cameras[r], h, w, channels, generator=g),
                          alpha_weights=torch.randn(cfg.cameras[r], h, w, 1, generator=g)))  # fmt: skip
    return gaussians, ranks


def _leaves(tensors):
    return {k: (None if v is None else v.detach().clone().requires_grad_(True)) for k, v in tensors.items()}


def _loss(colors, alphas, rank_data):
    return (colors * rank_data["weights"]).sum() + (alphas * rank_data["alpha_weights"]).sum()


def _single_process(cfg: Config, gaussians, ranks, options):
    """One process, every gaussian, every camera: one call when every rank's size agrees, else one per size."""
    params = _leaves({k: getattr(gaussians, k) for k in ("means", "quats", "scales", "opacities", "colors")})
    cams = [_leaves({k: d[k] for k in ("viewmats", "Ks", "backgrounds")}) for d in ranks]
    same_size = len({(d["width"], d["height"]) for d in ranks}) == 1
    groups = [list(range(len(ranks)))] if same_size else [[r] for r in range(len(ranks))]
    renders, metas, loss = {}, [], 0.0
    for group in groups:
        cat = {k: None if cams[group[0]][k] is None else torch.cat([cams[r][k] for r in group]) for k in cams[0]}
        colors, alphas, meta = rasterization(**params, **cat, width=ranks[group[0]]["width"],
                                             height=ranks[group[0]]["height"], **options)  # fmt: skip
        meta["means2d"].retain_grad()
        metas.append(meta)
        start = 0
        for r in group:
            c = cfg.cameras[r]
            renders[r] = (colors[start : start + c], alphas[start : start + c])
            loss = loss + _loss(*renders[r], ranks[r])
            start += c
    loss.backward()
    means2d_grad = torch.cat([m["means2d"].grad for m in metas])  # [C_total, N, 2]
    absgrad = torch.cat([m["means2d"].absgrad for m in metas]) if cfg.absgrad else None
    radii = torch.cat([m["radii"] for m in metas])
    return params, cams, renders, means2d_grad, absgrad, radii, metas


def _check_config(cfg: Config, rank: int, world: int, device: str = "cpu"):
    gaussians, ranks = _scene(cfg, world)
    gaussians = gaussians.to(device)
    ranks = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d.items()} for d in ranks]
    options = dict(sh_degree=cfg.sh_degree, render_mode=cfg.render_mode, absgrad=cfg.absgrad, backend=cfg.backend,
                   rasterize_mode=cfg.rasterize_mode, max_intersections=cfg.max_intersections)  # fmt: skip
    ref_params, ref_cams, ref_renders, ref_m2d_grad, ref_absgrad, ref_radii, ref_metas = _single_process(
        cfg, gaussians, ranks, options
    )

    lo, hi = sum(cfg.shards[:rank]), sum(cfg.shards[: rank + 1])
    offset, C = sum(cfg.cameras[:rank]), cfg.cameras[rank]
    mine = ranks[rank]
    params = _leaves({k: getattr(gaussians, k)[lo:hi] for k in ("means", "quats", "scales", "opacities", "colors")})
    cams = _leaves({k: mine[k] for k in ("viewmats", "Ks", "backgrounds")})
    # max_intersections only bounds this rank's own render: the ranks may differ (rank 0 alone chunks here).
    options["max_intersections"] = cfg.max_intersections if rank == 0 else None
    colors, alphas, meta = distributed_rasterization(**params, **cams, width=mine["width"], height=mine["height"],
                                                     **options)  # fmt: skip
    meta["means2d"].retain_grad()  # as DefaultStrategy does
    _loss(colors, alphas, mine).backward()

    where = f"[{cfg.name}, rank {rank}/{world}]"
    assert (meta["n_cameras"], meta["n_cameras_total"]) == (C, sum(cfg.cameras)), where
    assert (meta["camera_offset"], meta["world_size"]) == (offset, world), where
    assert (meta["width"], meta["height"]) == (mine["width"], mine["height"]), where
    assert torch.equal(meta["radii"], ref_radii[:, lo:hi]), f"{where} radii"
    _close(f"{where} render_colors", colors, ref_renders[rank][0])
    _close(f"{where} render_alphas", alphas, ref_renders[rank][1])
    for k, v in params.items():
        _close(f"{where} d/d {k}", v.grad, ref_params[k].grad[lo:hi])
    for k, v in cams.items():
        if v is not None:
            _close(f"{where} d/d {k}", v.grad, ref_cams[rank][k].grad)
    _close(f"{where} means2d.grad", meta["means2d"].grad, ref_m2d_grad[:, lo:hi])
    if cfg.absgrad:
        _close(f"{where} means2d.absgrad", meta["means2d"].absgrad, ref_absgrad[:, lo:hi])
    # One size and one camera count everywhere (the trainer's case: one camera per rank): DefaultStrategy's
    # densification statistics of this shard. With other counts per rank no one n_cameras scales every row.
    if len(ref_metas) == 1 and len(set(cfg.cameras)) == 1:
        # Each rank's loss is the mean over its own C_r cameras and the ranks' gradients add up, so DefaultStrategy
        # must see the rows as a single process with a batch of C_r cameras would: the single process's rows
        # (batch C_total) scaled by C_r / C_total.
        factor = cfg.cameras[0] / sum(cfg.cameras)
        expected = dict(ref_metas[0], means2d=torch.zeros_like(ref_m2d_grad))
        expected["means2d"].grad = ref_m2d_grad * factor
        if cfg.absgrad:
            expected["means2d"].absgrad = ref_absgrad * factor
        states = []
        for info, n in ((expected, sum(cfg.shards)), (meta, hi - lo)):
            strategy = DefaultStrategy(absgrad=cfg.absgrad, refine_scale2d_stop_iter=1)
            state = strategy.initialize_state()
            # step 1: statistics only (no refinement, no opacity reset); only len(params["means"]) is read
            strategy.step_post_backward({"means": torch.empty(n, 3)}, {}, state, 1, info)
            states.append(state)
        for key in ("grad2d", "count", "radii"):
            _close(f"{where} DefaultStrategy {key}", states[1][key], states[0][key][lo:hi])
    if cfg.max_intersections and rank == 0:
        assert meta["depth_chunks"] > 1, f"{where}: max_intersections={cfg.max_intersections} made no depth chunks"

    # What crossed ranks: the visible (camera, gaussian) pairs between this shard and the others' cameras, and
    # between the others' shards and this rank's cameras, 8 + D float32 each.
    visible = ref_radii.cpu() > 0  # [C_total, N]
    own_cams = torch.zeros(visible.shape[0], dtype=torch.bool)
    own_cams[offset : offset + C] = True
    own_rows = torch.zeros(visible.shape[1], dtype=torch.bool)
    own_rows[lo:hi] = True
    pairs = (visible & (own_cams[:, None] != own_rows[None])).sum()  # this rank's cameras xor its shard
    D = 0 if cfg.render_mode in ("D", "ED") else 3
    if meta["backend"] != "gsplat":  # gsplat's own mode sends every pair (its own count)
        assert meta["all_to_all_bytes"] == int(pairs) * (8 + D) * 4, where

    # The test must see gaussians that only another rank's camera sees (their gradients cross ranks),
    # and, with a blind camera, a rank whose camera receives nothing.
    owner = torch.repeat_interleave(torch.arange(world), torch.tensor(cfg.shards))  # [N] rank of each gaussian
    cam_owner = torch.repeat_interleave(torch.arange(world), torch.tensor(cfg.cameras))  # [C_total]
    seen_by_owner = (visible & (cam_owner[:, None] == owner[None])).any(0)
    foreign_only = visible.any(0) & ~seen_by_owner
    assert bool(foreign_only.any()), f"{cfg.name}: no gaussian seen only by another rank's camera; change the scene"
    if cfg.blind_rank is not None:
        assert not visible[sum(cfg.cameras[: cfg.blind_rank])].any(), f"{cfg.name}: the blind camera sees gaussians"


def _check_errors(rank: int, world: int):
    """Mismatched options or one rank's bad input: a clear error on every rank, no hang."""
    scene = random_scene(n=8, C=1, seed=0)
    kwargs = scene.kwargs(backend="reference")
    with pytest.raises(ValueError, match=r"same render_mode; per rank: \['RGB', 'RGB\+ED'\]"):
        distributed_rasterization(**{**kwargs, "render_mode": ["RGB", "RGB+ED"][rank]})
    with pytest.raises(ValueError, match="same near_plane"):
        distributed_rasterization(**{**kwargs, "near_plane": 0.01 * (rank + 1)})
    bad = {**kwargs, "opacities": scene.opacities[:-1]} if rank == 1 else kwargs
    match = r"opacities must be \[8\]" if rank == 1 else r"rank\(s\) \[1\] rejected their inputs"
    with pytest.raises(ValueError, match=match):
        distributed_rasterization(**bad)
    with torch.set_grad_enabled(rank == 0), pytest.raises(ValueError, match="same grad mode"):
        distributed_rasterization(**kwargs)  # backward would run collectives on one rank only
    colors, _, _ = distributed_rasterization(**kwargs)  # the group still works after the errors
    assert colors.shape == (1, scene.height, scene.width, 3)
    with torch.no_grad():  # rendering without autograd (evaluation on every rank)
        assert torch.equal(distributed_rasterization(**kwargs)[0], colors)


def _worker(rank: int, world: int, init_file: str, configs, check_errors: bool):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        for cfg in configs:
            _check_config(cfg, rank, world)
        if check_errors:
            _check_errors(rank, world)
    finally:
        settle_collectives()  # as at the exit of a run: no abort in gloo's teardown (see its docstring)
        dist.destroy_process_group()


def _spawn(world, configs, tmp_path, check_errors=False):
    if any(cfg.backend == "cpu" for cfg in configs) and not cpu_available():  # builds it once, before the spawn
        pytest.skip("no C++ compiler here to build the native CPU backend")
    for cfg in configs:
        if cfg.backend == "metal":  # compile the emulated kernels once here, not in every worker at once
            scene = random_scene(n=4, sh_degree=cfg.sh_degree, backgrounds=True)
            leaves = _leaves(scene.tensors())
            colors, _, _ = rasterization(**scene.kwargs(**leaves, backend="metal", absgrad=cfg.absgrad))
            colors.sum().backward()
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), configs, check_errors), nprocs=world)


def test_two_ranks_match_one_process(tmp_path):
    _spawn(2, TWO_RANKS, tmp_path, check_errors=True)


def test_three_ranks_match_one_process(tmp_path):
    _spawn(3, THREE_RANKS, tmp_path)


def test_world_of_one_is_rasterization(tmp_path):
    """A one-process group (and no group at all) is ops.rasterization, bit for bit, forward and backward."""
    scene = random_scene(n=40, C=2, seed=3, sh_degree=2, backgrounds=True)
    results = []
    for run in ("rasterization", "no group", "group of one"):
        leaves = _leaves(scene.tensors())
        kwargs = scene.kwargs(**leaves, absgrad=True, render_mode="RGB+ED", backend="reference")
        if run == "group of one":
            dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                                    timeout=TIMEOUT)  # fmt: skip
        try:
            colors, alphas, meta = (rasterization if run == "rasterization" else distributed_rasterization)(**kwargs)
            meta["means2d"].retain_grad()
            (colors.square().sum() + alphas.sum()).backward()
        finally:
            if run == "group of one":
                dist.destroy_process_group()
        if run != "rasterization":
            assert (meta["world_size"], meta["camera_offset"], meta["all_to_all_bytes"]) == (1, 0, 0)
        results.append([colors, alphas, meta["means2d"].grad, meta["means2d"].absgrad]
                       + [v.grad for v in leaves.values()])  # fmt: skip
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_gsplat_distributed_misfits():
    """When the call goes to gsplat's own distributed mode (CUDA) and when it cannot."""
    assert gsplat_distributed_misfit([2, 2], [(64, 48)] * 2, absgrad=False, default_group=True, packed=False) is None
    assert "absgrad" in gsplat_distributed_misfit([1, 1], [(64, 48)] * 2, True, True, False)
    assert "camera count" in gsplat_distributed_misfit([1, 2], [(64, 48)] * 2, False, True, False)
    assert "size" in gsplat_distributed_misfit([1, 1], [(64, 48), (48, 64)], False, True, False)
    assert "default process group" in gsplat_distributed_misfit([1, 1], [(64, 48)] * 2, False, False, False)


def _cuda_worker(rank: int, world: int, init_file: str):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        # gsplat's own distributed mode (fits), then the fallback (absgrad, uneven cameras) on CUDA.
        for cfg in (Config("gsplat", "gsplat", shards=(50, 40), cameras=(1, 1), absgrad=False, sh_degree=3),
                    Config("gsplat-fallback", "gsplat", shards=(50, 40), cameras=(2, 1), sh_degree=3)):  # fmt: skip
            _check_config(cfg, rank, world, device=f"cuda:{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="gsplat's distributed mode needs NCCL on 2+ CUDA GPUs")
def test_gsplat_two_gpus(tmp_path):
    mp.spawn(_cuda_worker, args=(2, str(tmp_path / "init")), nprocs=2)
