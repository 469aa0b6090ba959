"""The scale ledger's table (benchmarks/step_model/scale_ledger.py): one steady Metal training render counted at
0.5-3M gaussians under the emulator (count-only mode by default). `--help` for its options.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from step_model import scale_ledger  # noqa: E402

if __name__ == "__main__":
    sys.exit(scale_ledger.main())
