"""Images as cameras write them (issue 35 item 3): real files with known pixels, decoded by
SplatMetalDataset (images.py) as the datamanager decodes them.

Every file is written by PIL or OpenCV (as a camera app or converter would write it), non-square, with
values that the old decode (nerfstudio's ``np.array(image, dtype="uint8")``) gets wrong where it does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from nerfstudio.data.datasets.base_dataset import InputDataset
from PIL import Image

from splat_metal_method.data import demo_scene
from splat_metal_method.data.datamanager import SplatMetalDatamanager
from splat_metal_method.data.dataparser import SplatMetalDataParserConfig
from splat_metal_method.data.images import SplatMetalDataset, read_image

H, W = 20, 36  # non-square


def _values16(channels: int, seed: int = 0) -> np.ndarray:
    """[H, W, channels] uint16 covering the whole range, low bytes unrelated to high bytes."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 65536, size=(H, W, channels), dtype=np.uint16)
    values[0, 0] = 0
    values[0, 1] = 65535
    values[0, 2] = 257 * 128 + 255  # low byte 255, the value ~ half
    return values


def _dataset(files, alpha_color=None, scale_factor: float = 1.0, cls=SplatMetalDataset):
    """A dataset over ``files`` as the datamanager makes one (cameras sized by the first file)."""
    from nerfstudio.cameras.cameras import Cameras
    from nerfstudio.data.dataparsers.base_dataparser import DataparserOutputs
    from nerfstudio.data.scene_box import SceneBox

    with Image.open(files[0]) as im:
        w, h = im.size
    n = len(files)
    cameras = Cameras(camera_to_worlds=torch.eye(4)[:3].expand(n, 3, 4), fx=50.0, fy=50.0, cx=w / 2, cy=h / 2,
                      width=w, height=h)  # fmt: skip
    outputs = DataparserOutputs(
        image_filenames=list(files), cameras=cameras, scene_box=SceneBox(aabb=torch.tensor([[-1.0] * 3, [1.0] * 3])),
        alpha_color=None if alpha_color is None else torch.tensor(alpha_color),
    )  # fmt: skip
    return cls(outputs, scale_factor=scale_factor)


def _write(path: Path, array: np.ndarray, writer: str) -> Path:
    """``array`` (RGB(A) order) as ``path`` with PIL or OpenCV."""
    if writer == "cv2":
        bgr = (
            array
            if array.ndim == 2
            else cv2.cvtColor(array, cv2.COLOR_RGB2BGR if array.shape[2] == 3 else cv2.COLOR_RGBA2BGRA)
        )
        assert cv2.imwrite(str(path), bgr)
    else:
        Image.fromarray(array).save(path)
    return path


@pytest.mark.parametrize(
    "name, channels, writer",
    [
        ("gray16.png", 1, "pil"),  # PIL mode "I;16": the old decode kept the low byte
        ("gray16_cv2.png", 1, "cv2"),
        ("rgb16.png", 3, "cv2"),  # PIL reads it as 8-bit RGB (high byte): precision lost
        ("rgba16.png", 4, "cv2"),
        ("rgb16.tif", 3, "cv2"),
        ("gray16.tif", 1, "cv2"),
    ],
)
def test_16_bit_images_scale_to_unit_range(tmp_path, name, channels, writer):
    values = _values16(channels)  # [H, W, C]
    path = _write(tmp_path / name, values[:, :, 0] if channels == 1 else values, writer)
    with Image.open(path) as im:  # the file really is 16-bit
        assert im.mode.startswith("I;16") or ";16" in str(im.tile[0][3]), (im.mode, im.tile)

    expected = np.repeat(values, 3, axis=2) if channels == 1 else values  # grayscale -> 3 equal channels
    decoded = read_image(path)
    assert decoded.dtype == np.uint16 and decoded.shape == (H, W, expected.shape[2])
    np.testing.assert_array_equal(decoded, expected)

    dataset = _dataset([path])
    as_float = dataset.get_image_float32(0)  # [H, W, C], all 16 bits
    torch.testing.assert_close(as_float, torch.from_numpy(expected.astype(np.float32) / 65535), rtol=0, atol=1e-7)
    as_uint8 = dataset.get_image_uint8(0)  # [H, W, C], what the default uint8 cache holds
    assert as_uint8.dtype == torch.uint8
    np.testing.assert_array_equal(as_uint8.numpy(), np.rint(expected / 257.0).astype(np.uint8))
    assert abs(as_uint8[0, 2, 0].item() - 128) <= 1  # not 255, the low byte
    data = dataset.get_data(0, image_type="float32")  # what the datamanager calls
    assert torch.equal(data["image"], as_float)

    if channels == 1:  # the bug: nerfstudio's decode trains on the low byte
        old = _dataset([path], cls=InputDataset).get_image_uint8(0)
        assert torch.equal(old[..., 0], torch.from_numpy((values[:, :, 0] & 0xFF).astype(np.uint8)))
        assert not torch.equal(old, as_uint8)


def test_16_bit_rgba_alpha_as_nerfstudio_treats_it(tmp_path):
    """An alpha channel stays a 4th channel (splatfacto composites it with its background); with the
    dataparser's alpha_color set it is blended as nerfstudio blends 8-bit images."""
    values = _values16(4)
    path = _write(tmp_path / "rgba16.png", values, "cv2")
    rgba = values.astype(np.float32) / 65535
    assert _dataset([path]).get_image_float32(0).shape == (H, W, 4)
    blended = _dataset([path], alpha_color=[0.0, 0.5, 1.0]).get_image_float32(0)  # [H, W, 3]
    expected = rgba[..., :3] * rgba[..., 3:] + np.array([0.0, 0.5, 1.0], np.float32) * (1 - rgba[..., 3:])
    torch.testing.assert_close(blended, torch.from_numpy(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "mode, suffix", [("L", ".png"), ("RGB", ".png"), ("RGBA", ".png"), ("L", ".jpg"), ("RGB", ".jpg")]
)
@pytest.mark.parametrize("scale_factor", [1.0, 0.5])
def test_8_bit_images_unchanged(tmp_path, mode, suffix, scale_factor):
    """8-bit images decode (and resize, camera_res_scale_factor) bit for bit as nerfstudio decodes them."""
    rng = np.random.default_rng(1)
    shape = (H, W) if mode == "L" else (H, W, len(mode))
    path = tmp_path / f"image{suffix}"
    Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8), mode=mode).save(path)
    ours, theirs = (_dataset([path], scale_factor=scale_factor, cls=c) for c in (SplatMetalDataset, InputDataset))
    assert ours.get_image_uint8(0).shape[:2] == (int(H * scale_factor), int(W * scale_factor))
    assert torch.equal(ours.get_image_uint8(0), theirs.get_image_uint8(0))
    assert torch.equal(ours.get_image_float32(0), theirs.get_image_float32(0))


def test_16_bit_resize_matches_the_8_bit_filter(tmp_path):
    """camera_res_scale_factor on a 16-bit image: the same bilinear filter as nerfstudio's 8-bit resize."""
    rng = np.random.default_rng(2)
    rgb8 = rng.integers(0, 256, size=(H, W, 3), dtype=np.uint8)
    p8 = _write(tmp_path / "rgb8.png", rgb8, "pil")
    p16 = _write(tmp_path / "rgb16.png", rgb8.astype(np.uint16) * 257, "cv2")
    small8 = _dataset([p8], scale_factor=0.5).get_image_float32(0)
    small16 = _dataset([p16], scale_factor=0.5).get_image_float32(0)
    assert small16.shape == small8.shape == (H // 2, W // 2, 3)
    assert (small16 - small8).abs().max() < 1.0 / 255  # the 8-bit path rounds to 1/255; same filter otherwise


def test_other_pil_modes_become_rgb(tmp_path):
    """Palette, grey+alpha and CMYK files: the pixels they show, not palette indices or CMYK taken for RGBA."""
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, size=(H, W, 3), dtype=np.uint8)
    palette = Image.fromarray(rgb).quantize(colors=16)
    palette.save(tmp_path / "palette.png")
    la = Image.fromarray(np.stack([rgb[..., 0], rgb[..., 1]], axis=-1), mode="LA")
    la.save(tmp_path / "la.png")
    Image.fromarray(rgb).convert("CMYK").save(tmp_path / "cmyk.jpg", quality=100)

    np.testing.assert_array_equal(read_image(tmp_path / "palette.png"), np.array(palette.convert("RGB")))
    np.testing.assert_array_equal(read_image(tmp_path / "la.png"), np.array(la.convert("RGBA")))
    cmyk = read_image(tmp_path / "cmyk.jpg")
    assert cmyk.shape == (H, W, 3) and np.abs(cmyk.astype(int) - rgb).mean() < 8  # JPEG's loss only


def _to_16_bit(scene: Path, out: Path, gray: bool = False, seed: int = 0) -> Path:
    """The scene with every image rewritten as a 16-bit PNG: v * 257 plus dither below half an 8-bit
    step (what a 16-bit camera adds: precision the 8-bit file does not have)."""
    import shutil

    out = Path(shutil.copytree(scene, out))
    rng = np.random.default_rng(seed)
    for image in sorted((out / demo_scene.IMAGE_DIR).glob("*.png")):
        rgb = np.array(Image.open(image).convert("L" if gray else "RGB")).astype(np.int32) * 257
        rgb = np.clip(rgb + rng.integers(-120, 121, size=rgb.shape), 0, 65535).astype(np.uint16)
        _write(image, rgb, "cv2")
    return out


@pytest.fixture(scope="module")
def scene8(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("images") / "scene8"
    demo_scene.generate(out, width=64, height=40, views=12)
    return out


def _datamanager(data: Path, cache_images_type: str) -> SplatMetalDatamanager:
    from splat_metal_method.method.configs import splat_metal_trainer_config

    config = splat_metal_trainer_config().pipeline.datamanager
    config.data = data
    config.cache_images_type = cache_images_type
    return config.setup(device="cpu", test_mode="val")


@pytest.mark.parametrize("gray", [False, True], ids=["rgb", "gray"])
def test_datamanager_caches_16_bit_images_scaled(scene8, tmp_path, gray):
    """Through splat-metal's datamanager (the cached path ns-train takes): the default uint8 cache holds
    the 8-bit image the 16-bit one rounds to; the float32 cache keeps the 16 bits."""
    scene16 = _to_16_bit(scene8, tmp_path / "scene16", gray=gray)
    dm8, dm16 = _datamanager(scene8, "uint8"), _datamanager(scene16, "uint8")
    assert isinstance(dm16.train_dataset, SplatMetalDataset) and isinstance(dm16.eval_dataset, SplatMetalDataset)
    for a, b in zip(dm8.cached_train + dm8.cached_eval, dm16.cached_train + dm16.cached_eval):
        expected = a["image"]
        if gray:  # the 8-bit RGB image made gray as the 16-bit file was
            expected = torch.from_numpy(np.array(Image.fromarray(expected.numpy()).convert("L")))[..., None].expand(
                -1, -1, 3
            )
        assert b["image"].dtype == torch.uint8 and torch.equal(b["image"], expected)
    dm16f = _datamanager(scene16, "float32")
    for a, b in zip(dm16.cached_train, dm16f.cached_train):
        assert b["image"].dtype == torch.float32
        difference = (b["image"] - a["image"].float() / 255).abs()
        assert 0 < difference.max() <= 0.5 / 255 + 1e-6  # finer than 8 bits, within half a step of them


def _train(data: Path, cache_images_type: str, steps: int):
    """``steps`` training steps on the CPU; -> (last 10 losses' mean, held-out PSNR)."""
    from pipelines import setup_pipeline, train_step

    from splat_metal_method.method.configs import splat_metal_trainer_config

    cfg = splat_metal_trainer_config()
    cfg.machine.device_type = "cpu"
    cfg.pipeline.datamanager.data = data
    cfg.pipeline.datamanager.cache_images_type = cache_images_type
    cfg.pipeline.model.background_color = "white"
    cfg.pipeline.model.num_downscales = 0
    pipeline, optimizers, callbacks = setup_pipeline(cfg, "cpu", seed=0)
    losses = [train_step(pipeline, optimizers, callbacks, step).item() for step in range(steps)]
    pipeline.eval()
    psnrs = []
    with torch.no_grad():
        for camera, batch in pipeline.datamanager.fixed_indices_eval_dataloader:
            outputs = pipeline.model.get_outputs_for_camera(camera)
            psnrs.append(pipeline.model.get_image_metrics_and_images(outputs, batch)[0]["psnr"])
    return float(np.mean(losses[-10:])), float(np.mean(psnrs))


def test_training_on_a_16_bit_capture_matches_8_bit(scene8, tmp_path):
    """A short training on the demo capture converted to 16-bit PNGs (float32 cache: all 16 bits) lands
    where the 8-bit capture's does; before, nothing checked a 16-bit file's pixels at all."""
    scene16 = _to_16_bit(scene8, tmp_path / "scene16")
    loss8, psnr8 = _train(scene8, "uint8", steps=60)
    loss16, psnr16 = _train(scene16, "float32", steps=60)
    print(f"8-bit: loss {loss8:.4f} psnr {psnr8:.2f}; 16-bit: loss {loss16:.4f} psnr {psnr16:.2f}")
    assert math.isfinite(loss16) and math.isfinite(psnr16)
    assert psnr8 > 14  # it learned something
    assert abs(loss16 - loss8) < 0.1 * loss8 and abs(psnr16 - psnr8) < 0.5


def test_transforms_json_lists_16_bit_images_as_ns_process_data_would(scene8, tmp_path):
    """The dataparser and its check take 16-bit files as they are (sizes from the header)."""
    scene16 = _to_16_bit(scene8, tmp_path / "scene16", gray=True)
    meta = json.loads((scene16 / "transforms.json").read_text())
    outputs = SplatMetalDataParserConfig(data=scene16, load_3D_points=True).setup().get_dataparser_outputs("train")
    assert len(outputs.image_filenames) == len(meta["frames"]) - len(demo_scene.eval_indices(len(meta["frames"])))
