"""SH degree 4 (gsplat's highest: 25 coefficients per colour channel) as a user runs it on a CPU:
`ns-train splat-metal --pipeline.model.sh-degree 4` past step 4 x sh_degree_interval (where it crashed
before), the loaded run's eval and viewer renders on the cpu, metal (emulated) and reference backends, and
`ns-export gaussian-splat` / `splat-metal-export`: .ply and .spz hold band 4, .sog and .compressed.ply
say they drop it. The demo scene is 64x48 (non-square); the run is demo_runs' cached one."""

from __future__ import annotations

import math

import demo_runs
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.timeout(900)

STEPS, INTERVAL = 10, 2  # degree 4 from step 8 = 4 x INTERVAL
BAND4 = slice(15, 24)  # features_rest rows of band 4 (coefficients 16..24)


@pytest.fixture(scope="module")
def sh4_config(tmp_path_factory):
    return demo_runs.finished_run(
        tmp_path_factory, "sh4", STEPS, ["--pipeline.model.sh-degree", "4", "--pipeline.model.sh-degree-interval",
                                         str(INTERVAL)],
    )  # fmt: skip


def _checkpoint_params(config):
    ckpt = torch.load(demo_runs.latest_checkpoint(config), map_location="cpu")
    prefix = "_model.gauss_params."
    return {k[len(prefix) :]: v for k, v in ckpt["pipeline"].items() if k.startswith(prefix)}


def test_ns_train_trains_band_4_past_step_4_intervals(sh4_config):
    rest = _checkpoint_params(sh4_config)["features_rest"]  # [N, 24, 3]
    assert rest.shape[1:] == (24, 3)
    # zero-initialised and untouched until step 8 (Adam moves nothing without a gradient): trained at steps 8, 9
    assert rest[:, BAND4].abs().max() > 0


def test_eval_and_viewer_renders_use_band_4_on_every_backend(sh4_config, tmp_path, monkeypatch):
    from splat_metal_method.ops import stage_fallback
    from splat_metal_method.verify import self_check

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the metal render's self-check runs, at degree 4
    monkeypatch.setattr(self_check, "_verified", set())
    stage_fallback.reset()
    pipeline, _, step = demo_runs.load_pipeline(sh4_config)
    model = pipeline.model
    metrics = pipeline.get_average_eval_image_metrics(step)  # ns-eval's
    assert math.isfinite(metrics["psnr"]) and metrics["psnr"] > 5, metrics
    pipeline.eval()  # nerfstudio's eval metrics leave the pipeline in training mode
    with torch.no_grad():  # bands with weight, so that a backend's wrong band 4 would show
        g = torch.Generator().manual_seed(0)
        model.features_rest[:, BAND4] = 0.3 * torch.randn(model.features_rest[:, BAND4].shape, generator=g)
    camera = pipeline.datamanager.eval_dataset.cameras[0:1]
    renders = {}
    for backend in ("reference", "cpu", "metal"):
        model.config.backend = backend
        with torch.no_grad():
            out = model.get_outputs_for_camera(camera)  # the viewer's and ns-eval's render
        assert model.info["backend"] == backend and out["rgb"].shape == (demo_runs.HEIGHT, demo_runs.WIDTH, 3)
        renders[backend] = out["rgb"]
    assert stage_fallback.failed() == frozenset(), "a Metal stage failed the self-check at degree 4"
    for backend in ("cpu", "metal"):
        err = float((renders[backend] - renders["reference"]).abs().max())
        assert err < 1e-4, f"{backend}: max |render - reference| = {err:.3g}"
    with torch.no_grad():
        model.features_rest[:, BAND4] = 0.0
        without = model.get_outputs_for_camera(camera)["rgb"]
    assert float((without - renders["metal"]).abs().max()) > 1e-2, "band 4 does not change the render"


def test_exports_keep_band_4_where_the_format_can(sh4_config, tmp_path):
    from export_readers import read_spz
    from plyfile import PlyData

    params = _checkpoint_params(sh4_config)
    keep = (params["opacities"][:, 0] >= -5.5373).numpy()  # the exporters' cut (opacity 1/255)
    want = params["features_rest"].numpy()[keep].transpose(0, 2, 1).reshape(int(keep.sum()), -1)  # Inria order
    demo_runs.run_tool([demo_runs.tool("ns-export"), "gaussian-splat", "--load-config", sh4_config, "--output-dir",
                        tmp_path / "ns"], tmp_path, "ns-export")  # fmt: skip
    out = demo_runs.run_tool([demo_runs.tool("splat-metal-export"), "--load-config", sh4_config, "--output-dir",
                              tmp_path / "ours", "--format", "ply", "spz", "sog", "compressed-ply"],
                             tmp_path, "splat-metal-export")  # fmt: skip
    for ply in (tmp_path / "ns" / "splat.ply", tmp_path / "ours" / "splat.ply"):
        vertex = PlyData.read(str(ply))["vertex"]
        names = [p.name for p in vertex.properties if p.name.startswith("f_rest_")]
        assert names == [f"f_rest_{i}" for i in range(72)], f"{ply}: {len(names)} f_rest columns"
        got = np.stack([np.asarray(vertex[n]) for n in names], axis=1)
        np.testing.assert_array_equal(got, want, err_msg=str(ply))
    spz = read_spz(tmp_path / "ours" / "splat.spz")
    assert spz["sh_degree"] == 4 and spz["sh_rest"].shape[1:] == (24, 3)
    assert out.count("SH band 4 dropped (the format stores bands 1-3)") == 2, out  # .sog and .compressed.ply


def test_sh_degree_above_4_stops_before_ns_train_writes_anything(tmp_path):
    from splat_metal_method.method.configs import splat_metal_trainer_config

    cfg = splat_metal_trainer_config()
    cfg.output_dir = tmp_path / "outputs"
    cfg.pipeline.datamanager.data = tmp_path / "scene"
    cfg.pipeline.model.sh_degree = 5
    cfg.set_timestamp()
    with pytest.raises(SystemExit, match=r"^splat-metal: --pipeline.model.sh-degree must be 0\.\.4 .*got 5$"):
        cfg.save_config()  # ns-train's first write
    assert not (tmp_path / "outputs").exists()
