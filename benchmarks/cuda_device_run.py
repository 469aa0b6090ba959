"""Everything the CUDA path needs measured on a real NVIDIA GPU, in one call, results in one folder.

    bash benchmarks/cuda_device_run.sh --prepare     # here (network): wheels + garden data -> .cuda-carry/
    bash benchmarks/cuda_device_run.sh               # on the GPU machine: installs .cuda-carry/, runs this
    bash benchmarks/cuda_device_run.sh --stages build,overhead,commands   # a part of it
    python benchmarks/cuda_device_run.py --out DIR   # the same without the wrapper (deps already importable)
    python benchmarks/cuda_device_run.py --cpu-dry-run --out DIR   # any machine: the CUDA parts skipped

Stages, in order; each writes its results as soon as it ends (results.json, summary.md), so a run
cut short still leaves every finished stage behind:
  env       machine, GPU, driver, nvcc, torch, gsplat, numpy versions
  build     gsplat 1.4's CUDA kernels, JIT-compiled once with MAX_JOBS = all cores, only for this
            GPU's architecture (TORCH_CUDA_ARCH_LIST), timed
  parity    reference (CPU and CUDA) and cpu backends vs gsplat on CUDA, through the public op, on
            random scenes and the garden cameras: forward (colours, alphas, radii) and backward (means,
            quats, scales, opacities, colours/SH, viewmats, backgrounds, means2d.grad, absgrad);
            RGB and RGB+ED, classic and antialiased, square and non-square -> parity.csv
  overhead  the op layer (backend "auto" -> gsplat) vs gsplat's rasterization called directly, the
            same splatfacto-like call forward + backward, alternating, median ratio (goal <= 1.02)
            -> overhead.csv
  training  benchmarks/cuda_vs_splatfacto.py (step time and peak memory vs stock splatfacto) and
            benchmarks/bench_memory.py --device cuda with the memory hooks on and off -> memory.csv,
            their output in training.log
  commands  the user's commands on the GPU (each in a subprocess, output in training.log): ns-train
            splat-metal twice alike (the GPU's own nondeterminism: float atomics), the same run Ctrl-C'd
            once a checkpoint exists and resumed with the command it prints (its final checkpoint
            against the uninterrupted run's, beside the two uninterrupted runs' difference), ns-train
            splat-metal-mcmc on the demo scene shot through an OPENCV lens with per-frame intrinsics,
            splat-metal-export in every format (+ ns-export where open3d is installed) from the first
            run -> exports.tar (decoded afterwards by benchmarks/cuda_decode_exports.py, on a machine
            with the formats' own tools), and ns-viewer on that run answering one HTTP request and
            one websocket camera message with its render (viewer_round_trip)

Each stage has a time cap (--parity-s, --overhead-s, --training-s, --commands-s) and every stage ends by
--budget-s (none starts with less than 15 s of it left); parity and overhead stop between cases
when their time is up and say what was left. --stages picks a subset for a rerun.
At most 8 files land in --out (what the device tool brings back). --cpu-dry-run runs the same code
on CPU: parity becomes cpu vs reference on small cases, overhead times the cpu backend against the
reference (the harness only; its ratio is no overhead figure), build is skipped, training runs
only with --with-training and commands (small: 40 steps at 40x30) only with --with-commands. Exit status 0 unless a stage failed (a mismatch is reported, not fatal).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))  # the shared scene generators
sys.path.insert(0, str(ROOT))

from bench_step import cpu_model, with_sh  # noqa: E402
from cli_helpers import (  # noqa: E402
    checkpoint_differences,
    checkpoint_step,
    checkpoints,
    cli_env,
    demo_args,
    executable,
    final_checkpoint,
    interrupt_after_checkpoint,
    run_dir,
    tensorboard_scalars,
)
from scenes import GARDEN_PATH, Scene, garden_scene, load_garden, random_scene  # noqa: E402

from splat_metal_method.ops import BackendUnavailable, rasterization  # noqa: E402

CARRY = ROOT / ".cuda-carry"  # what `cuda_device_run.sh --prepare` fills (git-ignored)
STAGES = ("env", "build", "parity", "overhead", "training", "commands")
# Inputs whose gradients are compared. Ks is left out: gsplat 1.4 returns no gradient for it.
GRAD_INPUTS = ("means", "quats", "scales", "opacities", "colors", "viewmats", "backgrounds")
FORWARD = ("colors", "alphas")
PARITY_COLUMNS = ("quantity", "shape", "max_abs", "scale", "rel_max", "rel_l2", "differing", "tol", "ok", "note")
# Tolerances relative to the largest entry of each quantity: forward as the doctor's 1e-4, gradients
# as its 1e-3 (GPU float atomics reorder the sums, and gsplat builds with --use_fast_math).
FWD_RTOL, BWD_RTOL = 1e-4, 1e-3
OVERHEAD_GOAL = 1.02
# What splatfacto passes to rasterization (nerfstudio 1.1.5 splatfacto.get_outputs); it adds the
# background itself, after rendering.
SPLATFACTO_CALL = dict(
    packed=False,
    near_plane=0.01,
    far_plane=1e10,
    render_mode="RGB+ED",
    sh_degree=3,
    sparse_grad=False,
    absgrad=True,
    rasterize_mode="classic",
)


class StageTimeout(Exception):
    """A stage's cap was reached between two of its cases."""


class Results:
    """results.json and summary.md in ``out``, rewritten whenever a stage or a parity case ends;
    CSV files there, one row flushed at a time."""

    def __init__(self, out: Path, mode: str):
        self.out = out
        self.data = {
            "script": "benchmarks/cuda_device_run.py",
            "mode": mode,
            "argv": sys.argv[1:],
            "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "stages": {},
        }
        self._csv: Dict[str, tuple] = {}

    def stage(self, name: str) -> dict:
        return self.data["stages"].setdefault(name, {"status": "running"})

    def csv_row(self, name: str, row: dict) -> None:
        if name not in self._csv:
            f = open(self.out / f"{name}.csv", "w", newline="")
            writer = csv.DictWriter(f, fieldnames=list(row))
            writer.writeheader()
            self._csv[name] = (f, writer)
        f, writer = self._csv[name]
        writer.writerow(row)
        f.flush()

    def write(self) -> None:
        tmp = self.out / ".results.json.partial"
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.out / "results.json")
        (self.out / "summary.md").write_text(summary(self.data))


# ----------------------------------------------------------------------------------------------- env
def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command(cmd: List[str]) -> Optional[str]:
    if shutil.which(cmd[0]) is None:
        return None
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return res.stdout.strip() if res.returncode == 0 else None


def stage_env(ctx) -> dict:
    info = {
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "numpy": _version("numpy"),
        "gsplat": _version("gsplat"),
        "nerfstudio": _version("nerfstudio"),
        "open3d": _version("open3d"),
        "splat_metal": __import__("splat_metal_method").__version__,
        "gsplat_path": str(Path(importlib.util.find_spec("gsplat").origin).parent)
        if importlib.util.find_spec("gsplat")
        else None,
        "commit": _command(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
    }
    nvcc = _command(["nvcc", "--version"])
    info["nvcc"] = nvcc.splitlines()[-1] if nvcc else None
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
        )
        info["nvidia_smi"] = _command(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        )
    return info


# --------------------------------------------------------------------------------------------- build
def stage_build(ctx) -> dict:
    """JIT-compiles gsplat's CUDA extension (or loads the one built earlier on this machine)."""
    major, minor = torch.cuda.get_device_capability(0)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")  # this GPU only: a fraction of the time
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count()))  # gsplat's own default is 10
    t0 = time.perf_counter()
    from gsplat.cuda._backend import _C  # noqa: PLC0415  (importing it builds the extension)

    seconds = time.perf_counter() - t0
    if _C is None:
        raise RuntimeError("gsplat found no CUDA toolkit (nvcc not on PATH): its CUDA kernels are unavailable")
    ctx.gsplat_ok = True
    return {
        "build_seconds": round(seconds, 1),
        "max_jobs": os.environ["MAX_JOBS"],
        "torch_cuda_arch_list": os.environ["TORCH_CUDA_ARCH_LIST"],
        "module": getattr(_C, "__file__", None),
    }


# -------------------------------------------------------------------------------------------- parity
def sh_scene(scene: Scene, degree: int, seed: int = 0) -> Scene:
    """``scene`` with SH colours of ``degree`` (DC from its RGB; bench_step.with_sh makes degree 3,
    band 4's 9 coefficients are drawn as its higher bands are)."""
    scene = with_sh(scene, seed)
    if degree == 4:
        band4 = 0.05 * torch.randn(scene.N, 9, 3, generator=torch.Generator().manual_seed(seed + 1))
        scene.colors = torch.cat([scene.colors, band4.to(scene.colors.dtype)], dim=1)
    scene.colors = scene.colors[:, : (degree + 1) ** 2].contiguous()
    scene.sh_degree = degree
    return scene


def parity_cases(small: bool, garden: Optional[dict]) -> List[tuple]:
    """(name, scene, rasterization kwargs): random scenes, then the real garden cameras."""
    n = (lambda k: max(k // 10, 50)) if small else (lambda k: k)
    cases = [
        (
            "random 61x37 RGB classic",
            random_scene(n(400), C=2, width=61, height=37, seed=1, backgrounds=True),
            dict(render_mode="RGB"),
        ),
        (
            "random 61x37 SH3 RGB+ED classic",
            sh_scene(random_scene(n(400), C=2, width=61, height=37, seed=2, backgrounds=True), 3),
            dict(render_mode="RGB+ED"),
        ),
        (
            "random 61x37 SH3 RGB+ED antialiased",
            sh_scene(random_scene(n(400), C=2, width=61, height=37, seed=3, backgrounds=True), 3),
            dict(render_mode="RGB+ED", rasterize_mode="antialiased"),
        ),
        (
            "random 23x41 SH1 RGB antialiased",
            sh_scene(random_scene(n(300), C=2, width=23, height=41, seed=4), 1),
            dict(render_mode="RGB", rasterize_mode="antialiased"),
        ),
        (
            "random 16x16 SH2 RGB+ED classic",
            sh_scene(random_scene(n(200), C=1, width=16, height=16, seed=5), 2),
            dict(render_mode="RGB+ED"),
        ),
        (
            "random 64x40 dense (stop rule) RGB classic",
            random_scene(
                n(600),
                C=1,
                width=64,
                height=40,
                seed=6,
                opacity_range=(0.9, 1.0),
                scale_range=(0.2, 0.6),
                backgrounds=True,
            ),
            dict(render_mode="RGB"),
        ),
        (
            "random 200x120 5k SH3 RGB+ED antialiased",
            sh_scene(
                random_scene(
                    n(5000),
                    C=2,
                    width=200 // (4 if small else 1),
                    height=120 // (4 if small else 1),
                    seed=7,
                    scale_range=(0.01, 0.1),
                    backgrounds=True,
                ),
                3,
            ),
            dict(render_mode="RGB+ED", rasterize_mode="antialiased"),
        ),
        (  # SH degree 4 (25 coefficients a channel): gsplat 1.4 and our kernels both evaluate band 4
            "random 61x37 SH4 RGB+ED classic",
            sh_scene(random_scene(n(400), C=2, width=61, height=37, seed=8, backgrounds=True), 4),
            dict(render_mode="RGB+ED"),
        ),
        (
            "random 37x53 SH4 RGB antialiased",
            sh_scene(random_scene(n(300), C=1, width=37, height=53, seed=9), 4),
            dict(render_mode="RGB", rasterize_mode="antialiased"),
        ),
    ]
    if garden is not None:
        for name, degree, kw in (
            ("RGB RGB+ED classic", None, dict(render_mode="RGB+ED")),
            ("SH3 RGB+ED antialiased", 3, dict(render_mode="RGB+ED", rasterize_mode="antialiased")),
        ):
            scene = garden_scene(garden, n=1000 if small else 30_000, seed=1)
            if small:  # 1/8 resolution, one camera: seconds on a laptop
                scene.Ks = scene.Ks.clone()  # garden_scene's Ks share memory with the loaded arrays
                scene.Ks[:, :2] /= 8
                scene.width, scene.height = scene.width // 8, scene.height // 8
                scene.viewmats, scene.Ks = scene.viewmats[:1], scene.Ks[:1]
            scene.backgrounds = torch.rand(scene.C, 3, generator=torch.Generator().manual_seed(2))
            if degree is not None:
                scene = sh_scene(scene, degree)
            cases.append((f"garden {scene.width}x{scene.height} {scene.N // 1000}k x{scene.C} cams {name}", scene, kw))
    return cases


def render(scene: Scene, backend: str, device: str, **kw) -> dict:
    """Forward + backward of a fixed random weighting of colours and alphas; returns float64 CPU
    copies of the outputs, radii, every compared gradient, means2d.grad and absgrad."""
    inputs = {k: v.detach().to(device, copy=True).requires_grad_(k in GRAD_INPUTS) for k, v in scene.tensors().items()}
    colors, alphas, meta = rasterization(**scene.kwargs(**inputs), backend=backend, absgrad=True, packed=False, **kw)
    meta["means2d"].retain_grad()
    g = torch.Generator().manual_seed(3)
    weights = torch.randn(colors.shape, generator=g).to(device), torch.rand(alphas.shape, generator=g).to(device)
    ((colors * weights[0]).sum() + (alphas * weights[1]).sum()).backward()
    out = {
        "colors": colors,
        "alphas": alphas,
        "radii": meta["radii"],
        "means2d.grad": meta["means2d"].grad,
        "absgrad": getattr(meta["means2d"], "absgrad", None),
    }
    out.update({f"{k}.grad": v.grad for k, v in inputs.items() if v.requires_grad})
    if device == "cuda":
        torch.cuda.synchronize()
    return {k: None if v is None else v.detach().to("cpu", torch.float64) for k, v in out.items()}


def compare(got: dict, want: dict) -> List[dict]:
    """One row per quantity: max |got - want|, the largest |want|, their ratio, relative L2 error."""
    rows = []
    for k in want:
        row = {"quantity": k, "shape": "x".join(map(str, want[k].shape)) if want[k] is not None else ""}
        if want[k] is None or got.get(k) is None:
            both = want[k] is None and got.get(k) is None
            row.update(ok=both, note="absent on both sides" if both else "missing on one side")
        elif got[k].shape != want[k].shape:
            row.update(ok=False, note=f"shape {'x'.join(map(str, got[k].shape))} here")
        elif k == "radii":  # integers: how many differ (a pixel's rounding at the cull edge), by how much
            diff = (got[k] - want[k]).abs()
            row.update(
                max_abs=float(diff.max()) if diff.numel() else 0.0,
                differing=int((diff > 0).sum()),
                rel_max=float((diff > 0).double().mean()) if diff.numel() else 0.0,
                ok=True,
            )
        else:
            diff = got[k] - want[k]
            scale = float(want[k].abs().max()) if want[k].numel() else 0.0
            max_abs = float(diff.abs().max()) if diff.numel() else 0.0
            rel_max = max_abs / scale if scale > 0 else max_abs
            rel_l2 = float(diff.norm() / want[k].norm()) if float(want[k].norm()) > 0 else float(diff.norm())
            tol = FWD_RTOL if k in FORWARD else BWD_RTOL
            row.update(
                max_abs=max_abs,
                scale=scale,
                rel_max=rel_max,
                rel_l2=rel_l2,
                tol=tol,
                finite=bool(torch.isfinite(got[k]).all()),
                ok=bool(torch.isfinite(got[k]).all()) and rel_max <= tol,
            )
        rows.append(row)
    return rows


def garden_file(args) -> Path:
    """--garden, else ../shared/data's file, else the copy `cuda_device_run.sh --prepare` carries."""
    return args.garden or next((p for p in (GARDEN_PATH, CARRY / GARDEN_PATH.name) if p.exists()), GARDEN_PATH)


def stage_parity(ctx) -> dict:
    garden_path = garden_file(ctx.args)
    garden = load_garden(garden_path)
    backends = [("reference", "cpu"), ("cpu", "cpu")]
    if ctx.cuda:
        backends.append(("reference", "cuda"))
        if ctx.gsplat_ok:
            backends.append(("gsplat", "cuda"))
    target = "gsplat/cuda" if ctx.gsplat_ok else "reference/cpu"  # what every other backend is compared with
    result = ctx.results.stage("parity")  # filled in as the cases run
    result.update(
        {
            "target": target,
            "backends": [f"{b}/{d}" for b, d in backends],
            "tolerances": {"forward": FWD_RTOL, "backward": BWD_RTOL},
            "garden": str(garden_path) if garden else f"not found at {garden_path}: garden cases skipped",
            "cases": [],
            "not_run": [],
        }
    )
    cases = parity_cases(ctx.args.cpu_dry_run, garden)
    for i, (name, scene, kw) in enumerate(cases):
        if time.monotonic() > ctx.stage_deadline:
            result["not_run"] = [c[0] for c in cases[i:]]
            raise StageTimeout(f"parity cap reached: {len(cases) - i} of {len(cases)} cases not run")
        outs, seconds = {}, {}
        case = {
            "case": name,
            "gaussians": scene.N,
            "cameras": scene.C,
            "size": f"{scene.width}x{scene.height}",
            "kwargs": kw,
            "seconds": seconds,
            "comparisons": {},
        }
        for backend, device in backends:
            label = f"{backend}/{device}"
            t0 = time.perf_counter()
            try:
                outs[label] = render(scene, backend, device, **kw)
            except BackendUnavailable as e:
                case.setdefault("unavailable", {})[label] = str(e)
            except Exception:  # noqa: BLE001  (a backend that breaks on this device is a finding: record it, go on)
                case.setdefault("errors", {})[label] = traceback.format_exc()[-3000:]
                print(f"[parity] {name}: {label} failed:\n{case['errors'][label]}", flush=True)
            seconds[label] = round(time.perf_counter() - t0, 3)
        pairs = [(b, target) for b in outs if b != target] + (
            [("cpu/cpu", "reference/cpu")] if target != "reference/cpu" else []
        )
        for got, want in pairs:
            if got not in outs or want not in outs:
                continue
            rows = compare(outs[got], outs[want])
            for row in rows:
                ctx.results.csv_row(
                    "parity",
                    {"case": name, "backend": got, "against": want, **{k: row.get(k, "") for k in PARITY_COLUMNS}},
                )
            graded = [r for r in rows if "tol" in r]
            worst = max(
                graded, key=lambda r: r["rel_max"] / r["tol"], default={"quantity": "-", "rel_max": 0.0, "tol": 1.0}
            )
            case["comparisons"][f"{got} vs {want}"] = {
                "ok": all(r["ok"] for r in rows),
                "worst": {k: worst[k] for k in ("quantity", "rel_max", "tol")},
                "radii_differing": next((r["differing"] for r in rows if r["quantity"] == "radii"), None),
                "failing": [r["quantity"] for r in rows if not r["ok"]],
            }
        result["cases"].append(case)
        ctx.results.write()
        print(
            f"[parity] {name}: "
            + "; ".join(
                f"{k}: {'ok' if v['ok'] else 'MISMATCH ' + ','.join(v['failing'])} "
                f"(worst {v['worst']['quantity']} {v['worst']['rel_max']:.1e})"
                for k, v in case["comparisons"].items()
            ),
            flush=True,
        )
    result["all_ok"] = all(c["ok"] for case in result["cases"] for c in case["comparisons"].values()) and not any(
        case.get("errors") for case in result["cases"]
    )
    return result


# ------------------------------------------------------------------------------------------ overhead
def _step(fn: Callable, leaves: dict, fixed: dict, sync: Callable) -> float:
    """Seconds for one splatfacto-like forward + backward through ``fn``."""
    for v in leaves.values():
        v.grad = None
    sync()
    t0 = time.perf_counter()
    colors, alphas, meta = fn(**leaves, **fixed, **SPLATFACTO_CALL)
    meta["means2d"].retain_grad()  # as splatfacto's strategy does
    (colors.sum() + alphas.sum()).backward()
    sync()
    return time.perf_counter() - t0


def stage_overhead(ctx) -> dict:
    if ctx.gsplat_ok:
        from gsplat.rendering import rasterization as gsplat_rasterization  # noqa: PLC0415

        device, impls = (
            "cuda",
            {
                "op layer (auto)": lambda **kw: rasterization(**kw, backend="auto"),
                "gsplat direct": gsplat_rasterization,
            },
        )
        sync = torch.cuda.synchronize
        note = "the same call to splat-metal's op layer and to gsplat.rendering.rasterization"
    elif ctx.args.cpu_dry_run:
        device, impls = (
            "cpu",
            {
                "op layer (cpu)": lambda **kw: rasterization(**kw, backend="cpu"),
                "op layer (reference)": lambda **kw: rasterization(**kw, backend="reference"),
            },
        )
        sync = lambda: None  # noqa: E731
        note = "dry run: the timing harness on the cpu backend vs the reference; NOT the overhead figure"
    else:
        raise RuntimeError("needs gsplat's CUDA kernels (the build stage did not succeed)")
    garden = load_garden(garden_file(ctx.args))
    if ctx.args.cpu_dry_run:  # the harness only, on a scene the reference renders in a blink
        scenes = {
            "tiny 300 48x32": with_sh(random_scene(n=300, C=1, width=48, height=32, seed=0, scale_range=(0.01, 0.08)))
        }
    else:
        scenes = {
            "demo-like 2k 96x72": with_sh(
                random_scene(n=2000, C=1, width=96, height=72, seed=0, scale_range=(0.01, 0.08))
            )
        }
        if garden is not None:
            scenes["garden 648x420 all 138k"] = with_sh(garden_scene(garden, n=None, seed=0))
    result = ctx.results.stage("overhead")
    result.update({"note": note, "impls": list(impls), "goal_ratio": OVERHEAD_GOAL, "scenes": {}})
    max_reps = 2 if ctx.args.cpu_dry_run else ctx.args.overhead_reps
    per_scene = (ctx.stage_deadline - time.monotonic()) / len(scenes)
    (ours, ours_fn), (direct, direct_fn) = impls.items()
    for name, scene in scenes.items():
        deadline = time.monotonic() + per_scene
        leaves = {
            k: getattr(scene, k).detach().to(device, copy=True).requires_grad_()
            for k in ("means", "quats", "scales", "opacities", "colors")
        }
        leaves["viewmats"] = scene.viewmats[:1].to(device, copy=True).requires_grad_()  # the camera optimizer's path
        fixed = dict(Ks=scene.Ks[:1].to(device), width=scene.width, height=scene.height)
        for _ in range(1 if ctx.args.cpu_dry_run else 10):  # warm-up: caches, the allocator, cuBLAS
            _step(ours_fn, leaves, fixed, sync)
            _step(direct_fn, leaves, fixed, sync)
        times = {ours: [], direct: []}
        for rep in range(max_reps):
            order = [(ours, ours_fn), (direct, direct_fn)][:: 1 if rep % 2 == 0 else -1]  # ABBA: drift hits both alike
            for label, fn in order:
                seconds = _step(fn, leaves, fixed, sync)
                times[label].append(seconds)
                ctx.results.csv_row("overhead", {"scene": name, "rep": rep, "impl": label, "seconds": f"{seconds:.6e}"})
            if time.monotonic() > deadline:
                break
        paired = [a / b for a, b in zip(times[ours], times[direct])]
        med = {k: statistics.median(v) for k, v in times.items()}
        result["scenes"][name] = {
            "gaussians": scene.N,
            "size": f"{scene.width}x{scene.height}",
            "reps": len(paired),
            f"median_ms {ours}": round(med[ours] * 1e3, 4),
            f"median_ms {direct}": round(med[direct] * 1e3, 4),
            "ratio_of_medians": round(med[ours] / med[direct], 4),
            "median_paired_ratio": round(statistics.median(paired), 4),
            "paired_ratio_p10_p90": [round(q, 4) for q in statistics.quantiles(paired, n=10)[::8]]
            if len(paired) > 1
            else None,
            "meets_goal": med[ours] / med[direct] <= OVERHEAD_GOAL if ctx.gsplat_ok else None,
        }
        ctx.results.write()
        print(
            f"[overhead] {name}: {ours} {med[ours] * 1e3:.3f} ms, {direct} {med[direct] * 1e3:.3f} ms, "
            f"ratio {med[ours] / med[direct]:.4f} over {len(paired)} pairs",
            flush=True,
        )
    return result


# ------------------------------------------------------------------------------------------ training
def _subprocess(ctx, name: str, cmd: List[str], timeout: float, env: dict, stage: str = "training") -> dict:
    """Runs a command with its output appended to out/training.log; returns rc and seconds."""
    print(f"[{stage}] {name}: {' '.join(cmd)} (timeout {timeout:.0f} s)", flush=True)
    t0 = time.perf_counter()
    with open(ctx.out / "training.log", "a") as log:
        log.write(f"\n===== {stage}: {name}: {' '.join(cmd)}\n")
        log.flush()
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, env=env, cwd=ROOT
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 1)}


def stage_training(ctx) -> dict:
    device = "cuda" if ctx.cuda else "cpu"
    env = dict(
        os.environ,
        WANDB_MODE="disabled",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    if not any(ep.name == "splat-metal" for ep in importlib.metadata.entry_points(group="nerfstudio.method_configs")):
        env["NERFSTUDIO_METHOD_CONFIGS"] = (
            "splat-metal=splat_metal_method.method.configs:splat_metal_method"  # not pip-installed
        )
    # nerfstudio reads seed points with open3d (~900 MB, cannot travel): without it both methods start
    # from splatfacto's random initialisation instead.
    seed = [] if importlib.util.find_spec("open3d") else ["--no-seed-points"]
    result = ctx.results.stage("training")
    result.update({"device": device, "seed_points": not seed, "runs": {}})
    py, bench = sys.executable, ROOT / "benchmarks"
    tmp = Path(tempfile.mkdtemp(prefix="cuda_device_run_"))
    remaining = lambda: ctx.stage_deadline - time.monotonic()  # noqa: E731
    small = ctx.args.cpu_dry_run
    runs = [
        (
            "cuda_vs_splatfacto",
            0.45,
            [
                py,
                str(bench / "cuda_vs_splatfacto.py"),
                "--steps",
                "40" if small else str(ctx.args.training_steps),
                "--block",
                "10" if small else "25",
            ]
            + seed,
        ),
        (  # a capture shot through an OPENCV lens with per-frame intrinsics: nerfstudio undistorts on CUDA too
            "cuda_vs_splatfacto distorted",
            0.35,
            [
                py,
                str(bench / "cuda_vs_splatfacto.py"),
                "--data",
                "DISTORTED",
                "--steps",
                "20" if small else str(ctx.args.training_steps // 3),
                "--block",
                "10" if small else "25",
            ]
            + seed,
        ),
        (
            "bench_memory hooks on",
            0.5,
            [py, str(bench / "bench_memory.py"), "--device", device, "--hooks", "on"] + seed,
        ),
        (
            "bench_memory hooks off",
            1.0,
            [py, str(bench / "bench_memory.py"), "--device", device, "--hooks", "off"] + seed,
        ),
    ]
    if ctx.args.training_runs:  # a subset, in the order given (a rerun); the last one gets what time is left
        chosen = [n.strip() for n in ctx.args.training_runs.split(",")]
        by_name = {r[0]: r for r in runs}
        runs = [(n, 1.0 if i == len(chosen) - 1 else by_name[n][1], by_name[n][2]) for i, n in enumerate(chosen)]
    for name, share, cmd in runs:
        timeout = remaining() * share
        if timeout < 20:
            result["runs"][name] = {"rc": "not run: stage time used up"}
            continue
        if "DISTORTED" in cmd:  # the demo scene through the tests' OPENCV lens (tests/demo_runs.py LENSES)
            scene = tmp / "distorted"
            lens = ["--k1", "-0.12", "--k2", "0.03", "--k3", "-0.004", "--p1", "0.0015", "--p2", "-0.001"]
            subprocess.run(
                [
                    py,
                    "-m",
                    "splat_metal_method.data.demo_scene",
                    "--out",
                    str(scene),
                    "--camera-model",
                    "OPENCV",
                    "--per-frame-intrinsics",
                    *lens,
                ],
                env=env,
                check=False,
            )  # fmt: skip  (a failure shows in the run's rc)
            cmd = [str(scene) if c == "DISTORTED" else c for c in cmd]
        out_json = tmp / f"{name.replace(' ', '_')}.json"
        cmd = cmd + ["--json", str(out_json)]
        if name.startswith("bench_memory"):
            # Train minutes: what the timeout leaves after nerfstudio's imports and setup (~30 s).
            minutes = max((timeout - 40) / 60, 0.2)
            cmd += ["--out", str(tmp), "--max-minutes", f"{minutes:.2f}", "--steps", "200" if small else "2000"]
            if small:
                cmd += ["--refine-stop", "60", "--sample-every", "2"]
        run = _subprocess(ctx, name, cmd, timeout, env)
        if out_json.exists():
            run["result"] = json.loads(out_json.read_text())
        if name.startswith("bench_memory"):  # its samples (also of a run cut short) into one memory.csv
            hooks = name.split()[-1]
            for path in sorted(tmp.glob(f"memory_{device}_hooks-{hooks}_*.csv")):
                with open(path, newline="") as f:
                    for row in csv.DictReader(f):
                        ctx.results.csv_row("memory", {"run": name, **row})
        result["runs"][name] = run
        ctx.results.write()
    shutil.rmtree(tmp, ignore_errors=True)
    result["all_ok"] = all(r.get("rc") == 0 for r in result["runs"].values())
    return result


# ------------------------------------------------------------------------------------------ commands
EXPORT_FORMATS = ("ply", "splat", "spz", "sog", "compressed-ply", "glb", "lod")


def commands_env() -> dict:
    """What the commands run in: offline, unbuffered, this checkout first on the path, no splat-metal
    overrides (a user's defaults), splat-metal's methods registered even where it is not installed."""
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    if not any(ep.name == "splat-metal" for ep in importlib.metadata.entry_points(group="nerfstudio.method_configs")):
        env["NERFSTUDIO_METHOD_CONFIGS"] = ",".join(
            f"{name}=splat_metal_method.method.configs:{attr}"
            for name, attr in (("splat-metal", "splat_metal_method"), ("splat-metal-mcmc", "splat_metal_mcmc_method"))
        )
    return env


def pack_exports(config: Path, tar_path: Path, work: Path, env: dict, device: str) -> dict:
    """Every ``splat-metal-export`` format of the run ``config`` (written where the run trained: its
    .sog and lod k-means run on ``device``), ``ns-export gaussian-splat`` where open3d is installed,
    and what they were all written from (params.npz: export.gaussians.ExportGaussians of the run's
    checkpoint), in one tar with manifest.json: decoded afterwards, on a machine with the formats'
    own tools, by benchmarks/cuda_decode_exports.py. Returns the manifest."""
    from splat_metal_method.export.checkpoint import load_run  # noqa: PLC0415
    from splat_metal_method.export.gaussians import export_gaussians  # noqa: PLC0415
    from splat_metal_method.export.run_config import quick_run  # noqa: PLC0415

    exports = work / "exports"
    shutil.rmtree(exports, ignore_errors=True)
    exports.mkdir(parents=True)
    cmd = [executable("splat-metal-export"), "--load-config", str(config), "--output-dir", str(exports),
           "--format", *EXPORT_FORMATS]  # fmt: skip
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    manifest = {"device": device, "command": cmd, "rc": res.returncode,
                "seconds": round(time.perf_counter() - t0, 1), "formats": {}, "failed": {}}  # fmt: skip
    manifest["output_tail"] = (res.stdout + res.stderr)[-2000:]
    for fmt in EXPORT_FORMATS:
        path = exports / f"splat.{'compressed.ply' if fmt == 'compressed-ply' else fmt}"
        if path.exists():
            size = sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size
            manifest["formats"][fmt] = {"file": f"exports/{path.name}", "bytes": size}
        else:
            manifest["failed"][fmt] = f"splat-metal-export rc {res.returncode}: no {path.name}"
    if importlib.util.find_spec("open3d") is None:
        manifest["ns_export"] = "not run: open3d is not installed (ns-export imports it; open3d-cpu's wheel is 95 MB)"
    else:
        t0 = time.perf_counter()
        ns = subprocess.run([executable("ns-export"), "gaussian-splat", "--load-config", str(config), "--output-dir",
                             str(exports / "ns-export")], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
        manifest["ns_export"] = {"rc": ns.returncode, "seconds": round(time.perf_counter() - t0, 1)}
        if (exports / "ns-export" / "splat.ply").exists():
            manifest["formats"]["ns-export ply"] = {"file": "exports/ns-export/splat.ply",
                                                    "bytes": (exports / "ns-export" / "splat.ply").stat().st_size}  # fmt: skip
        else:
            manifest["failed"]["ns-export ply"] = f"ns-export rc {ns.returncode}: " + (ns.stdout + ns.stderr)[-500:]
    run = quick_run(config)
    if run is None:
        raise RuntimeError(f"{config}: not a config splat-metal-export reads directly")
    model, checkpoint, step = load_run(run)
    g = export_gaussians(model)
    np.savez(work / "params.npz", means=g.means, log_scales=g.log_scales, quats=g.quats,
             opacity_logits=g.opacity_logits, sh_dc=g.sh_dc, sh_rest=g.sh_rest,
             sh_degree=np.array(g.sh_degree), antialiased=np.array(g.antialiased))  # fmt: skip
    manifest.update(gaussians=g.count, step=step, checkpoint=checkpoint.name)
    size = sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
    skip = None
    if size > 15 * 2**20 and "ns-export ply" in manifest["formats"]:  # the device tool returns files of <= 16 MiB
        skip = exports / "ns-export"
        manifest["left_out"] = {"ns-export ply": "written, but exports.tar would be over 15 MiB with it"}
        del manifest["formats"]["ns-export ply"]
    (work / "manifest.json").write_text(json.dumps(manifest, indent=1))
    with tarfile.open(tar_path, "w") as tar:
        for name in ("manifest.json", "params.npz", "exports"):
            tar.add(
                work / name, arcname=name, filter=lambda i: None if skip and i.name.startswith("exports/ns-") else i
            )
    manifest["tar_bytes"] = tar_path.stat().st_size
    return manifest


def viewer_round_trip(port: int, proc: subprocess.Popen, timeout: float) -> dict:
    """One HTTP and websocket round trip with a running viser viewer (ns-viewer), as its web client
    makes one: GET / (the client page), then over the websocket (viser 0.2's protocol: msgpack, one
    message per client frame, a tuple of messages per server frame) a ViewerCameraMessage looking at
    the origin, and the BackgroundImageMessage nerfstudio answers with: the model's render, decoded."""
    import io  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    import msgspec  # noqa: PLC0415
    from PIL import Image  # noqa: PLC0415
    from websockets.sync.client import connect  # noqa: PLC0415

    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/"
    while True:  # the server is up once its HTTP answers
        if proc.poll() is not None:
            raise RuntimeError(f"ns-viewer ended (rc {proc.returncode}) before serving")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                page = r.read()
                http = {"status": r.status, "bytes": len(page), "is_viser_client": b"<html" in page.lower()}
            break
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no HTTP answer from {url} in {timeout:.0f} s") from None
            time.sleep(0.5)
    # As viser's web client: a first camera message, then the camera the server sets (splat-metal's
    # viewer opens on the first training camera), then its render of that camera.
    view = {"position": (0.0, 0.0, 3.0), "look_at": (0.0, 0.0, 0.0), "up_direction": (0.0, 1.0, 0.0), "fov": 0.9}
    setters = {"SetCameraPositionMessage": ("position", "position"), "SetCameraLookAtMessage": ("look_at", "look_at"),
               "SetCameraUpDirectionMessage": ("up_direction", "position"), "SetCameraFovMessage": ("fov", "fov")}  # fmt: skip
    t0 = time.perf_counter()
    frames, moved_at = 0, None
    with connect(f"ws://127.0.0.1:{port}", max_size=None, open_timeout=30) as ws:
        ws.send(msgspec.msgpack.encode(camera_message(**view)))
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no BackgroundImageMessage in {timeout:.0f} s ({frames} frames received)")
            raw = ws.recv(timeout=left)
            frames += 1
            messages = msgspec.msgpack.decode(raw)
            moved = [m for m in messages if m.get("type") in setters]
            for m in moved:
                key, field = setters[m["type"]]
                view[key] = m[field]
            if moved:
                moved_at = time.perf_counter()
                ws.send(msgspec.msgpack.encode(camera_message(**view)))
                continue
            for msg in messages:
                # A render of the server's camera (or of ours, where it set none within 10 s).
                if msg.get("type") == "BackgroundImageMessage" and (moved_at or time.perf_counter() - t0 > 10):
                    image = np.asarray(Image.open(io.BytesIO(msg["rgb_bytes"])).convert("RGB"))
                    return {
                        "http": http,
                        "camera": "the server's opening view" if moved_at else "the client's first camera",
                        "seconds_to_image": round(time.perf_counter() - t0, 2),
                        "frames_before_image": frames,
                        "media_type": msg["media_type"],
                        "image_bytes": len(msg["rgb_bytes"]),
                        "image_shape": list(image.shape),
                        "image_std": round(float(image.std()), 2),
                        "ok": bool(http["status"] == 200 and http["is_viser_client"] and image.std() > 2.0),
                    }


def camera_message(position, look_at, up_direction, fov, aspect: float = 4 / 3) -> dict:
    """viser's ViewerCameraMessage for a camera at ``position`` looking at ``look_at``: wxyz is
    T_world_camera's rotation in OpenCV's convention (+Z forward, +Y down), as the web client sends it."""
    p, t, up = (np.asarray(v, dtype=np.float64) for v in (position, look_at, up_direction))
    z = (t - p) / np.linalg.norm(t - p)
    y = -(up - up.dot(z) * z)
    y /= np.linalg.norm(y)
    x = np.cross(y, z)
    r = np.stack([x, y, z], axis=1)  # columns: the camera's axes in the world
    w = math.sqrt(max(1.0 + r[0, 0] + r[1, 1] + r[2, 2], 1e-12)) / 2
    if w > 1e-3:
        q = (w, (r[2, 1] - r[1, 2]) / (4 * w), (r[0, 2] - r[2, 0]) / (4 * w), (r[1, 0] - r[0, 1]) / (4 * w))
    else:  # a half turn: from the largest diagonal entry
        i = int(np.argmax(np.diag(r)))
        j, k = (i + 1) % 3, (i + 2) % 3
        s = math.sqrt(max(1.0 + r[i, i] - r[j, j] - r[k, k], 1e-12)) * 2
        v = [0.0, 0.0, 0.0]
        v[i], v[j], v[k] = s / 4, (r[j, i] + r[i, j]) / s, (r[k, i] + r[i, k]) / s
        q = ((r[k, j] - r[j, k]) / s, *v)
    return {"type": "ViewerCameraMessage", "wxyz": tuple(float(c) for c in q), "position": tuple(map(float, p)),
            "fov": float(fov), "aspect": float(aspect), "look_at": tuple(map(float, t)),
            "up_direction": tuple(map(float, up))}  # fmt: skip


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _param_differences(a: dict, b: dict) -> dict:
    """Two final checkpoints' gaussians: bit-identical, or each parameter's largest difference
    relative to its largest magnitude (where the counts agree)."""
    pa, pb = ({k.split(".")[-1]: v for k, v in c["pipeline"].items() if ".gauss_params." in k} for c in (a, b))
    out = {"identical_checkpoint": checkpoint_differences(a, b) == [], "count": [int(pa["means"].shape[0]),
           int(pb["means"].shape[0])]}  # fmt: skip
    if out["count"][0] == out["count"][1]:
        out["rel_max"] = {
            k: float((pa[k].float() - pb[k].float()).abs().max() / pa[k].float().abs().max().clamp_min(1e-12))
            for k in sorted(pa)
        }
    return out


def _curve_differences(a: Path, b: Path) -> dict:
    """The logged loss and gaussian count of two runs (b may be the resumed part of a run), step by step."""
    loss_a, loss_b = tensorboard_scalars(a, "Train Loss"), tensorboard_scalars(b, "Train Loss")
    count_a = tensorboard_scalars(a, "Train Metrics Dict/gaussian_count")
    count_b = tensorboard_scalars(b, "Train Metrics Dict/gaussian_count")
    steps = sorted(set(loss_a) & set(loss_b))
    return {
        "steps_compared": [steps[0], steps[-1]] if steps else None,
        "loss_max_abs_diff": max((abs(loss_a[s] - loss_b[s]) for s in steps), default=None),
        "loss_identical_steps": sum(loss_a[s] == loss_b[s] for s in steps),
        "first_count_difference": next(
            (s for s in sorted(set(count_a) & set(count_b)) if count_a[s] != count_b[s]), None
        ),  # fmt: skip
    }


def stage_commands(ctx) -> dict:
    """The user's commands on this machine's device: ns-train splat-metal twice the same (what the
    device's own nondeterminism gives), the same run Ctrl-C'd once a checkpoint exists and resumed
    with the command it prints, ns-train splat-metal-mcmc on a capture shot through an OPENCV lens with
    per-frame intrinsics, every export format of the first run (exports.tar, decoded elsewhere), and
    ns-viewer on it serving a render over viser's HTTP and websocket."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from splat_metal_method.data import demo_scene  # noqa: PLC0415
    from splat_metal_method.engine.trainer import INTERRUPTED_EXIT_CODE  # noqa: PLC0415

    small = ctx.args.cpu_dry_run
    device = "cuda" if ctx.cuda else "cpu"
    env = commands_env()
    result = ctx.results.stage("commands")
    result.update({"device": device, "runs": {}})
    work = Path(tempfile.mkdtemp(prefix="cuda_commands_"))
    width, height, views = (40, 30, 12) if small else (demo_scene.DEFAULT_WIDTH, demo_scene.DEFAULT_HEIGHT, 32)
    total, save, stop_after = (40, 10, 20) if small else (ctx.args.commands_steps, 50, ctx.args.commands_steps // 2)
    refine = 10 if small else 50
    demo_scene.generate(work / "scene", width=width, height=height, views=views, seed=0)
    lens = {"k1": -0.12, "k2": 0.03, "k3": -0.004, "p1": 0.0015, "p2": -0.001}  # tests/demo_runs.py's OPENCV lens
    demo_scene.generate(work / "distorted" / "scene", width=width, height=height, views=views, seed=0,
                        camera_model="OPENCV", lens=lens, per_frame_intrinsics=True)  # fmt: skip
    options = dict(
        max_num_iterations=total, machine__seed=7, logging__steps_per_log=1, steps_per_save=10**6,
        # Sizes that keep exports.tar under the 16 MiB a returned file may have (~260 bytes a gaussian a file)
        pipeline__model__num_random=2000 if small else 6000, pipeline__model__max_gaussians=4000 if small else 12000,
        pipeline__model__warmup_length=refine, pipeline__model__sh_degree_interval=refine,  # SH 3 by step 3*refine
        pipeline__model__refine_every=refine,
    )  # fmt: skip
    out = work / "outputs"

    def train(method: str, timestamp: str, scene: Path, **extra) -> List[str]:
        # Ends in the dataparser subcommand, as the seed-point message tells users: splatfacto's random
        # initialisation (nerfstudio reads the seed points with open3d, which cannot travel: 95 MB).
        return [executable("ns-train"), method, *demo_args(**{**options, **extra}), "--data", str(scene),
                "--output-dir", str(out), "--timestamp", timestamp, "nerfstudio-data", "--load-3D-points", "False"]  # fmt: skip

    def left(share: float) -> float:
        return max((ctx.stage_deadline - time.monotonic()) * share, 1.0)

    def interrupted() -> dict:
        args = train("splat-metal", "interrupted", work / "scene", steps_per_save=save)
        t0 = time.perf_counter()
        try:
            code, text = interrupt_after_checkpoint(args, work / "interrupted.log", env,
                                                    run_dir(out, "interrupted"), stop_after, timeout=left(0.5))  # fmt: skip
        except AssertionError as e:  # ended before the Ctrl-C, or no exit after it
            log = work / "interrupted.log"
            return {"rc": f"error: {e}".splitlines()[0], "output_tail": log.read_text()[-3000:] if log.exists() else ""}
        with open(ctx.out / "training.log", "a") as log:
            log.write(
                f"\n===== commands: interrupted (Ctrl-C after step {stop_after}'s checkpoint): {shlex.join(args)}\n"
            )
            log.write(text)
        match = re.search(r"^Resume with:\n\s+(\S*ns-train .*)$", text, re.MULTILINE)  # one line (soft wrap)
        return {"rc": code, "seconds": round(time.perf_counter() - t0, 1), "resume": match.group(1) if match else None,
                "stopped_at": checkpoint_step(checkpoints(run_dir(out, "interrupted"))[-1])}  # fmt: skip

    first = {  # in parallel; then the resume
        "whole": train("splat-metal", "whole", work / "scene"),
        "whole again": train("splat-metal", "again", work / "scene"),
        "mcmc distorted": train("splat-metal-mcmc", "mcmc", work / "distorted" / "scene"),
    }
    with ThreadPoolExecutor(4) as pool:
        jobs = {
            name: pool.submit(_subprocess, ctx, name, args, left(0.5), env, "commands") for name, args in first.items()
        }
        jobs["interrupted"] = pool.submit(interrupted)
        for name, job in jobs.items():
            result["runs"][name] = job.result()
    ctx.results.write()
    runs = result["runs"]
    whole = run_dir(out, "whole")
    if runs["interrupted"].get("resume"):
        printed = shlex.split(runs["interrupted"]["resume"])
        resume = [executable(printed[0]), printed[1], "--timestamp", "resumed", *printed[2:]]
        runs["resumed"] = _subprocess(ctx, "resumed", resume, left(0.3), env, stage="commands")
    else:
        runs["resumed"] = {"rc": "not run: the interrupted run printed no resume command"}

    if runs["whole"]["rc"] == 0:
        t0 = time.perf_counter()
        try:
            manifest = pack_exports(whole / "config.yml", ctx.out / "exports.tar", work / "pack", env, device)
            result["exports"] = {k: v for k, v in manifest.items() if k != "output_tail"}
            result["exports"]["ok"] = manifest["rc"] == 0 and not manifest["failed"]
            if not result["exports"]["ok"]:
                result["exports"]["output_tail"] = manifest["output_tail"]
        except Exception:  # noqa: BLE001  (recorded; the viewer still runs)
            result["exports"] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        result["exports"]["seconds"] = round(time.perf_counter() - t0, 1)
        ctx.results.write()
        port = _free_port()
        args = [executable("ns-viewer"), "--load-config", str(whole / "config.yml"), "--viewer.websocket-port",
                str(port)]  # fmt: skip
        with open(ctx.out / "training.log", "a") as log:
            log.write(f"\n===== commands: viewer: {shlex.join(args)}\n")
            log.flush()
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)  # fmt: skip
            try:
                result["viewer"] = viewer_round_trip(port, proc, timeout=left(0.9))
            except Exception:  # noqa: BLE001
                result["viewer"] = {"ok": False, "error": traceback.format_exc()[-3000:]}
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGINT)
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
    ctx.results.write()

    # Resume: the resumed run against the uninterrupted one, next to two uninterrupted runs' own difference.
    if runs["whole"]["rc"] == 0 and runs["whole again"]["rc"] == 0:
        a, b = final_checkpoint(whole), final_checkpoint(run_dir(out, "again"))
        result["whole_vs_whole_again"] = {
            **_param_differences(a, b),
            **_curve_differences(whole, run_dir(out, "again")),
        }
        if runs["resumed"].get("rc") == 0:
            r = final_checkpoint(run_dir(out, "resumed"))
            result["whole_vs_resumed"] = {**_param_differences(a, r),
                                          **_curve_differences(whole, run_dir(out, "resumed"))}  # fmt: skip
            result["resume_verdict"] = resume_verdict(result["whole_vs_whole_again"], result["whole_vs_resumed"])
    mcmc = run_dir(out, "mcmc", method="splat-metal-mcmc")
    if runs["mcmc distorted"]["rc"] == 0:
        loss = tensorboard_scalars(mcmc, "Train Loss")
        count = tensorboard_scalars(mcmc, "Train Metrics Dict/gaussian_count")
        psnr = tensorboard_scalars(mcmc, "Train Metrics Dict/psnr")
        result["mcmc"] = {"steps": len(loss), "first_loss": loss[min(loss)] if loss else None,
                          "last_loss": loss[max(loss)] if loss else None,
                          "gaussians": [count[min(count)], count[max(count)]] if count else None,
                          "last_psnr": psnr[max(psnr)] if psnr else None}  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    result["all_ok"] = (
        all(r.get("rc") == 0 for n, r in runs.items() if n != "interrupted")
        and runs["interrupted"].get("rc") == INTERRUPTED_EXIT_CODE
        and result.get("exports", {}).get("ok", False)
        and result.get("viewer", {}).get("ok", False)
        and result.get("resume_verdict", "").startswith(("bit-identical", "within"))
    )
    return result


def resume_verdict(floor: dict, resumed: dict) -> str:
    """What the resumed run's difference from the uninterrupted one says, given two uninterrupted
    runs' own difference (a GPU's float atomics reorder sums, so even those may differ)."""
    if resumed["identical_checkpoint"]:
        return "bit-identical: the resumed run's final checkpoint equals the uninterrupted run's, bit for bit"
    if floor["identical_checkpoint"]:
        return "DIFFERS: two uninterrupted runs are bit-identical here, the resumed one is not"
    if resumed["count"][0] != resumed["count"][1]:
        same = floor["count"][0] != floor["count"][1]
        return ("within the device's nondeterminism: gaussian counts differ, as between two uninterrupted runs"
                if same else "DIFFERS: gaussian counts differ, two uninterrupted runs' agree")  # fmt: skip
    if "rel_max" not in floor:
        return "within the device's nondeterminism: two uninterrupted runs' counts differ too"
    worst = max(resumed["rel_max"][k] / max(floor["rel_max"][k], 1e-7) for k in resumed["rel_max"])
    if worst <= 10:
        return f"within the float atomics' tolerance: at most {worst:.1f}x two uninterrupted runs' difference"
    return f"DIFFERS: up to {worst:.0f}x two uninterrupted runs' difference"


# ------------------------------------------------------------------------------------------- summary
def summary(data: dict) -> str:
    st = data["stages"]
    lines = [f"# splat-metal on CUDA: {data['mode']} run, started {data['started_utc']}", ""]
    env = st.get("env", {})
    if env:
        lines += [
            f"- {k}: {env.get(k)}"
            for k in (
                "gpu",
                "nvidia_smi",
                "capability",
                "nvcc",
                "torch",
                "torch_cuda",
                "gsplat",
                "numpy",
                "python",
                "cpu",
                "cores",
                "commit",
            )
            if k in env
        ]
    lines.append("")
    for name in STAGES:
        s = st.get(name)
        if not s:
            continue
        lines.append(f"## {name}: {s['status']}" + (f" ({s['seconds']} s)" if "seconds" in s else ""))
        if s.get("error"):
            lines += ["```", s["error"][-3000:], "```"]
        if name == "build" and "max_jobs" in s:
            lines.append(
                f"gsplat CUDA extension in {s.get('build_seconds', '?')} s with MAX_JOBS={s['max_jobs']}, "
                f"TORCH_CUDA_ARCH_LIST={s['torch_cuda_arch_list']}"
            )
        if name == "parity":
            lines.append(
                f"target {s.get('target')}; backends {', '.join(s.get('backends', []))}; garden: {s.get('garden')}"
            )
            lines += [
                "",
                "| case | comparison | result | worst quantity | rel. to max | radii differing |",
                "|---|---|---|---|---|---|",
            ]
            for case in s.get("cases", []):
                for comp, c in case["comparisons"].items():
                    verdict = "ok" if c["ok"] else "MISMATCH: " + ", ".join(c["failing"])
                    lines.append(
                        f"| {case['case']} | {comp} | {verdict} | {c['worst']['quantity']} | "
                        f"{c['worst']['rel_max']:.1e} (tol {c['worst']['tol']:.0e}) | {c['radii_differing']} |"
                    )
            for case in s.get("cases", []):
                for label, err in {**case.get("unavailable", {}), **case.get("errors", {})}.items():
                    lines.append(f"\n{case['case']}: {label} did not run: {err.strip().splitlines()[-1]}")
            if s.get("not_run"):
                lines.append(f"\nnot run (time): {', '.join(s['not_run'])}")
        if name == "overhead":
            lines.append(s.get("note", ""))
            for scene, r in s.get("scenes", {}).items():
                lines.append(f"- {scene}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
        if name == "training":
            for run, r in s.get("runs", {}).items():
                lines.append(
                    f"- {run}: rc {r.get('rc')}, {r.get('seconds', '?')} s"
                    + (f": {json.dumps(r['result'])}" if r.get("result") else "")
                )
        if name == "commands":
            lines += [f"- {run}: rc {r.get('rc')}, {r.get('seconds', '?')} s" for run, r in s.get("runs", {}).items()]
            for key in ("resume_verdict", "whole_vs_whole_again", "whole_vs_resumed", "mcmc", "exports", "viewer"):
                if key in s:
                    value = s[key] if isinstance(s[key], str) else json.dumps(s[key], default=str)
                    lines.append(f"- {key}: {value[:3000]}")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main
def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


class Context:
    def __init__(self, args, results: Results):
        self.args, self.results, self.out = args, results, args.out
        self.cuda = not args.cpu_dry_run and torch.cuda.is_available()
        self.gsplat_ok = False
        self.stage_deadline = float("inf")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results" / "cuda"))
    p.add_argument("--cpu-dry-run", action="store_true", help="no CUDA: small cases, cpu vs reference")
    p.add_argument(
        "--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)} (env always runs)"
    )
    p.add_argument("--with-training", action="store_true", help="run the training stage in a dry run too (slow)")
    p.add_argument("--with-commands", action="store_true", help="run the commands stage in a dry run too (slow)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=540,
        help="the whole run's seconds: stages end by then, none starts with < 15 s left (default 540)",
    )
    p.add_argument("--parity-s", type=float, default=150, help="parity stage cap (default 150 s)")
    p.add_argument("--overhead-s", type=float, default=60, help="overhead stage cap (default 60 s)")
    p.add_argument("--overhead-reps", type=int, default=1000, help="alternating pairs per overhead scene at most")
    p.add_argument("--training-s", type=float, default=240, help="training stage cap (default 240 s)")
    p.add_argument(
        "--training-steps", type=int, default=300, help="cuda_vs_splatfacto's steps (the distorted run: 1/3)"
    )
    p.add_argument(
        "--training-runs", default="", help="comma-separated training runs to do, in this order (default all)"
    )
    p.add_argument("--commands-s", type=float, default=240, help="commands stage cap (default 240 s)")
    p.add_argument(
        "--commands-steps", type=int, default=300, help="steps of each ns-train run of the commands stage (default 300)"
    )
    p.add_argument(
        "--garden", type=Path, default=None, help=f"garden_points.npz (default {GARDEN_PATH} or .cuda-carry/)"
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    mode = "cpu-dry-run" if args.cpu_dry_run else "cuda"
    results = Results(args.out, mode)
    ctx = Context(args, results)
    if not args.cpu_dry_run and not ctx.cuda:
        print("cuda_device_run: no CUDA device (torch.cuda.is_available() is False); use --cpu-dry-run to test it here")
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # the wrapper's `timeout` ends us: record where, then stop
    wanted = {"env", *args.stages.split(",")}
    if args.cpu_dry_run:
        wanted.discard("build")
        if not args.with_training:
            wanted.discard("training")
        if not args.with_commands:
            wanted.discard("commands")
    caps = {"parity": args.parity_s, "overhead": args.overhead_s, "training": args.training_s,
            "commands": args.commands_s}  # fmt: skip
    start = time.monotonic()
    failed = False
    for name in STAGES:
        stage = results.stage(name)
        if name not in wanted:
            stage["status"] = "skipped" + (
                " (cpu dry run)" if args.cpu_dry_run and name in ("build", "training", "commands") else ""
            )
            continue
        if name not in ("env", "build") and start + args.budget_s - time.monotonic() < 15:
            stage["status"] = f"not run: the {args.budget_s:.0f} s budget was used up"
            results.write()
            continue
        if name in ("overhead", "commands") and not (ctx.gsplat_ok or args.cpu_dry_run):
            stage["status"] = "skipped: gsplat's CUDA kernels did not build"
            results.write()
            continue
        ctx.stage_deadline = min(time.monotonic() + caps.get(name, float("inf")), start + args.budget_s)
        print(f"[{name}] starting", flush=True)
        t0 = time.perf_counter()
        try:
            stage.update(globals()[f"stage_{name}"](ctx))
            stage["status"] = "ok" if stage.get("all_ok", True) else "done, NOT all ok (see below)"
        except StageTimeout as e:
            stage["status"] = f"partial: {e}"
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001  (recorded; the next stages still run)
            failed = True
            stage["status"] = "failed" if not isinstance(e, KeyboardInterrupt) else "interrupted"
            stage["error"] = traceback.format_exc()[-8000:]
            print(stage["error"], flush=True)
            if isinstance(e, KeyboardInterrupt):
                stage["seconds"] = round(time.perf_counter() - t0, 1)
                results.write()
                return 130
        stage["seconds"] = round(time.perf_counter() - t0, 1)
        results.write()
        print(f"[{name}] {stage['status']} in {stage['seconds']} s", flush=True)
    results.data["finished_utc"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    results.write()
    print(f"wrote {args.out}/: " + ", ".join(sorted(p.name for p in args.out.iterdir() if not p.name.startswith("."))))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
