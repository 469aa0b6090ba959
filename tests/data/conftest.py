"""Fixtures of the bad-input tests (test_bad_input.py, test_capture_checks.py): a good scene, and fresh
copies of it to break."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from bad_scenes import HEIGHT, VIEWS, WIDTH

from splat_metal_method.data import demo_scene


@pytest.fixture(scope="module")
def good_scene(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bad_input") / "good"
    demo_scene.generate(out, width=WIDTH, height=HEIGHT, views=VIEWS)
    return out


@pytest.fixture
def scene_copy(good_scene, tmp_path):
    """A fresh copy of the good scene to break."""

    def make(name: str = "scene") -> Path:
        return Path(shutil.copytree(good_scene, tmp_path / name))

    return make
