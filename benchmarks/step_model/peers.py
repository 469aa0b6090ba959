"""A calibrated MODEL of a 3DGS training step on Apple GPUs: our step (from the step ledger) and the
peers' designs (from their source), with the few unknown per-operation costs fitted to the peers'
published measurements. Not a measurement: the report says how well it reproduces each one.

What a design is here (each count cited from the peer's source in the comments above each design):
- CPU: dispatches it encodes (aten ops at ``aten_encode_us``, native/compile_shader kernels at
  ``launch_us``; pytorch#148219) and host syncs at ``sync_us`` each (pytorch#152199: a small MPS op
  takes 22.75 us without and 245 us with torch.mps.synchronize(): ~220 us per round trip). With a host
  sync in the step the CPU waits for the GPU and the two add up; without one they overlap (max).
- GPU, per dispatch: ``dispatch_us`` (an ASSUMPTION: no point resolves it): the gap between dependent
  dispatches of one command buffer (pipeline change, drain, launch), paid by every dispatch, ours,
  aten's and the peers'.
- GPU, the rasterizer's walk: simdgroup steps. Forward and per-pixel backward: each simdgroup walks
  the tile's list up to its last contributor, WALK_PER_EVAL x the gaussians a pixel composites, 32
  pixels a step (E * WALK_PER_EVAL / 32 steps each); the per-pixel backward adds ``MATH_STEPS`` steps per active
  (gaussian, simdgroup) group. Per-splat backward (Plinth-it's ``rasterize_backward_persplat_kernel``):
  one simdgroup per tile holds 32 splats and replays the 256 tile pixels diagonally, 256 + 31 steps per
  round of 32 listed splats, a simdgroup barrier each step, the gradient math on every step that has
  an active lane. Cost ``step_cycles`` (FITTED) per step and scheduler, four schedulers per core.
- GPU, reductions: simd_sum at 14.54 cycles per scalar component (metal-benchmarks, as step_model).
- GPU, device atomics: ``atomic_cycles`` (FITTED) core cycles each. Per-pixel designs issue them per
  active group (msplat: lane 0 issues 9 in a row; the fork 10; ours 8 + D spread over lanes); the
  per-splat design one bundle per LISTED splat and tile (the fork flushes even all-zero bundles).
- GPU, barriers: ``barrier_cycles`` (FITTED) per threadgroup (or simdgroup) barrier.
- GPU, memory: bytes / (the chip's DRAM bandwidth x ``bw_efficiency`` (FITTED)); Apple's specs: M4 Max
  546 GB/s, M3 Pro 150 GB/s. Per stage max(compute, memory); the stages add up.

The scene statistics a step depends on (Scene): gaussians G, pixels P, tile intersections M and
gaussian-pixel evaluations E. Only the fork published E (27.1M "replay active" pairs at 1024x664 = 40
per pixel) and its atomic groups (0.8M ~ E / 32: active groups are full). E is taken as 40 per pixel at
every gaussian count (opacity saturation bounds the depth a pixel composites). M is not published by
anyone: issue 23's garden estimate (15M at 3M gaussians, 1297x840: 5 tiles per gaussian) is scaled
with the gaussians and the pixels.

Runs (7K, 30K) average over a gaussian count that grows: the seed points (garden's 138,766 COLMAP
points) until the warm-up ends (500), then linearly to the final count at the end of densification
(msplat: stop_split_at = iterations / 2), then constant. Refine steps and start-up are not modeled.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple

# Apple GPUs: cores, clock (GHz), DRAM bandwidth (GB/s). M4 Max / M1 as step_model.DEVICES; M3 Pro:
# Apple's spec (18-core GPU, 150 GB/s), clock 1.38 GHz from a third-party listing (Apple publishes none).
DEVICES: Dict[str, Dict[str, float]] = {
    "M1": {"cores": 8, "ghz": 1.278, "gbps": 68.25},
    "M3 Pro": {"cores": 18, "ghz": 1.38, "gbps": 150.0},
    "M4 Max": {"cores": 40, "ghz": 1.678, "gbps": 546.0},
}
SCHEDULERS = 4  # per core (metal-benchmarks)
SIMD_SUM_CYCLES = 14.54  # metal-benchmarks SUM<F32>, per scalar component and simdgroup
TILE_PIXELS = 256  # 16x16 tiles: msplat's bins, the fork's, ours
SIMDGROUP = 32
MATH_STEPS = 2.0  # ASSUMPTION: an active backward step costs two test steps (msplat's loop body ~2x its test)
SORT_STEP_WEIGHT = 1.0  # a bitonic compare-exchange per element and stage, counted as one walk step

# Scene statistics (see the module docstring)
EVALS_PER_PIXEL = 27.1e6 / (1024 * 664)  # the fork's replay-active pairs over its 1024x664 image
WALK_PER_EVAL = 2.0  # ASSUMPTION: a simdgroup walks twice the gaussians its pixels composite
FULL_PIXELS = 1297 * 840
TILES_PER_GAUSSIAN_FULL = 15.0e6 / 3.0e6  # issue 23's garden estimate: 15M intersections, 3M gaussians, 1297x840
SEED_POINTS = 138_766  # garden's COLMAP points (../shared/data/garden_points.npz holds them)


def _tiles(width: int, height: int) -> int:
    return math.ceil(width / 16) * math.ceil(height / 16)


@dataclass(frozen=True)
class Scene:
    name: str
    gaussians: float
    width: int
    height: int
    intersections: Optional[float] = None  # default: TILES_PER_GAUSSIAN_FULL, scaled with G and P
    evaluations: Optional[float] = None  # default: EVALS_PER_PIXEL per pixel

    @property
    def pixels(self) -> float:
        return float(self.width * self.height)

    @property
    def tiles(self) -> int:
        return _tiles(self.width, self.height)

    @property
    def M(self) -> float:
        if self.intersections is not None:
            return self.intersections
        return TILES_PER_GAUSSIAN_FULL * self.gaussians * self.pixels / FULL_PIXELS

    @property
    def E(self) -> float:
        return self.evaluations if self.evaluations is not None else EVALS_PER_PIXEL * self.pixels

    @property
    def groups(self) -> float:  # active (gaussian, simdgroup) pairs of a per-pixel backward
        return self.E / SIMDGROUP

    def with_gaussians(self, g: float) -> "Scene":
        return replace(self, gaussians=g, intersections=None)


# The scenes of issue 30 (the fork's point, and garden at the 3DGS benchmark resolution)
FORK_SCENE = Scene("garden 500K 1024x664", 5e5, 1024, 664, evaluations=27.1e6)
COMPARE_SCENES = (
    FORK_SCENE,
    Scene("garden 1.5M 1297x840", 1.5e6, 1297, 840),
    Scene("garden 3M 1297x840", 3.0e6, 1297, 840),
)


@dataclass
class Calib:
    """Per-operation costs. Published ones are fixed; FITTED ones come from fit() (stored below)."""

    aten_encode_us: float = 10.0  # pytorch#148219 (M1 Pro): 1.3 us .. 20 us per aten op, as step_model
    launch_us: float = 1.4  # pytorch#148219: a Metal-shader op's dispatch; msplat's native encodes too
    sync_us: float = 220.0  # pytorch#152199: 245 us with vs 22.75 us without torch.mps.synchronize()
    # GPU gap per dispatch: ASSUMPTION, not identifiable from the points (msplat's 17 dispatches a step make
    # it < 1% of its step; OpenSplat's run is not reproducible): the Metal-shader encode figure again
    dispatch_us: float = 1.4
    step_cycles: float = 20.0  # FITTED
    atomic_cycles: float = 4.0  # FITTED
    # a threadgroup atomic (on-chip threadgroup memory, no L2 round trip): ASSUMPTION, a quarter of a device
    # atomic (CALIBRATED: of the fitted one; CONSTANT_NOTES; the sensitivity table prices them at the full device cost)
    tg_atomic_cycles: float = 1.0
    barrier_cycles: float = 32.0  # FITTED
    bw_efficiency: float = 0.8  # FITTED: the share of the DRAM spec a step's streams reach

    FITTED = ("step_cycles", "atomic_cycles", "barrier_cycles", "bw_efficiency")


@dataclass
class Breakdown:
    """Modeled ms of one step (or one kernel), by term."""

    terms: Dict[str, float] = field(default_factory=dict)  # GPU stage -> ms (max of compute, memory)
    cpu_ms: float = 0.0
    sync_ms: float = 0.0
    syncs: float = 0.0

    @property
    def gpu_ms(self) -> float:
        return sum(self.terms.values())

    @property
    def step_ms(self) -> float:
        # a step with a host sync waits for the GPU (CPU and GPU add); without one they overlap. Fewer
        # than one a step (msplat: one per refine) serializes that share of the steps only.
        serial = min(self.syncs, 1.0)
        overlapped = max(self.cpu_ms, self.gpu_ms)
        return self.sync_ms + serial * (self.cpu_ms + self.gpu_ms) + (1.0 - serial) * overlapped


class _Gpu:
    """Unit conversions for one device."""

    def __init__(self, device: str, c: Calib):
        d = DEVICES[device]
        self.c = c
        self.core_hz = d["cores"] * d["ghz"] * 1e9  # core cycles per second, all cores
        self.issue_hz = self.core_hz * SCHEDULERS  # simdgroup instructions per second
        self.bw = d["gbps"] * 1e9 * c.bw_efficiency

    def steps_ms(self, steps: float) -> float:
        return steps * self.c.step_cycles / self.issue_hz * 1e3

    def sums_ms(self, components: float) -> float:
        return components * SIMD_SUM_CYCLES / self.issue_hz * 1e3

    def atomics_ms(self, n: float) -> float:
        return n * self.c.atomic_cycles / self.core_hz * 1e3

    def tg_atomics_ms(self, n: float) -> float:
        return n * self.c.tg_atomic_cycles / self.core_hz * 1e3

    def barriers_ms(self, n: float) -> float:
        return n * self.c.barrier_cycles / self.issue_hz * 1e3

    def bytes_ms(self, n: float) -> float:
        return n / self.bw * 1e3


# ------------------------------------------------------------------------------------------------
# Rasterizer walks (shared by every tile-based design)
# ------------------------------------------------------------------------------------------------
def walk_steps(s: Scene) -> float:
    """Simdgroup steps of one per-pixel pass over the image (forward, or the backward's walk)."""
    return s.E * WALK_PER_EVAL / SIMDGROUP


def per_pixel_backward(g: _Gpu, s: Scene, sums_per_group: float, atomics_per_group: float) -> Dict[str, float]:
    """msplat's rasterize_backward_kernel (and ours): the walk, the math of active groups, one simd_sum per
    reduced component and the group's atomics."""
    return {
        "walk": g.steps_ms(walk_steps(s) + MATH_STEPS * s.groups),
        "reductions": g.sums_ms(sums_per_group * s.groups),
        "atomics": g.atomics_ms(atomics_per_group * s.groups),
    }


def per_splat_backward(g: _Gpu, s: Scene, atomics_per_splat: float) -> Dict[str, float]:
    """Plinth-it's rasterize_backward_persplat_kernel: rounds of 32 listed splats per tile, 256 + 31 diagonal
    steps each with a simdgroup barrier; math on steps with an active lane; one atomic bundle per listed
    splat (also all-zero ones)."""
    rounds = s.M / SIMDGROUP + 0.5 * s.tiles  # the last round of a tile is partial
    steps = rounds * (TILE_PIXELS + SIMDGROUP - 1)
    p = min(1.0, s.E / (s.M * TILE_PIXELS))  # chance that a lane's (splat, pixel) pair composites
    active_steps = steps * (1.0 - (1.0 - p) ** SIMDGROUP)
    return {
        "walk": g.steps_ms(steps + MATH_STEPS * active_steps),
        "barriers": g.barriers_ms(steps),
        "atomics": g.atomics_ms(atomics_per_splat * s.M),
    }


# ------------------------------------------------------------------------------------------------
# Peer designs, from their source
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NativeDesign:
    """A whole step in one command buffer of native Metal dispatches (msplat), or a libtorch step with
    custom kernels and a host sync after each (OpenSplat)."""

    name: str
    dispatches: float  # kernel dispatches per step (GPU gap each; CPU encode each at launch_us)
    aten_ops: float = 0.0  # aten dispatches per step (libtorch designs), CPU encode at aten_encode_us
    syncs: float = 0.0  # host syncs per steady step
    bytes_per_gaussian: float = 0.0
    bytes_per_intersection: float = 0.0
    bytes_per_pixel: float = 0.0
    backward: str = "per-pixel"  # or "per-splat" or "per-thread"
    sums_per_group: float = 9.0  # simd_sum components per active group (per-pixel)
    atomics_per_group: float = 9.0  # per-pixel: per active group; per-splat: per listed splat; per-thread: per pair
    binning_atomics: float = 0.0  # device atomics per intersection while binning (msplat 1.1.3: one slot per entry)

    def step(self, s: Scene, device: str, c: Calib) -> Breakdown:
        g = _Gpu(device, c)
        b = Breakdown(syncs=self.syncs)
        b.cpu_ms = (self.dispatches * c.launch_us + self.aten_ops * c.aten_encode_us) * 1e-3
        b.sync_ms = self.syncs * c.sync_us * 1e-3
        b.terms["dispatch gaps"] = (self.dispatches + self.aten_ops) * c.dispatch_us * 1e-3
        b.terms["per-gaussian memory"] = g.bytes_ms(self.bytes_per_gaussian * s.gaussians)
        b.terms["per-pixel memory"] = g.bytes_ms(self.bytes_per_pixel * s.pixels)
        # bytes_per_intersection splits as msplat's 136: binning + sort 56 (0.4), forward 40 and backward 40
        # (0.3 each); the sort's compute: a bitonic network over each tile's list, log2(n)^2 / 2 stages
        # (the bin write 8 of the 56 in the scatter kernel, with its device atomics; the sort's 48 in the sort kernel)
        sort_steps = s.M * math.log2(max(s.M / s.tiles, 2.0)) ** 2 / 2 / SIMDGROUP * SORT_STEP_WEIGHT
        if self.binning_atomics:
            scatter = max(g.atomics_ms(self.binning_atomics * s.M), g.bytes_ms(8.0 * s.M))
            sort = max(g.steps_ms(sort_steps), g.bytes_ms((self.bytes_per_intersection * 0.4 - 8.0) * s.M))
            b.terms["binning + sort"] = scatter + sort
        else:
            b.terms["binning + sort"] = max(g.steps_ms(sort_steps), g.bytes_ms(self.bytes_per_intersection * 0.4 * s.M))
        fwd = g.steps_ms(walk_steps(s) + s.groups)
        b.terms["rasterize forward"] = max(fwd, g.bytes_ms(self.bytes_per_intersection * 0.3 * s.M))
        b.terms["rasterize backward"] = sum(self.backward_terms(g, s).values())
        return b

    def backward_terms(self, g: _Gpu, s: Scene) -> Dict[str, float]:
        if self.backward == "per-splat":
            t = per_splat_backward(g, s, self.atomics_per_group)
        elif self.backward == "per-thread":  # gsplat 0.1's nd_rasterize_backward: every thread, every pair
            t = {"walk": g.steps_ms(walk_steps(s) + MATH_STEPS * s.groups),
                 "atomics": g.atomics_ms(self.atomics_per_group * s.E)}  # fmt: skip
        else:
            t = per_pixel_backward(g, s, self.sums_per_group, self.atomics_per_group)
        t["memory"] = g.bytes_ms(self.bytes_per_intersection * 0.3 * s.M)
        return t

    def backward_kernel_ms(self, s: Scene, device: str, c: Calib) -> float:
        """The rasterize-backward kernel alone (the fork's rast_bwd stage median)."""
        t = self.backward_terms(_Gpu(device, c), s)
        mem = t.pop("memory")
        return max(sum(t.values()), mem)


# msplat v1.1.3 (rayanht/msplat core/metal/msplat_metal.mm encode_* lambdas, CHANGELOG v1.1.3): one
# compute encoder per step: project_and_sh_forward, scatter_to_prealloc_bins, bitonic_sort_per_tile
# (packs xy/opacity, conic, rgb inline), nd_rasterize_forward, fused loss + 3 separable SSIM passes,
# rasterize_backward, project_and_sh_backward (+ SH Adam), fused_adam x4, accumulate_grad_stats, and
# two buffer clears: 17 dispatches. No host read in a steady step (densification on the GPU; the new
# count is read back once per refine: 1 sync / 100 steps).
# Bytes per gaussian (read + write, each buffer once): forward 236 (59 floats of parameters) + 48
# (packed 2D), binning 48, backward + SH Adam 236 + 40 + 6 * 192 (SH, moments), fused Adam of the
# other 11 floats 7 * 44, grad stats 16, clears 40: ~2,100. Per intersection: bin write 8, sort read 8 +
# packed write 40, forward read 40, backward read 40: 136. Per pixel: image, render, final T and index,
# loss and SSIM maps: ~120.
# rasterize_backward_kernel: per pixel, simd_sum of 9 components (rgb 3, conic 3, xy 2, opacity 1),
# lane 0 issues the 9 atomics. scatter_to_prealloc_bins_kernel: one device atomic_fetch_add on the tile's
# counter per (gaussian, tile) entry, also for entries past MAX_TILE_ELEMS (dropped after the atomic).
MSPLAT = NativeDesign("msplat 1.1.3", dispatches=17, syncs=0.01, bytes_per_gaussian=2100,
                      bytes_per_intersection=136, bytes_per_pixel=120, sums_per_group=9, atomics_per_group=9)  # fmt: skip
# The same with its binning's device atomics priced at the fitted atomic cost (the sensitivity table's row; not
# the calibrated design: refit with it, the published msplat 1.1.3 times fit worse, see benchmarks/step_model/README.md)
MSPLAT_BINNING_ATOMICS = replace(MSPLAT, name="msplat 1.1.3, binning atomics priced", binning_atomics=1.0)
# msplat v1.0 / v0.1 (CHANGELOG v1.1.3 lists what it removed): the SH gradient round trip (~600 MB/iter at
# 1.5M gaussians = 400 B each), an SSIM intermediate (~130 MB/iter at 1297x840 = 120 B a pixel), the
# count -> prefix-sum -> scatter binning (3 more dispatches, keys written and read once more: +16 B per
# intersection), and separate SSIM / SH passes (+2 dispatches).
MSPLAT_V10 = replace(MSPLAT, name="msplat 1.0", dispatches=22, bytes_per_gaussian=2500, bytes_per_intersection=152,
                     bytes_per_pixel=240)  # fmt: skip
# The Plinth-it fork's two backward kernels (core/metal/msplat_raster_backward.metal): the per-pixel one
# adds a refine-gradient component (10 sums, 10 atomics); the per-splat one flushes 10 atomics per listed
# splat and tile.
FORK_PIXEL = replace(MSPLAT, name="Plinth-it per-pixel", sums_per_group=10, atomics_per_group=10)
FORK_SPLAT = replace(MSPLAT, name="Plinth-it per-splat", backward="per-splat", atomics_per_group=10)
# OpenSplat with PR #76 (pierotofy/OpenSplat rasterizer/gsplat-metal/gsplat_metal.mm: every custom kernel
# dispatch ends with torch::mps::synchronize(); model.cpp adds one before SH): 8 custom kernels (project,
# SH, intersect map, tile bins, rasterize fwd/bwd, project bwd, SH bwd) -> 9 syncs, plus the intersection
# count read back: 10. About 250 aten ops (libtorch sort, cumsum, SSIM by conv2d, unfused Adam over 6
# parameters, densification statistics): an ASSUMPTION, not counted. gsplat 0.1's per-pixel backward
# with atomics from every thread for every composited pair (8 per pair).
OPENSPLAT = NativeDesign("OpenSplat (PR #76)", dispatches=8, aten_ops=250, syncs=10, bytes_per_gaussian=4000,
                         bytes_per_intersection=136, bytes_per_pixel=400, backward="per-thread",
                         atomics_per_group=8)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Our step, from a stored or measured ledger (ledger.ModelLedger or its dict form)
# ------------------------------------------------------------------------------------------------
# What each of our kernels' counts grow with, by name prefix: the tile intersection, sort and rasterize
# kernels with intersections, the loss with pixels, everything else (projection, SH, covariances,
# per-gaussian training kernels such as densification statistics or the NaN flag) with gaussians
KERNEL_GROWS = (("isect_count", "G"), ("isect_", "M"), ("radix_", "M"), ("scan_", "M"), ("rasterize_", "M"),
                ("bin_", "M"), ("l1_ssim", "P"))  # fmt: skip


def kernel_grows(name: str) -> str:
    return next((g for prefix, g in KERNEL_GROWS if name.startswith(prefix)), "G")


OURS_ATOMICS_PER_GROUP = 11  # rasterize_bwd.metal: 8 + D quantities (conic 3, opacity, means2d 2, absgrad 2, rgb 3)
# The number of the backward's active (gaussian, simdgroup) groups in a ledger: counted (step_ledger.ACTIVE_GROUPS:
# its reductions less 3 a simdgroup, over the components a group reduces, 11 with absgrad and 9 without since
# rasterize_bwd reduces only what it issues); in ledgers from before that count, its reductions / 12 (three float4s
# a group then). Never from the atomics, which the tile merge (config field bwd_tile_merge) and a step without
# absgrad issue fewer of per group: counted from the atomics, such a step had fewer groups, and its reductions and
# atomics were scaled up by as much as they had gone down.
OURS_SUMS_PER_GROUP = 12
PIXEL_PARTS = ("model, loss, camera opt",)


def ledger_dict(led, shapes: bool = False) -> dict:
    """A ledger.ModelLedger as the plain dict stored in benchmarks/results/ledger_*.json (also accepts that dict); with
    ``shapes``, each kernel's bound bytes by buffer shape too (KernelWork.buffer_shapes)."""
    if isinstance(led, dict):
        return led
    from dataclasses import asdict

    return {
        "label": led.name, "n_gaussians": led.n_gaussians, "pixels": led.pixels, "intersections": led.intersections,
        "host_syncs": led.host_syncs, "aten_dispatches": led.aten_dispatches, "aten_kernels": led.aten_kernels,
        "part_bytes": dict(led.part_bytes), "parts": dict(led.parts),
        "kernels": {k: {kk: vv for kk, vv in asdict(w).items()
                        if vv and (shapes or kk not in ("buffer_shapes", "moved_shapes"))}
                    for k, w in led.kernels.items()},
    }  # fmt: skip


def aten_rates(ledgers) -> Optional[Dict[str, Tuple[float, float]]]:
    """Bytes per gaussian and per pixel of each part of the step's aten ops, solved (non-negative least
    squares) from two or more ledgers of different scenes; None from fewer. (Before issue 30: the optimizer,
    the strategy and the rasterization op's aten ops grow with gaussians only; the model/loss and autograd
    parts ~900 B a gaussian plus 110-150 B a pixel.)"""
    import numpy as np
    from scipy.optimize import nnls

    leds = [ledger_dict(v) for v in (ledgers.values() if isinstance(ledgers, dict) else ledgers)]
    if len({(d["n_gaussians"], d["pixels"]) for d in leds}) < 2:
        return None
    out = {}
    for part in {p for d in leds for p in d["part_bytes"]}:
        a = [[d["n_gaussians"], d["pixels"]] for d in leds]
        y = [d["part_bytes"].get(part, 0) for d in leds]
        x, _ = nnls(np.array(a, float), np.array(y, float))
        out[part] = (float(x[0]), float(x[1]))
    return out


@dataclass
class OursFromLedger:
    """Our steady step: the ledger's CPU counts as they are (they do not grow with the scene), its
    kernels' work scaled from the measured scene to the target (by gaussians, pixels, intersections; the
    backward's reductions, atomics and math by active groups: the scene's, as msplat forms them, times the
    ledger's share of ours to msplat's order's), the rasterizer's walk modeled as msplat's (both are per-pixel
    with 16x16 tiles), aten bytes by pixels (model/loss) or gaussians (the rest)."""

    ledger: dict
    name: str = "ours"
    rates: Optional[Dict[str, Tuple[float, float]]] = None  # aten_rates(...) of the same tree's ledgers

    @property
    def syncs(self) -> int:
        return int(self.ledger["host_syncs"])

    def _measured_groups(self) -> float:
        w = self.ledger["kernels"].get("rasterize_bwd", {})
        if w.get("active_groups"):  # counted (step_ledger.ACTIVE_GROUPS)
            return float(w["active_groups"])
        if w.get("simd_reductions"):  # ledgers before the count: 12 components a group
            return max(w["simd_reductions"] / OURS_SUMS_PER_GROUP, 1.0)
        return max(w.get("device_atomics", 0) / OURS_ATOMICS_PER_GROUP, 1.0)  # a ledger without the sums

    def _order_share(self) -> float:
        """Our backward's active groups over the same launches' groups in msplat's pixel order, 8x4 pixels a
        simdgroup (step_ledger.KernelWork.block_order_groups): Scene.groups counts groups as the calibration's backward forms
        them (msplat 1.1.3 rasterizes in 8x8 threadgroups), so ours are that many times it. 1 in ledgers without
        the count (the tree before it, whose 16x2 strips a simdgroup it priced as 8x4 blocks: optimistic)."""
        w = self.ledger["kernels"].get("rasterize_bwd", {})
        if w.get("active_groups") and w.get("block_order_groups"):
            return w["active_groups"] / w["block_order_groups"]
        return 1.0

    def step(self, s: Scene, device: str, c: Calib) -> Breakdown:
        led = self.ledger
        g = _Gpu(device, c)
        share = self._order_share()
        ratio = {
            "G": s.gaussians / max(led["n_gaussians"], 1),
            "P": s.pixels / max(led["pixels"], 1),
            "M": s.M / max(led["intersections"], 1),
            "A": s.groups * share / self._measured_groups(),
        }
        launches = sum(w.get("launches", 0) for w in led["kernels"].values())
        b = Breakdown(syncs=led["host_syncs"])
        b.cpu_ms = (led["aten_kernels"] * c.aten_encode_us + launches * c.launch_us) * 1e-3
        b.sync_ms = led["host_syncs"] * c.sync_us * 1e-3
        b.terms["dispatch gaps"] = (led["aten_kernels"] + launches) * c.dispatch_us * 1e-3
        groups = {
            "sort (radix + scan)": ("radix_", "scan_", "bin_sort"),
            "intersect": ("isect_", "bin_"),
            "loss": ("l1_ssim",),
            "project + SH": ("project", "sh_", "covar"),
        }  # fmt: skip (other kernels: a term each)
        for name, w in led["kernels"].items():
            r = ratio[kernel_grows(name)]
            stage = next((k for k, pre in groups.items() if name.startswith(pre)), name)
            threads_steps = w.get("threads", 0) / SIMDGROUP * r
            # the bytes its launches read and wrote where the ledger counted them (ledger.MOVED_BYTES), else the
            # bound buffers'; scaled by what each buffer holds where the ledger says it
            by_kind = w.get("moved_by_kind") or (None if w.get("moved_bytes") else w.get("bytes_by_kind"))
            nbytes = w.get("moved_bytes") or w.get("buffer_bytes", 0)
            mem = g.bytes_ms(sum(b * ratio[k] for k, b in by_kind.items()) if by_kind else nbytes * r)
            if name == "rasterize_fwd":
                compute = g.steps_ms(walk_steps(s) + s.groups) + g.barriers_ms(w.get("barriers", 0) * ratio["M"])
                stage = "rasterize forward"
            elif name == "rasterize_bwd":
                a = ratio["A"]
                compute = (g.steps_ms(walk_steps(s) + MATH_STEPS * s.groups * share)
                           + g.sums_ms(w.get("simd_reductions", 0) * a)
                           + g.atomics_ms(w.get("device_atomics", 0) * a)
                           + g.barriers_ms(w.get("barriers", 0) * ratio["M"]))  # fmt: skip
                stage = "rasterize backward"
            else:
                compute = (g.steps_ms(threads_steps) + g.sums_ms(w.get("simd_reductions", 0) * r)
                           + g.atomics_ms(w.get("device_atomics", 0) * r)
                           + g.tg_atomics_ms(w.get("threadgroup_atomics", 0) * r)
                           + g.barriers_ms(w.get("barriers", 0) * r))  # fmt: skip
            b.terms[stage] = b.terms.get(stage, 0.0) + max(compute, mem)
        aten = 0.0
        for part, nbytes in led["part_bytes"].items():
            if self.rates and part in self.rates:
                per_g, per_p = self.rates[part]
                aten += per_g * s.gaussians + per_p * s.pixels
            else:
                aten += nbytes * (ratio["P"] if part in PIXEL_PARTS else ratio["G"])
        b.terms["aten ops' memory"] = g.bytes_ms(aten)
        return b


# ------------------------------------------------------------------------------------------------
# Published measurements and the fit
# ------------------------------------------------------------------------------------------------
def run_ms(design, iterations: int, final_gaussians: float, width: int, height: int, device: str, c: Calib,
           seed: float = SEED_POINTS, warmup: int = 500, stop_split: Optional[int] = None) -> float:  # fmt: skip
    """Modeled wall time (ms) of a whole run whose gaussian count grows from ``seed`` (until the warm-up
    ends) linearly to ``final_gaussians`` (at ``stop_split``, default iterations / 2), then stays."""
    stop = stop_split if stop_split is not None else iterations // 2
    base = Scene("run", seed, width, height)
    chunk, total = 100, 0.0
    for t0 in range(0, iterations, chunk):
        t = t0 + chunk / 2
        frac = min(max((t - warmup) / max(stop - warmup, 1), 0.0), 1.0)
        g = seed + frac * (final_gaussians - seed)
        total += chunk * design.step(base.with_gaussians(g), device, c).step_ms
    return total


@dataclass
class Point:
    name: str
    source: str
    measured: float  # in ``unit``
    unit: str
    model: Optional[Callable[[Calib], float]]  # modeled value in ``unit``; None: not modeled
    fit: bool = True
    note: str = ""


def points() -> List[Point]:
    M4, full = "M4 Max", (1297, 840)
    s = lambda g, w=1297, h=840: Scene("", g, w, h)  # noqa: E731
    return [
        Point("msplat 1.1.3 garden 7K, full res", "rayanht/msplat README (v1.1.3 table)", 77.0, "s",
              lambda c: run_ms(MSPLAT, 7000, 1.5e6, *full, M4, c) / 1e3,
              note="count 138,766 -> 1.5M (msplat v0.1 CHANGELOG: 1.5M at 7K) by step 3,500"),
        Point("msplat 1.1.3 garden 30K, full res", "rayanht/msplat README (30K table)", 700.0, "s",
              lambda c: run_ms(MSPLAT, 30000, 3.51e6, *full, M4, c) / 1e3, note="3.51M at the end (README)"),
        Point("msplat 1.0 garden 7K", "rayanht/msplat README (performance history)", 107.0, "s",
              lambda c: run_ms(MSPLAT_V10, 7000, 1.5e6, *full, M4, c) / 1e3),
        Point("msplat 1.0 garden 30K", "rayanht/msplat README (performance history)", 1039.0, "s",
              lambda c: run_ms(MSPLAT_V10, 30000, 3.51e6, *full, M4, c) / 1e3),
        Point("msplat 0.1 full res", "rayanht/msplat CHANGELOG v0.1", 17.0, "ms/step",
              lambda c: MSPLAT_V10.step(s(1.5e6), M4, c).step_ms, note="steady step at 1.5M (assumed)"),
        Point("msplat 0.1 at 4x downscale", "rayanht/msplat CHANGELOG v0.1", 3.0, "ms/step",
              lambda c: MSPLAT_V10.step(s(1.5e6, 324, 210), M4, c).step_ms, fit=False,
              note="not reproducible as stated: the count at 4x downscale is not published (the default schedule "
                   "trains at 4x in its first 3,000 steps, while the count grows); 1.5M assumed"),
        Point("fork rast_bwd per-pixel, 500K, 1024 px", "Plinth-it/msplat docs/backward_atomic_reduction.md",
              2.389, "ms", lambda c: FORK_PIXEL.backward_kernel_ms(FORK_SCENE, M4, c),
              note="device not named: M4 Max assumed"),
        Point("fork rast_bwd per-splat, 500K, 1024 px", "Plinth-it/msplat docs/backward_atomic_reduction.md",
              4.894, "ms", lambda c: FORK_SPLAT.backward_kernel_ms(FORK_SCENE, M4, c),
              note="device not named: M4 Max assumed"),
        Point("OpenSplat banana 100 steps, M3 Pro", "issue 30, citing pierotofy/OpenSplat PR #76", 5.9, "s",
              lambda c: 100 * OPENSPLAT.step(s(3.0e4, 480, 360), "M3 Pro", c).step_ms / 1e3, fit=False,
              note="not reproducible: the 5.9 s is a whole run's wall time (image loading, runtime compile of the "
                   "Metal source, first-use graph builds); banana's size is not published (30K points at "
                   "480x360 assumed); the model gives the per-step part only"),
        Point("msplat 1.1.3 bicycle / counter / room 7K", "rayanht/msplat README", 59.0, "s", None, fit=False,
              note="not reproducible: no gaussian count or resolution published for them (74-80 s)"),
        Point("fork rast_bwd at 2048 px (1.265 vs 3.651 ms)", "Plinth-it/msplat docs/backward_atomic_reduction.md",
              1.265, "ms", None, fit=False,
              note="not reproducible: no evaluation or intersection counts published for it (and faster than "
                   "at 1024 px, so not the same scene scaled)"),
        Point("fork end to end 85.5 vs 83.4 it/s", "(issue 30)", 1000 / 85.5, "ms/step", None, fit=False,
              note="not found in the stored versions of the fork's doc; not modeled"),
        Point("Brush garden 5000 steps, 395.7 s MSL / 422.5 s WGSL", "ArthurBrussee/brush commit 362dc394 (PR #519)",
              395.7, "s", None, fit=False,
              note="not reproducible: 'same machine' is not named, the times include the dataset load and drifted "
                   "between runs (the commit says so), count and resolution are not given, and Brush's CubeCL "
                   "kernels are not expressed here"),
    ]  # fmt: skip


def residuals(c: Calib, pts: List[Point]) -> List[float]:
    return [math.log(p.model(c) / p.measured) for p in pts if p.fit and p.model is not None]


# Bounds of the fitted constants: a walk step is at least the ~10 instructions of msplat's per-pixel test
# (sigma, exp, two compares; one instruction per cycle and scheduler); a step's streams reach at most the
# DRAM spec
BOUNDS = {"step_cycles": (10.0, 1e3), "atomic_cycles": (0.1, 1e3), "barrier_cycles": (0.1, 1e3),
          "bw_efficiency": (0.05, 1.0)}  # fmt: skip


def fit(pts: Optional[List[Point]] = None, start: Optional[Calib] = None) -> Tuple[Calib, float]:
    """Least squares in log space over the fitted points, on the log of each FITTED constant. Returns
    the calibration and the RMS of log(modeled / measured)."""
    from scipy.optimize import least_squares

    pts = pts if pts is not None else points()
    c0 = start or Calib()

    def calib(x) -> Calib:
        return replace(c0, **{k: math.exp(v) for k, v in zip(Calib.FITTED, x)})

    lo = [math.log(BOUNDS[k][0]) for k in Calib.FITTED]
    hi = [math.log(BOUNDS[k][1]) for k in Calib.FITTED]
    x0 = [min(max(math.log(getattr(c0, k)), a + 1e-6), b - 1e-6) for k, a, b in zip(Calib.FITTED, lo, hi)]
    res = least_squares(lambda x: residuals(calib(x), pts), x0, bounds=(lo, hi))
    c = calib(res.x)
    r = residuals(c, pts)
    return c, math.sqrt(sum(v * v for v in r) / len(r))


TG_ATOMIC_SHARE = 4  # ASSUMPTION: a threadgroup atomic costs 1 / TG_ATOMIC_SHARE of a device atomic (CONSTANT_NOTES)
# The fit's result, stored so the report prints without refitting (tests check fit() still gives it)
CALIBRATED = Calib(step_cycles=10.0, atomic_cycles=13.87, barrier_cycles=3.291, bw_efficiency=0.6411,
                   tg_atomic_cycles=13.87 / TG_ATOMIC_SHARE)  # fmt: skip
CALIBRATED_RMS = 0.096  # of log(modeled / measured) over the fitted points


# ------------------------------------------------------------------------------------------------
# Reports (markdown)
# ------------------------------------------------------------------------------------------------
CONSTANT_NOTES = {
    "aten_encode_us": "fixed: pytorch#148219 (M1 Pro), between 1.3 us (Metal-shader ops) and 20 us (MPSGraph ops)",
    "launch_us": "fixed: pytorch#148219, dispatch of an op torch implements as a Metal shader",
    "sync_us": "fixed: pytorch#152199, a small op 22.75 us without vs 245 us with torch.mps.synchronize()",
    "dispatch_us": "fixed (assumption): no point resolves it; the Metal-shader encode figure",
    "step_cycles": "fitted, at its floor (~10 instructions of a per-pixel test): the points do not resolve it",
    "atomic_cycles": "fitted: core cycles per device float atomic",
    "tg_atomic_cycles": "fixed (ASSUMPTION): a threadgroup atomic (on-chip memory) at a quarter of the fitted device "
    "atomic; no published Apple figure. Evidence it is cheaper: philipturner/molecular-renderer's Apple-GPU grid "
    "build (BVH+BuildSmall+Cells.metal) went from 710 + 1,600 us to 440 + 1,200 us moving its cell counters to "
    "threadgroup atomics. Sensitivity: priced at the full device cost",
    "barrier_cycles": "fitted: only the fork's per-splat point resolves it (small: per-splat is slower without it)",
    "bw_efficiency": "fitted: share of the DRAM spec (546 GB/s M4 Max) a step's streams reach",
}


def calibration_table(c: Calib = CALIBRATED) -> str:
    lines = ["| measurement | source | measured | modeled | modeled / measured | in fit | note |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in points():
        if p.model is None:
            lines.append(f"| {p.name} | {p.source} | {p.measured:g} {p.unit} | - | - | no | {p.note} |")
            continue
        m = p.model(c)
        lines.append(f"| {p.name} | {p.source} | {p.measured:g} {p.unit} | {m:.3g} {p.unit} | {m / p.measured:.2f} "
                     f"| {'yes' if p.fit else 'no'} | {p.note} |")  # fmt: skip
    return "\n".join(lines)


def constants_table(c: Calib = CALIBRATED) -> str:
    lines = ["| constant | value | how |", "|---|---|---|"]
    for k in ("aten_encode_us", "launch_us", "sync_us", "dispatch_us", "tg_atomic_cycles", *Calib.FITTED):
        v = getattr(c, k)
        extra = f" ({v * DEVICES['M4 Max']['gbps']:.0f} GB/s on an M4 Max)" if k == "bw_efficiency" else ""
        lines.append(f"| {k} | {v:.4g}{extra} | {CONSTANT_NOTES[k]} |")
    return "\n".join(lines)


def design_checks(c: Calib = CALIBRATED) -> Dict[str, Tuple[float, float]]:
    """Peers' design choices, each as (modeled ms with it, modeled ms without it)."""
    s15 = Scene("", 1.5e6, 1297, 840)
    no_sync = replace(OPENSPLAT, syncs=0)
    banana = Scene("", 3.0e4, 480, 360)
    return {
        "per-splat vs per-pixel backward (fork's point, rast_bwd ms)":
            (FORK_SPLAT.backward_kernel_ms(FORK_SCENE, "M4 Max", c), FORK_PIXEL.backward_kernel_ms(FORK_SCENE, "M4 Max", c)),
        "OpenSplat: a sync after every dispatch vs none (step ms)":
            (OPENSPLAT.step(banana, "M3 Pro", c).step_ms, no_sync.step(banana, "M3 Pro", c).step_ms),
        "msplat 1.0 vs 1.1.3 fusions (1.5M, 1297x840, step ms)":
            (MSPLAT_V10.step(s15, "M4 Max", c).step_ms, MSPLAT.step(s15, "M4 Max", c).step_ms),
    }  # fmt: skip


def design_table(c: Calib = CALIBRATED) -> str:
    lines = ["| design choice | modeled with | modeled without | ratio |", "|---|---|---|---|"]
    for k, (a, b) in design_checks(c).items():
        lines.append(f"| {k} | {a:.2f} | {b:.2f} | {a / b:.2f} |")
    return "\n".join(lines)


def compare(
    ledgers: Dict[str, dict], c: Calib = CALIBRATED, scenes=COMPARE_SCENES
) -> Dict[Tuple[str, str], Tuple[float, float]]:
    """(scene, ledger label) -> (ours ms, msplat ms), steady steps on an M4 Max."""
    out = {}
    rates = aten_rates(ledgers)
    for s in scenes:
        ref = MSPLAT.step(s, "M4 Max", c).step_ms
        for label, led in ledgers.items():
            out[(s.name, label)] = (OursFromLedger(ledger_dict(led), rates=rates).step(s, "M4 Max", c).step_ms, ref)
    return out


def compare_table(runs: Dict[str, Dict[str, dict]], c: Calib = CALIBRATED) -> str:
    """``runs``: "before" / "after" -> {ledger label -> ledger}. One row per scene and ledger."""
    lines = ["| scene (M4 Max) | ours from ledger | ledger syncs / aten kernels / launches | ours ms | msplat ms | ours / msplat |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for when, ledgers in runs.items():
        for (scene, label), (ours, ref) in compare(ledgers, c).items():
            led = ledger_dict(ledgers[label])
            launches = sum(w.get("launches", 0) for w in led["kernels"].values())
            lines.append(f"| {scene} | {when}: {label} | {led['host_syncs']} / {led['aten_kernels']} / {launches} "
                         f"| {ours:.1f} | {ref:.1f} | {ours / ref:.2f} |")  # fmt: skip
    return "\n".join(lines)


def ours_levers(led: dict, s: Scene, c: Calib = CALIBRATED, rates=None) -> Dict[str, float]:
    """Our modeled step on ``s`` as it is and with one change at a time (ms): where cutting work pays."""
    led = ledger_dict(led)
    base = OursFromLedger(led, rates=rates).step(s, "M4 Max", c)
    ref = MSPLAT.step(s, "M4 Max", c)
    out = {"as measured": base.step_ms}

    def variant(**terms) -> float:
        b = Breakdown(dict(base.terms), base.cpu_ms, base.sync_ms, base.syncs)
        for k, v in terms.items():
            b.terms[k] = v
        return b.step_ms

    no_sync = Breakdown(dict(base.terms), base.cpu_ms, 0.0, 0)
    out["no host sync (CPU and GPU overlap)"] = no_sync.step_ms
    out["sort + intersect as msplat's (per-tile bins, bitonic in threadgroup memory)"] = variant(
        **{"sort (radix + scan)": ref.terms["binning + sort"], "intersect": 0.0}
    )
    out["aten ops' memory halved (fewer temporaries, fused Adam)"] = variant(
        **{"aten ops' memory": base.terms["aten ops' memory"] / 2}
    )
    atomics_cut = (1 - 9 / 11) * _Gpu("M4 Max", c).atomics_ms(OURS_ATOMICS_PER_GROUP * s.groups)
    out["atomics per group 11 -> 9 (msplat's)"] = base.step_ms - atomics_cut
    per_g = _Gpu("M4 Max", c).bytes_ms(MSPLAT.bytes_per_gaussian * s.gaussians)
    g_terms = {"aten ops' memory"} | {
        "project + SH" if name.startswith(("project", "sh_", "covar")) else name
        for name in led["kernels"]
        if kernel_grows(name) == "G" and name != "isect_count"
    }
    ours_g = sum(base.terms.get(k, 0.0) for k in g_terms)
    as_msplat = {k: per_g * base.terms.get(k, 0.0) / ours_g for k in g_terms}
    out["per-gaussian traffic as msplat's (2.1 KB: fused Adam and SH, no aten temporaries)"] = variant(**as_msplat)
    both = Breakdown(dict(base.terms), base.cpu_ms, 0.0, 0)
    both.terms.update(as_msplat)
    both.terms["sort (radix + scan)"], both.terms["intersect"] = ref.terms["binning + sort"], 0.0
    out["no sync + msplat's sort + msplat's per-gaussian traffic"] = both.step_ms
    # multi-pass launches and padded lists (a step without host syncs plans from capacity bounds): the
    # ledger counts each launch's bound buffers whole, which overstates passes that read a chunk each
    passes = copy.deepcopy(led)
    for name in ("rasterize_fwd", "rasterize_bwd"):
        w = passes["kernels"].get(name, {})
        n = max(w.get("launches", 1), 1)
        for k in ("buffer_bytes", "threads", "barriers"):
            w[k] = w.get(k, 0) / n
    out["rasterize in one pass (one launch's bytes)"] = OursFromLedger(passes, rates=rates).step(s, "M4 Max", c).step_ms
    unpadded = copy.deepcopy(led)
    capacity = unpadded["kernels"].get("isect_finalize", {}).get("threads", 0)
    f = min(1.0, unpadded["intersections"] / capacity) if capacity else 1.0
    for name in ("isect_finalize", "isect_offsets", "isect_pad"):
        w = unpadded["kernels"].get(name, {})
        for k in ("buffer_bytes", "threads"):
            w[k] = w.get(k, 0) * f
    out["intersection lists at their real length (no padding)"] = (
        OursFromLedger(unpadded, rates=rates).step(s, "M4 Max", c).step_ms
    )
    out["msplat 1.1.3 (modeled)"] = ref.step_ms
    return out


def sensitivity(ledgers: Dict[str, dict], c: Calib = CALIBRATED, label: Optional[str] = None) -> str:
    """Markdown: ours / msplat under each assumption changed alone (same calibration), per scene."""
    label = label or ("garden-points 20k 1/4" if "garden-points 20k 1/4" in ledgers else next(iter(ledgers)))
    ours = OursFromLedger(ledger_dict(ledgers[label]), rates=aten_rates(ledgers))
    cases = {
        "as calibrated": (c, lambda s: s),
        "evaluations per pixel x2": (c, lambda s: replace(s, evaluations=2 * s.E)),
        "intersections x2": (c, lambda s: replace(s, intersections=2 * s.M)),
        "sync_us x3 (660 us)": (replace(c, sync_us=3 * c.sync_us), lambda s: s),
        "aten_encode_us 20 (MPSGraph figure)": (replace(c, aten_encode_us=20.0), lambda s: s),
        "dispatch_us 10": (replace(c, dispatch_us=10.0), lambda s: s),
        "atomic_cycles x2": (replace(c, atomic_cycles=2 * c.atomic_cycles), lambda s: s),
        "msplat's binning atomics priced (one per entry, as ours)": (c, lambda s: s),
        "threadgroup atomics at the device atomic cost": (replace(c, tg_atomic_cycles=c.atomic_cycles), lambda s: s),
    }
    peer = {"msplat's binning atomics priced (one per entry, as ours)": MSPLAT_BINNING_ATOMICS}
    lines = [f"| assumption (ours from {label}) | " + " | ".join(s.name for s in COMPARE_SCENES) + " |",
             "|---|" + "---|" * len(COMPARE_SCENES)]  # fmt: skip
    for name, (cc, f) in cases.items():
        cells = []
        for s in COMPARE_SCENES:
            t = f(s)
            ref = peer.get(name, MSPLAT).step(t, "M4 Max", cc).step_ms
            cells.append(f"{ours.step(t, 'M4 Max', cc).step_ms / ref:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
