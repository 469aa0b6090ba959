"""``splat-metal-export --format lod``: the streamed level-of-detail SOG folder (lod_file.py).

- the merge: copies of one gaussian merge into that gaussian with their opacity summed (the
  weighted area kept), two separated ones into the mixture's moments;
- the layout: every gaussian of every level in exactly one leaf, at the rows lod-meta.json gives,
  the counts per level as written, the leaves' bounds around their gaussians;
- splat-transform (PlayCanvas's converter) reads every chunk back (an unbundled SOG, its
  ``meta.json`` input), each level's chunks holding the count lod-meta.json gives, and the finest
  level decodes to the values splat-transform decodes from our .sog of the same model;
- an interrupted export leaves no folder and no partial one, an earlier folder untouched; a SIGKILLed
  one leaves its hidden ``.NAME.partial-PID`` folder, which the next export removes (only a folder
  holding atomic_folder's mark: a user's folder of a matching name stays).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import demo_runs
import numpy as np
import pytest
import torch
from cli_helpers import cli_env
from playcanvas_viewer import splat_transform
from test_export_formats import _psnr, _reference_model
from test_export_playcanvas import (
    VIEW_HEIGHT,
    VIEW_WIDTH,
    _assert_same_values,
    _eval_cameras,
    _ply_values,
    viewer,  # noqa: F401 (the fixture)
    viewer_camera,
)
from test_export_roundtrip import _copy_run_with_checkpoint

from splat_metal_method.engine.files import PARTIAL_FOLDER_MARK, atomic_folder
from splat_metal_method.export import lod_file
from splat_metal_method.export.cli import ExportSplats
from splat_metal_method.export.gaussians import ExportGaussians
from splat_metal_method.export.sog_file import read_sog

pytestmark = pytest.mark.timeout(900)

VIEW_FIRST_FOV = 60.0  # the held-out camera's, as test_export_playcanvas.py's viewer test places it
LOD_VS_SOG_PSNR = 40.0  # the viewer's settled lod frame against its .sog frame (the same gaussians)


def _gaussians(n: int, seed: int = 0, spread: float = 1.0, sh_degree: int = 3) -> ExportGaussians:
    rng = np.random.default_rng(seed)
    k = (sh_degree + 1) ** 2 - 1
    f = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return ExportGaussians(means=f(rng.normal(size=(n, 3)) * spread), log_scales=f(rng.normal(-4, 0.5, (n, 3))),
                           quats=f(rng.normal(size=(n, 4))), opacity_logits=f(rng.normal(0, 1, n)),
                           sh_dc=f(rng.normal(0, 0.8, (n, 3))), sh_rest=f(0.2 * rng.normal(size=(n, k, 3))),
                           sh_degree=sh_degree, antialiased=False, n_model=n, n_cropped=0, n_nonfinite=0,
                           n_low_opacity=0)  # fmt: skip


def _covariances(g: ExportGaussians) -> np.ndarray:
    r = lod_file.rotation_matrices(g.quats.astype(np.float64))
    s2 = np.exp(2 * g.log_scales.astype(np.float64))
    return (r * s2[:, None, :]) @ r.transpose(0, 2, 1)


def _leaves(node: dict):
    if "lods" in node:
        yield node
    else:
        for child in node["children"]:
            yield from _leaves(child)


# ---------------------------------------------------------------------------------------------
# The merge and the layout (no command line)


def test_copies_merge_into_the_same_gaussian_with_their_opacity_summed():
    one = _gaussians(1, seed=3)
    one.opacity_logits[:] = np.log(0.1 / 0.9)  # opacity 0.1: four of them 0.4
    rows = np.zeros(4, np.int64)
    copies = lod_file.subset(one, rows)
    merged = lod_file.merge_neighbours(copies, group=4)
    assert merged.count == 1
    np.testing.assert_allclose(merged.means, one.means, atol=1e-6)
    np.testing.assert_allclose(_covariances(merged), _covariances(one), rtol=1e-4, atol=1e-12)
    np.testing.assert_allclose(1 / (1 + np.exp(-merged.opacity_logits)), 0.4, rtol=1e-4)
    np.testing.assert_allclose(merged.sh_dc, one.sh_dc, atol=1e-6)
    np.testing.assert_allclose(merged.sh_rest, one.sh_rest, atol=1e-6)


def test_two_separated_gaussians_merge_into_the_mixtures_moments():
    g = _gaussians(2, seed=1, sh_degree=1)
    g.means[:] = [[-1, 0, 0], [1, 0, 0]]
    g.log_scales[:] = np.log(0.01)
    g.opacity_logits[:] = 0.0  # equal weights
    merged = lod_file.merge_neighbours(g, group=2)
    np.testing.assert_allclose(merged.means, [[0, 0, 0]], atol=1e-6)
    cov = _covariances(merged)[0]
    np.testing.assert_allclose(np.diag(cov), [1 + 1e-4, 1e-4, 1e-4], rtol=1e-3)  # spread d^2 + own variance
    np.testing.assert_allclose(merged.sh_dc[0], g.sh_dc.mean(0), atol=1e-6)
    # the opacity that keeps opacity x area: two spheres of radius 0.01 at opacity 0.5 (4 pi r^2 each,
    # Thomsen's formula is exact for a sphere) over the merged ellipsoid's surface (~78 times one sphere's)
    area = lod_file.ellipsoid_area(np.exp(merged.log_scales.astype(np.float64)))[0]
    assert 60 * 4 * np.pi * 1e-4 < area < 100 * 4 * np.pi * 1e-4
    np.testing.assert_allclose(
        1 / (1 + np.exp(-merged.opacity_logits[0])), 2 * 0.5 * 4 * np.pi * 1e-4 / area, rtol=1e-4
    )


@pytest.mark.parametrize(
    "levels,chunk_size,spread", [(1, 512 * 1024, 1.0), (4, 1000, 1.0), (3, 1000, 40.0), (5, 100, 4.0)]
)
def test_every_gaussian_of_every_level_in_one_leaf(levels, chunk_size, spread):
    g = _gaussians(6000, spread=spread)
    lods = lod_file.build_levels(g, levels)
    assert [lv.count for lv in lods] == [-(-6000 // 4**i) for i in range(levels)]
    chunking = lod_file.chunk(lods, chunk_size=chunk_size)
    names = lod_file.file_names(chunking)
    assert len(set(names)) == len(names) and all(
        n.split("_")[0] == str(lv) for n, (lv, _) in zip(names, chunking.files)
    )
    seen = [np.zeros(lv.count, int) for lv in lods]
    for leaf in _leaves(chunking.tree):
        lo, hi = np.array(leaf["bound"]["min"]), np.array(leaf["bound"]["max"])
        centres = []
        for level, entry in leaf["lods"].items():
            file_level, rows = chunking.files[entry["file"]]
            assert file_level == int(level)
            mine = rows[entry["offset"] : entry["offset"] + entry["count"]]
            assert len(mine) == entry["count"] > 0
            seen[int(level)][mine] += 1
            means = lods[int(level)].means[mine]
            assert (means >= lo - 1e-5).all() and (means <= hi + 1e-5).all()
            centres.append(means)
        centres = np.concatenate(centres)  # the chunk-extent rule is on the centres (bounds add sizes)
        assert (np.ptp(centres, axis=0).max() <= 16 and len(centres) <= chunk_size) or len(centres) <= 256
    assert all((s == 1).all() for s in seen), "a gaussian in no leaf or in two"
    for i, (level, rows) in enumerate(chunking.files):  # a file closes once over the chunk size
        assert len(rows) <= 2 * chunk_size + 256  # it held at most chunk_size before its last leaf
        if any(other == level for other, _ in chunking.files[i + 1 :]):
            assert len(rows) > chunk_size
    if spread > 20:
        assert len(list(_leaves(chunking.tree))) > 1  # split by extent too


# ---------------------------------------------------------------------------------------------
# The command line on the SH-3 demo run, read back by splat-transform


def _run_gaussians(config: Path) -> ExportGaussians:
    """The gaussians the command exports from a run (what it hands the writers)."""
    from splat_metal_method.export.checkpoint import load_run
    from splat_metal_method.export.gaussians import export_gaussians
    from splat_metal_method.export.run_config import quick_run

    model, _, _ = load_run(quick_run(config))
    return export_gaussians(model)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    config = demo_runs.sh3_run(tmp_path_factory)
    out = tmp_path_factory.mktemp("lod_exports")
    ExportSplats(load_config=config, output_dir=out, format=("sog", "lod")).main()
    g = _run_gaussians(config)
    small = tmp_path_factory.mktemp("lod_small") / "splat.lod"  # many chunks: ~200 gaussians each
    written = lod_file.write_lod(g, small, levels=3, chunk_size=200)
    st = tmp_path_factory.mktemp("lod_splat_transform")
    splat_transform(out / "splat.sog", st / "from_sog.ply")
    return out, g, small, written, st


def _decode_chunks(folder: Path, st: Path) -> dict:
    """splat-transform's decoding of every chunk file: {filename: the readers' dict}, and the meta."""
    meta = json.loads((folder / "lod-meta.json").read_text())
    decoded = {}
    for name in meta["filenames"]:
        ply = st / f"{folder.name}_{name.split('/')[0]}.ply"
        splat_transform(folder / name, ply)
        decoded[name] = _ply_values(ply)
        _assert_same_values(read_sog(folder / name), decoded[name], f"read_sog vs splat-transform on {name}")
    return {"meta": meta, "chunks": decoded}


def test_cli_writes_the_folder(exports):
    out, g, _, _, _ = exports
    folder = out / "splat.lod"
    assert sorted(p.name for p in out.iterdir()) == ["splat.lod", "splat.sog"]  # nothing partial left
    meta = json.loads((folder / "lod-meta.json").read_text())
    assert meta["version"] == 1 and meta["lodLevels"] == 4
    assert meta["counts"] == [-(-g.count // 4**i) for i in range(4)] and meta["count"] == sum(meta["counts"])
    assert sorted(meta["filenames"]) == [f"{level}_0/meta.json" for level in range(4)]  # one chunk each
    assert meta["tree"]["lods"]["0"] == {"file": meta["filenames"].index("0_0/meta.json"), "offset": 0,
                                         "count": g.count}  # fmt: skip


def test_splat_transform_reads_every_level_finest_equal_to_the_sog(exports):
    out, g, _, _, st = exports
    read = _decode_chunks(out / "splat.lod", st)
    meta = read["meta"]
    for level, count in enumerate(meta["counts"]):
        assert len(read["chunks"][f"{level}_0/meta.json"]["means"]) == count
    # the finest level, one chunk in the .sog's Morton order: the .sog's values, and its very images
    _assert_same_values(read["chunks"]["0_0/meta.json"], _ply_values(st / "from_sog.ply"), "level 0 vs the .sog",
                        atol=0)  # fmt: skip
    import zipfile

    with zipfile.ZipFile(out / "splat.sog") as z:
        for name in z.namelist():
            assert (out / "splat.lod" / "0_0" / name).read_bytes() == z.read(name), f"level 0's {name} differs"


def test_splat_transform_reads_small_chunks_at_the_rows_the_tree_gives(exports):
    _, g, small, written, st = exports
    read = _decode_chunks(small, st)
    meta = read["meta"]
    assert meta["counts"] == written.counts == [-(-g.count // 4**i) for i in range(3)]
    assert written.files == len(meta["filenames"]) > 3  # level 0 in several chunks
    got = [0] * meta["lodLevels"]
    finest = []
    for leaf in _leaves(meta["tree"]):
        for level, entry in leaf["lods"].items():
            values = read["chunks"][meta["filenames"][entry["file"]]]
            rows = slice(entry["offset"], entry["offset"] + entry["count"])
            got[int(level)] += entry["count"]
            means = values["means"][rows]
            lo, hi = np.array(leaf["bound"]["min"]), np.array(leaf["bound"]["max"])
            assert (means >= lo - 1e-3).all() and (means <= hi + 1e-3).all(), "a gaussian outside its leaf's bound"
            if level == "0":
                finest.append(means)
    assert got == meta["counts"]
    assert sum(len(v["means"]) for v in read["chunks"].values()) == meta["count"]
    # the finest level is the model: each model gaussian has its decoded self (16-bit positions per chunk)
    from scipy.spatial import cKDTree

    distance, _ = cKDTree(np.concatenate(finest)).query(g.means.astype(np.float64))
    span = g.means.max(0) - g.means.min(0)
    assert distance.max() < 1e-3 * span.max(), f"a model gaussian is {distance.max():.3g} from its decoded self"


def test_ctrl_c_leaves_no_folder_and_keeps_the_earlier_one(tmp_path_factory, tmp_path, monkeypatch):
    config = demo_runs.sh3_run(tmp_path_factory)
    old = tmp_path / "splat.lod"
    old.mkdir()
    (old / "lod-meta.json").write_text("earlier")
    calls = []
    real = lod_file.sog_files

    def interrupted(*args, **kwargs):  # the second chunk
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(lod_file, "sog_files", interrupted)
    with pytest.raises(SystemExit) as e:
        ExportSplats(load_config=config, output_dir=tmp_path, format=("lod",)).main()
    assert "interrupted; nothing was written" in str(e.value.code)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["splat.lod"]
    assert (
        sorted(p.name for p in old.iterdir()) == ["lod-meta.json"] and (old / "lod-meta.json").read_text() == "earlier"
    )
    monkeypatch.setattr(lod_file, "sog_files", real)
    ExportSplats(load_config=config, output_dir=tmp_path, format=("lod",), lod_levels=2).main()  # replaces it
    assert json.loads((old / "lod-meta.json").read_text())["lodLevels"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["splat.lod"]


def test_bad_level_count_says_so(tmp_path_factory, tmp_path):
    with pytest.raises(SystemExit) as e:
        ExportSplats(load_config=demo_runs.sh3_run(tmp_path_factory), output_dir=tmp_path, format=("lod",),
                     lod_levels=0).main()  # fmt: skip
    assert "--lod-levels 0: give 1 or more" in str(e.value.code)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# In Chromium: SuperSplat's viewer (the PlayCanvas engine's octree streamer) streams the folder.

# Recorded by the page at the viewer's window.firstFrame hook: the bytes of every response so far
# (Resource Timing's encodedBodySize: what came over the wire for each file, the server sends no
# compression) and which files they were.
_FIRST_FRAME_HOOK = """
window.firstFrame = () => {
    window.__firstFrame = performance.getEntriesByType('resource').map(e => [e.name, e.encodedBodySize]);
};
"""


def _served(entries, folder_name: str) -> dict:
    """{path inside the folder: bytes} of the resource entries under it (the last load of each)."""
    out = {}
    for url, size in entries:
        if f"/{folder_name}/" in url:
            out[url.split(f"/{folder_name}/", 1)[1]] = size
    return out


def test_supersplat_viewer_streams_the_coarsest_level_first(tmp_path_factory, viewer):  # noqa: F811 (the imported fixture)
    """SuperSplat's viewer opens lod-meta.json as the PlayCanvas engine streams it: its first frame
    is drawn from the coarsest level (the viewer clamps the engine's LOD range to it until the
    first reveal), after a fraction of the folder's bytes; once streaming has settled the frame at a
    held-out camera is the .sog's frame (the finest level is the .sog)."""
    config = demo_runs.sh3_run(tmp_path_factory)
    ExportSplats(load_config=config, output_dir=viewer.folder, format=("sog", "lod")).main()
    pipeline, _, _ = demo_runs.load_pipeline(config)
    model = _reference_model(pipeline)
    camera = _eval_cameras(pipeline)[0]
    position, target, _ = viewer_camera(camera)
    background = model._get_background_color().tolist()
    driver = viewer.browser.driver
    hook = driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": _FIRST_FRAME_HOOK})
    try:
        lod_frame = viewer.capture("splat.lod/lod-meta.json", position, target, VIEW_FIRST_FOV, VIEW_WIDTH,
                                   VIEW_HEIGHT, background)  # fmt: skip
        first = _served(driver.execute_script("return window.__firstFrame || null") or [], "splat.lod")
        settled = _served(
            driver.execute_script(
                "return performance.getEntriesByType('resource').map(e => [e.name, e.encodedBodySize])"
            ),
            "splat.lod",
        )
    finally:
        driver.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": hook["identifier"]})
    sog_frame = viewer.capture("splat.sog", position, target, VIEW_FIRST_FOV, VIEW_WIDTH, VIEW_HEIGHT, background)

    folder = viewer.folder / "splat.lod"
    meta = json.loads((folder / "lod-meta.json").read_text())
    total = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    coarsest = str(meta["lodLevels"] - 1)
    first_chunks = {k.split("/")[0] for k in first if k != "lod-meta.json"}
    fraction = sum(first.values()) / total
    psnr = _psnr([torch.from_numpy(lod_frame)], [torch.from_numpy(sog_frame)])
    print(f"first frame after {sum(first.values()):,} of {total:,} bytes ({fraction:.1%}): {sorted(first)}; "
          f"settled: {sorted(settled)}; settled frame vs the .sog's {psnr:.1f} dB")  # fmt: skip
    assert first, "the page recorded no first frame"
    assert "lod-meta.json" in first and first_chunks == {f"{coarsest}_0"}, f"first frame from {sorted(first)}"
    assert fraction < 0.5, f"the first frame needed {fraction:.0%} of the folder"
    assert all(size > 0 for size in first.values())
    assert "0_0/meta.json" in settled, f"the finest level never streamed in: {sorted(settled)}"
    blank = _psnr(
        [torch.ones_like(torch.from_numpy(sog_frame)) * torch.tensor(background)], [torch.from_numpy(sog_frame)]
    )
    assert blank < LOD_VS_SOG_PSNR - 15, f"the .sog's frame is {blank:.1f} dB from the background alone: no teeth"
    assert psnr >= LOD_VS_SOG_PSNR, f"the settled lod frame is {psnr:.1f} dB off the .sog's (< {LOD_VS_SOG_PSNR})"


def test_a_file_named_like_the_folder_is_replaced(tmp_path):
    g = _gaussians(500)
    target = tmp_path / "splat.lod"
    target.write_bytes(b"not a folder")
    with atomic_folder(target) as tmp:
        lod_file.write_lod(g, tmp, levels=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["splat.lod"]
    assert json.loads((target / "lod-meta.json").read_text())["counts"] == [500, 125]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


LOD_GAUSSIANS = 20_000  # enough that the level-0 chunk's encoding takes a while: the kill lands mid-write


def _wait_for(predicate, proc, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the export exited ({proc.returncode}) before it was mid-write"
        assert time.monotonic() < end, "timed out waiting for the export to be mid-write"
        time.sleep(0.02)


def test_a_sigkilled_lod_export_leaves_a_folder_the_next_export_removes(tmp_path_factory, tmp_path):
    gen = torch.Generator().manual_seed(3)

    def edit(params):  # LOD_GAUSSIANS drawn from the run's, all above the opacity cut
        rows = torch.randint(params["means"].shape[0], (LOD_GAUSSIANS,), generator=gen)
        for key in params:
            params[key] = params[key][rows]
        params["means"] = params["means"] + 0.05 * torch.randn(params["means"].shape, generator=gen)
        params["opacities"] = torch.full_like(params["opacities"], 2.0)

    config = _copy_run_with_checkpoint(demo_runs.sh3_run(tmp_path_factory), tmp_path / "run", edit)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    users = out / f".photos.partial-{_dead_pid()}"  # a user's folder named like ours, its "pid" gone: not ours
    users.mkdir()
    (users / "a.jpg").write_bytes(b"jpeg")
    code = (
        "import sys\nfrom splat_metal_method.export.cli import entrypoint\n"
        f"sys.argv = ['splat-metal-export', '--load-config', {str(config)!r}, '--output-dir', {str(out)!r}, "
        "'--format', 'lod', '--lod-levels', '2']\nentrypoint()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    partial = out / f".splat.lod.partial-{proc.pid}"
    try:
        _wait_for(lambda: (partial / "lod-meta.json").is_file(), proc)  # the levels are made; chunks being written
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "splat.lod").exists() and (partial / PARTIAL_FOLDER_MARK).is_file()  # killed mid-write
    meta = json.loads((partial / "lod-meta.json").read_text())
    assert not all((partial / name).is_file() for name in meta["filenames"]), "the export had finished"

    written = ExportSplats(load_config=config, output_dir=out, format=("lod",), lod_levels=2).main()
    assert written == [out / "splat.lod"]
    assert not partial.exists(), "the SIGKILLed export's partial folder is still there"
    assert sorted(p.name for p in out.iterdir()) == sorted(["notes.txt", users.name, "splat.lod"])
    assert (out / "notes.txt").read_text() == "mine" and (users / "a.jpg").read_bytes() == b"jpeg"
    meta = json.loads((out / "splat.lod" / "lod-meta.json").read_text())  # the finished folder is complete
    assert sum(meta["counts"]) == meta["count"] and meta["counts"][0] == LOD_GAUSSIANS
    chunks = {p.relative_to(out / "splat.lod").as_posix() for p in (out / "splat.lod").rglob("meta.json")}
    assert chunks == set(meta["filenames"]) and not (out / "splat.lod" / PARTIAL_FOLDER_MARK).exists()
