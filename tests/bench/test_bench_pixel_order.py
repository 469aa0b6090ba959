"""benchmarks/bench_pixel_order.py, the count behind docs/step-model.md's "A simdgroup's pixels" table: on garden's
points, 16x2 strips a simdgroup meet more (gaussian, simdgroup) groups than 8x4 blocks, by the share the model's
ledgers show (1.2x), and the table it prints adds up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from scenes import GARDEN_PATH

REPO = Path(__file__).resolve().parents[2]


def test_strips_meet_a_fifth_more_groups_than_blocks_on_garden():
    if not GARDEN_PATH.is_file():
        pytest.skip(f"{GARDEN_PATH} not present (it lives outside the repo, docs/design.md section 5)")
    from cli_helpers import cli_env

    env = {**cli_env(), "SPLAT_METAL_GARDEN_POINTS": str(GARDEN_PATH)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_pixel_order.py"), "--downscales", "4"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = re.findall(
        r"^\| ([\d,]+) at (\d+)x(\d+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \|", proc.stdout, re.M
    )
    assert len(rows) == 1, proc.stdout
    n, w, h, isects, strips, blocks, share = rows[0]
    num = [int(v.replace(",", "")) for v in (n, isects, strips, blocks)]
    assert num[0] == 138_766 and (int(w), int(h)) == (162, 105) and num[1] > 0
    assert num[3] < num[2] and float(share) == pytest.approx(num[2] / num[3], abs=1e-3)
    assert 1.1 < float(share) < 1.35, share
