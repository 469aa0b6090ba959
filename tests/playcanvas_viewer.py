"""PlayCanvas's own tools for the export tests of .sog and .compressed.ply (test_export_playcanvas.py):

- ``splat_transform(...)``: PlayCanvas's converter (npm @playcanvas/splat-transform, pinned in
  scripts/setup.sh, installed into .npm-tools), run as its command line.
- ``PlayCanvasPage``: the PlayCanvas engine (npm playcanvas, the renderer SuperSplat and its
  viewer are built on) loading a file with its own gsplat loaders (SogBundleParser for .sog,
  PlyParser for .compressed.ply) in headless Chromium (SwiftShader WebGL 2), rendering given
  cameras; the page and the files are served from a local HTTP server.
- ``SuperSplatViewer``: SuperSplat's published viewer (npm @playcanvas/supersplat-viewer, its
  standalone page as shipped) opening a file with a settings.json that places its camera, read
  back through the page's own ``window.captureFrame``.
"""

from __future__ import annotations

import base64
import functools
import http.server
import io
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import List, Sequence

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
NPM_TOOLS = REPO / ".npm-tools" / "node_modules"
SPLAT_TRANSFORM = NPM_TOOLS / ".bin" / "splat-transform"
ENGINE = NPM_TOOLS / "playcanvas" / "build" / "playcanvas.mjs"
SUPERSPLAT_VIEWER = NPM_TOOLS / "@playcanvas" / "supersplat-viewer" / "public"


def require_tools() -> None:
    missing = [str(p) for p in (SPLAT_TRANSFORM, ENGINE, SUPERSPLAT_VIEWER) if not p.exists()]
    if not shutil.which("node"):
        missing.append("node")
    if missing:
        reason = f"{', '.join(missing)} missing: scripts/setup.sh installs Node's PlayCanvas tools into .npm-tools"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


def splat_transform(*args, timeout: float = 300) -> str:
    """Runs splat-transform (overwriting, quiet, CPU only); fails the test with its output if it fails."""
    require_tools()
    cmd = [str(SPLAT_TRANSFORM), "-w", "-g", "cpu", *map(str, args)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return proc.stdout


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><style>html,body{margin:0;background:#000}</style></head>
<body><canvas id="c"></canvas>
<script type="module">
import * as pc from './playcanvas.mjs';
const frames = (app, n) => new Promise(res => {
  let k = 0;
  const f = () => { if (++k >= n) { app.off('frameend', f); res(); } };
  app.on('frameend', f);
});
// url: the splat file; cams: [{c2w: 16 numbers, column-major, OpenGL axes}, fovY (degrees), width, height];
// background: [r, g, b] in 0..1. Resolves to one PNG data URL per camera.
window.renderSplat = async (url, cams, background) => {
  const canvas = document.getElementById('c');
  canvas.width = cams[0].width; canvas.height = cams[0].height;
  const device = await pc.createGraphicsDevice(canvas, { deviceTypes: [pc.DEVICETYPE_WEBGL2], antialias: false,
                                                         preserveDrawingBuffer: true, alpha: false });
  device.maxPixelRatio = 1;
  const opts = new pc.AppOptions();
  opts.graphicsDevice = device;
  opts.componentSystems = [pc.CameraComponentSystem, pc.GSplatComponentSystem];
  opts.resourceHandlers = [pc.TextureHandler, pc.GSplatHandler];
  const app = new pc.AppBase(canvas);
  app.init(opts);
  app.setCanvasFillMode(pc.FILLMODE_NONE);
  app.start();
  const camera = new pc.Entity('camera');
  camera.addComponent('camera', { clearColor: new pc.Color(background[0], background[1], background[2], 1),
                                  nearClip: 0.01, farClip: 1000 });
  app.root.addChild(camera);
  const asset = new pc.Asset('splat', 'gsplat', { url });
  app.assets.add(asset);
  await new Promise((res, rej) => { asset.once('load', res); asset.once('error', rej); app.assets.load(asset); });
  const splat = new pc.Entity('splat');
  splat.addComponent('gsplat', { asset });
  app.root.addChild(splat);
  const out = [];
  for (const cam of cams) {
    app.resizeCanvas(cam.width, cam.height);
    canvas.width = cam.width; canvas.height = cam.height;
    camera.camera.fov = cam.fovY;
    const m = new pc.Mat4(); m.set(cam.c2w);
    camera.setPosition(m.getTranslation());
    camera.setRotation(new pc.Quat().setFromMat4(m));
    await frames(app, 20);  // the depth sort runs in a worker: let it finish
    await new Promise(res => setTimeout(res, 300));
    await frames(app, 5);
    out.push(canvas.toDataURL('image/png'));
  }
  return out;
};
window.pageReady = true;
</script></body></html>
"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def end_headers(self):
        self.send_header("Cache-Control", "no-store")
        super().end_headers()


class PlayCanvasPage:
    """The page and the files to render, served over HTTP from ``folder`` (the engine is linked in)."""

    def __init__(self, folder: Path, browser):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "index.html").write_text(PAGE)
        engine = folder / "playcanvas.mjs"
        if not engine.exists():
            engine.symlink_to(ENGINE)
        handler = functools.partial(_Quiet, directory=str(folder))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.browser = browser

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    def render(self, name: str, cameras: Sequence[dict], background: Sequence[float]) -> List[np.ndarray]:
        """Renders folder/name for each camera ({c2w [4, 4], fov_y (degrees), width, height});
        returns RGB float images in [0, 1], [H, W, 3]."""
        from PIL import Image

        driver = self.browser.driver
        driver.get(self.url + "index.html")
        driver.set_script_timeout(240)
        for _ in range(200):
            if driver.execute_script("return window.pageReady === true"):
                break
            import time

            time.sleep(0.1)
        cams = [{"c2w": [float(v) for v in np.asarray(c["c2w"], np.float64).T.reshape(-1)], "fovY": float(c["fov_y"]),
                 "width": int(c["width"]), "height": int(c["height"])} for c in cameras]  # fmt: skip
        urls = driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "window.renderSplat(arguments[0], arguments[1], arguments[2]).then(done, e => done('error: ' + e));",
            name, cams, [float(b) for b in background],
        )  # fmt: skip
        if isinstance(urls, str):
            logs = ""
            try:
                logs = "\n".join(str(e) for e in driver.get_log("browser"))[-3000:]
            except Exception:
                pass
            pytest.fail(f"the PlayCanvas page could not render {name}: {urls}\n{logs}")
        images = []
        for data_url in urls:
            png = base64.b64decode(data_url.split(",", 1)[1])
            images.append(np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), np.float32) / 255)
        return images

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def look_at(position, target, up=(0.0, 1.0, 0.0)) -> np.ndarray:
    """[4, 4] camera-to-world of a camera at ``position`` looking at ``target`` (OpenGL axes: the
    camera looks down its -z, +y up), as PlayCanvas's Mat4.setLookAt builds it."""
    p, t, u = (np.asarray(v, np.float64) for v in (position, target, up))
    z = p - t
    z /= np.linalg.norm(z)
    x = np.cross(u, z)
    x /= np.linalg.norm(x)
    y = np.cross(z, x)
    m = np.eye(4)
    m[:3, 0], m[:3, 1], m[:3, 2], m[:3, 3] = x, y, z, p
    return m


# SuperSplat shows a .ply's data turned 180 degrees about z (its y points down, as COLMAP's): the
# viewer's world is this matrix times the file's coordinates.
SUPERSPLAT_WORLD = np.diag([-1.0, -1.0, 1.0, 1.0])


class SuperSplatViewer(PlayCanvasPage):
    """SuperSplat's viewer page (``index.html?content=...&settings=...&noui&noanim&nofx&webgl``)."""

    def __init__(self, folder: Path, browser):
        super().__init__(folder, browser)
        for name in ("index.html", "index.js", "index.css"):
            target = folder / "viewer" / name
            target.parent.mkdir(exist_ok=True)
            if not target.exists():
                target.symlink_to(SUPERSPLAT_VIEWER / name)

    def capture(self, name: str, position, target, fov_x: float, width: int, height: int,
                background: Sequence[float]) -> np.ndarray:  # fmt: skip
        """The viewer's frame (RGB float [H, W, 3]) of folder/name from a camera at ``position``
        looking at ``target`` (the viewer's world, +y up) with horizontal field of view ``fov_x``
        degrees (captureFrame renders with a horizontal fov when width >= height)."""
        import json
        import time

        assert width >= height
        settings = {
            "version": 2, "tonemapping": "none", "highPrecisionRendering": False,
            "background": {"color": [float(b) for b in background]},
            "postEffectSettings": {
                "sharpness": {"enabled": False, "amount": 0},
                "bloom": {"enabled": False, "intensity": 1, "blurLevel": 2},
                "grading": {"enabled": False, "brightness": 0, "contrast": 1, "saturation": 1, "tint": [1, 1, 1]},
                "vignette": {"enabled": False, "intensity": 0.5, "inner": 0.3, "outer": 0.75, "curvature": 1},
                "fringing": {"enabled": False, "intensity": 0.5},
            },
            "animTracks": [], "annotations": [], "startMode": "default",
            "cameras": [{"initial": {"position": [float(v) for v in position], "target": [float(v) for v in target],
                                     "fov": float(fov_x)}}],
        }  # fmt: skip
        (self.folder / "settings.json").write_text(json.dumps(settings))
        driver = self.browser.driver
        driver.set_window_size(width + 16, height + 120)
        driver.get(f"{self.url}viewer/index.html?content=../{name}&settings=../settings.json&noui&noanim&nofx&webgl")
        deadline = time.monotonic() + 120
        while not driver.execute_script("return typeof window.captureFrame === 'function'"):
            if time.monotonic() > deadline:
                logs = ""
                try:
                    logs = "\n".join(str(e) for e in driver.get_log("browser"))[-3000:]
                except Exception:
                    pass
                pytest.fail(f"SuperSplat's viewer showed no first frame of {name} in 120 s\n{logs}")
            time.sleep(0.25)
        time.sleep(2)  # the sort worker's first pass
        result = driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "window.captureFrame({width: arguments[0], height: arguments[1], supersample: 1})"
            ".then(r => done([r.width, r.height, r.data]), e => done('error: ' + e));",
            width, height,
        )  # fmt: skip
        if isinstance(result, str):
            pytest.fail(f"SuperSplat's viewer could not capture {name}: {result}")
        w, h, data = result
        rgba = np.frombuffer(base64.b64decode(data), np.uint8).reshape(h, w, 4)
        return rgba[..., :3].astype(np.float32) / 255
