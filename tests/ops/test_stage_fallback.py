"""Per-stage fallback after a failed Metal self-check (self_check.py, ops/stage_fallback.py), in-process
under the MSL emulator (the metal backend on CPU tensors).

A planted wrong kernel in the real dispatch path: the rasterizer's forward dispatch
(ops/metal/__init__.py's rasterize_to_pixels_fwd, which launches rasterize.metal) returns colours 5 %
too bright. A model training with backend "metal" then checks first, marks "rasterize" failed, says
so in one line, and keeps training: its renders equal the reference backend's, while projection, SH
and intersection + sort still launch their Metal kernels and rasterize.metal is never launched. With
``metal-self-check strict`` the same verdict stops the run (SelfCheckFailed)."""

from __future__ import annotations

import json
import math

import demo_runs
import pipelines
import pytest
import torch

from splat_metal_method.ops import backend_module, metal, quat_scale_to_covar_preci, reference, stage_fallback
from splat_metal_method.ops.metal import runtime
from splat_metal_method.verify import self_check

STEPS = 3
STAGE_KERNELS = {  # Metal kernels each stage launches in a training step (forward + backward)
    "projection": ("project_fwd", "project_bwd"),
    "sh": ("sh_fwd", "sh_bwd"),
    "isect+sort": ("isect_count", "radix_hist"),
    "rasterize": ("rasterize_fwd", "rasterize_bwd"),
}


@pytest.fixture
def fresh_process(tmp_path, monkeypatch):
    """No verdict cached, nothing verified, no stage marked failed; the marks are cleared afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(self_check, "_verified", set())
    stage_fallback.reset()
    yield
    stage_fallback.reset()


@pytest.fixture
def wrong_rasterizer(monkeypatch):
    right = metal.rasterize_to_pixels_fwd

    def wrong(*args, **kwargs):  # the Metal forward, 5 % too bright
        render_colors, render_alphas, transmittance, last_ids = right(*args, **kwargs)
        return render_colors * 1.05, render_alphas, transmittance, last_ids

    monkeypatch.setattr(metal, "rasterize_to_pixels_fwd", wrong)


def _metal_model(mode):
    model = demo_runs.small_model("black")
    model.config.backend = "metal"
    model.config.metal_self_check = mode
    return model


def test_a_wrong_stage_falls_back_and_training_continues(fresh_process, wrong_rasterizer, tmp_path, capsys):
    """nerfstudio's training set-up and steps (tests/pipelines.py) with backend "metal" on a 48x32 demo scene."""
    from splat_metal_method.data import demo_scene

    data = tmp_path / "scene"
    demo_scene.generate(data, width=48, height=32, views=10)  # in process: no second Python start-up
    pipeline, optimizers, callbacks = pipelines.make_pipeline(data, backend="metal")  # the self-check runs here
    lines = [line for line in capsys.readouterr().out.splitlines() if "Metal self-check" in line]
    losses, launches = [], []
    for step in range(STEPS):
        runtime.reset_launch_counts()
        losses.append(pipelines.train_step(pipeline, optimizers, callbacks, step).item())
        launches.append(runtime.launch_counts())
    print(f"losses {losses}; Metal launches per step: {launches}")

    assert stage_fallback.failed() == {"rasterize"}
    (line,) = lines  # one line, naming the stage, its error and the doctor command
    assert "rasterize failed (rasterize (tile 16, 3 channels, absgrad) forward: max abs error" in line, line
    assert "on the PyTorch reference on cpu, the others on Metal" in line and self_check.DOCTOR_COMMAND in line
    (verdict,) = json.loads(self_check.cache_path().read_text()).values()
    assert verdict["passed"] is False and set(verdict["failed"]) == {"rasterize"}

    assert all(math.isfinite(x) for x in losses)  # training went on
    for counts in launches:
        for stage in ("projection", "sh", "isect+sort"):
            for kernel in STAGE_KERNELS[stage]:
                assert counts.get(kernel, 0) >= 1, (stage, kernel, counts)
        assert not set(STAGE_KERNELS["rasterize"]) & set(counts), counts

    # The fallen-back stage's result is the reference's: the whole render equals backend "reference".
    model = pipeline.model
    model.eval()
    camera, _ = pipeline.datamanager.next_train(STEPS)
    with torch.no_grad():
        got = model.get_outputs(camera)["rgb"]
        model.config.backend = "reference"
        want = model.get_outputs(camera)["rgb"]
    assert (want - 1).abs().max() > 0.05  # something is drawn over the white background
    assert (got - want).abs().max().item() <= 1e-5


def test_the_fallback_routes_only_the_failed_stage(fresh_process):
    assert backend_module("metal") is metal
    stage_fallback.mark_failed(["isect+sort"])
    ops = backend_module("metal")

    assert ops.isect_tiles is reference.isect_tiles and ops.isect_offset_encode is reference.isect_offset_encode
    assert ops.project is metal.project and ops.rasterize_to_pixels is metal.rasterize_to_pixels
    with pytest.raises(ValueError, match=r"unknown stages \['raster'\]"):
        stage_fallback.mark_failed(["raster"])

    # MCMC's covariance (ops/mcmc.py): the Metal kernel until "covariance" failed, then the reference.
    quats, scales = torch.randn(50, 4), torch.rand(50, 3)
    runtime.reset_launch_counts()
    metal_covars, _ = quat_scale_to_covar_preci(quats, scales, backend="metal")
    assert runtime.launch_counts() == {"quat_scale_to_covar_preci_fwd": 1}
    stage_fallback.mark_failed(["covariance"])
    runtime.reset_launch_counts()
    covars, _ = quat_scale_to_covar_preci(quats, scales, backend="metal")
    assert runtime.launch_counts() == {}
    assert torch.equal(covars, reference.quat_scale_to_covar_preci(quats, scales)[0])
    assert torch.allclose(covars, metal_covars, atol=1e-5)


def test_strict_mode_stops_on_the_same_wrong_stage(fresh_process, wrong_rasterizer):
    model = _metal_model("strict")
    model.train()
    runtime.reset_launch_counts()
    with pytest.raises(
        self_check.SelfCheckFailed,
        match=r"(?s)failed their self-check.*rasterize \(tile 16.*"
        r"Stopped before training \(--pipeline.model.metal-self-check strict\)",
    ):
        self_check.ensure_verified(model, torch.device("cpu"), "metal")
    assert stage_fallback.failed() == set()  # nothing falls back: the run stops
    # The verdict is cached: strict stops again without running a kernel, fallback mode uses it too.
    runtime.reset_launch_counts()
    with pytest.raises(self_check.SelfCheckFailed):
        self_check.ensure_verified(model, torch.device("cpu"), "metal")
    assert runtime.launch_counts() == {}
    model.config.metal_self_check = "fallback"
    self_check.ensure_verified(model, torch.device("cpu"), "metal")
    assert stage_fallback.failed() == {"rasterize"} and runtime.launch_counts() == {}


def test_the_whole_op_check_blames_only_the_wrong_stage(fresh_process, monkeypatch, capsys):
    """With depth chunks the self-check also runs the whole op; a wrong SH kernel must not make it blame
    the rasterizer too (it runs with the stages already found wrong on the reference)."""
    right = metal.KERNELS.spherical_harmonics_fwd
    monkeypatch.setattr(metal.KERNELS, "spherical_harmonics_fwd", lambda *a, **k: right(*a, **k) * 1.05)
    run = self_check.RunKernels(tile_size=16, channels=(3,), rasterize_mode="classic", absgrad=True, sh_degree=1,
                                depth_chunks=True)  # fmt: skip
    assert self_check.verify(torch.device("cpu"), run) is not None
    (verdict,) = json.loads(self_check.cache_path().read_text()).values()
    assert list(verdict["failed"]) == ["sh"] and stage_fallback.failed() == {"sh"}
    assert "rasterization (metal, 3 depth chunks)" not in verdict["message"]
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "Metal self-check" in line]
    assert "sh failed (sh (degree 0) forward" in line and "that stage runs" in line


@pytest.mark.parametrize("failed, padded", [(["projection"], True), (["isect+sort"], False), (["rasterize"], False)])
def test_padded_lists_only_where_metal_intersects_and_rasterizes(fresh_process, failed, padded):
    """Training steps use padded intersection lists (no host read) only while both Metal's isect+sort and
    rasterizer run: the reference's stages take exact lists."""
    stage_fallback.mark_failed(failed)
    ops = backend_module("metal")
    assert (getattr(ops, "isect_tiles_padded", None) is metal.isect_tiles_padded) is padded
