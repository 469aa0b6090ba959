"""CesiumJS (npm cesium, tests/web_viewers.py) opening our .glb (glTF 2.0 with KHR_gaussian_splatting)
in a 3D Tiles 1.1 tileset, in headless Chromium (SwiftShader WebGL 2): it cannot draw it, and these
tests pin exactly what it does so that docs/export.md's table stays true.

CesiumJS 1.145 draws gaussian splats only from glTF that carries the SPZ compression sub-extension
(its GaussianSplat3DTileContent is chosen when the tileset requires both KHR_gaussian_splatting and
KHR_gaussian_splatting_compression_spz_2, and reads the attributes SPZ decoding produces). Our .glb
(like splat-transform 3.10's) stores the attributes uncompressed:

- a tileset that declares what the file requires (KHR_gaussian_splatting): Cesium loads the tile as a
  plain glTF model, and its shader for it does not compile (the extension's attribute names, with
  ':', become GLSL identifiers; 19 attributes for SH degree 3, over WebGL's 16): rendering stops,
  nothing is drawn;
- a tileset that also declares the SPZ sub-extension: the splat content fails to load the tile, no
  SPZ-decoded attributes to read.

The control, so that "nothing drawn" means something: the same glTF JSON with its attributes moved
into the SPZ sub-extension (our .spz version 3 of the same gaussians as its one buffer view, the
accessors without data, as the sub-extension defines them) is loaded as splats and drawn by the same
page under SwiftShader. Only "drew non-empty splats" is checked there, no PSNR: that file is built
here for the check, not one the exporter writes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from export_readers import read_glb
from test_export_spz_v4 import _gaussians
from web_viewers import CesiumPage, chromium_site, package_version, tileset_json

from splat_metal_method.export.gltf_file import write_glb
from splat_metal_method.export.spz_file import encode_spz

pytestmark = pytest.mark.timeout(600)

SPZ_2 = "KHR_gaussian_splatting_compression_spz_2"


@pytest.fixture
def cesium(tmp_path):
    browser, site = chromium_site(tmp_path)
    g = _gaussians(200, 3, antialiased=False)
    write_glb(g, site.folder / "splat.glb")
    (site.folder / "splat.spz").write_bytes(encode_spz(g, 3).data)
    yield CesiumPage(site)
    site.close()
    browser.quit()


def test_declared_as_it_is_cesium_takes_it_for_a_model_it_cannot_draw(cesium):
    assert package_version("cesium") == "1.145.0"
    (cesium.site.folder / "tileset.json").write_text(json.dumps(tileset_json("splat.glb", 4.0)))
    report = cesium.open("tileset.json")
    assert report["failed"] == [] and report["loaded"] == 1, report
    assert report["splats"] is False  # not Cesium's gaussian splat content
    assert "Fragment shader failed to compile" in (report["renderError"] or ""), report["renderError"]
    assert report["image"].max() == 0, "something was drawn"


def test_declared_spz_compressed_cesium_fails_to_load_it(cesium):
    required = ("KHR_gaussian_splatting", SPZ_2)
    (cesium.site.folder / "tileset.json").write_text(json.dumps(tileset_json("splat.glb", 4.0, required)))
    report = cesium.open("tileset.json")
    assert report["loaded"] == 0 and report["failed"] == ["Cannot read properties of undefined (reading 'slice')"], (
        report
    )
    assert report["image"].max() == 0, "something was drawn"


def _spz_compressed(glb: Path, spz: bytes) -> bytes:
    """glb's glTF with its attributes' data replaced by the SPZ sub-extension over ``spz`` (the GLB
    container as the glTF specification lays it out: 12-byte header, padded JSON and BIN chunks)."""
    gltf = read_glb(glb)["json"]
    for accessor in gltf["accessors"]:
        accessor.pop("bufferView", None)
        accessor.pop("byteOffset", None)
    binary = spz + bytes(-len(spz) % 4)
    gltf["buffers"] = [{"byteLength": len(binary)}]
    gltf["bufferViews"] = [{"buffer": 0, "byteOffset": 0, "byteLength": len(spz)}]
    primitive = gltf["meshes"][0]["primitives"][0]
    primitive["extensions"]["KHR_gaussian_splatting"]["extensions"] = {SPZ_2: {"bufferView": 0}}
    gltf["extensionsUsed"] = gltf["extensionsRequired"] = ["KHR_gaussian_splatting", SPZ_2]
    text = json.dumps(gltf).encode()
    text += b" " * (-len(text) % 4)
    body = struct.pack("<II", len(text), 0x4E4F534A) + text + struct.pack("<II", len(binary), 0x004E4942) + binary
    return struct.pack("<III", 0x46546C67, 2, 12 + len(body)) + body


def test_control_the_same_gaussians_spz_compressed_are_drawn(cesium):
    folder = cesium.site.folder
    (folder / "control.glb").write_bytes(_spz_compressed(folder / "splat.glb", (folder / "splat.spz").read_bytes()))
    required = ("KHR_gaussian_splatting", SPZ_2)
    (folder / "tileset.json").write_text(json.dumps(tileset_json("control.glb", 4.0, required)))
    report = cesium.open("tileset.json")
    assert report["failed"] == [] and report["loaded"] == 1 and report["renderError"] is None, report
    assert report["splats"] is True
    drawn = (report["image"].max(-1) > 0).mean()
    assert drawn > 0.005, f"Cesium drew {drawn:.2%} of the frame"
    print(f"CesiumJS drew the SPZ-compressed control on {drawn:.1%} of the frame")
