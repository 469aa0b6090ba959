"""The Metal self-check (splat_metal_method/verify/self_check.py) as a user meets it: `ns-train splat-metal
--pipeline.model.backend metal` on CPU tensors runs the Metal kernels under the MSL emulator, so the
check runs there too. The package is installed (copied) under a directory named with a non-ASCII
character, as on a Mac under /Users/José/, and imported from there (PYTHONPATH); first with its
kernels as they are (trains, caches the verdict), then with one wrong line in sh.h (the SH stage
falls back to the reference, named in one line with the doctor command, and the run trains on). The
strict mode's stop is tested in-process in tests/ops/test_stage_fallback.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import demo_runs
import pytest
import torch
from cli_helpers import checkpoints, cli_env, demo_args, run_cli

from splat_metal_method.ops import stage_fallback
from splat_metal_method.ops.metal import kernels, runtime
from splat_metal_method.ops.metal.emulator import MetalCompileError, compile_library
from splat_metal_method.verify import self_check

PACKAGE = Path(self_check.__file__).resolve().parents[1]  # the package root (self_check is in verify/)
RIGHT = "b.v[2] = 0.48860251190292f * z;"  # sh.h's SH basis, shared by sh.metal and the native cpu backend
WRONG = "b.v[2] = 0.5f * z;"  # a plausible typo: SH degree 1 off by 2 %


def _install_copy(root: Path) -> Path:
    shutil.copytree(PACKAGE, root / "splat_metal_method", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _train(scene: Path, out: Path, env: dict, *extra: str):
    return run_cli(
        "ns-train", "splat-metal", *demo_args(max_num_iterations=1, steps_per_eval_all_images=100000),
        "--data", scene, "--output-dir", out, "--timestamp", "run", "--machine.device-type", "cpu",
        "--pipeline.model.backend", "metal", *extra, timeout=600, env=env, cwd=out.parent,
    )  # fmt: skip


def test_ns_train_checks_metal_kernels_first_and_falls_back_on_a_wrong_one(tmp_path, tmp_path_factory):
    scene = demo_runs.demo_scene(tmp_path_factory)
    install = _install_copy(tmp_path / "Jos\u00e9 install")
    cache = tmp_path / "cache"
    env = cli_env(extra={"PYTHONPATH": str(install), "XDG_CACHE_HOME": str(cache)})

    # The copy's own runtime.py (its KERNEL_DIR is under the non-ASCII path) assembles ASCII sources with
    # package-relative #line names, which the emulator compiles.
    spec = importlib.util.spec_from_file_location("copied_runtime", install / "splat_metal_method/ops/metal/runtime.py")
    copied = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = copied  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(copied)
    finally:
        del sys.modules[spec.name]
    assert "\u00e9" in str(copied.KERNEL_DIR)
    src = copied.load_source("common.h", "covar.h", "sh.h", "sh.metal", defines={**kernels._base_defines(16)})
    assert src.isascii() and '#line 1 "splat_metal_method/ops/metal/sh.metal"' in src
    assert "sh_fwd" in dir(compile_library(src, "sh"))

    right = _train(scene, tmp_path / "right", env)
    assert right.returncode == 0, right.tail()
    assert "Metal self-check passed" in right.output, right.tail()
    run_dir = tmp_path / "right" / scene.name / "splat-metal" / "run"
    assert [p.name for p in checkpoints(run_dir)] == ["step-000000000.ckpt"]
    verdicts = json.loads((cache / "splat_metal" / "self_check.json").read_text())
    (verdict,) = verdicts.values()
    assert verdict["passed"] and verdict["run"] == {"tile_size": 16, "channels": [3, 4], "rasterize_mode": "classic",
                                                    "absgrad": True, "sh_degree": 3, "depth_chunks": True,
                                                    "covariance": False}  # fmt: skip
    print(
        f"self-check on the emulator: {verdict['checks']} checks in {verdict['seconds']} s; "
        f"ns-train (1 step) {right.seconds:.1f} s"
    )

    sh = install / "splat_metal_method" / "ops" / "metal" / "sh.h"
    assert sh.read_text().count(RIGHT) == 1
    sh.write_text(sh.read_text().replace(RIGHT, WRONG))
    wrong = _train(scene, tmp_path / "wrong", env)
    assert wrong.returncode == 0, wrong.tail()
    (line,) = [line for line in wrong.output.splitlines() if "Metal self-check" in line]
    assert "sh failed (sh (degree 1) forward: max abs error" in line, wrong.tail()
    assert "that stage runs on the PyTorch reference on cpu, the others on Metal" in line
    assert self_check.DOCTOR_COMMAND in line and "sh (degree 0)" not in line  # only the failing stage is named
    assert [p.name for p in checkpoints(tmp_path / "wrong" / scene.name / "splat-metal" / "run")] == [
        "step-000000000.ckpt"]  # fmt: skip
    verdicts = json.loads((cache / "splat_metal" / "self_check.json").read_text()).values()
    failed = [v for v in verdicts if not v["passed"]]
    assert [list(v["failed"]) for v in failed] == [["sh"]]
    assert "Traceback" not in wrong.stderr, wrong.tail()


def test_verdict_is_cached_and_the_check_runs_nothing_then(tmp_path, monkeypatch):
    """In-process: a fresh cache runs the kernels, the same configuration again runs none."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    run = self_check.RunKernels(tile_size=16, channels=(4,), rasterize_mode="antialiased", absgrad=False, sh_degree=1)
    runtime.reset_launch_counts()
    assert self_check.verify(torch.device("cpu"), run) is not None
    first = runtime.launch_counts()
    assert {"project_fwd", "project_bwd", "sh_fwd", "sh_bwd", "isect_count", "radix_hist", "rasterize_fwd",
            "rasterize_bwd"} <= set(first), first  # fmt: skip
    runtime.reset_launch_counts()
    assert self_check.verify(torch.device("cpu"), run) is None
    assert runtime.launch_counts() == {}
    (entry,) = json.loads(self_check.cache_path().read_text()).values()
    assert entry["run"]["rasterize_mode"] == "antialiased" and entry["gpu"].startswith("MSL emulator")
    assert entry["msl"] == 320  # keyed on the MSL version the kernels are built at (the emulator's 3.2)


def test_a_degree_4_run_checks_every_degree_and_catches_a_wrong_band_4(tmp_path, monkeypatch):
    """`--pipeline.model.sh-degree 4`: the check runs SH at degrees 0..4 and the fused preparation at degree 4,
    and they pass (they failed before the kernels had band 4); then with one wrong band-4 constant in sh.h
    (the forward basis), only degree 4 and the fused preparation fail, and the SH stage falls back."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    stage_fallback.reset()
    run = self_check.RunKernels(tile_size=16, channels=(3,), rasterize_mode="classic", absgrad=False, sh_degree=4)
    checks = self_check.run_checks(torch.device("cpu"), run)
    sh_checks = [c.stage for c in checks if c.stage.startswith("sh") and c.direction == "forward"]
    assert sh_checks == [f"sh (degree {d})" for d in range(5)] + [
        "sh (fused preparation with projection, degree 4, classic)"]  # fmt: skip
    assert all(c.ok for c in checks), [c.describe() for c in checks if not c.ok]

    right, wrong = "b.v[24] = 0.6258357354491763f * fc3;", "b.v[24] = 0.6f * fc3;"
    source = kernels.stage_source.__wrapped__

    def with_wrong_band_4(stage_file, *args):  # in the SH libraries (every library has sh.h: no other rebuilt)
        text = source(stage_file, *args)
        if stage_file not in ("sh.metal", "sh_bwd.metal"):
            return text
        assert text.count(right) == 1
        return text.replace(right, wrong)

    monkeypatch.setattr(kernels, "stage_source", with_wrong_band_4)
    try:
        assert self_check.verify(torch.device("cpu"), run) is not None
        (verdict,) = [v for v in json.loads(self_check.cache_path().read_text()).values() if not v["passed"]]
        assert list(verdict["failed"]) == ["sh"] and stage_fallback.failed() == {"sh"}
        assert "sh (degree 4) forward: max abs error" in verdict["message"]
        assert "sh (degree 3)" not in verdict["message"]  # bands 0-3 are right
    finally:
        stage_fallback.reset()


def test_an_mcmc_run_also_checks_the_covariance_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    run = self_check.RunKernels(tile_size=16, channels=(3,), rasterize_mode="classic", absgrad=False, sh_degree=0,
                                covariance=True)  # fmt: skip
    runtime.reset_launch_counts()
    assert self_check.verify(torch.device("cpu"), run) is not None
    assert runtime.launch_counts()["quat_scale_to_covar_preci_fwd"] == 2  # full 3x3 and upper triangles


def test_fast_math_is_reported_as_torch_reads_it(monkeypatch):
    from splat_metal_method.verify import doctor

    monkeypatch.delenv(self_check.FAST_MATH_ENV, raising=False)
    assert not self_check.fast_math_enabled() and doctor.fast_math_fact().startswith("unset")
    monkeypatch.setenv(self_check.FAST_MATH_ENV, "0")
    assert not self_check.fast_math_enabled() and doctor.fast_math_fact() == "'0': off"
    monkeypatch.setenv(self_check.FAST_MATH_ENV, "1")
    assert self_check.fast_math_enabled() and "FAST MATH ON" in doctor.fast_math_fact()


def test_non_ascii_path_outside_the_package_is_escaped_and_named_in_errors(tmp_path):
    """A kernel file outside the package (tests, experiments) under a non-ASCII path: the #line name is
    octal-escaped, so the source stays ASCII, and compiler errors still name the file and line."""
    bad = tmp_path / "Jos\u00e9" / "broken.metal"
    bad.parent.mkdir()
    bad.write_text("#include <metal_stdlib>\nusing namespace metal;\n"
                   "kernel void k(device float* o [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
                   "  o[i] = not_declared;\n}\n")  # fmt: skip
    src = runtime.load_source(bad)
    assert src.isascii() and "Jos\\303\\251/broken.metal" in src
    with pytest.raises(MetalCompileError, match=r"broken\.metal:4:.*not_declared"):
        compile_library(src, "broken")


def test_first_render_of_a_metal_model_checks_first(tmp_path, monkeypatch):
    """The viewer's path (get_outputs_for_camera, model not training): the check runs before the first
    render, once per process, and writes its verdict."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(self_check, "_verified", set())  # a fresh process, as far as the check knows
    model = demo_runs.small_model("black")
    model.config.backend = "metal"
    model.eval()
    runtime.reset_launch_counts()
    out = model.get_outputs_for_camera(demo_runs.camera(demo_runs.facing_origin()))
    assert out["rgb"].shape == (30, 40, 3) and model.info["backend"] == "metal"
    checked = runtime.launch_counts()
    assert checked["project_bwd"] >= 1 and checked["rasterize_bwd"] >= 2  # the check's backward passes
    assert json.loads(self_check.cache_path().read_text())  # the verdict
    runtime.reset_launch_counts()
    model.get_outputs_for_camera(demo_runs.camera(demo_runs.facing_origin()))
    assert "rasterize_bwd" not in runtime.launch_counts()  # checked once
