"""`splat-metal-export` reads config.yml without importing the run's classes (export/run_config.py)
when it recognises a gaussian-splatting run, and takes nerfstudio's full load otherwise. The quick
read must find what the full load finds (same checkpoint folder, load_step, SH degree, rasterize
mode), write the same bytes in every format, never import nerfstudio's trainer, and answer None
for every config it is not sure of, so that the full load's checks and error lines stay the ones
users see.
"""

from __future__ import annotations

import sys
from pathlib import Path

import demo_runs
import pytest
import yaml
from cli_helpers import cli_env
from test_export_formats import _export

from splat_metal_method.export import cli, run_config
from splat_metal_method.export.run_config import quick_run

pytestmark = pytest.mark.timeout(600)
FORMATS = ("ply", "splat", "spz", "compressed-ply", "sog")


def _same_settings(config: Path) -> None:
    quick, full = quick_run(config), cli._check_run(config)
    assert quick is not None, f"{config} not recognised"
    assert (quick.method_name, quick.checkpoint_dir, quick.load_step) == (
        full.method_name,
        full.checkpoint_dir,
        full.load_step,
    )
    assert (quick.model.sh_degree, quick.model.rasterize_mode) == (full.model.sh_degree, full.model.rasterize_mode)


@pytest.mark.parametrize("run", ["sh0", "sh3"])
def test_quick_read_finds_what_nerfstudios_load_finds(run, tmp_path_factory, tmp_path):
    config = getattr(demo_runs, f"{run}_run")(tmp_path_factory)
    _same_settings(config)
    # the fields it reads, changed: a load_step, another rasterize mode, the MCMC model's class
    cfg = yaml.load(config.read_text(), Loader=yaml.Loader)
    cfg.load_step = 9
    cfg.pipeline.model.rasterize_mode = "antialiased"
    edited = tmp_path / "config.yml"
    edited.write_text(
        yaml.dump(cfg).replace("method.model.SplatMetalModelConfig", "method.mcmc.SplatMetalMCMCModelConfig")
    )
    assert "SplatMetalMCMCModelConfig" in edited.read_text()
    _same_settings(edited)
    assert quick_run(edited).load_step == 9 and quick_run(edited).model.rasterize_mode == "antialiased"


def test_every_format_has_the_full_loads_bytes(tmp_path_factory, tmp_path, monkeypatch):
    config = demo_runs.sh3_run(tmp_path_factory)
    full_loads = []
    check_run = cli._check_run
    monkeypatch.setattr(cli, "_check_run", lambda path: full_loads.append(path) or check_run(path))
    quick = cli.ExportSplats(load_config=config, output_dir=tmp_path / "quick", format=FORMATS).main()
    assert full_loads == [], "the demo run's config.yml was not read by the quick path"
    monkeypatch.setattr(run_config, "quick_run", lambda path: None)
    full = cli.ExportSplats(load_config=config, output_dir=tmp_path / "full", format=FORMATS).main()
    assert full_loads == [config]
    assert len(quick) == len(FORMATS)
    for a, b in zip(quick, full):
        assert a.name == b.name and a.read_bytes() == b.read_bytes(), a.name


def test_ply_export_does_not_import_nerfstudios_trainer(tmp_path_factory, tmp_path):
    import subprocess

    config = demo_runs.sh0_run(tmp_path_factory)
    code = (
        "import sys\nfrom splat_metal_method.export.cli import entrypoint\n"
        f"sys.argv = ['splat-metal-export', '--load-config', {str(config)!r}, '--output-dir', {str(tmp_path)!r}, "
        "'--format', 'ply']\nentrypoint()\n"
        "print('trainer imported:', 'nerfstudio.engine.trainer' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trainer imported: False" in result.stdout, result.stdout + result.stderr
    assert (tmp_path / "splat.ply").stat().st_size > 0


def test_anything_else_takes_the_full_load(tmp_path_factory, tmp_path):
    from nerfstudio.configs.method_configs import method_configs

    nerfacto = tmp_path / "nerfacto.yml"
    nerfacto.write_text(yaml.dump(method_configs["nerfacto"]))
    assert quick_run(nerfacto) is None
    not_yaml = tmp_path / "bad.yml"
    not_yaml.write_text("pipeline: [unclosed\n")
    assert quick_run(not_yaml) is None
    not_utf8 = tmp_path / "binary.yml"
    not_utf8.write_bytes(b"\xff\xfe\x00")
    assert quick_run(not_utf8) is None

    config = demo_runs.sh0_run(tmp_path_factory)
    text = config.read_text()
    assert quick_run(config) is not None

    def variant(name: str, old: str, new: str) -> Path:
        assert old in text, old
        path = tmp_path / f"{name}.yml"
        path.write_text(text.replace(old, new, 1))
        return path

    for path in (
        variant("future-method", "method_name: splat-metal", "method_name: splat-metal-from-the-future"),
        variant("plugin-model", "splat_metal_method.method.model.SplatMetalModelConfig", "plugin.models.SplatConfig"),
        variant(
            "old-layout",
            "splat_metal_method.method.configs.SplatMetalTrainerConfig",
            "splat_metal_method.config.SplatMetalTrainerConfig",
        ),  # fmt: skip
        variant("missing-module", "nerfstudio.utils.writer.LocalWriter", "no_such_plugin.writer.LocalWriter"),
        variant("no-sh-degree", "    sh_degree: 0\n", "\n"),
        variant("step-as-text", "load_step: null", "load_step: '9'"),
    ):
        assert quick_run(path) is None, path.name
    # and the full load's messages stay
    message = _export(tmp_path / "missing-module.yml", tmp_path / "out")
    assert "cannot be read as a run's config" in message and "no_such_plugin.writer" in message, message
    assert "a method not installed here" in _export(tmp_path / "future-method.yml", tmp_path / "out")
