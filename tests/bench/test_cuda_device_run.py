"""benchmarks/cuda_device_run.py, the one script a GPU machine runs, end to end on CPU (--cpu-dry-run):
GPU time is scarce, so the script must not first fail there. Its CUDA stages are skipped here; the
parity stage runs the cpu backend against the reference with the same code that compares them with
gsplat on a GPU, and every output file must have the structure the GPU run will have."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import torch
from scenes import GARDEN_PATH

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cuda_device_run  # noqa: E402


def test_cpu_dry_run_runs_every_stage_and_writes_the_expected_files(tmp_path):
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cuda_device_run.py"), "--cpu-dry-run", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    # What the device tool brings back: at most 8 plain files, named in letters, digits, '.', '_', '-'.
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["overhead.csv", "parity.csv", "results.json", "summary.md"], files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)

    data = json.loads((tmp_path / "results.json").read_text())
    stages = data["stages"]
    assert data["mode"] == "cpu-dry-run" and list(stages) == list(cuda_device_run.STAGES)
    assert stages["env"]["status"] == "ok" and stages["env"]["torch"] == torch.__version__
    assert stages["build"]["status"].startswith("skipped") and stages["training"]["status"].startswith("skipped")

    parity = stages["parity"]
    assert parity["status"] == "ok" and parity["target"] == "reference/cpu"
    assert parity["backends"] == ["reference/cpu", "cpu/cpu"] and parity["not_run"] == []
    names = " | ".join(c["case"] for c in parity["cases"])
    for feature in ("RGB classic", "RGB+ED", "antialiased", "16x16", "61x37", "23x41", "SH3", "dense"):
        assert feature in names, f"no parity case with {feature!r}: {names}"
    if GARDEN_PATH.exists():
        assert "garden" in names
    for case in parity["cases"]:
        assert list(case["comparisons"]) == ["cpu/cpu vs reference/cpu"], case
        assert case["comparisons"]["cpu/cpu vs reference/cpu"]["ok"], case

    rows = list(csv.DictReader(open(tmp_path / "parity.csv")))
    grads = {f"{k}.grad" for k in cuda_device_run.GRAD_INPUTS}
    assert {r["quantity"] for r in rows} == {"colors", "alphas", "radii", "means2d.grad", "absgrad"} | grads
    assert all(r["ok"] == "True" and r["backend"] == "cpu/cpu" and r["against"] == "reference/cpu" for r in rows)
    graded = [r for r in rows if r["tol"]]
    # Nothing compared is all zero (a background may be hidden entirely), and the two sides differ a
    # little: two backends were compared, not one with itself.
    assert all(float(r["scale"]) > 0 for r in graded if r["quantity"] != "backgrounds.grad")
    assert max(float(r["rel_max"]) for r in graded) > 0

    overhead = stages["overhead"]
    assert overhead["status"] == "ok" and "NOT the overhead figure" in overhead["note"]
    (scene,) = overhead["scenes"].values()
    assert scene["reps"] >= 1 and scene["meets_goal"] is None and scene["ratio_of_medians"] > 0
    timed = list(csv.DictReader(open(tmp_path / "overhead.csv")))
    assert {r["impl"] for r in timed} == set(overhead["impls"]) and all(float(r["seconds"]) > 0 for r in timed)

    summary = (tmp_path / "summary.md").read_text()
    assert "## parity: ok" in summary and "| cpu/cpu vs reference/cpu | ok |" in summary


def test_compare_flags_a_wrong_gradient_and_a_missing_one():
    g = torch.Generator().manual_seed(0)
    want = {"colors": torch.rand(1, 4, 5, 3, generator=g, dtype=torch.float64),
            "means.grad": torch.randn(10, 3, generator=g, dtype=torch.float64),
            "absgrad": torch.rand(1, 10, 2, generator=g, dtype=torch.float64)}  # fmt: skip
    got = {k: v.clone() for k, v in want.items()}
    got["means.grad"][3, 1] += 0.01 * want["means.grad"].abs().max()  # 1e-2 of the largest entry: over 1e-3
    got["absgrad"] = None
    rows = {r["quantity"]: r for r in cuda_device_run.compare(got, want)}
    assert rows["colors"]["ok"] and rows["colors"]["max_abs"] == 0
    assert not rows["means.grad"]["ok"] and abs(rows["means.grad"]["rel_max"] - 0.01) < 1e-9
    assert not rows["absgrad"]["ok"] and rows["absgrad"]["note"] == "missing on one side"
