"""``.sog``: PlayCanvas's "Splat Optimized Graphics" (SuperSplat's recommended format; the PlayCanvas
engine and SuperSplat read it), version 2, as splat-transform (github.com/playcanvas/splat-transform,
src/lib/writers/write-sog.ts) writes it and src/lib/readers/read-sog.ts reads it.

A zip archive (entries stored, not deflated) of ``meta.json`` and lossless WebP images. Gaussian i
(in Morton order, quantize.morton_order) is texel i of every W x H per-gaussian image, row-major,
W = ceil(sqrt(N) / 4) * 4, H = ceil(N / W / 4) * 4; unused texels are zero.

    means_l.webp, means_u.webp  low and high byte of 16 bits per axis (RGB; A 255): the position
                                through t = sign(x) ln(|x| + 1), unorm over meta.means.mins..maxs
                                (per axis, in t)
    quats.webp                  "smallest three": the unit quaternion (w, x, y, z), sign made
                                positive for its largest |component|, whose index is A - 252; RGB
                                = the other three in order, 255 * (c * sqrt(2) * 0.5 + 0.5)
    scales.webp                 RGB: indices into meta.scales.codebook (256 log scales)
    sh0.webp                    RGB: indices into meta.sh0.codebook (256 DC coefficients);
                                A: sigmoid(opacity) * 255
    shN_labels.webp             (with SH) R + 256 G: the gaussian's entry in the SH palette
    shN_centroids.webp          (with SH) the palette: entry e, coefficient j (of the K-1 per
                                channel) is texel ((e % 64) * (K-1) + j, e // 64), RGB = the red,
                                green and blue coefficient as indices into meta.shN.codebook (256)

The codebooks are k-means (quantize.py): 1-D into 256 entries for log scales, DC colour and the
palette's values; the palette itself is k-means of the [N, 3(K-1)] SH vectors into
splat-transform's palette size (quantize.palette_size: 65,536 from 65,536 gaussians on): exact up to
2^29 point-entry distances per iteration, exact with bounds that skip most distances (run to
convergence: never worse than exact) below 2^32 (N < 65,536), a two-level codebook refined by inverted-file Lloyd
iterations beyond (quantize.kmeans; 1.5M gaussians in seconds of CPU), on the device the model is on. Bytes that splat-transform truncates are rounded here (positions,
quaternions, opacity), which halves their worst error; every reader decodes them the same way.
SH degree 4 models keep bands 1-3 (meta.shN.bands is at most 3).

Same gaussians, same bytes: the k-means seeds are fixed, the zip's timestamps are 1980-01-01.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Union

import numpy as np

from .compressed_ply_file import ply_arrays, unit_quats
from .gaussians import ANTIALIASED_SOG_MODEL, ExportGaussians
from .progress import or_none
from .quantize import codebook_1d, kmeans, morton_order, palette_size

VERSION = 2
KMEANS_ITERATIONS = 10  # splat-transform's default (--iterations)
ZIP_TIME = (1980, 1, 1, 0, 0, 0)
WEBP_OPTIONS = dict(lossless=True, quality=50, method=4, exact=True)  # exact: keep RGB under A = 0; quality: effort


@dataclass
class SogEncoding:
    data: bytes  # the .sog archive
    meta: dict
    sh_degree: int  # stored (min(model's, 3))
    palette: int  # SH palette entries (0 without SH)
    images: Dict[str, int]  # bytes per WebP


def texture_size(n: int):
    width = max(4, math.ceil(math.sqrt(n) / 4) * 4)
    height = max(4, math.ceil(n / width / 4) * 4)
    return width, height


def log_transform(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return np.sign(x) * np.log(np.abs(x) + 1)


def _webp(rgba: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgba, np.uint8), "RGBA").save(buf, "WEBP", **WEBP_OPTIONS)
    return buf.getvalue()


def _u8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.floor(np.asarray(x, np.float64) + 0.5), 0, 255).astype(np.uint8)


def encode_sog(g: ExportGaussians, device=None, generator: str = "splat-metal", report=None) -> SogEncoding:
    """The .sog archive of ``g`` in Morton order. ``report(step, done, total)``: progress (progress.py)."""
    meta, encoded, degree, palette = sog_files(g, morton_order(g.means), device, generator, report)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, blob in encoded.items():
            info = zipfile.ZipInfo(name, ZIP_TIME)
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            z.writestr(info, blob)
    return SogEncoding(
        buf.getvalue(), meta, degree, palette, {k: len(v) for k, v in encoded.items() if k != "meta.json"}
    )


def sog_files(g: ExportGaussians, order: np.ndarray, device=None, generator: str = "splat-metal", report=None):
    """The files of a SOG with gaussian ``order[i]`` of ``g`` as texel i: (meta, {name: bytes} with
    meta.json first, stored SH degree, SH palette entries). A .sog bundles them in a zip; an
    unbundled SOG (splat-transform's ``meta.json`` output, a level-of-detail chunk: lod_file.py) is
    the same files in a folder."""
    report = or_none(report)
    n = g.count
    a = ply_arrays(g)
    degree = a["sh_degree"]
    width, height = texture_size(n)

    def image(rgba_rows: np.ndarray) -> np.ndarray:  # [N, 4] in file order -> [H, W, 4]
        img = np.zeros((width * height, 4), np.uint8)
        img[:n] = rgba_rows
        return img.reshape(height, width, 4)

    opaque = np.full((n, 1), 255, np.uint8)
    images: Dict[str, np.ndarray] = {}

    # positions: 16 bits per axis of the log-transformed value
    t = log_transform(a["means"][order])  # [N, 3]
    mins, maxs = t.min(axis=0), t.max(axis=0)
    span = maxs - mins
    u = np.where(span > 0, np.floor(65535 * (t - mins) / np.where(span > 0, span, 1) + 0.5), 0).astype(np.uint16)
    images["means_l.webp"] = image(np.concatenate([(u & 0xFF).astype(np.uint8), opaque], 1))
    images["means_u.webp"] = image(np.concatenate([(u >> 8).astype(np.uint8), opaque], 1))

    # rotations: smallest three
    q = unit_quats(a["quats"][order])
    largest = np.argmax(np.abs(q), axis=1)
    q = np.where(np.take_along_axis(q, largest[:, None], axis=1) < 0, -q, q) * np.sqrt(2)
    others = np.array([[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]])[largest]  # [N, 3]
    small = np.take_along_axis(q, others, axis=1)
    tag = (252 + largest)[:, None].astype(np.uint8)
    images["quats.webp"] = image(np.concatenate([_u8(255 * (small * 0.5 + 0.5)), tag], 1))

    # scales and colour: 256-entry codebooks
    scale_book, scale_idx = codebook_1d(a["log_scales"][order])
    images["scales.webp"] = image(np.concatenate([scale_idx, opaque], 1))
    dc_book, dc_idx = codebook_1d(a["sh_dc"][order])
    alpha = _u8(255 / (1 + np.exp(-a["opacity_logits"][order].astype(np.float64))))[:, None]
    images["sh0.webp"] = image(np.concatenate([dc_idx, alpha], 1))

    meta = {
        "version": VERSION,
        "asset": {"generator": generator},
        "count": n,
        "means": {
            "mins": [float(v) for v in mins],
            "maxs": [float(v) for v in maxs],
            "files": ["means_l.webp", "means_u.webp"],
        },  # fmt: skip
        "scales": {"codebook": [float(v) for v in scale_book], "files": ["scales.webp"]},
        "quats": {"files": ["quats.webp"]},
        "sh0": {"codebook": [float(v) for v in dc_book], "files": ["sh0.webp"]},
    }
    if g.antialiased:
        meta["model"] = ANTIALIASED_SOG_MODEL
    palette = 0
    if degree > 0:
        coeffs = (degree + 1) ** 2 - 1
        vectors = a["sh_rest"][order].reshape(n, 3 * coeffs)  # f_rest_0.. (channel-major)
        centroids, labels = kmeans(vectors, palette_size(n), KMEANS_ITERATIONS, device=device, progress=report)
        palette = len(centroids)
        sh_book, sh_idx = codebook_1d(centroids)  # [P, 3*coeffs] uint8
        rows = -(-palette // 64)
        cimg = np.zeros((rows * 64, coeffs, 4), np.uint8)
        cimg[:palette, :, :3] = sh_idx.reshape(palette, 3, coeffs).transpose(0, 2, 1)
        cimg[:palette, :, 3] = 255
        images["shN_centroids.webp"] = cimg.reshape(rows, 64 * coeffs, 4)
        lab = np.stack([labels & 0xFF, labels >> 8, np.zeros(n, np.int64), np.full(n, 255)], 1).astype(np.uint8)
        images["shN_labels.webp"] = image(lab)
        meta["shN"] = {"count": palette, "bands": degree, "codebook": [float(v) for v in sh_book],
                       "files": ["shN_centroids.webp", "shN_labels.webp"]}  # fmt: skip

    encoded = {"meta.json": json.dumps(meta, separators=(",", ":")).encode()}
    for i, (name, img) in enumerate(images.items()):
        report("WebP images", i, len(images))
        encoded[name] = _webp(img)
    return meta, encoded, degree, palette


# ---------------------------------------------------------------------------------------------
# Reading (what read-sog.ts does), for .sog archives and unbundled meta.json folders of any writer.


def read_sog(path: Union[str, Path]) -> Dict[str, np.ndarray]:
    """Decoded values in the file's order: means [N, 3], log_scales [N, 3], sh_dc [N, 3],
    opacity_logits [N], quats [N, 4] (w, x, y, z, unit), sh_rest [N, 3, K-1] channel-major."""
    from PIL import Image

    path = Path(path)
    archive: Optional[zipfile.ZipFile] = zipfile.ZipFile(path) if path.suffix != ".json" else None

    def load(name: str) -> bytes:
        return archive.read(name) if archive else (path.parent / name).read_bytes()

    def rgba(name: str) -> np.ndarray:
        img = Image.open(io.BytesIO(load(name)))
        return np.asarray(img.convert("RGBA")).reshape(-1, 4).astype(np.int64)

    meta = json.loads(load("meta.json" if archive else path.name))
    if meta.get("version") != VERSION:
        raise ValueError(f"{path}: SOG version {meta.get('version')} (this reader knows {VERSION})")
    n = meta["count"]
    lo, hi = rgba(meta["means"]["files"][0])[:n], rgba(meta["means"]["files"][1])[:n]
    u = (lo[:, :3] | (hi[:, :3] << 8)).astype(np.float64)
    mins, maxs = np.array(meta["means"]["mins"]), np.array(meta["means"]["maxs"])
    span = np.where(maxs - mins != 0, maxs - mins, 1)
    t = mins + span * (u / 65535)
    means = np.sign(t) * (np.exp(np.abs(t)) - 1)

    qr = rgba(meta["quats"]["files"][0])[:n]
    tag = qr[:, 3] - 252
    small = qr[:, :3] / 255 * 2 - 1
    quats = np.zeros((n, 4))
    for w in range(4):
        rows = tag == w
        others = [i for i in range(4) if i != w]
        quats[np.ix_(rows, others)] = small[rows] / np.sqrt(2)
        quats[rows, w] = np.sqrt(np.maximum(0, 1 - (quats[rows] ** 2).sum(1)))
    quats[(tag < 0) | (tag > 3)] = [1, 0, 0, 0]

    scale_book = np.asarray(meta["scales"]["codebook"], np.float32)
    log_scales = scale_book[rgba(meta["scales"]["files"][0])[:n, :3]]
    c0 = rgba(meta["sh0"]["files"][0])[:n]
    sh_dc = np.asarray(meta["sh0"]["codebook"], np.float32)[c0[:, :3]]
    a = np.clip(c0[:, 3] / 255, 1e-6, 1 - 1e-6)
    out = {"means": means, "log_scales": log_scales, "sh_dc": sh_dc, "opacity_logits": np.log(a / (1 - a)),
           "quats": quats, "sh_rest": np.zeros((n, 3, 0))}  # fmt: skip
    if "shN" in meta:
        coeffs = [0, 3, 8, 15][meta["shN"]["bands"]]
        book = np.asarray(meta["shN"]["codebook"], np.float32)
        cent_img = Image.open(io.BytesIO(load(meta["shN"]["files"][0])))
        if cent_img.width != 64 * coeffs:
            raise ValueError(f"{path}: SH palette image is {cent_img.width} wide, not {64 * coeffs}")
        cent = np.asarray(cent_img.convert("RGBA")).reshape(-1, coeffs, 4)[:, :, :3]  # [rows*64, coeffs, 3]
        lab = rgba(meta["shN"]["files"][1])[:n]
        labels = lab[:, 0] | (lab[:, 1] << 8)
        values = book[cent[np.minimum(labels, len(cent) - 1)]]  # [N, coeffs, 3]
        values[labels >= meta["shN"]["count"]] = 0
        out["sh_rest"] = values.transpose(0, 2, 1)
    out["meta"] = meta
    return {k: (v if k == "meta" else np.asarray(v, np.float32)) for k, v in out.items()}
