"""The bench scenes find the shared garden points beside a clone, as the tests' own scenes do (the move
into bench/ once left the lookup one folder short, and the garden-points ledger was skipped)."""

from __future__ import annotations

import pytest
from scenes import GARDEN_PATH

from splat_metal_method.bench import scenes as bench_scenes


def test_garden_points_found_beside_the_clone(monkeypatch):
    monkeypatch.delenv(bench_scenes.GARDEN_ENV, raising=False)
    if not GARDEN_PATH.is_file():
        pytest.skip(f"{GARDEN_PATH} not present (it lives outside the repo, docs/design.md section 5)")
    assert bench_scenes.garden_points_path() == GARDEN_PATH.resolve()
