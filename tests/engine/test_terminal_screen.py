"""The lines a person must read at the end of ``ns-train`` stay on a real terminal's screen.

nerfstudio's progress table (LocalWriter) redraws itself by moving the cursor up over its own lines;
whatever was printed in between is overwritten. The byte stream still holds every message, so the
test reads the screen instead: ns-train runs in a tmux pane (a real pseudo-terminal, with the
terminal's own cursor handling), is Ctrl-C'd by keys sent to the pane as a person types them, and the
pane's final screen (``capture-pane``) must show the stop line, the checkpoint and the whole resume
command, and, for a run that finishes, where its checkpoint is and the command that trains further.
tmux is a system package (scripts/setup.sh installs it on Debian/Ubuntu).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from cli_helpers import checkpoints, cli_env, executable, run_dir, small_scene

from splat_metal_method.engine.trainer import resume_command

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/setup.sh installs it)"),
]

QUIET = ["--vis", "tensorboard", "--steps-per-eval-image", "1000000", "--steps-per-eval-all-images", "1000000",
         "--steps-per-eval-batch", "1000000", "--logging.steps-per-log", "1"]  # fmt: skip


class Pane:
    """One command in a detached tmux session of its own server (socket under tmp)."""

    def __init__(self, tmp: Path, name: str, command: str, width: int, height: int = 50):
        self.socket, self.name = str(tmp / f"tmux-{name}"), name
        # the shell stays after the command, so that the final screen can be read
        self._tmux("new-session", "-d", "-s", name, "-x", str(width), "-y", str(height),
                   f"{command}; echo EXIT=$?; sleep 600")  # fmt: skip

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", self.socket, *args], check=True, capture_output=True, text=True).stdout

    def screen(self) -> str:
        """What the pane shows now, wrapped lines joined (-J), as a person reads it."""
        return self._tmux("capture-pane", "-p", "-J", "-t", self.name)

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", self.name, *keys)

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.5)
        raise AssertionError(f"{text!r} never appeared on the screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True)


def _command(env: dict, argv: list) -> str:
    keep = {k: env[k] for k in ("PATH", "PYTHONPATH", "WANDB_MODE", "HF_HUB_OFFLINE", "TORCH_HOME", "HOME") if k in env}
    return "env -u COLUMNS " + " ".join(f"{k}={shlex.quote(v)}" for k, v in keep.items()) + " " + shlex.join(argv)


def test_end_of_run_lines_stay_on_the_screen(tmp_path):
    scene = small_scene(tmp_path / "data", 40, 30)  # non-square
    env = cli_env(tmp_path / "torch_home")
    out = tmp_path / "outputs"
    ns_train = executable("ns-train")
    stopped_argv = [ns_train, "splat-metal", "--data", str(scene), "--output-dir", str(out), "--timestamp", "stop",
                    "--max-num-iterations", "100000", "--steps-per-save", "5", *QUIET]  # fmt: skip
    finished_argv = [ns_train, "splat-metal", "--data", str(scene), "--output-dir", str(out), "--timestamp", "done",
                     "--max-num-iterations", "12", "--steps-per-save", "5", *QUIET]  # fmt: skip
    stopped = Pane(tmp_path, "stopped", _command(env, stopped_argv), width=120)
    finished = Pane(tmp_path, "finished", _command(env, finished_argv), width=200)
    try:
        stop_run = run_dir(out, "stop", scene=scene.name)
        deadline = time.monotonic() + 400
        while not [c for c in checkpoints(stop_run)]:  # a few steps in, with the table drawn
            assert time.monotonic() < deadline, stopped.screen()
            time.sleep(0.5)
        stopped.keys("C-c")  # what a person types: the terminal sends SIGINT to the foreground group
        screen = stopped.wait_for("EXIT=", timeout=300)
        assert "EXIT=130" in screen, screen
        lines = screen.splitlines()
        stop_line = next((x for x in lines if x.startswith("splat-metal: training stopped after step ")), None)
        assert stop_line is not None, screen
        step = int(stop_line.split("after step ")[1].split(";")[0])
        ckpt = stop_run / "nerfstudio_models" / f"step-{step:09d}.ckpt"
        assert f"checkpoint saved: {ckpt}" in stop_line and ckpt.is_file()
        expected = resume_command(stopped_argv, stop_run / "nerfstudio_models", 100000 - (step + 1))
        assert "Resume with:" in lines and f"  {expected}" in lines, screen

        screen = finished.wait_for("EXIT=", timeout=400)
        assert "EXIT=0" in screen, screen
        done_dir = run_dir(out, "done", scene=scene.name) / "nerfstudio_models"
        assert f"splat-metal: training finished; checkpoint: {done_dir / 'step-000000011.ckpt'}" in screen, screen
        assert f"  {resume_command(finished_argv, done_dir, 12)}" in screen.splitlines(), screen
    finally:
        stopped.close()
        finished.close()
