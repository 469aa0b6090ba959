"""Runs written before the package was laid out by role still load (issue 29).

Their config.yml names the old module paths (``splat_metal_method.config.SplatMetalTrainerConfig``,
``splat_metal_method.trainer.SplatMetalTrainer``, ``splat_metal_method.model.SplatMetalModel``, ...).
tests/fixtures/previous-layout holds two real 20-step runs of the demo scene written by that layout
(its README says how); here nerfstudio's and splat-metal's own tools load them: ns-export,
splat-metal-export, ns-eval, ns-viewer and ``ns-train --load-dir``.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import demo_runs
import pytest
import torch
import yaml
from cli_helpers import demo_args
from plyfile import PlyData

FIXTURE = Path(__file__).parent / "fixtures" / "previous-layout"
OLD_NAMES = (
    "splat_metal_method.config.SplatMetalTrainerConfig",
    "splat_metal_method.trainer.SplatMetalTrainer",
    "splat_metal_method.datamanager.SplatMetalDatamanager",
    "splat_metal_method.dataparser.SplatMetalDataParser",
    "splat_metal_method.model.SplatMetalModel",
)


@pytest.fixture(scope="module")
def old_runs(tmp_path_factory):
    """A folder with the fixture's runs/ and the demo scene they were trained on as scene/."""
    folder = tmp_path_factory.mktemp("previous_layout")
    shutil.copytree(FIXTURE / "runs", folder / "runs")
    (folder / "scene").symlink_to(demo_runs.demo_scene(tmp_path_factory))
    return folder


def _config(folder: Path, method: str) -> Path:
    return folder / "runs" / "scene" / method / "previous-layout" / "config.yml"


def _gaussians_in_checkpoint(config: Path) -> int:
    ckpt = torch.load(config.parent / "nerfstudio_models" / "step-000000019.ckpt", map_location="cpu",
                      weights_only=False)  # fmt: skip
    return int(ckpt["pipeline"]["_model.gauss_params.means"].shape[0])


def test_fixture_names_the_previous_layout():
    """The fixture really is an old-layout run (so the tests below check the alias table)."""
    text = (FIXTURE / "runs/scene/splat-metal/previous-layout/config.yml").read_text()
    for name in OLD_NAMES:
        assert name in text, name
    mcmc = (FIXTURE / "runs/scene/splat-metal-mcmc/previous-layout/config.yml").read_text()
    assert "splat_metal_method.mcmc.SplatMetalMCMCModelConfig" in mcmc


@pytest.mark.parametrize("method", ["splat-metal", "splat-metal-mcmc"])
def test_old_config_loads_into_todays_classes(old_runs, method, monkeypatch):
    """yaml resolves each old name to the class that lives in the new layout, and nerfstudio's own
    eval_setup builds the pipeline from it with the checkpoint's gaussians."""
    from nerfstudio.models.splatfacto import SplatfactoModel

    from splat_metal_method.engine.trainer import SplatMetalTrainer
    from splat_metal_method.method.model import SplatMetalModel

    monkeypatch.chdir(old_runs)
    config = _config(old_runs, method)
    loaded = yaml.load(config.read_text(), Loader=yaml.Loader)
    assert loaded._target is SplatMetalTrainer
    assert issubclass(loaded.pipeline.model._target, SplatMetalModel)
    assert loaded.pipeline.model._target.__module__.startswith("splat_metal_method.method.")
    pipeline, _, step = demo_runs.load_pipeline(config)
    assert step == 19 and isinstance(pipeline.model, SplatfactoModel)
    assert pipeline.model.num_points == _gaussians_in_checkpoint(config)


def test_ns_export_and_splat_metal_export_read_an_old_run(old_runs):
    config = _config(old_runs, "splat-metal")
    n = _gaussians_in_checkpoint(config)
    out = old_runs / "exports"
    demo_runs.run_tool([demo_runs.tool("ns-export"), "gaussian-splat", "--load-config", config, "--output-dir", out / "ns"],
                       old_runs, "ns-export")  # fmt: skip
    assert PlyData.read(str(out / "ns" / "splat.ply"))["vertex"].count == n
    demo_runs.run_tool([demo_runs.tool("splat-metal-export"), "--load-config", config, "--output-dir", out / "sm",
                        "--format", "splat"], old_runs, "splat-metal-export")  # fmt: skip
    assert (out / "sm" / "splat.splat").stat().st_size == 32 * n  # .splat: 32 bytes per gaussian


def test_ns_eval_reads_an_old_run(old_runs):
    out = old_runs / "eval.json"
    demo_runs.run_tool([demo_runs.tool("ns-eval"), "--load-config", _config(old_runs, "splat-metal"), "--output-path",
                        out], old_runs, "ns-eval")  # fmt: skip
    results = json.loads(out.read_text())["results"]
    assert results["psnr"] > 5, results  # a real render of the 20-step model, not an empty image


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ns_viewer_serves_an_old_run(old_runs):
    """ns-viewer loads the run (eval_setup) before it starts its server: the page being served means the
    old config and checkpoint loaded."""
    port = _free_port()
    log = old_runs / "ns-viewer.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [demo_runs.tool("ns-viewer"), "--load-config", str(_config(old_runs, "splat-metal")),
             "--viewer.websocket-port", str(port)],
            stdout=sink, stderr=subprocess.STDOUT, cwd=old_runs, env=demo_runs.tool_env(),
        )  # fmt: skip
    try:
        deadline, page = time.monotonic() + 180, None
        while time.monotonic() < deadline and proc.poll() is None and page is None:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).read()
            except OSError:
                time.sleep(0.5)
        assert page is not None, f"ns-viewer served nothing (exit {proc.poll()}):\n{log.read_text()[-3000:]}"
        assert b"<html" in page.lower()
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_ns_train_resumes_an_old_run_with_load_dir(old_runs):
    """--load-dir continues the old run: the log names its checkpoint and the new run starts at step 20."""
    models = _config(old_runs, "splat-metal").parent / "nerfstudio_models"
    out = old_runs / "resumed"
    text = demo_runs.run_tool(
        [demo_runs.tool("ns-train"), "splat-metal", *demo_args(max_num_iterations=3), "--data", old_runs / "scene",
         "--output-dir", out, "--timestamp", "resumed", "--load-dir", models, "--steps-per-eval-image", 100000],
        old_runs, "ns-train-resume",
    )  # fmt: skip
    joined = "".join(text.split())  # rich wraps long paths
    assert "DoneloadingNerfstudiocheckpointfrom" in joined, text[-3000:]
    assert "previous-layout/nerfstudio_models/step-000000019.ckpt" in joined, text[-3000:]
    ckpts = sorted((out / "scene" / "splat-metal" / "resumed" / "nerfstudio_models").glob("step-*.ckpt"))
    assert [c.name for c in ckpts] == ["step-000000022.ckpt"], ckpts
