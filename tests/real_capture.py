"""A cut of the real phone capture (../shared/data/snowmiku, outside the repository: docs/design.md section 5) in
nerfstudio's own data format, so that ``ns-train splat-metal --data <cut>`` reads it as it reads a
user's ``ns-process-data`` output. Used by tests/viewer/test_real_capture.py (a dozen small photos) and
benchmarks/bench_real_capture.py (all photos, possibly downscaled).

The cut keeps transforms.json as it is (camera model, distortion keys, ``ply_file_path``, each frame's
other keys) except: the frames kept, the image size and intrinsics scaled to the new width, and the
seed points (a random subset when asked). Held-out views are chosen by nerfstudio's own
``--eval-mode interval`` (every 8th frame of the cut), as users run it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


def _find_capture() -> Path:
    """$SPLAT_METAL_SNOWMIKU, else shared/data/snowmiku beside the checkout or beside a folder above it
    (a checkout at work/main and a worktree at work/wt/NAME both find work/shared)."""
    if os.environ.get("SPLAT_METAL_SNOWMIKU"):
        return Path(os.environ["SPLAT_METAL_SNOWMIKU"])
    for folder in REPO.parents:
        if (folder / "shared" / "data" / "snowmiku" / "transforms.json").is_file():
            return folder / "shared" / "data" / "snowmiku"
    return REPO.parent / "shared" / "data" / "snowmiku"


CAPTURE = _find_capture()
EVAL_INTERVAL = 8  # nerfstudio-data --eval-mode interval: frames 0, 8, 16, ... of the cut are held out


def read_ply(path: Path):
    """The seed points of an ascii or binary PLY with x, y, z, red, green, blue -> ([N, 3] float, [N, 3] uint8)."""
    from plyfile import PlyData

    vertex = PlyData.read(str(path))["vertex"]
    xyz = np.stack([np.asarray(vertex[k], dtype=np.float32) for k in ("x", "y", "z")], axis=1)  # [N, 3]
    rgb = np.stack([np.asarray(vertex[k], dtype=np.uint8) for k in ("red", "green", "blue")], axis=1)  # [N, 3]
    return xyz, rgb


def write_ply(path: Path, xyz: np.ndarray, rgb: np.ndarray) -> None:
    """[N, 3] float positions and [N, 3] uint8 colours as a binary PLY (what ns-process-data writes)."""
    from plyfile import PlyData, PlyElement

    vertex = np.empty(len(xyz), dtype=[("x", "f4"), ("y", "f4"), ("z", "f4"),
                                       ("red", "u1"), ("green", "u1"), ("blue", "u1")])  # fmt: skip
    for i, k in enumerate(("x", "y", "z")):
        vertex[k] = xyz[:, i]
    for i, k in enumerate(("red", "green", "blue")):
        vertex[k] = rgb[:, i]
    PlyData([PlyElement.describe(vertex, "vertex")]).write(str(path))


def make_cut(out: Path, frames: Optional[Sequence[int]] = None, width: Optional[int] = None,
             points: Optional[int] = None, source: Path = CAPTURE, seed: int = 0) -> Path:  # fmt: skip
    """Writes ``out``/transforms.json, images/ and sparse_pc.ply: the capture's frames ``frames``
    (indices into its frame list; all if None), resized to ``width`` px wide (height in proportion,
    rounded; intrinsics scaled per axis; full size if None), with ``points`` random seed points (all
    if None). Returns ``out``."""
    meta = json.loads((Path(source) / "transforms.json").read_text())
    src_w, src_h = int(meta["w"]), int(meta["h"])
    new_w = width or src_w
    new_h = round(src_h * new_w / src_w)
    sx, sy = new_w / src_w, new_h / src_h
    kept = [meta["frames"][i] for i in (range(len(meta["frames"])) if frames is None else frames)]
    (out / "images").mkdir(parents=True, exist_ok=True)
    for frame in kept:
        with Image.open(Path(source) / frame["file_path"]) as im:
            small = im.convert("RGB")
            if small.size != (new_w, new_h):
                small = small.resize((new_w, new_h), Image.LANCZOS)
            small.save(out / frame["file_path"], quality=95)
    meta.update(w=new_w, h=new_h, fl_x=meta["fl_x"] * sx, fl_y=meta["fl_y"] * sy, cx=meta["cx"] * sx,
                cy=meta["cy"] * sy, frames=kept)  # fmt: skip
    xyz, rgb = read_ply(Path(source) / meta["ply_file_path"])
    if points is not None and points < len(xyz):
        keep = np.sort(np.random.default_rng(seed).choice(len(xyz), points, replace=False))
        xyz, rgb = xyz[keep], rgb[keep]
    write_ply(out / meta["ply_file_path"], xyz, rgb)
    (out / "transforms.json").write_text(json.dumps(meta, indent=2))
    return out


def held_out(n_frames: int) -> list:
    """Indices (into the cut's frames) that ``--eval-mode interval`` holds out."""
    return [i for i in range(n_frames) if i % EVAL_INTERVAL == 0]
