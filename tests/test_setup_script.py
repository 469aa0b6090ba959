"""scripts/setup.sh refuses an unsupported Python before it installs anything, and accepts exactly
the Pythons pyproject.toml's requires-python admits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent


def fake_python(tmp_path: Path, version: str) -> Path:
    """An executable that answers any question with `version`, as setup.sh's version query expects
    of a real Python; it cannot make a virtual environment, so a setup that got past the check fails."""
    exe = tmp_path / f"python{version}"
    exe.write_text(f"#!/bin/sh\necho {version}\n")
    exe.chmod(0o755)
    return exe


def run_setup(tmp_path: Path, python: Path | str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": str(python), "SPLAT_METAL_VENV": str(tmp_path / "venv")}
    return subprocess.run(
        ["bash", "scripts/setup.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("version", ["3.9", "3.10", "3.11", "3.12", "3.13", "3.14"])
def test_check_python_agrees_with_requires_python(tmp_path, version):
    requires = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    proc = run_setup(tmp_path, fake_python(tmp_path, version), "--check-python")
    supported = f"{version}.0" in requires
    assert proc.returncode == (0 if supported else 1), proc.stdout + proc.stderr
    if not supported:
        assert f"Python {version};" in proc.stderr and "supports Python 3.10, 3.11, 3.12" in proc.stderr


def test_check_python_with_a_real_interpreter(tmp_path):
    proc = run_setup(tmp_path, sys.executable, "--check-python")
    assert proc.returncode == 0, proc.stderr
    assert f"Python {sys.version_info[0]}.{sys.version_info[1]} " in proc.stdout
    missing = run_setup(tmp_path, tmp_path / "no-such-python", "--check-python")
    assert missing.returncode == 1 and "not a working Python" in missing.stderr


def test_setup_stops_on_python_313_before_installing_anything(tmp_path):
    proc = run_setup(tmp_path, fake_python(tmp_path, "3.13"))
    assert proc.returncode == 1
    assert "Python 3.13; splat-metal supports Python 3.10, 3.11, 3.12" in proc.stderr
    assert "PYTHON=python3.12 bash scripts/setup.sh" in proc.stderr
    assert "apt-get" not in proc.stdout and not (tmp_path / "venv").exists()
