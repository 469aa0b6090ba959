"""splat-transform 3.x (PlayCanvas's converter, run by Node 22: tests/web_viewers.py) reads back what
``splat-metal-export`` writes, value for value as our own readers read the files:

- .ply: our values exactly; .compressed.ply and .sog: what our readers decode (the 2.7.1 tests in
  test_export_playcanvas.py bound those against the model); .splat: antimatter15's bytes as
  export_readers.read_splat reads them (its rotation bytes read as u / 127.5 - 1); .spz versions 3
  and 4: export_readers.read_spz's values, in the file's axes (2.7.1 turned y and z);
- the lod folder through its ``lod-meta.json``, one level per ``-L n``: each level the gaussians of
  that level's chunks (read_sog on each chunk);
- the render mode: ``--info`` says "antialiased" for every tagged file of an antialiased run (.ply
  ``comment SplatRenderMode: mip``, .compressed.ply, .sog and lod meta.json ``"model"``, the .spz
  flag) and "default" for the classic run's; .splat has no place for it;
- .glb: 3.10 writes it but does not read it (asserted, so docs/export.md's table stays true).
"""

from __future__ import annotations

import json

import demo_runs
import numpy as np
import pytest
import yaml
from export_readers import read_splat, read_spz
from test_export_playcanvas import _assert_same_values, _ply_values
from test_export_roundtrip import read_splat_ply
from test_export_spz_v4 import _gaussians
from web_viewers import package_version, splat_transform3, splat_transform3_info

from splat_metal_method.export.cli import ExportSplats
from splat_metal_method.export.compressed_ply_file import read_compressed_ply
from splat_metal_method.export.gltf_file import write_glb
from splat_metal_method.export.sog_file import read_sog

pytestmark = pytest.mark.timeout(900)

SH_C0 = 0.28209479177387814
FORMATS = ("ply", "splat", "spz", "sog", "compressed-ply", "glb", "lod")


def _unit(q: np.ndarray) -> np.ndarray:
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def _aligned(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """b with each row's sign flipped towards a (q and -q are one rotation)."""
    return b * np.sign((a * b).sum(1, keepdims=True) + 1e-12)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Every format of the SH-3 demo run, classic and (the same checkpoint) antialiased, .spz in
    both versions, and splat-transform 3.x's .ply of each."""
    assert package_version("@playcanvas/splat-transform").startswith("3.")
    config = demo_runs.sh3_run(tmp_path_factory)
    cfg = yaml.load(config.read_text(), Loader=yaml.Loader)
    assert cfg.pipeline.model.rasterize_mode == "classic"
    cfg.pipeline.model.rasterize_mode = "antialiased"
    root = tmp_path_factory.mktemp("splat_transform3")
    antialiased = root / "antialiased.yml"
    antialiased.write_text(yaml.dump(cfg))
    out = {}
    for mode, cfg_path in (("classic", config), ("antialiased", antialiased)):
        folder = out[mode] = root / mode
        ExportSplats(load_config=cfg_path, output_dir=folder, format=FORMATS).main()
        ExportSplats(load_config=cfg_path, output_dir=folder / "v4", format=("spz",), spz_version=4).main()
    decoded = root / "decoded"
    decoded.mkdir()
    files = {"ply": "splat.ply", "splat": "splat.splat", "spz3": "splat.spz", "spz4": "v4/splat.spz",
             "sog": "splat.sog", "compressed": "splat.compressed.ply"}  # fmt: skip
    for key, name in files.items():
        splat_transform3("-q", out["antialiased"] / name, decoded / f"{key}.ply")
    meta = read_sog(out["antialiased"] / "splat.lod" / "0_0" / "meta.json")["meta"]
    assert meta["count"] > 0
    return out, decoded, files


def test_reads_the_ply_exactly(exports):
    out, decoded, _ = exports
    ours, theirs = read_splat_ply(out["antialiased"] / "splat.ply"), read_splat_ply(decoded / "ply.ply")
    for key in ours:
        assert np.array_equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("name", ["sog", "compressed"])
def test_decodes_sog_and_compressed_ply_as_our_readers(exports, name):
    out, decoded, files = exports
    reader = read_sog if name == "sog" else read_compressed_ply
    _assert_same_values(reader(out["antialiased"] / files[name]), _ply_values(decoded / f"{name}.ply"),
                        f"splat-transform 3 vs our reader of {files[name]}")  # fmt: skip


def test_decodes_splat_as_antimatter15s_layout(exports):
    out, decoded, _ = exports
    s, p = read_splat(out["antialiased"] / "splat.splat"), read_splat_ply(decoded / "splat.ply")
    assert len(p["means"]) == len(s["means"])
    assert np.array_equal(p["means"], s["means"])
    assert np.abs(np.exp(p["scales"]) - s["scales"]).max() <= 1e-6 * s["scales"].max()
    assert np.abs(0.5 + SH_C0 * p["features_dc"] - s["rgba"][:, :3]).max() <= 1e-5
    assert np.abs(1 / (1 + np.exp(-p["opacities"][:, 0])) - s["rgba"][:, 3]).max() <= 1e-5
    # its rotation bytes as u / 127.5 - 1 (antimatter15's viewer: (u - 128) / 128, half a step apart)
    q = _unit(s["quats"] * 128 + 128 - 127.5)
    assert np.abs(_aligned(q, _unit(p["quats"])) - q).max() <= 1e-5
    assert p["features_rest"].shape[1] == 0


@pytest.mark.parametrize("version", [3, 4])
def test_decodes_spz_to_our_values(exports, version):
    """3.10 reads .spz in the file's own axes (2.7.1 turned y and z: test_export_spz_v4.py)."""
    out, decoded, files = exports
    z = read_spz(out["antialiased"] / files[f"spz{version}"])
    p = read_splat_ply(decoded / f"spz{version}.ply")
    assert z["version"] == version
    assert np.array_equal(p["means"], z["means"])
    assert np.array_equal(p["scales"], z["log_scales"])
    assert np.abs(p["features_dc"] - z["sh_dc"]).max() <= 1e-6
    a = 1 / (1 + np.exp(-p["opacities"][:, 0].astype(np.float64)))
    assert np.abs(a - 1 / (1 + np.exp(-z["opacity_logits"].astype(np.float64)))).max() <= 1e-6
    assert np.abs(_aligned(z["quats"], _unit(p["quats"])) - z["quats"]).max() <= 1e-6
    assert np.array_equal(p["features_rest"], z["sh_rest"])


def test_reads_every_lod_level_through_lod_meta_json(exports, tmp_path):
    out, _, _ = exports
    folder = out["antialiased"] / "splat.lod"
    meta = json.loads((folder / "lod-meta.json").read_text())
    info = splat_transform3_info(folder / "lod-meta.json")
    assert (info["format"], info["numLods"], info["lodCounts"]) == ("lod", meta["lodLevels"], meta["counts"])
    for level, count in enumerate(meta["counts"]):
        splat_transform3("-q", folder / "lod-meta.json", "-L", level, tmp_path / f"level{level}.ply")
        theirs = _ply_values(tmp_path / f"level{level}.ply")
        chunks = [read_sog(folder / f) for f in meta["filenames"] if f.startswith(f"{level}_")]
        ours = {k: np.concatenate([c[k] for c in chunks]) for k in theirs}
        assert len(theirs["means"]) == len(ours["means"]) == count
        order_t, order_o = np.lexsort(theirs["means"].T), np.lexsort(ours["means"].T)  # chunk order aside
        _assert_same_values({k: v[order_t] for k, v in theirs.items()}, {k: v[order_o] for k, v in ours.items()},
                            f"level {level} via lod-meta.json vs read_sog of its chunks")  # fmt: skip


@pytest.mark.parametrize(
    "name,tagged",
    [("splat.ply", True), ("splat.compressed.ply", True), ("splat.sog", True), ("splat.spz", True),
     ("v4/splat.spz", True), ("splat.lod/lod-meta.json", True), ("splat.splat", False)],
)  # fmt: skip
def test_reads_the_render_mode(exports, name, tagged):
    out, _, _ = exports
    assert splat_transform3_info(out["classic"] / name)["model"] == "default"
    assert splat_transform3_info(out["antialiased"] / name)["model"] == ("antialiased" if tagged else "default")


def test_keeps_the_render_mode_in_the_ply_it_writes(exports):
    _, decoded, files = exports
    for key in files:
        if key == "splat":
            continue
        header = (decoded / f"{key}.ply").read_bytes()[:4096]
        assert b"comment SplatRenderMode: mip\n" in header, f"{key}: no render mode in splat-transform's .ply"


def test_glb_is_not_an_input(tmp_path):
    """splat-transform 3.10 writes .glb but does not read it (fast: a 10-gaussian file)."""
    g = _gaussians(10, 0, antialiased=False)
    write_glb(g, tmp_path / "splat.glb")
    proc = splat_transform3("-q", tmp_path / "splat.glb", tmp_path / "out.ply", check=False)
    assert proc.returncode != 0 and "Unsupported input file type" in proc.stdout, proc.stdout
    assert not (tmp_path / "out.ply").exists()
