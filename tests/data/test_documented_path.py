"""docs/training.md's own-data command, as a user runs it: ``ns-process-data`` (COLMAP from the
system's packages; scripts/setup.sh installs Debian's) on 12 real phone photos, then a few steps of
``ns-train splat-metal`` on what it wrote. The command is read from the page, so they cannot drift."""

from __future__ import annotations

import json
import shlex
import shutil

from cli_helpers import run_cli
from real_capture import CAPTURE, REPO

PHOTOS = CAPTURE / "images"  # a real capture, 97 phone photos in the order they were taken
PICKED = slice(0, 24, 2)  # 12 photos, every other one of the first 23: enough overlap for COLMAP


def documented_command(program: str) -> list:
    """The first line of docs/training.md that starts with ``program`` (a fenced command), as argv."""
    for line in (REPO / "docs" / "training.md").read_text().splitlines():
        if line.startswith(program + " "):
            return shlex.split(line.split("#")[0])
    raise AssertionError(f"docs/training.md has no line starting with {program!r}")


def test_documented_ns_process_data_command_makes_a_scene_that_trains(tmp_path):
    assert shutil.which("colmap"), "COLMAP is not on the PATH: scripts/setup.sh installs Debian's colmap package"
    process = documented_command("ns-process-data")
    assert process[:2] == ["ns-process-data", "images"] and "--no-gpu" in process, process
    photos = tmp_path / process[process.index("--data") + 1]
    photos.mkdir()
    for image in sorted(PHOTOS.glob("*.jpg"))[PICKED]:
        shutil.copy(image, photos / image.name)
    processed = run_cli(process[0], *process[1:], cwd=tmp_path, timeout=300)
    assert processed.returncode == 0, processed.tail()
    scene = tmp_path / process[process.index("--output-dir") + 1]
    frames = json.loads((scene / "transforms.json").read_text())["frames"]
    assert len(frames) == 12, f"COLMAP posed {len(frames)} of 12 photos"

    train = documented_command("ns-train")
    assert (
        train[:2] == ["ns-train", "splat-metal"]
        and train[train.index("--data") + 1] == process[process.index("--output-dir") + 1]
    ), train
    trained = run_cli(
        train[0], *train[1:], "--max-num-iterations", 10, "--vis", "tensorboard", "--output-dir", tmp_path / "out",
        cwd=tmp_path, timeout=300, torch_home=tmp_path / "torch_home",
    )  # fmt: skip
    assert trained.returncode == 0, trained.tail()
    assert list((tmp_path / "out").rglob("step-000000009.ckpt")), trained.tail()
