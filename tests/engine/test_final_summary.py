"""The end of a finished ``ns-train splat-metal`` run: the checkpoint, the held-out metrics of the run's
last all-images eval (where it ran one) and the export command to run next, which works as printed."""

from __future__ import annotations

import re
import shlex

from cli_helpers import cli_env, run_cli, run_dir, small_scene

STEPS = 6


def test_summary_names_held_out_metrics_and_the_export_command(tmp_path):
    scene = small_scene(tmp_path / "data", 40, 30)
    out = tmp_path / "outputs"
    result = run_cli(
        "ns-train", "splat-metal", "--data", scene, "--output-dir", out, "--timestamp", "done",
        "--max-num-iterations", STEPS, "--steps-per-save", STEPS, "--vis", "tensorboard",
        "--steps-per-eval-image", 1000000, "--steps-per-eval-batch", 1000000, "--steps-per-eval-all-images", 5,
        timeout=400, torch_home=tmp_path / "torch_home",
    )  # fmt: skip
    assert result.returncode == 0, result.tail()
    held_out = re.search(
        r"^held-out images \((\d+), step 5\): PSNR (\d+\.\d\d) dB, SSIM (\d\.\d{3})", result.output, re.M
    )
    assert held_out, result.tail()
    assert int(held_out.group(1)) >= 1 and float(held_out.group(2)) > 0, held_out.group(0)
    lines = result.output.splitlines()
    export = lines[lines.index("To export the splat:") + 1].strip()
    base = run_dir(out, "done", scene=scene.name)
    assert export == (
        f"splat-metal-export --load-config {base / 'config.yml'} --output-dir {base / 'exports'} --format ply"
    ), export
    argv = shlex.split(export)
    exported = run_cli(argv[0], *argv[1:], timeout=300, env=cli_env(tmp_path / "torch_home"))
    assert exported.returncode == 0, exported.tail()
    assert list((base / "exports").glob("*.ply")), exported.tail()
