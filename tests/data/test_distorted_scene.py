"""The demo scene shot through a lens (demo_scene.py --camera-model/--k1../--per-frame-intrinsics): the
images are what the lens sees, so undistorting them as nerfstudio's datamanager does gives back the
pinhole view of the scene; and the coefficients are written as nerfstudio's dataparser reads them."""

from __future__ import annotations

import json

import demo_runs
import numpy as np
import pytest
import torch

from splat_metal_method.data import demo_scene

WIDTH, HEIGHT, VIEWS = 64, 48, 10  # non-square


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(-10 * np.log10(np.mean((a - b) ** 2)))


def _undistort_as_nerfstudio(image: np.ndarray, intrinsics: dict, camera_model: str, lens: dict):
    """nerfstudio's own undistortion (what FullImageDatamanager.cached_train runs): (image, K [3, 3])."""
    from nerfstudio.cameras import camera_utils
    from nerfstudio.cameras.cameras import CAMERA_MODEL_TO_TYPE, Cameras
    from nerfstudio.data.datamanagers.full_images_datamanager import _undistort_image

    camera = Cameras(camera_to_worlds=torch.eye(4)[:3][None], fx=intrinsics["fl_x"], fy=intrinsics["fl_y"],
                     cx=intrinsics["cx"], cy=intrinsics["cy"], width=intrinsics["w"], height=intrinsics["h"],
                     camera_type=CAMERA_MODEL_TO_TYPE[camera_model])  # fmt: skip
    params = camera_utils.get_distortion_params(**lens).numpy()
    K = camera.get_intrinsics_matrices()[0].numpy()
    K, undistorted, _ = _undistort_image(camera[0], params, {}, image.copy(), K)
    return undistorted, K


@pytest.mark.parametrize("camera_model", ["OPENCV", "OPENCV_FISHEYE"])
def test_undistorting_a_lens_image_gives_back_the_pinhole_view(camera_model):
    """Two views shot through the lens, undistorted by nerfstudio, against the pinhole render of the same
    gaussians with the undistorted intrinsics (also 3x3 sub-pixels a pixel). Undistorting with the
    coefficients' signs flipped (the distortion applied the wrong way round) must be clearly worse."""
    lens = demo_runs.LENSES[camera_model]
    gaussians = demo_scene.make_gaussians(0)
    c2w, intrinsics = demo_scene.make_cameras(VIEWS, WIDTH, HEIGHT, 0)
    viewmats = demo_scene.viewmats_from_c2w(torch.from_numpy(c2w[[0, 5]]))  # [2, 4, 4]
    shot = demo_scene.shoot_through_lens(gaussians, viewmats, camera_model, [(intrinsics, lens)] * 2).numpy()
    assert shot.shape == (2, HEIGHT, WIDTH, 3)
    s = demo_scene.SUPERSAMPLE
    for i in range(2):
        scores = {}
        for name, coefficients in (("right", lens), ("flipped", {k: -v for k, v in lens.items()})):
            undistorted, K = _undistort_as_nerfstudio(shot[i], intrinsics, camera_model, coefficients)
            h, w = undistorted.shape[:2]
            Ks = torch.from_numpy(K).float().clone()
            Ks[:2] *= s
            pinhole = demo_scene.render(gaussians, viewmats[i : i + 1], Ks[None], w * s, h * s)[0].numpy()
            pinhole = pinhole.reshape(h, s, w, s, 3).mean(axis=(1, 3))  # [h, w, 3]
            scores[name] = _psnr(undistorted, pinhole)
        assert scores["right"] > 35, scores  # measured 38-40 dB (OPENCV), 38 dB (fisheye)
        assert scores["flipped"] < scores["right"] - 4, scores  # measured 25-26 dB (OPENCV), 31-32 dB (fisheye)


@pytest.mark.parametrize("camera_model, per_frame", [("OPENCV", True), ("OPENCV_FISHEYE", False)])
def test_the_lens_is_written_as_nerfstudio_reads_it(tmp_path_factory, camera_model, per_frame):
    """nerfstudio's dataparser reads the camera model and, per frame or shared, the intrinsics and
    coefficients demo_scene wrote; per-frame ones differ from frame to frame."""
    from nerfstudio.cameras.cameras import CAMERA_MODEL_TO_TYPE
    from nerfstudio.data.dataparsers.nerfstudio_dataparser import NerfstudioDataParserConfig

    scene = demo_runs.lens_scene(tmp_path_factory, camera_model, per_frame)
    meta = json.loads((scene / "transforms.json").read_text())
    assert meta["camera_model"] == camera_model and ("fl_x" in meta) != per_frame and ("k1" in meta) != per_frame
    parser = NerfstudioDataParserConfig(data=scene, eval_mode="all").setup()  # every frame, in name order
    cameras = parser.get_dataparser_outputs("train").cameras
    assert (cameras.camera_type == CAMERA_MODEL_TO_TYPE[camera_model].value).all()
    names = ("k1", "k2", "k3", "k4", "p1", "p2")
    for i, frame in enumerate(meta["frames"]):
        source = frame if per_frame else meta
        expected = [source.get(k, 0.0) for k in names]
        np.testing.assert_allclose(cameras.distortion_params[i].numpy(), expected, rtol=1e-6)
        assert float(cameras.fx[i]) == pytest.approx(source["fl_x"]) and float(cameras.cy[i]) == pytest.approx(
            source["cy"]
        )
    lens = demo_runs.LENSES[camera_model]
    assert {k for k in names if (cameras.distortion_params[:, names.index(k)] != 0).any()} == set(lens)
    if per_frame:
        assert len(set(cameras.fx[:, 0].tolist())) == len(meta["frames"])
        assert len(set(cameras.distortion_params[:, 0].tolist())) == len(meta["frames"])


def test_the_command_line_refuses_a_coefficient_the_model_does_not_take(tmp_path, capsys):
    """OPENCV's k4 (nerfstudio's undistortion refuses it) and a fisheye's p1: one line, nothing written."""
    for args, names in (
        (["--k1", "-0.1", "--k4", "0.01"], "k4"),
        (["--camera-model", "OPENCV_FISHEYE", "--p1", "0.01"], "p1"),
    ):
        assert demo_scene.main(["--out", str(tmp_path / "scene"), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("[demo_scene]") and err.endswith(f"not {names}"), err
        assert not (tmp_path / "scene").exists()


def test_lens_rays_without_opencvs_iterative_undistort(monkeypatch):
    """OpenCV builds without undistortPointsIter (the CUDA machine's image has none): the demo generator's own
    fixed-point inversion gives the same rays to 1e-9 of a normalised coordinate, and its check still holds."""
    import cv2

    lens = demo_runs.LENSES["OPENCV"]
    pixels = np.random.default_rng(0).uniform([-1.0, -1.0], [97.0, 65.0], (40, 30, 2))
    with_opencv = demo_scene.lens_rays("OPENCV", lens, pixels, 80.0, 70.0, 48.5, 31.5)
    monkeypatch.delattr(cv2, "undistortPointsIter")
    without = demo_scene.lens_rays("OPENCV", lens, pixels, 80.0, 70.0, 48.5, 31.5)
    assert without.shape == with_opencv.shape == pixels.shape
    assert np.abs(without - with_opencv).max() < 1e-9
    assert np.abs(without - (pixels - [48.5, 31.5]) / [80.0, 70.0]).max() > 1e-3  # the lens does bend the rays
