"""splat-metal-bench: measure training speed and memory on this machine, and print one line to paste
into an issue.

    splat-metal-bench                 # on a Mac: the metal backend on mps; elsewhere cpu + emulated metal
    splat-metal-bench --quick         # small sizes, few steps (what the tests run on Linux)
    splat-metal-bench --out results/  # where bench.csv, memory.csv, memory.png and summary.txt go
    splat-metal-bench --vs tile-merge  # the metal backend with the backward's tile merge off, then on
                                       # (bwd_tile_merge): backward ms and atomics of each, one line

For each standard scene (the demo scene; garden-points at 1/4 and full size of its 648x420 cameras
when garden_points.npz is found, see bench_scenes.py) and backend, nerfstudio's Trainer runs a short
training with densification (warm-up an eighth of the run, refine every eighth, --quick once at
step 4; no opacity reset), and reports:

- per-stage times of each step (forward + loss, backward, optimizer + callbacks): GPU times from MPS
  events (torch.mps.Event(enable_timing=True)) on mps, wall times on cpu; steps per second;
- host syncs per step, counted by the step ledger (step_ledger.py) on one extra step that does not refine;
- the memory curve every few steps: torch.mps.driver_allocated_memory / current_allocated_memory on
  mps, process RSS / C heap in use on cpu, over the run with the memory hooks (memory.py) on, and for
  the first scene and backend a second run with them off; plotted to memory.png.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from .timing import STAGES, _StageClock, timed_step  # noqa: F401 (re-exported: splat-metal-bench's timing)

# --vs msplat (a benchmark against another project, outside the package now): what runs it
MSPLAT_MOVED = ("splat-metal-bench --vs msplat is now `python benchmarks/bench_vs_msplat.py [--data SCENE] [--steps N] "
                "[--sh-degree D] [--downscale F] [--num-downscales L]` in a clone of the repository")  # fmt: skip
EMULATED_QUICK_STEPS = 3  # --quick on a machine without MPS: steps of the emulated Metal backend


@dataclass
class Run:
    scene: str
    backend: str
    hooks: bool
    steps: int = 0
    stage_ms: Dict[str, List[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    step_ms: List[float] = field(default_factory=list)
    host_syncs: Optional[int] = None
    memory: List[Dict[str, float]] = field(default_factory=list)  # step, gaussians, MiB columns
    gaussians: int = 0
    variant: str = ""  # --vs tile-merge: the AB_RUNS variant ("direct", "tile merge")
    device_atomics: Optional[int] = None  # of the counted step (the step ledger's; our kernels only)

    @property
    def steps_per_s(self) -> float:
        return 1000.0 * len(self.step_ms) / sum(self.step_ms) if self.step_ms else 0.0

    def median(self, stage: str) -> float:
        v = sorted(self.stage_ms[stage])
        return v[len(v) // 2] if v else 0.0


def default_device() -> str:
    return "mps" if torch.backends.mps.is_available() else "cpu"


def memory_sample(device: str) -> Dict[str, float]:
    """MiB: driver/current allocated on mps; RSS and C heap in use on cpu."""
    from ..engine import memory

    mib = 1024.0**2
    if device == "mps":
        return {"driver_mib": torch.mps.driver_allocated_memory() / mib,
                "current_mib": torch.mps.current_allocated_memory() / mib}  # fmt: skip
    rss = memory.process_rss()
    heap = memory.malloc_stats()
    return {"rss_mib": (rss or 0) / mib, "heap_mib": (heap[0] if heap else 0) / mib}


# --vs A/B runs: option -> ((variant name, {(module under ops/metal, attribute): value}), ...), baseline first;
# each attribute is read at each call by the kernels' dispatch code, set for one run and restored after it;
# ("config", field): a field of the run's model config instead
AB_RUNS = {
    "tile-merge": (("direct", {("config", "bwd_tile_merge"): False}),
                   ("tile merge", {("config", "bwd_tile_merge"): True})),
}  # fmt: skip
# --vs options that are gone: option -> the one line that says so
GONE_VS = {
    "pixel-order": "--vs pixel-order: the rasterizers' row pixel order is gone; every tile runs in 8x4 pixel blocks a "
                   "simdgroup where its size allows (the default before), so there is nothing to compare",
}  # fmt: skip


def run_scene(data: Path, scene: str, backend: str, device: str, steps: int, hooks: bool, mem_every: int,
              refine_every: int, work: Path, count_syncs: bool, variant: Optional[tuple] = None) -> Run:  # fmt: skip
    """One training run. ``variant`` (metal backend): one of AB_RUNS' (name, settings), set for this run (the
    backward's tile merge); None leaves them as the environment set them."""
    import importlib

    name, settings = variant or ("", {})
    fields = {a: v for (m, a), v in settings.items() if m == "config"}
    settings = {k: v for k, v in settings.items() if k[0] != "config"}
    modules = {m: importlib.import_module(f"splat_metal_method.ops.metal.{m}") for m, _ in settings}
    before = {(m, a): getattr(modules[m], a) for m, a in settings}
    for (m, a), v in settings.items():
        setattr(modules[m], a, v)
    try:
        run = _run_scene(data, scene, backend, device, steps, hooks, mem_every, refine_every, work, count_syncs,
                         fields)  # fmt: skip
    finally:
        for (m, a), v in before.items():
            setattr(modules[m], a, v)
    run.variant = name
    return run


def _run_scene(data: Path, scene: str, backend: str, device: str, steps: int, hooks: bool, mem_every: int,
               refine_every: int, work: Path, count_syncs: bool, fields: Optional[dict] = None) -> Run:  # fmt: skip
    from nerfstudio.engine.callbacks import TrainingCallbackLocation  # noqa: F401 (before writer: import order)
    from nerfstudio.utils import writer

    from . import step_ledger

    def configure(cfg):
        m = cfg.pipeline.model
        m.warmup_length = max(steps // 8, 1)
        m.refine_every = refine_every
        m.reset_alpha_every = 1000  # no opacity reset in a short run
        m.sh_degree_interval = max(steps // 4, 1)
        m.empty_cache_after_refine = m.empty_cache_after_eval = hooks
        m.memory_log_every = 0
        for name, value in (fields or {}).items():  # an A/B run's config fields (AB_RUNS)
            setattr(m, name, value)

    writers = list(writer.EVENT_WRITERS)
    trainer = step_ledger.build_trainer(data, "splat-metal", backend, work / "outputs", device, configure)
    run = Run(scene, backend, hooks)
    try:
        model = trainer.pipeline.model
        if hasattr(model.strategy, "pause_refine_after_reset"):
            model.strategy.pause_refine_after_reset = 0  # no reset in the run: refine from the warm-up on
        for step in range(steps):
            stages = timed_step(trainer, step, device)
            if step >= 1:  # the first step builds lazy state (and compiles kernels)
                for name, ms in zip(STAGES, stages):
                    run.stage_ms[name].append(ms)
                run.step_ms.append(sum(stages))
            if step % mem_every == 0 or step == steps - 1:
                run.memory.append({"step": step, "gaussians": len(model.means), **memory_sample(device)})
        run.steps = steps
        if count_syncs:  # on a step that does not refine
            step = steps if steps % model.config.refine_every else steps + 1
            with step_ledger.count("bench", step_ledger.host_resident(trainer)) as ledger:
                timed_step(trainer, step, device)
            run.host_syncs = ledger.host_syncs
            run.device_atomics = ledger.kernel_total().device_atomics
        run.gaussians = len(model.means)
        return run
    finally:
        writer.EVENT_WRITERS[:] = writers
        del trainer
        if device == "mps":
            torch.mps.empty_cache()


def scenes(quick: bool, work: Path) -> Dict[str, Path]:
    from . import scenes as bench_scenes

    out = {}
    if quick:
        out["demo 48x32"] = bench_scenes.demo(work / "demo48", 48, 32)
        return out
    out["demo 192x128"] = bench_scenes.demo(work / "demo192", 192, 128)
    for n, downscale in ((20_000, 4), (138_766, 1)):
        try:
            out[f"garden-points {n // 1000}k 1/{downscale}"] = bench_scenes.garden_points(
                work / f"garden{n}_{downscale}", n, downscale)  # fmt: skip
        except FileNotFoundError as e:
            print(f"skipping garden-points: {e}", flush=True)
            break
    return out


def write_outputs(runs: List[Run], out: Path, device: str) -> Path:
    with open(out / "bench.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scene", "backend", "hooks", "steps", "gaussians", "steps_per_s", "host_syncs_per_step",
                    *(f"{s}_ms" for s in STAGES), "variant", "device_atomics_per_step"])  # fmt: skip
        for r in runs:
            w.writerow(
                [
                    r.scene,
                    r.backend,
                    int(r.hooks),
                    r.steps,
                    r.gaussians,
                    f"{r.steps_per_s:.3f}",
                    "" if r.host_syncs is None else r.host_syncs,
                    *(f"{r.median(s):.2f}" for s in STAGES),
                    r.variant,
                    "" if r.device_atomics is None else r.device_atomics,
                ]
            )
    keys = sorted({k for r in runs for m in r.memory for k in m} - {"step", "gaussians"})
    with open(out / "memory.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scene", "backend", "hooks", "step", "gaussians", *keys])
        for r in runs:
            for m in r.memory:
                w.writerow(
                    [r.scene, r.backend, int(r.hooks), m["step"], m["gaussians"], *(f"{m[k]:.1f}" for k in keys)]
                )
    png = out / "memory.png"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5))
    for r in runs:
        for k in keys:
            ax.plot([m["step"] for m in r.memory], [m[k] for m in r.memory], marker=".",
                    label=f"{r.scene} {r.backend} hooks {'on' if r.hooks else 'off'}: {k}")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    ax.set_title(f"splat-metal-bench memory on {device} ({platform.platform()})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def summary_line(runs: List[Run], device: str) -> str:
    """One line for an issue: machine, torch, then per run steps/s, host syncs/step, peak memory."""
    from importlib import metadata

    try:
        version = metadata.version("splat-metal-method")
    except metadata.PackageNotFoundError:
        version = "dev"
    parts = [f"splat-metal-bench {version}", f"{device} {platform.machine()} {platform.platform(terse=True)}",
             f"torch {torch.__version__}"]  # fmt: skip
    for r in runs:
        peak = max((max(v for k, v in m.items() if k.endswith("_mib")) for m in r.memory), default=0.0)
        syncs = "" if r.host_syncs is None else f", {r.host_syncs} host syncs/step"
        parts.append(
            f"{r.scene} {r.backend} hooks {'on' if r.hooks else 'off'}: {r.steps_per_s:.2f} steps/s"
            f"{syncs}, {r.gaussians} gaussians, peak {peak:.0f} MiB"
        )
    return " | ".join(parts)


def ab_line(option: str, runs: List[Run], device: str) -> str:
    """One line: per scene the backward's median ms and the step's device atomics of both variants of ``option``."""
    (base, _), (other, _) = AB_RUNS[option]
    parts = [f"splat-metal-bench --vs {option}, {device} {platform.machine()} {platform.platform(terse=True)}",
             f"torch {torch.__version__}"]  # fmt: skip
    if device != "mps":
        parts.append("EMULATED (the Metal kernels on the CPU): the times say nothing of a Mac, the atomics are counted")
    by_scene: Dict[str, Dict[str, Run]] = {}
    for r in runs:
        by_scene.setdefault(r.scene, {})[r.variant] = r
    for scene, pair in by_scene.items():
        d, m = pair[base], pair[other]
        bd, bm = d.median("backward"), m.median("backward")
        parts.append(
            f"{scene}: backward {bd:.2f} ms {base}, {bm:.2f} ms {other} ({other} / {base} {bm / bd if bd else 0:.2f}), "
            f"step {1000 / d.steps_per_s if d.steps_per_s else 0:.2f} / {1000 / m.steps_per_s if m.steps_per_s else 0:.2f} ms, "
            f"device atomics a step {d.device_atomics} / {m.device_atomics}"
        )
    return " | ".join(parts)


def ab_runs(option: str, scene_paths: Dict[str, Path], device: str, steps: int, mem_every: int, refine_every: int,
            work: Path, out: Path, quick: bool) -> int:  # fmt: skip
    """--vs tile-merge: each scene trained twice on the metal backend, the baseline variant then the
    other (AB_RUNS), same seed."""
    runs: List[Run] = []
    n = EMULATED_QUICK_STEPS if (quick and device == "cpu") else steps
    for scene, data in scene_paths.items():
        for variant in AB_RUNS[option]:
            t0 = time.perf_counter()
            run = run_scene(data, scene, "metal", device, n, True, mem_every, refine_every, work, True, variant)
            runs.append(run)
            print(f"{scene}, metal, {run.variant}: backward {run.median('backward'):.1f} ms, "
                  f"{run.device_atomics} device atomics a step ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    write_outputs(runs, out, device)
    line = ab_line(option, runs, device)
    (out / "summary.txt").write_text(line + "\n")
    print(f"\nPaste into an issue:\n{line}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="splat-metal-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small demo scene, 8 steps (about a minute on a CPU)")
    ap.add_argument("--device", choices=("auto", "mps", "cpu"), default="auto")
    ap.add_argument("--backends", nargs="+", default=None,
                    help="default: metal on mps; cpu and metal (emulated) on cpu")  # fmt: skip
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 200; --quick 8)")
    ap.add_argument("--mem-every", type=int, default=None, help="memory sample every N steps (default steps/20)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default ./splat-metal-bench-<time>)")
    ap.add_argument("--vs", choices=("msplat",) + tuple(AB_RUNS) + tuple(GONE_VS), default=None,
                    help="msplat: moved (says what runs it now); tile-merge: the metal backend with the backward's "
                         "tile merge off, then on, and one line with the backward's ms and atomics of each")  # fmt: skip
    for name, kind in (("--data", Path), ("--sh-degree", int), ("--downscale", int), ("--num-downscales", int)):
        ap.add_argument(
            name, type=kind, default=None, help="--vs msplat's, moved: " + MSPLAT_MOVED.split(" is now ")[1]
        )
    args = ap.parse_args(argv)
    if args.vs in GONE_VS:
        print(GONE_VS[args.vs], file=sys.stderr)
        return 2
    device = default_device() if args.device == "auto" else args.device
    if device == "mps" and not torch.backends.mps.is_available():
        ap.error("--device mps: MPS is not available on this machine")
    if args.vs == "msplat":
        print(MSPLAT_MOVED, file=sys.stderr)
        return 2
    backends = args.backends or (["metal"] if device == "mps" else ["cpu", "metal"])
    steps = args.steps or (8 if args.quick else 200)
    if steps < 3:
        ap.error("--steps must be at least 3 (the first step is not timed)")
    mem_every = args.mem_every or max(steps // 20, 1)
    refine_every = 4 if args.quick else max(steps // 8, 2)
    out = args.out or Path(f"splat-metal-bench-{dt.datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="splat_metal_bench_"))
    runs: List[Run] = []
    if args.vs in AB_RUNS:
        return ab_runs(args.vs, scenes(args.quick, work), device, steps, mem_every, refine_every, work, out, args.quick)
    for i, (scene, data) in enumerate(scenes(args.quick, work).items()):
        for j, backend in enumerate(backends):
            # the emulator runs Metal kernels ~100x slower than a GPU: --quick times it on 3 steps
            n = EMULATED_QUICK_STEPS if (args.quick and backend == "metal" and device == "cpu") else steps
            for hooks in (True, False) if i == 0 and j == 0 else (True,):
                t0 = time.perf_counter()
                run = run_scene(
                    data, scene, backend, device, n, hooks, mem_every, refine_every, work, count_syncs=hooks
                )
                runs.append(run)
                print(f"{scene}, {backend}, hooks {'on' if hooks else 'off'}: {run.steps_per_s:.2f} steps/s, "
                      + ", ".join(f"{s} {run.median(s):.1f} ms" for s in STAGES)
                      + (f", {run.host_syncs} host syncs/step" if run.host_syncs is not None else "")
                      + f" ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    png = write_outputs(runs, out, device)
    line = summary_line(runs, device)
    (out / "summary.txt").write_text(line + "\n")
    print(f"\nwrote {out / 'bench.csv'}, {out / 'memory.csv'}, {png}\n\nPaste into an issue:\n{line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
