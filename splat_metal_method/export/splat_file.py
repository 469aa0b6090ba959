""".splat: the raw gaussian buffer of antimatter15's WebGL viewer (github.com/antimatter15/splat),
which most web splat viewers also read.

No header; 32 bytes per gaussian, little-endian (main.js ``processPlyBuffer`` writes it,
``generateTexture`` reads it):

    offset  0  float32 x, y, z        position
    offset 12  float32 sx, sy, sz     scale, activated: exp(log scale)
    offset 24  uint8   r, g, b, a     r,g,b = (0.5 + SH_C0 * dc) * 255, a = sigmoid(opacity) * 255
    offset 28  uint8   qw, qx, qy, qz normalised quaternion q * 128 + 128 (read back as (v - 128) / 128)

uint8 values are rounded to nearest and clamped to 0..255 (JavaScript's Uint8ClampedArray, which
main.js writes through; its convert.py truncates instead). View-dependent colour (SH bands >= 1) has
no place in the format and is dropped.

Order: by exp(sx + sy + sz) * sigmoid(opacity) (volume times opacity), largest first, as main.js
sorts when it converts a .ply. The viewer draws whatever has arrived while the file streams in, so
the big, opaque gaussians that make up the picture come first; it re-sorts by depth every frame, so
the order changes nothing once the file is loaded.
"""

from __future__ import annotations

import numpy as np

from .gaussians import SH_C0, ExportGaussians

BYTES_PER_GAUSSIAN = 32
RECORD = np.dtype([("position", "<f4", 3), ("scale", "<f4", 3), ("rgba", "u1", 4), ("rotation", "u1", 4)])
assert RECORD.itemsize == BYTES_PER_GAUSSIAN


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def _to_u8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def importance_order(g: ExportGaussians) -> np.ndarray:
    """[N] indices, largest exp(sum of log scales) * sigmoid(opacity) first (stable for ties)."""
    key = np.exp(g.log_scales.astype(np.float64).sum(axis=1)) * _sigmoid(g.opacity_logits)
    return np.argsort(-key, kind="stable")


def encode_splat(g: ExportGaussians) -> bytes:
    order = importance_order(g)
    quats = g.quats[order].astype(np.float64)  # [N, 4] wxyz
    norm = np.linalg.norm(quats, axis=1, keepdims=True)
    # A zero quaternion renders as the identity rotation in every backend; keep it so here.
    quats = np.where(norm > 0, quats / np.where(norm > 0, norm, 1), np.array([1.0, 0, 0, 0]))
    out = np.empty(len(order), dtype=RECORD)
    out["position"] = g.means[order]
    out["scale"] = np.exp(g.log_scales[order].astype(np.float64))  # rounded to float32 as main.js does
    out["rgba"][:, :3] = _to_u8((0.5 + SH_C0 * g.sh_dc[order].astype(np.float64)) * 255)
    out["rgba"][:, 3] = _to_u8(_sigmoid(g.opacity_logits[order]) * 255)
    out["rotation"] = _to_u8(quats * 128 + 128)
    return out.tobytes()
