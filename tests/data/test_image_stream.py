"""Issue 35 item 5: a thousand photos in bounded memory.

Captures are written the way ns-process-data writes a COLMAP capture (JPEG photos, transforms.json with
the OPENCV lens model and k1/k2 set, sparse_pc.ply), by the large-capture benchmark's own writer, at
tiny non-square sizes. The streamed path is checked against the cached one and both against
nerfstudio's own FullImageDatamanager (the images and cameras it makes when it undistorts).
"""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_large_capture import write_capture  # noqa: E402
from pipelines import setup_pipeline, train_step  # noqa: E402

from splat_metal_method.data import image_stream  # noqa: E402
from splat_metal_method.data.image_stream import ImageStream  # noqa: E402

W, H = 40, 24  # the photos' size (non-square)
PHOTO = W * H * 3  # bytes of one decoded uint8 photo


def trainer_config(data: Path, image_cache_gb: float):
    from splat_metal_method.method.configs import splat_metal_trainer_config

    cfg = splat_metal_trainer_config()
    cfg.machine.device_type = "cpu"
    cfg.pipeline.datamanager.data = data
    cfg.pipeline.datamanager.image_cache_gb = image_cache_gb
    cfg.pipeline.model.background_color = "white"
    return cfg


def datamanager(data: Path, image_cache_gb: float, seed: int = 0):
    random.seed(seed)
    return trainer_config(data, image_cache_gb).pipeline.datamanager.setup(device="cpu", test_mode="val")


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> Path:
    return write_capture(tmp_path_factory.mktemp("capture"), 14, W, H)  # 13 training photos, 1 held out


# ---- the stream itself
class Photos:
    """Decoded photos i as [H, W, 3] uint8 filled with i, recording which were decoded, from which thread."""

    def __init__(self, fail: int = -1):
        self.loads, self.fail, self.lock = [], fail, threading.Lock()

    def __call__(self, i: int) -> dict:
        with self.lock:
            self.loads.append(i)
        if i == self.fail:
            raise ValueError(f"photo {i} is unreadable")
        return {"image_idx": i, "image": torch.full((H, W, 3), i, dtype=torch.uint8)}


def wait_for(condition, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def test_stream_decodes_ahead_in_order_once_each_within_budget():
    photos = Photos()
    budget = 3 * PHOTO
    stream = ImageStream(photos, lambda i: PHOTO, budget, "test")
    order = random.Random(1).sample(range(40), 40)
    for k, idx in enumerate(order):
        data = stream.get(idx, order[k + 1 :])
        assert data["image_idx"] == idx and torch.equal(data["image"], torch.full((H, W, 3), idx, dtype=torch.uint8))
        if k == 0:  # once photo 0 is handed out, the next three are decoded ahead, and no more (3 fit)
            assert wait_for(lambda: len(photos.loads) == 4), photos.loads
            assert sorted(photos.loads) == sorted(order[:4])
            time.sleep(0.05)
            assert len(photos.loads) == 4
        assert stream.held_bytes() <= budget
    assert sorted(photos.loads) == sorted(order)  # each photo decoded exactly once
    stream.close()


def test_stream_prefetch_is_bounded_by_count_under_a_large_budget():
    photos = Photos()
    stream = ImageStream(photos, lambda i: PHOTO, 10**12, "test")
    stream.get(0, list(range(1, 100)))
    assert wait_for(lambda: len(photos.loads) == image_stream.PREFETCH + 1)
    time.sleep(0.05)
    assert len(photos.loads) == image_stream.PREFETCH + 1
    assert stream.held_bytes() == image_stream.PREFETCH * PHOTO  # 1 to 8: photo 0 left when it was handed out
    stream.close()


def test_stream_raises_a_decoding_error_at_that_image_only():
    stream = ImageStream(Photos(fail=5), lambda i: PHOTO, 4 * PHOTO, "test")
    order = [3, 4, 5, 6, 7]
    for k, idx in enumerate(order):
        if idx == 5:
            with pytest.raises(ValueError, match="photo 5 is unreadable"):
                stream.get(idx, order[k + 1 :])
        else:
            assert stream.get(idx, order[k + 1 :])["image_idx"] == idx
    stream.close()


def test_stream_threads_end_when_closed_or_dropped():
    """close() joins the decoding threads (at exit too: a thread left inside OpenCV or torch while the
    interpreter tears down aborts the process); a stream no one holds is collected and its threads end."""
    import gc

    stream = ImageStream(Photos(), lambda i: PHOTO, 4 * PHOTO, "test")
    stream.get(0, [1, 2, 3])
    threads = list(stream._threads)
    assert threads and all(t.is_alive() for t in threads)
    stream.close()
    assert not any(t.is_alive() for t in threads)
    stream = ImageStream(Photos(), lambda i: PHOTO, 4 * PHOTO, "test")
    stream.get(0, [1, 2, 3])
    threads = list(stream._threads)
    del stream
    gc.collect()
    assert wait_for(lambda: not any(t.is_alive() for t in threads), 5.0)


# ---- the datamanager
def test_over_500_training_photos_start_on_cpu(tmp_path):
    """nerfstudio switches its cache to "cpu" over 500 training images and pins each one: without an NVIDIA
    driver pin_memory() raised before the first step."""
    data = write_capture(tmp_path / "c", 560, 24, 16)  # 504 training photos
    pipeline, optimizers, callbacks = setup_pipeline(trainer_config(data, 2.0), "cpu")
    dm = pipeline.datamanager
    assert len(dm.train_dataset) > 500 and dm.config.cache_images == "cpu" and not dm.streaming
    loss = train_step(pipeline, optimizers, callbacks, 0)
    assert torch.isfinite(loss)
    assert len(dm.cached_train) == len(dm.train_dataset)
    assert not dm.cached_train[0]["image"].is_pinned()  # training on cpu: pinning means nothing


def test_budget_decides_cached_or_streamed(capture):
    assert not datamanager(capture, 2.0).streaming  # 14 tiny photos fit 2 GB: cached whole, as nerfstudio does
    assert not datamanager(capture, -1).streaming
    assert datamanager(capture, 13 * PHOTO / 1e9).streaming  # less than the 14 photos take


def test_cameras_and_images_are_nerfstudios(capture):
    """The cameras are undistorted before the first step, to what nerfstudio's FullImageDatamanager writes
    when it caches the images, and the images (streamed or cached) are the ones it caches."""
    from nerfstudio.data.datamanagers.full_images_datamanager import FullImageDatamanager

    cfg = trainer_config(capture, -1).pipeline.datamanager
    theirs = FullImageDatamanager(cfg, device="cpu", test_mode="val")
    cached, streamed = datamanager(capture, -1), datamanager(capture, 3 * PHOTO / 1e9)
    lens = theirs.train_dataset.cameras
    assert float(lens.distortion_params[0, 0]) == pytest.approx(-0.05)
    before = (lens.width.clone(), lens.fx.clone())
    images, eval_images = theirs.cached_train, theirs.cached_eval  # nerfstudio undistorts here, rewrites its cameras
    assert not torch.equal(lens.width, before[0]) and not torch.equal(lens.fx, before[1])  # the lens mattered
    for split in ("train", "eval"):
        ours = getattr(streamed, f"{split}_dataset").cameras
        ns = getattr(theirs, f"{split}_dataset").cameras
        for name in ("fx", "fy", "cx", "cy", "width", "height"):
            assert torch.equal(getattr(ours, name), getattr(ns, name)), (split, name)
            assert torch.equal(getattr(getattr(cached, f"{split}_dataset").cameras, name), getattr(ns, name))
    for dm in (cached, streamed):
        seen = set()
        for _ in range(len(images)):
            camera, data = dm.next_train(0)
            idx = camera.metadata["cam_idx"]
            seen.add(idx)
            assert torch.equal(data["image"], images[idx]["image"])
            assert tuple(data["image"].shape[:2]) == (int(camera.height), int(camera.width))
        assert seen == set(range(len(images)))
        for i, (camera, data) in enumerate(dm.fixed_indices_eval_dataloader):
            assert torch.equal(data["image"], eval_images[i]["image"]) and int(camera.width) == data["image"].shape[1]


def test_streamed_order_is_nerfstudios_and_predicted(capture):
    """The same seed gives the same images in the same order, across epochs; what the stream is told comes
    next is what next_train then draws."""
    cached, streamed = datamanager(capture, -1), datamanager(capture, 3 * PHOTO / 1e9)
    assert streamed.streaming
    budget = streamed._streams["train"]._budget
    n = len(streamed.train_dataset)
    for step in range(3 * n):
        (cam_a, data_a), (cam_b, data_b) = cached.next_train(step), streamed.next_train(step)
        assert cam_a.metadata["cam_idx"] == cam_b.metadata["cam_idx"]
        assert torch.equal(data_a["image"], data_b["image"])
        assert streamed._streams["train"].held_bytes() <= budget
        if step == n // 2:
            upcoming = streamed._upcoming_train()
            assert len(upcoming) > n  # the rest of this epoch and the next
            predicted, drawn = upcoming[: n + 3], []
        if step > n // 2 and len(drawn) < len(predicted):
            drawn.append(cam_b.metadata["cam_idx"])
    assert drawn == predicted
    random.seed(3)
    a = [cached.next_eval_image(0)[1]["image"] for _ in range(3)]
    random.seed(3)
    b = [streamed.next_eval_image(0)[1]["image"] for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_streamed_training_is_the_cached_training(capture):
    """Same seed, a budget of 3 photos vs the whole capture cached: the same loss at every step and the same
    parameters after two epochs and more."""
    runs = {}
    for label, gb in (("cached", -1.0), ("streamed", 3 * PHOTO / 1e9)):
        pipeline, optimizers, callbacks = setup_pipeline(trainer_config(capture, gb), "cpu", seed=0)
        assert pipeline.datamanager.streaming == (label == "streamed")
        losses = torch.stack([train_step(pipeline, optimizers, callbacks, step) for step in range(30)])
        runs[label] = (losses, {k: v.detach().clone() for k, v in pipeline.model.gauss_params.items()})
    (loss_a, params_a), (loss_b, params_b) = runs["cached"], runs["streamed"]
    assert torch.equal(loss_a, loss_b)
    assert loss_a[-5:].mean() < loss_a[:5].mean()  # it trained
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name


@pytest.mark.parametrize("size", [(97, 61), (785, 589), (64, 48)])
@pytest.mark.parametrize("dtype, channels", [(np.uint8, 3), (np.uint8, 4), (np.float32, 3)])
def test_undistort_perspective_is_nerfstudios_bit_for_bit(size, dtype, channels):
    """The map made once per lens gives nerfstudio's _undistort_image's pixels exactly (non-square sizes,
    k1 k2 k3 p1 p2, 8-bit and float images, RGB and RGBA); a second image of the same lens reuses it."""
    from nerfstudio.cameras.cameras import Cameras, CameraType
    from nerfstudio.data.datamanagers.full_images_datamanager import _undistort_image

    from splat_metal_method.data.image_stream import undistort_perspective

    w, h = size
    rng = np.random.default_rng(w * h)
    for trial in range(3):
        distortion = torch.tensor([[-0.12 + 0.05 * trial, 0.03, 0.01 * trial, 0.0, 8e-4, -5e-4]])
        camera = Cameras(camera_to_worlds=torch.eye(4)[None, :3], fx=0.9 * w, fy=0.92 * w, cx=w / 2 + 1.3,
                         cy=h / 2 - 0.7, width=w, height=h, distortion_params=distortion,
                         camera_type=CameraType.PERSPECTIVE)[0]  # fmt: skip
        K = camera.get_intrinsics_matrices().numpy()
        for _ in range(2):  # the second image of the lens goes through the cached map
            image = rng.integers(0, 256, (h, w, channels)).astype(dtype)
            if dtype == np.float32:
                image /= 255.0
            _, expected, _ = _undistort_image(camera, camera.distortion_params.numpy(), {}, image.copy(), K.copy())
            got = undistort_perspective(K, camera.distortion_params.numpy(), image)
            assert got.dtype == expected.dtype and got.shape == expected.shape, (got.shape, expected.shape)
            assert np.array_equal(got, expected)
            assert got.shape[0] < h and got.shape[1] < w  # cropped to the valid area, as nerfstudio does
