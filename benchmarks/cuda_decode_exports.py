"""The exports of benchmarks/cuda_device_run.py's commands stage, decoded here by the formats' owners' tools:
every file `splat-metal-export` wrote on the GPU machine (which has no node), value by value against
what it was written from, within the format's quantisation bound.

    python benchmarks/cuda_decode_exports.py RESULTS_DIR              # RESULTS_DIR/exports.tar
    python benchmarks/cuda_decode_exports.py RESULTS_DIR --tar FILE   # another tar of the same contract

exports.tar (cuda_device_run.pack_exports): manifest.json (device, gaussians, step, command, formats
{fmt: {file, bytes}}, failed {fmt: reason}), params.npz (export.gaussians.ExportGaussians of the run's
final checkpoint: the values every file was written from) and exports/ (splat.ply, .splat, .spz, .sog,
.compressed.ply, .glb, splat.lod/ and, where open3d was installed, ns-export/splat.ply). Each file is
decoded by the reader the export tests use for its format (imported from tests/, not copied):

- .ply and ns-export's .ply: plyfile (test_export_roundtrip.read_splat_ply); every value exact;
- .splat: antimatter15/splat main.js's reading (tests/export_readers.read_splat), in its importance order;
- .spz: Niantic's own library (npm @adobe/spz: nianticlabs/spz in WebAssembly, playcanvas_viewer.niantic_spz),
  its header by export_readers.read_spz;
- .sog, .compressed.ply and every chunk of the lod folder: PlayCanvas's splat-transform (to .ply, then
  plyfile), in the Morton order both are written in; the lod's counts per level and leaf bounds from
  its lod-meta.json;
- every file splat-transform 3.x reads (all but .splat, .glb and ns-export's .ply) also through its
  ``--info``: count, SH bands and the render mode the run was trained with;
- .glb: the glTF specification's reader (export_readers.read_glb, test_export_glb.glb_params turns it
  back into the run's axes) and Khronos' glTF-Validator (its one known miss set aside as the glb test does).

The bounds are the export tests' (test_export_formats.py for .splat and .spz, test_export_playcanvas.py
for .sog and .compressed.ply, test_export_glb.py for .glb, test_export_lod.py for the lod folder; each
function below names its test): opacity is compared as sigmoid(logit) in the quantised formats, rotations
as normalised quaternions (q and -q alike). Writes RESULTS_DIR/decode.json and decode.md (a Markdown table
and this command line) and prints the table. Exit status 0 only if every format of the manifest decoded
within its bounds; a format the manifest lists as failed, or whose file is missing, makes it 1.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Dict, Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "export"), str(REPO)]  # helpers, the export tests

# The formats cuda_device_run.pack_exports writes (its EXPORT_FORMATS), and ns-export's .ply where it could run.
FORMATS = ("ply", "splat", "spz", "sog", "compressed-ply", "glb", "lod")
NS_EXPORT = "ns-export ply"
ATTRIBUTES = ("means", "scales", "quats", "opacity", "sh_dc", "sh_rest")


class Params:
    """params.npz: the gaussians every export was written from, in the model's order."""

    def __init__(self, path: Path):
        with np.load(path) as z:
            self.raw = {k: z[k] for k in z.files}
        r = self.raw
        self.means = r["means"].astype(np.float64)
        self.log_scales = r["log_scales"].astype(np.float64)
        self.quats_stored = r["quats"]
        q = r["quats"].astype(np.float64)
        norm = np.linalg.norm(q, axis=1, keepdims=True)
        q = np.where(norm > 0, q / np.where(norm > 0, norm, 1), np.array([1.0, 0, 0, 0]))  # zero: the identity
        self.quats = q  # [N, 4] wxyz, unit
        self.opacity_logits = r["opacity_logits"].astype(np.float64)
        self.sh_dc = r["sh_dc"].astype(np.float64)
        self.sh_rest = r["sh_rest"].astype(np.float64)  # [N, K-1, 3] coefficient-major
        self.sh_degree = int(r["sh_degree"])
        self.antialiased = bool(r["antialiased"])
        self.count = len(self.means)

    def gaussians(self):
        from splat_metal_method.export.gaussians import ExportGaussians

        r = self.raw
        return ExportGaussians(means=r["means"], log_scales=r["log_scales"], quats=r["quats"],
                               opacity_logits=r["opacity_logits"], sh_dc=r["sh_dc"], sh_rest=r["sh_rest"],
                               sh_degree=self.sh_degree, antialiased=self.antialiased, n_model=self.count,
                               n_cropped=0, n_nonfinite=0, n_low_opacity=0)  # fmt: skip


def _sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


class Report:
    """One format's result: per attribute the max error and its bound (a number, or per value), other checks."""

    def __init__(self, tool: str):
        self.tool = tool
        self.count: Optional[int] = None
        self.errors: Dict[str, dict] = {}
        self.checks: Dict[str, dict] = {}

    def error(self, name: str, err, bound, note: str = "") -> None:
        err = np.abs(np.asarray(err, np.float64))
        bound = np.broadcast_to(np.asarray(bound, np.float64), err.shape)
        worst = float(err.max()) if err.size else 0.0
        ratio = float((err / np.maximum(bound, 1e-300)).max()) if err.size else 0.0
        self.errors[name] = {"max_error": worst, "bound": float(bound.max()) if bound.size else 0.0,
                             "per_value_bound": bool(bound.size and bound.min() != bound.max()),
                             "worst_error_over_bound": ratio, "ok": bool((err <= bound).all()) and bool(np.isfinite(err).all())}  # fmt: skip
        if note:
            self.errors[name]["note"] = note

    def check(self, name: str, ok: bool, value) -> None:
        self.checks[name] = {"ok": bool(ok), "value": value}

    def as_dict(self, expected: int) -> dict:
        count_ok = self.count == expected
        ok = count_ok and all(e["ok"] for e in self.errors.values()) and all(c["ok"] for c in self.checks.values())
        return {"ok": bool(ok), "tool": self.tool, "decoded": self.count, "expected": expected,
                "errors": self.errors, "checks": self.checks}  # fmt: skip


def _info_check(r: Report, path: Path, p: Params, lod_counts=None) -> None:
    """What splat-transform 3.x (Node 22, tests/web_viewers.py) reads of the file's header: the count, the SH
    bands and the render mode ("antialiased" for a run trained so, else "default":
    test_export_viewers_splat_transform3.test_reads_the_render_mode); for the lod folder its counts per level."""
    from web_viewers import splat_transform3_info

    info = splat_transform3_info(path)
    want = {"numGaussians": p.count, "shBands": p.sh_degree, "model": "antialiased" if p.antialiased else "default"}
    if lod_counts is not None:
        want["lodCounts"] = lod_counts
    got = {k: info.get(k) for k in want}
    r.check("splat-transform 3.x --info", got == want, got)
    r.tool += "; splat-transform 3.x --info"


# ------------------------------------------------------------------------------------------ the formats
def decode_ply(path: Path, p: Params, tool: str = "plyfile") -> Report:
    """Lossless: every value as params.npz has it (test_export_formats: byte-identical to ns-export's)."""
    from test_export_roundtrip import read_splat_ply

    r = Report(tool)
    d = read_splat_ply(path)
    if tool == "plyfile":  # ns-export's .ply carries no render mode
        _info_check(r, path, p)
    r.count = len(d["means"])
    if r.count != p.count:
        return r
    raw = p.raw
    r.error("means", d["means"] - raw["means"], 0)
    r.error("scales", d["scales"] - raw["log_scales"], 0, "log scales as stored")
    r.error("quats", d["quats"] - raw["quats"], 0, "as stored, not normalised")
    r.error("opacity", d["opacities"][:, 0] - raw["opacity_logits"], 0, "logits as stored")
    r.error("sh_dc", d["features_dc"] - raw["sh_dc"], 0)
    r.error("sh_rest", d["features_rest"] - raw["sh_rest"], 0)
    return r


def decode_splat(path: Path, p: Params) -> Report:
    """test_export_formats.test_splat_fields_order_and_size: float32 positions and scales, 8-bit RGBA,
    quaternions at 1/128 (1.0 stored as 255: 127/128); no SH rest."""
    from export_readers import read_splat
    from test_export_formats import EPS

    from splat_metal_method.export.gaussians import SH_C0
    from splat_metal_method.export.splat_file import importance_order

    r = Report("antimatter15/splat main.js's reading (tests/export_readers.read_splat)")
    s = read_splat(path)
    r.count = len(s["means"])
    if r.count != p.count:
        return r
    order = importance_order(p.gaussians())  # antimatter15's order: volume x opacity, largest first
    r.error("means", s["means"] - p.raw["means"][order], 0, "float32")
    scales = np.exp(p.log_scales[order])
    r.error("scales", (s["scales"] - scales) / scales, 1e-6, "relative, linear scales")
    q = np.clip(p.quats[order], -1, 127 / 128)
    r.error("quats", s["quats"] - q, 0.5 / 128 + EPS)
    r.error("opacity", s["rgba"][:, 3] - _sigmoid(p.opacity_logits[order]), 0.5 / 255 + EPS)
    r.error("sh_dc", s["rgba"][:, :3] - np.clip(0.5 + SH_C0 * p.sh_dc[order], 0, 1), 0.5 / 255 + EPS, "as RGB")
    return r


def decode_spz(path: Path, p: Params) -> Report:
    """test_export_formats.test_spz_header_and_fields: 24-bit fixed point positions, log scales at 1/16,
    8-bit alpha, colour at 1/38.25 in SH units, smallest-three rotations (<= 3e-3), SH band 1 at 5 bits
    and bands 2-3 at 4 bits (over [-1, 127/128])."""
    from export_readers import read_spz
    from playcanvas_viewer import niantic_spz
    from test_export_formats import EPS

    r = Report("Niantic's spz library (npm @adobe/spz loadSpzFromBuffer)")
    cloud = niantic_spz(path)
    header = read_spz(path)
    n = r.count = int(cloud["numPoints"])
    r.check("header", header["num_points"] == n and header["sh_degree"] == cloud["shDegree"] == p.sh_degree,
            {k: header[k] for k in ("version", "num_points", "sh_degree", "fractional_bits", "flags")})  # fmt: skip
    r.check("antialiased flag", cloud["antialiased"] == p.antialiased, bool(cloud["antialiased"]))
    _info_check(r, path, p)
    if n != p.count:
        return r
    fb = header["fractional_bits"]
    r.error("means", cloud["positions"].reshape(n, 3) - p.means, 0.5 / 2**fb + EPS, f"{fb} fractional bits")
    r.error("scales", cloud["scales"].reshape(n, 3) - np.clip(p.log_scales, -10, 255 / 16 - 10), 0.5 / 16 + EPS,
            "log scales")  # fmt: skip
    q = np.roll(cloud["rotations"].reshape(n, 4).astype(np.float64), 1, axis=1)  # xyzw -> wxyz
    q = q * np.sign((q * p.quats).sum(1, keepdims=True) + 1e-12)  # q and -q are the same rotation
    r.error("quats", q - p.quats, 3e-3)
    r.error("opacity", _sigmoid(cloud["alphas"]) - _sigmoid(p.opacity_logits), 0.5 / 255 + EPS)
    dc_range = (-127.5 / 38.25, 127.5 / 38.25)  # colour byte = dc * 0.15 * 255 + 127.5
    r.error("sh_dc", cloud["colors"].reshape(n, 3) - np.clip(p.sh_dc, *dc_range), 0.5 / 38.25 + EPS)
    k = p.sh_rest.shape[1]
    if k:
        err = np.abs(cloud["sh"].reshape(n, k, 3) - np.clip(p.sh_rest, -1, 127 / 128))
        bound = np.full_like(err, 8.5 / 128 + EPS)  # bands 2-3: 4 bits (buckets of 16) + rounding
        bound[:, :3] = 4.5 / 128 + EPS  # band 1: 5 bits (buckets of 8) + rounding
        r.error("sh_rest", err, bound, "band 1 at 5 bits, bands 2-3 at 4")
    return r


def _file_order(p: Params) -> dict:
    """params in the Morton order .sog and .compressed.ply are written in, as the .ply has them (quats
    normalised, the largest |component| positive; SH rest channel-major [N, 3, K-1]), as
    test_export_playcanvas._model_in_file_order lays out the model's."""
    from splat_metal_method.export.quantize import morton_order

    order = morton_order(p.raw["means"])
    q = p.quats * np.sign(p.quats[np.arange(p.count), np.abs(p.quats).argmax(1)])[:, None]
    return {"means": p.means[order], "log_scales": p.log_scales[order], "sh_dc": p.sh_dc[order],
            "opacity_logits": p.opacity_logits[order], "quats": q[order],
            "sh_rest": p.sh_rest[order].transpose(0, 2, 1)}  # fmt: skip


def _splat_transform(source: Path, work: Path) -> dict:
    """splat-transform's decoding of ``source`` (to .ply, read by plyfile) as the readers' dict."""
    from playcanvas_viewer import splat_transform
    from test_export_playcanvas import _ply_values

    out = work / f"decoded_{len(list(work.glob('decoded_*')))}.ply"
    splat_transform(source, out)
    return _ply_values(out)


def _sog_errors(r: Report, d: dict, m: dict, meta: dict) -> None:
    """test_export_playcanvas.test_splat_transform_decodes_sog: positions at 16 bits over the
    log-transformed range, log scales and DC the nearest of 256 codebook entries, opacity 8 bits,
    rotations <= 0.0125, SH through a k-means palette (values from its codebook, relative error < 0.6)."""
    from test_export_playcanvas import EPS, _same_rotation

    t = np.sign(m["means"]) * np.log1p(np.abs(m["means"]))
    half = (t.max(0) - t.min(0)) / (2 * 65535)
    r.error("means", d["means"] - m["means"], (np.abs(m["means"]) + 1) * half * 1.001 + EPS, "16 bits, log range")
    for name, key, book in (("scales", "log_scales", meta["scales"]["codebook"]), ("sh_dc", "sh_dc", meta["sh0"]["codebook"])):  # fmt: skip
        book = np.asarray(book, np.float64)
        nearest = np.abs(m[key][..., None] - book).min(-1)  # the format's quantisation: the nearest entry
        r.error(name, d[key] - m[key], nearest + EPS, f"nearest of {len(book)} codebook entries")
    r.error("opacity", _sigmoid(d["opacity_logits"]) - _sigmoid(m["opacity_logits"]), 0.5 / 255 + EPS)
    r.error("quats", _same_rotation(m["quats"], d["quats"]) - m["quats"], 0.0125)
    if m["sh_rest"].shape[2]:
        n = len(m["means"])
        r.check("sh_rest in its codebook", bool(np.isin(d["sh_rest"].astype(np.float32),
                                                        np.asarray(meta["shN"]["codebook"], np.float32)).all()),
                len(meta["shN"]["codebook"]))  # fmt: skip
        distinct = len(np.unique(d["sh_rest"].reshape(n, -1), axis=0))
        r.check("sh_rest palette size", distinct <= meta["shN"]["count"] <= n, [distinct, meta["shN"]["count"]])
        scale = np.sqrt((m["sh_rest"] ** 2).sum())
        rel = np.sqrt(((d["sh_rest"] - m["sh_rest"]) ** 2).sum()) / scale if scale > 0 else 0.0
        r.error("sh_rest", rel, 0.6, "relative (RMS over the whole palette)")


def decode_sog(path: Path, p: Params, work: Path) -> Report:
    r = Report("PlayCanvas splat-transform (npm @playcanvas/splat-transform) -> .ply, plyfile")
    d = _splat_transform(path, work)
    with zipfile.ZipFile(path) as z:
        meta = json.loads(z.read("meta.json"))
    r.count = len(d["means"])
    r.check("meta count", meta["count"] == p.count, meta["count"])
    _info_check(r, path, p)
    if r.count == p.count:
        _sog_errors(r, d, _file_order(p), meta)
    return r


def decode_compressed_ply(path: Path, p: Params, work: Path) -> Report:
    """test_export_playcanvas.test_splat_transform_decodes_compressed_ply: positions and log scales 11/10/11
    bits over their 256-gaussian chunk's range, colour 8 bits over the chunk's range, opacity 8 bits,
    rotations <= 3e-3, SH 8 bits over [-4, 4] (<= 1/32)."""
    from test_export_playcanvas import EPS, _same_rotation

    from splat_metal_method.export.gaussians import SH_C0

    r = Report("PlayCanvas splat-transform (npm @playcanvas/splat-transform) -> .ply, plyfile")
    d = _splat_transform(path, work)
    _info_check(r, path, p)
    n = r.count = len(d["means"])
    if n != p.count:
        return r
    m = _file_order(p)
    chunk = np.arange(n) // 256

    def chunk_step(values: np.ndarray, bits) -> np.ndarray:  # [N, 3] -> the half-step per value
        lo = np.stack([np.minimum.reduceat(values[:, i], np.r_[0:n:256]) for i in range(3)], 1)[chunk]
        hi = np.stack([np.maximum.reduceat(values[:, i], np.r_[0:n:256]) for i in range(3)], 1)[chunk]
        return (hi - lo) / (2 * (2.0 ** np.asarray(bits) - 1))

    r.error("means", d["means"] - m["means"], chunk_step(m["means"], [11, 10, 11]) + EPS, "11/10/11 bits a chunk")
    r.error("scales", d["log_scales"] - m["log_scales"], chunk_step(m["log_scales"], [11, 10, 11]) + EPS,
            "log scales, 11/10/11 bits a chunk")  # fmt: skip
    r.error("quats", _same_rotation(m["quats"], d["quats"]) - m["quats"], 3e-3)
    r.error("opacity", _sigmoid(d["opacity_logits"]) - _sigmoid(m["opacity_logits"]), 0.5 / 255 + EPS)
    rgb = (m["sh_dc"] * SH_C0 + 0.5).astype(np.float32).astype(np.float64)
    r.error("sh_dc", (d["sh_dc"] * SH_C0 + 0.5) - rgb, chunk_step(rgb, [8, 8, 8]) + EPS, "as RGB, 8 bits a chunk")
    if m["sh_rest"].shape[2]:
        r.error("sh_rest", d["sh_rest"] - np.clip(m["sh_rest"], -4, 4), 1 / 32 + EPS, "8 bits over [-4, 4]")
    return r


def decode_glb(path: Path, p: Params) -> Report:
    """test_export_glb.test_layout_and_values_in_gltf_axes (float32 values in glTF's y-up axes: positions,
    rotations and scales within 1e-6, opacity 1e-7, DC exact, COLOR_0 at 8 bits) and test_decoded_renders_as_the_model
    (the SH rotated back into the run's axes within 1e-5); Khronos' glTF-Validator finds no error but its
    one known miss (test_cli_writes_it_and_the_validator_finds_no_other_error)."""
    from export_readers import read_glb
    from test_export_glb import KHR, _errors_beside_the_extension_attributes, _rotation_matrices, glb_params, validate

    from splat_metal_method.export.gaussians import SH_C0
    from splat_metal_method.export.gltf_file import TO_GLTF

    r = Report("glTF 2.0 reader (tests/export_readers.read_glb) + Khronos glTF-Validator (npm gltf-validator)")
    report = validate(path)
    others = _errors_beside_the_extension_attributes(report)
    r.check("glTF-Validator", others == [] and report["issues"]["numWarnings"] == 0,
            {"version": report["validatorVersion"], "errors beside the extension's attribute names": len(others),
             "warnings": report["issues"]["numWarnings"], "first": [m["code"] for m in others[:5]]})  # fmt: skip
    glb = read_glb(path)
    a = glb["attributes"]
    n = r.count = len(a["POSITION"])
    if n != p.count:
        return r
    r.error("means", a["POSITION"] - p.means @ TO_GLTF.T, 1e-6, "glTF axes")
    scales = np.exp(p.log_scales)
    r.error("scales", (a[f"{KHR}:SCALE"] - scales) / scales, 1e-6, "relative, linear scales")
    model = _rotation_matrices(np.roll(p.quats, -1, axis=1))
    r.error("quats", _rotation_matrices(a[f"{KHR}:ROTATION"]) - TO_GLTF @ model, 1e-6, "as rotation matrices")
    r.error("opacity", a[f"{KHR}:OPACITY"][:, 0] - _sigmoid(p.opacity_logits), 1e-7)
    r.error("sh_dc", a[f"{KHR}:SH_DEGREE_0_COEF_0"] - p.raw["sh_dc"], 0, "float32")
    rgb = np.clip(0.5 + SH_C0 * p.sh_dc, 0, 1)
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)  # COLOR_0 is linear
    r.error("COLOR_0", np.abs(a["COLOR_0"] - np.concatenate([linear, _sigmoid(p.opacity_logits)[:, None]], 1)),
            0.5 / 255 + 1e-6, "linear RGB and opacity, 8 bits")  # fmt: skip
    k = p.sh_rest.shape[1]
    if k:
        kept = min(k, 15)  # band 4 is dropped (with a note)
        back = glb_params(glb, k)["features_rest"][:, :kept]
        r.error("sh_rest", back - p.sh_rest[:, :kept], 1e-5, "rotated back into the run's axes")
    return r


def decode_lod(folder: Path, p: Params, work: Path) -> Report:
    """test_export_lod.py: every chunk read by splat-transform, each level holding the count lod-meta.json
    gives (ceil(N / 4^l)), every leaf's gaussians inside its bound (1e-3), and the finest level the
    model: in one chunk, the .sog's bounds in its Morton order (test_splat_transform_reads_every_level_finest_equal_to_the_sog);
    in several, each gaussian within 1e-3 of the scene's extent of its decoded self
    (test_splat_transform_reads_small_chunks_at_the_rows_the_tree_gives)."""
    from test_export_lod import _leaves

    r = Report("PlayCanvas splat-transform (npm @playcanvas/splat-transform) per chunk -> .ply, plyfile")
    meta = json.loads((folder / "lod-meta.json").read_text())
    chunks = {name: _splat_transform(folder / name, work) for name in meta["filenames"]}
    levels = meta["lodLevels"]
    got = [0] * levels
    finest, outside = [], 0
    for leaf in _leaves(meta["tree"]):
        lo, hi = np.array(leaf["bound"]["min"]), np.array(leaf["bound"]["max"])
        for level, entry in leaf["lods"].items():
            rows = slice(entry["offset"], entry["offset"] + entry["count"])
            means = chunks[meta["filenames"][entry["file"]]]["means"][rows]
            got[int(level)] += len(means)
            outside += int(((means < lo - 1e-3) | (means > hi + 1e-3)).any(axis=1).sum())
            if level == "0":
                finest.append((entry, means))
    want = [-(-p.count // 4**i) for i in range(levels)]
    r.check("counts per level", got == meta["counts"] == want, got)
    r.check("chunks decode to the meta's count", sum(len(c["means"]) for c in chunks.values()) == meta["count"],
            meta["count"])  # fmt: skip
    r.check("gaussians outside their leaf's bound", outside == 0, outside)
    _info_check(r, folder / "lod-meta.json", p, meta["counts"])
    level0 = sorted({meta["filenames"][e["file"]] for e, _ in finest})
    r.count = got[0]
    if r.count != p.count:
        return r
    if len(level0) == 1:
        name = level0[0]
        chunk_meta = json.loads((folder / name).read_text())
        _sog_errors(r, chunks[name], _file_order(p), chunk_meta)
    else:
        from scipy.spatial import cKDTree

        distance, _ = cKDTree(np.concatenate([m for _, m in finest])).query(p.means)
        span = p.means.max(0) - p.means.min(0)
        r.error("means", distance, 1e-3 * span.max(), "distance to the nearest decoded level-0 gaussian")
    r.check("level-0 chunks", True, len(level0))
    return r


def decode(fmt: str, path: Path, p: Params, work: Path) -> Report:
    decoders: Dict[str, Callable[[], Report]] = {
        "ply": lambda: decode_ply(path, p),
        NS_EXPORT: lambda: decode_ply(path, p, "plyfile (ns-export gaussian-splat's file)"),
        "splat": lambda: decode_splat(path, p),
        "spz": lambda: decode_spz(path, p),
        "sog": lambda: decode_sog(path, p, work),
        "compressed-ply": lambda: decode_compressed_ply(path, p, work),
        "glb": lambda: decode_glb(path, p),
        "lod": lambda: decode_lod(path, p, work),
    }
    return decoders[fmt]()


# ------------------------------------------------------------------------------------------ the report
def _cell(e: Optional[dict]) -> str:
    if e is None:
        return ""
    bound = f"{'per value <= ' if e['per_value_bound'] else ''}{e['bound']:.3g}"
    return f"{e['max_error']:.3g} / {bound}{'' if e['ok'] else ' **over**'}"


def table(result: dict) -> str:
    lines = ["| format | file | bytes | decoded | " + " | ".join(ATTRIBUTES) + " | other checks | ok | decoded by |",
             "|---|---|---:|---:|" + "---:|" * len(ATTRIBUTES) + "---|---|---|"]  # fmt: skip
    for fmt, f in result["formats"].items():
        if "failed" in f or "error" in f:
            reason = f.get("failed") or f.get("error")
            what = "export failed" if "failed" in f else "not decoded"
            lines.append(f"| {fmt} | {f.get('file', '')} | {f.get('bytes', '')} | | {what}: {reason} |"
                         + " |" * (len(ATTRIBUTES) - 1) + f" | not ok | {f.get('tool', '')} |")  # fmt: skip
            continue
        extra = [f"{k} {_cell(e)}" for k, e in f["errors"].items() if k not in ATTRIBUTES]
        extra += [f"{k}: {json.dumps(c['value'])}{'' if c['ok'] else ' **not ok**'}" for k, c in f["checks"].items()]
        count = f"{f['decoded']:,}" if f["decoded"] is not None else "?"
        if f["decoded"] != f["expected"]:
            count += f" **of {f['expected']:,}**"
        lines.append(f"| {fmt} | {f['file']} | {f['bytes']:,} | {count} | "
                     + " | ".join(_cell(f["errors"].get(a)) for a in ATTRIBUTES)
                     + f" | {'; '.join(extra)} | {'ok' if f['ok'] else '**not ok**'} | {f['tool']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="the device run's results folder (decode.json/.md go there)")
    parser.add_argument("--tar", type=Path, help="the tar to decode (default RESULTS/exports.tar)")
    args = parser.parse_args(argv)
    import pytest  # the tests' tools report a failure with pytest.fail / pytest.skip

    outcome = (pytest.fail.Exception, pytest.skip.Exception)
    tar_path = args.tar or args.results / "exports.tar"
    command = shlex.join([sys.executable, *sys.argv] if argv is None else ["cuda_decode_exports.py", *argv])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cuda_decode_exports_") as tmp:
        root = Path(tmp) / "tar"
        with tarfile.open(tar_path) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(root, filter="data")
            else:  # Python without extraction filters: no absolute paths, no parent references
                assert all(not m.name.startswith("/") and ".." not in Path(m.name).parts for m in tar.getmembers())
                tar.extractall(root)
        manifest = json.loads((root / "manifest.json").read_text())
        params = Params(root / "params.npz")
        work = Path(tmp) / "work"
        work.mkdir()
        result = {"tar": str(tar_path), "command": command,
                  "run": {k: manifest.get(k) for k in ("device", "gaussians", "step", "checkpoint", "command")},
                  "params": {"gaussians": params.count, "sh_degree": params.sh_degree, "antialiased": params.antialiased},
                  "formats": {}}  # fmt: skip
        listed = dict(manifest.get("formats", {}))
        failed = dict(manifest.get("failed", {}))
        for fmt in FORMATS:
            if fmt not in listed and fmt not in failed:
                failed[fmt] = "not in the manifest"
        for fmt in [*FORMATS, NS_EXPORT, *(k for k in {**listed, **failed} if k not in (*FORMATS, NS_EXPORT))]:
            if fmt in failed:
                result["formats"][fmt] = {"ok": False, "failed": failed[fmt]}
                continue
            if fmt not in listed:
                continue
            entry = listed[fmt]
            path = root / entry["file"]
            row = {"file": entry["file"], "bytes": entry.get("bytes")}
            t = time.perf_counter()
            try:
                if not path.exists():
                    raise FileNotFoundError(f"{entry['file']} is listed in the manifest but not in the tar")
                if fmt not in (*FORMATS, NS_EXPORT):
                    raise ValueError(f"no decoder for {fmt!r}")
                row.update(decode(fmt, path, params, work).as_dict(params.count))
            except (Exception, *outcome) as e:  # noqa: BLE001 (one format's failure is its row, not the end)
                row.update(ok=False, error=f"{type(e).__name__}: {str(e).strip()[-1500:]}")
            row["seconds"] = round(time.perf_counter() - t, 1)
            result["formats"][fmt] = row
        if "left_out" in manifest:
            result["left_out"] = manifest["left_out"]
    result["ok"] = all(f["ok"] for f in result["formats"].values())
    result["seconds"] = round(time.perf_counter() - t0, 1)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "decode.json").write_text(json.dumps(result, indent=1) + "\n")
    run = result["run"]
    head = (f"{tar_path}: {params.count:,} gaussians (manifest {run['gaussians']}), SH degree {params.sh_degree}, "
            f"step {run['step']}, written on {run['device']}")  # fmt: skip
    verdict = "every format decoded within its bounds" if result["ok"] else "NOT every format decoded within its bounds"
    md = (f"# The device run's exports, decoded by the formats' own tools\n\n{head}: {verdict}.\n\n"
          "Each cell: the largest error against params.npz / its bound (the export tests' quantisation bounds).\n\n"
          f"{table(result)}\n\n"
          f"Produced by `{command}` ({result['seconds']:.0f} s)."
          + (f"\n\nLeft out of the tar: {json.dumps(result['left_out'])}" if "left_out" in result else "") + "\n")  # fmt: skip
    (args.results / "decode.md").write_text(md)
    print(f"\n{head}: {verdict}\n\n{table(result)}\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
