"""legacy_paths.py: ``python -m`` on a module path of the earlier layout runs the module's new home,
as older docs and scripts do (``python -m splat_metal_method.doctor --emit-metal DIR``)."""

from __future__ import annotations

import sys

from cli_helpers import run_cli


def test_python_m_on_an_old_module_path_runs_the_new_module(tmp_path):
    old = run_cli([sys.executable, "-m", "splat_metal_method.doctor"], "--emit-metal", tmp_path / "old", timeout=300)
    new = run_cli([sys.executable, "-m", "splat_metal_method.verify.doctor"], "--emit-metal", tmp_path / "new",
                  timeout=300)  # fmt: skip
    assert old.returncode == 0 and "Traceback" not in old.output, old.tail()
    assert new.returncode == 0, new.tail()
    emitted = sorted(p.name for p in (tmp_path / "old").iterdir())
    assert emitted and any(name.endswith(".metal") for name in emitted)
    assert emitted == sorted(p.name for p in (tmp_path / "new").iterdir())
    for name in emitted:
        assert (tmp_path / "old" / name).read_bytes() == (tmp_path / "new" / name).read_bytes()


def test_python_m_help_names_the_command():
    result = run_cli([sys.executable, "-m", "splat_metal_method.doctor"], "--help", timeout=300)
    assert result.returncode == 0 and "--emit-metal" in result.stdout, result.tail()
