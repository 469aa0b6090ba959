"""benchmarks/cuda_device_run.py, the one script a GPU machine runs, end to end on CPU (--cpu-dry-run):
GPU time is scarce, so the script must not first fail there. Its CUDA stages are skipped here; the
parity stage runs the cpu backend against the reference with the same code that compares them with
gsplat on a GPU, and every output file must have the structure the GPU run will have."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
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
    assert stages["commands"]["status"].startswith("skipped")

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


def test_cpu_dry_run_of_the_commands_stage(tmp_path):
    """The commands a GPU run tries (ns-train twice, Ctrl-C + resume, MCMC on a distorted capture, every
    export, ns-viewer's round trip), on CPU, where a resume must be bit-identical; with only the
    distributions the GPU machine has importable (benchmarks/cuda_image), so that a missing one fails here."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks" / "cuda_image"), str(ROOT)]))
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cuda_device_run.py"), "--cpu-dry-run", "--stages", "commands",
         "--with-commands", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=ROOT, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exports.tar", "results.json", "summary.md", "training.log"]
    stage = json.loads((tmp_path / "results.json").read_text())["stages"]["commands"]
    assert stage["status"] == "ok" and stage["device"] == "cpu", stage
    runs = stage["runs"]
    assert {n: r["rc"] for n, r in runs.items()} == {"whole": 0, "whole again": 0, "mcmc distorted": 0,
                                                      "interrupted": 130, "resumed": 0}  # fmt: skip
    assert 10 <= runs["interrupted"]["stopped_at"] < 39 and "--load-dir" in runs["interrupted"]["resume"]
    assert stage["resume_verdict"].startswith("bit-identical"), stage["resume_verdict"]
    resumed = stage["whole_vs_resumed"]
    assert (
        resumed["steps_compared"] == [runs["interrupted"]["stopped_at"] + 1, 39] and resumed["loss_max_abs_diff"] == 0
    )
    assert stage["whole_vs_whole_again"]["identical_checkpoint"]  # CPU: no float atomics

    mcmc = stage["mcmc"]
    # 40 steps from random gaussians: a run, not a quality figure (bench_real_capture.py measures that).
    assert mcmc["steps"] == 40 and 0 < mcmc["last_loss"] < mcmc["first_loss"] and mcmc["last_psnr"] > 5, mcmc

    exports = stage["exports"]
    assert exports["ns_export"].startswith("not run: open3d is not installed")  # as on the GPU machine
    assert exports["ok"] and exports["failed"] == {} and exports["rc"] == 0, exports
    assert set(cuda_device_run.EXPORT_FORMATS) <= set(exports["formats"])
    with tarfile.open(tmp_path / "exports.tar") as tar:
        names = set(tar.getnames())
        manifest = json.load(tar.extractfile("manifest.json"))
        params = np.load(io.BytesIO(tar.extractfile("params.npz").read()))
    assert {f["file"] for f in manifest["formats"].values()} <= names and "exports/splat.lod/lod-meta.json" in names
    assert params["means"].shape == (manifest["gaussians"], 3) and manifest["gaussians"] > 100
    assert params["sh_rest"].shape == (manifest["gaussians"], 15, 3) and int(params["sh_degree"]) == 3
    assert np.abs(params["sh_rest"]).max() > 0  # trained up to SH degree 3: the formats' SH bands are exercised
    # What the GPU run's results go through next, here on the dry run's: every format decoded by its tools.
    decoded = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_decode_exports.py"), str(tmp_path)],
                             capture_output=True, text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert decoded.returncode == 0, decoded.stdout[-4000:] + decoded.stderr[-4000:]

    viewer = stage["viewer"]
    assert viewer["ok"] is True and viewer["camera"] == "the server's opening view", viewer
    assert viewer["http"]["status"] == 200 and viewer["media_type"] == "image/jpeg" and viewer["image_std"] > 2
    summary = (tmp_path / "summary.md").read_text()
    assert "## commands: ok" in summary and "- resume_verdict: bit-identical" in summary


def _diff(identical: bool, count=(10, 10), rel=1e-6) -> dict:
    d = {"identical_checkpoint": identical, "count": list(count)}
    if count[0] == count[1]:
        d["rel_max"] = {"means": 0.0 if identical else rel, "scales": 0.0 if identical else rel}
    return d


@pytest.mark.parametrize(
    "floor, resumed, verdict",
    [
        (_diff(True), _diff(True), "bit-identical"),
        (_diff(True), _diff(False), "DIFFERS: two uninterrupted runs are bit-identical"),
        (_diff(False, rel=1e-6), _diff(False, rel=5e-6), "within the float atomics' tolerance: at most 5.0x"),
        (_diff(False, rel=1e-6), _diff(False, rel=1e-3), "DIFFERS: up to 1000x"),
        (_diff(False, count=(10, 11)), _diff(False, count=(10, 12)), "within the device's nondeterminism"),
        (_diff(False), _diff(False, count=(10, 12)), "DIFFERS: gaussian counts differ"),
    ],
)
def test_resume_verdict(floor, resumed, verdict):
    assert cuda_device_run.resume_verdict(floor, resumed).startswith(verdict)


@pytest.mark.parametrize("position", [(0.0, 0.0, 3.0), (1.0, -2.0, 0.5), (0.0, 0.0, -3.0), (3.0, 0.0, 0.0)])
def test_camera_message_looks_at_its_target(position):
    """The wxyz a ViewerCameraMessage carries turns the camera's +Z (OpenCV forward) towards the target
    and its -Y towards the up direction, as viser's client computes it."""
    target, up = np.array([0.2, 0.1, -0.3]), np.array([0.0, 0.0, 1.0])
    msg = cuda_device_run.camera_message(position, tuple(target), tuple(up), fov=0.8)
    w, x, y, z = msg["wxyz"]
    assert abs(w * w + x * x + y * y + z * z - 1) < 1e-9
    rot = np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
                    [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
                    [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]])  # fmt: skip
    forward = (target - np.array(position)) / np.linalg.norm(target - np.array(position))
    assert np.allclose(rot[:, 2], forward, atol=1e-9)
    assert rot[:, 1] @ up < 0 and abs(rot[:, 0] @ up) < 1e-9  # -Y up-ish, X level


def test_the_gpu_image_emulation_hides_what_the_image_lacks():
    """benchmarks/cuda_image: open3d (installed here, not there) is neither importable nor a distribution;
    what the image has (torch) or what travels (nerfstudio, tyro's typeguard) stays; the checkout stays."""
    code = (
        "import importlib.util as u, importlib.metadata as m\n"
        "print([u.find_spec(n) is not None for n in ('open3d', 'torch', 'nerfstudio', 'typeguard', 'splat_metal_method')])\n"
        "print(sorted({d.metadata['Name'].lower() for d in m.distributions()} & {'open3d', 'torch', 'nerfstudio'}))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks" / "cuda_image"), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["[False, True, True, True, True]", "['nerfstudio', 'torch']"], out.stdout
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert plain.stdout.startswith("[True,"), plain.stdout  # open3d is installed here: hidden, not absent
