"""`splat-metal-export` as users run it: .ply (byte-identical to `ns-export gaussian-splat`), .splat
and .spz of a trained demo run, read back with readers written from the formats' sources
(export_readers.py), field by field within each format's quantisation step, and rendered back
through the reference op next to the model's own render.

PSNR bounds (both renders with backend "reference", black and white pixels alike, over the
held-out views and a novel view at another resolution):
- .splat >= 45 dB. Positions and scales are float32, so the loss is colour and opacity at 8 bits
  (at most 0.5/255 each, per layer: one opaque layer of such errors is 48 dB at its worst pixel;
  independent errors of overlapping layers add in quadrature) plus the SH bands the format drops,
  which a 12-step run barely has (the test checks |SH rest| < 2e-3, where a band-1..3 colour change
  stays under ~1/255). Measured 68.8 dB on the 12-step SH-3 demo run.
- .spz >= 40 dB. On top of 8-bit opacity: colour at 1/38.25 in SH units (about 1/136 in RGB, twice
  .splat's step), log scales in steps of 1/16 (a gaussian up to 3% larger or smaller, which moves
  every edge), positions at 2^-12 (1/2000 of this scene's extent) and SH at 5/4 bits. Those are
  several times .splat's errors, hence 5 dB less. Measured 60.5 dB on the same run.
The bounds have teeth: the same files read with R and B swapped (.splat) or with SH in the .ply's
channel-major order (.spz, with random SH) land far below them.
"""

from __future__ import annotations

import copy
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Dict, List

import demo_runs
import numpy as np
import pytest
import torch
import yaml
from bad_input_table import record
from cli_helpers import run_cli
from export_readers import read_splat, read_spz
from nerfstudio.models.splatfacto import RGB2SH
from test_export_roundtrip import _cameras, _copy_run_with_checkpoint, model_from_ply

from splat_metal_method.export.cli import ExportSplats

pytestmark = pytest.mark.timeout(900)

LOW_OPACITY_LOGIT = -5.5373  # logit(1/255): what ns-export drops
SH_C0 = 0.28209479177387814
SPLAT_PSNR, SPZ_PSNR = 45.0, 40.0
EPS = 1e-6  # float32 slack on top of the quantisation steps


def _sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


def _model_arrays(model) -> Dict[str, np.ndarray]:
    """The gaussians ns-export keeps (finite, opacity >= 1/255), in the model's order."""
    p = {k: v.detach().cpu().numpy() for k, v in model.gauss_params.items()}
    op = p["opacities"][:, 0]
    keep = op >= LOW_OPACITY_LOGIT
    for v in p.values():
        keep &= np.isfinite(v.reshape(len(op), -1)).all(axis=1)
    out = {k: v[keep] for k, v in p.items()}
    out["shs_0"] = model.shs_0.detach().cpu().numpy()[keep]
    return out


def _psnr(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    mse = sum(((x - y) ** 2).sum().item() for x, y in zip(a, b)) / sum(x.numel() for x in a)
    return 10 * math.log10(1 / mse) if mse > 0 else float("inf")


def _render(model, cameras) -> List[torch.Tensor]:
    return [model.get_outputs_for_camera(cam)["rgb"] for cam in cameras]


def _splat_params(s: Dict[str, np.ndarray], n_rest: int) -> Dict[str, np.ndarray]:
    """gauss_params of a .splat's gaussians (DC colour from RGB, no SH rest)."""
    n = len(s["means"])
    a = np.clip(s["rgba"][:, 3], 1e-6, 1 - 1e-6)
    return {
        "means": s["means"], "scales": np.log(s["scales"]), "quats": s["quats"],
        "opacities": np.log(a / (1 - a))[:, None].astype(np.float32),
        "features_dc": ((s["rgba"][:, :3] - 0.5) / SH_C0).astype(np.float32),
        "features_rest": np.zeros((n, n_rest, 3), np.float32),
    }  # fmt: skip


def _spz_params(z: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    p = {"means": z["means"], "scales": z["log_scales"], "quats": z["quats"], "opacities": z["opacity_logits"][:, None],
         "features_dc": z["sh_dc"], "features_rest": z["sh_rest"]}  # fmt: skip
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in p.items()}


def _console_script() -> str:
    """The installed console script (next to this Python, else on PATH), as users run it."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which("splat-metal-export", path=search)
    assert found, "the splat-metal-export console script is not installed: `pip install -e .` (setup.sh) adds it"
    return found


def _reference_model(pipeline):
    model = copy.deepcopy(pipeline.model)
    model.config.backend = "reference"
    model.eval()
    return model


# ---------------------------------------------------------------------------------------------
# The command line on a run with random SH (so a mis-ordered SH cannot hide behind near-zero
# trained values) and 10% of the gaussians below ns-export's opacity cut.


@pytest.fixture(scope="module")
def edited_run(tmp_path_factory) -> Path:
    config = demo_runs.sh3_run(tmp_path_factory)
    gen = torch.Generator().manual_seed(1)

    def edit(params):
        params["features_rest"] = 0.3 * torch.randn(params["features_rest"].shape, generator=gen)
        n = params["opacities"].shape[0]
        params["opacities"][torch.randperm(n, generator=gen)[: n // 10]] = -8.0

    return _copy_run_with_checkpoint(config, tmp_path_factory.mktemp("formats_run") / "outputs", edit)


@pytest.fixture(scope="module")
def cli_exports(edited_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("formats_exports")
    result = run_cli([_console_script()], "--load-config", edited_run, "--output-dir", out / "ours",
                     "--format", "ply", "splat", "spz", timeout=600)  # fmt: skip
    assert result.returncode == 0, result.tail()
    # nerfstudio's own exporter, in this process (its command line is tested in test_export_roundtrip.py),
    # without splat-metal's patch: its own writer, value by value
    from nerfstudio.scripts.exporter import ExportGaussianSplat

    from splat_metal_method.engine import reliability

    current = ExportGaussianSplat.__dict__["write_ply"].__func__  # patched if a model was built here before
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ExportGaussianSplat, "write_ply", staticmethod(getattr(current, "nerfstudio_write_ply", current)))
        m.setattr(reliability, "install_atomic_ply_export", lambda *args: False)
        ExportGaussianSplat(load_config=edited_run, output_dir=out / "ns").main()
        assert not hasattr(ExportGaussianSplat.write_ply, "nerfstudio_write_ply")  # nerfstudio's own wrote it
    pipeline, _, _ = demo_runs.load_pipeline(edited_run)
    return out, result, pipeline


def test_cli_ply_is_byte_identical_to_ns_export_and_prints_sizes(cli_exports):
    out, result, pipeline = cli_exports
    ours, theirs = (out / "ours" / "splat.ply").read_bytes(), (out / "ns" / "splat.ply").read_bytes()
    assert len(ours) == len(theirs) and ours == theirs, "splat-metal-export's .ply differs from ns-export's"
    assert sorted(p.name for p in (out / "ours").iterdir()) == ["splat.ply", "splat.splat", "splat.spz"]  # no temp left

    n = len(_model_arrays(pipeline.model)["means"])
    assert n < pipeline.model.num_points  # the low-opacity tenth is dropped
    text = " ".join(result.output.split())
    assert f"{n:,} gaussians (of {pipeline.model.num_points:,}" in text
    for name in ("splat.ply", "splat.splat", "splat.spz"):
        size = (out / "ours" / name).stat().st_size
        assert f"{name} {size:,} bytes {size / n:.1f} bytes/gaussian" in text, f"no size line for {name}:\n{text}"
        assert re.search(rf"{name} {size:,} bytes [^(]* \(\d+\.\d s\)", text), f"no time for {name}:\n{text}"
    assert re.search(r"\(loaded in \d+\.\d s\)", text), text


def test_ply_writer_is_nerfstudios_bytes(cli_exports, tmp_path):
    """export/ply_file.write_ply against nerfstudio 1.1.5's own write_ply (value by value): the
    demo run's columns as ns-export builds them, and the other columns nerfstudio's writer accepts
    (float64, float16, [N, 1], uint8); its errors with its messages. And ns-export writes with it."""
    from nerfstudio.scripts.exporter import ExportGaussianSplat

    from splat_metal_method.engine import reliability
    from splat_metal_method.export import ply_file
    from splat_metal_method.export.gaussians import export_gaussians

    _, _, pipeline = cli_exports
    with pytest.MonkeyPatch.context() as m:
        current = ExportGaussianSplat.__dict__["write_ply"].__func__
        m.setattr(ExportGaussianSplat, "write_ply", staticmethod(getattr(current, "nerfstudio_write_ply", current)))
        assert reliability.install_atomic_ply_export(ply_file.write_ply)  # what the model does in ns-export
        wrapper = ExportGaussianSplat.write_ply
        theirs = wrapper.nerfstudio_write_ply
    assert wrapper.__wrapped__ is ply_file.write_ply and theirs.__module__ == "nerfstudio.scripts.exporter"

    g = export_gaussians(pipeline.model)
    rng = np.random.default_rng(0)
    odd = g.ply_columns()
    odd["x"] = odd["x"].astype(np.float64)[:, None]
    odd["f16"] = rng.normal(size=g.count).astype(np.float16)
    odd["red"] = rng.integers(0, 256, g.count).astype(np.uint8)
    odd["big"] = rng.normal(size=g.count) * 1e39  # float64 beyond float32's range: inf, as np.float32 makes it
    for name, cols, count in (("demo", g.ply_columns(), g.count), ("odd", odd, np.int64(g.count))):
        theirs(str(tmp_path / f"{name}_ns.ply"), count, cols)
        ply_file.write_ply(str(tmp_path / f"{name}_ours.ply"), count, cols)
        assert (tmp_path / f"{name}_ours.ply").read_bytes() == (tmp_path / f"{name}_ns.ply").read_bytes(), name
    one_block = ply_file.BLOCK_ROWS
    assert g.count < one_block  # the block boundary: a scene of more rows than a block
    big = {k: np.resize(v, one_block + 3) for k, v in g.ply_columns().items()}
    theirs(str(tmp_path / "big_ns.ply"), one_block + 3, big)
    ply_file.write_ply(str(tmp_path / "big_ours.ply"), one_block + 3, big)
    assert (tmp_path / "big_ours.ply").read_bytes() == (tmp_path / "big_ns.ply").read_bytes()
    for cols, count in (({"x": np.zeros(3, np.float32)}, 4), ({"x": np.zeros(3, np.int32)}, 3)):
        with pytest.raises(ValueError) as e_ns:
            theirs(str(tmp_path / "bad.ply"), count, cols)
        with pytest.raises(ValueError) as e_ours:
            ply_file.write_ply(str(tmp_path / "bad.ply"), count, cols)
        assert str(e_ours.value) == str(e_ns.value)


def test_splat_fields_order_and_size(cli_exports):
    out, _, pipeline = cli_exports
    m = _model_arrays(pipeline.model)
    s = read_splat(out / "ours" / "splat.splat")
    n = len(m["means"])
    assert (out / "ours" / "splat.splat").stat().st_size == 32 * n

    # antimatter15's order: volume * opacity, largest first.
    order = np.argsort(-(np.exp(m["scales"].astype(np.float64).sum(1)) * _sigmoid(m["opacities"][:, 0])), kind="stable")
    np.testing.assert_array_equal(s["means"], m["means"][order])  # float32, exact
    np.testing.assert_allclose(s["scales"], np.exp(m["scales"][order].astype(np.float64)), rtol=1e-6)
    rgb = np.clip(0.5 + SH_C0 * m["shs_0"][order], 0, 1)
    assert np.abs(s["rgba"][:, :3] - rgb).max() <= 0.5 / 255 + EPS
    assert np.abs(s["rgba"][:, 3] - _sigmoid(m["opacities"][order, 0])).max() <= 0.5 / 255 + EPS
    q = m["quats"][order] / np.linalg.norm(m["quats"][order], axis=1, keepdims=True)
    assert np.abs(s["quats"] - np.clip(q, -1, 127 / 128)).max() <= 0.5 / 128 + EPS  # 1.0 is stored as 255


def test_spz_header_and_fields(cli_exports):
    out, _, pipeline = cli_exports
    m = _model_arrays(pipeline.model)
    z = read_spz(out / "ours" / "splat.spz")
    n = len(m["means"])
    assert (z["version"], z["num_points"], z["sh_degree"], z["fractional_bits"], z["flags"], z["reserved"]) == (
        3, n, 3, 12, 0, 0)  # fmt: skip

    assert np.abs(z["means"] - m["means"]).max() <= 0.5 / 2**12 + EPS
    assert np.abs(z["log_scales"] - np.clip(m["scales"], -10, 255 / 16 - 10)).max() <= 0.5 / 16 + EPS
    assert np.abs(_sigmoid(z["opacity_logits"]) - _sigmoid(m["opacities"][:, 0])).max() <= 0.5 / 255 + EPS
    dc_range = (-127.5 / 38.25, 127.5 / 38.25)  # colour byte = dc * 0.15 * 255 + 127.5
    assert np.abs(z["sh_dc"] - np.clip(m["shs_0"], *dc_range)).max() <= 0.5 / 38.25 + EPS
    q = m["quats"] / np.linalg.norm(m["quats"], axis=1, keepdims=True)
    q = q * np.sign((q * z["quats"]).sum(1, keepdims=True))  # q and -q are the same rotation
    assert np.abs(z["quats"] - q).max() <= 3e-3  # 9-bit smallest three; the largest is derived
    rest = np.clip(m["features_rest"], -1, 127 / 128)  # [N, 15, 3]: same layout as the file
    err = np.abs(z["sh_rest"] - rest)
    assert err[:, :3].max() <= 4.5 / 128 + EPS  # band 1: 5 bits (buckets of 8) + rounding
    assert err[:, 3:].max() <= 8.5 / 128 + EPS  # bands 2-3: 4 bits (buckets of 16) + rounding
    assert err.max() > 1 / 128  # the SH is really quantised (random values, not near zero)


def test_spz_keeps_sh_in_the_render(cli_exports):
    """With random SH (large view-dependent colour), spz's SH renders close to the model's and the
    same values read in the .ply's channel-major order do not: the SH layout is what it should be."""
    out, _, pipeline = cli_exports
    model = _reference_model(pipeline)
    cameras = _cameras(pipeline)
    reference = _render(model, cameras)
    params = _spz_params(read_spz(out / "ours" / "splat.spz"))
    right = _psnr(reference, _render(model_from_ply(model, params), cameras))
    n, k = params["features_rest"].shape[:2]
    wrong_rest = np.ascontiguousarray(params["features_rest"].reshape(n, 3, k).transpose(0, 2, 1))
    wrong = _psnr(reference, _render(model_from_ply(model, dict(params, features_rest=wrong_rest)), cameras))
    dropped = _psnr(reference, _render(model_from_ply(model, dict(params, features_rest=0 * wrong_rest)), cameras))
    # Measured: 48.9 dB; the wrong order 28.1 dB, no SH 30.2 dB. SH steps of 1/16 and 1/8 per coefficient
    # are coarse, but their errors average out over a pixel's many gaussians: the .spz bound holds.
    assert right >= SPZ_PSNR, f"spz with random SH renders at {right:.1f} dB (< {SPZ_PSNR})"
    assert max(wrong, dropped) < SPZ_PSNR - 5, f"right {right:.1f} dB, wrong order {wrong:.1f}, no SH {dropped:.1f}"


# ---------------------------------------------------------------------------------------------
# The trained run as it is: render PSNR per format.


@pytest.fixture(scope="module")
def trained_exports(tmp_path_factory):
    config = demo_runs.sh3_run(tmp_path_factory)
    out = tmp_path_factory.mktemp("formats_trained")
    written = ExportSplats(load_config=config, output_dir=out, format=("splat", "spz")).main()
    assert written == [out / "splat.splat", out / "splat.spz"]
    pipeline, _, _ = demo_runs.load_pipeline(config)
    return out, pipeline


def test_renders_close_to_the_model(trained_exports):
    out, pipeline = trained_exports
    model = _reference_model(pipeline)
    assert model.config.sh_degree == 3 and model.features_rest.abs().max() < 2e-3  # what the .splat bound assumes
    cameras = _cameras(pipeline)
    reference = _render(model, cameras)
    n_rest = model.features_rest.shape[1]

    s = read_splat(out / "splat.splat")
    splat_psnr = _psnr(reference, _render(model_from_ply(model, _splat_params(s, n_rest)), cameras))
    spz_psnr = _psnr(reference, _render(model_from_ply(model, _spz_params(read_spz(out / "splat.spz"))), cameras))
    assert splat_psnr >= SPLAT_PSNR, f".splat renders at {splat_psnr:.1f} dB (< {SPLAT_PSNR})"
    assert spz_psnr >= SPZ_PSNR, f".spz renders at {spz_psnr:.1f} dB (< {SPZ_PSNR})"

    swapped = dict(s, rgba=s["rgba"][:, [2, 1, 0, 3]])  # the check has teeth: BGR instead of RGB
    bgr_psnr = _psnr(reference, _render(model_from_ply(model, _splat_params(swapped, n_rest)), cameras))
    assert bgr_psnr < SPZ_PSNR - 10, f"a BGR .splat still renders at {bgr_psnr:.1f} dB"


def test_sh0_run_exports_rgb_as_dc(tmp_path_factory, tmp_path):
    """SH degree 0 models store colour logits; every format gets the exporter's RGB2SH(sigmoid(.))."""
    config = demo_runs.sh0_run(tmp_path_factory)
    ExportSplats(load_config=config, output_dir=tmp_path, format=("spz", "splat")).main()
    pipeline, _, _ = demo_runs.load_pipeline(config, test_mode="inference")
    m = _model_arrays(pipeline.model)
    expected_dc = RGB2SH(torch.sigmoid(torch.from_numpy(m["features_dc"]))).numpy()
    np.testing.assert_allclose(m["shs_0"], expected_dc, atol=1e-6)
    z = read_spz(tmp_path / "splat.spz")
    assert z["sh_degree"] == 0 and z["sh_rest"].shape == (len(m["means"]), 0, 3)
    assert np.abs(z["sh_dc"] - expected_dc).max() <= 0.5 / 38.25 + EPS
    s = read_splat(tmp_path / "splat.splat")
    rgb = np.sort(_sigmoid(m["features_dc"]).reshape(-1))  # the file's order differs; compare the values
    assert np.abs(np.sort(s["rgba"][:, :3].reshape(-1)) - rgb).max() <= 0.5 / 255 + EPS


def test_crop_to_an_oriented_box(tmp_path_factory, tmp_path):
    config = demo_runs.sh0_run(tmp_path_factory)
    pipeline, _, _ = demo_runs.load_pipeline(config, test_mode="inference")
    m = _model_arrays(pipeline.model)
    center = tuple(float(c) for c in np.median(m["means"], axis=0))
    size = (0.2, 0.3, 10.0)
    ExportSplats(load_config=config, output_dir=tmp_path, format=("splat",), obb_center=center,
                 obb_rotation=(0.0, 0.0, 0.0), obb_scale=size).main()  # fmt: skip
    inside = (np.abs(m["means"] - np.array(center)) <= np.array(size) / 2).all(axis=1)
    s = read_splat(tmp_path / "splat.splat")
    assert 0 < len(s["means"]) == int(inside.sum()) < len(m["means"])
    assert (np.abs(s["means"] - np.array(center)) <= np.array(size) / 2 + 1e-6).all()


# ---------------------------------------------------------------------------------------------
# Bad input: one clear message, nothing written, nothing there before touched.


def _export(config, out, case=None, what=None, paths=None, **kw):
    """The one-line message; with ``case``, also docs/reliability.md's row (tests/bad_input_table.py)."""
    with pytest.raises(SystemExit) as e:
        ExportSplats(load_config=Path(config), output_dir=Path(out), **kw).main()
    message = str(e.value.code)
    assert message.startswith("splat-metal-export: "), message
    if case:
        record(f"export/{case}", what, message, config=config, out=out, **(paths or {}))
    return message


def test_cli_missing_config_one_line_no_traceback(tmp_path):
    result = run_cli([_console_script()], "--load-config", tmp_path / "nope" / "config.yml",
                     "--output-dir", tmp_path / "out", timeout=300)  # fmt: skip
    assert result.returncode == 1, result.tail()
    assert "no such file" in result.stderr and "Traceback" not in result.output, result.tail()
    assert not (tmp_path / "out").exists()


def test_wrong_configs(tmp_path, tmp_path_factory):
    out = tmp_path / "out"
    assert "no such file" in _export(
        tmp_path / "missing.yml", out, "config-missing", "--load-config names no file", {"tmp": tmp_path}
    )
    assert "is a folder" in _export(
        tmp_path, out, "config-is-folder", "--load-config names a folder", {"tmp": tmp_path}
    )
    bad = tmp_path / "bad.yml"
    bad.write_text("pipeline: [unclosed\n")
    assert "cannot be read as a run's config" in _export(bad, out, "config-not-yaml", "config.yml is not YAML")
    bad.write_text("just: a mapping\n")
    assert "not a run's config.yml" in _export(bad, out, "config-not-a-run", "a YAML file that is not a run's config")

    from nerfstudio.configs.method_configs import method_configs

    nerfacto = tmp_path / "nerfacto.yml"
    nerfacto.write_text(yaml.dump(method_configs["nerfacto"]))
    assert "is a nerfacto run; only gaussian-splatting runs" in _export(
        nerfacto, out, "not-a-splat-run", "a nerfacto run's config"
    )

    run = demo_runs.sh0_run(tmp_path_factory)  # a real run's config whose checkpoints are elsewhere
    cfg = yaml.load(run.read_text(), Loader=yaml.Loader)
    cfg.output_dir = tmp_path / "elsewhere"
    moved = tmp_path / "moved.yml"
    moved.write_text(yaml.dump(cfg))
    paths = {"tmp": tmp_path}
    assert "no checkpoint (step-*.ckpt) in" in _export(moved, out, "no-checkpoint", "a run without checkpoints", paths)
    cfg.method_name = "splat-metal-from-the-future"
    moved.write_text(yaml.dump(cfg))
    assert "a method not installed here" in _export(moved, out)  # not in the table: it lists the installed methods
    assert not any(out.iterdir())


def test_unwritable_output(tmp_path, tmp_path_factory):
    config = demo_runs.sh0_run(tmp_path_factory)
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    assert "is a file, not a folder" in _export(config, a_file, "output-is-file", "--output-dir is a file")
    assert "cannot write there" in _export(
        config, a_file / "sub", "output-unwritable", "--output-dir cannot be made", {"a_file": a_file}
    )
    (tmp_path / "out" / "splat.spz").mkdir(parents=True)
    assert "splat.spz is a folder" in _export(
        config, tmp_path / "out", "target-is-folder", "an output file's name is a folder"
    )
    assert a_file.read_text() == "keep me"


@pytest.fixture(scope="module")
def edit_run(tmp_path_factory):
    def make(name, edit):
        return _copy_run_with_checkpoint(demo_runs.sh0_run(tmp_path_factory),
                                         tmp_path_factory.mktemp(name) / "outputs", edit)  # fmt: skip

    return make


def test_empty_model_writes_nothing(edit_run, tmp_path):
    def all_transparent(params):
        params["opacities"][:] = -10.0

    old = tmp_path / "splat.splat"
    old.write_bytes(b"the previous export")
    config = edit_run("empty", all_transparent)
    ckpt = next((config.parent / "nerfstudio_models").glob("step-*.ckpt"))
    n = len(torch.load(ckpt, map_location="cpu", weights_only=False)["pipeline"]["_model.gauss_params.means"])
    paths = {"run": config.parent, "n": f"{n:,}"}  # the table's row holds neither this run's path nor its size
    message = _export(config, tmp_path, "nothing-to-export", "every gaussian transparent", paths)
    assert "no gaussians to export" in message and "below opacity 1/255" in message and "nothing was written" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["splat.splat"] and old.read_bytes() == b"the previous export"


def test_failure_in_one_format_writes_none(edit_run, tmp_path):
    """A position beyond spz's 24-bit range fails the .spz after the .ply and .splat are staged:
    none of the three lands, the old files stay, no temporary file is left."""

    def far_away(params):
        params["means"][0] = 1e7

    (tmp_path / "splat.ply").write_bytes(b"old ply")
    config = edit_run("far", far_away)
    message = _export(config, tmp_path, "spz-out-of-range", "a position beyond .spz's range", {"run": config.parent})
    assert "do not fit the format's 24-bit fixed point" in message and "nothing was written" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["splat.ply"]
    assert (tmp_path / "splat.ply").read_bytes() == b"old ply"


def test_checkpoint_that_does_not_fit_its_config(edit_run, tmp_path):
    """splat-metal-export reads the tensors from the checkpoint itself (export/checkpoint.py): a
    checkpoint whose SH does not fit the config's SH degree is one line, nothing written."""

    def sh3_rest(params):
        params["features_rest"] = torch.zeros(params["means"].shape[0], 15, 3)

    message = _export(edit_run("misfit", sh3_rest), tmp_path / "out")
    assert "features_rest is (" in message and ", 15, 3), not (" in message and "SH degree 0" in message, message
    assert "nothing was written" in message and "\n" not in message
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
