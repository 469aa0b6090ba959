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
"""

from __future__ import annotations

import json

import pytest
from test_export_spz_v4 import _gaussians
from web_viewers import CesiumPage, chromium_site, package_version, tileset_json

from splat_metal_method.export.gltf_file import write_glb

pytestmark = pytest.mark.timeout(600)

SPZ_2 = "KHR_gaussian_splatting_compression_spz_2"


@pytest.fixture
def cesium(tmp_path):
    browser, site = chromium_site(tmp_path)
    g = _gaussians(200, 3, antialiased=False)
    write_glb(g, site.folder / "splat.glb")
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
