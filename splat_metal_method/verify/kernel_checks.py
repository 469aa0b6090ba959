"""Kernel checks: each stage of the splatting op (projection, covariance, spherical harmonics, tile
intersection, rasterization, forward and backward) run by a fast backend against the pure-PyTorch
reference on the same device and a random non-square scene, as `Check` rows.

Used by the training-time self-check (self_check.py) and by `splat-metal-doctor` (doctor.py), which
prints them; neither imports the other for these.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch

# Forward outputs must agree to this (float32, a few hundred gaussians per pixel at most) ...
FWD_ATOL = 1e-4
# ... and gradients to this relative error (atomics reorder float sums on a GPU).
BWD_RTOL = 1e-3


@dataclass
class Check:
    stage: str
    direction: str
    max_abs: float
    rel: float
    ms: float
    ok: bool
    error: str = ""  # the exception a stage raised instead of returning (then ok is False)

    def describe(self) -> str:
        """One line naming the stage and what went wrong (or its errors)."""
        if self.error:
            return f"{self.stage} {self.direction}: raised {self.error}"
        what = (
            f"max abs error {self.max_abs:.2e} (tolerance {FWD_ATOL:.0e})"
            if self.direction == "forward"
            else f"relative error {self.rel:.2e} (tolerance {BWD_RTOL:.0e})"
        )
        return f"{self.stage} {self.direction}: {what}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max()) if a.numel() else 0.0


def random_scene(
    device: torch.device, n: int = 300, width: int = 61, height: int = 37, cameras: int = 2, seed: int = 0
):
    """A seeded scene of n gaussians in front of `cameras` cameras; width != height on purpose."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(n, 3, generator=g) * 0.6
    quats = torch.randn(n, 4, generator=g)
    scales = torch.rand(n, 3, generator=g) * 0.08 + 0.01
    opacities = torch.rand(n, generator=g) * 0.8 + 0.1
    coeffs = torch.randn(n, 25, 3, generator=g) * 0.3  # SH up to degree 4 (constants.SH_MAX_DEGREE)
    viewmats = torch.eye(4).repeat(cameras, 1, 1)
    viewmats[:, 2, 3] = 3.0
    viewmats[:, 0, 3] = torch.linspace(-0.3, 0.3, cameras)
    f = 0.9 * width
    Ks = torch.tensor([[f, 0, width / 2], [0, f * 1.02, height / 2 + 0.7], [0, 0, 1]]).repeat(cameras, 1, 1)
    scene = dict(means=means, quats=quats, scales=scales, opacities=opacities, coeffs=coeffs, viewmats=viewmats, Ks=Ks)
    return {k: v.to(device) for k, v in scene.items()}, width, height


def _timed(fn: Callable, device: torch.device):
    def sync():
        if device.type == "mps":
            torch.mps.synchronize()
        elif device.type == "cuda":
            torch.cuda.synchronize()

    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - start) * 1000


def _compare_stage(name: str, run: Callable, inputs: Dict[str, torch.Tensor], fast, ref, device) -> List[Check]:
    """Runs `run(backend_module, **leaves)` for both backends, compares outputs, then the gradients of
    a fixed random projection of the outputs w.r.t. every floating input (and the `absgrad` a
    backend attaches to an input, as rasterize_to_pixels does to means2d). A stage that raises gives
    one failed Check carrying the exception."""
    try:
        return _compare(name, run, inputs, fast, ref, device)
    except Exception as e:  # a compile error, a launch refused by the GPU, ...: report it, keep checking
        return [Check(name, "forward+backward", float("inf"), float("inf"), 0.0, False, f"{type(e).__name__}: {e}")]


def _compare(name: str, run: Callable, inputs: Dict[str, torch.Tensor], fast, ref, device) -> List[Check]:
    checks = []
    results = {}
    for label, module in (("fast", fast), ("ref", ref)):
        leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
        outs, ms = _timed(lambda: run(module, **leaves), device)
        results[label] = (leaves, [o for o in outs if o is not None], ms)
    (leaves_f, outs_f, ms_f), (leaves_r, outs_r, _) = results["fast"], results["ref"]
    err = max((_max_abs(a, b) for a, b in zip(outs_f, outs_r)), default=0.0)
    rel = max((_rel(a, b) for a, b in zip(outs_f, outs_r) if a.is_floating_point()), default=0.0)
    checks.append(Check(name, "forward", err, rel, ms_f, err <= FWD_ATOL))

    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=g).to(device) for o in outs_r if o.is_floating_point()]
    grads = {}
    for label, leaves, outs in (("fast", leaves_f, outs_f), ("ref", leaves_r, outs_r)):
        floats = [o for o in outs if o.is_floating_point()]
        wanted = [v for v in leaves.values() if v.requires_grad]
        loss = sum((o * w).sum() for o, w in zip(floats, weights))
        (got, ms) = _timed(lambda: torch.autograd.grad(loss, wanted, allow_unused=True), device)
        grads[label] = ([torch.zeros_like(v) if x is None else x for v, x in zip(wanted, got)], ms)
    pairs = list(zip(grads["fast"][0], grads["ref"][0]))
    pairs += [(leaves_f[k].absgrad, leaves_r[k].absgrad) for k in leaves_r if hasattr(leaves_r[k], "absgrad")]
    err = max((_max_abs(a, b) for a, b in pairs), default=0.0)
    rel = max((_rel(a, b) for a, b in pairs), default=0.0)
    checks.append(Check(name, "backward", err, rel, grads["fast"][1], rel <= BWD_RTOL))
    return checks


def _padded_isect_check(fast, means2d, radii, depths, ts, tw, th, tiles_r, ids_r, flat_r, offsets) -> Check:
    """The training steps' padded lists (Metal): the second call of a tile grid reads nothing on the host
    and must hold the reference's entries first, its offsets, and the real count in the end slot; then a
    refine's row selection (select_rows) against torch.where."""
    name = f"isect + sort, padded (tile {ts})"
    try:
        from ..ops.metal import isect
        from ..ops.metal.scan import select_rows

        capacities = isect.IntersectionCapacities()
        fast.isect_tiles_padded(means2d, radii, depths, ts, tw, th, capacities)  # sizes the capacity (one read)
        got, ms = _timed(lambda: fast.isect_tiles_padded(means2d, radii, depths, ts, tw, th, capacities),
                         means2d.device)  # fmt: skip
        tiles_p, ids_p, flat_p, offsets_p = (t.cpu() for t in got)
        M = ids_r.numel()
        same = (
            torch.equal(tiles_p, tiles_r.cpu()) and torch.equal(ids_p[:M], ids_r.cpu())
            and torch.equal(flat_p[:M], flat_r.cpu()) and torch.equal(offsets_p[:-1], offsets.cpu().flatten())
            and int(offsets_p[-1]) == M
        )  # fmt: skip
        mask = tiles_r.flatten() > 0
        sel, rest = select_rows(mask.to(means2d.device), int(mask.sum()), with_rest=True)
        same = same and torch.equal(sel.cpu(), torch.where(mask)[0]) and torch.equal(rest.cpu(), torch.where(~mask)[0])
        return Check(name, "forward", 0.0 if same else float("inf"), 0.0, ms, same)
    except Exception as e:
        return Check(name, "forward", float("inf"), 0.0, 0.0, False, f"{type(e).__name__}: {e}")


def stage_checks(
    device: torch.device,
    fast,
    ref,
    width: int,
    height: int,
    *,
    tile_size: int = 16,
    channels: Sequence[int] = (4,),
    sh_degrees: Sequence[int] = (0, 1, 2, 3, 4),
    modes: Sequence[str] = ("classic", "antialiased"),
    absgrad: bool = False,
    backgrounds: bool = True,
    cameras: int = 2,
    n: int = 300,
) -> List[Check]:
    """Stages of the backend contract, forward and backward, `fast` vs `ref`, on one seeded scene: the
    projection in each rasterize mode, SH at each degree, intersection + sort at `tile_size`, and the
    rasterizer at `tile_size` for each channel count (with or without absgrad and backgrounds; without
    backgrounds and with 3+ channels also with splatfacto's background composite fused in).
    The doctor checks every option; the self-check (self_check.py) what one run will use. Draws no
    numbers from torch's global generator (training runs after this must not change)."""
    scene, W, H = random_scene(device, n=n, width=width, height=height, cameras=cameras)
    checks: List[Check] = []
    proj_in = {k: scene[k] for k in ("means", "quats", "scales", "viewmats", "Ks")}
    for mode in modes:
        checks += _compare_stage(
            f"project ({mode})",
            lambda m, **x: m.project(**x, width=W, height=H, calc_compensations=mode == "antialiased"),
            proj_in, fast, ref, device,
        )  # fmt: skip
    radii, means2d, depths, conics, _ = ref.project(**proj_in, width=W, height=H)
    C, N = radii.shape
    campos = torch.linalg.inv(scene["viewmats"])[:, :3, 3]
    dirs = scene["means"][None] - campos[:, None]
    for degree in sh_degrees:
        sh_in = {"dirs": dirs, "coeffs": scene["coeffs"].expand(C, -1, -1, -1).contiguous()}
        checks += _compare_stage(
            f"sh (degree {degree})", lambda m, **x: (m.spherical_harmonics(degree, **x, masks=radii > 0),),
            sh_in, fast, ref, device,
        )  # fmt: skip

    ts = tile_size
    tw, th = -(-W // ts), -(-H // ts)
    try:
        (tiles_f, ids_f, flat_f), ms = _timed(lambda: fast.isect_tiles(means2d, radii, depths, ts, tw, th), device)
        tiles_r, ids_r, flat_r = ref.isect_tiles(means2d, radii, depths, ts, tw, th)
        same = (
            torch.equal(tiles_f.cpu(), tiles_r.cpu()) and torch.equal(ids_f.cpu(), ids_r.cpu())
            and torch.equal(flat_f.cpu(), flat_r.cpu())
        )  # fmt: skip
        offsets = ref.isect_offset_encode(ids_r, C, tw, th)
        same = same and torch.equal(fast.isect_offset_encode(ids_f, C, tw, th).cpu(), offsets.cpu())
        checks.append(Check(f"isect + sort (tile {ts})", "forward", 0.0 if same else float("inf"), 0.0, ms, same))
    except Exception as e:
        checks.append(
            Check(f"isect + sort (tile {ts})", "forward", float("inf"), 0.0, 0.0, False, f"{type(e).__name__}: {e}")
        )
        tiles_r, ids_r, flat_r = ref.isect_tiles(means2d, radii, depths, ts, tw, th)
        offsets = ref.isect_offset_encode(ids_r, C, tw, th)
    if hasattr(fast, "isect_tiles_padded"):
        checks.append(_padded_isect_check(fast, means2d, radii, depths, ts, tw, th, tiles_r, ids_r, flat_r, offsets))

    g = torch.Generator().manual_seed(2)
    opac = scene["opacities"].expand(C, -1).contiguous()
    for D in channels:
        raster_in = {"means2d": means2d, "conics": conics, "colors": torch.rand(C, N, D, generator=g).to(device),
                     "opacities": opac}  # fmt: skip
        if backgrounds:
            raster_in["backgrounds"] = torch.rand(C, D, generator=g).to(device)
        label = f"rasterize (tile {ts}, {D} channel{'s' if D > 1 else ''}{', absgrad' if absgrad else ''})"
        checks += _compare_stage(
            label,
            lambda m, **x: m.rasterize_to_pixels(
                x["means2d"], x["conics"], x["colors"], x["opacities"], W, H, ts, offsets, flat_r,
                x.get("backgrounds"), absgrad,
            ),
            raster_in, fast, ref, device,
        )  # fmt: skip
        if D >= 3 and "backgrounds" not in raster_in:  # what a training step and a viewer render run
            checks += _compare_stage(
                f"rasterize (tile {ts}, {D} channels, fused composite{', absgrad' if absgrad else ''})",
                lambda m, **x: _rasterize_composite(m, x, W, H, ts, offsets, flat_r, absgrad), raster_in, fast, ref,
                device,
            )  # fmt: skip
    return checks


_COMPOSITE_BG = (0.25, 0.5, 1.0)  # a fixed background (drawn from no generator)


def _rasterize_composite(m, x, W, H, ts, offsets, flatten_ids, absgrad):
    """(render, alpha, rgb): the backend's rasterizer with splatfacto's background composite fused in where it
    has one (metal's rasterize_to_pixels_composite), else rasterize_to_pixels and ops/composite.py's expression
    (the reference; its unfused twin)."""
    from ..ops.composite import composite_background_reference

    bg = torch.tensor(_COMPOSITE_BG, device=x["colors"].device)
    fused = getattr(m, "rasterize_to_pixels_composite", None)
    if fused is not None:
        return fused(
            x["means2d"], x["conics"], x["colors"], x["opacities"], W, H, ts, offsets, flatten_ids, bg, absgrad
        )
    rc, ra = m.rasterize_to_pixels(x["means2d"], x["conics"], x["colors"], x["opacities"], W, H, ts, offsets,
                                   flatten_ids, None, absgrad)  # fmt: skip
    return rc, ra, composite_background_reference(rc, ra, bg)


def covariance_checks(device: torch.device, backend: str) -> List[Check]:
    """quat_scale_to_covar_preci (MCMC's position noise) on ``backend`` vs the reference, forward and
    backward, full 3x3 and upper triangles; scales near 1 so covariance and precision are both O(1)."""
    from ..ops import quat_scale_to_covar_preci

    scene, _, _ = random_scene(device)
    inputs = {"quats": scene["quats"], "scales": scene["scales"] * 10 + 0.3}
    checks: List[Check] = []
    for triu in (False, True):
        checks += _compare_stage(
            f"covariance + precision ({'triu' if triu else '3x3'}, {backend})",
            lambda b, **x: quat_scale_to_covar_preci(**x, triu=triu, backend=b), inputs, backend, "reference", device,
        )  # fmt: skip
    return checks


def prepare_checks(device: torch.device, sh_degree: int, rasterize_mode: str = "classic") -> List[Check]:
    """The metal backend's fused preparation (ops/metal/prepare.py: projection, culling, activations and SH
    colours from the stored parameters) vs the reference's stages with rasterization.py's glue between
    them, forward (radii, means2d, depths, conics, opacities, colours) and backward (every parameter).
    Counted as an SH check (it shares sh.metal's basis with the SH stage): where it fails, the SH stage runs on
    the reference, and rasterization the unfused stages (stage_fallback.routed has no project_and_shade)."""
    from ..ops import metal, reference
    from ..ops.rasterization import _project_and_cull

    scene, W, H = random_scene(device)
    viewmats, Ks = scene["viewmats"], scene["Ks"]
    aa = rasterize_mode == "antialiased"
    inputs = {"means": scene["means"], "quats": scene["quats"], "log_scales": torch.log(scene["scales"]),
              "logits": torch.logit(scene["opacities"])[:, None], "dc": scene["coeffs"][:, 0].contiguous(),
              "rest": scene["coeffs"][:, 1:].contiguous()}  # fmt: skip

    def run(which, means, quats, log_scales, logits, dc, rest):
        if which == "metal":
            return metal.project_and_shade(means, quats, log_scales, logits, dc, rest, viewmats, Ks, W, H, 0.3,
                                           0.01, 1e10, 0.0, aa, sh_degree, True, True)  # fmt: skip
        return _project_and_cull(reference, means, quats, torch.exp(log_scales), torch.sigmoid(logits)[:, 0],
                                 torch.cat((dc[:, None], rest), dim=1), viewmats, Ks, W, H, 0.3, 0.01, 1e10, 0.0,
                                 rasterize_mode, sh_degree)  # fmt: skip

    return _compare_stage(f"sh (fused preparation with projection, degree {sh_degree}, {rasterize_mode})", run, inputs,
                          "metal", "reference", device)  # fmt: skip


def loss_checks(device: torch.device) -> List[Check]:
    """The fused training loss (ops/metal/loss.py, (1 - 0.2) * L1 + 0.2 * (1 - SSIM)) vs the reference, forward
    (loss, L1, SSIM) and backward (d loss / d pred), on a seeded non-square image pair."""
    from ..ops.loss import l1_ssim_loss_reference
    from ..ops.metal.loss import l1_ssim_loss

    g = torch.Generator().manual_seed(0)
    gt = torch.rand(29, 37, 3, generator=g)
    pred = (gt + 0.2 * torch.randn(29, 37, 3, generator=g)).clamp(0, 1)

    def run(backend, pred, gt):  # gt is a target and L1, SSIM are for logging: gradients of the loss in pred only
        loss, l1, ssim = (l1_ssim_loss if backend == "metal" else l1_ssim_loss_reference)(pred, gt.detach(), 0.2)
        return loss, l1.detach(), ssim.detach()

    return _compare_stage("l1 + ssim loss (metal)", run, {"pred": pred.to(device), "gt": gt.to(device)}, "metal",
                          "reference", device)  # fmt: skip


def adam_checks(device: torch.device) -> List[Check]:
    """The gaussians' fused Adam (ops/metal/adam.py, engine/optimizers.py) vs torch.optim.Adam: three steps
    of six seeded tensors of splatfacto's row widths, with zero-gradient rows, on ``device``."""
    from ..ops.metal.adam import fused_adam, zero_moments

    name = "adam (fused, 6 tensors)"
    try:
        g = torch.Generator().manual_seed(0)
        shapes, lrs = [(37, 3), (37, 3), (37, 4), (37, 1), (37, 3), (37, 15, 3)], [1e-3, 5e-3, 1e-3, 0.05, 2e-3, 1e-4]
        params = [torch.randn(s, generator=g).to(device) for s in shapes]
        ref = [torch.nn.Parameter(p.clone()) for p in params]
        opts = [torch.optim.Adam([r], lr=lr, eps=1e-15) for r, lr in zip(ref, lrs)]
        exp_avgs, exp_avg_sqs = zero_moments(params)  # views of the two moment arenas, as the optimizer keeps them
        steps = [torch.zeros((), device=device) for _ in params]
        ms = 0.0
        for _ in range(3):
            grads = [torch.randn(s, generator=g).to(device) * 10.0 ** torch.randint(-6, 1, (1,), generator=g).item()
                     for s in shapes]  # fmt: skip
            grads[0][:5] = 0.0  # gaussians nobody saw
            for r, gr, opt in zip(ref, grads, opts):
                r.grad = gr.clone()
                opt.step()
            _, t = _timed(lambda: fused_adam(params, grads, exp_avgs, exp_avg_sqs, steps,
                                             lrs, [1e-15] * 6, 0.9, 0.999), device)  # fmt: skip
            ms += t
        err = max(_max_abs(p, r.detach()) for p, r in zip(params, ref))
        rel = max(_rel(p, r.detach()) for p, r in zip(params, ref))
        return [Check(name, "forward", err, rel, ms, err <= FWD_ATOL)]
    except Exception as e:  # a compile error, a launch refused by the GPU, ...: report it
        return [Check(name, "forward", float("inf"), float("inf"), 0.0, False, f"{type(e).__name__}: {e}")]


def full_op_checks(
    device: torch.device,
    backend: str,
    width: int,
    height: int,
    *,
    depth_chunks: int = 0,
    n: int = 300,
    cameras: int = 2,
    absgrad: bool = False,
    rasterize_mode: str = "classic",
) -> List[Check]:
    """The whole public op `backend` vs "reference" (used for gsplat on CUDA, which has no stage API), with SH
    colours of degree 4 (every band gsplat supports).
    With `depth_chunks`, `backend` renders with an intersection budget of about 1/depth_chunks of the
    scene's intersections (ops/chunked.py: resumed compositing), the reference without one."""
    from ..ops import rasterization, reference
    from ..ops.chunked import count_intersections

    scene, W, H = random_scene(device, n=n, width=width, height=height, cameras=cameras)
    budget = None
    if depth_chunks:
        radii, means2d, *_ = reference.project(scene["means"], scene["quats"], scene["scales"], scene["viewmats"],
                                               scene["Ks"], W, H)  # fmt: skip
        total = int(count_intersections(means2d, radii, 16, -(-W // 16), -(-H // 16)).sum())
        budget = max(1, total // depth_chunks)

    def run(backend_name, max_intersections):
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in scene.items() if k != "Ks"}
        out, ms = _timed(
            lambda: rasterization(
                leaves["means"], leaves["quats"], leaves["scales"], leaves["opacities"], leaves["coeffs"],
                leaves["viewmats"], scene["Ks"], W, H, sh_degree=4, render_mode="RGB+ED", backend=backend_name,
                absgrad=absgrad, rasterize_mode=rasterize_mode, max_intersections=max_intersections,
            ),
            device,
        )  # fmt: skip
        colors, alphas, meta = out
        (colors[..., :3].sum() + alphas.sum()).backward()
        grads = {k: v.grad for k, v in leaves.items()}
        if absgrad:
            grads["means2d.absgrad"] = meta["means2d"].absgrad
        return colors, alphas, grads, ms, meta.get("depth_chunks", 1)  # gsplat's meta has no depth_chunks

    label = f"rasterization ({backend})"
    try:
        cf, af, gf, ms, chunks = run(backend, budget)
        cr, ar, gr, _, _ = run("reference", None)
    except Exception as e:
        return [Check(label, "forward+backward", float("inf"), float("inf"), 0.0, False, f"{type(e).__name__}: {e}")]
    if depth_chunks:
        label = f"rasterization ({backend}, {chunks} depth chunks)"
    err = max(_max_abs(cf[..., :3], cr[..., :3]), _max_abs(af, ar))
    checks = [Check(label, "forward", err, _rel(cf[..., :3], cr[..., :3]), ms, err <= FWD_ATOL)]
    rel = max(_rel(gf[k], gr[k]) for k in gr)
    checks.append(Check(label, "backward", 0.0, rel, 0.0, rel <= BWD_RTOL))
    return checks
