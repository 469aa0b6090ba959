"""Scene generators shared by every test file (reference tests, Metal-kernel-vs-reference tests, ...).

Everything is seeded and built on CPU in the requested dtype; move it with ``Scene.to(device)``.
Cameras use the OpenCV convention gsplat uses (world -> camera viewmats, x right, y down, z forward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

# Image sizes every rendering test should cover: square, non-square both ways, partial tiles.
SIZES: Tuple[Tuple[int, int], ...] = ((16, 16), (37, 23), (64, 40), (23, 41))

GARDEN_PATH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "garden_points.npz"


def look_at(campos: Sequence[float], target: Sequence[float] = (0.0, 0.0, 0.0), up=(0.0, 0.0, 1.0)) -> Tensor:
    """World -> camera matrix [4,4] (float64) of a camera at ``campos`` looking at ``target``."""
    campos = torch.as_tensor(campos, dtype=torch.float64)
    forward = torch.as_tensor(target, dtype=torch.float64) - campos
    forward = forward / forward.norm()
    up = torch.as_tensor(up, dtype=torch.float64)
    right = torch.linalg.cross(forward, up)
    if right.norm() < 1e-6:  # looking along `up`: pick any perpendicular
        right = torch.linalg.cross(forward, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    right = right / right.norm()
    down = torch.linalg.cross(forward, right)
    R = torch.stack([right, down, forward])  # rows: camera axes in world coordinates
    viewmat = torch.eye(4, dtype=torch.float64)
    viewmat[:3, :3] = R
    viewmat[:3, 3] = -R @ campos
    return viewmat


def intrinsics(width: int, height: int, fov_x_deg: float = 60.0, aspect: float = 1.0, shift=(0.0, 0.0)) -> Tensor:
    """Pinhole K [3,3] (float64); ``aspect`` = fy/fx, ``shift`` moves the principal point (pixels)."""
    fx = 0.5 * width / math.tan(math.radians(fov_x_deg) / 2)
    K = torch.tensor([[fx, 0.0, width / 2 + shift[0]], [0.0, fx * aspect, height / 2 + shift[1]], [0.0, 0.0, 1.0]])
    return K.double()


@dataclass
class Scene:
    """Inputs of ``rasterization`` (activated values: opacities in (0,1), scales > 0)."""

    means: Tensor  # [N, 3]
    quats: Tensor  # [N, 4] wxyz, not normalised
    scales: Tensor  # [N, 3]
    opacities: Tensor  # [N]
    colors: Tensor  # [N, D] or [N, K, 3] SH coefficients (then sh_degree is set)
    viewmats: Tensor  # [C, 4, 4]
    Ks: Tensor  # [C, 3, 3]
    width: int
    height: int
    backgrounds: Optional[Tensor] = None  # [C, D] (D = 3 for SH colors)
    sh_degree: Optional[int] = None

    @property
    def N(self) -> int:
        return self.means.shape[0]

    @property
    def C(self) -> int:
        return self.viewmats.shape[0]

    def tensors(self) -> Dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}

    def to(self, device=None, dtype=None) -> "Scene":
        return replace(self, **{k: v.to(device=device, dtype=dtype) for k, v in self.tensors().items()})

    def kwargs(self, **overrides) -> Dict:
        """Keyword arguments for ``rasterization(**scene.kwargs(...))``."""
        kw = dict(
            means=self.means, quats=self.quats, scales=self.scales, opacities=self.opacities, colors=self.colors,
            viewmats=self.viewmats, Ks=self.Ks, width=self.width, height=self.height,
            backgrounds=self.backgrounds, sh_degree=self.sh_degree,
        )  # fmt: skip
        kw.update(overrides)
        return kw


def random_scene(
    n: int = 64,
    C: int = 1,
    width: int = 37,
    height: int = 23,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    channels: int = 3,
    sh_degree: Optional[int] = None,
    backgrounds: bool = False,
    opacity_range: Tuple[float, float] = (0.1, 0.9),
    scale_range: Tuple[float, float] = (0.03, 0.25),
    extent: float = 1.0,
    distance: float = 4.0,
    fov_x_deg: float = 60.0,
) -> Scene:
    """N gaussians in a cube of half-size ``extent`` around the origin, C cameras on a sphere of radius
    ``distance`` looking at the origin, each with its own intrinsics (focal, aspect and principal point
    differ per camera). With ``sh_degree`` colors are SH coefficients [N,(sh_degree+1)^2,3]."""
    g = torch.Generator().manual_seed(seed)

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=g, dtype=torch.float64)

    means = uniform((n, 3), -extent, extent)
    quats = torch.randn((n, 4), generator=g, dtype=torch.float64)
    quats = quats + 0.1 * torch.sign(quats[:, :1]) * (quats.norm(dim=-1, keepdim=True) < 1e-3)  # never all-zero
    # Log-uniform scales: some needles, some blobs.
    scales = torch.exp(uniform((n, 3), math.log(scale_range[0]), math.log(scale_range[1])))
    opacities = uniform((n,), *opacity_range)
    if sh_degree is None:
        colors = uniform((n, channels), 0.0, 1.0)
        D = channels
    else:
        colors = 0.3 * torch.randn((n, (sh_degree + 1) ** 2, 3), generator=g, dtype=torch.float64)
        D = 3
    viewmats, Ks = [], []
    for c in range(C):
        theta = uniform((), 0.0, 2 * math.pi).item()
        phi = uniform((), 0.3, 1.2).item()
        direction = [math.cos(theta) * math.sin(phi), math.sin(theta) * math.sin(phi), math.cos(phi)]
        campos = distance * torch.tensor(direction)
        target = uniform((3,), -0.2 * extent, 0.2 * extent)
        viewmats.append(look_at(campos, target))
        fov = fov_x_deg * uniform((), 0.85, 1.15).item()
        aspect = uniform((), 0.9, 1.1).item()
        shift = (uniform((), -0.1, 0.1).item() * width, uniform((), -0.1, 0.1).item() * height)
        Ks.append(intrinsics(width, height, fov, aspect, shift))
    bg = uniform((C, D), 0.0, 1.0) if backgrounds else None
    scene = Scene(
        means=means, quats=quats, scales=scales, opacities=opacities, colors=colors,
        viewmats=torch.stack(viewmats), Ks=torch.stack(Ks), width=width, height=height,
        backgrounds=bg, sh_degree=sh_degree,
    )  # fmt: skip
    return scene.to(dtype=dtype)


def knn_scales(points: np.ndarray, k: int = 3, min_scale: float = 1e-3, max_scale: float = 0.1) -> np.ndarray:
    """Isotropic scale per point: mean distance to its k nearest neighbours (as 3DGS initialises)."""
    from scipy.spatial import cKDTree

    dist, _ = cKDTree(points).query(points, k=k + 1)
    return np.clip(dist[:, 1:].mean(axis=1), min_scale, max_scale)


def load_garden(path: Optional[Path] = None) -> Optional[Dict]:
    """The real garden points and cameras (see docs/design.md section 5), or None when the file is absent."""
    path = Path(path) if path is not None else GARDEN_PATH
    if not path.exists():
        return None
    with np.load(path) as d:
        return {
            "means3d": d["means3d"].astype(np.float32),  # [N, 3]
            "colors": d["colors"],  # [N, 3] uint8
            "viewmats": d["viewmats"].astype(np.float32),  # [3, 4, 4]
            "Ks": d["Ks"].astype(np.float32),  # [3, 3, 3]
            "width": int(d["width"]),
            "height": int(d["height"]),
            "path": path,
        }


def garden_scene(
    garden: Dict,
    n: Optional[int] = 20_000,
    seed: int = 0,
    opacity: Optional[float] = None,
    scale: Optional[float] = None,
    dtype: torch.dtype = torch.float32,
) -> Scene:
    """Scene from the garden data: ``n`` points (subsampled without, or repeated with jitter beyond
    the data's size), colors from the points, made-up gaussian shapes. ``scale=None`` uses kNN
    distances; ``opacity=None`` draws opacities in [0.3, 0.95]."""
    rng = np.random.default_rng(seed)
    pts, cols = garden["means3d"], garden["colors"].astype(np.float32) / 255.0
    total = pts.shape[0]
    if n is None or n == total:
        idx = np.arange(total)
    elif n < total:
        idx = np.sort(rng.choice(total, n, replace=False))
    else:
        idx = np.concatenate([np.arange(total), rng.integers(0, total, n - total)])
    means = pts[idx].copy()
    if n is not None and n > total:  # repeated points get a small jitter so they are distinct gaussians
        means[total:] += rng.normal(scale=0.005, size=(n - total, 3)).astype(np.float32)
    if scale is None:
        s = knn_scales(means)[:, None] * np.exp(rng.normal(scale=0.2, size=(len(idx), 3)))
    else:
        s = np.full((len(idx), 3), scale)
    op = rng.uniform(0.3, 0.95, len(idx)) if opacity is None else np.full(len(idx), opacity)
    quats = rng.normal(size=(len(idx), 4))
    scene = Scene(
        means=torch.from_numpy(means), quats=torch.from_numpy(quats), scales=torch.from_numpy(s),
        opacities=torch.from_numpy(op), colors=torch.from_numpy(cols[idx]),
        viewmats=torch.from_numpy(garden["viewmats"]), Ks=torch.from_numpy(garden["Ks"]),
        width=garden["width"], height=garden["height"],
    )  # fmt: skip
    return scene.to(dtype=dtype)
