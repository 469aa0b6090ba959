"""Shared fixtures. The generators live in ``tests/scenes.py`` so any test module can import them
(``from scenes import random_scene``); this file only exposes them as fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import scenes` from any test directory

from scenes import GARDEN_PATH, SIZES, Scene, garden_scene, load_garden, random_scene  # noqa: E402,F401


@pytest.fixture
def make_scene():
    """Factory: ``make_scene(n=..., C=..., width=..., height=..., seed=..., dtype=..., ...)`` -> Scene."""
    return random_scene


@pytest.fixture(params=SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def size(request):
    """(width, height) pairs, square and non-square."""
    return request.param


@pytest.fixture(scope="session")
def garden():
    """The garden points and 3 real cameras (648x420) as numpy arrays; skips when the file is absent."""
    data = load_garden()
    if data is None:
        pytest.skip(f"garden data not found at {GARDEN_PATH} (it lives outside the repo, see docs/design.md section 5)")
    return data


def pytest_configure(config):
    """One random grid seed for the whole run (tests/ops/test_backend_grid.py puts it in its test ids):
    pytest-xdist's workers inherit it from the controller and so collect the same tests."""
    import os
    import random

    os.environ.setdefault("SPLAT_METAL_GRID_SEED", str(random.SystemRandom().randrange(10**6)))
