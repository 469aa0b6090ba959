"""The tools of tests/export/test_export_viewers_*.py, installed by scripts/setup.sh into
.npm-tools-node22 (git-ignored; beside .npm-tools, whose splat-transform 2.7.1 runs on Node 20 and
has the same package name):

- ``splat_transform3(...)``: PlayCanvas's converter 3.x (npm @playcanvas/splat-transform) run by
  Node 22 (npm ``node``, the binary it ships), which 3.x needs;
- ``SPARK``: Spark's browser module (npm @sparkjsdev/spark, three.js inside its page);
- ``CESIUM``: CesiumJS's built library (npm cesium, Build/Cesium), which draws glTF
  ``KHR_gaussian_splatting`` inside 3D Tiles.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / ".npm-tools-node22" / "node_modules"
NODE22 = TOOLS / ".bin" / "node"
SPLAT_TRANSFORM3 = TOOLS / "@playcanvas" / "splat-transform" / "bin" / "cli.mjs"
SPARK = TOOLS / "@sparkjsdev" / "spark"
THREE = TOOLS / "three"
CESIUM = TOOLS / "cesium" / "Build" / "Cesium"


def require(*paths: Path) -> None:
    """Skips (fails on CI, where scripts/setup.sh installs them) when a tool is missing."""
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        reason = f"{', '.join(missing)} missing: scripts/setup.sh installs them into .npm-tools-node22"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


def chromium_site(tmp_path: Path):
    """Headless Chromium (tests/browser.py) and a playcanvas_viewer.LocalSite in tmp_path/site for it;
    skips (fails on CI) without Debian's chromium and chromedriver. The caller closes both."""
    import browser as test_browser
    from playcanvas_viewer import LocalSite

    if not all(os.path.exists(p) for p in (test_browser.CHROMIUM, test_browser.CHROMEDRIVER)):
        reason = "chromium / chromedriver missing: scripts/setup.sh installs them"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    browser = test_browser.Browser(tmp_path / "chromium-profile")
    return browser, LocalSite(tmp_path / "site", browser)


def _load_page(site, page: str, ready: str, what: str) -> None:
    """Opens site/page and waits (60 s at most) until the JavaScript expression ``ready`` is true."""
    driver = site.browser.driver
    driver.set_script_timeout(120)
    driver.get(site.url + page)
    deadline = time.monotonic() + 60
    while not driver.execute_script(f"return {ready}"):
        if time.monotonic() > deadline:
            logs = "\n".join(str(e) for e in driver.get_log("browser"))[-3000:]
            pytest.fail(f"{what} did not load in 60 s\n{logs}")
        time.sleep(0.25)


def package_version(name: str) -> str:
    return json.loads((TOOLS / name / "package.json").read_text())["version"]


def splat_transform3(*args, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs splat-transform 3.x (overwriting, CPU only) under Node 22; with ``check`` a failure fails
    the test with its output."""
    require(NODE22, SPLAT_TRANSFORM3)
    cmd = [str(NODE22), str(SPLAT_TRANSFORM3), "-w", "-g", "cpu", *map(str, args)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return proc


def splat_transform3_info(path: Path) -> dict:
    """What splat-transform 3.x reads of a file: ``--info json`` (format, counts per level, SH bands,
    "model": "antialiased" or "default")."""
    out = splat_transform3("-q", path, "--info", "json", "null").stdout
    return json.loads(out[out.index("{") : out.rindex("}") + 1])


SPARK_PAGE = """<!doctype html>
<html><head><meta charset="utf-8">
<script type="importmap">{"imports": {"three": "./three/build/three.module.js",
                                      "three/addons/": "./three/examples/jsm/",
                                      "@sparkjsdev/spark": "./spark/dist/spark.module.js"}}</script>
</head><body style="margin:0">
<script type="module">
import * as THREE from "three";
import {SparkRenderer, SplatMesh} from "@sparkjsdev/spark";
// window.sparkRender(url, c2w (16, column-major), fovY degrees, width, height, [r, g, b]):
// a data URL of the frame once Spark has decoded and sorted the file, or "error: ..." (what Spark threw)
window.sparkRender = async (url, c2w, fovY, width, height, background) => {
  try {
    const renderer = new THREE.WebGLRenderer({antialias: false, preserveDrawingBuffer: true});
    renderer.setPixelRatio(1);
    renderer.setSize(width, height);
    renderer.setClearColor(new THREE.Color().setRGB(...background, THREE.SRGBColorSpace), 1);
    document.body.replaceChildren(renderer.domElement);
    const scene = new THREE.Scene();
    scene.add(new SparkRenderer({renderer}));
    const mesh = new SplatMesh({url});
    scene.add(mesh);
    await mesh.initialized;
    const camera = new THREE.PerspectiveCamera(fovY, width / height, 0.01, 1000);
    camera.matrixAutoUpdate = false;
    camera.matrix.fromArray(c2w);
    camera.matrixWorld.copy(camera.matrix);
    camera.matrixWorldInverse.copy(camera.matrix).invert();
    for (let i = 0; i < 60; i++) {  // Spark sorts in a worker: frames until the order settles
      renderer.render(scene, camera);
      await new Promise(r => setTimeout(r, 50));
    }
    return {numSplats: mesh.packedSplats.numSplats, image: renderer.domElement.toDataURL("image/png")};
  } catch (e) {
    return "error: " + (e && e.message ? e.message : e);
  }
};
window.sparkReady = true;
</script></body></html>
"""


class SparkPage:
    """Spark's page (SPARK_PAGE) served from ``site.folder`` (a playcanvas_viewer.LocalSite) with the
    tools linked beside the files it opens."""

    def __init__(self, site):
        require(SPARK / "dist" / "spark.module.js", THREE / "build" / "three.module.js")
        self.site = site
        for name, target in (("three", THREE), ("spark", SPARK)):
            if not (site.folder / name).exists():
                (site.folder / name).symlink_to(target)
        (site.folder / "spark.html").write_text(SPARK_PAGE)
        _load_page(site, "spark.html", "window.sparkReady === true", "Spark's module")

    def render(self, name: str, c2w: np.ndarray, fov_y: float, width: int, height: int, background):
        """(number of splats Spark loaded, RGB float [H, W, 3]) of folder/name seen by a camera with
        camera-to-world ``c2w`` [4, 4] (OpenGL axes, as three.js and nerfstudio) and vertical field
        of view ``fov_y`` degrees; or the error Spark raised, as a string."""
        result = self.site.browser.driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "window.sparkRender(arguments[0], arguments[1], arguments[2], arguments[3], arguments[4], arguments[5])"
            ".then(done);",
            name, np.asarray(c2w, np.float64).T.flatten().tolist(), fov_y, width, height, [float(b) for b in background],
        )  # fmt: skip
        if isinstance(result, str):
            return result
        from PIL import Image

        png = base64.b64decode(result["image"].split(",", 1)[1])
        rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), np.float32) / 255
        return result["numSplats"], rgb


CESIUM_PAGE = """<!doctype html>
<html><head><meta charset="utf-8">
<script>window.CESIUM_BASE_URL = "./cesium/";</script>
<script src="./cesium/Cesium.js"></script>
</head><body style="margin:0"><div id="view" style="width:WIDTHpx;height:HEIGHTpx"></div>
<script>
// window.cesiumOpen(url): a CesiumWidget without globe, imagery or sky (nothing from the network)
// opens the 3D Tiles tileset at url, looks at its bounding sphere, and reports what happened:
// {loaded: tiles loaded, failed: [each tile's error message], splats: whether the content is
// Cesium's Gaussian splat content, renderError: the error that stopped rendering (or null),
// image: a data URL of the frame}
window.cesiumOpen = async (url) => {
  const widget = new Cesium.CesiumWidget("view", {
    globe: false, baseLayer: false, skyBox: false, skyAtmosphere: false, shadows: false,
    contextOptions: {requestWebgl1: false, webgl: {preserveDrawingBuffer: true, antialias: false}},
  });
  widget.scene.backgroundColor = Cesium.Color.BLACK;
  const report = {loaded: 0, failed: [], splats: false, renderError: null};
  widget.scene.renderError.addEventListener((scene, e) => { report.renderError = String(e && e.message ? e.message : e); });
  try {
    const tileset = await Cesium.Cesium3DTileset.fromUrl(url);
    tileset.tileLoad.addEventListener((tile) => {
      report.loaded += 1;
      report.splats = !!tile.content && "sphericalHarmonicsDegree" in tile.content;  // its splat content
    });
    tileset.tileFailed.addEventListener((e) => report.failed.push(e.message));
    widget.scene.primitives.add(tileset);
    widget.camera.viewBoundingSphere(tileset.boundingSphere);
    const start = performance.now();
    while (report.loaded + report.failed.length === 0 && performance.now() - start < 60000) {
      await new Promise(r => setTimeout(r, 100));
    }
    for (let i = 0; i < 30 && !report.renderError; i++) {  // frames for the content to be built and drawn
      widget.scene.render();
      await new Promise(r => setTimeout(r, 100));
    }
  } catch (e) {
    report.failed.push("fromUrl: " + (e && e.message ? e.message : e));
  }
  report.image = widget.canvas.toDataURL("image/png");
  return report;
};
window.cesiumReady = true;
</script></body></html>
"""


def tileset_json(content: str, radius: float, required=("KHR_gaussian_splatting",)) -> dict:
    """A 3D Tiles 1.1 tileset whose one tile is the glTF ``content`` (at the origin, bounded by a
    sphere of ``radius``), declaring the glTF extensions its content requires (3DTILES_content_gltf)."""
    return {
        "asset": {"version": "1.1"},
        "extensionsUsed": ["3DTILES_content_gltf"],
        "extensions": {"3DTILES_content_gltf": {"extensionsUsed": list(required), "extensionsRequired": list(required)}},
        "geometricError": 1000.0,
        "root": {"boundingVolume": {"sphere": [0.0, 0.0, 0.0, float(radius)]}, "geometricError": 0.0,
                 "refine": "ADD", "content": {"uri": content}},
    }  # fmt: skip


class CesiumPage:
    """CESIUM_PAGE served from ``site.folder`` (a playcanvas_viewer.LocalSite), CesiumJS linked beside."""

    def __init__(self, site, width: int = 256, height: int = 192):
        require(CESIUM / "Cesium.js")
        self.site = site
        if not (site.folder / "cesium").exists():
            (site.folder / "cesium").symlink_to(CESIUM)
        page = CESIUM_PAGE.replace("WIDTH", str(width)).replace("HEIGHT", str(height))
        (site.folder / "cesium.html").write_text(page)
        _load_page(site, "cesium.html", "window.cesiumReady === true && typeof Cesium === 'object'", "CesiumJS")

    def open(self, tileset: str) -> dict:
        """cesiumOpen's report, the frame as RGB float [H, W, 3] under "image"."""
        from PIL import Image

        driver = self.site.browser.driver
        driver.get(self.site.url + "cesium.html")
        report = driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "const wait = () => window.cesiumReady ? window.cesiumOpen(arguments[0]).then(done) : setTimeout(wait, 100);"
            "wait();",
            tileset,
        )  # fmt: skip
        png = base64.b64decode(report["image"].split(",", 1)[1])
        report["image"] = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), np.float32) / 255
        return report
