"""The step model's before/after comparison on stored ledgers (benchmarks/step_model/model.py; a modelEL, not a
measurement): `python benchmarks/bench_step_model.py --step STEP.json --before A.json [..] --after B.json [..]`.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from step_model import model  # noqa: E402

if __name__ == "__main__":
    sys.exit(model.main())
