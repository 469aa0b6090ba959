"""`splat-metal-export --format spz --spz-version 4`: Niantic's current .spz layout (a plain 32-byte
header, a TOC, one ZSTD frame per attribute), checked by the format's own tools:

- Niantic's spz library (nianticlabs/spz as WebAssembly, npm @adobe/spz: tests/playcanvas_viewer.py
  niantic_spz) loads our version 4 to the values our version 3 holds, and its own writer, given
  those gaussians, writes the same header, the same TOC sizes and the same ZSTD frames (rotations
  aside: it re-quantises the quaternions it decoded, one 9-bit step apart at most);
- splat-transform (PlayCanvas's converter, which reads .spz through that library) decodes it to a
  .ply with our values in its own axes (it flips y and z: it takes .spz as RUB and writes RDF);
- our test reader (tests/export_readers.read_spz, written from the format's description) reads
  both versions to the same values.
Version 3 stays the default (Spark 2.2 opens only gzip .spz).
"""

from __future__ import annotations

from pathlib import Path

import demo_runs
import numpy as np
import pytest
from cli_helpers import run_cli
from export_readers import read_spz
from playcanvas_viewer import niantic_spz, splat_transform
from test_export_formats import _console_script
from test_export_roundtrip import read_splat_ply

from splat_metal_method.export.gaussians import ExportGaussians
from splat_metal_method.export.spz_file import encode_spz

pytestmark = pytest.mark.timeout(600)

FIELDS = ("means", "log_scales", "quats", "opacity_logits", "sh_dc", "sh_rest")


def _gaussians(n: int, degree: int, antialiased: bool, seed: int = 4) -> ExportGaussians:
    rng = np.random.default_rng(seed)
    k = (degree + 1) ** 2 - 1
    return ExportGaussians(
        means=rng.normal(size=(n, 3)).astype(np.float32), log_scales=rng.uniform(-6, 0, (n, 3)).astype(np.float32),
        quats=rng.normal(size=(n, 4)).astype(np.float32), opacity_logits=rng.normal(size=n).astype(np.float32),
        sh_dc=rng.normal(size=(n, 3)).astype(np.float32), sh_rest=(0.3 * rng.normal(size=(n, k, 3))).astype(np.float32),
        sh_degree=degree, antialiased=antialiased, n_model=n, n_cropped=0, n_nonfinite=0, n_low_opacity=0,
    )  # fmt: skip


@pytest.mark.parametrize("degree", [0, 3])
def test_version_4_holds_version_3s_values(tmp_path, degree):
    g = _gaussians(500, degree, antialiased=True)
    (tmp_path / "v3.spz").write_bytes(encode_spz(g, 3).data)
    (tmp_path / "v4.spz").write_bytes(encode_spz(g, 4).data)
    v3, v4 = read_spz(tmp_path / "v3.spz"), read_spz(tmp_path / "v4.spz")
    assert (tmp_path / "v3.spz").read_bytes()[:2] == b"\x1f\x8b" and (tmp_path / "v4.spz").read_bytes()[:4] == b"NGSP"
    assert (v4["version"], v4["num_points"], v4["sh_degree"], v4["fractional_bits"], v4["flags"]) == (4, 500, degree,
                                                                                                        12, 1)  # fmt: skip
    assert (v4["num_streams"], v4["toc_byte_offset"]) == (6 if degree else 5, 32)
    sizes = [500 * 9, 500, 500 * 3, 500 * 3, 500 * 4] + ([500 * 15 * 3] if degree else [])
    assert [u for _, u in v4["toc"]] == sizes
    for key in FIELDS:
        assert np.array_equal(v3[key], v4[key]), key


def test_niantics_library_reads_ours_and_writes_the_same_file(tmp_path):
    g = _gaussians(2000, 3, antialiased=True)
    ours = tmp_path / "ours.spz"
    ours.write_bytes(encode_spz(g, 4).data)
    theirs = tmp_path / "niantic.spz"
    cloud = niantic_spz(ours, rewrite_to=theirs, version=4)
    mine = read_spz(ours)
    n = g.count
    assert (cloud["numPoints"], cloud["shDegree"], cloud["antialiased"]) == (n, 3, True)
    assert np.abs(cloud["positions"].reshape(n, 3) - mine["means"]).max() <= 1e-6
    assert np.abs(cloud["scales"].reshape(n, 3) - mine["log_scales"]).max() <= 1e-6
    assert np.abs(cloud["colors"].reshape(n, 3) - mine["sh_dc"]).max() <= 1e-5
    assert np.abs(cloud["sh"].reshape(n, 15, 3) - mine["sh_rest"]).max() <= 1e-6
    alpha = 1 / (1 + np.exp(-cloud["alphas"].astype(np.float64)))
    assert np.abs(alpha - 1 / (1 + np.exp(-mine["opacity_logits"].astype(np.float64)))).max() <= 1e-5
    assert np.abs(np.roll(cloud["rotations"].reshape(n, 4), 1, axis=1) - mine["quats"]).max() <= 1e-5  # xyzw

    data, again = ours.read_bytes(), theirs.read_bytes()
    assert data[:32] == again[:32], "Niantic's writer puts another header on the same gaussians"
    redone = read_spz(theirs)
    assert [u for _, u in redone["toc"]] == [u for _, u in mine["toc"]]
    offsets = np.cumsum([0] + [c for c, _ in mine["toc"]]) + 32 + 16 * mine["num_streams"]
    offsets_again = np.cumsum([0] + [c for c, _ in redone["toc"]]) + 32 + 16 * redone["num_streams"]
    for i, name in enumerate(("positions", "alphas", "colors", "scales", "rotations", "sh")):
        if name == "rotations":
            continue
        frame = data[offsets[i] : offsets[i + 1]]
        assert frame == again[offsets_again[i] : offsets_again[i + 1]], f"the {name} frame differs from Niantic's"
    q = redone["quats"] * np.sign((redone["quats"] * mine["quats"]).sum(1, keepdims=True))
    assert np.abs(q - mine["quats"]).max() <= 1.5 * np.sqrt(0.5) / 511  # one 9-bit step (plus the derived one)


def test_classic_is_not_flagged(tmp_path):
    path = tmp_path / "classic.spz"
    path.write_bytes(encode_spz(_gaussians(100, 1, antialiased=False), 4).data)
    assert read_spz(path)["flags"] == 0 and niantic_spz(path)["antialiased"] is False


def test_splat_transform_decodes_version_4(tmp_path):
    g = _gaussians(1000, 3, antialiased=False)
    path = tmp_path / "splat.spz"
    path.write_bytes(encode_spz(g, 4).data)
    splat_transform(path, tmp_path / "decoded.ply")
    p, z = read_splat_ply(tmp_path / "decoded.ply"), read_spz(path)
    flip = np.array([1, -1, -1], np.float32)  # splat-transform's axes: y and z turned
    assert np.abs(p["means"] - z["means"] * flip).max() <= 1e-6
    assert np.abs(p["scales"] - z["log_scales"]).max() <= 1e-6
    assert np.abs(p["features_dc"] - z["sh_dc"]).max() <= 1e-5
    qz = z["quats"] * np.array([1, 1, -1, -1], np.float32)
    qz *= np.sign((qz * p["quats"]).sum(1, keepdims=True))
    assert np.abs(p["quats"] / np.linalg.norm(p["quats"], axis=1, keepdims=True) - qz).max() <= 1e-5
    assert np.abs(np.abs(p["features_rest"]) - np.abs(z["sh_rest"])).max() <= 1e-6  # SH signs follow the axes
    assert np.abs(p["features_rest"] - z["sh_rest"]).max() > 0.1  # ... which really are turned


def test_cli_spz_version(tmp_path, tmp_path_factory):
    config = demo_runs.sh3_run(tmp_path_factory)
    script = _console_script()
    result = run_cli([script], "--load-config", config, "--output-dir", tmp_path / "v4", "--format", "spz",
                     "--spz-version", "4", timeout=600)  # fmt: skip
    assert result.returncode == 0, result.tail()
    z = read_spz(tmp_path / "v4" / "splat.spz")
    assert z["version"] == 4 and "version 4" in result.output
    default = run_cli(
        [script], "--load-config", config, "--output-dir", tmp_path / "v3", "--format", "spz", timeout=600
    )
    assert default.returncode == 0, default.tail()
    z3 = read_spz(tmp_path / "v3" / "splat.spz")
    assert z3["version"] == 3
    for key in FIELDS:
        assert np.array_equal(z[key], z3[key]), key

    bad = run_cli([script], "--load-config", config, "--output-dir", tmp_path / "v5", "--format", "spz",
                  "--spz-version", "5", timeout=600)  # fmt: skip
    assert bad.returncode != 0 and "--spz-version" in bad.output
    assert not Path(tmp_path / "v5" / "splat.spz").exists()
