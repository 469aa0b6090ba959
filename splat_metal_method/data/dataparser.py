"""nerfstudio-data with its inputs checked before anything reads them.

nerfstudio's own parser meets a bad dataset with an assert or an exception from deep inside PIL,
numpy or a worker thread, after it has already written a new run directory. ``ns-train splat-metal``
checks first (``check_dataset``), in the two places that come before any use of the data:

  * ``SplatMetalTrainerConfig.save_config`` (config.py): ns-train calls it before it sets anything
    up, so a bad ``--data`` leaves no new run directory and overwrites no existing ``config.yml``;
  * ``SplatMetalDataParser`` (below), for every other way in (``ns-eval``, ``--load-config``, Python).

What is checked (docs/training.md lists it with the fix for each): the folder (or explicit ``.json``)
exists; transforms.json exists, is JSON and lists at least 2 frames, not all at one position; its
``camera_model`` is one nerfstudio knows and the rasterizer can use; every frame has a file_path, a 4x4
finite transform, positive finite focal lengths ``fl_x``/``fl_y``, finite ``cx``/``cy``/distortion and a
positive ``w``/``h`` (per frame or shared); every image exists, decodes completely (a truncated PNG/JPEG
fails PIL's ``load()``, not ``open()``) and has the size its camera says, in ``images_N/`` at 1/N of it
when nerfstudio downscales (``--downscale-factor N``, or chosen by itself for images over 1600 px);
masks are given for every frame or none, exist, have one channel and their image's size; the train/val
split nerfstudio will make has a training image; the seed-point PLY (``ply_file_path``, when
``load_3D_points``) exists and holds points, all finite, as many as its header lists. Images of
different sizes are fine when each frame carries its own ``w``/``h`` (nerfstudio supports that); against
a shared ``w``/``h`` a different size is an error.

A problem is raised as ``DatasetError``, a ``SystemExit`` whose message starts with "splat-metal: "
and names the path: nerfstudio's CLIs do not catch it, so Python prints just the message and exits
with status 1, with no traceback (the same mechanism argparse and tyro use for bad arguments).
Python callers can still ``except DatasetError``.

Images are decoded once per process (results are cached by path, size and mtime), in a few threads.
nerfstudio's "inference" setup (ns-export, ns-viewer) never opens images, and neither does this
parser then: a trained model can be exported after its images are gone.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Type

import numpy as np
import torch
from nerfstudio.cameras.cameras import CAMERA_MODEL_TO_TYPE, CameraType
from nerfstudio.data.dataparsers.nerfstudio_dataparser import (
    MAX_AUTO_RESOLUTION,
    Nerfstudio,
    NerfstudioDataParserConfig,
)
from nerfstudio.data.utils.dataparsers_utils import (
    get_train_eval_split_filename,
    get_train_eval_split_fraction,
    get_train_eval_split_interval,
)
from PIL import Image

MAX_LISTED_PROBLEMS = 8
CAMERA_KEYS = ("fl_x", "fl_y", "cx", "cy", "w", "h")  # shared at the top of transforms.json or per frame
DISTORTION_KEYS = ("k1", "k2", "k3", "k4", "p1", "p2")  # optional, shared or per frame
# What nerfstudio's datamanager turns into pinhole images (undistorting the others) for the rasterizer.
RASTERIZED_CAMERA_TYPES = (CameraType.PERSPECTIVE, CameraType.FISHEYE, CameraType.FISHEYE624)
ONE_CHANNEL_MODES = ("1", "L", "P", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")  # PIL modes np.array makes [H, W]
PLY_TYPE_SIZES = {"char": 1, "uchar": 1, "int8": 1, "uint8": 1, "short": 2, "ushort": 2, "int16": 2, "uint16": 2,
                  "int": 4, "uint": 4, "int32": 4, "uint32": 4, "float": 4, "float32": 4, "double": 8, "float64": 8}  # fmt: skip
POSE_TOLERANCE = 1e-3  # poses written as float32 by COLMAP/ns-process-data are orthonormal to ~1e-6
HINT_NO_DATASET = (
    "ns-train splat-metal --data needs a nerfstudio dataset: a folder with transforms.json and the images "
    "it lists. Make one from photos or a video with ns-process-data, or a demo scene with "
    "`python -m splat_metal_method.data.demo_scene --out DIR`."
)


class DatasetError(SystemExit):
    """A problem with the user's dataset. ``str(e)`` is the whole message, starting "splat-metal: ".

    A SystemExit so that ns-train/ns-eval print only the message and exit with status 1."""

    def __init__(self, message: str):
        super().__init__(f"splat-metal: {message}")


# (path, size in bytes, mtime in ns) -> (width, height) or the reason the image cannot be read.
_decode_cache: Dict[Tuple[str, int, int], object] = {}


def _decode(path: Path) -> object:
    """Fully decodes ``path``; returns (width, height) or an error string (never raises)."""
    try:
        st = path.stat()
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _decode_cache:
        try:
            with Image.open(path) as im:
                im.load()  # open() reads only the header; load() decodes all of it
                _decode_cache[key] = im.size
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            _decode_cache[key] = f"is not a readable image ({type(e).__name__}: {e})"
    return _decode_cache[key]


def _number(value) -> Optional[float]:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _read_transforms(data: Path) -> Tuple[Path, Path, dict]:
    """-> (transforms.json path, data_dir, parsed dict); raises DatasetError for problems that stop everything."""
    if not data.exists():
        raise DatasetError(f"dataset path {data} does not exist. {HINT_NO_DATASET}")
    if data.is_file():
        if data.suffix != ".json":
            raise DatasetError(
                f"{data} is a file; expected a dataset folder or its transforms .json. {HINT_NO_DATASET}"
            )
        transforms, data_dir = data, data.parent
    else:
        transforms, data_dir = data / "transforms.json", data
        if not transforms.is_file():
            if (data / "images").is_dir():
                raise DatasetError(
                    f"dataset folder {data} has images/ but no transforms.json: ns-process-data stopped before "
                    "writing it (its output above says why). Rerun it, e.g. `ns-process-data "
                    f"images --data PHOTOS --output-dir {data} --no-gpu --matching-method exhaustive`."
                )
            what = "is empty" if not any(data.iterdir()) else "has no transforms.json"
            raise DatasetError(f"dataset folder {data} {what}. {HINT_NO_DATASET}")
    try:
        meta = json.loads(transforms.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise DatasetError(f"{transforms} is not a text file ({e})") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{transforms} is not valid JSON: {e}") from None
    except OSError as e:
        raise DatasetError(f"cannot read {transforms}: {e.strerror or e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("frames"), list) or not meta["frames"]:
        raise DatasetError(f'{transforms} lists no frames (expected a non-empty "frames" list)')
    return transforms, data_dir, meta


def _seed_points_problem(path: Path) -> Optional[str]:
    """Why the seed-point PLY at ``path`` cannot seed a run (None if it can), read as nerfstudio reads it
    (open3d). open3d itself only warns on a bad file and hands back no points (nerfstudio then starts
    from 50,000 random gaussians without a word), or the points it read before a truncation."""
    try:
        data = path.read_bytes()
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    end = data.find(b"end_header")
    if not data.startswith(b"ply") or end < 0:
        return "is not a PLY file (it must start with a 'ply' ... 'end_header' header)"
    formats, elements = [], []  # elements: [name, count, row size in bytes or None (list properties)]
    for line in data[:end].decode("ascii", "replace").splitlines():
        words = line.split()
        if words[:1] == ["format"] and len(words) > 1:
            formats.append(words[1])
        elif words[:1] == ["element"] and len(words) == 3 and words[2].isdigit():
            elements.append([words[1], int(words[2]), 0])
        elif words[:1] == ["property"] and elements and elements[-1][2] is not None:
            size = PLY_TYPE_SIZES.get(words[1]) if len(words) == 3 else None  # "property list ..." varies
            elements[-1][2] = None if size is None else elements[-1][2] + size
    vertex = [i for i, e in enumerate(elements) if e[0] == "vertex"]
    if not vertex or elements[vertex[0]][1] == 0:
        return "holds no points (its header lists no vertices)"
    count = elements[vertex[0]][1]
    body = data[data.index(b"\n", end) + 1 :] if b"\n" in data[end:] else b""
    before = elements[: vertex[0] + 1]  # the elements stored up to the last point
    if formats[:1] == ["ascii"]:
        needed, held, unit = sum(e[1] for e in before), len(body.strip().splitlines()), "lines"
    else:
        sizes_known = all(e[2] is not None for e in before)
        needed, held, unit = (sum(e[1] * e[2] for e in before) if sizes_known else 0), len(body), "bytes"
    if held < needed:
        return f"is truncated: its header lists {count} points ({needed} {unit} of data), the file holds {held} {unit}"
    import open3d as o3d  # what nerfstudio reads it with (slow to import: only here)

    points = np.asarray(o3d.io.read_point_cloud(str(path)).points)  # [N, 3]
    if len(points) != count:
        return f"cannot be read: open3d read {len(points)} of the {count} points its header lists"
    bad = int((~np.isfinite(points).all(axis=1)).sum())
    if bad:
        return f"holds {bad} point(s) with NaN or infinite coordinates (of {count})"
    return None


def _auto_downscale_factor(data_dir: Path, first_file: str) -> int:
    """nerfstudio's choice when --downscale-factor is not given (Nerfstudio._get_fname): halve while the
    first frame's image is over 1600 px and images_<2 factor>/ holds it."""
    try:
        with Image.open(data_dir / first_file) as im:
            max_res = max(im.size)
    except (OSError, ValueError, SyntaxError):
        return 1  # reported with the image itself
    factor = 1
    while (
        max_res / factor > MAX_AUTO_RESOLUTION and (data_dir / f"images_{factor * 2}" / Path(first_file).name).exists()
    ):
        factor *= 2
    return factor


def _downscaled(size: Tuple[int, int], factor: int) -> Tuple[int, int]:
    """(w, h) after nerfstudio's Cameras.rescale_output_resolution(1 / factor) (float32, rounded down)."""
    scaled = (torch.tensor(size) * torch.tensor([1.0 / factor])).to(torch.int64)
    return int(scaled[0]), int(scaled[1])


def _split_problem(meta: dict, names: List[str], resolve, config: NerfstudioDataParserConfig) -> Optional[str]:
    """Why nerfstudio cannot make the train and val splits ns-train reads (a val split may be empty: then
    nothing is evaluated), with nerfstudio's own split functions; ``names`` are the frames' image files
    sorted as nerfstudio sorts them."""
    if any(f"{split}_filenames" in meta for split in ("train", "val", "test")):  # the dataset gives the split
        for split in ("train", "val"):
            listed = meta.get(f"{split}_filenames")
            if not isinstance(listed, list) or (split == "train" and not listed):
                return f'lists files per split but no "{split}_filenames"; add it, or remove the *_filenames lists'
            unknown = [x for x in listed if not isinstance(x, str) or str(resolve(x)) not in names]
            if unknown:
                return f'"{split}_filenames" names {unknown[0]!r}, which is no frame\'s file_path; list frames only'
        return None
    if config.eval_mode == "filename":
        if not all("train" in os.path.basename(n) or "eval" in os.path.basename(n) for n in names):
            return '(--eval-mode filename) needs "train" or "eval" in every image file name; name them so'
        i_train, _ = get_train_eval_split_filename(names)
    elif config.eval_mode == "fraction":
        i_train, _ = get_train_eval_split_fraction(names, config.train_split_fraction)
    elif config.eval_mode == "interval":
        i_train, _ = get_train_eval_split_interval(names, config.eval_interval)
    else:
        return None  # "all": every frame in both
    if len(i_train) == 0:
        return (
            f"has {len(names)} frames and --eval-mode {config.eval_mode} (train_split_fraction "
            f"{config.train_split_fraction}, eval_interval {config.eval_interval}) leaves no training image; "
            "change those options or add frames"
        )
    return None


@dataclass
class _Checks:
    """The checks of one dataset: each appends its problems (messages) to ``problems``, in the order
    check_dataset runs them, which is the order they are listed."""

    transforms: Path  # transforms.json
    data_dir: Path
    meta: dict  # transforms.json, parsed
    config: NerfstudioDataParserConfig
    problems: List[str] = field(default_factory=list)
    factor: int = 1  # nerfstudio reads images_<factor>/ (masks_<factor>/) when it downscales

    @property
    def camera_model(self):
        return self.meta.get("camera_model", "PINHOLE")

    def frame_count(self) -> None:
        if len(self.meta["frames"]) < 2:
            self.problems.append(
                f"{self.transforms} lists 1 frame; add more: nerfstudio scales the scene by the spread of the camera "
                "positions (one camera has none) and a scene needs views from several positions"
            )

    def camera_model_known(self) -> None:
        camera_model, transforms = self.camera_model, self.transforms
        if not isinstance(camera_model, str) or camera_model not in CAMERA_MODEL_TO_TYPE:
            self.problems.append(
                f"unknown camera_model {camera_model!r} in {transforms}; nerfstudio reads "
                f"{', '.join(CAMERA_MODEL_TO_TYPE)} (ns-process-data writes OPENCV or OPENCV_FISHEYE)"
            )
        elif CAMERA_MODEL_TO_TYPE[camera_model] not in RASTERIZED_CAMERA_TYPES:
            self.problems.append(
                f"camera_model {camera_model} in {transforms}: splat-metal renders pinhole views (nerfstudio "
                "undistorts OPENCV and fisheye images into them, not this model); for a 360° capture make "
                "perspective crops with `ns-process-data images --camera-type equirectangular --images-per-equirect 8`"
            )

    def value(self, key: str, value, where: str) -> bool:
        """One camera value (``where``: "" for the shared ones, "frame i (path): " for a frame's); True if usable."""
        x, transforms = _number(value), self.transforms
        if key in ("fl_x", "fl_y") and (x is None or x <= 0):
            self.problems.append(f"{where}focal length {key} = {value!r} in {transforms}; it must be a number > 0")
            return False
        if key in ("cx", "cy") and (x is None or x <= 0):
            self.problems.append(f"{where}principal point {key} = {value!r} in {transforms}; it must be a number > 0")
            return False
        if key in ("w", "h") and (x is None or x <= 0 or x != int(x)):
            self.problems.append(f"{where}image size {key} = {value!r} in {transforms}; it must be a whole number > 0")
            return False
        if x is None:
            self.problems.append(f"{where}{key} = {value!r} in {transforms}; it must be a finite number")
            return False
        return True

    def distortion(self, owner: dict, where: str) -> None:
        """The distortion values of ``owner`` (transforms.json's top level or a frame)."""
        camera_model, transforms = self.camera_model, self.transforms
        for key in DISTORTION_KEYS:
            if key in owner:
                self.value(key, owner[key], where)
        k4 = _number(owner.get("k4", 0))
        perspective = isinstance(camera_model, str) and CAMERA_MODEL_TO_TYPE.get(camera_model) == CameraType.PERSPECTIVE
        if k4 and perspective:
            self.problems.append(  # nerfstudio's undistortion asserts on it at the first step
                f"{where}k4 = {owner['k4']} in {transforms} with camera_model {camera_model}: nerfstudio undistorts k4 "
                "only for OPENCV_FISHEYE; set k4 to 0 (COLMAP's OPENCV has no k4) or camera_model to OPENCV_FISHEYE "
                "for a fisheye lens"
            )
        params = owner.get("distortion_params")
        if params is not None and not (
            isinstance(params, list) and len(params) == 6 and all(_number(x) is not None for x in params)
        ):
            self.problems.append(
                f"{where}distortion_params in {transforms} must be 6 finite numbers [k1, k2, k3, k4, p1, p2]"
            )

    def image_folder(self, named: List[dict]) -> bool:
        """Sets ``factor`` (the user's --downscale-factor or nerfstudio's choice); False if its folder is missing
        (then no image can be checked)."""
        self.factor = self.config.downscale_factor or _auto_downscale_factor(self.data_dir, named[0]["file_path"])
        folder = self.data_dir / f"images_{self.factor}"
        if self.factor > 1 and not folder.is_dir():
            self.problems.append(
                f"--downscale-factor {self.factor} reads images from {folder}, which does not exist; make it with "
                f"ns-process-data (--num-downscales 3 writes images_2/, images_4/, images_8/), or drop "
                f"--downscale-factor and pass --pipeline.datamanager.camera-res-scale-factor {1 / self.factor:g} "
                "(nerfstudio then resizes each image as it loads it)"
            )
            return False
        return True

    def resolve(self, file_path: str, prefix: str = "images_") -> Path:
        factor = self.factor
        return self.data_dir / f"{prefix}{factor}" / Path(file_path).name if factor > 1 else self.data_dir / file_path

    def downscale_fix(self) -> str:
        """The fix for a missing or wrongly sized image in images_<factor>/, chosen by the user or by nerfstudio
        for images over 1600 px."""
        return (
            f"; remake {self.data_dir / f'images_{self.factor}'} at 1/{self.factor} of the size transforms.json "
            "gives (ns-process-data --num-downscales), or "
            + (
                "drop --downscale-factor"
                if self.config.downscale_factor
                else "use the originals: `nerfstudio-data --downscale-factor 1`"
            )
        )

    def all_or_none(self) -> None:
        """Masks and depth images: for every frame or for none."""
        frames = self.meta["frames"]
        for key, name in (("mask_path", "mask"), ("depth_file_path", "depth image")):
            having = sum(isinstance(f, dict) and key in f for f in frames)
            if 0 < having < len(frames):
                self.problems.append(
                    f"{having} of the {len(frames)} frames in {self.transforms} have a {key}; nerfstudio needs a "
                    f"{name} for every frame or for none (remove {key} or add the missing ones)"
                )

    def frame_camera(self, frame: dict, label: str, shared_ok: Dict[str, bool]) -> Optional[Tuple[int, int]]:
        """The frame's camera values and distortion, and its pose; -> the (w, h) its camera gives, None if unusable."""
        camera_ok = True
        for key in CAMERA_KEYS:
            if key in frame:
                camera_ok &= self.value(key, frame[key], f"{label}: ")
            elif key in self.meta:
                camera_ok &= shared_ok[key]
            else:
                self.problems.append(
                    f"{label}: no {key} in {self.transforms} (neither shared nor in the frame); give every frame "
                    "fl_x, fl_y, cx, cy, w, h or put them at the top of the file"
                )
                camera_ok = False
        self.distortion(frame, f"{label}: ")
        camera = {key: _number(frame.get(key, self.meta.get(key))) for key in CAMERA_KEYS} if camera_ok else None
        pose = _pose_problem(frame)
        if pose:
            self.problems.append(f"{label}: transform_matrix in {self.transforms} {pose}")
        return (int(camera["w"]), int(camera["h"])) if camera_ok else None

    def frame_files(self, i: int, frame: dict, label: str, first_use: Dict[Path, int]) -> Optional[Path]:
        """The frame's image (listed once, a file) and mask; -> the image if it is there to decode."""
        image = self.resolve(frame["file_path"])
        if image in first_use:
            self.problems.append(
                f"{label}: image {image} is also frame {first_use[image]}'s; each image must be listed once "
                "(remove one of the two frames)"
            )
        first_use.setdefault(image, i)
        found = None
        if image.is_dir():
            self.problems.append(f"{label}: image {image} is a folder, not an image file; give the image's own path")
        elif not image.is_file():
            self.problems.append(
                f"{label}: image {image} does not exist" + (self.downscale_fix() if self.factor > 1 else "")
            )
        else:
            found = image
        if "mask_path" in frame:
            mask = self.resolve(str(frame["mask_path"]), "masks_")
            problem = _mask_problem(mask, image)
            if problem:
                self.problems.append(f"{label}: mask {mask} {problem}")
        return found

    def split(self, named: List[dict]) -> None:
        names = sorted(str(self.resolve(f["file_path"])) for f in named)
        split = _split_problem(self.meta, names, self.resolve, self.config) if len(self.meta["frames"]) >= 2 else None
        if split:
            self.problems.append(f"{self.transforms} {split}")

    def camera_spread(self, named: List[dict]) -> None:
        positions = [np.array(f["transform_matrix"], dtype=float)[:3, 3] for f in named if _is_pose(f)]
        if len(positions) >= 2 and self.config.auto_scale_poses and self.config.center_method == "poses":
            spread = np.abs(np.array(positions) - np.mean(positions, axis=0)).max()
            if not spread > 0:
                self.problems.append(
                    f"all {len(positions)} cameras in {self.transforms} are at the same position; nerfstudio scales "
                    "the scene by their spread (it would divide by zero): a capture needs camera movement, not "
                    "only turning"
                )

    def seed_points(self) -> None:
        seed_points = self.data_dir / str(self.meta.get("ply_file_path"))
        problem = "do not exist" if not seed_points.is_file() else _seed_points_problem(seed_points)
        if problem:
            self.problems.append(
                f"seed points {seed_points} (ply_file_path) {problem}; fix or re-export them (ns-process-data "
                "writes them from COLMAP's points), or start from random gaussians with "
                "`nerfstudio-data --load-3D-points False` at the end of the ns-train command"
            )

    def decoded(self, to_decode: List[Tuple[Path, Tuple[int, int], str]]) -> None:
        """Decodes the images (in a few threads) and compares their sizes with what their cameras say."""
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            results = list(pool.map(_decode, [image for image, _, _ in to_decode]))
        for (image, expected, label), result in zip(to_decode, results):
            if isinstance(result, str):
                self.problems.append(f"{label}: image {image} {result}")
            elif tuple(result) != expected:
                says = f"w={expected[0]}, h={expected[1]}"
                if self.factor > 1:
                    says += f" (transforms.json's size / {self.factor}){self.downscale_fix()}"
                else:
                    says += " (all images must have the size their camera gives)"
                if tuple(result) == expected[::-1]:
                    says += "; width and height are swapped: was the image rotated (EXIF orientation)?"
                self.problems.append(
                    f"{label}: image {image} is {result[0]}x{result[1]} but its camera in {self.transforms} says {says}"
                )


def check_dataset(
    data: Path,
    inference: bool = False,
    load_3D_points: bool = True,
    config: Optional[NerfstudioDataParserConfig] = None,
) -> None:
    """Raises DatasetError naming every problem found (the first few) in the dataset at ``data``.

    ``config``: the dataparser's options (downscale factor, split, pose scaling, load_3D_points; its
    load_3D_points replaces the argument); nerfstudio-data's defaults with ``load_3D_points`` if None.
    ``inference=True`` checks transforms.json only: nerfstudio's inference setup (ns-export, ns-viewer)
    reads the cameras from it but opens no image, and the model comes from the checkpoint."""
    data = Path(data)
    config = config if config is not None else NerfstudioDataParserConfig(load_3D_points=load_3D_points)
    transforms, data_dir, meta = _read_transforms(data)
    check = _Checks(transforms, data_dir, meta, config)
    check.frame_count()
    check.camera_model_known()
    shared_ok = {key: check.value(key, meta[key], "") for key in CAMERA_KEYS if key in meta}  # shared by all frames
    check.distortion(meta, "")
    named = [f for f in meta["frames"] if isinstance(f, dict) and isinstance(f.get("file_path"), str)]
    check_files = not inference and (not named or check.image_folder(named))
    check.all_or_none()

    first_use: Dict[Path, int] = {}  # image path -> index of the first frame that lists it
    to_decode: List[Tuple[Path, Tuple[int, int], str]] = []  # (image, (w, h) its camera says, frame label)
    for i, frame in enumerate(meta["frames"]):
        if not isinstance(frame, dict) or not isinstance(frame.get("file_path"), str):
            check.problems.append(f'frame {i} in {transforms} has no "file_path"; give every frame its image file')
            continue
        label = f"frame {i} ({frame['file_path']})"
        size = check.frame_camera(frame, label, shared_ok)
        image = check.frame_files(i, frame, label, first_use) if check_files else None
        if image is not None and size is not None:
            to_decode.append((image, _downscaled(size, check.factor) if check.factor > 1 else size, label))

    check.split(named)
    check.camera_spread(named)
    if not inference and config.load_3D_points and "ply_file_path" in meta:  # what nerfstudio then reads
        check.seed_points()
    if to_decode:
        check.decoded(to_decode)
    _raise_problems(data, check.problems)


def _raise_problems(data: Path, problems: List[str]) -> None:
    if problems:
        shown = problems[:MAX_LISTED_PROBLEMS]
        more = len(problems) - len(shown)
        if len(problems) == 1:
            raise DatasetError(f"bad dataset {data}: {problems[0]}")
        lines = "\n".join(f"  - {p}" for p in shown) + (f"\n  ... and {more} more" if more else "")
        raise DatasetError(f"bad dataset {data}: {len(problems)} problems:\n{lines}")


def _pose_problem(frame: dict) -> Optional[str]:
    """Why a frame's transform_matrix is not a camera-to-world pose (None if it is): a 4x4 matrix of finite
    numbers, last row 0 0 0 1, rotation orthonormal with determinant +1 (within float32 tolerance)."""
    if not _is_pose(frame):
        rows = frame.get("transform_matrix")
        if isinstance(rows, list) and len(rows) == 3 and all(isinstance(r, list) and len(r) == 4 for r in rows):
            # nerfstudio 1.1.5's own parser fails on these (a RuntimeError in auto_orient_and_center_poses).
            return "has 3 rows; give the 4x4 camera-to-world matrix (add the last row [0, 0, 0, 1])"
        return "must be a 4x4 matrix of finite numbers"
    pose = np.array(frame["transform_matrix"], dtype=float)  # [4, 4]
    if not np.allclose(pose[3], [0, 0, 0, 1], atol=POSE_TOLERANCE):
        return f"has last row {pose[3].tolist()}; a camera-to-world transform's last row is 0 0 0 1"
    rotation = pose[:3, :3]  # [3, 3]
    if not np.allclose(rotation.T @ rotation, np.eye(3), atol=POSE_TOLERANCE) or np.linalg.det(rotation) < 0:
        return (
            f"has a 3x3 part that is not a rotation (R^T R = I and det R = +1 within {POSE_TOLERANCE:g}; det R = "
            f"{np.linalg.det(rotation):.3g}); give each camera's camera-to-world pose, as ns-process-data writes it"
        )
    return None


def _is_pose(frame: dict) -> bool:
    rows = frame.get("transform_matrix")
    return (
        isinstance(rows, list)
        and len(rows) == 4
        and all(isinstance(r, list) and len(r) == 4 and all(_number(x) is not None for x in r) for r in rows)
    )


def _mask_problem(mask: Path, image: Path) -> Optional[str]:
    """Why nerfstudio cannot use ``mask`` for ``image`` (None if it can): it reads a one-channel image of the
    image's size (get_image_mask_tensor_from_path; 0 = ignore the pixel)."""
    if not mask.is_file():
        return "does not exist; add it or remove mask_path from the frame"
    try:
        with Image.open(mask) as m:
            mode, size = m.mode, m.size
    except (OSError, ValueError, SyntaxError) as e:
        return f"is not a readable image ({type(e).__name__}: {e})"
    try:
        with Image.open(image) as im:
            image_size = im.size
    except (OSError, ValueError, SyntaxError):
        image_size = size  # the image's own problem is reported with the image
    if mode not in ONE_CHANNEL_MODES:
        return f"has {len(mode)} channels ({mode}); nerfstudio reads a one-channel mask: save it as grayscale (L)"
    if size != image_size:
        return f"is {size[0]}x{size[1]} but its image {image} is {image_size[0]}x{image_size[1]}; masks must match"
    return None


@dataclass
class SplatMetalDataParserConfig(NerfstudioDataParserConfig):
    """nerfstudio-data, checked first: a bad dataset stops with one message naming the path."""

    _target: Type = field(default_factory=lambda: SplatMetalDataParser)


@dataclass
class SplatMetalDataParser(Nerfstudio):
    config: SplatMetalDataParserConfig

    def _generate_dataparser_outputs(self, split="train", **kwargs):
        if not getattr(self, "_checked", False):  # once per parser: train and eval splits share the data
            # nerfstudio's inference setup (ns-export, ns-viewer) sets downscale_factor = 1 on the parser
            # (not its config) so that no image is opened; then only transforms.json is checked.
            inference = self.downscale_factor == 1 and self.config.downscale_factor is None
            check_dataset(self.config.data, inference=inference, config=self.config)
            self._checked = True
        outputs = super()._generate_dataparser_outputs(split, **kwargs)
        if self.downscale_factor is not None and self.downscale_factor > 1:  # images come from images_<factor>/
            missing = [p for p in outputs.image_filenames if not Path(p).is_file()]
            if missing:
                raise DatasetError(
                    f"bad dataset {self.config.data}: {len(missing)} downscaled image(s) of the {split} split "
                    f"do not exist, e.g. {missing[0]}"
                )
        return outputs
