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
Everything else (image queue, sampling, caching, eval) is nerfstudio's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Tuple, Type

from nerfstudio.cameras.cameras import Cameras
from nerfstudio.data.datamanagers.full_images_datamanager import FullImageDatamanager, FullImageDatamanagerConfig

from .images import SplatMetalDataset


@dataclass
class SplatMetalDatamanagerConfig(FullImageDatamanagerConfig):
    _target: Type = field(default_factory=lambda: SplatMetalDatamanager)


class SplatMetalDatamanager(FullImageDatamanager[SplatMetalDataset]):  # images decoded by images.py
    _train_camera_cache: Dict[int, Tuple[Cameras, dict, dict]]  # i -> (camera, its fields, slice metadata)

    def next_train(self, step: int) -> Tuple[Cameras, Dict]:
        """nerfstudio's next_train (same images, same order, same camera values)."""
        image_idx = self.train_unseen_cameras.pop(0)
        if len(self.train_unseen_cameras) == 0:
            self.train_unseen_cameras = self.sample_train_cameras()
        data = self.cached_train[image_idx].copy()  # nerfstudio#3335: the cached dict is not mutated
        data["image"] = data["image"].to(self.device)
        camera = self.train_camera(image_idx)
        return camera, data

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
