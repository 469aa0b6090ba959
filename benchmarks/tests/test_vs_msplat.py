"""benchmarks/bench_vs_msplat.py (was `splat-metal-bench --vs msplat`): the matched settings (one function, both projects' terms), the clear
refusal where msplat cannot be installed (here), the wiring with a stand-in msplat module, and our side
trained by nerfstudio's real Trainer with those settings."""

from __future__ import annotations

import math
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from step_model import vs_msplat as msplat_bench

BENCHMARKS = Path(__file__).resolve().parents[1]

# msplat 1.1.3's TrainingConfig fields (python/msplat/_core.pyi)
MSPLAT_CONFIG_FIELDS = {
    "iterations", "sh_degree", "sh_degree_interval", "ssim_weight", "num_downscales", "resolution_schedule",
    "refine_every", "warmup_length", "reset_alpha_every", "densify_grad_thresh", "densify_size_thresh",
    "stop_screen_size_at", "split_screen_size", "keep_crs", "downscale_factor", "output", "save_every", "bg_color",
}  # fmt: skip


def _ours_config(m):
    from splat_metal_method.method.configs import splat_metal_trainer_config

    cfg = splat_metal_trainer_config()
    msplat_bench.ours_configure(m)(cfg)
    return cfg


@pytest.mark.parametrize("steps", [7000, 30000, 300, 8])
def test_matched_settings_are_the_same_in_both(steps):
    m = msplat_bench.matched_settings(steps, sh_degree=2, downscale=2, num_downscales=1)
    theirs = msplat_bench.msplat_config_kwargs(m)
    assert set(theirs) <= MSPLAT_CONFIG_FIELDS
    data = msplat_bench.msplat_dataset_kwargs(m)
    assert data == {"downscale_factor": 2.0, "eval_mode": True, "test_every": 8}
    cfg = _ours_config(m)
    ours, parser = cfg.pipeline.model, cfg.pipeline.datamanager.dataparser
    assert cfg.max_num_iterations == theirs["iterations"] == steps
    assert ours.sh_degree == theirs["sh_degree"] == 2
    assert ours.num_downscales == theirs["num_downscales"] == 1 and parser.downscale_factor == 2
    assert (parser.eval_mode, parser.eval_interval) == ("interval", 8)
    # the densification schedule, mapped name by name
    for ns_name, ms_name in (("sh_degree_interval", "sh_degree_interval"), ("resolution_schedule", "resolution_schedule"),
                             ("warmup_length", "warmup_length"), ("refine_every", "refine_every"),
                             ("reset_alpha_every", "reset_alpha_every"), ("stop_screen_size_at", "stop_screen_size_at"),
                             ("densify_size_thresh", "densify_size_thresh"), ("split_screen_size", "split_screen_size"),
                             ("ssim_lambda", "ssim_weight")):  # fmt: skip
        assert getattr(ours, ns_name) == theirs[ms_name], ns_name
    assert ours.stop_split_at == steps // 2  # msplat's Model: stopSplitAt = maxSteps / 2
    if steps >= msplat_bench.FULL_SCHEDULE_STEPS:  # both projects' defaults, unchanged
        assert (ours.warmup_length, ours.refine_every, ours.reset_alpha_every, ours.sh_degree_interval) == (
            500,
            100,
            30,
            1000,
        )
    else:  # scaled: densification happens inside the run, no opacity reset does
        assert ours.warmup_length < steps and ours.refine_every < steps
        assert ours.reset_alpha_every * ours.refine_every > steps


def test_held_out_images_are_the_same_every_8th():
    from nerfstudio.data.utils.dataparsers_utils import get_train_eval_split_interval

    names = [f"frame_{i:05d}.png" for i in range(1, 30)]
    _, ours = get_train_eval_split_interval(names, 8)
    theirs = [i for i in range(len(names)) if i % 8 == 0]  # msplat InputData::splitTrainTest(testEvery)
    assert list(ours) == theirs == [0, 8, 16, 24]


def test_steady_median_skips_the_first_and_refine_steps():
    m = msplat_bench.matched_settings(16)  # warm-up 2, refine every 2
    ms = [100.0] + [1.0 if s % 2 else 50.0 for s in range(1, 16)]
    assert msplat_bench.steady_median(ms, m) == 1.0


def test_without_msplat_the_option_says_so_and_fails():
    import importlib.util

    if importlib.util.find_spec("msplat") is not None:
        pytest.skip("msplat is installed here")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_vs_msplat.py")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    for needed in ("msplat", "macOS 14+", "Python 3.12+", "pip install msplat"):
        assert needed in proc.stderr, proc.stderr
    assert "ours:" not in proc.stdout  # nothing trained


def test_the_line_with_a_stand_in_msplat(monkeypatch, tmp_path):
    calls = {}

    class Stats:
        def __init__(self, i):
            self.iteration, self.splat_count, self.ms_per_step = i, 1000 + i, 5.0

    class Trainer:
        def __init__(self, dataset, config):
            calls["config"], self.i = config, 0

        def step(self):
            self.i += 1
            return Stats(self.i)

        def evaluate(self):
            return {"psnr": 21.5, "ssim": 0.7, "l1": 0.1}

    fake = types.SimpleNamespace(
        load_dataset=lambda path, **kw: calls.setdefault("dataset", (path, kw)),
        TrainingConfig=lambda **kw: kw, GaussianTrainer=Trainer, sync=lambda: calls.setdefault("synced", True),
    )  # fmt: skip
    monkeypatch.setitem(sys.modules, "msplat", fake)
    monkeypatch.setattr(msplat_bench, "run_ours", lambda data, m, device, backend, work: msplat_bench.Result(
        "ours", 4.0, 900, 22.0, 1.0, 4.5))  # fmt: skip
    (tmp_path / "scene").mkdir()
    rc = msplat_bench.main(tmp_path / "scene", 40, 3, 1, 0, "mps", tmp_path / "out")
    assert rc == 0
    m = msplat_bench.matched_settings(40)
    assert calls["config"] == msplat_bench.msplat_config_kwargs(m)
    assert calls["dataset"] == (str((tmp_path / "scene").resolve()), msplat_bench.msplat_dataset_kwargs(m))
    line = (tmp_path / "out" / "vs_msplat.txt").read_text().strip()
    assert "\n" not in line and line.startswith("bench_vs_msplat | scene | mps | 40 steps")
    assert calls["synced"]  # the loop's wall time drains msplat's queue first
    assert "ours: 4.00 ms/step (wall 4.50), 900 gaussians, PSNR 22.00 dB" in line
    assert "msplat: 5.00 ms/step (wall " in line and "1040 gaussians, PSNR 21.50 dB" in line
    assert "ours / msplat: 0.80x ms/step (wall " in line


def test_our_side_trains_with_the_matched_settings(tmp_path):
    from splat_metal_method.bench import scenes as bench_scenes

    data = bench_scenes.demo(tmp_path / "demo", 48, 32)
    m = msplat_bench.matched_settings(6)
    r = msplat_bench.run_ours(Path(data), m, "cpu", "cpu", tmp_path)
    assert r.name == "ours" and r.ms_per_step > 0 and r.wall_ms_per_step > 0 and r.gaussians > 0
    assert math.isfinite(r.psnr) and 0 < r.psnr < 100
    assert np.isfinite(r.seconds)
