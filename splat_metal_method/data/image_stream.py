"""Training images decoded on demand, in the order training asks for them, holding a bounded number.

nerfstudio 1.1.5's FullImageDatamanager decodes and undistorts every image before the first step and
keeps them all (1,000 photos of 1600x1200 are 5.8 GB as uint8). For a capture whose decoded images
do not fit the datamanager's budget, SplatMetalDatamanager hands out images from an ``ImageStream``
instead: background threads decode (and undistort) the next few images of the order training will
ask for, and an image is dropped once it is handed out and not due again soon.

Both paths make each image the same way, ``decode``: the dataset's own ``get_data`` (so a dataset
class's image loading applies) and nerfstudio's own ``_undistort_image`` (for perspective lenses its
bit-identical twin ``undistort_perspective``, which makes the map once per lens), from the cameras as the
dataparser wrote them (``lens``). The cameras training renders with are rewritten once, up front, by
``undistort_cameras``: the same function on a blank image of the camera's size gives the cropped
intrinsics nerfstudio writes when it undistorts the pixels, without decoding any.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Set

import cv2
import numpy as np
import torch
from nerfstudio.cameras.cameras import Cameras, CameraType
from nerfstudio.data.datamanagers.full_images_datamanager import _undistort_image
from nerfstudio.data.datasets.base_dataset import InputDataset

PREFETCH = 8  # images held at most (within the budget): the one training asks for and those due next
WORKERS = 2  # decoding threads per stream (nerfstudio caches with 2)


def _has_distortion(camera: Cameras) -> bool:
    return camera.distortion_params is not None and not bool(torch.all(camera.distortion_params == 0))


def decode(dataset: InputDataset, lens: Cameras, idx: int, image_type: str) -> Dict:
    """Image ``idx`` as nerfstudio's cache holds it: ``dataset.get_data``, undistorted and cropped through
    its camera in ``lens`` (the dataparser's cameras, before any rewrite)."""
    data = dataset.get_data(idx, image_type=image_type)
    camera = lens[idx].reshape(())
    h, w = data["image"].shape[:2]
    if (w, h) != (int(camera.width), int(camera.height)):
        raise ValueError(
            f"{dataset.image_filenames[idx]}: the image is {w}x{h} but its camera says "
            f"{int(camera.width)}x{int(camera.height)}; fix w/h in transforms.json or the image"
        )
    if not _has_distortion(camera):
        return data
    K = camera.get_intrinsics_matrices().numpy()
    if int(camera.camera_type) == CameraType.PERSPECTIVE.value and not {"mask", "depth_image"} & set(data):
        data["image"] = torch.from_numpy(
            undistort_perspective(K, camera.distortion_params.numpy(), data["image"].numpy())
        )
        return data
    K, image, mask = _undistort_image(camera, camera.distortion_params.numpy(), data, data["image"].numpy(), K)
    data["image"] = torch.from_numpy(image)
    if mask is not None:
        data["mask"] = mask
    return data


_MAPS: Dict[tuple, tuple] = {}  # lens (K, distortion, size) -> (map1, map2, crop), shared by threads
_MAPS_LOCK = threading.Lock()


def undistort_perspective(K: np.ndarray, distortion: np.ndarray, image: np.ndarray) -> np.ndarray:
    """nerfstudio's ``_undistort_image`` for a perspective camera, bit for bit, with its undistortion map
    made once per lens instead of once per image (the map is two thirds of cv2.undistort's time). The
    map is cv2.undistort's own: it builds it a stripe of rows at a time (the new camera's cy shifted by
    the stripe's first row), then remaps bilinearly with a constant border; here the stripes are
    stacked once. K: [3, 3]; distortion: [6] nerfstudio's (k1, k2, k3, k4, p1, p2); image: [H, W, C]."""
    h, w = image.shape[:2]
    key = (*K.reshape(-1).tolist(), *distortion.tolist(), w, h)
    with _MAPS_LOCK:
        maps = _MAPS.get(key)
    if maps is None:
        d = distortion
        dist = np.array([d[0], d[1], d[4], d[5], d[2], d[3], 0, 0])  # OpenCV's order, as nerfstudio passes it
        K = K.copy()
        K[0, 2] -= 0.5  # OpenCV's pixel centres (nerfstudio#3048)
        K[1, 2] -= 0.5
        new_K, (x, y, cw, ch) = cv2.getOptimalNewCameraMatrix(K, dist, (w, h), 0)
        stripe = min(max(1, (1 << 12) // max(w, 1)), h)  # cv2.undistort's stripe of rows
        A, Ar, parts = np.asarray(K, np.float64), np.asarray(new_K, np.float64).copy(), []
        for row in range(0, h, stripe):
            Ar[1, 2] = new_K[1, 2] - row
            n = min(stripe, h - row)
            parts.append(cv2.initUndistortRectifyMap(A, dist, np.eye(3), Ar, (w, n), cv2.CV_16SC2))
        maps = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), (x, y, cw, ch))
        with _MAPS_LOCK:
            _MAPS[key] = maps
    map1, map2, (x, y, cw, ch) = maps
    out = cv2.remap(image, map1, map2, cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT)
    return out[y : y + ch, x : x + cw]


def undistort_cameras(cameras: Cameras) -> None:
    """Rewrites fx, fy, cx, cy, width and height of every distorted camera in place, as nerfstudio's
    cache does when it undistorts the image: ``_undistort_image`` on a blank image of the camera's size
    (its intrinsics and crop depend on K, the distortion and the size only). Cameras with the same
    lens share one computation."""
    if cameras.distortion_params is None:
        return
    done: Dict[tuple, tuple] = {}
    for idx in range(len(cameras)):
        camera = cameras[idx].reshape(())
        if not _has_distortion(camera):
            continue
        w, h = int(camera.width), int(camera.height)
        radius = (camera.metadata or {}).get("fisheye_crop_radius")
        key = (int(camera.camera_type), *camera.get_intrinsics_matrices().reshape(-1).tolist(), w, h, radius,
               *camera.distortion_params.tolist())  # fmt: skip
        if key not in done:
            K = camera.get_intrinsics_matrices().numpy()
            blank = np.zeros((h, w), dtype=np.uint8)
            K, image, _ = _undistort_image(camera, camera.distortion_params.numpy(), {}, blank, K)
            done[key] = (float(K[0, 0]), float(K[1, 1]), float(K[0, 2]), float(K[1, 2]), image.shape[1], image.shape[0])
        fx, fy, cx, cy, width, height = done[key]
        cameras.fx[idx], cameras.fy[idx], cameras.cx[idx], cameras.cy[idx] = fx, fy, cx, cy
        cameras.width[idx], cameras.height[idx] = width, height


def nbytes(data: Dict) -> int:
    """Host memory the tensors of a decoded image hold (whole storages: a cropped view keeps its image)."""
    return sum(v.untyped_storage().nbytes() for v in data.values() if isinstance(v, torch.Tensor))


class ImageStream:
    """The images of one split, decoded by ``WORKERS`` background threads in the order ``get`` is told they
    will be asked for, at most ``PREFETCH`` images and ``budget`` bytes (estimated per image by
    ``estimate(idx)`` until decoded) held. An image leaves as soon as it is handed out, unless it is due
    again within the window. A decoding error is raised by ``get`` of that image."""

    def __init__(self, load: Callable[[int], Dict], estimate: Callable[[int], int], budget: int, name: str):
        self._load, self._estimate, self._budget, self._name = load, estimate, budget, name
        self._cache: Dict[int, object] = {}  # idx -> decoded dict, or the exception decoding raised
        self._bytes: Dict[int, int] = {}
        self._loading: Set[int] = set()
        self._plan: List[int] = []  # indices in the order they will be asked for
        self._cond = threading.Condition()
        self._threads: List[threading.Thread] = []
        self._closed = False

    def get(self, idx: int, upcoming: Sequence[int] = ()) -> Dict:
        """Image ``idx`` (waits for it); ``upcoming``: the indices training will ask for next, in order."""
        with self._cond:
            self._plan = [idx, *upcoming[: PREFETCH * 4]]
            self._start()
            self._cond.notify_all()
            while idx not in self._cache:
                if self._closed:
                    raise RuntimeError(f"the {self._name} image stream is closed")
                self._cond.wait()
            entry = self._cache[idx]
            self._plan = list(upcoming[: PREFETCH * 4])
            self._evict()
            self._cond.notify_all()
        if isinstance(entry, BaseException):
            raise entry
        return entry  # type: ignore[return-value]

    def held_bytes(self) -> int:
        with self._cond:
            return sum(self._bytes.values())

    def close(self) -> None:
        """Stops the decoding threads (after the image each is decoding) and drops the images."""
        with self._cond:
            self._closed = True
            self._cache.clear()
            self._bytes.clear()
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    # -- inside the lock
    def _window(self) -> List[int]:
        """The distinct indices at the head of the plan that fit PREFETCH and the budget (the first always)."""
        window: List[int] = []
        total = 0
        for idx in self._plan:
            if idx in window:
                continue
            size = self._bytes.get(idx) or self._estimate(idx)
            if window and (len(window) >= PREFETCH or total + size > self._budget):
                break
            window.append(idx)
            total += size
        return window

    def _evict(self) -> None:
        keep = set(self._window())
        for idx in [i for i in self._cache if i not in keep]:
            del self._cache[idx]
            self._bytes.pop(idx, None)

    def _start(self) -> None:
        if not self._threads:
            _LIVE.add(self)
            for k in range(WORKERS):
                name = f"splat-metal {self._name} images {k}"
                thread = threading.Thread(target=_work, args=(weakref.ref(self), self._cond), name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    def _next(self) -> Optional[int]:
        for idx in self._window():
            if idx not in self._cache and idx not in self._loading:
                return idx
        return None

    # -- the decoding threads
    def _decode_into(self, idx: int) -> None:
        try:
            data: object = self._load(idx)
        except BaseException as e:  # handed to the step that asks for this image
            data = e
        with self._cond:
            self._loading.discard(idx)
            if not self._closed and idx in self._window():
                self._cache[idx] = data
                self._bytes[idx] = nbytes(data) if isinstance(data, dict) else 0
            self._cond.notify_all()


def _work(ref: "weakref.ref[ImageStream]", cond: threading.Condition) -> None:
    """A decoding thread. It holds its stream only while decoding (it waits without it, a second at a
    time), so a stream no one uses is collected and its threads end."""
    while True:
        with cond:
            stream = ref()
            if stream is None or stream._closed:
                return
            idx = stream._next()
            if idx is None:
                del stream
                cond.wait(timeout=1.0)
                continue
            stream._loading.add(idx)
        stream._decode_into(idx)
        del stream


_LIVE: "weakref.WeakSet[ImageStream]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit, before the interpreter tears down: a thread left inside OpenCV or torch then aborts the
    process ("terminate called without an active exception")."""
    for stream in list(_LIVE):
        stream.close()
