"""``--format lod``: a streamed level-of-detail SOG, the folder splat-transform writes for a
``lod-meta.json`` output (github.com/playcanvas/splat-transform, src/lib/writers/write-lod.ts) and
the PlayCanvas engine streams chunk by chunk (GSplatOctreeParser, scene/gsplat-unified).

    <name>-lod/lod-meta.json          version 1: count, counts (per level), lodLevels, filenames, tree
    <name>-lod/<level>_<i>/meta.json  chunk i of a level: an unbundled SOG (meta.json and its WebP
                                      images, sog_file.sog_files), rows grouped by tree leaf

The levels: level 0 is the model itself; level l + 1 merges the gaussians of level l in groups of
MERGE_GROUP neighbours along their Morton curve (a moment-matching merge: the weights are opacity x
ellipsoid area, as splat-transform's --decimate weighs its pairs; the mean and the mixture's
covariance under those weights, the opacity that keeps the weighted area (capped at 1), DC and SH
as weighted means).

The tree (splat-transform's layout): every level's gaussians together are split at the median of
the centres' longest axis until a node holds at most CHUNK_SIZE of them and spans at most
CHUNK_EXTENT on every axis (or holds 256 or fewer); such a node is a leaf: its ``bound`` is the box
around its gaussians' one-sigma boxes, its ``lods`` say, per level, which chunk file holds its
gaussians of that level, at which row (``offset``) and how many (``count``), each leaf's rows in
their own Morton order. A level's leaves fill its chunk files in tree order; a file is closed once
it holds more than CHUNK_SIZE. A viewer loads, per leaf, the level its distance asks for.

The folder is written under a hidden temporary name beside the target and renamed into place at
the end: an interrupted export leaves no partial folder, and an earlier one stays until then.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from .compressed_ply_file import unit_quats
from .gaussians import ExportGaussians
from .progress import or_none
from .quantize import morton_order
from .sog_file import sog_files

VERSION = 1
LEVELS = 4  # the model and three coarser levels
MERGE_GROUP = 4  # gaussians of a level merged into one of the next (each level ~1/4 of the one before)
CHUNK_SIZE = 512 * 1024  # gaussians per chunk (splat-transform's default --lod-chunk-count 512, in thousands)
CHUNK_EXTENT = 16.0  # largest side of a leaf, in scene units (splat-transform's --lod-chunk-extent)
LEAF_SIZE = 256  # the tree's smallest node
ELLIPSOID_P = 1.6075  # Knud Thomsen's approximation of an ellipsoid's surface
META_NAME = "lod-meta.json"


def folder_name(output_name: str) -> str:
    return f"{output_name}-lod"


# ---------------------------------------------------------------------------------------------
# Levels


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


def ellipsoid_area(s: np.ndarray) -> np.ndarray:
    """Surface of ellipsoids with semi-axes s [N, 3] (Knud Thomsen's formula, p = 1.6075)."""
    p = ELLIPSOID_P
    a, b, c = s[:, 0] * s[:, 1], s[:, 0] * s[:, 2], s[:, 1] * s[:, 2]
    return 4 * np.pi * ((a**p + b**p + c**p) / 3) ** (1 / p)


def rotation_matrices(quats: np.ndarray) -> np.ndarray:
    """[N, 3, 3] rotations of quaternions [N, 4] (w, x, y, z; normalised here)."""
    w, x, y, z = unit_quats(quats).T
    r = np.empty((len(w), 3, 3))
    r[:, 0, 0], r[:, 0, 1], r[:, 0, 2] = 1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)
    r[:, 1, 0], r[:, 1, 1], r[:, 1, 2] = 2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)
    r[:, 2, 0], r[:, 2, 1], r[:, 2, 2] = 2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)
    return r


PAIRS = ((0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2))  # the six entries of a symmetric 3 x 3


def matrix_quats(r: np.ndarray) -> np.ndarray:
    """[N, 4] unit quaternions (w, x, y, z) of rotations r [N, 3, 3] (Shepperd's method)."""
    m00, m11, m22 = r[:, 0, 0], r[:, 1, 1], r[:, 2, 2]
    options = np.stack([
        np.stack([1 + m00 + m11 + m22, r[:, 2, 1] - r[:, 1, 2], r[:, 0, 2] - r[:, 2, 0], r[:, 1, 0] - r[:, 0, 1]], -1),
        np.stack([r[:, 2, 1] - r[:, 1, 2], 1 + m00 - m11 - m22, r[:, 0, 1] + r[:, 1, 0], r[:, 0, 2] + r[:, 2, 0]], -1),
        np.stack([r[:, 0, 2] - r[:, 2, 0], r[:, 0, 1] + r[:, 1, 0], 1 - m00 + m11 - m22, r[:, 1, 2] + r[:, 2, 1]], -1),
        np.stack([r[:, 1, 0] - r[:, 0, 1], r[:, 0, 2] + r[:, 2, 0], r[:, 1, 2] + r[:, 2, 1], 1 - m00 - m11 + m22], -1),
    ], 1)  # fmt: skip  # [N, 4 candidates, 4]: candidate c is 4 q_c q, best where q_c is largest
    best = np.argmax(
        np.stack([1 + m00 + m11 + m22, 1 + m00 - m11 - m22, 1 - m00 + m11 - m22, 1 - m00 - m11 + m22], 1), 1
    )
    q = options[np.arange(len(r)), best]
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def merge_neighbours(g: ExportGaussians, group: int = MERGE_GROUP) -> ExportGaussians:
    """The next coarser level: the gaussians of ``g`` in Morton order, each ``group`` consecutive
    ones merged into one by moment matching (module docstring). Float64 inside."""
    order = morton_order(g.means)
    n = len(order)
    starts = np.arange(0, n, group)
    member = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, n]))  # [N]: each sorted row's group

    def total(v: np.ndarray) -> np.ndarray:  # sums over each group's rows (the last group padded with zeros)
        padded = np.zeros((len(starts) * group, *v.shape[1:]), v.dtype)
        padded[:n] = v
        return padded.reshape(len(starts), group, *v.shape[1:]).sum(1)

    means = g.means[order].astype(np.float64)  # [N, 3]
    s = np.exp(g.log_scales[order].astype(np.float64))  # [N, 3]
    w = _sigmoid(g.opacity_logits[order]) * ellipsoid_area(s) + 1e-30  # [N]
    weight = total(w)  # [M]
    p = w / weight[member]  # [N]: share within the group
    mu = total(p[:, None] * means)  # [M, 3]
    r = rotation_matrices(g.quats[order].astype(np.float64))  # [N, 3, 3]
    d = means - mu[member]  # [N, 3]
    s2 = s * s
    second = np.stack([(r[:, i] * r[:, j] * s2).sum(1) + d[:, i] * d[:, j] for i, j in PAIRS], 1)  # [N, 6]
    six = total(p[:, None] * second)  # [M, 6]: the mixture's covariance R S^2 R^T + d d^T, weighted
    cov = np.empty((len(starts), 3, 3))
    for k, (i, j) in enumerate(PAIRS):
        cov[:, i, j] = cov[:, j, i] = six[:, k] + (1e-12 if i == j else 0.0)
    eigenvalues, vectors = np.linalg.eigh(cov)  # columns: the axes
    vectors[np.linalg.det(vectors) < 0, :, 0] *= -1  # a rotation
    scales = np.sqrt(np.maximum(eigenvalues, 1e-24))  # [M, 3]
    opacity = np.clip(weight / ellipsoid_area(scales), 1e-7, 1 - 1e-7)
    p32 = p.astype(np.float32)  # the SH in float32, as stored (float64 there: 5x the time at 1.5M, SH 3)
    return dataclasses.replace(
        g,
        means=mu.astype(np.float32),
        log_scales=np.log(scales).astype(np.float32),
        quats=matrix_quats(vectors).astype(np.float32),
        opacity_logits=np.log(opacity / (1 - opacity)).astype(np.float32),
        sh_dc=total(p[:, None] * g.sh_dc[order]).astype(np.float32),
        sh_rest=total(p32[:, None] * g.sh_rest[order].reshape(n, -1)).reshape(-1, *g.sh_rest.shape[1:]),
    )


def build_levels(g: ExportGaussians, levels: int = LEVELS) -> List[ExportGaussians]:
    """[the model, its merge, the merge of that, ...]: ``levels`` of them."""
    out = [g]
    while len(out) < levels:
        out.append(merge_neighbours(out[-1]))
    return out


def subset(g: ExportGaussians, rows: np.ndarray) -> ExportGaussians:
    return dataclasses.replace(g, means=g.means[rows], log_scales=g.log_scales[rows], quats=g.quats[rows],
                               opacity_logits=g.opacity_logits[rows], sh_dc=g.sh_dc[rows], sh_rest=g.sh_rest[rows])  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The tree and its chunks


def sigma_bound(means: np.ndarray, log_scales: np.ndarray, quats: np.ndarray) -> Dict[str, List[float]]:
    """The box around the gaussians' one-sigma boxes (splat-transform's calcBound); non-finite ones skipped."""
    r = rotation_matrices(quats.astype(np.float64))
    half = (np.abs(r) * np.exp(log_scales.astype(np.float64))[:, None, :]).sum(2)  # [N, 3]
    lo, hi = means - half, means + half
    ok = np.all(np.isfinite(lo) & np.isfinite(hi), axis=1)
    return {"min": lo[ok].min(0).tolist(), "max": hi[ok].max(0).tolist()}


@dataclasses.dataclass
class Chunking:
    """Which rows of each level go in which chunk file: ``files[i]`` = (level, [rows of that level])
    in the file's order; ``tree``: lod-meta.json's tree."""

    tree: dict
    files: List[Tuple[int, np.ndarray]]
    counts: List[int]


def chunk(levels: List[ExportGaussians], chunk_size: int = CHUNK_SIZE, chunk_extent: float = CHUNK_EXTENT) -> Chunking:
    centres = np.concatenate([lv.means for lv in levels]).astype(np.float64)  # [sum N, 3]
    level_of = np.concatenate([np.full(lv.count, i) for i, lv in enumerate(levels)])
    first_row = np.cumsum([0] + [lv.count for lv in levels])
    bin_size = chunk_size
    open_files: Dict[int, List[np.ndarray]] = {}  # level -> the rows of its last file, leaf by leaf
    file_index: Dict[int, int] = {}  # level -> its last file's index in ``files``
    files: List[Tuple[int, List[np.ndarray]]] = []

    def leaf(idx: np.ndarray) -> dict:
        lods, bounds = {}, []
        for level in range(len(levels)):
            own = idx[level_of[idx] == level] - first_row[level]
            if not len(own):
                continue
            lv = levels[level]
            own = own[morton_order(lv.means[own])]
            if level not in open_files:
                open_files[level] = []
                file_index[level] = len(files)
                files.append((level, open_files[level]))
            held = sum(len(rows) for rows in open_files[level])
            lods[str(level)] = {"file": file_index[level], "offset": held, "count": len(own)}
            open_files[level].append(own)
            if held + len(own) > bin_size:
                del open_files[level]  # the next leaf of this level opens a new file
            bounds.append(sigma_bound(lv.means[own], lv.log_scales[own], lv.quats[own]))
        return {"bound": _union(bounds), "lods": lods}

    def node(idx: np.ndarray) -> dict:
        c = centres[idx]
        lo, hi = c.min(0), c.max(0)
        if len(idx) <= LEAF_SIZE or (len(idx) <= bin_size and (hi - lo).max() <= chunk_extent):
            return leaf(idx)
        axis, mid = int(np.argmax(hi - lo)), len(idx) // 2
        part = np.argpartition(c[:, axis], mid)
        children = [node(idx[part[:mid]]), node(idx[part[mid:]])]
        return {"bound": _union([ch["bound"] for ch in children]), "children": children}

    tree = node(np.arange(len(centres)))
    return Chunking(tree, [(level, np.concatenate(rows)) for level, rows in files], [lv.count for lv in levels])


def _union(bounds: List[Dict[str, List[float]]]) -> Dict[str, List[float]]:
    return {
        "min": np.min([b["min"] for b in bounds], 0).tolist(),
        "max": np.max([b["max"] for b in bounds], 0).tolist(),
    }


def file_names(chunking: Chunking) -> List[str]:
    """``<level>_<i>/meta.json``: the i-th chunk file of its level."""
    seen: Dict[int, int] = {}
    names = []
    for level, _ in chunking.files:
        names.append(f"{level}_{seen.get(level, 0)}/meta.json")
        seen[level] = seen.get(level, 0) + 1
    return names


def _json_floats(x):
    """Floats to 7 significant digits (float32's), as splat-transform writes lod-meta.json."""
    if isinstance(x, float):
        return float(f"{x:.7g}")
    if isinstance(x, dict):
        return {k: _json_floats(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_floats(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------------
# Writing


@dataclasses.dataclass
class LodWritten:
    bytes: int  # the whole folder
    counts: List[int]  # gaussians per level
    level_bytes: List[int]  # bytes of each level's chunk files
    files: int  # chunk files
    sh_degree: int  # stored (min(model's, 3))


def write_lod(
    g: ExportGaussians,
    folder: Path,
    device=None,
    report=None,
    levels: int = LEVELS,
    chunk_size: int = CHUNK_SIZE,
    chunk_extent: float = CHUNK_EXTENT,
    generator: str = "splat-metal",
) -> LodWritten:
    """Writes the level-of-detail folder into ``folder`` (created; the caller renames it into place:
    engine/files.atomic_folder). ``device``: where the chunks' SH palettes are clustered (sog_file)."""
    report = or_none(report)
    report("levels", 0, levels)
    lods = build_levels(g, levels)
    report("levels", levels, levels)
    chunking = chunk(lods, chunk_size, chunk_extent)
    names = file_names(chunking)
    meta = {"version": VERSION, "asset": {"generator": generator}, "count": int(sum(chunking.counts)),
            "counts": chunking.counts, "lodLevels": len(lods), "filenames": names, "tree": _json_floats(chunking.tree)}  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / META_NAME).write_text(json.dumps(meta, separators=(",", ":")))
    level_bytes = [0] * len(lods)
    degree = g.sh_degree
    for i, ((level, rows), name) in enumerate(zip(chunking.files, names)):
        label = f"chunk {i + 1}/{len(names)} (level {level})"

        def step(what: str, done: int, total: int, label=label) -> None:
            report(f"{label} {what}", done, total)

        part = subset(lods[level], rows)
        _, encoded, degree, _ = sog_files(part, np.arange(part.count), device, generator, step)
        target = folder / name
        target.parent.mkdir()
        for file, blob in encoded.items():
            (target.parent / file).write_bytes(blob)
            level_bytes[level] += len(blob)
    total = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return LodWritten(total, chunking.counts, level_bytes, len(names), degree)
