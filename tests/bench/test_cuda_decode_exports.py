"""benchmarks/cuda_decode_exports.py, which decodes the GPU machine's exports.tar here with the formats'
owners' tools, on the tar cuda_device_run.pack_exports (the device run's own packer) writes from the cached
12-step SH-3 demo run on CPU: every format decodes within its bounds with the errors its quantisation makes
(zero for the .ply files, nonzero wherever the format quantises), and planted faults fail it: one gaussian of
params.npz moved by 0.1 fails every format; an .spz of other gaussians fails the .spz alone, and a format
the manifest lists as failed is reported failed; either exits 1. The first test runs the script's command line,
the planted ones its main() in this process (the helpers' torch and nerfstudio already imported: ~5 s less each)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import demo_runs
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests" / "export")]

import cuda_decode_exports  # noqa: E402
import cuda_device_run  # noqa: E402

pytestmark = pytest.mark.timeout(900)

SCRIPT = ROOT / "benchmarks" / "cuda_decode_exports.py"
FORMATS = ("ply", "splat", "spz", "sog", "compressed-ply", "glb", "lod")
# Where each format quantises (its decoded values must differ from params.npz there) and where it stores
# float32 as it is (no error): the .ply files store every value as it is; the .glb all but COLOR_0.
QUANTISED = {
    "splat": ("quats", "opacity", "sh_dc"),
    "spz": ("means", "scales", "quats", "opacity", "sh_dc", "sh_rest"),
    "sog": ("means", "scales", "quats", "opacity", "sh_dc", "sh_rest"),
    "compressed-ply": ("means", "scales", "quats", "opacity", "sh_dc", "sh_rest"),
    "lod": ("means", "scales", "quats", "opacity", "sh_dc", "sh_rest"),
    "glb": ("COLOR_0",),
}
EXACT = {"ply": ("means", "scales", "quats", "opacity", "sh_dc", "sh_rest"), "glb": ("means", "sh_dc")}


def _decode(results: Path):
    """The script's command line, as it is run after a device run."""
    cmd = [sys.executable, str(SCRIPT), str(results)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    decoded = json.loads((results / "decode.json").read_text()) if (results / "decode.json").exists() else None
    return proc, decoded


def _decode_here(results: Path, tar: Path):
    """The script's main() in this process (torch and nerfstudio, which its test helpers import, already
    loaded): its exit status and decode.json."""
    status = cuda_decode_exports.main([str(results), "--tar", str(tar)])
    return status, json.loads((results / "decode.json").read_text())


def _repack(tar: Path, out: Path, edit) -> Path:
    """A copy of ``tar`` whose members ``edit({name: bytes})`` changes (it returns the new dict)."""
    with tarfile.open(tar) as t:
        members = {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}
    members = edit(members)
    with tarfile.open(out, "w") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return out


def _npz(members: dict) -> dict:
    with np.load(io.BytesIO(members["params.npz"])) as z:
        return {k: z[k] for k in z.files}


def _npz_bytes(params: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **params)
    return buf.getvalue()


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    from playcanvas_viewer import require_tools
    from test_export_glb import VALIDATOR, _require
    from web_viewers import NODE22, SPLAT_TRANSFORM3, require

    require_tools()  # splat-transform 2.7, @adobe/spz (node); the glTF validator; splat-transform 3.x (Node 22)
    _require(VALIDATOR)
    require(NODE22, SPLAT_TRANSFORM3)
    config = demo_runs.sh3_run(tmp_path_factory)
    base = tmp_path_factory.mktemp("cuda_decode")
    results = base / "results"
    results.mkdir()
    manifest = cuda_device_run.pack_exports(config, results / "exports.tar", base / "pack",
                                            cuda_device_run.commands_env(), "cpu")  # fmt: skip
    assert manifest["failed"] == {} and set(FORMATS) <= set(manifest["formats"]), manifest
    return base, results, manifest


def test_every_format_decodes_within_its_bounds(packed):
    _, results, manifest = packed
    proc, decoded = _decode(results)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    formats = decoded["formats"]
    assert set(formats) == set(manifest["formats"]), sorted(formats)  # ns-export's .ply too where open3d is
    n = manifest["gaussians"]
    assert decoded["ok"] and decoded["params"] == {"gaussians": n, "sh_degree": 3, "antialiased": False}
    for fmt, row in formats.items():
        assert row["ok"] and row["decoded"] == n, (fmt, row)
        assert all(e["max_error"] <= e["bound"] for e in row["errors"].values()), (fmt, row["errors"])
        assert {"means", "scales", "quats", "opacity", "sh_dc"} <= set(row["errors"]), (fmt, row["errors"])
    for fmt, names in EXACT.items():
        for name in names:
            assert formats[fmt]["errors"][name]["max_error"] == 0, (fmt, name, formats[fmt]["errors"][name])
    if "ns-export ply" in formats:
        assert all(e["max_error"] == 0 for e in formats["ns-export ply"]["errors"].values())
    for fmt, names in QUANTISED.items():
        for name in names:  # a real decoding: the format's steps show
            assert formats[fmt]["errors"][name]["max_error"] > 0, (fmt, name, formats[fmt]["errors"][name])
    assert "Niantic" in formats["spz"]["tool"] and "splat-transform" in formats["sog"]["tool"]
    assert formats["glb"]["checks"]["glTF-Validator"]["ok"]
    for fmt in ("ply", "spz", "sog", "compressed-ply", "lod"):  # the render mode as splat-transform 3.x reads it
        assert formats[fmt]["checks"]["splat-transform 3.x --info"]["value"]["model"] == "default", formats[fmt]
    assert formats["lod"]["checks"]["counts per level"]["value"] == [-(-n // 4**i) for i in range(4)]
    md = (results / "decode.md").read_text()
    assert "| format | file | bytes | decoded | means |" in md and f"{SCRIPT.name} {results}`" in md
    assert md.count(" | ok | ") == len(formats) + 1 and "| spz | exports/splat.spz |" in md
    assert "**not ok**" not in md and "**over**" not in md
    print(md)


def test_one_moved_gaussian_fails_every_format(packed, tmp_path):
    _, results, _ = packed

    def move(members):
        params = _npz(members)
        params["means"][7, 0] += 0.1
        return dict(members, **{"params.npz": _npz_bytes(params)})

    tar = _repack(results / "exports.tar", tmp_path / "moved.tar", move)
    status, decoded = _decode_here(tmp_path, tar)
    assert status == 1
    assert decoded["ok"] is False
    for fmt, row in decoded["formats"].items():
        assert row["ok"] is False and row["errors"]["means"]["ok"] is False, (fmt, row)
    assert abs(decoded["formats"]["ply"]["errors"]["means"]["max_error"] - 0.1) < 1e-6
    assert "**not ok**" in (tmp_path / "decode.md").read_text()


def test_an_spz_of_other_gaussians_and_a_failed_export_fail_alone(packed, tmp_path):
    """The .spz replaced by one of the same gaussians but one moved by 0.1 (written by the package's .spz
    writer), and the .glb reported failed by the manifest (its file absent): those two rows fail, the rest pass."""
    from splat_metal_method.export.gaussians import ExportGaussians
    from splat_metal_method.export.spz_file import encode_spz

    _, results, _ = packed

    def swap(members):
        p = _npz(members)
        p["means"][7, 0] += 0.1
        n = len(p["means"])
        g = ExportGaussians(means=p["means"], log_scales=p["log_scales"], quats=p["quats"],
                            opacity_logits=p["opacity_logits"], sh_dc=p["sh_dc"], sh_rest=p["sh_rest"],
                            sh_degree=int(p["sh_degree"]), antialiased=bool(p["antialiased"]), n_model=n, n_cropped=0,
                            n_nonfinite=0, n_low_opacity=0)  # fmt: skip
        manifest = json.loads(members["manifest.json"])
        del manifest["formats"]["glb"]
        manifest["failed"]["glb"] = "planted: the export failed"
        members = {k: v for k, v in members.items() if k != "exports/splat.glb"}
        return dict(
            members, **{"exports/splat.spz": encode_spz(g).data, "manifest.json": json.dumps(manifest).encode()}
        )

    tar = _repack(results / "exports.tar", tmp_path / "swapped.tar", swap)
    status, decoded = _decode_here(tmp_path, tar)
    assert status == 1
    rows = decoded["formats"]
    assert rows["glb"] == {"ok": False, "failed": "planted: the export failed"}
    spz = rows["spz"]
    assert spz["ok"] is False and spz["decoded"] == spz["expected"], spz
    assert [k for k, e in spz["errors"].items() if not e["ok"]] == ["means"]
    assert spz["errors"]["means"]["max_error"] > 0.09
    assert {fmt for fmt, row in rows.items() if not row["ok"]} == {"spz", "glb"}
    assert "| glb |  |  | | export failed: planted: the export failed |" in (tmp_path / "decode.md").read_text()
