"""A checkpoint that cannot be written or read, through the real commands:

* a full disk while ``ns-train`` saves a checkpoint (planted by tests/inject.py around the real ns-train:
  the write fails half-way with ENOSPC, as a full disk makes it): one message naming the
  file, saying the previous checkpoint is intact, and the command that resumes; exit 1, no traceback,
  no partial file; the previous checkpoint loads;
* then Finder's .DS_Store and a truncated newer checkpoint in that run's nerfstudio_models:
  ``ns-export gaussian-splat`` names the broken file and the good one (exit 1, nothing written),
  ``ns-train --load-dir`` resumes from the good one with a warning, and once the broken file is moved
  away nerfstudio's eval_setup (ns-eval, ns-export, ns-viewer, ns-render) loads it, .DS_Store and all.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import inject
import pytest
from bad_input_table import record
from cli_helpers import cli_env, run_cli, run_dir, small_scene

from splat_metal_method.engine.trainer import resume_command
from splat_metal_method.patches.checkpoints import unreadable

pytestmark = pytest.mark.timeout(600)
QUIET = ["--vis", "tensorboard", "--steps-per-eval-image", "1000000", "--steps-per-eval-all-images", "1000000",
         "--steps-per-eval-batch", "1000000"]  # fmt: skip


def test_full_disk_then_broken_and_stray_files(tmp_path):
    scene = small_scene(tmp_path / "data", 40, 30)  # non-square
    out = tmp_path / "outputs"
    env = cli_env(tmp_path / "torch_home")
    args = ["splat-metal", "--data", scene, "--output-dir", out, "--timestamp", "run", "--max-num-iterations", 12,
            "--steps-per-save", 5, *QUIET]  # fmt: skip
    result = run_cli(inject.command("save-error", 10, "ns-train"), *args, timeout=400, env=env)
    assert result.returncode == 1, result.tail()
    assert "Traceback" not in result.output, result.tail()
    run = run_dir(out, "run", scene=scene.name)
    models = run / "nerfstudio_models"
    good = models / "step-000000005.ckpt"
    lines = result.stderr.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("splat-metal: could not write"))
    message = "\n".join(lines[start:])
    record("train/disk-full-during-save", "the disk fills up while `ns-train` saves a checkpoint", message,
           models=models, data=scene, out=out)  # fmt: skip
    assert str(models / "step-000000010.ckpt") in lines[start] and "No space left on device" in lines[start]
    assert f"the previous checkpoint, {good}, is intact" in lines[start]
    argv = [str(a) for a in result.args]
    argv = argv[argv.index("--") + 1 :]  # ns-train's own, as the process saw them
    assert lines[start + 1 :] == ["Resume with:", f"  {resume_command(argv, models, 12 - 6)}"]
    assert sorted(p.name for p in models.iterdir()) == [good.name] and unreadable(good) is None
    assert not [p for p in run.rglob("*") if ".partial-" in p.name]

    # Finder's .DS_Store and a truncated newer checkpoint
    (models / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    broken = models / "step-000000010.ckpt"
    broken.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    plain_env = cli_env(tmp_path / "torch_home")
    with ThreadPoolExecutor(2) as pool:
        export = pool.submit(run_cli, "ns-export", "gaussian-splat", "--load-config", run / "config.yml",
                             "--output-dir", tmp_path / "export", timeout=400, env=plain_env)  # fmt: skip
        resumed = pool.submit(run_cli, "ns-train", "splat-metal", "--data", scene, "--output-dir", out, "--timestamp",
                              "resumed", "--load-dir", models, "--max-num-iterations", 2, *QUIET,
                              timeout=400, env=plain_env)  # fmt: skip
        export, resumed = export.result(), resumed.result()
    assert export.returncode == 1 and "Traceback" not in export.output, export.tail()
    last = export.stderr.rstrip().splitlines()[-1]
    record("checkpoint/ns-export-newest-truncated", "`ns-export` of a run whose newest checkpoint is truncated",
           last, models=models)  # fmt: skip
    assert str(broken) in last and str(good) in last
    assert not (tmp_path / "export" / "splat.ply").exists()

    assert resumed.returncode == 0 and "Traceback" not in resumed.output, resumed.tail()
    flat = " ".join(resumed.output.split())
    assert f"{broken} cannot be read" in flat and f"resuming from the previous good one, {good}" in flat
    assert (run_dir(out, "resumed", scene=scene.name) / "nerfstudio_models" / "step-000000007.ckpt").is_file()

    shutil.move(broken, tmp_path / broken.name)  # as the message says
    from nerfstudio.utils.eval_utils import eval_setup

    config, pipeline, path, step = eval_setup(run / "config.yml", test_mode="inference")
    assert (Path(path), step) == (good, 5) and (models / ".DS_Store").exists()
    assert config.load_step == 5
