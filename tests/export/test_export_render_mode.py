"""The render mode in every format that has a place for it: a run trained with ``rasterize_mode
antialiased`` (the mip filter) is tagged as splat-transform and Brush spell it, a classic run is not:

- .ply and .compressed.ply: the header line ``comment SplatRenderMode: mip``;
- .sog: ``"model": "antialiased"`` in meta.json;
- .spz (versions 3 and 4): the header's antialiased flag (0x1), which Niantic's library reports;
- .splat has no place for it.
Tagged or not, the files hold the same gaussians (the .ply differs in that header line only, so
the classic run's .ply stays ``ns-export gaussian-splat``'s bytes: test_export_formats.py), and
splat-transform still decodes the tagged .ply, .compressed.ply and .sog. (The pinned splat-transform,
2.7.1, predates reading the tags; 3.x, which reads them, needs Node >= 22.)
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import demo_runs
import numpy as np
import pytest
import yaml
from export_readers import read_spz
from playcanvas_viewer import niantic_spz, splat_transform
from test_export_roundtrip import read_splat_ply

from splat_metal_method.export.cli import ExportSplats

pytestmark = pytest.mark.timeout(900)

FORMATS = ("ply", "splat", "spz", "sog", "compressed-ply")
TAG = b"comment SplatRenderMode: mip\n"


def _header(path: Path) -> bytes:
    data = path.read_bytes()
    return data[: data.index(b"end_header\n")]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    config = demo_runs.sh3_run(tmp_path_factory)
    cfg = yaml.load(config.read_text(), Loader=yaml.Loader)
    assert cfg.pipeline.model.rasterize_mode == "classic"
    cfg.pipeline.model.rasterize_mode = "antialiased"
    root = tmp_path_factory.mktemp("render_mode")
    antialiased = root / "antialiased.yml"
    antialiased.write_text(yaml.dump(cfg))
    out = {}
    for name, cfg_path in (("classic", config), ("antialiased", antialiased)):
        out[name] = root / name
        ExportSplats(load_config=cfg_path, output_dir=out[name], format=FORMATS).main()
        ExportSplats(load_config=cfg_path, output_dir=out[name] / "v4", format=("spz",), spz_version=4).main()
    return out


def test_ply_tagged_only_when_antialiased(exports):
    classic, tagged = exports["classic"] / "splat.ply", exports["antialiased"] / "splat.ply"
    assert b"SplatRenderMode" not in _header(classic)
    assert TAG in _header(tagged) + b"\n" and _header(tagged).count(b"SplatRenderMode") == 1
    a, b = classic.read_bytes(), tagged.read_bytes()
    assert len(b) == len(a) + len(TAG) and b.replace(TAG, b"") == a, "the tag is not the only difference"
    decoded = exports["antialiased"] / "decoded.ply"
    splat_transform(tagged, decoded)
    assert np.array_equal(read_splat_ply(decoded)["means"], read_splat_ply(classic)["means"])


def test_compressed_ply_tagged_only_when_antialiased(exports):
    classic = exports["classic"] / "splat.compressed.ply"
    tagged = exports["antialiased"] / "splat.compressed.ply"
    assert b"SplatRenderMode" not in _header(classic)
    assert (TAG in _header(tagged) + b"\n") and tagged.read_bytes().replace(TAG, b"") == classic.read_bytes()
    splat_transform(tagged, exports["antialiased"] / "compressed-decoded.ply")
    splat_transform(classic, exports["classic"] / "compressed-decoded.ply")
    a = read_splat_ply(exports["antialiased"] / "compressed-decoded.ply")
    b = read_splat_ply(exports["classic"] / "compressed-decoded.ply")
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_sog_tagged_only_when_antialiased(exports):
    metas = {}
    for name in ("classic", "antialiased"):
        with zipfile.ZipFile(exports[name] / "splat.sog") as z:
            metas[name] = json.loads(z.read("meta.json"))
    assert "model" not in metas["classic"]
    assert metas["antialiased"].pop("model") == "antialiased"
    assert metas["antialiased"] == metas["classic"]
    splat_transform(exports["antialiased"] / "splat.sog", exports["antialiased"] / "sog-decoded.ply")
    assert len(read_splat_ply(exports["antialiased"] / "sog-decoded.ply")["means"]) == metas["classic"]["count"]


@pytest.mark.parametrize("version", [3, 4])
def test_spz_flagged_only_when_antialiased(exports, version):
    where = "" if version == 3 else "v4"
    for name, flagged in (("classic", False), ("antialiased", True)):
        path = exports[name] / where / "splat.spz"
        z = read_spz(path)
        assert z["version"] == version and z["flags"] == (1 if flagged else 0), (name, z["flags"])
        assert niantic_spz(path)["antialiased"] is flagged
