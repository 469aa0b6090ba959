"""`splat-metal-export` reads a checkpoint's tensors without torch (export/torch_zip.py): the same values
torch.load gives, the same bytes in every format as the torch path, torch never imported for .ply, .splat,
.spz, .compressed.ply and .glb (its SH turned into glTF's axes) of an SH degree > 0 run, and what the reader cannot read goes to torch.load.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile

import demo_runs
import numpy as np
import pytest
import torch
from cli_helpers import cli_env

from splat_metal_method.export import cli, torch_zip

pytestmark = pytest.mark.timeout(600)
FAST_FORMATS = ("ply", "splat", "spz", "compressed-ply", "glb")


def _checkpoint(config):
    return sorted((config.parent / "nerfstudio_models").glob("step-*.ckpt"))[-1]


def _same(ours, theirs, where="") -> int:
    """Compares torch.load's object with torch_zip.load's; returns how many tensors were compared."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, np.ndarray), where
        want = theirs.float().numpy() if theirs.dtype == torch.bfloat16 else theirs.numpy()
        got = torch_zip.as_float32(ours) if theirs.dtype == torch.bfloat16 else ours
        assert got.shape == want.shape and got.dtype == want.dtype, (where, got.shape, want.shape, got.dtype)
        assert np.array_equal(got, want, equal_nan=True), where
        return 1
    if isinstance(theirs, dict):
        assert set(ours) == set(theirs), where
        return sum(_same(ours[k], theirs[k], f"{where}/{k}") for k in theirs)
    if isinstance(theirs, (list, tuple)):
        return sum(_same(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(ours, theirs)))
    return 0


def test_a_runs_checkpoint_reads_as_torch_loads_it(tmp_path_factory):
    path = _checkpoint(demo_runs.sh3_run(tmp_path_factory))
    ours = torch_zip.load(path)
    theirs = torch.load(path, map_location="cpu", weights_only=False)
    compared = _same(ours["pipeline"], theirs["pipeline"], "pipeline")
    assert compared >= 6, compared  # the six gaussian tensors at least
    assert not ours["pipeline"]["_model.gauss_params.means"].flags.writeable  # a view of the mapped file


def test_views_dtypes_and_empty_tensors(tmp_path):
    t = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    tensors = {
        "transposed": t.t(), "offset window": t[2:, 3:7], "strided": t[::2, ::3], "bfloat16": t.to(torch.bfloat16)[1:],
        "half": t.half(), "double": t.double(), "int64": torch.arange(5), "int32": torch.arange(7, dtype=torch.int32),
        "bool": t > 3, "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5),
    }  # fmt: skip
    path = tmp_path / "odd.ckpt"
    torch.save({"tensors": tensors, "step": 7, "nested": [t[1], (t[:, 0],)]}, path)
    ours = torch_zip.load(path)
    assert _same(ours, torch.load(path, weights_only=False)) == len(tensors) + 2
    assert ours["step"] == 7


def test_what_it_cannot_read_is_unsupported(tmp_path):
    t = torch.arange(12, dtype=torch.float32)
    legacy = tmp_path / "legacy.ckpt"
    torch.save({"x": t}, legacy, _use_new_zipfile_serialization=False)
    text = tmp_path / "text.ckpt"
    text.write_text("not a checkpoint")
    deflated = tmp_path / "deflated.ckpt"
    torch.save({"x": t}, tmp_path / "plain.ckpt")
    with zipfile.ZipFile(tmp_path / "plain.ckpt") as src, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            dst.writestr(item.filename, src.read(item.filename))
    for path in (legacy, text, deflated):
        with pytest.raises(torch_zip.Unsupported):
            torch_zip.load(path)
    assert np.array_equal(torch_zip.load(tmp_path / "plain.ckpt")["x"], t.numpy())


@pytest.fixture(scope="module")
def offset_run(tmp_path_factory):
    """The SH-3 demo run with random SH, a tenth of its gaussians below the opacity cut, and its means
    saved as a non-contiguous view at a storage offset (a transposed window of a larger tensor), as a
    checkpoint can hold them: the export must read the view, not the storage's first bytes."""
    from test_export_roundtrip import _copy_run_with_checkpoint

    gen = torch.Generator().manual_seed(2)

    def edit(params):
        params["features_rest"] = 0.3 * torch.randn(params["features_rest"].shape, generator=gen)
        n = params["opacities"].shape[0]
        params["opacities"][torch.randperm(n, generator=gen)[: n // 10]] = -8.0
        big = torch.randn(5, n + 2, generator=gen)
        big[1:4, 2:] = params["means"].t()
        params["means"] = big[1:4, 2:].t()  # [N, 3], strides (1, n + 2), storage offset n + 4
        assert not params["means"].is_contiguous() and params["means"].storage_offset() > 0

    config = demo_runs.sh3_run(tmp_path_factory)
    return _copy_run_with_checkpoint(config, tmp_path_factory.mktemp("offset_run") / "outputs", edit)


@pytest.mark.parametrize("which", ["demo", "offset"])
def test_export_without_torch_writes_the_torch_paths_bytes(tmp_path_factory, tmp_path, monkeypatch, which, request):
    from splat_metal_method.export.playcanvas import gpu_possible

    config = demo_runs.sh3_run(tmp_path_factory) if which == "demo" else request.getfixturevalue("offset_run")
    fast = tmp_path / "fast"
    # .sog too where torch could see no GPU (its k-means then runs on numpy; with a GPU torch picks the device)
    formats = FAST_FORMATS + (() if gpu_possible() else ("sog",))
    code = (
        "import sys\nfrom splat_metal_method.export.cli import entrypoint\n"
        f"sys.argv = ['splat-metal-export', '--load-config', {str(config)!r}, '--output-dir', {str(fast)!r}, "
        f"'--format', {', '.join(repr(f) for f in formats)}]\n"
        "try:\n    entrypoint()\nfinally:\n    print('torch imported:', 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torch imported: False" in result.stdout, result.stdout + result.stderr

    def unsupported(path):
        raise torch_zip.Unsupported("the test takes torch's path")

    monkeypatch.setattr(torch_zip, "load", unsupported)
    with_torch = cli.ExportSplats(load_config=config, output_dir=tmp_path / "torch", format=formats).main()
    assert len(with_torch) == len(formats)
    for path in with_torch:
        assert (fast / path.name).read_bytes() == path.read_bytes(), path.name
