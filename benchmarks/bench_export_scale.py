"""`splat-metal-export` at the sizes people train (issue 39), beside PlayCanvas's splat-transform in the
same run: per format and size, seconds, peak memory and, for the lossy formats, the decoded error.

    python benchmarks/bench_export_scale.py --sizes 100000 400000 1500000 [--out /tmp/bench_export_scale]

The checkpoints: a 20-step SH-3 `ns-train splat-metal` run on the demo scene (its config, dataset and
checkpoint layout), with its gaussians replaced by N made to look like a trained scene's: positions
in a few hundred surface-like clumps, log scales ~ N(-4.5, 1), random rotations, opacity logits ~
N(1, 2), DC ~ N(0, 0.8), and SH bands 1-3 as a trained scene has them: a few thousand shared
"materials" (Laplace, per band scale 0.12 / 0.06 / 0.03, the three colour channels alike) times a
per-gaussian gain, plus a per-gaussian Laplace part at 0.3 of that scale; fixed seed.

Per format, each in its own process as a user runs it (our `.ply` is written first, untimed, as
splat-transform's input where --formats leaves `ply` out):
- ours: `splat-metal-export --format F` (wall seconds of the whole command, the seconds it reports
  for the file itself, peak RSS); `.ply` also through `ns-export gaussian-splat`;
- splat-transform 2.7.1 (`.npm-tools`, `-g cpu`; `.spz` version 3 as ours) converting our `.ply` to
  the same format (wall seconds, peak RSS); it writes no `.splat`, and `.glb` with its
  KHR_gaussian_splatting writer. For `lod` (ours: `--format lod`,
  4 levels) it gets our `.ply` as level 0 and, as levels 1-3, the same `.ply` decimated (`-F`, its
  pairwise merge) to 25%, 6.25% and 1.5625%, into `lod-meta.json`. Its `.sog` on the CPU is killed
  after --st-timeout seconds (hours at 100k: a single-threaded kd-tree k-means).
- decoded error (lossy formats, ours and theirs, each file decoded by our readers (a lod folder: its
  finest level, every level-0 chunk), which the tests
  check against splat-transform's and Niantic's): every decoded gaussian matched to the model's by
  position; SH = RMS error of SH bands 1-3 relative to their RMS (the measure of
  tests/export/test_export_playcanvas.py), colour = RMS error of the DC colour (0.5 + C0 dc).

Prints a Markdown table (ratio = our command's wall time / splat-transform's) and writes
benchmarks/results/export_scale.csv. Run on a quiet machine: every number is wall time. "Ours" is this
checkout's splat_metal_method (first on PYTHONPATH); with --baseline DIR each of our commands is
also run, just before, with DIR's (before/after in one run, the same load; the files compared byte
for byte):

    git archive <commit> splat_metal_method | tar -x -C /tmp/before
    python benchmarks/bench_export_scale.py --sizes 100000 --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "export")]
sys.path.insert(0, str(REPO))
from splat_metal_method.export.cli import FORMATS as EXPORT_FORMATS  # noqa: E402

SPLAT_TRANSFORM = REPO / ".npm-tools" / "node_modules" / ".bin" / "splat-transform"
# every format the command writes, lod last
FORMATS = tuple(f for f in ("ply", "splat", "spz", "compressed-ply", "sog", "glb", "lod") if f in EXPORT_FORMATS)
EXT = {"compressed-ply": "compressed.ply"}
ST_OUTPUT = {"lod": "lod-meta.json"}  # splat-transform's output name, in theirs_N/splat.lod/ (else splat.EXT)
# splat-transform's levels for the same folder: our .ply tagged level 0, then decimated to the counts
# our levels have (--lod-levels 4: a quarter each), each tagged with its level
ST_LOD_INPUT = ["-l", "0", *[a for lv in (1, 2, 3) for a in ("{ply}", "-F", f"{100 / 4**lv:g}%", "-l", str(lv))]]
SH_SCALE = np.array([0.12] * 3 + [0.06] * 5 + [0.03] * 7)  # per coefficient of bands 1-3


def plausible_gaussians(n: int, seed: int = 0) -> dict:
    """Parameters of n gaussians with a trained scene's statistics (module docstring)."""
    import torch

    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(max(1, n // 4000), 3)) * 3
    means = centers[rng.integers(0, len(centers), n)] + rng.normal(size=(n, 3)) * 0.3
    materials = rng.laplace(size=(4096, 15, 1)) * SH_SCALE[:, None]
    rest = materials[rng.integers(0, 4096, n)] * (1 + 0.2 * rng.normal(size=(n, 1, 3)))
    rest += rng.laplace(size=(n, 15, 3)) * 0.3 * SH_SCALE[:, None]
    f = lambda a: torch.from_numpy(np.asarray(a, np.float32))  # noqa: E731
    return {"means": f(means), "scales": f(rng.normal(-4.5, 1.0, (n, 3))), "quats": f(rng.normal(size=(n, 4))),
            "opacities": f(rng.normal(1, 2, (n, 1))), "features_dc": f(rng.normal(0, 0.8, (n, 3))),
            "features_rest": f(rest)}  # fmt: skip


def base_run(root: Path) -> Path:
    """config.yml of a 20-step SH-3 run on the demo scene (made once under root)."""
    from cli_helpers import cli_env, demo_args, executable

    from splat_metal_method.data import demo_scene

    config = root / "outputs" / "scene" / "splat-metal" / "run" / "config.yml"
    if not config.is_file():
        demo_scene.generate(root / "scene", width=64, height=48, views=20, seed=0)
        subprocess.run(
            [executable("ns-train"), "splat-metal", *demo_args(), "--data", str(root / "scene"), "--output-dir",
             str(root / "outputs"), "--timestamp", "run", "--vis", "tensorboard", "--max-num-iterations", "20",
             "--steps-per-save", "100000", "--pipeline.model.sh-degree-interval", "4"],
            check=True, cwd=root, env=cli_env(), stdout=subprocess.DEVNULL,
        )  # fmt: skip
    return config


def sized_run(config: Path, n: int, root: Path) -> Path:
    from test_export_roundtrip import _copy_run_with_checkpoint

    dest = root / f"run_{n}"
    made = dest / "outputs" / "scene" / "splat-metal" / "run" / "config.yml"
    if made.is_file():
        return made
    shutil.rmtree(dest, ignore_errors=True)
    return _copy_run_with_checkpoint(config, dest / "outputs", lambda params: params.update(plausible_gaussians(n)))


def timed(cmd, cwd: Path, timeout: float, code: Optional[Path] = None):
    """(wall seconds, peak RSS in MB, output) of a command, through GNU time (its own small process
    forks the command: a child forked from this one would count this process's memory as its own);
    (None, None, output) when killed at timeout. ``code``: the folder whose splat_metal_method the
    command imports (first on PYTHONPATH; else the installed one)."""
    import tempfile

    from cli_helpers import cli_env

    env = cli_env()
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "time.txt"
        started = time.perf_counter()
        proc = subprocess.Popen(["/usr/bin/time", "-f", "%M", "-o", str(report), *map(str, cmd)], cwd=cwd,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the command too, not only GNU time
            return None, None, proc.communicate()[0]
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{out[-3000:]}")
        return wall, int(report.read_text().split()[-1]) / 1024, out  # %M: KiB


def median(runs):
    """(median wall seconds, median peak RSS, the last run's output) of timed()'s runs; (None, None,
    output) if one was killed."""
    if any(r[0] is None for r in runs):
        return None, None, runs[-1][2]
    return float(np.median([r[0] for r in runs])), float(np.median([r[1] for r in runs])), runs[-1][2]


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file in a folder (lod)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def same_bytes(a: Path, b: Path) -> bool:
    if a.is_dir():
        files = sorted(f.relative_to(a) for f in a.rglob("*") if f.is_file())
        return files == sorted(f.relative_to(b) for f in b.rglob("*") if f.is_file()) and all(
            (a / f).read_bytes() == (b / f).read_bytes() for f in files
        )
    return a.read_bytes() == b.read_bytes()


def decoded(path: Path) -> Optional[dict]:
    """means [N, 3], DC colour rgb [N, 3] and SH bands 1-3 [N, 45] channel-major (None for .splat);
    of a lod folder, its finest level (level 0's chunks); None for a format without a reader here."""
    from export_readers import read_splat, read_spz

    from splat_metal_method.export.compressed_ply_file import read_compressed_ply
    from splat_metal_method.export.gaussians import SH_C0
    from splat_metal_method.export.sog_file import read_sog

    name = path.name
    if path.is_dir() or name.endswith("lod-meta.json"):  # a lod folder: level 0 is the model
        import json

        meta_path = path / "lod-meta.json" if path.is_dir() else path
        meta = json.loads(meta_path.read_text())
        chunks = [read_sog(meta_path.parent / f) for f in meta["filenames"] if f.startswith("0_")]
        d = {k: np.concatenate([c[k] for c in chunks]) for k in ("means", "sh_dc", "sh_rest")}
        return {"means": d["means"], "rgb": 0.5 + SH_C0 * d["sh_dc"], "sh": d["sh_rest"].reshape(len(d["means"]), -1),
                "order": False}  # fmt: skip
    if not name.endswith((".splat", ".spz", ".sog", ".compressed.ply")):
        return None
    if name.endswith(".splat"):
        d = read_splat(path)
        return {"means": d["means"], "rgb": d["rgba"][:, :3], "sh": None, "order": False}
    if name.endswith(".spz"):
        d = read_spz(path)
        rest = d["sh_rest"].transpose(0, 2, 1)  # [N, D, 3] coefficient-major -> [N, 3, D]
    else:
        d = read_sog(path) if name.endswith(".sog") else read_compressed_ply(path)
        rest = d["sh_rest"]  # [N, 3, D]
    return {
        "means": d["means"],
        "rgb": 0.5 + SH_C0 * d["sh_dc"],
        "sh": rest.reshape(len(rest), -1),
        "order": name.endswith(".spz"),
    }


def errors(model: dict, d: dict, sh: bool = True):
    """(SH relative RMS error or None, DC colour RMS error) of a decoded file against the model,
    each model gaussian matched to the decoded one nearest its position; .spz keeps the .ply's order
    and is matched by it (splat-transform's .spz is in another frame: y and z negated, which also
    changes the SH's signs, hence sh=False for it)."""
    from scipy.spatial import cKDTree

    if d["order"]:
        idx = np.arange(len(model["means"]))
    else:
        _, idx = cKDTree(d["means"]).query(model["means"], k=1)
    colour = float(np.sqrt(((d["rgb"][idx] - model["rgb"]) ** 2).mean()))
    if d["sh"] is None or not sh:
        return None, colour
    sh = d["sh"][idx]
    return float(np.sqrt(((sh - model["sh"]) ** 2).sum() / (model["sh"] ** 2).sum())), colour


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 400_000, 1_500_000])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_export_scale"))
    parser.add_argument("--st-timeout", type=float, default=900, help="seconds before splat-transform is killed")
    parser.add_argument("--no-splat-transform", action="store_true")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each command (ours, --baseline's and "
                        "splat-transform's in turn); the table gives the median wall time and peak RSS")  # fmt: skip
    parser.add_argument("--baseline", type=Path, help="also time the command with the splat_metal_method of this "
                        "folder (e.g. `git archive <commit> splat_metal_method | tar -x -C DIR`), right before ours")  # fmt: skip
    args = parser.parse_args()
    from cli_helpers import cli_env, executable

    args.out.mkdir(parents=True, exist_ok=True)
    config = base_run(args.out)
    rows = []
    for n in args.sizes:
        run = sized_run(config, n, args.out)
        ckpt = sorted((run.parent / "nerfstudio_models").glob("*.ckpt"))[-1]
        p = plausible_gaussians(n)
        from splat_metal_method.export.gaussians import SH_C0

        keep = p["opacities"].numpy()[:, 0] >= -5.5373  # what the export keeps
        model = {"means": p["means"].numpy()[keep], "rgb": 0.5 + SH_C0 * p["features_dc"].numpy()[keep],
                 "sh": p["features_rest"].numpy()[keep].transpose(0, 2, 1).reshape(int(keep.sum()), -1)}  # fmt: skip
        exports = args.out / f"exports_{n}"
        shutil.rmtree(exports, ignore_errors=True)
        exports.mkdir()
        if "ply" not in args.formats and not args.no_splat_transform:  # splat-transform's input, untimed
            subprocess.run([executable("splat-metal-export"), "--load-config", run, "--output-dir", exports, "--format",
                            "ply"], check=True, cwd=args.out, env=cli_env(), stdout=subprocess.DEVNULL)  # fmt: skip
        for fmt in args.formats:
            name = f"splat.{EXT.get(fmt, fmt)}"
            command = [executable("splat-metal-export"), "--load-config", run, "--output-dir", exports, "--format", fmt]
            walls = {"before": [], "ours": [], "st": []}  # --repeat runs, in turn, each a (wall, rss, output)
            theirs = args.out / f"theirs_{n}" / name
            theirs_output = theirs / ST_OUTPUT[fmt] if fmt in ST_OUTPUT else theirs
            st = fmt != "splat" and not args.no_splat_transform
            for _ in range(args.repeat):
                if args.baseline is not None:
                    walls["before"].append(timed(command, args.out, 3600, code=args.baseline.resolve()))
                    (exports / name).rename(exports / f"baseline.{EXT.get(fmt, fmt)}")
                walls["ours"].append(timed(command, args.out, 3600, code=REPO))  # this checkout's code
                if st and not (walls["st"] and walls["st"][0][0] is None):  # not again once killed
                    theirs_output.parent.mkdir(parents=True, exist_ok=True)
                    extra = ["--spz-version", "3"] if fmt == "spz" else []
                    ply = str(exports / "splat.ply")
                    levels = [a.format(ply=ply) for a in ST_LOD_INPUT] if fmt == "lod" else []
                    walls["st"].append(timed([SPLAT_TRANSFORM, "-w", "-q", "-g", "cpu", *extra, ply, *levels,
                                              theirs_output], args.out, args.st_timeout))  # fmt: skip
            before = median(walls["before"]) if walls["before"] else None
            wall, rss, out = median(walls["ours"])
            line = next(x for x in out.splitlines() if name in x and " bytes " in x)
            own = float(line.rsplit("(", 1)[1].split(" s)")[0])
            load = float(out.split("loaded in ")[1].split(" s)")[0])
            row = {"gaussians": n, "format": fmt, "checkpoint_mb": round(ckpt.stat().st_size / 2**20),
                   "ours_s": round(wall, 2), "ours_load_s": round(load, 1), "ours_write_s": round(own, 1),
                   "ours_rss_mb": round(rss), "bytes": size_of(exports / name)}  # fmt: skip
            if before is not None:
                same = same_bytes(exports / f"baseline.{EXT.get(fmt, fmt)}", exports / name)
                row.update(baseline_s=round(before[0], 2), baseline_rss_mb=round(before[1]), baseline_same_bytes=same)
            if fmt != "ply" and decoded(exports / name) is not None:
                sh, colour = errors(model, decoded(exports / name))
                row.update(ours_sh_err=sh, ours_colour_err=colour)
            if fmt == "ply":
                ns_out = args.out / f"ns_export_{n}"
                wall, rss, _ = timed([executable("ns-export"), "gaussian-splat", "--load-config", run, "--output-dir",
                                      ns_out], args.out, 3600)  # fmt: skip
                same = (ns_out / "splat.ply").read_bytes() == (exports / name).read_bytes()
                row.update(ns_export_s=round(wall, 1), ns_export_rss_mb=round(rss), ns_export_same_bytes=same)
            if st:
                wall, rss, _ = median(walls["st"])
                row.update(st_s=None if wall is None else round(wall, 2), st_rss_mb=None if rss is None else round(rss))
                if wall is not None:
                    row["ratio"] = round(row["ours_s"] / wall, 2)
                    if before is not None:
                        row["baseline_ratio"] = round(row["baseline_s"] / wall, 2)
                    if fmt != "ply" and decoded(theirs_output) is not None:
                        sh, colour = errors(model, decoded(theirs_output), sh=fmt != "spz")
                        row.update(st_sh_err=sh, st_colour_err=colour)
            rows.append(row)
            print(row, flush=True)
    _table(rows, args.st_timeout)
    if args.baseline is not None:
        print(
            f"\n| gaussians | format | ours before ({args.baseline}) | ours now | splat-transform | before / st | now / st "
            "| same bytes |\n|---|---|---:|---:|---:|---:|---:|---|"
        )
        for r in rows:
            print(f"| {r['gaussians']:,} | {r['format']} | {r['baseline_s']} s | {r['ours_s']} s | "
                  f"{'' if r.get('st_s') is None else str(r['st_s']) + ' s'} | {r.get('baseline_ratio', '')} | "
                  f"{r.get('ratio', '')} | {r['baseline_same_bytes']} |")  # fmt: skip
    results = REPO / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[-1]).index(k) if k in rows[-1] else 99)
    with open(results / "export_scale.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def _table(rows, st_timeout) -> None:
    def err(r, who):
        sh, c = r.get(f"{who}_sh_err"), r.get(f"{who}_colour_err")
        return "" if c is None else (f"SH {sh:.3f}, " if sh is not None else "") + f"colour {c:.4f}"

    print(
        "\n| gaussians | format | ours: command (load + write) | peak RSS | decoded error | splat-transform | "
        "peak RSS | its decoded error | ours / splat-transform |\n|---|---|---|---:|---|---|---:|---|---:|"
    )
    for r in rows:
        st = (
            "" if "st_s" not in r else (f"{r['st_s']} s" if r["st_s"] is not None else f"> {st_timeout:.0f} s (killed)")
        )
        ours = f"{r['ours_s']} s ({r['ours_load_s']} + {r['ours_write_s']} s)"
        print(
            f"| {r['gaussians']:,} | {r['format']} | {ours} | {r['ours_rss_mb']} MB | {err(r, 'ours')} | {st} | "
            f"{r.get('st_rss_mb') or ''}{' MB' if r.get('st_rss_mb') else ''} | {err(r, 'st')} | {r.get('ratio', '')} |"
        )
        if "ns_export_s" in r:
            print(
                f"| {r['gaussians']:,} | ply via ns-export gaussian-splat | {r['ns_export_s']} s | "
                f"{r['ns_export_rss_mb']} MB | same bytes: {r['ns_export_same_bytes']} | | | | |"
            )


if __name__ == "__main__":
    main()
