"""Seconds of `export/ply_file.write_ply` for n random gaussians (SH degree 3, the columns
`ExportGaussians.ply_columns` gives), in process: min and median of --runs.

    PYTHONPATH=<checkout> python benchmarks/bench_ply_write.py --sizes 100000 400000

(PYTHONPATH picks the checkout whose code is timed; without it, the installed splat_metal_method.)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 400_000])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    from splat_metal_method.export import ply_file
    from splat_metal_method.export.gaussians import ExportGaussians

    print(f"write_ply of {ply_file.__file__}")
    rng = np.random.default_rng(0)
    for n in args.sizes:
        f = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
        g = ExportGaussians(f(n, 3), f(n, 3), f(n, 4), f(n), f(n, 3), f(n, 15, 3), 3, False, n, 0, 0, 0)
        times = []
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.runs):
                started = time.perf_counter()
                ply_file.write_ply(str(Path(tmp) / "splat.ply"), n, g.ply_columns())
                times.append(time.perf_counter() - started)
        print(f"{n:,} gaussians: min {min(times):.3f} s, median {float(np.median(times)):.3f} s")


if __name__ == "__main__":
    main()
