"""`splat-metal-doctor` as users run it: every kernel compiled and checked against the reference (on
CPU: the Metal kernels under the emulator, plus the native cpu backend), exit status 0."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from splat_metal_method.ops.metal import variants
from splat_metal_method.ops.metal.emulator.errors import MetalCompileError
from splat_metal_method.verify import doctor

NO_MPS = pytest.mark.skipif(torch.backends.mps.is_available(), reason="the no-MPS path: this machine has MPS")


def test_doctor_passes_on_cpu():
    exe = shutil.which("splat-metal-doctor")
    assert exe, "the splat-metal-doctor console script is not installed (pip install -e .)"
    env = {**os.environ, "COLUMNS": "200"}  # rich wraps table cells at the terminal width
    res = subprocess.run(
        [exe, "--device", "cpu", "--size", "45x29"], capture_output=True, text=True, timeout=600, env=env
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "auto backend here: cpu" in res.stdout
    assert "rasterization (cpu)" in res.stdout and "MISMATCH" not in res.stdout
    assert "rasterize (tile 16, 3 channels, absgrad)" in res.stdout  # what training uses
    assert "sh (degree 4) " in res.stdout  # every SH degree gsplat supports, 0..4
    assert "sh (fused preparation with projection, degree 4, antialiased)" in res.stdout  # training's SH path
    assert "covariance + precision (triu, metal)" in res.stdout and "covariance + precision (3x3, cpu)" in res.stdout
    assert "l1 + ssim loss (metal)" in res.stdout  # the fused training loss (ops/metal/loss.py)
    assert "Metal pipelines" in res.stdout and "radix_scatter" in res.stdout  # each kernel's threadgroup limit
    passed, total = res.stdout.rsplit(" checks passed", 1)[0].rsplit("\n", 1)[-1].split("/")
    assert passed == total and int(total) >= 18, res.stdout


def test_full_op_check_reads_only_what_gsplats_meta_holds(monkeypatch):
    """cuda_vs_splatfacto runs full_op_checks(cuda, "gsplat") on a GPU, where the op returns gsplat's own meta
    (no depth_chunks: the H200 run of 2026-12-04 reported inf from a KeyError). Here the cpu backend's meta is
    cut to gsplat's keys: the check still compares and passes."""
    import splat_metal_method.ops as ops
    from splat_metal_method.verify.kernel_checks import full_op_checks

    full = ops.rasterization
    gsplat_keys = {"camera_ids", "gaussian_ids", "radii", "means2d", "depths", "conics", "opacities", "tile_width",
                   "tile_height", "tiles_per_gauss", "isect_ids", "flatten_ids", "isect_offsets", "width", "height",
                   "tile_size", "n_cameras"}  # fmt: skip

    def gsplat_like(*args, **kwargs):
        colors, alphas, meta = full(*args, **kwargs)
        return colors, alphas, {k: v for k, v in meta.items() if k in gsplat_keys}

    monkeypatch.setattr(ops, "rasterization", gsplat_like)
    checks = full_op_checks(torch.device("cpu"), "cpu", 31, 19, n=60)
    assert [c.direction for c in checks] == ["forward", "backward"]
    assert all(c.ok for c in checks), [c.describe() for c in checks]


@NO_MPS
def test_all_variants_parses_and_runs_the_linux_checks_on_every_checked_library(monkeypatch, capsys):
    """--all-variants without MPS: one line says that Apple's compiler needs a Mac and what runs instead; the list it
    checks is variants.checked_variants(), in order; a failure is reported by library name with the compiler's
    message and exits 1. The per-library check is recorded here (test_all_variants_linux_checks_pass runs it)."""
    seen = []
    monkeypatch.setattr(doctor, "check_on_linux", seen.append)
    assert doctor.main(["--all-variants", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    checked = list(variants.checked_variants())
    assert seen == checked
    mac_lines = [line for line in out.splitlines() if "needs a Mac" in line]
    assert len(mac_lines) == 1 and "Linux checks" in mac_lines[0], out
    assert f"{len(checked)}/{len(checked)} libraries of checked_variants checked" in out and "FAILED" not in out

    planted = checked[len(checked) // 2]

    def refuse_one(variant):
        if variant == planted:
            raise MetalCompileError("planted: error: use of undeclared identifier 'x'")

    monkeypatch.setattr(doctor, "check_on_linux", refuse_one)
    assert doctor.main(["--all-variants"]) == 1
    out = capsys.readouterr().out
    name = variants.variant_name(planted)
    assert f"FAILED {name}: MetalCompileError: planted: error: use of undeclared identifier 'x'" in out
    assert f"{len(checked) - 1}/{len(checked)} libraries" in out and "1 FAILED, please report" in out


@NO_MPS
def test_device_mps_without_mps_says_so_in_one_line(capsys):
    for argv in (["--device", "mps"], ["--device", "mps", "--all-variants"]):
        assert doctor.main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and "no usable MPS device" in captured.err


def test_all_variants_linux_checks_pass():
    """`splat-metal-doctor --all-variants` as a user on Linux runs it: every checked library passes the MSL-subset
    parser and the address-space check."""
    exe = shutil.which("splat-metal-doctor")
    assert exe, "the splat-metal-doctor console script is not installed (pip install -e .)"
    res = subprocess.run([exe, "--all-variants", "--device", "cpu"], capture_output=True, text=True, timeout=900)
    n = len(list(variants.checked_variants()))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{n}/{n} libraries of checked_variants checked (MSL subset, address spaces)" in res.stdout


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs a Mac with MPS (torch.mps.compile_shader)")
def test_all_variants_compile_with_apples_compiler_on_mps():
    """On a Mac: every checked library compiles with torch.mps.compile_shader and builds its pipelines."""
    count, failures, _ = doctor.check_every_variant(doctor.compile_on_mps)
    assert count == len(list(variants.checked_variants())) and failures == {}, failures
