"""End to end through the real command lines, on CPU, in subprocesses: the demo scene generator,
``ns-train splat-metal`` with the demo preset, ``ns-eval``, ``ns-export gaussian-splat`` and a
``--load-dir`` resume. One training run (module fixture) serves every test.

Sizes are chosen so the file runs in a few minutes on 2 CPU cores: a 64x48 demo scene (32 views,
3 held out) and ITERS steps with densification every REFINE steps after a REFINE-step warmup, so
that it fires (at least) once. Every subprocess gets an empty TORCH_HOME: nothing may be
downloaded (LPIPS weights) and nothing from the user's cache is used.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from cli_helpers import CliResult, checkpoint_step, checkpoints, demo_args, run_cli
from PIL import Image

from splat_metal_method.data import demo_scene
from splat_metal_method.method.configs import default_device_type, splat_metal_trainer_config

WIDTH, HEIGHT, VIEWS = 64, 48, 32
ITERS = 90  # steps of the main run: 0 .. ITERS-1
REFINE = 30  # warmup and refine interval: gsplat densifies at steps > warmup that are multiples: 60 (and 90)
RESUME_ITERS = 10  # steps the resumed run adds: ITERS .. ITERS+9, starting with a densification at step 90
SEED_POINTS = demo_scene.N_SEED_POINTS
LOGIT_MIN_OPACITY = -5.5373  # logit(1/255): ns-export drops gaussians below it (exporter.py)
TRAIN_TIMEOUT = 600

pytestmark = pytest.mark.timeout(1200)


@dataclass
class Run:
    scene: Path
    output_dir: Path
    run_dir: Path  # the folder holding config.yml
    torch_home: Path
    result: CliResult

    @property
    def config(self) -> Path:
        return self.run_dir / "config.yml"


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _scalars(run_dir: Path, tag: str) -> dict:
    """{step: value} of a scalar that nerfstudio's tensorboard writer logged in ``run_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    assert tag in events.Tags()["scalars"], f"{tag!r} not logged; tags: {events.Tags()['scalars']}"
    return {e.step: e.value for e in events.Scalars(tag)}


def _train_args(scene: Path, output_dir: Path, timestamp: str, **overrides) -> list:
    options = dict(
        max_num_iterations=ITERS,
        steps_per_save=50,  # a save during training (nerfstudio keeps only the latest) and one at the end
        steps_per_eval_image=10**6,  # no eval renders during training: they cost time and are not tested here
        steps_per_eval_all_images=10**6,
        pipeline__model__warmup_length=REFINE,
        pipeline__model__refine_every=REFINE,
    )
    options.update(overrides)
    return ["splat-metal", *demo_args(**options), "--data", scene, "--output-dir", output_dir, "--timestamp", timestamp]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    root = tmp_path_factory.mktemp("e2e")
    scene, output_dir, torch_home = root / "demo", root / "outputs", root / "torch_home"
    torch_home.mkdir()
    made = run_cli(
        [sys.executable, "-m", "splat_metal_method.data.demo_scene"],
        "--out", scene, "--width", WIDTH, "--height", HEIGHT, "--views", VIEWS, timeout=300,
    )  # fmt: skip
    assert made.returncode == 0, made.tail()
    result = run_cli("ns-train", *_train_args(scene, output_dir, "first"), timeout=TRAIN_TIMEOUT, torch_home=torch_home)
    assert result.returncode == 0, result.tail()
    run_dir = output_dir / scene.name / "splat-metal" / "first"
    assert (run_dir / "config.yml").is_file(), result.tail()
    return Run(scene, output_dir, run_dir, torch_home, result)


@pytest.fixture(scope="module")
def checkpoint(run) -> Path:
    ckpts = checkpoints(run.run_dir)
    assert len(ckpts) == 1, f"expected exactly the final checkpoint (nerfstudio keeps only the latest), got {ckpts}"
    return ckpts[0]


@pytest.fixture(scope="module")
def evaluation(run, tmp_path_factory) -> tuple:
    out = tmp_path_factory.mktemp("eval") / "eval.json"
    result = run_cli(
        "ns-eval", "--load-config", run.config, "--output-path", out, timeout=300, torch_home=run.torch_home
    )
    assert result.returncode == 0, result.tail()
    return json.loads(out.read_text()), result


# ----------------------------------------------------------------------------- training


def test_training_saves_checkpoint_and_densifies(run, checkpoint):
    assert checkpoint_step(checkpoint) == ITERS - 1
    state = torch.load(checkpoint, map_location="cpu")  # weights_only: see test_checkpoint_loads_weights_only
    assert state["step"] == ITERS - 1
    means = state["pipeline"]["_model.gauss_params.means"]
    assert means.ndim == 2 and means.shape[1] == 3 and torch.isfinite(means).all()
    # Densification fired: the strategy reported it and the model no longer has the seed count.
    assert "GSs split" in run.result.stdout, run.result.tail()
    assert means.shape[0] != SEED_POINTS
    counts = _scalars(run.run_dir, "Train Metrics Dict/gaussian_count")
    assert counts[0] == SEED_POINTS and counts[max(counts)] == means.shape[0]
    assert (run.run_dir / "dataparser_transforms.json").is_file()


def test_loss_falls(run):
    loss = _scalars(run.run_dir, "Train Loss")  # logged every 10 steps from step 0
    steps = sorted(loss)
    assert steps[0] == 0 and steps[-1] >= ITERS - 10, steps
    # Each logged loss is on one random training view, so single values jump by ~20 %; compare
    # means of three logs at each end and ask for a clear drop.
    early = np.mean([loss[s] for s in steps[:3]])
    late = np.mean([loss[s] for s in steps[-3:]])
    assert late < 0.75 * early, f"train loss did not fall: first logs {early:.4f}, last logs {late:.4f}"
    psnr = _scalars(run.run_dir, "Train Metrics Dict/psnr")
    assert np.mean([psnr[s] for s in steps[-3:]]) > np.mean([psnr[s] for s in steps[:3]]) + 2.0
    step_ms = _scalars(run.run_dir, "Train Iter (time)")
    print(f"[e2e] train loss {early:.4f} -> {late:.4f}; median step {1000 * np.median(list(step_ms.values())):.0f} ms")


def _constant_colour_psnr(images: list) -> float:
    """Mean per-image PSNR of the best constant colour (each image's mean colour: the MSE optimum)."""
    psnrs = []
    for im in images:
        mse = float(((im - im.mean(axis=(0, 1), keepdims=True)) ** 2).mean())
        psnrs.append(-10 * math.log10(mse))
    return float(np.mean(psnrs))


def test_heldout_psnr_beats_baselines(run, evaluation):
    """Held-out PSNR must clearly beat (by 3 dB, i.e. half the squared error) both
    - the best constant-colour image of each held-out view (what a model that learnt nothing about
      structure scores), and
    - the initial render: nerfstudio logs the training PSNR of step 0, computed on the render of the
      untouched seed-point gaussians before the first optimiser step.
    Measured on 2 CPU cores after 90 steps: constant 10.6 dB, initial 17.5 dB, held-out 23.9 dB."""
    metrics, _ = evaluation
    results = metrics["results"]
    frames = demo_scene.eval_indices(VIEWS)
    images = [np.asarray(Image.open(run.scene / demo_scene.frame_name(i)), dtype=np.float64) / 255 for i in frames]
    constant = _constant_colour_psnr(images)
    initial = _scalars(run.run_dir, "Train Metrics Dict/psnr")[0]
    baseline = max(constant, initial)
    print(f"[e2e] held-out psnr {results['psnr']:.2f} dB (ssim {results['ssim']:.3f}); "
          f"constant-colour {constant:.2f} dB, initial render {initial:.2f} dB")  # fmt: skip
    assert results["psnr"] > baseline + 3.0, (results, constant, initial)
    assert 0.0 < results["ssim"] <= 1.0


# ----------------------------------------------------------------------------- LPIPS, offline


def test_lpips_skipped_once_and_nothing_downloaded(run, evaluation):
    metrics, eval_result = evaluation
    for name, result in (("ns-train", run.result), ("ns-eval", eval_result)):
        count = result.output.count("LPIPS skipped")
        assert count == 1, f"{name}: {count} 'LPIPS skipped' warnings, expected one\n{result.tail()}"
    assert "psnr" in metrics["results"] and "ssim" in metrics["results"]
    assert not any("lpips" in key for key in metrics["results"]), metrics["results"]
    downloaded = [p for p in run.torch_home.rglob("*") if p.is_file()]
    assert downloaded == [], f"something was written to TORCH_HOME: {downloaded}"


# ----------------------------------------------------------------------------- export


def test_export_gaussian_splat_ply(run, checkpoint, tmp_path):
    from plyfile import PlyData

    result = run_cli(
        "ns-export", "gaussian-splat", "--load-config", run.config, "--output-dir", tmp_path,
        timeout=300, torch_home=run.torch_home,
    )  # fmt: skip
    assert result.returncode == 0, result.tail()
    vertex = PlyData.read(str(tmp_path / "splat.ply"))["vertex"]

    p = {k[len("_model.gauss_params."):]: v for k, v in torch.load(checkpoint, map_location="cpu")["pipeline"].items()
         if k.startswith("_model.gauss_params.")}  # fmt: skip
    n, n_rest = p["means"].shape[0], p["features_rest"].shape[1]
    assert n_rest == 15  # sh_degree 3
    names = [prop.name for prop in vertex.properties]
    expected_names = (["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"]
                      + [f"f_rest_{i}" for i in range(3 * n_rest)]
                      + ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"])  # fmt: skip
    assert names == expected_names

    # ns-export writes every gaussian except those with non-finite values or opacity < 1/255.
    flat = torch.cat([v.reshape(n, -1) for v in p.values()], dim=1)
    keep = torch.isfinite(flat).all(dim=1) & (p["opacities"][:, 0] >= LOGIT_MIN_OPACITY)
    assert keep.sum() >= 0.9 * n, f"only {int(keep.sum())}/{n} gaussians are exportable"
    exportable = int(keep.sum())
    assert vertex.count == exportable, f"PLY has {vertex.count} vertices, model has {n} ({exportable} exportable)"
    if keep.all():
        assert vertex.count == n

    def col(name):
        return torch.from_numpy(np.asarray(vertex[name], dtype=np.float32))

    torch.testing.assert_close(torch.stack([col("x"), col("y"), col("z")], 1), p["means"][keep])
    torch.testing.assert_close(torch.stack([col(f"f_dc_{i}") for i in range(3)], 1), p["features_dc"][keep])
    rest = p["features_rest"][keep].transpose(1, 2).reshape(-1, 3 * n_rest)  # Inria order: channel-major
    torch.testing.assert_close(torch.stack([col(f"f_rest_{i}") for i in range(3 * n_rest)], 1), rest)
    torch.testing.assert_close(col("opacity"), p["opacities"][keep][:, 0])
    torch.testing.assert_close(torch.stack([col(f"scale_{i}") for i in range(3)], 1), p["scales"][keep])
    torch.testing.assert_close(torch.stack([col(f"rot_{i}") for i in range(4)], 1), p["quats"][keep])


# ----------------------------------------------------------------------------- resume


def test_resume_continues_step_count(run, checkpoint):
    before_hash, before_mtime = _sha256(checkpoint), checkpoint.stat().st_mtime_ns
    old_step = checkpoint_step(checkpoint)
    # --machine.device-type given explicitly here: the resumed run's config must record it.
    args = _train_args(run.scene, run.output_dir, "resumed", max_num_iterations=RESUME_ITERS)
    result = run_cli(
        "ns-train", *args, "--load-dir", checkpoint.parent, "--machine.device-type", "cpu",
        timeout=TRAIN_TIMEOUT, torch_home=run.torch_home,
    )  # fmt: skip
    assert result.returncode == 0, result.tail()
    assert f"Done loading Nerfstudio checkpoint from {checkpoint}" in " ".join(result.stdout.split()), result.tail()

    new_run = run.run_dir.parent / "resumed"
    new = checkpoints(new_run)
    assert [checkpoint_step(c) for c in new] == [old_step + RESUME_ITERS]  # resume adds max-num-iterations steps
    resumed_state = torch.load(new[0], map_location="cpu")
    assert resumed_state["step"] == old_step + RESUME_ITERS
    # The optimizers hold the model's own parameters: their Adam moments have the parameters' shapes
    # (after a densification they would not if the optimizers still pointed at pre-load tensors).
    for name in ("means", "scales", "quats", "features_dc", "features_rest", "opacities"):
        param = resumed_state["pipeline"][f"_model.gauss_params.{name}"]
        moments = resumed_state["optimizers"][name]["state"][0]["exp_avg"]
        assert moments.shape == param.shape, (name, moments.shape, param.shape)
    # The old run is untouched.
    assert checkpoints(run.run_dir) == [checkpoint]
    assert _sha256(checkpoint) == before_hash and checkpoint.stat().st_mtime_ns == before_mtime
    # The weights were loaded, not re-initialised: the first loss after resuming is near the
    # trained model's, far below the loss of the fresh model at step 0.
    fresh, resumed = _scalars(run.run_dir, "Train Loss"), _scalars(new_run, "Train Loss")
    assert min(resumed) > old_step, sorted(resumed)
    first_resumed = resumed[min(resumed)]
    assert first_resumed < 0.75 * fresh[0], (first_resumed, fresh[0])
    config = yaml.load((new_run / "config.yml").read_text(), Loader=yaml.Loader)
    assert config.machine.device_type == "cpu"


# ----------------------------------------------------------------------------- checkpoints and torch.load


def test_checkpoint_loads_weights_only(checkpoint):
    """ns-export, ns-eval, ns-viewer and --load-dir use a plain torch.load, which is weights_only
    from torch 2.6. It works because importing splat_metal_method allow-lists numpy scalar types."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert state["step"] == ITERS - 1

    # The allow-list is needed: the checkpoint does hold numpy objects ...
    full = torch.load(checkpoint, map_location="cpu", weights_only=False)
    found = []

    def scan(x, path="ckpt"):
        if isinstance(x, (np.generic, np.ndarray, np.dtype)):
            found.append(path)
        elif isinstance(x, dict):
            for k, v in x.items():
                scan(v, f"{path}[{k!r}]")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                scan(v, f"{path}[{i}]")

    scan(full)
    assert found, "no numpy objects in the checkpoint: the weights_only allow-list is not exercised"
    # ... and a weights_only load without it fails.
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(Exception, match="(?i)weights.only|unsupported global"):
            torch.load(checkpoint, map_location="cpu", weights_only=True)
    finally:
        torch.serialization.add_safe_globals(saved)
    torch.load(checkpoint, map_location="cpu", weights_only=True)  # restored


# ----------------------------------------------------------------------------- device choice


def test_training_used_the_default_device(run):
    config = yaml.load(run.config.read_text(), Loader=yaml.Loader)
    assert config.machine.device_type == default_device_type()
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert config.machine.device_type == "cpu"


@pytest.mark.parametrize(
    "mps, cuda, expected",
    [(True, True, "mps"), (True, False, "mps"), (False, True, "cuda"), (False, False, "cpu")],
)
def test_default_device_type_prefers_mps_then_cuda(monkeypatch, mps, cuda, expected):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert default_device_type() == expected
    assert splat_metal_trainer_config().machine.device_type == expected


def test_explicit_device_type_wins(monkeypatch):
    """With an Apple GPU present the default is mps; --machine.device-type cpu overrides it (parsed
    by tyro exactly as ns-train parses it)."""
    import tyro

    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    config = splat_metal_trainer_config()
    assert config.machine.device_type == "mps"
    assert tyro.cli(type(config), default=config, args=[]).machine.device_type == "mps"
    assert tyro.cli(type(config), default=config, args=["--machine.device-type", "cpu"]).machine.device_type == "cpu"
