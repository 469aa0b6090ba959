"""Distorted captures end to end (issue 35): a scene shot through a lens (demo_scene.py, images truly
distorted) and written as ns-process-data writes a COLMAP capture, through every tool a user runs on it.

nerfstudio's datamanager undistorts OPENCV/OPENCV_FISHEYE images only when it first hands out a batch,
cropping each to its valid area and rewriting its camera (this OPENCV lens: 64x48 becomes 63x47; the
old code rendered 64x48 and crashed at step 0); every size the model uses must be that one.

- One ns-train run (demo_runs.distorted_run: OPENCV k1 k2 k3 p1 p2, per-frame intrinsics, cpu backend),
  shared by: resume with --load-dir, ns-eval, ns-render, the viewer (nerfstudio's Viewer in process, as
  ns-viewer builds it), ns-export gaussian-splat and splat-metal-export in every format.
- In process (tests/pipelines.py): training steps on the emulated Metal backend (OPENCV, per frame) and
  on cpu with the bilateral grid (OPENCV_FISHEYE, shared intrinsics).
- The bilateral grid where torch lacks grid_sample on 5-D tensors (the op made to raise as MPS does):
  refused in one line before ns-train writes anything, and before the first step in process.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import demo_runs
import numpy as np
import pytest
import torch
from cli_helpers import run_cli
from PIL import Image
from pipelines import setup_pipeline, train_step

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return demo_runs.distorted_run(tmp_path_factory)


@pytest.fixture(scope="module")
def pipeline(run):
    pipeline, _, _ = demo_runs.load_pipeline(run)
    return pipeline


def _sizes(cameras) -> list:
    return list(zip(cameras.width[:, 0].tolist(), cameras.height[:, 0].tolist()))


def test_nerfstudio_undistorts_to_smaller_sizes(pipeline):
    """The premise of the tests below: the eval images, once undistorted, are smaller than the photos
    (so a size taken before undistortion would show). Each frame has its own intrinsics and
    coefficients, but nerfstudio's crop (cv2.getOptimalNewCameraMatrix, alpha 0) gives them one size.
    Our datamanager rewrites the cameras when it is built (data/image_stream.py undistort_cameras), so
    they hold the cropped sizes before any image is decoded, and the decoded images agree."""
    dm = pipeline.datamanager
    sizes = _sizes(dm.eval_dataset.cameras)
    assert all(w < demo_runs.WIDTH and h < demo_runs.HEIGHT for w, h in sizes), sizes
    data = dm.cached_eval  # decodes and undistorts the held-out photos
    assert [tuple(d["image"].shape[1::-1]) for d in data] == sizes == _sizes(dm.eval_dataset.cameras)


def test_resume_with_load_dir(run, tmp_path_factory, tmp_path):
    """ns-train --load-dir on the distorted run's last checkpoint (step 9) trains 3 more steps."""
    scene = demo_runs.lens_scene(tmp_path_factory)
    result = run_cli("ns-train", "splat-metal", *demo_runs.demo_args(), "--data", scene, "--output-dir", tmp_path,
                     "--timestamp", "resumed", "--max-num-iterations", 3, "--steps-per-save", 100000,
                     "--steps-per-eval-image", 100000, "--steps-per-eval-all-images", 100000,
                     "--pipeline.model.sh-degree-interval", 4, "--load-dir", run.parent / "nerfstudio_models",
                     timeout=600)  # fmt: skip
    assert result.returncode == 0, result.tail()
    ckpts = sorted((tmp_path / scene.name / "splat-metal" / "resumed" / "nerfstudio_models").glob("*.ckpt"))
    assert ckpts and ckpts[-1].name == "step-000000012.ckpt", ckpts


def test_ns_eval_scores_undistorted_views_at_their_sizes(run, pipeline, tmp_path):
    out, renders = tmp_path / "eval.json", tmp_path / "renders"
    demo_runs.run_tool([demo_runs.tool("ns-eval"), "--load-config", run, "--output-path", out,
                        "--render-output-path", renders], tmp_path, "ns-eval")  # fmt: skip
    results = json.loads(out.read_text())["results"]
    assert math.isfinite(results["psnr"]) and results["psnr"] > 10, results
    assert len(pipeline.datamanager.cached_eval) == demo_runs.N_EVAL  # undistorted: the cameras rewritten
    sizes = _sizes(pipeline.datamanager.eval_dataset.cameras)
    images = sorted(renders.glob("*.png"))
    assert len(images) == demo_runs.N_EVAL, images
    for path, (w, h) in zip(images, sizes):
        with Image.open(path) as im:  # splatfacto's "img": the photo and the render side by side
            assert im.size == (2 * w, h), (path.name, im.size, (w, h))


def test_ns_render_dataset(run, pipeline, tmp_path):
    """`ns-render dataset` renders every held-out camera of the distorted dataset at its undistorted
    size: our datamanager, which ns-render builds, gives its cameras the undistorted intrinsics and crop
    when it is built, so the renders line up with the undistorted photos they are compared with."""
    if shutil.which("ffmpeg") is None:
        pytest.skip("ns-render refuses to run without ffmpeg")
    out = tmp_path / "render"
    demo_runs.run_tool([demo_runs.tool("ns-render"), "dataset", "--load-config", run, "--output-path", out,
                        "--split", "test", "--rendered-output-names", "rgb", "--image-format", "png"],
                       tmp_path, "ns-render")  # fmt: skip
    frames = sorted(out.rglob("*.png"))
    assert len(frames) == demo_runs.N_EVAL, frames
    sizes = set(_sizes(pipeline.datamanager.eval_dataset.cameras))
    assert len(sizes) == 1 and all(w < demo_runs.WIDTH and h < demo_runs.HEIGHT for w, h in sizes), sizes
    (w, h) = sizes.pop()
    for frame in frames:
        image = np.asarray(Image.open(frame).convert("RGB"))
        assert image.shape == (h, w, 3) and image.std() > 5, (frame.name, image.shape)


def test_viewer_on_the_distorted_run(run, tmp_path):
    """nerfstudio's Viewer as ns-viewer builds it (training cameras and their photos drawn from the
    distorted dataset) renders the model."""
    from nerfstudio.cameras.cameras import CameraType
    from nerfstudio.configs.base_config import ViewerConfig
    from nerfstudio.viewer.render_state_machine import RenderStateMachine
    from nerfstudio.viewer.utils import CameraState
    from nerfstudio.viewer.viewer import VISER_NERFSTUDIO_SCALE_RATIO, Viewer

    pipeline, _, _ = demo_runs.load_pipeline(run)
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    viewer = Viewer(ViewerConfig(websocket_port=port, image_format="png"), log_filename=tmp_path / "viewer_log.txt",
                    datapath=run.parent, pipeline=pipeline)  # fmt: skip
    try:
        dm = pipeline.datamanager
        viewer.init_scene(train_dataset=dm.train_dataset, train_state="completed", eval_dataset=dm.eval_dataset)
        assert len(viewer.camera_handles) > 0
        sent = []
        client = SimpleNamespace(camera=SimpleNamespace(aspect=4 / 3),
                                 scene=SimpleNamespace(set_background_image=lambda image, **kw: sent.append(image)))  # fmt: skip
        machine = RenderStateMachine(viewer, VISER_NERFSTUDIO_SCALE_RATIO, client)
        machine.state = "high"
        viewer.control_panel._max_res.value = 64
        cams = dm.eval_dataset.cameras
        fov = 2 * math.atan(float(cams.height[0]) / 2 / float(cams.fy[0]))
        state = CameraState(fov=fov, aspect=4 / 3, c2w=cams.camera_to_worlds[0], camera_type=CameraType.PERSPECTIVE)
        outputs = machine._render_img(state)
        machine._send_output_to_viewer(outputs, static_render=True)
        assert sent[-1].shape == (48, 64, 3) and sent[-1].std() > 5
    finally:
        viewer.viser_server.stop()


def test_exports_every_format(run, tmp_path):
    """ns-export gaussian-splat (in process, as its command runs it) and splat-metal-export in every format."""
    from nerfstudio.scripts.exporter import ExportGaussianSplat

    ExportGaussianSplat(load_config=run, output_dir=tmp_path / "ns").main()
    assert (tmp_path / "ns" / "splat.ply").stat().st_size > 1000
    formats = ["ply", "splat", "spz", "sog", "compressed-ply"]
    result = run_cli("splat-metal-export", "--load-config", run, "--output-dir", tmp_path / "ours", "--format",
                     *formats, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.tail()
    written = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert written == sorted(["splat.ply", "splat.splat", "splat.spz", "splat.sog", "splat.compressed.ply"]), written
    assert (tmp_path / "ours" / "splat.ply").read_bytes() == (tmp_path / "ns" / "splat.ply").read_bytes()


# ---------------------------------------------------------------------------------------------
# In process: training steps on each backend


def _pipeline(scene: Path, backend: str, bilateral_grid: bool = False):
    from splat_metal_method.method.configs import splat_metal_trainer_config

    cfg = splat_metal_trainer_config()
    cfg.machine.device_type = "cpu"
    cfg.pipeline.datamanager.data = scene
    model = cfg.pipeline.model
    model.background_color, model.backend, model.metal_self_check = "white", backend, False
    model.use_bilateral_grid = bilateral_grid
    return setup_pipeline(cfg, "cpu")


@pytest.mark.parametrize(
    "camera_model, per_frame, backend, bilateral_grid",
    [("OPENCV", True, "metal", False), ("OPENCV_FISHEYE", False, "cpu", True)],
)
def test_training_steps_render_the_undistorted_sizes(tmp_path_factory, camera_model, per_frame, backend,
                                                     bilateral_grid):  # fmt: skip
    """Every training camera's first step renders its undistorted image's size; the bilateral grid
    (per training image, sliced at that size) trains."""
    scene = demo_runs.lens_scene(tmp_path_factory, camera_model, per_frame)
    pipeline, optimizers, callbacks = _pipeline(scene, backend, bilateral_grid)
    model, dm = pipeline.model, pipeline.datamanager
    grids = model.bil_grids.grids.detach().clone() if bilateral_grid else None
    for step in range(4):
        idx = dm.train_unseen_cameras[0]
        loss = train_step(pipeline, optimizers, callbacks, step)
        assert torch.isfinite(loss), step
        image = dm.cached_train[idx]["image"]
        assert model.last_size == tuple(image.shape[:2]), (step, idx, model.last_size, image.shape)
        assert model._train_sizes[idx][2] == tuple(image.shape[1::-1])
    # A render of another size than its image (what the model made before this was fixed): one clear line.
    with pytest.raises(RuntimeError, match=r"render is 64x48 but its training image is \d+x\d+: the camera"):
        model.get_metrics_dict({"rgb": torch.zeros(demo_runs.HEIGHT, demo_runs.WIDTH, 3)}, {"image": image[:-1]})
    sizes = _sizes(dm.train_dataset.cameras)
    if camera_model == "OPENCV":
        assert all(w < demo_runs.WIDTH and h < demo_runs.HEIGHT for w, h in sizes), sizes
    if bilateral_grid:
        assert not torch.equal(grids, model.bil_grids.grids), "the bilateral grid did not train"


# ---------------------------------------------------------------------------------------------
# The bilateral grid where grid_sample lacks 5-D tensors


@pytest.fixture
def no_5d_grid_sample(monkeypatch):
    """F.grid_sample raising on 5-D input as torch 2.8 does on MPS (pytorch#160541)."""
    from splat_metal_method.method import model as model_module

    real = torch.nn.functional.grid_sample

    def grid_sample(input, grid, *args, **kwargs):
        if input.dim() == 5:
            raise NotImplementedError(
                "The operator 'aten::grid_sampler_3d' is not currently implemented for the MPS device."
            )
        return real(input, grid, *args, **kwargs)

    model_module._grid_sample_5d_missing.cache_clear()
    monkeypatch.setattr(torch.nn.functional, "grid_sample", grid_sample)
    yield
    monkeypatch.undo()
    model_module._grid_sample_5d_missing.cache_clear()


def test_grid_sample_probe_on_cpu():
    from splat_metal_method.method import model as model_module

    model_module._grid_sample_5d_missing.cache_clear()
    assert model_module._grid_sample_5d_missing("cpu") is None


def test_bilateral_grid_refused_before_anything_is_written(tmp_path_factory, tmp_path, no_5d_grid_sample):
    from splat_metal_method.method.configs import splat_metal_trainer_config
    from splat_metal_method.method.model import BilateralGridUnavailable

    cfg = splat_metal_trainer_config()
    cfg.machine.device_type = "cpu"
    cfg.data = cfg.pipeline.datamanager.data = demo_runs.demo_scene(tmp_path_factory)
    cfg.output_dir = tmp_path / "outputs"
    cfg.pipeline.model.use_bilateral_grid = True
    cfg.set_timestamp()
    with pytest.raises(BilateralGridUnavailable) as e:
        cfg.save_config()  # ns-train's first write
    message = str(e.value)
    assert len(message.splitlines()) == 1 and message.startswith("splat-metal: --pipeline.model.use-bilateral-grid")
    assert "grid_sampler_3d" in message and "use-bilateral-grid False" in message, message
    assert not cfg.output_dir.exists()
    cfg.pipeline.model.use_bilateral_grid = False
    cfg.save_config()  # without the grid the run starts
    assert cfg.get_base_dir().joinpath("config.yml").is_file()

    # In process (no ns-train): refused when the training callbacks are made, before the first step.
    with pytest.raises(BilateralGridUnavailable):
        _pipeline(demo_runs.demo_scene(tmp_path_factory), "cpu", bilateral_grid=True)
