"""A small synthetic scene in nerfstudio's data format, made from a known set of gaussians.

    python -m splat_metal_method.data.demo_scene --out data/demo
    ns-train splat-metal --data data/demo

The ground truth is 4,209 3D gaussians (flat, surface-aligned), z up: a textured ground patch (checkerboard), a
segmented sphere shell, a rotated box and a tilted torus, each coloured so that there is
structure to learn. It is rendered with our own ``rasterization(..., backend="reference")``
(RGB colours, no SH) on a white background (composited into RGB, no alpha channel) from
``--views`` cameras (default 32) on an orbit of varying height and radius around the centre,
at a non-square size (default 96x64) with fx != fy and an off-centre principal point, so that
a swapped width/height, fx/fy or cx/cy anywhere downstream shows. Generation is deterministic
for a given ``--seed`` and takes a few seconds on a CPU.

Written to ``--out``:
  images/frame_00000.png ...  uint8 RGB
  transforms.json             nerfstudio format: camera_model "OPENCV", fl_x, fl_y, cx, cy, w, h,
                              k1..p2 = 0 (unless a lens is given), frames[{file_path, transform_matrix}] with camera-to-world
                              in nerfstudio/OpenGL convention (camera looks down -z, +y up), and
                              "ply_file_path": "sparse_pc.ply". The "splat_metal_demo" key records
                              how the scene was made (nerfstudio ignores it).
  sparse_pc.ply               seed points, SfM-like: a noisy subset of the gt means (1,500 points)
                              with slightly noisy colours; binary PLY, x,y,z float + red,green,blue uchar.

Lens distortion (``--camera-model`` OPENCV or OPENCV_FISHEYE with ``--k1 .. --k4 --p1 --p2``, and
``--per-frame-intrinsics``): the images are shot through the lens, not just labelled with it. Each
pixel of the distorted image is the mean of 3x3 sub-pixel rays; each ray is the lens model inverted at
that sub-pixel (OpenCV's undistortPoints, checked by distorting back), looked up in a pinhole render
wide enough to hold every ray at 3x the lens' central pixel density. So undistorting an image as
nerfstudio does (cv2.undistort / cv2.fisheye, the pixel centre at i + 0.5 shifted to OpenCV's i)
gives back the pinhole view of the scene; tests/data/test_distorted_scene.py checks that. The
coefficients are written as ns-process-data writes them (top level, or per frame with
``--per-frame-intrinsics``, where every frame gets its own focal length, principal point and
coefficients, within a few percent of the given ones).

Held-out views: nerfstudio-data's default split (eval_mode="fraction", train_split_fraction=0.9)
keeps ceil(0.9 * views) images for training and holds out the rest, evenly spaced: with 32 views
frames 10, 20 and 30 are the eval set (3 images; 30-39 views give 3, 40+ give 4 or more). Fewer
than 10 views would leave no eval image, which this script refuses.

Notes on loading it with nerfstudio's dataparser (NerfstudioDataParserConfig):
  * the seed points are read only with ``load_3D_points=True`` (its default is False; nerfstudio's
    splatfacto config turns it on), and reading them imports open3d, which needs the system
    library libusb-1.0 (Debian: libusb-1.0-0);
  * the dataparser re-orients (mean camera up -> +z), re-centres (mean camera position -> origin)
    and rescales (largest camera coordinate -> 1) the poses and applies the same to the seed
    points; ``dataparser_transform`` and ``dataparser_scale`` map this scene's world to its world.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

GENERATOR = "splat_metal_method.data.demo_scene"
MARKER_KEY = "splat_metal_demo"  # key in transforms.json that marks a directory as ours
FORMAT_VERSION = 1
DEFAULT_WIDTH, DEFAULT_HEIGHT, DEFAULT_VIEWS, DEFAULT_SEED = 96, 64, 32, 0
N_SEED_POINTS = 1500
BACKGROUND = (1.0, 1.0, 1.0)
LOOK_AT = (0.0, 0.0, 0.3)
IMAGE_DIR = "images"
TRANSFORMS = "transforms.json"
PLY_NAME = "sparse_pc.ply"
TRAIN_SPLIT_FRACTION = 0.9  # nerfstudio-data's default
# The lens models nerfstudio's datamanager undistorts, and the coefficients each one takes (as transforms.json
# names them). OPENCV's k4 is left out: nerfstudio 1.1.5's undistortion refuses it (OpenCV's k4 is a rational term).
LENS_COEFFICIENTS = {"OPENCV": ("k1", "k2", "k3", "p1", "p2"), "OPENCV_FISHEYE": ("k1", "k2", "k3", "k4")}
SUPERSAMPLE = 3  # sub-pixels per side when an image is shot through a lens
MAX_PINHOLE_PIXELS = 100  # the pinhole render behind a lens holds at most this many times the image's pixels


def frame_name(i: int) -> str:
    return f"{IMAGE_DIR}/frame_{i:05d}.png"


def eval_indices(n_views: int, train_split_fraction: float = TRAIN_SPLIT_FRACTION) -> np.ndarray:
    """The frames nerfstudio-data's default split holds out (same arithmetic as its
    get_train_eval_split_fraction, for frames sorted by name as ours are)."""
    n_train = math.ceil(n_views * train_split_fraction)
    i_train = np.linspace(0, n_views - 1, n_train, dtype=int)
    return np.setdiff1d(np.arange(n_views), i_train)


# ----------------------------------------------------------------------------- ground truth


def _rotmat_to_quat(R: np.ndarray) -> np.ndarray:  # [N,3,3] -> [N,4] wxyz, w >= 0
    m = R
    tr = m[:, 0, 0] + m[:, 1, 1] + m[:, 2, 2]
    cands = np.stack(
        [
            np.stack([1 + tr, m[:, 2, 1] - m[:, 1, 2], m[:, 0, 2] - m[:, 2, 0], m[:, 1, 0] - m[:, 0, 1]], -1),
            np.stack(
                [m[:, 2, 1] - m[:, 1, 2], 1 + 2 * m[:, 0, 0] - tr, m[:, 0, 1] + m[:, 1, 0], m[:, 0, 2] + m[:, 2, 0]], -1
            ),
            np.stack(
                [m[:, 0, 2] - m[:, 2, 0], m[:, 0, 1] + m[:, 1, 0], 1 + 2 * m[:, 1, 1] - tr, m[:, 1, 2] + m[:, 2, 1]], -1
            ),
            np.stack(
                [m[:, 1, 0] - m[:, 0, 1], m[:, 0, 2] + m[:, 2, 0], m[:, 1, 2] + m[:, 2, 1], 1 + 2 * m[:, 2, 2] - tr], -1
            ),
        ],
        1,
    )  # [N, 4 candidates, 4]; each is 4|q_k| * q for the k-th largest-component choice
    diag = np.stack([tr, m[:, 0, 0], m[:, 1, 1], m[:, 2, 2]], -1)
    best = np.argmax(diag, axis=1)
    q = cands[np.arange(len(R)), best]
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    return q * np.where(q[:, :1] < 0, -1.0, 1.0)


def _surfels(normals: np.ndarray, tangents: np.ndarray) -> np.ndarray:
    """Quaternions of frames whose local z is the normal (flat gaussians lie in the surface)."""
    n = normals / np.linalg.norm(normals, axis=1, keepdims=True)
    t = tangents - n * np.sum(tangents * n, axis=1, keepdims=True)
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    b = np.cross(n, t)
    return _rotmat_to_quat(np.stack([t, b, n], axis=-1))  # columns: local x, y, z


def _rot_z(angle: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def _rot_x(angle: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    return np.array([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])


def _ground(rng: np.random.Generator):
    n, half = 40, 1.2
    g = (np.arange(n) + 0.5) / n * 2 * half - half
    x, y = np.meshgrid(g, g, indexing="ij")
    xy = np.stack([x.ravel(), y.ravel()], 1) + rng.uniform(-0.01, 0.01, (n * n, 2))
    means = np.concatenate([xy, np.zeros((n * n, 1))], 1)
    checker = (np.floor(xy[:, 0] / 0.3) + np.floor(xy[:, 1] / 0.3)) % 2
    colors = np.where(checker[:, None] > 0, [0.62, 0.50, 0.36], [0.28, 0.36, 0.30])
    normals = np.tile([0.0, 0.0, 1.0], (n * n, 1))
    tangents = np.tile([1.0, 0.0, 0.0], (n * n, 1))
    scales = np.tile([0.038, 0.038, 0.004], (n * n, 1))
    return means, normals, tangents, scales, colors


def _sphere(rng: np.random.Generator):
    n, r, centre = 900, 0.33, np.array([-0.5, -0.4, 0.36])
    k = np.arange(n) + 0.5
    z = 1 - 2 * k / n
    phi = k * math.pi * (3 - math.sqrt(5))  # Fibonacci sphere
    normals = np.stack([np.sqrt(1 - z * z) * np.cos(phi), np.sqrt(1 - z * z) * np.sin(phi), z], 1)
    means = centre + r * normals
    lon = np.arctan2(normals[:, 1], normals[:, 0])
    segment = np.floor((lon + math.pi) / (2 * math.pi) * 6).astype(int) % 2  # beach-ball segments
    colors = np.where(segment[:, None] > 0, [0.85, 0.14, 0.10], [0.95, 0.78, 0.15])
    colors = np.where(np.abs(normals[:, 2:]) > 0.9, [0.15, 0.15, 0.55], colors)  # caps
    tangents = np.cross(normals, [0.0, 0.0, 1.0]) + [1e-3, 0.0, 0.0]
    scales = np.tile([0.027, 0.027, 0.004], (n, 1))
    return means, normals, tangents, scales, colors


def _box(rng: np.random.Generator):
    m, half, centre = 13, 0.24, np.array([0.5, -0.3, 0.24])
    R = _rot_z(math.radians(30))
    g = (np.arange(m) + 0.5) / m * 2 - 1
    u, v = (a.ravel() for a in np.meshgrid(g, g, indexing="ij"))
    face_colors = {  # +x, -x, +y, -y, +z (the bottom face is never seen)
        (0, 1): [0.15, 0.35, 0.85], (0, -1): [0.10, 0.55, 0.80], (1, 1): [0.45, 0.20, 0.75],
        (1, -1): [0.20, 0.25, 0.60], (2, 1): [0.60, 0.80, 0.95],
    }  # fmt: skip
    parts = []
    for (axis, sign), color in face_colors.items():
        local = np.zeros((m * m, 3))
        local[:, axis] = sign
        local[:, (axis + 1) % 3], local[:, (axis + 2) % 3] = u, v
        normal = np.zeros(3)
        normal[axis] = sign
        tangent = np.zeros(3)
        tangent[(axis + 1) % 3] = 1.0
        stripe = (np.floor((u + 1) * 2) % 2)[:, None]  # two-tone stripes on each face
        parts.append(
            (
                centre + (half * local) @ R.T,
                np.tile(R @ normal, (m * m, 1)),
                np.tile(R @ tangent, (m * m, 1)),
                np.tile([0.024, 0.024, 0.004], (m * m, 1)),
                np.asarray(color) * (0.8 + 0.2 * stripe),
            )
        )
    return tuple(np.concatenate(p) for p in zip(*parts))


def _torus(rng: np.random.Generator):
    nu, nv, big, small = 48, 18, 0.30, 0.10
    centre = np.array([0.15, 0.55, 0.45])
    R = _rot_z(math.radians(-20)) @ _rot_x(math.radians(60))  # axis tilted 60 degrees from vertical
    u = (np.arange(nu) + 0.5) / nu * 2 * math.pi
    v = (np.arange(nv) + 0.5) / nv * 2 * math.pi
    u, v = (a.ravel() for a in np.meshgrid(u, v, indexing="ij"))
    ring = np.stack([np.cos(u), np.sin(u), np.zeros_like(u)], 1)
    normals_l = np.cos(v)[:, None] * ring + np.sin(v)[:, None] * np.array([0.0, 0.0, 1.0])
    means = centre + (big * ring + small * normals_l) @ R.T
    tangents = np.stack([-np.sin(u), np.cos(u), np.zeros_like(u)], 1) @ R.T
    hue = 0.5 + 0.5 * np.cos(3 * u)[:, None]  # green <-> teal along the ring
    colors = hue * np.array([0.20, 0.70, 0.25]) + (1 - hue) * np.array([0.05, 0.55, 0.60])
    scales = np.tile([0.022, 0.022, 0.004], (nu * nv, 1))
    return means, normals_l @ R.T, tangents, scales, colors


def make_gaussians(seed: int = DEFAULT_SEED) -> dict[str, torch.Tensor]:
    """The ground-truth gaussians (world frame of transforms.json, z up), float32 CPU tensors:
    means [N,3], quats [N,4] wxyz, scales [N,3], opacities [N], colors [N,3] RGB in [0,1]."""
    rng = np.random.default_rng(seed)
    parts = [make(rng) for make in (_ground, _sphere, _box, _torus)]
    means, normals, tangents, scales, colors = (np.concatenate(p) for p in zip(*parts))
    n = len(means)
    colors = np.clip(colors + rng.normal(0.0, 0.03, (n, 3)), 0.0, 1.0)
    scales = scales * rng.uniform(0.9, 1.1, (n, 1))
    opacities = rng.uniform(0.85, 0.98, n)

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))

    return {
        "means": t(means),
        "quats": t(_surfels(normals, tangents)),
        "scales": t(scales),
        "opacities": t(opacities),
        "colors": t(colors),
    }


# ----------------------------------------------------------------------------- cameras


def make_cameras(n_views: int, width: int, height: int, seed: int = DEFAULT_SEED) -> tuple[np.ndarray, dict]:
    """Camera-to-world matrices [V,4,4] float64 (nerfstudio/OpenGL: looks down -z, +y up), rounded
    to what transforms.json stores, and the shared intrinsics (fl_x, fl_y, cx, cy, w, h)."""
    rng = np.random.default_rng([seed, 1])
    i = np.arange(n_views)
    azimuth = 2 * math.pi * i / n_views + rng.uniform(-0.05, 0.05, n_views)
    elevation = np.radians(28 + 14 * np.sin(3 * azimuth + 0.4))  # the orbit rises and falls 3 times
    radius = 3.6 + 0.3 * np.cos(2 * azimuth) + rng.uniform(-0.1, 0.1, n_views)
    target = np.asarray(LOOK_AT)
    eye = target + radius[:, None] * np.stack(
        [np.cos(elevation) * np.cos(azimuth), np.cos(elevation) * np.sin(azimuth), np.sin(elevation)], 1
    )
    forward = target - eye
    forward /= np.linalg.norm(forward, axis=1, keepdims=True)
    right = np.cross(forward, [0.0, 0.0, 1.0])
    right /= np.linalg.norm(right, axis=1, keepdims=True)
    up = np.cross(right, forward)
    c2w = np.tile(np.eye(4), (n_views, 1, 1))
    c2w[:, :3, 0], c2w[:, :3, 1], c2w[:, :3, 2], c2w[:, :3, 3] = right, up, -forward, eye
    c2w = np.round(c2w, 8)
    # ~52 degrees horizontal field of view; fx != fy and an off-centre principal point on purpose.
    fl_x = round(0.5 * width / math.tan(math.radians(26)), 4)
    intrinsics = {
        "fl_x": fl_x,
        "fl_y": round(fl_x * 1.01, 4),
        "cx": 0.5 * width + 1.0,
        "cy": 0.5 * height - 0.5,
        "w": int(width),
        "h": int(height),
    }
    return c2w, intrinsics


def viewmats_from_c2w(c2w: torch.Tensor) -> torch.Tensor:
    """nerfstudio camera-to-world [C,3|4,4] -> gsplat world-to-camera [C,4,4], as splatfacto's
    get_viewmat does (flip camera y and z, then invert)."""
    c2w = c2w.to(torch.float64)
    full = torch.eye(4, dtype=torch.float64).repeat(c2w.shape[0], 1, 1)
    full[:, :3, :] = c2w[:, :3, :]
    flip = torch.diag(torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64))
    return torch.linalg.inv(full @ flip)


def intrinsics_matrix(intrinsics: dict) -> torch.Tensor:  # [3, 3]
    return torch.tensor(
        [[intrinsics["fl_x"], 0.0, intrinsics["cx"]], [0.0, intrinsics["fl_y"], intrinsics["cy"]], [0.0, 0.0, 1.0]]
    )


@torch.no_grad()
def render(
    gaussians: dict[str, torch.Tensor],
    viewmats: torch.Tensor,  # [C, 4, 4] world -> camera (gsplat convention)
    Ks: torch.Tensor,  # [C, 3, 3]
    width: int,
    height: int,
    background=BACKGROUND,
    batch: int = 8,
) -> torch.Tensor:
    """Renders with the reference backend on the CPU; returns float images [C,H,W,3] in [0,1]."""
    from ..ops import rasterization

    out = []
    for s in range(0, viewmats.shape[0], batch):
        v = viewmats[s : s + batch].float()
        colors, _, _ = rasterization(
            gaussians["means"], gaussians["quats"], gaussians["scales"], gaussians["opacities"],
            gaussians["colors"], v, Ks[s : s + batch].float(), width, height,
            backgrounds=torch.tensor(background, dtype=torch.float32).expand(v.shape[0], 3),
            backend="reference",
        )  # fmt: skip
        out.append(colors.clamp(0.0, 1.0))
    return torch.cat(out)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    return (images * 255.0).round().to(torch.uint8).numpy()


# ----------------------------------------------------------------------------- lens


def opencv_coefficients(camera_model: str, lens: dict) -> np.ndarray:
    """The coefficients in OpenCV's order: (k1, k2, p1, p2, k3) for cv2's OPENCV model, (k1..k4) for
    cv2.fisheye; absent ones are 0."""
    order = ("k1", "k2", "p1", "p2", "k3") if camera_model == "OPENCV" else ("k1", "k2", "k3", "k4")
    return np.array([float(lens.get(k, 0.0)) for k in order])


def _undistort_opencv(distorted: np.ndarray, D: np.ndarray, iterations: int = 200) -> np.ndarray:
    """OpenCV's fixed-point inversion of its k1 k2 p1 p2 k3 model (undistortPointsIter's loop), for OpenCV
    builds without undistortPointsIter. distorted [M, 1, 2] normalised -> [M, 1, 2]; lens_rays checks the result."""
    k1, k2, p1, p2, k3 = D
    x0, y0 = distorted[..., 0], distorted[..., 1]
    x, y = x0.copy(), y0.copy()
    for _ in range(iterations):
        r2 = x * x + y * y
        inverse_radial = 1.0 / (1.0 + ((k3 * r2 + k2) * r2 + k1) * r2)
        x, y = (
            (x0 - (2 * p1 * x * y + p2 * (r2 + 2 * x * x))) * inverse_radial,
            (y0 - (p1 * (r2 + 2 * y * y) + 2 * p2 * x * y)) * inverse_radial,
        )
    return np.stack([x, y], -1)


def lens_rays(camera_model: str, lens: dict, pixels: np.ndarray, fx: float, fy: float, cx: float, cy: float):
    """The pinhole direction (x/z, y/z) [..., 2] each point of ``pixels`` [..., 2] sees through the lens.

    Pixels in nerfstudio's convention (pixel i spans [i, i + 1], its centre at i + 0.5, and cx, cy in the
    same units), the convention gsplat renders in. The lens model is OpenCV's (nerfstudio undistorts with
    it), inverted iteratively and checked by distorting the result back."""
    import cv2

    D = opencv_coefficients(camera_model, lens)
    distorted = ((pixels - [cx, cy]) / [fx, fy]).reshape(-1, 1, 2)  # normalised image coordinates
    criteria = (cv2.TERM_CRITERIA_COUNT | cv2.TERM_CRITERIA_EPS, 200, 1e-12)
    if camera_model == "OPENCV":
        iterate = getattr(cv2, "undistortPointsIter", None)  # some OpenCV builds lack it (seen: the CUDA image's)
        rays = iterate(distorted, np.eye(3), D, None, None, criteria) if iterate else _undistort_opencv(distorted, D)
        back = cv2.projectPoints(
            np.concatenate([rays, np.ones_like(rays[..., :1])], -1), np.zeros(3), np.zeros(3), np.eye(3), D
        )[0]
    else:
        rays = cv2.fisheye.undistortPoints(distorted, np.eye(3), D, criteria=criteria)
        back = cv2.fisheye.distortPoints(rays, np.eye(3), D)
    error = float(np.abs(back - distorted).max())
    if not error < 1e-6:
        raise ValueError(
            f"[demo_scene] the {camera_model} lens {dict(lens)} cannot be inverted over the image (off by {error:.2g}): "
            "coefficients this strong fold the image over; use smaller ones"
        )
    return rays.reshape(pixels.shape)


def subpixel_rays(camera_model: str, intrinsics: dict, lens: dict, s: int = SUPERSAMPLE) -> np.ndarray:
    """lens_rays of the s x s sub-pixel centres of every pixel of a ``intrinsics["w"] x intrinsics["h"]``
    image: [H*s, W*s, 2]."""
    W, H = intrinsics["w"], intrinsics["h"]
    u, v = np.meshgrid((np.arange(W * s) + 0.5) / s, (np.arange(H * s) + 0.5) / s)
    fx, fy, cx, cy = (float(intrinsics[k]) for k in ("fl_x", "fl_y", "cx", "cy"))
    return lens_rays(camera_model, lens, np.stack([u, v], -1), fx, fy, cx, cy)


def through_lens(pinhole: np.ndarray, K: np.ndarray, rays: np.ndarray, s: int = SUPERSAMPLE) -> np.ndarray:
    """The image [H, W, C] a lens sees, from a pinhole image [h, w, C] (float) with intrinsics K [3, 3] (pixel
    centres at i + 0.5) that holds every ray of ``rays`` [H*s, W*s, 2] (subpixel_rays): each ray looked up
    bilinearly, each pixel the mean of its s x s rays."""
    import cv2

    map_x = (rays[..., 0] * K[0, 0] + K[0, 2] - 0.5).astype(np.float32)  # cv2.remap: pixel centres at integers
    map_y = (rays[..., 1] * K[1, 1] + K[1, 2] - 0.5).astype(np.float32)
    image = cv2.remap(pinhole, map_x, map_y, interpolation=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    H, W = rays.shape[0] // s, rays.shape[1] // s
    return image.reshape(H, s, W, s, -1).mean(axis=(1, 3))


def shoot_through_lens(gaussians, viewmats: torch.Tensor, camera_model: str, cameras: list) -> torch.Tensor:
    """The images [V, H, W, 3] in [0, 1] cameras with these lenses see (``cameras``: one (intrinsics, lens)
    per view of ``viewmats`` [V, 4, 4]): through_lens of a pinhole render of each view at SUPERSAMPLE times
    the lens' central pixel density, just holding every ray (1 px margin); all views rendered in batches on
    one canvas, each with its own pinhole intrinsics."""
    s = SUPERSAMPLE
    W, H = cameras[0][0]["w"], cameras[0][0]["h"]
    views = []  # per view: rays [H*s, W*s, 2] and its pinhole K [3, 3]
    for intrinsics, lens in cameras:
        rays = subpixel_rays(camera_model, intrinsics, lens)
        fx, fy, lo = s * float(intrinsics["fl_x"]), s * float(intrinsics["fl_y"]), rays.reshape(-1, 2).min(0)
        views.append((rays, np.array([[fx, 0.0, 1.0 - lo[0] * fx], [0.0, fy, 1.0 - lo[1] * fy], [0.0, 0.0, 1.0]])))
    pw = max(math.ceil(rays[..., 0].max() * K[0, 0] + K[0, 2]) + 1 for rays, K in views)
    ph = max(math.ceil(rays[..., 1].max() * K[1, 1] + K[1, 2]) + 1 for rays, K in views)
    if pw * ph > MAX_PINHOLE_PIXELS * W * H:
        raise ValueError(
            f"[demo_scene] the {camera_model} lens {dict(cameras[0][1])} sees too wide a field for a pinhole render "
            f"({pw}x{ph} for a {W}x{H} image); use smaller coefficients"
        )
    Ks = torch.from_numpy(np.stack([K for _, K in views])).float()  # [V, 3, 3]
    pinholes = render(gaussians, viewmats, Ks, pw, ph).numpy()  # [V, ph, pw, 3]
    return torch.stack([torch.from_numpy(through_lens(p, K, rays)) for p, (rays, K) in zip(pinholes, views)])


def frame_intrinsics(intrinsics: dict, lens: dict, n_views: int, seed: int) -> list[tuple[dict, dict]]:
    """Per-frame intrinsics and coefficients for --per-frame-intrinsics: focal lengths within 3 %, the
    principal point within 1.5 px and each coefficient within 15 % of the given ones, per frame."""
    rng = np.random.default_rng([seed, 3])
    frames = []
    for _ in range(n_views):
        f = rng.uniform(0.97, 1.03)
        own = dict(intrinsics, fl_x=round(intrinsics["fl_x"] * f, 4), fl_y=round(intrinsics["fl_y"] * f, 4))
        own["cx"] = round(intrinsics["cx"] + rng.uniform(-1.5, 1.5), 4)
        own["cy"] = round(intrinsics["cy"] + rng.uniform(-1.5, 1.5), 4)
        frames.append((own, {k: round(c * rng.uniform(0.85, 1.15), 6) for k, c in lens.items()}))
    return frames


# ----------------------------------------------------------------------------- files


def write_ply(path: Path, xyz: np.ndarray, rgb: np.ndarray) -> None:
    """Binary little-endian PLY: x, y, z float32 and red, green, blue uchar (what open3d reads)."""
    vertex = np.empty(
        len(xyz), dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("red", "u1"), ("green", "u1"), ("blue", "u1")]
    )
    vertex["x"], vertex["y"], vertex["z"] = xyz[:, 0], xyz[:, 1], xyz[:, 2]
    vertex["red"], vertex["green"], vertex["blue"] = rgb[:, 0], rgb[:, 1], rgb[:, 2]
    header = (
        "ply\nformat binary_little_endian 1.0\ncomment splat-metal demo scene seed points\n"
        f"element vertex {len(xyz)}\n"
        "property float x\nproperty float y\nproperty float z\n"
        "property uchar red\nproperty uchar green\nproperty uchar blue\nend_header\n"
    )
    path.write_bytes(header.encode("ascii") + vertex.tobytes())


def read_ply(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Reads back what write_ply wrote: xyz [N,3] float32, rgb [N,3] uint8."""
    data = path.read_bytes()
    end = data.index(b"end_header\n") + len(b"end_header\n")
    n = int(
        next(line for line in data[:end].decode("ascii").splitlines() if line.startswith("element vertex")).split()[2]
    )
    dtype = [("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("red", "u1"), ("green", "u1"), ("blue", "u1")]
    v = np.frombuffer(data, dtype=dtype, count=n, offset=end)
    return np.stack([v["x"], v["y"], v["z"]], 1), np.stack([v["red"], v["green"], v["blue"]], 1)


def seed_points(gaussians: dict[str, torch.Tensor], seed: int, n: int = N_SEED_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """SfM-like seed: a random subset of the gt means with position noise and noisy colours."""
    rng = np.random.default_rng([seed, 2])
    means = gaussians["means"].numpy().astype(np.float64)
    idx = np.sort(rng.choice(len(means), size=min(n, len(means)), replace=False))
    xyz = means[idx] + rng.normal(0.0, 0.015, (len(idx), 3))
    rgb = gaussians["colors"].numpy()[idx] * 255.0 + rng.normal(0.0, 6.0, (len(idx), 3))
    return xyz.astype(np.float32), np.clip(np.round(rgb), 0, 255).astype(np.uint8)


def _is_demo_dir(out: Path) -> bool:
    try:
        meta = json.loads((out / TRANSFORMS).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and isinstance(meta.get(MARKER_KEY), dict)


def _prepare_dir(out: Path) -> None:
    """Creates ``out``, or clears what a previous run wrote there; refuses anything else."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"[demo_scene] {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not _is_demo_dir(out):
            raise FileExistsError(
                f"[demo_scene] refusing to write into {out}: it is not empty and does not look like a demo "
                f"scene made by this script (no {TRANSFORMS} with a '{MARKER_KEY}' entry). "
                "Pass an empty or new directory with --out."
            )
        # Remove only what a previous run wrote, so a run with fewer views leaves no stale frames.
        for old in sorted((out / IMAGE_DIR).glob("frame_*.png")):
            old.unlink()
        for name in (TRANSFORMS, PLY_NAME):
            (out / name).unlink(missing_ok=True)
    (out / IMAGE_DIR).mkdir(parents=True, exist_ok=True)


@dataclass
class SceneStats:
    out: Path
    n_gaussians: int
    n_views: int
    width: int
    height: int
    n_seed_points: int
    eval_frames: tuple[int, ...]
    seconds: float

    def __str__(self) -> str:
        return (
            f"demo scene in {self.out}: {self.n_gaussians} gt gaussians, {self.n_views} views of "
            f"{self.width}x{self.height} (held out by nerfstudio's default split: frames "
            f"{list(self.eval_frames)}), {self.n_seed_points} seed points, {self.seconds:.1f} s"
        )


def generate(
    out,
    width: int = DEFAULT_WIDTH,
    height: int = DEFAULT_HEIGHT,
    views: int = DEFAULT_VIEWS,
    seed: int = DEFAULT_SEED,
    camera_model: str = "OPENCV",
    lens: dict | None = None,
    per_frame_intrinsics: bool = False,
) -> SceneStats:
    """Writes the demo scene to ``out`` (see the module docstring) and returns its stats. ``lens``: the
    coefficients of ``camera_model`` (LENS_COEFFICIENTS names them; absent ones are 0); the images
    are then shot through that lens. ``per_frame_intrinsics``: every frame its own intrinsics and
    coefficients (frame_intrinsics), written per frame."""
    start = time.perf_counter()
    out = Path(out)
    if width < 16 or height < 16:
        raise ValueError(f"[demo_scene] width and height must be >= 16, got {width}x{height}")
    if camera_model not in LENS_COEFFICIENTS:
        raise ValueError(f"[demo_scene] camera model {camera_model!r} is not one of {', '.join(LENS_COEFFICIENTS)}")
    lens = {k: float(v) for k, v in (lens or {}).items()}
    unknown = sorted(set(lens) - set(LENS_COEFFICIENTS[camera_model]))
    if unknown:
        raise ValueError(
            f"[demo_scene] {camera_model} takes the coefficients {', '.join(LENS_COEFFICIENTS[camera_model])}, "
            f"not {', '.join(unknown)}"
        )
    held_out = eval_indices(views)
    if len(held_out) == 0:
        raise ValueError(
            f"[demo_scene] {views} views leave no held-out image under nerfstudio's default split "
            "(train_split_fraction 0.9); use at least 10 (30+ for 3 held-out views)"
        )
    _prepare_dir(out)

    gaussians = make_gaussians(seed)
    c2w, intrinsics = make_cameras(views, width, height, seed)
    viewmats = viewmats_from_c2w(torch.from_numpy(c2w))
    cameras = frame_intrinsics(intrinsics, lens, views, seed) if per_frame_intrinsics else [(intrinsics, lens)] * views
    if camera_model == "OPENCV" and not any(lens.values()) and not per_frame_intrinsics:  # a pinhole camera
        images = to_uint8(render(gaussians, viewmats, intrinsics_matrix(intrinsics).expand(views, 3, 3), width, height))
    else:
        images = to_uint8(shoot_through_lens(gaussians, viewmats, camera_model, cameras))
    for i, image in enumerate(images):
        Image.fromarray(image, mode="RGB").save(out / frame_name(i), format="PNG", optimize=False)

    xyz, rgb = seed_points(gaussians, seed)
    write_ply(out / PLY_NAME, xyz, rgb)

    def coefficients(lens: dict) -> dict:  # as ns-process-data writes them
        names = ("k1", "k2", "p1", "p2") + (("k3",) if "k3" in lens else ())
        return {k: lens.get(k, 0.0) for k in (names if camera_model == "OPENCV" else LENS_COEFFICIENTS[camera_model])}

    shared = {} if per_frame_intrinsics else {**intrinsics, **coefficients(lens)}
    per_frame = [{**own, **coefficients(own_lens)} if per_frame_intrinsics else {} for own, own_lens in cameras]
    transforms = {
        "camera_model": camera_model,
        **shared,
        "ply_file_path": PLY_NAME,
        MARKER_KEY: {
            "generator": GENERATOR,
            "version": FORMAT_VERSION,
            "seed": seed,
            "n_gaussians": int(gaussians["means"].shape[0]),
            "background": list(BACKGROUND),
            "world_up": [0.0, 0.0, 1.0],
            **({"lens": lens, "per_frame_intrinsics": per_frame_intrinsics} if lens or camera_model != "OPENCV"
               or per_frame_intrinsics else {}),
        },
        "frames": [
            {"file_path": frame_name(i), "transform_matrix": c2w[i].tolist(), **per_frame[i]} for i in range(views)
        ],
    }  # fmt: skip
    (out / TRANSFORMS).write_text(json.dumps(transforms, indent=2) + "\n")
    return SceneStats(
        out=out,
        n_gaussians=int(gaussians["means"].shape[0]),
        n_views=views,
        width=width,
        height=height,
        n_seed_points=len(xyz),
        eval_frames=tuple(int(i) for i in held_out),
        seconds=time.perf_counter() - start,
    )


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splat_metal_method.data.demo_scene",
        description="Write a small synthetic nerfstudio scene (images, transforms.json, seed points) "
        "rendered from known gaussians. Then: ns-train splat-metal --data OUT",
    )
    parser.add_argument("--out", type=Path, default=Path("data/demo"), help="output directory (default: data/demo)")
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH, help=f"image width (default {DEFAULT_WIDTH})")
    parser.add_argument("--height", type=int, default=DEFAULT_HEIGHT, help=f"image height (default {DEFAULT_HEIGHT})")
    parser.add_argument("--views", type=int, default=DEFAULT_VIEWS, help=f"number of cameras (default {DEFAULT_VIEWS})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"random seed (default {DEFAULT_SEED})")
    parser.add_argument("--camera-model", choices=list(LENS_COEFFICIENTS), default="OPENCV",
                        help="lens model the images are shot through (default OPENCV, pinhole unless coefficients are given)")  # fmt: skip
    for name in ("k1", "k2", "k3", "k4", "p1", "p2"):
        models = " and ".join(m for m, names in LENS_COEFFICIENTS.items() if name in names)
        parser.add_argument(f"--{name}", type=float, default=None, help=f"lens coefficient {name} ({models})")
    parser.add_argument("--per-frame-intrinsics", action="store_true",
                        help="every frame its own focal length, principal point and coefficients, written per frame")  # fmt: skip
    args = parser.parse_args(argv)
    lens = {k: getattr(args, k) for k in ("k1", "k2", "k3", "k4", "p1", "p2") if getattr(args, k) is not None}
    try:
        stats = generate(args.out, width=args.width, height=args.height, views=args.views, seed=args.seed,
                         camera_model=args.camera_model, lens=lens, per_frame_intrinsics=args.per_frame_intrinsics)  # fmt: skip
    except (FileExistsError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    print(stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
