"""nerfstudio's own tools on a finished splat-metal run, as users run them: ns-render (interpolate
to a video, a camera path to images, with rgb, depth and accumulation outputs) and ns-eval; and the
background colour options, checked at the model level where they are exact.

Each tool's output is compared with what the model renders in this process for the same cameras, so
these tests check that the tools show *our* renders (and not merely that files appear).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil

import demo_runs
import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.timeout(900)

# The colour splatfacto shows behind a "random"-background model outside training (viser's default).
VISER_GREY = (0.1490, 0.1647, 0.2157)


@pytest.fixture(scope="module")
def ffmpeg():
    """ns-render checks for the ffmpeg binary even when it writes images (install_checks)."""
    if shutil.which("ffmpeg") is None:
        reason = "ffmpeg not on PATH; ns-render refuses to run without it (apt-get install ffmpeg, scripts/setup.sh)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return demo_runs.sh3_run(tmp_path_factory)


@pytest.fixture(scope="module")
def pipeline(run):
    pipeline, _, _ = demo_runs.load_pipeline(run)
    return pipeline


def _expected_frame(model, camera, names):
    """What ns-render writes for one camera: the outputs side by side, colormapped as it does."""
    from nerfstudio.utils import colormaps

    outputs = model.get_outputs_for_camera(camera)
    parts = []
    for name in names:
        if "depth" in name:
            parts.append(colormaps.apply_depth_colormap(outputs[name], accumulation=outputs["accumulation"]))
        else:
            parts.append(colormaps.apply_colormap(outputs[name]))
    return torch.cat(parts, dim=1).numpy(), outputs


def _fov_degrees(fy: float, height: int) -> float:
    return math.degrees(2 * math.atan(height / 2 / fy))


# ---------------------------------------------------------------------------------------------
# ns-render


def test_ns_render_camera_path_images_rgb_depth_accumulation(run, pipeline, tmp_path, ffmpeg):
    """A camera path (the viewer's JSON format) with one held-out view and one view of nothing,
    rendered to PNGs with three outputs side by side; each frame equals our own render."""
    model = pipeline.model
    cams = pipeline.datamanager.eval_dataset.cameras
    W, H = int(cams.width[0]), int(cams.height[0])
    c2w = cams.camera_to_worlds[0]
    fov = _fov_degrees(float(cams.fy[0]), H)
    path = {
        "camera_type": "perspective",
        "render_width": W,
        "render_height": H,
        "seconds": 2,
        "camera_path": [
            {"camera_to_world": torch.cat([m, torch.tensor([[0.0, 0, 0, 1]])]).flatten().tolist(), "fov": fov,
             "aspect": W / H}
            for m in (c2w, demo_runs.look_away(c2w))
        ],
    }  # fmt: skip
    path_file = tmp_path / "camera_path.json"
    path_file.write_text(json.dumps(path))
    names = ["rgb", "depth", "accumulation"]
    out = tmp_path / "renders" / "path.mp4"  # images go to renders/path/00000.png ...
    demo_runs.run_tool(
        [demo_runs.tool("ns-render"), "camera-path", "--load-config", run, "--camera-path-filename", path_file,
         "--output-path", out, "--output-format", "images", "--image-format", "png",
         "--rendered-output-names", *names],
        tmp_path, "ns-render",
    )  # fmt: skip
    frames = sorted((out.parent / out.stem).glob("*.png"))
    assert [f.name for f in frames] == ["00000.png", "00001.png"]

    from nerfstudio.cameras.camera_paths import get_path_from_json

    cameras = get_path_from_json(path)
    for i, frame in enumerate(frames):
        image = np.asarray(Image.open(frame).convert("RGB")).astype(np.float32) / 255
        assert image.shape == (H, 3 * W, 3), f"{frame.name}: {image.shape}"
        expected, outputs = _expected_frame(model, cameras[i : i + 1], names)
        diff = np.abs(image - expected).max()
        assert diff <= 1 / 255 + 1e-6, f"{frame.name}: differs from the model's render by {diff * 255:.1f}/255"
        rgb, acc = image[:, :W], outputs["accumulation"].numpy()
        if i == 0:  # the held-out view shows the scene: not blank, depth varies, partly covered
            assert rgb.std() > 0.05 and 0.2 < acc.mean() < 0.99
            assert len(np.unique(image[:, W : 2 * W].reshape(-1, 3), axis=0)) > 20, "depth image is flat"
            gt = pipeline.datamanager.eval_dataset.get_image_float32(0).numpy()
            assert np.abs(rgb - gt).mean() < 0.1, "the render does not resemble the held-out image"
        else:  # nothing in view: exactly the run's background (white: configs/demo.args)
            assert acc.max() == 0.0
            assert (rgb == 1.0).all(), "background of a white-background run is not white in ns-render"


def test_ns_render_interpolate_video(run, pipeline, tmp_path, ffmpeg):
    """`ns-render interpolate` to an mp4 (ffmpeg), rgb + depth + accumulation: the decoded frames
    match our renders of the same interpolated path (within video compression)."""
    import mediapy
    from nerfstudio.cameras.camera_paths import get_interpolated_camera_path

    steps, names = 3, ["rgb", "depth", "accumulation"]
    out = tmp_path / "interp.mp4"
    demo_runs.run_tool(
        [demo_runs.tool("ns-render"), "interpolate", "--load-config", run, "--output-path", out,
         "--interpolation-steps", steps, "--frame-rate", 6, "--rendered-output-names", *names],
        tmp_path, "ns-render",
    )  # fmt: skip
    assert out.is_file() and out.stat().st_size > 1000
    video = mediapy.read_video(str(out)).astype(np.float32) / 255  # [F, H, W, 3]
    cameras = get_interpolated_camera_path(pipeline.datamanager.eval_dataset.cameras, steps=steps, order_poses=False)
    assert video.shape[0] == cameras.shape[0] >= 2
    H, W = int(cameras.height[0]), int(cameras.width[0])
    # Some encoders pad odd sizes; the frame must at least contain ours.
    assert video.shape[1] >= H and video.shape[2] >= 3 * W
    for i in range(cameras.shape[0]):
        expected, _ = _expected_frame(pipeline.model, cameras[i : i + 1], names)
        diff = np.abs(video[i, :H, : 3 * W] - expected)
        assert diff.mean() < 0.03, f"frame {i}: mean difference {diff.mean():.3f} from the model's render"
    # Frames differ along the path (it is not one still image repeated).
    assert np.abs(video[0] - video[-1]).mean() > 0.01


# ---------------------------------------------------------------------------------------------
# ns-eval


def test_ns_eval_writes_psnr(run, pipeline, tmp_path):
    out, renders = tmp_path / "eval.json", tmp_path / "eval_renders"
    demo_runs.run_tool(
        [demo_runs.tool("ns-eval"), "--load-config", run, "--output-path", out, "--render-output-path", renders],
        tmp_path, "ns-eval",
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["method_name"] == "splat-metal"
    metrics = result["results"]
    for key in ("psnr", "ssim", "num_rays_per_sec", "fps"):
        assert math.isfinite(metrics[key]), f"{key} = {metrics[key]}"
    assert "lpips" not in metrics or math.isfinite(metrics["lpips"])

    # The same PSNR computed here from the model's renders of the held-out images.
    dataset = pipeline.datamanager.eval_dataset
    psnrs = []
    for i in range(len(dataset)):
        rgb = pipeline.model.get_outputs_for_camera(dataset.cameras[i : i + 1])["rgb"]
        gt = dataset.get_image_float32(i)
        psnrs.append(-10 * math.log10(((rgb - gt) ** 2).mean().item()))
    assert len(psnrs) == demo_runs.N_EVAL
    assert metrics["psnr"] == pytest.approx(float(np.mean(psnrs)), abs=1e-3)
    assert metrics["psnr"] > 12, "the trained demo run should beat a blank image"
    images = sorted(renders.glob("*.png"))
    assert len(images) == demo_runs.N_EVAL, f"ns-eval --render-output-path wrote {[p.name for p in images]}"


# ---------------------------------------------------------------------------------------------
# Background colours at the model level (exact). ns-render's white background is checked above.


@pytest.mark.parametrize(
    "background, expected", [("black", (0.0, 0.0, 0.0)), ("white", (1.0, 1.0, 1.0)), ("random", VISER_GREY)]
)
def test_background_where_nothing_is_seen(background, expected):
    model = demo_runs.small_model(background)
    model.eval()
    away = demo_runs.look_away(demo_runs.facing_origin())
    out = model.get_outputs_for_camera(demo_runs.camera(away))
    assert out["accumulation"].max() == 0.0, "test camera sees a gaussian"
    want = torch.tensor(expected).expand(30, 40, 3)
    assert torch.equal(out["rgb"], want), f"{background}: rgb {out['rgb'].reshape(-1, 3)[0].tolist()}"
    assert torch.equal(out["background"], want)
    assert torch.isfinite(out["depth"]).all() and out["depth"].shape == (30, 40, 1)
    # Looking at the gaussians, the same model covers part of the image.
    assert out["accumulation"].shape == (30, 40, 1)
    seen = model.get_outputs_for_camera(demo_runs.camera(demo_runs.facing_origin()))
    assert seen["accumulation"].max() > 0.9 and (seen["rgb"] != want).any()


def test_random_background_is_random_in_training_only():
    model = demo_runs.small_model("random")
    model.optimizers = {}  # set by get_training_callbacks in a trainer; the forward pass only passes it on
    model.train()
    away = demo_runs.look_away(demo_runs.facing_origin())
    a, b = model.get_outputs(demo_runs.camera(away)), model.get_outputs(demo_runs.camera(away))
    for out in (a, b):
        assert out["accumulation"].max() == 0.0
        assert torch.equal(out["rgb"], out["background"].expand(30, 40, 3))  # exactly the drawn colour
    assert not torch.equal(a["background"], b["background"]), "training background is not drawn per step"
    model.eval()
    c, d = (model.get_outputs_for_camera(demo_runs.camera(away))["rgb"] for _ in range(2))
    assert torch.equal(c, d) and torch.equal(c[0, 0], torch.tensor(VISER_GREY))


@pytest.mark.parametrize("background", ["black", "white", "random"])
def test_background_composites_exactly(background):
    """Where the gaussians are, rgb = colour + (1 - alpha) * background; checked against black."""
    model = demo_runs.small_model(background)
    black = copy.deepcopy(model)
    black.config.background_color = "black"
    for m in (model, black):
        m.eval()
    cam = demo_runs.camera(demo_runs.facing_origin())
    out, ref = model.get_outputs_for_camera(cam), black.get_outputs_for_camera(cam)
    assert torch.equal(out["accumulation"], ref["accumulation"]) and torch.equal(out["depth"], ref["depth"])
    assert torch.equal(ref["background"][0, 0], torch.zeros(3))
    bg = out["background"][0, 0]
    expected = torch.clamp(ref["rgb"] + (1 - ref["accumulation"]) * bg, 0, 1)
    # where neither render was clamped to 1
    unclamped = (ref["rgb"] < 1).all(-1) & (ref["rgb"] + (1 - ref["accumulation"]) * bg <= 1).all(-1)
    assert unclamped.float().mean() > 0.5
    torch.testing.assert_close(out["rgb"][unclamped], expected[unclamped], atol=1e-6, rtol=0)
    assert 0.05 < out["accumulation"].mean() < 0.95  # some pixels partly covered: the check has teeth
