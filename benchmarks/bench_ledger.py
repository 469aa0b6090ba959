"""The step ledger as a table: host syncs, aten dispatches, our kernel launches and the work inside
our kernels per steady training step, refine step, eval render and steady step after refine stop, for splat-metal and
splat-metal-mcmc on the demo scene and a garden-points scene, then the modeled step time of garden
at 1/4 and full resolution (a MODEL: benchmarks/step_model/model.py).

    python benchmarks/bench_ledger.py                         # demo 96x64 + garden-points 20k at 162x105
    python benchmarks/bench_ledger.py --garden-points 50000 --garden-downscale 2 --per-kernel

Counted under the MSL emulator on CPU tensors, as a Mac runs the step (splat_metal_method/bench/step_ledger.py, extended by
benchmarks/step_model/ledger.py).
garden_points.npz is found beside a clone (../shared/data/) or at $SPLAT_METAL_GARDEN_POINTS.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from step_model import ledger as step_ledger  # noqa: E402
from step_model import model as step_model  # noqa: E402

from splat_metal_method.bench import scenes as bench_scenes  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=list(step_ledger.METHODS))
    ap.add_argument("--demo-size", nargs=2, type=int, default=(96, 64), metavar=("W", "H"))
    ap.add_argument("--garden-points", type=int, default=20_000, help="0 skips the garden-points scene")
    ap.add_argument("--garden-downscale", type=int, default=4, help="of the 648x420 garden cameras")
    ap.add_argument("--per-kernel", action="store_true", help="also print per-kernel work and sync sites")
    ap.add_argument("--work-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_ledger_"))
    scenes = {f"demo {args.demo_size[0]}x{args.demo_size[1]}": bench_scenes.demo(work / "demo", *args.demo_size)}
    if args.garden_points:
        try:
            n, downscale = args.garden_points, args.garden_downscale
            g = bench_scenes.garden_points(work / f"garden{n}_{downscale}", n, downscale)
            scenes[f"garden-points {args.garden_points // 1000}k 1/{args.garden_downscale}"] = g
        except FileNotFoundError as e:
            print(f"skipping garden-points: {e}")
    rows, steady = {}, {}
    for scene, data in scenes.items():
        for method in args.methods:
            t0 = time.perf_counter()
            ledgers = step_ledger.measure(data, method, "metal", work / "outputs")
            print(f"measured {method} on {scene} in {time.perf_counter() - t0:.0f} s", flush=True)
            for phase, led in ledgers.items():
                rows[f"{method}, {scene}, {phase}"] = led
            steady[(method, scene)] = ledgers["steady"]
            if args.per_kernel:
                for phase, led in ledgers.items():
                    print(f"\n{method}, {scene}, {phase}: host syncs\n{step_ledger.sync_sites(led)}")
                    print(f"aten ops by part: {dict(led.parts)}\n{step_ledger.kernel_table(led)}")
    print("\n## Step ledger (metal backend, counted under the emulator as a Mac runs it)\n")
    print(step_ledger.table(rows))
    for (method, scene), led in steady.items():
        if scene.startswith("garden") or len(steady) == len(args.methods):
            print(f"\n## Modeled step time: {method}\n")
            print(step_model.table(led, f"{method} steady step on {scene}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
