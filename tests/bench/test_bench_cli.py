"""`splat-metal-bench --quick` end to end, as a user runs it (here on CPU: the cpu backend and the
Metal backend under the emulator): its summary line, bench.csv, memory.csv and memory.png."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_console_script_is_declared():
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["splat-metal-bench"] == "splat_metal_method.bench.cli:main"
    from splat_metal_method.bench import cli as bench

    assert callable(bench.main)


def test_vs_msplat_says_in_one_line_what_runs_it_now(tmp_path):
    """--vs msplat moved to benchmarks/ (a run beside another project): the option says what replaced it, trains
    nothing and writes nothing."""
    from cli_helpers import cli_env

    proc = subprocess.run([sys.executable, "-m", "splat_metal_method.bench.cli", "--vs", "msplat", "--data", "scene"],
                          capture_output=True, text=True, timeout=300, env=cli_env(), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "python benchmarks/bench_vs_msplat.py" in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == [] and proc.stdout == ""


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    from cli_helpers import cli_env

    out = tmp_path_factory.mktemp("bench") / "results"
    proc = subprocess.run([sys.executable, "-m", "splat_metal_method.bench.cli", "--quick", "--out", str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, env=cli_env(),
                          cwd=out.parent)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
    return out, proc.stdout


def test_quick_bench_summary_line(quick_run):
    out, stdout = quick_run
    line = (out / "summary.txt").read_text().strip()
    assert line in stdout and "\n" not in line
    assert line.startswith("splat-metal-bench ") and "| cpu " in line
    runs = re.findall(r"demo 48x32 (\w+) hooks (on|off): ([\d.]+) steps/s(?:, (\d+) host syncs/step)?", line)
    assert [(b, h) for b, h, _, _ in runs] == [("cpu", "on"), ("cpu", "off"), ("metal", "on")], line
    for backend, hooks, steps_per_s, syncs in runs:
        assert float(steps_per_s) > 0
        if hooks == "on":  # counted by the step ledger: none in a steady Metal step (padded lists), the
            # cpu backend's exact lists read the intersection count
            assert (int(syncs) == 0) if backend == "metal" else (0 < int(syncs) < 100), line


def test_quick_bench_files(quick_run):
    out, _ = quick_run
    rows = list(csv.DictReader(open(out / "bench.csv")))
    steps = {"cpu": 8, "metal": 3}  # --quick: the emulated Metal backend runs 3 steps
    assert [(r["backend"], r["hooks"]) for r in rows] == [("cpu", "1"), ("cpu", "0"), ("metal", "1")]
    for r in rows:
        assert int(r["steps"]) == steps[r["backend"]] and int(r["gaussians"]) > 0 and float(r["steps_per_s"]) > 0
        assert all(float(r[f"{s}_ms"]) > 0 for s in ("forward", "backward", "optimizer"))
    memory = list(csv.DictReader(open(out / "memory.csv")))
    for backend, hooks in (("cpu", "1"), ("cpu", "0"), ("metal", "1")):
        curve = [m for m in memory if m["backend"] == backend and m["hooks"] == hooks]
        assert [int(m["step"]) for m in curve] == list(range(steps[backend])), curve  # every step (--mem-every 1)
        assert all(100 < float(m["rss_mib"]) < 64_000 for m in curve)
    # densification ran: the count changed during the 8-step runs
    assert len({m["gaussians"] for m in memory if m["backend"] == "cpu"}) > 1
    png = (out / "memory.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.parametrize("option,base,other", [("tile-merge", "direct", "tile merge")])
def test_vs_ab_trains_both_and_counts_fewer_atomics_with_the_other(tmp_path, option, base, other):
    """`splat-metal-bench --vs tile-merge`: what a Mac user runs to settle the backward's tile merge (off by default
    until measured). Here emulated: the line says its times say nothing, the atomics are counted: fewer merged, for
    the same training."""
    from cli_helpers import cli_env

    out = tmp_path / "ab"
    proc = subprocess.run([sys.executable, "-m", "splat_metal_method.bench.cli", "--quick", "--vs", option,
                           "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900, env=cli_env(), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
    line = (out / "summary.txt").read_text().strip()
    assert line in proc.stdout and "EMULATED" in line and f"--vs {option}," in line
    m = re.search(rf"demo 48x32: backward ([\d.]+) ms {base}, ([\d.]+) ms {other} .*device atomics a step (\d+) / (\d+)",
                  line)  # fmt: skip
    assert m, line
    assert float(m[1]) > 0 and float(m[2]) > 0
    assert 0 < int(m[4]) < int(m[3]), line
    rows = list(csv.DictReader(open(out / "bench.csv")))
    assert [(r["backend"], r["variant"]) for r in rows] == [("metal", base), ("metal", other)]
    assert [int(r["device_atomics_per_step"]) for r in rows] == [int(m[3]), int(m[4])]
    assert all(int(r["gaussians"]) > 0 for r in rows)


def test_vs_pixel_order_says_in_one_line_that_the_row_order_is_gone(tmp_path):
    """The row pixel order was removed (8x4 blocks are the only order): `--vs pixel-order` says so in one line,
    trains nothing and writes nothing."""
    from cli_helpers import cli_env

    proc = subprocess.run([sys.executable, "-m", "splat_metal_method.bench.cli", "--vs", "pixel-order",
                           "--out", str(tmp_path / "ab")], capture_output=True, text=True, timeout=120,
                          env=cli_env(), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "row pixel order is gone" in lines[0] and "8x4" in lines[0], proc.stderr
    assert not (tmp_path / "ab").exists()
