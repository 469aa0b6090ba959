"""PlayCanvas's own tools for the export tests of .sog and .compressed.ply (test_export_playcanvas.py):

- ``splat_transform(...)``: PlayCanvas's converter (npm @playcanvas/splat-transform, pinned in
  scripts/setup.sh, installed into .npm-tools), run as its command line.
- ``niantic_spz(...)``: Niantic's spz library (nianticlabs/spz built to WebAssembly as npm
  @adobe/spz, the reader and writer splat-transform itself uses for .spz) loading an .spz as its
  ``loadSpzFromBuffer`` does, and writing the same gaussians back with its ``saveSpzToBuffer``.
- ``SuperSplatViewer``: SuperSplat's published viewer (npm @playcanvas/supersplat-viewer, its
  standalone page as shipped, the PlayCanvas engine inside: SogBundleParser for .sog, PlyParser
  for .ply and .compressed.ply) in headless Chromium (SwiftShader WebGL 2), opening a file with a
  settings.json that places its camera, read back through the page's own ``window.captureFrame``;
  the page and the files are served from a local HTTP server.
"""

from __future__ import annotations

import base64
import functools
import http.server
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
NPM_TOOLS = REPO / ".npm-tools" / "node_modules"
SPLAT_TRANSFORM = NPM_TOOLS / ".bin" / "splat-transform"
SUPERSPLAT_VIEWER = NPM_TOOLS / "@playcanvas" / "supersplat-viewer" / "public"


def require_tools() -> None:
    missing = [str(p) for p in (SPLAT_TRANSFORM, SUPERSPLAT_VIEWER) if not p.exists()]
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


_NIANTIC_SPZ_JS = r"""
import fs from 'fs';
const [tools, input, output, version] = process.argv.slice(1);
const spz = await (await import(`${tools}/@adobe/spz/dist/spz.js`)).default();
const none = spz.CoordinateSystem.UNSPECIFIED;  // the values as stored, no axis flip
const cloud = spz.loadSpzFromBuffer(new Uint8Array(fs.readFileSync(input)), {to: none});
const keys = ['positions', 'scales', 'rotations', 'alphas', 'colors', 'sh'];
const out = {numPoints: cloud.numPoints, shDegree: cloud.shDegree, antialiased: cloud.antialiased};
for (const k of keys) out[k] = Array.from(cloud[k]);
if (output) fs.writeFileSync(output, spz.saveSpzToBuffer(cloud, {version: Number(version), from: none,
                                                                  sh1Bits: 5, shRestBits: 4}));
process.stdout.write("\nCLOUD " + JSON.stringify(out) + "\n");
"""


def niantic_spz(path: Path, rewrite_to: Path = None, version: int = 4) -> dict:
    """An .spz as Niantic's library loads it: numPoints, shDegree, antialiased and the float arrays
    (positions [N*3], scales [N*3] log, rotations [N*4] xyzw, alphas [N] logit, colors [N*3] DC,
    sh [N*D*3] coefficient-major). ``rewrite_to``: its writer saves the loaded gaussians there as
    ``version``."""
    import json

    require_tools()
    cmd = ["node", "--input-type=module", "-e", _NIANTIC_SPZ_JS, str(NPM_TOOLS), str(path),
           str(rewrite_to or ""), str(version)]  # fmt: skip
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"@adobe/spz could not load {path} ({proc.returncode}):\n{proc.stderr[-3000:]}")
    cloud = next(line[6:] for line in proc.stdout.splitlines() if line.startswith("CLOUD "))  # among its log lines
    return {k: np.asarray(v, np.float32) if isinstance(v, list) else v for k, v in json.loads(cloud).items()}


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def end_headers(self):
        self.send_header("Cache-Control", "no-store")
        super().end_headers()


class LocalSite:
    """Files served over HTTP from ``folder`` on 127.0.0.1 (a free port), for ``browser``."""

    def __init__(self, folder: Path, browser):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        handler = functools.partial(_Quiet, directory=str(folder))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.browser = browser

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

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


class SuperSplatViewer(LocalSite):
    """SuperSplat's viewer page (``index.html?content=...&settings=...&noui&noanim&nofx&webgl``)."""

    def __init__(self, folder: Path, browser):
        super().__init__(folder, browser)
        browser.driver.set_script_timeout(120)
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
