"""Rank 0 of `torchrun --nproc-per-node 2 $(command -v ns-train) splat-metal --vis viewer` serves nerfstudio's
viewer, seen in Chromium: after training (the viewer stays up) the canvas shows the WHOLE scene -- every
rank's shard, gathered on rank 0 -- exactly as the final checkpoint renders it, not rank 0's shard."""

from __future__ import annotations

import subprocess
import time

import demo_runs
import numpy as np
import torch
from cli_helpers import cli_env, executable
from test_viewer import (  # noqa: F401
    _assert_frame_is_the_models_render,
    _free_port,
    _http_up,
    _render_like_viewer,
    _settled_frame,  # fmt: skip
    _stop,
    _wait_for,
    browser,
)

from splat_metal_method.viewer.render_device import RENDER_LOG_ENV

STEPS = 40


def test_rank_0_serves_the_viewer_with_every_shard(tmp_path_factory, tmp_path, browser):  # noqa: F811
    scene = demo_runs.demo_scene(tmp_path_factory)
    port, trace, log = _free_port(), tmp_path / "renders.jsonl", tmp_path / "torchrun.log"
    out = tmp_path / "outputs"
    args = [executable("torchrun"), "--standalone", "--nproc-per-node", "2", executable("ns-train"), "splat-metal",
            *demo_runs.demo_args(), "--data", scene, "--output-dir", out, "--timestamp", "dview", "--vis", "viewer",
            "--viewer.websocket-port", port, "--viewer.quit-on-train-completion", "False",
            "--max-num-iterations", STEPS, "--steps-per-save", 10**6]  # fmt: skip
    config = out / scene.name / "splat-metal" / "dview" / "config.yml"
    env = cli_env(extra={RENDER_LOG_ENV: str(trace), "OMP_NUM_THREADS": "1"})
    with open(log, "w") as log_file:
        proc = subprocess.Popen([str(a) for a in args], stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                cwd=tmp_path, start_new_session=True)  # fmt: skip
    try:
        final = config.parent / "nerfstudio_models" / f"step-{STEPS - 1:09d}.ckpt"
        _wait_for("training to finish", lambda: final.is_file() or None, 600, proc, log)
        _wait_for("rank 0's viewer", lambda: _http_up(port), 120, proc, log)
        connected = time.time()
        browser.driver.get(f"http://localhost:{port}")
        record, shot = _settled_frame(browser, trace, proc, log, after=connected)

        pipeline, ckpt, step = demo_runs.load_pipeline(config, test_mode="inference")
        assert (ckpt, step) == (final, STEPS - 1)
        model = pipeline.model
        assert record["num_points"] == model.num_points, "the viewer rendered a shard, not the whole scene"
        _assert_frame_is_the_models_render(model, record, shot, tmp_path)

        # The comparison can tell the whole scene from rank 0's shard.
        frame_diff = np.abs(_render_like_viewer(model, record, shot.shape) - shot).mean()
        counts = torch.load(final, map_location="cpu")["splat_metal_resume"]["distributed"]["counts"]
        assert len(counts) == 2 and counts[1] > 0
        for name, p in model.gauss_params.items():
            p.data = p.data[: counts[0]]
        shard_only = _render_like_viewer(model, record, shot.shape)
        shard_diff = np.abs(shard_only - shot).mean()
        assert shard_diff > 4 * frame_diff, (
            f"can't tell rank 0's shard ({shard_diff:.4f}) from the scene ({frame_diff:.4f})"
        )
        assert proc.poll() is None, "torchrun ended while rank 0's viewer was open"
    finally:
        ended = _stop(proc)
    text = log.read_text()
    assert ended, f"torchrun ignored Ctrl+C for 60 s:\n{text[-3000:]}"
    assert text.count("splat-metal distributed: world size 2") == 1, text[-3000:]
