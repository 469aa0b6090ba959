"""``.compressed.ply``: PlayCanvas's compressed PLY (SuperSplat, the PlayCanvas engine, Spark and most
web viewers read it), written as splat-transform (github.com/playcanvas/splat-transform,
src/lib/writers/write-compressed-ply.ts and compressed-chunk.ts) writes it, read back as its
readers/decompress-ply.ts reads it.

A binary little-endian PLY with three elements:

    chunk  ceil(N/256) x 18 float32  min_x min_y min_z max_x max_y max_z, min/max_scale_x/y/z (log
                                     scales, clamped to [-20, 20]), min/max_r/g/b (colour
                                     0.5 + SH_C0 * dc), over the chunk's 256 gaussians
    vertex N x 4 uint32              packed_position  x:11 y:10 z:11 bits, unorm over the chunk's range
                                     packed_rotation  2 bits: index of the largest |component| of the
                                                      unit quaternion (rot_0..rot_3 = w, x, y, z),
                                                      sign made positive; the other three in order,
                                                      10 bits each of c * sqrt(2)/2 + 0.5
                                     packed_scale     11:10:11 over the chunk's log-scale range
                                     packed_color     r:8 g:8 b:8 over the chunk's colour range,
                                                      a:8 = sigmoid(opacity)
    sh     N x 3*(K-1) uint8         (only with SH) f_rest_* in the .ply's channel-major order,
                                     trunc((c / 8 + 0.5) * 256) clamped to 0..255: range [-4, 4]

unorm packing is floor(v * (2^bits - 1) + 0.5) of (value - min) / (max - min), 0 when the range is
under 1e-5; the last chunk is padded with copies of its last gaussian for the ranges. Gaussians are
written in Morton order (quantize.morton_order), which keeps every chunk's box small. SH degree 4
models keep bands 1-3 (the format has no room for band 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Union

import numpy as np

from .gaussians import SH_C0, ExportGaussians
from .quantize import morton_order

CHUNK = 256
CHUNK_PROPS = (
    "min_x", "min_y", "min_z", "max_x", "max_y", "max_z",
    "min_scale_x", "min_scale_y", "min_scale_z", "max_scale_x", "max_scale_y", "max_scale_z",
    "min_r", "min_g", "min_b", "max_r", "max_g", "max_b",
)  # fmt: skip
VERTEX_PROPS = ("packed_position", "packed_rotation", "packed_scale", "packed_color")
SH_COEFFS = {0: 0, 1: 3, 2: 8, 3: 15}  # per channel, by SH degree (bands)
SCALE_LIMIT = 20.0
BLOCK = 1 << 16  # rows of SH quantised at a time


@dataclass
class CompressedPlyEncoding:
    data: bytes
    sh_degree: int  # the SH degree stored (min(model's, 3))
    clamped_sh: int  # SH coefficients outside [-4, 4]


def ply_arrays(g: ExportGaussians, max_degree: int = 3) -> Dict[str, np.ndarray]:
    """The .ply's columns as splat-transform reads them: positions, log scales, DC, opacity logits,
    quaternions (w, x, y, z) and SH rest [N, 3, K-1] channel-major, up to SH degree ``max_degree``."""
    degree = min(g.sh_degree, max_degree)
    k = (degree + 1) ** 2 - 1
    rest = g.sh_rest[:, :k, :].transpose(0, 2, 1)  # [N, 3, k]
    return {"means": g.means, "log_scales": g.log_scales, "sh_dc": g.sh_dc, "opacity_logits": g.opacity_logits,
            "quats": g.quats, "sh_rest": np.ascontiguousarray(rest, np.float32), "sh_degree": degree}  # fmt: skip


def _unorm(v: np.ndarray, bits: int) -> np.ndarray:
    t = (1 << bits) - 1
    return np.clip(np.floor(v * t + 0.5), 0, t).astype(np.uint32)


def _normalize(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """splat-transform's normalize per chunk: x [C, 256], lo/hi [C, 1]; in float64 like JavaScript."""
    x, lo, hi = (np.asarray(a, np.float64) for a in (x, lo, hi))
    span = hi - lo
    out = np.where(span < 1e-5, 0.0, (x - lo) / np.where(span < 1e-5, 1, span))
    return np.where(x <= lo, 0.0, np.where(x >= hi, 1.0, out))


def _pack_111011(a, b, c) -> np.ndarray:
    return (_unorm(a, 11) << np.uint32(21)) | (_unorm(b, 10) << np.uint32(11)) | _unorm(c, 11)


def unit_quats(quats: np.ndarray) -> np.ndarray:
    """Normalised in float64; a zero quaternion becomes the identity (w = 1), as the rasterizers draw it."""
    q = np.asarray(quats, np.float64)
    norm = np.sqrt((q * q).sum(axis=1, keepdims=True))
    return np.where(norm > 0, q / np.where(norm > 0, norm, 1), np.array([1.0, 0, 0, 0]))


def _pack_rotation(quats: np.ndarray) -> np.ndarray:  # [N, 4] in file order -> [N] uint32
    q = unit_quats(quats)
    largest = np.argmax(np.abs(q), axis=1)  # the first of equals, as splat-transform's reduce
    q = np.where(np.take_along_axis(q, largest[:, None], axis=1) < 0, -q, q)
    out = largest.astype(np.uint32)
    norm = np.sqrt(2) * 0.5
    for i in range(4):
        out = np.where(largest != i, (out << np.uint32(10)) | _unorm(q[:, i] * norm + 0.5, 10), out)
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def encode_compressed_ply(g: ExportGaussians, generator: str = "splat-metal") -> CompressedPlyEncoding:
    n = g.count
    a = ply_arrays(g)
    degree = a["sh_degree"]
    order = morton_order(g.means)
    n_chunks = -(-n // CHUNK)
    pad = n_chunks * CHUNK - n
    padded = np.r_[order, np.full(pad, order[-1] if n else 0, order.dtype)].reshape(n_chunks, CHUNK)

    def chunked(col: np.ndarray) -> np.ndarray:  # [N] float32 -> [C, 256]
        return col[padded]

    chunk = np.zeros((n_chunks, 18), np.float32)
    fields = []
    # positions
    p = [chunked(a["means"][:, i]) for i in range(3)]
    lo = [c.min(axis=1, keepdims=True) for c in p]
    hi = [c.max(axis=1, keepdims=True) for c in p]
    chunk[:, 0:3] = np.concatenate(lo, axis=1)
    chunk[:, 3:6] = np.concatenate(hi, axis=1)
    fields.append(_pack_111011(*(_normalize(p[i], lo[i], hi[i]) for i in range(3))))
    # rotation
    fields.append(_pack_rotation(a["quats"][padded.reshape(-1)]).reshape(n_chunks, CHUNK))
    # scales (log), ranges clamped to [-20, 20]
    s = [chunked(a["log_scales"][:, i]) for i in range(3)]
    lo = [np.clip(c.min(axis=1, keepdims=True), -SCALE_LIMIT, SCALE_LIMIT) for c in s]
    hi = [np.clip(c.max(axis=1, keepdims=True), -SCALE_LIMIT, SCALE_LIMIT) for c in s]
    chunk[:, 6:9] = np.concatenate(lo, axis=1)
    chunk[:, 9:12] = np.concatenate(hi, axis=1)
    scale = _pack_111011(*(_normalize(s[i], lo[i], hi[i]) for i in range(3)))
    # colour: 0.5 + SH_C0 * dc, rounded to float32 as splat-transform stores it before its ranges
    c = [(chunked(a["sh_dc"][:, i]).astype(np.float64) * SH_C0 + 0.5).astype(np.float32) for i in range(3)]
    lo = [x.min(axis=1, keepdims=True) for x in c]
    hi = [x.max(axis=1, keepdims=True) for x in c]
    chunk[:, 12:15] = np.concatenate(lo, axis=1)
    chunk[:, 15:18] = np.concatenate(hi, axis=1)
    cn = [_unorm(_normalize(c[i], lo[i], hi[i]), 8) for i in range(3)]
    alpha = _unorm(_sigmoid(chunked(a["opacity_logits"])), 8)
    color = (cn[0] << np.uint32(24)) | (cn[1] << np.uint32(16)) | (cn[2] << np.uint32(8)) | alpha
    fields += [scale, color]
    vertex = np.stack([f.reshape(-1)[:n] for f in fields], axis=1).astype("<u4")  # [N, 4]

    rest = a["sh_rest"].reshape(n, -1)  # [N, 3*(K-1)] channel-major
    sh = np.empty(rest.shape, np.uint8)
    clamped = 0
    for s in range(0, n, BLOCK):  # in blocks of rows: float64 temporaries of a few MB
        q = np.trunc((rest[order[s : s + BLOCK]].astype(np.float64) / 8 + 0.5) * 256)
        clamped += int(((q < 0) | (q > 255)).sum())
        sh[s : s + BLOCK] = np.clip(q, 0, 255)

    header = [
        "ply", "format binary_little_endian 1.0", f"comment Generated by {generator}",
        *(f"comment {c}" for c in g.ply_comments()),
        f"element chunk {n_chunks}", *(f"property float {p}" for p in CHUNK_PROPS),
        f"element vertex {n}", *(f"property uint {p}" for p in VERTEX_PROPS),
    ]  # fmt: skip
    if degree > 0:
        header += [f"element sh {n}", *(f"property uchar f_rest_{i}" for i in range(sh.shape[1]))]
    header.append("end_header\n")
    data = "\n".join(header).encode("ascii") + chunk.astype("<f4").tobytes() + vertex.tobytes() + sh.tobytes()
    return CompressedPlyEncoding(data, degree, clamped)


# ---------------------------------------------------------------------------------------------
# Reading (what decompress-ply.ts does), for files of any writer that follows the layout above.


def _read_header(data: bytes):
    end = data.index(b"end_header\n") + len(b"end_header\n")
    lines = data[:end].decode("ascii").splitlines()
    if lines[0] != "ply" or lines[1] != "format binary_little_endian 1.0":
        raise ValueError("not a binary little-endian PLY")
    elements = []  # [name, count, [(type, name)]]
    for line in lines[2:]:
        parts = line.split()
        if parts[0] == "element":
            elements.append([parts[1], int(parts[2]), []])
        elif parts[0] == "property":
            elements[-1][2].append((parts[1], parts[2]))
    return end, elements


_PLY_TYPES = {"float": "<f4", "float32": "<f4", "uint": "<u4", "uint32": "<u4", "uchar": "u1", "uint8": "u1"}


def read_compressed_ply(path: Union[str, Path]) -> Dict[str, np.ndarray]:
    """Decoded values in the file's order: means [N, 3], log_scales [N, 3], sh_dc [N, 3],
    opacity_logits [N], quats [N, 4] (w, x, y, z, unit), sh_rest [N, 3, K-1] channel-major."""
    data = Path(path).read_bytes()
    offset, elements = _read_header(data)
    tables = {}
    for name, count, props in elements:
        dtype = np.dtype([(p, _PLY_TYPES[t]) for t, p in props])
        tables[name] = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
        offset += dtype.itemsize * count
    if offset != len(data):
        raise ValueError(f"{path}: {len(data) - offset} bytes after the last element")
    ch, v = tables["chunk"], tables["vertex"]
    n = len(v)
    ci = np.arange(n) // CHUNK

    def unorm(x, shift, bits):
        return ((x >> np.uint32(shift)) & np.uint32((1 << bits) - 1)).astype(np.float64) / ((1 << bits) - 1)

    def lerp(lo, hi, t):
        lo, hi = ch[lo][ci].astype(np.float64), ch[hi][ci].astype(np.float64)
        return lo * (1 - t) + hi * t

    pp, ps, pc, pr = (v[f"packed_{k}"].astype(np.uint32) for k in ("position", "scale", "color", "rotation"))
    xyz = (("x", 21, 11), ("y", 11, 10), ("z", 0, 11))  # axis, shift, bits
    means = np.stack([lerp(f"min_{a}", f"max_{a}", unorm(pp, sh, b)) for a, sh, b in xyz], 1)
    scales = np.stack([lerp(f"min_scale_{a}", f"max_scale_{a}", unorm(ps, sh, b)) for a, sh, b in xyz], 1)
    rgb = np.stack([lerp(f"min_{a}", f"max_{a}", unorm(pc, sh, 8)) for a, sh in (("r", 24), ("g", 16), ("b", 8))], 1)
    alpha = unorm(pc, 0, 8)
    norm = 1 / (np.sqrt(2) * 0.5)
    small = np.stack([(unorm(pr, sh, 10) - 0.5) * norm for sh in (20, 10, 0)], 1)
    largest = (pr >> np.uint32(30)).astype(np.int64)
    m = np.sqrt(np.maximum(0, 1 - (small**2).sum(1)))
    quats = np.zeros((n, 4))
    for w in range(4):
        rows = largest == w
        others = [i for i in range(4) if i != w]
        quats[np.ix_(rows, others)] = small[rows]
        quats[rows, w] = m[rows]
    with np.errstate(divide="ignore"):
        logits = -np.log(1 / alpha - 1)
    out = {"means": means, "log_scales": scales, "sh_dc": (rgb - 0.5) / SH_C0, "opacity_logits": logits, "quats": quats}
    if "sh" in tables:
        names = tables["sh"].dtype.names
        raw = np.stack([tables["sh"][f"f_rest_{i}"] for i in range(len(names))], 1).astype(np.float64)
        unit = np.where(raw == 0, 0.0, np.where(raw == 255, 1.0, (raw + 0.5) / 256))
        out["sh_rest"] = ((unit - 0.5) * 8).reshape(n, 3, -1)
    else:
        out["sh_rest"] = np.zeros((n, 3, 0))
    return {k: np.asarray(val, np.float32) for k, val in out.items()}
