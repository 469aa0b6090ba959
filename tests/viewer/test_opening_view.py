"""The viewer opens on the scene (splat_metal_method/viewer/opening_view.py): a browser that connects looks
through the first training camera, with a field of view that shows all of its photo.

- The pose and fov math against nerfstudio's own conversions (fast).
- nerfstudio's real Viewer with a splat-metal run: every frustum drawn, the opening camera's hidden.
- In Chromium: `ns-train splat-metal --vis viewer` on the demo scene; without any click, the canvas at a
  mid-training step shows the model's render from training camera 0 (PSNR above OPENING_PSNR_DB), and
  not that of its neighbour, camera 1. `ns-viewer` on a finished run opens there too.
"""

from __future__ import annotations

import math
from pathlib import Path

import demo_runs
import numpy as np
import pytest
import torch
from PIL import Image
from test_viewer import (  # noqa: F401 (browser is a fixture)
    _assert_clean_log,
    _free_port,
    _http_up,
    _settled_frame,
    _stop,
    _wait_for,
    browser,
    ns_train_with_viewer,
    ns_viewer_in_browser,
)  # fmt: skip

from splat_metal_method.viewer.opening_view import OPENING_CAMERA, fitting_fov, viser_pose

pytestmark = pytest.mark.timeout(900)

# The canvas against the model's render of training camera 0 at a mid-training step (step STEPS - 1 or
# earlier of the demo's 600-step schedule), measured on the demo scene on a loaded 2-core machine: 42.8
# to 44.7 dB in three runs, at steps 40 to 59 (JPEG at quality 75 and the browser's upscaling of a
# 512 px render are what remain); against the neighbouring training camera (18 degrees along the
# orbit) 16.9 and 17.5 dB; viser's default view, where the viewer opened before, 10.5 dB. 30 dB is
# more than 10 dB clear of each.
OPENING_PSNR_DB = 30.0
STEPS = 60


def _camera(c2w, width=64, height=48, fx=50.0, fy=51.0, cx=33.0, cy=23.5):
    from nerfstudio.cameras.cameras import Cameras

    return Cameras(camera_to_worlds=torch.as_tensor(c2w, dtype=torch.float32)[None], fx=fx, fy=fy, cx=cx, cy=cy,
                   width=width, height=height)[0]  # fmt: skip


def test_viser_pose_is_the_frustums_and_reads_back_as_the_camera():
    """viser_pose places a camera where nerfstudio's init_scene draws its frustum, and nerfstudio's
    get_camera_state (how every viewer render reads the browser's camera) turns it back into the
    same camera-to-world, for cameras turned every way."""
    import viser.transforms as vtf
    from nerfstudio.viewer.viewer import VISER_NERFSTUDIO_SCALE_RATIO

    rng = np.random.default_rng(0)
    for _ in range(20):
        rotation = vtf.SO3.from_rpy_radians(*rng.uniform(-math.pi, math.pi, 3)).as_matrix()
        c2w = np.concatenate([rotation, rng.uniform(-2, 2, (3, 1))], axis=1)  # [3, 4]
        wxyz, position = viser_pose(c2w)
        frustum = vtf.SO3.from_matrix(c2w[:3, :3]) @ vtf.SO3.from_x_radians(np.pi)  # Viewer.init_scene's
        np.testing.assert_allclose(wxyz, frustum.wxyz, atol=1e-12)
        np.testing.assert_allclose(position, c2w[:3, 3] * VISER_NERFSTUDIO_SCALE_RATIO)
        back = (vtf.SO3(wxyz=wxyz) @ vtf.SO3.from_x_radians(np.pi)).as_matrix()  # Viewer.get_camera_state's
        np.testing.assert_allclose(back, c2w[:3, :3], atol=1e-9)
        np.testing.assert_allclose(position / VISER_NERFSTUDIO_SCALE_RATIO, c2w[:3, 3], atol=1e-12)


@pytest.mark.parametrize("canvas_aspect", [0.5, 1.0, 4 / 3, 1.6, 3.0])
@pytest.mark.parametrize("cx, cy", [(32.0, 24.0), (33.0, 23.5), (20.0, 40.0)])
def test_fitting_fov_shows_the_whole_photo_and_no_more(canvas_aspect, cx, cy):
    """The fov shows every corner of the photo inside the canvas, and one edge of the photo touches
    the canvas' edge (a narrower fov would cut the photo)."""
    camera = _camera(np.eye(4)[:3], cx=cx, cy=cy)
    fov = fitting_fov(camera, canvas_aspect)
    tan_v = math.tan(fov / 2)
    tan_h = tan_v * canvas_aspect
    W, H, fx, fy = 64.0, 48.0, 50.0, 51.0
    corners_x = [abs(0 - cx) / fx, abs(W - cx) / fx]  # tan of each edge's angle from the axis
    corners_y = [abs(0 - cy) / fy, abs(H - cy) / fy]
    assert max(corners_x) <= tan_h + 1e-9 and max(corners_y) <= tan_v + 1e-9
    assert math.isclose(max(corners_x), tan_h) or math.isclose(max(corners_y), tan_v)


def test_the_opening_cameras_frustum_is_hidden_and_the_others_drawn(tmp_path_factory, tmp_path):
    """nerfstudio's real Viewer with a splat-metal run: the model hands it the hook (a ViewerControl), and
    init_scene draws every training camera's frustum as nerfstudio does, camera 0's hidden (a browser
    looks through it); "Show Train Cams" (set_camera_visibility) shows it again."""
    from nerfstudio.configs.base_config import ViewerConfig
    from nerfstudio.viewer.viewer import Viewer

    pipeline, _, _ = demo_runs.load_pipeline(demo_runs.sh3_run(tmp_path_factory))
    config = ViewerConfig(websocket_port=_free_port())
    viewer = Viewer(config, log_filename=tmp_path / "viewer_log.txt", datapath=tmp_path, pipeline=pipeline)
    try:
        assert pipeline.model.opening_view in viewer.viewer_controls
        dataset = pipeline.datamanager.train_dataset
        viewer.init_scene(train_dataset=dataset, train_state="completed")
        assert sorted(viewer.camera_handles) == list(range(len(dataset)))
        hidden = [i for i, frustum in viewer.camera_handles.items() if not frustum.visible]
        assert hidden == [OPENING_CAMERA]
        wxyz, position = viser_pose(dataset.cameras.camera_to_worlds[OPENING_CAMERA].numpy())
        np.testing.assert_allclose(viewer.camera_handles[OPENING_CAMERA].position, position, atol=1e-6)
        np.testing.assert_allclose(viewer.camera_handles[OPENING_CAMERA].wxyz, wxyz, atol=1e-6)
        viewer.set_camera_visibility(True)
        assert all(frustum.visible for frustum in viewer.camera_handles.values())
    finally:
        viewer.viser_server.stop()


def _photo_region(record: dict, camera, shape) -> tuple:
    """(x0, y0, x1, y1) in canvas pixels where ``camera``'s photo lies in a canvas of ``shape`` showing
    the viewer render ``record`` (a centred camera: its vertical fov spans the canvas height)."""
    height, width = shape[:2]
    tan_half = record["height"] / 2 / record["fy"]  # the viewer camera's vertical fov, as tan of half
    f = height / 2 / tan_half  # its focal length in canvas pixels
    fx, fy, cx, cy = (float(v) for v in (camera.fx, camera.fy, camera.cx, camera.cy))
    W, H = float(camera.width), float(camera.height)
    return (
        width / 2 - cx / fx * f,
        height / 2 - cy / fy * f,
        width / 2 + (W - cx) / fx * f,
        height / 2 + (H - cy) / fy * f,
    )


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(-10 * np.log10(np.mean((a - b) ** 2)))


def _canvas_against_camera(model, cameras, index: int, record: dict, shot: np.ndarray, scale: int = 4):
    """(PSNR, the model's render, the canvas cut to that camera's photo): the canvas region where training
    camera ``index``'s photo lies, resized to ``scale`` x the photo, against the model's render from it."""
    camera = cameras[index : index + 1]
    camera.rescale_output_resolution(scale)
    rgb = model.get_outputs_for_camera(camera)["rgb"].numpy()  # [H, W, 3]
    canvas = Image.fromarray((shot * 255).round().astype(np.uint8))
    region = _photo_region(record, cameras[index], shot.shape)
    cut = canvas.resize((rgb.shape[1], rgb.shape[0]), Image.BOX, box=region)
    cut = np.asarray(cut).astype(np.float32) / 255
    return _psnr(cut, rgb), rgb, cut


def test_browser_opens_on_the_first_training_camera(tmp_path_factory, tmp_path, browser):  # noqa: F811 (fixture)
    """`ns-train splat-metal --vis viewer` on the demo scene, Chromium on its page and no click: the
    viewer's camera is training camera 0's (pose and fov, from the render log), and the canvas at a
    mid-training step is the model's render from that camera (the step's checkpoint)."""
    scene = demo_runs.demo_scene(tmp_path_factory)
    # Every step's model on disk: the frame's step is loaded whenever it settles.
    proc, port, trace, log, config = ns_train_with_viewer(
        scene, tmp_path, "opening", STEPS, "--steps-per-save", 1, "--save-only-latest-checkpoint", "False"
    )
    try:
        _wait_for("the viewer's web server", lambda: _http_up(port), 240, proc, log)
        browser.driver.get(f"http://localhost:{port}")
        record, shot = _settled_frame(browser, trace, proc, log, after=0.0)  # any render since the start
        Image.fromarray((shot * 255).astype(np.uint8)).save(tmp_path / "viewer.png")
        assert proc.poll() is None, "ns-train exited while the viewer was open"
    finally:
        ended = _stop(proc)
    _assert_clean_log(log.read_text(), "ns-train")
    assert ended, "ns-train ignored Ctrl+C"

    step = record["step"]
    assert 0 <= step < STEPS
    _, pipeline, _, loaded = _load_at_step(config, step)
    assert loaded == step
    model = pipeline.model
    cameras = pipeline.datamanager.train_dataset.cameras
    psnr, ours, cut = _canvas_against_camera(model, cameras, OPENING_CAMERA, record, shot)
    Image.fromarray((ours * 255).astype(np.uint8)).save(tmp_path / "model.png")
    Image.fromarray((cut * 255).astype(np.uint8)).save(tmp_path / "viewer_cut.png")
    neighbour, _, _ = _canvas_against_camera(model, cameras, OPENING_CAMERA + 1, record, shot)
    print(f"[opening view] step {step}: canvas vs camera {OPENING_CAMERA} {psnr:.2f} dB, vs camera "
          f"{OPENING_CAMERA + 1} {neighbour:.2f} dB ({tmp_path})")  # fmt: skip
    assert psnr > OPENING_PSNR_DB, f"the viewer does not open on training camera {OPENING_CAMERA}: {psnr:.2f} dB"
    # The viewer's camera: training camera 0's pose, and the fov that fits its photo in the canvas.
    np.testing.assert_allclose(record["camera_to_world"], cameras.camera_to_worlds[OPENING_CAMERA].numpy(), atol=1e-4)
    fov = 2 * math.atan(record["height"] / 2 / record["fy"])
    expected = fitting_fov(cameras[OPENING_CAMERA], record["width"] / record["height"])
    assert abs(fov - expected) < 0.01, (fov, expected)  # the render's size rounds the aspect to pixels
    assert neighbour < OPENING_PSNR_DB, f"the comparison cannot tell camera 1 ({neighbour:.2f} dB) from camera 0"


def test_ns_viewer_opens_on_the_first_training_camera(tmp_path_factory, tmp_path, browser):  # noqa: F811 (fixture)
    """`ns-viewer --load-config` on a finished run (12 steps), Chromium on its page and no click: the
    settled frame is through training camera 0 and is the model's render from it."""
    run = demo_runs.sh3_run(tmp_path_factory)
    with ns_viewer_in_browser(run, browser, tmp_path, demo_runs.tool_env()) as (proc, trace, log, opened):
        record, shot = _settled_frame(browser, trace, proc, log, after=opened)
    pipeline, _, _ = demo_runs.load_pipeline(run, test_mode="inference")
    cameras = pipeline.datamanager.train_dataset.cameras
    np.testing.assert_allclose(record["camera_to_world"], cameras.camera_to_worlds[OPENING_CAMERA].numpy(), atol=1e-4)
    psnr, _, _ = _canvas_against_camera(pipeline.model, cameras, OPENING_CAMERA, record, shot)
    print(f"[opening view] ns-viewer: canvas vs camera {OPENING_CAMERA} {psnr:.2f} dB")
    assert psnr > OPENING_PSNR_DB, f"ns-viewer does not open on training camera {OPENING_CAMERA}: {psnr:.2f} dB"


def _load_at_step(config: Path, step: int):
    """nerfstudio's loader (as ns-viewer loads a run) at the checkpoint of ``step``."""
    from nerfstudio.utils.eval_utils import eval_setup

    def at_step(trainer_config):
        trainer_config.load_step = step
        return trainer_config

    loaded_config, pipeline, ckpt, loaded = eval_setup(config, test_mode="inference", update_config_callback=at_step)
    pipeline.eval()
    return loaded_config, pipeline, ckpt, loaded
