"""splat-metal beside msplat with matched settings, one line to paste (benchmarks/step_model/vs_msplat.py; was
`splat-metal-bench --vs msplat`): `python benchmarks/bench_vs_msplat.py [--data SCENE] [--steps N] ...`, on a Mac
where msplat is installed (`pip install msplat`: macOS 14+, Python 3.12+).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from step_model import vs_msplat  # noqa: E402

if __name__ == "__main__":
    sys.exit(vs_msplat.cli())
