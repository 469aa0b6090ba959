"""A MODEL of the Metal training step time, not a measurement: the step ledger's counts times
per-operation costs published for Apple GPUs, for scenes the ledger did not run (garden at 1/4 and
full resolution), extrapolated from a measured ledger by gaussians, pixels and intersections.

What it adds up (each term cited or marked as an assumption in COSTS / DEVICES):
- CPU: each aten op that encodes a kernel costs ``aten_encode_us`` (pytorch/pytorch#148219, M1 Pro:
  ~20 us dispatch for MPSGraph-backed ops such as sqrt/log/sin, ~1.3 us for ops torch implements as
  Metal shaders: the model takes 10 us, between the two); each of our kernel launches costs
  ``launch_us`` (the Metal-shader figure of the same issue: torch.mps.compile_shader kernels are
  dispatched the same way).
- GPU, per kernel: the larger of memory time (bytes of its bound buffers, or those its launches move where
  the ledger counts them, ledger.MOVED_BYTES, / DRAM bandwidth) and the
  time of the counted SIMD work: simdgroup reductions at 14.54 cycles (SUM<F32>) and shuffles at
  2.04 cycles per simdgroup instruction, four schedulers per core (philipturner/metal-benchmarks,
  M1 "Intra-simd communication" table and ALU layout); device atomics at ATOMIC_CYCLES and barriers at
  BARRIER_CYCLES per core (assumptions: no published Apple figure found). Arithmetic is not counted, so
  the GPU term is a lower bound for the compute-bound kernels.
- GPU, aten ops: bytes they read and write / DRAM bandwidth.
- Host syncs: with at least one per step the CPU waits for the GPU, so CPU and GPU time add up; with
  none they overlap and the step takes the larger of the two. No fixed latency per sync is added.

Calibrated against the peers (issue 30): peers.py expresses msplat's, the Plinth-it fork's and
OpenSplat's steps from their source, fits the unknown costs to their published Apple-GPU measurements
and models our step from a ledger on the same scenes; ``table`` appends its ours / msplat rows, and
benchmarks/bench_model.py prints the whole calibration (benchmarks/step_model/README.md).

Extrapolation: a kernel's counts scale with gaussians (projection, SH), intersections (tile
intersection and rasterization) or both (the radix sort runs over depths and intersections);
aten bytes of the model/loss scale with pixels, the rest with gaussians; aten op counts and launch
counts do not scale (they do not depend on the scene size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from .ledger import Ledger

# Apple GPUs: cores, clock (GHz), DRAM bandwidth (GB/s)
DEVICES: Dict[str, Dict[str, float]] = {
    # philipturner/metal-benchmarks overview table (M1: 8 cores, 1.278 GHz); Apple's M1 spec: 68.25 GB/s
    "M1": {"cores": 8, "ghz": 1.278, "gbps": 68.25},
    # Apple's M4 Max announcement: 40-core GPU, 546 GB/s; clock 1.678 GHz from a third-party listing
    # (hmc-tech.com, M4 Max), Apple publishes none
    "M4 Max": {"cores": 40, "ghz": 1.678, "gbps": 546.0},
}
SCHEDULERS_PER_CORE = 4  # metal-benchmarks: four schedulers per core, one simd instruction each per cycle
SIMD_SUM_CYCLES = 14.54  # metal-benchmarks, SUM<F32> throughput (cycles per simdgroup instruction)
SHUFFLE_CYCLES = 2.04  # metal-benchmarks, SHUFFLE/BROADCAST32/BALLOT throughput
ATOMIC_CYCLES = 4.0  # ASSUMPTION: one device float atomic retires per 4 core cycles (L2 round trip)
BARRIER_CYCLES = 32.0  # ASSUMPTION: one threadgroup barrier costs 32 core cycles
ATEN_ENCODE_US = 10.0  # pytorch#148219 (M1 Pro): 1.3 us (Metal-shader ops) .. 20 us (MPSGraph ops)
LAUNCH_US = 1.4  # pytorch#148219: dispatch of ops implemented as Metal shaders

# What each of our kernels' work grows with
KERNEL_SCALE = {
    "project_fwd": "gaussians", "project_bwd": "gaussians", "sh_fwd": "gaussians", "sh_bwd": "gaussians",
    "covar_fwd": "gaussians", "covar_bwd": "gaussians", "isect_count": "gaussians",
    "isect_emit": "intersections", "isect_finalize": "intersections", "isect_offsets": "intersections",
    "bin_count": "intersections", "bin_fill": "intersections", "bin_sort": "intersections",
    "rasterize_fwd": "intersections", "rasterize_bwd": "intersections",
    "l1_ssim_fwd": "pixels", "l1_ssim_reduce": "pixels", "l1_ssim_bwd": "pixels",
}  # fmt: skip
PIXEL_PARTS = {"model, loss, camera opt"}

# msplat 1.1.4 (its README): mip-NeRF 360 garden, 7K steps in 77 s on an M4 Max, 25.68 dB
MSPLAT_M4MAX_MS_PER_STEP = 77.0 / 7000 * 1e3


@dataclass
class Scene:
    """Size of a scene's training step: gaussians, rendered pixels, tile intersections."""

    name: str
    gaussians: float
    pixels: float
    intersections: float


# Garden (mip-NeRF 360) at the resolution 3DGS benchmarks train on (1297x840, "images_4"; msplat's
# 77 s), with ~3M gaussians and ~15M intersections (issue 23's estimate), and at 1/4 of that
# resolution (324x210): the same gaussians, each covering ~1 tile (intersections ~ gaussians).
GARDEN_FULL = Scene("garden 1297x840", 3.0e6, 1297 * 840, 15.0e6)
GARDEN_QUARTER = Scene("garden 324x210", 3.0e6, 324 * 210, 3.0e6)


@dataclass
class Modeled:
    cpu_ms: float
    gpu_ms: float
    step_ms: float
    gpu_kernels_ms: float  # our kernels
    gpu_aten_ms: float


def _ratio(kind: str, measured: Scene, target: Scene) -> float:
    g = target.gaussians / max(measured.gaussians, 1)
    m = target.intersections / max(measured.intersections, 1)
    if kind == "gaussians":
        return g
    if kind == "intersections":
        return m
    if kind == "pixels":
        return target.pixels / max(measured.pixels, 1)
    both = measured.gaussians + measured.intersections
    return (target.gaussians + target.intersections) / max(both, 1)


def model_step(ledger: Ledger, target: Scene, device: str) -> Modeled:
    """Modeled time of ``ledger``'s step on ``device`` for a scene of ``target``'s size."""
    d = DEVICES[device]
    core_hz = d["ghz"] * 1e9
    bandwidth = d["gbps"] * 1e9
    measured = Scene("measured", ledger.n_gaussians, ledger.pixels, ledger.intersections)
    kernels_s = 0.0
    for name, w in ledger.kernels.items():
        r = _ratio(KERNEL_SCALE.get(name, "both"), measured, target)
        simd_cycles = (w.simd_reductions * SIMD_SUM_CYCLES + w.simd_shuffles * SHUFFLE_CYCLES) / SCHEDULERS_PER_CORE
        other_cycles = w.device_atomics * ATOMIC_CYCLES + w.barriers * BARRIER_CYCLES
        alu_s = r * (simd_cycles + other_cycles) / (d["cores"] * core_hz)
        mem_s = r * (w.moved_bytes or w.buffer_bytes) / bandwidth  # moved where counted (ledger.MOVED_BYTES)
        kernels_s += max(alu_s, mem_s)
    aten_s = 0.0
    for part, nbytes in ledger.part_bytes.items():
        r = target.pixels / max(measured.pixels, 1) if part in PIXEL_PARTS else _ratio("gaussians", measured, target)
        aten_s += r * nbytes / bandwidth
    cpu_s = (ledger.aten_kernels * ATEN_ENCODE_US + ledger.kernel_launches * LAUNCH_US) * 1e-6
    gpu_s = kernels_s + aten_s
    step_s = cpu_s + gpu_s if ledger.host_syncs > 0 else max(cpu_s, gpu_s)
    return Modeled(cpu_s * 1e3, gpu_s * 1e3, step_s * 1e3, kernels_s * 1e3, aten_s * 1e3)


def table(ledger: Ledger, label: str) -> str:
    """Markdown: modeled ms per step for garden at both sizes on M1 and M4 Max, beside msplat."""
    lines = [
        f"MODEL, not a measurement (benchmarks/step_model/model.py), from the {label} ledger "
        f"({ledger.n_gaussians} gaussians, {ledger.intersections} intersections, {ledger.host_syncs} host syncs, "
        f"{ledger.aten_kernels} aten kernels, {ledger.kernel_launches} launches per step):",
        "",
        "| scene | device | CPU encode ms | GPU ms (our kernels + aten) | modeled step ms | msplat measured |",
        "|---|---|---|---|---|---|",
    ]
    for scene in (GARDEN_QUARTER, GARDEN_FULL):
        for device in DEVICES:
            m = model_step(ledger, scene, device)
            ref = f"{MSPLAT_M4MAX_MS_PER_STEP:.1f} ms" if (device == "M4 Max" and scene is GARDEN_FULL) else ""
            lines.append(
                f"| {scene.name} | {device} | {m.cpu_ms:.1f} | {m.gpu_ms:.1f} ({m.gpu_kernels_ms:.1f} + "
                f"{m.gpu_aten_ms:.1f}) | {m.step_ms:.1f} | {ref} |"
            )
    lines += ["", calibrated_table(ledger)]
    return "\n".join(lines)


def calibrated_table(ledger: Ledger) -> str:
    """Markdown: the calibrated model's (peers.py) ours / msplat for ``ledger`` on issue 30's scenes."""
    from . import peers

    lines = ["Calibrated on the peers' measurements (peers.py; M4 Max; `python benchmarks/bench_model.py`):", "",
             "| scene | ours modeled ms | msplat modeled ms | ours / msplat |", "|---|---|---|---|"]  # fmt: skip
    for (scene, _), (ours, ref) in peers.compare({"ledger": peers.ledger_dict(ledger)}).items():
        lines.append(f"| {scene} | {ours:.1f} | {ref:.1f} | {ours / ref:.2f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# At the sizes people train (issue 36): counts from the scale ledger, not scaled from 20k
# ------------------------------------------------------------------------------------------------
# The calibrated model (peers.OursFromLedger) takes a 20k step ledger's launch and aten counts as they are
# and scales its kernels' bytes by gaussians or intersections. At 1.5M gaussians the step that ran before
# issue 36 issued 4,112 launches and 71,094 aten ops per render (scale_ledger.py), which that
# reading could not see. ``at_scale`` corrects a step ledger with the scale ledger of the same tree:
# - launches of the render's kernels (projection to loss, forward and backward): the scale ledger's at the
#   target size; the rest of the step's (train.metal) the step ledger's;
# - aten kernels: the step ledger's plus what the scale ledger's render step at the target size issues
#   beyond its 20k render (`base20k`, of the tree the step ledger was measured on);
# - our kernels' bound bytes and threads: the scale ledger's at the target size (per intersection, per
#   gaussian, per pixel: each buffer by what it holds, scale_ledger.bytes_by_kind; scaled by the model's own
#   scene from there, not from 20k); the rasterizer's bytes are one
#   launch's (each pass or band binds every buffer whole but reads its share: the bound bytes of all its
#   launches would count the per-gaussian and per-pixel buffers once per launch);
# - bin_count's atomics: the scale ledger's where it has them (count-only mode records bin_count's from the host
#   model of its threadgroup histograms: one device atomic per (group, tile) touched does not scale with the
#   intersections as a 20k ledger's count would be scaled);
# - Adam's bytes as accesses: a fused Adam reads parameter, gradient and two moments and writes three of
#   them (7 accesses of a parameter's size; msplat's are counted so in peers.py); the step ledger counts
#   each tensor argument once (4), so the optimizer's aten bytes are taken x 7/4.
ADAM_ACCESSES = 7 / 4
# msplat's exactness at these sizes (its source, rayanht/msplat core/metal/msplat_metal.mm and
# msplat_metal.metal MAX_TILE_ELEMS): a 16x16 tile holds at most 2,048 entries; past that, entries are
# dropped in the order its atomics scattered them. The model prices msplat's step as it runs, drops included.
MSPLAT_TILE_CAP = 2048


def at_scale(step: dict, scale: dict, base20k: dict) -> dict:
    """``step`` (a peers.ledger_dict of a 20k step ledger) with launch counts, aten kernels and kernel bytes
    from ``scale`` (a scale-ledger row of the target size, scale_ledger.py as_dict), relative to
    ``base20k`` (the scale-ledger row at 20k gaussians, same image, of the tree ``step`` was measured on)."""
    import copy

    from .peers import kernel_grows

    out = copy.deepcopy(step)
    out["aten_kernels"] = step["aten_kernels"] + scale["aten_kernels"] - base20k["aten_kernels"]
    ref = {"G": ("n_gaussians",), "M": ("intersections",), "P": ("pixels",), "A": ("intersections",)}
    for name in set(base20k["kernels"]) - set(scale["kernels"]):  # render kernels this tree no longer issues
        out["kernels"].pop(name, None)
    for name in set(out["kernels"]) | set(scale["kernels"]):
        w = out["kernels"].setdefault(name, {})
        sw = scale["kernels"].get(name, {})
        if name in scale["kernels"]:
            w["launches"] = sw.get(
                "launches", 0
            )  # bytes and threads as the scale ledger counted them, rescaled by peers
            (k,) = ref[kernel_grows(name)]
            f = step[k] / max(scale[k], 1)
            share = 1 / max(sw.get("launches", 1), 1) if name.startswith("rasterize") else 1
            # (passes and bands of the rasterizer each bind every buffer whole and read their share)
            w["buffer_bytes"] = sw.get("buffer_bytes", 0) * share * f
            if "bytes_by_kind" in sw:  # each part scaled by what it holds: gaussians, pixels, intersections
                kinds = {"G": "n_gaussians", "P": "pixels", "M": "intersections"}
                w["bytes_by_kind"] = {
                    kind: b * share * step[kinds[kind]] / max(scale[kinds[kind]], 1)
                    for kind, b in sw["bytes_by_kind"].items()
                }
                w["buffer_bytes"] = sum(w["bytes_by_kind"].values())
            # what its launches read and wrote (ledger.MOVED_BYTES: bin_sort, scan_block_sums), alike
            w.pop("moved_bytes", None), w.pop("moved_by_kind", None)
            if "moved_by_kind" in sw:
                kinds = {"G": "n_gaussians", "P": "pixels", "M": "intersections"}
                w["moved_by_kind"] = {kind: b * step[kinds[kind]] / max(scale[kinds[kind]], 1)
                                      for kind, b in sw["moved_by_kind"].items()}  # fmt: skip
                w["moved_bytes"] = sum(w["moved_by_kind"].values())
            elif "moved_bytes" in sw:
                w["moved_bytes"] = sw["moved_bytes"] * f
            w["threads"] = sw.get("threads", 0) * f
            for k in ("device_atomics", "threadgroup_atomics"):  # where the scale ledger counted them (bin_count:
                if k in sw:  # its host model, scale_ledger.expected_bin_atomics), theirs at the target size
                    w[k] = sw[k] * f
    out["part_bytes"] = dict(step["part_bytes"])
    if "optimizer" in out["part_bytes"]:
        out["part_bytes"]["optimizer"] *= ADAM_ACCESSES
    return out


MSPLAT_BYTES_PER_GAUSSIAN = 2100  # peers.py MSPLAT: msplat 1.1.3's bytes a gaussian a step, from its source


def bytes_per_gaussian(step: dict, scale: dict) -> Dict[str, float]:
    """Bytes a steady training step moves per gaussian, counted as msplat's ~2,100 are (peers.MSPLAT: every
    buffer a kernel binds, in-place ones twice), from two counters CI runs: the render's kernels at the scale
    ledger's size (``scale``: a scale_ledger.as_dict row; the per-gaussian part of each kernel's buffers,
    ``bytes_by_kind["G"]``; the rasterizer's bands each bind its buffers whole and read their share, so one
    launch's), the step's kernels outside the render (``step``: a peers.ledger_dict of a steady
    step ledger; Adam, the densification statistics), and the aten ops' per-gaussian bytes (the step ledger's
    parts that grow with gaussians; torch's Adam counted as accesses, ADAM_ACCESSES). Returns each source's
    bytes a gaussian by kernel or part, and "total"."""
    from .peers import PIXEL_PARTS, kernel_grows

    out: Dict[str, float] = {}
    n_scale, n_step = max(scale["n_gaussians"], 1), max(step["n_gaussians"], 1)
    for name, w in scale["kernels"].items():
        by_kind = w.get("moved_by_kind") or w.get("bytes_by_kind")  # what it moves where counted (MOVED_BYTES)
        b = (
            by_kind.get("G", 0)
            if by_kind is not None
            else (w.get("buffer_bytes", 0) if kernel_grows(name) == "G" else 0)
        )
        share = 1 / max(w.get("launches", 1), 1) if name.startswith("rasterize") else 1  # as at_scale: bands
        out[f"render: {name}"] = b * share / n_scale
    for name, w in step["kernels"].items():
        if name not in scale["kernels"] and kernel_grows(name) == "G":
            out[f"step: {name}"] = (w.get("moved_bytes") or w.get("buffer_bytes", 0)) / n_step
    for part, b in step["part_bytes"].items():
        if part not in PIXEL_PARTS:
            out[f"aten: {part}"] = b * (ADAM_ACCESSES if part == "optimizer" else 1) / n_step
    out = {k: v for k, v in out.items() if v > 0}
    out["total"] = sum(out.values())
    return out


def scale_compare_table(step: dict, before: dict, after: dict, c=None, msplat=None) -> str:
    """Markdown: ours / msplat at issue 30's scenes (peers.COMPARE_SCENES), from the 20k step ledger
    ``step`` corrected by the scale ledgers ``before`` and ``after`` (scale_ledger.key -> as_dict row;
    ``before`` is of the tree ``step`` was measured on); ``c``: the calibration (peers.CALIBRATED);
    ``msplat``: its design (peers.MSPLAT, or the sensitivity peers.MSPLAT_BINNING_ATOMICS)."""
    from . import peers

    c = c or peers.CALIBRATED
    msplat = msplat or peers.MSPLAT

    lines = [
        "| scene (M4 Max) | scale ledger | launches / aten kernels per render | bytes a gaussian (msplat ~2,100) "
        "| ours ms | msplat ms | ours / msplat |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in peers.COMPARE_SCENES:
        k = f"{int(s.gaussians)} {s.width}x{s.height}"
        base = before.get(f"20000 {s.width}x{s.height}")
        if base is None:  # no scale ledger of the step ledger's tree at this image
            continue
        ref = msplat.step(s, "M4 Max", c).step_ms
        for when, rows in (("before", before), ("after", after)):
            if k not in rows:
                continue
            row = rows[k]
            ours = peers.OursFromLedger(at_scale(step, row, base)).step(s, "M4 Max", c).step_ms
            launches = sum(w.get("launches", 0) for w in row["kernels"].values())
            per_g = bytes_per_gaussian(step, row)["total"]
            lines.append(f"| {s.name} | {when} | {launches:,} / {row['aten_kernels']:,} | {per_g:,.0f} | {ours:.1f} | {ref:.1f} "
                         f"| {ours / ref:.2f} |")  # fmt: skip
    return "\n".join(lines)


def scale_terms_table(step: dict, rows: dict, c=None) -> str:
    """Markdown: our modeled GPU terms (ms) at issue 30's scenes (peers.COMPARE_SCENES), from the 20k step
    ledger ``step`` corrected by the scale ledgers ``rows`` (of the same tree), as scale_compare_table prices them."""
    from . import peers

    c = c or peers.CALIBRATED

    found = {}
    for s in peers.COMPARE_SCENES:
        k, base = f"{int(s.gaussians)} {s.width}x{s.height}", rows.get(f"20000 {s.width}x{s.height}")
        if k in rows and base is not None:
            found[s.name] = peers.OursFromLedger(at_scale(step, rows[k], base)).step(s, "M4 Max", c)
    names = sorted(
        {t for b in found.values() for t in b.terms}, key=lambda t: -max(b.terms.get(t, 0) for b in found.values())
    )
    lines = ["| our term (ms) | " + " | ".join(found) + " |", "|---|" + "---|" * len(found)]
    lines += [f"| {t} | " + " | ".join(f"{b.terms.get(t, 0.0):.2f}" for b in found.values()) + " |" for t in names]
    return "\n".join(lines)


def main(argv=None) -> None:
    """python benchmarks/bench_step_model.py --step STEP.json --before A.json [..] --after B.json [..]"""
    import argparse
    import json

    ap = argparse.ArgumentParser(description="ours / msplat at 500k-3M gaussians from a step ledger and scale ledgers")
    ap.add_argument("--step", required=True, help="step ledgers (benchmarks/bench_model.py --write-ledger)")
    ap.add_argument("--label", default="garden-points 20k 1/4", help="which ledger of --step")
    ap.add_argument("--before", nargs="+", required=True, help="scale ledgers (scale_ledger --json) of --step's tree")
    ap.add_argument("--after", nargs="+", required=True, help="scale ledgers of this tree")
    ap.add_argument("--terms", action="store_true", help="also our modeled terms with the --before ledgers")
    ap.add_argument("--after-terms", action="store_true", help="also our modeled terms with the --after ledgers")
    ap.add_argument("--tg-atomics-at-device-cost", action="store_true",
                    help="sensitivity: threadgroup atomics priced as device atomics (peers.CALIBRATED prices them at "
                         "1 / peers.TG_ATOMIC_SHARE of one, an assumption)")  # fmt: skip
    ap.add_argument("--msplat-binning-atomics", action="store_true",
                    help="sensitivity: msplat's binning atomics priced at the fitted atomic cost, one per entry "
                         "(peers.MSPLAT_BINNING_ATOMICS; the calibrated design prices them at nothing)")  # fmt: skip
    args = ap.parse_args(argv)
    from dataclasses import replace

    from . import peers

    c = peers.CALIBRATED
    if args.tg_atomics_at_device_cost:
        c = replace(c, tg_atomic_cycles=c.atomic_cycles)

    def load(paths):
        out = {}
        for p in paths:
            out.update(json.loads(open(p).read()))
        return out

    step = json.loads(open(args.step).read())[args.label]
    print("MODEL, not a measurement (model.py at_scale, calibrated as peers.py), M4 Max; "
          f"ours from the {args.label} step ledger with the render's counts of the scale ledger:\n")  # fmt: skip
    msplat = peers.MSPLAT_BINNING_ATOMICS if args.msplat_binning_atomics else peers.MSPLAT
    print(scale_compare_table(step, load(args.before), load(args.after), c, msplat))
    if args.terms:
        print("\nOur modeled terms, the step ledger with the --before scale ledgers:\n")
        print(scale_terms_table(step, load(args.before), c))
    if args.after_terms:
        print("\nOur modeled terms, the step ledger with the --after scale ledgers:\n")
        print(scale_terms_table(step, load(args.after), c))


if __name__ == "__main__":
    main()
