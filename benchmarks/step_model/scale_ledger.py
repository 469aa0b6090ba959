"""The scale ledger: one steady training render of the Metal backend counted at the sizes people train.

The step ledger (splat_metal_method/bench/step_ledger.py, ledger.py) runs a real nerfstudio Trainer on the demo scene; nobody trains at that
size. Garden at full resolution ends 7K steps with ~1.5M gaussians and 30K with ~3.5M, and at those sizes
the dispatch plan of the Metal step is not the demo's. This ledger counts, at 0.5-3M gaussians and the
image sizes of garden at full and at 0.8 resolution, the part of a steady training step that depends on
the scene and the image: the render exactly as the model calls it (`rasterization` with raw splatfacto
parameters, SH degree 3, absgrad, the model's padded intersection lists), the background composite, the
fused L1 + SSIM loss and the backward through all of it, with every gaussian parameter's Adam step inside the
projection's backward as a steady training step arms it (engine/optimizers.py: their adam_prepare and
project_bwd's PROJECT_SH_ADAM and PROJECT_ADAM_*). The rest of the step (the strategy's statistics, the camera
optimizer) is counted by the step ledger and issues the same dispatches at any scene size (one densify_stats
kernel).

Counted as ledger.count counts (as a Mac runs it): our kernel launches and the bytes of the buffers
bound to each (and, for bin_sort and scan_block_sums, the bytes each launch moves: ledger.MOVED_BYTES; in
count-only mode bin_sort's from the host model's bins, the intersections of each tile), aten dispatches and the bytes each aten kernel reads and writes, host syncs, and the
command buffers the runtime's ledger closes (runtime.command_buffers()).

Count-only mode (the default; ``execute=False``): the kernels are counted, not run (ledger.count_only: the runtime's launch observer skips them),
so 3M gaussians count in seconds on a small machine; aten ops still run, on real tensors. The host then
learns nothing from the device, so the model's capacities (what two training renders would have taught
it: the intersection count and where the intersections lie) are seeded from a host model of the scene:
the reference projection (ops/reference.py) and its tile bounds, the kernels' own rectangle math.
benchmarks/tests/test_scale_ledger.py proves count-only equals executed (the kernels under the emulator) at
small sizes, and holds the counts to budgets at every size. The one count of atomics count-only mode records is
bin_count's (device and threadgroup, expected_bin_atomics: the host's count of what its threadgroup histograms
issue, which does not grow linearly with the intersections); the other kernels' atomics are the step ledger's.

    python benchmarks/bench_scale_ledger.py            # the table at 0.5M, 1.5M, 3M (and 20k)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import torch

from .ledger import ModelLedger, count, count_only

IMAGES: Tuple[Tuple[int, int], ...] = ((1297, 840), (1024, 664))  # garden full resolution, and 0.8 of it
SIZES: Tuple[int, ...] = (20_000, 500_000, 1_500_000, 3_000_000)
TILE = 16
SH_DEGREE = 3
FOCAL = 0.9  # focal length in image widths: a ~58 degree horizontal field of view, garden's camera
# The size distribution (per axis, in pixels at 1297 wide): lognormal around this median, this spread.
# With the 0.3 px^2 blur the kernels add, ~5 tiles per gaussian at 1297x840 (the figure for
# garden); the same scene seen at 1024 px covers fewer.
SIGMA_PX_MEDIAN = 1.45
SIGMA_PX_SPREAD = 0.9


@dataclass
class Scene:
    """Splatfacto's parameters of N gaussians in front of a camera at the origin looking down +z."""

    means: torch.Tensor  # [N, 3]
    quats: torch.Tensor  # [N, 4]
    log_scales: torch.Tensor  # [N, 3]
    opacity_logits: torch.Tensor  # [N, 1]
    features_dc: torch.Tensor  # [N, 3]
    features_rest: torch.Tensor  # [N, 15, 3]

    def params(self):
        return (self.means, self.quats, self.log_scales, self.opacity_logits, self.features_dc, self.features_rest)


def make_scene(n: int, seed: int = 0, device="cpu") -> Scene:
    """A scene with garden's statistics where they set the cost of a render: depths over 2-30 units,
    spread over the field of view, sizes lognormal (a few large, most a few pixels), mixed opacities."""
    g = torch.Generator().manual_seed(seed)
    z = torch.exp(torch.empty(n).uniform_(math.log(2.0), math.log(30.0), generator=g))  # [N]
    half = 0.5 / FOCAL * 1.1  # a little past the image edges, as a real scene is
    x = (torch.rand(n, generator=g) * 2 - 1) * half * z
    y = (torch.rand(n, generator=g) * 2 - 1) * half * (840 / 1297) * z
    sigma_px = SIGMA_PX_MEDIAN * torch.exp(SIGMA_PX_SPREAD * torch.randn(n, generator=g))  # [N]
    sigma = sigma_px * z / (FOCAL * 1297)  # world units at depth z
    log_scales = torch.log(sigma)[:, None] + 0.3 * torch.randn(n, 3, generator=g)  # [N, 3] anisotropic
    quats = torch.nn.functional.normalize(torch.randn(n, 4, generator=g), dim=-1)
    opacity_logits = 1.5 * torch.randn(n, 1, generator=g)
    features_dc = 0.5 * torch.randn(n, 3, generator=g)
    features_rest = 0.05 * torch.randn(n, (SH_DEGREE + 1) ** 2 - 1, 3, generator=g)
    t = (torch.stack([x, y, z], -1), quats, log_scales, opacity_logits, features_dc, features_rest)
    return Scene(*(p.to(device).requires_grad_(True) for p in t))


def camera(width: int, height: int, device="cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    """viewmats [1, 4, 4] (identity) and Ks [1, 3, 3] of a pinhole camera FOCAL image widths long."""
    f = FOCAL * width
    K = torch.tensor([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]], device=device)
    return torch.eye(4, device=device)[None], K[None]


MODEL_SAMPLE = 200_000  # gaussians the host model projects; a larger scene's counts are scaled from them


@torch.no_grad()
def expected_intersections(
    scene: Scene, width: int, height: int, sample: int = MODEL_SAMPLE
) -> Tuple[int, torch.Tensor, int, torch.Tensor]:
    """The host model of a render's intersections: the reference projection's radii and tile bounds
    (the kernels' rectangle math). Returns the count M, the intersections per tile row [1, tile_height],
    those of the longest tile (what the per-tile bins plan their merge dispatches from) and those of each
    tile [tile_height, tile_width] (the bins' lengths, which bin_sort's moved bytes are counted from).
    Scenes of more than `sample` gaussians (drawn independently) are modelled from their first `sample`,
    scaled (a relative error ~1/sqrt(sample) of the count, 0.2% at 200k)."""
    from splat_metal_method.ops import reference

    n = scene.means.shape[0]
    k = min(n, sample)
    viewmats, Ks = camera(width, height, scene.means.device)
    radii, means2d, _, _, _ = reference.project(
        scene.means[:k], scene.quats[:k], torch.exp(scene.log_scales[:k]), viewmats, Ks, width, height
    )
    th, tw = math.ceil(height / TILE), math.ceil(width / TILE)
    lo, span = reference.tile_bounds(means2d, radii, TILE, tw, th)  # [1, N, 2]
    span = torch.where((radii > 0)[..., None], span, torch.zeros_like(span))
    per_row = span[..., 0]  # tiles a gaussian covers in each of its rows  [1, N]
    diff = torch.zeros(1, th + 1, dtype=torch.int64)
    diff.scatter_add_(1, lo[..., 1], per_row)
    diff.scatter_add_(1, lo[..., 1] + span[..., 1], -per_row)
    rows = diff.cumsum(1)[:, :th]  # [1, th]
    # per tile: a 2-D difference array over the rectangles [x0, x0 + w) x [y0, y0 + h)
    x0, y0 = lo[0, :, 0], lo[0, :, 1]  # [N]
    x1, y1 = x0 + span[0, :, 0], y0 + span[0, :, 1]
    corners = torch.zeros((th + 1) * (tw + 1), dtype=torch.int64)
    for ys, xs, sign in ((y0, x0, 1), (y0, x1, -1), (y1, x0, -1), (y1, x1, 1)):
        corners.scatter_add_(0, ys * (tw + 1) + xs, torch.full_like(xs, sign))
    tiles = corners.view(th + 1, tw + 1).cumsum(0).cumsum(1)[:th, :tw]  # [th, tw]
    longest = int(tiles.max()) if tiles.numel() else 0
    if k < n:
        rows = torch.round(rows.double() * (n / k)).long()
        longest = round(longest * n / k)
        tiles = torch.round(tiles.double() * (n / k)).long()
    return int(rows.sum()), rows, longest, tiles


@torch.no_grad()
def expected_bin_atomics(scene: Scene, width: int, height: int, sample: int = MODEL_SAMPLE) -> Tuple[int, int]:
    """The host model of bin_count's atomics in a render (isect.bin_count_atomics on the reference projection):
    (device, threadgroup). A device atomic per (threadgroup, tile) the group's run of gaussians touches (and per
    entry of a tile past its window), so not linear in the intersections: counted here at the scene's size, not
    scaled from a small one. Scenes of more than `sample` gaussians are modelled from their first whole runs of
    a group within `sample` (the gaussians are drawn independently: each run alike), scaled by gaussians."""
    from splat_metal_method.ops import reference
    from splat_metal_method.ops.metal.isect import BIN_COUNT_ITEMS, GROUP_1D, bin_count_atomics

    n = scene.means.shape[0]
    run = GROUP_1D * BIN_COUNT_ITEMS
    k = n if n <= sample else max(run, sample // run * run)
    viewmats, Ks = camera(width, height, scene.means.device)
    radii, means2d, _, _, _ = reference.project(
        scene.means[:k], scene.quats[:k], torch.exp(scene.log_scales[:k]), viewmats, Ks, width, height
    )
    device, tg = bin_count_atomics(means2d, radii, TILE, math.ceil(width / TILE), math.ceil(height / TILE))
    return round(device * n / k), round(tg * n / k)


def sh_optimizers(scene: Scene) -> tuple:
    """torch Adams of every gaussian parameter with their state made, as splatfacto's (lr, eps): (features_dc's,
    features_rest's, {means, quats, scales, opacities: theirs}), for the Adam step the render's backward takes
    (adam.ShStep: all six inside project_bwd, as a steady step of the model arms them), their moments views of the
    two moment arenas as GaussianOptimizers packs them (adam.pack_moments)."""
    from splat_metal_method.ops.metal import adam

    out = []
    lrs = (1.6e-4, 0.001, 0.005, 0.05, 0.0025, 0.0025 / 20)
    for p, lr in zip(scene.params(), lrs):
        opt = torch.optim.Adam([p], lr=lr, eps=1e-15)
        opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                        "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}  # fmt: skip
        out.append(opt)
    adam.pack_moments([opt.state[opt.param_groups[0]["params"][0]] for opt in out])
    return out[4], out[5], dict(zip(("means", "quats", "scales", "opacities"), out[:4]))


def render_step(scene: Scene, width: int, height: int, capacities, gt: torch.Tensor, background: torch.Tensor,
                cam: Tuple[torch.Tensor, torch.Tensor], sh_opts: Optional[tuple] = None):  # fmt: skip
    """One steady training render as the model runs it (its camera already on the device, `cam`):
    rasterization with the composite fused in, fused loss, backward (with ``sh_opts``, sh_optimizers(scene),
    the SH coefficients' Adam step in it, armed as GaussianOptimizers arms it)."""
    from splat_metal_method.ops.loss import l1_ssim_loss
    from splat_metal_method.ops.metal import adam
    from splat_metal_method.ops.metal.fused import rasterization_metal

    for p in scene.params():
        p.grad = None
    adam.arm_sh_step(adam.ShStep(tuple(sh_opts[:2]), sh_opts[2]) if sh_opts is not None else None)
    viewmats, Ks = cam
    _, _, meta = rasterization_metal(
        means=scene.means, quats=scene.quats, scales=scene.log_scales, opacities=scene.opacity_logits,
        colors=scene.features_dc, colors_rest=scene.features_rest, viewmats=viewmats, Ks=Ks, width=width,
        height=height, sh_degree=SH_DEGREE, absgrad=True, scales_are_log=True,
        opacities_are_logits=True, isect_capacity=capacities, composite_background=background, composite_squeeze=True,
    )  # fmt: skip
    rgb = meta["rgb"]  # [H, W, 3]: the metal rasterizer composites
    loss, _, _ = l1_ssim_loss(rgb, gt, 0.2, "metal", stats=False)
    loss.backward()
    adam.arm_sh_step(None)


@dataclass
class ScaleRow:
    """The counts of one render step at one size."""

    n_gaussians: int
    width: int
    height: int
    intersections: int
    ledger: ModelLedger
    command_buffers: int
    mode: str  # "count-only" or "executed"
    capacities: object = None  # the renderer's IntersectionCapacities after the counted render
    bin_lengths: Optional[list] = None  # the bins' lengths bin_sort's moved bytes were counted from

    def summary(self) -> Dict[str, int]:
        s = self.ledger.summary()
        moved = sum(w.moved_bytes if w.moved_shapes else w.buffer_bytes for w in self.ledger.kernels.values())
        return {
            "kernel_launches": s["kernel_launches"], "aten_dispatches": s["aten_dispatches"],
            "host_syncs": s["host_syncs"], "command_buffers": self.command_buffers,
            "kernel_bytes": s["buffer_bytes"], "kernel_moved_bytes": moved, "aten_bytes": s["aten_bytes"],
            "dispatches": s["kernel_launches"] + s["aten_dispatches"],
        }  # fmt: skip


def forget_pending(capacities) -> None:
    """Count-only mode: the intersection counts a render sent to the host are of kernels that did not run (unwritten
    buffers); the capacities keep what they were seeded with, as if the device had said nothing."""
    for state in capacities._grids.values():
        state.pending.clear()


def measure(n: int, width: int, height: int, execute: bool = False, seed: int = 0,
            seed_from=None, bins: Optional[list] = None) -> ScaleRow:  # fmt: skip
    """Counts one steady render step of `n` gaussians at width x height (see the module docstring).

    Executed: two uncounted renders first teach the capacities, as a model's earlier steps do; bin_sort's moved
    bytes are counted from the bins the kernels filled.
    Count-only: the capacities are seeded with what those renders would have taught (the host model of
    the scene, or ``seed_from``: an IntersectionCapacities of an executed run), one uncounted render warms
    the workspace as it would be warm, then the counted one; bin_sort's moved bytes are counted from the host
    model's bins (the intersections of each tile), or ``bins`` (an executed row's bin_lengths)."""
    from splat_metal_method.ops import IntersectionCapacities
    from splat_metal_method.ops.metal import runtime
    from splat_metal_method.ops.workspace import workspace

    scene = make_scene(n, seed)
    gt = torch.rand(height, width, 3, generator=torch.Generator().manual_seed(seed + 1))
    background = torch.zeros(3)
    cam = camera(width, height)
    sh_opts = sh_optimizers(scene)
    capacities = IntersectionCapacities()
    workspace().clear()
    M = 0
    if not execute:
        if seed_from is not None:
            capacities.seed_like(seed_from)
        if seed_from is None or bins is None:
            model_m, _, longest, tiles = expected_intersections(scene, width, height)
            bins = tiles.reshape(-1).tolist() if bins is None else bins  # one camera: tile order y * tw + x
            if seed_from is None:
                M = model_m
                th, tw = math.ceil(height / TILE), math.ceil(width / TILE)
                capacities.expect(tw, th, 1, n, M, tile_size=TILE, longest=longest)
    mode = contextlib.nullcontext() if execute else count_only()
    with mode:
        for _ in range(2 if execute else 1):
            render_step(scene, width, height, capacities, gt, background, cam, sh_opts)
            if not execute:
                forget_pending(capacities)
        runtime.reset_command_buffers()
        extents = None if execute else {"bin_sort": bins}
        with count(f"{n} gaussians {width}x{height}", extents=extents, execute=execute) as ledger:
            render_step(scene, width, height, capacities, gt, background, cam, sh_opts)
        if not execute:
            forget_pending(capacities)
        n_buffers = len([b for b in runtime.command_buffers() if b.launches or b.work])
    ledger.n_gaussians, ledger.pixels = n, width * height
    if execute:
        M = capacities.last_count or 0
    elif "bin_count" in ledger.kernels:  # the kernels did not run: bin_count's atomics from the host model
        work = ledger.kernels["bin_count"]
        work.device_atomics, work.threadgroup_atomics = expected_bin_atomics(scene, width, height)
    ledger.intersections = M
    return ScaleRow(
        n,
        width,
        height,
        M,
        ledger,
        n_buffers,
        "executed" if execute else "count-only",
        capacities,
        ledger.extents.get("bin_sort"),
    )


COLUMNS = (("our launches", "kernel_launches"), ("aten ops", "aten_dispatches"), ("host syncs", "host_syncs"),
           ("command buffers", "command_buffers"), ("kernel MB (bound)", "kernel_bytes"),
           ("kernel MB (moved)", "kernel_moved_bytes"), ("aten MB", "aten_bytes"))  # fmt: skip


def table(rows: Sequence[ScaleRow]) -> str:
    head = "| gaussians | image | intersections | " + " | ".join(c for c, _ in COLUMNS) + " | mode |"
    lines = [head, "|" + "---|" * (4 + len(COLUMNS))]
    for r in rows:
        s = r.summary()
        cells = [f"{s[k] / 1e6:,.0f}" if k.endswith("bytes") else f"{s[k]:,}" for _, k in COLUMNS]
        lines.append(f"| {r.n_gaussians:,} | {r.width}x{r.height} | {r.intersections:,} | " + " | ".join(cells)
                     + f" | {r.mode} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--images", nargs="+", default=[f"{w}x{h}" for w, h in IMAGES], help="WIDTHxHEIGHT")
    ap.add_argument("--execute", action="store_true", help="run the kernels (the emulator: small sizes only)")
    ap.add_argument("--json", type=Path, help="also write each row's ledger (peers.ledger_dict) here")
    args = ap.parse_args(argv)
    rows = []
    for image in args.images:
        w, h = (int(v) for v in image.lower().split("x"))
        for n in args.sizes:
            rows.append(measure(n, w, h, execute=args.execute))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            if args.json:
                args.json.write_text(json.dumps({key(r.n_gaussians, r.width, r.height): as_dict(r) for r in rows}))
    print(table(rows))


def key(n: int, width: int, height: int) -> str:
    return f"{n} {width}x{height}"


def bytes_by_kind(buffer_shapes: Dict[str, int], n: int, width: int, height: int) -> Dict[str, int]:
    """A kernel's bound bytes (ledger.ModelWork.buffer_shapes) by what each buffer holds: "G" per
    gaussian (a dimension of n, or one flat dimension of k * n floats, k < 128: the moment arenas and
    project_bwd's gradients, several parameters' rows in one allocation), "P" per pixel (the image's or the
    tile grid's two dimensions), "M" the rest: intersection lists, bins and the few scalars beside them."""
    th, tw = math.ceil(height / TILE), math.ceil(width / TILE)
    out = {"G": 0, "P": 0, "M": 0}
    for shape, b in buffer_shapes.items():
        dims = [int(d) for d in shape.split("x") if d]
        if n in dims or (len(dims) == 1 and n > 0 and dims[0] % n == 0 and dims[0] < 128 * n):
            out["G"] += b
        elif (height in dims and width in dims) or (th in dims and tw in dims):
            out["P"] += b
        else:
            out["M"] += b
    return out


def as_dict(row: ScaleRow) -> dict:
    """The row as peers.ledger_dict's plain dict, with its command buffers; each kernel's bound bytes also
    by what they hold (bytes_by_kind), the shapes themselves left out."""
    from .peers import ledger_dict

    out = {**ledger_dict(row.ledger, shapes=True), "command_buffers": row.command_buffers, "mode": row.mode}
    for work in out["kernels"].values():
        shapes = work.pop("buffer_shapes", {})
        work["bytes_by_kind"] = bytes_by_kind(shapes, row.n_gaussians, row.width, row.height)
        if "moved_shapes" in work:  # what its launches read and wrote (ledger.MOVED_BYTES), split alike
            work["moved_by_kind"] = bytes_by_kind(work.pop("moved_shapes"), row.n_gaussians, row.width, row.height)
    return out


if __name__ == "__main__":
    main()
