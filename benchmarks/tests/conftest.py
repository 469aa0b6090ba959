"""The benchmarks' tests (the step model, the scale ledger, the step ledger's budgets, the run beside msplat):
benchmarks/ on sys.path (``import step_model``) and tests/'s helpers (``import scenes``); the tests of
tests/conftest.py's SLOW_TESTS here are marked slow too (the one list of the fast tier)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1]
TESTS = BENCHMARKS.parent / "tests"
sys.path[:0] = [str(BENCHMARKS), str(TESTS)]

_spec = importlib.util.spec_from_file_location("splat_metal_tests_conftest", TESTS / "conftest.py")
_tests_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tests_conftest)
SLOW_TESTS = _tests_conftest.SLOW_TESTS


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith("benchmarks/") and item.nodeid in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
