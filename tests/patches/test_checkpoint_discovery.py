"""patches/checkpoints.py: the checkpoint nerfstudio loads is the newest readable step-N.ckpt, whatever
else lies in the folder (Finder's .DS_Store, a temporary file, a sub-folder), and a broken one is
named with the previous good one (eval, export) or skipped with a warning (resume).

Checkpoints here are real torch.save files; the broken ones are cut short or have one byte flipped,
as a full disk or a bad copy leaves them."""

from __future__ import annotations

import pytest
import torch
from bad_input_table import record

from splat_metal_method.patches.checkpoints import CheckpointError, find_checkpoint, step_checkpoints, unreadable


def _save(path, step):
    torch.save({"step": step, "pipeline": {"w": torch.full((4096,), float(step))}}, path)
    return path


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "nerfstudio_models"
    d.mkdir()
    for step in (99, 199, 1999):  # 1999 > 199: steps compare as numbers, not names
        _save(d / f"step-{step:09d}.ckpt", step)
    return d


def _clutter(d):
    (d / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")  # what Finder writes
    (d / "._step-000001999.ckpt").write_bytes(b"AppleDouble")  # macOS resource fork on a foreign disk
    (d / "step-000009999.ckpt.partial-123").write_bytes(b"x")
    (d / "notes.txt").write_text("mine")
    (d / "step-000005000.ckpt").mkdir()  # a folder with a checkpoint's name
    (d / "step-latest.ckpt").write_bytes(b"x")


def test_other_files_are_ignored(folder):
    _clutter(folder)
    assert [s for s, _ in step_checkpoints(folder)] == [99, 199, 1999]
    path, warning = find_checkpoint(folder)
    assert path == folder / "step-000001999.ckpt" and warning is None
    assert torch.load(path)["step"] == 1999
    assert find_checkpoint(folder, step=199)[0] == folder / "step-000000199.ckpt"


def _cut(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data: the zip directory still reads
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_cut, _flip], ids=["truncated", "flipped-byte"])
def test_a_broken_newest_checkpoint_is_named_with_the_previous_good_one(folder, damage, request):
    newest = folder / "step-000001999.ckpt"
    damage(newest)
    assert unreadable(newest) and unreadable(folder / "step-000000199.ckpt") is None
    with pytest.raises(CheckpointError) as info:
        find_checkpoint(folder)
    message = str(info.value.code)
    case = {"truncated": "checkpoint/newest-truncated", "flipped-byte": "checkpoint/newest-damaged"}[
        request.node.callspec.id
    ]
    what = {"truncated": "the newest checkpoint is truncated (ns-export, ns-eval, ns-viewer, ns-render, splat-metal-export)",
            "flipped-byte": "one byte of the newest checkpoint is flipped (ns-export, ns-eval, ...)"}[request.node.callspec.id]  # fmt: skip
    record(case, what, message, models=folder)
    assert "\n" not in message and str(newest) in message and str(folder / "step-000000199.ckpt") in message

    path, warning = find_checkpoint(folder, resume=True)  # ns-train --load-dir: the previous good one, said so
    assert path == folder / "step-000000199.ckpt"
    assert str(newest) in warning and str(path) in warning


def test_resume_warning(folder):
    _cut(folder / "step-000001999.ckpt")
    _, warning = find_checkpoint(folder, resume=True)
    record("checkpoint/resume-newest-truncated", "`ns-train --load-dir` whose newest checkpoint is truncated "
           "(exit status 0: it resumes)", warning, models=folder)  # fmt: skip


def test_every_checkpoint_broken(folder):
    for p in folder.iterdir():
        _cut(p)
    with pytest.raises(CheckpointError) as info:
        find_checkpoint(folder)
    message = str(info.value.code)
    assert "no earlier good checkpoint" in message
    with pytest.raises(CheckpointError):
        find_checkpoint(folder, resume=True)
    with pytest.raises(CheckpointError, match="choose another --load-step"):
        find_checkpoint(folder, step=199)
