"""The standard scenes the step ledger and `splat-metal-bench` train on, as nerfstudio datasets.

- ``demo``: the bundled synthetic demo scene (demo_scene.py) at a given size.
- ``garden_points``: the real Mip-NeRF 360 garden points and cameras of garden_points.npz (docs/design.md
  section 5; 138,766 points, 3 cameras of 648x420), subsampled to ``n_points`` and made a dataset:
  gaussians with kNN scales and fixed opacity at the points, rendered by the reference backend from
  the 3 real cameras and 7 jittered copies of them (nerfstudio's split needs 10 views to hold one
  out), at 1/``downscale`` of the real resolution; the same points (with their colours) are the
  seed points. What it measures is the cost of a step on real geometry and real cameras, not quality.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch

GARDEN_ENV = "SPLAT_METAL_GARDEN_POINTS"
N_VIEWS = 10


def garden_points_path() -> Optional[Path]:
    """garden_points.npz: $SPLAT_METAL_GARDEN_POINTS, else ../shared/data/ beside a clone; None if absent."""
    candidates = [os.environ.get(GARDEN_ENV)] if os.environ.get(GARDEN_ENV) else []
    candidates.append(Path(__file__).resolve().parents[3] / "shared" / "data" / "garden_points.npz")  # beside the clone
    for c in candidates:
        if Path(c).is_file():
            return Path(c)
    return None


def demo(out: Path, width: int = 96, height: int = 64, views: int = N_VIEWS) -> Path:
    """The demo scene in ``out`` (made once; reused when it is there)."""
    from ..data import demo_scene

    out = Path(out)
    if not (out / demo_scene.TRANSFORMS).is_file():
        demo_scene.generate(out, width=width, height=height, views=views, seed=0)
    return out


def _knn_scale(points: np.ndarray, k: int = 3) -> np.ndarray:  # [N] mean distance to the k nearest
    from scipy.spatial import cKDTree

    dist, _ = cKDTree(points).query(points, k=k + 1)
    return np.clip(dist[:, 1:].mean(axis=1), 1e-3, 0.1)


def garden_points(out: Path, n_points: int = 20_000, downscale: int = 4, path: Optional[Path] = None,
                  seed: int = 0) -> Path:  # fmt: skip
    """The garden-points dataset in ``out`` (made once; reused when it is there). Raises
    FileNotFoundError when garden_points.npz is not found (set $SPLAT_METAL_GARDEN_POINTS)."""
    from PIL import Image

    from ..data import demo_scene

    out = Path(out)
    if (out / "transforms.json").is_file():
        return out
    path = path or garden_points_path()
    if path is None or not Path(path).is_file():
        raise FileNotFoundError(
            f"garden_points.npz not found; set ${GARDEN_ENV} to its path (docs/design.md section 5)"
        )
    rng = np.random.default_rng(seed)
    with np.load(path) as d:
        means, colors = d["means3d"].astype(np.float32), d["colors"]  # [P, 3], [P, 3] uint8
        viewmats, Ks = d["viewmats"].astype(np.float64), d["Ks"].astype(np.float64)  # [3, 4, 4], [3, 3, 3]
        width, height = int(d["width"]) // downscale, int(d["height"]) // downscale
    idx = np.sort(rng.choice(len(means), min(n_points, len(means)), replace=False))
    means, colors = means[idx], colors[idx]
    n = len(means)
    gaussians = {
        "means": torch.from_numpy(means),
        "quats": torch.tensor([1.0, 0.0, 0.0, 0.0]).repeat(n, 1),
        "scales": torch.from_numpy(np.repeat(_knn_scale(means)[:, None], 3, 1).astype(np.float32)),
        "opacities": torch.full((n,), 0.8),
        "colors": torch.from_numpy(colors.astype(np.float32) / 255.0),
    }
    # 10 views: the 3 real ones, then copies moved by up to 2% of the camera distance
    views = [viewmats[i % 3].copy() for i in range(N_VIEWS)]
    for v in views[3:]:
        v[:3, 3] += rng.normal(0.0, 0.02 * np.linalg.norm(v[:3, 3]), 3)
    Ks_views = np.stack([Ks[i % 3] for i in range(N_VIEWS)]) / np.array([downscale, downscale, 1.0])[:, None]
    viewmats_t = torch.from_numpy(np.stack(views))
    images = demo_scene.to_uint8(demo_scene.render(gaussians, viewmats_t, torch.from_numpy(Ks_views), width, height))
    (out / "images").mkdir(parents=True, exist_ok=True)
    flip = np.diag([1.0, -1.0, -1.0, 1.0])  # gsplat world->camera to nerfstudio (OpenGL) camera->world
    frames = []
    for i, (v, K, image) in enumerate(zip(views, Ks_views, images)):
        name = f"images/frame_{i:05d}.png"
        Image.fromarray(image, mode="RGB").save(out / name)
        frames.append(
            {
                "file_path": name,
                "transform_matrix": (np.linalg.inv(v) @ flip).tolist(),
                "fl_x": K[0, 0],
                "fl_y": K[1, 1],
                "cx": K[0, 2],
                "cy": K[1, 2],
                "w": width,
                "h": height,
            }
        )
    demo_scene.write_ply(out / "points.ply", means, colors)
    transforms = {"camera_model": "OPENCV", "k1": 0.0, "k2": 0.0, "p1": 0.0, "p2": 0.0,
                  "ply_file_path": "points.ply", "frames": frames}  # fmt: skip
    (out / "transforms.json").write_text(json.dumps(transforms, indent=1) + "\n")
    return out
