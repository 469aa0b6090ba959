""".glb: binary glTF 2.0 with Khronos' ``KHR_gaussian_splatting`` (github.com/KhronosGroup/glTF,
extensions/2.0/Khronos/KHR_gaussian_splatting, status "Release Candidate"), one buffer in the GLB's
BIN chunk.

One mesh of one primitive, ``mode`` 0 (POINTS), with the extension object ``{"kernel": "ellipse",
"colorSpace": "srgb_rec709_display"}`` (3DGS colours are the training images' sRGB, display-referred)
and one tightly packed float32 accessor per attribute, little-endian, in this order:

    POSITION                                    VEC3   the gaussian's centre (min / max given)
    COLOR_0                                     VEC4   unsigned byte normalised: the fallback colour for
                                                       a viewer that draws points (linear, as COLOR_0 is:
                                                       clamp(0.5 + SH_C0 dc, 0, 1) decoded from sRGB) and
                                                       opacity
    KHR_gaussian_splatting:ROTATION             VEC4   unit quaternion, glTF's (x, y, z, w) order
    KHR_gaussian_splatting:SCALE                VEC3   linear: exp(log scale)
    KHR_gaussian_splatting:OPACITY              SCALAR sigmoid(opacity logit), 0..1
    KHR_gaussian_splatting:SH_DEGREE_0_COEF_0   VEC3   the DC coefficient (rgb = 0.5 + SH_C0 dc)
    KHR_gaussian_splatting:SH_DEGREE_l_COEF_n   VEC3   bands l = 1..3, n = 0..2l (m = -l..l), rgb

The extension's SH basis is gsplat's (the same constants, signs and order), so coefficients need no
change of convention; band 4 has no attribute and is dropped.

Axes: glTF is right-handed with +y up; a nerfstudio run's world is +z up. The data is turned into
glTF's axes (x, y, z) -> (x, z, -y), a rotation of -90 degrees about x, baked into positions,
rotations and SH (the extension recommends data in glTF's frame; a renderer that does not rotate SH
by a node's rotation, which the extension only recommends, still shows the right view-dependent
colour), so the node has no transform and the scene stands upright in a glTF viewer.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from ..sh_basis import sh_basis_terms
from .gaussians import SH_C0, ExportGaussians
from .progress import Report, or_none

EXTENSION = "KHR_gaussian_splatting"
SPZ_EXTENSION = "KHR_gaussian_splatting_compression_spz_2"
COMPRESSIONS = ("none", "spz")
SPZ_STREAM_VERSION = 3  # CesiumJS's decoder (@spz-loader/core 0.3.1, Niantic's C++ in wasm) reads gzip SPZ only
GLB_MAGIC, GLB_VERSION = 0x46546C67, 2  # "glTF"
JSON_CHUNK, BIN_CHUNK = 0x4E4F534A, 0x004E4942  # "JSON", "BIN\0"
FLOAT, UNSIGNED_BYTE = 5126, 5121
ARRAY_BUFFER = 34962
MAX_SH_DEGREE = 3  # the extension's attributes stop at band 3
COMPONENTS = {"SCALAR": 1, "VEC3": 3, "VEC4": 4}
# Run axes (+z up) -> glTF axes (+y up): (x, y, z) -> (x, z, -y), -90 degrees about x.
TO_GLTF = np.array([[1, 0, 0], [0, 0, 1], [0, -1, 0]], np.float64)
TO_GLTF_QUAT = np.array([np.sqrt(0.5), -np.sqrt(0.5), 0, 0])  # the same rotation, wxyz


def sh_rotation(degree: int, rotation: np.ndarray) -> np.ndarray:
    """[2l+1, 2l+1] A such that coefficients c of band ``degree`` ([2l+1] per channel) become A c
    when the scene is turned by ``rotation`` R ([3, 3]): Y_l(R^T d) = Y_l(d) A for every direction d
    (row vectors of the band's 2l+1 basis functions), so sum_k c_k Y_k(R^T d) = sum_j (A c)_j Y_j(d);
    solved on 64 directions with gsplat's basis (sh_basis.py, as ops/reference.sh_bases evaluates it),
    exact to float64 rounding; numpy only, so a glb export never imports torch."""
    dirs = np.random.default_rng(0).normal(size=(64, 3))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)  # [S, 3]
    here = np.stack(sh_basis_terms(degree, *dirs.T), axis=-1)[:, degree * degree - 1 :]  # [S, 2l+1]
    back = np.stack(sh_basis_terms(degree, *(dirs @ rotation).T), axis=-1)[:, degree * degree - 1 :]  # Y_l(R^T d)
    return np.linalg.lstsq(here, back, rcond=None)[0]


def _quat_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # [4] or [N, 4] wxyz each -> [N, 4]
    aw, ax, ay, az = np.moveaxis(np.broadcast_to(a, b.shape), -1, 0)
    bw, bx, by, bz = np.moveaxis(b, -1, 0)
    return np.stack([aw * bw - ax * bx - ay * by - az * bz, aw * bx + ax * bw + ay * bz - az * by,
                     aw * by - ax * bz + ay * bw + az * bx, aw * bz + ax * by - ay * bx + az * bw], -1)  # fmt: skip


def _srgb_to_linear(c: np.ndarray) -> np.ndarray:
    return np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)


def gltf_attributes(g: ExportGaussians) -> List[Tuple[str, np.ndarray]]:
    """(semantic, array) per attribute in the file's order, in glTF's axes: float32 [N, k] arrays,
    COLOR_0 uint8 [N, 4]."""
    n = g.count
    sigmoid = 1 / (1 + np.exp(-g.opacity_logits.astype(np.float64)))  # [N]
    quats = g.quats.astype(np.float64)  # [N, 4] wxyz
    norm = np.linalg.norm(quats, axis=1, keepdims=True)
    quats = np.where(norm > 0, quats / np.where(norm > 0, norm, 1), np.array([1.0, 0, 0, 0]))  # zero: identity
    quats = _quat_product(TO_GLTF_QUAT, quats)
    quats /= np.linalg.norm(quats, axis=1, keepdims=True)
    with np.errstate(over="ignore"):
        scales = np.exp(g.log_scales.astype(np.float64)).astype(np.float32)  # [N, 3]
    if not np.isfinite(scales).all():
        raise ValueError(f"[glb] log scales up to {g.log_scales.max():.4g} overflow float32's range as linear scales")
    rgb = np.clip(0.5 + SH_C0 * g.sh_dc.astype(np.float64), 0, 1)  # [N, 3]
    color = np.rint(np.concatenate([_srgb_to_linear(rgb), sigmoid[:, None]], axis=1) * 255).astype(np.uint8)
    out = [
        ("POSITION", (g.means.astype(np.float64) @ TO_GLTF.T).astype(np.float32)),
        ("COLOR_0", color),
        (f"{EXTENSION}:ROTATION", np.roll(quats, -1, axis=1).astype(np.float32)),  # xyzw
        (f"{EXTENSION}:SCALE", scales),  # per local axis: unchanged by the turn
        (f"{EXTENSION}:OPACITY", sigmoid.astype(np.float32)[:, None]),
        (f"{EXTENSION}:SH_DEGREE_0_COEF_0", g.sh_dc.astype(np.float32)),
    ]
    for degree in range(1, min(g.sh_degree, MAX_SH_DEGREE) + 1):
        band = g.sh_rest[:, degree * degree - 1 : (degree + 1) ** 2 - 1]  # [N, 2l+1, 3]
        coefs = np.moveaxis(band, 1, 0).reshape(2 * degree + 1, -1).astype(np.float32)  # [2l+1, N*3]
        turned = sh_rotation(degree, TO_GLTF).astype(np.float32) @ coefs  # A c for every gaussian and channel
        out += [(f"{EXTENSION}:SH_DEGREE_{degree}_COEF_{i}", turned[i].reshape(n, 3)) for i in range(2 * degree + 1)]
    assert all(len(a) == n for _, a in out)
    return out


@dataclass
class GlbLayout:
    header: bytes  # the GLB header, the JSON chunk and the BIN chunk's header
    arrays: List[np.ndarray]  # the BIN chunk's contents, in order (each a multiple of 4 bytes)
    size: int  # bytes of the whole file
    note: str


def _spz_gaussians(g: ExportGaussians, attributes: List[Tuple[str, np.ndarray]]) -> ExportGaussians:
    """g with the turned values of ``attributes`` (gltf_attributes' POSITION, ROTATION and SH bands
    1-3, in glTF's axes): what the SPZ stream holds, so that a reader decoding it without any axis
    conversion gets the uncompressed file's attributes."""
    a = dict(attributes)
    degree = min(g.sh_degree, MAX_SH_DEGREE)
    rest = [a[f"{EXTENSION}:SH_DEGREE_{band}_COEF_{i}"] for band in range(1, degree + 1) for i in range(2 * band + 1)]
    return dataclasses.replace(
        g,
        means=a["POSITION"],
        quats=np.roll(a[f"{EXTENSION}:ROTATION"], 1, axis=1),  # [N, 4] xyzw -> wxyz
        sh_rest=np.stack(rest, axis=1) if rest else np.zeros((g.count, 0, 3), np.float32),  # [N, D, 3]
        sh_degree=degree,
    )


def glb_layout(g: ExportGaussians, generator: str = "splat-metal-export", compression: str = "none") -> GlbLayout:
    if compression not in COMPRESSIONS:
        raise ValueError(f"[glb] compression must be one of {', '.join(COMPRESSIONS)}, got {compression!r}")
    attributes = gltf_attributes(g)
    accessors, views, arrays, offset = [], [], [], 0
    primitive_extension = {"kernel": "ellipse", "colorSpace": "srgb_rec709_display"}
    if compression == "spz":
        from .spz_file import encode_spz

        spz = encode_spz(_spz_gaussians(g, attributes), SPZ_STREAM_VERSION)
        stream = np.frombuffer(spz.data, np.uint8)
        a = dict(attributes)
        fixed = a["POSITION"] * np.float32(1 << spz.fractional_bits)  # [N, 3] float32, as encode_spz rounds it
        decoded = np.trunc(fixed.astype(np.float64) + np.copysign(0.5, fixed)) / (1 << spz.fractional_bits)
        rgb = np.clip(0.5 + SH_C0 * g.sh_dc.astype(np.float64), 0, 1)  # [N, 3] as decoded: 0.5 + SH_C0 dc, sRGB
        color = np.rint(np.concatenate([rgb, a[f"{EXTENSION}:OPACITY"]], axis=1) * 255).astype(np.uint8)
        # the sub-extension's attributes, shapes and bounds only (the accessors hold no data)
        attributes = (
            [("POSITION", decoded.astype(np.float32)), ("COLOR_0", color)]
            + [(s, v) for s, v in attributes if s in (f"{EXTENSION}:SCALE", f"{EXTENSION}:ROTATION")]
            + [(s, v) for s, v in attributes if "SH_DEGREE_" in s and not s.endswith("SH_DEGREE_0_COEF_0")]
        )
        views.append({"buffer": 0, "byteOffset": 0, "byteLength": len(stream)})
        arrays.append(stream)
        offset = len(stream) + (-len(stream) % 4)
        if offset > len(stream):
            arrays.append(np.zeros(offset - len(stream), np.uint8))  # the BIN chunk is padded to 4 bytes
        primitive_extension["extensions"] = {SPZ_EXTENSION: {"bufferView": 0}}
    for semantic, array in attributes:
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))  # little-endian, no copy if it is
        kind = {1: "SCALAR", 3: "VEC3", 4: "VEC4"}[array.shape[1]]
        accessor = {"componentType": UNSIGNED_BYTE if array.dtype == np.uint8 else FLOAT,
                    "count": int(len(array)), "type": kind}  # fmt: skip
        if array.dtype == np.uint8:
            accessor["normalized"] = True
        if semantic == "POSITION":  # glTF requires the bounds of POSITION
            accessor["min"] = [float(v) for v in array.min(axis=0)]
            accessor["max"] = [float(v) for v in array.max(axis=0)]
        if compression == "none":  # with SPZ the accessors hold no data: the sub-extension's stream has it
            accessor = {"bufferView": len(views), **accessor}
            views.append({"buffer": 0, "byteOffset": offset, "byteLength": array.nbytes, "target": ARRAY_BUFFER})
            arrays.append(array)
            offset += array.nbytes  # 4-byte elements: every view stays aligned
        accessors.append(accessor)
    used = [EXTENSION] + ([SPZ_EXTENSION] if compression == "spz" else [])
    primitive = {
        "attributes": {semantic: i for i, (semantic, _) in enumerate(attributes)},
        "mode": 0,  # POINTS
        "extensions": {EXTENSION: primitive_extension},
    }
    gltf = {
        "asset": {"version": "2.0", "generator": generator},
        "extensionsUsed": used,
        **({"extensionsRequired": used} if compression == "spz" else {}),  # accessors without data otherwise
        "scene": 0,
        "scenes": [{"nodes": [0]}],
        "nodes": [{"mesh": 0}],
        "meshes": [{"primitives": [primitive]}],
        "accessors": accessors,
        "bufferViews": views,
        "buffers": [{"byteLength": offset}],
    }
    text = json.dumps(gltf, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 4)  # the JSON chunk is padded with spaces
    size = 12 + 8 + len(text) + 8 + offset
    if size >= 1 << 32:
        raise ValueError(f"[glb] {g.count:,} gaussians make a {size:,}-byte file, over GLB's 4 GiB limit")
    header = struct.pack("<III", GLB_MAGIC, GLB_VERSION, size) + struct.pack("<II", len(text), JSON_CHUNK) + text
    header += struct.pack("<II", offset, BIN_CHUNK)
    note = f"SH band {g.sh_degree} dropped (the format stores bands 1-3)" if g.sh_degree > MAX_SH_DEGREE else ""
    return GlbLayout(header, arrays, size, note)


def write_glb(g: ExportGaussians, path, report: Optional[Report] = None, compression: str = "none") -> Tuple[int, str]:
    """Writes the .glb to ``path`` (``compression`` "none" or "spz"); returns (bytes, note for the
    summary)."""
    report = or_none(report)
    if compression == "spz":
        report("SPZ stream", 0, 1)
    layout = glb_layout(g, compression=compression)
    with open(path, "wb") as f:
        f.write(layout.header)
        for i, array in enumerate(layout.arrays):
            report("attributes", i, len(layout.arrays))
            f.write(array.tobytes())
        report("attributes", len(layout.arrays), len(layout.arrays))
    return layout.size, f", {layout.note}" if layout.note else ""
