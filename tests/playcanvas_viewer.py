"""PlayCanvas's own tools for the export tests of .sog and .compressed.ply (test_export_playcanvas.py):

- ``splat_transform(...)``: PlayCanvas's converter (npm @playcanvas/splat-transform, pinned in
  scripts/setup.sh, installed into .npm-tools), run as its command line.
- ``PlayCanvasPage``: the PlayCanvas engine (npm playcanvas, the renderer SuperSplat and its
  viewer are built on) loading a file with its own gsplat loaders (SogBundleParser for .sog,
  PlyParser for .compressed.ply) in headless Chromium (SwiftShader WebGL 2), rendering given
  cameras; the page and the files are served from a local HTTP server.
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


def require_tools() -> None:
    missing = [str(p) for p in (SPLAT_TRANSFORM, ENGINE) if not p.exists()]
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
