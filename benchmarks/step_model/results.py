"""Stored measurements the model reads (benchmarks/results/*.json), so that it prints without training anything.

``ledger_before_issue30.json``: the counts of one steady splat-metal training step (metal backend, counted under
the emulator as a Mac runs it), as ``ledger.measure(...)["steady"]`` gave them at main 55067df (2026-12-03), on the
demo scene 96x64 (1,500 gaussians) and garden-points 20k at 1/4 (162x105), the two scenes of
benchmarks/bench_ledger.py's default run. Re-measure with ``python benchmarks/bench_model.py --write-ledger
FILE.json`` and pass ``--after FILE.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def load(name: str) -> dict:
    """benchmarks/results/<name>.json."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def before_issue30() -> dict:
    """Scene label -> the stored steady step's ledger dict (peers.ledger_dict's form), before issue 30."""
    return load("ledger_before_issue30")
