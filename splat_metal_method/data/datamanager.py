"""SplatMetalDatamanager: nerfstudio's FullImageDatamanager, with next_train handing out one Cameras
object per training image instead of a new one every step.

nerfstudio's next_train slices the training cameras and moves the slice to the device every step
(``train_cameras[i : i + 1].to(device)``): two TensorDataclass rebuilds, each indexing and
broadcasting every field, 27 aten dispatches per step (on a Mac where the cameras stay on the host,
also a host-to-device copy of each field). Here the camera of image i is made that way once and handed
out again while its fields are the ones it was made with; a consumer that assigns a field (as
``rescale_output_resolution`` does) makes the next step slice afresh. The tensors are the same views
of ``train_cameras`` nerfstudio's slice has, so in-place edits of those show through as before, and
``metadata`` is a new dict each step ({"cam_idx": i} plus the slice's own), as nerfstudio's is.
Images (image_stream.py): every image is decoded the same way, through the dataset's ``get_data`` and
nerfstudio's own undistortion, and the cameras are rewritten to the undistorted intrinsics and crop up
front (nerfstudio rewrites them only when it caches the images, at the first step, after the model has
read their sizes). A capture whose decoded images fit ``image_cache_gb`` is cached whole before the first
step, as nerfstudio does; a larger one is streamed: background threads decode the next few images of the
order training asks for (nerfstudio's shuffled queue, and the next epoch's shuffle predicted from a copy of
its generator), so the images and their order are the cached path's. Cached images are pinned only where
pinning means something (a CUDA device; nerfstudio pins every image once a capture has over 500, which
fails without an NVIDIA driver). The queue, sampling and eval choice are nerfstudio's.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from copy import deepcopy
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Dict, List, Literal, Optional, Tuple, Type

import torch
from nerfstudio.cameras.cameras import Cameras
from nerfstudio.data.datamanagers.full_images_datamanager import FullImageDatamanager, FullImageDatamanagerConfig
from nerfstudio.data.datasets.base_dataset import InputDataset
from nerfstudio.utils.rich_utils import CONSOLE
from rich.progress import track

from .image_stream import ImageStream, decode, nbytes, undistort_cameras
from .images import SplatMetalDataset

GB = 1e9


@dataclass
class SplatMetalDatamanagerConfig(FullImageDatamanagerConfig):
    _target: Type = field(default_factory=lambda: SplatMetalDatamanager)
    image_cache_gb: float = 2.0
    """Decoded images held in memory at most, in GB (training and eval images together). A capture whose
    images fit is decoded whole before the first step (nerfstudio's cache); a larger one is streamed:
    images are decoded in the background just before training asks for them. -1: always cache whole."""


class SplatMetalDatamanager(FullImageDatamanager[SplatMetalDataset]):  # images decoded by images.py
    config: SplatMetalDatamanagerConfig
    _train_camera_cache: Dict[int, Tuple[Cameras, dict, dict]]  # i -> (camera, its fields, slice metadata)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The cameras as the dataparser wrote them (decode undistorts through these), then the cameras
        # training renders with: undistorted and cropped, before anything reads their sizes.
        self._lens = {"train": deepcopy(self.train_dataset.cameras), "eval": deepcopy(self.eval_dataset.cameras)}
        undistort_cameras(self.train_dataset.cameras)
        undistort_cameras(self.eval_dataset.cameras)
        self.train_cameras = self.train_dataset.cameras
        if self.config.cache_images == "gpu":
            self.train_cameras = self.train_cameras.to(self.device)

    # ---- images
    def _dataset(self, split: str) -> InputDataset:
        return self.train_dataset if split == "train" else self.eval_dataset

    def _decode(self, split: str, idx: int) -> Dict:
        data = decode(self._dataset(split), self._lens[split], idx, self.config.cache_images_type)
        if self._pin:
            data = {k: v.pin_memory() if k in ("image", "mask") else v for k, v in data.items()}
        return data

    @property
    def _pin(self) -> bool:
        """Page-locked host images speed up copies to a CUDA device only; without an NVIDIA driver
        pin_memory() raises, and on a Mac what it does depends on the torch version."""
        return torch.cuda.is_available() and torch.device(self.device).type == "cuda"

    def _load_images(self, split: Literal["train", "eval"], cache_images_device: Literal["cpu", "gpu"]) -> List[Dict]:
        """nerfstudio's cache: every image of the split decoded (2 threads), kept on the device ("gpu")
        or on the host ("cpu", pinned where that means something)."""
        n = len(self._dataset(split))
        CONSOLE.log(f"Caching / undistorting {split} images")
        with ThreadPoolExecutor(max_workers=2) as executor:
            images = list(
                track(
                    executor.map(partial(self._decode, split), range(n)),
                    description=f"Caching / undistorting {split} images",
                    transient=True,
                    total=n,
                )
            )
        if cache_images_device == "gpu":
            for data in images:
                for key in ("image", "mask", "depth"):
                    if key in data:
                        data[key] = data[key].to(self.device)
        return images

    @cached_property
    def _streams(self) -> Optional[Dict[str, ImageStream]]:
        """None when the decoded images of both splits fit ``image_cache_gb`` (cached whole), else one
        stream per split with a share of the budget proportional to its images' size. The size of the
        first training image, decoded once, scales with each image's pixel count."""
        budget = self.config.image_cache_gb * GB
        if budget < 0 or len(self.train_dataset) == 0:
            return None
        lens = self._lens["train"]
        per_pixel = nbytes(self._decode("train", 0)) / float(lens.width[0] * lens.height[0])
        pixels = {
            split: (c.width.reshape(-1).double() * c.height.reshape(-1).double()) for split, c in self._lens.items()
        }
        sizes = {split: (p * per_pixel).tolist() for split, p in pixels.items()}
        total = sum(sum(s) for s in sizes.values())
        if total <= budget:
            return None
        CONSOLE.print(
            f"splat-metal: the decoded images take {total / GB:.3g} GB, more than image_cache_gb "
            f"({self.config.image_cache_gb:g} GB): they are decoded in the background as training asks for them "
            "(--pipeline.datamanager.image-cache-gb sets the budget).",
            highlight=False,
            soft_wrap=True,
        )
        return {
            split: ImageStream(
                partial(self._decode, split), sizes[split].__getitem__, int(budget * sum(sizes[split]) / total), split
            )
            for split in ("train", "eval")
        }

    @property
    def streaming(self) -> bool:
        return self._streams is not None

    def _upcoming_train(self) -> List[int]:
        """The training images after the one just drawn, in the order next_train will draw them: this
        epoch's queue, then the next epoch as sample_train_cameras will shuffle it ("random": a copy of
        its generator shuffles; "fps" is drawn only when the epoch ends)."""
        upcoming = list(self.train_unseen_cameras)
        generator = getattr(self, "random_generator", None)
        if self.config.train_cameras_sampling_strategy == "random" and isinstance(generator, random.Random):
            state = generator.getstate()
            if getattr(self, "_next_epoch", (None,))[0] != state:
                ahead = random.Random()
                ahead.setstate(state)
                indices = list(range(len(self.train_dataset)))
                ahead.shuffle(indices)
                self._next_epoch = (state, indices)
            upcoming += self._next_epoch[1]
        return upcoming

    def _train_image(self, image_idx: int) -> Dict:
        if self._streams is None:
            return self.cached_train[image_idx]
        return self._streams["train"].get(image_idx, self._upcoming_train())

    def _eval_image(self, image_idx: int, upcoming=()) -> Dict:
        if self._streams is None:
            return self.cached_eval[image_idx]
        return self._streams["eval"].get(image_idx, upcoming)

    # ---- what training and eval call
    def next_train(self, step: int) -> Tuple[Cameras, Dict]:
        """nerfstudio's next_train (same images, same order, same camera values)."""
        image_idx = self.train_unseen_cameras.pop(0)
        if len(self.train_unseen_cameras) == 0:
            self.train_unseen_cameras = self.sample_train_cameras()
        data = self._train_image(image_idx).copy()  # nerfstudio#3335: the cached dict is not mutated
        data["image"] = data["image"].to(self.device)
        camera = self.train_camera(image_idx)
        return camera, data

    def next_eval_image(self, step: int) -> Tuple[Cameras, Dict]:
        """nerfstudio's next_eval_image (the same draw from Python's ``random``), streamed or cached."""
        image_idx = self.eval_unseen_cameras.pop(random.randint(0, len(self.eval_unseen_cameras) - 1))
        if len(self.eval_unseen_cameras) == 0:
            self.eval_unseen_cameras = [i for i in range(len(self.eval_dataset))]
        data = self._eval_image(image_idx).copy()
        data["image"] = data["image"].to(self.device)
        assert len(self.eval_dataset.cameras.shape) == 1, "Assumes single batch dimension"
        camera = self.eval_dataset.cameras[image_idx : image_idx + 1].to(self.device)
        return camera, data

    @property
    def fixed_indices_eval_dataloader(self):
        """nerfstudio's list of (camera, data) for every eval image; streamed, a sequence that decodes
        each image as it is reached (and the next few ahead)."""
        if self._streams is None:
            return super().fixed_indices_eval_dataloader
        return _EvalImages(self)

    def get_train_rays_per_batch(self) -> int:
        if self._streams is None:
            return super().get_train_rays_per_batch()
        return int(self.train_dataset.cameras.height[0]) * int(self.train_dataset.cameras.width[0])

    def train_camera(self, image_idx: int) -> Cameras:
        """``train_cameras[i : i + 1]`` on the device, with metadata {"cam_idx": i}: made once per image."""
        cache = self.__dict__.setdefault("_train_camera_cache", {})
        entry = cache.get(image_idx)
        if entry is None or any(getattr(entry[0], k) is not v for k, v in entry[1].items()):
            assert len(self.train_cameras.shape) == 1, "Assumes single batch dimension"
            camera = self.train_cameras[image_idx : image_idx + 1].to(self.device)
            fields = {f.name: getattr(camera, f.name) for f in dataclasses.fields(camera) if f.name != "metadata"}
            entry = cache[image_idx] = (camera, fields, dict(camera.metadata or {}))
        camera, _, metadata = entry
        camera.metadata = {**metadata, "cam_idx": image_idx}
        return camera


class _EvalImages(Sequence):
    """fixed_indices_eval_dataloader of a streamed capture: (camera, data) of eval image i on the device,
    as nerfstudio's list holds them, made when asked for."""

    def __init__(self, datamanager: SplatMetalDatamanager):
        self._dm = datamanager

    def __len__(self) -> int:
        return len(self._dm.eval_dataset)

    def __getitem__(self, i: int) -> Tuple[Cameras, Dict]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        dm = self._dm
        data = dm._eval_image(i, range(i + 1, len(self))).copy()
        data["image"] = data["image"].to(dm.device)
        camera = deepcopy(dm.eval_dataset.cameras[i : i + 1]).to(dm.device)
        return camera, data
