"""The sdist: Apache-2.0 as an SPDX expression with the LICENSE file, and the whole test suite with
everything it reads (presets, scripts, pins) -- not setuptools' default half set of tests/test*.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_sdist_carries_license_and_what_the_tests_need(tmp_path):
    # Built from a copy without *.egg-info: setuptools would otherwise also take the files an earlier
    # build listed in its SOURCES.txt.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(
        ".git", ".venv", "*.egg-info", "__pycache__", "outputs", "exports", "build", "results", ".pytest_cache"
    )

    def ignore(folder, names):  # the repo's data/ (generated scenes) only: tests/data/ is part of the suite
        return set(skip(folder, names)) | ({"data"} if Path(folder) == ROOT else set())

    shutil.copytree(ROOT, src, ignore=ignore)
    build = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path)], cwd=src, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with tarfile.open(tmp_path / proc.stdout.split()[-1]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
        pkg_info = (
            sdist.extractfile(
                next(m for m in sdist.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
            )
            .read()
            .decode()
        )
    assert "License-Expression: Apache-2.0" in pkg_info and "License-File: LICENSE" in pkg_info
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    needed = {"LICENSE", "README.md", "pyproject.toml", "constraints.txt", "constraints-macos-arm64.txt"}
    for folder in ("tests", "configs", "scripts"):
        needed |= {
            str(p.relative_to(ROOT))
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        }
    assert needed <= names, sorted(needed - names)
    assert not any(n.startswith(("benchmarks/", ".ci/", ".github/")) for n in names)
    # the package's bench/ is splat-metal-bench's (tests/test_layout.py BENCH_MODULES): the step model stays out
    bench = {n.rsplit("/", 1)[1][:-3] for n in names if n.startswith("splat_metal_method/bench/") and n.endswith(".py")}
    assert bench == {"__init__", "__main__", "cli", "scenes", "step_ledger", "timing"}, sorted(bench)
