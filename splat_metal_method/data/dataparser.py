"""nerfstudio-data with its inputs checked before anything reads them.

nerfstudio's own parser meets a bad dataset with an assert or an exception from deep inside PIL,
numpy or a worker thread, after it has already written a new run directory. ``ns-train splat-metal``
checks first (``check_dataset``), in the two places that come before any use of the data:

  * ``SplatMetalTrainerConfig.save_config`` (config.py): ns-train calls it before it sets anything
    up, so a bad ``--data`` leaves no new run directory and overwrites no existing ``config.yml``;
  * ``SplatMetalDataParser`` (below), for every other way in (``ns-eval``, ``--load-config``, Python).

What is checked: the folder (or explicit ``.json``) exists; transforms.json exists, is JSON and lists
frames; every frame has a 4x4 finite transform, positive finite focal lengths ``fl_x``/``fl_y`` and a
positive ``w``/``h`` (per frame or shared); every image, mask and the seed-point PLY it names exists;
every image decodes completely (a truncated PNG/JPEG fails PIL's ``load()``, not ``open()``) and has
the size its camera says. Images of different sizes are fine when each frame carries its own
``w``/``h`` (nerfstudio supports that); against a shared ``w``/``h`` a different size is an error.

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

from nerfstudio.data.dataparsers.nerfstudio_dataparser import Nerfstudio, NerfstudioDataParserConfig
from PIL import Image

MAX_LISTED_PROBLEMS = 8
CAMERA_KEYS = ("fl_x", "fl_y", "cx", "cy", "w", "h")  # shared at the top of transforms.json or per frame
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


def check_dataset(data: Path, inference: bool = False, load_3D_points: bool = True) -> None:
    """Raises DatasetError naming every problem found (the first few) in the dataset at ``data``.

    ``inference=True`` checks transforms.json only: nerfstudio's inference setup (ns-export, ns-viewer)
    reads the cameras from it but opens no image, and the model comes from the checkpoint."""
    data = Path(data)
    transforms, data_dir, meta = _read_transforms(data)
    problems: List[str] = []
    to_decode: List[Tuple[Path, Tuple[int, int], str]] = []  # (image, (w, h) its camera says, frame label)

    seed_points = data_dir / str(meta.get("ply_file_path"))
    if not inference and load_3D_points and "ply_file_path" in meta and not seed_points.is_file():
        problems.append(f"seed points {seed_points} (ply_file_path) do not exist")

    def check_value(key: str, value, where: str) -> bool:
        x = _number(value)
        if key in ("fl_x", "fl_y") and (x is None or x <= 0):
            problems.append(f"{where}focal length {key} = {value!r} in {transforms}; it must be a number > 0")
            return False
        if key in ("w", "h") and (x is None or x <= 0 or x != int(x)):
            problems.append(f"{where}image size {key} = {value!r} in {transforms}; it must be a whole number > 0")
            return False
        if x is None:
            problems.append(f"{where}{key} = {value!r} in {transforms}; it must be a finite number")
            return False
        return True

    shared_ok = {key: check_value(key, meta[key], "") for key in CAMERA_KEYS if key in meta}  # shared by all frames
    for i, frame in enumerate(meta["frames"]):
        if not isinstance(frame, dict) or not isinstance(frame.get("file_path"), str):
            problems.append(f'frame {i} in {transforms} has no "file_path"')
            continue
        label = f"frame {i} ({frame['file_path']})"
        camera_ok = True
        for key in CAMERA_KEYS:
            if key in frame:
                camera_ok &= check_value(key, frame[key], f"{label}: ")
            elif key in meta:
                camera_ok &= shared_ok[key]
            else:
                problems.append(f"{label}: no {key} in {transforms} (neither shared nor in the frame)")
                camera_ok = False
        camera = {key: _number(frame.get(key, meta.get(key))) for key in CAMERA_KEYS} if camera_ok else None
        size = (int(camera["w"]), int(camera["h"])) if camera_ok else None
        matrix = frame.get("transform_matrix")
        rows = matrix if isinstance(matrix, list) else []
        if not (len(rows) == 4 and all(isinstance(r, list) and len(r) == 4 and all(_number(x) is not None for x in r)
                                       for r in rows)):  # fmt: skip
            problems.append(f"{label}: transform_matrix in {transforms} must be a 4x4 matrix of finite numbers")
        if not inference and "mask_path" in frame and not (data_dir / str(frame["mask_path"])).is_file():
            problems.append(f"{label}: mask {data_dir / str(frame['mask_path'])} does not exist")
        if not inference:
            image = data_dir / frame["file_path"]
            if not image.is_file():
                problems.append(f"{label}: image {image} does not exist")
            elif size is not None:
                to_decode.append((image, size, label))

    if to_decode:
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            results = list(pool.map(_decode, [image for image, _, _ in to_decode]))
        for (image, expected, label), result in zip(to_decode, results):
            if isinstance(result, str):
                problems.append(f"{label}: image {image} {result}")
            elif tuple(result) != expected:
                problems.append(
                    f"{label}: image {image} is {result[0]}x{result[1]} but its camera in {transforms} says "
                    f"w={expected[0]}, h={expected[1]} (all images must have the size their camera gives)"
                )

    if problems:
        shown = problems[:MAX_LISTED_PROBLEMS]
        more = len(problems) - len(shown)
        if len(problems) == 1:
            raise DatasetError(f"bad dataset {data}: {problems[0]}")
        lines = "\n".join(f"  - {p}" for p in shown) + (f"\n  ... and {more} more" if more else "")
        raise DatasetError(f"bad dataset {data}: {len(problems)} problems:\n{lines}")


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
            check_dataset(self.config.data, inference=inference, load_3D_points=self.config.load_3D_points)
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
