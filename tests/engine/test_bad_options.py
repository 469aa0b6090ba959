"""Bad options and environment of ``ns-train splat-metal``: one line (what, which option or file, how
to fix), exit status 1, no traceback, and nothing written (engine/preflight.py, patches/checkpoints.py).

The options are parsed by nerfstudio's own command line (tyro over its method union, as ns-train
does) and run through ns-train's steps up to its first write (``set_timestamp``, ``save_config``) in
this process; one case also runs as the real ns-train in a subprocess (test_ns_train_...). Each case's
line is a row of docs/reliability.md's table (bad_input_table.record).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest
import torch
import tyro
from bad_input_table import record
from cli_helpers import cli_env, run_cli, small_scene, snapshot

FAST = ["--max-num-iterations", "5", "--vis", "tensorboard"]


@pytest.fixture(scope="module")
def scene(tmp_path_factory) -> Path:
    return small_scene(tmp_path_factory.mktemp("bad_options"), 40, 30)


def _checkpoint(path: Path, step: int = 5) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "pipeline": {"w": torch.arange(1000.0)}}, path)
    return path


def _truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _run_folder(tmp: Path) -> Path:
    run = tmp / "old" / "scene" / "splat-metal" / "run"
    _checkpoint(run / "nerfstudio_models" / "step-000000005.ckpt")
    (run / "config.yml").write_text("# a run\n")
    return run


@contextlib.contextmanager
def _read_only_folder(path: Path):
    """A folder nobody can write in: a read-only tmpfs as root (root ignores permissions), else 0555."""
    path.mkdir()
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True)
        if mounted.returncode != 0:
            pytest.skip(f"running as root without mount: a read-only folder cannot be made ({mounted.stderr!r})")
        try:
            yield path
        finally:
            subprocess.run(["umount", str(path)], check=True)
    else:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)


# case: (what the user did, extra arguments (a function of tmp), environment, method)
CASES = {
    "option/device-mps-missing": ("`--machine.device-type mps` on a machine without MPS",
                                  lambda t: ["--machine.device-type", "mps"], {}, "splat-metal"),
    "option/device-cuda-missing": ("`--machine.device-type cuda` on a machine without CUDA",
                                   lambda t: ["--machine.device-type", "cuda"], {}, "splat-metal"),
    "option/backend-env-unknown": ("`SPLAT_METAL_BACKEND=vulkan`", lambda t: [],
                                   {"SPLAT_METAL_BACKEND": "vulkan"}, "splat-metal"),
    "option/backend-unavailable": ("`--pipeline.model.backend gsplat` without CUDA",
                                   lambda t: ["--pipeline.model.backend", "gsplat"], {}, "splat-metal"),
    "option/sh-degree-too-high": ("`--pipeline.model.sh-degree 5`",
                                  lambda t: ["--pipeline.model.sh-degree", "5"], {}, "splat-metal"),
    "option/sh-degree-negative": ("`--pipeline.model.sh-degree -1`",
                                  lambda t: ["--pipeline.model.sh-degree", "-1"], {}, "splat-metal"),
    "option/cap-max-zero": ("`ns-train splat-metal-mcmc --pipeline.model.cap-max 0`",
                            lambda t: ["--pipeline.model.cap-max", "0"], {}, "splat-metal-mcmc"),
    "option/cap-max-negative": ("`ns-train splat-metal-mcmc --pipeline.model.cap-max -5`",
                                lambda t: ["--pipeline.model.cap-max", "-5"], {}, "splat-metal-mcmc"),
    "option/max-num-iterations-zero": ("`--max-num-iterations 0`",
                                       lambda t: ["--max-num-iterations", "0"], {}, "splat-metal"),
    "option/steps-per-save-zero": ("`--steps-per-save 0`", lambda t: ["--steps-per-save", "0"], {}, "splat-metal"),
    "option/experiment-name-outside": ("`--experiment-name ../../elsewhere` (outside `--output-dir`)",
                                       lambda t: ["--experiment-name", "../../elsewhere"], {}, "splat-metal"),
    "option/output-dir-is-a-file": ("`--output-dir` is a file",
                                    lambda t: ["--output-dir", t / "a_file"], {}, "splat-metal"),
    "load/load-dir-missing": ("`--load-dir` a folder that does not exist",
                              lambda t: ["--load-dir", t / "nope"], {}, "splat-metal"),
    "load/load-dir-run-folder": ("`--load-dir` the run's folder instead of its nerfstudio_models",
                                 lambda t: ["--load-dir", _run_folder(t)], {}, "splat-metal"),
    "load/load-dir-empty": ("`--load-dir` an empty folder", lambda t: ["--load-dir", t / "empty"], {}, "splat-metal"),
    "load/load-dir-only-truncated": (
        "`--load-dir` whose only checkpoint is truncated",
        lambda t: ["--load-dir", _truncate(_checkpoint(t / "ckpts" / "step-000000009.ckpt")).parent], {}, "splat-metal"),
    "load/load-step-missing": ("`--load-step 7` that was not saved",
                               lambda t: ["--load-dir", _run_folder(t) / "nerfstudio_models", "--load-step", "7"], {},
                               "splat-metal"),
    "load/load-checkpoint-missing": ("`--load-checkpoint` a file that does not exist",
                                     lambda t: ["--load-checkpoint", t / "step-000000001.ckpt"], {}, "splat-metal"),
    "load/load-checkpoint-truncated": (
        "`--load-checkpoint` a truncated file",
        lambda t: ["--load-checkpoint", _truncate(_checkpoint(t / "step-000000003.ckpt"))], {}, "splat-metal"),
}  # fmt: skip
NEEDS_NO = {"option/device-mps-missing": "mps", "option/device-cuda-missing": "cuda",
            "option/backend-unavailable": "cuda"}  # fmt: skip


def _has(device: str) -> bool:
    return torch.backends.mps.is_available() if device == "mps" else torch.cuda.is_available()


def _ns_train_until_first_write(argv, monkeypatch, env) -> str:
    """nerfstudio's ns-train (scripts/train.py main) up to its first write; the SystemExit's message."""
    from nerfstudio.configs.method_configs import AnnotatedBaseConfigUnion

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    config = tyro.cli(AnnotatedBaseConfigUnion, args=[str(a) for a in argv])
    if config.data:
        config.pipeline.datamanager.data = config.data
    with pytest.raises(SystemExit) as info:
        config.set_timestamp()
        config.save_config()
    return str(info.value.code)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_option_is_one_line_before_anything_is_written(case, scene, tmp_path, monkeypatch):
    if case in NEEDS_NO and _has(NEEDS_NO[case]):
        pytest.skip(f"this machine has {NEEDS_NO[case]}: the case cannot happen here")
    what, extra, env, method = CASES[case]
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "empty").mkdir()
    out = tmp_path / "outputs"
    args = extra(tmp_path)
    before = snapshot(tmp_path)
    message = _ns_train_until_first_write(
        [method, "--data", scene, "--output-dir", out, *FAST, *args], monkeypatch, env
    )
    record(case, what, message, tmp=tmp_path, data=scene)
    assert message.startswith("splat-metal: ") and "\n" not in message, message
    assert snapshot(tmp_path) == before and not out.exists()  # nothing written, no run folder


def test_read_only_output_dir(scene, tmp_path, monkeypatch):
    with _read_only_folder(tmp_path / "read_only") as folder:
        out = folder / "outputs"
        message = _ns_train_until_first_write(["splat-metal", "--data", scene, "--output-dir", out, *FAST],
                                              monkeypatch, {})  # fmt: skip
        record("option/output-dir-read-only", "`--output-dir` in a read-only folder", message, tmp=tmp_path)
        assert "\n" not in message and str(folder) in message
        assert not out.exists()


def test_ns_train_prints_the_line_and_writes_nothing(scene, tmp_path):
    """The real ns-train: the same line as the in-process case, last on stderr, exit 1, no traceback."""
    out = tmp_path / "outputs"
    result = run_cli("ns-train", "splat-metal", "--data", scene, "--output-dir", out, *FAST,
                     "--pipeline.model.sh-degree", 5, timeout=300, env=cli_env(tmp_path / "torch_home"))  # fmt: skip
    assert result.returncode == 1, result.tail()
    assert "Traceback" not in result.output, result.tail()
    last = result.stderr.rstrip().splitlines()[-1]
    record("option/sh-degree-too-high", "`--pipeline.model.sh-degree 5`", last, tmp=tmp_path, data=scene)
    assert not out.exists()
