"""Exact resumes through the real command lines, on CPU: a run of TOTAL steps, the same run stopped
and resumed (Ctrl-C mid-run, then the command splat-metal prints; or ended at --max-num-iterations
and continued with --load-dir), must give the same bits: every loss, the gaussian count at every
step, and the final checkpoint entirely (parameters, optimizer and scheduler state, densification
statistics, random generators, camera queues). A checkpoint without the resume state (an older
splat-metal's) still resumes, with a note, and then differs: what the resume state carries.

The schedule makes the resumed part matter: refines every 10 steps from step 30 to 90 (after
the opacity reset at step 0 and its pause of 11 views + 10 steps), another opacity reset at step
100, random backgrounds (torch's generator), an eval image every 7 steps (Python's ``random`` and
the eval queue), 11 training views (the camera queue is mid-epoch at any resume point).
Scene: 40x30, 12 views, 300 seed points.
"""

from __future__ import annotations

import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from cli_helpers import (
    checkpoint_differences,
    checkpoint_step,
    checkpoints,
    cli_env,
    demo_args,
    executable,
    final_checkpoint,
    interrupt_after_checkpoint,
    run_cli,
    run_dir,
    small_scene,
    tensorboard_scalars,
)

from splat_metal_method.engine import resume_state
from splat_metal_method.engine.trainer import INTERRUPTED_EXIT_CODE

pytestmark = pytest.mark.timeout(900)

TOTAL, FIRST = 120, 30  # steps in all; the plain continue's first run ends after FIRST steps
REFINES = range(30, 100, 10)  # refine steps of this schedule
INTERRUPT_AFTER = 12  # Ctrl-C once the checkpoint of this step exists
OPTIONS = dict(
    max_num_iterations=TOTAL, machine__device_type="cpu", machine__seed=7, logging__steps_per_log=1,
    steps_per_eval_image=7, steps_per_eval_all_images=10**6, pipeline__model__warmup_length=10,
    pipeline__model__refine_every=10, pipeline__model__background_color="random",
    pipeline__model__densify_grad_thresh=0.0004, pipeline__model__split_screen_size=0.1,
)  # fmt: skip


def _args(scene: Path, out: Path, timestamp: str, **options) -> list:
    return ["splat-metal", *demo_args(**{**OPTIONS, **options}), "--data", scene, "--output-dir", out,
            "--timestamp", timestamp]  # fmt: skip


def _interrupted(scene: Path, out: Path) -> tuple:
    """Ctrl-C once step INTERRUPT_AFTER is saved."""
    args = [executable("ns-train"), *_args(scene, out, "interrupted", steps_per_save=1)]
    return interrupt_after_checkpoint(
        args, out / "interrupted.log", cli_env(out / "torch_home"), run_dir(out, "interrupted"), INTERRUPT_AFTER
    )


def _train(scene: Path, out: Path, timestamp: str, *extra, **options):
    return run_cli("ns-train", *_args(scene, out, timestamp, **options), *extra, timeout=600,
                   env=cli_env(out / "torch_home"))  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """In parallel: the uninterrupted run, the Ctrl-C'd one, the first part of the plain continue;
    then in parallel the two resumes and a resume from a checkpoint stripped of the resume state."""
    out = tmp_path_factory.mktemp("resume")
    scene = small_scene(out, 40, 30)
    with ThreadPoolExecutor(3) as pool:
        whole = pool.submit(_train, scene, out, "whole", steps_per_save=10**6)
        interrupted = pool.submit(_interrupted, scene, out)
        first = pool.submit(_train, scene, out, "first", max_num_iterations=FIRST, steps_per_save=10**6)
        whole, (code, text), first = whole.result(), interrupted.result(), first.result()
    assert code == INTERRUPTED_EXIT_CODE, text[-3000:]
    for result in (whole, first):
        assert result.returncode == 0, result.tail()
    match = re.search(r"Resume with: (\S*ns-train .*?--max-num-iterations \d+)", " ".join(text.split()))
    assert match, text[-3000:]
    printed = shlex.split(match.group(1))
    stopped = checkpoint_step(checkpoints(run_dir(out, "interrupted"))[-1])

    old = run_dir(out, "old") / "nerfstudio_models"  # the first part's checkpoint as an older splat-metal wrote it
    old.mkdir(parents=True)
    state = final_checkpoint(run_dir(out, "first"))
    del state[resume_state.KEY]
    torch.save(state, old / checkpoints(run_dir(out, "first"))[-1].name)
    with ThreadPoolExecutor(3) as pool:
        resumed = pool.submit(run_cli, printed[0], *printed[1:], "--timestamp", "resumed", timeout=600,
                              env=cli_env(out / "torch_home"))  # fmt: skip
        first_dir = run_dir(out, "first") / "nerfstudio_models"
        continued = pool.submit(_train, scene, out, "continued", "--load-dir", first_dir,
                                max_num_iterations=TOTAL - FIRST, steps_per_save=10**6)  # fmt: skip
        from_old = pool.submit(_train, scene, out, "from_old", "--load-dir", old, max_num_iterations=5,
                               steps_per_save=10**6)  # fmt: skip
        resumed, continued, from_old = resumed.result(), continued.result(), from_old.result()
    for result in (resumed, continued, from_old):
        assert result.returncode == 0, result.tail()
    return dict(out=out, stopped=stopped, whole=whole, resumed=resumed, continued=continued, from_old=from_old)


def _curve(out: Path, tag: str, *timestamps: str) -> dict:
    curve = {}
    for t in timestamps:
        curve.update(tensorboard_scalars(run_dir(out, t), tag))
    return curve


@pytest.mark.parametrize("parts", [("interrupted", "resumed"), ("first", "continued")], ids=["ctrl_c", "continue"])
def test_resumed_run_is_bit_identical_to_the_uninterrupted_one(runs, parts):
    out = runs["out"]
    resume_at = runs["stopped"] + 1 if parts[0] == "interrupted" else FIRST
    counts = _curve(out, "Train Metrics Dict/gaussian_count", "whole")
    assert sorted(counts) == list(range(TOTAL)), sorted(counts)[-5:]
    grown = [s for s in REFINES if s >= resume_at and counts[s + 1] != counts[s]]  # logged before the refine
    assert len(grown) >= 2, f"resumed at step {resume_at}: refines that changed the count after it: {grown}"

    for tag in ("Train Loss", "Train Metrics Dict/gaussian_count", "Train Metrics Dict/psnr"):
        whole, pieces = _curve(out, tag, "whole"), _curve(out, tag, *parts)
        assert min(_curve(out, tag, parts[1])) == resume_at
        diffs = [s for s in whole if pieces.get(s) != whole[s]]
        assert not diffs, f"{tag} differs at steps {diffs[:8]}: {[(whole[s], pieces.get(s)) for s in diffs[:3]]}"

    whole, resumed = final_checkpoint(run_dir(out, "whole")), final_checkpoint(run_dir(out, parts[1]))
    assert whole["step"] == resumed["step"] == TOTAL - 1
    assert checkpoint_differences(whole, resumed) == []
    assert whole[resume_state.KEY]["strategy"]["state"]["grad2d"] is not None  # the comparison covered it


def test_checkpoint_without_resume_state_resumes_with_a_note(runs):
    result, out = runs["from_old"], runs["out"]
    notes = [line for line in result.stdout.splitlines() if "has no resume state" in line]
    assert len(notes) == 1 and "not exactly as it would have gone on" in notes[0], result.tail()
    whole, old = _curve(out, "Train Loss", "whole"), _curve(out, "Train Loss", "from_old")
    assert sorted(old) == list(range(FIRST, FIRST + 5))
    assert [old[s] for s in old] != [whole[s] for s in old]  # what the resume state carries
